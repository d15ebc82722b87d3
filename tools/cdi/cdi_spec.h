// A CDI (Container Device Interface) spec that injects gpuslice into a
// container: the environment (limits, policy, priority, region), the mounts
// (the library, the region directory, the slice's configuration file,
// optionally /etc/ld.so.preload). A DRA driver, a device plugin or an NRI
// plugin writes it to /etc/cdi or /var/run/cdi and names the device
// ("gpuslice.io/slice=<name>") in its response; the container runtime applies
// the edits. See docs/deploy.md.
//
// Spec version: the lowest the content needs, by the rules of the CDI
// library's MinimumRequiredVersion (container-device-interface
// pkg/cdi/version.go): 0.3.0 for a plain spec, 0.5.0 when the device name
// starts with something other than a letter, 0.6.0 with annotations or a '.'
// in the kind's class. Runtimes refuse a version newer than the CDI library
// they carry (Debian 12's podman 4.3 reads up to 0.5.0), and accept older ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace gpuslice::cdi {

inline constexpr char kDefaultKind[] = "gpuslice.io/slice";
// Where the library reads its configuration file when the environment says
// nothing (docs/deploy.md "Configuration file"); the spec mounts the slice's
// file there read-only.
inline constexpr char kConfigContainerFile[] = "/etc/gpuslice/gpuslice.conf";
// The agent's default --region-dir (tools/agent/agent.h kDefaultRegionDir):
// each slice's region directory is one directory of its own right below it.
inline constexpr char kDefaultAgentRegionDir[] = "/run/gpuslice/regions";
// The longest region file name and container name gpuslice-cdi writes.
inline constexpr std::size_t kMaxFileNameBytes = 255;      // NAME_MAX
inline constexpr std::size_t kMaxContainerNameBytes = 63;  // GPUSLICE_CONTAINER_NAME's bound

enum class Inject { preload_file, env };

struct SliceRequest {
  std::string kind = kDefaultKind;
  std::string device_name;      // CDI device name (e.g. the claim UID)
  std::string memory_limit;     // GPUSLICE_MEMORY_LIMIT syntax ("" = unlimited)
  std::string sm_limit;         // GPUSLICE_SM_LIMIT syntax ("" = unlimited)
  std::string sm_policy;        // hard | elastic ("" = the library's default)
  std::string priority;         // high | normal | low ("" = default)
  std::string container_name;   // GPUSLICE_CONTAINER_NAME ("" = none)
  std::string region_host_dir;  // host directory holding the region: <agent_region_dir>/<one name>
  std::string agent_region_dir = kDefaultAgentRegionDir;  // the agent's --region-dir on this node
  std::string region_container_dir = "/run/gpuslice";
  std::string region_file = "slice.region";
  std::string library_host = "/usr/local/gpuslice/lib/libgpuslice.so";
  std::string library_container = "/usr/local/gpuslice/lib/libgpuslice.so";
  Inject inject = Inject::preload_file;
  // A host file holding library_container's path (Inject::preload_file);
  // deploy/'s agent DaemonSet writes this one.
  std::string preload_host_file = "/usr/local/gpuslice/lib/ld.so.preload";
  // The slice's configuration file on the host ("" = none): the same
  // NAME=VALUE lines as the spec's environment, mounted read-only at
  // kConfigContainerFile, so that a process that clears its environment is
  // still limited. Outside the region directory (which the container can write).
  std::string config_host_file;
  std::map<std::string, std::string> annotations;
  // The driver's per-cgroup memory limit (R615+) for nodes where the agent
  // does not set it (docs/deploy.md, "Driver backstop"): the GPUs (UUIDs) the
  // container gets; empty = none. The spec then sets NVIDIA's container
  // toolkit's NVIDIA_GPU_MEMORY_LIMIT (the quota in MiB, rounded up) and
  // NVIDIA_GPU_MEMORY_REQUEST=0, and its createRuntime hook
  // `nvidia-cdi-hook apply-cuda-memory-limits --gpu-id <uuid>...`.
  std::vector<std::string> driver_limit_gpus;
  std::string cdi_hook = "/usr/bin/nvidia-cdi-hook";
};

// The default configuration file of a region directory: a hidden sibling,
// "<parent>/.<name>.conf" (the agent skips hidden files), never inside the
// directory the container may write.
std::string default_config_host_file(const std::string& region_host_dir);

// CDI's naming rules (container-device-interface pkg/parser): vendor and
// class start with a letter, end with a letter or digit, and hold letters,
// digits, '-', '_' and '.'; a device name starts and ends with a letter or
// digit and also allows ':'. false + a message naming the rule.
bool valid_kind(const std::string& kind, std::string* why);
bool valid_device_name(const std::string& name, std::string* why);

// An annotation key as the CDI library checks it (Kubernetes' annotation
// rules: an optional DNS-subdomain prefix of at most 253 characters and '/',
// then a name of 1-63 letters, digits, '-', '_', '.' that starts and ends
// with a letter or digit; checked in lower case).
bool valid_annotation_key(const std::string& key, std::string* why);

// Checks every field without touching the file system: names, annotations,
// limits (parsed by the library's own option parser, limiter/options/options.h, so
// that the spec never carries a value the library refuses), paths (absolute,
// normalised, and a region directory safe to bind read-write: a directory of
// its own right below the agent's region directory). Names (the region file,
// the container name, the region directory's own name) follow the one rule
// of tools/common/text.h (valid_name), and every value the spec sets reads
// back the same from the configuration file (no blank at either end).
// false + one message naming the option (--flag) and what was expected.
bool validate(const SliceRequest& req, std::string* why);

// What the host's file system must hold for the spec to work: the region
// directory exists, is a directory and no symbolic link leads to or inside
// it; the preload file (Inject::preload_file) names the library's container
// path; an existing configuration file there is this device's (never another
// slice's, whose limits it would replace). false + a message naming the flag.
bool check_host(const SliceRequest& req, std::string* why);

// The words of a preload file as ld.so reads them (separated by spaces, tabs,
// newlines or ':', '#' to the end of a line is a comment).
std::vector<std::string> preload_entries(const std::string& text);

// "0.3.0", "0.5.0" or "0.6.0": the lowest CDI spec version holding this spec.
std::string required_version(const SliceRequest& req);

// The quota in whole MiB (rounded up) that NVIDIA_GPU_MEMORY_LIMIT carries:
// one value for every GPU, as the toolkit's hook applies it. false + why when
// there is no quota or the per-device quotas differ.
bool driver_limit_mib(const SliceRequest& req, std::uint64_t* mib, std::string* why);

// The gpuslice environment the spec sets (NAME=VALUE), in order.
std::vector<std::string> slice_environment(const SliceRequest& req);

// The configuration file's text (the same values as slice_environment). Its
// first line, config_file_header, names the device: the file's owner.
std::string config_file_text(const SliceRequest& req);
std::string config_file_header(const SliceRequest& req);

// The spec (validate() first).
nlohmann::json build_spec(const SliceRequest& req);

// "gpuslice.io/slice=<name>": what a runtime, a DRA driver's CDI device IDs
// or an NRI plugin names.
std::string qualified_name(const SliceRequest& req);

}  // namespace gpuslice::cdi
