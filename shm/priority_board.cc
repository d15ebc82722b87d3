// The priority board's files. See priority_board.h and docs/priority.md.
#include "shm/priority_board.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstring>

#include "platform/fs.h"
#include "platform/ofd_lock.h"
#include "platform/text.h"

namespace gpuslice::shm {

namespace {

// This process's liveness byte of an activity file (hold_liveness).
std::uint64_t own_liveness_byte() noexcept { return kPriorityLivenessBase + static_cast<std::uint64_t>(getpid()); }

void fail(Error* err, const char* path, const char* what, int error, const char* expected = nullptr) noexcept {
  if (err == nullptr) return;
  platform::Text t(err->message, sizeof err->message);
  t.str("gpuslice: priority board ").escaped(path).str(": ").str(what);
  if (error != 0) t.str(": ").errno_text(error);
  if (expected != nullptr) t.str(", expected ").str(expected);
}

constexpr const char* kBoardExpected = "a board directory (created if missing) this process may search";
constexpr const char* kLevelExpected = "a level directory (created if missing, never a symbolic link) of the board";

bool level_dir(const char* board, Priority level, char out[kBoardPathMax]) noexcept {
  platform::Text t(out, kBoardPathMax);
  t.str(board).ch('/').str(level_directory(level));
  return !t.truncated();
}

void level_fail(Error* err, const char* dir, const char* what, std::uint64_t uid, std::uint64_t board_uid) noexcept {
  if (err == nullptr) return;
  platform::Text t(err->message, sizeof err->message);
  t.str("gpuslice: priority board ").escaped(dir).str(": ").str(what).u64(uid);
  t.str(", expected root or the board's owner (uid ").u64(board_uid);
  t.str("): the owner of a level directory may remove every activity file in it");
}

// <board>/<level> as a directory this process may use, or -1 (+ err when not
// null). Never through a symbolic link; only when root or the board's owner
// owns it: a directory's owner may remove any file in it, sticky bit or not,
// so another user's level directory would let that user remove every
// activity file in it (the board's owner has that power over the whole board
// anyway). `create`: creates the board (mkdir -p, 01777 set on descriptors)
// with its three levels when missing, and a missing level when this process
// is root or the board's owner.
int open_level(const char* board, Priority level, bool create, char dir[kBoardPathMax], Error* err) noexcept {
  if (!level_dir(board, level, dir)) {
    fail(err, board, "path too long, expected at most 4000 characters", 0);
    return -1;
  }
  int bfd = -1;
  bool board_created = false;
  if (create) {
    const platform::MadeDir made = platform::make_dirs(board, 01777);
    if (made.fd < 0) {
      char part[kBoardPathMax];
      platform::copy_string(part, made.at < sizeof part ? made.at + 1 : sizeof part, board);
      fail(err, part, made.what, made.error, kBoardExpected);
      return -1;
    }
    bfd = made.fd;
    board_created = made.created;
  } else {
    bfd = platform::open_at(AT_FDCWD, board, O_PATH | O_DIRECTORY);  // searching it needs no read permission
    if (bfd < 0) {
      fail(err, board, "cannot open the board directory", errno, kBoardExpected);
      return -1;
    }
  }
  struct stat bst;
  if (fstat(bfd, &bst) != 0) {
    fail(err, board, "cannot look at the board directory", errno, kBoardExpected);
    close(bfd);
    return -1;
  }
  const char* name = level_directory(level);
  int fd = -1;
  if (board_created) {
    // Ours: all three levels at once, so that they are the board owner's.
    for (Priority l : {Priority::high, Priority::normal, Priority::low}) {
      const platform::MadeDir made = platform::make_dir_at(bfd, level_directory(l), 01777, false);
      if (l == level) {
        fd = made.fd;
        if (fd < 0) fail(err, dir, made.what, made.error, kLevelExpected);
      } else if (made.fd >= 0) {
        close(made.fd);
      }
    }
  } else {
    fd = platform::open_at(bfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (fd < 0 && errno == ENOENT && create) {
      if (geteuid() != 0 && geteuid() != bst.st_uid) {
        level_fail(err, dir, "does not exist, and this process may not create it: it would be owned by uid ", geteuid(),
                   bst.st_uid);
      } else {
        const platform::MadeDir made = platform::make_dir_at(bfd, name, 01777, false);
        fd = made.fd;
        if (fd < 0) fail(err, dir, made.what, made.error, kLevelExpected);
      }
    } else if (fd < 0) {
      fail(err, dir, "cannot open the level directory", errno, kLevelExpected);
    }
  }
  close(bfd);
  if (fd < 0) return -1;
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode)) {
    fail(err, dir, "cannot look at the level directory", errno, kLevelExpected);
    close(fd);
    return -1;
  }
  if (st.st_uid != 0 && st.st_uid != bst.st_uid) {
    level_fail(err, dir, "owned by uid ", st.st_uid, bst.st_uid);
    close(fd);
    return -1;
  }
  return fd;
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

bool activity_name(const char uuid_text[platform::kUuidTextSize], std::uint64_t region_dev, std::uint64_t region_ino,
                   char out[kBoardNameMax]) noexcept {
  char dev[24], ino[24];
  platform::Text d(dev, sizeof dev), i(ino, sizeof ino);
  d.hex(region_dev);
  i.hex(region_ino);
  platform::Text t(out, kBoardNameMax);
  t.str(uuid_text).ch('.').str(dev + 2).ch('-').str(ino + 2).str(".act");  // without the 0x prefixes
  return !t.truncated();
}

int open_own_activity(const char* board, Priority level, const char* name, const char* container_name,
                      Error* err) noexcept {
  char dir[kBoardPathMax];
  // Sticky and world-writable like /dev/shm when we create it (set with
  // fchmod, not through the umask): a deployment that restricts levels
  // creates (or mounts) the directories itself.
  const int dfd = open_level(board, level, true, dir, err);
  if (dfd < 0) return -1;
  int fd = -1;
  bool created = false;
  int e = 0;
  for (int attempt = 0; attempt < 4 && fd < 0; ++attempt) {
    fd = platform::open_at(dfd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd >= 0) {
      created = true;
      hold_liveness(fd);  // at once: a process of the container opening it now must not think it nobody's
      fchmod(fd, 0644);   // whatever the umask: readable by every reader, writable by its owner only
      break;
    }
    e = errno;
    if (e != EEXIST) break;
    fd = platform::open_at(dfd, name, O_RDWR | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
      e = errno;
      if (e == ENOENT) continue;  // removed meanwhile: create it
      if (e != EACCES && e != EPERM && e != ELOOP) break;
      // Not ours (another user's, or a link): replace it if we may remove it.
      if (unlinkat(dfd, name, 0) == 0) continue;
      e = errno;
      break;
    }
    struct stat st;
    const bool foreign = fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid();
    if (foreign || !any_writer_alive(fd)) {
      // Another uid's file (it could write what we publish), not a regular
      // file, or nobody's any more: a new file, so that readers notice.
      close(fd);
      fd = -1;
      if (unlinkat(dfd, name, 0) != 0 && errno != ENOENT) {
        e = errno;
        if (!foreign) {  // ours, but we may not remove it: use it as it is
          fd = platform::open_at(dfd, name, O_RDWR | O_NOFOLLOW | O_NONBLOCK);
          e = errno;
        }
        break;
      }
    }
  }
  close(dfd);
  if (fd < 0) {
    fail(err, dir,
         "cannot create this container's activity file, expected a writable level directory with no file of "
         "another user in its place",
         e);
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
  if (created || static_cast<std::size_t>(st.st_size) < sizeof rec || !read_activity(fd, &rec)) {
    // New (or garbage): a complete record in one write. Two processes of the
    // container racing here write the same header.
    std::memset(&rec, 0, sizeof rec);
    rec.magic = kPriorityMagic;
    rec.abi_version = kPriorityAbiVersion;
    rec.size = sizeof rec;
    platform::copy_string(rec.container_name, sizeof rec.container_name,
                          container_name != nullptr ? container_name : "");
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
  return platform::ofd_lock::take(fd, platform::ofd_lock::Kind::read, own_liveness_byte(), 1);
}

bool write_activity(int fd, Priority level, std::uint64_t active_until_ns, std::uint64_t last_launch_ns) noexcept {
  // One pwrite from `level` to `last_launch_ns`: a reader sees the writer and
  // its word together (a process killed mid-way cannot pair its pid with
  // another process's word).
  struct {
    std::uint32_t level, writer_pid;
    std::uint64_t active_until_ns, last_launch_ns;
  } words{static_cast<std::uint32_t>(level), static_cast<std::uint32_t>(getpid()), active_until_ns, last_launch_ns};
  static_assert(sizeof words == 24 &&
                offsetof(PriorityActivity, last_launch_ns) - offsetof(PriorityActivity, level) == 16);
  return write_all(fd, &words, sizeof words, offsetof(PriorityActivity, level));
}

bool writer_alive(int fd, const PriorityActivity& rec) noexcept {
  if (rec.writer_pid == 0) return true;
  return platform::ofd_lock::probe(fd, kPriorityLivenessBase + rec.writer_pid, 1) != platform::ofd_lock::Probe::free;
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

bool any_writer_alive(int fd) noexcept {
  // From the first liveness byte to the end of any file.
  return platform::ofd_lock::probe(fd, kPriorityLivenessBase, 0) != platform::ofd_lock::Probe::free;
}

bool remove_own_activity(const char* board, Priority level, const char* name, int fd) noexcept {
  if (fd < 0) return false;
  platform::ofd_lock::drop(fd, own_liveness_byte(), 1);
  struct stat own;
  if (fstat(fd, &own) != 0 || own.st_nlink == 0) return false;
  // Another process of the container still lives: it keeps the file. (One
  // that opens it between this look and the unlink finds it unlinked at its
  // next refresh and creates a new one.)
  if (any_writer_alive(fd)) return false;
  char dir[kBoardPathMax];
  const int dfd = open_level(board, level, false, dir, nullptr);
  if (dfd < 0) return false;
  struct stat named;
  bool removed = false;
  if (fstatat(dfd, name, &named, AT_SYMLINK_NOFOLLOW) == 0 && named.st_dev == own.st_dev && named.st_ino == own.st_ino)
    removed = unlinkat(dfd, name, 0) == 0;
  close(dfd);
  return removed;
}

bool unlink_activity(const char* board, Priority level, const char* name, int fd) noexcept {
  struct stat own;
  if (fd < 0 || fstat(fd, &own) != 0 || own.st_nlink == 0) return false;
  char dir[kBoardPathMax];
  const int dfd = open_level(board, level, false, dir, nullptr);
  if (dfd < 0) return false;
  struct stat named;
  bool removed = false;
  if (fstatat(dfd, name, &named, AT_SYMLINK_NOFOLLOW) == 0 && named.st_dev == own.st_dev && named.st_ino == own.st_ino)
    removed = unlinkat(dfd, name, 0) == 0;
  close(dfd);
  return removed;
}

namespace {

std::int64_t ts_ns(const struct timespec& t) noexcept {
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

std::int64_t realtime_ns() noexcept {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return ts_ns(t);
}

void drop(LevelScan* s, int i) noexcept {
  if (s->files[i].fd >= 0) close(s->files[i].fd);
  s->files[i] = s->files[s->count - 1];
  s->files[s->count - 1] = PeerFile{};
  --s->count;
}

void reset(LevelScan* s) noexcept {
  while (s->count > 0) drop(s, s->count - 1);
  if (s->dfd >= 0) close(s->dfd);
  s->dfd = -1;
  s->dir_dev = s->dir_ino = 0;
  s->settled_mtime_ns = -1;
  s->in_pass = false;
  s->want_pass = false;
}

// One candidate name of a pass: into the table when a live process holds it,
// removed when it is stale and nobody holds it.
void visit(LevelScan* s, Priority level, const char* name, std::int64_t now, bool can_reap, ScanCost& c) noexcept {
  struct stat st;
  ++c.stats;
  if (fstatat(s->dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) return;
  for (int i = 0; i < s->count; ++i) {
    if (s->files[i].dev == static_cast<std::uint64_t>(st.st_dev) &&
        s->files[i].ino == static_cast<std::uint64_t>(st.st_ino)) {
      s->files[i].seen = true;
      return;
    }
  }
  const bool old = now - ts_ns(st.st_mtim) >= kReapAgeNs;
  const bool record = static_cast<std::size_t>(st.st_size) >= sizeof(PriorityActivity);
  if (!record) {
    // Never a record, and long enough ago that no writer is filling it in.
    if (old && can_reap && c.reaped < kScanReaps && unlinkat(s->dfd, name, 0) == 0) ++c.reaped;
    return;
  }
  // A full table: a place frees when one of its files goes (that sets
  // want_pass); looking again before would only repeat this pass.
  if (s->count >= kLevelPeers && !(old && can_reap)) return;
  ++c.opens;
  const int fd = platform::open_at(s->dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return;
  struct stat fst;
  if (fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode) || fst.st_dev != st.st_dev || fst.st_ino != st.st_ino) {
    close(fd);
    return;
  }
  if (!any_writer_alive(fd)) {
    // Nobody's: its container is gone (or it was never anybody's).
    if (old && can_reap && c.reaped < kScanReaps && unlinkat(s->dfd, name, 0) == 0) ++c.reaped;
    close(fd);
    return;
  }
  if (s->count >= kLevelPeers) {
    close(fd);
    return;
  }
  s->files[s->count++] =
      PeerFile{fd, level, static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino), true};
}

}  // namespace

void close_level(LevelScan* scan) noexcept { reset(scan); }

bool scan_level(const char* board, Priority level, const char* uuid_text, const char* own_name, LevelScan* s,
                ScanCost* cost) noexcept {
  ScanCost local;
  ScanCost& c = cost != nullptr ? *cost : local;
  c = ScanCost{};
  char dir[kBoardPathMax];
  if (!level_dir(board, level, dir)) return false;
  struct stat ds;
  if (stat(dir, &ds) != 0 || !S_ISDIR(ds.st_mode)) {  // nobody of that level has published yet
    reset(s);
    return false;
  }
  if (s->dfd < 0 || s->dir_dev != static_cast<std::uint64_t>(ds.st_dev) ||
      s->dir_ino != static_cast<std::uint64_t>(ds.st_ino)) {
    reset(s);  // a new directory (created, replaced or remounted): a new table
    // Through the board (never a link, only root's or the board owner's).
    s->dfd = open_level(board, level, false, dir, nullptr);
    if (s->dfd < 0) return false;
    struct stat opened;
    if (fstat(s->dfd, &opened) != 0) {
      reset(s);
      return false;
    }
    s->dir_dev = static_cast<std::uint64_t>(opened.st_dev);
    s->dir_ino = static_cast<std::uint64_t>(opened.st_ino);
    ds = opened;
  }
  // The table: files unlinked, or whose writers are all gone, leave it.
  for (int i = s->count - 1; i >= 0; --i) {
    struct stat fst;
    if (fstat(s->files[i].fd, &fst) != 0 || fst.st_nlink == 0 || !any_writer_alive(s->files[i].fd)) {
      drop(s, i);
      s->want_pass = true;
    }
  }
  const std::int64_t mtime = ts_ns(ds.st_mtim);
  const std::int64_t now = realtime_ns();
  if (!s->in_pass) {
    if (mtime == s->settled_mtime_ns && !s->want_pass) return true;  // nothing new
    if (lseek(s->dfd, 0, SEEK_SET) != 0) {
      reset(s);
      return false;
    }
    s->in_pass = true;
    s->want_pass = false;
    s->pass_mtime_ns = mtime;
    s->pass_begin_ns = now;
    for (int i = 0; i < s->count; ++i) s->files[i].seen = false;
  }
  const bool can_reap = faccessat(AT_FDCWD, dir, W_OK, AT_EACCESS) == 0;
  const std::size_t uuid_len = std::strlen(uuid_text);
  alignas(8) char buf[4096];
  bool end = false;
  while (c.entries < kScanEntries && c.opens < kScanOpens) {
    const long n = syscall(SYS_getdents64, s->dfd, buf, sizeof buf);
    ++c.dir_reads;
    if (n <= 0) {
      end = true;
      break;
    }
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
      ++c.entries;
      const std::size_t len = strnlen(e->name, 256);
      if (len <= uuid_len + 1 || std::memcmp(e->name, uuid_text, uuid_len) != 0 || e->name[uuid_len] != '.' ||
          !ends_with(e->name, len, ".act") || (own_name != nullptr && std::strcmp(e->name, own_name) == 0))
        continue;
      if (e->type != DT_REG && e->type != DT_UNKNOWN) continue;
      visit(s, level, e->name, now, can_reap, c);
    }
  }
  if (!end) return true;  // the pass goes on at the next call
  s->in_pass = false;
  c.passed = true;
  for (int i = s->count - 1; i >= 0; --i)
    if (!s->files[i].seen) drop(s, i);
  // Settled when nothing changed during the pass and the last change is old
  // enough that the file system's coarse time stamp cannot hide a later one.
  struct stat after;
  if (fstat(s->dfd, &after) == 0 && ts_ns(after.st_mtim) == s->pass_mtime_ns &&
      s->pass_begin_ns - s->pass_mtime_ns >= kScanSettleNs)
    s->settled_mtime_ns = s->pass_mtime_ns;
  else
    s->settled_mtime_ns = -1;
  return true;
}

}  // namespace gpuslice::shm
