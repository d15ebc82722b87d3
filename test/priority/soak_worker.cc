// soak_worker: one process of a container in the node soak
// (test/priority/soak.py, docs/soak.md). On one (simulated) device it
//   - allocates chunks until the quota refuses one, frees some, allocates
//     again (the memory the simulator sees must never exceed the quota);
//   - "train": keeps a few kernels queued (synchronising every batch);
//   - "serve": bursts of kernels then a synchronize with random gaps, and
//     reports each burst's host latency (first launch to synchronize return).
//
//   soak_worker train|serve DEVICE SECONDS CHUNK_BYTES KERNEL_US SEED
//
// Prints one JSON line at exit: allocations, refusals, bytes held at most,
// launches, launch errors, and for serve the burst latencies' p50/p99 (ms).
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

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: soak_worker train|serve DEVICE SECONDS CHUNK_BYTES KERNEL_US SEED\n");
    return 2;
  }
  const bool serve = std::strcmp(argv[1], "serve") == 0;
  const int device = std::atoi(argv[2]);
  const double seconds = std::atof(argv[3]);
  const unsigned long long chunk = std::strtoull(argv[4], nullptr, 10);
  const unsigned kernel_us = static_cast<unsigned>(std::atoi(argv[5]));
  std::mt19937_64 rng(std::strtoull(argv[6], nullptr, 10));
  if (cuInit(0) != CUDA_SUCCESS) return 3;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (cuDeviceGet(&dev, device) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
    return 3;
  const std::string name = "spin_" + std::to_string(kernel_us) + "us";
  CUmodule module = nullptr;
  CUfunction f = nullptr;
  if (cuModuleLoadData(&module, name.c_str()) != CUDA_SUCCESS ||
      cuModuleGetFunction(&f, module, name.c_str()) != CUDA_SUCCESS)
    return 4;
  CUstream stream = nullptr;
  if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return 5;

  std::vector<CUdeviceptr> held;
  unsigned long long allocs = 0, refusals = 0, bytes = 0, most = 0, launches = 0, errors = 0;
  std::vector<double> latencies;
  const double end = now_s() + seconds;
  double next_memory = 0;
  while (now_s() < end) {
    if (now_s() >= next_memory) {
      // Up to the quota, then give some back.
      for (int i = 0; i < 64; ++i) {
        CUdeviceptr p = 0;
        const CUresult rc = cuMemAlloc_v2(&p, chunk);
        if (rc != CUDA_SUCCESS) {
          ++refusals;
          break;
        }
        ++allocs;
        held.push_back(p);
        bytes += chunk;
      }
      most = std::max(most, bytes);
      std::shuffle(held.begin(), held.end(), rng);
      const std::size_t keep = held.size() / 2;
      while (held.size() > keep) {
        cuMemFree_v2(held.back());
        held.pop_back();
        bytes -= chunk;
      }
      next_memory = now_s() + 0.05 + static_cast<double>(rng() % 200) / 1000.0;
    }
    const unsigned kernels = serve ? 10 : 8;
    const double t0 = now_s();
    for (unsigned k = 0; k < kernels; ++k) {
      if (cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr) == CUDA_SUCCESS)
        ++launches;
      else
        ++errors;
    }
    if (cuStreamSynchronize(stream) != CUDA_SUCCESS) ++errors;
    if (serve) {
      latencies.push_back((now_s() - t0) * 1e3);
      usleep(static_cast<useconds_t>(5000 + rng() % 20000));
    }
  }
  for (CUdeviceptr p : held) cuMemFree_v2(p);
  double p50 = 0, p99 = 0;
  if (!latencies.empty()) {
    std::sort(latencies.begin(), latencies.end());
    p50 = latencies[latencies.size() / 2];
    p99 = latencies[std::min(latencies.size() - 1, latencies.size() * 99 / 100)];
  }
  std::printf(
      "{\"pid\": %d, \"allocs\": %llu, \"refusals\": %llu, \"most_bytes\": %llu, \"launches\": %llu, "
      "\"errors\": %llu, \"bursts\": %zu, \"p50_ms\": %.3f, \"p99_ms\": %.3f}\n",
      static_cast<int>(getpid()), allocs, refusals, most, launches, errors, latencies.size(), p50, p99);
  return 0;
}
