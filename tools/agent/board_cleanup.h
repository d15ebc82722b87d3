// Removal of stale files from the priority board (docs/priority.md): the
// library never removes its container's activity files (several processes
// share one and none knows it is the last), so the agent does, for files of
// containers or devices gone for longer than a grace period.
#pragma once

#include <cstdint>
#include <string>

namespace gpuslice::agent {

inline constexpr char kDefaultPriorityBoard[] = "/dev/shm/gpuslice-priority";

struct BoardCleanup {
  std::uint64_t examined = 0;  // activity files looked at
  std::uint64_t removed = 0;   // ... and removed
};

// Removes <board>/{high,normal,low}/*.act files that
//   - nobody holds a liveness lock on (no live process of the container has
//     the file open: a live one, however idle, keeps it), and
//   - were last written more than `grace_ns` before `now_realtime_ns`
//     (modification time, CLOCK_REALTIME: no clock of another time namespace
//     is trusted).
// Files that are not regular, symbolic links and other names are left alone.
// A missing board is not an error. Never follows a symbolic link.
BoardCleanup clean_priority_board(const std::string& board, std::uint64_t now_realtime_ns, std::uint64_t grace_ns);

}  // namespace gpuslice::agent
