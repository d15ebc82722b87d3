// The chaos mode, the invariant monitor and the torture suite (README.md).
// The monitor is first shown to fail: a program that bypasses gpuslice
// (the simulated driver without the preload library, in the container's
// region) must be reported; then the CI subset of the torture suite runs a
// bounded number of seeded schedules with the monitor on.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gpuslice/region.h"
#include "harness.h"

namespace gpuslice::test {
namespace {

Env monitored(const Sandbox& box, bool preload) {
  return merge(box.env(preload), {{"FAKECUDA_MONITOR", "1"},
                                  {"FAKECUDA_MONITOR_REPORT", box.path("violations")},
                                  {"FAKECUDA_MONITOR_LAG_MS", "100"},
                                  {"FAKECUDA_MEMORY", "4Gi"},
                                  {"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
}

// The container's region, mapped writable (the tests play a process's or
// the agent's part in it), or nullptr; the caller unmaps sizeof(Region).
Region* map_region(const Env& env) {
  const int fd = open(env.at("GPUSLICE_REGION").c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return nullptr;
  void* mapped = mmap(nullptr, sizeof(Region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return mapped == MAP_FAILED ? nullptr : static_cast<Region*>(mapped);
}

// First a process under gpuslice creates the region's device entry (quota
// 64 MiB) and, with `machine`'s FAKECUDA_* settings, the simulated machine.
void create_region(const Sandbox& box, const Env& machine = {}) {
  Result r = run({GPUSLICE_PROBE, "monitor", "hold", "16", "0"}, merge(monitored(box, true), machine));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_NE(r.out.find("alloc=0"), std::string::npos) << r.describe();
  ASSERT_EQ(read_text(box.path("violations")), "") << "no violation under gpuslice";
}

TEST(ChaosMonitor, ReportsAnAllocationAboveTheQuotaThatBypassesGpuslice) {
  Sandbox box;
  create_region(box);
  // The same container (GPUSLICE_REGION) without the preload library: the
  // simulated driver grants 128 MiB over a 64 MiB quota.
  Result r = run({GPUSLICE_PROBE, "monitor", "hold", "128", "0"},
                 merge(monitored(box, false), {{"FAKECUDA_CHAOS_SEED", "4242"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("alloc=0"), std::string::npos) << r.describe();
  const std::string report = read_text(box.path("violations"));
  EXPECT_NE(report.find("VIOLATION (quota)"), std::string::npos) << report;
  EXPECT_NE(report.find("seed=4242"), std::string::npos) << report;
  EXPECT_NE(report.find("device holds 134217728 bytes"), std::string::npos) << report;
  // The last operations name the call (cuMemAlloc_v2 checks initialisation in its helper alloc_common).
  EXPECT_NE(report.find("charge dev0 134217728 bytes (in alloc_common)"), std::string::npos) << report;
  EXPECT_NE(r.err.find("VIOLATION (quota)"), std::string::npos) << r.describe();
}

// The quota is checked at every change of device memory (the simulator's
// observer, after each charge, under its state lock), not by sampling: an
// excursion of 2 MiB over the quota, freed at once, is reported with the
// background sampler off.
TEST(ChaosMonitor, ReportsAnExcursionAtItsChargeWithTheSamplerOff) {
  Sandbox box;
  create_region(box);
  Result r = run({GPUSLICE_PROBE, "monitor", "hold", "66", "0"},
                 merge(monitored(box, false), {{"FAKECUDA_MONITOR_INTERVAL_MS", "0"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::string report = read_text(box.path("violations"));
  EXPECT_NE(report.find("an allocation the driver granted left the container above its limit"), std::string::npos)
      << report;
  EXPECT_NE(report.find("device holds 69206016 bytes"), std::string::npos) << report;
}

TEST(ChaosMonitor, ReportsACountLeftBelowTheDevice) {
  Sandbox box;
  create_region(box);
  // 32 MiB within the quota, but never counted: the count stays below the
  // device for 500 ms > FAKECUDA_MONITOR_LAG_MS (the background sampler sees it).
  Result r = run({GPUSLICE_PROBE, "monitor", "hold", "32", "500"}, monitored(box, false));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::string report = read_text(box.path("violations"));
  EXPECT_NE(report.find("VIOLATION (count)"), std::string::npos) << report;
  EXPECT_EQ(report.find("VIOLATION (quota)"), std::string::npos) << report;
}

// A deficit seen once, gone unseen (no check ran: no grant, no sampler),
// and another seen 300 ms later are two transients, not one deficit that
// lasted 300 ms: checks must see a condition without a gap longer than
// lag/2 for it to have "stayed". (The monitor kept the first sighting's time
// and reported the second at once: seeds 70361, 71647 and 73609 of a run at
// load 10-17, whose samplers were starved, each reported a placement a
// fraction of a millisecond after its grant; here, the second run's context.)
TEST(ChaosMonitor, TwoShortDeficitsFarApartAreNotOneLongOne) {
  Sandbox box;
  // Contexts hold 1 MiB (fixed by the state file's creator: every run says
  // so), so each run's first check, its context's grant, uncounted without
  // the library, sees a deficit at once.
  const Env context{{"FAKECUDA_CONTEXT_MEMORY", "1Mi"}};
  create_region(box, context);
  const Env env = merge(merge(monitored(box, false), context), {{"FAKECUDA_MONITOR_INTERVAL_MS", "0"}});
  Result first = run({GPUSLICE_PROBE, "monitor", "hold", "32", "0"}, env);
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  usleep(300 * 1000);
  Result second = run({GPUSLICE_PROBE, "monitor", "hold", "8", "0"}, env);
  ASSERT_EQ(second.exit_code, 0) << second.describe();
  EXPECT_EQ(read_text(box.path("violations")), "");
  // Seen continuously (the sampler, every 5 ms) for 500 ms: reported.
  Result held = run({GPUSLICE_PROBE, "monitor", "hold", "8", "500"}, merge(monitored(box, false), context));
  ASSERT_EQ(held.exit_code, 0) << held.describe();
  EXPECT_NE(read_text(box.path("violations")).find("VIOLATION (count)"), std::string::npos);
}

// Memory gpuslice counts as spilled (managed memory advised to the host) is
// not on the device, so the count the device is checked against leaves it
// out (device <= resident count <= allowance). A process under gpuslice holds
// 16 MiB; the region then says all its bytes are spilled (written here, as a
// library that counted resident memory as spilled would): the count stays
// below the device for 600 ms. The monitor once compared the device with
// used_bytes, spilled bytes included, and saw nothing.
TEST(ChaosMonitor, ReportsDeviceMemoryCountedAsSpilled) {
  Sandbox box;
  create_region(box);
  Env env = monitored(box, true);
  const pid_t probe = spawn({GPUSLICE_PROBE, "monitor", "hold", "16", "600"}, env, box.path("probe.out"));
  bool allocated = false;
  for (int i = 0; i < 10000 && !allocated; ++i) {
    allocated = read_text(box.path("probe.out")).find("alloc=0") != std::string::npos;
    if (!allocated) usleep(1000);
  }
  EXPECT_TRUE(allocated) << read_text(box.path("probe.out"));
  Region* const region = map_region(env);
  if (region != nullptr) {
    DeviceState& d = region->devices[0];
    d.spilled_in_bytes.fetch_add(d.used_bytes.load());
    munmap(region, sizeof(Region));
  }
  Result r = wait(probe, box.path("probe.out"));
  ASSERT_NE(region, nullptr) << "cannot map " << env["GPUSLICE_REGION"];
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::string report = read_text(box.path("violations"));
  EXPECT_NE(report.find("VIOLATION (count)"), std::string::npos) << report;
  EXPECT_NE(report.find("device holds 16777216 bytes"), std::string::npos) << report;
}

// Managed memory may stand above the limit only in flight: from its grant to
// the granting thread's next change of device memory (where the library's
// spill advises it to the host). 80 MiB of managed memory over a 64 MiB
// quota, then 1 MiB more while it is held: reported at the second grant,
// though all of it is freed at once. The monitor once tolerated any managed
// memory above the limit for the lag, and saw nothing here.
TEST(ChaosMonitor, ReportsManagedMemoryAboveTheLimitOnceItIsNoLongerInFlight) {
  Sandbox box;
  create_region(box);
  Result r = run({GPUSLICE_PROBE, "monitor", "hold-managed", "80", "0"},
                 merge(monitored(box, false), {{"FAKECUDA_CHAOS_SEED", "5"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("alloc=0"), std::string::npos) << r.describe();
  const std::string report = read_text(box.path("violations"));
  EXPECT_NE(report.find("VIOLATION (quota)"), std::string::npos) << report;
  EXPECT_NE(report.find("an allocation the driver granted left the container above its limit"), std::string::npos)
      << report;
  EXPECT_NE(report.find("grant: managed 1048576 bytes in cuMemAllocManaged"), std::string::npos) << report;
}

// A quota lowered below the container's use takes nothing away, nor does it
// undo an allocation gpuslice admitted before the change, however long the
// driver then takes to grant it (seed 352 of 0f406b0: a grant 155 ms in the
// driver, the lowered quota seen more than the 100 ms lag before it landed,
// reported as a quota violation). Here 8 MiB is admitted (the region's
// used_bytes shows it) and held about 100 ms in the driver (a chaos sleep at
// alloc_common's entry: seed 34, thread 1, point 1); meanwhile the quota falls
// to 4 MiB and the monitor (lag 10 ms, sampler every 1 ms) sees it.
TEST(ChaosMonitor, AnAllocationAdmittedBeforeTheQuotaFellMayLandAfterTheLag) {
  Sandbox box;
  const Env spill{{"GPUSLICE_OVERSUBSCRIBE", "spill"},  // as seed 352; an allowance: no spare leases in used_bytes
                  {"GPUSLICE_MEMORY_RESIDENT", "128Mi"},
                  {"FAKECUDA_MONITOR_LAG_MS", "10"},
                  {"FAKECUDA_MONITOR_INTERVAL_MS", "1"}};
  create_region(box, spill);
  const Env env = merge(merge(monitored(box, true), spill), {{"FAKECUDA_CHAOS_SEED", "34"},
                                                             {"FAKECUDA_CHAOS_CALLS", "alloc_common"},
                                                             {"FAKECUDA_CHAOS_YIELD_PCT", "0"},
                                                             {"FAKECUDA_CHAOS_SLEEP_PCT", "100"},
                                                             {"FAKECUDA_CHAOS_SLEEP_US", "100000"}});
  Region* const region = map_region(env);
  ASSERT_NE(region, nullptr) << "cannot map " << env.at("GPUSLICE_REGION");
  DeviceState& d = region->devices[0];
  const pid_t probe = spawn({GPUSLICE_PROBE, "monitor", "hold", "8", "0"}, env, box.path("probe.out"));
  bool admitted = false;
  for (int i = 0; i < 20000 && !admitted; ++i) {
    admitted = d.used_bytes.load() >= (8u << 20);
    if (!admitted) usleep(500);
  }
  d.quota_bytes.store(4u << 20);
  const bool in_driver = read_text(box.path("probe.out")).find("alloc=") == std::string::npos;
  munmap(region, sizeof(Region));
  Result r = wait(probe, box.path("probe.out"));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_TRUE(admitted) << r.describe();
  EXPECT_NE(r.out.find("alloc=0"), std::string::npos) << r.describe();
  if (!in_driver) GTEST_SKIP() << "the grant landed before the quota fell (a loaded machine): nothing was judged";
  EXPECT_EQ(read_text(box.path("violations")), "");
  // Bounded: a call begun after the lag is judged against the lowered limit
  // (16 MiB: above the 8 MiB the ceiling may still hold if no check saw the free).
  Result bypass = run({GPUSLICE_PROBE, "monitor", "hold", "16", "0"}, merge(monitored(box, false), spill));
  ASSERT_EQ(bypass.exit_code, 0) << bypass.describe();
  const std::string report = read_text(box.path("violations"));
  EXPECT_NE(report.find("VIOLATION (quota)"), std::string::npos) << report;
  EXPECT_NE(report.find("device holds 16777216 bytes"), std::string::npos) << report;
}

// ...but only up to the highest limit in force since its call began. The
// quota falls from 64 to 4 MiB (seen by a monitored program), then a program
// bypassing gpuslice begins an 8 MiB allocation held 100 ms in the driver
// (the chaos sleep above); meanwhile the quota rises to 6 MiB. Its call began
// after the fall's lag, so no limit above 6 MiB admitted it: reported when it
// lands. The monitor once excused any grant of a call begun before the lag of
// the last change ended by its bytes, a raise as a fall, and saw nothing.
TEST(ChaosMonitor, AnAllocationBegunAfterAFallIsJudgedAgainstTheRaisedLimit) {
  Sandbox box;
  const Env fast{{"FAKECUDA_MONITOR_LAG_MS", "10"}, {"FAKECUDA_MONITOR_INTERVAL_MS", "1"}};
  create_region(box, fast);
  const Env bypass = merge(monitored(box, false), fast);
  Region* const region = map_region(bypass);
  ASSERT_NE(region, nullptr) << "cannot map " << bypass.at("GPUSLICE_REGION");
  DeviceState& d = region->devices[0];
  d.quota_bytes.store(4u << 20);
  Result seen = run({GPUSLICE_PROBE, "monitor", "hold", "1", "0"}, bypass);  // its checks see the fall
  usleep(50 * 1000);                                                         // past the fall's lag
  const pid_t probe = spawn({GPUSLICE_PROBE, "monitor", "hold", "8", "0"},
                            merge(bypass, {{"FAKECUDA_CHAOS_SEED", "34"},
                                           {"FAKECUDA_CHAOS_CALLS", "alloc_common"},
                                           {"FAKECUDA_CHAOS_YIELD_PCT", "0"},
                                           {"FAKECUDA_CHAOS_SLEEP_PCT", "100"},
                                           {"FAKECUDA_CHAOS_SLEEP_US", "100000"}}),
                            box.path("probe.out"));
  bool allocating = false;
  for (int i = 0; i < 20000 && !allocating; ++i) {
    allocating = read_text(box.path("probe.out")).find("allocating") != std::string::npos;
    if (!allocating) usleep(1000);
  }
  usleep(20 * 1000);  // the call has begun; its probe's sampler sees the raise
  d.quota_bytes.store(6u << 20);
  const bool in_driver = read_text(box.path("probe.out")).find("alloc=") == std::string::npos;
  munmap(region, sizeof(Region));
  Result r = wait(probe, box.path("probe.out"));
  ASSERT_EQ(seen.exit_code, 0) << seen.describe();
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_TRUE(allocating) << r.describe();
  EXPECT_NE(r.out.find("alloc=0"), std::string::npos) << r.describe();
  if (!in_driver) GTEST_SKIP() << "the grant landed before the quota rose (a loaded machine): nothing was judged";
  const std::string report = read_text(box.path("violations"));
  EXPECT_NE(report.find("an allocation the driver granted left the container above its limit"), std::string::npos)
      << report;
  EXPECT_NE(report.find("device holds 8388608 bytes"), std::string::npos) << report;
}

// A spill's managed grant is excused while in flight; its advice to the host
// (an uncharge, made without the simulator's state lock) lowers what the
// process holds and then lands the grant. A check that read the held bytes
// before the advice and the flight after its landing counted the grant as
// held and not in flight: an excess the device never had, reported as a
// quota violation with gpuslice's count equal to it (the campaign's six
// `spill` seeds: 142-157 MiB on a 128 MiB allowance). Widened here by the
// monitor's test knob (--read-delay: a sleep between the two reads of each
// process); before the fix every such schedule failed (3 to 6 violations).
TEST(ChaosMonitor, AManagedGrantLandingDuringACheckIsNoExcess) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the knob's sleeps under the state lock, 10x slower: Release and ASan run it";
#endif
  Result r = run({CHAOS_TORTURE, "--seeds", "1", "--exact", "--classes", "resident-spill,fill", "--procs", "2",
                  "--threads", "2", "--ops", "8", "--read-delay", "2000"},
                 {}, 120000);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("summary: seeds=1 failed=0 violations=0"), std::string::npos) << r.describe();
  // Under spill: each fill (8 MiB at a time up to the 256 MiB quota) spills
  // past the 128 MiB allowance, so the window was there to be hit.
  EXPECT_NE(r.out.find("(spill)"), std::string::npos) << r.describe();
}

TEST(ChaosMonitor, CheckpointIsExactForAQuiescentProcess) {
  Sandbox box;
  create_region(box);
  // Under gpuslice the 16 MiB are committed: the exact check passes.
  Result counted = run({GPUSLICE_PROBE, "monitor", "hold", "16", "0", "checkpoint"}, monitored(box, true));
  ASSERT_EQ(counted.exit_code, 0) << counted.describe();
  EXPECT_NE(counted.out.find("checkpoint=0"), std::string::npos) << counted.describe();
  EXPECT_EQ(read_text(box.path("violations")), "");
  // Without it nothing is committed: 1 violation at once (no lag), though
  // 16 MiB are within the quota.
  Result bypass = run({GPUSLICE_PROBE, "monitor", "hold", "16", "0", "checkpoint"}, monitored(box, false));
  ASSERT_EQ(bypass.exit_code, 0) << bypass.describe();
  EXPECT_NE(bypass.out.find("checkpoint=1"), std::string::npos) << bypass.describe();
  const std::string report = read_text(box.path("violations"));
  EXPECT_NE(report.find("VIOLATION (count at checkpoint)"), std::string::npos) << report;
  EXPECT_NE(report.find("holds 16777216 bytes on the device; gpuslice committed 0"), std::string::npos) << report;
}

TEST(ChaosMonitor, GpusliceRefusingTheSameAllocationIsNoViolation) {
  Sandbox box;
  create_region(box);
  Result r = run({GPUSLICE_PROBE, "monitor", "hold", "128", "300"},
                 merge(monitored(box, true), {{"FAKECUDA_CHAOS_SEED", "7"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("alloc=2"), std::string::npos) << "refused: " << r.describe();
  EXPECT_EQ(read_text(box.path("violations")), "");
}

// The refusal direction. A torture worker (it reports each request and each
// CUDA_ERROR_OUT_OF_MEMORY to the monitor: monitor_request_begin/end) fills
// the container with 8 MiB allocations until gpuslice refuses, while the
// region says the agent sees 32 MiB beyond gpuslice's count
// (agent_extra_bytes), memory the device does not hold. With the agent's
// heartbeat fresh that is a documented conservative transient (the agent's
// figure, bounded by its next cycle); with no heartbeat it is stale (an agent
// that died), and the refusals came while the container had room: reported.
int fill_with_extra(const Sandbox& box, bool heartbeat, std::string* report, std::string* out) {
  create_region(box);
  Env env = monitored(box, true);
  Region* region = map_region(env);
  if (region == nullptr) return -1;
  region->devices[0].agent_extra_bytes.store(32u << 20);
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  region->header.agent_heartbeat_ns.store(
      heartbeat ? static_cast<std::uint64_t>(now.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(now.tv_nsec) : 0);
  Result r = run({CHAOS_TORTURE, "--worker", "0", "--seed", "1", "--threads", "1", "--ops", "4", "--classes", "fill",
                  "--quota", std::to_string(64u << 20)},
                 env, 60000);
  munmap(region, sizeof(Region));
  *report = read_text(box.path("violations"));
  *out = r.describe();
  return r.exit_code;
}

TEST(ChaosMonitor, ReportsARefusalWhileTheContainerHasRoom) {
  Sandbox box;
  std::string report, out;
  ASSERT_EQ(fill_with_extra(box, false, &report, &out), 0) << out;
  EXPECT_NE(report.find("VIOLATION (refusal)"), std::string::npos) << report << out;
  EXPECT_NE(report.find("cuMemAlloc of 8388608 bytes refused (CUDA_ERROR_OUT_OF_MEMORY)"), std::string::npos) << report;
  EXPECT_NE(report.find("fresh agent_extra_bytes 0)"), std::string::npos) << report;
}

// A refusal report names the processes whose slot counts more than the device
// holds for them, and each writes its last operations and its holdings to the
// report (issue 32, seed 1,175,727: another process counted 30 MiB it did not
// hold, and the report printed only the refusing process's, which held
// nothing). A (refusal_overlap, under gpuslice, its sampler off) holds 8 MiB
// and counts 24 MiB more; a torture worker fills the 64 MiB container until
// refused with room.
TEST(ChaosMonitor, ARefusalReportHasTheProcessesCountingMoreThanTheyHoldWriteTheirOperations) {
  Sandbox box;
  create_region(box);
  const Env env = monitored(box, true);
  const pid_t a = spawn({REFUSAL_OVERLAP, "overcount-held", "24", "15000"},
                        merge(env, {{"FAKECUDA_MONITOR_INTERVAL_MS", "0"}}), box.path("a.out"));
  for (int i = 0; i < 2000 && read_text(box.path("a.out")).find("ready=1") == std::string::npos; ++i) usleep(5000);
  Result w = run({CHAOS_TORTURE, "--worker", "0", "--seed", "1", "--threads", "1", "--ops", "4", "--classes", "fill",
                  "--quota", std::to_string(64u << 20)},
                 env, 60000);
  Result ra = wait(a, box.path("a.out"));
  ASSERT_EQ(ra.exit_code, 0) << ra.describe();
  const std::string report = read_text(box.path("violations"));
  ASSERT_NE(report.find("VIOLATION (refusal)"), std::string::npos) << w.describe() << report;
  const std::string pid = value(ra, "overcount-held", "pid");
  const std::size_t line = report.find("  processes counting more than the device holds for them");
  ASSERT_NE(line, std::string::npos) << report;
  EXPECT_NE(report.find(" pid " + pid + " ", line), std::string::npos) << report;
  EXPECT_EQ(value(ra, "overcount-held", "dumped"), "1") << ra.describe() << report;
  const std::size_t dump = report.find("fakecuda-monitor: holder pid " + pid + " (named by the report of pid ");
  ASSERT_NE(dump, std::string::npos) << report;
  EXPECT_NE(report.find("charge dev0 8388608 bytes (in alloc_common)", dump), std::string::npos) << report;
  EXPECT_NE(report.find("its holdings:\n    ", dump), std::string::npos) << report;
  EXPECT_NE(report.find(" size 8388608 held 8388608 dev0", dump), std::string::npos) << report;
}

TEST(ChaosMonitor, ARefusalExplainedByTheAgentsFreshFigureIsNoViolation) {
  Sandbox box;
  std::string report, out;
  ASSERT_EQ(fill_with_extra(box, true, &report, &out), 0) << out;
  EXPECT_EQ(report, "") << out;
}

// Issue 32 (docs/log/2026-11-29-agent-refusals.md, seed 223): a process
// mid-exit whose files are closed (the driver freed its memory at the last
// close) while its leader is a zombie and other threads still exit. The one
// rule keeps it alive (the zombie-leader rule; the lock's release cannot
// prove the device memory gone), so gpuslice counts it until its last thread
// is gone: a documented transient, bounded by the rest of its exit. Here a
// forked child whose main thread left (a zombie leader, one thread waiting
// on a pipe) owns a slot counting 32 MiB that no process of the simulator
// holds; a worker fills the 64 MiB container with 8 MiB allocations until
// refused at 32 MiB held. The process mid-exit explains that refusal.
void* wait_on_pipe(void* fd) {
  char c;
  while (read(*static_cast<int*>(fd), &c, 1) < 0) {}
  return nullptr;
}

// /proc/<pid>/stat fields 3 (state), 20 (threads) and 22 (start time).
bool stat_of(pid_t pid, char* state, unsigned long* threads, unsigned long long* start) {
  const std::string text = read_text("/proc/" + std::to_string(pid) + "/stat");
  const std::size_t paren = text.rfind(')');
  if (paren == std::string::npos) return false;
  std::istringstream in(text.substr(paren + 1));
  std::string field[20];
  for (std::string& f : field) in >> f;
  if (field[19].empty()) return false;
  *state = field[0][0];
  *threads = std::stoul(field[17]);
  *start = std::stoull(field[19]);
  return true;
}

TEST(ChaosMonitor, ARefusalExplainedByAProcessMidExitWithItsFilesClosedIsNoViolation) {
#if defined(__SANITIZE_THREAD__)
  // A thread created in a child forked from a process with TSan's background
  // thread can hang in the runtime, with SIGALRM deferred (CI's TSan lane hit
  // the 240 s timeout): the monitor's rule is plain code, Release and ASan run it.
  GTEST_SKIP() << "pthread_create after fork under TSan";
#endif
  Sandbox box;
  create_region(box);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pipe_fds[1]);
    alarm(60);  // never outlives the test
    pthread_t t;
    if (pthread_create(&t, nullptr, wait_on_pipe, &pipe_fds[0]) != 0) _exit(1);
    // The leader's thread alone exits (no unwinding through the test body):
    // the leader a zombie, the waiting thread alive.
    syscall(SYS_exit, 0);
  }
  close(pipe_fds[0]);
  char state = 0;
  unsigned long threads = 0;
  unsigned long long start = 0;
  for (int i = 0; i < 2000 && !(stat_of(child, &state, &threads, &start) && state == 'Z' && threads == 2); ++i)
    usleep(5000);
  if (state != 'Z' || threads != 2) {  // never leave the child holding the test's output
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  }
  ASSERT_EQ(state, 'Z');
  ASSERT_EQ(threads, 2u);

  Env env = monitored(box, true);
  Region* region = map_region(env);
  ASSERT_NE(region, nullptr);
  struct stat ns {};
  ASSERT_EQ(stat("/proc/self/ns/pid", &ns), 0);
  Slot& slot = region->slots[kMaxSlots - 1];
  slot.pid.store(static_cast<std::uint32_t>(child));
  slot.pidns_inode.store(ns.st_ino);
  slot.start_time.store(start);
  slot.committed_bytes[0].store(32u << 20);
  region->devices[0].used_bytes.fetch_add(32u << 20);
  slot.state.store(kSlotLive);
  Result r = run({CHAOS_TORTURE, "--worker", "0", "--seed", "1", "--threads", "1", "--ops", "4", "--classes", "fill",
                  "--quota", std::to_string(64u << 20)},
                 env, 60000);
  const bool still_mid_exit = stat_of(child, &state, &threads, &start) && state == 'Z' && threads == 2;
  const std::uint64_t counted = slot.committed_bytes[0].load();
  const std::uint32_t slot_state = slot.state.load();
  munmap(region, sizeof(Region));
  close(pipe_fds[1]);  // the waiting thread ends: the process is gone
  waitpid(child, nullptr, 0);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_TRUE(still_mid_exit);
  ASSERT_EQ(slot_state, static_cast<std::uint32_t>(kSlotLive)) << "the rule keeps a zombie leader with threads";
  ASSERT_EQ(counted, 32u << 20);
  EXPECT_EQ(read_text(box.path("violations")), "") << r.describe();
}

// A slot being reaped (kSlotReaping: judged dead, its count not yet out of
// used_bytes) while another reaper holds the region's reaper lock: a
// refusal waits for that reaper at most 20 ms, then refuses with the dead
// process's bytes counted (the agent subset's "24 MiB in used_bytes in no
// listed process's slot"). The documented transient, bounded by that reap:
// no violation. Before, the monitor reported it as a refusal with room.
TEST(ChaosMonitor, ARefusalExplainedByASlotBeingReapedIsNoViolation) {
  Sandbox box;
  create_region(box);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // gone: its device memory too
  Env env = monitored(box, true);
  Region* region = map_region(env);
  ASSERT_NE(region, nullptr);
  Slot& slot = region->slots[kMaxSlots - 1];
  slot.pid.store(static_cast<std::uint32_t>(child));
  slot.committed_bytes[0].store(32u << 20);
  region->devices[0].used_bytes.fetch_add(32u << 20);
  slot.state.store(kSlotReaping);
  // A reaper of another pid namespace holds the lock (never judged dead).
  region->header.reaper_lock.store(1);
  Result r = run({CHAOS_TORTURE, "--worker", "0", "--seed", "1", "--threads", "1", "--ops", "4", "--classes", "fill",
                  "--quota", std::to_string(64u << 20)},
                 env, 60000);
  const std::uint64_t counted = slot.committed_bytes[0].load();
  const std::uint32_t slot_state = slot.state.load();
  region->header.reaper_lock.store(0);
  munmap(region, sizeof(Region));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_EQ(slot_state, static_cast<std::uint32_t>(kSlotReaping)) << "reaped meanwhile: the case is not made";
  ASSERT_EQ(counted, 32u << 20);
  EXPECT_EQ(read_text(box.path("violations")), "") << r.describe();
}

// A request refused while another request of the container was in flight:
// gpuslice may have counted the other's reservation when it refused, and
// that request may end (refused too, its reservation given back) before this
// one is judged. The container holds 48 MiB of 64; A asks for 24 MiB (no
// room), B for 8 MiB while A is in flight (room once A is gone). Overlapping,
// A explains B's refusal (the documented transient: requests overlapping
// the refused one); apart, B's refusal is reported. Before, only requests
// still in flight at the judgement counted, and the overlap was reported
// too (the chaos suite's resident-wait refusals with "0 bytes beyond").
std::string refusal_pair(const Sandbox& box, const char* mode, std::string* out) {
  create_region(box);
  Result r = run({REFUSAL_OVERLAP, mode}, merge(monitored(box, false), {{"FAKECUDA_MONITOR_LAG_MS", "60000"}}), 60000);
  *out = r.describe();
  return r.exit_code == 0 ? value(r, "judged", "b") : "exit";
}

TEST(ChaosMonitor, ARefusalExplainedByAnOverlappingRequestThatEndedIsNoViolation) {
  Sandbox box;
  std::string out;
  EXPECT_EQ(refusal_pair(box, "overlap", &out), "0") << out << read_text(box.path("violations"));
  EXPECT_EQ(read_text(box.path("violations")).find("VIOLATION (refusal)"), std::string::npos)
      << read_text(box.path("violations"));
}

// Memory the program allocated outside CUDA while gpuslice measured an object
// of it (monitor_absorbed, monitor.h) explains a refusal by what it is and no
// more: the container holds 48 MiB of 64 and is refused 8 MiB; with 9 MiB so
// absorbed that is no violation, with 8 MiB it is (48 + 8 + 8 <= 64).
TEST(ChaosMonitor, OutsideMemoryMeasuredIntoAnObjectExplainsARefusalByItsBytesOnly) {
  Sandbox nine, eight;
  create_region(nine);
  create_region(eight);
  const Env lag{{"FAKECUDA_MONITOR_LAG_MS", "60000"}};
  Result r9 = run({REFUSAL_OVERLAP, "absorbed", "9"}, merge(monitored(nine, false), lag), 60000);
  Result r8 = run({REFUSAL_OVERLAP, "absorbed", "8"}, merge(monitored(eight, false), lag), 60000);
  EXPECT_EQ(value(r9, "judged", "b"), "0") << r9.describe() << read_text(nine.path("violations"));
  EXPECT_EQ(value(r8, "judged", "b"), "1") << r8.describe();
  EXPECT_NE(read_text(eight.path("violations")).find("outside memory measured into live objects 8388608"),
            std::string::npos)
      << read_text(eight.path("violations"));
}

// A graphics free (no CUDA call) inside a module's measured load leaves the
// module counted short by the freed bytes: NVML's usage of the process is
// all it uses, so nothing tells the free from the module's size
// (docs/memory.md). The checkpoint allows exactly the bytes freed during
// measurements of objects still alive (monitor_measured_short): 8 MiB freed
// inside the load, 8 allowed: none; 4 allowed: the 4 MiB left are reported
// (above the process's 2 MiB spare lease, which the checkpoint counts as
// committed); none allowed, as before: reported (the chaos suite's seeds
// 902710, 903600, 905882, 910000, 2026-11-29).
TEST(ChaosMonitor, AGraphicsFreeInsideAMeasurementIsAllowedAtCheckpointByItsBytesOnly) {
  const Env machine{{"FAKECUDA_MODULE_MEMORY", "1"}};
  const Env chaos{{"FAKECUDA_CHAOS_SEED", "3"},
                  {"FAKECUDA_CHAOS_YIELD_PCT", "0"},
                  {"FAKECUDA_CHAOS_SLEEP_PCT", "100"},
                  {"FAKECUDA_CHAOS_SLEEP_US", "100000"},
                  {"FAKECUDA_CHAOS_CALLS", "module_load"}};
  for (const char* allowed : {"8", "4", "0"}) {
    Sandbox box;
    create_region(box, machine);
    Result r = run({REFUSAL_OVERLAP, "measured-short", "8", allowed},
                   merge(monitored(box, true), merge(machine, chaos)), 60000);
    ASSERT_EQ(value(r, "load", "rc"), "0") << r.describe();
    ASSERT_EQ(unsigned_number(r, "load", "held") - unsigned_number(r, "load", "counted"), 8u << 20)
        << "the free landed inside the measurement: the module counted 8 MiB short\n"
        << r.describe();
    EXPECT_EQ(value(r, "load", "checkpoint"), std::string(allowed) == "8" ? "0" : "1")
        << "allowed " << allowed << " MiB\n"
        << r.describe() << read_text(box.path("violations"));
  }
}

// The library's refusal path trims the process's pools (the driver has the
// memory back) before it lowers their count: bytes the driver took back
// inside another request that overlaps the refused one explain it, and only
// those. The container holds 64 MiB of 64; B (1 MiB) frees 16 MiB inside its
// request, then A is refused 8 MiB (48 + 8 + 1 + 16 > 64): no violation; with
// the 16 MiB freed before B began, A's refusal is one (48 + 8 + 1 <= 64).
TEST(ChaosMonitor, BytesTrimmedInsideAnOverlappingRequestExplainARefusalOnlyThen) {
  Sandbox inside, before;
  create_region(inside);
  create_region(before);
  const Env lag{{"FAKECUDA_MONITOR_LAG_MS", "60000"}};
  Result ri = run({REFUSAL_OVERLAP, "reclaim"}, merge(monitored(inside, false), lag), 60000);
  Result rb = run({REFUSAL_OVERLAP, "noreclaim"}, merge(monitored(before, false), lag), 60000);
  EXPECT_EQ(value(ri, "judged", "a"), "0") << ri.describe() << read_text(inside.path("violations"));
  EXPECT_EQ(value(rb, "judged", "a"), "1") << rb.describe();
  EXPECT_NE(read_text(before.path("violations")).find("trimmed inside other requests 0,"), std::string::npos)
      << read_text(before.path("violations"));
}

// The refusal is judged after the call returned, with the state then; the
// agent's figure gpuslice refused under may be gone by then (issue 32, seed
// 2582 of the agent's subset: an 8 MiB refusal under an extra of 56 MiB in
// force, the agent's cycle writing 0 before the judgement: "fresh
// agent_extra_bytes 0", reported). The container holds 48 MiB of 64; B (8
// MiB) is refused under a fresh extra of 16 MiB. Its cycle writing 0 during
// B: no violation; the 0 written before B began: one (48 + 8 <= 64); a next
// cycle writing 0 during B (a figure in between unseen): not judged.
std::string judged_b(const Sandbox& box, std::vector<std::string> args, std::string* out) {
  create_region(box);
  args.insert(args.begin(), REFUSAL_OVERLAP);
  Result r = run(args, merge(monitored(box, false), {{"FAKECUDA_MONITOR_LAG_MS", "60000"}}), 60000);
  *out = r.describe() + read_text(box.path("violations"));
  return r.exit_code == 0 ? value(r, "judged", "b") : "exit";
}

TEST(ChaosMonitor, ARefusalUnderTheAgentsFigureInForceAtItsStartIsNoViolation) {
  Sandbox ends, gone, next;
  std::string out;
  EXPECT_EQ(judged_b(ends, {"extra-ends"}, &out), "0") << out;
  EXPECT_EQ(judged_b(gone, {"extra-gone"}, &out), "1") << out;
  EXPECT_NE(out.find("fresh agent_extra_bytes 0)"), std::string::npos) << out;
  EXPECT_EQ(judged_b(next, {"extra-next-cycle"}, &out), "0") << out;
  EXPECT_EQ(read_text(next.path("violations")), "") << out;
}

// A process mid-exit when the request began (a zombie leader, another
// thread still exiting: the library keeps it, the documented transient) may
// finish its exit before the refusal is judged; gpuslice still counts its
// slot then (it refused while the process was mid-exit, and no reap ran
// since): no violation (issue 32, seeds 1373 and 2582 of the agent's subset:
// a SIGKILLed worker's slot, "dead" when judged). A process already dead when
// the request began is no such transient (gpuslice reaps before it refuses):
// reported.
pid_t zombie_leader(int pipe_fds[2], unsigned long long* start) {
  if (pipe(pipe_fds) != 0) return -1;
  const pid_t child = fork();
  if (child == 0) {
    close(pipe_fds[1]);
    alarm(60);  // never outlives the test
    pthread_t t;
    if (pthread_create(&t, nullptr, wait_on_pipe, &pipe_fds[0]) != 0) _exit(1);
    syscall(SYS_exit, 0);  // the leader's thread alone exits
  }
  close(pipe_fds[0]);
  char state = 0;
  unsigned long threads = 0;
  for (int i = 0; i < 2000 && !(stat_of(child, &state, &threads, start) && state == 'Z' && threads == 2); ++i)
    usleep(5000);
  return child;
}

std::string judged_with_process(const char* mode, std::string* out) {
  Sandbox box;
  create_region(box);
  int pipe_fds[2];
  unsigned long long start = 0;
  const pid_t child = zombie_leader(pipe_fds, &start);
  if (child < 0) return "fork";
  Env env = monitored(box, false);
  Region* region = map_region(env);
  std::string b = "region";
  if (region != nullptr) {
    struct stat ns {};
    stat("/proc/self/ns/pid", &ns);
    Slot& slot = region->slots[kMaxSlots - 1];
    slot.pid.store(static_cast<std::uint32_t>(child));
    slot.pidns_inode.store(ns.st_ino);
    slot.start_time.store(start);
    slot.committed_bytes[0].store(32u << 20);
    region->devices[0].used_bytes.fetch_add(32u << 20);
    slot.state.store(kSlotLive);
    Result r =
        run({REFUSAL_OVERLAP, mode, std::to_string(child)}, merge(env, {{"FAKECUDA_MONITOR_LAG_MS", "60000"}}), 60000);
    *out = r.describe() + read_text(box.path("violations"));
    b = r.exit_code == 0 ? value(r, "judged", "b") : "exit";
    munmap(region, sizeof(Region));
  }
  kill(child, SIGKILL);
  close(pipe_fds[1]);
  waitpid(child, nullptr, 0);
  return b;
}

TEST(ChaosMonitor, ARefusalBesideAProcessWhoseExitEndedDuringItIsNoViolation) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "pthread_create after fork under TSan";  // as *MidExitWithItsFilesClosed*
#endif
  std::string out;
  EXPECT_EQ(judged_with_process("mid-exit-ends", &out), "0") << out;
  EXPECT_EQ(judged_with_process("dead-before", &out), "1") << out;
  EXPECT_NE(out.find("counted for processes mid-exit 0,"), std::string::npos) << out;
}

TEST(ChaosMonitor, ReportsARefusalAfterAnotherRequestEndedBeforeItBegan) {
  Sandbox box;
  std::string out;
  EXPECT_EQ(refusal_pair(box, "apart", &out), "1") << out;
  EXPECT_NE(read_text(box.path("violations")).find("cuMemAlloc of 8388608 bytes refused"), std::string::npos)
      << read_text(box.path("violations"));
}

// The chaos decisions of the probe's one thread, as its report lists them
// ("chaos: yield at point N (in call)", "chaos: sleep U us (in call)").
std::string decisions(const std::string& report) {
  std::string out;
  std::istringstream in(report);
  for (std::string line; std::getline(in, line);) {
    const std::size_t at = line.find("chaos: ");
    if (at != std::string::npos) out += line.substr(at) + "\n";
  }
  return out;
}

TEST(ChaosMode, TheSameSeedReplaysTheSameDecisions) {
  auto run_seed = [](const char* seed) {
    Sandbox box;
    create_region(box);
    Result r = run({GPUSLICE_PROBE, "monitor", "hold", "128", "0"},
                   merge(monitored(box, false), {{"FAKECUDA_CHAOS_SEED", seed},
                                                 {"FAKECUDA_CHAOS_YIELD_PCT", "40"},
                                                 {"FAKECUDA_CHAOS_SLEEP_PCT", "30"},
                                                 {"FAKECUDA_CHAOS_SLEEP_US", "20"}}));
    EXPECT_EQ(r.exit_code, 0) << r.describe();
    return decisions(read_text(box.path("violations")));
  };
  const std::string first = run_seed("11");
  EXPECT_NE(first, "") << "some chaos points perturbed";
  EXPECT_EQ(run_seed("11"), first);
  EXPECT_NE(run_seed("12"), first);
}

TEST(ChaosMode, BadVariablesFailCuInitNamingTheVariable) {
  Sandbox box;
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"FAKECUDA_CHAOS_SEED", "12x"},
                                                        {"FAKECUDA_CHAOS_YIELD_PCT", "101"},
                                                        {"FAKECUDA_CHAOS_SLEEP_US", "0"},
                                                        {"FAKECUDA_MONITOR", "yes"},
                                                        {"FAKECUDA_MONITOR_LAG_MS", "-1"}}) {
    Env env = merge(box.env(false), {{"FAKECUDA_CHAOS_SEED", "1"}});
    env[name] = value;
    Result r = run({GPUSLICE_PROBE, "monitor", "hold", "1", "0"}, env);
    EXPECT_EQ(r.exit_code, 2) << r.describe();
    EXPECT_NE(r.err.find(name + "='" + value + "'"), std::string::npos) << r.describe();
  }
}

// The CI subset: classes that pass on this branch (CHAOS_CI_CLASSES in
// CMakeLists.txt). Excluded, with the defect it finds today
// (docs/memory-accounting.md, "Chaos testing"): resident-wait (managed
// memory is not checked against the resident allowance). Re-enable a class
// when its fix merges.
constexpr const char* kCiClasses = CHAOS_CI_CLASSES;

TEST(ChaosTorture, ASchedulePastGpusliceFailsTheRun) {
  // The same container without the preload library: the workers fill the
  // device past the quota, and the launcher must say so and exit 1.
  Result r = run({CHAOS_TORTURE, "--seeds", "1-2", "--exact", "--classes", "alloc,fill", "--procs", "2", "--threads",
                  "2", "--ops", "40", "--no-preload"},
                 {}, 120000);
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.out.find("summary: seeds=2 failed=2"), std::string::npos) << r.describe();
  EXPECT_NE(r.out.find("fakecuda-monitor: VIOLATION (quota) seed=1"), std::string::npos) << r.describe();
}

TEST(ChaosTorture, AWorkerThatLdSoCouldNotPreloadFailsNamingTheCause) {
  // What a library rebuilt during a long run_many.sh does (issue 20's "kill"
  // schedules 558, 424, 677): ld.so cannot preload libgpuslice.so, warns,
  // and starts the worker without it. Such a worker must fail the schedule
  // and say why, not run unlimited and uncounted — which, when the others
  // run under gpuslice, the monitor reports as a live process with no
  // gpuslice slot holding memory above the quota, and, when none does, not
  // at all (no region: nothing to check, the schedule passed).
  Sandbox box;
  const std::string broken = box.path("libgpuslice.so");
  { std::ofstream(broken) << "not an ELF object"; }
  Result r = run({CHAOS_TORTURE, "--seeds", "1", "--exact", "--classes", "alloc,fill", "--procs", "2", "--threads", "1",
                  "--ops", "20", "--library", broken},
                 {}, 120000);
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_NE(r.out.find("summary: seeds=1 failed=1"), std::string::npos) << r.describe();
  EXPECT_NE(r.out.find("libgpuslice.so is not loaded"), std::string::npos) << r.describe();
}

TEST(ChaosTorture, CiSubsetOfSeededSchedulesHasNoViolation) {
  // The monitor's default lag (250 ms) rather than the torture's 100 ms: CI
  // machines are loaded, and a thread descheduled between a grant and its
  // count must not fail the run (the checkpoints are exact regardless).
  // Both directions: the quota, and refusals with room.
  Result r = run({CHAOS_TORTURE, "--seeds", CHAOS_CI_SEEDS, "--classes", kCiClasses, "--procs", "2", "--threads", "2",
                  "--ops", "100", "--lag", "250"},
                 {}, 200000);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("summary: "), std::string::npos) << r.describe();
  std::printf("%s", r.out.c_str());
}

// The deployed system under one oracle: the real gpuslice-agent (NVML
// reconciliation, reaping, region removal) beside the workers, restarted at
// random, with gpuslice-smi set from outside (CHAOS_CI_AGENT_CLASSES).
TEST(ChaosTorture, CiSubsetWithTheAgentBesideTheWorkersHasNoViolation) {
  // Both directions, as the subset above: the quota, and refusals with room.
  Result r = run({CHAOS_TORTURE, "--seeds", CHAOS_CI_AGENT_SEEDS, "--classes", CHAOS_CI_AGENT_CLASSES, "--procs", "2",
                  "--threads", "2", "--ops", "150", "--lag", "250"},
                 {}, 200000);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("summary: "), std::string::npos) << r.describe();
  std::printf("%s", r.out.c_str());
}

}  // namespace
}  // namespace gpuslice::test
