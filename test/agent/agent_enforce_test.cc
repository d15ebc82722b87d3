// --enforce (tools/agent/enforce.h): a container holding more device memory
// than its quota plus the tolerance, as NVML measures it, for --enforce-cycles
// cycles. Real processes in their own pid namespaces (containers) are killed
// or not; NVML's per-process figures are given to the cycle directly (these
// processes hold no device memory; with the simulated NVML in real
// containers: test/container/enforce_test.cc).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <deque>
#include <memory>
#include <vector>

#include "agent.h"
#include "agent_test_util.h"
#include "enforce.h"
#include "limiter/memory_accounting.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

// A pid namespace with two processes: its init, which maps the container's
// region file as the library does (the tests register it), and one more
// (the one that "went around the library"). map = "": the init maps nothing.
struct Container {
  pid_t unshare = -1;
  Identity init, other;
};

bool start_container(Container* c, const std::string& map) {
  const char* script =
      "import mmap, sys, time\n"
      "if sys.argv[1]:\n"
      "    f = open(sys.argv[1], 'r+b')\n"
      "    m = mmap.mmap(f.fileno(), 0)\n"
      "time.sleep(60)\n";
  c->unshare = test::spawn({"/usr/bin/unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "/bin/sh", "-c",
                            "sleep 60 & exec /usr/bin/python3 -c \"$1\" \"$2\"", "sh", script, map},
                           {}, "/dev/null");
  struct stat st {};
  if (!map.empty() && stat(map.c_str(), &st) != 0) return false;
  return eventually(
      [&] {
        auto kids = children_of(static_cast<std::uint32_t>(c->unshare));
        if (kids.size() != 1) return false;
        Identity init;
        if (!identity(kids[0], &init) || init.pidns == own_pidns() || init.ns_pid != 1) return false;
        auto inside = processes_in(init.pidns);
        if (inside.size() != 2) return false;
        if (!map.empty() && !agent::maps_file(init.host_pid, st.st_dev, st.st_ino)) return false;
        c->init = init;
        return identity(inside[0] == init.host_pid ? inside[1] : inside[0], &c->other);
      },
      20000);
}

void stop_container(Container& c) {
  if (c.unshare > 0) {
    kill(c.unshare, SIGKILL);
    test::wait(c.unshare);
  }
}

// The process is still the one identified (not exited, not a zombie).
bool alive(const Identity& id) {
  platform::procfs::Process p;
  return platform::procfs::read_process(id.host_pid, false, &p) == 0 && p.stat.start_time == id.start_time &&
         p.stat.state != 'Z' && p.stat.state != 'X';
}

agent::GpuSample sample_of(std::uint8_t uuid_byte, const std::vector<std::pair<std::uint32_t, std::uint64_t>>& procs) {
  agent::GpuSample sample;
  sample.devices.resize(1);
  agent::GpuDevice& g = sample.devices[0];
  uuid_bytes(uuid_byte, g.uuid);
  g.uuid_text = agent::format_uuid(g.uuid);
  for (const auto& [pid, bytes] : procs) g.processes.push_back({pid, bytes, true});
  g.processes_known = true;
  return sample;
}

// Registers a process as the library would, holding `charged`.
bool register_process(Region* r, const Identity& id, std::uint64_t charged) {
  const int slot = add_slot(r, id.ns_pid, id.pidns, id.start_time);
  EXPECT_GE(slot, 0);
  if (slot < 0) return false;
  if (charged != 0) {
    EXPECT_TRUE(limiter::charge(r, slot, first_device(r), charged));
  }
  return true;
}

// A sandbox; the regions and containers a test asks for, unmapped and stopped
// at its end; the agent it starts.
class AgentEnforce : public ::testing::Test {
 protected:
  void TearDown() override {
    for (Container& c : containers_) stop_container(c);
    for (Region* r : regions_) shm::detach(r);
  }
  // The region of a container (of `pod`): one device entry with this quota.
  // nullptr (the test failed) if it could not be made.
  Region* region(const std::string& pod, const std::string& name, std::uint64_t quota) {
    Region* r = make_region(container_region(box_, pod), name);
    if (r == nullptr) return nullptr;
    regions_.push_back(r);
    EXPECT_GE(add_device(r, 0x50, quota), 0);
    return r;
  }
  // A container whose init maps `map` ("": nothing); nullptr (the test failed) if it did not start.
  const Container* container(const std::string& map) {
    Container& c = containers_.emplace_back();
    const bool started = start_container(&c, map);
    EXPECT_TRUE(started) << "the container of '" << map << "' did not start";
    return started ? &c : nullptr;
  }
  // A container using gpuslice: its region, and its init mapping it and
  // registered holding `charged`. nullptr (the test failed) on any error.
  const Container* pod(const std::string& pod, const std::string& name, std::uint64_t quota, std::uint64_t charged) {
    Region* r = region(pod, name, quota);
    const Container* c = r == nullptr ? nullptr : container(container_region(box_, pod));
    return c != nullptr && register_process(r, c->init, charged) ? c : nullptr;
  }
  agent::Agent& start_agent(agent::EnforceMode mode) {
    agent::AgentConfig cfg = config_for(box_, false);
    cfg.enforce = mode;
    cfg.enforce_cycles = 3;
    cfg.bypass_tolerance_bytes = 32 * kMi;
    agent_ = std::make_unique<agent::Agent>(cfg);
    agent_->start();
    return *agent_;
  }

  Sandbox box_;
  std::deque<Container> containers_;  // a deque: what container() returned stays where it is
  std::vector<Region*> regions_;
  std::unique_ptr<agent::Agent> agent_;
};

constexpr const char* kNoPidNamespace = "unshare --pid is not permitted here";

TEST_F(AgentEnforce, KillKillsTheUnregisteredProcessAfterTheCycles) {
  if (!can_unshare_pid()) GTEST_SKIP() << kNoPidNamespace;
  const Container* c = pod("pod-a", "a", 256 * kMi, 100 * kMi);
  ASSERT_NE(c, nullptr);
  // The registered process holds what it accounted for; the other 1 GiB with no slot.
  const auto g = sample_of(0x50, {{c->init.host_pid, 100 * kMi}, {c->other.host_pid, 1024 * kMi}});
  agent::Agent& a = start_agent(agent::EnforceMode::kill);
  a.cycle_with(&g);
  a.cycle_with(&g);
  EXPECT_TRUE(alive(c->other)) << "two cycles over quota: not yet";
  EXPECT_EQ(a.stats().enforce.kills, 0u);
  a.cycle_with(&g);
  EXPECT_EQ(a.stats().enforce.kills, 1u);
  EXPECT_TRUE(eventually([&] { return !alive(c->other); }, 10000)) << "the unregistered process is killed";
  EXPECT_TRUE(alive(c->init)) << "the registered one, within its account, is not";
  EXPECT_NE(a.metrics_text().find("gpuslice_agent_enforce_kills_total{container=\"a\",region=\"pod-a/c.region\"} 1"),
            std::string::npos)
      << a.metrics_text();
  // NVML still lists the killed process while the driver tears it down: not
  // counted again, so nobody else is killed for its memory.
  for (int i = 0; i < 6; ++i) a.cycle_with(&g);
  EXPECT_EQ(a.stats().enforce.kills, 1u);
  EXPECT_TRUE(alive(c->init));
}

TEST_F(AgentEnforce, ReportOnlyReports) {
  if (!can_unshare_pid()) GTEST_SKIP() << kNoPidNamespace;
  const Container* c = pod("pod-a", "a", 256 * kMi, 100 * kMi);
  ASSERT_NE(c, nullptr);
  const auto g = sample_of(0x50, {{c->init.host_pid, 100 * kMi}, {c->other.host_pid, 1024 * kMi}});
  agent::Agent& a = start_agent(agent::EnforceMode::report);
  for (int i = 0; i < 10; ++i) a.cycle_with(&g);
  EXPECT_EQ(a.stats().enforce.over_reports, 1u) << "one report per episode";
  EXPECT_EQ(a.stats().enforce.kills, 0u);
  usleep(200'000);
  EXPECT_TRUE(alive(c->other));
  EXPECT_TRUE(alive(c->init));
}

TEST_F(AgentEnforce, ContainerWithinQuotaPlusToleranceIsNeverKilled) {
  if (!can_unshare_pid()) GTEST_SKIP() << kNoPidNamespace;
  const Container* c = pod("pod-a", "a", 256 * kMi, 200 * kMi);
  ASSERT_NE(c, nullptr);
  // 230 + 50 = 280 MiB: above the quota (256) but within the tolerance (32).
  const auto g = sample_of(0x50, {{c->init.host_pid, 230 * kMi}, {c->other.host_pid, 50 * kMi}});
  agent::Agent& a = start_agent(agent::EnforceMode::kill);
  for (int i = 0; i < 10; ++i) a.cycle_with(&g);
  EXPECT_EQ(a.stats().enforce.kills, 0u);
  EXPECT_EQ(a.stats().enforce.over_reports, 0u);
  usleep(200'000);
  EXPECT_TRUE(alive(c->init));
  EXPECT_TRUE(alive(c->other));
}

TEST_F(AgentEnforce, RegisteredProcessOverItsQuotaIsKilledAsTheLargestHolder) {
  if (!can_unshare_pid()) GTEST_SKIP() << kNoPidNamespace;
  const Container* c = pod("pod-a", "a", 256 * kMi, 100 * kMi);
  ASSERT_NE(c, nullptr);
  // Registered, but holding 1 GiB of which it accounted for 100 MiB (it went around its wrappers).
  const auto g = sample_of(0x50, {{c->init.host_pid, 1024 * kMi}});
  agent::Agent& a = start_agent(agent::EnforceMode::kill);
  for (int i = 0; i < 3; ++i) a.cycle_with(&g);
  EXPECT_EQ(a.stats().enforce.kills, 1u);
  EXPECT_TRUE(eventually([&] { return !alive(c->init); }, 10000));
}

TEST_F(AgentEnforce, ProcessesOfAnotherContainerOrOfTheNodeAreNeverKilled) {
  if (!can_unshare_pid()) GTEST_SKIP() << kNoPidNamespace;
  const Container* a_box = pod("pod-a", "a", 256 * kMi, 100 * kMi);
  ASSERT_NE(a_box, nullptr);
  const Container* b_box = pod("pod-b", "b", 2048 * kMi, 100 * kMi);
  ASSERT_NE(b_box, nullptr);
  // A node process (the agent's own pid namespace, no region) holding the most.
  pid_t node = test::spawn({"/bin/sleep", "60"}, {}, "/dev/null");
  Identity node_id;
  ASSERT_TRUE(eventually([&] { return identity(static_cast<std::uint32_t>(node), &node_id); }, 5000));
  // A is over through its unregistered process; B's unregistered process and
  // the node's hold more but B is within its quota and the node is no container.
  const auto g = sample_of(0x50, {{a_box->init.host_pid, 100 * kMi},
                                  {a_box->other.host_pid, 512 * kMi},
                                  {b_box->init.host_pid, 100 * kMi},
                                  {b_box->other.host_pid, 1500 * kMi},
                                  {node_id.host_pid, 4096 * kMi},
                                  {static_cast<std::uint32_t>(getpid()), 4096 * kMi}});
  agent::Agent& a = start_agent(agent::EnforceMode::kill);
  for (int i = 0; i < 12; ++i) a.cycle_with(&g);
  EXPECT_EQ(a.stats().enforce.kills, 1u);
  EXPECT_TRUE(eventually([&] { return !alive(a_box->other); }, 10000));
  usleep(200'000);
  EXPECT_TRUE(alive(a_box->init));
  EXPECT_TRUE(alive(b_box->init));
  EXPECT_TRUE(alive(b_box->other)) << "another container's process";
  EXPECT_TRUE(alive(node_id)) << "a node process";
  kill(node, SIGKILL);
  test::wait(node);
}

// A slot is the container's word: one forged to name the process of another
// container (one that does not use gpuslice, so its namespace is no region's)
// attributes that container's processes to the forger, but neither they nor
// the forged slot's process map the forger's region: nobody is killed.
TEST_F(AgentEnforce, AForgedSlotNamingAnotherContainersProcessGetsNothingKilled) {
  if (!can_unshare_pid()) GTEST_SKIP() << kNoPidNamespace;
  Region* r = region("pod-a", "a", 256 * kMi);
  ASSERT_NE(r, nullptr);
  const Container* other = container("");
  ASSERT_NE(other, nullptr);
  ASSERT_TRUE(register_process(r, other->init, 0));  // the forgery
  const auto g = sample_of(0x50, {{other->init.host_pid, 1024 * kMi}, {other->other.host_pid, 1024 * kMi}});
  agent::Agent& a = start_agent(agent::EnforceMode::kill);
  for (int i = 0; i < 6; ++i) a.cycle_with(&g);
  EXPECT_EQ(a.stats().enforce.over_reports, 1u) << "counted against the forger";
  EXPECT_EQ(a.stats().enforce.kills, 0u);
  usleep(200'000);
  EXPECT_TRUE(alive(other->init));
  EXPECT_TRUE(alive(other->other));
}

// The last check before the signal: a pid whose start time or pid namespace is
// not the one the agent attributed (the pid was recycled) is never signalled.
TEST_F(AgentEnforce, KillChecksTheProcessIdentityFirst) {
  pid_t child = test::spawn({"/bin/sleep", "60"}, {}, "/dev/null");
  Identity id;
  ASSERT_TRUE(eventually([&] { return identity(static_cast<std::uint32_t>(child), &id); }, 5000));
  std::string why;
  EXPECT_FALSE(agent::kill_if_same(id.host_pid, id.start_time + 1, id.pidns, &why));
  EXPECT_NE(why.find("start time"), std::string::npos) << why;
  EXPECT_FALSE(agent::kill_if_same(id.host_pid, id.start_time, id.pidns + 1, &why));
  EXPECT_NE(why.find("namespace"), std::string::npos) << why;
  EXPECT_FALSE(agent::kill_if_same(static_cast<std::uint32_t>(getpid()), id.start_time, 0, &why));
  EXPECT_FALSE(agent::kill_if_same(1, 0, 0, &why));
  usleep(100'000);
  EXPECT_TRUE(alive(id)) << "nothing was sent";
  EXPECT_TRUE(agent::kill_if_same(id.host_pid, id.start_time, id.pidns, &why)) << why;
  const test::Result res = test::wait(child);
  EXPECT_EQ(res.signal, SIGKILL) << res.describe();
}

// End to end with the simulated driver and NVML: a registered process holding
// device memory the library never admitted (a context it could not measure,
// standing in for memory allocated around its wrappers) makes its container
// 512 MiB + 16 MiB against a 128 MiB quota.
void over_quota_probe(const Sandbox& box, agent::EnforceMode mode) {
  const test::Env env = test::merge(box.env(), {{"GPUSLICE_REGION", container_region(box)},
                                                {"GPUSLICE_MEMORY_LIMIT", "128Mi"},
                                                {"FAKECUDA_CONTEXT_MEMORY", "512Mi"},
                                                {"GPUSLICE_REAL_LIBNVML", GPUSLICE_NVML_UNUSABLE}});
  const std::string ready = box.path("ready");
  pid_t probe = test::spawn(
      {test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(16 * kMi), "touch", ready, "sleep", "30000"},
      env, box.path("probe.out"));
  ASSERT_TRUE(eventually([&] { return file_exists(ready); }, 20000));
  agent::AgentConfig cfg = config_for(box);
  cfg.enforce = mode;
  cfg.enforce_cycles = 3;
  cfg.bypass_tolerance_bytes = 32 * kMi;
  agent::Agent a(cfg);
  a.start();
  ASSERT_TRUE(a.stats().nvml_available);
  a.cycle();
  a.cycle();
  EXPECT_EQ(a.stats().enforce.kills, 0u);
  a.cycle();
  EXPECT_EQ(a.stats().enforce.over_reports, 1u);
  if (mode == agent::EnforceMode::kill) {
    EXPECT_EQ(a.stats().enforce.kills, 1u);
    const test::Result res = test::wait(probe, "", 20000);
    EXPECT_EQ(res.signal, SIGKILL) << res.describe();
    return;
  }
  for (int i = 0; i < 5; ++i) a.cycle();
  EXPECT_EQ(a.stats().enforce.kills, 0u);
  EXPECT_EQ(kill(probe, 0), 0) << "reported only: still running";
  kill(probe, SIGKILL);
  test::wait(probe);
}

TEST_F(AgentEnforce, SimulatedDriverProcessOverTheQuotaIsKilled) { over_quota_probe(box_, agent::EnforceMode::kill); }
TEST_F(AgentEnforce, SimulatedDriverProcessOverTheQuotaIsOnlyReported) {
  over_quota_probe(box_, agent::EnforceMode::report);
}

TEST_F(AgentEnforce, FlagsAreCheckedByTheBinary) {
  const Sandbox& box = box_;
  mkdir(region_dir(box).c_str(), 0755);
  auto agent = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> argv{test::bin("gpuslice-agent"), "--region-dir", region_dir(box), "--no-nvml", "--once"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return test::run(argv, {});
  };
  const test::Result bad = agent({"--enforce", "evict"});
  EXPECT_EQ(bad.exit_code, 64) << bad.describe();
  EXPECT_NE(bad.err.find("--enforce 'evict': expected report or kill"), std::string::npos) << bad.err;
  EXPECT_EQ(agent({"--enforce-cycles", "0"}).exit_code, 64);
  const test::Result ok = agent({"--enforce", "kill", "--enforce-cycles", "5"});
  EXPECT_EQ(ok.exit_code, 0) << ok.describe();
  EXPECT_NE(ok.out.find("# TYPE gpuslice_agent_enforce_kills_total counter"), std::string::npos);
  EXPECT_NE(ok.out.find("# TYPE gpuslice_agent_tamper_repairs_total counter"), std::string::npos);
}

}  // namespace
