// The option table (options.def) as constexpr data for tools: the parser
// (limiter/options.cc), `gpuslice-smi options` and the README table expand
// the same list.
#pragma once

#include <cstddef>

namespace gpuslice {

enum class OptionType { per_device_size, per_device_percent, policy, level, choice, flag, duration_ms, path, name };

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

// Variable names of the incumbents accepted as aliases (HAMi-core), so that
// gpuslice drops into existing deployments. Ours win; for one device a
// per-device alias beats the global alias.
struct OptionAlias {
  const char* env;     // "CUDA_DEVICE_MEMORY_LIMIT" (the per-device form appends "_<i>")
  const char* target;  // "GPUSLICE_MEMORY_LIMIT"
  bool per_device;     // also accepted with an "_<i>" suffix; parsed with HAMi-core's grammar for the target's type
  // Scalar aliases: "value=word,..." (values compared in any case; an empty
  // word means "not set"), or nullptr: the value is given to the target's parser.
  const char* map;
  const char* doc;
};
inline constexpr OptionAlias kOptionAliases[] = {
    {"CUDA_DEVICE_MEMORY_LIMIT", "GPUSLICE_MEMORY_LIMIT", true, nullptr,
     "bytes, or a k/m/g suffix (base 1024, either case); 0 = not set (HAMi-core semantics)"},
    {"CUDA_DEVICE_SM_LIMIT", "GPUSLICE_SM_LIMIT", true, nullptr, "0-100; 0 = unlimited, as 100 (HAMi-core semantics)"},
    {"GPU_CORE_UTILIZATION_POLICY", "GPUSLICE_SM_POLICY", false, "default=elastic,force=hard,disable=",
     "default = elastic (HAMi does not limit a container alone on its GPU), force = hard, disable = no SM limit "
     "from the CUDA_DEVICE_SM_LIMIT aliases"},
    {"CUDA_TASK_PRIORITY", "GPUSLICE_PRIORITY", false, "0=high,1=low", "0 = high, 1 = low (HAMi semantics)"},
    {"CUDA_OVERSUBSCRIBE", "GPUSLICE_OVERSUBSCRIBE", false, "true=spill,false=", "true = spill, false = not set"},
    {"CUDA_DISABLE_CONTROL", "GPUSLICE_PASSTHROUGH", false, "true=true,false=false", "true | false"},
    {"CUDA_DEVICE_MEMORY_SHARED_CACHE", "GPUSLICE_REGION", false, nullptr,
     "absolute file path (HAMi's per-container cache file; the region format stays gpuslice's)"},
    {"LIBCUDA_LOG_LEVEL", "GPUSLICE_LOG_LEVEL", false, "0=error,1=warn,2=info,3=debug,4=debug",
     "0 = error, 1 = warn, 2 = info, 3-4 = debug (HAMi-core levels)"},
};
inline constexpr std::size_t kOptionAliasCount = sizeof(kOptionAliases) / sizeof(kOptionAliases[0]);

}  // namespace gpuslice
