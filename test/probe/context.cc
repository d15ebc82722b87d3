// gpuslice-probe context: a context created while the container holds most of its
// quota (or of its device-resident allowance), for
// test/hardening/context_admission_test.cc. Links the simulated driver
// directly, as an application links libcuda; runs under the preload library.
//
//   peak HOLD_MIB TRIES FREE_AFTER_MS
//       retains the primary context (its size is measured: the container
//       remembers it), allocates HOLD_MIB, then runs a second process of the
//       container (this program, "context tries TRIES") that creates and destroys a
//       context TRIES times, while a thread samples what the device holds
//       for the container (fakecuda_device_used_bytes). FREE_AFTER_MS >= 0:
//       the allocation is freed that long after the child started. Prints
//       "peak peak=<bytes> child_exit=<code>" and the child's line.
//   destroy-vs-realloc ROUNDS
//       the main thread destroys a created context holding a 9 MiB
//       allocation while another thread, as soon as the device lets go of it,
//       allocates 9 MiB (the driver reuses the address); run with a sleep at
//       cuMemGetAddressRange_v2's return so that the allocation lands between
//       the destroy's look at the address and its bookkeeping. Prints the
//       rounds in which the address was reused (reused) and those that left
//       the count below the device (shorts)
//   tries N
//       cuCtxCreate + cuCtxDestroy N times; prints
//       "tries created=<n> refused=<n> other=<n> elapsed_ms=<ms>"
#include <cuda.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "fakecuda_query.h"
#include "probe.h"

namespace gpuslice::probe::context {

int tries(int n) {
  int created = 0, refused = 0, other = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    CUcontext ctx = nullptr;
    const CUresult rc = cuCtxCreate(&ctx, nullptr, 0, 0);
    if (rc == CUDA_SUCCESS) {
      ++created;
      check(cuCtxDestroy(ctx), "cuCtxDestroy");
    } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
      ++refused;
    } else {
      ++other;
    }
  }
  const long long ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  std::printf("tries created=%d refused=%d other=%d elapsed_ms=%lld\n", created, refused, other, ms);
  std::fflush(stdout);
  return 0;
}

int peak(std::size_t hold, int n, int free_after_ms) {
  use_primary(0);
  CUdeviceptr p = 0;
  check(cuMemAlloc(&p, hold), "cuMemAlloc");
  std::atomic<bool> stop{false};
  // Sampled once here too: a loaded machine may not run the sampler before the child ends.
  std::atomic<unsigned long long> top{fakecuda_device_used_bytes(0)};
  std::thread sampler([&] {
    while (!stop.load()) {
      const unsigned long long used = fakecuda_device_used_bytes(0);
      if (used > top.load()) top.store(used);
    }
  });
  std::fflush(stdout);
  const pid_t child = fork();
  if (child == 0) {
    const std::string count = std::to_string(n);
    execl("/proc/self/exe", "gpuslice-probe", "context", "tries", count.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  if (free_after_ms >= 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(free_after_ms));
    check(cuMemFree(p), "cuMemFree");
    p = 0;
  }
  int status = 0;
  waitpid(child, &status, 0);
  stop.store(true);
  sampler.join();
  if (p != 0) check(cuMemFree(p), "cuMemFree");
  std::printf("peak peak=%llu child_exit=%d\n", top.load(), WIFEXITED(status) ? WEXITSTATUS(status) : 128);
  return 0;
}

int destroy_vs_realloc(int rounds) {
  constexpr std::size_t kSize = 9 * kMi;
  const CUcontext home = use_primary(0);
  int reused = 0;
  Shortfall shorts;
  for (int i = 0; i < rounds; ++i) {
    CUcontext c1 = nullptr;
    check(cuCtxCreate(&c1, nullptr, 0, 0), "cuCtxCreate");
    CUdeviceptr x = 0;
    check(cuMemAlloc(&x, kSize), "cuMemAlloc");
    check(cuCtxSetCurrent(home), "cuCtxSetCurrent");
    const long long before = held();
    std::atomic<bool> go{false};
    CUdeviceptr y = 0;
    std::thread b([&] {
      cuCtxSetCurrent(home);
      while (!go.load()) std::this_thread::yield();
      while (held() > before - static_cast<long long>(kSize)) std::this_thread::yield();  // c1 and x are gone
      // The destroy's sweep is now asking the driver about x (and sleeping at
      // the call's return, 1-20 ms): allocate in that window, most rounds.
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      cuMemAlloc(&y, kSize);
    });
    go.store(true);
    check(cuCtxDestroy(c1), "cuCtxDestroy");
    b.join();
    check(cuCtxSetCurrent(home), "cuCtxSetCurrent");
    if (y == x) ++reused;
    shorts.observe();
    if (y != 0) check(cuMemFree(y), "cuMemFree");
  }
  std::printf("destroy-vs-realloc rounds=%d reused=%d shorts=%d max_short=%lld\n", rounds, reused, shorts.rounds,
              shorts.max);
  return 0;
}

}  // namespace gpuslice::probe::context
