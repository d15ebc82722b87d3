// gpuslice-startup-cpu: the CPU time (user + system, getrusage) one process
// spends in cuInit, its primary context and its first cuMemAlloc while N other
// processes of the same container are alive and hold memory (issue 35:
// start-up flat in the number of live processes). Run with LD_PRELOAD set to
// libgpuslice.so and GPUSLICE_REGION / a quota in the environment (or without,
// for the driver's own figure); against the simulated driver its figures are
// the simulator's, never a GPU's.
//
//   gpuslice-startup-cpu hold           cuInit, a context, 1 MiB; print "ready"; wait for EOF on stdin
//   gpuslice-startup-cpu measure        print "cpu_us=<n>" for cuInit + context + first allocation,
//                                       then "meminfo_us=<n>" for the first cuMemGetInfo after them
//   gpuslice-startup-cpu run N [REPS]   start N holders, then REPS (default 9) measured processes,
//                                       one after another; print the median, the least and each figure
//   gpuslice-startup-cpu locks N        what a slot-lock probe costs beside N lock holders
//                                       (startup_cpu_locks.cc)
//
// STARTUP_CPU_APART=1: the holders use other simulator state files than the
// measured processes (other devices to the simulator, the same region to
// gpuslice), so that the simulator's own start does not grow with them and
// the difference to a native run is the library's alone.
#include <cuda.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

long g_minflt = 0;  // minor page faults, as of the last cpu_us()

long cpu_us() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  g_minflt = u.ru_minflt;
  return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1'000'000L + u.ru_utime.tv_usec + u.ru_stime.tv_usec;
}

// cuInit, the primary context of device 0 and 1 MiB: what every CUDA process does first.
bool start(CUdeviceptr* p) {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  return cuInit(0) == CUDA_SUCCESS && cuDeviceGet(&dev, 0) == CUDA_SUCCESS &&
         cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS &&
         cuMemAlloc(p, 1 << 20) == CUDA_SUCCESS;
}

int hold() {
  CUdeviceptr p = 0;
  const bool ok = start(&p);
  std::printf("%s\n", ok ? "ready" : "failed");
  std::fflush(stdout);
  char c;
  while (read(0, &c, 1) > 0) {}
  return ok ? 0 : 1;
}

int measure() {
  CUdeviceptr p = 0;
  const long before = cpu_us();
  const long faults_before = g_minflt;
  const bool ok = start(&p);
  const long after = cpu_us();
  const long faults = g_minflt - faults_before;
  // The first cuMemGetInfo, apart: a framework's sizing query.
  size_t free = 0, total = 0;
  const bool info = cuMemGetInfo(&free, &total) == CUDA_SUCCESS;
  const long queried = cpu_us();
  std::printf("%s cpu_us=%ld faults=%ld meminfo_us=%ld\n", ok && info ? "ok" : "failed", after - before, faults,
              queried - after);
  return ok ? 0 : 1;
}

// One child running `self mode`, its stdin and stdout pipes returned.
// The simulator holds 512 processes per state file: holders past the first
// 448 use another (another device to gpuslice, the same region).
pid_t spawn(const char* self, const char* mode, int state_file, int* to_child, int* from_child) {
  int in[2], out[2];
  if (pipe(in) != 0 || pipe(out) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    const char* state = getenv("FAKECUDA_STATE");
    if (state_file > 0 && state != nullptr)
      setenv("FAKECUDA_STATE", (std::string(state) + "." + std::to_string(state_file)).c_str(), 1);
    dup2(in[0], 0);
    dup2(out[1], 1);
    close(in[0]);
    close(in[1]);
    close(out[0]);
    close(out[1]);
    // STARTUP_CPU_WRAP (e.g. "valgrind --tool=callgrind"): the measured process runs under it.
    const char* wrap = getenv("STARTUP_CPU_WRAP");
    if (wrap != nullptr && std::strcmp(mode, "measure") == 0) {
      const std::string line = std::string(wrap) + " " + self + " " + mode;
      execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    }
    execl(self, self, mode, static_cast<char*>(nullptr));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  *to_child = in[1];
  *from_child = out[0];
  return pid;
}

std::string read_all(int fd, bool line_only) {
  std::string s;
  char c;
  while (read(fd, &c, 1) == 1) {
    if (line_only && c == '\n') break;
    s += c;
  }
  return s;
}

int run(const char* self, int holders, int reps) {
  std::vector<pid_t> pids;
  std::vector<int> stdins;
  int rc = 0;
  const char* apart = getenv("STARTUP_CPU_APART");
  const int first_file = apart != nullptr && std::strcmp(apart, "1") == 0 ? 1 : 0;
  for (int i = 0; i < holders && rc == 0; ++i) {
    int to = -1, from = -1;
    const pid_t pid = spawn(self, "hold", first_file + i / 448, &to, &from);
    if (pid < 0) rc = 1;
    pids.push_back(pid);
    stdins.push_back(to);
    const std::string line = read_all(from, true);
    close(from);
    if (line != "ready") {
      std::fprintf(stderr, "holder %d: '%s'\n", i, line.c_str());
      rc = 1;
    }
  }
  std::vector<long> figures, faults, queries;
  for (int r = 0; r < reps && rc == 0; ++r) {
    int to = -1, from = -1;
    const pid_t pid = spawn(self, "measure", 0, &to, &from);
    close(to);
    const std::string out = read_all(from, false);
    close(from);
    int status = 0;
    waitpid(pid, &status, 0);
    const char* at = std::strstr(out.c_str(), "ok cpu_us=");
    if (at == nullptr) {
      std::fprintf(stderr, "measured process: '%s'\n", out.c_str());
      rc = 1;
      break;
    }
    figures.push_back(std::atol(at + 10));
    const char* f = std::strstr(out.c_str(), "faults=");
    faults.push_back(f == nullptr ? -1 : std::atol(f + 7));
    const char* q = std::strstr(out.c_str(), "meminfo_us=");
    queries.push_back(q == nullptr ? -1 : std::atol(q + 11));
  }
  for (int fd : stdins) close(fd);
  for (pid_t pid : pids) {
    int status = 0;
    if (pid > 0) waitpid(pid, &status, 0);
  }
  if (rc != 0) return rc;
  std::vector<long> sorted = figures;
  std::sort(sorted.begin(), sorted.end());
  std::sort(faults.begin(), faults.end());
  std::sort(queries.begin(), queries.end());
  // The least figure too: on a loaded machine other processes only add to a
  // start's CPU time (caches, the kernel's lists evicted), never take from it.
  std::printf("live=%d median_cpu_us=%ld min_cpu_us=%ld median_minor_faults=%ld median_first_meminfo_us=%ld runs=",
              holders, sorted[sorted.size() / 2], sorted[0], faults[faults.size() / 2], queries[queries.size() / 2]);
  for (std::size_t i = 0; i < figures.size(); ++i) std::printf("%s%ld", i == 0 ? "" : ",", figures[i]);
  std::printf("\n");
  return 0;
}

}  // namespace

int locks_main(int n);  // startup_cpu_locks.cc

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "hold") return hold();
  if (mode == "measure") return measure();
  if (mode == "run" && argc > 2) {
    const int reps = argc > 3 ? std::atoi(argv[3]) : 9;
    char self[4096] = {};
    if (readlink("/proc/self/exe", self, sizeof self - 1) <= 0) return 2;
    return run(self, std::atoi(argv[2]), reps < 1 ? 1 : reps);
  }
  if (mode == "locks" && argc > 2) return locks_main(std::atoi(argv[2]));
  std::fprintf(stderr, "usage: %s hold | measure | run N [REPS] | locks N\n", argv[0]);
  return 2;
}
