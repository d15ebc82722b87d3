// Opening region files that may be hostile, and reading them safely.
//
// A region file belongs to a container, so everything in it is untrusted: the
// header is validated before the file is trusted at all, no value read from it
// is ever used as a size, index or divisor, and every access to the mapping
// runs under a SIGBUS guard, because a container can truncate its own file
// after we mapped it (touching a page past the new end raises SIGBUS).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpuslice/region.h"

namespace gpuslice::agent {

// Installs the SIGBUS handler the guard needs (idempotent, thread-safe). A
// fault outside a guard is passed on to the previous handler (or kills the
// process as it would have without us).
void install_fault_guard();

// Runs fn(ctx); false if a SIGBUS interrupted it. Whatever fn does between two
// region accesses must be abandonable at any point: no locks, no objects with
// destructors, no allocation in the frames the guard unwinds.
bool run_guarded(void (*fn)(void*), void* ctx) noexcept;

template <class F>
bool guarded(F&& fn) noexcept {
  return run_guarded([](void* p) { (*static_cast<F*>(p))(); }, &fn);
}

// A validated mapping of one region file. Move-only; unmaps on destruction.
class MappedRegion {
 public:
  MappedRegion() = default;
  ~MappedRegion();
  MappedRegion(MappedRegion&& other) noexcept;
  MappedRegion& operator=(MappedRegion&& other) noexcept;
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  Region* get() const { return region_; }
  explicit operator bool() const { return region_ != nullptr; }
  bool writable() const { return writable_; }
  // Our own open description of the file: the slots' file locks are probed
  // through it (shm::probe_slot_lock).
  int fd() const { return fd_; }
  dev_t device() const { return device_; }
  ino_t inode() const { return inode_; }
  void reset();
  // Takes ownership of a mapping of sizeof(Region) bytes and of the open file
  // it maps (open_region's job).
  void adopt(Region* region, int fd, bool writable, dev_t device, ino_t inode);
  // Unmaps the pages of the slot array from this process (the file keeps
  // them): the next access maps back only the pages it touches. After a
  // walk of every slot (the reaper), so that the agent does not keep every
  // page of the region resident (slot_index.h).
  void release_slot_pages() const;
  // Maps exactly the pages of these slots (and releases the others'), by
  // write faults, which map one page each: a read fault of a file on disk
  // maps up to 16 neighbours already in the page cache ("fault-around").
  // Nothing is written. Writable mappings only; elsewhere a no-op.
  void map_slots(const std::vector<std::uint16_t>& slots) const;
  // The file was unlinked since we opened it (its inode number may already
  // name a new file: only the open descriptor can tell).
  bool unlinked() const;

 private:
  Region* region_ = nullptr;
  int fd_ = -1;
  bool writable_ = false;
  dev_t device_ = 0;
  ino_t inode_ = 0;
};

// Opens `name` relative to dirfd (AT_FDCWD: a path), never blocking (a FIFO
// planted in place of a region must not hang us) and, unless follow_symlinks,
// never through a symbolic link (a container must not make the node agent
// open a host file). Maps it (read-only unless writable) and validates the
// header. On failure `why` holds "<what is wrong>, expected <what>" and
// `missing` (optional) tells whether the file simply does not exist.
bool open_region(int dirfd, const char* name, bool writable, bool follow_symlinks, MappedRegion* out, std::string* why,
                 bool* missing = nullptr);

// Checks the header of a mapping again (a container may rewrite it at any
// time). Guarded; false + why if it is no longer a valid region.
bool revalidate(const Region* r, std::string* why);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (NVML's spelling) <-> 16 bytes.
std::string format_uuid(const std::uint8_t uuid[16]);
bool parse_uuid(const char* text, std::uint8_t out[16]);

// Untrusted text (a container name) as one printable line: control and
// non-ASCII bytes as \xNN, at most max_chars bytes of input.
std::string printable(const char* data, std::size_t max_bytes);

std::uint64_t monotonic_ns();

}  // namespace gpuslice::agent
