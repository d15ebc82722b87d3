// gpuslice-smi: golden table output of a region with known contents, JSON,
// the directory view, `set`, `options`, and its errors and exit codes.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "agent_test_util.h"
#include "gpuslice/options.h"
#include "region_io.h"

using namespace std::string_literals;

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

constexpr std::uint64_t kGi = std::uint64_t{1} << 30;

// A region whose every shown field is fixed (utilisation fresh, no agent heartbeat).
void fill_known_region(const std::string& path, const std::string& name, std::uint8_t uuid_byte) {
  Region* r = make_region(path, name);
  ASSERT_NE(r, nullptr);
  const int dev = add_device(r, uuid_byte, 8 * kGi, 30);
  ASSERT_EQ(dev, 0);
  DeviceState& d = r->devices[dev];
  d.used_bytes.store(3 * kGi / 2);
  d.agent_extra_bytes.store(256 * kMi);
  d.oom_refusals.store(3);
  d.peak_used_bytes.store(2 * kGi);
  d.throttled_ns.store(1'250'000'000);
  d.launches.store(4242);
  d.util_permille.store(284);
  d.device_util_permille.store(512);
  d.util_updated_ns.store(agent::monotonic_ns());
  const int a = add_slot(r, 12, 4026532001ull, 777);
  const int b = add_slot(r, 13, 4026532001ull, 778);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  r->slots[a].host_pid.store(34567);
  r->slots[a].committed_bytes[dev].store(kGi);
  r->slots[a].context_bytes[dev].store(0);
  r->slots[a].nvml_used_bytes[dev].store(kGi + 256 * kMi);
  r->slots[b].committed_bytes[dev].store(kGi / 2);
  shm::detach(r);
}

// The golden file, with the version substituted. GPUSLICE_UPDATE_GOLDEN=1
// rewrites it from `actual` instead (review the diff before committing).
std::string golden(const std::string& name, const std::string& actual) {
  const std::string path = std::string(GPUSLICE_TEST_SOURCE_DIR) + "/golden/" + name;
  if (std::getenv("GPUSLICE_UPDATE_GOLDEN") != nullptr) {
    std::string text = actual;
    for (auto pos = text.find(GPUSLICE_VERSION); pos != std::string::npos; pos = text.find(GPUSLICE_VERSION, pos)) {
      text.replace(pos, std::strlen(GPUSLICE_VERSION), "@VERSION@");
    }
    write_file(path, text);
  }
  std::string text = read_file(path);
  const std::string marker = "@VERSION@";
  for (auto pos = text.find(marker); pos != std::string::npos; pos = text.find(marker)) {
    text.replace(pos, marker.size(), GPUSLICE_VERSION);
  }
  return text;
}

test::Result smi(const std::vector<std::string>& args, const test::Env& env = {}) {
  std::vector<std::string> argv{test::bin("gpuslice-smi")};
  argv.insert(argv.end(), args.begin(), args.end());
  return test::run(argv, env, 20000);
}

TEST(Smi, TableMatchesTheGoldenOutput) {
  Sandbox box;
  const std::string path = box.path("trainer.region");
  fill_known_region(path, "trainer", 0x00);
  test::Result r = smi({"--region", path});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out, golden("smi_table.txt", r.out)) << r.out;
  EXPECT_EQ(r.err, "");
  // The container's own view: GPUSLICE_REGION names the region.
  test::Result own = smi({}, {{"GPUSLICE_REGION", path}});
  EXPECT_EQ(own.exit_code, 0) << own.describe();
  EXPECT_EQ(own.out, r.out);
}

TEST(Smi, JsonCarriesEveryField) {
  Sandbox box;
  const std::string path = box.path("trainer.region");
  fill_known_region(path, "trainer", 0x00);
  test::Result r = smi({"--region", path, "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["regions"].size(), 1u);
  const auto& region = j["regions"][0];
  EXPECT_EQ(region["container"], "trainer");
  EXPECT_TRUE(region["agent_heartbeat_age_ns"].is_null());
  const auto& dev = region["devices"][0];
  EXPECT_EQ(dev["uuid"], "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
  EXPECT_EQ(dev["memory"]["quota_bytes"], 8 * kGi);
  EXPECT_EQ(dev["memory"]["counted_bytes"], 3 * kGi / 2);
  EXPECT_EQ(dev["memory"]["agent_extra_bytes"], 256 * kMi);
  EXPECT_EQ(dev["memory"]["used_bytes"], 3 * kGi / 2 + 256 * kMi);
  EXPECT_EQ(dev["memory"]["oom_refusals"], 3);
  EXPECT_EQ(dev["compute"]["sm_limit_pct"], 30);
  EXPECT_EQ(dev["compute"]["sm_policy"], "hard");
  EXPECT_EQ(dev["compute"]["util_permille"], 284);
  EXPECT_EQ(dev["compute"]["throttled_ns"], 1'250'000'000);
  EXPECT_EQ(dev["processes"], 2);
  ASSERT_EQ(region["processes"].size(), 2u);
  EXPECT_EQ(region["processes"][0]["pid"], 12);
  EXPECT_EQ(region["processes"][0]["host_pid"], 34567);
  EXPECT_TRUE(region["processes"][1]["host_pid"].is_null());
}

TEST(Smi, RegionDirShowsEveryContainerPerDevice) {
  Sandbox box;
  fill_known_region(box.path("regions/pod-a/a.region"), "alpha", 0x00);
  fill_known_region(box.path("regions/pod-b/b.region"), "beta", 0x00);
  fill_known_region(box.path("regions/c.region"), "gamma", 0x77);
  write_file(box.path("regions/junk.region"), "junk");
  test::Result r = smi({"--region-dir", box.path("regions")});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n') > 20, true) << r.out;
  // Regions in path order (c.region, pod-a/, pod-b/); devices in order of first use.
  const auto uuid7 = r.out.find("GPU GPU-7778797a");
  const auto uuid0 = r.out.find("GPU GPU-00010203");
  const auto processes = r.out.find("| GPU          |");
  ASSERT_NE(uuid0, std::string::npos) << r.out;
  ASSERT_NE(uuid7, std::string::npos) << r.out;
  ASSERT_NE(processes, std::string::npos) << r.out;
  EXPECT_LT(uuid7, r.out.find("| gamma"));
  EXPECT_LT(r.out.find("| gamma"), uuid0);
  EXPECT_LT(uuid0, r.out.find("| alpha")) << "alpha and beta share the other device";
  EXPECT_LT(r.out.find("| alpha"), r.out.find("| beta"));
  EXPECT_LT(r.out.find("| beta"), processes);
  EXPECT_NE(r.err.find("junk.region: file holds only 4 bytes"), std::string::npos) << r.err;
  test::Result j = smi({"--region-dir", box.path("regions"), "--json"});
  ASSERT_EQ(j.exit_code, 0);
  EXPECT_EQ(nlohmann::json::parse(j.out)["regions"].size(), 3u);
}

TEST(Smi, WatchRefreshesUntilCount) {
  Sandbox box;
  const std::string path = box.path("w.region");
  fill_known_region(path, "watched", 0x00);
  test::Result r = smi({"--region", path, "--json", "--watch", "0.05", "--count", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 3) << r.out;
  test::Result t = smi({"--region", path, "--watch", "50ms", "--count", "2"});
  ASSERT_EQ(t.exit_code, 0) << t.describe();
  EXPECT_EQ(test::lines_with(t.out, "gpuslice-smi ").size(), 2u);
  EXPECT_EQ(smi({"--region", path, "--watch", "soon"}).exit_code, 64);
}

TEST(Smi, MissingOrInvalidRegionIsExitTwoWithOneLine) {
  Sandbox box;
  test::Result missing = smi({"--region", box.path("absent.region")});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_EQ(missing.err, "gpuslice-smi: "s + box.path("absent.region") +
                             ": cannot open: No such file or directory, expected an existing region file\n");
  write_file(box.path("foreign"), "#!/bin/sh\necho not a region\n");
  test::Result foreign = smi({"--region", box.path("foreign")});
  EXPECT_EQ(foreign.exit_code, 2);
  EXPECT_EQ(foreign.err, "gpuslice-smi: "s + box.path("foreign") +
                             ": bad magic 0x732f6e69622f2123 (not a gpuslice region; another program's file?), "
                             "expected magic 0x45434c5353555047 (\"GPUSSLCE\")\n");
  test::Result dir = smi({"--region-dir", box.path("nowhere")});
  EXPECT_EQ(dir.exit_code, 2);
  EXPECT_EQ(std::count(dir.err.begin(), dir.err.end(), '\n'), 1);
  // The default path when nothing names a region.
  test::Result dflt = smi({}, {{"GPUSLICE_REGION", ""}});
  EXPECT_EQ(dflt.exit_code == 2 || dflt.exit_code == 0, true);
  EXPECT_EQ(smi({"--bogus"}).exit_code, 64);
  EXPECT_EQ(smi({"--region", "a", "--region-dir", "b"}).exit_code, 64);
}

TEST(Smi, SetChangesLimitsInPlace) {
  Sandbox box;
  const std::string path = box.path("s.region");
  fill_known_region(path, "resized", 0x00);
  test::Result r = smi({"set", "--region", path, "--memory", "4Gi", "--sm-limit", "50", "--sm-policy", "elastic"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out, "gpuslice-smi: "s + path +
                       ": device 0 (GPU-00010203-0405-0607-0809-0a0b0c0d0e0f): memory quota 8GiB -> 4GiB, SM limit "
                       "30% -> 50%, SM policy hard -> elastic\n");
  Region* reg = attach(path);
  ASSERT_NE(reg, nullptr);
  EXPECT_EQ(reg->devices[0].quota_bytes.load(), 4 * kGi);
  EXPECT_EQ(reg->devices[0].sm_limit_pct.load(), 50u);
  EXPECT_EQ(reg->devices[0].sm_policy.load(), static_cast<std::uint32_t>(SmPolicy::elastic));

  // Below what is used: allowed, and said.
  r = smi({"set", "--region", path, "--device", "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f", "--memory", "1Gi"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.out.find("above the new quota"), std::string::npos) << r.out;
  EXPECT_EQ(reg->devices[0].quota_bytes.load(), kGi);
  r = smi({"set", "--region", path, "--device", "0", "--memory", "unlimited", "--sm-limit", "unlimited"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(reg->devices[0].quota_bytes.load(), kUnlimited);
  EXPECT_EQ(reg->devices[0].sm_limit_pct.load(), 100u);

  // A device the container has not used yet, named by UUID: created with the values.
  r = smi({"set", "--region", path, "--device", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "--memory", "2G"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(reg->devices[1].quota_bytes.load(), 2'000'000'000u);

  // Same parsers as the library: strict.
  for (const std::vector<std::string>& bad : {std::vector<std::string>{"--memory", "8 Gi"},
                                              {"--memory", "0"},
                                              {"--memory", "-1"},
                                              {"--sm-limit", "0"},
                                              {"--sm-limit", "101"},
                                              {"--sm-limit", "30x"},
                                              {"--sm-policy", "soft"},
                                              {"--device", "GPU-xyz", "--memory", "1Gi"},
                                              {}}) {
    std::vector<std::string> args{"set", "--region", path};
    args.insert(args.end(), bad.begin(), bad.end());
    test::Result e = smi(args);
    EXPECT_EQ(e.exit_code, 64) << e.describe();
    EXPECT_EQ(std::count(e.err.begin(), e.err.end(), '\n'), 1) << e.err;
  }
  EXPECT_EQ(smi({"set", "--region", path, "--device", "9", "--memory", "1Gi"}).exit_code, 1);
  EXPECT_EQ(smi({"set", "--region", box.path("absent"), "--memory", "1Gi"}).exit_code, 2);
  EXPECT_EQ(reg->devices[0].quota_bytes.load(), kUnlimited) << "failed commands change nothing";
  shm::detach(reg);
}

TEST(Smi, OptionsListsEveryOptionOfTheTable) {
  test::Result text = smi({"options"});
  ASSERT_EQ(text.exit_code, 0) << text.describe();
  test::Result json = smi({"options", "--json"});
  ASSERT_EQ(json.exit_code, 0);
  auto j = nlohmann::json::parse(json.out);
  ASSERT_EQ(j["options"].size(), kOptionCount);
  for (std::size_t i = 0; i < kOptionCount; ++i) {
    EXPECT_NE(text.out.find(std::string(kOptions[i].env) + "\n    default: "), std::string::npos) << kOptions[i].env;
    EXPECT_EQ(j["options"][i]["name"], kOptions[i].env);
    EXPECT_EQ(j["options"][i]["default"], kOptions[i].default_value);
    EXPECT_EQ(j["options"][i]["doc"], kOptions[i].doc);
  }
  test::Result md = smi({"options", "--markdown"});
  ASSERT_EQ(md.exit_code, 0);
  EXPECT_EQ(md.out.rfind("| Variable | Default |", 0), 0u) << md.out;
}

}  // namespace
