// Building the spec: names, version, environment, mounts, configuration file.
// Validation is in cdi_validate.cc.
#include "cdi_spec.h"

#include <cctype>

using namespace std::string_literals;

namespace gpuslice::cdi {
namespace {

bool is_alnum(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }
bool is_alpha(char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0; }

bool valid_vendor_or_class(const std::string& what, const std::string& s, std::string* why) {
  if (s.empty()) {
    *why = what + " is empty";
    return false;
  }
  if (!is_alpha(s.front())) {
    *why = what + " '" + s + "' must start with a letter";
    return false;
  }
  if (!is_alnum(s.back())) {
    *why = what + " '" + s + "' must end with a letter or digit";
    return false;
  }
  for (char c : s) {
    if (!is_alnum(c) && c != '-' && c != '_' && c != '.') {
      *why = what + " '" + s + "' may hold only letters, digits, '-', '_' and '.'";
      return false;
    }
  }
  return true;
}

}  // namespace

bool valid_kind(const std::string& kind, std::string* why) {
  const std::size_t slash = kind.find('/');
  if (slash == std::string::npos || kind.find('/', slash + 1) != std::string::npos) {
    *why = "kind '" + kind + "' must be <vendor>/<class> (e.g. gpuslice.io/slice)";
    return false;
  }
  return valid_vendor_or_class("the kind's vendor", kind.substr(0, slash), why) &&
         valid_vendor_or_class("the kind's class", kind.substr(slash + 1), why);
}

bool valid_device_name(const std::string& name, std::string* why) {
  if (name.empty()) {
    *why = "the device name is empty";
    return false;
  }
  if (!is_alnum(name.front()) || !is_alnum(name.back())) {
    *why = "device name '" + name + "' must start and end with a letter or digit";
    return false;
  }
  for (char c : name) {
    if (!is_alnum(c) && c != '-' && c != '_' && c != '.' && c != ':') {
      *why = "device name '" + name + "' may hold only letters, digits, '-', '_', '.' and ':'";
      return false;
    }
  }
  return true;
}

std::string default_config_host_file(const std::string& region_host_dir) {
  const std::size_t slash = region_host_dir.find_last_of('/');
  if (slash == std::string::npos || slash + 1 >= region_host_dir.size()) return "";
  return region_host_dir.substr(0, slash + 1) + "." + region_host_dir.substr(slash + 1) + ".conf";
}

std::string required_version(const SliceRequest& r) {
  // container-device-interface pkg/cdi/version.go, requiresV060/V050/V040:
  // spec or device annotations, or a '.' in the class, need 0.6.0; a device
  // name that does not start with a letter needs 0.5.0 (as do device nodes
  // with a hostPath, which we never write); a mount "type" needs 0.4.0 (we
  // write none); anything else is valid from the earliest version, 0.3.0.
  const std::size_t slash = r.kind.find('/');
  const std::string cls = slash == std::string::npos ? "" : r.kind.substr(slash + 1);
  if (!r.annotations.empty() || cls.find('.') != std::string::npos) return "0.6.0";
  if (!r.device_name.empty() && !is_alpha(r.device_name.front())) return "0.5.0";
  return "0.3.0";
}

std::string qualified_name(const SliceRequest& r) { return r.kind + "=" + r.device_name; }

std::vector<std::string> slice_environment(const SliceRequest& r) {
  std::vector<std::string> env;
  if (!r.memory_limit.empty()) env.push_back("GPUSLICE_MEMORY_LIMIT=" + r.memory_limit);
  if (!r.sm_limit.empty()) env.push_back("GPUSLICE_SM_LIMIT=" + r.sm_limit);
  if (!r.sm_policy.empty()) env.push_back("GPUSLICE_SM_POLICY=" + r.sm_policy);
  if (!r.priority.empty()) env.push_back("GPUSLICE_PRIORITY=" + r.priority);
  env.push_back("GPUSLICE_REGION=" + r.region_container_dir + "/" + r.region_file);
  if (!r.container_name.empty()) env.push_back("GPUSLICE_CONTAINER_NAME=" + r.container_name);
  return env;
}

std::string config_file_header(const SliceRequest& r) {
  return "# gpuslice configuration of CDI device " + qualified_name(r) + ", written by gpuslice-cdi.\n";
}

std::string config_file_text(const SliceRequest& r) {
  std::string text =
      config_file_header(r) + "# libgpuslice.so reads an option here when the environment does not set it.\n";
  for (const std::string& line : slice_environment(r)) text += line + "\n";
  return text;
}

nlohmann::json build_spec(const SliceRequest& r) {
  using nlohmann::json;
  std::vector<std::string> env = slice_environment(r);
  if (r.inject == Inject::env) env.push_back("LD_PRELOAD=" + r.library_container);
  json hooks = json::array();
  std::uint64_t mib = 0;
  std::string why;
  if (!r.driver_limit_gpus.empty() && driver_limit_mib(r, &mib, &why)) {
    // NVIDIA's container toolkit (1.20.1+): the hook reads these from the OCI
    // spec, in MiB: REQUEST is the soft limit (0: gpuslice promises no
    // memory; docs/agent.md, "Driver backstop"), LIMIT the hard one, applied
    // to the container's cgroup on each --gpu-id.
    env.push_back("NVIDIA_GPU_MEMORY_LIMIT=" + std::to_string(mib));
    env.push_back("NVIDIA_GPU_MEMORY_REQUEST=0");
    json args = {"nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root", "/"};
    for (const std::string& uuid : r.driver_limit_gpus) {
      args.push_back("--gpu-id");
      args.push_back(uuid);
    }
    hooks.push_back({{"hookName", "createRuntime"}, {"path", r.cdi_hook}, {"args", args}});
  }

  // OCI bind mounts: "bind" makes runc/crun bind instead of mounting a file
  // system; nosuid/nodev because nothing here needs either.
  json mounts = json::array();
  mounts.push_back({{"hostPath", r.library_host},
                    {"containerPath", r.library_container},
                    {"options", {"ro", "nosuid", "nodev", "bind"}}});
  mounts.push_back({{"hostPath", r.region_host_dir},
                    {"containerPath", r.region_container_dir},
                    {"options", {"rw", "nosuid", "nodev", "bind"}}});
  if (r.inject == Inject::preload_file) {
    mounts.push_back({{"hostPath", r.preload_host_file},
                      {"containerPath", "/etc/ld.so.preload"},
                      {"options", {"ro", "nosuid", "nodev", "bind"}}});
  }
  if (!r.config_host_file.empty()) {
    mounts.push_back({{"hostPath", r.config_host_file},
                      {"containerPath", kConfigContainerFile},
                      {"options", {"ro", "nosuid", "nodev", "bind"}}});
  }
  json edits = {{"env", env}, {"mounts", mounts}};
  if (!hooks.empty()) edits["hooks"] = hooks;
  json device = {{"name", r.device_name}, {"containerEdits", edits}};
  json spec = {{"cdiVersion", required_version(r)}, {"kind", r.kind}, {"devices", json::array({device})}};
  if (!r.annotations.empty()) spec["annotations"] = r.annotations;
  return spec;
}

}  // namespace gpuslice::cdi
