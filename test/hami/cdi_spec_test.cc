// gpuslice-cdi: the CDI spec that injects gpuslice validates against the CDI
// JSON schema (vendored in cdi-schema/) and CDI's naming rules, carries the
// limits, priority, region and mounts asked for, and bad input is refused
// with a message naming the option.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cdi_spec.h"
#include "harness.h"

// GCC 12 reports a false -Wrestrict inside std::string assignment inlined
// into these lambdas (GCC bug 105329).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

using namespace std::string_literals;
using gpuslice::cdi::SliceRequest;
using gpuslice::test::Sandbox;
using nlohmann::json;

namespace {

SliceRequest claim_request() {
  SliceRequest r;
  r.device_name = "c1a1e000-aaaa-4bbb-8ccc-dddddddddddd";
  r.memory_limit = "0=8Gi,1=4Gi";
  r.sm_limit = "30";
  r.sm_policy = "elastic";
  r.priority = "high";
  r.container_name = "trainer";
  r.region_host_dir = "/run/gpuslice/regions/c1a1e000-aaaa-4bbb-8ccc-dddddddddddd";
  r.preload_host_file = "/usr/local/gpuslice/ld.so.preload";
  r.annotations["gpuslice.io/claim"] = "default/train-gpu";
  return r;
}

// validate_cdi.py on a file: exit code and output.
gpuslice::test::Result validate_file(const std::string& path) {
  return gpuslice::test::run({GPUSLICE_PYTHON, GPUSLICE_HAMI_SOURCE_DIR "/validate_cdi.py",
                              GPUSLICE_HAMI_SOURCE_DIR "/cdi-schema", path},
                             {}, 60000);
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

std::vector<std::string> env_of(const json& spec) {
  return spec["devices"][0]["containerEdits"]["env"].get<std::vector<std::string>>();
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

TEST(CdiSpec, CarriesLimitsPriorityRegionAndMounts) {
  const SliceRequest r = claim_request();
  std::string why;
  ASSERT_TRUE(gpuslice::cdi::validate(r, &why)) << why;
  const json spec = gpuslice::cdi::build_spec(r);
  EXPECT_EQ(spec["cdiVersion"], "0.6.0");
  EXPECT_EQ(spec["kind"], "gpuslice.io/slice");
  EXPECT_EQ(gpuslice::cdi::qualified_name(r), "gpuslice.io/slice=c1a1e000-aaaa-4bbb-8ccc-dddddddddddd");
  ASSERT_EQ(spec["devices"].size(), 1u);
  EXPECT_EQ(spec["devices"][0]["name"], r.device_name);
  const auto env = env_of(spec);
  EXPECT_TRUE(has(env, "GPUSLICE_MEMORY_LIMIT=0=8Gi,1=4Gi"));
  EXPECT_TRUE(has(env, "GPUSLICE_SM_LIMIT=30"));
  EXPECT_TRUE(has(env, "GPUSLICE_SM_POLICY=elastic"));
  EXPECT_TRUE(has(env, "GPUSLICE_PRIORITY=high"));
  EXPECT_TRUE(has(env, "GPUSLICE_REGION=/run/gpuslice/slice.region"));
  EXPECT_TRUE(has(env, "GPUSLICE_CONTAINER_NAME=trainer"));
  for (const auto& e : env) EXPECT_NE(e.rfind("LD_PRELOAD=", 0), 0u) << "preload-file injection sets no LD_PRELOAD";
  const json& mounts = spec["devices"][0]["containerEdits"]["mounts"];
  ASSERT_EQ(mounts.size(), 3u);
  EXPECT_EQ(mounts[0]["hostPath"], "/usr/local/gpuslice/lib/libgpuslice.so");
  EXPECT_EQ(mounts[0]["options"], json({"ro", "nosuid", "nodev", "bind"}));
  EXPECT_EQ(mounts[1]["hostPath"], r.region_host_dir);
  EXPECT_EQ(mounts[1]["containerPath"], "/run/gpuslice");
  EXPECT_EQ(mounts[1]["options"][0], "rw");
  EXPECT_EQ(mounts[2]["containerPath"], "/etc/ld.so.preload");
  EXPECT_EQ(mounts[2]["hostPath"], r.preload_host_file);
  EXPECT_EQ(spec["annotations"]["gpuslice.io/claim"], "default/train-gpu");
}

TEST(CdiSpec, DefaultPreloadFileIsTheOneTheAgentDaemonSetWrites) {
  SliceRequest r;
  r.device_name = "slice-a";
  r.region_host_dir = "/run/gpuslice/regions/a";
  std::string why;
  ASSERT_TRUE(gpuslice::cdi::validate(r, &why)) << why;
  const json spec = gpuslice::cdi::build_spec(r);
  const json& mounts = spec["devices"][0]["containerEdits"]["mounts"];
  ASSERT_EQ(mounts.size(), 3u);
  EXPECT_EQ(mounts[2]["hostPath"], "/usr/local/gpuslice/lib/ld.so.preload");  // deploy/kubernetes/agent-daemonset.yaml
  EXPECT_EQ(mounts[2]["containerPath"], "/etc/ld.so.preload");
  EXPECT_TRUE(has(env_of(spec), "GPUSLICE_REGION=/run/gpuslice/slice.region"));
  EXPECT_EQ(env_of(spec).size(), 1u) << "nothing but the region when no limit is asked for";
  EXPECT_FALSE(spec.contains("annotations"));
}

TEST(CdiSpec, EnvInjectionSetsLdPreloadAndMountsNoPreloadFile) {
  SliceRequest r = claim_request();
  r.inject = gpuslice::cdi::Inject::env;
  r.preload_host_file.clear();
  std::string why;
  ASSERT_TRUE(gpuslice::cdi::validate(r, &why)) << why;
  const json spec = gpuslice::cdi::build_spec(r);
  EXPECT_TRUE(has(env_of(spec), "LD_PRELOAD=/usr/local/gpuslice/lib/libgpuslice.so"));
  EXPECT_EQ(spec["devices"][0]["containerEdits"]["mounts"].size(), 2u);
}

TEST(CdiSpec, BadInputIsRefusedNamingTheField) {
  struct Case {
    std::function<void(SliceRequest&)> edit;
    const char* expect;
  };
  const Case cases[] = {
      {[](SliceRequest& r) { r.kind = "gpuslice.io"; }, "<vendor>/<class>"},
      {[](SliceRequest& r) { r.kind = "gpuslice.io/slice/x"; }, "<vendor>/<class>"},
      {[](SliceRequest& r) { r.kind = "1gpuslice.io/slice"; }, "start with a letter"},
      {[](SliceRequest& r) { r.kind = "gpuslice.io/sl ice"; }, "may hold only"},
      {[](SliceRequest& r) { r.device_name = "-claim"; }, "device name"},
      {[](SliceRequest& r) { r.device_name = "a/b"; }, "device name"},
      {[](SliceRequest& r) { r.memory_limit = "8Gx"; }, "memory limit"},
      {[](SliceRequest& r) { r.memory_limit = "0"; }, "memory limit"},
      {[](SliceRequest& r) { r.memory_limit = "0=8Gi,x=1Gi"; }, "memory limit"},
      {[](SliceRequest& r) { r.sm_limit = "0"; }, "SM limit"},
      {[](SliceRequest& r) { r.sm_limit = "101"; }, "SM limit"},
      {[](SliceRequest& r) { r.sm_policy = "force"; }, "SM policy"},
      {[](SliceRequest& r) { r.priority = "0"; }, "priority"},
      {[](SliceRequest& r) { r.region_host_dir = "run/gpuslice"; }, "region host directory"},
      {[](SliceRequest& r) { r.region_file = "../x"; }, "region file"},
      {[](SliceRequest& r) { r.preload_host_file.clear(); }, "ld.so.preload"},
      {[](SliceRequest& r) { r.preload_host_file = "ld.so.preload"; }, "ld.so.preload"},
      {[](SliceRequest& r) { r.container_name = std::string(64, 'c'); }, "container name"},
  };
  for (const Case& c : cases) {
    SliceRequest r = claim_request();
    c.edit(r);
    std::string why;
    EXPECT_FALSE(gpuslice::cdi::validate(r, &why)) << c.expect;
    EXPECT_NE(why.find(c.expect), std::string::npos) << why;
  }
}

TEST(CdiSpec, EmittedSpecValidatesAgainstTheCdiSchema) {
  Sandbox box;
  const std::string out = box.path("gpuslice-claim.json");
  const gpuslice::test::Result emit = gpuslice::test::run(
      {gpuslice::test::bin("gpuslice-cdi"), "--name", "c1a1e000-aaaa-4bbb-8ccc-dddddddddddd", "--memory", "8Gi",
       "--sm-limit", "30", "--priority", "low", "--container-name", "trainer", "--region-host-dir",
       "/run/gpuslice/regions/c1a1e000-aaaa-4bbb-8ccc-dddddddddddd", "--preload-host-file",
       "/usr/local/gpuslice/ld.so.preload", "--annotation", "gpuslice.io/claim=default/train", "--output", out},
      {}, 30000);
  ASSERT_EQ(emit.exit_code, 0) << emit.describe();
  EXPECT_EQ(emit.out, "gpuslice.io/slice=c1a1e000-aaaa-4bbb-8ccc-dddddddddddd\n");
  const gpuslice::test::Result v = validate_file(out);
  if (v.exit_code == 77) GTEST_SKIP() << v.out;
  EXPECT_EQ(v.exit_code, 0) << v.describe();
  // The same on stdout, with LD_PRELOAD injection.
  const gpuslice::test::Result emit2 = gpuslice::test::run(
      {gpuslice::test::bin("gpuslice-cdi"), "--name", "slice-a", "--region-host-dir", "/run/gpuslice/regions/a",
       "--inject", "env"},
      {}, 30000);
  ASSERT_EQ(emit2.exit_code, 0) << emit2.describe();
  write_text(box.path("stdout.json"), emit2.out);
  EXPECT_EQ(validate_file(box.path("stdout.json")).exit_code, 0);
}

TEST(CdiSpec, ValidatorRejectsBrokenSpecs) {
  Sandbox box;
  const json good = gpuslice::cdi::build_spec(claim_request());
  const std::pair<const char*, std::function<void(json&)>> breakages[] = {
      {"no devices", [](json& s) { s.erase("devices"); }},
      {"old version", [](json& s) { s["cdiVersion"] = "0.5.0"; }},
      {"bad kind", [](json& s) { s["kind"] = "slice"; }},
      {"bad device name", [](json& s) { s["devices"][0]["name"] = "_x"; }},
      {"env not NAME=value", [](json& s) { s["devices"][0]["containerEdits"]["env"][0] = "novalue"; }},
      {"mount without hostPath", [](json& s) { s["devices"][0]["containerEdits"]["mounts"][0].erase("hostPath"); }},
      {"mount options as a string", [](json& s) { s["devices"][0]["containerEdits"]["mounts"][0]["options"] = "ro"; }},
      {"unknown field", [](json& s) { s["containerRuntime"] = json::array({"docker"}); }},
  };
  int n = 0;
  for (const auto& [what, breakit] : breakages) {
    json s = good;
    breakit(s);
    const std::string path = box.path("bad" + std::to_string(n++) + ".json");
    write_text(path, s.dump());
    const gpuslice::test::Result v = validate_file(path);
    if (v.exit_code == 77) GTEST_SKIP() << v.out;
    EXPECT_EQ(v.exit_code, 1) << what << ": " << v.describe();
  }
}

TEST(CdiSpec, BinaryRefusesBadInputWithExit64) {
  const gpuslice::test::Result r = gpuslice::test::run(
      {gpuslice::test::bin("gpuslice-cdi"), "--name", "x", "--region-host-dir", "/r", "--inject", "env", "--memory",
       "lots"},
      {}, 30000);
  EXPECT_EQ(r.exit_code, 64) << r.describe();
  EXPECT_NE(r.err.find("memory limit 'lots'"), std::string::npos) << r.describe();
  const gpuslice::test::Result k = gpuslice::test::run(
      {gpuslice::test::bin("gpuslice-cdi"), "--name", "x", "--region-host-dir", "/r", "--inject", "mount"}, {}, 30000);
  EXPECT_EQ(k.exit_code, 64) << k.describe();
  EXPECT_NE(k.err.find("--inject"), std::string::npos) << k.describe();
}

}  // namespace
