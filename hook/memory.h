// Linear, pitched and managed allocations (memory.cc): their table, which
// cuMemFreeAsync (pools.cc) frees from too, and the sweep after the driver
// freed memory implicitly.
#pragma once

#include <atomic>
#include <cstdint>

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

// Device memory freed behind a record (docs/memory-accounting.md, "Frees
// behind a record"): the driver may free, or hand out again, an address a
// record of the linear table is about to be made for, when a program frees a
// pointer its primary-context reset or context destroy already freed. This
// word changes at each such chance: +1 when a reset or destroy begins (the
// low 16 bits: how many are in progress), +kFreedBehindEvent - 1 when it
// ended (its sweep done), +kFreedBehindEvent after a free the table had no
// record of went through. An allocation reads it before its driver call
// (freed_behind_mark) and after its record is made; if it changed, it asks
// the driver whether its address is still held (settle_freed_behind). The
// table's shard lock orders the record against the change: a free that
// changed it after the allocation read it again finds the record instead.
[[gnu::visibility("hidden")]] extern std::atomic<std::uint64_t> g_freed_behind;
inline constexpr std::uint64_t kFreedBehindEvent = std::uint64_t{1} << 16;
inline std::uint64_t freed_behind_mark() noexcept {
  return g_freed_behind.load(std::memory_order_relaxed) & ~(kFreedBehindEvent - 1);
}
[[gnu::cold, gnu::noinline]] void settle_freed_behind(std::uint64_t key) noexcept;
// After the record of `key` (an allocation that succeeded) was made.
inline void recheck_freed_behind(std::uint64_t mark, std::uint64_t key) noexcept {
  if (__builtin_expect(g_freed_behind.load(std::memory_order_relaxed) != mark, 0)) settle_freed_behind(key);
}
// A free the linear table had no record of went through the driver: it may
// have freed an allocation whose record was not made yet.
[[gnu::cold, gnu::noinline]] void freed_untracked(std::uint64_t key) noexcept;
// A reset or destroy (every path out of it ends it).
struct FreeingBehind {
  FreeingBehind() noexcept { g_freed_behind.fetch_add(1, std::memory_order_relaxed); }
  ~FreeingBehind() { g_freed_behind.fetch_add(kFreedBehindEvent - 1, std::memory_order_relaxed); }
  FreeingBehind(const FreeingBehind&) = delete;
  FreeingBehind& operator=(const FreeingBehind&) = delete;
};

}  // namespace gpuslice::hook
