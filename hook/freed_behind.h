// The freed-behind word (docs/memory-accounting.md, "Frees behind a
// record"), apart from the linear table's use of it (hook/memory.h) so that
// the array wrappers (hook/arrays.cc) read it without a cycle of includes.
#pragma once

#include <atomic>
#include <cstdint>

namespace gpuslice::hook {

// Device memory freed behind a record (docs/memory-accounting.md, "Frees
// behind a record"): the driver may free, or hand out again, an address (or
// an array handle) a record is about to be made for, when a program frees a
// pointer (or destroys an array) a primary-context reset or context destroy
// already freed, or when that reset or destroy frees it first. This
// word changes at each such chance: +1 when a reset or destroy begins (the
// low 16 bits: how many are in progress), +kFreedBehindEvent - 1 when it
// ended (its sweep done), +kFreedBehindEvent after a free the table had no
// record of went through (hook/arrays.cc: an array destroy too). An
// allocation or array creation reads it before its driver call
// (freed_behind_mark) and after its record is made; if it changed, it asks
// the driver whether its address is still held (settle_freed_behind). The
// table's shard lock orders the record against the change: a free that
// changed it after the allocation read it again finds the record instead.
[[gnu::visibility("hidden")]] inline constinit std::atomic<std::uint64_t> g_freed_behind{0};
inline constexpr std::uint64_t kFreedBehindEvent = std::uint64_t{1} << 16;
// A free (or array destroy) the tables had no record of went through the
// driver: it may have freed memory whose record is not made yet.
inline void note_freed_untracked() noexcept { g_freed_behind.fetch_add(kFreedBehindEvent, std::memory_order_seq_cst); }
inline std::uint64_t freed_behind_mark() noexcept {
  return g_freed_behind.load(std::memory_order_relaxed) & ~(kFreedBehindEvent - 1);
}
// A reset or destroy (every path out of it ends it).
struct FreeingBehind {
  FreeingBehind() noexcept { g_freed_behind.fetch_add(1, std::memory_order_relaxed); }
  ~FreeingBehind() { g_freed_behind.fetch_add(kFreedBehindEvent - 1, std::memory_order_relaxed); }
  FreeingBehind(const FreeingBehind&) = delete;
  FreeingBehind& operator=(const FreeingBehind&) = delete;
};

}  // namespace gpuslice::hook
