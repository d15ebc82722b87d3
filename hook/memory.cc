// Linear, pitched and managed allocations: reserved against the container's
// quota before the driver allocates, recorded by device pointer, returned to
// the budget exactly once at free. A free of a pointer we did not count is
// forwarded unchanged.
// gpuslice: hot path (no heap, no locks)
#include "hook/memory.h"

#include <cuda.h>

#include "hook/address_gone.h"
#include "hook/arrays.h"
#include "hook/log.h"
#include "hook/modules.h"
#include "hook/oversub.h"
#include "hook/pool_state.h"
#include "hook/wrap.h"
#include "platform/compare.h"

namespace gpuslice::hook {

namespace {
constinit NoDestroy<limiter::AllocTable> g_pointers;  // device pointer -> counted bytes

// cuMemAllocPitch's pitch is known only afterwards; reserve with the widest
// alignment the driver uses for pitched rows, then settle on the real size.
constexpr std::uint64_t kPitchAlignment = 512;

std::uint64_t pitch_estimate(std::uint64_t width, std::uint64_t height) noexcept {
  if (width > ~std::uint64_t{0} - kPitchAlignment) return ~std::uint64_t{0};
  std::uint64_t pitch = (width + kPitchAlignment - 1) / kPitchAlignment * kPitchAlignment;
  if (height != 0 && pitch > ~std::uint64_t{0} / height) return ~std::uint64_t{0};
  return pitch * height;
}
}  // namespace

limiter::AllocTable& linear_table() noexcept { return *g_pointers; }

void settle_freed_behind(std::uint64_t key) noexcept {
  limiter::settle_record(*g_pointers, key, limiter::AllocRecord{}, pointer_gone,
                         [](const limiter::AllocRecord& rec) { release_record(rec); });
}

void freed_untracked(std::uint64_t key) noexcept {
  note_freed_untracked();
  settle_freed_behind(key);
  // A pool allocation of ours at the address, recorded after this free
  // took it in the driver (pool_state.h, settle_freed_behind).
  if (pools::g_slots_used.load(std::memory_order_relaxed) != 0) pools::settle_freed_behind(key);
}

void sweep_implicitly_freed() noexcept {
  sweep_implicitly_freed_arrays();
  sweep_implicitly_unloaded_modules();
  if (real_cuMemGetAddressRange_v2 == nullptr) return;
  sweep_table(*g_pointers, pointer_gone);
}

bool pointer_gone(std::uint64_t key, const limiter::AllocRecord&) noexcept {
  return (pools::g_slots_used.load(std::memory_order_relaxed) != 0 && pools::holds(key)) || address_gone(key);
}

void release_stale_linear(std::uint64_t key) noexcept {
  limiter::AllocRecord rec{};
  if (g_pointers->erase(key, &rec)) release_record(rec);
}

void take_address_uncounted(std::uint64_t key) noexcept {
  if (!platform::record(*g_pointers, key, limiter::AllocRecord{0, -1, limiter::AllocKind::linear},
                        [](const limiter::AllocRecord& rec) noexcept { release_record(rec); }))
    release_stale_linear(key);  // no room for a record: at least the stale one goes
}

}  // namespace gpuslice::hook

using namespace gpuslice::hook;
using gpuslice::limiter::AllocKind;
using gpuslice::limiter::AllocRecord;

namespace {
// Spill: managed memory that prefers to live on the host; the device pages it
// in on access (docs/memory.md).
CUresult spill_managed(CUdeviceptr* dptr, std::uint64_t bytes, unsigned flags = CU_MEM_ATTACH_GLOBAL) noexcept {
  CUresult rc = real_cuMemAllocManaged(dptr, bytes, flags);
  if (rc == CUDA_SUCCESS && real_cuMemAdvise_v2 != nullptr) {
    CUmemLocation host{};
    host.type = CU_MEM_LOCATION_TYPE_HOST;
    real_cuMemAdvise_v2(*dptr, bytes, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host);  // advice only
  }
  return rc;
}

// cuMemFree of a stream-ordered allocation of ours (false, *rc untouched,
// for any other pointer): its pool's record is taken before the driver call
// (an address the driver hands out again at once, to another thread, is
// never confused with this one) and settled after it.
bool free_if_pool(CUdeviceptr dptr, CUresult* rc) noexcept {
  pools::PoolState* st = nullptr;
  std::uint64_t bytes = 0;
  if (!pools::take_record(dptr, &st, &bytes)) return false;
  const std::uint64_t mark = freed_behind_mark();
  CountingOp op;               // the last free of a destroyed pool frees the pool
  release_stale_linear(dptr);  // while the allocation still holds the address
  pools::mark_dirty(*st);      // before the driver call, as free_pool_pointer (hook/pools.cc)
  *rc = real_cuMemFree_v2(dptr);
  if (*rc == CUDA_SUCCESS) {
    pools::freed(*st, bytes);
    if (g_freed_behind.load(std::memory_order_relaxed) != mark) freed_untracked(dptr);  // as free_pool_pointer
  } else {
    pools::record(dptr, *st, bytes);  // the driver refused: the allocation is still live
    // unless an untracked free took it meanwhile (as free_pool_pointer)
    if (g_freed_behind.load(std::memory_order_relaxed) != mark) pools::settle_freed_behind(dptr);
  }
  return true;
}

struct LinearAlloc {
  CUdeviceptr* dptr;
  std::uint64_t bytes;
};

struct ManagedAlloc {
  CUdeviceptr* dptr;
  std::uint64_t bytes;
  unsigned flags;
};
}  // namespace

namespace {
// The allocation pair's fast word (hook/lifecycle.h, OwnerPage::fast): set
// once the whole way found what it vouches for, which then stays true in
// this process. g_fast_never: something that never changes in a process
// (several devices, oversubscription, counting in the shared word) rules it
// out, so the whole way stops asking (a forked child inherits both).
std::atomic<bool> g_fast_never{false};

// A shard of a table became stuck (include/platform/pointer_table.h), or
// the region file was lost (region.cc): the fast way no longer vouches for
// it; the whole way refuses (until the table grows again, and arms the word
// again after) or fails closed.
void disarm_fast_path() noexcept { owner_page().fast.store(0, std::memory_order_seq_cst); }

[[gnu::cold, gnu::noinline]] void arm_fast_path() noexcept {
  OwnerPage& page = owner_page();
  if (page.slot.load(std::memory_order_acquire) == nullptr) return;  // not claimed, a child, the fallback page
  if (page.owner.load(std::memory_order_acquire) != kSlotOurs) return;
  if (g_ready.load(std::memory_order_acquire) != kReadyYes) return;
  const int entry = g_single_entry.load(std::memory_order_relaxed);
  const int counting = g_counting_state.load(std::memory_order_relaxed);
  const int oversub = g_oversub_state.load(std::memory_order_relaxed);
  if (entry == kSeveralDevices || counting == 3 || oversub == 2) {
    g_fast_never.store(true, std::memory_order_relaxed);
    return;
  }
  if (entry < 0 || static_cast<unsigned>(entry) >= gpuslice::kMaxDevices || counting == 0 || oversub != 1)
    return;  // not yet
  if (gpuslice::platform::table_detail::g_stuck_shards.load(std::memory_order_seq_cst) != 0) return;
  gpuslice::platform::table_detail::set_on_stuck(disarm_fast_path);
  set_on_region_lost(disarm_fast_path);
  g_pointers->enter_process();
  page.epoch.store(gpuslice::platform::table_detail::process_epoch(), std::memory_order_relaxed);
  page.lease.store(&page.slot.load(std::memory_order_relaxed)->lease[entry], std::memory_order_relaxed);
  page.committed.store(&page.slot.load(std::memory_order_relaxed)->committed_bytes[entry], std::memory_order_relaxed);
  page.waiting.store(&g_process.region->devices[entry].oversub_waiting, std::memory_order_relaxed);
  page.entry.store(entry, std::memory_order_relaxed);
  // The region lost meanwhile or a table stuck (disarm_fast_path runs after
  // g_ready or g_stuck_shards said so): a word set after that is taken back.
  page.fast.store(kFastArmed | (counting == 2 ? kFastCounting : 0) | static_cast<std::uint32_t>(entry),
                  std::memory_order_seq_cst);
  if (g_ready.load(std::memory_order_seq_cst) != kReadyYes ||
      gpuslice::platform::table_detail::g_stuck_shards.load(std::memory_order_seq_cst) != 0)
    page.fast.store(0, std::memory_order_seq_cst);
}
[[gnu::cold, gnu::noinline]] void settle_freed_behind_at(const CUdeviceptr* dptr) noexcept {
  settle_freed_behind(*dptr);
}

// cuMemAlloc_v2's fast way after the driver call: the driver refused (the
// reservation goes back), or the record could not be inserted (commit_slow
// decides; the allocation stands). The record by value: the caller keeps
// no address of it across the insert.
[[gnu::cold, gnu::noinline]] CUresult alloc_refused(CUresult rc, AllocRecord rec) noexcept {
  commit_slow(*g_pointers, rc, Reservation{rec.dev, rec.bytes}, 0, AllocKind::linear);
  return rc;
}
[[gnu::cold, gnu::noinline]] CUresult alloc_unrecorded(const CUdeviceptr* dptr, AllocRecord rec,
                                                       std::uint64_t mark) noexcept {
  commit_slow(*g_pointers, CUDA_SUCCESS, Reservation{rec.dev, rec.bytes}, *dptr, AllocKind::linear);
  recheck_freed_behind(mark, *dptr);
  return CUDA_SUCCESS;
}

// cuMemFree_v2's fast way, the driver refused the free: the table's address
// taken here, not kept across the driver call.
[[gnu::cold, gnu::noinline]] CUresult free_refused_linear(CUdeviceptr dptr, AllocRecord rec, CUresult rc) noexcept {
  free_refused(*g_pointers, dptr, rec, pointer_gone);
  return rc;
}

// CUDA_SUCCESS, as a value GCC cannot see equal to the driver's result that
// was tested for it (else the pair's wrappers keep that result in a saved
// register across every call to the return).
inline CUresult opaque_success() noexcept {
  CUresult success = CUDA_SUCCESS;
  asm("" : "+r"(success));
  return success;
}

// cuMemFree_v2's fast way, no record of the pointer (out of line: its
// calls share no code with the common path's).
[[gnu::cold, gnu::noinline]] CUresult free_unrecorded(CUdeviceptr dptr, std::uint64_t mark) noexcept {
  const CUresult untracked = real_cuMemFree_v2(dptr);
  if (untracked == CUDA_SUCCESS) {  // as the whole way: its untracked free, then its after
    freed_untracked(dptr);
    if (g_freed_behind.load(std::memory_order_relaxed) != mark) freed_untracked(dptr);
  }
  return untracked;
}

inline void maybe_arm_fast_path() noexcept {
  if (__builtin_expect(!g_fast_never.load(std::memory_order_relaxed), 1)) arm_fast_path();
}

[[gnu::noinline]] CUresult alloc_whole(CUdeviceptr* dptr, size_t bytesize) noexcept;
[[gnu::noinline]] CUresult free_whole(CUdeviceptr dptr) noexcept;

}  // namespace

// The fast way (the fast word set): what the whole way (alloc_whole) does,
// less what the word vouches for. A reservation the lease word does not
// give goes to ensure_ready (the region lost: its error, as the whole way
// returns it), then to the whole protocol.
GPUSLICE_EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) {
  const OwnerPage& page = owner_page();
  const std::uint32_t fast = page.fast.load(std::memory_order_acquire);
  if (__builtin_expect(fast == 0, 0)) return alloc_whole(dptr, bytesize);
  CountingOp op(CountingOp::Known{(fast & kFastCounting) != 0}, page.epoch.load(std::memory_order_relaxed));
  // The record made first: kept in memory across the region look's clock
  // call and the driver call, not in registers the frame would save (the
  // bytes and the entry read from it where they are used).
  AllocRecord rec{bytesize, static_cast<int>(fast & kFastEntryMask), AllocKind::linear};
  asm volatile("" : "+m"(rec));
  if (__builtin_expect(!reserve_armed(rec), 0)) {
    if (const CUresult rc = ensure_ready(); rc != CUDA_SUCCESS) return rc;
    if (!reserve_out_of_line(rec.dev, rec.bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const std::uint64_t mark = freed_behind_mark();
  const CUresult rc = real_cuMemAlloc_v2(dptr, rec.bytes);
  // Each path but the common one in a call whose result is returned as it
  // is: from here on the result is CUDA_SUCCESS, a constant, and neither rc
  // nor the table's address is kept across a call (registers the frame
  // would save).
  if (__builtin_expect(rc != CUDA_SUCCESS, 0)) return alloc_refused(rc, rec);
  if (__builtin_expect(!g_pointers->insert_entered(*dptr, rec), 0)) return alloc_unrecorded(dptr, rec, mark);
  // (The pointer read in the cold call: not loaded again on the common path.)
  if (__builtin_expect(!gpuslice::platform::relaxed_equals(g_freed_behind, mark), 0)) settle_freed_behind_at(dptr);
  return opaque_success();
}

namespace {
// cuMemFree_v2's fast way past the pool check (the fast word set).
[[gnu::always_inline]] inline CUresult free_armed(CUdeviceptr dptr, std::uint32_t fast,
                                                  const OwnerPage& page) noexcept {
  const std::uint64_t mark = freed_behind_mark();
  CountingOp op(CountingOp::Known{(fast & kFastCounting) != 0}, page.epoch.load(std::memory_order_relaxed));
  AllocRecord rec;  // read only once erase_entered() copied the record into it
  if (__builtin_expect(!g_pointers->erase_entered(dptr, &rec), 0)) return free_unrecorded(dptr, mark);
  const CUresult rc = real_cuMemFree_v2(dptr);
  if (__builtin_expect(rc != CUDA_SUCCESS, 0)) return free_refused_linear(dptr, rec, rc);
  release_record_armed(rec);
  if (__builtin_expect(!gpuslice::platform::relaxed_equals(g_freed_behind, mark), 0)) freed_untracked(dptr);
  return opaque_success();
}

// Pools in use: a stream-ordered allocation of ours is freed as such, any
// other pointer the fast way (the word read again: the call above may have
// run long). Out of line, so that the common path keeps no value across
// the pool check's call.
[[gnu::cold, gnu::noinline]] CUresult free_beside_pools(CUdeviceptr dptr) noexcept {
  CUresult pool_rc = CUDA_SUCCESS;
  if (free_if_pool(dptr, &pool_rc)) return pool_rc;
  const OwnerPage& page = owner_page();
  const std::uint32_t fast = page.fast.load(std::memory_order_acquire);
  if (__builtin_expect(fast == 0, 0)) return free_whole(dptr);
  return free_armed(dptr, fast, page);
}
}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
  // The region lost (g_ready failed) sets the word to 0 (region.cc): the
  // whole way's error, before the driver.
  const OwnerPage& page = owner_page();
  const std::uint32_t fast = page.fast.load(std::memory_order_acquire);
  if (__builtin_expect(fast == 0, 0)) return free_whole(dptr);
  if (__builtin_expect(!gpuslice::platform::relaxed_equals(pools::g_slots_used, 0), 0)) return free_beside_pools(dptr);
  return free_armed(dptr, fast, page);
}

namespace {
CUresult alloc_whole(CUdeviceptr* dptr, size_t bytesize) noexcept {
  CountingOp op;
  Reservation r;
  CUresult rc = reserve_on_current(bytesize, &r);
  if (rc != CUDA_SUCCESS) return rc;
  const std::uint64_t mark = freed_behind_mark();
  if (__builtin_expect(oversubscribing(), 0) && dptr != nullptr) {
    LinearAlloc a{dptr, bytesize};
    std::uint64_t* key = reinterpret_cast<std::uint64_t*>(dptr);
    const Reservation held = r;  // a copy by reference: r itself stays in registers on the common path
    rc = alloc_oversubscribed(
        *g_pointers, held, key, AllocKind::linear,
        [](void* c) noexcept {
          auto* p = static_cast<LinearAlloc*>(c);
          return real_cuMemAlloc_v2(p->dptr, p->bytes);
        },
        [](void* c) noexcept {
          auto* p = static_cast<LinearAlloc*>(c);
          return spill_managed(p->dptr, p->bytes);
        },
        &a);
    if (rc == CUDA_SUCCESS) recheck_freed_behind(mark, *dptr);
    return rc;
  }
  rc = real_cuMemAlloc_v2(dptr, bytesize);
  commit(*g_pointers, rc, r, rc == CUDA_SUCCESS ? *dptr : 0, AllocKind::linear);
  if (rc == CUDA_SUCCESS) recheck_freed_behind(mark, *dptr);
  maybe_arm_fast_path();
  return rc;
}
}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr* dptr, size_t bytesize, unsigned int flags) {
  CountingOp op;
  // Counted in full on the current device: every page may become resident
  // there, and the driver does not tell us when it does (docs/memory.md).
  Reservation r;
  CUresult rc = reserve_on_current(bytesize, &r);
  if (rc != CUDA_SUCCESS) return rc;
  // Under the device-resident allowance managed memory is resident memory
  // like cuMemAlloc's: admitted within it, beyond it the policy's (refused,
  // served advised to the host and counted as spilled, or waited for).
  // Arguments the driver refuses go to it unchanged, whatever the policy.
  const std::uint64_t mark = freed_behind_mark();
  if (__builtin_expect(oversubscribing(), 0) && dptr != nullptr && bytesize != 0 &&
      (flags == CU_MEM_ATTACH_GLOBAL || flags == CU_MEM_ATTACH_HOST)) {
    ManagedAlloc a{dptr, bytesize, flags};
    rc = alloc_oversubscribed(
        *g_pointers, r, reinterpret_cast<std::uint64_t*>(dptr), AllocKind::managed,
        [](void* c) noexcept {
          auto* p = static_cast<ManagedAlloc*>(c);
          return real_cuMemAllocManaged(p->dptr, p->bytes, p->flags);
        },
        [](void* c) noexcept {
          auto* p = static_cast<ManagedAlloc*>(c);
          return spill_managed(p->dptr, p->bytes, p->flags);
        },
        &a);
    if (rc == CUDA_SUCCESS) recheck_freed_behind(mark, *dptr);
    return rc;
  }
  rc = real_cuMemAllocManaged(dptr, bytesize, flags);
  commit(*g_pointers, rc, r, rc == CUDA_SUCCESS ? *dptr : 0, AllocKind::managed);
  if (rc == CUDA_SUCCESS) recheck_freed_behind(mark, *dptr);
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pPitch, size_t WidthInBytes,
                                                    size_t Height, unsigned int ElementSizeBytes) {
  CountingOp op;
  Reservation r;
  CUresult rc = reserve_on_current(pitch_estimate(WidthInBytes, Height), &r);
  if (rc != CUDA_SUCCESS) return rc;
  const std::uint64_t mark = freed_behind_mark();
  if (__builtin_expect(oversubscribing(), 0) && dptr != nullptr && pPitch != nullptr && Height != 0) {
    // Counted at the 512-byte-aligned estimate (at most 511 bytes a row above
    // the driver's pitch); spilled rows use that pitch.
    struct PitchAlloc {
      CUdeviceptr* dptr;
      size_t* pitch;
      size_t width, height;
      unsigned elem;
      std::uint64_t bytes;
    } a{dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, r.bytes};
    rc = alloc_oversubscribed(
        *g_pointers, r, reinterpret_cast<std::uint64_t*>(dptr), AllocKind::pitch,
        [](void* c) noexcept {
          auto* p = static_cast<PitchAlloc*>(c);
          return real_cuMemAllocPitch_v2(p->dptr, p->pitch, p->width, p->height, p->elem);
        },
        [](void* c) noexcept {
          auto* p = static_cast<PitchAlloc*>(c);
          const CUresult rc = spill_managed(p->dptr, p->bytes);
          if (rc == CUDA_SUCCESS) *p->pitch = static_cast<size_t>(p->bytes / p->height);
          return rc;
        },
        &a);
    if (rc == CUDA_SUCCESS) recheck_freed_behind(mark, *dptr);
    return rc;
  }
  rc = real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
  if (rc == CUDA_SUCCESS) {
    // Settle on what the driver really holds: the pitch it returned times the rows.
    const std::uint64_t actual = static_cast<std::uint64_t>(*pPitch) * Height;
    if (actual < r.bytes) {
      release(r.entry, r.bytes - actual);
      r.bytes = actual;
    } else if (actual > r.bytes) {
      if (!reserve(r.entry, actual - r.bytes)) {
        real_cuMemFree_v2(*dptr);
        release(r.entry, r.bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
      }
      r.bytes = actual;
    }
  }
  commit(*g_pointers, rc, r, rc == CUDA_SUCCESS ? *dptr : 0, AllocKind::pitch);
  if (rc == CUDA_SUCCESS) recheck_freed_behind(mark, *dptr);
  return rc;
}

namespace {
CUresult free_whole(CUdeviceptr dptr) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  maybe_arm_fast_path();
  // A pool allocation of ours first: a record of the linear table at its
  // address is stale (release_stale_linear), never what this frees.
  if (pools::g_slots_used.load(std::memory_order_relaxed) != 0 && free_if_pool(dptr, &rc)) return rc;
  // A record taken before a reset began, freed in the driver after it ended:
  // the address may be another thread's allocation by then (hook/memory.h).
  const std::uint64_t mark = freed_behind_mark();
  return free_counted(
      *g_pointers, dptr, [&] { return real_cuMemFree_v2(dptr); },
      [&] {
        const CUresult untracked = real_cuMemFree_v2(dptr);
        if (untracked == CUDA_SUCCESS) freed_untracked(dptr);
        return untracked;
      },
      pointer_gone,
      [&] {
        if (__builtin_expect(g_freed_behind.load(std::memory_order_relaxed) != mark, 0)) freed_untracked(dptr);
      });
}
}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuMemAlloc(CUdeviceptr_v1*, unsigned int) { return refuse_legacy("cuMemAlloc"); }

GPUSLICE_EXPORT CUresult CUDAAPI cuMemAllocPitch(CUdeviceptr_v1*, unsigned int*, unsigned int, unsigned int,
                                                 unsigned int) {
  return refuse_legacy("cuMemAllocPitch");
}
