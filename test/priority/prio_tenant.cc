// prio_tenant: one tenant of the many-tenants priority test
// (priority_many_tenants_test.cc, docs/priority.md "Many tenants") on the
// simulated device 0.
//
//   prio_tenant low KERNEL_US STOP_FILE
//       a training tenant: launches KERNEL_US kernels on its own stream,
//       synchronising every 16, until STOP_FILE exists (how many are in
//       flight is what gpuslice lets through).
//   prio_tenant high KERNEL_US KERNELS BURSTS GAP_MIN_US GAP_MAX_US SEED GO_FILE
//       an inference tenant: one launch (it is present), then once GO_FILE
//       exists and 0.3 s later, BURSTS bursts of KERNELS kernels, each
//       between two events and followed by a synchronize, with random idle
//       gaps.
//
// high prints one line: "prio_tenant pid=<pid> start_ns=<first launch,
// CLOCK_MONOTONIC> end_ns=<last synchronize> bursts=<n> p50_us=<..>
// p90_us=<..> p99_us=<..> max_us=<..> host_p99_us=<..>": burst latencies device-side
// (between the events: simulated instants, free of the host's wake-up) and
// host-side (first launch to the synchronize's return).
#include <cuda.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

std::uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

void check(CUresult rc, const char* what) {
  if (rc == CUDA_SUCCESS) return;
  std::fprintf(stderr, "prio_tenant: %s failed: %d\n", what, static_cast<int>(rc));
  std::exit(3);
}

double percentile(std::vector<double> v, int p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, v.size() * static_cast<std::size_t>(p) / 100)];
}

}  // namespace

int main(int argc, char** argv) {
  const bool low = argc == 4 && std::strcmp(argv[1], "low") == 0;
  const bool high = argc == 9 && std::strcmp(argv[1], "high") == 0;
  if (!low && !high) {
    std::fprintf(stderr,
                 "usage: prio_tenant low KERNEL_US STOP_FILE\n"
                 "       prio_tenant high KERNEL_US KERNELS BURSTS GAP_MIN_US GAP_MAX_US SEED GO_FILE\n");
    return 2;
  }
  const unsigned kernel_us = static_cast<unsigned>(std::atoi(argv[2]));
  check(cuInit(0), "cuInit");
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  const std::string name = "spin_" + std::to_string(kernel_us) + "us";
  CUmodule module = nullptr;
  CUfunction f = nullptr;
  check(cuModuleLoadData(&module, name.c_str()), "cuModuleLoadData");
  check(cuModuleGetFunction(&f, module, name.c_str()), "cuModuleGetFunction");
  CUstream stream = nullptr;
  check(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  auto launch = [&] { check(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr), "cuLaunchKernel"); };

  if (low) {
    const char* stop = argv[3];
    for (unsigned n = 1;; ++n) {
      launch();
      if (n % 16 == 0) {
        check(cuStreamSynchronize(stream), "cuStreamSynchronize");
        if (access(stop, F_OK) == 0) break;
      }
    }
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    return 0;
  }

  const int kernels = std::atoi(argv[3]);
  const int bursts = std::atoi(argv[4]);
  const unsigned gap_min = static_cast<unsigned>(std::atoi(argv[5]));
  const unsigned gap_max = static_cast<unsigned>(std::atoi(argv[6]));
  std::mt19937_64 rng(std::strtoull(argv[7], nullptr, 10));
  CUevent a = nullptr, b = nullptr;
  check(cuEventCreate(&a, CU_EVENT_DEFAULT), "cuEventCreate");
  check(cuEventCreate(&b, CU_EVENT_DEFAULT), "cuEventCreate");
  // Present first: low tenants that start later are bounded from their first
  // launch (one already running keeps its whole queue until it notices a new
  // neighbour, within a rescan: docs/priority.md, Limitations). The bursts
  // measured here are the steady state.
  launch();
  check(cuStreamSynchronize(stream), "cuStreamSynchronize");
  while (access(argv[8], F_OK) != 0) usleep(10'000);
  usleep(300'000);
  std::vector<double> device_us, host_us;
  std::uint64_t start = 0, end = 0;
  for (int i = 0; i < bursts; ++i) {
    const std::uint64_t t0 = now_ns();
    if (start == 0) start = t0;
    check(cuEventRecord(a, stream), "cuEventRecord");
    for (int k = 0; k < kernels; ++k) launch();
    check(cuEventRecord(b, stream), "cuEventRecord");
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    end = now_ns();
    float ms = 0;
    check(cuEventElapsedTime(&ms, a, b), "cuEventElapsedTime");
    device_us.push_back(static_cast<double>(ms) * 1000.0);
    host_us.push_back(static_cast<double>(end - t0) / 1000.0);
    usleep(static_cast<useconds_t>(gap_min + rng() % (gap_max - gap_min + 1)));
  }
  std::printf(
      "prio_tenant pid=%d start_ns=%llu end_ns=%llu bursts=%zu p50_us=%.1f p90_us=%.1f p99_us=%.1f "
      "max_us=%.1f host_p99_us=%.1f\n",
      static_cast<int>(getpid()), static_cast<unsigned long long>(start), static_cast<unsigned long long>(end),
      device_us.size(), percentile(device_us, 50), percentile(device_us, 90), percentile(device_us, 99),
      percentile(device_us, 100), percentile(host_us, 99));
  return 0;
}
