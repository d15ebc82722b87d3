#include "cdi_spec.h"

#include <cctype>

#include "limiter/options.h"

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

// The words of a choice, any case as the library accepts them.
bool one_of(const std::string& value, std::initializer_list<const char*> words) {
  for (const char* w : words) {
    std::string a = value, b = w;
    for (auto& c : a) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (a == b) return true;
  }
  return false;
}

// "8Gi" or "0=8Gi,1=4Gi" (GPUSLICE_MEMORY_LIMIT / GPUSLICE_SM_LIMIT syntax).
bool per_device_list(const std::string& text, bool size, std::string* bad) {
  std::size_t start = 0;
  const bool indexed = text.find('=') != std::string::npos;
  while (start <= text.size()) {
    const std::size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (indexed) {
      const std::size_t eq = item.find('=');
      if (eq == std::string::npos || eq == 0) {
        *bad = item;
        return false;
      }
      for (std::size_t i = 0; i < eq; ++i) {
        if (!std::isdigit(static_cast<unsigned char>(item[i]))) {
          *bad = item;
          return false;
        }
      }
      item = item.substr(eq + 1);
    } else if (comma != std::string::npos) {
      *bad = text;
      return false;
    }
    bool ok;
    if (size) {
      std::uint64_t v = 0;
      ok = limiter::parse_size(item.c_str(), &v) && v != 0;
    } else {
      std::uint32_t v = 0;
      ok = limiter::parse_percent(item.c_str(), &v);
    }
    if (!ok) {
      *bad = item;
      return false;
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return true;
}

bool absolute(const std::string& what, const std::string& path, std::string* why) {
  if (path.empty() || path[0] != '/') {
    *why = what + " '" + path + "': expected an absolute path";
    return false;
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

bool validate(const SliceRequest& r, std::string* why) {
  if (!valid_kind(r.kind, why) || !valid_device_name(r.device_name, why)) return false;
  std::string bad;
  if (!r.memory_limit.empty() && !per_device_list(r.memory_limit, true, &bad)) {
    *why = "memory limit '" + r.memory_limit + "': '" + bad +
           "' is not a size above 0 (e.g. 8Gi, 512Mi) or <device>=<size> list";
    return false;
  }
  if (!r.sm_limit.empty() && !per_device_list(r.sm_limit, false, &bad)) {
    *why = "SM limit '" + r.sm_limit + "': '" + bad + "' is not a percentage 1-100 or <device>=<percent> list";
    return false;
  }
  if (!r.sm_policy.empty() && !one_of(r.sm_policy, {"hard", "elastic"})) {
    *why = "SM policy '" + r.sm_policy + "': expected hard or elastic";
    return false;
  }
  if (!r.priority.empty() && !one_of(r.priority, {"high", "normal", "low"})) {
    *why = "priority '" + r.priority + "': expected high, normal or low";
    return false;
  }
  if (r.container_name.size() > 63) {
    *why = "container name '" + r.container_name + "': at most 63 characters";
    return false;
  }
  for (char c : r.container_name) {
    if (c < 0x20 || c >= 0x7f) {
      *why = "container name: printable ASCII only";
      return false;
    }
  }
  if (!absolute("region host directory", r.region_host_dir, why) ||
      !absolute("region container directory", r.region_container_dir, why) ||
      !absolute("library host path", r.library_host, why) ||
      !absolute("library container path", r.library_container, why)) {
    return false;
  }
  if (r.region_file.empty() || r.region_file.find('/') != std::string::npos || r.region_file[0] == '.') {
    *why = "region file '" + r.region_file + "': expected a plain file name, not hidden";
    return false;
  }
  if (r.inject == Inject::preload_file && !absolute("ld.so.preload host file", r.preload_host_file, why)) return false;
  return true;
}

std::string qualified_name(const SliceRequest& r) { return r.kind + "=" + r.device_name; }

nlohmann::json build_spec(const SliceRequest& r) {
  using nlohmann::json;
  std::vector<std::string> env;
  if (!r.memory_limit.empty()) env.push_back("GPUSLICE_MEMORY_LIMIT=" + r.memory_limit);
  if (!r.sm_limit.empty()) env.push_back("GPUSLICE_SM_LIMIT=" + r.sm_limit);
  if (!r.sm_policy.empty()) env.push_back("GPUSLICE_SM_POLICY=" + r.sm_policy);
  if (!r.priority.empty()) env.push_back("GPUSLICE_PRIORITY=" + r.priority);
  env.push_back("GPUSLICE_REGION=" + r.region_container_dir + "/" + r.region_file);
  if (!r.container_name.empty()) env.push_back("GPUSLICE_CONTAINER_NAME=" + r.container_name);
  if (r.inject == Inject::env) env.push_back("LD_PRELOAD=" + r.library_container);

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
  json device = {{"name", r.device_name}, {"containerEdits", {{"env", env}, {"mounts", mounts}}}};
  json spec = {{"cdiVersion", kCdiVersion}, {"kind", r.kind}, {"devices", json::array({device})}};
  if (!r.annotations.empty()) spec["annotations"] = r.annotations;
  return spec;
}

}  // namespace gpuslice::cdi
