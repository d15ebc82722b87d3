// The feedback loop and its thread. See compute_feedback.h.
#include "limiter/compute_feedback.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <new>

#include "limiter/compute.h"
#include "platform/clock.h"
#include "platform/uuid.h"

namespace gpuslice::limiter {
namespace {

enum class Got { none, baseline, window };

constexpr unsigned kMaxSamples = 512;

}  // namespace

void FeedbackLoop::warn(const char* message) noexcept {
  if (host_.warn != nullptr) host_.warn(message);
}

bool FeedbackLoop::nvml_ready() noexcept {
  if (nvml_state_ == 0) {
    nvml_state_ = 2;
    if (host_.load_nvml != nullptr && host_.load_nvml(&nvml_) && nvml_.init != nullptr &&
        nvml_.handle_by_uuid != nullptr && nvml_.process_utilization != nullptr && nvml_.init() == NVML_SUCCESS) {
      nvml_state_ = 1;
    } else {
      warn(
          "compute limit: no node agent and no usable NVML to measure the container's device time; "
          "launches are priced by their estimate alone, expected NVML or the gpuslice agent");
    }
  }
  return nvml_state_ == 1;
}

bool FeedbackLoop::open_device(int e) noexcept {
  EntryFeedback& f = entries_[e];
  if (f.nvml_device != nullptr) return true;
  if (f.nvml_failed) return false;
  char uuid[platform::kUuidTextSize];
  platform::format_uuid(host_.region->devices[e].uuid, uuid);
  if (nvml_.handle_by_uuid(uuid, &f.nvml_device) != NVML_SUCCESS || f.nvml_device == nullptr) {
    f.nvml_device = nullptr;
    f.nvml_failed = true;
    warn(
        "compute limit: NVML does not know a device the container uses; its launches are priced by their "
        "estimate alone, expected NVML to see every CUDA device");
    return false;
  }
  return true;
}

void FeedbackLoop::collect_pids(std::uint64_t now_ns) noexcept {
  pid_count_ = 0;
  const Region* r = host_.region;
  for (const Slot& s : r->slots) {
    if (s.state.load(std::memory_order_acquire) != kSlotLive) continue;
    const std::uint32_t host_pid = s.host_pid.load(std::memory_order_relaxed);
    const std::uint32_t pid = host_pid != 0 ? host_pid : s.pid.load(std::memory_order_relaxed);
    if (pid != 0) pids_[pid_count_++] = pid;
  }
  // Recently exited processes: their queued kernels are the container's work.
  for (const DepartedProcess& d : r->departed) {
    const std::uint32_t seq = d.seq.load(std::memory_order_acquire);
    // Acquire loads keep the re-read of seq after them (no fence: ThreadSanitizer
    // does not model atomic_thread_fence).
    const std::uint32_t pid = d.pid.load(std::memory_order_acquire);
    const std::uint64_t at = d.departed_ns.load(std::memory_order_acquire);
    if ((seq & 1u) != 0 || seq != d.seq.load(std::memory_order_relaxed)) continue;  // being written
    if (pid == 0 || at == 0 || (now_ns > at && now_ns - at > kDepartedKeepNs)) continue;
    if (!in_container(pid)) pids_[pid_count_++] = pid;
  }
}

bool FeedbackLoop::in_container(std::uint32_t pid) const noexcept {
  for (std::uint32_t i = 0; i < pid_count_; ++i)
    if (pids_[i] == pid) return true;
  return false;
}

// NVML reports host pids; the region holds the container's own unless the
// agent filled host_pid. If none of the container's processes is among the
// device's NVML processes, the two disagree (a pid namespace without the
// agent): measuring would attribute the container's time to others and the
// true-up would refund everything, so the measurement is refused instead.
bool FeedbackLoop::pids_match(int e) noexcept {
  EntryFeedback& f = entries_[e];
  if (nvml_.running_processes == nullptr) return true;
  if (f.steps_since_check++ % 200 != 0) return f.pids_ok;
  nvmlProcessInfo_t infos[256];
  unsigned int count = 256;
  if (nvml_.running_processes(f.nvml_device, &count, infos) != NVML_SUCCESS) return f.pids_ok;
  bool ok = false;
  for (unsigned int i = 0; i < count && i < 256 && !ok; ++i) ok = in_container(infos[i].pid);
  if (!ok && f.pids_ok)
    warn(
        "compute limit: NVML's process ids are not the region's (pid namespace without the node agent); "
        "measurements are ignored and launches priced by their estimate alone, expected the gpuslice agent "
        "to map host pids");
  f.pids_ok = ok;
  return ok;
}

bool FeedbackLoop::measure_agent(int e, Measurement* out) noexcept {
  EntryFeedback& f = entries_[e];
  DeviceState& d = host_.region->devices[e];
  const std::uint64_t updated = d.util_updated_ns.load(std::memory_order_acquire);
  if (updated <= f.agent_last_ns) return false;
  const std::uint64_t window = updated - f.agent_last_ns;
  f.agent_last_ns = updated;
  const std::uint64_t util = d.util_permille.load(std::memory_order_relaxed);
  const std::uint64_t device = d.device_util_permille.load(std::memory_order_relaxed);
  out->window_ns = window;
  out->busy_ns = util * window / kFullPermille;
  out->others_ns = (device > util ? device - util : 0) * window / kFullPermille;
  // The agent reduces NVML's samples too (whole percents of its period, most
  // likely): half a percent of the window.
  out->resolution_ns = window / 200;
  return true;
}

bool FeedbackLoop::ours(const void* loop, std::uint32_t pid) noexcept {
  return static_cast<const FeedbackLoop*>(loop)->in_container(pid);
}

// NVML's answer since the previous window, reduced by compute_samples: a
// window closes on a new sample (or as idle once none came for a while), so
// NOT_FOUND between two samples of a sampling NVML measures nothing yet.
bool FeedbackLoop::measure_nvml(int e, std::uint64_t now_ns, Measurement* out) noexcept {
  EntryFeedback& f = entries_[e];
  const std::uint64_t asked_us = host_.real_us();
  nvmlProcessUtilizationSample_t samples[kMaxSamples];
  unsigned int n = kMaxSamples;
  const nvmlReturn_t rc = nvml_.process_utilization(f.nvml_device, samples, &n, f.nvml_clock.last_seen_us);
  if (n > kMaxSamples) n = kMaxSamples;
  bool trusted = true;
  if (rc == NVML_SUCCESS && n != 0) {
    collect_pids(now_ns);
    trusted = pids_match(e);
  }
  if (!samples_reduce(f.nvml_clock, rc, samples, n, asked_us, &FeedbackLoop::ours, this, out)) return false;
  if (!trusted) return false;  // consumed, not measured
  // Published for gpuslice-smi and the agent's metrics.
  DeviceState& d = host_.region->devices[e];
  d.util_permille.store(share_permille(out->busy_ns, out->window_ns), std::memory_order_relaxed);
  d.device_util_permille.store(share_permille(out->busy_ns + out->others_ns, out->window_ns),
                               std::memory_order_relaxed);
  d.util_updated_ns.store(now_ns, std::memory_order_release);
  return true;
}

bool FeedbackLoop::measure(int e, std::uint64_t now_ns, Measurement* out) noexcept {
  EntryFeedback& f = entries_[e];
  const std::uint64_t beat = host_.region->header.agent_heartbeat_ns.load(std::memory_order_acquire);
  const bool agent = beat != 0 && now_ns >= beat && now_ns - beat < kAgentFreshNs;
  if (agent != f.from_agent) {
    // Another source: its windows do not line up with the previous one's.
    f.from_agent = agent;
    f.nvml_clock.last_seen_us = 0;
    f.agent_last_ns = 0;
  }
  if (agent) {
    if (f.agent_last_ns == 0) {
      f.agent_last_ns = host_.region->devices[e].util_updated_ns.load(std::memory_order_acquire);
      if (f.agent_last_ns == 0) return false;
      control_begin(host_.region->devices[e], f.control);
      return false;
    }
    return measure_agent(e, out);
  }
  if (!nvml_ready() || !open_device(e)) return false;
  if (f.nvml_clock.last_seen_us == 0) {
    samples_begin(f.nvml_clock, host_.real_us());
    control_begin(host_.region->devices[e], f.control);
    return false;
  }
  return measure_nvml(e, now_ns, out);
}

void FeedbackLoop::tick() noexcept {
  const std::uint64_t now = host_.mono_ns();
  if (now >= next_refresh_ns_) {
    if (host_.refresh != nullptr) host_.refresh();
    next_refresh_ns_ = now + kRefreshNs;
  }
  Region* r = host_.region;
  if (r == nullptr) return;
  const std::uint32_t mask = host_.entries != nullptr ? host_.entries() : 0;
  for (unsigned e = 0; e < kMaxDevices; ++e) {
    EntryFeedback& f = entries_[e];
    DeviceState& d = r->devices[e];
    if (((mask >> e) & 1u) == 0 || !is_limited(d)) {
      if (f.owner) drop_feedback(d, self_);
      f.owner = false;
      continue;
    }
    if (!hold_feedback(d, self_, now)) {
      f.owner = false;
      continue;
    }
    if (!f.owner) {
      // Newly elected: start from a fresh baseline.
      f.owner = true;
      f.control = ControlState{};
      f.nvml_clock.last_seen_us = 0;
      f.agent_last_ns = 0;
      f.last_step_ns = 0;
    }
    if (f.control.primed && now - f.last_step_ns < kControlPeriodNs) continue;
    // A step runs when a new window is there: with a sampling NVML (a sample
    // every ~166 ms) the owner asks every tick until one comes, so the step
    // follows the sample by at most a tick instead of up to a control period.
    const bool was_primed = f.control.primed;
    Measurement m;
    if (measure(static_cast<int>(e), now, &m)) {
      if (f.control.primed)
        control_step(d, f.control, m, now);
      else
        control_begin(d, f.control);
      f.last_step_ns = now;
    } else if (!was_primed) {
      f.last_step_ns = now;  // the baseline: the first window is a period long
    }
  }
}

namespace {

std::atomic<std::uint32_t> g_thread_pid{0};
std::atomic<bool> g_stopping{false};
std::atomic<bool> g_in_tick{false};
FeedbackHost g_host;
alignas(FeedbackLoop) unsigned char g_loop_storage[sizeof(FeedbackLoop)];

void* feedback_main(void* arg) noexcept {
  const auto self = static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(arg));
  auto* loop = new (g_loop_storage) FeedbackLoop(g_host, self);
  for (;;) {
    g_in_tick.store(true, std::memory_order_seq_cst);
    if (!g_stopping.load(std::memory_order_seq_cst)) loop->tick();
    g_in_tick.store(false, std::memory_order_release);
    platform::sleep_ns(kFeedbackTickNs);
  }
  return nullptr;
}

}  // namespace

bool ensure_feedback_thread(const FeedbackHost& host) noexcept {
  const auto self = static_cast<std::uint32_t>(getpid());
  std::uint32_t current = g_thread_pid.load(std::memory_order_acquire);
  if (current == self) return true;
  // First call in this process (or in a forked child, where the parent's
  // thread does not exist): exactly one caller starts the thread.
  if (!g_thread_pid.compare_exchange_strong(current, self, std::memory_order_acq_rel)) return true;
  g_host = host;
  pthread_attr_t attr;
  if (pthread_attr_init(&attr) != 0) return false;
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  // Signals sent to the process must never be delivered on our thread (the
  // application's handlers expect its own threads): it inherits the creating
  // thread's mask, so that is everything blocked for the length of
  // pthread_create, then the caller's own mask again (a signal arriving
  // meanwhile stays pending for the caller). pthread_attr_setsigmask_np would
  // say it in one call but needs glibc 2.32 (docs/deploy.md, glibc floor).
  sigset_t all;
  sigset_t caller_mask;
  sigfillset(&all);
  const bool masked = pthread_sigmask(SIG_SETMASK, &all, &caller_mask) == 0;
  pthread_t thread;
  const int rc =
      masked ? pthread_create(&thread, &attr, feedback_main, reinterpret_cast<void*>(static_cast<std::uintptr_t>(self)))
             : -1;
  if (masked) pthread_sigmask(SIG_SETMASK, &caller_mask, nullptr);
  pthread_attr_destroy(&attr);
  if (rc == 0) pthread_setname_np(thread, "gpuslice-fb");
  return rc == 0;
}

void stop_feedback_thread() noexcept {
  g_stopping.store(true, std::memory_order_seq_cst);
  // A tick in progress ends within a few NVML calls; never wait longer than
  // 100 ms on it (a stalled NVML must not hold the exit up).
  for (int i = 0; i < 1000 && g_in_tick.load(std::memory_order_seq_cst); ++i) platform::sleep_ns(100'000);
}

void record_departure(Region* r, std::uint32_t nvml_pid, std::uint32_t self, std::uint64_t now_ns) noexcept {
  if (r == nullptr) return;
  if (nvml_pid != 0) {
    const std::uint64_t n = r->header.departed_next.fetch_add(1, std::memory_order_relaxed);
    DepartedProcess& d = r->departed[n % kMaxDeparted];
    // A writer killed mid-record leaves seq odd: the record is skipped until
    // the ring comes round to it again.
    const std::uint32_t seq = d.seq.load(std::memory_order_relaxed);
    d.seq.store(seq | 1u, std::memory_order_relaxed);
    // Release stores: the odd seq is visible before either field changes.
    d.pid.store(nvml_pid, std::memory_order_release);
    d.departed_ns.store(now_ns == 0 ? 1 : now_ns, std::memory_order_release);
    d.seq.store((seq | 1u) + 1, std::memory_order_release);
  }
  for (DeviceState& d : r->devices) drop_feedback(d, self);
}

}  // namespace gpuslice::limiter
