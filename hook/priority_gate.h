// Priority between tenants on the launch path (docs/priority.md). The launch
// code makes two calls:
//   - priority_refresh() wherever it re-reads its caches (the feedback
//     thread, every 100 ms, and the launch path's initialisation): true when
//     some device needs the slow path for priority's sake, so that a container
//     with no SM limit still comes through admission;
//   - priority_admit() from the admission slow path, before the driver call,
//     for every launch on a device: one relaxed load when priority is not
//     engaged on that device; otherwise it publishes this container's activity,
//     holds the launch while a higher-priority tenant is active and bounds the
//     work in flight while one is present.
#pragma once

#include <cuda.h>

namespace gpuslice::hook {

bool priority_refresh() noexcept;
// True when this node uses priorities (the board directory exists): then a
// process needs the background refresh even without a compute limit, to
// notice a neighbour of another level appearing.
bool priority_board_present() noexcept;
// True when the launch path must call priority_after_launch() once the
// launch is queued (a launch booked in its level's timetable: a marker behind
// it measures its device time).
bool priority_admit(int ordinal, CUstream stream, bool ptsz) noexcept;
void priority_after_launch(int ordinal, CUstream stream, bool ptsz, bool launched) noexcept;

}  // namespace gpuslice::hook
