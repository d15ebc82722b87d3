// What a container (or anyone who can write below the region directory) can
// do to the agent with many files (issue 33, docs/agent.md "Scale"): junk
// renamed at every rescan must not flood the log, hard links of one region
// must not fill --max-regions, and regions past --max-regions are counted,
// not silently dropped.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

#include "agent.h"
#include "agent_test_util.h"

using namespace std::string_literals;

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

int count_lines(const std::string& text, const std::string& needle) {
  int n = 0;
  for (std::size_t pos = 0; (pos = text.find(needle, pos)) != std::string::npos; pos += needle.size()) ++n;
  return n;
}

// The value of a sample given by its name and labels, -1 if absent.
double metric(const std::string& text, const std::string& name) {
  const std::string head = "\n" + name + " ";
  const std::size_t at = text.find(head);
  return at == std::string::npos ? -1 : std::strtod(text.c_str() + at + head.size(), nullptr);
}

void make_container(const std::string& path, const std::string& name) {
  Region* r = make_region(path, name);
  ASSERT_NE(r, nullptr);
  add_device(r, 0xa0, 64 * kMi);
  shm::detach(r);
}

TEST(AgentFlood, JunkRenamedAtEveryRescanLogsABoundedNumberOfLines) {
  Sandbox box;
  const std::string dir = region_dir(box);
  mkdir(dir.c_str(), 0755);
  constexpr int kFiles = 2000;
  for (int i = 0; i < kFiles; ++i) write_file(dir + "/junk-" + std::to_string(i) + "-0.region", "not a region\n");
  std::atomic<bool> stop{false};
  std::atomic<int> passes{0};
  std::thread renamer([&] {
    for (int gen = 0; !stop.load(); ++gen) {
      for (int i = 0; i < kFiles; ++i) {
        const std::string base = dir + "/junk-" + std::to_string(i) + "-";
        rename((base + std::to_string(gen) + ".region").c_str(), (base + std::to_string(gen + 1) + ".region").c_str());
      }
      passes.fetch_add(1);
    }
  });
  test::Result r = test::run({"/usr/bin/timeout", "-s", "TERM", "4", test::bin("gpuslice-agent"), "--region-dir", dir,
                              "--no-nvml", "--interval", "10ms", "--rescan", "10ms", "--listen", "off"},
                             {}, 30000);
  stop.store(true);
  renamer.join();
  EXPECT_EQ(r.exit_code, 124) << r.describe();
  ASSERT_GE(passes.load(), 3) << "the files were not renamed between rescans";
  // The budget: 32 lines, then one every 2 s; and one summary line.
  const int skipping = count_lines(r.err, "skipping ");
  EXPECT_GE(skipping, 32) << r.err.substr(0, 4000);
  EXPECT_LE(skipping, 36) << "lines: " << skipping << ", bytes: " << r.err.size();
  EXPECT_EQ(count_lines(r.err, "were not logged"), 1) << r.err.substr(r.err.size() > 4000 ? r.err.size() - 4000 : 0);
  EXPECT_LT(r.err.size(), 16u * 1024) << "lines: " << skipping;
}

TEST(AgentFlood, HardLinksOfOneRegionAreOneRegion) {
  Sandbox box;
  agent::AgentConfig cfg = config_for(box, false);
  cfg.max_regions = 16;
  const std::string a = container_region(box, "pod-a");
  make_container(a, "a");
  if (HasFatalFailure()) return;
  for (int i = 0; i < 64; ++i) {
    ASSERT_EQ(link(a.c_str(), (region_dir(box) + "/pod-a/link-" + std::to_string(i) + ".region").c_str()), 0);
  }
  make_container(container_region(box, "pod-b"), "b");  // a container started later
  if (HasFatalFailure()) return;
  agent::Agent agent(cfg);
  agent.start();
  for (int i = 0; i < 3; ++i) agent.cycle();
  EXPECT_EQ(agent.stats().regions, 2u);
  const std::string text = agent.metrics_text();
  EXPECT_NE(text.find("region=\"pod-b/c.region\""), std::string::npos) << "the later container is not watched";
  EXPECT_EQ(metric(text, "gpuslice_agent_regions_unwatched"), 0) << text;
}

TEST(AgentFlood, RegionsPastTheCapAreCountedAndLoggedOnce) {
  Sandbox box;
  agent::AgentConfig cfg = config_for(box, false);
  cfg.max_regions = 4;
  for (int i = 0; i < 10; ++i) make_container(container_region(box, "pod-"s + std::to_string(i)), "c");
  if (HasFatalFailure()) return;
  {
    agent::Agent agent(cfg);
    agent.start();
    for (int i = 0; i < 3; ++i) agent.cycle();
    const std::string text = agent.metrics_text();
    EXPECT_EQ(metric(text, "gpuslice_agent_regions"), 4) << text;
    EXPECT_EQ(metric(text, "gpuslice_agent_regions_max"), 4) << text;
    EXPECT_EQ(metric(text, "gpuslice_agent_regions_unwatched"), 6) << text;
  }
  // The binary, rescanning every 10 ms for a second: one line, not one per rescan.
  test::Result r =
      test::run({"/usr/bin/timeout", "-s", "TERM", "1", test::bin("gpuslice-agent"), "--region-dir", region_dir(box),
                 "--no-nvml", "--interval", "10ms", "--rescan", "10ms", "--listen", "off", "--max-regions", "4"},
                {}, 20000);
  EXPECT_EQ(r.exit_code, 124) << r.describe();
  EXPECT_EQ(count_lines(r.err, "are not watched"), 1) << r.err;
}

// The agent reads only the slots it knows to be busy (slot_index.h): a claim
// or a release must still be seen at the next cycle, not at the next
// periodic re-read of the slot array.
TEST(AgentSlots, AClaimAndAReleaseAreSeenAtTheNextCycle) {
  Sandbox box;
  agent::AgentConfig cfg = config_for(box, false);
  cfg.verify_ns = 1'000'000'000;
  const std::string path = container_region(box, "pod-a");
  make_container(path, "a");
  if (HasFatalFailure()) return;
  agent::Agent agent(cfg);
  agent.start();
  agent.cycle();
  agent.cycle();
  EXPECT_EQ(metric(agent.metrics_text(), "gpuslice_container_processes{container=\"a\",region=\"pod-a/c.region\"}"), 0);
  Region* r = attach(path);
  ASSERT_NE(r, nullptr);
  Identity me;
  ASSERT_TRUE(identity(static_cast<std::uint32_t>(getpid()), &me));
  const int slot = add_slot(r, me.ns_pid, me.pidns, me.start_time);
  ASSERT_GE(slot, 0);
  agent.cycle();
  EXPECT_EQ(metric(agent.metrics_text(), "gpuslice_container_processes{container=\"a\",region=\"pod-a/c.region\"}"), 1);
  EXPECT_EQ(r->slots[slot].host_pid.load(), static_cast<std::uint32_t>(getpid())) << "the agent mapped the new process";
  shm::release_slot(r, slot);
  agent.cycle();
  EXPECT_EQ(metric(agent.metrics_text(), "gpuslice_container_processes{container=\"a\",region=\"pod-a/c.region\"}"), 0);
  shm::detach(r);
}

}  // namespace
