// The agent under HAMi's host layout (tools/agent/layout.h): regions in
// <hami-root>/containers/<pod-uid>_<container>/ (HAMi's device plugin) and
// <hami-root>/claims/<claim-uid>/ (HAMi's DRA kubelet plugin) are watched
// beside gpuslice's own directory, with pod and container labels in /metrics;
// HAMi's directories are never removed by the agent.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "agent.h"
#include "agent_test_util.h"
#include "layout.h"

using namespace std::string_literals;
using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

constexpr char kPodA[] = "0f4e8c2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b";
constexpr char kPodB[] = "7d9a1c3e-5f7b-4a2c-9e4d-6b8f0a2c4e6d";
constexpr char kClaim[] = "c1a1e000-aaaa-4bbb-8ccc-dddddddddddd";

void mkdirs(const std::string& path) {
  for (std::size_t pos = 1; (pos = path.find('/', pos)) != std::string::npos; ++pos)
    mkdir(path.substr(0, pos).c_str(), 0755);
  mkdir(path.c_str(), 0755);
}

Region* region_at(const std::string& dir, const std::string& file, const std::string& name, std::uint64_t quota) {
  mkdirs(dir);
  Region* r = make_region(dir + "/" + file, name);
  if (r != nullptr) add_device(r, 0x10, quota);
  return r;
}

// The /metrics line of a family whose labels contain every needle.
std::string series(const std::string& metrics, const std::string& family, std::initializer_list<std::string> needles) {
  std::size_t pos = 0;
  while ((pos = metrics.find(family + "{", pos)) != std::string::npos) {
    const std::size_t end = metrics.find('\n', pos);
    const std::string line = metrics.substr(pos, end - pos);
    bool all = true;
    for (const std::string& n : needles) all = all && line.find(n) != std::string::npos;
    if (all) return line;
    pos = end;
  }
  return "";
}

TEST(HamiLayout, OwnerLabelsFromDirectoryNames) {
  using agent::Layout;
  EXPECT_TRUE(agent::is_kubernetes_uid(kPodA));
  EXPECT_FALSE(agent::is_kubernetes_uid("pod-1"));
  EXPECT_FALSE(agent::is_kubernetes_uid(std::string(kPodA) + "0"));
  EXPECT_FALSE(agent::is_kubernetes_uid("0f4e8c2a-1b3d-4e5f-8a9b_0c1d2e3f4a5b"));
  const agent::OwnerLabels c = agent::owner_labels(Layout::hami_containers, std::string(kPodA) + "_main");
  EXPECT_EQ(c.pod_uid, kPodA);
  EXPECT_EQ(c.container, "main");
  EXPECT_TRUE(c.claim_uid.empty());
  // Not HAMi's naming: no labels rather than wrong ones.
  EXPECT_TRUE(agent::owner_labels(Layout::hami_containers, "somedir").pod_uid.empty());
  EXPECT_TRUE(agent::owner_labels(Layout::hami_containers, std::string(kPodA) + "_").container.empty());
  EXPECT_TRUE(agent::owner_labels(Layout::hami_containers, "notauid_main").container.empty());
  EXPECT_EQ(agent::owner_labels(Layout::hami_claims, kClaim).claim_uid, kClaim);
  EXPECT_EQ(agent::owner_labels(Layout::gpuslice, kPodB).pod_uid, kPodB);
  EXPECT_TRUE(agent::owner_labels(Layout::gpuslice, "pod-1").pod_uid.empty());
  EXPECT_TRUE(agent::owner_labels(Layout::gpuslice, "").pod_uid.empty());
}

TEST(HamiLayout, AgentWatchesHamiDirectoriesWithPodAndContainerLabels) {
  Sandbox box;
  agent::AgentConfig cfg = config_for(box, false);
  cfg.hami_root = box.path("usr-local-vgpu");
  const std::string cdir = cfg.hami_root + "/containers/" + kPodA + "_main";
  const std::string claimdir = cfg.hami_root + "/claims/" + kClaim;
  Region* hami = region_at(cdir, "5b1c0f7e-0000-4000-8000-000000000001.cache", "", 3000 * kMi);
  Region* claim = region_at(claimdir, "5b1c0f7e-0000-4000-8000-000000000002.cache", "", 1024 * kMi);
  Region* own = region_at(cfg.region_dir + "/" + kPodB, "web.region", "web", 2048 * kMi);
  ASSERT_TRUE(hami && claim && own);
  agent::Agent a(cfg);
  a.start();
  a.cycle();
  EXPECT_EQ(a.stats().regions, 3u);
  const std::string m = a.metrics_text();
  const std::string hami_line = series(m, "gpuslice_memory_quota_bytes",
                                       {"container=\"main\"", "region=\"" + cdir + "/", "pod_uid=\""s + kPodA + "\""});
  ASSERT_FALSE(hami_line.empty()) << m;
  const std::string quota_text = std::to_string(3000 * kMi);
  EXPECT_NE(hami_line.find("} " + quota_text), std::string::npos) << hami_line;
  EXPECT_EQ(hami_line.find("claim_uid"), std::string::npos) << hami_line;
  const std::string claim_line =
      series(m, "gpuslice_memory_quota_bytes", {"claim_uid=\""s + kClaim + "\"", "region=\"" + claimdir + "/"});
  ASSERT_FALSE(claim_line.empty()) << m;
  EXPECT_EQ(claim_line.find("pod_uid"), std::string::npos) << claim_line;
  // gpuslice's own layout: the region path as before, the pod UID from the directory.
  EXPECT_FALSE(series(m, "gpuslice_memory_quota_bytes",
                      {"container=\"web\"", "region=\""s + kPodB + "/web.region\"", "pod_uid=\""s + kPodB + "\""})
                   .empty())
      << m;
  // Per-region families carry the owner too.
  EXPECT_FALSE(series(m, "gpuslice_container_processes", {"container=\"main\"", "pod_uid=\""s + kPodA + "\""}).empty())
      << m;
  shm::detach(hami);
  shm::detach(claim);
  shm::detach(own);
}

TEST(HamiLayout, HamiDirectoriesAreNotWatchedUnlessAsked) {
  Sandbox box;
  agent::AgentConfig cfg = config_for(box, false);
  const std::string hami_root = box.path("usr-local-vgpu");
  Region* hami = region_at(hami_root + "/containers/" + kPodA + "_main", "x.cache", "", 100 * kMi);
  ASSERT_NE(hami, nullptr);
  agent::Agent a(cfg);
  a.start();
  a.cycle();
  EXPECT_EQ(a.stats().regions, 0u);
  shm::detach(hami);
}

TEST(HamiLayout, HamiCoreCacheFilesAreSkippedAndDirectoriesKept) {
  Sandbox box;
  agent::AgentConfig cfg = config_for(box, false);
  cfg.hami_root = box.path("vgpu");
  cfg.grace_ns = 1;  // remove unused regions at once
  const std::string cdir = cfg.hami_root + "/containers/" + kPodA + "_main";
  const std::string olddir = cfg.hami_root + "/containers/" + kPodB + "_legacy";
  Region* hami = region_at(cdir, "a.cache", "", 100 * kMi);
  Region* own = region_at(cfg.region_dir + "/" + kPodB, "c.region", "c", 100 * kMi);
  ASSERT_TRUE(hami && own);
  shm::detach(hami);
  shm::detach(own);
  // A container still under HAMi-core during the migration: its own cache
  // format is not a region; skipped with one warning, never removed.
  mkdirs(olddir);
  write_file(olddir + "/b.cache", std::string(4096, '\x01'));
  agent::Agent a(cfg);
  a.start();
  for (int i = 0; i < 4; ++i) a.cycle();
  EXPECT_EQ(a.stats().invalid_files, 1u);
  EXPECT_TRUE(file_exists(olddir + "/b.cache"));
  // Both unused regions are removed after the grace period; gpuslice's empty
  // pod directory goes too, HAMi's stays (its device plugin owns it and the
  // container has it mounted at /usr/local/vgpu).
  EXPECT_EQ(a.stats().regions_removed, 2u);
  EXPECT_FALSE(file_exists(cdir + "/a.cache"));
  struct stat st {};
  EXPECT_EQ(stat(cdir.c_str(), &st), 0) << "HAMi's container directory was removed";
  EXPECT_NE(stat((cfg.region_dir + "/" + kPodB).c_str(), &st), 0) << "gpuslice's empty pod directory was kept";
}

TEST(HamiLayout, AgentRefusesARelativeHamiRoot) {
  const test::Result r =
      test::run({test::bin("gpuslice-agent"), "--hami-root", "usr/local/vgpu", "--once", "--no-nvml"}, {}, 30000);
  EXPECT_EQ(r.exit_code, 64) << r.describe();
  EXPECT_NE(r.err.find("--hami-root"), std::string::npos) << r.describe();
  EXPECT_NE(r.err.find("absolute"), std::string::npos) << r.describe();
}

TEST(HamiLayout, AgentBinaryReportsHamiRegions) {
  Sandbox box;
  const std::string root = box.path("vgpu");
  Region* hami = region_at(root + "/containers/" + kPodA + "_trainer", "u.cache", "", 512 * kMi);
  ASSERT_NE(hami, nullptr);
  mkdirs(box.path("regions"));
  const test::Result r = test::run({test::bin("gpuslice-agent"), "--region-dir", box.path("regions"), "--hami-root",
                                    root + "/", "--once", "--no-nvml"},
                                   {}, 30000);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_FALSE(
      series(r.out, "gpuslice_memory_quota_bytes", {"container=\"trainer\"", "pod_uid=\""s + kPodA + "\""}).empty())
      << r.out;
  shm::detach(hami);
}

}  // namespace
