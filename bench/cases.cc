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
// native and gpuslice benchmarks run at different moments (a limited
// cuLaunchKernel at 32 threads on 2 cores: native 29-45 ns from one run to
// the next). So these calls are measured paired: each benchmark iteration is
// a block of calls per side — native, gpuslice, control; which goes first
// rotates — each block timed with the thread's CPU clock, so all sides come
// from the same moments. The clock read (a system call) falls a third in
// each side: it cancels in "added".
//
// The control side makes the native calls after a private delay before each
// (--control-turns empty loop turns, 100 unless told, no shared state): a
// cost that is the caller's alone. Where the simulator's registry lock is
// contended (many threads on few cores) any added cost grows with the thread
// count, the library's or not. The control's growth from 1 to N threads is
// that amplification, measured in the same moments as the library's
// (docs/benchmarks.md, "Current figures"; the sweep of the turns that shows
// it grow with the delay: docs/log/2026-11-26-many-threads.md).
int g_control_turns = kDefaultControlTurns;  // set before the benchmarks start

inline void private_delay() {
  for (int i = 0, n = g_control_turns; i < n; ++i) asm volatile("");
}

// `block` calls of `op(calls, delay)` per side and iteration; op returns
// false (after SkipWithError) when a call failed.
template <class Op>
void paired_blocks(benchmark::State& state, Fixture& f, int block, Op op) {
  double side_ns[3] = {0, 0, 0};  // native, gpuslice, control
  int first = state.thread_index() % 3;
  for (auto _ : state) {
    for (int turn = 0; turn < 3; ++turn) {
      const int side = (first + turn) % 3;
      const Calls& c = side == 1 ? f.wrapped : f.native;
      timespec a{}, b{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
      for (int i = 0; i < block; ++i)
        if (!op(c, side == 2)) return;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
      side_ns[side] += static_cast<double>(b.tv_sec - a.tv_sec) * 1e9 + static_cast<double>(b.tv_nsec - a.tv_nsec);
    }
    first = (first + 1) % 3;
  }
  // Summed over the threads by Google Benchmark; results.cc divides by
  // "pairs": the calls (for cuMemAlloc+cuMemFree, the pairs) of each side.
  state.counters["native_ns"] = side_ns[0];
  state.counters["gpuslice_ns"] = side_ns[1];
  state.counters["control_ns"] = side_ns[2];
  state.counters["pairs"] = static_cast<double>(state.iterations()) * block;
}

void launch_paired(benchmark::State& state, Fixture& f, const Calls&) {
  CUstream stream = f.streams[static_cast<std::size_t>(state.thread_index())];
  paired_blocks(state, f, 64, [&](const Calls& c, bool delay) {
    if (delay) private_delay();
    return !failed(state, c.launch(f.empty, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr));
  });
}

void alloc_free_paired(benchmark::State& state, Fixture& f, const Calls&) {
  paired_blocks(state, f, 32, [&](const Calls& c, bool delay) {
    CUdeviceptr p = 0;
    if (delay) private_delay();
    if (failed(state, c.alloc(&p, kAllocBytes))) return false;
    if (delay) private_delay();
    return !failed(state, c.free(p));
  });
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
    {"cuLaunchKernel", launch_paired, true},
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
  g_control_turns = set.control_turns;
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
