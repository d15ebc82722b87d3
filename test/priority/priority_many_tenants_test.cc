// A high-priority tenant's bursts next to many low-priority tenants on one
// simulated device (docs/priority.md, "Many tenants"): each tenant its own
// container (region, activity file), every one a prio_tenant process. Burst
// latencies are device-side (between events: simulated instants), the low
// tenants' harvest of the idle time is read from the simulated timeline
// (fakecuda-ctl busy). Label `timing`: the bounds leave room for a loaded
// 2-core machine; what is checked is that the high tenant's wait does not
// grow with the number of low tenants (before the shared budget it grew with
// each one: 256 × 250 µs ≈ 64 ms).
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "scenarios.h"

namespace {

using namespace gpuslice::test;
using namespace gpuslice::test::limiter;

constexpr unsigned kLowUs = 250;  // the low tenants' kernels
constexpr unsigned kHighUs = 100;
constexpr int kHighKernels = 4;

struct Figures {
  double p50_us = 0, p90_us = 0, p99_us = 0, max_us = 0, host_p99_us = 0;
  double harvest = 0;  // percent of the time the high tenant left that the low ones used
  int bursts = 0;
  long handoff_waits = 0, handoff_woken = 0;  // the low tenants' (prio_tenant_low lines)
  long crowded = 0;       // with g_count_crowded: low launches within the bursts that found two others' kernels queued
  std::string breakdown;  // prio_tenant's breakdown line (where the burst's time went)
  std::vector<std::string> rows;  // per burst, with PRIO_TENANT_ROWS set
  std::string describe() const {
    return "p50 " + std::to_string(p50_us) + " us, p90 " + std::to_string(p90_us) + " us, p99 " +
           std::to_string(p99_us) + " us, max " + std::to_string(max_us) + " us, host p99 " +
           std::to_string(host_p99_us) + " us, harvest " + std::to_string(harvest) + " %, bursts " +
           std::to_string(bursts);
  }
};

void kill_pid(pid_t pid) { kill(pid, SIGKILL); }

int files_in(const std::string& dir) {
  int n = 0;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".act") == 0) ++n;
  }
  closedir(d);
  return n;
}

const char* g_handoff = nullptr;  // GPUSLICE_PRIORITY_HANDOFF of every tenant, unset when null
const char* g_profile = nullptr;  // FAKECUDA_PROFILE of every tenant, the Machine's when null
bool g_count_crowded = false;     // the low tenants count crowded launches (PRIO_TENANT_HIGH_PID)

Env tenant_env(const Machine& m, const std::string& name, const std::string& level) {
  Env e = m.sandbox().env(true);
  if (g_handoff != nullptr) e["GPUSLICE_PRIORITY_HANDOFF"] = g_handoff;
  if (!m.profile().empty()) e["FAKECUDA_PROFILE"] = m.profile();
  if (g_profile != nullptr) e["FAKECUDA_PROFILE"] = g_profile;
  // The harness passes no FAKECUDA_* of ours on: the sweep's timing knobs are
  // passed explicitly (without this, FAKECUDA_JITTER_PCT=0 ran with the
  // profile's 10 %).
  for (const char* knob : {"FAKECUDA_JITTER_PCT", "FAKECUDA_TIMESLICE_US", "FAKECUDA_LAUNCH_COST_US"}) {
    if (const char* v = std::getenv(knob)) e[knob] = v;
  }
  // The realistic profile's 512 MiB per context: 256 contexts would not fit
  // on the simulated device (nor on a real one); not what is measured here.
  e["FAKECUDA_CONTEXT_MEMORY"] = "0";
  e["GPUSLICE_REGION"] = m.region_path(name);
  e["GPUSLICE_CONTAINER_NAME"] = name;
  e["GPUSLICE_PRIORITY_BOARD"] = m.sandbox().path("board");
  e["GPUSLICE_PRIORITY"] = level;
  if (const char* trace = std::getenv("PRIO_TENANT_TRACE")) e["PRIO_TENANT_TRACE"] = trace;
  return e;
}

// The high tenant starts (and launches once); then `lows` low tenants start;
// once all of them publish, the high tenant runs `bursts` bursts of 4 × 100 µs
// with 5-50 ms gaps; then the low ones stop. With `kill`, that many low
// tenants are SIGKILLed `kill_after_s` into the bursts, and the harvest is
// the survivors' from 0.1 s after that.
Figures run_next_to(Machine& m, int lows, int bursts, int kill = 0, double kill_after_s = 0) {
  const std::string stop = m.sandbox().path("stop"), go = m.sandbox().path("go");
  const std::string high_out = m.sandbox().path("high.out");
  Env high_env = tenant_env(m, "high", "high");
  if (std::getenv("PRIO_TENANT_ROWS") != nullptr) high_env["PRIO_TENANT_ROWS"] = "1";
  if (const char* nice = std::getenv("PRIO_TENANT_NICE")) high_env["PRIO_TENANT_NICE"] = nice;
  const pid_t high_pid = spawn({bin("prio_tenant"), "high", std::to_string(kHighUs), std::to_string(kHighKernels),
                                std::to_string(bursts), "5000", "50000", "7", go},
                               high_env, high_out);
  const std::uint64_t deadline = mono_now_ns() + 120'000'000'000ull;
  while (files_in(m.sandbox().path("board") + "/high") < 1 && mono_now_ns() < deadline) usleep(20'000);
  std::vector<pid_t> pids;
  for (int i = 0; i < lows; ++i) {
    const std::string name = "low" + std::to_string(i);
    Env low_env = tenant_env(m, name, "low");
    if (g_count_crowded) low_env["PRIO_TENANT_HIGH_PID"] = std::to_string(high_pid);
    pids.push_back(
        spawn({bin("prio_tenant"), "low", std::to_string(kLowUs), stop}, low_env, m.sandbox().path(name + ".out")));
  }
  while (files_in(m.sandbox().path("board") + "/low") < lows && mono_now_ns() < deadline) usleep(50'000);
  EXPECT_EQ(files_in(m.sandbox().path("board") + "/low"), lows) << "low tenants publishing";
  close(open(go.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644));
  std::uint64_t killed_ns = 0;
  long lows_waits = 0, lows_woken = 0;
  std::vector<std::string> crowded_lines;
  if (kill > 0) {
    usleep(static_cast<useconds_t>((0.3 + kill_after_s) * 1e6));  // the high tenant's 0.3 s, then into its bursts
    for (int i = 0; i < kill && i < lows; ++i) kill_pid(pids[static_cast<std::size_t>(i)]);
    killed_ns = mono_now_ns();
  }
  const Result high = wait(high_pid, high_out, 120000);
  close(open(stop.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644));
  for (std::size_t i = 0; i < pids.size(); ++i) {
    const Result r = wait(pids[i], m.sandbox().path("low" + std::to_string(i) + ".out"), 120000);
    for (const std::string& l : lines_with(r.out, "prio_tenant_low ")) {
      lows_waits += std::atol(field(l, "handoff_waits").c_str());
      lows_woken += std::atol(field(l, "handoff_woken").c_str());
    }
    for (const std::string& l : lines_with(r.out, "prio_tenant_crowded")) crowded_lines.push_back(l);
    if (static_cast<int>(i) < kill)
      EXPECT_EQ(r.signal, SIGKILL) << r.describe();
    else
      EXPECT_EQ(r.exit_code, 0) << r.describe();
  }
  unlink(stop.c_str());
  unlink(go.c_str());
  Figures f;
  f.handoff_waits = lows_waits;
  f.handoff_woken = lows_woken;
  EXPECT_EQ(high.exit_code, 0) << high.describe();
  const auto lines = lines_with(high.out, "prio_tenant ");
  if (lines.empty()) return f;
  const std::string& line = lines.back();
  f.p50_us = std::atof(field(line, "p50_us").c_str());
  f.p90_us = std::atof(field(line, "p90_us").c_str());
  f.p99_us = std::atof(field(line, "p99_us").c_str());
  f.max_us = std::atof(field(line, "max_us").c_str());
  f.host_p99_us = std::atof(field(line, "host_p99_us").c_str());
  f.bursts = std::atoi(field(line, "bursts").c_str());
  if (const auto more = lines_with(high.out, "prio_tenant_breakdown "); !more.empty()) f.breakdown = more.back();
  f.rows = lines_with(high.out, "row ");
  if (const auto gaps = lines_with(high.out, "prio_tenant_gaps "); !gaps.empty()) f.breakdown += "\n  " + gaps.back();
  std::uint64_t t0 = std::strtoull(field(line, "start_ns").c_str(), nullptr, 10);
  if (killed_ns != 0) t0 = killed_ns + 100'000'000;
  const std::uint64_t t1 = std::strtoull(field(line, "end_ns").c_str(), nullptr, 10);
  // From 150 ms into the bursts: until the first burst the low tenants were
  // bounded relaxed (the high one idle for 0.3 s: ~1 ms of work queued, by
  // design), and they see it serving within a refresh (100 ms).
  for (const std::string& l : crowded_lines) {
    std::istringstream words(l.substr(l.find(' ') == std::string::npos ? l.size() : l.find(' ')));
    for (std::uint64_t t = 0; words >> t;) f.crowded += t >= t0 + 150'000'000 && t <= t1;
  }
  if (lows > 0 && t1 > t0) {
    const double all = static_cast<double>(m.busy_ns(t0, t1));
    const double mine = static_cast<double>(m.busy_ns(t0, t1, high_pid));
    const double left = static_cast<double>(t1 - t0) - mine;
    f.harvest = left > 0 ? 100.0 * (all - mine) / left : 0;
  }
  return f;
}

// The case: next to 256 low tenants, each held to one launch in
// flight, the high tenant's burst waited behind all of them (here p50 74 ms,
// p90 105 ms, p99 129 ms; 0.42 ms alone). Now the low tenants share one
// in-flight budget per device: the burst waits for about one low kernel, the
// single-tenant bound (1.2 × alone plus one low kernel). Asserted with room
// for a loaded 2-core host, whose stalls of the high tenant's own thread
// between its launches (device-side latency starts at its first event) set
// the tail: at load 24 its host p99 alone reached 39 ms, and 256 × 250 µs
// queued would be 64 ms. So the median within the bound + 0.5 ms, p90 within
// + 5 ms (the p99 is printed, docs/priority.md has the figures); and the low
// tenants still use a good part of the time the high one leaves (83 % on an
// idle host; 37.6 % in one clean-clone CI run beside another build: 256
// processes on 2 loaded cores wake late, and a late waker costs slots).
TEST(PriorityManyTenants, HighBurstNextTo256LowTenantsWaitsForOneOfThem) {
  Machine alone_machine;
  const Figures alone = run_next_to(alone_machine, 0, 150);
  ASSERT_EQ(alone.bursts, 150) << alone.describe();
  Machine m;
  const Figures many = run_next_to(m, 256, 150);
  ASSERT_EQ(many.bursts, 150) << many.describe();
  const double bound = 1.2 * alone.p99_us + kLowUs;
  std::printf("alone: %s\n256 low: %s\nbound %.0f us\n", alone.describe().c_str(), many.describe().c_str(), bound);
  EXPECT_LT(many.p50_us, bound + 500.0) << "alone " << alone.describe() << "\n256 low " << many.describe();
  EXPECT_LT(many.p90_us, bound + 5000.0) << "alone " << alone.describe() << "\n256 low " << many.describe();
  EXPECT_GT(many.harvest, 25.0) << many.describe();
}

// Low tenants SIGKILLed while they hold the level's budget (slots booked
// ahead, launches claimed, maybe the booking lock): what they held is device
// time that passes and a lock the kernel drops. The survivors keep harvesting
// and the high tenant's bursts stay within the bound (as above). With the
// booking lock never obtainable (as if a dead holder kept it): p50 5.9 ms,
// p90 11.6 ms, and this fails.
TEST(PriorityManyTenants, KilledLowTenantsLeaveTheBudgetToTheOthers) {
  Machine alone_machine;
  const Figures alone = run_next_to(alone_machine, 0, 100);
  ASSERT_EQ(alone.bursts, 100) << alone.describe();
  Machine m;
  const Figures f = run_next_to(m, 32, 100, 16, 0.8);
  ASSERT_EQ(f.bursts, 100) << f.describe();
  const double bound = 1.2 * alone.p99_us + kLowUs;
  std::printf("alone: %s\n32 low, 16 killed: %s\n", alone.describe().c_str(), f.describe().c_str());
  EXPECT_LT(f.p50_us, bound + 500.0) << "alone " << alone.describe() << "\nkilled " << f.describe();
  EXPECT_LT(f.p90_us, bound + 5000.0) << "alone " << alone.describe() << "\nkilled " << f.describe();
  EXPECT_GT(f.harvest, 40.0) << "the survivors' harvest after the kill: " << f.describe();
}

// The level's budget on a device whose kernels vary (the realistic profile:
// run times within +-10 % of nominal, contexts time-sliced): the level keeps
// one launch running and the next queued within the lead, so while the high
// tenant serves a low launch never finds two other low kernels still on the
// device (docs/priority.md, "Many tenants"; the high tenant's kernels are not
// counted: a launch claimed as its burst began queues behind them). Counted
// by the simulated device at each low launch, not timed. Before, the level's
// timetable counted each launch as the least of its samples (the shortest
// kernels) and never saw the device: it ran ahead, and the device stayed a
// launch or more behind it for long stretches (1,549 crowded launches in
// this test; the high tenant's p99 1.1-1.3 ms against a 0.80 ms bound).
TEST(PriorityManyTenants, AVaryingDeviceStaysWithinALaunchOfTheTimetable) {
  g_profile = "realistic";
  g_count_crowded = true;
  Machine m;
  const Figures f = run_next_to(m, 16, 150);
  g_profile = nullptr;
  g_count_crowded = false;
  ASSERT_EQ(f.bursts, 150) << f.describe();
  std::printf("16 low, realistic: %s, %ld crowded launches\n", f.describe().c_str(), f.crowded);
  // 0 in every idle run; a few are allowed for a loaded CI machine, where a
  // look at the lag can come late (a wake-up without a CPU): far below the
  // open-loop timetable's 1,137-1,549.
  EXPECT_LE(f.crowded, 30) << f.describe();
}

// GPUSLICE_PRIORITY_HANDOFF (docs/priority.md, "Many tenants"): unset or
// false, a bounded low tenant's booking sleeps to its slot (the high tenant's
// p99 first): its launches make no futex wait, so no launch wakes it; true,
// bookings wait on the lease's wake word and launches of the level wake them.
// Counted (prio_tenant_low's lines), not timed.
TEST(PriorityManyTenants, TheHandoffWakesBookingsOnlyWhenTurnedOn) {
  for (const char* value : {static_cast<const char*>(nullptr), "false", "true"}) {
    g_handoff = value;
    Machine m;
    const Figures f = run_next_to(m, 4, 30);
    g_handoff = nullptr;
    ASSERT_EQ(f.bursts, 30) << f.describe();
    const std::string what = std::string("GPUSLICE_PRIORITY_HANDOFF=") + (value != nullptr ? value : "(unset)");
    std::printf("%s: %ld handoff waits, %ld woken\n", what.c_str(), f.handoff_waits, f.handoff_woken);
    if (value == nullptr || std::string(value) == "false") {
      EXPECT_EQ(f.handoff_waits, 0) << what << ": a booking waited on the wake word";
      EXPECT_EQ(f.handoff_woken, 0) << what << ": a launch woke a booking";
    } else {
      EXPECT_GT(f.handoff_woken, 0) << what << ": no launch woke a booking (" << f.handoff_waits << " waits)";
    }
  }
}

// The figures of docs/priority.md's table: N = 0, 1, 16, 64, 256 (run by hand:
// --gtest_also_run_disabled_tests; FAKECUDA_PROFILE=realistic for that profile,
// PRIO_N=<n> for one N). Each N also prints where the bursts' time went
// (prio_tenant's breakdown and gaps lines); PRIO_TENANT_ROWS=1 adds a row
// per burst: latency, device queue at its arrival, the others' device time
// and the idle time in its window, the high thread's wait for a CPU (us);
// PRIO_TENANT_NICE=<n> runs the high tenant at that nice value;
// PRIO_TENANT_TRACE=<dir> has every tenant write its launches there
// (prio_tenant.cc; test/priority/harvest_split.py splits the idle time);
// PRIO_HANDOFF=<value> sets every tenant's GPUSLICE_PRIORITY_HANDOFF.
TEST(PriorityManyTenants, DISABLED_Sweep) {
  std::vector<int> ns = {0, 1, 16, 64, 256};
  if (const char* only = std::getenv("PRIO_N")) ns = {std::atoi(only)};
  g_handoff = std::getenv("PRIO_HANDOFF");
  for (int n : ns) {
    Machine m;
    const Figures f = run_next_to(m, n, 200);
    std::printf("profile=%s N=%d handoff=%s %s\n  %s\n", m.profile().empty() ? "ideal" : m.profile().c_str(), n,
                g_handoff != nullptr ? g_handoff : "default", f.describe().c_str(), f.breakdown.c_str());
    for (const std::string& row : f.rows) std::printf("  %s\n", row.c_str());
    std::fflush(stdout);
  }
  g_handoff = nullptr;
}

}  // namespace
