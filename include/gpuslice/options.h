// The option table (options.def) as constexpr data for tools: the parser
// (limiter/options.cc), `gpuslice-smi options` and the README table expand
// the same list.
#pragma once

#include <cstddef>

namespace gpuslice {

enum class OptionType { per_device_size, per_device_percent, policy, path, name, level, duration_ms };

struct OptionInfo {
  const char* id;             // C++ identifier, e.g. "memory_limit"
  const char* env;            // environment variable, e.g. "GPUSLICE_MEMORY_LIMIT"
  OptionType type;
  const char* type_name;      // "per_device_size"
  const char* default_value;  // as documented
  const char* range;          // accepted values and unit
  const char* doc;            // one line
};

inline constexpr OptionInfo kOptions[] = {
#define GPUSLICE_OPTION(id, env, type, def, range, doc) {#id, env, OptionType::type, #type, def, range, doc},
#include "gpuslice/options.def"
#undef GPUSLICE_OPTION
};
inline constexpr std::size_t kOptionCount = sizeof(kOptions) / sizeof(kOptions[0]);

// Variable names of the incumbents accepted as aliases (HAMi-core). Ours win;
// for one device a per-device alias beats the global alias.
struct OptionAlias {
  const char* env;     // "CUDA_DEVICE_MEMORY_LIMIT" (the per-device form appends "_<i>")
  const char* target;  // "GPUSLICE_MEMORY_LIMIT"
  bool per_device;     // also accepted with an "_<i>" suffix
  const char* doc;
};
inline constexpr OptionAlias kOptionAliases[] = {
    {"CUDA_DEVICE_MEMORY_LIMIT", "GPUSLICE_MEMORY_LIMIT", true,
     "bytes, or a k/m/g suffix (base 1024, either case); 0 = not set (HAMi-core semantics)"},
    {"CUDA_DEVICE_SM_LIMIT", "GPUSLICE_SM_LIMIT", true, "0-100; 0 = unlimited, as 100 (HAMi-core semantics)"},
};

}  // namespace gpuslice
