// gpuslice-startup-cpu locks N: what a slot-lock probe costs beside N live
// processes, and what one probe can tell (docs/scale.md, "Start-up beside
// live processes"). N children each take an open-file-description write lock
// on one byte of one file, in the reverse order of the bytes (the last byte
// first), as live processes hold their slots' locks on the region file. Then,
// through a description of our own, best of seven rounds, in µs:
//   single_probes_total_us  F_OFD_GETLK of every held byte, one after another
//                           (what a full reaper pass does)
//   range_probe_us          one F_OFD_GETLK over all N bytes
//   range_reports_byte      the byte of the lock that range probe reports: the
//                           lock first taken (byte N-1), not the lowest byte
//   free_probe_us           F_OFD_GETLK of a byte nobody holds
//   take_drop_us            F_OFD_SETLK of a read lock on a free byte, then
//                           F_UNLCK (what a start does to join and claim)
//   in_order_probes_us      single_probes_total_us again, N new holders
//                           locking the bytes in their order (the first byte
//                           first, as the simulator's processes hold theirs)
//   interleaved_probes_us   the same, each holder locking a byte of a second
//                           file just before (as a wrapped process holds its
//                           region slot's lock before the simulator's): the
//                           same walks over the same number of locks, whose
//                           records lie every other one in the kernel's memory
// and what judging the N holders one by one costs by other means, each a
// floor under any O(N) pass (the walk above is quadratic, but at N = 1,023
// these cost as much; best of seven rounds, totals over the N holders):
//   kill_total_us           kill(pid, 0) each: cannot tell a zombie or a
//                           reused pid from a live process
//   pidfd_total_us          pidfd_open, poll (readable once it exited), close
//                           each: tells a zombie, not a reused pid (-1: no
//                           pidfd_open, Linux < 5.3)
//   stat_read_total_us      platform::procfs::read_stat each (the read and
//                           parse of /proc/<pid>/stat that shm::judge_liveness
//                           makes for a slot not held)
//   own_file_probes_us      open, F_OFD_GETLK, close of a file of each
//                           holder's own, holding one lock (the walk is one
//                           lock long: a lock file per slot)
// Against the kernel of the machine it runs on; the simulator plays no part.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "platform/procfs.h"

namespace {

double now_us() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) * 1e6 + static_cast<double>(t.tv_nsec) / 1e3;
}

flock range(short type, off_t start, off_t len) {
  flock f{};
  f.l_type = type;
  f.l_whence = SEEK_SET;
  f.l_start = start;
  f.l_len = len;
  return f;
}

// The lock F_OFD_GETLK reports on [start, start + len), or l_type F_UNLCK.
flock probe(int fd, off_t start, off_t len) {
  flock f = range(F_WRLCK, start, len);
  if (fcntl(fd, F_OFD_GETLK, &f) != 0) f.l_type = -1;
  return f;
}

constexpr off_t kBase = 4096;  // the held bytes: kBase .. kBase + N - 1

// N children, each holding a write lock on one byte of `path` (the last byte
// first, or the first first) and, with `other`, first one on a byte of
// `other`; false if one failed.
bool start_holders(const char* path, const char* other, int n, bool last_first, std::vector<pid_t>* holders) {
  int ready[2];
  if (pipe(ready) != 0) return false;
  bool ok_all = true;
  for (int i = 0; i < n && ok_all; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      bool ok = true;
      if (other != nullptr) {
        const int ofd = open(other, O_RDWR);
        flock f = range(F_WRLCK, kBase + i, 1);
        ok = ofd >= 0 && fcntl(ofd, F_OFD_SETLK, &f) == 0;
      }
      const int fd = open(path, O_RDWR);
      flock f = range(F_WRLCK, last_first ? kBase + n - 1 - i : kBase + i, 1);
      const char c = ok && fd >= 0 && fcntl(fd, F_OFD_SETLK, &f) == 0 ? 'y' : 'n';
      if (write(ready[1], &c, 1) != 1) _exit(1);
      pause();
      _exit(0);
    }
    if (pid < 0) ok_all = false;
    holders->push_back(pid);
    char c = 'n';
    if (ok_all && (read(ready[0], &c, 1) != 1 || c != 'y')) ok_all = false;
  }
  close(ready[0]);
  close(ready[1]);
  return ok_all;
}

void stop_holders(std::vector<pid_t>* holders) {
  for (pid_t pid : *holders) {
    if (pid > 0) kill(pid, SIGKILL);
  }
  for (pid_t pid : *holders) {
    int status = 0;
    if (pid > 0) waitpid(pid, &status, 0);
  }
  holders->clear();
}

// Best of seven rounds of a probe of every held byte, one after another, in µs.
double all_single_probes(int fd, int n, bool* all_held) {
  double best = 1e18;
  for (int round = 0; round < 7; ++round) {
    const double t = now_us();
    for (int b = 0; b < n; ++b) *all_held = *all_held && probe(fd, kBase + b, 1).l_type == F_WRLCK;
    best = std::min(best, now_us() - t);
  }
  return best;
}

// Best of seven rounds of `judge` over every holder, in µs; false from judge
// marks the figure wrong.
template <typename Judge>
double each_holder(const std::vector<pid_t>& holders, bool* all_right, Judge judge) {
  double best = 1e18;
  for (int round = 0; round < 7; ++round) {
    const double t = now_us();
    for (std::size_t i = 0; i < holders.size(); ++i) *all_right = judge(i, holders[i]) && *all_right;
    best = std::min(best, now_us() - t);
  }
  return best;
}

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

// A live holder's pidfd polls not readable; -1 where pidfd_open is missing.
int pidfd_alive(pid_t pid) {
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return -1;
  pollfd p{fd, POLLIN, 0};
  const int ready = poll(&p, 1, 0);
  close(fd);
  return ready == 0 ? 1 : 0;
}

// The other means of judging the N holders of `path` (the comment above).
struct OtherMeans {
  double kill_total = -1, pidfd_total = -1, stat_total = -1, own_file_total = -1;
};

bool other_means(const std::string& path, int n, OtherMeans* out) {
  std::vector<pid_t> holders;
  bool right = start_holders(path.c_str(), nullptr, n, false, &holders);
  if (right) {
    out->kill_total = each_holder(holders, &right, [](std::size_t, pid_t pid) { return kill(pid, 0) == 0; });
    if (pidfd_alive(holders[0]) >= 0)
      out->pidfd_total = each_holder(holders, &right, [](std::size_t, pid_t pid) { return pidfd_alive(pid) == 1; });
    out->stat_total = each_holder(holders, &right, [](std::size_t, pid_t pid) {
      gpuslice::platform::procfs::Stat st{};
      return gpuslice::platform::procfs::read_stat(static_cast<std::uint32_t>(pid), &st) == 0;
    });
  }
  stop_holders(&holders);
  // A file of each holder's own, one lock on it.
  std::vector<std::string> own;
  for (int i = 0; i < n && right; ++i) {
    own.push_back(path + "-own-" + std::to_string(i));
    const int made = open(own.back().c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    right = made >= 0;
    if (made >= 0) close(made);
  }
  for (int i = 0; i < n && right; ++i) {
    std::vector<pid_t> one;
    right = start_holders(own[static_cast<std::size_t>(i)].c_str(), nullptr, 1, false, &one);
    holders.insert(holders.end(), one.begin(), one.end());
  }
  if (right) {
    out->own_file_total = each_holder(holders, &right, [&own](std::size_t i, pid_t) {
      const int fd = open(own[i].c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) return false;
      const bool held = probe(fd, kBase, 1).l_type == F_WRLCK;
      close(fd);
      return held;
    });
  }
  stop_holders(&holders);
  for (const std::string& file : own) unlink(file.c_str());
  return right;
}

}  // namespace

int locks_main(int n) {
  if (n < 1 || n > 4096) return 2;
  const char* dir = getenv("TMPDIR");
  std::string name = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/gpuslice-startup-locks-XXXXXX";
  char* path = name.data();
  const int made = mkstemp(path);
  if (made < 0) return 1;
  close(made);
  std::vector<pid_t> holders;
  int rc = start_holders(path, nullptr, n, true, &holders) ? 0 : 1;
  const int fd = rc == 0 ? open(path, O_RDWR) : -1;
  if (fd < 0) rc = 1;
  double single = 1e18, whole = 1e18, free_byte = 1e18, take_drop = 1e18;
  long reported = -1;
  bool all_held = true;
  if (rc == 0) single = all_single_probes(fd, n, &all_held);
  for (int round = 0; round < 7 && rc == 0; ++round) {
    double t = now_us();
    for (int k = 0; k < 100; ++k) reported = static_cast<long>(probe(fd, kBase, n).l_start - kBase);
    whole = std::min(whole, (now_us() - t) / 100);
    t = now_us();
    for (int k = 0; k < 100; ++k) all_held = all_held && probe(fd, kBase + n + 1, 1).l_type == F_UNLCK;
    free_byte = std::min(free_byte, (now_us() - t) / 100);
    t = now_us();
    for (int k = 0; k < 100; ++k) {
      flock f = range(F_RDLCK, kBase + n + 1, 1);
      if (fcntl(fd, F_OFD_SETLK, &f) != 0) all_held = false;
      f.l_type = F_UNLCK;
      fcntl(fd, F_OFD_SETLK, &f);
    }
    take_drop = std::min(take_drop, (now_us() - t) / 100);
  }
  stop_holders(&holders);
  if (fd >= 0) close(fd);
  // Again, holders locking in the bytes' order, without and with a lock on a second file first.
  double in_order = 1e18, interleaved = 1e18;
  const std::string other_name = name + "-other";
  const int other_made = rc == 0 ? open(other_name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : -1;
  if (other_made < 0) rc = 1;
  if (other_made >= 0) close(other_made);
  for (double* figure : {&in_order, &interleaved}) {
    if (rc == 0 && !start_holders(path, figure == &interleaved ? other_name.c_str() : nullptr, n, false, &holders))
      rc = 1;
    const int again = rc == 0 ? open(path, O_RDWR) : -1;
    if (again >= 0) {
      *figure = all_single_probes(again, n, &all_held);
      close(again);
    } else {
      rc = 1;
    }
    stop_holders(&holders);
  }
  if (other_made >= 0) unlink(other_name.c_str());
  OtherMeans means;
  if (rc == 0 && !other_means(name, n, &means)) all_held = false;
  unlink(path);
  if (rc != 0 || !all_held) {
    std::fprintf(stderr, "locks %d: %s\n", n, rc != 0 ? "could not start the holders" : "a probe answered wrong");
    return 1;
  }
  std::printf(
      "locks=%d single_probes_total_us=%.0f range_probe_us=%.2f range_reports_byte=%ld free_probe_us=%.2f "
      "take_drop_us=%.2f in_order_probes_us=%.0f interleaved_probes_us=%.0f kill_total_us=%.0f "
      "pidfd_total_us=%.0f stat_read_total_us=%.0f own_file_probes_us=%.0f\n",
      n, single, whole, reported, free_byte, take_drop, in_order, interleaved, means.kill_total, means.pidfd_total,
      means.stat_total, means.own_file_total);
  return 0;
}
