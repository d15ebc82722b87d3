// The priority board's lease files. See priority_lease.h and docs/priority.md.
#include "shm/priority_lease.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstddef>

#include <cstring>

#include "platform/clock.h"
#include "platform/ofd_lock.h"
#include "platform/text.h"
#include "shm/priority_board.h"

namespace gpuslice::shm {

namespace {

void fail(Error* err, const char* path, const char* what, int error) noexcept {
  if (err == nullptr) return;
  platform::Text t(err->message, sizeof err->message);
  t.str("gpuslice: priority lease ").escaped(path).str(": ").str(what);
  if (error != 0) t.str(": ").errno_text(error);
}

std::uint64_t own_user_byte() noexcept { return kLeaseUserBase + static_cast<std::uint64_t>(getpid()); }

// <board>/<level> and <uuid> + kLeaseSuffix; false when too long.
bool lease_path(const char* board, Priority level, const char* uuid_text, char (&dir)[kBoardPathMax],
                char (&name)[kBoardNameMax]) noexcept {
  platform::Text d(dir, sizeof dir);
  d.str(board).ch('/').str(level_directory(level));
  platform::Text n(name, sizeof name);
  n.str(uuid_text).str(kLeaseSuffix);
  return !d.truncated() && !n.truncated();
}

bool full_pread(int fd, void* data, std::size_t size) noexcept {
  ssize_t n;
  do {
    n = pread(fd, data, size, 0);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(size);
}

}  // namespace

int open_lease(const char* board, Priority level, const char uuid_text[platform::kUuidTextSize], Error* err) noexcept {
  char dir[kBoardPathMax], name[kBoardNameMax];
  if (!lease_path(board, level, uuid_text, dir, name)) {
    fail(err, board, "path too long", 0);
    return -1;
  }
  if (mkdir(dir, 01777) == 0) chmod(dir, 01777);  // as open_own_activity: not through the umask
  const int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    fail(err, dir, "cannot open the level directory", errno);
    return -1;
  }
  int fd = openat(dfd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd >= 0) {
    fchmod(fd, 0644);  // whatever the umask: writable by its owner only
  } else if (errno == EEXIST) {
    fd = openat(dfd, name, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  }
  const int e = errno;
  close(dfd);
  if (fd < 0) {
    fail(err, dir, "cannot open the level's lease file, expected a writable level directory", e);
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    // Another user's file could be written by that user: never relied on.
    close(fd);
    fail(err, dir, "the lease file is not a regular file of this user", 0);
    return -1;
  }
  platform::ofd_lock::take(fd, platform::ofd_lock::Kind::read, own_user_byte(), 1);
  return fd;
}

bool lease_unlinked(int fd) noexcept {
  struct stat st;
  return fstat(fd, &st) == 0 && st.st_nlink == 0;
}

bool lease_shared(int fd) noexcept {
  return platform::ofd_lock::probe(fd, kLeaseUserBase, 0) == platform::ofd_lock::Probe::held;
}

bool lease_user_alive(int fd, std::uint32_t pid) noexcept {
  return platform::ofd_lock::probe(fd, kLeaseUserBase + pid, 1) != platform::ofd_lock::Probe::free;
}

bool remove_lease(const char* board, Priority level, const char uuid_text[platform::kUuidTextSize], int fd) noexcept {
  if (fd < 0) return false;
  platform::ofd_lock::drop(fd, own_user_byte(), 1);
  struct stat own;
  if (fstat(fd, &own) != 0 || own.st_nlink == 0) return false;
  if (platform::ofd_lock::probe(fd, kLeaseUserBase, 0) != platform::ofd_lock::Probe::free) return false;
  char dir[kBoardPathMax], name[kBoardNameMax];
  if (!lease_path(board, level, uuid_text, dir, name)) return false;
  const int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) return false;
  struct stat named;
  bool removed = false;
  if (fstatat(dfd, name, &named, AT_SYMLINK_NOFOLLOW) == 0 && named.st_dev == own.st_dev && named.st_ino == own.st_ino)
    removed = unlinkat(dfd, name, 0) == 0;
  close(dfd);
  return removed;
}

bool lock_lease(int fd, unsigned tries) noexcept {
  for (unsigned i = 0; i < tries; ++i) {
    if (platform::ofd_lock::take(fd, platform::ofd_lock::Kind::write, kLeaseLockByte, 1)) return true;
    if (platform::ofd_lock::probe(fd, kLeaseLockByte, 1) == platform::ofd_lock::Probe::unknown) return false;
    platform::sleep_ns(10'000);
  }
  return false;
}

void unlock_lease(int fd) noexcept { platform::ofd_lock::drop(fd, kLeaseLockByte, 1); }

void read_lease(int fd, PriorityLease* out) noexcept {
  if (!full_pread(fd, out, sizeof *out) || out->magic != kLeaseMagic || out->abi_version != kLeaseAbiVersion ||
      out->size != sizeof *out)
    std::memset(out, 0, sizeof *out);  // new or truncated: nothing booked
}

bool write_lease(int fd, PriorityLease rec) noexcept {
  rec.magic = kLeaseMagic;
  rec.abi_version = kLeaseAbiVersion;
  rec.size = sizeof rec;
  rec.booker_pid = static_cast<std::uint32_t>(getpid());
  ssize_t n;
  do {
    n = pwrite(fd, &rec, sizeof rec, 0);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof rec);
}

const std::uint32_t* map_wake_word(int fd) noexcept {
  if (fd < 0) return nullptr;
  void* page = mmap(nullptr, sizeof(PriorityLease), PROT_READ, MAP_SHARED, fd, 0);
  if (page == MAP_FAILED) return nullptr;
  return reinterpret_cast<const std::uint32_t*>(static_cast<const char*>(page) + offsetof(PriorityLease, wake_seq));
}

void unmap_wake_word(const std::uint32_t* word) noexcept {
  if (word == nullptr) return;
  munmap(const_cast<char*>(reinterpret_cast<const char*>(word)) - offsetof(PriorityLease, wake_seq),
         sizeof(PriorityLease));
}

Wake wait_wake(const std::uint32_t* word, std::uint32_t seen, std::uint64_t timeout_ns) noexcept {
  if (word == nullptr) return Wake::unavailable;
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1'000'000'000);
  // Shared (no FUTEX_PRIVATE_FLAG): the key is the file's page, the same in
  // every process that maps it. A relative timeout: always bounded.
  const long rc = syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);
  if (rc == 0) return Wake::woken;
  switch (errno) {
    case EAGAIN:  // the word moved since it was read: a launch went
    case EINTR: return Wake::moved;
    case ETIMEDOUT: return Wake::timeout;
    default: return Wake::unavailable;  // EFAULT (truncated), ENOSYS
  }
}

int wake_one(const std::uint32_t* word) noexcept {
  if (word == nullptr) return 0;
  const long n = syscall(SYS_futex, word, FUTEX_WAKE, 1, nullptr, nullptr, 0);
  return n > 0 ? static_cast<int>(n) : 0;
}

}  // namespace gpuslice::shm
