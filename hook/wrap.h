// Shared pieces of the accounting wrappers: the export attribute, the free
// path every counted free follows, and what a wrapper needs besides: the
// reserve-before / commit-or-undo-after protocol of every allocation
// (hook/account.h), the counting operation around every call that can change
// the process's device memory (hook/measure.h), bootstrap and the region.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "hook/account.h"
#include "hook/bootstrap.h"
#include "hook/config.h"
#include "hook/log.h"
#include "hook/measure.h"
#include "hook/no_destroy.h"
#include "hook/real.h"
#include "hook/region.h"
#include "limiter/alloc_table.h"

#define GPUSLICE_EXPORT extern "C" [[gnu::visibility("default")]]

namespace gpuslice::hook {

// Free path: forget `key` (exactly once), run the real free, then return the
// bytes to the budget. A key the table does not hold is freed by `untracked`
// instead. If the driver refused, the record goes back, unless the object it
// describes is gone: gone(key, record) says the driver no longer knows the
// key (the memory went with a context destroyed or reset meanwhile, whose
// sweep ran while the record was out of the table and never sees it again),
// or the key is held again by a newer record (the driver handed it out
// again: the stale-record rule, platform::record). Both release it.
// The driver refused the free: the record goes back unless its object is
// gone (free_counted, below). "Known" may be another thread's allocation at
// the address, freed again before the record went back (issue 32): so once
// back, the record is settled as the sweep settles one it put back
// (limiter::settle_record: asked again, released if gone). Out of line: the
// common path keeps nothing of the table across the driver call.
template <class Gone>
[[gnu::cold, gnu::noinline]] void free_refused(limiter::AllocTable& table, std::uint64_t key,
                                               const limiter::AllocRecord& rec, Gone& gone) noexcept {
  if (gone(key, rec) || !table.insert(key, rec)) return release_record(rec);
  limiter::settle_record(table, key, rec, gone, [](const limiter::AllocRecord& r) { release_record(r); });
}

// `after` runs once the driver freed it (rc CUDA_SUCCESS), still inside the
// counting operation: the common path then ends in one place.
template <class RealFree, class Untracked, class Gone, class After>
CUresult free_counted(limiter::AllocTable& table, std::uint64_t key, RealFree&& real_free, Untracked&& untracked,
                      Gone&& gone, After&& after) noexcept {
  CountingOp op;
  limiter::AllocRecord rec;  // read only once erase() copied the record into it
  if (!table.erase(key, &rec)) {
    const CUresult rc = untracked();
    if (rc == CUDA_SUCCESS) after();
    return rc;
  }
  const CUresult rc = real_free();
  if (__builtin_expect(rc == CUDA_SUCCESS, 1)) {
    release_record(rec);
    after();
  } else {
    free_refused(table, key, rec, gone);
  }
  return rc;
}
template <class RealFree, class Untracked, class Gone>
CUresult free_counted(limiter::AllocTable& table, std::uint64_t key, RealFree&& real_free, Untracked&& untracked,
                      Gone&& gone) noexcept {
  return free_counted(table, key, real_free, untracked, gone, [] {});
}
template <class RealFree, class Gone>
CUresult free_counted(limiter::AllocTable& table, std::uint64_t key, RealFree&& real_free, Gone&& gone) noexcept {
  return free_counted(table, key, real_free, real_free, gone);
}

// Legacy 32-bit entry points that would let memory bypass the quota.
[[gnu::cold, gnu::noinline]] inline CUresult refuse_legacy(const char* symbol) noexcept {
  GPUSLICE_WARN_CAPPED(5,
                       "%s (the pre-CUDA-3.2 32-bit ABI) is refused with CUDA_ERROR_NOT_SUPPORTED: "
                       "it would bypass the memory quota; rebuild against a current cuda.h",
                       symbol);
  return CUDA_ERROR_NOT_SUPPORTED;
}

}  // namespace gpuslice::hook
