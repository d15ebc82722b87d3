// context_probe: a context created while the container holds most of its
// quota (or of its device-resident allowance), for
// test/hardening/context_admission_test.cc. Links the simulated driver
// directly, as an application links libcuda; runs under the preload library.
//
//   context_probe peak HOLD_MIB TRIES FREE_AFTER_MS
//       retains the primary context (its size is measured: the container
//       remembers it), allocates HOLD_MIB, then runs a second process of the
//       container (this program, "tries TRIES") that creates and destroys a
//       context TRIES times, while a thread samples what the device holds
//       for the container (fakecuda_device_used_bytes). FREE_AFTER_MS >= 0:
//       the allocation is freed that long after the child started. Prints
//       "peak peak=<bytes> child_exit=<code>" and the child's line.
//   context_probe tries N
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

namespace {

constexpr std::size_t kMi = std::size_t{1} << 20;

void check(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) {
    std::fprintf(stderr, "context_probe: %s failed: %d\n", what, static_cast<int>(rc));
    std::exit(2);
  }
}

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
  CUcontext primary = nullptr;
  check(cuDevicePrimaryCtxRetain(&primary, 0), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
  CUdeviceptr p = 0;
  check(cuMemAlloc(&p, hold), "cuMemAlloc");
  std::atomic<bool> stop{false};
  std::atomic<unsigned long long> top{0};
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
    execl("/proc/self/exe", "context_probe", "tries", count.c_str(), static_cast<char*>(nullptr));
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: context_probe SCENARIO ARGS...\n");
    return 64;
  }
  check(cuInit(0), "cuInit");
  const std::string what = argv[1];
  if (what == "tries" && argc == 3) return tries(std::atoi(argv[2]));
  if (what == "peak" && argc == 5)
    return peak(std::strtoull(argv[2], nullptr, 10) * kMi, std::atoi(argv[3]), std::atoi(argv[4]));
  std::fprintf(stderr, "context_probe: unknown scenario or wrong arguments: %s\n", what.c_str());
  return 64;
}
