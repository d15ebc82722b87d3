// The accounting core (account.cc): what an allocation reserves against the
// container's quota before the driver call, what a free gives back, the
// records that tie one to the other.
// Every counted byte of the preload library goes through reserve(),
// release() or charge() (limiter's cross-process protocol on this process's
// slot); the wrappers (memory.cc, arrays.cc, vmm.cc, pools.cc, ...) only say
// how many bytes and under which key.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"
#include "hook/bootstrap.h"
#include "hook/process.h"
#include "hook/region.h"
#include "limiter/alloc_table.h"
#include "limiter/lease.h"
#include "platform/compare.h"

namespace gpuslice::hook {

// Reserve/release `bytes` on a device entry for this process (limiter's
// cross-process protocol). reserve() tries the slow reclaim paths (dead
// processes, idle pool reserves) before refusing.
// Inline fast halves (below): the slot is ours (the owner page's slot: not a
// child that has yet to claim its own, hook/lifecycle.h), the region file
// intact, and one CAS on the slot's lease word (limiter/lease.h) moves the
// bytes between spare and in use. Anything else, and every refusal, goes to the whole of the protocol
// out of line (account.cc), which checks everything again.
[[gnu::noinline]] bool reserve_out_of_line(int entry, std::uint64_t bytes) noexcept;
[[gnu::noinline]] void release_out_of_line(int entry, std::uint64_t bytes) noexcept;
inline bool reserve(int entry, std::uint64_t bytes) noexcept;
inline bool release_fast(int entry, std::uint64_t bytes) noexcept;  // false: nothing was released
inline void release(int entry, std::uint64_t bytes) noexcept;
bool charge(int entry, std::uint64_t bytes) noexcept;

// Hooks that run before an allocation is refused (pools.cc registers one that
// trims this process's idle pool reserves back into the budget).
using ReclaimFn = void (*)() noexcept;
void set_pool_reclaim(ReclaimFn fn) noexcept;

// When a thread ends (a pthread key) it runs the one function set here (the
// launch path's: it gives back its credit of prices taken ahead).
// arm_thread_exit() arms that for the calling thread, once; false when no key
// could be made or set (nothing is then run).
using ThreadExitFn = void (*)() noexcept;
void set_thread_exit(ThreadExitFn fn) noexcept;
bool arm_thread_exit() noexcept;

struct Reservation {
  int entry = -1;
  std::uint64_t bytes = 0;
};

// Reserve `bytes` on the current context's device before the real call.
// Returns the error to hand back unchanged: bootstrap failure, no current
// context (the driver's own error), or CUDA_ERROR_OUT_OF_MEMORY over quota.
// Inline (as it was beside the wrappers of memory.cc): an allocation makes
// one call, reserve(), not two.
// (The driver's error only on the slow path: a local there, so that the
// inline caller keeps nothing of it in memory.)
inline CUresult reserve_on_current(std::uint64_t bytes, Reservation* r) noexcept {
  if (const CUresult rc = ensure_ready(); rc != CUDA_SUCCESS) return rc;
  int entry = g_single_entry.load(std::memory_order_relaxed);  // current_device_entry's fast half
  if (__builtin_expect(entry < 0, 0)) {
    CUresult rc = CUDA_SUCCESS;
    entry = current_device_entry_slow(&rc);
    if (entry < 0) return rc;
  }
  if (!reserve(entry, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  r->entry = entry;
  r->bytes = bytes;
  return CUDA_SUCCESS;
}
// Same on an explicit device ordinal.
inline CUresult reserve_on_ordinal(CUdevice ordinal, std::uint64_t bytes, Reservation* r) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  int entry = device_entry(ordinal);
  if (entry < 0) return CUDA_ERROR_INVALID_DEVICE;
  if (!reserve(entry, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  r->entry = entry;
  r->bytes = bytes;
  return CUDA_SUCCESS;
}

// After the real allocation: on failure the reservation is returned; on
// success it is recorded under `key` in `table` (a stale record for the same
// key, from a free we never saw, is released first). Inline: a success whose
// key the table does not hold is one insert; anything else (a failure, a
// stale record, a full table) is commit_slow()'s, out of line.
// (The reservation by value: in registers, so that the inline caller's stays
// out of memory.)
[[gnu::noinline]] void commit_slow(limiter::AllocTable& table, CUresult rc, Reservation r, std::uint64_t key,
                                   limiter::AllocKind kind) noexcept;
inline void commit(limiter::AllocTable& table, CUresult rc, const Reservation& r, std::uint64_t key,
                   limiter::AllocKind kind) noexcept {
  if (__builtin_expect(rc == CUDA_SUCCESS, 1) && table.insert(key, limiter::AllocRecord{r.bytes, r.entry, kind}))
    return;
  commit_slow(table, rc, r, key, kind);
}

// Counted memory went back to the driver and its bytes to the budget:
// allocations of the container waiting for memory (hook/oversub.h, "wait")
// are woken. Inline: every free pays one load of the device's waiter count
// (seq_cst: a plain load on x86; the waiter's seq_cst increment pairs with it).
[[gnu::cold, gnu::noinline]] void wake_oversub_waiters(int entry) noexcept;
inline void oversub_freed(int entry, limiter::AllocKind, std::uint64_t) noexcept {
  if (entry < 0 || static_cast<unsigned>(entry) >= kMaxDevices || g_process.region == nullptr) return;
  if (g_process.region->devices[entry].oversub_waiting.load(std::memory_order_seq_cst) != 0)
    wake_oversub_waiters(entry);
}
// Spilled memory went back to the driver: its bytes stop counting as spilled
// (before they leave the budget, so resident memory is never understated).
void oversub_unspill(int entry, std::uint64_t bytes) noexcept;

// A table of records that could not grow (platform::table_detail::g_stuck_shards)
// sends every reservation out of line, where it is refused unless the table
// grows again (issue 35: never admitted without a record).
inline bool reserve(int entry, std::uint64_t bytes) noexcept {
  if (__builtin_expect(platform::table_detail::g_stuck_shards.load(std::memory_order_relaxed) == 0, 1)) {
    // The slot, if ours: one load for owner word and index (lifecycle.h).
    Slot* const slot = owner_page().slot.load(std::memory_order_acquire);
    if (__builtin_expect(slot != nullptr && static_cast<unsigned>(entry) < kMaxDevices, 1) && region_intact() &&
        limiter::lease_alloc(*slot, g_process.lease_tag.load(std::memory_order_relaxed), entry, bytes))
      return true;
  }
  return reserve_out_of_line(entry, bytes);
}

inline bool release_fast(int entry, std::uint64_t bytes) noexcept {
  Slot* const slot = owner_page().slot.load(std::memory_order_acquire);
  // Separate tests (not one && of three): each a compare and a branch.
  if (__builtin_expect(slot == nullptr, 0)) return false;
  if (__builtin_expect(static_cast<unsigned>(entry) >= kMaxDevices, 0)) return false;
  if (__builtin_expect(bytes == 0, 0)) return false;
  return region_intact() &&
         limiter::lease_free(*slot, g_process.lease_tag.load(std::memory_order_relaxed), entry, bytes);
}

// The allocation pair's fast path (hook/memory.cc), with the owner page's
// fast word set (hook/lifecycle.h): the slot is ours and non-null, the entry
// a device's, no table stuck (a stuck shard sets the word to 0). The lease
// word's one CAS when the region file is intact; false sends the caller the
// whole way (ensure_ready, then reserve_out_of_line).
// The region looked at first; the lease's address (the entry's, stored
// before the fast word) and the record's bytes read after its clock call:
// `rec` is the caller's, in memory, so nothing is kept in a register across
// that call that the caller's frame would save.
inline bool reserve_armed(const limiter::AllocRecord& rec) noexcept {
  if (__builtin_expect(!region_intact(), 0)) return false;
  Slot::Lease* const lease = owner_page().lease.load(std::memory_order_relaxed);
  return limiter::lease_alloc(*lease, g_process.lease_tag.load(std::memory_order_relaxed), rec.bytes);
}

inline void release(int entry, std::uint64_t bytes) noexcept {
  if (!release_fast(entry, bytes)) release_out_of_line(entry, bytes);
}

// A counted record whose memory the driver has let go: its bytes go back to
// the budget (spilled ones stop counting as spilled first; waiters are woken).
// Inline, the common case: not spilled, and release_fast() took the bytes
// back (so the entry is a device's and the region mapped); then the one load
// of the device's waiter count. Anything else: release_record_slow().
[[gnu::noinline]] void release_record_slow(const limiter::AllocRecord& rec) noexcept;
inline void release_record(const limiter::AllocRecord& rec) noexcept {
  if (__builtin_expect(rec.kind != limiter::AllocKind::spilled && release_fast(rec.dev, rec.bytes), 1)) {
    if (g_process.region->devices[rec.dev].oversub_waiting.load(std::memory_order_seq_cst) != 0)
      wake_oversub_waiters(rec.dev);
    return;
  }
  release_record_slow(rec);
}

// release_record() on the allocation pair's fast path (hook/memory.cc), the
// owner page's fast word set: the slot known non-null. The region file is
// looked at first and the record read after its clock call (`rec` is the
// caller's copy, in memory): nothing of it is then kept in a register
// across that call, which the caller's frame would save. A record of 0
// bytes on a device's entry moves the lease word by 0. Anything else, as
// release_record(): release_record_slow().
// A record of the word's entry (any record of a process with one device
// but an uncounted one, entry -1) takes the entry's lease, committed bytes
// and waiter count from the page; any other goes the slow way. (The page's
// entry is stored with them, before the word, and stays when the word is
// set to 0 since: the four always agree.)
inline void release_record_armed(limiter::AllocRecord& rec) noexcept {
  if (__builtin_expect(region_intact(), 1)) {
    asm volatile("" : "+m"(rec));
    const OwnerPage& page = owner_page();
    // (No test of a spilled record: the word is set only with
    // oversubscription off, which stays so for the process, hook/config.h,
    // and only oversubscription makes them, hook/oversub.cc.)
    if (__builtin_expect(rec.dev == page.entry.load(std::memory_order_relaxed), 1)) {
      Slot::Lease& lease = *page.lease.load(std::memory_order_relaxed);
      const std::uint64_t cap = lease.cap_bytes.load(std::memory_order_relaxed);
      const std::uint64_t committed = page.committed.load(std::memory_order_relaxed)->load(std::memory_order_relaxed);
      if (__builtin_expect(limiter::lease_free(lease, cap < committed ? cap : committed,
                                               g_process.lease_tag.load(std::memory_order_relaxed), rec.bytes),
                           1)) {
        if (__builtin_expect(!platform::seq_cst_equals(*page.waiting.load(std::memory_order_relaxed), 0), 0))
          wake_oversub_waiters(rec.dev);
        return;
      }
    }
  }
  release_record_slow(rec);
}

// After the driver freed memory implicitly: releases every record of `table`
// for which gone(key, record) says the driver no longer knows the handle
// (limiter::sweep_records has the races it settles).
template <class Gone>
void sweep_table(limiter::AllocTable& table, Gone&& gone) noexcept {
  limiter::sweep_records(table, gone, [](const limiter::AllocRecord& rec) { release_record(rec); });
}

}  // namespace gpuslice::hook
