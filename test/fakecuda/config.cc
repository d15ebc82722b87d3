// FAKECUDA_* environment parsing: strict, one line per error naming the variable.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "state.h"

namespace gpuslice::fakecuda {

bool parse_size(const char* text, std::uint64_t& out) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0) return false;
  struct Suffix {
    const char* name;
    std::uint64_t scale;
  };
  static constexpr Suffix kSuffixes[] = {
      {"", 1},
      {"B", 1},
      {"K", 1000ull},
      {"M", 1000ull * 1000},
      {"G", 1000ull * 1000 * 1000},
      {"T", 1000ull * 1000 * 1000 * 1000},
      {"Ki", 1ull << 10},
      {"Mi", 1ull << 20},
      {"Gi", 1ull << 30},
      {"Ti", 1ull << 40},
  };
  for (const Suffix& suffix : kSuffixes) {
    if (std::strcmp(end, suffix.name) == 0) {
      if (value > ~std::uint64_t{0} / suffix.scale) return false;
      out = value * suffix.scale;
      return true;
    }
  }
  return false;
}

void state_path_from_env(char* out, std::size_t len) {
  const char* path = std::getenv("FAKECUDA_STATE");
  if (path != nullptr && *path != '\0') {
    std::snprintf(out, len, "%s", path);
  } else {
    std::snprintf(out, len, "/dev/shm/fakecuda-%u.state", static_cast<unsigned>(getuid()));
  }
}

namespace {

bool parse_uint(const char* text, std::uint64_t lo, std::uint64_t hi, std::uint64_t& out) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < lo || value > hi) return false;
  out = value;
  return true;
}

// One timing knob: FAKECUDA_<name>, an integer in [lo, hi] times `scale`.
bool parse_knob(const char* name, std::uint64_t lo, std::uint64_t hi, std::uint64_t scale, const char* unit,
                std::uint64_t& out, char* error, std::size_t error_len) {
  const char* value = std::getenv(name);
  if (value == nullptr) return true;
  std::uint64_t number = 0;
  if (!parse_uint(value, lo, hi, number)) {
    std::snprintf(error, error_len, "%s='%s': expected an integer %llu-%llu (%s)", name, value,
                  static_cast<unsigned long long>(lo), static_cast<unsigned long long>(hi), unit);
    return false;
  }
  out = number * scale;
  return true;
}

// FAKECUDA_PROFILE picks every timing knob's default (README "Profiles"); each
// knob's own variable overrides it.
bool parse_timing(Config& config, char* error, std::size_t error_len) {
  const char* value = std::getenv("FAKECUDA_PROFILE");
  if (value != nullptr && std::strcmp(value, "ideal") != 0) {
    if (std::strcmp(value, "realistic") != 0) {
      std::snprintf(error, error_len, "FAKECUDA_PROFILE='%s': expected ideal or realistic", value);
      return false;
    }
    config.profile = Profile::realistic;
    config.jitter_pct = 10;
    config.nvml_period_ns = 166ull * 1000 * 1000;
    config.timeslice_ns = 2ull * 1000 * 1000;
    config.launch_cost_ns = 3ull * 1000;
    config.queue_depth = 1024;
    config.context_bytes = std::uint64_t{512} << 20;
    config.module_memory = 1;
  }
  std::uint64_t number = config.jitter_pct;
  if (!parse_knob("FAKECUDA_JITTER_PCT", 0, 50, 1, "percent", number, error, error_len)) return false;
  config.jitter_pct = static_cast<std::uint32_t>(number);
  number = config.module_memory;
  if (!parse_knob("FAKECUDA_MODULE_MEMORY", 0, 1, 1, "1 = modules hold device memory, 0 = none", number, error,
                  error_len)) {
    return false;
  }
  config.module_memory = static_cast<std::uint32_t>(number);
  if (!parse_knob("FAKECUDA_SEED", 0, ~std::uint64_t{0}, 1, "any 64-bit seed", config.seed, error, error_len) ||
      !parse_knob("FAKECUDA_NVML_PERIOD_MS", 0, 10000, 1000000, "milliseconds, 0 = exact windows",
                  config.nvml_period_ns, error, error_len) ||
      !parse_knob("FAKECUDA_LAUNCH_COST_US", 0, 1000, 1000, "microseconds", config.launch_cost_ns, error, error_len)) {
    return false;
  }
  // Time-slicing and the hardware queue are the realistic scheduler's.
  const char* scheduler_only[] = {"FAKECUDA_TIMESLICE_US", "FAKECUDA_QUEUE_DEPTH"};
  for (const char* name : scheduler_only) {
    if (config.profile == Profile::ideal && std::getenv(name) != nullptr) {
      std::snprintf(error, error_len, "%s='%s': expected only with FAKECUDA_PROFILE=realistic", name,
                    std::getenv(name));
      return false;
    }
  }
  return parse_knob("FAKECUDA_TIMESLICE_US", 1, 1000000, 1000, "microseconds", config.timeslice_ns, error, error_len) &&
         parse_knob("FAKECUDA_QUEUE_DEPTH", 1, 4096, 1, "pending launches per stream", config.queue_depth, error,
                    error_len);
}

}  // namespace

namespace {

// One CUDA_VISIBLE_DEVICES entry ([begin, end)): the physical index it names,
// or -1 when it is invalid. Documented forms: an integer index; a GPU UUID as
// nvidia-smi prints it, or a prefix of it ("GPU-8932f937") naming exactly one
// GPU; a MIG UUID ("MIG-...": the simulator has no MIG instance, so none
// matches). Anything else the documentation does not describe is invalid.
int visible_entry(const char* begin, const char* end, const StateHeader& header, std::uint32_t devices) {
  const std::size_t len = static_cast<std::size_t>(end - begin);
  if (len == 0) return -1;
  bool digits = true;
  for (const char* p = begin; p < end; ++p) digits = digits && *p >= '0' && *p <= '9';
  if (digits) {
    if (len > 4) return -1;
    unsigned index = 0;
    for (const char* p = begin; p < end; ++p) index = index * 10 + static_cast<unsigned>(*p - '0');
    return index < devices ? static_cast<int>(index) : -1;
  }
  if (len < 5 || std::strncmp(begin, "GPU-", 4) != 0) return -1;
  int found = -1;
  for (std::uint32_t d = 0; d < devices; ++d) {
    char uuid[48];
    device_uuid_string(header, d, uuid, sizeof uuid);
    if (len <= std::strlen(uuid) && std::strncmp(uuid, begin, len) == 0) {
      if (found >= 0) return -1;  // a prefix must name one GPU
      found = static_cast<int>(d);
    }
  }
  return found;
}

}  // namespace

std::uint32_t parse_visible_devices(const char* text, const StateHeader& header, std::uint32_t devices,
                                    std::uint32_t out[]) {
  if (text == nullptr) {
    for (std::uint32_t d = 0; d < devices; ++d) out[d] = d;
    return devices;
  }
  // Entries in order until the first invalid one: the devices after it are
  // not visible. A device named twice: the documentation is silent, and the
  // simulator stops there (refuses rather than invents).
  std::uint32_t count = 0;
  const char* p = text;
  while (*p != '\0' && count < devices) {
    const char* end = std::strchr(p, ',');
    if (end == nullptr) end = p + std::strlen(p);
    const int physical = visible_entry(p, end, header, devices);
    if (physical < 0) break;
    bool repeated = false;
    for (std::uint32_t i = 0; i < count; ++i) repeated = repeated || out[i] == static_cast<std::uint32_t>(physical);
    if (repeated) break;
    out[count++] = static_cast<std::uint32_t>(physical);
    if (*end == '\0') break;
    p = end + 1;
  }
  return count;
}

// "615.20" or "580.65.06": a three-digit branch, then one or two numbers.
static bool parse_driver_version(const char* text, Config& config) {
  const std::size_t len = std::strlen(text);
  if (len >= sizeof(config.driver_version)) return false;
  int parts = 0;
  std::size_t digits = 0;
  for (std::size_t i = 0; i <= len; ++i) {
    if (i == len || text[i] == '.') {
      if (digits == 0 || digits > (parts == 0 ? 3 : 4)) return false;
      if (parts == 0 && digits != 3) return false;
      ++parts;
      digits = 0;
    } else if (text[i] >= '0' && text[i] <= '9') {
      ++digits;
    } else {
      return false;
    }
  }
  if (parts < 2 || parts > 3 || text[0] == '0') return false;
  std::memcpy(config.driver_version, text, len + 1);
  config.driver_branch = static_cast<std::uint32_t>(std::strtoul(text, nullptr, 10));
  return true;
}

bool parse_config(Config& config, char* error, std::size_t error_len) {
  config = Config{};
  const char* value = nullptr;
  std::uint64_t number = 0;
  if (!parse_timing(config, error, error_len)) return false;
  if ((value = std::getenv("FAKECUDA_DEVICES")) != nullptr) {
    if (!parse_uint(value, 0, kMaxDevices, number)) {
      std::snprintf(error, error_len, "FAKECUDA_DEVICES='%s': expected an integer 0-%u", value, kMaxDevices);
      return false;
    }
    config.devices = static_cast<std::uint32_t>(number);
  }
  if ((value = std::getenv("FAKECUDA_MEMORY")) != nullptr) {
    // At most 1 PiB so that address ranges and sums never overflow.
    if (!parse_size(value, number) || number == 0 || number > (std::uint64_t{1} << 50)) {
      std::snprintf(error, error_len,
                    "FAKECUDA_MEMORY='%s': expected bytes 1..1Pi with optional suffix B, K/M/G/T (base 1000) "
                    "or Ki/Mi/Gi/Ti (base 1024)",
                    value);
      return false;
    }
    config.memory_bytes = number;
  }
  if ((value = std::getenv("FAKECUDA_SMS")) != nullptr) {
    if (!parse_uint(value, 1, 4096, number)) {
      std::snprintf(error, error_len, "FAKECUDA_SMS='%s': expected an integer 1-4096", value);
      return false;
    }
    config.sms = static_cast<std::uint32_t>(number);
  }
  if ((value = std::getenv("FAKECUDA_INTEGRATED")) != nullptr) {
    if (!parse_uint(value, 0, 1, number)) {
      std::snprintf(error, error_len, "FAKECUDA_INTEGRATED='%s': expected 0 or 1", value);
      return false;
    }
    config.integrated = static_cast<std::uint32_t>(number);
  }
  if ((value = std::getenv("FAKECUDA_CONTEXT_MEMORY")) != nullptr) {
    if (!parse_size(value, number) || number > config.memory_bytes) {
      std::snprintf(error, error_len,
                    "FAKECUDA_CONTEXT_MEMORY='%s': expected bytes (suffix B, K/M/G/T or Ki/Mi/Gi/Ti) "
                    "not above FAKECUDA_MEMORY",
                    value);
      return false;
    }
    config.context_bytes = number;
  }
  if ((value = std::getenv("FAKECUDA_DRIVER_VERSION")) != nullptr && !parse_driver_version(value, config)) {
    std::snprintf(error, error_len,
                  "FAKECUDA_DRIVER_VERSION='%s': expected a driver version as nvidia-smi prints it "
                  "(branch 100-999, then one or two .number parts: 615.20 or 580.65.06)",
                  value);
    return false;
  }
  value = std::getenv("FAKECUDA_STATE");
  if (value != nullptr && (*value == '\0' || std::strlen(value) >= sizeof(config.state_path) - 32)) {
    std::snprintf(error, error_len, "FAKECUDA_STATE='%s': expected a file path shorter than %zu bytes", value,
                  sizeof(config.state_path) - 32);
    return false;
  }
  state_path_from_env(config.state_path, sizeof(config.state_path));
  return true;
}

}  // namespace gpuslice::fakecuda
