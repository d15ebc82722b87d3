// The simulated NVML (libnvidia-ml.so.1): a read-mostly view of the same shared
// state the simulated driver keeps, so NVML and the driver always agree.
// PIDs are host pids (first NSpid field), as NVML reports on real hardware.
#include <time.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "nvml_abi.h"
#include "state.h"
#include "scheduler.h"
#include "timeline.h"
#include "nvml_internal.h"

struct nvmlDevice_st {
  unsigned int index;
};

using namespace gpuslice::fakecuda;

namespace {

std::mutex g_mu;
int g_init_count = 0;      // nvmlInit/nvmlShutdown nest
State* g_state = nullptr;  // kept for the process's life once attached
nvmlDevice_st g_devices[kMaxDevices];

// Utilisation with no lastSeenTimeStamp covers the last second, like nvidia-smi's sample.
constexpr std::uint64_t kDefaultWindowNs = 1000000000ull;

State* attached() {
  std::lock_guard<std::mutex> guard(g_mu);
  return g_init_count > 0 ? g_state : nullptr;
}

nvmlReturn_t check_device(nvmlDevice_t device, State** state, std::uint32_t* index) {
  *state = attached();
  if (*state == nullptr) return NVML_ERROR_UNINITIALIZED;
  auto address = reinterpret_cast<std::uintptr_t>(device);
  auto first = reinterpret_cast<std::uintptr_t>(&g_devices[0]);
  if (address < first || address >= first + sizeof(g_devices) || (address - first) % sizeof(nvmlDevice_st) != 0 ||
      device->index >= (*state)->device_count()) {
    return NVML_ERROR_INVALID_ARGUMENT;
  }
  *index = device->index;
  return NVML_SUCCESS;
}

std::uint64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

nvmlReturn_t init(unsigned int flags) {
  (void)flags;
  std::lock_guard<std::mutex> guard(g_mu);
  if (g_state == nullptr) {
    Config config;
    char error[1400];
    if (!parse_config(config, error, sizeof(error))) {
      std::fprintf(stderr, "fakecuda: %s\n", error);
      return NVML_ERROR_UNKNOWN;
    }
    g_state = State::open_or_create(config, error, sizeof(error));
    if (g_state == nullptr) {
      std::fprintf(stderr, "%s\n", error);
      return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    for (unsigned i = 0; i < kMaxDevices; ++i) g_devices[i].index = i;
  }
  ++g_init_count;
  return NVML_SUCCESS;
}

nvmlReturn_t copy_string(const char* text, char* out, unsigned int length) {
  if (out == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (std::strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
  std::memcpy(out, text, std::strlen(text) + 1);
  return NVML_SUCCESS;
}

template <typename Info>
// Compute list: every process on the device (a process with a graphics
// context too is listed, with all the memory it uses). Graphics list
// (graphics_only): the processes holding graphics allocations there.
nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int* infoCount, Info* infos, bool with_instances,
                               bool graphics_only = false) {
  if (infoCount == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = check_device(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  // An integrated GPU's memory is system memory: what NVML reports for it is
  // not documented (users of GB10 report NOT_SUPPORTED): refused.
  if (state->header().integrated != 0) return NVML_ERROR_NOT_SUPPORTED;
  ProcessUsage usage[kMaxSlots];
  int count = 0;
  {
    State::Lock lock(*state);
    if (!lock.ok()) return NVML_ERROR_UNKNOWN;
    state->header().nvml_process_lists.fetch_add(1, std::memory_order_relaxed);
    state->reap_locked(-1);  // dead processes' memory is gone, as after a real process exit
    count = collect_usage_locked(*state, static_cast<int>(dev), usage, static_cast<int>(kMaxSlots));
  }
  if (graphics_only) {
    int kept = 0;
    for (int i = 0; i < count && i < static_cast<int>(kMaxSlots); ++i) {
      if (usage[i].graphics != 0) usage[kept++] = usage[i];
    }
    count = kept;
  }
  if (*infoCount < static_cast<unsigned>(count) || (count > 0 && infos == nullptr)) {
    *infoCount = static_cast<unsigned>(count);
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  for (int i = 0; i < count; ++i) {
    Info info{};
    info.pid = host_pid_seen_here(usage[i]);
    info.usedGpuMemory = usage[i].used_bytes;
    if constexpr (sizeof(Info) > sizeof(nvmlProcessInfo_v1_t)) {
      if (with_instances) {
        info.gpuInstanceId = 0xFFFFFFFFu;
        info.computeInstanceId = 0xFFFFFFFFu;
      }
    }
    infos[i] = info;
  }
  *infoCount = static_cast<unsigned>(count);
  return NVML_SUCCESS;
}

nvmlReturn_t memory_used(nvmlDevice_t device, std::uint64_t* total, std::uint64_t* used) {
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = check_device(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  if (state->header().integrated != 0) return NVML_ERROR_NOT_SUPPORTED;  // as running_processes
  State::Lock lock(*state);
  if (!lock.ok()) return NVML_ERROR_UNKNOWN;
  state->reap_locked(-1);
  *total = state->header().memory_bytes;
  *used = state->device_used_locked(dev);
  return NVML_SUCCESS;
}

constexpr unsigned kMaxSamples = 1024;
constexpr std::uint64_t kSampleBuffer = 10;  // periods the periodic model keeps (README)

// Ideal profile: one sample per process over the exact window since
// lastSeenTimeStamp (or the last second), stamped now.
unsigned exact_samples(State& state, std::uint32_t dev, unsigned long long last_seen,
                       nvmlProcessUtilizationSample_t* samples) {
  // NVML timestamps are CPU (wall-clock) microseconds; the timeline is CLOCK_MONOTONIC.
  const std::uint64_t now_mono = mono_ns();
  const std::uint64_t now_real = realtime_ns();
  std::uint64_t t0 = now_mono - kDefaultWindowNs;
  if (last_seen != 0) {
    std::uint64_t last_real = last_seen * 1000ull;
    std::uint64_t ago = now_real > last_real ? now_real - last_real : 0;
    t0 = ago < now_mono ? now_mono - ago : 0;
  }
  const std::uint64_t window = now_mono > t0 ? now_mono - t0 : 1;
  unsigned count = 0;
  timeline_busy_by_process(state, dev, t0, now_mono, [&](std::uint32_t host_pid, std::uint64_t busy) {
    if (count >= kMaxSamples) return;
    std::uint64_t percent = (busy * 100 + window / 2) / window;
    samples[count++] = nvmlProcessUtilizationSample_t{
        host_pid, now_real / 1000ull, static_cast<unsigned int>(percent > 100 ? 100 : percent), 0, 0, 0};
  });
  return count;
}

// Periodic model: the driver samples on its own period P from the state's
// creation; sample k covers [origin + kP, origin + (k+1)P), exists once that
// period has ended, and is stamped with its end (CPU microseconds). One sample
// per process with a non-zero integer percent, for each of the last
// kSampleBuffer periods whose stamp is newer than last_seen.
unsigned periodic_samples(State& state, std::uint32_t dev, unsigned long long last_seen,
                          nvmlProcessUtilizationSample_t* samples) {
  const StateHeader& header = state.header();
  const std::uint64_t period = header.nvml_period_ns;
  const std::uint64_t origin = header.created_mono_ns;
  const std::uint64_t now = mono_ns();
  const std::uint64_t completed = (now - origin) / period;  // periods that have ended
  if (completed == 0) return 0;
  const std::uint64_t first = completed > kSampleBuffer ? completed - kSampleBuffer : 0;
  constexpr int kMaxPids = 64;
  std::uint32_t pids[kMaxPids];
  std::uint64_t busy[kMaxPids][kSampleBuffer] = {};
  int pid_count = 0;
  const std::uint64_t t0 = origin + first * period;
  const std::uint64_t t1 = origin + completed * period;
  timeline_for_each(state, dev, [&](std::uint64_t start, std::uint64_t end, std::uint64_t packed) {
    std::uint64_t lo = start > t0 ? start : t0;
    std::uint64_t hi = end < t1 ? end : t1;
    if (hi <= lo) return;
    auto host = static_cast<std::uint32_t>(packed >> 32);
    int p = 0;
    while (p < pid_count && pids[p] != host) ++p;
    if (p == pid_count) {
      if (pid_count == kMaxPids) return;
      pids[pid_count++] = host;
    }
    // Split the interval over the periods it overlaps.
    while (lo < hi) {
      std::uint64_t k = (lo - origin) / period;
      std::uint64_t period_end = origin + (k + 1) * period;
      std::uint64_t piece_end = hi < period_end ? hi : period_end;
      busy[p][k - first] += piece_end - lo;
      lo = piece_end;
    }
  });
  unsigned count = 0;
  for (std::uint64_t k = first; k < completed; ++k) {
    const std::uint64_t stamp_us = (header.created_real_ns + (k + 1) * period) / 1000ull;
    if (stamp_us <= last_seen) continue;
    for (int p = 0; p < pid_count && count < kMaxSamples; ++p) {
      std::uint64_t percent = (busy[p][k - first] * 100 + period / 2) / period;
      if (percent == 0) continue;
      samples[count++] = nvmlProcessUtilizationSample_t{
          pids[p], stamp_us, static_cast<unsigned int>(percent > 100 ? 100 : percent), 0, 0, 0};
    }
  }
  return count;
}

}  // namespace

extern "C" {

nvmlReturn_t nvmlInit_v2(void) { return init(0); }
nvmlReturn_t nvmlInit(void) { return init(0); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { return init(flags); }

nvmlReturn_t nvmlShutdown(void) {
  std::lock_guard<std::mutex> guard(g_mu);
  if (g_init_count == 0) return NVML_ERROR_UNINITIALIZED;
  --g_init_count;
  return NVML_SUCCESS;
}

const char* nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_OPERATING_SYSTEM: return "Operating System Error";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not Ready";
    default: return "Unknown Error";
  }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char* version, unsigned int length) {
  State* state = attached();
  if (state == nullptr) return NVML_ERROR_UNINITIALIZED;
  char text[sizeof(state->header().driver_version)];
  std::memcpy(text, state->header().driver_version, sizeof(text));
  text[sizeof(text) - 1] = '\0';
  return copy_string(text, version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char* version, unsigned int length) {
  State* state = attached();
  if (state == nullptr) return NVML_ERROR_UNINITIALIZED;
  char text[64];
  std::snprintf(text, sizeof(text), "%d.%.31s", kDriverVersion / 1000, state->header().driver_version);
  return copy_string(text, version, length);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int* cudaDriverVersion) {
  if (cudaDriverVersion == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *cudaDriverVersion = kDriverVersion;
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int* cudaDriverVersion) {
  return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* deviceCount) {
  if (deviceCount == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  State* state = attached();
  if (state == nullptr) return NVML_ERROR_UNINITIALIZED;
  *deviceCount = state->device_count();
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int* deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  if (device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  State* state = attached();
  if (state == nullptr) return NVML_ERROR_UNINITIALIZED;
  if (index >= state->device_count()) return NVML_ERROR_INVALID_ARGUMENT;
  *device = &g_devices[index];
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t* device) {
  return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, nvmlDevice_t* device) {
  if (uuid == nullptr || device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  State* state = attached();
  if (state == nullptr) return NVML_ERROR_UNINITIALIZED;
  for (std::uint32_t i = 0; i < state->device_count(); ++i) {
    char text[NVML_DEVICE_UUID_BUFFER_SIZE];
    device_uuid_string(state->header(), i, text, sizeof(text));
    if (std::strcmp(text, uuid) == 0) {
      *device = &g_devices[i];
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int* index) {
  if (index == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = check_device(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  *index = dev;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = check_device(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  char text[NVML_DEVICE_UUID_BUFFER_SIZE];
  device_uuid_string(state->header(), dev, text, sizeof(text));
  return copy_string(text, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length) {
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = check_device(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  return copy_string(kDeviceName, name, length);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) {
  if (memory == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  std::uint64_t total = 0;
  std::uint64_t used = 0;
  if (nvmlReturn_t rc = memory_used(device, &total, &used); rc != NVML_SUCCESS) return rc;
  memory->total = total;
  memory->used = used;
  memory->free = used < total ? total - used : 0;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory) {
  if (memory == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  std::uint64_t total = 0;
  std::uint64_t used = 0;
  if (nvmlReturn_t rc = memory_used(device, &total, &used); rc != NVML_SUCCESS) return rc;
  std::uint64_t free = used < total ? total - used : 0;
  // Inside a cgroup with a hard limit: the partition (nvml_limits.cc).
  partition_memory(device->index, &total, &used, &free);
  memory->total = total;
  memory->reserved = 0;  // the simulated driver reserves nothing for itself
  memory->used = used;
  memory->free = free;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int* infoCount,
                                                  nvmlProcessInfo_v1_t* infos) {
  return running_processes(device, infoCount, infos, false);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int* infoCount,
                                                     nvmlProcessInfo_v2_t* infos) {
  return running_processes(device, infoCount, infos, true);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int* infoCount,
                                                     nvmlProcessInfo_t* infos) {
  return running_processes(device, infoCount, infos, true);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int* infoCount,
                                                   nvmlProcessInfo_v1_t* infos) {
  return running_processes(device, infoCount, infos, false, true);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int* infoCount,
                                                      nvmlProcessInfo_v2_t* infos) {
  return running_processes(device, infoCount, infos, true, true);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int* infoCount,
                                                      nvmlProcessInfo_t* infos) {
  return running_processes(device, infoCount, infos, true, true);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t* utilization,
                                             unsigned int* processSamplesCount, unsigned long long lastSeenTimeStamp) {
  if (processSamplesCount == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = check_device(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  sched_catch_up(*state);
  nvmlProcessUtilizationSample_t samples[kMaxSamples];
  unsigned int count = state->header().nvml_period_ns != 0 ? periodic_samples(*state, dev, lastSeenTimeStamp, samples)
                                                           : exact_samples(*state, dev, lastSeenTimeStamp, samples);
  if (count == 0) return NVML_ERROR_NOT_FOUND;  // no valid sample newer than lastSeenTimeStamp
  if (utilization == nullptr || *processSamplesCount < count) {
    *processSamplesCount = count;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  std::memcpy(utilization, samples, count * sizeof(samples[0]));
  *processSamplesCount = count;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t* utilization) {
  if (utilization == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = check_device(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  std::uint64_t now = mono_ns();
  // Exact: the last second up to now. Periodic: the last completed sample period.
  std::uint64_t window = kDefaultWindowNs;
  std::uint64_t end = now;
  if (const std::uint64_t period = state->header().nvml_period_ns; period != 0) {
    const std::uint64_t origin = state->header().created_mono_ns;
    window = period;
    end = origin + (now - origin) / period * period;
  }
  std::uint64_t busy = end > window ? timeline_busy_ns(*state, dev, 0, end - window, end) : 0;
  std::uint64_t percent = (busy * 100 + window / 2) / window;
  utilization->gpu = static_cast<unsigned int>(percent > 100 ? 100 : percent);
  utilization->memory = 0;  // memory traffic is not simulated
  return NVML_SUCCESS;
}

}  // extern "C"

namespace gpuslice::fakecuda {
State* nvml_attached() { return attached(); }
nvmlReturn_t nvml_check_device(nvmlDevice_t device, State** state, std::uint32_t* index) {
  return check_device(device, state, index);
}
}  // namespace gpuslice::fakecuda
