// The agent with real processes: cuprobe under libgpuslice.so against the
// simulated driver and NVML, processes in their own pid namespace, SIGKILL,
// an agent killed and restarted, /metrics scraped over HTTP.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <sstream>

#include "agent.h"
#include "agent_test_util.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"
#include "nvml.h"

using namespace std::string_literals;

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Env;
using gpuslice::test::Sandbox;

namespace {

constexpr int kOutOfMemory = 2;  // CUDA_ERROR_OUT_OF_MEMORY

Env container_env(const Sandbox& box, const Env& extra, const std::string& pod = "pod-1") {
  return test::merge(box.env(), test::merge({{"GPUSLICE_REGION", container_region(box, pod)}}, extra));
}

// The first live slot of a region.
int first_live_slot(const Region* r) {
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
    if (r->slots[i].state.load() == kSlotLive) return static_cast<int>(i);
  }
  return -1;
}
int live_slots(const Region* r) {
  int n = 0;
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) n += r->slots[i].state.load() != kSlotFree;
  return n;
}

// One sample line of the text exposition format: name, optional {label="value",...}
// (values with \\, \" and \n escapes), a space, a number. key = name{labels}.
bool parse_sample(const std::string& line, std::string* key, double* value) {
  auto name_char = [](char c, bool first) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' || (!first && c >= '0' && c <= '9');
  };
  std::size_t i = 0;
  while (i < line.size() && name_char(line[i], i == 0)) ++i;
  if (i == 0) return false;
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (i < line.size() && line[i] != '}') {
      const std::size_t start = i;
      while (i < line.size() && name_char(line[i], i == start) && line[i] != ':') ++i;
      if (i == start || line.compare(i, 2, "=\"") != 0) return false;
      i += 2;
      while (i < line.size() && line[i] != '"') {
        if (line[i] == '\\') {
          if (i + 1 >= line.size() || (line[i + 1] != '\\' && line[i + 1] != '"' && line[i + 1] != 'n')) return false;
          ++i;
        }
        ++i;
      }
      if (i >= line.size()) return false;
      ++i;  // closing quote
      if (i < line.size() && line[i] == ',') ++i;
    }
    if (i >= line.size()) return false;
    ++i;  // '}'
  }
  if (i >= line.size() || line[i] != ' ') return false;
  *key = line.substr(0, i);
  const std::string number = line.substr(i + 1);
  if (number == "NaN" || number == "+Inf" || number == "-Inf") {
    *value = 0;
    return true;
  }
  char* end = nullptr;
  *value = std::strtod(number.c_str(), &end);
  return !number.empty() && *end == '\0';
}

TEST(AgentReconcile, ContextMemoryTheLibraryCannotSeeIsAddedToTheContainer) {
  Sandbox box;
  // No NVML for the library (one that loads but does not start: a path that
  // does not load fails closed): it cannot measure its contexts; the agent can.
  Env env = container_env(box, {{"GPUSLICE_MEMORY_LIMIT", "128Mi"},
                                {"FAKECUDA_CONTEXT_MEMORY", "64Mi"},
                                {"GPUSLICE_REAL_LIBNVML", GPUSLICE_NVML_UNUSABLE}});
  const std::string ready = box.path("ready"), go = box.path("go"), done = box.path("done"), end = box.path("end");
  const std::string out = box.path("probe.out");
  pid_t probe = test::spawn(
      {test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(16 * kMi), "touch", ready, "waitfile", go,
       "alloc", std::to_string(64 * kMi), "alloc", std::to_string(32 * kMi), "touch", done, "waitfile", end},
      env, out);
  ASSERT_TRUE(eventually([&] { return file_exists(ready); }, 20000));
  auto cfg = config_for(box);
  cfg.bypass_tolerance_bytes = 32 * kMi;
  agent::Agent a(cfg);
  a.start();
  ASSERT_TRUE(a.stats().nvml_available);
  a.cycle();
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  const int dev = first_device(r);
  const int slot = first_live_slot(r);
  ASSERT_GE(dev, 0);
  ASSERT_GE(slot, 0);
  EXPECT_EQ(r->devices[dev].used_bytes.load() - limiter::spare_lease_bytes(r, dev), 16 * kMi);  // leases aside
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 64 * kMi) << "the context, seen only by NVML";
  EXPECT_EQ(limiter::used_bytes(r, dev), 80 * kMi);
  EXPECT_EQ(r->slots[slot].nvml_used_bytes[dev].load(), 80 * kMi);
  EXPECT_EQ(r->slots[slot].host_pid.load(), static_cast<std::uint32_t>(probe));
  EXPECT_EQ(a.stats().bypass_reports, 1u) << "64Mi unaccounted > 32Mi tolerance";
  EXPECT_NE(a.metrics_text().find(
                "gpuslice_bypass_suspected_processes{container=\"\",region=\"pod-1/c.region\",device=\"0\""),
            std::string::npos);

  // The quota now bounds what the device really holds: 16 + 64 (context) + 64 > 128.
  test::run({"/usr/bin/touch", go}, {});
  ASSERT_TRUE(eventually([&] { return file_exists(done); }, 20000));
  a.cycle();
  EXPECT_EQ(r->devices[dev].used_bytes.load() - limiter::spare_lease_bytes(r, dev), 48 * kMi);
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 64 * kMi);
  test::run({"/usr/bin/touch", end}, {});
  test::Result res = test::wait(probe, out);
  ASSERT_EQ(res.exit_code, 0) << res.describe();
  const auto rcs = test::lines_with(res.out, "alloc ");
  ASSERT_EQ(rcs.size(), 3u) << res.out;
  EXPECT_EQ(test::field(rcs[0], "rc"), "0");
  EXPECT_EQ(test::field(rcs[1], "rc"), std::to_string(kOutOfMemory)) << "64Mi more would exceed the quota";
  EXPECT_EQ(test::field(rcs[2], "rc"), "0") << "32Mi more fits exactly";

  // The process is gone: NVML shows nothing, so nothing extra is charged.
  a.cycle();
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 0u);
  shm::detach(r);
}

// Issue 32 (docs/log/2026-11-29-agent-refusals.md, seed 1175): the agent
// samples NVML, then reads the count. A free (driver first, count after)
// ending in between was in NVML's figure and no longer in the count: added
// as agent_extra_bytes for a cycle, and an allocation with room was refused.
// Here the test takes the sample between two note_counts (as cycle() does),
// lets the free run to its end, then runs the cycle on that sample.
TEST(AgentReconcile, AFreeEndingAfterTheNvmlSampleIsNoExtra) {
  Sandbox box;
  Env env = container_env(box, {{"GPUSLICE_MEMORY_LIMIT", "128Mi"}});
  const std::string ready = box.path("ready"), go = box.path("go"), done = box.path("done"), end = box.path("end");
  const std::string out = box.path("probe.out");
  pid_t probe = test::spawn({test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(64 * kMi), "touch",
                             ready, "waitfile", go, "free", "touch", done, "waitfile", end},
                            env, out);
  ASSERT_TRUE(eventually([&] { return file_exists(ready); }, 20000)) << read_file(out);
  agent::Agent a(config_for(box));
  a.start();
  ASSERT_TRUE(a.stats().nvml_available);
  a.cycle();
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  const int dev = first_device(r);
  ASSERT_GE(dev, 0);
  ASSERT_EQ(r->devices[dev].agent_extra_bytes.load(), 0u) << "everything NVML sees is counted";

  agent::Nvml nvml;
  std::string why;
  ASSERT_TRUE(nvml.open(fake_nvml(), &why)) << why;
  agent::GpuSample sample;
  a.note_counts();
  nvml.sample(&sample);  // the 64 MiB still on the device
  a.note_counts();
  test::run({"/usr/bin/touch", go}, {});
  ASSERT_TRUE(eventually([&] { return file_exists(done); }, 20000)) << read_file(out);
  a.cycle_with(&sample);  // the count read after the free ended
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 0u)
      << "a free that ended after the NVML sample is no memory held beyond the count";
  a.cycle();
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 0u);

  test::run({"/usr/bin/touch", end}, {});
  test::Result res = test::wait(probe, out);
  ASSERT_EQ(res.exit_code, 0) << res.describe();
  const auto rcs = test::lines_with(res.out, "free ");
  ASSERT_EQ(rcs.size(), 1u) << res.out;
  EXPECT_EQ(test::field(rcs[0], "rc"), "0");
  shm::detach(r);
}

// Issue 20: a spare quota lease admitted before the agent found memory held
// beyond our count (a context the library cannot measure) was spent past it.
// The agent's store of the larger agent_extra_bytes invalidates the leases:
// the next allocation admits again under quota - extra.
TEST(AgentReconcile, MoreExtraMakesSpareLeasesUnspendable) {
  Sandbox box;
  Env env = container_env(box, {{"GPUSLICE_MEMORY_LIMIT", "128Mi"},
                                {"FAKECUDA_CONTEXT_MEMORY", "100Mi"},
                                {"GPUSLICE_REAL_LIBNVML", GPUSLICE_NVML_UNUSABLE}});
  const std::string ready = box.path("ready"), go = box.path("go"), done = box.path("done");
  const std::string out = box.path("probe.out");
  // 16 MiB in use and a 14 MiB spare lease ((128 - 16) / 8), taken while the
  // context is still unknown to the count.
  pid_t probe =
      test::spawn({test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(16 * kMi), "touch", ready,
                   "waitfile", go, "alloc", std::to_string(14 * kMi), "alloc", std::to_string(12 * kMi), "touch", done},
                  env, out);
  ASSERT_TRUE(eventually([&] { return file_exists(ready); }, 20000));
  agent::Agent a(config_for(box));
  a.start();
  ASSERT_TRUE(a.stats().nvml_available);
  a.cycle();
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  const int dev = first_device(r);
  ASSERT_GE(dev, 0);
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 100 * kMi);
  test::run({"/usr/bin/touch", go}, {});
  ASSERT_TRUE(eventually([&] { return file_exists(done); }, 20000));
  test::Result res = test::wait(probe, out);
  ASSERT_EQ(res.exit_code, 0) << res.describe();
  const auto rcs = test::lines_with(res.out, "alloc ");
  ASSERT_EQ(rcs.size(), 3u) << res.out;
  EXPECT_EQ(test::field(rcs[1], "rc"), std::to_string(kOutOfMemory))
      << "16 + 14 + 100 (context) > 128: the spare was spent";
  EXPECT_EQ(test::field(rcs[2], "rc"), "0") << "16 + 12 + 100 fits exactly";
  shm::detach(r);
}

TEST(AgentReap, SlotOfAProcessKilledBySigkillIsReclaimed) {
  Sandbox box;
  Env env = container_env(box, {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
  pid_t probe = test::spawn({test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(32 * kMi), "touch",
                             box.path("held"), "sleep", "30000"},
                            env, "/dev/null");
  ASSERT_TRUE(eventually([&] { return file_exists(box.path("held")); }, 20000));
  agent::Agent a(config_for(box, false));  // the reaper needs no NVML
  a.start();
  a.cycle();
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  const int dev = first_device(r);
  ASSERT_GE(dev, 0);
  EXPECT_EQ(r->devices[dev].used_bytes.load() - limiter::spare_lease_bytes(r, dev), 32 * kMi);
  EXPECT_EQ(live_slots(r), 1);
  kill(probe, SIGKILL);
  test::wait(probe);
  a.cycle();
  EXPECT_EQ(live_slots(r), 0);
  EXPECT_EQ(r->devices[dev].used_bytes.load(), 0u) << "the dead process's 32Mi are given back";
  EXPECT_EQ(a.stats().slots_reaped, 1u);
  EXPECT_EQ(r->header.slots_reaped.load(), 1u);
  shm::detach(r);
}

// Processes in their own pid namespace (a container): the agent finds their
// host pids through /proc, attributes NVML's per-process figures (given here
// directly: these processes hold no device memory; the simulated NVML's own
// host pids are tested in real containers, test/container/enforce_test.cc),
// including a process that never registered, and reaps them once killed.
TEST(AgentPidNamespace, ProcessesOfAPidNamespaceAreMappedAttributedAndReaped) {
  if (!can_unshare_pid()) GTEST_SKIP() << "unshare --pid is not permitted here (needs root or user namespaces)";
  Sandbox box;
  pid_t unshare = test::spawn({"/usr/bin/unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "/bin/sh", "-c",
                               "sleep 60 & exec sleep 60"},
                              {}, "/dev/null");
  std::vector<std::uint32_t> inside;
  std::uint64_t ns = 0;
  ASSERT_TRUE(eventually(
      [&] {
        auto kids = children_of(static_cast<std::uint32_t>(unshare));
        if (kids.size() != 1) return false;
        Identity init;
        if (!identity(kids[0], &init) || init.pidns == own_pidns()) return false;
        ns = init.pidns;
        inside = processes_in(ns);
        return inside.size() == 2;
      },
      10000));
  Identity registered, unregistered;
  ASSERT_TRUE(identity(inside[0], &registered));
  ASSERT_TRUE(identity(inside[1], &unregistered));
  ASSERT_NE(registered.ns_pid, registered.host_pid) << "the namespace numbers its processes from 1";

  const std::string path = container_region(box);
  Region* r = make_region(path, "in-a-namespace");
  ASSERT_NE(r, nullptr);
  const int dev = add_device(r, 0x50, 512 * kMi);
  const int slot = add_slot(r, registered.ns_pid, registered.pidns, registered.start_time);
  ASSERT_GE(slot, 0);
  ASSERT_TRUE(limiter::charge(r, slot, dev, 100 * kMi));

  agent::GpuSample sample;
  sample.devices.resize(1);
  agent::GpuDevice& g = sample.devices[0];
  uuid_bytes(0x50, g.uuid);
  g.uuid_text = agent::format_uuid(g.uuid);
  g.processes = {{registered.host_pid, 100 * kMi, true}, {unregistered.host_pid, 300 * kMi, true}};
  g.util_busy_ns = {{registered.host_pid, 20'000'000}, {unregistered.host_pid, 30'000'000}};
  g.util_window_ns = 100'000'000;
  g.processes_known = g.util_known = g.device_util_known = true;
  g.device_util_permille = 500;

  auto cfg = config_for(box, false);
  agent::Agent a(cfg);
  a.start();
  a.cycle_with(&sample);
  EXPECT_EQ(r->slots[slot].host_pid.load(), registered.host_pid) << "container pid " << registered.ns_pid;
  EXPECT_EQ(r->slots[slot].nvml_used_bytes[dev].load(), 100 * kMi);
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 300 * kMi) << "the unregistered process counts too";
  EXPECT_EQ(r->devices[dev].util_permille.load(), 500u);
  EXPECT_EQ(r->devices[dev].device_util_permille.load(), 500u);
  EXPECT_NE(r->devices[dev].util_updated_ns.load(), 0u);
  EXPECT_EQ(a.stats().unregistered_reports, 1u);
  EXPECT_EQ(a.stats().bypass_reports, 0u);
  const std::string metrics = a.metrics_text();
  EXPECT_NE(metrics.find("gpuslice_unregistered_processes{container=\"in-a-namespace\",region=\"pod-1/c.region\","
                         "device=\"0\",uuid=\"" +
                         g.uuid_text + "\"} 1"),
            std::string::npos)
      << metrics;

  // The whole namespace dies: the agent sees the exit through its pidfd.
  kill(static_cast<pid_t>(inside[0] < inside[1] ? inside[0] : inside[1]), SIGKILL);
  kill(unshare, SIGKILL);
  test::wait(unshare);
  agent::GpuSample empty;
  ASSERT_TRUE(eventually(
      [&] {
        a.cycle_with(&empty);
        return r->slots[slot].state.load() == kSlotFree;
      },
      5000));
  EXPECT_EQ(r->devices[dev].used_bytes.load(), 0u);
  EXPECT_EQ(a.stats().slots_reaped, 1u);
  shm::detach(r);
}

// Stateless: an agent killed with SIGKILL and started again carries on from the
// regions alone (reaps what died meanwhile, heartbeats again).
TEST(AgentRestart, KilledAgentRestartsFromTheRegionsAlone) {
  Sandbox box;
  mkdir(region_dir(box).c_str(), 0755);
  Env env = container_env(box, {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
  pid_t probe = test::spawn({test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(8 * kMi), "touch",
                             box.path("held"), "sleep", "30000"},
                            env, "/dev/null");
  ASSERT_TRUE(eventually([&] { return file_exists(box.path("held")); }, 20000));
  const std::vector<std::string> agent_argv{test::bin("gpuslice-agent"),
                                            "--region-dir",
                                            region_dir(box),
                                            "--nvml",
                                            fake_nvml(),
                                            "--interval",
                                            "20ms",
                                            "--listen",
                                            "off"};
  Env agent_env = test::merge(box.env(false), {});
  pid_t first = test::spawn(agent_argv, agent_env, "/dev/null");
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(eventually([&] { return r->header.agent_heartbeat_ns.load() != 0; }, 10000));
  kill(first, SIGKILL);
  test::wait(first);
  const std::uint64_t last_beat = r->header.agent_heartbeat_ns.load();
  kill(probe, SIGKILL);
  test::wait(probe);
  EXPECT_EQ(live_slots(r), 1) << "nobody reaped it while the agent was down";

  pid_t second = test::spawn(agent_argv, agent_env, "/dev/null");
  EXPECT_TRUE(eventually([&] { return live_slots(r) == 0 && r->header.agent_heartbeat_ns.load() > last_beat; }, 10000));
  const int dev = first_device(r);
  ASSERT_GE(dev, 0);
  EXPECT_EQ(r->devices[dev].used_bytes.load(), 0u);
  kill(second, SIGTERM);
  test::Result res = test::wait(second);
  EXPECT_EQ(res.exit_code, 0) << res.describe();
  shm::detach(r);
}

// /metrics over HTTP with a real client, parsed line by line.
TEST(AgentMetrics, ScrapedOverHttpAndParsed) {
  Sandbox box;
  mkdir(region_dir(box).c_str(), 0755);
  Env env = container_env(box, {{"GPUSLICE_MEMORY_LIMIT", "64Mi"},
                                {"GPUSLICE_SM_LIMIT", "30"},
                                {"GPUSLICE_CONTAINER_NAME", "web \"front\"\\1"}});
  pid_t probe = test::spawn({test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(8 * kMi), "touch",
                             box.path("held"), "waitfile", box.path("end")},
                            env, "/dev/null");
  ASSERT_TRUE(eventually([&] { return file_exists(box.path("held")); }, 20000));
  // Allocations refused because a process's records could not grow (issue
  // 35, test/hardening/limits_test.cc) are counted where the agent reads them.
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  r->devices[0].record_refusals.store(3);
  shm::detach(r);
  const int port = free_port();
  ASSERT_GT(port, 0);
  pid_t agent = test::spawn({test::bin("gpuslice-agent"), "--region-dir", region_dir(box), "--nvml", fake_nvml(),
                             "--interval", "20ms", "--listen", "127.0.0.1:"s + std::to_string(port)},
                            box.env(false), "/dev/null");
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1, 0);
  client.set_read_timeout(5, 0);
  ASSERT_TRUE(eventually(
      [&] {
        auto res = client.Get("/healthz");
        return res && res->status == 200;
      },
      10000));
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->get_header_value("Content-Type").find("text/plain"), std::string::npos);

  // Every line: a comment, or name{labels} value.
  std::map<std::string, double> values;  // "name{labels}" -> value
  std::istringstream in(res->body);
  std::string line;
  int samples = 0;
  while (std::getline(in, line)) {
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
    std::string key;
    double value = 0;
    ASSERT_TRUE(parse_sample(line, &key, &value)) << "not exposition format: " << line;
    values[key] = value;
    ++samples;
  }
  EXPECT_GT(samples, 20);
  const std::string labels = "{container=\"web \\\"front\\\"\\\\x5c1\",region=\"pod-1/c.region\",device=\"0\",uuid=\"";
  auto find = [&](const std::string& name) -> double {
    for (const auto& [k, v] : values) {
      if (k.rfind(name + labels, 0) == 0) return v;
    }
    ADD_FAILURE() << "no " << name << labels << "...} in\n" << res->body;
    return -1;
  };
  EXPECT_EQ(find("gpuslice_memory_quota_bytes"), 64.0 * kMi);
  EXPECT_EQ(find("gpuslice_memory_counted_bytes"), 8.0 * kMi);
  EXPECT_EQ(find("gpuslice_memory_used_bytes"), 8.0 * kMi);
  EXPECT_EQ(find("gpuslice_sm_limit_percent"), 30);
  EXPECT_EQ(find("gpuslice_processes"), 1);
  EXPECT_EQ(find("gpuslice_oom_refusals_total"), 0);
  EXPECT_EQ(find("gpuslice_record_refusals_total"), 3);
  EXPECT_GE(find("gpuslice_sm_utilization_ratio"), 0);
  EXPECT_EQ(find("gpuslice_throttled_seconds_total"), 0);
  EXPECT_EQ(values["gpuslice_agent_nvml_available"], 1);
  EXPECT_GE(values["gpuslice_agent_cycles_total"], 1);
  EXPECT_EQ(values["gpuslice_agent_regions"], 1);
  EXPECT_GT(values["gpuslice_agent_cycle_seconds"], 0);
  auto missing = client.Get("/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);

  test::run({"/usr/bin/touch", box.path("end")}, {});
  EXPECT_EQ(test::wait(probe).exit_code, 0);
  kill(agent, SIGTERM);
  test::Result a = test::wait(agent);
  EXPECT_EQ(a.exit_code, 0) << a.describe();
}

}  // namespace
