// interop_probe: a graphics-interop program (Vulkan/OptiX/ggml's pattern) on
// the simulated driver's graphics allocator (fakecuda_graphics_*): memory the
// graphics API allocates, imported into CUDA by OPAQUE_FD, a buffer mapped
// onto it, then cuMemAlloc up to the quota. Prints "op key=value" lines; exits
// 0, or 2 when a setup call failed.
//   interop_probe quota GFX_MIB CHUNK_MIB [ORDER] [WAIT_FILE]
//     ORDER: destroy-first (cuDestroyExternalMemory, then cuMemFree of the
//     mapped buffer) or free-first (the documented order); default free-first.
//     WAIT_FILE: once everything is held, "holding" is printed and a file
//     <WAIT_FILE>.ready touched; the program waits for WAIT_FILE to exist.
//   interop_probe graphics GFX_MIB ALLOC_MIB WAIT_FILE
//     graphics memory never imported into CUDA, beside cuMemAlloc: held until
//     WAIT_FILE exists (<WAIT_FILE>.ready touched once held)
//   interop_probe measured-free GFX_MIB
//     graphics memory never imported, freed by another thread while this one
//     creates a context (which gpuslice measures by NVML): prints the bytes
//     the process then holds and the bytes counted (run it with the
//     simulator's chaos sleeping at create_context's entry)
//   interop_probe null-info    cuMemGetInfo and NVML memory queries with NULL outputs
//   interop_probe semaphores   import, signal, wait, destroy an OPAQUE_FD semaphore
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "fakecuda_query.h"

namespace {

void check(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) {
    std::fprintf(stderr, "interop_probe: %s failed: %d\n", what, static_cast<int>(rc));
    std::exit(2);
  }
}

constexpr unsigned long long kMi = 1ull << 20;

unsigned long long counted() {
  size_t free = 0, total = 0;
  check(cuMemGetInfo(&free, &total), "cuMemGetInfo");
  return total - free;
}

void setup() {
  check(cuInit(0), "cuInit");
  CUcontext ctx = nullptr;
  check(cuDevicePrimaryCtxRetain(&ctx, 0), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

void hold_until(const char* wait_file);

int quota(unsigned long long gfx_mib, unsigned long long chunk_mib, const std::string& order, const char* wait_file) {
  setup();
  const std::uint64_t gfx = fakecuda_graphics_alloc(0, gfx_mib * kMi);
  if (gfx == 0) {
    std::fprintf(stderr, "interop_probe: fakecuda_graphics_alloc failed\n");
    return 2;
  }
  std::printf("graphics held=%llu\n", static_cast<unsigned long long>(fakecuda_process_used_bytes(0, 0)));
  const unsigned long long before = counted();
  CUDA_EXTERNAL_MEMORY_HANDLE_DESC desc{};
  desc.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
  desc.handle.fd = fakecuda_graphics_export_fd(gfx);
  desc.size = gfx_mib * kMi;
  CUexternalMemory ext = nullptr;
  // INTEROP_VIA_PROCADDR=1: the entry points as the CUDA runtime gets them.
  auto import_fn = &cuImportExternalMemory;
  auto destroy_fn = &cuDestroyExternalMemory;
  if (const char* v = std::getenv("INTEROP_VIA_PROCADDR"); v != nullptr && std::strcmp(v, "1") == 0) {
    void* pi = nullptr;
    void* pd = nullptr;
    check(cuGetProcAddress("cuImportExternalMemory", &pi, 12000, CU_GET_PROC_ADDRESS_DEFAULT, nullptr),
          "cuGetProcAddress(cuImportExternalMemory)");
    check(cuGetProcAddress("cuDestroyExternalMemory", &pd, 12000, CU_GET_PROC_ADDRESS_DEFAULT, nullptr),
          "cuGetProcAddress(cuDestroyExternalMemory)");
    import_fn = reinterpret_cast<decltype(import_fn)>(pi);
    destroy_fn = reinterpret_cast<decltype(destroy_fn)>(pd);
  }
  const CUresult import_rc = import_fn(&ext, &desc);
  std::printf("import rc=%d counted_delta=%llu\n", import_rc, counted() - before);
  if (import_rc != CUDA_SUCCESS) {
    close(desc.handle.fd);  // still ours: ownership passes only on success
    fakecuda_graphics_free(gfx);
    return 0;
  }
  CUDA_EXTERNAL_MEMORY_BUFFER_DESC buf{};
  buf.size = desc.size;
  CUdeviceptr mapped = 0;
  check(cuExternalMemoryGetMappedBuffer(&mapped, ext, &buf), "cuExternalMemoryGetMappedBuffer");
  std::printf("mapped counted=%llu\n", counted());
  CUmipmappedArray mip = nullptr;
  CUDA_EXTERNAL_MEMORY_MIPMAPPED_ARRAY_DESC mdesc{};
  mdesc.arrayDesc.Width = 64;
  mdesc.arrayDesc.Height = 64;
  mdesc.arrayDesc.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  mdesc.arrayDesc.NumChannels = 1;
  mdesc.numLevels = 1;
  std::printf("mipmapped rc=%d\n", cuExternalMemoryGetMappedMipmappedArray(&mip, ext, &mdesc));

  // cuMemAlloc up to the quota.
  std::vector<CUdeviceptr> chunks;
  CUresult last = CUDA_SUCCESS;
  for (int i = 0; i < 1024; ++i) {
    CUdeviceptr p = 0;
    last = cuMemAlloc(&p, chunk_mib * kMi);
    if (last != CUDA_SUCCESS) break;
    chunks.push_back(p);
  }
  std::printf(
      "alloc succeeded=%zu last_rc=%d counted=%llu held=%llu\n", chunks.size(), last, counted(),
      static_cast<unsigned long long>(fakecuda_process_used_bytes(0, 0) - fakecuda_process_context_bytes(0, 0)));
  if (wait_file != nullptr) hold_until(wait_file);

  CUresult free_rc = CUDA_SUCCESS, destroy_rc = CUDA_SUCCESS;
  if (order == "destroy-first") {
    destroy_rc = destroy_fn(ext);
    std::printf("destroy rc=%d counted=%llu\n", destroy_rc, counted());
    free_rc = cuMemFree(mapped);
    std::printf("free-mapped rc=%d counted=%llu\n", free_rc, counted());
  } else {
    free_rc = cuMemFree(mapped);
    std::printf("free-mapped rc=%d counted=%llu\n", free_rc, counted());
    destroy_rc = destroy_fn(ext);
    std::printf("destroy rc=%d counted=%llu\n", destroy_rc, counted());
  }
  std::printf("destroy-again rc=%d\n", destroy_fn(ext));
  std::printf("free-mapped-again rc=%d counted=%llu\n", cuMemFree(mapped), counted());
  for (CUdeviceptr p : chunks) check(cuMemFree(p), "cuMemFree");
  std::printf("freed counted=%llu\n", counted());
  fakecuda_graphics_free(gfx);
  std::printf("graphics-freed held=%llu counted=%llu\n",
              static_cast<unsigned long long>(fakecuda_process_used_bytes(0, 0) - fakecuda_process_context_bytes(0, 0)),
              counted());
  return 0;
}

// NVML's memory structures (nvml.h is not installed; NVIDIA's documented ABI).
struct NvmlMemory {
  unsigned long long total, free, used;
};
using NvmlInit = int (*)();
using NvmlGetHandle = int (*)(unsigned, void**);
using NvmlGetMemory = int (*)(void*, void*);

int null_info() {
  setup();
  size_t v = 0;
  std::printf("meminfo-null-free rc=%d\n", cuMemGetInfo(nullptr, &v));
  std::printf("meminfo-null-total rc=%d\n", cuMemGetInfo(&v, nullptr));
  std::printf("meminfo-null-both rc=%d\n", cuMemGetInfo(nullptr, nullptr));
  std::printf("totalmem-null rc=%d\n", cuDeviceTotalMem(nullptr, 0));
  void* nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (nvml == nullptr) {
    std::printf("nvml unavailable\n");
    return 0;
  }
  auto init = reinterpret_cast<NvmlInit>(dlsym(nvml, "nvmlInit_v2"));
  auto handle = reinterpret_cast<NvmlGetHandle>(dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2"));
  auto info = reinterpret_cast<NvmlGetMemory>(dlsym(nvml, "nvmlDeviceGetMemoryInfo"));
  auto info2 = reinterpret_cast<NvmlGetMemory>(dlsym(nvml, "nvmlDeviceGetMemoryInfo_v2"));
  void* dev = nullptr;
  if (init == nullptr || handle == nullptr || info == nullptr || info2 == nullptr || init() != 0 ||
      handle(0, &dev) != 0) {
    std::printf("nvml unavailable\n");
    return 0;
  }
  std::printf("nvml-null rc=%d\n", info(dev, nullptr));
  std::printf("nvml-v2-null rc=%d\n", info2(dev, nullptr));
  NvmlMemory m{};
  std::printf("nvml-ok rc=%d\n", info(dev, &m));
  return 0;
}

void hold_until(const char* wait_file) {
  std::printf("holding\n");
  std::fflush(stdout);
  const std::string ready = std::string(wait_file) + ".ready";
  std::fclose(std::fopen(ready.c_str(), "w"));
  for (int i = 0; i < 6000 && access(wait_file, F_OK) != 0; ++i) usleep(10000);
}

int graphics(unsigned long long gfx_mib, unsigned long long alloc_mib, const char* wait_file) {
  setup();
  const std::uint64_t gfx = gfx_mib == 0 ? 0 : fakecuda_graphics_alloc(0, gfx_mib * kMi);
  if (gfx_mib != 0 && gfx == 0) return 2;
  CUdeviceptr p = 0;
  check(cuMemAlloc(&p, alloc_mib * kMi), "cuMemAlloc");
  std::printf("graphics held=%llu counted=%llu\n", static_cast<unsigned long long>(fakecuda_process_used_bytes(0, 0)),
              counted());
  hold_until(wait_file);
  check(cuMemFree(p), "cuMemFree");
  if (gfx != 0) fakecuda_graphics_free(gfx);
  return 0;
}

int semaphores() {
  setup();
  CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC desc{};
  desc.type = CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD;
  desc.handle.fd = fakecuda_graphics_semaphore();
  CUexternalSemaphore sem = nullptr;
  std::printf("sem-import rc=%d\n", cuImportExternalSemaphore(&sem, &desc));
  CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS sp{};
  CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS wp{};
  std::printf("sem-signal rc=%d\n", cuSignalExternalSemaphoresAsync(&sem, &sp, 1, nullptr));
  std::printf("sem-wait rc=%d\n", cuWaitExternalSemaphoresAsync(&sem, &wp, 1, nullptr));
  std::printf("sem-destroy rc=%d\n", cuDestroyExternalSemaphore(sem));
  std::printf("sem-destroy-again rc=%d\n", cuDestroyExternalSemaphore(sem));
  return 0;
}

// A graphics free (vkFreeMemory in another thread: no CUDA call, nothing
// gpuslice sees) during a context's measured creation.
int measured_free(unsigned long long gfx_mib) {
  setup();
  const std::uint64_t gfx = fakecuda_graphics_alloc(0, gfx_mib * kMi);
  if (gfx == 0) {
    std::fprintf(stderr, "interop_probe: fakecuda_graphics_alloc failed\n");
    return 2;
  }
  std::atomic<bool> go{false};
  std::thread other([&] {
    while (!go.load()) std::this_thread::yield();
    usleep(5000);  // inside the creation: the simulator's chaos sleeps at its entry
    fakecuda_graphics_free(gfx);
  });
  go.store(true);
  CUcontext ctx = nullptr;
  const CUresult rc = cuCtxCreate(&ctx, nullptr, 0, 0);
  other.join();
  std::printf("measured rc=%d held=%llu counted=%llu\n", rc,
              static_cast<unsigned long long>(fakecuda_process_used_bytes(0, 0)), counted());
  if (rc == CUDA_SUCCESS) cuCtxDestroy(ctx);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "quota" && argc >= 4) {
    return quota(std::strtoull(argv[2], nullptr, 10), std::strtoull(argv[3], nullptr, 10),
                 argc > 4 ? argv[4] : "free-first", argc > 5 ? argv[5] : nullptr);
  }
  if (mode == "graphics" && argc >= 5) {
    return graphics(std::strtoull(argv[2], nullptr, 10), std::strtoull(argv[3], nullptr, 10), argv[4]);
  }
  if (mode == "measured-free" && argc >= 3) return measured_free(std::strtoull(argv[2], nullptr, 10));
  if (mode == "null-info") return null_info();
  if (mode == "semaphores") return semaphores();
  std::fprintf(
      stderr,
      "usage: interop_probe quota GFX_MIB CHUNK_MIB [ORDER] [WAIT_FILE] | graphics GFX_MIB ALLOC_MIB WAIT_FILE |"
      " measured-free GFX_MIB | null-info | semaphores\n");
  return 2;
}
