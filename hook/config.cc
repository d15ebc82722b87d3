// Configuration of the preload library: the options, parsed once from environ
// and the configuration file, and the modes derived from them.
#include "hook/config.h"

#include <sched.h>

#include "hook/log.h"
#include "limiter/options/file.h"

extern char** environ;

namespace gpuslice::hook {

std::atomic<int> g_oversub_state{0};

namespace {

Config g_config;
// The configuration file's text while config() parses it (static: no heap, 64 KiB).
options::ConfigFileBuffer g_config_file;
std::atomic<int> g_config_state{0};  // 0 unparsed, 1 parsing, 2 parsed

}  // namespace

const Config& config() noexcept {
  if (g_config_state.load(std::memory_order_acquire) == 2) return g_config;
  int expected = 0;
  if (g_config_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    g_config.valid =
        options::load_options(environ, options::kDefaultConfigFile, &g_config_file, &g_config.options, &g_config.error);
    if (g_config.valid) g_log_level.store(g_config.options.log_level, std::memory_order_relaxed);
    g_config_state.store(2, std::memory_order_release);
  } else {
    while (g_config_state.load(std::memory_order_acquire) != 2) sched_yield();
  }
  return g_config;
}

bool oversub_init() noexcept {
  const options::Options& o = config().options;
  bool on = o.oversubscribe != options::kOversubscribeFail;
  for (std::uint32_t d = 0; d < kMaxDevices && !on; ++d) on = o.memory_resident[d] != kUnlimited;
  g_oversub_state.store(on ? 2 : 1, std::memory_order_relaxed);
  return on;
}

}  // namespace gpuslice::hook
