// Process-wide state of the preload library: the container's region and this
// process's slot (bootstrap.cc, lifecycle.cc), and the map from CUDA device
// ordinals to region device entries (region.cc); the options are config.h.
// Bootstrap is lazy (first hooked call), allocation-free, thread-safe and
// re-entrancy-safe; after fork() the child starts over with its own slot.
#pragma once

#include <cuda.h>
#include <time.h>

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"
#include "hook/config.h"
#include "shm/region_file.h"

namespace gpuslice::hook {

struct Process {
  Region* region;
  std::atomic<int> slot;  // -1 before bootstrap, after fork (until re-claimed) and after exit
  shm::Observer self;     // our identity and our own descriptor of the region file (the reaper's view of slot locks)
  // limiter::lease_tag of our claim, read when the slot was claimed: a thread
  // still running after the slot changed hands carries the old tag, and the
  // lease fast path refuses it (limiter/lease.h).
  std::atomic<std::uint64_t> lease_tag;
};

enum : int { kReadyNo = 0, kReadyYes = 1, kReadyFailed = 2 };
extern std::atomic<int> g_ready;
extern Process g_process;  // valid once g_ready == kReadyYes

// Slow path: bootstrap (options, driver, region, slot). Returns CUDA_SUCCESS or
// the fail-closed error.
[[gnu::cold, gnu::noinline]] CUresult bootstrap() noexcept;

// The hot-path test every accounting wrapper starts with.
inline CUresult ensure_ready() noexcept {
  if (__builtin_expect(g_ready.load(std::memory_order_acquire) == kReadyYes, 1)) return CUDA_SUCCESS;
  return bootstrap();
}

// Whether the region file still has a region's size and magic (someone may
// truncate it under our mapping: touching it then raises SIGBUS). Looks at
// the file at most once per coarse clock tick (a few ms) unless `force`; on
// the first failure logs one error line and fails closed (g_ready). Call it
// on a slow path before touching the region; the accounting calls below and
// device_entry() already do. Inline: the allocation and free fast paths pay
// a coarse-clock read (vDSO, no syscall) and a compare, no call.
extern std::atomic<int> g_region_fd;                     // region.cc; -1: not watched
extern std::atomic<std::int64_t> g_region_checked_tick;  // the tick of the last look
extern std::atomic<bool> g_region_lost;
[[gnu::cold, gnu::noinline]] bool region_check_now(int fd, std::int64_t tick) noexcept;
inline bool region_intact(bool force = false) noexcept {
  if (__builtin_expect(g_region_lost.load(std::memory_order_relaxed), 0)) return false;
  const int fd = g_region_fd.load(std::memory_order_relaxed);
  if (fd < 0) return true;
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &now);  // vDSO: no syscall
  const std::int64_t tick = static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
  if (__builtin_expect(!force && g_region_checked_tick.load(std::memory_order_relaxed) == tick, 1)) return true;
  return region_check_now(fd, tick);
}

// What a thread keeps of its frees for its own next allocations (the thread
// reserve: lifecycle.cc, docs/memory-accounting.md). It lives in the
// thread's op counter (wrap.h), so that a measurement can add up every
// thread's (thread_reserves_on): written only by its thread (relaxed stores,
// plain moves), read by the measurer once every operation settled. Counted
// as in use by the slot (committed_bytes) but not on the device.
struct ThreadReserve {
  std::atomic<std::uint64_t> bytes;
  std::atomic<std::uint64_t> tag;  // the lease tag of the claim it was counted on
  std::atomic<int> slot;
  std::atomic<int> entry;
};
// The calling thread's reserve (its op counter's), or nullptr: none before
// its first counting operation, without per-thread counters, in a forked
// child until it claimed a counter of its own (memory.cc).
[[gnu::tls_model("initial-exec")]] extern constinit thread_local ThreadReserve* t_reserve;
// A claimed counter's reserve starts empty (lifecycle.cc; memory.cc calls it).
void reset_thread_reserve(ThreadReserve& t) noexcept;
// The bytes the threads of this process keep on `entry` for its present claim
// (memory.cc): counted in committed_bytes, not held on the device.
std::uint64_t thread_reserves_on(int entry) noexcept;

// When a thread ends (a pthread key, lifecycle.cc) it gives back its reserve
// and runs the one function set here (the launch path's: its credit of
// prices taken ahead). arm_thread_exit() arms that for the calling thread,
// once; false when no key could be made or set (nothing is then given back).
using ThreadExitFn = void (*)() noexcept;
void set_thread_exit(ThreadExitFn fn) noexcept;
bool arm_thread_exit() noexcept;

// Region device entry for a CUDA device ordinal (claimed on first use with the
// quota and SM limit configured for that ordinal), or -1.
int device_entry(CUdevice ordinal) noexcept;
// Region device entry of the calling thread's current context; on failure
// returns -1 and sets *rc to the driver's error (e.g. no current context).
// With a single device the entry is cached and the driver is not asked: a
// call without a context then fails in the real call that follows, which
// returns the driver's own error (the caller releases its reservation).
int current_device_entry(CUresult* rc) noexcept;
// CUDA ordinal of a region device entry, or -1 if this process has not mapped it.
int ordinal_of_entry(int entry) noexcept;

// Reserve/release `bytes` on a device entry for this process (limiter's
// cross-process protocol). reserve() tries the slow reclaim paths (dead
// processes, idle pool reserves) before refusing.
bool reserve(int entry, std::uint64_t bytes) noexcept;
void release(int entry, std::uint64_t bytes) noexcept;
bool charge(int entry, std::uint64_t bytes) noexcept;

// Hooks that run before an allocation is refused (pools.cc registers one that
// trims this process's idle pool reserves back into the budget).
using ReclaimFn = void (*)() noexcept;
void set_pool_reclaim(ReclaimFn fn) noexcept;

// Between the files that implement this header, nobody else's:
void watch_region_file(int fd) noexcept;     // region.cc: the region file to watch (-1: none)
void own_claimed_slot() noexcept;            // lifecycle.cc: the slot just claimed is ours (fork handler, owner word)
void hold_slot_lock(int fd) noexcept;        // lifecycle.cc: our own descriptor holding the slot's file lock (-1: none)
void restart_bootstrap_in_child() noexcept;  // bootstrap.cc: a forked child may claim a slot again

}  // namespace gpuslice::hook
