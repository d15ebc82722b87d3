// The option table (options.def) as constexpr data for tools: the parser
// (limiter/options/options.cc, limiter/options/values.cc), `gpuslice-smi
// options` and the README table expand the same list.
#pragma once

#include <cstddef>

namespace gpuslice {

enum class OptionType { per_device_size, per_device_percent, policy, level, choice, flag, duration_ms, path, name };

struct OptionInfo {
  const char* id;   // C++ identifier, e.g. "memory_limit"
  const char* env;  // environment variable, e.g. "GPUSLICE_MEMORY_LIMIT"
  OptionType type;
  const char* type_name;      // "per_device_size"
  const char* default_value;  // as documented
  const char* range;          // accepted values and unit
  const char* doc;            // one line
};

inline constexpr OptionInfo kOptions[] = {
// A choice's words come in as its range text ("a | b (any case)"); their enum
// values are the parser's (limiter/options/options.h).
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
  // Scalar aliases: "key=word,..." (an empty word means "not set"), or nullptr:
  // the value is given to the target's parser. The first key that matches
  // wins: a word (any case; a number also matches its other decimal
  // spellings, "02" = 2), `N+` any integer >= N, `-` any negative integer,
  // `*` anything else (taken with a warning). No key: an error (fail closed).
  // limiter/options/env.h match_alias.
  const char* map;
  const char* doc;
};
inline constexpr OptionAlias kOptionAliases[] = {
    {"CUDA_DEVICE_MEMORY_LIMIT", "GPUSLICE_MEMORY_LIMIT", true, nullptr,
     "bytes, or a k/m/g suffix (base 1024, either case); 0 = not set (HAMi-core semantics)"},
    {"CUDA_DEVICE_SM_LIMIT", "GPUSLICE_SM_LIMIT", true, nullptr, "0-100; 0 = unlimited, as 100 (HAMi-core semantics)"},
    {"GPU_CORE_UTILIZATION_POLICY", "GPUSLICE_SM_POLICY", false, "default=elastic,force=hard,disable=,*=elastic",
     "default = elastic (HAMi does not limit a container alone on its GPU), force = hard, disable = no SM limit "
     "from the CUDA_DEVICE_SM_LIMIT aliases (any case); any other value, empty included, is HAMi-core's default "
     "policy: elastic, with a warning"},
    {"CUDA_TASK_PRIORITY", "GPUSLICE_PRIORITY", false, "0=high,1+=low,*=",
     "an integer, as HAMi-core reads it (atoi; a lower number goes first): 0 = high, 1 (HAMi's default) and above "
     "= low; anything else (negative, not a number) = not set, with a warning"},
    {"CUDA_OVERSUBSCRIBE", "GPUSLICE_OVERSUBSCRIBE", false, "true=spill,false=", "true = spill, false = not set"},
    {"CUDA_DISABLE_CONTROL", "GPUSLICE_PASSTHROUGH", false, "1=true,t=true,true=true,0=false,f=false,false=false",
     "Go's strconv.ParseBool spellings, as HAMi's device plugin reads it (any case here): 1, t, true = true; "
     "0, f, false = false; anything else fails closed"},
    {"CUDA_DEVICE_MEMORY_SHARED_CACHE", "GPUSLICE_REGION", false, nullptr,
     "absolute file path (HAMi's per-container cache file; the region format stays gpuslice's)"},
    {"LIBCUDA_LOG_LEVEL", "GPUSLICE_LOG_LEVEL", false, "0=error,1=error,2=warn,3=info,4+=debug,-=error,*=",
     "an integer, as HAMi-core reads it (atoi): 0, 1 or negative = error, 2 = warn, 3 = info, 4 and above = "
     "debug; anything else = not set (warn), with a warning"},
};
inline constexpr std::size_t kOptionAliasCount = sizeof(kOptionAliases) / sizeof(kOptionAliases[0]);

}  // namespace gpuslice
