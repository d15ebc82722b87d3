// gpuslice-probe reserve: what a thread frees while it stays alive, for
// leases_test.cc and reserve_test.cc (test/hardening). The container is shown
// what it holds, and no allocation is refused or admitted because of bytes
// other threads freed (docs/memory-accounting.md, "Freed bytes and threads").
//
//   thread-exit THREADS MIB BIG_MIB
//     THREADS threads each allocate and free MIB and exit; then the main
//     thread allocates BIG_MIB in one call. Prints
//     "thread-exit freed=N big_rc=RC" (N: the threads' frees that succeeded).
//   idle THREADS MIB BIG_MIB
//     The same, but the threads stay alive (idle, waiting) while the main
//     thread allocates BIG_MIB. Prints "idle freed=N big_rc=RC".
//   shown BYTES
//     One allocation of BYTES and its free; prints what cuMemGetInfo
//     (total - free) and NVML through the library (nvmlDeviceGetMemoryInfo's
//     used) show before the allocation and after the free:
//     "shown before=U0 after=U1 nvml_before=N0 nvml_after=N1".
//   shown-held BYTES READY GO
//     One allocation of BYTES and its free; then creates the file READY and
//     waits for the file GO (the test reads gpuslice-smi meanwhile). Prints
//     "shown-held freed=1".
//   lowered THREADS MIB READY GO
//     THREADS threads each allocate and free MIB and stay alive; the program
//     creates the file READY and waits for the file GO (the test lowers the
//     quota meanwhile); then every thread allocates MIB again and keeps it.
//     Prints "lowered freed=N admitted=K held=H" (H: the bytes of
//     allocations the simulated device holds for the process).
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "nvml_abi.h"
#include "probe.h"

namespace gpuslice::probe::reserve {

namespace {

// Starts `threads` threads that each allocate and free `bytes` in `ctx`,
// then run after(i) once go is set; returns once every free returned.
struct Freers {
  std::atomic<int> freed{0}, done{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  Freers(int threads, CUcontext ctx, std::size_t bytes, std::function<void()> after) {
    for (int i = 0; i < threads; ++i) {
      pool.emplace_back([this, ctx, bytes, after] {
        if (cuCtxSetCurrent(ctx) == CUDA_SUCCESS) {
          CUdeviceptr p = 0;
          if (cuMemAlloc(&p, bytes) == CUDA_SUCCESS && cuMemFree(p) == CUDA_SUCCESS) freed.fetch_add(1);
        }
        done.fetch_add(1);
        while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        after();
      });
    }
    while (done.load() != threads) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void finish() {
    go.store(true);
    for (std::thread& t : pool) t.join();
  }
};

// NVML's used bytes of device 0 as the library shows them (its export comes
// first: it is preloaded), or -1.
long long nvml_used() {
  using Init = nvmlReturn_t (*)();
  using Handle = nvmlReturn_t (*)(unsigned int, nvmlDevice_t*);
  using Info = nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t*);
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) return -1;
  auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
  auto handle = reinterpret_cast<Handle>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
  auto info = reinterpret_cast<Info>(dlsym(RTLD_DEFAULT, "nvmlDeviceGetMemoryInfo"));
  nvmlDevice_t dev{};
  nvmlMemory_t m{};
  if (init == nullptr || handle == nullptr || info == nullptr || init() != NVML_SUCCESS ||
      handle(0, &dev) != NVML_SUCCESS || info(dev, &m) != NVML_SUCCESS)
    return -1;
  return static_cast<long long>(m.used);
}

}  // namespace

int thread_exit(int threads, std::size_t bytes, std::size_t big) {
  const CUcontext ctx = use_primary(0);
  std::atomic<int> freed{0};
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&] {
      if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return;
      CUdeviceptr p = 0;
      if (cuMemAlloc(&p, bytes) == CUDA_SUCCESS && cuMemFree(p) == CUDA_SUCCESS) freed.fetch_add(1);
    });
  }
  for (std::thread& t : pool) t.join();
  CUdeviceptr p = 0;
  const CUresult rc = cuMemAlloc(&p, big);
  std::printf("thread-exit freed=%d big_rc=%d\n", freed.load(), static_cast<int>(rc));
  if (rc == CUDA_SUCCESS) check(cuMemFree(p), "cuMemFree");
  return 0;
}

int idle(int threads, std::size_t bytes, std::size_t big) {
  const CUcontext ctx = use_primary(0);
  Freers freers(threads, ctx, bytes, [] {});
  CUdeviceptr p = 0;
  const CUresult rc = cuMemAlloc(&p, big);
  std::printf("idle freed=%d big_rc=%d\n", freers.freed.load(), static_cast<int>(rc));
  freers.finish();
  if (rc == CUDA_SUCCESS) check(cuMemFree(p), "cuMemFree");
  return 0;
}

int shown(std::size_t bytes) {
  use_primary(0);
  const long long before = counted_used(), nvml_before = nvml_used();
  CUdeviceptr p = 0;
  check(cuMemAlloc(&p, bytes), "cuMemAlloc");
  check(cuMemFree(p), "cuMemFree");
  const long long after = counted_used(), nvml_after = nvml_used();
  std::printf("shown before=%lld after=%lld nvml_before=%lld nvml_after=%lld\n", before, after, nvml_before,
              nvml_after);
  return 0;
}

int shown_held(std::size_t bytes, const std::string& ready, const std::string& go) {
  use_primary(0);
  CUdeviceptr p = 0;
  check(cuMemAlloc(&p, bytes), "cuMemAlloc");
  check(cuMemFree(p), "cuMemFree");
  const int fd = open(ready.c_str(), O_CREAT | O_WRONLY, 0644);
  if (fd < 0) return 2;
  close(fd);
  while (access(go.c_str(), F_OK) != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::printf("shown-held freed=1\n");
  return 0;
}

int lowered(int threads, std::size_t bytes, const std::string& ready, const std::string& go) {
  const CUcontext ctx = use_primary(0);
  std::atomic<int> admitted{0}, kept{0};
  std::vector<CUdeviceptr> blocks(static_cast<std::size_t>(threads), 0);
  std::atomic<int> next{0};
  Freers freers(threads, ctx, bytes, [&] {
    cuCtxSetCurrent(ctx);
    const int i = next.fetch_add(1);
    if (cuMemAlloc(&blocks[static_cast<std::size_t>(i)], bytes) == CUDA_SUCCESS) admitted.fetch_add(1);
    kept.fetch_add(1);
  });
  const int fd = open(ready.c_str(), O_CREAT | O_WRONLY, 0644);
  if (fd < 0) return 2;
  close(fd);
  while (access(go.c_str(), F_OK) != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  freers.finish();
  std::printf("lowered freed=%d admitted=%d held=%lld\n", freers.freed.load(), admitted.load(), held_allocations());
  for (CUdeviceptr p : blocks)
    if (p != 0) check(cuMemFree(p), "cuMemFree");
  return 0;
}

}  // namespace gpuslice::probe::reserve
