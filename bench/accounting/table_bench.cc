// Insert+erase pairs of distinct addresses (address churn, as an allocator
// hands out), on the pointer table of issue 14 and on the table it replaced,
// in one run, at 1 and 8 threads. Pure CPU: no driver involved.
//   build-*/bin/table_bench [--benchmark_min_time=0.2] [--benchmark_repetitions=3]
#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>

#include "legacy_alloc_table.h"
#include "limiter/alloc_table.h"

namespace {

using gpuslice::legacy::AllocTable;
using gpuslice::limiter::AllocRecord;
using gpuslice::platform::PointerTable;

// A per-thread stride of distinct 256-byte-aligned addresses; each thread
// keeps kLive allocations alive, so erases hit populated clusters.
constexpr std::uint64_t kLive = 64;
std::uint64_t address(int thread, std::uint64_t i) {
  return 0x7f0000000000ull + (static_cast<std::uint64_t>(thread) << 36) + i * 256;
}

template <class Table, class Rec>
void churn(benchmark::State& state, Table& table) {
  const int th = state.thread_index();
  std::uint64_t i = 1;
  for (; i <= kLive; ++i) table.insert(address(th, i), Rec{i, 0, {}});
  for (auto _ : state) {
    table.insert(address(th, i), Rec{i, 0, {}});
    Rec out{};
    benchmark::DoNotOptimize(table.erase(address(th, i - kLive), &out));
    ++i;
  }
  for (std::uint64_t j = i - kLive; j < i; ++j) table.erase(address(th, j), nullptr);
  state.SetItemsProcessed(state.iterations());
}

AllocTable g_legacy;
PointerTable<AllocRecord> g_sharded;

void BM_LegacyTable_InsertErasePair(benchmark::State& state) {
  churn<AllocTable, gpuslice::legacy::AllocRecord>(state, g_legacy);
}
void BM_PointerTable_InsertErasePair(benchmark::State& state) {
  churn<PointerTable<AllocRecord>, AllocRecord>(state, g_sharded);
}

BENCHMARK(BM_LegacyTable_InsertErasePair)->Threads(1)->Threads(8)->UseRealTime();
BENCHMARK(BM_PointerTable_InsertErasePair)->Threads(1)->Threads(8)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
