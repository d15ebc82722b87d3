// A CDI (Container Device Interface) spec that injects gpuslice into a
// container: the environment (limits, policy, priority, region) and the
// mounts (the library, the region directory, optionally /etc/ld.so.preload).
// A DRA driver, a device plugin or an NRI plugin writes it to /etc/cdi or
// /var/run/cdi and names the device ("gpuslice.io/slice=<name>") in its
// response; the container runtime applies the edits. See docs/deploy.md.
//
// Spec version 0.6.0: the oldest that holds everything we may write (spec
// annotations arrived in 0.6.0); runtimes refuse a spec that uses a field
// newer than its cdiVersion, and accept older versions.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace gpuslice::cdi {

inline constexpr char kCdiVersion[] = "0.6.0";
inline constexpr char kDefaultKind[] = "gpuslice.io/slice";

enum class Inject { preload_file, env };

struct SliceRequest {
  std::string kind = kDefaultKind;
  std::string device_name;        // CDI device name (e.g. the claim UID)
  std::string memory_limit;       // GPUSLICE_MEMORY_LIMIT syntax ("" = unlimited)
  std::string sm_limit;           // GPUSLICE_SM_LIMIT syntax ("" = unlimited)
  std::string sm_policy;          // hard | elastic ("" = the library's default)
  std::string priority;           // high | normal | low ("" = default)
  std::string container_name;     // GPUSLICE_CONTAINER_NAME ("" = none)
  std::string region_host_dir;    // host directory holding the region (the agent watches it)
  std::string region_container_dir = "/run/gpuslice";
  std::string region_file = "slice.region";
  std::string library_host = "/usr/local/gpuslice/lib/libgpuslice.so";
  std::string library_container = "/usr/local/gpuslice/lib/libgpuslice.so";
  Inject inject = Inject::preload_file;
  // A host file holding library_container's path (Inject::preload_file);
  // deploy/'s agent DaemonSet writes this one.
  std::string preload_host_file = "/usr/local/gpuslice/lib/ld.so.preload";
  std::map<std::string, std::string> annotations;
};

// CDI's naming rules (container-device-interface pkg/parser): vendor and
// class start with a letter, end with a letter or digit, and hold letters,
// digits, '-', '_' and '.'; a device name starts and ends with a letter or
// digit and also allows ':'. false + a message naming the rule.
bool valid_kind(const std::string& kind, std::string* why);
bool valid_device_name(const std::string& name, std::string* why);

// Checks every field (names, sizes, percentages, words, absolute paths);
// false + one message naming the option and what was expected.
bool validate(const SliceRequest& req, std::string* why);

// The spec (validate() first).
nlohmann::json build_spec(const SliceRequest& req);

// "gpuslice.io/slice=<name>": what a runtime, a DRA driver's CDI device IDs
// or an NRI plugin names.
std::string qualified_name(const SliceRequest& req);

}  // namespace gpuslice::cdi
