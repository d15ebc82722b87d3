// Linear, pitched and managed allocations (memory.cc): their table, which
// cuMemFreeAsync (pools.cc) frees from too, and the sweep after the driver
// freed memory implicitly.
#pragma once

#include <atomic>
#include <cstdint>

#include "hook/freed_behind.h"
#include "limiter/alloc_table.h"

namespace gpuslice::hook {

// The table of linear/pitched/managed allocations: cuMemFreeAsync frees
// those too.
limiter::AllocTable& linear_table() noexcept;
// After the driver freed memory implicitly (context destroyed, primary context
// reset or released for the last time): release every counted allocation the
// driver no longer knows (arrays included: hook/arrays.h).
void sweep_implicitly_freed() noexcept;
// Whether the driver no longer knows the allocation at `key` (a counted
// pointer): "no such allocation". Any other answer (no current context, ...)
// says nothing: the count is kept. For free_counted (hook/wrap.h) and the sweep.
// A pool allocation of ours holding `key` makes a record of this table at
// `key` stale too (the driver handed the address out again after the memory
// went with a context: between the tables what platform::record's
// stale-record rule is within one).
bool pointer_gone(std::uint64_t key, const limiter::AllocRecord& = {}) noexcept;
// Before a pool allocation of ours at `key` is freed (the address still
// its): a record of this table at `key` is stale, released (issue 32).
void release_stale_linear(std::uint64_t key) noexcept;
// An object with no memory of its own took `key` from the driver (a buffer
// mapped onto imported memory): a record of 0 bytes takes the key, settling a
// stale record there as an allocation's record does (platform::record), so a
// sweep holding the stale one out meanwhile releases it rather than put it
// back (limiter::settle_record). cuMemFree of the object takes it, releasing 0.
void take_address_uncounted(std::uint64_t key) noexcept;

// The linear table's use of the freed-behind word (hook/freed_behind.h):
// an allocation whose word moved settles its address.
[[gnu::cold, gnu::noinline]] void settle_freed_behind(std::uint64_t key) noexcept;
// After the record of `key` (an allocation that succeeded) was made.
inline void recheck_freed_behind(std::uint64_t mark, std::uint64_t key) noexcept {
  if (__builtin_expect(g_freed_behind.load(std::memory_order_relaxed) != mark, 0)) settle_freed_behind(key);
}
// A free the linear table had no record of went through the driver: it may
// have freed an allocation whose record was not made yet.
[[gnu::cold, gnu::noinline]] void freed_untracked(std::uint64_t key) noexcept;

}  // namespace gpuslice::hook
