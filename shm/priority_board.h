// The priority board's files (layout: include/gpuslice/priority_board.h,
// design: docs/priority.md). Heap-free, never blocks on another process, never
// maps another container's file (pread/pwrite only), never follows a symbolic
// link below the board directory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpuslice/priority_board.h"
#include "shm/region_file.h"
#include "shm/uuid.h"

namespace gpuslice::shm {

inline constexpr const char* kDefaultPriorityBoard = "/dev/shm/gpuslice-priority";
inline constexpr std::size_t kBoardPathMax = 4096;
inline constexpr std::size_t kBoardNameMax = 128;

// "high", "normal", "low": the level directories below the board.
const char* level_directory(Priority p) noexcept;

// File name of a container's activity on a device: "<GPU-uuid>.<key>.act",
// key = the container's region file as <st_dev>-<st_ino> in hex (the same file
// for every process of the container, whatever its mount namespace).
bool activity_name(const char uuid_text[kUuidTextSize], std::uint64_t region_dev, std::uint64_t region_ino,
                   char out[kBoardNameMax]) noexcept;

// Opens (creating it and the level directory if needed, mode 0644 / 01777 &
// ~umask) this container's activity file at `level` and fills its header when
// new or short. -1 + err (one line naming the path and what was expected) if
// the level directory cannot be written: e.g. mounted read-only, which is how
// a deployment keeps a container out of levels it was not given.
int open_own_activity(const char* board, Priority level, const char* name, const char* container_name,
                      Error* err) noexcept;
// Takes this process's liveness lock on its own activity file (an OFD read
// lock on byte kPriorityLivenessBase + getpid(); the kernel drops it when the
// process dies, however). False if the file system refuses (then readers fall
// back on the timeout).
bool hold_liveness(int fd) noexcept;
// Writes level, writer_pid (= getpid()), active_until_ns and last_launch_ns
// in one pwrite. False on error.
bool write_activity(int fd, Priority level, std::uint64_t active_until_ns, std::uint64_t last_launch_ns) noexcept;
// Whether the writer of `rec` still lives: false only when the kernel says
// nobody holds its liveness lock; true when it cannot tell (writer_pid 0, a
// file system without OFD locks).
bool writer_alive(int fd, const PriorityActivity& rec) noexcept;
// Writes held_ns and holds (one pwrite).
bool write_held(int fd, std::uint64_t held_ns, std::uint64_t holds) noexcept;

struct PeerFile {
  int fd = -1;
  Priority level = Priority::unset;  // the directory it was found in
  std::uint64_t dev = 0, ino = 0;
  bool seen = false;                 // scratch for scan_level
};

// Scans <board>/<level>/ for "<uuid_text>.*.act" regular files other than
// `own_name`, opening the new ones read-only into files[*count..cap) and
// closing the ones of that level that disappeared. Returns false only when the
// directory cannot be read (it may simply not exist yet).
bool scan_level(const char* board, Priority level, const char* uuid_text, const char* own_name, PeerFile* files,
                int* count, int cap) noexcept;
// Closes every file of the table.
void close_peers(PeerFile* files, int* count) noexcept;

// Reads a whole activity record; false if short or not a valid record.
bool read_activity(int fd, PriorityActivity* out) noexcept;

}  // namespace gpuslice::shm
