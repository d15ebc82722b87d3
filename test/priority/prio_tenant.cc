// prio_tenant: one tenant of the many-tenants priority test
// (priority_many_tenants_test.cc, docs/priority.md "Many tenants") on the
// simulated device 0.
//
//   prio_tenant low KERNEL_US STOP_FILE
//       a training tenant: launches KERNEL_US kernels on its own stream,
//       synchronising every 16, until STOP_FILE exists (how many are in
//       flight is what gpuslice lets through).
//   prio_tenant high KERNEL_US KERNELS BURSTS GAP_MIN_US GAP_MAX_US SEED GO_FILE
//       an inference tenant: one launch (it is present), then once GO_FILE
//       exists and 0.3 s later, BURSTS bursts of KERNELS kernels, each
//       between two events and followed by a synchronize, with random idle
//       gaps.
//
// low prints "prio_tenant_low handoff_waits=<n> handoff_woken=<n>" at its
// end: the gate's futex waits inside its launches (GPUSLICE_PRIORITY_HANDOFF)
// and how many a launch's wake ended; with PRIO_TENANT_HIGH_PID (realistic
// profile), "prio_tenant_crowded <t>...": when its launches found two or more
// kernels of the others (not that pid's) still on the device. high prints one line: "prio_tenant pid=<pid> start_ns=<first launch,
// CLOCK_MONOTONIC> end_ns=<last synchronize> bursts=<n> p50_us=<..>
// p90_us=<..> p99_us=<..> max_us=<..> host_p99_us=<..>": burst latencies device-side
// (between the events: simulated instants, free of the host's wake-up) and
// host-side (first launch to the synchronize's return). Then a line
// "prio_tenant_gaps ..." (the device's idle time between bursts) and one
// "prio_tenant_breakdown ..." (where the worst 2 % and all bursts' time went:
// the device's queue at arrival (fakecuda_pending_ns), the others' device time in the burst's
// window, the idle time in it, the time this thread waited for a CPU between
// its first event and its last launch, from /proc/thread-self/schedstat);
// with PRIO_TENANT_ROWS set, a "row ..." line per burst. PRIO_TENANT_NICE=<n>
// sets the high tenant's nice value (setpriority) before its bursts: whether
// its thread's wait for a CPU, not the gate, sets the tail.
//
// PRIO_TENANT_TRACE=<dir> (docs/log/2026-11-29-priority-harvest.md): where the
// idle time the low tenants leave goes. A low tenant writes <dir>/<pid>.low,
// one line per launch: "L <enter> <exit> <kernel end> <run_delay at enter>
// <at exit>", then one per sleep inside a launch (the gate's, seen through
// clock_nanosleep, defined below): "S <start> <planned wake> <wake>
// <run_delay before> <after> <launch index>" (ns, CLOCK_MONOTONIC;
// run_delay: the thread's wait for a CPU, schedstat). The high one writes
// <dir>/high.bursts: "B <first event> <device-side latency ns> <device work
// queued at its start, ns>" per burst, then "H <each launch's return>" and
// "G <start> <end> <host pid>" per busy interval of the device from 1 ms before
// the burst to its end (fakecuda_busy_segments); <dir>/device.timeline: every
// busy interval of the bursts' span, "<start> <end> <host pid>".
// test/priority/harvest_split.py reads them.
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fakecuda_query.h"

namespace {

std::uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

void check(CUresult rc, const char* what) {
  if (rc == CUDA_SUCCESS) return;
  std::fprintf(stderr, "prio_tenant: %s failed: %d\n", what, static_cast<int>(rc));
  std::exit(3);
}

// How long this thread has waited for a CPU (run_delay, ns): the second
// field of /proc/thread-self/schedstat; 0 where the kernel has no schedstats.
std::uint64_t run_delay_ns() {
  const int fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[128] = {};
  const ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  char* rest = nullptr;
  std::strtoull(buf, &rest, 10);
  return std::strtoull(rest, nullptr, 10);
}

// The trace (PRIO_TENANT_TRACE): this thread's run_delay through one open
// descriptor (a pread each), and the gate's sleeps inside a launch.
int g_schedstat = -1;
thread_local bool g_in_launch = false;    // the main thread only (the library has its own threads)
std::vector<std::uint64_t> g_sleeps_rec;  // start, planned wake, wake, run_delay before, after, launch index
std::uint64_t g_launch_index = 0;
// The gate's handoff waits inside a launch (shared FUTEX_WAIT with a timeout,
// GPUSLICE_PRIORITY_HANDOFF), traced or not, and how many a wake ended.
std::uint64_t g_handoff_waits = 0, g_handoff_woken = 0;

std::uint64_t traced_delay_ns() {
  char buf[128] = {};
  const ssize_t n = pread(g_schedstat, buf, sizeof buf - 1, 0);
  if (n <= 0) return 0;
  char* rest = nullptr;
  std::strtoull(buf, &rest, 10);
  return std::strtoull(rest, nullptr, 10);
}

double percentile(std::vector<double> v, int p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, v.size() * static_cast<std::size_t>(p) / 100)];
}

}  // namespace

// The gate's sleeps (platform::sleep_ns) resolve here before libc: with a
// trace, each one inside a launch is recorded (planned wake, real wake).
extern "C" int clock_nanosleep(clockid_t clock, int flags, const timespec* req, timespec* rem) {
  const bool traced = g_in_launch && g_schedstat >= 0 && flags == 0;
  std::uint64_t target = 0, before = 0, began = 0;
  if (traced) before = traced_delay_ns();
  if (traced)
    target = (began = now_ns()) + static_cast<std::uint64_t>(req->tv_sec) * 1000000000ull +
             static_cast<std::uint64_t>(req->tv_nsec);
  const long rc = syscall(SYS_clock_nanosleep, clock, flags, req, rem);
  if (traced && g_sleeps_rec.size() + 6 <= g_sleeps_rec.capacity()) {
    const std::uint64_t wake = now_ns();
    g_sleeps_rec.insert(g_sleeps_rec.end(), {began, target, wake, before, traced_delay_ns(), g_launch_index});
  }
  if (rc < 0) return static_cast<int>(errno);
  return 0;
}

// ... and the handoff's waits (shm::wait_wake: syscall(SYS_futex, FUTEX_WAIT)
// with a relative timeout) too, as sleeps planned to their timeout: one woken
// early makes its tenant due at nothing (its next sleep, or its launch, says
// when), one that timed out counts as a sleep. Other calls pass through.
extern "C" long syscall(long number, ...) {
  va_list ap;
  va_start(ap, number);
  long a[6];
  for (long& x : a) x = va_arg(ap, long);
  va_end(ap);
  using Real = long (*)(long, ...);
  static const Real real = reinterpret_cast<Real>(dlsym(RTLD_NEXT, "syscall"));
  const bool gate_wait = number == SYS_futex && a[1] == FUTEX_WAIT && a[3] != 0 && g_in_launch;
  if (gate_wait && g_schedstat < 0) {
    const long rc = real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
    ++g_handoff_waits;
    g_handoff_woken += rc == 0;
    return rc;
  }
  const bool traced =
      number == SYS_futex && (a[1] & FUTEX_CMD_MASK) == FUTEX_WAIT && a[3] != 0 && g_in_launch && g_schedstat >= 0;
  if (!traced) return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
  const timespec* req = reinterpret_cast<const timespec*>(a[3]);
  const std::uint64_t before = traced_delay_ns(), began = now_ns();
  const std::uint64_t target =
      began + static_cast<std::uint64_t>(req->tv_sec) * 1000000000ull + static_cast<std::uint64_t>(req->tv_nsec);
  const long rc = real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
  const int e = errno;
  g_handoff_waits += gate_wait;
  g_handoff_woken += gate_wait && rc == 0;
  if (g_sleeps_rec.size() + 6 <= g_sleeps_rec.capacity())
    g_sleeps_rec.insert(g_sleeps_rec.end(), {began, target, now_ns(), before, traced_delay_ns(), g_launch_index});
  errno = e;
  return rc;
}

int main(int argc, char** argv) {
  const bool low = argc == 4 && std::strcmp(argv[1], "low") == 0;
  const bool high = argc == 9 && std::strcmp(argv[1], "high") == 0;
  if (!low && !high) {
    std::fprintf(stderr,
                 "usage: prio_tenant low KERNEL_US STOP_FILE\n"
                 "       prio_tenant high KERNEL_US KERNELS BURSTS GAP_MIN_US GAP_MAX_US SEED GO_FILE\n");
    return 2;
  }
  const unsigned kernel_us = static_cast<unsigned>(std::atoi(argv[2]));
  check(cuInit(0), "cuInit");
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  const std::string name = "spin_" + std::to_string(kernel_us) + "us";
  CUmodule module = nullptr;
  CUfunction f = nullptr;
  check(cuModuleLoadData(&module, name.c_str()), "cuModuleLoadData");
  check(cuModuleGetFunction(&f, module, name.c_str()), "cuModuleGetFunction");
  CUstream stream = nullptr;
  check(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  auto launch = [&] { check(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr), "cuLaunchKernel"); };

  const char* trace = std::getenv("PRIO_TENANT_TRACE");
  if (low) {
    const char* stop = argv[3];
    std::vector<std::uint64_t> rec;
    if (trace != nullptr) {
      g_schedstat = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
      rec.reserve(5u << 17);
      g_sleeps_rec.reserve(6u << 18);
    }
    // PRIO_TENANT_HIGH_PID (the realistic profile): after each launch, how
    // many kernels of the others (not the high tenant's) are still on the
    // device. The level's budget keeps one running and this one queued
    // (docs/priority.md, "Many tenants"): a launch that finds two others is
    // crowded; its time is printed (the test counts those within the bursts).
    const char* high_pid = std::getenv("PRIO_TENANT_HIGH_PID");
    const int except = high_pid != nullptr ? std::atoi(high_pid) : 0;
    std::vector<std::uint64_t> crowded;
    for (unsigned n = 1;; ++n) {
      if (g_schedstat < 0) {
        g_in_launch = true;
        launch();
        g_in_launch = false;
        if (except != 0 && fakecuda_pending_kernels(0, except) > 2 && crowded.size() < 100000)
          crowded.push_back(now_ns());
      } else {
        const std::uint64_t d0 = traced_delay_ns(), t0 = now_ns();
        g_in_launch = true;
        launch();
        g_in_launch = false;
        ++g_launch_index;
        const std::uint64_t t1 = now_ns(), d1 = traced_delay_ns(), end = fakecuda_busy_until_ns(0);
        if (rec.size() + 5 <= rec.capacity()) rec.insert(rec.end(), {t0, t1, end, d0, d1});
      }
      if (n % 16 == 0) {
        check(cuStreamSynchronize(stream), "cuStreamSynchronize");
        if (access(stop, F_OK) == 0) break;
      }
    }
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    std::printf("prio_tenant_low handoff_waits=%llu handoff_woken=%llu\n",
                static_cast<unsigned long long>(g_handoff_waits), static_cast<unsigned long long>(g_handoff_woken));
    if (except != 0) {
      std::printf("prio_tenant_crowded");
      for (std::uint64_t t : crowded) std::printf(" %llu", static_cast<unsigned long long>(t));
      std::printf("\n");
    }
    if (trace != nullptr) {
      const std::string path = std::string(trace) + "/" + std::to_string(getpid()) + ".low";
      if (FILE* out = std::fopen(path.c_str(), "w")) {
        for (std::size_t i = 0; i + 5 <= rec.size(); i += 5) {
          std::fprintf(out, "L");
          for (std::size_t k = 0; k < 5; ++k) std::fprintf(out, " %llu", static_cast<unsigned long long>(rec[i + k]));
          std::fprintf(out, "\n");
        }
        for (std::size_t i = 0; i + 6 <= g_sleeps_rec.size(); i += 6) {
          std::fprintf(out, "S");
          for (std::size_t k = 0; k < 6; ++k)
            std::fprintf(out, " %llu", static_cast<unsigned long long>(g_sleeps_rec[i + k]));
          std::fprintf(out, "\n");
        }
        std::fclose(out);
      }
    }
    return 0;
  }

  const int kernels = std::atoi(argv[3]);
  if (const char* nice = std::getenv("PRIO_TENANT_NICE")) {
    if (setpriority(PRIO_PROCESS, 0, std::atoi(nice)) != 0) std::perror("prio_tenant: setpriority");
  }
  const int bursts = std::atoi(argv[4]);
  const unsigned gap_min = static_cast<unsigned>(std::atoi(argv[5]));
  const unsigned gap_max = static_cast<unsigned>(std::atoi(argv[6]));
  std::mt19937_64 rng(std::strtoull(argv[7], nullptr, 10));
  CUevent a = nullptr, b = nullptr;
  check(cuEventCreate(&a, CU_EVENT_DEFAULT), "cuEventCreate");
  check(cuEventCreate(&b, CU_EVENT_DEFAULT), "cuEventCreate");
  // Present first: low tenants that start later are bounded from their first
  // launch (one already running keeps its whole queue until it notices a new
  // neighbour, within a rescan: docs/priority.md, Limitations). The bursts
  // measured here are the steady state.
  launch();
  check(cuStreamSynchronize(stream), "cuStreamSynchronize");
  while (access(argv[8], F_OK) != 0) usleep(10'000);
  usleep(300'000);
  std::vector<double> device_us, host_us;
  // Per burst, for the breakdown line: when it began, the device's queue
  // then (fakecuda_pending_ns: the work still owed, on either profile).
  std::vector<std::uint64_t> began_ns, queued_ns, cpu_wait_ns, launched_ns;
  std::uint64_t start = 0, end = 0;
  for (int i = 0; i < bursts; ++i) {
    const std::uint64_t queued = fakecuda_pending_ns(0);
    const std::uint64_t t0 = now_ns();
    if (start == 0) start = t0;
    began_ns.push_back(t0);
    queued_ns.push_back(queued);
    const std::uint64_t delay0 = run_delay_ns();
    check(cuEventRecord(a, stream), "cuEventRecord");
    for (int k = 0; k < kernels; ++k) {
      launch();
      if (trace != nullptr) launched_ns.push_back(now_ns());
    }
    check(cuEventRecord(b, stream), "cuEventRecord");
    cpu_wait_ns.push_back(run_delay_ns() - delay0);
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    end = now_ns();
    float ms = 0;
    check(cuEventElapsedTime(&ms, a, b), "cuEventElapsedTime");
    device_us.push_back(static_cast<double>(ms) * 1000.0);
    host_us.push_back(static_cast<double>(end - t0) / 1000.0);
    usleep(static_cast<useconds_t>(gap_min + rng() % (gap_max - gap_min + 1)));
  }
  if (trace != nullptr) {
    if (FILE* out = std::fopen((std::string(trace) + "/high.bursts").c_str(), "w")) {
      std::vector<std::uint64_t> seg(3 * 64);
      for (std::size_t i = 0; i < began_ns.size(); ++i) {
        const std::uint64_t t0 = began_ns[i], t1 = t0 + static_cast<std::uint64_t>(device_us[i] * 1000.0);
        std::fprintf(out, "B %llu %llu %llu\n", static_cast<unsigned long long>(t0),
                     static_cast<unsigned long long>(device_us[i] * 1000.0),
                     static_cast<unsigned long long>(queued_ns[i]));
        std::fprintf(out, "H");
        for (int k = 0; k < kernels; ++k)
          std::fprintf(out, " %llu",
                       static_cast<unsigned long long>(
                           launched_ns[i * static_cast<std::size_t>(kernels) + static_cast<std::size_t>(k)]));
        std::fprintf(out, "\n");
        const std::size_t n =
            std::min<std::size_t>(64, fakecuda_busy_segments(0, t0 - 1'000'000, t1 + 100'000, seg.data(), 64));
        for (std::size_t k = 0; k < n; ++k)
          std::fprintf(out, "G %llu %llu %llu\n", static_cast<unsigned long long>(seg[3 * k]),
                       static_cast<unsigned long long>(seg[3 * k + 1]),
                       static_cast<unsigned long long>(seg[3 * k + 2]));
      }
      std::fclose(out);
    }
    // The whole device timeline of the bursts' span: who held the device when.
    if (FILE* out = std::fopen((std::string(trace) + "/device.timeline").c_str(), "w")) {
      std::vector<std::uint64_t> all(3u << 17);
      const std::size_t n =
          std::min<std::size_t>(all.size() / 3, fakecuda_busy_segments(0, start, end, all.data(), all.size() / 3));
      for (std::size_t k = 0; k < n; ++k)
        std::fprintf(out, "%llu %llu %llu\n", static_cast<unsigned long long>(all[3 * k]),
                     static_cast<unsigned long long>(all[3 * k + 1]), static_cast<unsigned long long>(all[3 * k + 2]));
      std::fclose(out);
    }
  }
  std::printf(
      "prio_tenant pid=%d start_ns=%llu end_ns=%llu bursts=%zu p50_us=%.1f p90_us=%.1f p99_us=%.1f "
      "max_us=%.1f host_p99_us=%.1f\n",
      static_cast<int>(getpid()), static_cast<unsigned long long>(start), static_cast<unsigned long long>(end),
      device_us.size(), percentile(device_us, 50), percentile(device_us, 90), percentile(device_us, 99),
      percentile(device_us, 100), percentile(host_us, 99));
  // Where the burst's device-side time went (docs/log/2026-11-29-priority-
  // tenants.md), for the worst 2 % of the bursts and for all: the device's
  // queue when it began (ideal profile), the other tenants' device time in
  // the burst's window (that queue, plus what they launched into the burst),
  // and the device's idle time in it (the high tenant's own thread late
  // between its launches: the host, not the device).
  std::vector<std::size_t> order(device_us.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return device_us[x] > device_us[y]; });
  const std::size_t worst = std::max<std::size_t>(2, order.size() / 50);
  double sum[2][5] = {};
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::size_t i = order[k];
    const std::uint64_t t0 = began_ns[i], t1 = t0 + static_cast<std::uint64_t>(device_us[i] * 1000.0);
    const double all = static_cast<double>(fakecuda_busy_ns(0, 0, t0, t1));
    const double mine = static_cast<double>(fakecuda_busy_ns(0, getpid(), t0, t1));
    const double row[5] = {device_us[i], static_cast<double>(queued_ns[i]) / 1000.0, (all - mine) / 1000.0,
                           device_us[i] - all / 1000.0, static_cast<double>(cpu_wait_ns[i]) / 1000.0};
    if (std::getenv("PRIO_TENANT_ROWS") != nullptr)
      std::printf("row %.1f %.1f %.1f %.1f %.1f\n", row[0], row[1], row[2], row[3], row[4]);
    for (int c = 0; c < 5; ++c) {
      if (k < worst) sum[0][c] += row[c] / static_cast<double>(worst);
      sum[1][c] += row[c] / static_cast<double>(order.size());
    }
  }
  // The idle time the others left between bursts: in the first 2 ms after
  // a burst's end (the high tenant's linger, the held ones' release) and
  // after that, as percent of each part's length.
  double near_len = 0, near_idle = 0, far_len = 0, far_idle = 0;
  for (std::size_t i = 0; i + 1 < began_ns.size(); ++i) {
    const std::uint64_t e = began_ns[i] + static_cast<std::uint64_t>(device_us[i] * 1000.0);
    const std::uint64_t next = began_ns[i + 1];
    if (next <= e + 2'000'000) continue;
    const std::uint64_t mid = e + 2'000'000;
    near_len += 2e6;
    near_idle += 2e6 - static_cast<double>(fakecuda_busy_ns(0, 0, e, mid));
    far_len += static_cast<double>(next - mid);
    far_idle += static_cast<double>(next - mid) - static_cast<double>(fakecuda_busy_ns(0, 0, mid, next));
  }
  std::printf("prio_tenant_gaps idle_first_2ms_pct=%.1f idle_after_pct=%.1f\n",
              near_len > 0 ? 100.0 * near_idle / near_len : 0.0, far_len > 0 ? 100.0 * far_idle / far_len : 0.0);
  std::printf(
      "prio_tenant_breakdown worst=%zu worst_us=%.1f worst_queued_us=%.1f worst_others_us=%.1f worst_idle_us=%.1f "
      "worst_cpu_wait_us=%.1f mean_us=%.1f mean_queued_us=%.1f mean_others_us=%.1f mean_idle_us=%.1f "
      "mean_cpu_wait_us=%.1f\n",
      worst, sum[0][0], sum[0][1], sum[0][2], sum[0][3], sum[0][4], sum[1][0], sum[1][1], sum[1][2], sum[1][3],
      sum[1][4]);
  return 0;
}
