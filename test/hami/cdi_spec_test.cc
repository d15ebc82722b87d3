// gpuslice-cdi: the CDI spec that injects gpuslice validates against the CDI
// JSON schema (vendored in cdi-schema/) and CDI's naming rules, carries the
// limits, priority, region and mounts asked for, and bad input is refused
// with a message naming the option.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cdi_spec.h"
#include "harness.h"
#include "limiter/options/file.h"
#include "limiter/options/options.h"

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
  return gpuslice::test::run(
      {GPUSLICE_PYTHON, GPUSLICE_HAMI_SOURCE_DIR "/validate_cdi.py", GPUSLICE_HAMI_SOURCE_DIR "/cdi-schema", path}, {},
      60000);
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }
std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
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
      {[](SliceRequest& r) { r.region_host_dir = "run/gpuslice"; }, "--region-host-dir"},
      // Bound read-write: never the host's root, a top-level directory or a system tree.
      {[](SliceRequest& r) { r.region_host_dir = "/"; }, "--region-host-dir '/'"},
      {[](SliceRequest& r) { r.region_host_dir = "/etc"; }, "--region-host-dir '/etc'"},
      {[](SliceRequest& r) { r.region_host_dir = "/etc/gpuslice"; }, "--region-host-dir '/etc/gpuslice'"},
      {[](SliceRequest& r) { r.region_host_dir = "/usr/local/gpuslice"; }, "--region-host-dir"},
      {[](SliceRequest& r) { r.region_host_dir = "/tmp"; }, "--region-host-dir '/tmp'"},
      {[](SliceRequest& r) { r.region_host_dir = "/run/gpuslice/regions/.."; }, "--region-host-dir"},
      {[](SliceRequest& r) { r.region_host_dir = "/run/gpuslice/../../etc"; }, "--region-host-dir"},
      {[](SliceRequest& r) { r.region_host_dir = "/run//gpuslice"; }, "--region-host-dir"},
      {[](SliceRequest& r) { r.region_host_dir = "/run/gpuslice/a/"; }, "--region-host-dir"},
      {[](SliceRequest& r) { r.region_host_dir = "/run/gpuslice/a\nb"; }, "--region-host-dir"},
      {[](SliceRequest& r) { r.region_container_dir = "/etc"; }, "--region-dir '/etc'"},
      {[](SliceRequest& r) { r.region_container_dir = "/"; }, "--region-dir '/'"},
      // What the container must not rewrite is never inside its writable directory.
      {[](SliceRequest& r) {
         r.region_host_dir = "/usr2/local";
         r.library_host = "/usr2/local/lib/libgpuslice.so";
       },
       "holds --library-host"},
      {[](SliceRequest& r) { r.config_host_file = r.region_host_dir + "/gpuslice.conf"; }, "holds --config-host-file"},
      {[](SliceRequest& r) { r.preload_host_file = r.region_host_dir + "/ld.so.preload"; },
       "holds --preload-host-file"},
      // Keys the CDI library refuses (Kubernetes' annotation key rules).
      {[](SliceRequest& r) { r.annotations["bad key"] = "v"; }, "--annotation key 'bad key'"},
      {[](SliceRequest& r) { r.annotations["a/b/c"] = "v"; }, "--annotation key 'a/b/c'"},
      {[](SliceRequest& r) { r.annotations["-a"] = "v"; }, "--annotation key '-a'"},
      {[](SliceRequest& r) { r.annotations[std::string(64, 'k')] = "v"; }, "longer than 63"},
      {[](SliceRequest& r) { r.annotations["Bad_Prefix/x"] = "v"; }, "DNS subdomain"},
      {[](SliceRequest& r) { r.annotations["/x"] = "v"; }, "empty prefix"},
      {[](SliceRequest& r) { r.annotations["k"] = "\xff"; }, "UTF-8"},
      {[](SliceRequest& r) { r.annotations["k"] = std::string(256 * 1024, 'v'); }, "at most 262144"},
      // Limits the library's own parser refuses.
      {[](SliceRequest& r) { r.memory_limit = "0=8Gi,0=4Gi"; }, "--memory"},
      {[](SliceRequest& r) { r.memory_limit = "99=8Gi"; }, "--memory"},
      {[](SliceRequest& r) { r.memory_limit = "16=8Gi"; }, "--memory"},
      {[](SliceRequest& r) { r.sm_limit = "16=30"; }, "--sm-limit"},
      {[](SliceRequest& r) { r.sm_limit = "0=30,0=40"; }, "--sm-limit"},
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

TEST(CdiSpec, AcceptsWhatTheLibrariesAccept) {
  const std::function<void(SliceRequest&)> edits[] = {
      [](SliceRequest& r) { r.memory_limit = "0=8Gi,15=1Gi"; },
      [](SliceRequest& r) { r.sm_limit = "0=30,1=50"; },
      [](SliceRequest& r) { r.annotations[std::string(63, 'k')] = "v"; },
      [](SliceRequest& r) { r.annotations["Example.COM/Name_1.x"] = "v"; },  // checked in lower case
      [](SliceRequest& r) { r.annotations["1234"] = ""; },
      [](SliceRequest& r) {
        r.agent_region_dir = "/var/lib/gpuslice/regions";
        r.region_host_dir = "/var/lib/gpuslice/regions/x";
      },
      [](SliceRequest& r) { r.region_container_dir = "/gpuslice"; },
  };
  for (const auto& edit : edits) {
    SliceRequest r = claim_request();
    edit(r);
    std::string why;
    EXPECT_TRUE(gpuslice::cdi::validate(r, &why)) << why;
  }
}

// container-device-interface pkg/cdi/version.go (MinimumRequiredVersion):
// runtimes with an older CDI library (Debian 12's podman 4.3 reads up to
// 0.5.0) refuse a spec whose version is newer than they know.
TEST(CdiSpec, VersionIsTheLowestTheContentNeeds) {
  SliceRequest r;
  r.device_name = "slice-a";
  r.region_host_dir = "/run/gpuslice/regions/a";
  EXPECT_EQ(gpuslice::cdi::build_spec(r)["cdiVersion"], "0.3.0") << "a plain spec";
  r.device_name = "91a1e000-aaaa";  // a claim UID may start with a digit
  EXPECT_EQ(gpuslice::cdi::build_spec(r)["cdiVersion"], "0.5.0") << "a device name starting with a digit";
  r.kind = "gpuslice.io/slice.v2";
  EXPECT_EQ(gpuslice::cdi::build_spec(r)["cdiVersion"], "0.6.0") << "a '.' in the class";
  r.kind = gpuslice::cdi::kDefaultKind;
  r.annotations["gpuslice.io/claim"] = "x";
  EXPECT_EQ(gpuslice::cdi::build_spec(r)["cdiVersion"], "0.6.0") << "annotations";
}

TEST(CdiSpec, PreloadFileEntriesAsLdSoReadsThem) {
  using V = std::vector<std::string>;
  EXPECT_EQ(gpuslice::cdi::preload_entries("/a/lib.so\n"), V({"/a/lib.so"}));
  EXPECT_EQ(gpuslice::cdi::preload_entries("# comment /x.so\n /a.so:/b.so\t/c.so # d.so\n"),
            V({"/a.so", "/b.so", "/c.so"}));
  EXPECT_TRUE(gpuslice::cdi::preload_entries("\n# nothing\n").empty());
}

TEST(CdiSpec, ConfigFileCarriesTheEnvironmentAndIsMountedReadOnly) {
  SliceRequest r = claim_request();
  r.config_host_file = "/run/gpuslice/regions/.c1a1e000.conf";
  std::string why;
  ASSERT_TRUE(gpuslice::cdi::validate(r, &why)) << why;
  const json spec = gpuslice::cdi::build_spec(r);
  const json& mounts = spec["devices"][0]["containerEdits"]["mounts"];
  ASSERT_EQ(mounts.size(), 4u);
  EXPECT_EQ(mounts[3]["hostPath"], r.config_host_file);
  EXPECT_EQ(mounts[3]["containerPath"], "/etc/gpuslice/gpuslice.conf");
  EXPECT_EQ(mounts[3]["options"][0], "ro");
  const std::string text = gpuslice::cdi::config_file_text(r);
  for (const std::string& e : env_of(spec)) EXPECT_NE(text.find("\n" + e + "\n"), std::string::npos) << e;
  EXPECT_EQ(gpuslice::cdi::default_config_host_file("/run/gpuslice/regions/c1a1e000"),
            "/run/gpuslice/regions/.c1a1e000.conf");
}

// A host layout for the binary: a region directory, the library, a preload
// file naming it.
struct HostLayout {
  Sandbox box;
  std::string regions = box.path("regions");
  std::string region_dir = regions + "/c1a1e000-aaaa-4bbb-8ccc-dddddddddddd";
  std::string preload = box.path("ld.so.preload");
  HostLayout() {
    mkdir(regions.c_str(), 0755);
    mkdir(region_dir.c_str(), 0755);
    write_text(preload, "/usr/local/gpuslice/lib/libgpuslice.so\n");
  }
  // The defaults above, less any flag `extra` gives again (CLI11 takes each once).
  std::vector<std::string> argv(std::vector<std::string> extra) const {
    const std::pair<std::string, std::string> defaults[] = {{"--name", "c1a1e000-aaaa-4bbb-8ccc-dddddddddddd"},
                                                            {"--region-host-dir", region_dir},
                                                            {"--agent-region-dir", regions},
                                                            {"--library-host", gpuslice::test::preload_library()},
                                                            {"--preload-host-file", preload}};
    std::vector<std::string> a = {gpuslice::test::bin("gpuslice-cdi")};
    for (const auto& [flag, value] : defaults) {
      if (std::find(extra.begin(), extra.end(), flag) != extra.end()) continue;
      a.push_back(flag);
      a.push_back(value);
    }
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  // Every file below the sandbox, for "writes nothing".
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::recursive_directory_iterator(box.dir())) out.push_back(e.path().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

TEST(CdiSpec, EmittedSpecValidatesAgainstTheCdiSchema) {
  HostLayout host;
  const std::string out = host.box.path("gpuslice-claim.json");
  const gpuslice::test::Result emit =
      gpuslice::test::run(host.argv({"--memory", "8Gi", "--sm-limit", "30", "--priority", "low", "--container-name",
                                     "trainer", "--annotation", "gpuslice.io/claim=default/train", "--output", out}),
                          {}, 30000);
  ASSERT_EQ(emit.exit_code, 0) << emit.describe();
  EXPECT_EQ(emit.out, "gpuslice.io/slice=c1a1e000-aaaa-4bbb-8ccc-dddddddddddd\n");
  const gpuslice::test::Result v = validate_file(out);
  if (v.exit_code == 77) GTEST_SKIP() << v.out;
  EXPECT_EQ(v.exit_code, 0) << v.describe();
  // The same on stdout, with LD_PRELOAD injection and a plain name: version 0.3.0.
  mkdir((host.regions + "/slice-a").c_str(), 0755);  // a slice's directory of its own
  const gpuslice::test::Result emit2 = gpuslice::test::run(
      {gpuslice::test::bin("gpuslice-cdi"), "--name", "slice-a", "--region-host-dir", host.regions + "/slice-a",
       "--agent-region-dir", host.regions, "--library-host", gpuslice::test::preload_library(), "--inject", "env"},
      {}, 30000);
  ASSERT_EQ(emit2.exit_code, 0) << emit2.describe();
  EXPECT_EQ(json::parse(emit2.out)["cdiVersion"], "0.3.0");
  write_text(host.box.path("stdout.json"), emit2.out);
  EXPECT_EQ(validate_file(host.box.path("stdout.json")).exit_code, 0);
}

TEST(CdiSpec, BinaryWritesTheConfigFileNextToTheRegionDirectory) {
  HostLayout host;
  const std::string out = host.box.path("spec.json");
  const gpuslice::test::Result emit =
      gpuslice::test::run(host.argv({"--memory", "0=8Gi,1=4Gi", "--sm-limit", "30", "--output", out}), {}, 30000);
  ASSERT_EQ(emit.exit_code, 0) << emit.describe();
  const std::string conf = host.regions + "/.c1a1e000-aaaa-4bbb-8ccc-dddddddddddd.conf";
  std::ifstream in(conf);
  ASSERT_TRUE(in) << conf;
  std::stringstream text;
  text << in.rdbuf();
  std::ifstream spec_in(out);
  const json spec = json::parse(spec_in);
  for (const std::string& e : env_of(spec)) EXPECT_NE(text.str().find("\n" + e + "\n"), std::string::npos) << e;
  const json& mounts = spec["devices"][0]["containerEdits"]["mounts"];
  ASSERT_EQ(mounts.size(), 4u);
  EXPECT_EQ(mounts[3]["hostPath"], conf);
  // --no-config-file: no file, no mount.
  std::filesystem::remove(conf);
  const gpuslice::test::Result bare = gpuslice::test::run(host.argv({"--no-config-file"}), {}, 30000);
  ASSERT_EQ(bare.exit_code, 0) << bare.describe();
  EXPECT_EQ(json::parse(bare.out)["devices"][0]["containerEdits"]["mounts"].size(), 3u);
  EXPECT_FALSE(std::filesystem::exists(conf));
}

TEST(CdiSpec, BinaryRefusesBadInputWithExit64AndWritesNothing) {
  HostLayout host;
  const std::string out = host.box.path("spec.json");
  mkdir(host.box.path("real").c_str(), 0755);
  symlink(host.box.path("real").c_str(), (host.regions + "/link").c_str());
  const std::vector<std::string> layout = host.files();
  struct Case {
    std::vector<std::string> args;
    const char* expect;
  };
  const Case cases[] = {
      {{"--memory", "lots"}, "--memory (memory limit)"},
      {{"--memory", "0=8Gi,0=4Gi"}, "device 0 is listed twice"},
      {{"--memory", "99=1Gi"}, "--memory"},
      {{"--sm-limit", "16=30"}, "--sm-limit"},
      {{"--inject", "mount"}, "--inject"},
      {{"--inject", "e\x1bnv"}, "--inject 'e\\x1bnv'"},  // shown escaped
      {{"--annotation", "k\n"}, "--annotation 'k\\x0a'"},
      // The preload file names another path: ld.so would skip the library.
      {{"--library", "/opt/gpuslice/libgpuslice.so"}, "--library '/opt/gpuslice/libgpuslice.so' is not what"},
      {{"--preload-host-file", host.box.path("missing")}, "--preload-host-file"},
      {{"--region-host-dir", "/etc"}, "--region-host-dir '/etc'"},
      {{"--region-host-dir", "/"}, "--region-host-dir '/'"},
      {{"--region-host-dir", host.regions + "/.."}, "--region-host-dir"},
      {{"--region-host-dir", host.regions + "/absent"}, "no such directory"},
      {{"--region-host-dir", host.regions + "/link"}, "symbolic link"},
      {{"--library-host", host.box.path("absent.so")}, "--library-host"},
      {{"--annotation", "bad key=v"}, "--annotation key 'bad key'"},
      {{"--annotation", "a/b/c=v"}, "--annotation key 'a/b/c'"},
      {{"--annotation", "-a=v"}, "--annotation key '-a'"},
      {{"--annotation", std::string(64, 'k') + "=v"}, "longer than 63"},
      {{"--annotation", "k=v", "--annotation", "k=w"}, "given twice"},
      {{"--config-host-file", host.region_dir + "/gpuslice.conf"}, "holds --config-host-file"},
      {{"--config-host-file", host.box.path("nodir/x.conf")}, "--config-host-file"},
      {{"--no-config-file", "--config-host-file", host.box.path("x.conf")}, "--no-config-file"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.args;
    args.push_back("--output");
    args.push_back(out);
    const gpuslice::test::Result r = gpuslice::test::run(host.argv(args), {}, 30000);
    EXPECT_EQ(r.exit_code, 64) << c.expect << ": " << r.describe();
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << r.describe();
    EXPECT_EQ(host.files(), layout) << c.expect << ": wrote something";
  }
}

// Bound read-write into the container: the region's host directory is one
// directory of this slice alone, right below the agent's region directory.
TEST(CdiSpec, RegionHostDirIsADirectoryOfItsOwnBelowTheAgents) {
  const std::pair<std::string, const char*> refused[] = {
      {"/var/lib", "expected /run/gpuslice/regions/<name>"},                              // a host tree
      {"/run/gpuslice/regions", "expected /run/gpuslice/regions/<name>"},                 // every slice's directories
      {"/run/gpuslice/regions/c1a1e000/inner", "expected /run/gpuslice/regions/<name>"},  // inside another's
      {"/run/gpuslice", "expected /run/gpuslice/regions/<name>"},
      {"/srv/regions/c1a1e000", "expected /run/gpuslice/regions/<name>"},
      {"/run/gpuslice/regions/.c1a1e000", "hidden"},
      {"/run/gpuslice/regions/c1a1e000 ", "starts or ends with a blank"},
      {"/run/gpuslice/regions/c1\\a", "holds '\\'"},
  };
  for (const auto& [dir, expect] : refused) {
    SliceRequest r = claim_request();
    r.region_host_dir = dir;
    std::string why;
    EXPECT_FALSE(gpuslice::cdi::validate(r, &why)) << dir;
    EXPECT_NE(why.find("--region-host-dir '" + dir + "'"), std::string::npos) << why;
    EXPECT_NE(why.find(expect), std::string::npos) << why;
  }
  SliceRequest r = claim_request();
  r.agent_region_dir = "/srv/regions";
  r.region_host_dir = "/srv/regions/c1a1e000";
  std::string why;
  EXPECT_TRUE(gpuslice::cdi::validate(r, &why)) << why;
  r.agent_region_dir = "/srv/regions/";
  EXPECT_FALSE(gpuslice::cdi::validate(r, &why));
  EXPECT_NE(why.find("--agent-region-dir"), std::string::npos) << why;
}

TEST(CdiSpec, BinaryRefusesAHostTreeTheAgentsDirectoryAndAnotherSlicesDirectory) {
  HostLayout host;
  const std::string out = host.box.path("spec.json");
  // The first slice's spec and configuration file.
  const gpuslice::test::Result first = gpuslice::test::run(host.argv({"--memory", "256Mi"}), {}, 30000);
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  const std::string conf = host.regions + "/.c1a1e000-aaaa-4bbb-8ccc-dddddddddddd.conf";
  const std::string conf_text = read_text(conf);
  ASSERT_NE(conf_text.find("GPUSLICE_MEMORY_LIMIT=256Mi\n"), std::string::npos) << conf_text;
  mkdir(host.box.path("var").c_str(), 0755);
  mkdir(host.box.path("var/lib").c_str(), 0755);
  const std::vector<std::string> layout = host.files();
  struct Case {
    std::vector<std::string> args;
    const char* expect;
  };
  const Case cases[] = {
      {{"--region-host-dir", host.box.path("var/lib")}, "right below the agent's region directory"},
      {{"--region-host-dir", host.regions}, "right below the agent's region directory"},
      // Another claim naming the first one's directory would replace its limits.
      {{"--name", "other-claim", "--memory", "8Gi"}, "the configuration file of gpuslice.io/slice=c1a1e000"},
      {{"--name", "other-claim", "--config-host-file", host.preload}, "not a configuration file gpuslice-cdi wrote"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = c.args;
    args.push_back("--output");
    args.push_back(out);
    const gpuslice::test::Result r = gpuslice::test::run(host.argv(args), {}, 30000);
    EXPECT_EQ(r.exit_code, 64) << c.expect << ": " << r.describe();
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << r.describe();
    EXPECT_EQ(host.files(), layout) << c.expect << ": wrote something";
  }
  EXPECT_EQ(read_text(conf), conf_text) << "the first slice's configuration file changed";
  // The same slice again (a repeated NodePrepareResources) rewrites its own file.
  const gpuslice::test::Result again = gpuslice::test::run(host.argv({"--memory", "512Mi"}), {}, 30000);
  EXPECT_EQ(again.exit_code, 0) << again.describe();
  EXPECT_NE(read_text(conf).find("GPUSLICE_MEMORY_LIMIT=512Mi\n"), std::string::npos);
}

// One rule for the names the spec writes (tools/common/text.h valid_name).
TEST(CdiSpec, NamesAreRefusedUnlessEveryReaderReadsThemAlike) {
  const std::pair<std::function<void(SliceRequest&)>, const char*> refused[] = {
      {[](SliceRequest& r) { r.region_file = "slice.region "; }, "--region-file (region file) 'slice.region '"},
      {[](SliceRequest& r) { r.region_file = " slice.region"; }, "starts or ends with a blank"},
      {[](SliceRequest& r) { r.region_file = "slice.region\t"; }, "control character"},
      {[](SliceRequest& r) { r.region_file = "sl\nice"; }, "--region-file (region file) 'sl\\x0aice'"},
      {[](SliceRequest& r) { r.region_file = "sl\\ice"; }, "holds '\\'"},
      {[](SliceRequest& r) { r.region_file = "\xff\xfe.region"; }, "'\\xff\\xfe.region': holds a byte that is not"},
      {[](SliceRequest& r) { r.region_file = std::string(256, 'r'); }, "too long"},
      {[](SliceRequest& r) { r.region_file = ".slice.region"; }, "hidden"},
      {[](SliceRequest& r) { r.region_file = ""; }, "empty"},
      {[](SliceRequest& r) { r.container_name = "trainer "; }, "--container-name (container name) 'trainer '"},
      {[](SliceRequest& r) { r.container_name = "a/b"; }, "--container-name (container name) 'a/b': holds '/'"},
      {[](SliceRequest& r) { r.container_name = "caf\xc3\xa9"; }, "not ASCII"},
      // What is refused is shown escaped: no control byte reaches the caller's log.
      {[](SliceRequest& r) { r.region_host_dir = "/run/gpuslice/regions/a\nb"; },
       "--region-host-dir '/run/gpuslice/regions/a\\x0ab'"},
      {[](SliceRequest& r) { r.annotations["k\x1b[2J"] = "v"; }, "--annotation key 'k\\x1b[2J'"},
      // Any value of the spec's environment that the file would read otherwise.
      {[](SliceRequest& r) { r.region_container_dir = "/run/gpuslice\t"; }, "--region-dir"},
  };
  for (const auto& [edit, expect] : refused) {
    SliceRequest r = claim_request();
    edit(r);
    std::string why;
    EXPECT_FALSE(gpuslice::cdi::validate(r, &why)) << expect;
    EXPECT_NE(why.find(expect), std::string::npos) << why;
  }
}

// Round trip: whatever gpuslice-cdi accepts, the library reads the same from
// the configuration file (a process with a cleared environment) as from the
// spec's environment, byte for byte. Every printable ASCII character at the
// start, inside and at the end of both names.
TEST(CdiSpec, ConfigFileReadsBackWhatTheEnvironmentSetsByteForByte) {
  Sandbox box;
  static gpuslice::options::ConfigFileBuffer buf;
  static gpuslice::options::Options from_env, from_file;
  const std::string file = box.path("slice.conf");
  int accepted = 0, refused = 0;
  for (int c = 0x01; c < 0x100; ++c) {
    const std::string ch(1, static_cast<char>(c));
    for (const std::string& name : {ch + "ab", "a" + ch + "b", "ab" + ch}) {
      SliceRequest r = claim_request();
      r.region_file = name;
      r.container_name = name;
      std::string why;
      if (!gpuslice::cdi::validate(r, &why)) {
        ++refused;
        continue;
      }
      ++accepted;
      std::vector<std::string> env = gpuslice::cdi::slice_environment(r);
      std::vector<char*> envp;
      for (std::string& e : env) envp.push_back(e.data());
      envp.push_back(nullptr);
      gpuslice::shm::Error err{};
      ASSERT_TRUE(gpuslice::options::parse_options(envp.data(), &from_env, &err)) << err.message;
      write_text(file, gpuslice::cdi::config_file_text(r));
      std::string named = "GPUSLICE_CONFIG_FILE=" + file;
      char* file_env[] = {named.data(), nullptr};
      ASSERT_TRUE(gpuslice::options::load_options(file_env, "/nonexistent", &buf, &from_file, &err))
          << err.message << "\n"
          << gpuslice::cdi::config_file_text(r);
      EXPECT_STREQ(from_file.region, from_env.region) << "name '" << name << "'";
      EXPECT_STREQ(from_file.container_name, from_env.container_name) << "name '" << name << "'";
      EXPECT_EQ(std::string(from_env.region), "/run/gpuslice/" + name);
      EXPECT_EQ(std::string(from_env.container_name), name);
    }
  }
  // 94 printable characters but '/' and '\' inside; the blank not at the ends.
  EXPECT_EQ(accepted, 3 * 92 + 1 - 1) << refused;  // '.' cannot start the file name
}

// The files gpuslice-cdi reads (as root) are opened without blocking and
// must be regular: a FIFO named as the preload file would hang it, a device
// such as /dev/zero would never end.
TEST(CdiSpec, BinaryNeverHangsOnAFifoOrReadsADeviceAsThePreloadFile) {
  HostLayout host;
  const std::string fifo = host.box.path("preload.fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  for (const std::string& path : {fifo, "/dev/zero"s}) {
    const gpuslice::test::Result r = gpuslice::test::run(host.argv({"--preload-host-file", path}), {}, 10000);
    EXPECT_FALSE(r.timed_out) << path << ": " << r.describe();
    EXPECT_EQ(r.exit_code, 64) << path << ": " << r.describe();
    EXPECT_NE(r.err.find("--preload-host-file '" + path + "'"), std::string::npos) << r.describe();
    EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << r.describe();
  }
}

TEST(CdiSpec, ValidatorRejectsBrokenSpecs) {
  Sandbox box;
  const json good = gpuslice::cdi::build_spec(claim_request());
  const std::pair<const char*, std::function<void(json&)>> breakages[] = {
      {"no devices", [](json& s) { s.erase("devices"); }},
      {"old version", [](json& s) { s["cdiVersion"] = "0.5.0"; }},  // annotations need 0.6.0
      {"unreleased version", [](json& s) { s["cdiVersion"] = "0.9.9"; }},
      {"before the earliest", [](json& s) { s["cdiVersion"] = "0.2.0"; }},
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

// --driver-memory-limit: for nodes without the agent, the spec carries what
// NVIDIA's container toolkit (1.20.1+) needs to set the driver's per-cgroup
// limit (R615+): NVIDIA_GPU_MEMORY_LIMIT in MiB (rounded up: gpuslice refuses
// first), NVIDIA_GPU_MEMORY_REQUEST=0 (no soft guarantee), and one createRuntime
// hook `nvidia-cdi-hook apply-cuda-memory-limits` naming every GPU.
TEST(CdiSpec, DriverMemoryLimitCarriesTheToolkitsVariablesAndHook) {
  SliceRequest r = claim_request();
  r.memory_limit = "8Gi";
  json plain = gpuslice::cdi::build_spec(r);
  EXPECT_FALSE(plain["devices"][0]["containerEdits"].contains("hooks"));
  for (const std::string& e : env_of(plain)) EXPECT_EQ(e.rfind("NVIDIA_GPU_MEMORY", 0), std::string::npos) << e;

  r.driver_limit_gpus = {"GPU-00010203-0405-0607-0809-0a0b0c0d0e0f", "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"};
  std::string why;
  ASSERT_TRUE(gpuslice::cdi::validate(r, &why)) << why;
  json spec = gpuslice::cdi::build_spec(r);
  EXPECT_TRUE(has(env_of(spec), "NVIDIA_GPU_MEMORY_LIMIT=8192"));
  EXPECT_TRUE(has(env_of(spec), "NVIDIA_GPU_MEMORY_REQUEST=0"));
  EXPECT_TRUE(has(env_of(spec), "GPUSLICE_MEMORY_LIMIT=8Gi")) << "gpuslice's own quota stays in front";
  const json& hooks = spec["devices"][0]["containerEdits"]["hooks"];
  ASSERT_EQ(hooks.size(), 1u);
  EXPECT_EQ(hooks[0]["hookName"], "createRuntime");
  EXPECT_EQ(hooks[0]["path"], "/usr/bin/nvidia-cdi-hook");
  EXPECT_EQ(hooks[0]["args"].get<std::vector<std::string>>(),
            (std::vector<std::string>{"nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root", "/", "--gpu-id",
                                      "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f", "--gpu-id",
                                      "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"}));

  std::uint64_t mib = 0;
  r.memory_limit = "8G";  // 8e9 bytes: 7629.39 MiB
  ASSERT_TRUE(gpuslice::cdi::driver_limit_mib(r, &mib, &why)) << why;
  EXPECT_EQ(mib, 7630u);
  r.memory_limit = "0=4Gi,1=4Gi";
  ASSERT_TRUE(gpuslice::cdi::validate(r, &why)) << why;
  r.memory_limit = "0=8Gi,1=4Gi";
  EXPECT_FALSE(gpuslice::cdi::validate(r, &why));
  EXPECT_NE(why.find("--driver-memory-limit"), std::string::npos) << why;
  r.memory_limit = "";
  EXPECT_FALSE(gpuslice::cdi::validate(r, &why));
  EXPECT_NE(why.find("--memory"), std::string::npos) << why;
  r.memory_limit = "8Gi";
  r.driver_limit_gpus = {"0"};
  EXPECT_FALSE(gpuslice::cdi::validate(r, &why));
  EXPECT_NE(why.find("GPU UUIDs"), std::string::npos) << why;
  r.driver_limit_gpus = {"GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"};
  r.cdi_hook = "nvidia-cdi-hook";
  EXPECT_FALSE(gpuslice::cdi::validate(r, &why));
  EXPECT_NE(why.find("--nvidia-cdi-hook"), std::string::npos) << why;
}

TEST(CdiSpec, BinaryEmitsADriverMemoryLimitSpecThatValidates) {
  HostLayout host;
  const std::string out = host.box.path("limit.json");
  const gpuslice::test::Result emit = gpuslice::test::run(
      host.argv({"--memory", "6Gi", "--driver-memory-limit",
                 "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f,GPU-10111213-1415-1617-1819-1a1b1c1d1e1f", "--output", out}),
      {}, 30000);
  ASSERT_EQ(emit.exit_code, 0) << emit.describe();
  const json spec = json::parse(read_text(out));
  EXPECT_TRUE(has(env_of(spec), "NVIDIA_GPU_MEMORY_LIMIT=6144"));
  EXPECT_EQ(spec["devices"][0]["containerEdits"]["hooks"][0]["args"].size(), 8u);
  const gpuslice::test::Result v = validate_file(out);
  if (v.exit_code == 77) GTEST_SKIP() << v.out;
  EXPECT_EQ(v.exit_code, 0) << v.describe();
  const gpuslice::test::Result bad =
      gpuslice::test::run(host.argv({"--memory", "0=6Gi,1=2Gi", "--driver-memory-limit", "GPU-0001"}), {}, 30000);
  EXPECT_EQ(bad.exit_code, 64) << bad.describe();
  EXPECT_NE(bad.err.find("--driver-memory-limit"), std::string::npos) << bad.describe();
}

}  // namespace
