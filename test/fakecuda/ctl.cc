// fakecuda-ctl: inspect or remove the simulated machine's state (FAKECUDA_STATE).
//   fakecuda-ctl status                      JSON: devices and processes
//   fakecuda-ctl busy <dev> <t0_ns> <t1_ns> [pid]   busy device ns in a CLOCK_MONOTONIC window
//   fakecuda-ctl counters                    JSON: work counted so far (NVML process lists, slot-lock probes)
//   fakecuda-ctl reset                       remove the state file
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "state.h"
#include "scheduler.h"
#include "timeline.h"

using namespace gpuslice::fakecuda;

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: fakecuda-ctl status | busy <dev> <t0_ns> <t1_ns> [pid] | counters | reset\n"
               "  reads the state file named by FAKECUDA_STATE (default /dev/shm/fakecuda-<uid>.state)\n");
  return 2;
}

bool parse_u64(const char* text, std::uint64_t& out) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  errno = 0;
  char* end = nullptr;
  out = std::strtoull(text, &end, 10);
  return errno == 0 && *end == '\0';
}

State* attach(const char* path) {
  char error[1400];
  State* state = State::open_existing(path, error, sizeof(error));
  if (state == nullptr) std::fprintf(stderr, "fakecuda-ctl: %s\n", error);
  return state;
}

int status(const char* path) {
  State* state = attach(path);
  if (state == nullptr) return 1;
  static ProcessUsage usage[kMaxSlots * 4];
  int count = 0;
  std::uint64_t used[kMaxDevices] = {};
  {
    State::Lock lock(*state);
    if (!lock.ok()) {
      std::fprintf(stderr, "fakecuda-ctl: state mutex unrecoverable\n");
      delete state;
      return 1;
    }
    state->reap_locked(-1);
    for (std::uint32_t d = 0; d < state->device_count(); ++d) used[d] = state->device_used_locked(d);
    count = collect_usage_locked(*state, -1, usage, static_cast<int>(sizeof(usage) / sizeof(usage[0])));
  }
  const StateHeader& h = state->header();
  std::printf(
      "{\"state\": \"%s\", \"profile\": {\"name\": \"%s\", \"nvml_period_ns\": %llu, \"timeslice_ns\": %llu, "
      "\"jitter_pct\": %u, \"seed\": %llu, \"launch_cost_ns\": %llu, \"queue_depth\": %llu, "
      "\"context_bytes\": %llu, \"module_memory\": %u}, \"devices\": [",
      path, sched_enabled(h) ? "realistic" : "ideal", static_cast<unsigned long long>(h.nvml_period_ns),
      static_cast<unsigned long long>(h.timeslice_ns), h.jitter_pct, static_cast<unsigned long long>(h.seed),
      static_cast<unsigned long long>(h.launch_cost_ns), static_cast<unsigned long long>(h.queue_depth),
      static_cast<unsigned long long>(h.context_bytes), h.module_memory);
  for (std::uint32_t d = 0; d < state->device_count(); ++d) {
    std::printf("%s{\"index\": %u, \"total\": %llu, \"used\": %llu, \"busy_until\": %llu}", d == 0 ? "" : ", ", d,
                static_cast<unsigned long long>(state->header().memory_bytes), static_cast<unsigned long long>(used[d]),
                static_cast<unsigned long long>(state->device(d).busy_until_ns.load()));
  }
  std::printf("], \"processes\": [");
  for (int i = 0; i < count; ++i) {
    const ProcessUsage& p = usage[i];
    std::printf(
        "%s{\"pid\": %u, \"host_pid\": %u, \"device\": %u, \"used_bytes\": %llu, \"context_bytes\": %llu, "
        "\"busy_ns\": %llu}",
        i == 0 ? "" : ", ", p.pid, p.host_pid, p.device, static_cast<unsigned long long>(p.used_bytes),
        static_cast<unsigned long long>(p.context_bytes), static_cast<unsigned long long>(p.busy_ns));
  }
  std::printf("]}\n");
  delete state;
  return 0;
}

// Read without the lock and without reaping: counts nothing itself.
int counters(const char* path) {
  State* state = attach(path);
  if (state == nullptr) return 1;
  const StateHeader& h = state->header();
  std::printf("{\"nvml_process_lists\": %llu, \"slot_probes\": %llu}\n",
              static_cast<unsigned long long>(h.nvml_process_lists.load()),
              static_cast<unsigned long long>(h.slot_probes.load()));
  delete state;
  return 0;
}

int busy(const char* path, int argc, char** argv) {
  std::uint64_t dev = 0, t0 = 0, t1 = 0, pid = 0;
  if (argc < 5 || argc > 6 || !parse_u64(argv[2], dev) || !parse_u64(argv[3], t0) || !parse_u64(argv[4], t1) ||
      (argc == 6 && !parse_u64(argv[5], pid))) {
    return usage();
  }
  State* state = attach(path);
  if (state == nullptr) return 1;
  if (dev >= state->device_count()) {
    std::fprintf(stderr, "fakecuda-ctl: no device %llu (state has %u)\n", static_cast<unsigned long long>(dev),
                 state->device_count());
    delete state;
    return 1;
  }
  std::printf("%llu\n", static_cast<unsigned long long>(timeline_busy_ns(*state, static_cast<std::uint32_t>(dev),
                                                                         static_cast<std::uint32_t>(pid), t0, t1)));
  delete state;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  char path[1024];
  state_path_from_env(path, sizeof(path));
  if (std::strcmp(argv[1], "status") == 0 && argc == 2) return status(path);
  if (std::strcmp(argv[1], "busy") == 0) return busy(path, argc, argv);
  if (std::strcmp(argv[1], "counters") == 0 && argc == 2) return counters(path);
  if (std::strcmp(argv[1], "reset") == 0 && argc == 2) {
    // Processes still attached keep their mapping; the next one creates a fresh state.
    if (unlink(path) != 0 && errno != ENOENT) {
      std::fprintf(stderr, "fakecuda-ctl: cannot remove %s: %s\n", path, std::strerror(errno));
      return 1;
    }
    return 0;
  }
  return usage();
}
