// Device memory the driver takes without saying how much (contexts, modules,
// resource limits): measured as this process's NVML usage after minus before
// the call that takes it (measure.cc), exact when no counting operation of the
// process overlapped (CountingOp, below), and never short when one stayed in
// flight (settled once it finished, measured_bytes). context.cc and
// modules.cc measure with it; every wrapper that can change the process's
// device memory is a counting operation.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "hook/account.h"
#include "platform/pointer_table.h"

namespace gpuslice::hook {

// Counting operations of this process: every call that can change its device
// memory (an allocation or free, and every release that is not a free:
// destroys, unloads, trims, synchronisations), from before the driver call
// until the count is settled. A context's memory is measured as
// NVML's usage of this process after minus before its creation, which is
// exact only if no counting operation overlapped (measured_bytes, below).
// Without any memory quota nothing is measured (measure.cc only asks NVML on
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
[[gnu::visibility("hidden")]] extern std::atomic<std::uint64_t> g_counting_ops;
// 0 unknown, 1 off, 2 on (per-thread counters), 3 on (shared word). These
// words are declared hidden: read PC-relative by every wrapper (process.h).
[[gnu::visibility("hidden")]] extern std::atomic<int> g_counting_state;
[[gnu::cold, gnu::noinline]] bool counting_init() noexcept;
inline bool counting_on() noexcept {
  const int s = g_counting_state.load(std::memory_order_relaxed);
  if (__builtin_expect(s >= 2, 1)) return true;  // on: one compare
  return s == 0 && counting_init();
}

struct alignas(64) OpCounter {
  std::atomic<std::uint64_t> ops;    // 2 per finished operation of the owner; odd while one is in flight
  std::atomic<std::uint64_t> owner;  // process epoch << 32 | kernel thread id; 0 = free
};
inline constexpr unsigned kOpCounters = 256;
[[gnu::visibility("hidden")]] extern OpCounter g_op_counters[kOpCounters];
// The calling thread's counter, or &g_counting_ops (shared word); nullptr
// until claimed. Claimed again in a forked child (the process epoch of
// include/platform/pointer_table.h changes there): two threads never share a counter.
// One thread-local object for both words: one look-up of its offset.
struct OpThread {
  std::atomic<std::uint64_t>* counter;
  std::uint64_t epoch;  // the process epoch the counter was claimed in; kNoEpoch before
};
// No process epoch (epochs are counters from 1, and the epoch word reads 0
// until one is taken): an unclaimed thread never matches the word.
inline constexpr std::uint64_t kNoEpoch = ~std::uint64_t{0};
// Set in the epoch of a thread that counts in the shared word
// (g_counting_ops): it never matches the word either, so the inline fast
// path is only ever a thread's own counter and such a thread's operations
// go out of line (begin_op_slow), where the mark sends them to the shared word.
inline constexpr std::uint64_t kSharedEpoch = std::uint64_t{1} << 62;
[[gnu::tls_model("initial-exec")]] extern constinit thread_local OpThread t_op;
[[gnu::cold, gnu::noinline]] std::atomic<std::uint64_t>* claim_op_counter() noexcept;
// A counting operation's start when the thread's epoch does not match the
// word: claims a counter (or the shared word), marks the operation in flight
// and waits at a closed gate; returns the counter.
[[gnu::cold, gnu::noinline]] std::atomic<std::uint64_t>* begin_op_slow() noexcept;
// Whether a counter's owner is a live thread of this process.
bool op_counter_owner_alive(std::uint64_t owner) noexcept;

// Closed (non-zero) while a measurement is in progress (measure_before,
// below): a counting operation that finds it closed after marking itself
// in flight takes the mark back and waits (asleep on the gate word: a
// futex the measurer wakes when it opens the gate) for the measurement to
// end before it calls the driver, so nothing of the process changes the
// device's usage during a measurement but the measured call itself (docs/memory.md,
// "Contexts, modules and libraries"). The measurer closes it, then issues
// membarrier before reading the counters: an operation that marked itself
// before that barrier is seen in flight and waited for; one that marked
// itself after sees the gate closed.
[[gnu::visibility("hidden")]] extern std::atomic<std::uint32_t> g_measure_gate;
// Uses of a library found placed already in the driver now, and drops of
// library copies in flight (modules.cc, PlacementDrop in modules.h): here
// so that a forked child starts them at 0 (its fork handler, below).
[[gnu::visibility("hidden")]] extern std::atomic<std::uint32_t> g_placed_uses;
[[gnu::visibility("hidden")]] extern std::atomic<std::uint32_t> g_drops_in_flight;
[[gnu::cold, gnu::noinline]] void wait_measure_gate(std::atomic<std::uint64_t>* counter) noexcept;

// One more on a counter only its own thread writes: on x86-64 one add to
// memory (not locked: no other thread writes it; the measurer's loads see
// the aligned 8-byte store whole), the same micro-operations as the load,
// add and store an atomic takes three instructions for. "memory": ordered
// as the release store it replaces (x86 stores are release).
inline void bump_own_counter(std::atomic<std::uint64_t>* c) noexcept {
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
  asm volatile("addq $1, %0" : "+m"(*reinterpret_cast<std::uint64_t*>(c)) : : "memory");
#else
  c->store(c->load(std::memory_order_relaxed) + 1, std::memory_order_release);
#endif
}

struct CountingOp {
  CountingOp() noexcept : counter(counting_on() ? begin() : kNone) {}
  // With counting_on() already known (the allocation pair's fast word,
  // hook/lifecycle.h: counting on there is per thread, never the shared word).
  struct Known {
    bool on;
  };
  // (`epoch`: the process epoch, as the owner page keeps it.)
  CountingOp(Known k, std::uint64_t epoch) noexcept : counter(k.on ? begin(epoch) : kNone) {}
  [[gnu::always_inline]] ~CountingOp() {
    // (Inline always: GCC otherwise calls it from a large wrapper.)
    // One compare on the common path: a thread's own counter is an address
    // above both kNone and kShared.
    if (__builtin_expect(counter > kShared, 1)) {
      // Release: what the operation did is visible to a measurer that sees the count.
      bump_own_counter(reinterpret_cast<std::atomic<std::uint64_t>*>(counter));
    } else if (counter == kShared) {
      g_counting_ops.fetch_add((std::uint64_t{1} << 32) - 1, std::memory_order_seq_cst);
    }
  }
  CountingOp(const CountingOp&) = delete;
  CountingOp& operator=(const CountingOp&) = delete;

 private:
  static std::uintptr_t begin() noexcept {
    return begin(platform::table_detail::g_epoch_word.load(std::memory_order_acquire)->load(std::memory_order_relaxed));
  }
  static std::uintptr_t begin(std::uint64_t epoch) noexcept {
    // One compare: a claimed counter's epoch is never 0 and an unclaimed
    // thread's is kNoEpoch, so a process with no epoch yet (the word still
    // 0, as in a child before its first look) and a thread that never
    // claimed (counter still null) both claim anew; a thread of the shared
    // word carries kSharedEpoch and goes out of line too, so what is read
    // here is always the thread's own counter. The epoch is read
    // before the counter it vouches for (claim_op_counter stores them the
    // other way round): a signal handler's operation in between cannot
    // leave this one with a null counter.
    if (__builtin_expect(t_op.epoch != epoch, 0)) {
      std::atomic<std::uint64_t>* const c = begin_op_slow();
      return c == &g_counting_ops ? kShared : reinterpret_cast<std::uintptr_t>(c);
    }
    std::atomic_signal_fence(std::memory_order_seq_cst);
    std::atomic<std::uint64_t>* const c = t_op.counter;
    bump_own_counter(c);
    // Kept before the driver call by the compiler; the measurer's
    // membarrier orders it for the CPU.
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (__builtin_expect(g_measure_gate.load(std::memory_order_relaxed) != 0, 0)) wait_measure_gate(c);
    return reinterpret_cast<std::uintptr_t>(c);
  }
  // The operation's counter: kNone (counting off), kShared (g_counting_ops),
  // else the address of the thread's own counter.
  static constexpr std::uintptr_t kNone = 0, kShared = 1;
  const std::uintptr_t counter;
};

struct Measure {
  bool nvml;                // before was read
  std::uint64_t before;     // NVML usage of this process
  std::uint64_t ops;        // the counts of counting operations (above) when read
  std::uint64_t committed;  // this process's counted bytes on the device
  bool quiet;               // no counting operation was in flight at the start
  bool graphics;            // NVML listed the process with a graphics context at the start
};

// Serialises measured calls in the process (one measurement at a time).
// measure_before() closes the gate of counting operations
// (g_measure_gate, above); unlocking opens it again, so every path out of a
// measured call ends the measurement.
class MeasureMutex {
 public:
  void lock() noexcept { mu_.lock(); }
  void unlock() noexcept;

 private:
  std::mutex mu_;
};
MeasureMutex& measure_mutex() noexcept;
// Before the call (holding measure_mutex()). Closes the gate: counting
// operations (allocations, frees and every call that can release device
// memory: destroys, unloads, trims, synchronisations) that start from now on
// wait until the measurement ends; those in flight are waited for (bounded,
// kDrainNs) before NVML is read.
Measure measure_before(CUdevice ordinal) noexcept;
// The gate part of measure_before() alone (holding measure_mutex()): true
// when no counting operation is in flight now; *ops gets their counts.
bool close_gate_and_drain(std::uint64_t* ops) noexcept;
// Runs fn(ctx) with measure_mutex() held and the gate closed (counting
// operations drained, new ones held back; a warning naming `what` if one
// stayed in flight for kDrainNs). cuDeviceSetMemPool uses it so that no
// cuMemAllocAsync is between its look at the device's current pool and its
// driver call while the pool changes (pools.cc, which takes no lock itself).
CUresult gated_call(const char* what, CUresult (*fn)(void* ctx) noexcept, void* ctx) noexcept;
inline constexpr std::uint64_t kDrainNs = 2'000'000'000;
// How long a disturbed measurement waits after the call for the operations
// in flight to finish before it settles (measured_bytes).
inline constexpr std::uint64_t kSettleNs = 8'000'000'000;
// After it: the bytes the driver began to hold. An undisturbed measurement is
// exact (and stored in *remembered when given). A disturbed one (an
// operation stayed in flight past kDrainNs) is conservative: it waits, gate
// still closed, for the operations in flight to finish (bounded, kSettleNs)
// (counting the object at the fallback meanwhile, taken back before it
// returns) and returns the largest of *remembered (when set; else the difference
// minus what the process's counted bytes moved meanwhile) and what the
// process then holds beyond all its counted bytes but `prepaid` (what was
// already reserved for this object): the process's count then covers what
// it holds. 0 when NVML cannot see the process.
// A process NVML lists with a graphics context (before or after) is never
// exact: its graphics API changes device memory with no CUDA call; the
// difference is returned, never below *remembered.
// *exact (when given) says whether the measurement was undisturbed.
std::uint64_t measured_bytes(CUdevice ordinal, int entry, const Measure& m, std::atomic<std::uint64_t>* remembered,
                             bool* exact = nullptr, std::uint64_t prepaid = 0) noexcept;

}  // namespace gpuslice::hook
