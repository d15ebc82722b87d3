// Accounting state of stream-ordered allocation (pools.cc): one record per
// memory pool this process uses, the registry that finds it by handle or by
// device, and the records of live allocations. docs/memory.md, "Stream-ordered
// pools", has the model; in short:
//  - a pool is counted at `counted`, bytes held in the region for it, kept at
//    or above the pool's physical reserve (what the card holds for it);
//  - `outstanding` is the bytes of its allocations made through us and not yet
//    freed. An allocation that fits (outstanding <= counted) touches nothing
//    but this process's own pool record and one driver query: no lock, no
//    region operation. One that does not grows `counted` first (reserve(), in
//    2 MiB chunks) under the pool's mutex. Either way the reserve the driver
//    reports is read before the pointer is handed out: a growth past
//    `counted` is reserved (or trimmed back, or the allocation refused);
//  - a free lowers `outstanding` only: the pool keeps the memory reserved;
//  - `counted` is brought down (or up) to the reserve the driver reports on
//    slow triggers only: synchronisation, cuMemPoolTrimTo, before any
//    allocation of the process is refused, destroy, and a free of a pool
//    the last reconciliation left counted above its reserve.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "gpuslice/region.h"
#include "hook/real.h"
#include "platform/pointer_table.h"

namespace gpuslice::hook::pools {

// What a pool's reserve grows by: the driver maps physical memory for pools
// in 2 MiB pages.
inline constexpr std::uint64_t kChunk = std::uint64_t{2} << 20;
inline constexpr std::uint64_t round_chunk(std::uint64_t v) noexcept {
  return v > ~std::uint64_t{0} - (kChunk - 1) ? ~std::uint64_t{0} - (kChunk - 1) : (v + kChunk - 1) / kChunk * kChunk;
}

// Larger than any device (2^48 bytes): such a request always takes the slow
// path, so the fast path's sums never wrap.
inline constexpr std::uint64_t kHugeBytes = std::uint64_t{1} << 48;

// Pools one process may use at once (a slot is reused once its pool is
// destroyed and its last allocation freed). Beyond it, allocations from a new
// pool are refused with CUDA_ERROR_OUT_OF_MEMORY and one warning.
inline constexpr std::uint32_t kMaxPools = 4096;

struct alignas(64) PoolState {
  // Hot: every allocation and free of the pool (one cache line).
  std::atomic<std::uint64_t> outstanding{0};  // bytes allocated through us, not yet freed (or in flight)
  std::atomic<std::uint64_t> counted{0};      // bytes this process holds in the region for the pool
  std::atomic<std::uint32_t> dirty{0};        // an allocation or free since the last sync-time reconciliation
  std::atomic<std::uint32_t> destroyed{0};    // cuMemPoolDestroy returned; freed with the last allocation
  std::atomic<std::int32_t> entry{-1};        // region device entry (set before `handle` is published)
  std::atomic<std::uint32_t> host{0};         // host-located: never charged
  // The last reconciliation left `counted` above the driver's reserve (kept
  // for allocations then in flight, which the driver may serve from the
  // reserve), or could not read it consistently: a free looks again.
  std::atomic<std::uint32_t> above_reserve{0};
  // Cold.
  std::atomic<CUmemoryPool> handle{nullptr};   // nullptr once destroyed (lookups miss) or free
  std::atomic<std::uint32_t> in_use{0};        // slot taken (until destroyed and drained)
  std::atomic<std::uint32_t> finalized{0};     // the destroyed pool's count was released (exactly once)
  std::atomic<std::uint32_t> made_current{0};  // cuDeviceSetMemPool made it current: destroyed under the gate
  std::mutex mu;                               // growth, reconciliation and destroy of this pool
};

// An allocation or free happened: the next synchronisation reconciles the pool.
inline void mark_dirty(PoolState& st) noexcept {
  if (st.dirty.load(std::memory_order_relaxed) == 0) st.dirty.store(1, std::memory_order_relaxed);
}

// --- registry (pool_state.cc) ---
// The record of `pool`, or nullptr if this process never registered it.
// Lock-free when cached (a direct-mapped cache verified against the record).
inline PoolState* find(CUmemoryPool pool) noexcept;
// Registers `pool` (created, looked up, or first seen in an allocation) with
// its device entry; returns the existing record if it is known. nullptr when
// every slot is taken.
PoolState* track(CUmemoryPool pool, int entry, bool host) noexcept;
// The current pool of device `ordinal` as cuMemAllocAsync uses it, cached;
// the driver is asked (cuDeviceGetMemPool) on a miss. nullptr with *rc set
// when the driver cannot say or the device has no region entry.
inline PoolState* current_pool(int ordinal, CUresult* rc) noexcept;
// The device's current pool may have changed (cuDeviceSetMemPool, destroy).
void forget_current(int ordinal) noexcept;
void forget_current(const PoolState* st) noexcept;
// The cached current pool of `ordinal` was destroyed: forgets it and asks the
// driver. nullptr with *rc set as current_pool(); CUDA_ERROR_OUT_OF_MEMORY
// when the answer is still a destroyed pool (never allocated uncounted).
[[gnu::cold, gnu::noinline]] PoolState* current_pool_after_destroy(int ordinal, CUresult* rc) noexcept;
// Slots ever used (the reconciliation loops' bound); 0 means no pool was ever
// seen and the free and sync paths do nothing more. Hidden on the
// declaration: cuMemFree reads it PC-relative (hook/process.h).
[[gnu::visibility("hidden")]] extern std::atomic<std::uint32_t> g_slots_used;

// The caches behind find() and current_pool(), and their slow paths.
extern PoolState g_states[kMaxPools];
inline constexpr unsigned kCacheBits = 8;
extern std::atomic<std::uint32_t> g_cache[1u << kCacheBits];  // slot + 1, 0 = empty
extern std::atomic<PoolState*> g_current[kMaxDevices];
inline unsigned cache_home(CUmemoryPool pool) noexcept {
  const auto key = reinterpret_cast<std::uintptr_t>(pool);
  return static_cast<unsigned>(((key >> 4) * 0x9e3779b97f4a7c15ull) >> (64 - kCacheBits));
}
[[gnu::cold, gnu::noinline]] PoolState* find_slow(CUmemoryPool pool) noexcept;
[[gnu::cold, gnu::noinline]] PoolState* current_pool_slow(int ordinal, CUresult* rc) noexcept;

inline PoolState* find(CUmemoryPool pool) noexcept {
  const std::uint32_t v = g_cache[cache_home(pool)].load(std::memory_order_acquire);
  if (__builtin_expect(v != 0, 1)) {
    PoolState& st = g_states[v - 1];
    if (__builtin_expect(st.handle.load(std::memory_order_acquire) == pool && pool != nullptr, 1)) return &st;
  }
  return find_slow(pool);
}

inline PoolState* current_pool(int ordinal, CUresult* rc) noexcept {
  if (__builtin_expect(static_cast<unsigned>(ordinal) < kMaxDevices, 1)) {
    if (PoolState* st = g_current[ordinal].load(std::memory_order_acquire)) return st;
  }
  return current_pool_slow(ordinal, rc);
}

// --- accounting (pool_state.cc) ---
// Grows `counted` in whole chunks to cover an allocation of `bytes` being
// made (already in `outstanding`), by at most its own chunks. `refused` when
// the quota or the resident allowance refuses it; `wait` when it is over the
// resident allowance under GPUSLICE_OVERSUBSCRIBE=wait: *held bytes stay
// reserved, `counted` is unchanged, and the caller waits without st.mu
// (alloc_growing). Caller holds st.mu.
enum class Grow { ok, refused, wait };
Grow grow_locked(PoolState& st, std::uint64_t bytes, std::uint64_t* held) noexcept;
// Brings `counted` to max(the driver's reserve, outstanding rounded to a
// chunk); the driver's reserve is read unless `reserve_known` (trusted).
// Keeps `counted` when the driver cannot say (destroyed, foreign pool) unless
// `unknown_is_empty` (a failed allocation: a pool the driver does not know
// holds nothing). Caller holds st.mu.
void reconcile_locked(PoolState& st, bool unknown_is_empty) noexcept;
// After the destroy returned: if nothing is outstanding, releases the count
// and frees the slot (exactly once, also against a racing last free).
// (declared with the records below)
// Reconciles every pool marked dirty (after a synchronisation): one driver
// query per pool used since the last one, none when idle. A pool another
// thread holds is waited for (bounded), never skipped while it is quick.
void reconcile_dirty() noexcept;
// Before an allocation is refused: trims this process's pools down to what
// their allocations use (what the driver does before failing one of its own)
// and reconciles them. Skips a pool whose mutex the calling thread holds;
// waits (bounded) for one another thread holds, unless a thread holding a
// pool's mutex is reclaiming too (a reclaim runs inside a pool's growth,
// which holds that pool's mutex, and may be waiting for ours). Returns
// whether it skipped a pool another thread held.
bool reclaim_all() noexcept;
// After reclaim_all, before refusing: waits until no other thread of the
// process is in reclaim_all (at most kReclaimWaitNs). A pool this reclaim
// skipped may be the one another thread is trimming: the driver has its
// memory back, the count not yet (it is lowered after the trim). Never
// deadlocks: a reclaim waits for a pool's mutex only while no thread that
// holds one is reclaiming, and both waits are bounded.
inline constexpr std::uint64_t kReclaimWaitNs = 2'000'000'000;
void await_other_reclaims() noexcept;

// --- the slow paths of the wrappers (pools.cc takes no lock itself) ---
// An allocation that does not fit in what is counted for its pool
// (`outstanding`, read after the count, is above it): grows the count under the pool's mutex,
// calls real_alloc(ctx) (the caller brackets it all as one counting
// operation, measure.h), settles on the
// driver's reserve and records the pointer. On failure `outstanding` is
// given back and the count is what the driver holds. A reserve the driver
// grew past the count (its growth step is its own) is reserved against the
// quota and the allowance; what does not fit is trimmed, and if it still
// does not fit the allocation is freed on `stream` and refused. A pool
// destroyed while this waited for its mutex is not grown and the driver is
// not called: *destroyed is set (the caller handles a destroyed pool).
using RealAllocFn = CUresult (*)(void* ctx) noexcept;
[[gnu::cold, gnu::noinline]] CUresult alloc_growing(PoolState& st, std::uint64_t bytes, CUdeviceptr* dptr,
                                                    CUstream stream, bool per_thread, RealAllocFn real_alloc, void* ctx,
                                                    bool* destroyed) noexcept;
// After a fast-path allocation (one that fit in `counted`): whether the
// driver's reserve is above `counted` all the same (it grows in steps, and
// where fragmentation or the reuse attributes keep freed memory from the
// allocation, of its own accord). A driver that cannot say: no.
inline bool grew_past_count(const PoolState& st) noexcept {
  cuuint64_t reserved = 0;
  return real_cuMemPoolGetAttribute != nullptr &&
         real_cuMemPoolGetAttribute(st.handle.load(std::memory_order_relaxed), CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                                    &reserved) == CUDA_SUCCESS &&
         reserved > st.counted.load(std::memory_order_seq_cst);
}
// Then, under the pool's mutex: the excess is reserved against the quota and
// the allowance, or trimmed, or the allocation (made, `bytes` in
// `outstanding`, not recorded) is freed on `stream` and refused, as
// alloc_growing's. Records the pointer when admitted.
[[gnu::cold, gnu::noinline]] CUresult settle_fast_growth(PoolState& st, std::uint64_t bytes, CUdeviceptr* dptr,
                                                         CUstream stream, bool per_thread) noexcept;
// cuMemPoolDestroy of a registered pool: a last reconciliation, the driver
// call, then the count goes now or with the pool's last allocation.
CUresult destroy(PoolState& st, CUmemoryPool pool) noexcept;
// After cuMemPoolTrimTo: reconciles now, or at the next synchronisation if
// another thread holds the pool's mutex.
void reconcile_now(PoolState& st) noexcept;
[[gnu::cold, gnu::noinline]] void record_failed() noexcept;

// --- records of live allocations: device pointer -> pool and size ---
struct PoolRecord {
  std::uint64_t bytes;
  std::uint32_t slot;
};
// Never destroyed, constant-initialised (usable from other libraries'
// constructors and during exit).
extern platform::PointerTable<PoolRecord>& g_records;
[[gnu::cold, gnu::noinline]] void settle_stale(const PoolRecord& rec) noexcept;
[[gnu::cold, gnu::noinline]] void finalize_if_drained(PoolState& st) noexcept;

inline bool record(CUdeviceptr ptr, const PoolState& st, std::uint64_t bytes) noexcept {
  const PoolRecord rec{bytes, static_cast<std::uint32_t>(&st - g_states)};
  return platform::record(g_records, ptr, rec, settle_stale);
}
// Whether `ptr` is a pool allocation of ours.
inline bool holds(CUdeviceptr ptr) noexcept {
  PoolRecord rec{};
  return g_records.find(ptr, &rec);
}
// Exactly once per record; false if `ptr` is not a pool allocation of ours.
inline bool take_record(CUdeviceptr ptr, PoolState** st, std::uint64_t* bytes) noexcept {
  PoolRecord rec{};
  if (!g_records.erase(ptr, &rec)) return false;
  *st = &g_states[rec.slot];
  *bytes = rec.bytes;
  return true;
}
// An allocation's bytes went back to its pool (the driver accepted the free).
// The pool is marked dirty *before* the subtraction, unconditionally (the
// line is written anyway): a reconciliation that sees the subtraction sees
// the mark, so an allocation and free between its reads is never missed
// (reconcile_locked).
// A free of a pool counted above its reserve reconciles it (below).
[[gnu::cold, gnu::noinline]] void reconcile_after_free(PoolState& st) noexcept;
// An untracked free (the freed-behind word, hook/memory.h) may have freed a
// pool allocation of ours that was in the driver and not yet recorded (a
// program's stale pointer at an address the allocation took): its record,
// made after, counts what the driver no longer holds. Settles the record at
// `ptr` if the driver does not know the address (at most 3 rounds against
// new allocations there, as limiter::settle_record). Run by the allocation
// once recorded, if the word moved during it, and by the untracked free
// after it (one of the two sees the other).
[[gnu::cold, gnu::noinline]] void settle_freed_behind(CUdeviceptr ptr) noexcept;
inline void freed(PoolState& st, std::uint64_t bytes) noexcept {
  st.dirty.store(1, std::memory_order_relaxed);
  st.outstanding.fetch_sub(bytes, std::memory_order_seq_cst);
  if (__builtin_expect(st.destroyed.load(std::memory_order_seq_cst) != 0, 0)) finalize_if_drained(st);
  if (__builtin_expect(st.above_reserve.load(std::memory_order_relaxed) != 0, 0)) reconcile_after_free(st);
}

}  // namespace gpuslice::hook::pools
