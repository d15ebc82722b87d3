#include "cases.h"

#include <benchmark/benchmark.h>

#include <time.h>

#include <cstdlib>
#include <functional>

namespace gpuslice::microbench {

namespace {

// 64 KiB: the simulated driver never reuses a device address (a 16 TiB
// window per device), so the size bounds how many allocations a run may make:
// 2^28 here, against 2^24 at 1 MiB, which a few seconds of
// cuMemAllocAsync+cuMemFreeAsync at ~100 ns per pair would exhaust.
constexpr std::size_t kAllocBytes = std::size_t{64} << 10;

// A call that fails would measure an error path: stop the benchmark instead.
inline bool failed(benchmark::State& state, CUresult rc) {
  if (__builtin_expect(rc == CUDA_SUCCESS, 1)) return false;
  state.SkipWithError(("CUresult " + std::to_string(rc)).c_str());
  return true;
}

using Body = void (*)(benchmark::State&, Fixture&, const Calls&);

void launch(benchmark::State& state, Fixture& f, const Calls& c) {
  CUstream stream = f.streams[static_cast<std::size_t>(state.thread_index())];
  for (auto _ : state) {
    if (failed(state, c.launch(f.empty, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr))) break;
  }
}

void launch_ex(benchmark::State& state, Fixture& f, const Calls& c) {
  CUlaunchConfig config{};
  config.gridDimX = config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = config.blockDimY = config.blockDimZ = 1;
  config.hStream = f.streams[static_cast<std::size_t>(state.thread_index())];
  for (auto _ : state) {
    if (failed(state, c.launch_ex(&config, f.empty, nullptr, nullptr))) break;
  }
}

void graph_launch(benchmark::State& state, Fixture& f, const Calls& c) {
  const auto index = static_cast<std::size_t>(state.thread_index());
  for (auto _ : state) {
    if (failed(state, c.graph_launch(f.graphs[index], f.streams[index]))) break;
  }
}

// cuMemAlloc+cuMemFree costs the simulator ~100 ns (~850 ns before its slot
// scans stopped at the highest slot in use) and moves by more than the
// ~25 ns gpuslice adds whenever the machine's load changes, and separate
// native and gpuslice benchmarks run at different moments. So this call is
// measured paired: each benchmark iteration is a block of kPairedBlock native
// pairs and one of wrapped pairs (which goes first alternates), each timed
// with the thread's CPU clock; both sides come from the same moments. The
// clock read (a system call) falls half in each side: it cancels in "added".
constexpr int kPairedBlock = 32;

void alloc_free_paired(benchmark::State& state, Fixture& f, const Calls&) {
  double side_ns[2] = {0, 0};  // native, gpuslice
  bool wrapped_first = state.thread_index() % 2 == 1;
  for (auto _ : state) {
    for (int turn = 0; turn < 2; ++turn) {
      const int side = (turn == 0) == wrapped_first ? 1 : 0;
      const Calls& c = side == 0 ? f.native : f.wrapped;
      timespec a{}, b{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
      for (int i = 0; i < kPairedBlock; ++i) {
        CUdeviceptr p = 0;
        if (failed(state, c.alloc(&p, kAllocBytes)) || failed(state, c.free(p))) return;
      }
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
      side_ns[side] += static_cast<double>(b.tv_sec - a.tv_sec) * 1e9 + static_cast<double>(b.tv_nsec - a.tv_nsec);
    }
    wrapped_first = !wrapped_first;
  }
  // Summed over the threads by Google Benchmark; results.cc divides by pairs.
  state.counters["native_ns"] = side_ns[0];
  state.counters["gpuslice_ns"] = side_ns[1];
  state.counters["pairs"] = static_cast<double>(state.iterations()) * kPairedBlock;
}

void alloc_free_async(benchmark::State& state, Fixture& f, const Calls& c) {
  CUstream stream = f.streams[static_cast<std::size_t>(state.thread_index())];
  for (auto _ : state) {
    CUdeviceptr p = 0;
    if (failed(state, c.alloc_async(&p, kAllocBytes, stream)) || failed(state, c.free_async(p, stream))) break;
  }
}

void get_info(benchmark::State& state, Fixture&, const Calls& c) {
  for (auto _ : state) {
    std::size_t free_bytes = 0;
    std::size_t total = 0;
    if (failed(state, c.get_info(&free_bytes, &total))) break;
    benchmark::DoNotOptimize(free_bytes);
  }
}

void get_proc_address(benchmark::State& state, Fixture&, const Calls& c) {
  for (auto _ : state) {
    void* fn = nullptr;
    CUdriverProcAddressQueryResult status{};
    if (failed(state, c.get_proc_address("cuLaunchKernel", &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &status)))
      break;
    benchmark::DoNotOptimize(fn);
  }
}

struct Case {
  const char* name;
  Body body;
  bool paired = false;  // one benchmark measures both sides (results.cc splits it)
};

const Case kCases[] = {
    {"cuLaunchKernel", launch},
    {"cuLaunchKernelEx", launch_ex},
    {"cuGraphLaunch", graph_launch},
    {"cuMemAlloc+cuMemFree", alloc_free_paired, true},
    {"cuMemAllocAsync+cuMemFreeAsync", alloc_free_async},
    {"cuMemGetInfo", get_info},
    {"cuGetProcAddress", get_proc_address},
};

}  // namespace

const std::vector<std::string>& all_cases() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Case& c : kCases) out.emplace_back(c.name);
    return out;
  }();
  return names;
}

void register_cases(Fixture& fixture, const CaseSet& set) {
  for (const Case& c : kCases) {
    bool wanted = false;
    for (const std::string& name : set.calls) wanted = wanted || name == c.name;
    if (!wanted) continue;
    if (c.paired) {
      Fixture* f = &fixture;
      Body body = c.body;
      auto* bm =
          benchmark::RegisterBenchmark((std::string(c.name) + "/paired").c_str(), [f, body](benchmark::State& state) {
            f->set_current(f->ctx);
            body(state, *f, f->native);
          });
      for (int threads : set.threads) bm->Threads(threads);
      continue;
    }
    for (const char* side : {"native", "gpuslice"}) {
      const Calls* calls = side[0] == 'n' ? &fixture.native : &fixture.wrapped;
      Fixture* f = &fixture;
      Body body = c.body;
      auto* bm = benchmark::RegisterBenchmark((std::string(c.name) + "/" + side).c_str(),
                                              [f, calls, body](benchmark::State& state) {
                                                // Each benchmark thread needs the context current.
                                                f->set_current(f->ctx);
                                                body(state, *f, *calls);
                                              });
      for (int threads : set.threads) bm->Threads(threads);
    }
  }
}

}  // namespace gpuslice::microbench
