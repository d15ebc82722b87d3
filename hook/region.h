// The container's region as this process sees it (region.cc): the watch on
// the region file, and the map from CUDA device ordinals to region device
// entries.
#pragma once

#include <cuda.h>
#include <time.h>

#include <atomic>
#include <cstdint>

#include "platform/clock.h"  // clock_gettime called through its GOT entry
#include "platform/compare.h"

namespace gpuslice::hook {

// Whether the region file still has a region's size and magic (someone may
// truncate it under our mapping: touching it then raises SIGBUS). Looks at
// the file at most once per coarse clock tick (a few ms) unless `force`; on
// the first failure logs one error line and fails closed (g_ready). Call it
// on a slow path before touching the region; the accounting calls
// (hook/account.h) and device_entry() already do. Inline: the allocation and
// free fast paths pay a coarse-clock read (vDSO, no syscall) and one compare:
// g_region_checked_tick is the tick of the last look that found the file
// intact (or no file watched), and -1 once the region is lost, so the one
// compare also covers "lost" and "not watched" (region_check_now).
// (rdtsc would be one instruction, but on a KVM guest that traps it it costs
// ~3x the vDSO read: docs/security.md.)
// Hidden on the declaration: read PC-relative (process.h).
[[gnu::visibility("hidden")]] extern std::atomic<int> g_region_fd;                     // -1: not watched
[[gnu::visibility("hidden")]] extern std::atomic<std::int64_t> g_region_checked_tick;  // the tick of the last look
[[gnu::visibility("hidden")]] extern std::atomic<bool> g_region_lost;
[[gnu::cold, gnu::noinline]] bool region_check_now(std::int64_t tick) noexcept;
inline bool region_intact(bool force = false) noexcept {
  timespec now;                                 // clock_gettime fills it (not zeroed first: two stores fewer)
  clock_gettime(CLOCK_MONOTONIC_COARSE, &now);  // vDSO: no syscall
  const std::int64_t tick = static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
  if (__builtin_expect(!force && platform::relaxed_equals(g_region_checked_tick, tick), 1)) return true;
  return region_check_now(tick);
}
// Run once the region file was found lost, after g_ready says so (seq_cst):
// the allocation pair's fast way, which tests no g_ready, stops vouching
// for it (hook/memory.cc). One function per process.
using RegionLostFn = void (*)() noexcept;
void set_on_region_lost(RegionLostFn fn) noexcept;
// The region file to watch (-1: none); bootstrap sets it when it attaches.
void watch_region_file(int fd) noexcept;

// Region device entry for a CUDA device ordinal (claimed on first use with the
// quota and SM limit configured for that ordinal), or -1.
int device_entry(CUdevice ordinal) noexcept;
// Region device entry of the calling thread's current context; on failure
// returns -1 and sets *rc to the driver's error (e.g. no current context).
// With a single device the entry is cached and the driver is not asked: a
// call without a context then fails in the real call that follows, which
// returns the driver's own error (the caller releases its reservation).
// Inline: one load of g_single_entry (the entry of the only device, >= 0;
// else the slow path: kNotCounted until the driver could count its devices,
// which it cannot before cuInit, or kSeveralDevices).
enum : int { kNotCounted = -1, kSeveralDevices = -2 };
[[gnu::visibility("hidden")]] extern std::atomic<int> g_single_entry;
[[gnu::noinline]] int current_device_entry_slow(CUresult* rc) noexcept;
inline int current_device_entry(CUresult* rc) noexcept {
  const int single = g_single_entry.load(std::memory_order_relaxed);
  if (__builtin_expect(single >= 0, 1)) return single;
  return current_device_entry_slow(rc);
}
// CUDA ordinal of a region device entry, or -1 if this process has not mapped it.
int ordinal_of_entry(int entry) noexcept;
// Region entry of a GPU NVML lists but CUDA does not show this process
// (CUDA_VISIBLE_DEVICES), claimed with its container ordinal's limits, or -1.
int device_entry_of_uuid(const std::uint8_t uuid[16]) noexcept;

}  // namespace gpuslice::hook
