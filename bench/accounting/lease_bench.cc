// The accounting path alone: an alloc+free pair of limiter calls on a
// process-private region, without any driver (build-*/bin/lease_bench; not a
// test). "exact" is the bracketed protocol every call used before quota
// leases; "leased" is the lease fast path the preload library now takes.
// Threads share one slot (threads of one process) or each own one (as
// processes do). Compiles against older trees too (no lease cases there).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>

#include "limiter/memory_accounting.h"
#include "shm/region_file.h"
#if __has_include("limiter/lease.h")
#include "limiter/lease.h"
#define LEASE_BENCH_HAS_LEASES 1
#endif

namespace gpuslice {
namespace {

constexpr std::uint64_t kBytes = 4096;
constexpr int kMaxThreads = 32;

struct Bench {
  Region* region = nullptr;
  int dev = -1;
  int slots[kMaxThreads] = {};
  shm::ProcessIdentity self{};
};

Bench& bench() {
  static Bench b = [] {
    Bench x;
    shm::Error err{};
    x.region = shm::create_private("lease-bench", &err);
    if (x.region == nullptr) {
      std::fprintf(stderr, "lease_bench: %s\n", err.message);
      return x;
    }
    shm::read_identity(0, &x.self);
    const std::uint8_t uuid[16] = {1, 2, 3};
    x.dev = shm::device_index(x.region, uuid, std::uint64_t{1} << 40, 0, SmPolicy::hard);
    for (int& s : x.slots) s = shm::claim_slot(x.region, x.self);
    return x;
  }();
  return b;
}

int slot_for(const benchmark::State& state, bool own_slot) {
  return bench().slots[own_slot ? state.thread_index() % kMaxThreads : 0];
}

void exact_pair(benchmark::State& state, bool own_slot) {
  Bench& b = bench();
  const int slot = slot_for(state, own_slot);
  for (auto _ : state) {
    benchmark::DoNotOptimize(limiter::reserve(b.region, slot, b.dev, kBytes, b.self));
    limiter::release(b.region, slot, b.dev, kBytes);
  }
  state.SetItemsProcessed(state.iterations());  // pairs, summed over threads
}

#ifdef LEASE_BENCH_HAS_LEASES
void leased_pair(benchmark::State& state, bool own_slot) {
  Bench& b = bench();
  const int slot = slot_for(state, own_slot);
  const std::uint64_t tag = limiter::lease_tag(b.region, slot);
  for (auto _ : state) {
    benchmark::DoNotOptimize(limiter::reserve(b.region, slot, tag, b.dev, kBytes, b.self));
    limiter::release(b.region, slot, tag, b.dev, kBytes);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK_CAPTURE(leased_pair, shared_slot, false)->Threads(1)->Threads(8)->UseRealTime();
BENCHMARK_CAPTURE(leased_pair, own_slots, true)->Threads(8)->UseRealTime();
#endif
BENCHMARK_CAPTURE(exact_pair, shared_slot, false)->Threads(1)->Threads(8)->UseRealTime();
BENCHMARK_CAPTURE(exact_pair, own_slots, true)->Threads(8)->UseRealTime();

}  // namespace
}  // namespace gpuslice

BENCHMARK_MAIN();
