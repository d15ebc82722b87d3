// Grant records: how `gpuslice-smi set` tells the agent that a change of a
// region's limits is the operator's, not the container's (docs/agent.md,
// "Tampered regions"). The region is the container's to write, so the agent
// keeps the limits it was given and restores any other value; smi writes a
// record of its change, before the change itself, into the grant directory:
// `.gpuslice-grants` at the top of the agent's region directory, created by
// the agent (mode 0700, its owner), which no container has mounted (a pod
// gets its own subdirectory only). One file per change, named
// `<st_dev>-<st_ino>-<CLOCK_REALTIME ns>-<pid>` of the region file, holding
//   gpuslice-grant 1
//   quota <uuid> <bytes> | sm <uuid> <pct> | policy <uuid> <0|1> | priority <1-3>
// (exactly as grant_text writes it: the agent takes nothing else). The agent
// applies each record to the limits it keeps and removes it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpuslice::agent {

inline constexpr char kGrantDirName[] = ".gpuslice-grants";
inline constexpr std::size_t kMaxGrantBytes = 4096;

struct GrantLine {
  enum Field { quota, sm, policy, priority } field;
  std::uint8_t uuid[16] = {};  // quota, sm, policy
  std::uint64_t value = 0;
};

struct Grant {
  std::vector<GrantLine> lines;
};

std::string grant_text(const Grant& g);
bool parse_grant(const std::string& text, Grant* out);
// The record's name for a region file; parse_grant_name reads it back.
std::string grant_name(dev_t dev, ino_t ino, std::uint64_t realtime_ns, std::uint32_t pid);
bool parse_grant_name(const char* name, dev_t* dev, ino_t* ino, std::uint64_t* realtime_ns);

// A directory fit to hold grant records: opened without following a
// symbolic link, owned by this user, writable by nobody else. -1 otherwise
// (why says what is wrong; errno ENOENT: there is none).
int open_grant_dir(int at, const char* path, std::string* why);
// A grant directory held open (fd, opened from path) is still fit: still
// this user's and writable by nobody else (fstat of what is held), and still
// what path names (not renamed away, removed or replaced). false + why.
bool grant_dir_still_fit(int fd, const char* path, std::string* why);

// smi's side: the grant directory for a region path (the agent's region
// directory is the region's directory or its parent; the parent is tried
// first, as the region's own directory may be a pod's, which its container
// can write). "" = none found (no agent keeps this region's limits); where
// one is there but unfit (a link, a FIFO, a file, another user's or one others
// may write), `refused` (if given) says which and why.
std::string find_grant_dir(const std::string& region_path, std::string* refused = nullptr);
// Writes a record atomically (a temporary name, then rename). false + why.
bool write_grant(const std::string& dir, dev_t dev, ino_t ino, const Grant& g, std::string* why);

}  // namespace gpuslice::agent
