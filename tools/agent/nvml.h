// NVML, loaded with dlopen at run time (never linked: the agent must start,
// and reap, on a node whose driver is broken or absent). One sample per cycle:
// for every device, the compute processes with their device memory and their
// SM utilisation since the previous sample.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace gpuslice::agent {

struct GpuProcess {
  std::uint32_t host_pid = 0;    // NVML reports pids of the host (initial) pid namespace
  std::uint64_t used_bytes = 0;  // device memory it holds (context included)
  bool used_known = true;        // false: NVML_VALUE_NOT_AVAILABLE
  bool graphics = false;         // NVML also lists it with a graphics context (graphics interop)
};

struct GpuDevice {
  std::uint8_t uuid[16] = {};
  std::string uuid_text;
  std::vector<GpuProcess> processes;
  // host pid -> device time (ns) its kernels used in the window NVML's
  // samples closed this cycle, reduced as the library reduces them
  // (limiter::samples_window); pids without a sample ran no kernel. A
  // container's share is limiter::share_permille(sum, util_window_ns).
  std::unordered_map<std::uint32_t, std::uint64_t> util_busy_ns;
  std::uint64_t util_window_ns = 0;
  bool util_known = false;                 // a window closed this cycle (util_busy_ns, util_window_ns are valid)
  std::uint32_t device_util_permille = 0;  // the whole device (limiter::share_permille)
  std::uint32_t device_util_pct = 0;       // the same, in whole percents (metrics)
  bool device_util_known = false;
  std::uint64_t util_sampled_ns = 0;  // CLOCK_MONOTONIC at the window's end; 0 = unknown
  bool processes_known = false;

  // The device time of one host pid in the window (0 without a sample).
  std::uint64_t busy_ns_of(std::uint32_t host_pid) const {
    auto it = util_busy_ns.find(host_pid);
    return it != util_busy_ns.end() ? it->second : 0;
  }
};

struct GpuSample {
  std::vector<GpuDevice> devices;
};

class Nvml {
 public:
  Nvml() = default;
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  // dlopen + nvmlInit_v2 + device enumeration. false + why on failure.
  bool open(const std::string& library, std::string* why);
  bool available() const { return handle_ != nullptr; }
  // One sample of every device into `out` (its buffers are reused).
  void sample(GpuSample* out);
  std::size_t device_count() const { return devices_.size(); }
  // The driver's per-cgroup device-memory limit (R615+; backstop.h) of device
  // `index` (as in GpuSample::devices): NVML's return code,
  // NVML_ERROR_FUNCTION_NOT_FOUND if the library lacks the call.
  int set_memory_limit(std::size_t index, const std::string& cgroup_dir, std::uint64_t soft, std::uint64_t hard);
  int get_memory_limit(std::size_t index, const std::string& cgroup_dir, std::uint64_t* soft, std::uint64_t* hard,
                       std::uint64_t* used);
  std::string error_text(int rc) const;
  std::string driver_version() const;

 private:
  struct Device;
  bool enumerate(std::string* why);
  void sample_processes(Device& dev, GpuDevice* out);
  void mark_graphics(Device& dev, GpuDevice* out);
  void sample_utilisation(Device& dev, GpuDevice* out);

  void* handle_ = nullptr;
  struct Api;
  Api* api_ = nullptr;
  std::vector<Device*> devices_;
};

}  // namespace gpuslice::agent
