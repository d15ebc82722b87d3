#include "nvml.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>

#include "gpuslice/nvml_abi.h"
#include "limiter/compute_samples.h"
#include "log.h"
#include "platform/clock.h"
#include "region_io.h"

using namespace std::string_literals;

namespace gpuslice::agent {

struct Nvml::Api {
  decltype(&::nvmlInit_v2) init = nullptr;
  decltype(&::nvmlShutdown) shutdown = nullptr;
  decltype(&::nvmlErrorString) error_string = nullptr;
  decltype(&::nvmlDeviceGetCount_v2) get_count = nullptr;
  decltype(&::nvmlDeviceGetHandleByIndex_v2) get_handle = nullptr;
  decltype(&::nvmlDeviceGetUUID) get_uuid = nullptr;
  decltype(&::nvmlDeviceGetComputeRunningProcesses_v3) processes = nullptr;
  decltype(&::nvmlDeviceGetComputeRunningProcesses_v3) graphics_processes = nullptr;  // same ABI, graphics list
  decltype(&::nvmlDeviceGetProcessUtilization) process_util = nullptr;
  decltype(&::nvmlDeviceGetUtilizationRates) util_rates = nullptr;
  decltype(&::nvmlDeviceSetMemoryLimits_v1) set_limits = nullptr;  // R615+ (backstop.h)
  decltype(&::nvmlDeviceGetMemoryLimits_v1) get_limits = nullptr;
  decltype(&::nvmlSystemGetDriverVersion) driver_version = nullptr;

  std::string error(nvmlReturn_t rc) const {
    const char* text = error_string != nullptr ? error_string(rc) : nullptr;
    return (text != nullptr ? std::string(text) : "NVML error"s) + " (" + std::to_string(rc) + ")";
  }
};

struct Nvml::Device {
  nvmlDevice_t handle = nullptr;
  std::uint8_t uuid[16] = {};
  std::string uuid_text;
  limiter::SampleClock util_clock;  // windows measured so far (last_seen_us 0: no baseline yet)
  std::vector<nvmlProcessInfo_t> process_buf;
  std::vector<nvmlProcessInfo_t> graphics_buf;
  std::vector<nvmlProcessUtilizationSample_t> util_buf;
  bool util_unsupported = false;
  bool util_known_once = false;            // a window was measured: device_util_permille holds its share
  std::uint32_t device_util_permille = 0;  // the latest window's (kept between windows, for the metrics)
  bool rates_unsupported = false;
};

namespace {

template <class F>
bool resolve(void* handle, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  return *out != nullptr;
}

}  // namespace

Nvml::~Nvml() {
  for (Device* d : devices_) delete d;
  if (api_ != nullptr && api_->shutdown != nullptr) api_->shutdown();
  delete api_;
  // Never dlclose()d: NVML keeps process-wide state (and threads, on real
  // drivers) that does not expect to be unmapped; it stays loaded for the
  // process's life, as in nvidia-smi.
}

bool Nvml::open(const std::string& library, std::string* why) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    *why = "cannot load "s + library + ": " + (err != nullptr ? err : "dlopen failed");
    return false;
  }
  auto* api = new Api;
  const bool ok = resolve(handle, "nvmlInit_v2", &api->init) && resolve(handle, "nvmlShutdown", &api->shutdown) &&
                  resolve(handle, "nvmlDeviceGetCount_v2", &api->get_count) &&
                  resolve(handle, "nvmlDeviceGetHandleByIndex_v2", &api->get_handle) &&
                  resolve(handle, "nvmlDeviceGetUUID", &api->get_uuid);
  resolve(handle, "nvmlErrorString", &api->error_string);
  resolve(handle, "nvmlDeviceGetComputeRunningProcesses_v3", &api->processes);
  resolve(handle, "nvmlDeviceGetGraphicsRunningProcesses_v3", &api->graphics_processes);
  resolve(handle, "nvmlDeviceGetProcessUtilization", &api->process_util);
  resolve(handle, "nvmlDeviceGetUtilizationRates", &api->util_rates);
  resolve(handle, "nvmlDeviceSetMemoryLimits_v1", &api->set_limits);
  resolve(handle, "nvmlDeviceGetMemoryLimits_v1", &api->get_limits);
  resolve(handle, "nvmlSystemGetDriverVersion", &api->driver_version);
  if (!ok) {
    *why = library + " lacks nvmlInit_v2/nvmlDeviceGetCount_v2/nvmlDeviceGetHandleByIndex_v2/nvmlDeviceGetUUID";
    delete api;
    dlclose(handle);
    return false;
  }
  const nvmlReturn_t rc = api->init();
  if (rc != NVML_SUCCESS) {
    *why = "nvmlInit_v2: "s + api->error(rc);
    delete api;
    dlclose(handle);
    return false;
  }
  handle_ = handle;
  api_ = api;
  if (!enumerate(why)) {
    api_->shutdown();
    delete api_;
    api_ = nullptr;
    dlclose(handle_);
    handle_ = nullptr;
    return false;
  }
  if (api_->processes == nullptr)
    log(LogLevel::warn, "%s lacks nvmlDeviceGetComputeRunningProcesses_v3: no memory reconciliation", library.c_str());
  if (api_->process_util == nullptr)
    log(LogLevel::warn, "%s lacks nvmlDeviceGetProcessUtilization: no utilisation feedback", library.c_str());
  return true;
}

bool Nvml::enumerate(std::string* why) {
  unsigned int count = 0;
  nvmlReturn_t rc = api_->get_count(&count);
  if (rc != NVML_SUCCESS) {
    *why = "nvmlDeviceGetCount_v2: "s + api_->error(rc);
    return false;
  }
  for (unsigned int i = 0; i < count; ++i) {
    auto* dev = new Device;
    char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
    rc = api_->get_handle(i, &dev->handle);
    if (rc == NVML_SUCCESS) rc = api_->get_uuid(dev->handle, text, sizeof text);
    text[sizeof text - 1] = '\0';
    if (rc != NVML_SUCCESS || !parse_uuid(text, dev->uuid)) {
      log(LogLevel::warn, "NVML device %u: %s; skipped", i,
          rc != NVML_SUCCESS ? api_->error(rc).c_str() : "unparsable UUID");
      delete dev;
      continue;
    }
    dev->uuid_text = format_uuid(dev->uuid);
    devices_.push_back(dev);
  }
  return true;
}

int Nvml::set_memory_limit(std::size_t index, const std::string& cgroup_dir, std::uint64_t soft, std::uint64_t hard) {
  if (api_ == nullptr || api_->set_limits == nullptr) return NVML_ERROR_FUNCTION_NOT_FOUND;
  if (index >= devices_.size()) return NVML_ERROR_INVALID_ARGUMENT;
  nvmlSetMemoryLimits_v1_t limits{cgroup_dir.c_str(), soft, hard};
  return api_->set_limits(devices_[index]->handle, &limits);
}

int Nvml::get_memory_limit(std::size_t index, const std::string& cgroup_dir, std::uint64_t* soft, std::uint64_t* hard,
                           std::uint64_t* used) {
  if (api_ == nullptr || api_->get_limits == nullptr) return NVML_ERROR_FUNCTION_NOT_FOUND;
  if (index >= devices_.size()) return NVML_ERROR_INVALID_ARGUMENT;
  nvmlGetMemoryLimits_v1_t limits{cgroup_dir.c_str(), 0, 0, 0};
  const nvmlReturn_t rc = api_->get_limits(devices_[index]->handle, &limits);
  if (rc == NVML_SUCCESS) {
    *soft = limits.softLimit;
    *hard = limits.hardLimit;
    *used = limits.currentUsed;
  }
  return rc;
}

std::string Nvml::error_text(int rc) const {
  if (rc == NVML_ERROR_FUNCTION_NOT_FOUND && (api_ == nullptr || api_->set_limits == nullptr))
    return "NVML lacks nvmlDeviceSetMemoryLimits_v1 (driver older than R615)";
  return api_ != nullptr ? api_->error(static_cast<nvmlReturn_t>(rc)) : "NVML not loaded";
}

std::string Nvml::driver_version() const {
  char text[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = {};
  if (api_ == nullptr || api_->driver_version == nullptr || api_->driver_version(text, sizeof text) != NVML_SUCCESS)
    return "unknown";
  text[sizeof text - 1] = '\0';
  return text;
}

void Nvml::sample(GpuSample* out) {
  out->devices.resize(devices_.size());
  for (std::size_t i = 0; i < devices_.size(); ++i) {
    Device& dev = *devices_[i];
    GpuDevice& g = out->devices[i];
    std::memcpy(g.uuid, dev.uuid, sizeof g.uuid);
    g.uuid_text = dev.uuid_text;
    sample_processes(dev, &g);
    sample_utilisation(dev, &g);
  }
}

void Nvml::sample_processes(Device& dev, GpuDevice* out) {
  out->processes.clear();
  out->processes_known = false;
  if (api_->processes == nullptr) return;
  if (dev.process_buf.empty()) dev.process_buf.resize(64);
  // The list may grow between the two calls: retry a few times.
  for (int attempt = 0; attempt < 4; ++attempt) {
    auto count = static_cast<unsigned int>(dev.process_buf.size());
    const nvmlReturn_t rc = api_->processes(dev.handle, &count, dev.process_buf.data());
    if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
      dev.process_buf.resize(std::max<std::size_t>(count + 16, dev.process_buf.size() * 2));
      continue;
    }
    if (rc != NVML_SUCCESS) {
      log_once(LogLevel::warn, "nvml-processes-"s + dev.uuid_text,
               "nvmlDeviceGetComputeRunningProcesses_v3(%s): %s; memory reconciliation paused on this device",
               dev.uuid_text.c_str(), api_->error(rc).c_str());
      return;
    }
    count = std::min<unsigned int>(count, static_cast<unsigned int>(dev.process_buf.size()));
    for (unsigned int k = 0; k < count; ++k) {
      const nvmlProcessInfo_t& info = dev.process_buf[k];
      GpuProcess p;
      p.host_pid = info.pid;
      p.used_known = info.usedGpuMemory != NVML_VALUE_NOT_AVAILABLE;
      p.used_bytes = p.used_known ? info.usedGpuMemory : 0;
      out->processes.push_back(p);
    }
    out->processes_known = true;
    mark_graphics(dev, out);
    return;
  }
}

// Processes NVML also lists with a graphics context: memory a graphics API
// allocated (Vulkan, OpenGL) is in their figure, and no CUDA call made it.
// Without the list (an old driver, an error) none is marked.
void Nvml::mark_graphics(Device& dev, GpuDevice* out) {
  if (api_->graphics_processes == nullptr) return;
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (dev.graphics_buf.empty()) dev.graphics_buf.resize(16);
    auto count = static_cast<unsigned int>(dev.graphics_buf.size());
    const nvmlReturn_t rc = api_->graphics_processes(dev.handle, &count, dev.graphics_buf.data());
    if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
      dev.graphics_buf.resize(std::max<std::size_t>(count + 16, dev.graphics_buf.size() * 2));
      continue;
    }
    if (rc != NVML_SUCCESS) return;
    count = std::min<unsigned int>(count, static_cast<unsigned int>(dev.graphics_buf.size()));
    for (GpuProcess& p : out->processes) {
      for (unsigned int k = 0; k < count; ++k) p.graphics = p.graphics || dev.graphics_buf[k].pid == p.host_pid;
    }
    return;
  }
}

namespace {

void add_busy(void* map, std::uint32_t pid, std::uint64_t busy_ns) noexcept {
  auto& busy = *static_cast<std::unordered_map<std::uint32_t, std::uint64_t>*>(map);
  busy[pid] += busy_ns;  // std::bad_alloc would end the agent, as anywhere else in it
}

}  // namespace

// NVML's per-process samples reduced exactly as the library's feedback owner
// reduces them (limiter/compute_samples.h): windows close on NVML's own
// sample stamps, each sample weighs its period. The library reads the
// agent's shares over the windows between util_updated_ns, so the window's
// end is handed on in CLOCK_MONOTONIC.
void Nvml::sample_utilisation(Device& dev, GpuDevice* out) {
  out->util_sampled_ns = 0;
  out->util_busy_ns.clear();
  out->util_window_ns = 0;
  out->util_known = false;
  out->device_util_known = false;
  if (api_->process_util != nullptr && !dev.util_unsupported) {
    // The first window: the last second of NVML's samples (the library
    // starts from "now" instead: it has no cycle to report at once), so a
    // device's utilisation is known from the agent's first cycle.
    if (dev.util_clock.last_seen_us == 0)
      limiter::samples_begin(dev.util_clock, platform::realtime_us() - limiter::kNoSampleIdleUs);
    // One call in the steady state: the buffer only grows when NVML says so.
    if (dev.util_buf.empty()) dev.util_buf.resize(64);
    unsigned int count = 0;
    nvmlReturn_t rc = NVML_ERROR_UNKNOWN;
    std::uint64_t asked_us = 0, asked_ns = 0;
    for (int attempt = 0; attempt < 3; ++attempt) {
      count = static_cast<unsigned int>(dev.util_buf.size());
      asked_ns = monotonic_ns();
      asked_us = platform::realtime_us();
      rc = api_->process_util(dev.handle, dev.util_buf.data(), &count, dev.util_clock.last_seen_us);
      if (rc != NVML_ERROR_INSUFFICIENT_SIZE) break;
      dev.util_buf.resize(std::max<std::size_t>(count + 16, dev.util_buf.size() * 2));
    }
    if (rc == NVML_SUCCESS || rc == NVML_ERROR_NOT_FOUND) {
      count = rc == NVML_SUCCESS ? std::min<unsigned int>(count, static_cast<unsigned int>(dev.util_buf.size())) : 0;
      std::uint64_t window_ns = 0;
      if (limiter::samples_window(dev.util_clock, rc, dev.util_buf.data(), count, asked_us, add_busy,
                                  &out->util_busy_ns, &window_ns) &&
          window_ns != 0) {
        std::uint64_t all_ns = 0;
        for (const auto& [pid, busy] : out->util_busy_ns) all_ns += busy;
        out->util_window_ns = window_ns;
        out->util_known = true;
        dev.device_util_permille = limiter::share_permille(all_ns, window_ns);
        dev.util_known_once = true;
        // The window ends at a sample's stamp (CPU us), usually before the
        // call: the same instant on the monotonic clock.
        const std::uint64_t end_us = dev.util_clock.last_seen_us;
        const std::uint64_t behind_ns = asked_us > end_us ? (asked_us - end_us) * 1000 : 0;
        out->util_sampled_ns = asked_ns > behind_ns ? asked_ns - behind_ns : asked_ns;
      }
      if (dev.util_known_once) {
        out->device_util_permille = dev.device_util_permille;
        out->device_util_pct = dev.device_util_permille / 10;
        out->device_util_known = true;
      }
    } else if (rc == NVML_ERROR_NOT_SUPPORTED) {
      dev.util_unsupported = true;
      log(LogLevel::warn, "%s: per-process utilisation not supported; no utilisation feedback on this device",
          dev.uuid_text.c_str());
    } else {
      log_once(LogLevel::warn, "nvml-util-"s + dev.uuid_text, "nvmlDeviceGetProcessUtilization(%s): %s",
               dev.uuid_text.c_str(), api_->error(rc).c_str());
    }
  }
  // Without per-process samples, the whole device from NVML's own counter
  // (its window is NVML's sampling period, not our cycle).
  if (!out->device_util_known && api_->util_rates != nullptr && !dev.rates_unsupported) {
    nvmlUtilization_t u{};
    const nvmlReturn_t rc = api_->util_rates(dev.handle, &u);
    if (rc == NVML_SUCCESS) {
      out->device_util_pct = std::min(u.gpu, 100u);
      out->device_util_permille = out->device_util_pct * 10;
      out->device_util_known = true;
    } else if (rc == NVML_ERROR_NOT_SUPPORTED) {
      dev.rates_unsupported = true;
    }
  }
}

}  // namespace gpuslice::agent
