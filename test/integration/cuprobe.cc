// cuprobe: a driver-API program that runs a script of operations given on the
// command line and prints one line per operation ("<op> rc=<code> ..."). It
// is built three ways from this one source:
//   cuprobe       linked against libcuda.so.1, calling symbols directly
//   cuprobe_ptds  the same with CUDA_API_PER_THREAD_DEFAULT_STREAM (_ptsz/_ptds names)
//   cuprobe_dl    dlopen("libcuda.so.1") + cuGetProcAddress_v2, as the CUDA runtime
//                 does (fetching cuGetProcAddress through itself first); with
//                 PROBE_PTSZ=1 it asks for per-thread-default-stream variants.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Api {
  PFN_cuInit_v2000 init;
  PFN_cuDeviceGet_v2000 device_get;
  PFN_cuDevicePrimaryCtxRetain_v7000 primary_retain;
  PFN_cuDevicePrimaryCtxRelease_v11000 primary_release;
  PFN_cuCtxSetCurrent_v4000 ctx_set_current;
  PFN_cuCtxCreate_v3020 ctx_create;
  PFN_cuCtxDestroy_v4000 ctx_destroy;
  PFN_cuCtxSynchronize_v2000 ctx_sync;
  PFN_cuMemAlloc_v3020 alloc;
  PFN_cuMemAllocManaged_v6000 alloc_managed;
  PFN_cuMemAllocPitch_v3020 alloc_pitch;
  PFN_cuMemFree_v3020 free;
  PFN_cuMemAllocAsync_v11020 alloc_async;
  PFN_cuMemAllocFromPoolAsync_v11020 alloc_from_pool;
  PFN_cuMemFreeAsync_v11020 free_async;
  PFN_cuMemPoolCreate_v11020 pool_create;
  PFN_cuMemPoolDestroy_v11020 pool_destroy;
  PFN_cuMemPoolTrimTo_v11020 pool_trim;
  PFN_cuDeviceGetMemPool_v11020 device_get_mempool;
  PFN_cuStreamSynchronize_v2000 stream_sync;
  PFN_cuMemCreate_v10020 mem_create;
  PFN_cuMemRelease_v10020 mem_release;
  PFN_cuMemAddressReserve_v10020 addr_reserve;
  PFN_cuMemAddressFree_v10020 addr_free;
  PFN_cuMemMap_v10020 mem_map;
  PFN_cuMemUnmap_v10020 mem_unmap;
  PFN_cuMemGetAllocationGranularity_v10020 granularity;
  PFN_cuArrayCreate_v3020 array_create;
  PFN_cuArray3DCreate_v3020 array3d_create;
  PFN_cuArrayDestroy_v2000 array_destroy;
  PFN_cuMipmappedArrayCreate_v5000 mipmap_create;
  PFN_cuMipmappedArrayDestroy_v5000 mipmap_destroy;
  PFN_cuMemGetInfo_v3020 mem_get_info;
  PFN_cuDeviceTotalMem_v3020 total_mem;
  PFN_cuModuleLoadData_v2000 module_load_data;
  PFN_cuModuleGetFunction_v2000 module_get_function;
  PFN_cuLaunchKernel_v4000 launch;
  PFN_cuLaunchKernelEx_v11060 launch_ex;
  PFN_cuLaunchCooperativeKernel_v9000 launch_coop;
  PFN_cuGraphCreate_v10000 graph_create;
  PFN_cuGraphAddKernelNode_v12000 graph_add_kernel;
  PFN_cuGraphInstantiateWithFlags_v11040 graph_instantiate;
  PFN_cuGraphLaunch_v10000 graph_launch;
  PFN_cuStreamBeginCapture_v10010 begin_capture;
  PFN_cuStreamEndCapture_v10000 end_capture;
  PFN_cuStreamCreate_v2000 stream_create;
  void* legacy_alloc;  // the pre-3.2 cuMemAlloc(unsigned int*, unsigned int)
};

Api g;
CUdevice g_dev = 0;

#if defined(PROBE_DLOPEN)
PFN_cuGetProcAddress_v12000 g_gpa = nullptr;

void* resolve(const char* name, int version, bool stream_variant) {
  static const bool ptsz = std::getenv("PROBE_PTSZ") != nullptr;
  void* fn = nullptr;
  CUdriverProcAddressQueryResult status{};
  cuuint64_t flags =
      (ptsz && stream_variant) ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
  if (g_gpa(name, &fn, version, flags, &status) != CUDA_SUCCESS) return nullptr;
  return fn;
}

bool load_api() {
  void* h = dlopen("libcuda.so.1", RTLD_NOW);
  if (h == nullptr) {
    std::printf("load rc=-1 error=%s\n", dlerror());
    return false;
  }
  auto first = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(h, "cuGetProcAddress_v2"));
  if (first == nullptr) return false;
  void* fn = nullptr;
  CUdriverProcAddressQueryResult status{};
  // What libcudart does: a probe, then cuGetProcAddress fetched through itself.
  first("", &fn, 0, 0, &status);
  if (first("cuGetProcAddress", &fn, 12000, 0, &status) != CUDA_SUCCESS) return false;
  g_gpa = reinterpret_cast<PFN_cuGetProcAddress_v12000>(fn);
  std::printf("gpa self_resolved=%d\n", fn == reinterpret_cast<void*>(first) ? 1 : 0);
#define R(field, name, version, stream) g.field = reinterpret_cast<decltype(g.field)>(resolve(name, version, stream))
  R(init, "cuInit", 2000, false);
  R(device_get, "cuDeviceGet", 2000, false);
  R(primary_retain, "cuDevicePrimaryCtxRetain", 7000, false);
  R(primary_release, "cuDevicePrimaryCtxRelease", 11000, false);
  R(ctx_set_current, "cuCtxSetCurrent", 4000, false);
  R(ctx_create, "cuCtxCreate", 3020, false);
  R(ctx_destroy, "cuCtxDestroy", 4000, false);
  R(ctx_sync, "cuCtxSynchronize", 2000, false);
  R(alloc, "cuMemAlloc", 3020, false);
  R(alloc_managed, "cuMemAllocManaged", 6000, false);
  R(alloc_pitch, "cuMemAllocPitch", 3020, false);
  R(free, "cuMemFree", 3020, false);
  R(alloc_async, "cuMemAllocAsync", 11020, true);
  R(alloc_from_pool, "cuMemAllocFromPoolAsync", 11020, true);
  R(free_async, "cuMemFreeAsync", 11020, true);
  R(pool_create, "cuMemPoolCreate", 11020, false);
  R(pool_destroy, "cuMemPoolDestroy", 11020, false);
  R(pool_trim, "cuMemPoolTrimTo", 11020, false);
  R(device_get_mempool, "cuDeviceGetMemPool", 11020, false);
  R(stream_sync, "cuStreamSynchronize", 2000, true);
  R(mem_create, "cuMemCreate", 10020, false);
  R(mem_release, "cuMemRelease", 10020, false);
  R(addr_reserve, "cuMemAddressReserve", 10020, false);
  R(addr_free, "cuMemAddressFree", 10020, false);
  R(mem_map, "cuMemMap", 10020, false);
  R(mem_unmap, "cuMemUnmap", 10020, false);
  R(granularity, "cuMemGetAllocationGranularity", 10020, false);
  R(array_create, "cuArrayCreate", 3020, false);
  R(array3d_create, "cuArray3DCreate", 3020, false);
  R(array_destroy, "cuArrayDestroy", 2000, false);
  R(mipmap_create, "cuMipmappedArrayCreate", 5000, false);
  R(mipmap_destroy, "cuMipmappedArrayDestroy", 5000, false);
  R(mem_get_info, "cuMemGetInfo", 3020, false);
  R(total_mem, "cuDeviceTotalMem", 3020, false);
  R(module_load_data, "cuModuleLoadData", 2000, false);
  R(module_get_function, "cuModuleGetFunction", 2000, false);
  R(launch, "cuLaunchKernel", 4000, true);
  R(launch_ex, "cuLaunchKernelEx", 11060, true);
  R(launch_coop, "cuLaunchCooperativeKernel", 9000, true);
  R(graph_create, "cuGraphCreate", 10000, false);
  R(graph_add_kernel, "cuGraphAddKernelNode", 12000, false);
  R(graph_instantiate, "cuGraphInstantiateWithFlags", 11040, false);
  R(graph_launch, "cuGraphLaunch", 10000, true);
  R(begin_capture, "cuStreamBeginCapture", 10010, true);
  R(end_capture, "cuStreamEndCapture", 10000, true);
  R(stream_create, "cuStreamCreate", 2000, false);
  R(legacy_alloc, "cuMemAlloc", 2000, false);
#undef R
  return true;
}
#else
#undef cuMemAlloc
extern "C" CUresult CUDAAPI cuMemAlloc(unsigned int* dptr, unsigned int bytesize);
// cuda.h maps cuCtxCreate to _v4; the _v2 ABI is still exported by the driver.
extern "C" CUresult CUDAAPI cuCtxCreate_v2(CUcontext* pctx, unsigned int flags, CUdevice dev);

bool load_api() {
  g.init = &cuInit;
  g.device_get = &cuDeviceGet;
  g.primary_retain = &cuDevicePrimaryCtxRetain;
  g.primary_release = &cuDevicePrimaryCtxRelease;
  g.ctx_set_current = &cuCtxSetCurrent;
  g.ctx_create = &cuCtxCreate_v2;
  g.ctx_destroy = &cuCtxDestroy;
  g.ctx_sync = &cuCtxSynchronize;
  g.alloc = &cuMemAlloc_v2;
  g.alloc_managed = &cuMemAllocManaged;
  g.alloc_pitch = &cuMemAllocPitch;
  g.free = &cuMemFree;
  g.alloc_async = &cuMemAllocAsync;
  g.alloc_from_pool = &cuMemAllocFromPoolAsync;
  g.free_async = &cuMemFreeAsync;
  g.pool_create = &cuMemPoolCreate;
  g.pool_destroy = &cuMemPoolDestroy;
  g.pool_trim = &cuMemPoolTrimTo;
  g.device_get_mempool = &cuDeviceGetMemPool;
  g.stream_sync = &cuStreamSynchronize;
  g.mem_create = &cuMemCreate;
  g.mem_release = &cuMemRelease;
  g.addr_reserve = &cuMemAddressReserve;
  g.addr_free = &cuMemAddressFree;
  g.mem_map = &cuMemMap;
  g.mem_unmap = &cuMemUnmap;
  g.granularity = &cuMemGetAllocationGranularity;
  g.array_create = &cuArrayCreate;
  g.array3d_create = &cuArray3DCreate;
  g.array_destroy = &cuArrayDestroy;
  g.mipmap_create = &cuMipmappedArrayCreate;
  g.mipmap_destroy = &cuMipmappedArrayDestroy;
  g.mem_get_info = &cuMemGetInfo;
  g.total_mem = &cuDeviceTotalMem;
  g.module_load_data = &cuModuleLoadData;
  g.module_get_function = &cuModuleGetFunction;
  g.launch = &cuLaunchKernel;
  g.launch_ex = &cuLaunchKernelEx;
  g.launch_coop = &cuLaunchCooperativeKernel;
  g.graph_create = &cuGraphCreate;
  g.graph_add_kernel = &cuGraphAddKernelNode;
  g.graph_instantiate = &cuGraphInstantiateWithFlags;
  g.graph_launch = &cuGraphLaunch;
  g.begin_capture = &cuStreamBeginCapture;
  g.end_capture = &cuStreamEndCapture;
  g.stream_create = &cuStreamCreate;
  g.legacy_alloc = reinterpret_cast<void*>(&cuMemAlloc);
  return true;
}
#endif

enum class Kind { linear, managed, pitch, async, pool, vmm, array, array3d, mipmap };
struct Held {
  Kind kind;
  CUdeviceptr ptr = 0;
  CUmemGenericAllocationHandle handle = 0;
  size_t size = 0;
  CUarray array = nullptr;
  CUmipmappedArray mipmap = nullptr;
};
std::vector<Held> g_held;
CUmemoryPool g_pool = nullptr;
std::vector<CUcontext> g_created;

int n(const char* s) { return std::atoi(s); }
unsigned long long u(const char* s) { return std::strtoull(s, nullptr, 0); }

CUresult allocate(Kind kind, unsigned long long a, unsigned long long b, unsigned long long c) {
  Held h{kind};
  CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
  switch (kind) {
    case Kind::linear: rc = g.alloc(&h.ptr, a); break;
    case Kind::managed: rc = g.alloc_managed(&h.ptr, a, CU_MEM_ATTACH_GLOBAL); break;
    case Kind::pitch: {
      size_t pitch = 0;
      rc = g.alloc_pitch(&h.ptr, &pitch, a, b ? b : 1, 4);
      break;
    }
    case Kind::async: rc = g.alloc_async(&h.ptr, a, nullptr); break;
    case Kind::pool:
      if (g_pool == nullptr) {
        CUmemPoolProps props{};
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = g_dev;
        if ((rc = g.pool_create(&g_pool, &props)) != CUDA_SUCCESS) return rc;
      }
      rc = g.alloc_from_pool(&h.ptr, a, g_pool, nullptr);
      break;
    case Kind::vmm: {
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = g_dev;
      rc = g.mem_create(&h.handle, a, &prop, 0);
      if (rc != CUDA_SUCCESS) break;
      h.size = a;
      if (b != 0) {  // "vmm N 1": reserve a range, map it and release the handle at once
        if ((rc = g.addr_reserve(&h.ptr, a, 0, 0, 0)) == CUDA_SUCCESS &&
            (rc = g.mem_map(h.ptr, a, 0, h.handle, 0)) == CUDA_SUCCESS)
          rc = g.mem_release(h.handle), h.handle = 0;
      }
      break;
    }
    case Kind::array: {
      CUDA_ARRAY_DESCRIPTOR d{};
      d.Width = a;
      d.Height = b;
      d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
      d.NumChannels = 1;
      rc = g.array_create(&h.array, &d);
      break;
    }
    case Kind::array3d: {
      CUDA_ARRAY3D_DESCRIPTOR d{};
      d.Width = a;
      d.Height = b;
      d.Depth = c;
      d.Format = CU_AD_FORMAT_FLOAT;
      d.NumChannels = 1;
      rc = g.array3d_create(&h.array, &d);
      break;
    }
    case Kind::mipmap: {
      CUDA_ARRAY3D_DESCRIPTOR d{};
      d.Width = a;
      d.Height = b;
      d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
      d.NumChannels = 4;
      rc = g.mipmap_create(&h.mipmap, &d, c ? static_cast<unsigned>(c) : 1);
      break;
    }
  }
  if (rc == CUDA_SUCCESS) g_held.push_back(h);
  return rc;
}

CUresult release(const Held& h) {
  switch (h.kind) {
    case Kind::linear:
    case Kind::managed:
    case Kind::pitch: return g.free(h.ptr);
    case Kind::async:
    case Kind::pool: return g.free_async(h.ptr, nullptr);
    case Kind::vmm: {
      CUresult rc = CUDA_SUCCESS;
      if (h.ptr != 0) {
        rc = g.mem_unmap(h.ptr, h.size);
        g.addr_free(h.ptr, h.size);
      }
      if (h.handle != 0) rc = g.mem_release(h.handle);
      return rc;
    }
    case Kind::array:
    case Kind::array3d: return g.array_destroy(h.array);
    case Kind::mipmap: return g.mipmap_destroy(h.mipmap);
  }
  return CUDA_ERROR_INVALID_VALUE;
}

bool parse_kind(const std::string& s, Kind* k) {
  static const std::pair<const char*, Kind> kinds[] = {
      {"alloc", Kind::linear}, {"managed", Kind::managed}, {"pitch", Kind::pitch},
      {"async", Kind::async},  {"poolasync", Kind::pool},  {"vmm", Kind::vmm},
      {"array", Kind::array},  {"array3d", Kind::array3d}, {"mipmap", Kind::mipmap}};
  for (auto& [name, kind] : kinds)
    if (s == name) return *k = kind, true;
  return false;
}

CUfunction g_function = nullptr;

CUresult load_function(const char* name) {
  static CUmodule module = nullptr;
  static std::string image;
  image = std::string(".entry ") + name + "\n";
  CUresult rc = g.module_load_data(&module, image.c_str());
  if (rc != CUDA_SUCCESS) return rc;
  return g.module_get_function(&g_function, module, name);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (!load_api()) {
    std::printf("load rc=-1\n");
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    std::string op = argv[i];
    auto arg = [&](int k) -> const char* { return i + k < argc ? argv[i + k] : "0"; };
    Kind kind;
    if (op == "init") {
      std::printf("init rc=%d\n", g.init(0));
    } else if (op == "ctx") {
      CUcontext ctx = nullptr;
      g_dev = n(arg(1));
      CUresult rc = g.primary_retain(&ctx, g_dev);
      if (rc == CUDA_SUCCESS) rc = g.ctx_set_current(ctx);
      std::printf("ctx rc=%d\n", rc);
      i += 1;
    } else if (op == "ctxnone") {  // the calling thread has no current context afterwards
      std::printf("ctxnone rc=%d\n", g.ctx_set_current(nullptr));
    } else if (op == "ctxrelease") {
      std::printf("ctxrelease rc=%d\n", g.primary_release(n(arg(1))));
      i += 1;
    } else if (op == "ctxcreate") {
      CUcontext ctx = nullptr;
      g_dev = n(arg(1));
      CUresult rc = g.ctx_create(&ctx, 0, g_dev);
      if (rc == CUDA_SUCCESS) g_created.push_back(ctx);
      std::printf("ctxcreate rc=%d\n", rc);
      i += 1;
    } else if (op == "ctxdestroy") {
      CUresult rc = CUDA_ERROR_INVALID_CONTEXT;
      if (!g_created.empty()) rc = g.ctx_destroy(g_created.back()), g_created.pop_back();
      std::printf("ctxdestroy rc=%d\n", rc);
    } else if (parse_kind(op, &kind)) {
      CUresult rc = allocate(kind, u(arg(1)), u(arg(2)), u(arg(3)));
      std::printf("%s rc=%d\n", op.c_str(), rc);
      i += (kind == Kind::array3d || kind == Kind::mipmap)                     ? 3
           : (kind == Kind::pitch || kind == Kind::array || kind == Kind::vmm) ? 2
                                                                               : 1;
    } else if (op == "fill") {
      // fill KIND CHUNK: allocate CHUNK-byte blocks until refused.
      Kind k;
      if (!parse_kind(arg(1), &k)) return 3;
      unsigned long long chunk = u(arg(2)), total = 0, count = 0;
      CUresult rc;
      while ((rc = allocate(k, chunk, k == Kind::pitch || k == Kind::array ? 1 : 0, 1)) == CUDA_SUCCESS) {
        total += chunk;
        ++count;
      }
      std::printf("fill kind=%s bytes=%llu count=%llu rc=%d\n", arg(1), total, count, rc);
      i += 2;
    } else if (op == "free") {
      CUresult rc = CUDA_ERROR_INVALID_VALUE;
      if (!g_held.empty()) rc = release(g_held.back()), g_held.pop_back();
      std::printf("free rc=%d\n", rc);
    } else if (op == "freeall") {
      CUresult worst = CUDA_SUCCESS;
      while (!g_held.empty()) {
        CUresult rc = release(g_held.back());
        if (rc != CUDA_SUCCESS) worst = rc;
        g_held.pop_back();
      }
      std::printf("freeall rc=%d\n", worst);
    } else if (op == "freeptr") {
      std::printf("freeptr rc=%d\n", g.free(u(arg(1))));
      i += 1;
    } else if (op == "meminfo") {
      size_t f = 0, t = 0;
      CUresult rc = g.mem_get_info(&f, &t);
      std::printf("meminfo rc=%d free=%zu total=%zu\n", rc, f, t);
    } else if (op == "meminfo-null") {
      std::printf("meminfo-null rc=%d\n", g.mem_get_info(nullptr, nullptr));
    } else if (op == "totalmem") {
      size_t b = 0;
      CUresult rc = g.total_mem(&b, n(arg(1)));
      std::printf("totalmem rc=%d bytes=%zu\n", rc, b);
      i += 1;
    } else if (op == "sync") {
      std::printf("sync rc=%d\n", g.ctx_sync());
    } else if (op == "streamsync") {
      std::printf("streamsync rc=%d\n", g.stream_sync(nullptr));
    } else if (op == "trim") {
      CUmemoryPool pool = g_pool;
      if (pool == nullptr) g.device_get_mempool(&pool, g_dev);
      std::printf("trim rc=%d\n", g.pool_trim(pool, 0));
    } else if (op == "pooldestroy") {
      CUresult rc = g.pool_destroy(g_pool);
      g_pool = nullptr;
      std::printf("pooldestroy rc=%d\n", rc);
    } else if (op == "legacy-alloc") {
      unsigned int p = 0;
      auto fn = reinterpret_cast<CUresult(CUDAAPI*)(unsigned int*, unsigned int)>(g.legacy_alloc);
      std::printf("legacy-alloc rc=%d\n", fn ? fn(&p, static_cast<unsigned>(u(arg(1)))) : -1);
      i += 1;
    } else if (op == "function") {
      std::printf("function rc=%d\n", load_function(arg(1)));
      i += 1;
    } else if (op == "launch") {
      // launch COUNT [ex|coop]: COUNT launches of the loaded function.
      unsigned long long count = u(arg(1));
      std::string how = i + 2 < argc ? argv[i + 2] : "";
      CUresult rc = CUDA_SUCCESS;
      for (unsigned long long k = 0; k < count && rc == CUDA_SUCCESS; ++k) {
        if (how == "ex") {
          CUlaunchConfig cfg{};
          cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
          cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1;
          rc = g.launch_ex(&cfg, g_function, nullptr, nullptr);
        } else if (how == "coop") {
          rc = g.launch_coop(g_function, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr);
        } else {
          rc = g.launch(g_function, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr);
        }
      }
      std::printf("launch rc=%d\n", rc);
      i += (how == "ex" || how == "coop") ? 2 : 1;
    } else if (op == "sleep") {
      std::this_thread::sleep_for(std::chrono::milliseconds(n(arg(1))));
      i += 1;
    } else if (op == "touch") {
      if (FILE* f = std::fopen(arg(1), "w")) std::fclose(f);
      i += 1;
    } else if (op == "waitfile") {
      while (access(arg(1), F_OK) != 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      i += 1;
    } else if (op == "exit") {
      std::fflush(stdout);
      _exit(n(arg(1)));
    } else {
      std::printf("unknown op=%s\n", op.c_str());
      return 3;
    }
  }
  return 0;
}
