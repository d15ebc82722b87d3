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
// Against the kernel of the machine it runs on; the simulator plays no part.
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

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

}  // namespace

int locks_main(int n) {
  if (n < 1 || n > 4096) return 2;
  const char* dir = getenv("TMPDIR");
  std::string name = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/gpuslice-startup-locks-XXXXXX";
  char* path = name.data();
  const int made = mkstemp(path);
  if (made < 0) return 1;
  close(made);
  int ready[2];
  if (pipe(ready) != 0) return 1;
  std::vector<pid_t> holders;
  int rc = 0;
  for (int i = 0; i < n && rc == 0; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int fd = open(path, O_RDWR);
      flock f = range(F_WRLCK, kBase + n - 1 - i, 1);
      const char ok = fd >= 0 && fcntl(fd, F_OFD_SETLK, &f) == 0 ? 'y' : 'n';
      if (write(ready[1], &ok, 1) != 1) _exit(1);
      pause();
      _exit(0);
    }
    if (pid < 0) rc = 1;
    holders.push_back(pid);
    char ok = 'n';
    if (rc == 0 && (read(ready[0], &ok, 1) != 1 || ok != 'y')) rc = 1;
  }
  const int fd = rc == 0 ? open(path, O_RDWR) : -1;
  if (fd < 0) rc = 1;
  double single = 1e18, whole = 1e18, free_byte = 1e18, take_drop = 1e18;
  long reported = -1;
  bool all_held = true;
  for (int round = 0; round < 7 && rc == 0; ++round) {
    double t = now_us();
    for (int b = 0; b < n; ++b) all_held = all_held && probe(fd, kBase + b, 1).l_type == F_WRLCK;
    single = std::min(single, now_us() - t);
    t = now_us();
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
  for (pid_t pid : holders) {
    if (pid > 0) kill(pid, SIGKILL);
  }
  for (pid_t pid : holders) {
    int status = 0;
    if (pid > 0) waitpid(pid, &status, 0);
  }
  unlink(path);
  if (rc != 0 || !all_held) {
    std::fprintf(stderr, "locks %d: %s\n", n, rc != 0 ? "could not start the holders" : "a probe answered wrong");
    return 1;
  }
  std::printf(
      "locks=%d single_probes_total_us=%.0f range_probe_us=%.2f range_reports_byte=%ld free_probe_us=%.2f "
      "take_drop_us=%.2f\n",
      n, single, whole, reported, free_byte, take_drop);
  return 0;
}
