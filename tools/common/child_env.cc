// Clean child environments. See child_env.h.
#include "child_env.h"

extern char** environ;

namespace gpuslice::tools {
namespace {

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

}  // namespace

bool inherited(const std::string& name, const ChildEnvRules& rules) {
  if (name == "LD_PRELOAD" || name == "FAKECUDA_STATE") return false;
  if (name == "LD_LIBRARY_PATH") return rules.keep_library_path;
  if (starts_with(name, "GPUSLICE_")) return rules.keep_log_level && name == "GPUSLICE_LOG_LEVEL";
  if (starts_with(name, "CUDA_DEVICE_")) return false;
  if (starts_with(name, "FAKECUDA_")) return rules.keep_fakecuda_profile;
  return true;
}

std::vector<std::string> child_environment(const std::map<std::string, std::string>& set, const ChildEnvRules& rules) {
  std::map<std::string, std::string> all;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const auto eq = entry.find('=');
    if (eq == std::string::npos) continue;
    std::string name = entry.substr(0, eq);
    if (inherited(name, rules)) all[std::move(name)] = entry.substr(eq + 1);
  }
  for (const auto& [name, value] : set) {
    if (value.empty()) {
      all.erase(name);
    } else {
      all[name] = value;
    }
  }
  std::vector<std::string> out;
  out.reserve(all.size());
  for (const auto& [name, value] : all) out.push_back(name + "=" + value);
  return out;
}

std::vector<char*> envp_of(std::vector<std::string>& entries) {
  std::vector<char*> envp;
  envp.reserve(entries.size() + 1);
  for (std::string& e : entries) envp.push_back(e.data());
  envp.push_back(nullptr);
  return envp;
}

}  // namespace gpuslice::tools
