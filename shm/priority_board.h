// The priority board's files (layout: include/gpuslice/priority_board.h,
// design: docs/priority.md). Heap-free, never blocks on another process, never
// maps another container's file (pread/pwrite only), never follows a symbolic
// link below the board directory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpuslice/priority_board.h"
#include "platform/uuid.h"
#include "shm/region_file.h"

namespace gpuslice::shm {

inline constexpr const char* kDefaultPriorityBoard = "/dev/shm/gpuslice-priority";
inline constexpr std::size_t kBoardPathMax = 4096;
inline constexpr std::size_t kBoardNameMax = 128;

// "high", "normal", "low": the level directories below the board.
const char* level_directory(Priority p) noexcept;

// File name of a container's activity on a device: "<GPU-uuid>.<key>.act",
// key = the container's region file as <st_dev>-<st_ino> in hex (the same file
// for every process of the container, whatever its mount namespace).
bool activity_name(const char uuid_text[platform::kUuidTextSize], std::uint64_t region_dev, std::uint64_t region_ino,
                   char out[kBoardNameMax]) noexcept;

// Opens (creating it, and the board and level directories if needed, mode
// 0644 / 01777 set on descriptors) this container's activity file at `level`
// and fills its header
// when new or short. An existing file nobody holds a liveness lock on (its
// container's processes are gone) is replaced by a new one, so that readers
// see the directory change; one owned by another uid is replaced when this
// process may remove it and refused otherwise (another user's file is never
// written: it could forge it). -1 + err (one line naming the path and what was expected) if
// the level directory cannot be written: e.g. mounted read-only, which is how
// a deployment keeps a container out of levels it was not given. A level
// directory is used (by readers too) only when root or the board directory's
// owner owns it, and only those two create one in an existing board; a board
// this call creates gets all three levels at once (docs/priority.md, threat
// model).
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
  bool seen = false;  // scratch for scan_level
};

// Per level and device, a reader keeps its own table of neighbour files: a
// level's files can never take another level's places.
inline constexpr int kLevelPeers = 32;
// Bounded work per scan_level call (docs/priority.md, "What a scan costs"):
// it stops after the directory buffer in which it reached kScanEntries names
// or kScanOpens opens, and goes on from there at the next call; at most
// kScanReaps stale files are removed per call.
inline constexpr unsigned kScanEntries = 4096;
inline constexpr unsigned kScanOpens = 64;
inline constexpr unsigned kScanReaps = 64;
// A pass over a directory whose modification time is this close to the pass's
// start is repeated (the file system's time stamps are coarse, and a writer
// takes its liveness lock just after creating its file).
inline constexpr std::int64_t kScanSettleNs = 50'000'000;
// A file nobody holds a liveness lock on and nobody wrote for this long
// (modification time) is removed by a reader that may write the directory.
inline constexpr std::int64_t kReapAgeNs = 30'000'000'000;

struct LevelScan {
  PeerFile files[kLevelPeers];
  int count = 0;
  int dfd = -1;  // the level directory, kept open between calls
  std::uint64_t dir_dev = 0, dir_ino = 0;
  std::int64_t settled_mtime_ns = -1;  // directory mtime after the last settled pass; -1: none
  std::int64_t pass_mtime_ns = 0;      // its mtime when the current pass began
  std::int64_t pass_begin_ns = 0;      // CLOCK_REALTIME when it began
  bool in_pass = false;                // a pass is under way (the directory position is its cursor)
  bool want_pass = false;              // a table entry was dropped: a file left out may take its place
};

// What one scan_level call did (tests and benchmarks).
struct ScanCost {
  unsigned dir_reads = 0;  // getdents64 calls
  unsigned entries = 0;    // names examined
  unsigned stats = 0;      // fstatat calls on candidate names
  unsigned opens = 0;      // candidate files opened
  unsigned reaped = 0;     // stale files removed
  bool passed = false;     // a pass over the directory ended in this call
};

// One step of the scan of <board>/<level>/ for "<uuid_text>.*.act" files other
// than `own_name`. Cheap when nothing changed: one stat of the directory, then
// one fstat and one lock query per file already in the table (files whose
// writers are all gone, or unlinked, are dropped). When the directory's
// modification time changed, a pass over it begins, continued by later calls
// under the bounds above. A name is only opened when it is a regular file of a
// record's size (fstatat, no open), not already in the table, and the table
// has room; it enters the table only when some live process holds a liveness
// lock on it (a running container). Returns false when the directory cannot
// be read (the table is emptied).
bool scan_level(const char* board, Priority level, const char* uuid_text, const char* own_name, LevelScan* scan,
                ScanCost* cost = nullptr) noexcept;
// Closes every file of the table and the directory.
void close_level(LevelScan* scan) noexcept;
// True when a live process holds a liveness lock on the file (any pid), or the
// kernel cannot tell; false when nobody does.
bool any_writer_alive(int fd) noexcept;
// Called by a writer at exit (after dropping nothing else): drops this
// process's liveness lock on its file and removes the file when no other live
// process holds one and the name still names this file. True when removed.
bool remove_own_activity(const char* board, Priority level, const char* name, int fd) noexcept;
// Removes this container's file at `level` (its level changed), when `name`
// still names the file open as fd, whoever else holds it. True when removed.
bool unlink_activity(const char* board, Priority level, const char* name, int fd) noexcept;

// Reads a whole activity record; false if short or not a valid record.
bool read_activity(int fd, PriorityActivity* out) noexcept;

}  // namespace gpuslice::shm
