// gpuslice as a drop-in for HAMi-core: the library installed as HAMi's
// /usr/local/vgpu/libvgpu.so, loaded through /etc/ld.so.preload in a private
// mount namespace (hami_container.sh; LD_PRELOAD of the same file where no
// namespace can be made: each test says which it used), two containers on one
// simulated device with the environment exactly as HAMi's device plugin
// (v2.10, Allocate) writes it, limits enforced, the agent reporting both.
//
// Parts that need the lead's HAMi aliases in the option table
// (include/gpuslice/options.h) are compiled in only where the alias is named
// there (GPUSLICE_HAVE_ALIAS_*, found by test/hami/CMakeLists.txt); otherwise
// they are skipped naming the missing alias.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <fstream>
#include <string>

#include "agent.h"
#include "agent_test_util.h"
#include "harness.h"

using namespace std::string_literals;
using namespace gpuslice;
using gpuslice::agent_test::eventually;
using gpuslice::agent_test::file_exists;
using gpuslice::agent_test::kMi;
using gpuslice::test::Env;
using gpuslice::test::Result;
using gpuslice::test::Sandbox;

#define SKIP_WITHOUT_ALIAS(have, name) \
  if (!(have)) GTEST_SKIP() << "needs the option alias " name " (not in include/gpuslice/options.h yet)"

#ifndef GPUSLICE_HAVE_ALIAS_CUDA_DEVICE_MEMORY_SHARED_CACHE
#define GPUSLICE_HAVE_ALIAS_CUDA_DEVICE_MEMORY_SHARED_CACHE 0
#endif
#ifndef GPUSLICE_HAVE_ALIAS_GPU_CORE_UTILIZATION_POLICY
#define GPUSLICE_HAVE_ALIAS_GPU_CORE_UTILIZATION_POLICY 0
#endif
#ifndef GPUSLICE_HAVE_ALIAS_CUDA_DISABLE_CONTROL
#define GPUSLICE_HAVE_ALIAS_CUDA_DISABLE_CONTROL 0
#endif
#ifndef GPUSLICE_HAVE_ALIAS_LIBCUDA_LOG_LEVEL
#define GPUSLICE_HAVE_ALIAS_LIBCUDA_LOG_LEVEL 0
#endif
#ifndef GPUSLICE_HAVE_ALIAS_CUDA_TASK_PRIORITY
#define GPUSLICE_HAVE_ALIAS_CUDA_TASK_PRIORITY 0
#endif
#ifndef GPUSLICE_HAVE_ALIAS_CUDA_OVERSUBSCRIBE
#define GPUSLICE_HAVE_ALIAS_CUDA_OVERSUBSCRIBE 0
#endif

namespace {

constexpr char kGpuUuid[] = "GPU-00000000-0000-0000-0000-000000000000";  // as NVIDIA_VISIBLE_DEVICES names it

// A node's HAMi hook path (HOOK_PATH, /usr/local on a real node) inside a sandbox.
struct HamiNode {
  explicit HamiNode(const Sandbox& box) : hook(box.path("usr-local")) {
    std::filesystem::create_directories(hook + "/vgpu/containers");
    // What HAMi's device-plugin DaemonSet installs: the library and the preload file naming it.
    std::filesystem::copy_file(test::preload_library(), library());
    std::ofstream(hook + "/vgpu/ld.so.preload") << "/usr/local/vgpu/libvgpu.so\n";
  }
  std::string library() const { return hook + "/vgpu/libvgpu.so"; }
  std::string vgpu_root() const { return hook + "/vgpu"; }
  // Allocate(): a fresh per-container host directory, mode 0777.
  std::string container_dir(const std::string& pod_uid, const std::string& ctr) const {
    const std::string d = hook + "/vgpu/containers/" + pod_uid + "_" + ctr;
    std::filesystem::create_directories(d);
    chmod(d.c_str(), 0777);
    return d;
  }
  std::string hook;
};

// Whether hami_container.sh can make a mount namespace here (answer cached).
// GPUSLICE_TEST_NO_MOUNT_NAMESPACE=1 forces the LD_PRELOAD variant (to test it
// on machines that have namespaces).
bool namespaces_available() {
  static const int answer = [] {
    if (const char* no = std::getenv("GPUSLICE_TEST_NO_MOUNT_NAMESPACE"); no != nullptr && *no == '1') return 0;
    const Result r =
        test::run({GPUSLICE_HAMI_SOURCE_DIR "/hami_container.sh", "/nonexistent", "/nonexistent", "true"}, {}, 30000);
    return r.exit_code == 77 && r.err.find("cannot make a mount namespace") != std::string::npos ? 0 : 1;
  }();
  return answer == 1;
}

// One container: the environment of HAMi's Allocate response plus the
// simulated driver's, run in a mount namespace when possible (else with
// LD_PRELOAD of the same libvgpu.so and host paths).
struct HamiContainer {
  HamiContainer(const HamiNode& node, const Sandbox& box, std::string pod_uid, std::string name, int mem_mib, int sm)
      : node(node), pod_uid(std::move(pod_uid)), name(std::move(name)) {
    dir = node.container_dir(this->pod_uid, this->name);
    in_namespace = namespaces_available();
    // HAMi names it <random UUID>.cache; any UUID will do here.
    char uuid[64];
    std::snprintf(uuid, sizeof uuid, "5b1c0f7e-0000-4000-8000-%012d.cache", mem_mib * 1000 + sm);
    cache_file = uuid;
    env = {{"LD_LIBRARY_PATH", test::fakecuda_dir()},
           {"FAKECUDA_STATE", box.path("fakecuda.state")},
           {"NVIDIA_VISIBLE_DEVICES", kGpuUuid},
           {"CUDA_DEVICE_MEMORY_LIMIT_0", std::to_string(mem_mib) + "m"},
           {"CUDA_DEVICE_SM_LIMIT", std::to_string(sm)},
           {"CUDA_DEVICE_MEMORY_SHARED_CACHE", (in_namespace ? "/usr/local/vgpu/"s : dir + "/") + cache_file}};
    if (!in_namespace) env["LD_PRELOAD"] = node.library();
  }
  std::vector<std::string> argv(std::vector<std::string> ops) const {
    ops.insert(ops.begin(), test::bin("cuprobe"));
    if (in_namespace) {
      ops.insert(ops.begin(), {GPUSLICE_HAMI_SOURCE_DIR "/hami_container.sh", node.hook, dir});
    }
    return ops;
  }
  std::string how() const {
    return in_namespace ? "loaded through /etc/ld.so.preload in a private mount namespace"
                        : "loaded with LD_PRELOAD=<hook>/vgpu/libvgpu.so (no mount namespace here)";
  }
  std::string host_cache() const { return dir + "/" + cache_file; }

  const HamiNode& node;
  std::string pod_uid, name, dir, cache_file;
  bool in_namespace = false;
  Env env;
};

TEST(HamiDropIn, LibraryWorksInstalledAsLibvgpuSo) {
  Sandbox box;
  HamiNode node(box);
  // The name and path are HAMi's; the quota is HAMi's variable; the region is
  // named with gpuslice's own variable so this runs without the region alias.
  Env env{{"LD_LIBRARY_PATH", test::fakecuda_dir()},
          {"FAKECUDA_STATE", box.path("fakecuda.state")},
          {"LD_PRELOAD", node.library()},
          {"GPUSLICE_REGION", box.path("c.region")},
          {"CUDA_DEVICE_MEMORY_LIMIT_0", "64m"}};
  const Result r = test::run({test::bin("cuprobe"), "init", "ctx", "0", "fill", "alloc", std::to_string(kMi)}, env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(test::value(r, "fill", "bytes"), std::to_string(64 * kMi)) << r.describe();
  EXPECT_TRUE(file_exists(box.path("c.region")));
}

TEST(HamiDropIn, LoadedThroughEtcLdSoPreloadInAMountNamespace) {
  if (!namespaces_available()) GTEST_SKIP() << "no mount namespace can be made here (needs root or user namespaces)";
  Sandbox box;
  HamiNode node(box);
  const std::string dir = node.container_dir("0f4e8c2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b", "main");
  // No LD_PRELOAD: only /etc/ld.so.preload (inside the namespace) names the library.
  Env env{{"LD_LIBRARY_PATH", test::fakecuda_dir()},
          {"FAKECUDA_STATE", box.path("fakecuda.state")},
          {"GPUSLICE_REGION", box.path("c.region")},
          {"CUDA_DEVICE_MEMORY_LIMIT_0", "48m"}};
  const Result r = test::run({GPUSLICE_HAMI_SOURCE_DIR "/hami_container.sh", node.hook, dir, test::bin("cuprobe"),
                              "init", "ctx", "0", "fill", "alloc", std::to_string(kMi)},
                             env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(test::value(r, "fill", "bytes"), std::to_string(48 * kMi))
      << "the library was not loaded from /etc/ld.so.preload\n"
      << r.describe();
  // Without the preload file the same program is not limited (the test can fail).
  const Result unlimited =
      test::run({test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(64 * kMi)}, env);
  EXPECT_EQ(test::field(test::lines_with(unlimited.out, "alloc ").at(0), "rc"), "0") << unlimited.describe();
  // The runtime's mount point of libvgpu.so is in the host directory, as under HAMi.
  EXPECT_TRUE(file_exists(dir + "/libvgpu.so"));
}

TEST(HamiDropIn, TwoHamiContainersOnOneDeviceLimitedAndReported) {
  SKIP_WITHOUT_ALIAS(GPUSLICE_HAVE_ALIAS_CUDA_DEVICE_MEMORY_SHARED_CACHE, "CUDA_DEVICE_MEMORY_SHARED_CACHE");
  Sandbox box;
  HamiNode node(box);
  HamiContainer a(node, box, "0f4e8c2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b", "trainer", 96, 30);
  HamiContainer b(node, box, "7d9a1c3e-5f7b-4a2c-9e4d-6b8f0a2c4e6d", "server", 64, 50);
  RecordProperty("injection", a.how());
  const std::string go = box.path("go");
  const pid_t pa = test::spawn(
      a.argv({"init", "ctx", "0", "fill", "alloc", std::to_string(kMi), "touch", box.path("held-a"), "waitfile", go}),
      a.env, box.path("a.out"));
  const pid_t pb = test::spawn(
      b.argv({"init", "ctx", "0", "fill", "alloc", std::to_string(kMi), "touch", box.path("held-b"), "waitfile", go}),
      b.env, box.path("b.out"));
  const bool held =
      eventually([&] { return file_exists(box.path("held-a")) && file_exists(box.path("held-b")); }, 60000);
  // The agent, as a DaemonSet would run it with --hami-root=/usr/local/vgpu.
  agent::AgentConfig cfg = agent_test::config_for(box, true);
  cfg.hami_root = node.vgpu_root();
  std::string metrics;
  agent::AgentStats stats;
  if (held) {
    agent::Agent agent(cfg);
    agent.start();
    agent.cycle();
    agent.cycle();
    metrics = agent.metrics_text();
    stats = agent.stats();
  }
  std::ofstream(go) << "go";
  const Result ra = test::wait(pa, box.path("a.out"));
  const Result rb = test::wait(pb, box.path("b.out"));
  ASSERT_TRUE(held) << a.how() << "\n" << ra.describe() << rb.describe();
  ASSERT_EQ(ra.exit_code, 0) << ra.describe();
  ASSERT_EQ(rb.exit_code, 0) << rb.describe();
  // Each container's quota held, independently, on one device.
  EXPECT_EQ(test::value(ra, "fill", "bytes"), std::to_string(96 * kMi)) << a.how() << "\n" << ra.describe();
  EXPECT_EQ(test::value(rb, "fill", "bytes"), std::to_string(64 * kMi)) << rb.describe();
  // Each region is where HAMi put the shared cache, on the host.
  EXPECT_TRUE(file_exists(a.host_cache())) << a.host_cache();
  EXPECT_TRUE(file_exists(b.host_cache())) << b.host_cache();
  // The agent watches both, labelled with pod UID and container name, and
  // nothing else of HAMi's directories (the libvgpu.so mount point is no region).
  EXPECT_EQ(stats.regions, 2u) << metrics;
  EXPECT_EQ(stats.invalid_files, 0u) << metrics;
  for (const HamiContainer* c : {&a, &b}) {
    const std::string want = "container=\"" + c->name + "\",region=\"" + c->host_cache() + "\",device=\"0\"";
    const std::size_t at = metrics.find("gpuslice_memory_used_bytes{" + want);
    ASSERT_NE(at, std::string::npos) << want << "\n" << metrics;
    const std::string line = metrics.substr(at, metrics.find('\n', at) - at);
    EXPECT_NE(line.find("pod_uid=\"" + c->pod_uid + "\""), std::string::npos) << line;
    const std::string quota = c == &a ? std::to_string(96 * kMi) : std::to_string(64 * kMi);
    EXPECT_NE(line.find("} " + quota), std::string::npos) << "used bytes = the filled quota\n" << line;
    EXPECT_NE(metrics.find("gpuslice_memory_quota_bytes{" + want), std::string::npos) << metrics;
  }
  EXPECT_NE(metrics.find("gpuslice_sm_limit_percent{container=\"trainer\""), std::string::npos);
  EXPECT_NE(metrics.find("} 30\n", metrics.find("gpuslice_sm_limit_percent{container=\"trainer\"")), std::string::npos)
      << metrics;
}

// gpuslice-smi --json of one region: the first device entry.
nlohmann::json smi_device(const std::string& region) {
  const Result r = test::run({test::bin("gpuslice-smi"), "--region", region, "--json"}, {}, 30000);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  try {
    const auto doc = nlohmann::json::parse(r.out);
    return doc.at("regions").at(0).at("devices").at(0);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what() << "\n" << r.describe();
    return {};
  }
}

TEST(HamiDropIn, CoreUtilizationPolicyMapsOntoSmPolicy) {
  SKIP_WITHOUT_ALIAS(GPUSLICE_HAVE_ALIAS_CUDA_DEVICE_MEMORY_SHARED_CACHE, "CUDA_DEVICE_MEMORY_SHARED_CACHE");
  SKIP_WITHOUT_ALIAS(GPUSLICE_HAVE_ALIAS_GPU_CORE_UTILIZATION_POLICY, "GPU_CORE_UTILIZATION_POLICY");
  Sandbox box;
  HamiNode node(box);
  // Written by HAMi's webhook when the scheduler's gpuCorePolicy is not "default",
  // and by the device plugin ("disable") when core limits are switched off.
  const std::pair<const char*, const char*> cases[] = {{"force", "hard"}, {"default", "elastic"}, {"disable", ""}};
  int i = 0;
  for (const auto& [policy, want] : cases) {
    HamiContainer c(node, box, "0f4e8c2a-1b3d-4e5f-8a9b-0c1d2e3f4a5" + std::to_string(i++), "main", 32, 40);
    c.env["GPU_CORE_UTILIZATION_POLICY"] = policy;
    const Result r = test::run(c.argv({"init", "ctx", "0", "alloc", std::to_string(kMi)}), c.env);
    ASSERT_EQ(r.exit_code, 0) << policy << ": " << r.describe();
    const auto dev = smi_device(c.host_cache());
    if (*want != '\0') {
      EXPECT_EQ(dev["compute"]["sm_policy"], want) << policy << ": " << dev.dump();
      EXPECT_EQ(dev["compute"]["sm_limit_pct"], 40) << policy << ": " << dev.dump();
    } else {
      EXPECT_TRUE(dev["compute"]["sm_limit_pct"].is_null()) << "disable: no SM limit\n" << dev.dump();
    }
  }
}

TEST(HamiDropIn, DisableControlPassesEverythingThrough) {
  SKIP_WITHOUT_ALIAS(GPUSLICE_HAVE_ALIAS_CUDA_DEVICE_MEMORY_SHARED_CACHE, "CUDA_DEVICE_MEMORY_SHARED_CACHE");
  SKIP_WITHOUT_ALIAS(GPUSLICE_HAVE_ALIAS_CUDA_DISABLE_CONTROL, "CUDA_DISABLE_CONTROL");
  Sandbox box;
  HamiNode node(box);
  HamiContainer c(node, box, "0f4e8c2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b", "main", 16, 50);
  // A user sets CUDA_DISABLE_CONTROL=true in the pod: HAMi then skips the
  // /etc/ld.so.preload mount, so the library is loaded only where something
  // else preloads it (an image's LD_PRELOAD; here the test's preload), and
  // then must pass everything through.
  c.env["CUDA_DISABLE_CONTROL"] = "true";
  c.env["FAKECUDA_MEMORY"] = "128Mi";
  const Result r = test::run(c.argv({"init", "ctx", "0", "fill", "alloc", std::to_string(kMi)}), c.env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(test::value(r, "fill", "bytes"), std::to_string(128 * kMi))
      << "the whole simulated device, not the 16m quota\n"
      << r.describe();
}

TEST(HamiDropIn, LogLevelPriorityAndOversubscribeFromHamiVariables) {
  SKIP_WITHOUT_ALIAS(GPUSLICE_HAVE_ALIAS_CUDA_DEVICE_MEMORY_SHARED_CACHE, "CUDA_DEVICE_MEMORY_SHARED_CACHE");
  SKIP_WITHOUT_ALIAS(GPUSLICE_HAVE_ALIAS_LIBCUDA_LOG_LEVEL, "LIBCUDA_LOG_LEVEL");
  Sandbox box;
  HamiNode node(box);
  HamiContainer c(node, box, "0f4e8c2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b", "main", 32, 50);
  const Result quiet = test::run(c.argv({"init", "ctx", "0", "alloc", std::to_string(kMi)}), c.env);
  ASSERT_EQ(quiet.exit_code, 0) << quiet.describe();
  EXPECT_EQ(quiet.err.find("GPUSLICE_MEMORY_LIMIT"), std::string::npos) << "no debug listing by default\n"
                                                                        << quiet.describe();
  c.env["LIBCUDA_LOG_LEVEL"] = "4";  // HAMi-core's most verbose level
  if (GPUSLICE_HAVE_ALIAS_CUDA_TASK_PRIORITY) c.env["CUDA_TASK_PRIORITY"] = "0";
  if (GPUSLICE_HAVE_ALIAS_CUDA_OVERSUBSCRIBE) c.env["CUDA_OVERSUBSCRIBE"] = "true";
  const Result debug = test::run(c.argv({"init", "ctx", "0", "alloc", std::to_string(kMi)}), c.env);
  ASSERT_EQ(debug.exit_code, 0) << debug.describe();
  EXPECT_NE(debug.err.find("GPUSLICE_MEMORY_LIMIT"), std::string::npos) << "debug lists the options\n"
                                                                        << debug.describe();
  EXPECT_NE(debug.err.find("CUDA_DEVICE_MEMORY_SHARED_CACHE"), std::string::npos) << debug.describe();
  if (!GPUSLICE_HAVE_ALIAS_CUDA_TASK_PRIORITY) GTEST_SKIP() << "needs the option alias CUDA_TASK_PRIORITY";
  EXPECT_NE(debug.err.find("GPUSLICE_PRIORITY=high"), std::string::npos) << debug.describe();
  if (!GPUSLICE_HAVE_ALIAS_CUDA_OVERSUBSCRIBE) GTEST_SKIP() << "needs the option alias CUDA_OVERSUBSCRIBE";
  EXPECT_NE(debug.err.find("GPUSLICE_OVERSUBSCRIBE=spill"), std::string::npos) << debug.describe();
}

}  // namespace
