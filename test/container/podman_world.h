// A private podman world for the container tests: storage, run directory,
// cgroup parent and image of its own (removed at the end), CDI specs in the
// runtime's spec directory under names of its own, and a simulated GPU node:
// the simulated driver as a vendor CDI device, two gpuslice slices from
// gpuslice-cdi, their region directories watched by a host agent.
#pragma once

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

class World {
 public:
  // Builds everything; on failure `skip` (the runtime cannot run here: exit
  // 77) or `error` (anything else: a test failure) says why.
  World();
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  std::string skip, error;
  std::string dir;               // test-private root
  std::string vendor_device;     // the simulated GPU, as a vendor's CDI device
  Slice a, b;                    // a: /etc/ld.so.preload injection, b: LD_PRELOAD
  std::string state_file;        // the simulated driver's state, on the host
  std::string regions;           // the agent's --region-dir

  // podman run --rm with the given --device flags (and only those) and command.
  std::vector<std::string> run_argv(const std::vector<std::string>& devices, const std::vector<std::string>& cmd) const;
  gpuslice::test::Result run(const std::vector<std::string>& devices, const std::vector<std::string>& cmd,
                             int timeout_ms = 120000) const;
  // Does the preload library read /etc/gpuslice/gpuslice.conf?
  static bool library_reads_config_file();

 private:
  std::vector<std::string> podman_;  // podman and its global flags
  std::string image_, cgroup_parent_;
  std::vector<std::string> spec_files_;
  bool made_cdi_dir_ = false;

  bool setup();
  bool build_image();
  bool write_specs();
  void cleanup();
  gpuslice::test::Result podman(std::vector<std::string> args, int timeout_ms = 120000) const;
};

}  // namespace gpuslice::container_test
