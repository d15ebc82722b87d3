// Process identity (pid, pid namespace, start time) and liveness.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "shm/region_file.h"
#include "shm/text.h"

namespace gpuslice::shm {
namespace {

struct StatFields {
  std::uint32_t pid;          // field 1, as the /proc mount's namespace sees it
  char state;                 // field 3
  std::uint64_t start_time;   // field 22
};

void proc_path(char* buf, std::size_t cap, std::uint32_t pid, const char* leaf) {
  Text t(buf, cap);
  t.str("/proc/");
  if (pid == 0) {
    t.str("self");
  } else {
    t.u64(pid);
  }
  t.ch('/').str(leaf);
}

// 0 on success, else the errno of the failure (ENOENT/ESRCH: no such process;
// EINVAL: unparsable).
int read_stat(std::uint32_t pid, StatFields* out) {
  char path[64];
  proc_path(path, sizeof path, pid, "stat");
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  // comm is at most 16 bytes and the other 50 fields are numbers: 1 KiB holds
  // the line up to field 22 with a wide margin.
  char buf[1024];
  std::size_t len = 0;
  while (len < sizeof buf - 1) {
    const ssize_t n = read(fd, buf + len, sizeof buf - 1 - len);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      close(fd);
      return e;
    }
    if (n == 0) break;
    len += static_cast<std::size_t>(n);
  }
  close(fd);
  buf[len] = '\0';

  std::uint64_t pid_field = 0;
  std::size_t i = 0;
  for (; i < len && buf[i] >= '0' && buf[i] <= '9'; ++i) pid_field = pid_field * 10 + static_cast<unsigned>(buf[i] - '0');
  // comm is "(...)" and may itself contain spaces and parentheses: the fields
  // resume after the *last* ')'.
  std::size_t close_paren = len;
  for (std::size_t j = len; j > 0; --j) {
    if (buf[j - 1] == ')') {
      close_paren = j - 1;
      break;
    }
  }
  if (close_paren == len || i == 0) return EINVAL;
  std::size_t p = close_paren + 1;
  int field = 2;
  std::uint64_t value = 0;
  char state = 0;
  while (p < len) {
    if (buf[p] == ' ') {
      ++field;
      ++p;
      if (field == 3 && p < len) state = buf[p];
      continue;
    }
    if (field == 22) {
      if (buf[p] < '0' || buf[p] > '9') break;
      value = value * 10 + static_cast<unsigned>(buf[p] - '0');
    } else if (field > 22) {
      break;
    }
    ++p;
  }
  if (field < 22) return EINVAL;
  out->pid = static_cast<std::uint32_t>(pid_field);
  out->state = state;
  out->start_time = value;
  return 0;
}

}  // namespace

bool read_identity(std::uint32_t pid, ProcessIdentity* out) noexcept {
  const bool self = pid == 0;
  out->pid = self ? static_cast<std::uint32_t>(getpid()) : pid;
  out->pidns_inode = 0;
  out->start_time = 0;
  StatFields f{};
  if (read_stat(pid, &f) != 0) return false;
  // /proc mounted for another pid namespace (a container given the host's
  // /proc): /proc/<pid> would name other processes, so we know nothing.
  if (self && f.pid != out->pid) return false;
  out->start_time = f.start_time;
  char path[64];
  proc_path(path, sizeof path, pid, "ns/pid");
  struct stat st;
  // Another user's process: the ns link needs ptrace access; the start time
  // alone is still an identity, with an unknown namespace.
  if (stat(path, &st) == 0) out->pidns_inode = static_cast<std::uint64_t>(st.st_ino);
  return true;
}

Liveness identity_liveness(std::uint32_t pid, std::uint64_t pidns_inode, std::uint64_t start_time,
                           const ProcessIdentity& observer, std::uint64_t start_time_mask) noexcept {
  if (pid == 0 || pidns_inode == 0 || observer.pidns_inode == 0 || pidns_inode != observer.pidns_inode) {
    return Liveness::unknown;
  }
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return Liveness::dead;
  StatFields f{};
  const int e = read_stat(pid, &f);
  if (e == ENOENT || e == ESRCH) return Liveness::dead;  // exited between kill() and open()
  if (e != 0) return Liveness::alive;                     // exists, unreadable: cannot prove it dead
  // A zombie has released its device memory with its address space; its
  // parent may never wait for it (a container without an init).
  if (f.state == 'Z' || f.state == 'X' || f.state == 'x') return Liveness::dead;
  if (start_time != 0 && (f.start_time & start_time_mask) != start_time) return Liveness::dead;  // pid reused
  return Liveness::alive;
}

Liveness slot_liveness(const Slot& s, const ProcessIdentity& observer) noexcept {
  return identity_liveness(s.pid.load(), s.pidns_inode.load(), s.start_time.load(), observer);
}

}  // namespace gpuslice::shm
