// A CUDA program for the multi-process tests. It reaches the driver the way
// the CUDA runtime does: dlopen("libcuda.so.1"), then every entry point through
// cuGetProcAddress_v2 by base name and ABI version.
//   helper alloc <bytes> <count>   allocate, print "ready", wait to be killed
//   helper allocloop <bytes>       allocate/free forever (print "ready" first)
//   helper spin <us> <count>       launch count spin_<us>us kernels, synchronise,
//                                  print "<pid> <start_ns> <end_ns>", exit
//   helper launchexit <us> <count> launch count kernels, print "<pid>", exit unsynchronised
//   helper launchhang <us> <count> the same, then wait to be killed
//   helper vmmimport <fd> <bytes>  import the VMM allocation exported as fd (inherited),
//                                  map it, print "read <hex>" (the u32 at offset 64),
//                                  write 0x600DF00D at offset 128, print "wrote", exit
//   helper teardown <bytes> 0      exit; a destructor that runs after the driver's
//                                  (the driver was dlopen'ed later) allocates and
//                                  prints "late <CUresult>"
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

PFN_cuGetProcAddress_v12000 get_proc = nullptr;

template <typename F>
F resolve(const char* name, int version) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult status;
  if (get_proc(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS) {
    std::fprintf(stderr, "helper: cannot resolve %s\n", name);
    std::exit(3);
  }
  return reinterpret_cast<F>(fn);
}

unsigned long long now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

#define CHECK(call)                                               \
  do {                                                            \
    CUresult rc_ = (call);                                        \
    if (rc_ != CUDA_SUCCESS) {                                    \
      std::fprintf(stderr, "helper: %s = %d\n", #call, (int)rc_); \
      return 4;                                                   \
    }                                                             \
  } while (0)

// Called from this program's ELF destructor, which runs after the destructors
// of libraries it dlopen'ed (libcuda), as another library's would.
PFN_cuMemAlloc_v3020 g_late_alloc = nullptr;
unsigned long long g_late_bytes = 0;

[[gnu::destructor]] void allocate_after_teardown() {
  if (g_late_alloc == nullptr) return;
  CUdeviceptr p = 0;
  std::printf("late %d\n", static_cast<int>(g_late_alloc(&p, g_late_bytes)));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == nullptr) return 5;
  get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) return 5;
  auto init = resolve<PFN_cuInit_v2000>("cuInit", 2000);
  auto retain = resolve<PFN_cuDevicePrimaryCtxRetain_v7000>("cuDevicePrimaryCtxRetain", 7000);
  auto set_current = resolve<PFN_cuCtxSetCurrent_v4000>("cuCtxSetCurrent", 4000);
  auto mem_alloc = resolve<PFN_cuMemAlloc_v3020>("cuMemAlloc", 3020);
  auto mem_free = resolve<PFN_cuMemFree_v3020>("cuMemFree", 3020);
  CHECK(init(0));
  CUcontext ctx = nullptr;
  CHECK(retain(&ctx, 0));
  CHECK(set_current(ctx));
  std::string command = argv[1];
  unsigned long long value = std::strtoull(argv[2], nullptr, 10);
  if (command == "alloc" && argc == 4) {
    int count = std::atoi(argv[3]);
    for (int i = 0; i < count; ++i) {
      CUdeviceptr p = 0;
      CHECK(mem_alloc(&p, value));
    }
    std::printf("ready\n");
    std::fflush(stdout);
    for (;;) pause();
  }
  if (command == "allocloop") {
    std::printf("ready\n");
    std::fflush(stdout);
    for (;;) {
      CUdeviceptr p = 0;
      if (mem_alloc(&p, value) == CUDA_SUCCESS) mem_free(p);
    }
  }
  if (command == "spin" && argc == 4) {
    auto load = resolve<PFN_cuModuleLoadData_v2000>("cuModuleLoadData", 2000);
    auto get_function = resolve<PFN_cuModuleGetFunction_v2000>("cuModuleGetFunction", 2000);
    auto launch = resolve<PFN_cuLaunchKernel_v4000>("cuLaunchKernel", 4000);
    auto synchronize = resolve<PFN_cuCtxSynchronize_v2000>("cuCtxSynchronize", 2000);
    std::string name = "spin_" + std::to_string(value) + "us";
    CUmodule module = nullptr;
    CHECK(load(&module, name.c_str()));
    CUfunction function = nullptr;
    CHECK(get_function(&function, module, name.c_str()));
    int count = std::atoi(argv[3]);
    unsigned long long start = now_ns();
    for (int i = 0; i < count; ++i) CHECK(launch(function, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr));
    CHECK(synchronize());
    std::printf("%d %llu %llu\n", static_cast<int>(getpid()), start, now_ns());
    return 0;
  }
  // Queues `count` kernels of `value` us and leaves without synchronising:
  // "exit" returns from main (the driver's teardown runs), "hang" waits to be killed.
  if (command == "teardown") {
    g_late_alloc = mem_alloc;
    g_late_bytes = value;
    std::printf("ready\n");
    std::fflush(stdout);
    return 0;
  }
  if (command == "vmmimport" && argc == 4) {
    auto import = resolve<PFN_cuMemImportFromShareableHandle_v10020>("cuMemImportFromShareableHandle", 10020);
    auto reserve = resolve<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve", 10020);
    auto map = resolve<PFN_cuMemMap_v10020>("cuMemMap", 10020);
    auto dtoh = resolve<PFN_cuMemcpyDtoH_v3020>("cuMemcpyDtoH", 3020);
    auto set32 = resolve<PFN_cuMemsetD32_v3020>("cuMemsetD32", 3020);
    unsigned long long bytes = std::strtoull(argv[3], nullptr, 10);
    CUmemGenericAllocationHandle handle = 0;
    CHECK(import(&handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(value)),
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CUdeviceptr va = 0;
    CHECK(reserve(&va, bytes, 0, 0, 0));
    CHECK(map(va, bytes, 0, handle, 0));
    unsigned seen = 0;
    CHECK(dtoh(&seen, va + 64, sizeof(seen)));
    std::printf("read %x\n", seen);
    CHECK(set32(va + 128, 0x600DF00Du, 1));
    std::printf("wrote\n");
    return 0;
  }
  if ((command == "launchexit" || command == "launchhang") && argc == 4) {
    auto load = resolve<PFN_cuModuleLoadData_v2000>("cuModuleLoadData", 2000);
    auto get_function = resolve<PFN_cuModuleGetFunction_v2000>("cuModuleGetFunction", 2000);
    auto launch = resolve<PFN_cuLaunchKernel_v4000>("cuLaunchKernel", 4000);
    std::string name = "spin_" + std::to_string(value) + "us";
    CUmodule module = nullptr;
    CHECK(load(&module, name.c_str()));
    CUfunction function = nullptr;
    CHECK(get_function(&function, module, name.c_str()));
    int count = std::atoi(argv[3]);
    for (int i = 0; i < count; ++i) CHECK(launch(function, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr));
    std::printf("%d\n", static_cast<int>(getpid()));
    std::fflush(stdout);
    if (command == "launchhang") {
      for (;;) pause();
    }
    return 0;
  }
  return 2;
}
