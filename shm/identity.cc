// Process identity (pid, pid namespace, start time) and liveness.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "platform/procfs.h"
#include "shm/region_file.h"

namespace gpuslice::shm {

bool read_identity(std::uint32_t pid, ProcessIdentity* out) noexcept {
  const bool self = pid == 0;
  out->pid = self ? static_cast<std::uint32_t>(getpid()) : pid;
  out->pidns_inode = 0;
  out->start_time = 0;
  platform::procfs::Stat f;
  if (platform::procfs::read_stat(pid, &f) != 0) return false;
  // /proc mounted for another pid namespace (a container given the host's
  // /proc): /proc/<pid> would name other processes, so we know nothing.
  if (self && f.pid != out->pid) return false;
  out->start_time = f.start_time;
  char path[64];
  platform::procfs::path(path, sizeof path, pid, "ns/pid");
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
  platform::procfs::Stat f;
  const int e = platform::procfs::read_stat(pid, &f);
  if (e == ENOENT || e == ESRCH) return Liveness::dead;  // exited between kill() and open()
  if (e != 0) return Liveness::alive;                    // exists, unreadable: cannot prove it dead
  // A zombie has released its device memory with its address space; its
  // parent may never wait for it (a container without an init). But /proc/<pid>
  // is the thread group's leader: after a SIGKILL (or pthread_exit in main) the
  // leader is a zombie while other threads still run the exit — and still hold
  // the address space and the device memory — for a while. num_threads counts
  // the group's threads, the zombie leader included: 1 only once all are gone.
  if (f.state == 'Z' || f.state == 'X' || f.state == 'x') {
    return f.num_threads > 1 ? Liveness::alive : Liveness::dead;
  }
  if (start_time != 0 && (f.start_time & start_time_mask) != start_time) return Liveness::dead;  // pid reused
  return Liveness::alive;
}

Liveness slot_liveness(const Slot& s, const ProcessIdentity& observer) noexcept {
  return identity_liveness(s.pid.load(), s.pidns_inode.load(), s.start_time.load(), observer);
}

}  // namespace gpuslice::shm
