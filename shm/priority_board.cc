// The priority board's files. See priority_board.h and docs/priority.md.
#include "shm/priority_board.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "shm/text.h"

namespace gpuslice::shm {

namespace {

void fail(Error* err, const char* path, const char* what, int error) noexcept {
  if (err == nullptr) return;
  Text t(err->message, sizeof err->message);
  t.str("gpuslice: priority board ").escaped(path).str(": ").str(what);
  if (error != 0) t.str(": ").errno_text(error);
}

// mkdir -p with mode `mode` for the directories this call creates.
bool make_dirs(char* path, mode_t mode) noexcept {
  for (char* p = path + 1; *p != 0; ++p) {
    if (*p != '/') continue;
    *p = 0;
    const int rc = mkdir(path, mode);
    const int e = errno;
    *p = '/';
    if (rc != 0 && e != EEXIST) return false;
  }
  return mkdir(path, mode) == 0 || errno == EEXIST;
}

bool level_dir(const char* board, Priority level, char out[kBoardPathMax]) noexcept {
  Text t(out, kBoardPathMax);
  t.str(board).ch('/').str(level_directory(level));
  return !t.truncated();
}

bool write_all(int fd, const void* data, std::size_t size, off_t offset) noexcept {
  const char* p = static_cast<const char*>(data);
  while (size != 0) {
    const ssize_t n = pwrite(fd, p, size, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<std::size_t>(n);
    offset += n;
  }
  return true;
}

bool ends_with(const char* s, std::size_t len, const char* suffix) noexcept {
  const std::size_t n = std::strlen(suffix);
  return len >= n && std::memcmp(s + len - n, suffix, n) == 0;
}

}  // namespace

const char* level_directory(Priority p) noexcept {
  switch (p) {
    case Priority::high: return "high";
    case Priority::low: return "low";
    default: return "normal";
  }
}

bool activity_name(const char uuid_text[kUuidTextSize], std::uint64_t region_dev, std::uint64_t region_ino,
                   char out[kBoardNameMax]) noexcept {
  char dev[24], ino[24];
  Text d(dev, sizeof dev), i(ino, sizeof ino);
  d.hex(region_dev);
  i.hex(region_ino);
  Text t(out, kBoardNameMax);
  t.str(uuid_text).ch('.').str(dev + 2).ch('-').str(ino + 2).str(".act");  // without the 0x prefixes
  return !t.truncated();
}

int open_own_activity(const char* board, Priority level, const char* name, const char* container_name,
                      Error* err) noexcept {
  char dir[kBoardPathMax];
  if (!level_dir(board, level, dir)) {
    fail(err, board, "path too long, expected at most 4000 characters", 0);
    return -1;
  }
  // Sticky and world-writable like /dev/shm when we create it: a deployment
  // that restricts levels creates (or mounts) the directories itself.
  if (!make_dirs(dir, 01777)) {
    fail(err, dir, "cannot create the level directory, expected a writable board", errno);
    return -1;
  }
  const int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    fail(err, dir, "cannot open the level directory", errno);
    return -1;
  }
  const int fd = openat(dfd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  const int e = errno;
  close(dfd);
  if (fd < 0) {
    fail(err, dir, "cannot create this container's activity file, expected a writable level directory", e);
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    fail(err, dir, "the activity file is not a regular file", 0);
    return -1;
  }
  // Before our pid goes into the file: readers must never see it unlocked
  // while we live.
  hold_liveness(fd);
  PriorityActivity rec;
  if (static_cast<std::size_t>(st.st_size) < sizeof rec || !read_activity(fd, &rec)) {
    // New (or garbage): a complete record in one write. Two processes of the
    // container racing here write the same header.
    std::memset(&rec, 0, sizeof rec);
    rec.magic = kPriorityMagic;
    rec.abi_version = kPriorityAbiVersion;
    rec.size = sizeof rec;
    copy_string(rec.container_name, sizeof rec.container_name, container_name != nullptr ? container_name : "");
  }
  rec.level = static_cast<std::uint32_t>(level);
  rec.writer_pid = static_cast<std::uint32_t>(getpid());
  if (!write_all(fd, &rec, sizeof rec, 0)) {
    const int we = errno;
    close(fd);
    fail(err, dir, "cannot write this container's activity file", we);
    return -1;
  }
  return fd;
}

bool hold_liveness(int fd) noexcept {
  struct flock fl;
  std::memset(&fl, 0, sizeof fl);
  fl.l_type = F_RDLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(kPriorityLivenessBase + static_cast<std::uint64_t>(getpid()));
  fl.l_len = 1;
  int rc;
  do {
    rc = fcntl(fd, F_OFD_SETLK, &fl);
  } while (rc != 0 && errno == EINTR);
  return rc == 0;
}

bool write_activity(int fd, Priority level, std::uint64_t active_until_ns, std::uint64_t last_launch_ns) noexcept {
  // One pwrite from `level` to `last_launch_ns`: a reader sees the writer and
  // its word together (a process killed mid-way cannot pair its pid with
  // another process's word).
  struct {
    std::uint32_t level, writer_pid;
    std::uint64_t active_until_ns, last_launch_ns;
  } words{static_cast<std::uint32_t>(level), static_cast<std::uint32_t>(getpid()), active_until_ns, last_launch_ns};
  static_assert(sizeof words == 24 && offsetof(PriorityActivity, last_launch_ns) - offsetof(PriorityActivity, level) == 16);
  return write_all(fd, &words, sizeof words, offsetof(PriorityActivity, level));
}

bool writer_alive(int fd, const PriorityActivity& rec) noexcept {
  if (rec.writer_pid == 0) return true;
  struct flock fl;
  std::memset(&fl, 0, sizeof fl);
  fl.l_type = F_WRLCK;  // conflicts with any read lock on the byte
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(kPriorityLivenessBase + rec.writer_pid);
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return true;
  return fl.l_type != F_UNLCK;
}

bool write_held(int fd, std::uint64_t held_ns, std::uint64_t holds) noexcept {
  const std::uint64_t words[2] = {held_ns, holds};
  return write_all(fd, words, sizeof words, offsetof(PriorityActivity, held_ns));
}

bool read_activity(int fd, PriorityActivity* out) noexcept {
  ssize_t n;
  do {
    n = pread(fd, out, sizeof *out, 0);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof *out)) return false;
  return out->magic == kPriorityMagic && out->abi_version == kPriorityAbiVersion && out->size == sizeof *out;
}

void close_peers(PeerFile* files, int* count) noexcept {
  for (int i = 0; i < *count; ++i) {
    if (files[i].fd >= 0) close(files[i].fd);
    files[i] = PeerFile{};
  }
  *count = 0;
}

bool scan_level(const char* board, Priority level, const char* uuid_text, const char* own_name, PeerFile* files,
                int* count, int cap) noexcept {
  char dir[kBoardPathMax];
  if (!level_dir(board, level, dir)) return false;
  const int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    // Nobody of that level has published yet: forget what we had.
    int kept = 0;
    for (int i = 0; i < *count; ++i) {
      if (files[i].level == level) {
        close(files[i].fd);
      } else {
        files[kept++] = files[i];
      }
    }
    *count = kept;
    return false;
  }
  for (int i = 0; i < *count; ++i) files[i].seen = files[i].level != level;
  const std::size_t uuid_len = std::strlen(uuid_text);
  alignas(8) char buf[4096];
  for (;;) {
    const long n = syscall(SYS_getdents64, dfd, buf, sizeof buf);
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      struct Entry {
        std::uint64_t ino;
        std::int64_t off;
        unsigned short reclen;
        unsigned char type;
        char name[1];
      };
      const Entry* e = reinterpret_cast<const Entry*>(buf + off);
      off += e->reclen;
      const std::size_t len = strnlen(e->name, 256);
      if (len <= uuid_len + 1 || std::memcmp(e->name, uuid_text, uuid_len) != 0 || e->name[uuid_len] != '.' ||
          !ends_with(e->name, len, ".act") || (own_name != nullptr && std::strcmp(e->name, own_name) == 0))
        continue;
      const int fd = openat(dfd, e->name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      if (fd < 0) continue;
      struct stat st;
      if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        continue;
      }
      bool known = false;
      for (int i = 0; i < *count; ++i) {
        if (files[i].level == level && files[i].dev == st.st_dev && files[i].ino == st.st_ino) {
          files[i].seen = true;
          known = true;
        }
      }
      if (known || *count >= cap) {
        close(fd);
        continue;
      }
      files[*count] = PeerFile{fd, level, static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino), true};
      ++*count;
    }
  }
  close(dfd);
  int kept = 0;
  for (int i = 0; i < *count; ++i) {
    if (files[i].seen) {
      files[kept++] = files[i];
    } else {
      close(files[i].fd);
    }
  }
  *count = kept;
  return true;
}

}  // namespace gpuslice::shm
