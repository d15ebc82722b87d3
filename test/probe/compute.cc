// gpuslice-probe compute: drives the launch paths the compute limiter must
// not let escape, for the test/hardening/compute_*_test.cc tests. Links the
// simulated driver directly (as an application links libcuda); the preload
// library interposes at run time. One operation per run. Compiled with
// cuda.h's internal names (CMakeLists.txt): _ptsz variants are called by name.
//
//   stream-device other-current|no-context KERNEL_US MAX_LAUNCHES SECONDS
//       Launches a context-less kernel (cuLibraryGetKernel) into a stream of
//       device 1 while device 0's context is current (other-current) or while
//       no context is current (no-context), as fast as it can, never waiting.
//       Prints "probe start_ns=.. end_ns=.. launches=.. errors=..".
//   null-config
//       cuLaunchKernelEx(NULL, ...) and _ptsz as the first CUDA calls, then
//       through cuGetProcAddress. Prints "null <how> rc=<n>" per call.
//   entry-points
//       Resolves each deprecated/graph-update entry point through
//       cuGetProcAddress and dlsym, prints "entry <name> via=<how> in=<file>".
//   legacy-launch NAME KERNEL_US LAUNCHES
//       Launches LAUNCHES kernels through cuLaunch / cuLaunchGrid /
//       cuLaunchGridAsync / multi-device, or cuLaunchKernel /
//       cuLaunchCooperativeKernel (and their _ptsz), as fast as it can. Prints
//       "probe ... first_rc=<n>".
//   churn KERNEL_US KERNELS
//       Launches KERNELS kernels and exits at once, without synchronising.
//   launch-then-exit thread|main|fork LAUNCHES
//       Launches LAUNCHES one-block 1 us kernels, synchronises, and ends the
//       thread that launched them: a thread of its own that is joined
//       (thread), or the main thread, which returns from main (main). fork:
//       the main thread launches, then makes a child with fork() that calls
//       exit(0) at once; the parent waits for it and returns from main.
//       (Not _Fork: its child may call only async-signal-safe functions, and
//       exit() is not one; it hangs when another thread held the loader's
//       lock at the _Fork.)
//       Prints "probe launched=N child_status=S".
#include <cuda.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "probe.h"

namespace gpuslice::probe::compute {

std::uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

std::string kernel_name(unsigned us) { return "spin_" + std::to_string(us) + "us"; }

CUkernel library_kernel(unsigned us) {
  const std::string name = kernel_name(us);
  CUlibrary lib = nullptr;
  check(cuLibraryLoadData(&lib, name.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0), "cuLibraryLoadData");
  CUkernel k = nullptr;
  check(cuLibraryGetKernel(&k, lib, name.c_str()), "cuLibraryGetKernel");
  return k;
}

void* proc(const char* name, int version = 13000) {
  void* p = nullptr;
  CUdriverProcAddressQueryResult status;
  if (cuGetProcAddress_v2(name, &p, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS) return nullptr;
  return p;
}

const char* file_of(void* p) {
  Dl_info info;
  if (p == nullptr || dladdr(p, &info) == 0 || info.dli_fname == nullptr) return "none";
  const char* slash = std::strrchr(info.dli_fname, '/');
  return slash != nullptr ? slash + 1 : info.dli_fname;
}

int stream_device(const std::string& mode, unsigned us, long max_launches, double seconds) {
  const CUcontext c0 = primary(0);
  use_primary(1);
  const CUstream s1 = new_stream();
  CUkernel k = library_kernel(us);
  check(cuCtxSetCurrent(mode == "no-context" ? nullptr : c0), "cuCtxSetCurrent");
  const std::uint64_t start = now_ns();
  const std::uint64_t stop = start + static_cast<std::uint64_t>(seconds * 1e9);
  long launches = 0, errors = 0;
  std::uint64_t end = start;
  while (launches < max_launches && (end = now_ns()) < stop) {
    if (cuLaunchKernel(reinterpret_cast<CUfunction>(k), 1, 1, 1, 1, 1, 1, 0, s1, nullptr, nullptr) == CUDA_SUCCESS)
      ++launches;
    else
      ++errors;
  }
  std::printf("probe pid=%d start_ns=%llu end_ns=%llu launches=%ld errors=%ld\n", static_cast<int>(getpid()),
              static_cast<unsigned long long>(start), static_cast<unsigned long long>(now_ns()), launches, errors);
  std::fflush(stdout);
  return 0;
}

int null_config() {
  // First CUDA calls of the process: nothing is loaded yet.
  std::printf("null direct rc=%d\n", static_cast<int>(cuLaunchKernelEx(nullptr, nullptr, nullptr, nullptr)));
  std::printf("null direct_ptsz rc=%d\n", static_cast<int>(cuLaunchKernelEx_ptsz(nullptr, nullptr, nullptr, nullptr)));
  std::printf("null multi_device rc=%d\n", static_cast<int>(cuLaunchCooperativeKernelMultiDevice(nullptr, 1, 0)));
  const CUresult init = cuInit(0);
  std::printf("init rc=%d\n", static_cast<int>(init));
  if (init == CUDA_SUCCESS) {
    using Ex = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
    auto ex = reinterpret_cast<Ex>(proc("cuLaunchKernelEx", 12000));
    if (ex != nullptr) std::printf("null procaddr rc=%d\n", static_cast<int>(ex(nullptr, nullptr, nullptr, nullptr)));
  }
  std::fflush(stdout);
  return 0;
}

int entry_points() {
  const struct {
    const char* name;
    int version;
  } names[] = {{"cuLaunch", 2000},
               {"cuLaunchGrid", 2000},
               {"cuLaunchGridAsync", 2000},
               {"cuLaunchCooperativeKernelMultiDevice", 9000},
               {"cuGraphExecKernelNodeSetParams", 10010},
               {"cuGraphExecKernelNodeSetParams", 12000},
               {"cuGraphExecNodeSetParams", 12020}};
  for (const auto& n : names) {
    std::printf("entry %s@%d via=procaddr in=%s\n", n.name, n.version, file_of(proc(n.name, n.version)));
    std::printf("entry %s@%d via=dlsym in=%s\n", n.name, n.version, file_of(dlsym(RTLD_DEFAULT, n.name)));
  }
  std::fflush(stdout);
  return 0;
}

int legacy_launch(const std::string& name, unsigned us, long count) {
  use_primary(0);
  const CUfunction f = module_kernel(kernel_name(us), kernel_name(us));  // the name is the image
  // The deprecated launches take their block shape from cuFuncSetBlockShape.
  using SetBlockShape = CUresult (*)(CUfunction, int, int, int);
  if (void* shape = proc("cuFuncSetBlockShape", 2000)) reinterpret_cast<SetBlockShape>(shape)(f, 1, 1, 1);
  using Launch = CUresult (*)(CUfunction);
  using Grid = CUresult (*)(CUfunction, int, int);
  using GridAsync = CUresult (*)(CUfunction, int, int, CUstream);
  using Multi = CUresult (*)(CUDA_LAUNCH_PARAMS*, unsigned, unsigned);
  using Kernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void**, void**);
  using Cooperative =
      CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**);
  // The current entry points with stack arguments (launch_fast_x86_64.S), as
  // the runtime binds them: by name from the loaded library.
  const bool kernel = name == "cuLaunchKernel" || name == "cuLaunchKernel_ptsz";
  const bool cooperative = name == "cuLaunchCooperativeKernel" || name == "cuLaunchCooperativeKernel_ptsz";
  void* p = kernel || cooperative ? dlsym(RTLD_DEFAULT, name.c_str())
                                  : proc(name.c_str(), name == "cuLaunchCooperativeKernelMultiDevice" ? 9000 : 2000);
  if (p == nullptr) return 3;
  CUDA_LAUNCH_PARAMS params{};
  params.function = f;
  params.gridDimX = params.gridDimY = params.gridDimZ = 1;
  params.blockDimX = params.blockDimY = params.blockDimZ = 1;
  params.hStream = nullptr;
  const std::uint64_t start = now_ns();
  long launches = 0, errors = 0;
  int first_rc = -1;
  for (long i = 0; i < count; ++i) {
    CUresult rc;
    if (name == "cuLaunch")
      rc = reinterpret_cast<Launch>(p)(f);
    else if (name == "cuLaunchGrid")
      rc = reinterpret_cast<Grid>(p)(f, 1, 1);
    else if (name == "cuLaunchGridAsync")
      rc = reinterpret_cast<GridAsync>(p)(f, 1, 1, nullptr);
    else if (kernel)
      rc = reinterpret_cast<Kernel>(p)(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr);
    else if (cooperative)
      rc = reinterpret_cast<Cooperative>(p)(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr);
    else
      rc = reinterpret_cast<Multi>(p)(&params, 1, 0);
    if (first_rc < 0) first_rc = static_cast<int>(rc);
    (rc == CUDA_SUCCESS ? launches : errors) += 1;
  }
  std::printf("probe pid=%d start_ns=%llu end_ns=%llu launches=%ld errors=%ld first_rc=%d\n",
              static_cast<int>(getpid()), static_cast<unsigned long long>(start),
              static_cast<unsigned long long>(now_ns()), launches, errors, first_rc);
  std::fflush(stdout);
  return 0;
}

int churn(unsigned us, long kernels) {
  use_primary(0);
  const CUfunction f = module_kernel(kernel_name(us), kernel_name(us));  // the name is the image
  long launched = 0;
  for (long i = 0; i < kernels; ++i)
    if (cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr) == CUDA_SUCCESS) ++launched;
  std::printf("churn pid=%d launched=%ld\n", static_cast<int>(getpid()), launched);
  std::fflush(stdout);
  return 0;  // no synchronisation: the work is still queued
}

int launch_then_exit(const std::string& where, long launches) {
  if (where != "thread" && where != "main" && where != "fork") {
    std::fprintf(stderr, "launch-then-exit: expected thread, main or fork, got %s\n", where.c_str());
    return 64;
  }
  const CUcontext ctx = use_primary(0);
  const CUfunction f = module_kernel(kernel_name(1), kernel_name(1));
  long launched = 0;
  auto launch = [&] {
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    for (long i = 0; i < launches; ++i)
      if (cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr) == CUDA_SUCCESS) ++launched;
    check(cuCtxSynchronize(), "cuCtxSynchronize");
  };
  int child_status = 0;
  if (where == "thread") {
    std::thread t(launch);
    t.join();
  } else {
    launch();
  }
  if (where == "fork") {
    std::fflush(stdout);
    const pid_t child = fork();
    if (child == 0) std::exit(0);  // atexit handlers run: the library's among them
    if (child < 0 || waitpid(child, &child_status, 0) != child) child_status = -1;
  }
  std::printf("probe launched=%ld child_status=%d\n", launched, child_status);
  std::fflush(stdout);
  return 0;
}

}  // namespace gpuslice::probe::compute
