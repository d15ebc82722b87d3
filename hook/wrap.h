// Shared pieces of the accounting wrappers: the export attribute, and the
// reserve-before / commit-or-undo-after protocol every allocation follows.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "hook/real.h"
#include "hook/runtime.h"
#include "limiter/alloc_table.h"

#define GPUSLICE_EXPORT extern "C" [[gnu::visibility("default")]]

namespace gpuslice::hook {

// Process-lifetime storage: the object is never destroyed, so a CUDA call made
// during exit (the runtime's own teardown frees memory after our static
// destructors would have run) never touches a destroyed table.
template <class T>
union NoDestroy {
  T value;
  constexpr NoDestroy() : value() {}
  ~NoDestroy() {}
  T& operator*() noexcept { return value; }
  T* operator->() noexcept { return &value; }
};

// Counting operations of this process (allocation or free, from before the
// driver call until the count is settled): in flight in the low 32 bits,
// finished in the high 32. A context's memory is measured as NVML's usage of
// this process after minus before its creation, which is exact only if no
// counting operation overlapped: context.cc checks this word did not change.
// Without any memory quota nothing is measured (context.cc only asks NVML on
// a device with a quota), so the bracket costs one predictable branch.
extern std::atomic<std::uint64_t> g_counting_ops;
extern std::atomic<int> g_counting_state;  // 0 unknown, 1 off, 2 on
[[gnu::cold, gnu::noinline]] bool counting_init() noexcept;
inline bool counting_on() noexcept {
  const int s = g_counting_state.load(std::memory_order_relaxed);
  if (__builtin_expect(s != 0, 1)) return s == 2;
  return counting_init();
}
struct CountingOp {
  CountingOp() noexcept : on(counting_on()) {
    if (on) g_counting_ops.fetch_add(1, std::memory_order_seq_cst);
  }
  ~CountingOp() {
    if (on) g_counting_ops.fetch_add((std::uint64_t{1} << 32) - 1, std::memory_order_seq_cst);
  }
  CountingOp(const CountingOp&) = delete;
  CountingOp& operator=(const CountingOp&) = delete;
  const bool on;
};

struct Reservation {
  int entry = -1;
  std::uint64_t bytes = 0;
};

// Reserve `bytes` on the current context's device before the real call.
// Returns the error to hand back unchanged: bootstrap failure, no current
// context (the driver's own error), or CUDA_ERROR_OUT_OF_MEMORY over quota.
CUresult reserve_on_current(std::uint64_t bytes, Reservation* r) noexcept;
// Same on an explicit device ordinal.
CUresult reserve_on_ordinal(CUdevice ordinal, std::uint64_t bytes, Reservation* r) noexcept;

// After the real allocation: on failure the reservation is returned; on
// success it is recorded under `key` in `table` (a stale record for the same
// key, from a free we never saw, is released first).
void commit(limiter::AllocTable& table, CUresult rc, const Reservation& r, std::uint64_t key,
            limiter::AllocKind kind) noexcept;

// A counted allocation went back to the driver: spilled bytes stop counting
// as spilled, and allocations of the container waiting for memory are woken
// (oversub.cc).
void oversub_freed(int entry, limiter::AllocKind kind, std::uint64_t bytes) noexcept;

// A counted record whose memory the driver has let go: its bytes go back to
// the budget (and stop counting as spilled; waiters are woken).
inline void release_record(const limiter::AllocRecord& rec) noexcept {
  release(rec.dev, rec.bytes);
  oversub_freed(rec.dev, rec.kind, rec.bytes);
}

// After the driver freed memory implicitly: releases every record of `table`
// for which gone(key, record) says the driver no longer knows the handle.
// Keys are collected in batches on the stack (the table must not change while
// it is walked), then erased exactly once.
template <class Gone>
void sweep_table(limiter::AllocTable& table, Gone&& gone) noexcept {
  constexpr std::size_t kBatch = 128;
  std::uint64_t keys[kBatch];
  for (;;) {
    std::size_t n = 0;
    bool more = false;
    table.for_each([&](std::uint64_t key, const limiter::AllocRecord& rec) {
      if (!gone(key, rec)) return;
      if (n < kBatch) keys[n++] = key; else more = true;
    });
    for (std::size_t i = 0; i < n; ++i) {
      limiter::AllocRecord rec{};
      if (table.erase(keys[i], &rec)) release_record(rec);
    }
    if (!more) return;
  }
}

// Free path: forget `key` (exactly once), run the real free, then return the
// bytes to the budget — or put the record back if the driver refused.
template <class RealFree>
CUresult free_counted(limiter::AllocTable& table, std::uint64_t key, RealFree&& real_free) noexcept {
  CountingOp op;
  limiter::AllocRecord rec{};
  const bool counted = table.erase(key, &rec);
  CUresult rc = real_free();
  if (counted) {
    if (rc == CUDA_SUCCESS)
      release_record(rec);
    else
      table.insert(key, rec);
  }
  return rc;
}

// The table of linear/pitched/managed allocations (memory.cc): cuMemFreeAsync
// frees those too.
limiter::AllocTable& linear_table() noexcept;
// A device pointer was freed through any entry point: pools.cc settles pools
// destroyed with allocations outstanding. One relaxed load when no pool is known.
void pool_pointer_freed(CUdeviceptr dptr) noexcept;
// After the driver freed memory implicitly (context destroyed, primary context
// reset or released for the last time): release every counted allocation the
// driver no longer knows (memory.cc).
void sweep_implicitly_freed() noexcept;
void sweep_implicitly_freed_arrays() noexcept;  // arrays.cc

// Legacy 32-bit entry points that would let memory bypass the quota.
[[gnu::cold]] CUresult refuse_legacy(const char* symbol) noexcept;

}  // namespace gpuslice::hook
