// File and directory operations of code that runs as any user, root
// included, in directories other users may write, inside programs it does not
// control (docs/security.md, "The library's file operations"):
// - a directory it creates is opened (O_NOFOLLOW) and checked to be the one it
//   created before its mode changes (fchmod on that descriptor): a directory
//   swapped for a symbolic link between the mkdir and the chmod never gets it;
// - no descriptor it opens is 0, 1 or 2: a program started with a standard
//   descriptor closed would otherwise write its output into our file.
// Heap-free; every descriptor is close-on-exec.
#pragma once

#include <sys/types.h>

#include <cstddef>

namespace gpuslice::platform {

// fd itself, or, when fd is 0, 1 or 2, a close-on-exec duplicate >= 3 with fd
// closed. -1 (errno set) when fd is -1 or the duplicate fails.
int above_stdio(int fd) noexcept;

// openat(dirfd, path, flags | O_CLOEXEC, mode), never 0, 1 or 2; -1 + errno.
int open_at(int dirfd, const char* path, int flags, mode_t mode = 0) noexcept;

struct MadeDir {
  int fd = -1;            // the directory, close-on-exec, >= 3; -1 on failure
  bool created = false;   // this call created it (its last component)
  int error = 0;          // errno of the failure
  const char* what = "";  // the failure, for a message: "cannot create", "was replaced ..."
  std::size_t at = 0;     // the failing directory: path[0, at)
};

// Opens directory `name` (one component) of `parent`, creating it when absent:
// mkdirat(0700), then openat(O_NOFOLLOW | O_DIRECTORY) and fstat: it must be a
// directory of this effective uid that nobody opened up yet (no group or other
// permission bits), else it was replaced before we could look (error EEXIST,
// what "was replaced ..."); then fchmod(mode) on that descriptor (a failure
// there is not an error: the directory still serves its creator). An existing
// directory is used as it is; `follow`: a symbolic link to one too (a
// component of a path someone configured); without, it is refused (ELOOP).
MadeDir make_dir_at(int parent, const char* name, mode_t mode, bool follow) noexcept;

// mkdir -p: opens directory `path` (absolute, or relative to the working
// directory), creating every missing component as make_dir_at does (existing
// ones followed). The descriptor serves the *at calls and fstat: O_PATH when
// the directory existed (passing through needs no read permission). Fails
// with ENAMETOOLONG past 4095 bytes.
MadeDir make_dirs(const char* path, mode_t mode) noexcept;

}  // namespace gpuslice::platform
