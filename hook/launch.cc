// Kernel launches. Every launch path — cuLaunchKernel, cuLaunchKernelEx,
// cooperative launches, their per-thread-stream variants and cuGraphLaunch —
// goes through here, by exported symbol, dlsym or cuGetProcAddress.
//
// Without a compute limit on any device the wrapper is one load, one
// predictable branch and a tail call. With one, admit() prices the launch,
// spends it from the container's shared bucket (limiter/compute.h) and, when
// the bucket is in debt, sleeps; every few launches it also checks the queue
// bound: how much admitted work this process has not seen complete, measured
// by event markers recorded behind the launches. docs/limiter.md has the design.
#include <cuda.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <cstdlib>

#include "hook/log.h"
#include "hook/wrap.h"
#include "limiter/compute.h"
#include "limiter/compute_feedback.h"
#include "limiter/compute_graphs.h"

using namespace gpuslice;
using namespace gpuslice::hook;

namespace {

// --- queue bound (docs/limiter.md "queue bound") ---
constexpr std::uint64_t kQueueCostNs = 20'000'000;     // priced device time in flight
constexpr std::uint64_t kQueueLatencyNs = 50'000'000;  // age of the oldest unfinished marker
constexpr std::uint64_t kQueueLaunches = 1024;         // launches in flight, once calibrated
constexpr std::uint64_t kQueueLaunchesPrior = 4;       // ... while the price is still the prior
constexpr std::uint32_t kCheckEvery = 16;              // launches per thread between checks
constexpr std::uint64_t kCheckCostNs = 1'000'000;      // or this much priced time
constexpr std::uint64_t kMarkerEveryNs = 1'000'000;
constexpr std::uint64_t kQueuePollNs = 200'000;
constexpr unsigned kMarkers = 32;

enum : int { kModeCold = 0, kModeUnlimited = 1, kModeLimited = 2 };
// kModeUnlimited only once bootstrap succeeded and every visible device is
// unlimited: then the wrappers call the driver straight away.
std::atomic<int> g_mode{kModeCold};
std::atomic<int> g_single_ordinal{-1};  // the ordinal when the process sees one device
std::atomic<int> g_init_busy{0};
std::atomic<std::uint32_t> g_used_entries{0};  // entries launched on (feedback thread's work list)

struct Marker {
  CUevent event;
  std::uint64_t recorded_ns;
  std::uint64_t count;  // submitted_count when recorded
  std::uint64_t cost;   // submitted_cost when recorded
};

struct alignas(64) LaunchDevice {
  // Read by every limited launch.
  std::atomic<int> limited{0};
  std::atomic<int> calibrated{0};
  std::atomic<int> used{0};
  int entry = -1;
  DeviceState* state = nullptr;
  std::uint64_t sm_recip = 1;
  // Queue bound, process-local. Counters flushed from threads at checks.
  alignas(64) std::atomic<std::uint64_t> submitted_count{0};
  std::atomic<std::uint64_t> submitted_cost{0};
  std::atomic<std::uint64_t> completed_count{0};
  std::atomic<std::uint64_t> completed_cost{0};
  std::atomic<std::uint64_t> oldest_pending_ns{0};  // 0 = no marker outstanding
  std::atomic<std::uint64_t> last_marker_ns{0};
  std::atomic<std::uint32_t> ring_lock{0};
  std::uint32_t head = 0, tail = 0;  // ring_lock
  Marker ring[kMarkers] = {};        // ring_lock
};
LaunchDevice g_dev[kMaxDevices];

struct ThreadCounts {
  std::uint32_t launches;
  std::uint32_t since_check;
  std::uint64_t cost;
};
[[gnu::tls_model("initial-exec")]] thread_local ThreadCounts t_counts[kMaxDevices];

// Driver entry points used for markers only (not hooked).
decltype(&::cuEventCreate) real_event_create = nullptr;
decltype(&::cuEventRecord) real_event_record = nullptr;
decltype(&::cuEventQuery) real_event_query = nullptr;
decltype(&::cuEventDestroy_v2) real_event_destroy = nullptr;
decltype(&::cuStreamIsCapturing) real_stream_is_capturing = nullptr;

std::uint64_t mono_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}
std::uint64_t real_us() noexcept {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec) / 1000;
}
void sleep_ns(std::uint64_t ns) noexcept {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, &ts) != 0) {
  }
}

// The stream a launch really went to: the per-thread default stream for a
// _ptsz launch on the null stream.
CUstream target_stream(CUstream s, bool ptsz) noexcept { return ptsz && s == nullptr ? CU_STREAM_PER_THREAD : s; }

// Launches into a capturing stream do not run: they are neither throttled nor
// followed by a marker (an event record would become a node of the user's graph).
bool capturing(CUstream s, bool ptsz) noexcept {
  if (real_stream_is_capturing == nullptr) return false;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return real_stream_is_capturing(target_stream(s, ptsz), &status) == CUDA_SUCCESS &&
         status != CU_STREAM_CAPTURE_STATUS_NONE;
}

bool try_lock(LaunchDevice& d) noexcept {
  std::uint32_t expected = 0;
  return d.ring_lock.compare_exchange_strong(expected, 1, std::memory_order_acquire);
}
void unlock(LaunchDevice& d) noexcept { d.ring_lock.store(0, std::memory_order_release); }

void max_store(std::atomic<std::uint64_t>& a, std::uint64_t v) noexcept {
  std::uint64_t cur = a.load(std::memory_order_relaxed);
  while (cur < v && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

// Retires completed markers (oldest first). A marker whose event the driver
// no longer knows (its context was destroyed) counts as complete: the work
// behind it can no longer run.
void poll_markers(LaunchDevice& d) noexcept {
  if (!try_lock(d)) return;
  while (d.head != d.tail) {
    Marker& m = d.ring[d.head % kMarkers];
    const CUresult rc = real_event_query(m.event);
    if (rc == CUDA_ERROR_NOT_READY) break;
    if (rc != CUDA_SUCCESS) m.event = nullptr;
    max_store(d.completed_count, m.count);
    max_store(d.completed_cost, m.cost);
    ++d.head;
  }
  d.oldest_pending_ns.store(d.head != d.tail ? d.ring[d.head % kMarkers].recorded_ns : 0, std::memory_order_relaxed);
  unlock(d);
}

// Without a marker nothing tells us when the work completes: treat everything
// admitted so far as done rather than block on a signal that cannot come.
void forget_queue(LaunchDevice& d) noexcept {
  max_store(d.completed_count, d.submitted_count.load(std::memory_order_relaxed));
  max_store(d.completed_cost, d.submitted_cost.load(std::memory_order_relaxed));
}

void record_marker(LaunchDevice& d, CUstream s, bool ptsz) noexcept {
  if (!try_lock(d)) return;  // another thread is at it; the next check retries
  const std::uint64_t now = mono_ns();
  d.last_marker_ns.store(now, std::memory_order_relaxed);
  if (d.tail - d.head < kMarkers && !capturing(s, ptsz)) {
    Marker& m = d.ring[d.tail % kMarkers];
    if (m.event == nullptr && real_event_create(&m.event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) m.event = nullptr;
    CUresult rc = m.event != nullptr ? real_event_record(m.event, target_stream(s, ptsz)) : CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS) {
      m.recorded_ns = now;
      m.count = d.submitted_count.load(std::memory_order_relaxed);
      m.cost = d.submitted_cost.load(std::memory_order_relaxed);
      if (d.head == d.tail) d.oldest_pending_ns.store(now, std::memory_order_relaxed);
      ++d.tail;
    } else {
      // E.g. the event belongs to another context than the stream: drop it;
      // the next marker creates one in the context current then.
      if (m.event != nullptr) real_event_destroy(m.event);
      m.event = nullptr;
      if (d.head == d.tail) forget_queue(d);
    }
  }
  unlock(d);
}

bool over_queue_bound(LaunchDevice& d, std::uint64_t now) noexcept {
  const std::uint64_t count = d.submitted_count.load(std::memory_order_relaxed) -
                              d.completed_count.load(std::memory_order_relaxed);
  const std::uint64_t cost = d.submitted_cost.load(std::memory_order_relaxed) -
                             d.completed_cost.load(std::memory_order_relaxed);
  const std::uint64_t oldest = d.oldest_pending_ns.load(std::memory_order_relaxed);
  const bool calibrated = d.calibrated.load(std::memory_order_relaxed) != 0;
  return static_cast<std::int64_t>(cost) > static_cast<std::int64_t>(kQueueCostNs) ||
         static_cast<std::int64_t>(count) > static_cast<std::int64_t>(calibrated ? kQueueLaunches : kQueueLaunchesPrior) ||
         (oldest != 0 && now > oldest && now - oldest > kQueueLatencyNs);
}

// Every few launches per thread: publish this thread's counts, retire markers,
// sleep while the queue is over its bound, and say whether a marker is due
// behind this launch.
[[gnu::noinline, gnu::cold]] bool check_queue(LaunchDevice& d, ThreadCounts& tc, CUstream s, bool ptsz) noexcept {
  d.submitted_count.fetch_add(tc.launches, std::memory_order_relaxed);
  d.submitted_cost.fetch_add(tc.cost, std::memory_order_relaxed);
  d.state->launches.fetch_add(tc.launches, std::memory_order_relaxed);
  tc = ThreadCounts{};
  if (d.calibrated.load(std::memory_order_relaxed) == 0 &&
      limiter::scale_updated_ns(*d.state).load(std::memory_order_relaxed) != 0)
    d.calibrated.store(1, std::memory_order_relaxed);
  std::uint64_t now = mono_ns();
  poll_markers(d);
  std::uint64_t slept = 0;
  bool checked_capture = false;
  while (over_queue_bound(d, now)) {
    if (d.oldest_pending_ns.load(std::memory_order_relaxed) == 0) break;  // nothing to wait on: mark first
    if (!checked_capture) {
      checked_capture = true;
      if (capturing(s, ptsz)) break;
    }
    sleep_ns(kQueuePollNs);
    const std::uint64_t after = mono_ns();
    slept += after - now;
    now = after;
    poll_markers(d);
  }
  if (slept != 0) d.state->throttled_ns.fetch_add(slept, std::memory_order_relaxed);
  return d.calibrated.load(std::memory_order_relaxed) == 0 ||
         now - d.last_marker_ns.load(std::memory_order_relaxed) >= kMarkerEveryNs;
}

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
  void* h = nvml_handle();
  api->init = real_nvmlInit_v2;
  api->handle_by_uuid = real_nvmlDeviceGetHandleByUUID;
  api->running_processes = real_nvmlDeviceGetComputeRunningProcesses_v3;
  api->process_utilization = reinterpret_cast<decltype(api->process_utilization)>(
      real_dlsym(h, "nvmlDeviceGetProcessUtilization"));
  return api->init != nullptr && api->handle_by_uuid != nullptr && api->process_utilization != nullptr;
}

void after_fork_in_child() noexcept {
  // CUDA does not survive fork(): the child starts the launch path afresh
  // (and with it its own feedback thread) on its first launch.
  g_mode.store(kModeCold, std::memory_order_relaxed);
  g_init_busy.store(0, std::memory_order_relaxed);
  for (LaunchDevice& d : g_dev) {
    d.head = d.tail = 0;
    for (Marker& m : d.ring) m = Marker{};
    d.oldest_pending_ns.store(0, std::memory_order_relaxed);
    forget_queue(d);
  }
}

template <class T>
void resolve(T* out, const char* name) noexcept {
  *out = reinterpret_cast<T>(real_dlsym(driver_handle(), name));
}

// At exit, before the libraries' static destructors (NVML's among them) run
// under the feedback thread's feet: atexit handlers registered after start-up
// run before the loader's destructor pass.
void stop_feedback_at_exit() noexcept { limiter::stop_feedback_thread(); }

CUresult init_now() noexcept {
  static std::atomic<bool> handlers_registered{false};
  if (!handlers_registered.exchange(true)) {
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
    std::atexit(stop_feedback_at_exit);
  }
  resolve(&real_event_create, "cuEventCreate");
  resolve(&real_event_record, "cuEventRecord");
  resolve(&real_event_query, "cuEventQuery");
  resolve(&real_event_destroy, "cuEventDestroy_v2");
  resolve(&real_stream_is_capturing, "cuStreamIsCapturing");
  const bool markers = real_event_create && real_event_record && real_event_query && real_event_destroy;
  int count = 0;
  if (real_cuDeviceGetCount == nullptr || real_cuDeviceGetCount(&count) != CUDA_SUCCESS || count <= 0) {
    // A launch before cuInit (it fails in the driver anyway): try again at
    // the next launch rather than settle for "no devices".
    g_init_busy.store(0, std::memory_order_release);
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
  if (!markers) GPUSLICE_LOG(warn, "the driver has no usable event API; the compute limiter runs without its queue bound");
  g_single_ordinal.store(count == 1 ? 0 : -1, std::memory_order_relaxed);
  // Publishes everything above to the launching threads (they acquire g_mode).
  g_mode.store(update_caches() ? kModeLimited : kModeUnlimited, std::memory_order_release);
  limiter::FeedbackHost host;
  host.region = g_process.region;
  host.load_nvml = load_nvml_api;
  host.refresh = refresh_caches;
  host.entries = used_entries;
  host.warn = warn_feedback;
  host.mono_ns = mono_ns;
  host.real_us = real_us;
  if (!limiter::ensure_feedback_thread(host))
    GPUSLICE_LOG(warn, "cannot start the compute feedback thread; limits hold on estimates alone and run-time "
                       "limit changes are not seen");
  return CUDA_SUCCESS;
}

[[gnu::noinline, gnu::cold]] CUresult init_launch_path() noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  int expected = 0;
  if (g_init_busy.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return init_now();
  // Another thread is initialising (a few driver queries), or gave up
  // because the driver has no device yet.
  while (g_mode.load(std::memory_order_acquire) == kModeCold && g_init_busy.load(std::memory_order_acquire) != 0)
    sched_yield();
  return CUDA_SUCCESS;
}

struct Ticket {
  LaunchDevice* dev = nullptr;  // null: nothing to settle
  int ordinal = 0;
  std::int64_t cost = 0;
  std::uint32_t kernels = 0;
  bool marker = false;
};

// Admission of one launch (or one graph): `work` is a block count, or when
// `nominal` is set an already-computed nominal_ns. Returns the error to hand
// back (bootstrap failed), else CUDA_SUCCESS with *t filled when charged.
[[gnu::noinline]] CUresult admit(std::uint64_t work, bool nominal, std::uint32_t kernels, CUstream s, bool ptsz,
                                 Ticket* t) noexcept {
  if (__builtin_expect(g_mode.load(std::memory_order_acquire) == kModeCold, 0)) {
    const CUresult rc = init_launch_path();
    if (rc != CUDA_SUCCESS) return rc;
  }
  int ordinal = g_single_ordinal.load(std::memory_order_relaxed);
  if (ordinal < 0) {
    CUdevice dev = 0;
    if (real_cuCtxGetDevice(&dev) != CUDA_SUCCESS) return CUDA_SUCCESS;  // the driver reports it
    ordinal = dev;
  }
  if (static_cast<unsigned>(ordinal) >= kMaxDevices) return CUDA_SUCCESS;
  LaunchDevice& d = g_dev[ordinal];
  if (d.limited.load(std::memory_order_relaxed) == 0) return CUDA_SUCCESS;
  if (__builtin_expect(d.used.load(std::memory_order_relaxed) == 0, 0)) {
    d.used.store(1, std::memory_order_relaxed);
    g_used_entries.fetch_or(1u << d.entry, std::memory_order_relaxed);
  }
  DeviceState& state = *d.state;
  const std::uint64_t nominal_ns = nominal ? work : limiter::nominal_ns(work, d.sm_recip);
  const std::int64_t cost = limiter::price_ns(nominal_ns, state.cost_scale_ppm.load(std::memory_order_relaxed));
  ThreadCounts& tc = t_counts[ordinal];
  tc.launches += kernels;
  tc.cost += static_cast<std::uint64_t>(cost);
  const std::uint32_t every = d.calibrated.load(std::memory_order_relaxed) != 0 ? kCheckEvery : 1;
  if (++tc.since_check >= every || tc.cost >= kCheckCostNs) t->marker = check_queue(d, tc, s, ptsz);
  if (!limiter::spend(state, cost)) {
    if (capturing(s, ptsz)) {
      limiter::refund(state, cost);
      return CUDA_SUCCESS;
    }
    limiter::wait_for_credit(state, mono_ns, sleep_ns);
  }
  t->dev = &d;
  t->ordinal = ordinal;
  t->cost = cost;
  t->kernels = kernels;
  return CUDA_SUCCESS;
}

void settle(const Ticket& t, CUresult rc, CUstream s, bool ptsz) noexcept {
  if (t.dev == nullptr) return;
  if (rc != CUDA_SUCCESS) {
    // Not launched: give the price back and uncount it (this thread's counts
    // may have been flushed since; then the statistics keep one stray launch).
    limiter::refund(*t.dev->state, t.cost);
    ThreadCounts& tc = t_counts[t.ordinal];
    if (tc.launches >= t.kernels && tc.cost >= static_cast<std::uint64_t>(t.cost)) {
      tc.launches -= t.kernels;
      tc.cost -= static_cast<std::uint64_t>(t.cost);
    }
    return;
  }
  if (t.marker) record_marker(*t.dev, s, ptsz);
}

inline bool unlimited() noexcept {
  return __builtin_expect(g_mode.load(std::memory_order_acquire) == kModeUnlimited, 1);
}

inline std::uint64_t blocks(unsigned gx, unsigned gy, unsigned gz) noexcept {
  return std::uint64_t{gx} * gy * gz;
}

template <class Launch>
CUresult gated(std::uint64_t work, bool nominal, std::uint32_t kernels, CUstream s, bool ptsz, Launch&& launch) noexcept {
  Ticket t;
  CUresult rc = admit(work, nominal, kernels, s, ptsz, &t);
  if (rc != CUDA_SUCCESS) return rc;
  rc = launch();
  settle(t, rc, s, ptsz);
  return rc;
}

template <class Launch>
CUresult gated_graph(CUgraphExec g, CUstream s, bool ptsz, Launch&& launch) noexcept {
  limiter::GraphCost cost;
  if (!limiter::graph_costs().find(reinterpret_cast<std::uintptr_t>(g), &cost) || cost.kernels == 0) {
    // Instantiated where we could not price it: one kernel's prior, which the
    // true-up corrects with what the graph measurably used.
    cost.nominal_ns = limiter::kNominalWaveNs;
    cost.kernels = 1;
  }
  return gated(cost.nominal_ns, true, cost.kernels, s, ptsz, launch);
}

}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                unsigned int bx, unsigned int by, unsigned int bz,
                                                unsigned int shmem, CUstream s, void** params, void** extra) {
  if (unlimited()) return real_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  return gated(blocks(gx, gy, gz), false, 1, s, false,
               [&] { return real_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                                     unsigned int gz, unsigned int bx, unsigned int by,
                                                     unsigned int bz, unsigned int shmem, CUstream s,
                                                     void** params, void** extra) {
  if (unlimited()) return real_cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  return gated(blocks(gx, gy, gz), false, 1, s, true,
               [&] { return real_cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params,
                                                  void** extra) {
  if (unlimited() || config == nullptr) return real_cuLaunchKernelEx(config, f, params, extra);
  return gated(blocks(config->gridDimX, config->gridDimY, config->gridDimZ), false, 1, config->hStream, false,
               [&] { return real_cuLaunchKernelEx(config, f, params, extra); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernelEx_ptsz(const CUlaunchConfig* config, CUfunction f, void** params,
                                                       void** extra) {
  if (unlimited() || config == nullptr) return real_cuLaunchKernelEx_ptsz(config, f, params, extra);
  return gated(blocks(config->gridDimX, config->gridDimY, config->gridDimZ), false, 1, config->hStream, true,
               [&] { return real_cuLaunchKernelEx_ptsz(config, f, params, extra); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                                           unsigned int gz, unsigned int bx, unsigned int by,
                                                           unsigned int bz, unsigned int shmem, CUstream s,
                                                           void** params) {
  if (unlimited()) return real_cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  return gated(blocks(gx, gy, gz), false, 1, s, false,
               [&] { return real_cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                                                unsigned int gz, unsigned int bx, unsigned int by,
                                                                unsigned int bz, unsigned int shmem, CUstream s,
                                                                void** params) {
  if (unlimited()) return real_cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  return gated(blocks(gx, gy, gz), false, 1, s, true,
               [&] { return real_cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphLaunch(CUgraphExec g, CUstream s) {
  if (unlimited()) return real_cuGraphLaunch(g, s);
  return gated_graph(g, s, false, [&] { return real_cuGraphLaunch(g, s); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) {
  if (unlimited()) return real_cuGraphLaunch_ptsz(g, s);
  return gated_graph(g, s, true, [&] { return real_cuGraphLaunch_ptsz(g, s); });
}
