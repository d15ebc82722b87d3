// Descriptor-based file and directory operations (fs.h).
#include "platform/fs.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

namespace gpuslice::platform {

int above_stdio(int fd) noexcept {
  if (fd < 0 || fd > 2) return fd;
  const int high = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  const int e = errno;
  close(fd);
  errno = e;
  return high;
}

int open_at(int dirfd, const char* path, int flags, mode_t mode) noexcept {
  return above_stdio(openat(dirfd, path, flags | O_CLOEXEC, mode));
}

namespace {

constexpr const char* kReplaced = "was replaced between its creation and the change of its mode";

MadeDir failed(const char* what, int error) noexcept {
  MadeDir r;
  r.what = what;
  r.error = error;
  return r;
}

}  // namespace

MadeDir make_dir_at(int parent, const char* name, mode_t mode, bool follow) noexcept {
  const int open_flags = O_RDONLY | O_DIRECTORY | (follow ? 0 : O_NOFOLLOW);
  // A few rounds: another process may create (or remove) it meanwhile.
  for (int round = 0; round < 4; ++round) {
    int fd = open_at(parent, name, open_flags);
    if (fd >= 0) {
      MadeDir r;
      r.fd = fd;
      return r;
    }
    if (errno != ENOENT) return failed("cannot open", errno);
    if (mkdirat(parent, name, 0700) != 0) {
      if (errno == EEXIST) continue;
      return failed("cannot create", errno);
    }
    // Ours until now, 0700: whoever could swap it (the parent's owner, or
    // anyone in a directory without the sticky bit) gets no mode of ours.
    fd = open_at(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (fd < 0) {
      return failed(kReplaced, errno);
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 0077) != 0) {
      close(fd);
      return failed(kReplaced, EEXIST);
    }
    (void)fchmod(fd, mode);  // not through the umask
    MadeDir r;
    r.fd = fd;
    r.created = true;
    return r;
  }
  return failed("keeps appearing and disappearing", EAGAIN);
}

MadeDir make_dirs(const char* path, mode_t mode) noexcept {
  constexpr std::size_t kCap = 4096;
  char buf[kCap];
  const std::size_t len = strnlen(path, kCap);
  if (len == kCap) return failed("path too long", ENAMETOOLONG);
  std::memcpy(buf, path, len + 1);
  // O_PATH where we only pass through: searching a directory needs no read permission.
  int cur = open_at(AT_FDCWD, buf[0] == '/' ? "/" : ".", O_PATH | O_DIRECTORY);
  if (cur < 0) {
    MadeDir r = failed("cannot open", errno);
    r.at = buf[0] == '/' ? 1 : 0;
    return r;
  }
  bool created = false;
  std::size_t i = 0;
  while (i < len) {
    while (i < len && buf[i] == '/') ++i;
    if (i == len) break;
    const std::size_t start = i;
    while (i < len && buf[i] != '/') ++i;
    const char saved = buf[i];
    buf[i] = '\0';
    MadeDir step;
    step.fd = open_at(cur, buf + start, O_PATH | O_DIRECTORY);
    if (step.fd < 0 && errno == ENOENT) {
      step = make_dir_at(cur, buf + start, mode, true);
    } else if (step.fd < 0) {
      step = failed("cannot open", errno);
    }
    buf[i] = saved;
    close(cur);
    if (step.fd < 0) {
      step.at = i;
      return step;
    }
    cur = step.fd;
    created = step.created;
  }
  MadeDir r;
  r.fd = cur;
  r.created = created;
  return r;
}

}  // namespace gpuslice::platform
