// The launch path's initialisation (first limited-or-not launch), its reset
// in a forked child, and the wiring of the compute feedback thread
// (limiter/compute_feedback.h): the caches it refreshes and NVML.
#include "hook/launch_init.h"

#include <cuda.h>
#include <pthread.h>
#include <unistd.h>

#include <cstdlib>

#include "hook/launch_queue.h"
#include "hook/launch_state.h"
#include "hook/launch_streams.h"
#include "hook/log.h"
#include "hook/priority_gate.h"
#include "hook/wrap.h"
#include "limiter/compute.h"
#include "limiter/compute_feedback.h"
#include "platform/clock.h"
#include "platform/once.h"

namespace gpuslice::hook::launch {
namespace {

// Claimed by the thread that initialises; reset when there is no device yet
// (the next launch tries again) and in a forked child.
platform::OnceFlag g_init;

// --- caches refreshed by the feedback thread ---
// Re-reads each mapped device's limit; true if any is limited.
bool update_caches() noexcept {
  bool any = false;
  for (LaunchDevice& d : g_dev) {
    if (d.state == nullptr) continue;
    const bool limited = limiter::is_limited(*d.state);
    d.limited.store(limited ? 1 : 0, std::memory_order_relaxed);
    d.calibrated.store(limiter::scale_updated_ns(*d.state).load(std::memory_order_relaxed) != 0 ? 1 : 0,
                       std::memory_order_relaxed);
    any = any || limited;
  }
  if (priority_refresh()) any = true;  // priority needs admission even without a limit (docs/priority.md)
  return any;
}

void refresh_caches() noexcept {
  const bool any = update_caches();
  // Only ever moves between the two initialised modes: a forked child resets
  // to cold itself, and has no feedback thread until it initialises again.
  int mode = g_mode.load(std::memory_order_relaxed);
  if (mode != kModeCold)
    g_mode.compare_exchange_strong(mode, any ? kModeLimited : kModeUnlimited, std::memory_order_release);
}

std::uint32_t used_entries() noexcept { return g_used_entries.load(std::memory_order_relaxed); }

void warn_feedback(const char* message) noexcept { GPUSLICE_WARN_CAPPED(4, "%s", message); }

bool load_nvml_api(limiter::NvmlApi* api) noexcept {
  if (!load_nvml()) return false;
  api->init = real_nvmlInit_v2;
  api->handle_by_uuid = real_nvmlDeviceGetHandleByUUID;
  api->running_processes = real_nvmlDeviceGetComputeRunningProcesses_v3;
  api->process_utilization = real_nvmlDeviceGetProcessUtilization;
  return api->init != nullptr && api->handle_by_uuid != nullptr && api->process_utilization != nullptr;
}

// A thread's credit (ThreadCounts::credit) goes back to the buckets when it
// exits (set_thread_exit: the hook's thread-exit key, account.cc). The
// thread that calls exit() gives its own back in the atexit handler below;
// threads still running at exit keep theirs (at most limiter::kAheadMaxNs
// each per device, which the controller's true-up refunds where the device
// is measured).
void return_credit() noexcept {
  if (t_credit_owner == 0) return;  // took none since it was last given back
  // Only credit this process took: a child forked without our handlers
  // carries its parent's, which the parent still holds.
  const bool ours = t_credit_owner == static_cast<std::uint32_t>(getpid());
  for (unsigned i = 0; i < kMaxDevices; ++i) {
    ThreadCounts& tc = t_counts[i];
    if (ours && tc.credit > 0 && g_dev[i].state != nullptr) limiter::refund(*g_dev[i].state, tc.credit);
    tc.credit = 0;
  }
  t_credit_owner = 0;  // credit taken after this (another key's destructor launching) arms it again
}

void after_fork_in_child() noexcept {
  // The forking thread's credit was taken by the parent, which keeps it.
  for (ThreadCounts& tc : t_counts) tc.credit = 0;
  t_credit_owner = 0;
  // CUDA does not survive fork(): the child starts the launch path afresh
  // (and with it its own feedback thread) on its first launch.
  g_mode.store(kModeCold, std::memory_order_relaxed);
  g_init.reset();
  for (LaunchDevice& d : g_dev) {
    reset_queue_after_fork(d);
    d.used.store(0, std::memory_order_relaxed);  // the child has launched nothing yet
  }
  g_used_entries.store(0, std::memory_order_relaxed);
  forget_all_streams();
}

// At exit, before the libraries' static destructors (NVML's among them) run
// under the feedback thread's feet: atexit handlers registered after start-up
// run before the loader's destructor pass. A process that launched on a
// limited device is recorded as departed: the work it leaves queued is still
// measured as the container's once it runs (limiter/compute_feedback.h).
void stop_feedback_at_exit() noexcept {
  return_credit();  // the exiting thread's: no key destructor runs for it
  limiter::stop_feedback_thread();
  if (g_used_entries.load(std::memory_order_relaxed) == 0 || g_ready.load(std::memory_order_acquire) != kReadyYes)
    return;
  Region* region = g_process.region;
  if (region == nullptr) return;
  const auto self = static_cast<std::uint32_t>(getpid());
  std::uint32_t nvml_pid = self;  // NVML's pid: the host's, when the agent has told us
  const int slot = g_process.slot.load(std::memory_order_acquire);
  if (slot >= 0 && static_cast<unsigned>(slot) < kMaxSlots) {
    const std::uint32_t host = region->slots[slot].host_pid.load(std::memory_order_relaxed);
    if (host != 0) nvml_pid = host;
  }
  limiter::record_departure(region, nvml_pid, self, mono_ns());
}

void start_feedback() noexcept;

CUresult init_now() noexcept {
  static std::atomic<bool> handlers_registered{false};
  if (!handlers_registered.exchange(true)) {
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
    std::atexit(stop_feedback_at_exit);
    set_thread_exit(return_credit);
  }
  const bool markers = markers_available();
  int count = 0;
  if (real_cuDeviceGetCount == nullptr || real_cuDeviceGetCount(&count) != CUDA_SUCCESS || count <= 0) {
    // A launch before cuInit (it fails in the driver anyway): try again at
    // the next launch rather than settle for "no devices".
    g_init.reset();
    return CUDA_SUCCESS;
  }
  if (count > static_cast<int>(kMaxDevices)) count = static_cast<int>(kMaxDevices);
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    LaunchDevice& d = g_dev[ordinal];
    const int entry = device_entry(ordinal);
    if (entry < 0) continue;
    int sms = 0;
    if (real_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal) != CUDA_SUCCESS || sms <= 0)
      sms = 1;
    d.sm_recip = limiter::sm_reciprocal(static_cast<std::uint32_t>(sms));
    d.entry = entry;
    d.state = &g_process.region->devices[entry];
    if (!markers) forget_queue(d);
  }
  if (!markers)
    GPUSLICE_LOG(warn, "the driver has no usable event API; the compute limiter runs without its queue bound");
  g_single_ordinal.store(count == 1 ? 0 : -1, std::memory_order_relaxed);
  // Publishes everything above to the launching threads (they acquire g_mode).
  const bool limited = update_caches();
  g_mode.store(limited ? kModeLimited : kModeUnlimited, std::memory_order_release);
  g_init.complete();
  // No compute limit on any device: no feedback thread and no NVML (issue 9);
  // unlimited launches look for a limit set later (recheck_limits).
  if (!limited && !priority_board_present()) return CUDA_SUCCESS;
  start_feedback();
  return CUDA_SUCCESS;
}

void start_feedback() noexcept {
  limiter::FeedbackHost host;
  host.region = g_process.region;
  host.load_nvml = load_nvml_api;
  host.refresh = refresh_caches;
  host.entries = used_entries;
  host.warn = warn_feedback;
  host.mono_ns = mono_ns;
  host.real_us = platform::realtime_us;
  if (!limiter::ensure_feedback_thread(host))
    GPUSLICE_LOG(warn,
                 "cannot start the compute feedback thread; limits hold on estimates alone and run-time "
                 "limit changes are not seen");
}

}  // namespace

[[gnu::tls_model("initial-exec")]] constinit thread_local std::uint32_t t_unlimited_launches = 0;

bool recheck_limits() noexcept {
  // Only the region's limit words (a few loads): the priority board is the
  // feedback thread's to watch (it runs wherever a board exists).
  bool any = false;
  for (const LaunchDevice& d : g_dev) any = any || (d.state != nullptr && limiter::is_limited(*d.state));
  if (!any || !update_caches()) return false;
  int mode = kModeUnlimited;
  g_mode.compare_exchange_strong(mode, kModeLimited, std::memory_order_release);
  start_feedback();  // once per process: the feedback owner keeps the limit accurate
  return true;
}

[[gnu::tls_model("initial-exec")]] constinit thread_local std::uint32_t t_credit_owner = 0;

// At a thread's first credit. If the thread-exit key cannot be armed, this
// thread's credit stays taken when it ends (at most limiter::kAheadMaxNs per
// device: conservative, and trued up by the controller).
void arm_credit_return() noexcept {
  t_credit_owner = static_cast<std::uint32_t>(getpid());
  arm_thread_exit();
}

CUresult init_launch_path() noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (g_init.claim()) return init_now();
  // Another thread is initialising (a few driver queries, no loader lock),
  // or gave up because the driver has no device yet.
  g_init.wait();
  return CUDA_SUCCESS;
}

}  // namespace gpuslice::hook::launch
