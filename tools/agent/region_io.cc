#include "region_io.h"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "platform/clock.h"
#include "platform/uuid.h"
#include "shm/region_file.h"
#include "text.h"

namespace gpuslice::agent {
namespace {

thread_local sigjmp_buf* t_guard = nullptr;
struct sigaction g_previous_sigbus;
std::once_flag g_guard_once;
std::atomic<bool> g_guard_installed{false};

void on_sigbus(int sig, siginfo_t* info, void* uctx) {
  if (sigjmp_buf* guard = t_guard; guard != nullptr) {
    t_guard = nullptr;
    siglongjmp(*guard, 1);
  }
  // Not ours: behave as if we had never been installed.
  if (g_previous_sigbus.sa_flags & SA_SIGINFO) {
    if (g_previous_sigbus.sa_sigaction != nullptr) {
      g_previous_sigbus.sa_sigaction(sig, info, uctx);
      return;
    }
  } else if (g_previous_sigbus.sa_handler != SIG_DFL && g_previous_sigbus.sa_handler != SIG_IGN) {
    g_previous_sigbus.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);
  raise(SIGBUS);
}

// validate_header's messages start "gpuslice: region header: ".
std::string strip_prefix(const char* message) {
  static const char kPrefix[] = "gpuslice: region header: ";
  if (std::strncmp(message, kPrefix, sizeof kPrefix - 1) == 0) return message + sizeof kPrefix - 1;
  return message;
}

std::string errno_message(const char* what, int err) { return std::string(what) + ": " + std::strerror(err); }

}  // namespace

void install_fault_guard() {
  std::call_once(g_guard_once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous_sigbus);
    g_guard_installed.store(true, std::memory_order_release);
  });
}

// The signal mask is not saved here (sigsetjmp's second argument 0: saving
// it is a system call, and a cycle makes several guarded reads per region).
// It need not be: the handler runs with SA_NODEFER and an empty sa_mask, so
// the kernel delivers SIGBUS without changing the thread's mask, and the jump
// out of the handler leaves the mask as it was when fn started. On that rare
// path SIGBUS is unblocked explicitly all the same.
bool run_guarded(void (*fn)(void*), void* ctx) noexcept {
  if (!g_guard_installed.load(std::memory_order_acquire)) install_fault_guard();
  sigjmp_buf buf;
  sigjmp_buf* const outer = t_guard;
  if (sigsetjmp(buf, 0) != 0) {
    t_guard = outer;
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
    return false;
  }
  t_guard = &buf;
  fn(ctx);
  t_guard = outer;
  return true;
}

MappedRegion::~MappedRegion() { reset(); }

MappedRegion::MappedRegion(MappedRegion&& other) noexcept
    : region_(other.region_), fd_(other.fd_), writable_(other.writable_), device_(other.device_), inode_(other.inode_) {
  other.region_ = nullptr;
  other.fd_ = -1;
}

MappedRegion& MappedRegion::operator=(MappedRegion&& other) noexcept {
  if (this != &other) {
    reset();
    region_ = other.region_;
    fd_ = other.fd_;
    writable_ = other.writable_;
    device_ = other.device_;
    inode_ = other.inode_;
    other.region_ = nullptr;
    other.fd_ = -1;
  }
  return *this;
}

void MappedRegion::adopt(Region* region, int fd, bool writable, dev_t device, ino_t inode) {
  reset();
  region_ = region;
  fd_ = fd;
  writable_ = writable;
  device_ = device;
  inode_ = inode;
}

void MappedRegion::reset() {
  if (region_ != nullptr) munmap(region_, sizeof(Region));
  if (fd_ >= 0) close(fd_);
  region_ = nullptr;
  fd_ = -1;
}

namespace {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// Maps [begin, end) of a writable shared mapping by write faults (no data is
// written); false where the kernel cannot (then reads fault the pages in).
bool populate(void* base, std::size_t begin, std::size_t end) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t first = begin / page * page;
  return madvise(static_cast<char*>(base) + first, end - first, MADV_POPULATE_WRITE) == 0;
}

}  // namespace

void MappedRegion::map_slots(const std::vector<std::uint16_t>& slots) const {
  if (region_ == nullptr || !writable_) return;
  release_slot_pages();
  populate(region_, 0, offsetof(Region, slots));  // the header and device entries (sharing a page with slot 0)
  for (const std::uint16_t i : slots) {
    if (i >= kMaxSlots) continue;
    const std::size_t at = offsetof(Region, slots) + std::size_t{i} * sizeof(Slot);
    if (!populate(region_, at, at + sizeof(Slot))) return;
  }
}

void MappedRegion::release_slot_pages() const {
  if (region_ == nullptr) return;
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t start = offsetof(Region, slots) / page * page;
  madvise(reinterpret_cast<char*>(region_) + start, sizeof(Region) - start, MADV_DONTNEED);
}

bool MappedRegion::unlinked() const {
  struct stat st {};
  return fd_ >= 0 && fstat(fd_, &st) == 0 && st.st_nlink == 0;
}

bool open_region(int dirfd, const char* name, bool writable, bool follow_symlinks, MappedRegion* out, std::string* why,
                 bool* missing) {
  out->reset();
  if (missing != nullptr) *missing = false;
  int flags = (writable ? O_RDWR : O_RDONLY) | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;
  if (!follow_symlinks) flags |= O_NOFOLLOW;
  const int fd = openat(dirfd, name, flags);
  if (fd < 0) {
    const int err = errno;
    if (missing != nullptr) *missing = err == ENOENT;
    if (err == ELOOP && !follow_symlinks) {
      *why = "is a symbolic link, expected a regular region file (links are not followed)";
    } else {
      *why = errno_message(writable ? "cannot open for writing" : "cannot open", err) +
             (err == ENOENT ? ", expected an existing region file" : ", expected a readable region file");
    }
    return false;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    *why = errno_message("cannot stat", errno) + ", expected a readable region file";
    close(fd);
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = "not a regular file, expected a gpuslice region file";
    close(fd);
    return false;
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size != sizeof(Region)) {
    // Never map a file of the wrong size: read its head for the best message.
    unsigned char head[sizeof(RegionHeader)] = {};
    const ssize_t n = pread(fd, head, sizeof head, 0);
    close(fd);
    shm::Error err{};
    char size_message[160];
    std::snprintf(size_message, sizeof size_message, "wrong size: file holds %llu bytes, expected %zu bytes",
                  static_cast<unsigned long long>(size), sizeof(Region));
    if (n < 0) {
      *why = errno_message("cannot read", errno) + ", expected a readable region file";
    } else if (!shm::validate_header(head, static_cast<std::size_t>(n), &err) &&
               std::strstr(err.message, ": wrong size") == nullptr) {
      *why = strip_prefix(err.message);  // not even a good header: say what is wrong with it
    } else {
      *why = size_message;
    }
    return false;
  }
  void* p = mmap(nullptr, sizeof(Region), writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *why = errno_message("cannot map", errno) + ", expected a mappable region file";
    close(fd);
    return false;
  }
  MappedRegion mapped;
  mapped.adopt(static_cast<Region*>(p), fd, writable, st.st_dev, st.st_ino);
  if (!revalidate(mapped.get(), why)) return false;
  *out = std::move(mapped);
  return true;
}

bool revalidate(const Region* r, std::string* why) {
  shm::Error err{};
  bool valid = false;
  if (!guarded([&] { valid = shm::validate_header(r, sizeof(Region), &err); })) {
    *why = "the file shrank while mapped (truncated by its owner?), expected a region file of fixed size";
    return false;
  }
  if (!valid) *why = strip_prefix(err.message);
  return valid;
}

std::string format_uuid(const std::uint8_t uuid[16]) {
  char text[platform::kUuidTextSize];
  platform::format_uuid(uuid, text);
  return text;
}

bool parse_uuid(const char* text, std::uint8_t out[16]) { return platform::parse_uuid(text, out); }

std::string printable(const char* data, std::size_t max_bytes) {
  return tools::escape_untrusted(std::string_view(data, strnlen(data, max_bytes)));
}

std::uint64_t monotonic_ns() { return platform::monotonic_ns(); }

}  // namespace gpuslice::agent
