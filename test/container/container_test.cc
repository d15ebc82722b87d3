// gpuslice in real containers: podman (Debian's, with runc) starts an image
// built here from files on this machine (busybox, a CUDA probe, the C and C++
// runtime libraries) with only --device flags: the simulated GPU as a
// vendor's CDI device, and a gpuslice slice from gpuslice-cdi's spec. Inside:
// the quota is enforced and cuMemGetInfo reports it, under both injection
// variants; a second container of the same slice shares its quota, another
// slice does not; the host's agent sees the containers; a process that clears
// its environment is still limited (through the slice's configuration file).
// Exit 77 (skipped) only when the runtime cannot run a container at all.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "podman_world.h"

using gpuslice::container_test::Image;
using gpuslice::container_test::World;
using gpuslice::container_test::WorldSuite;
using namespace std::string_literals;
using gpuslice::test::field;
using gpuslice::test::lines_with;
using gpuslice::test::Result;

namespace {

constexpr unsigned long long kMi = 1ull << 20;
constexpr int kOutOfMemory = 2;  // CUDA_ERROR_OUT_OF_MEMORY

std::string mib(unsigned long long n) { return std::to_string(n * kMi); }

class Container : public WorldSuite<Image::local> {
 protected:
  // Waits for a file the container makes in its region directory.
  static bool wait_for(const std::string& path, int seconds = 60) {
    for (int i = 0; i < seconds * 50 && access(path.c_str(), F_OK) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return access(path.c_str(), F_OK) == 0;
  }
};

TEST_F(Container, PreloadFileVariantEnforcesTheQuotaAndReportsIt) {
  const Result r = world->run({world->vendor_device, world->a.device},
                              {"/bin/sh", "-c",
                               "echo \"env LD_PRELOAD=[$LD_PRELOAD]\"; echo \"preload $(cat /etc/ld.so.preload)\"; "
                               "exec cuprobe init ctx 0 meminfo alloc " +
                                   mib(200) + " alloc " + mib(100) + " alloc " + mib(50)});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(line(r, "env"), "env LD_PRELOAD=[]") << "only /etc/ld.so.preload loads the library";
  EXPECT_EQ(line(r, "preload"), "preload /usr/local/gpuslice/lib/libgpuslice.so");
  EXPECT_EQ(field(line(r, "init"), "rc"), "0") << r.describe();
  const std::string info = line(r, "meminfo");
  EXPECT_EQ(field(info, "total"), mib(256)) << "cuMemGetInfo reports the quota as the device's size: " << r.describe();
  EXPECT_EQ(field(info, "free"), mib(256)) << r.describe();
  const auto allocs = lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 3u) << r.describe();
  EXPECT_EQ(field(allocs[0], "rc"), "0");
  EXPECT_EQ(field(allocs[1], "rc"), std::to_string(kOutOfMemory)) << "200 + 100 MiB is over the 256 MiB quota";
  EXPECT_EQ(field(allocs[2], "rc"), "0") << "what fits still fits";
}

TEST_F(Container, LdPreloadVariantEnforcesTheQuotaAndReportsIt) {
  const Result r =
      world->run({world->vendor_device, world->b.device},
                 {"/bin/sh", "-c",
                  "echo \"env LD_PRELOAD=[$LD_PRELOAD]\"; test -e /etc/ld.so.preload || echo 'preload none'; "
                  "exec cuprobe init ctx 0 meminfo alloc " +
                      mib(100) + " alloc " + mib(64)});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(line(r, "env"), "env LD_PRELOAD=[/usr/local/gpuslice/lib/libgpuslice.so]");
  EXPECT_EQ(line(r, "preload"), "preload none");
  EXPECT_EQ(field(line(r, "meminfo"), "total"), mib(128)) << r.describe();
  const auto allocs = lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 2u) << r.describe();
  EXPECT_EQ(field(allocs[0], "rc"), "0");
  EXPECT_EQ(field(allocs[1], "rc"), std::to_string(kOutOfMemory)) << "100 + 64 MiB is over the 128 MiB quota";
}

TEST_F(Container, ContainersOfASliceShareItsQuotaAndTheAgentSeesThem) {
  using gpuslice::test::spawn;
  const std::string held_a = world->a.region_dir + "/.a1-held", held_b = world->b.region_dir + "/.b1-held";
  // One container of each slice holds memory until released.
  const std::string out_a = world->dir + "/a1.out", out_b = world->dir + "/b1.out";
  const pid_t a1 = spawn(world->run_argv({world->vendor_device, world->a.device},
                                         {"cuprobe", "init", "ctx", "0", "alloc", mib(200), "touch",
                                          "/run/gpuslice/.a1-held", "waitfile", "/run/gpuslice/.release", "meminfo"}),
                         {}, out_a);
  const pid_t b1 = spawn(world->run_argv({world->vendor_device, world->b.device},
                                         {"cuprobe", "init", "ctx", "0", "alloc", mib(100), "touch",
                                          "/run/gpuslice/.b1-held", "waitfile", "/run/gpuslice/.release", "meminfo"}),
                         {}, out_b);
  const bool held = wait_for(held_a) && wait_for(held_b);
  Result a2, agent;
  if (held) {
    // A second container of slice a: 56 MiB left of its 256.
    a2 = world->run({world->vendor_device, world->a.device},
                    {"cuprobe", "init", "ctx", "0", "meminfo", "alloc", mib(100), "alloc", mib(48)});
    // The node agent, on the host, over both slices' regions.
    agent = gpuslice::test::run(
        {gpuslice::test::bin("gpuslice-agent"), "--region-dir", world->regions, "--once", "--listen", "off", "--nvml",
         gpuslice::test::fakecuda_dir() + "/libnvidia-ml.so.1", "--grace", "0"},
        {{"FAKECUDA_STATE", world->state_file}}, 60000);
  }
  // Release both, whatever happened.
  std::FILE* f = std::fopen((world->a.region_dir + "/.release").c_str(), "w");
  if (f != nullptr) std::fclose(f);
  f = std::fopen((world->b.region_dir + "/.release").c_str(), "w");
  if (f != nullptr) std::fclose(f);
  const Result ra = gpuslice::test::wait(a1, out_a, 120000), rb = gpuslice::test::wait(b1, out_b, 120000);
  ASSERT_TRUE(held) << ra.describe() << rb.describe();
  EXPECT_EQ(ra.exit_code, 0) << ra.describe();
  EXPECT_EQ(rb.exit_code, 0) << rb.describe();
  EXPECT_EQ(field(line(ra, "alloc"), "rc"), "0") << ra.describe();
  EXPECT_EQ(field(line(rb, "alloc"), "rc"), "0") << "another slice's quota is its own: " << rb.describe();

  ASSERT_EQ(a2.exit_code, 0) << a2.describe();
  EXPECT_EQ(field(line(a2, "meminfo"), "free"), mib(56)) << "the first container's 200 MiB count: " << a2.describe();
  EXPECT_EQ(field(line(a2, "meminfo"), "total"), mib(256));
  const auto allocs = lines_with(a2.out, "alloc ");
  ASSERT_EQ(allocs.size(), 2u) << a2.describe();
  EXPECT_EQ(field(allocs[0], "rc"), std::to_string(kOutOfMemory)) << "shared quota: " << a2.describe();
  EXPECT_EQ(field(allocs[1], "rc"), "0") << a2.describe();

  ASSERT_EQ(agent.exit_code, 0) << agent.describe();
  auto used = [&](const std::string& container) {
    for (const std::string& l : lines_with(agent.out, "gpuslice_memory_used_bytes{")) {
      if (l.find("container=\"" + container + "\"") != std::string::npos) return l.substr(l.rfind(' ') + 1);
    }
    return std::string("absent");
  };
  EXPECT_EQ(used("ctr-a"), mib(200)) << agent.out;
  EXPECT_EQ(used("ctr-b"), mib(100)) << agent.out;
}

// gpuslice-cdi writes 0.6.0 only when the content needs it (annotations):
// Debian 12's podman 4.3 (CDI library up to 0.5.0) refuses such a spec.
TEST_F(Container, AnnotatedSpecNeedsANewerRuntime) {
  const std::string version = world->podman_version();
  if (version.rfind("4.3.", 0) != 0) GTEST_SKIP() << "podman " << version << ": its CDI library may read 0.6.0";
  const std::string name = world->a.name + "-annotated";
  const std::string out = World::cdi_dir() + "/gpuslice-test-"s + name + ".json";
  const Result made = gpuslice::test::run(
      {gpuslice::test::bin("gpuslice-cdi"), "--name", name, "--memory", mib(256), "--region-host-dir",
       world->a.region_dir, "--agent-region-dir", world->regions, "--library-host", gpuslice::test::preload_library(),
       "--inject", "env", "--no-config-file", "--annotation", "gpuslice.io/claim=default/x", "--output", out},
      {}, 30000);
  const Result r = world->run({world->vendor_device, made.out.substr(0, made.out.find('\n'))},
                              {"cuprobe", "init", "ctx", "0", "meminfo"});
  std::remove(out.c_str());
  ASSERT_EQ(made.exit_code, 0) << made.describe();
  EXPECT_NE(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("unresolvable CDI devices"), std::string::npos) << r.describe();
  // Without the annotation, the same device is 0.3.0 and runs (the tests above).
}

TEST_F(Container, ProcessWithAClearedEnvironmentIsStillLimited) {
  // Nothing of the container's environment is left: no GPUSLICE_*, no
  // LD_PRELOAD, not even the simulated driver's FAKECUDA_STATE (the vendor
  // device mounts its state at the driver's default path, as device nodes
  // need no environment). /etc/ld.so.preload still loads the library.
  std::vector<std::string> cmd = {"/bin/env", "-i"};
#if defined(__SANITIZE_ADDRESS__)
  cmd.push_back(gpuslice::container_test::kAsanOptions);  // the sanitizer's, not the container's configuration
#endif
  for (const std::string& a :
       {"/usr/bin/cuprobe"s, "init"s, "ctx"s, "0"s, "meminfo"s, "alloc"s, mib(300), "alloc"s, mib(200)}) {
    cmd.push_back(a);
  }
  const Result r = world->run({world->vendor_device, world->a.device}, cmd);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_EQ(field(line(r, "init"), "rc"), "0") << "the driver is reachable without any environment: " << r.describe();
  if (!World::library_reads_config_file()) {
    GTEST_SKIP() << "this libgpuslice.so does not read /etc/gpuslice/gpuslice.conf yet (the configuration-file "
                    "fallback is not in this build); today such a process sees "
                 << line(r, "meminfo") << " and " << lines_with(r.out, "alloc ").size()
                 << " allocation(s) of 300 and 200 MiB: " << r.out;
  }
  EXPECT_EQ(field(line(r, "meminfo"), "total"), mib(256)) << r.describe();
  const auto allocs = lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 2u) << r.describe();
  EXPECT_EQ(field(allocs[0], "rc"), std::to_string(kOutOfMemory)) << "300 MiB against 256: " << r.describe();
  EXPECT_EQ(field(allocs[1], "rc"), "0") << r.describe();
}

}  // namespace
