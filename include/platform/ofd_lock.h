// Open-file-description locks (fcntl F_OFD_SETLK/F_OFD_GETLK), the one helper
// of the slots' file locks (shm/slots.cc) and the priority board's liveness
// locks (shm/priority_board.cc, the agent's board cleanup). An OFD lock
// belongs to an open file description, not to a process: it is shared with
// the children that inherit the descriptor and released when the last
// descriptor of that description closes (exit, exec of an O_CLOEXEC one), so
// it says whether some process still has that file open. Never blocks, never
// changes errno (the preload library calls it inside the user's CUDA calls).
#pragma once

#include <cstdint>

namespace gpuslice::platform::ofd_lock {

enum class Kind { read, write };

// Takes a lock of `kind` on [start, start + len) (len 0: to the end of any
// file) through fd's description, without waiting (EINTR is retried). False
// when another description holds a conflicting lock, or the file system has
// no OFD locks.
bool take(int fd, Kind kind, std::uint64_t start, std::uint64_t len) noexcept;
// Drops this description's locks on the range.
void drop(int fd, std::uint64_t start, std::uint64_t len) noexcept;

enum class Probe { held, free, unknown };
// Whether another open file description holds any lock on the range (a lock
// of fd's own description is never reported: a forked child shares its
// parent's). unknown when it cannot be told (fd < 0, no OFD locks).
Probe probe(int fd, std::uint64_t start, std::uint64_t len) noexcept;

}  // namespace gpuslice::platform::ofd_lock
