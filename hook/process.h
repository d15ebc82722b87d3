// This process as the preload library sees it: the container's region, its
// slot there, and whether bootstrap has run (hook/bootstrap.h sets them up,
// hook/lifecycle.h keeps the slot across fork and exit). State only: the
// words every accounting call reads, defined in process.cc.
#pragma once

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"
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

// Hidden on the declaration too (-fvisibility=hidden covers definitions
// only): every file then reads these words PC-relative, as the file that
// defines them does, without a GOT load on the accounting fast paths.
enum : int { kReadyNo = 0, kReadyYes = 1, kReadyFailed = 2 };
[[gnu::visibility("hidden")]] extern std::atomic<int> g_ready;
[[gnu::visibility("hidden")]] extern Process g_process;  // valid once g_ready == kReadyYes

}  // namespace gpuslice::hook
