// Creating, validating and mapping the region file.
#include "shm/region_file.h"

#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "platform/clock.h"
#include "platform/fs.h"
#include "platform/text.h"

namespace gpuslice::shm {
namespace {

constexpr std::size_t kPathCap = 4096;
constexpr std::size_t kRegionBytes = sizeof(Region);
// How long an attach keeps trying a region that is being removed or replaced.
constexpr std::uint64_t kAttachPatienceNs = 2'000'000'000;

// Starts "gpuslice: GPUSLICE_REGION=<path>: "; the caller appends
// "<what is wrong>, expected <what>".
platform::Text region_error(Error* err, const char* path) {
  platform::Text t(err->message, sizeof err->message);
  t.str("gpuslice: GPUSLICE_REGION=").escaped(path, 160).str(": ");
  return t;
}

template <class T>
T load_field(const unsigned char* data, std::size_t offset) {
  T v;
  std::memcpy(&v, data + offset, sizeof v);
  return v;
}

// data holds `avail` bytes of a file of `file_size` bytes. Appends
// "<what is wrong>, expected <what>" to t on failure.
bool validate_impl(const unsigned char* data, std::size_t avail, std::uint64_t file_size, platform::Text& t) {
  const std::uint64_t want_size = kRegionBytes;
  if (avail < sizeof(std::uint64_t)) {
    t.str("file holds only ")
        .u64(file_size)
        .str(" bytes (truncated, or not a region file), expected a gpuslice region of ")
        .u64(want_size)
        .str(" bytes");
    return false;
  }
  const auto magic = load_field<std::uint64_t>(data, offsetof(RegionHeader, magic));
  if (magic != kRegionMagic) {
    t.str("bad magic ")
        .hex(magic)
        .str(" (not a gpuslice region; another program's file?), expected magic ")
        .hex(kRegionMagic)
        .str(" (\"GPUSSLCE\")");
    return false;
  }
  if (avail < sizeof(RegionHeader)) {
    t.str("truncated header: file holds ")
        .u64(file_size)
        .str(" bytes, expected a gpuslice region of ")
        .u64(want_size)
        .str(" bytes");
    return false;
  }
  const auto abi = load_field<std::uint32_t>(data, offsetof(RegionHeader, abi_version));
  if (abi != kRegionAbiVersion) {
    t.str("region ABI version ")
        .u64(abi)
        .str(" (created by another gpuslice release), expected version ")
        .u64(kRegionAbiVersion)
        .str(": run one release per region file, or use another GPUSLICE_REGION");
    return false;
  }
  const auto header_size = load_field<std::uint32_t>(data, offsetof(RegionHeader, header_size));
  if (header_size != sizeof(RegionHeader)) {
    t.str("header_size ").u64(header_size).str(", expected ").u64(sizeof(RegionHeader));
    return false;
  }
  const auto total_size = load_field<std::uint64_t>(data, offsetof(RegionHeader, total_size));
  if (total_size != want_size) {
    t.str("total_size ").u64(total_size).str(", expected ").u64(want_size);
    return false;
  }
  const auto max_devices = load_field<std::uint32_t>(data, offsetof(RegionHeader, max_devices));
  if (max_devices != kMaxDevices) {
    t.str("max_devices ").u64(max_devices).str(", expected ").u64(kMaxDevices);
    return false;
  }
  const auto max_slots = load_field<std::uint32_t>(data, offsetof(RegionHeader, max_slots));
  if (max_slots != kMaxSlots) {
    t.str("max_slots ").u64(max_slots).str(", expected ").u64(kMaxSlots);
    return false;
  }
  if (file_size != want_size) {
    t.str("wrong size: file holds ").u64(file_size).str(" bytes, expected total_size ").u64(want_size).str(" bytes");
    return false;
  }
  const unsigned char* name = data + offsetof(RegionHeader, container_name);
  if (std::memchr(name, 0, sizeof(RegionHeader::container_name)) == nullptr) {
    t.str("container_name is not NUL-terminated, expected at most ")
        .u64(sizeof(RegionHeader::container_name) - 1)
        .str(" bytes and a NUL");
    return false;
  }
  return true;
}

Region* map_fd(int fd, bool writable) {
  void* p = mmap(nullptr, kRegionBytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<Region*>(p);
}

// Validates and maps an open region file.
Region* map_existing(int fd, const char* path, bool writable, Error* err) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    region_error(err, path).str("cannot stat: ").errno_text(errno).str(", expected a readable region file");
    return nullptr;
  }
  if (!S_ISREG(st.st_mode)) {
    region_error(err, path).str("not a regular file, expected a gpuslice region file");
    return nullptr;
  }
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size != kRegionBytes) {
    // Never map a file of the wrong size (touching past its end raises
    // SIGBUS): read what is there for the most useful message.
    unsigned char head[sizeof(RegionHeader)];
    ssize_t n = pread(fd, head, sizeof head, 0);
    platform::Text t = region_error(err, path);
    if (n < 0) {
      t.str("cannot read: ").errno_text(errno).str(", expected a readable region file");
      return nullptr;
    }
    if (validate_impl(head, static_cast<std::size_t>(n), file_size, t)) {
      t.str("wrong size ").u64(file_size).str(", expected ").u64(kRegionBytes);  // unreachable: size checked
    }
    return nullptr;
  }
  Region* r = map_fd(fd, writable);
  if (r == nullptr) {
    region_error(err, path).str("cannot map: ").errno_text(errno).str(", expected a mappable region file");
    return nullptr;
  }
  platform::Text t = region_error(err, path);
  if (!validate_impl(reinterpret_cast<const unsigned char*>(r), kRegionBytes, file_size, t)) {
    munmap(r, kRegionBytes);
    return nullptr;
  }
  err->message[0] = '\0';
  return r;
}

std::atomic<std::uint32_t> g_temp_counter{0};

// A directory several users may create files in: world-writable, and sticky
// (/dev/shm, /tmp, the directories we create: none may remove another's
// files) or another user's (its owner, or anyone without the sticky bit, may
// replace files in it). A region there is its creator's alone (0600) and
// another user's region there is never joined. A world-writable directory
// without the sticky bit of root's or our own is a container's (HAMi's
// per-container directories are 0777): its owner decided who reaches it.
bool shared_by_users(const struct stat& st) {
  if (!S_ISDIR(st.st_mode) || (st.st_mode & S_IWOTH) == 0) return false;
  return (st.st_mode & S_ISVTX) != 0 || (st.st_uid != 0 && st.st_uid != geteuid());
}

// Where a region file lies: its directory, opened once (mkdir -p when asked:
// directories we create are made 01777 on their descriptor, like /tmp), and
// every later operation relative to that descriptor, never the path again.
struct Place {
  int dfd = -1;
  const char* base = nullptr;  // the file's name in it
  bool shared = false;         // shared_by_users
  char dir[kPathCap];          // for messages
};

bool open_place(const char* path, Place* place, Error* err) {
  const std::size_t len = platform::bounded_len(path, kPathCap - 1);
  std::memcpy(place->dir, path, len);
  place->dir[len] = '\0';
  char* slash = std::strrchr(place->dir, '/');
  place->base = slash == nullptr ? path : path + (slash - place->dir) + 1;
  if (slash == nullptr) {
    place->dir[0] = '.';
    place->dir[1] = '\0';
  } else {
    slash[slash == place->dir ? 1 : 0] = '\0';
  }
  if (*place->base == '\0') {
    region_error(err, path).str("names a directory, expected a file path");
    return false;
  }
  const platform::MadeDir made = platform::make_dirs(place->dir, 01777);
  if (made.fd < 0) {
    char part[kPathCap];
    platform::copy_string(part, made.at < sizeof part ? made.at + 1 : sizeof part, place->dir);
    region_error(err, path)
        .str("its directory ")
        .escaped(part, 100)
        .ch(' ')
        .str(made.what)
        .str(": ")
        .errno_text(made.error)
        .str(", expected an existing or creatable directory");
    return false;
  }
  place->dfd = made.fd;
  struct stat st;
  place->shared = fstat(place->dfd, &st) == 0 && shared_by_users(st);
  return true;
}

void initialise(Region* r, const char* container_name) {
  // The file is fresh (all zeros) and invisible to everybody until link().
  RegionHeader& h = r->header;
  h.abi_version = kRegionAbiVersion;
  h.header_size = sizeof(RegionHeader);
  h.total_size = kRegionBytes;
  h.max_devices = kMaxDevices;
  h.max_slots = kMaxSlots;
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  h.created_ns = static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(ts.tv_nsec);
  if (container_name != nullptr) platform::copy_string(h.container_name, sizeof h.container_name, container_name);
  h.magic = kRegionMagic;
}

enum class CreateResult { created, lost_race, failed };

// Builds a complete region in a temporary file of the same directory and
// publishes it with link() (atomic, fails if the name exists): nobody can
// ever map a half-initialised region, and exactly one creator wins.
CreateResult create_region(const Place& place, const char* path, const char* container_name, Error* err, Region** out,
                           int* keep_fd) {
  char temp[NAME_MAX + 1];
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    platform::Text name(temp, sizeof temp);
    name.ch('.')
        .str(place.base)
        .ch('.')
        .u64(static_cast<std::uint64_t>(getpid()))
        .ch('-')
        .u64(g_temp_counter.fetch_add(1, std::memory_order_relaxed))
        .str(".tmp");
    if (name.truncated()) {
      region_error(err, path)
          .str("file name too long for a temporary file next to it, expected at most ")
          .u64(NAME_MAX - 40)
          .str(" bytes");
      return CreateResult::failed;
    }
    fd = platform::open_at(place.dfd, temp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW, 0600);
    if (fd < 0 && errno != EEXIST) {
      const int e = errno;
      region_error(err, path)
          .str("cannot create a file in ")
          .escaped(place.dir, 100)
          .str(": ")
          .errno_text(e)
          .str(", expected a directory writable by uid ")
          .u64(getuid());
      return CreateResult::failed;
    }
  }
  if (fd < 0) {
    region_error(err, path).str("cannot pick a temporary file name, expected a usable directory");
    return CreateResult::failed;
  }

  auto fail = [&](const char* what, int e) {
    region_error(err, path)
        .str(what)
        .str(": ")
        .errno_text(e)
        .str(", expected ")
        .u64(kRegionBytes)
        .str(" bytes of free space in ")
        .escaped(place.dir, 100);
    close(fd);
    unlinkat(place.dfd, temp, 0);
    return CreateResult::failed;
  };
  // Every process of the container shares the region whatever its uid or
  // umask (a root entrypoint that drops to a user is the common case): the
  // mode is set explicitly, never through the process's umask, which the
  // library does not touch. In a directory shared by the node's users
  // (shared_by_users) the region is its creator's alone: 0600, so that
  // another user can neither join the job's region nor change its limits
  // (docs/security.md, "Who may join or change a region").
  const mode_t mode = place.shared ? 0600 : 0666;
  if (fchmod(fd, mode) != 0) {
    const int e = errno;
    region_error(err, path)
        .str(mode == 0600 ? "cannot make the new region file 0600: " : "cannot make the new region file 0666: ")
        .errno_text(e)
        .str(", expected a file system with Unix permissions");
    close(fd);
    unlinkat(place.dfd, temp, 0);
    return CreateResult::failed;
  }
  // Reserve the blocks now: on a full tmpfs a sparse file would raise SIGBUS
  // at the first touch of an unbacked page, long after start-up.
  if (fallocate(fd, 0, 0, static_cast<off_t>(kRegionBytes)) != 0) {
    const int e = errno;
    if (e != EOPNOTSUPP && e != ENOSYS && e != EINVAL) return fail("cannot allocate the region file", e);
    if (ftruncate(fd, static_cast<off_t>(kRegionBytes)) != 0) return fail("cannot size the region file", errno);
  }
  Region* r = map_fd(fd, true);
  if (r == nullptr) return fail("cannot map the new region file", errno);
  initialise(r, container_name);

  // The library's join (keep_fd) holds the joining lock from before the file
  // has a name: the agent never removes it before our slot is claimed.
  if (keep_fd != nullptr) (void)begin_attach(fd);
  int rc = linkat(place.dfd, temp, place.dfd, place.base, 0);
  int link_errno = rc == 0 ? 0 : errno;
  bool temp_consumed = false;
  if (rc != 0 && link_errno != EEXIST) {
    // File systems without hard links: an atomic rename that refuses to
    // replace an existing name gives the same guarantee.
    rc = static_cast<int>(syscall(SYS_renameat2, place.dfd, temp, place.dfd, place.base, 1u /* RENAME_NOREPLACE */));
    if (rc == 0) temp_consumed = true;
    if (rc != 0 && errno == EEXIST) link_errno = EEXIST;
  }
  if (!temp_consumed) unlinkat(place.dfd, temp, 0);
  if (rc == 0 && keep_fd != nullptr) {
    *keep_fd = fd;
  } else {
    close(fd);
  }
  if (rc == 0) {
    *out = r;
    return CreateResult::created;
  }
  munmap(r, kRegionBytes);
  if (link_errno == EEXIST) return CreateResult::lost_race;
  region_error(err, path)
      .str("cannot publish the new region (link): ")
      .errno_text(link_errno)
      .str(", expected a file system with hard links or renameat2");
  return CreateResult::failed;
}

// A process joining a region in a directory shared by users joins only its
// own user's (or root's): another user could have created it there first,
// and would then control this job's limits.
bool owned_by_us_or_root(int fd, const Place& place, const char* path, Error* err) {
  struct stat st;
  if (!place.shared || fstat(fd, &st) != 0 || st.st_uid == geteuid() || st.st_uid == 0) return true;
  region_error(err, path)
      .str("owned by uid ")
      .u64(st.st_uid)
      .str(" in ")
      .escaped(place.dir, 100)
      .str(
          ", a directory every user may write (world-writable, and sticky or another user's), expected a region of "
          "uid ")
      .u64(geteuid())
      .str(" or root: another user's region is never joined (docs/security.md)");
  return false;
}

// The library's join (keep_fd): takes the joining lock (shm::begin_attach),
// then checks that the name still names the file opened and that it is still
// linked: a region the agent renamed away or unlinked between our open and
// our lock is never joined (the caller opens the name again).
// A remover holds the lock for one rename or unlink, but may be descheduled
// meanwhile (a loaded node, an agent being killed): past a few yields the
// joiner sleeps 1 ms a look, until the attach's deadline.
bool joined(int fd, const Place& place, std::uint64_t deadline_ns) {
  Join j = begin_attach(fd);
  for (int spin = 0; j == Join::removing; ++spin) {
    if (spin < 64) {
      sched_yield();
    } else if (platform::monotonic_ns() < deadline_ns) {
      platform::sleep_ns(1'000'000);
    } else {
      break;
    }
    j = begin_attach(fd);
  }
  if (j == Join::removing) return false;
  struct stat own {};
  struct stat named {};
  if (fstat(fd, &own) == 0 && own.st_nlink > 0 &&
      fstatat(place.dfd, place.base, &named, place.shared ? AT_SYMLINK_NOFOLLOW : 0) == 0 &&
      named.st_dev == own.st_dev && named.st_ino == own.st_ino)
    return true;
  end_attach(fd);
  return false;
}

Region* attach_at(const Place& place, const char* path, const char* container_name, bool create, bool writable,
                  Error* err, bool* created, int* keep_fd) {
  // Never blocks (a FIFO planted under the name); in a directory shared by
  // users never through a symbolic link (someone else's).
  const int flags = (writable ? O_RDWR : O_RDONLY) | O_NONBLOCK | (place.shared ? O_NOFOLLOW : 0);
  // A creator that loses the race, or a region deleted between our open and
  // our link, sends us round again; a few rounds settle any real race. Past
  // eight, a round every millisecond until 2 s from the start: a remover
  // (the agent) descheduled between its lock, its rename and its unlink must
  // not fail a process's start.
  const std::uint64_t deadline_ns = platform::monotonic_ns() + kAttachPatienceNs;
  for (int round = 0; round < 8 || platform::monotonic_ns() < deadline_ns; ++round) {
    if (round >= 8) platform::sleep_ns(1'000'000);
    const int fd = create ? platform::open_at(place.dfd, place.base, flags) : platform::open_at(AT_FDCWD, path, flags);
    if (fd >= 0) {
      if (create && !owned_by_us_or_root(fd, place, path, err)) {
        close(fd);
        return nullptr;
      }
      Region* r = map_existing(fd, path, writable, err);
      if (r != nullptr && keep_fd != nullptr && place.dfd >= 0 && !joined(fd, place, deadline_ns)) {
        detach(r);  // being removed: open the name again (a new region, or the old one put back)
        close(fd);
        continue;
      }
      if (r != nullptr && keep_fd != nullptr) {
        *keep_fd = fd;
      } else {
        close(fd);
      }
      return r;
    }
    const int e = errno;
    if (e != ENOENT || !create) {
      platform::Text t = region_error(err, path);
      t.str("cannot open: ").errno_text(e).str(", expected ");
      if (e == ELOOP && place.shared)
        t.str("a region file, never a symbolic link in a directory shared by users");
      else
        t.str(create ? "a region file readable and writable by uid " : "an existing region file readable by uid ")
            .u64(getuid());
      return nullptr;
    }
    Region* r = nullptr;
    switch (create_region(place, path, container_name, err, &r, keep_fd)) {
      case CreateResult::created:
        if (created != nullptr) *created = true;
        err->message[0] = '\0';
        return r;
      case CreateResult::failed: return nullptr;
      case CreateResult::lost_race: break;
    }
  }
  region_error(err, path).str("the file keeps appearing and disappearing, expected a stable region file");
  return nullptr;
}

Region* attach_impl(const char* path, const char* container_name, bool create, bool writable, Error* err, bool* created,
                    int* keep_fd = nullptr) {
  if (created != nullptr) *created = false;
  if (keep_fd != nullptr) *keep_fd = -1;
  err->message[0] = '\0';
  if (path == nullptr || *path == '\0') {
    region_error(err, "").str("empty path, expected a region file path");
    return nullptr;
  }
  if (platform::bounded_len(path, kPathCap) >= kPathCap - 64) {
    region_error(err, path).str("path too long, expected at most ").u64(kPathCap - 64).str(" bytes");
    return nullptr;
  }
  // A process that creates looks up and creates the file relative to its
  // directory's descriptor (never the path again: no swap of a directory
  // between a check and a use).
  Place place;
  if (create && !open_place(path, &place, err)) return nullptr;
  Region* r = attach_at(place, path, container_name, create, writable, err, created, keep_fd);
  if (place.dfd >= 0) close(place.dfd);
  return r;
}

}  // namespace

Region* create_private(const char* container_name, Error* err) noexcept {
  void* p = mmap(nullptr, kRegionBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    platform::Text t(err->message, sizeof err->message);
    t.str("gpuslice: cannot map a private region: ").errno_text(errno);
    return nullptr;
  }
  Region* r = static_cast<Region*>(p);
  initialise(r, container_name);
  return r;
}

Region* attach(const char* path, const char* container_name, Error* err, bool* created) noexcept {
  return attach_impl(path, container_name, true, true, err, created);
}

Region* attach(const char* path, const char* container_name, Error* err) noexcept {
  return attach_impl(path, container_name, true, true, err, nullptr);
}

Region* attach(const char* path, const char* container_name, Error* err, bool* created, int* fd) noexcept {
  return attach_impl(path, container_name, true, true, err, created, fd);
}

bool mapped_file_intact(int fd, const char* path, Error* err) noexcept {
  struct stat st;
  if (fstat(fd, &st) != 0) return true;  // cannot tell: the mapping itself is unaffected by an fstat failure
  if (static_cast<std::uint64_t>(st.st_size) != kRegionBytes) {
    region_error(err, path)
        .str("the file was truncated to ")
        .u64(static_cast<std::uint64_t>(st.st_size))
        .str(" bytes while in use, expected ")
        .u64(kRegionBytes)
        .str(" bytes");
    return false;
  }
  std::uint64_t magic = 0;
  if (pread(fd, &magic, sizeof magic, 0) == static_cast<ssize_t>(sizeof magic) && magic != kRegionMagic) {
    region_error(err, path)
        .str("the file was truncated and overwritten while in use (magic ")
        .hex(magic)
        .str("), expected magic ")
        .hex(kRegionMagic);
    return false;
  }
  return true;
}

Region* attach_existing(const char* path, bool writable, Error* err) noexcept {
  return attach_impl(path, nullptr, false, writable, err, nullptr);
}

int reopen(int fd, const char* path) noexcept {
  struct stat want;
  if (fd < 0 || fstat(fd, &want) != 0) return -1;
  char self[40];
  platform::Text(self, sizeof self).str("/proc/self/fd/").u64(static_cast<std::uint64_t>(fd));
  for (const char* name : {static_cast<const char*>(self), path}) {
    if (name == nullptr) continue;
    const int again = platform::open_at(AT_FDCWD, name, O_RDWR | O_NONBLOCK);
    if (again < 0) continue;
    struct stat got;
    if (fstat(again, &got) == 0 && got.st_dev == want.st_dev && got.st_ino == want.st_ino) return again;
    close(again);
  }
  return -1;
}

bool rejoin(int fd, const char* path) noexcept {
  if (fd < 0 || path == nullptr || *path == '\0' || platform::bounded_len(path, kPathCap) >= kPathCap - 64)
    return false;
  Error err{};
  Place place;
  if (!open_place(path, &place, &err)) return false;
  const bool ok = joined(fd, place, platform::monotonic_ns() + kAttachPatienceNs);
  close(place.dfd);
  return ok;
}

bool validate_header(const void* data, std::size_t size, Error* err) noexcept {
  platform::Text t(err->message, sizeof err->message);
  t.str("gpuslice: region header: ");
  if (data == nullptr) size = 0;
  if (!validate_impl(static_cast<const unsigned char*>(data), size, size, t)) return false;
  err->message[0] = '\0';
  return true;
}

void detach(Region* r) noexcept {
  if (r != nullptr) munmap(r, kRegionBytes);
}

}  // namespace gpuslice::shm
