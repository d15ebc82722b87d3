// The fakecuda_* test API (fakecuda_query.h).
#include "fakecuda_query.h"

#include <cstdio>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

char g_path[1024];

// The state cuInit attached to, else the one FAKECUDA_STATE names (attached
// once, read-mostly: queries only reap and read).
State* query_state() {
  Runtime& r = runtime();
  if (initialized() || r.init_state.load(std::memory_order_acquire) == static_cast<int>(InitState::forked)) {
    return r.state;
  }
  static State* attached = [] {
    state_path_from_env(g_path, sizeof(g_path));
    char error[1400];
    return State::open_existing(g_path, error, sizeof(error));
  }();
  return attached;
}

bool valid(State* s, int dev) {
  return s != nullptr && dev >= 0 && static_cast<std::uint32_t>(dev) < s->device_count();
}

int own_slot() { return initialized() ? runtime().slot : -1; }

// Sums one field of the usage of processes matching pid (0 = this process).
std::uint64_t process_usage(int dev, int pid, bool context_only) {
  State* s = query_state();
  if (!valid(s, dev)) return 0;
  auto wanted = static_cast<std::uint32_t>(pid);
  if (pid == 0) {
    if (!initialized()) return 0;
    wanted = runtime().submitter.pid;
  }
  State::Lock lock(*s);
  if (!lock.ok()) return 0;
  s->reap_locked(own_slot());
  ProcessUsage usage[kMaxSlots];
  int count = collect_usage_locked(*s, dev, usage, static_cast<int>(kMaxSlots));
  std::uint64_t total = 0;
  for (int i = 0; i < count && i < static_cast<int>(kMaxSlots); ++i) {
    if (usage[i].pid == wanted || usage[i].host_pid == wanted) {
      total += context_only ? usage[i].context_bytes : usage[i].used_bytes;
    }
  }
  return total;
}

}  // namespace

extern "C" int fakecuda_device_count(void) {
  State* s = query_state();
  return s == nullptr ? -1 : static_cast<int>(s->device_count());
}

extern "C" uint64_t fakecuda_device_total_bytes(int dev) {
  State* s = query_state();
  return valid(s, dev) ? s->header().memory_bytes : 0;
}

extern "C" uint64_t fakecuda_device_used_bytes(int dev) {
  State* s = query_state();
  if (!valid(s, dev)) return 0;
  State::Lock lock(*s);
  if (!lock.ok()) return 0;
  s->reap_locked(own_slot());
  return s->device_used_locked(static_cast<std::uint32_t>(dev));
}

extern "C" uint64_t fakecuda_device_managed_bytes(int dev, uint64_t* used) {
  std::uint64_t held = 0;
  State* s = query_state();
  if (!valid(s, dev)) {
    if (used != nullptr) *used = 0;
    return 0;
  }
  State::Lock lock(*s);
  if (!lock.ok()) {
    if (used != nullptr) *used = 0;
    return 0;
  }
  s->reap_locked(own_slot());
  const std::uint64_t managed = s->device_managed_locked(static_cast<std::uint32_t>(dev), &held);
  if (used != nullptr) *used = held;
  return managed;
}

extern "C" uint64_t fakecuda_process_used_bytes(int dev, int pid_or_0) { return process_usage(dev, pid_or_0, false); }

extern "C" uint64_t fakecuda_process_context_bytes(int dev, int pid_or_0) { return process_usage(dev, pid_or_0, true); }

extern "C" int fakecuda_process_count(int dev) {
  State* s = query_state();
  if (!valid(s, dev)) return 0;
  State::Lock lock(*s);
  if (!lock.ok()) return 0;
  s->reap_locked(own_slot());
  return collect_usage_locked(*s, dev, nullptr, 0);
}

extern "C" uint64_t fakecuda_busy_ns(int dev, int pid_or_0, uint64_t t0_ns, uint64_t t1_ns) {
  State* s = query_state();
  if (!valid(s, dev)) return 0;
  return timeline_busy_ns(*s, static_cast<std::uint32_t>(dev), static_cast<std::uint32_t>(pid_or_0), t0_ns, t1_ns);
}

extern "C" size_t fakecuda_busy_segments(int dev, uint64_t t0_ns, uint64_t t1_ns, uint64_t* out, size_t max) {
  State* s = query_state();
  if (!valid(s, dev)) return 0;
  std::size_t count = 0;
  timeline_for_each(*s, static_cast<std::uint32_t>(dev),
                    [&](std::uint64_t start, std::uint64_t end, std::uint64_t pids) {
                      const std::uint64_t lo = start > t0_ns ? start : t0_ns, hi = end < t1_ns ? end : t1_ns;
                      if (hi <= lo) return;
                      if (count < max) {
                        out[3 * count] = lo;
                        out[3 * count + 1] = hi;
                        out[3 * count + 2] = pids >> 32;
                      }
                      ++count;
                    });
  return count;
}

extern "C" uint64_t fakecuda_busy_until_ns(int dev) {
  State* s = query_state();
  return valid(s, dev) ? s->device(static_cast<std::uint32_t>(dev)).busy_until_ns.load(std::memory_order_acquire) : 0;
}

extern "C" uint64_t fakecuda_pending_ns(int dev) {
  State* s = query_state();
  if (!valid(s, dev)) return 0;
  const auto d = static_cast<std::uint32_t>(dev);
  const std::uint64_t now = mono_ns();
  if (!sched_enabled(s->header())) {
    const std::uint64_t until = s->device(d).busy_until_ns.load(std::memory_order_acquire);
    return until > now ? until - now : 0;
  }
  State::Lock lock(*s);
  if (!lock.ok()) return 0;
  sched_advance_locked(*s, d, now);
  std::uint64_t pending = 0;
  for (const SchedStream& stream : sched_device(*s, d).streams) {
    if (stream.used != 0) pending += stream.remaining_ns;
  }
  return pending;
}

extern "C" uint64_t fakecuda_pending_kernels(int dev, int except_pid) {
  State* s = query_state();
  if (!valid(s, dev) || !sched_enabled(s->header())) return 0;
  const auto d = static_cast<std::uint32_t>(dev);
  const auto except = static_cast<std::uint32_t>(except_pid);
  State::Lock lock(*s);
  if (!lock.ok()) return 0;
  sched_advance_locked(*s, d, mono_ns());
  const SchedDevice& sd = sched_device(*s, d);
  std::uint64_t kernels = 0;
  for (const SchedStream& stream : sd.streams) {
    if (stream.used == 0) continue;
    const auto pid = static_cast<std::uint32_t>(stream.info.pids),
               host_pid = static_cast<std::uint32_t>(stream.info.pids >> 32);
    if (except != 0 && (pid == except || host_pid == except)) continue;
    for (std::uint32_t i = stream.head; i != kNoEntry; i = sd.entries[i].next)
      kernels += sd.entries[i].kind == SchedKind::kernel;
  }
  return kernels;
}

extern "C" uint64_t fakecuda_now_ns(void) { return mono_ns(); }

extern "C" int fakecuda_reap(void) {
  State* s = query_state();
  if (s == nullptr) return 0;
  State::Lock lock(*s);
  return lock.ok() ? s->reap_locked(own_slot()) : 0;
}

extern "C" const char* fakecuda_state_path(void) {
  if (query_state() == nullptr) return "";
  if (initialized()) return runtime().state_path;
  return g_path;
}

extern "C" const char* fakecuda_profile(void) {
  State* s = query_state();
  if (s == nullptr) return "";
  return sched_enabled(s->header()) ? "realistic" : "ideal";
}
