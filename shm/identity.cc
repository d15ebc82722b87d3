// Process identity (pid, pid namespace, start time) and the one rule of
// liveness (region_file.h: judge_liveness).
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
  platform::procfs::Process f;
  // Another user's process: the ns link needs ptrace access; the start time
  // alone is still an identity, with an unknown namespace.
  if (platform::procfs::read_process(pid, true, &f) != 0) return false;
  // /proc mounted for another pid namespace (a container given the host's
  // /proc): /proc/<pid> would name other processes, so we know nothing.
  if (self && f.stat.pid != out->pid) return false;
  out->start_time = f.stat.start_time;
  out->pidns_inode = f.pidns_inode;
  return true;
}

Liveness judge_liveness(const platform::procfs::Process& facts, std::uint64_t pidns_inode, std::uint64_t start_time,
                        SlotLock lock, std::uint64_t start_time_mask) noexcept {
  if (lock == SlotLock::held) return Liveness::alive;
  if (facts.error == ENOENT || facts.error == ESRCH) return Liveness::dead;
  if (facts.error != 0) return Liveness::alive;  // exists, unreadable: cannot prove it dead
  if (facts.pidns_inode != 0 && pidns_inode != 0 && facts.pidns_inode != pidns_inode) return Liveness::dead;
  if (start_time != 0 && (facts.stat.start_time & start_time_mask) != start_time) return Liveness::dead;  // pid reused
  // A zombie has released its device memory with its address space; its
  // parent may never wait for it (a container without an init). But /proc/<pid>
  // is the thread group's leader: after a SIGKILL (or pthread_exit in main) the
  // leader is a zombie while other threads still run the exit — and still hold
  // the address space and the device memory — for a while (or, after a
  // pthread_exit, for as long as they run). num_threads counts the group's
  // threads, the zombie leader included: 1 only once all are gone.
  const char state = facts.stat.state;
  if (state == 'Z' || state == 'X' || state == 'x') {
    return facts.stat.num_threads > 1 ? Liveness::alive : Liveness::dead;
  }
  return Liveness::alive;
}

namespace {

// The rule applied to what the observer's /proc says of pid, which speaks
// for the observer's own pid namespace only.
Liveness observe(std::uint32_t pid, std::uint64_t pidns_inode, std::uint64_t start_time,
                 const ProcessIdentity& observer, SlotLock lock, std::uint64_t start_time_mask) noexcept {
  if (lock == SlotLock::held) return Liveness::alive;  // no /proc read needed
  if (pid == 0 || pidns_inode == 0 || observer.pidns_inode == 0 || pidns_inode != observer.pidns_inode) {
    return Liveness::unknown;
  }
  platform::procfs::Process facts;
  platform::procfs::read_process(pid, false, &facts);
  return judge_liveness(facts, pidns_inode, start_time, lock, start_time_mask);
}

}  // namespace

Liveness identity_liveness(std::uint32_t pid, std::uint64_t pidns_inode, std::uint64_t start_time,
                           const ProcessIdentity& observer, std::uint64_t start_time_mask) noexcept {
  return observe(pid, pidns_inode, start_time, observer, SlotLock::unknown, start_time_mask);
}

Liveness slot_liveness(const Slot& s, const Observer& observer, SlotLock lock) noexcept {
  return observe(s.pid.load(), s.pidns_inode.load(), s.start_time.load(), observer, lock, ~std::uint64_t{0});
}

}  // namespace gpuslice::shm
