// A private podman world for the container tests: storage, run directory,
// cgroup parent and image of its own (removed at the end), CDI specs in the
// runtime's spec directory under names of its own, and a simulated GPU node:
// the simulated driver as a vendor CDI device, two gpuslice slices from
// gpuslice-cdi, their region directories watched by a host agent.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "harness.h"

namespace gpuslice::container_test {

// What a sanitized (ASan) build's programs need in the container's environment.
inline constexpr char kAsanOptions[] = "ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0";

struct Slice {
  std::string name;        // CDI device name
  std::string device;      // gpuslice.io/slice=<name>
  std::string region_dir;  // host directory of the region
  std::string container;   // GPUSLICE_CONTAINER_NAME
  unsigned long long quota = 0;
};

// The image: files of this machine (busybox, cuprobe_dl and the libraries
// they need), or a Debian bullseye root (glibc 2.31, python3) made by
// test/deploy/bullseye_rootfs.sh, or the root GPUSLICE_BULLSEYE_ROOT names,
// with test/container/cuda_probe.py added as /usr/local/bin/cuda_probe.py.
enum class Image { local, bullseye };

class World {
 public:
  // Builds everything; on failure `skip` (the runtime cannot run here, or no
  // bullseye root can be had: exit 77) or `error` (anything else: a test
  // failure) says why.
  explicit World(Image image = Image::local);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  std::string skip, error;
  std::string dir;            // test-private root
  std::string vendor_device;  // the simulated GPU, as a vendor's CDI device
  Slice a, b;                 // a: /etc/ld.so.preload injection, b: LD_PRELOAD
  std::string state_file;     // the simulated driver's state, on the host
  std::string regions;        // the agent's --region-dir

  // podman run --rm with the given --device flags (and only those) and command.
  std::vector<std::string> run_argv(const std::vector<std::string>& devices, const std::vector<std::string>& cmd) const;
  gpuslice::test::Result run(const std::vector<std::string>& devices, const std::vector<std::string>& cmd,
                             int timeout_ms = 120000) const;
  // `podman version`'s client version ("4.3.1").
  std::string podman_version() const;
  // The directory podman reads CDI specs from (podman 4.3 has no --cdi-spec-dir).
  static constexpr const char* cdi_dir() { return "/var/run/cdi"; }
  // Does the preload library read /etc/gpuslice/gpuslice.conf?
  static bool library_reads_config_file();

 private:
  Image kind_;
  std::vector<std::string> podman_;  // podman and its global flags
  std::string image_, cgroup_parent_;
  std::vector<std::string> spec_files_;
  bool made_cdi_dir_ = false;

  bool setup();
  bool build_image();
  bool build_local_root(const std::string& root);
  bool bullseye_root(std::string* root);
  bool write_specs();
  void cleanup();
  gpuslice::test::Result podman(std::vector<std::string> args, int timeout_ms = 120000) const;
};

// The tests' fixture: one World per suite, built before its first test; the
// whole suite exits 77 (skipped, with the reason) where the runtime or the
// image cannot be had.
template <Image kImage>
class WorldSuite : public ::testing::Test {
 protected:
  static inline World* world = nullptr;
  static void SetUpTestSuite() {
    world = new World(kImage);
    if (!world->skip.empty()) {
      std::printf("SKIPPED: %s\n", world->skip.c_str());
      std::fflush(stdout);
      delete world;
      std::_Exit(77);
    }
  }
  static void TearDownTestSuite() {
    delete world;
    world = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(world->error.empty()) << world->error; }

  // The one line of `r.out` that starts with `op`.
  static std::string line(const gpuslice::test::Result& r, const std::string& op) {
    const auto l = gpuslice::test::lines_with(r.out, op + " ");
    return l.size() == 1 ? l[0] : "";
  }
};

}  // namespace gpuslice::container_test
