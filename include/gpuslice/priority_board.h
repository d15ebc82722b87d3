// The priority board: per-device "who is active at which priority", shared by
// the containers of a node (docs/priority.md). It is a directory tree of small
// files, not one shared region, because its trust rule is enforced by the file
// system:
//
//   <board>/<level>/<GPU-uuid>.<key>.act      level = high | normal | low
//
// One activity file per (container, device), written only by that container
// (its processes share it; `key` names the container's region file). Readers
// take a file's priority from the DIRECTORY it is in, never from its content:
// in a deployment every container mounts the board read-only and only its own
// level's directory writable (or, on a bare node, the level directories carry
// group permissions), so a low-priority container can neither publish at high
// priority nor write a high-priority container's activity.
//
// Files are read with pread and written with pwrite, never mapped: a peer that
// truncates its file cannot raise SIGBUS in another container's process.
// Every field is a plain little-endian fixed-width integer, 8-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpuslice {

inline constexpr std::uint64_t kPriorityMagic = 0x3142524f49525047ull;  // "GPRIORB1" little-endian
inline constexpr std::uint32_t kPriorityAbiVersion = 1;
// Liveness locks live at this file offset + the writer's pid (past the record).
inline constexpr std::uint64_t kPriorityLivenessBase = 1ull << 20;

// Priority levels as stored in RegionHeader::priority and PriorityActivity::
// level. 0 in the region means "not recorded yet" (the first process records
// its GPUSLICE_PRIORITY). Larger is more important.
enum class Priority : std::uint32_t { unset = 0, low = 1, normal = 2, high = 3 };

struct PriorityActivity {
  std::uint64_t magic;        // kPriorityMagic
  std::uint32_t abi_version;  // kPriorityAbiVersion
  std::uint32_t size;         // sizeof(PriorityActivity)
  std::uint32_t level;        // what the writer says it is (tools only; readers use the directory)
  // The process that wrote active_until_ns (its own pid namespace). While it
  // lives it holds an OFD read lock on byte kPriorityLivenessBase + writer_pid
  // of this file (beyond its end): readers ask the kernel whether that lock is
  // still held, so a killed writer stops holding anyone at once. 0: unknown.
  std::uint32_t writer_pid;
  std::uint64_t active_until_ns;  // CLOCK_MONOTONIC: the container counts as active before this
  std::uint64_t last_launch_ns;   // CLOCK_MONOTONIC of its latest launch on the device (presence)
  std::uint64_t held_ns;          // total time its launches waited for higher-priority tenants
  std::uint64_t holds;            // launches that waited
  char container_name[64];        // GPUSLICE_CONTAINER_NAME, NUL-terminated (tools only)
  std::uint64_t reserved[5];
};
static_assert(sizeof(PriorityActivity) == 160);
static_assert(offsetof(PriorityActivity, writer_pid) == 20);
static_assert(offsetof(PriorityActivity, active_until_ns) == 24);
static_assert(offsetof(PriorityActivity, last_launch_ns) == 32);
static_assert(offsetof(PriorityActivity, held_ns) == 40);
static_assert(offsetof(PriorityActivity, holds) == 48);
static_assert(offsetof(PriorityActivity, container_name) == 56);

}  // namespace gpuslice
