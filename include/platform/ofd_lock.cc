// Open-file-description locks. See ofd_lock.h.
#include "platform/ofd_lock.h"

#include <fcntl.h>

#include <cerrno>

namespace gpuslice::platform::ofd_lock {
namespace {

bool call(int fd, int cmd, short type, std::uint64_t start, std::uint64_t len, short* seen) noexcept {
  if (fd < 0) return false;
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(start);
  fl.l_len = static_cast<off_t>(len);
  const int saved_errno = errno;
  int rc;
  do {
    rc = fcntl(fd, cmd, &fl);
  } while (rc != 0 && errno == EINTR);
  errno = saved_errno;
  if (rc == 0 && seen != nullptr) *seen = fl.l_type;
  return rc == 0;
}

}  // namespace

bool take(int fd, Kind kind, std::uint64_t start, std::uint64_t len) noexcept {
  return call(fd, F_OFD_SETLK, kind == Kind::read ? F_RDLCK : F_WRLCK, start, len, nullptr);
}

void drop(int fd, std::uint64_t start, std::uint64_t len) noexcept {
  call(fd, F_OFD_SETLK, F_UNLCK, start, len, nullptr);
}

Probe probe(int fd, std::uint64_t start, std::uint64_t len) noexcept {
  short seen = F_UNLCK;
  // A write lock conflicts with every lock: the kernel reports any of them.
  if (!call(fd, F_OFD_GETLK, F_WRLCK, start, len, &seen)) return Probe::unknown;
  return seen == F_UNLCK ? Probe::free : Probe::held;
}

}  // namespace gpuslice::platform::ofd_lock
