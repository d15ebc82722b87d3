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

// Counting operations of this process: every call that can change its device
// memory (an allocation or free, and every release that is not a free:
// destroys, unloads, trims, synchronisations), from before the driver call
// until the count is settled. A context's memory is measured as
// NVML's usage of this process after minus before its creation, which is
// exact only if no counting operation overlapped (context.cc, measure.h).
// Without any memory quota nothing is measured (context.cc only asks NVML on
// a device with a quota), so the bracket costs one predictable branch.
//
// With a quota each thread counts its own operations in a counter of its own
// (odd while one is in flight), with plain stores: no locked instruction, no
// cache line shared between threads. The rare measurer pays instead: it
// issues membarrier(PRIVATE_EXPEDITED), a full memory barrier in every
// thread of the process, before it reads the counters, and again after the
// measured call before it reads them a second time. An operation whose
// driver call can change NVML's figure in between has stored its odd count
// before its thread's barrier (the second one at the latest), so the second
// read sees the count changed; one that stores it later calls the driver
// after the measurement. Where membarrier is unavailable (Linux < 4.14,
// seccomp) and for threads beyond the counters, operations fall back to two
// seq_cst read-modify-writes of g_counting_ops (in flight in the low 32 bits,
// finished in the high 32).
extern std::atomic<std::uint64_t> g_counting_ops;
extern std::atomic<int> g_counting_state;  // 0 unknown, 1 off, 2 on (per-thread counters), 3 on (shared word)
[[gnu::cold, gnu::noinline]] bool counting_init() noexcept;
inline bool counting_on() noexcept {
  const int s = g_counting_state.load(std::memory_order_relaxed);
  if (__builtin_expect(s != 0, 1)) return s >= 2;
  return counting_init();
}

struct alignas(64) OpCounter {
  std::atomic<std::uint64_t> ops;    // 2 per finished operation of the owner; odd while one is in flight
  std::atomic<std::uint64_t> owner;  // process epoch << 32 | kernel thread id; 0 = free
  ThreadReserve reserve;             // the owner's thread reserve (runtime.h)
};
inline constexpr unsigned kOpCounters = 256;
extern OpCounter g_op_counters[kOpCounters];
// The calling thread's counter, or &g_counting_ops (shared word); nullptr
// until claimed. Claimed again in a forked child (the process epoch of
// include/platform/pointer_table.h changes there): two threads never share a counter.
[[gnu::tls_model("initial-exec")]] extern constinit thread_local std::atomic<std::uint64_t>* t_op_counter;
[[gnu::tls_model("initial-exec")]] extern constinit thread_local std::uint64_t t_op_epoch;
[[gnu::cold, gnu::noinline]] std::atomic<std::uint64_t>* claim_op_counter() noexcept;
// Whether a counter's owner is a live thread of this process.
bool op_counter_owner_alive(std::uint64_t owner) noexcept;

// Closed (non-zero) while a measurement is in progress (context.cc,
// measure.h): a counting operation that finds it closed after marking itself
// in flight takes the mark back and waits for the measurement to end before
// it calls the driver, so nothing of the process changes the device's usage
// during a measurement but the measured call itself (docs/memory.md,
// "Contexts, modules and libraries"). The measurer closes it, then issues
// membarrier before reading the counters: an operation that marked itself
// before that barrier is seen in flight and waited for; one that marked
// itself after sees the gate closed.
extern std::atomic<std::uint32_t> g_measure_gate;
[[gnu::cold, gnu::noinline]] void wait_measure_gate(std::atomic<std::uint64_t>* counter) noexcept;

struct CountingOp {
  CountingOp() noexcept : counter(counting_on() ? begin() : nullptr) {}
  ~CountingOp() {
    if (counter == nullptr) return;
    if (counter == &g_counting_ops) {
      g_counting_ops.fetch_add((std::uint64_t{1} << 32) - 1, std::memory_order_seq_cst);
    } else {
      // Release: what the operation did is visible to a measurer that sees the count.
      counter->store(counter->load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
  }
  CountingOp(const CountingOp&) = delete;
  CountingOp& operator=(const CountingOp&) = delete;

 private:
  static std::atomic<std::uint64_t>* begin() noexcept {
    std::atomic<std::uint64_t>* c = t_op_counter;
    if (__builtin_expect(c == nullptr || t_op_epoch != platform::table_detail::process_epoch(), 0))
      c = claim_op_counter();
    if (c == &g_counting_ops) {
      g_counting_ops.fetch_add(1, std::memory_order_seq_cst);
      if (__builtin_expect(g_measure_gate.load(std::memory_order_seq_cst) != 0, 0)) wait_measure_gate(c);
    } else {
      c->store(c->load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      // Kept before the driver call by the compiler; the measurer's
      // membarrier orders it for the CPU.
      std::atomic_signal_fence(std::memory_order_seq_cst);
      if (__builtin_expect(g_measure_gate.load(std::memory_order_relaxed) != 0, 0)) wait_measure_gate(c);
    }
    return c;
  }
  std::atomic<std::uint64_t>* const counter;
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

// Counted memory went back to the driver and its bytes to the budget:
// allocations of the container waiting for memory are woken (oversub.cc).
// Inline: every free pays one load of the device's waiter count (seq_cst: a
// plain load on x86; the waiter's seq_cst increment pairs with it).
[[gnu::cold, gnu::noinline]] void wake_oversub_waiters(int entry) noexcept;
inline void oversub_freed(int entry, limiter::AllocKind, std::uint64_t) noexcept {
  if (entry < 0 || static_cast<unsigned>(entry) >= kMaxDevices || g_process.region == nullptr) return;
  if (g_process.region->devices[entry].oversub_waiting.load(std::memory_order_seq_cst) != 0)
    wake_oversub_waiters(entry);
}
// Spilled memory went back to the driver: its bytes stop counting as spilled
// (before they leave the budget, so resident memory is never understated).
void oversub_unspill(int entry, std::uint64_t bytes) noexcept;

// A counted record whose memory the driver has let go: its bytes go back to
// the budget (spilled ones stop counting as spilled first; waiters are woken).
inline void release_record(const limiter::AllocRecord& rec) noexcept {
  if (rec.kind == limiter::AllocKind::spilled) [[unlikely]]
    oversub_unspill(rec.dev, rec.bytes);
  release(rec.dev, rec.bytes);
  oversub_freed(rec.dev, rec.kind, rec.bytes);
}

// After the driver freed memory implicitly: releases every record of `table`
// for which gone(key, record) says the driver no longer knows the handle.
// gone() asks the driver, so it runs on copies with no table lock held
// (a driver calling back into a hooked entry point must not wait on one);
// each record is then erased exactly once.
// Between gone() and the erase another thread may allocate at the same
// address (the driver reuses addresses) and commit its record under the same
// key, releasing the gone one as stale; that record must not be erased in
// its place: the driver is asked again about the record taken, and a key it
// knows again goes back (a free of it meanwhile found no record and was
// forwarded uncounted: gone then, and released here).
template <class Gone>
void sweep_table(limiter::AllocTable& table, Gone&& gone) noexcept {
  table.for_each_unlocked([&](std::uint64_t key, const limiter::AllocRecord& rec) {
    if (!gone(key, rec)) return;
    limiter::AllocRecord taken{};
    if (!table.erase(key, &taken)) return;
    if (gone(key, taken))
      release_record(taken);
    else
      table.insert(key, taken);  // allocated again at this address since
  });
}

// Free path: forget `key` (exactly once), run the real free, then return the
// bytes to the budget — or put the record back if the driver refused. A key
// the table does not hold is freed by `untracked` instead.
template <class RealFree, class Untracked>
CUresult free_counted(limiter::AllocTable& table, std::uint64_t key, RealFree&& real_free,
                      Untracked&& untracked) noexcept {
  CountingOp op;
  limiter::AllocRecord rec{};
  if (!table.erase(key, &rec)) return untracked();
  const CUresult rc = real_free();
  if (rc == CUDA_SUCCESS)
    release_record(rec);
  else
    table.insert(key, rec);  // the driver refused: still live
  return rc;
}
template <class RealFree>
CUresult free_counted(limiter::AllocTable& table, std::uint64_t key, RealFree&& real_free) noexcept {
  return free_counted(table, key, real_free, real_free);
}

// The table of linear/pitched/managed allocations (memory.cc): cuMemFreeAsync
// frees those too.
limiter::AllocTable& linear_table() noexcept;
// cuMemFree of a pointer the linear table does not hold: a stream-ordered
// allocation (its pool's record is taken before the driver call and settled
// after it) or memory we never counted (forwarded). One relaxed load when no
// pool is known (pools.cc).
CUresult free_pool_or_untracked(CUdeviceptr dptr) noexcept;
// After the driver freed memory implicitly (context destroyed, primary context
// reset or released for the last time): release every counted allocation the
// driver no longer knows (memory.cc).
void sweep_implicitly_freed() noexcept;
void sweep_implicitly_freed_arrays() noexcept;  // arrays.cc

// Legacy 32-bit entry points that would let memory bypass the quota.
[[gnu::cold]] CUresult refuse_legacy(const char* symbol) noexcept;

}  // namespace gpuslice::hook
