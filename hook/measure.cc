// Measuring what the driver takes implicitly (measure.h): the counting
// operations' counters, the gate that holds them back during a measurement,
// and NVML's usage of this process before and after the measured call.
// gpuslice: hot path (no heap, no locks)
#include "hook/measure.h"

#include <linux/futex.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <new>

#include "hook/config.h"
#include "hook/log.h"
#include "hook/no_destroy.h"
#include "hook/process.h"
#include "hook/real.h"
#include "hook/region.h"
#include "limiter/lease.h"
#include "platform/clock.h"
#include "platform/once.h"
#include "platform/procfs.h"
#include "platform/uuid.h"

namespace gpuslice::hook {

alignas(64) std::atomic<std::uint64_t> g_counting_ops{0};
std::atomic<int> g_counting_state{0};
OpCounter g_op_counters[kOpCounters];
[[gnu::tls_model("initial-exec")]] constinit thread_local OpThread t_op{nullptr, kNoEpoch};

bool counting_init() noexcept {
  const options::Options& o = config().options;
  bool quota = false;
  for (std::uint32_t d = 0; d < kMaxDevices && !quota; ++d) quota = o.memory_limit[d] != kUnlimited;
  // Per-thread counters only where the measurer can issue its barrier (measure.h).
  const int saved_errno = errno;
  const bool barrier = quota && syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  errno = saved_errno;
  // A quota set later at run time (gpuslice-smi set) is measured from the next
  // process on; this one keeps counting contexts by the difference alone.
  g_counting_state.store(!quota ? 1 : barrier ? 2 : 3, std::memory_order_relaxed);
  return quota;
}

// A thread's first counting operation (and its first in a forked child)
// takes a free counter, or one whose owner is gone: a thread that exited, or
// any thread of the parent a forked child inherited the counters from.
std::atomic<std::uint64_t>* claim_op_counter() noexcept {
  std::atomic<std::uint64_t>* mine = &g_counting_ops;
  const int saved_errno = errno;  // the caller's errno survives our syscalls
  const std::uint64_t epoch = platform::table_detail::process_epoch();
  if (g_counting_state.load(std::memory_order_relaxed) == 2) {
    const std::uint64_t me = (epoch << 32) | static_cast<std::uint32_t>(syscall(SYS_gettid));
    for (int pass = 0; pass < 2 && mine == &g_counting_ops; ++pass) {
      for (OpCounter& c : g_op_counters) {
        std::uint64_t owner = c.owner.load(std::memory_order_relaxed);
        if (pass == 0 ? owner != 0 : owner == 0 || op_counter_owner_alive(owner)) continue;
        if (!c.owner.compare_exchange_strong(owner, me, std::memory_order_acquire)) continue;
        // An owner that died inside an operation left it odd: even it again
        // (an increase, so a measurement spanning it is not taken as exact).
        const std::uint64_t v = c.ops.load(std::memory_order_relaxed);
        if (v & 1) c.ops.store(v + 1, std::memory_order_release);
        mine = &c.ops;
        break;
      }
    }
  }
  errno = saved_errno;
  // The counter before the epoch that vouches for it: a signal handler's
  // counting operation on this thread in between claims again, never
  // takes a null counter.
  t_op.counter = mine;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_op.epoch = mine == &g_counting_ops ? epoch | kSharedEpoch : epoch;
  return mine;
}

std::atomic<std::uint64_t>* begin_op_slow() noexcept {
  const std::uint64_t seen = t_op.epoch;
  const std::uint64_t word =
      platform::table_detail::g_epoch_word.load(std::memory_order_acquire)->load(std::memory_order_relaxed);
  std::atomic<std::uint64_t>* c;
  if (word != 0 && seen == (word | kSharedEpoch)) {
    c = &g_counting_ops;  // this thread counts in the shared word, in this process
  } else if (word != 0 && seen == word) {
    // Matched meanwhile: a signal handler's operation on this thread claimed
    // between the inline compare and here.
    std::atomic_signal_fence(std::memory_order_seq_cst);
    c = t_op.counter;
  } else {
    c = claim_op_counter();
  }
  if (c == &g_counting_ops) {
    g_counting_ops.fetch_add(1, std::memory_order_seq_cst);
    if (__builtin_expect(g_measure_gate.load(std::memory_order_seq_cst) != 0, 0)) wait_measure_gate(c);
  } else {
    c->store(c->load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (__builtin_expect(g_measure_gate.load(std::memory_order_relaxed) != 0, 0)) wait_measure_gate(c);
  }
  return c;
}

bool op_counter_owner_alive(std::uint64_t owner) noexcept {
  if ((owner >> 32) != (platform::table_detail::process_epoch() & 0xffffffffu)) return false;  // a parent's
  const int saved_errno = errno;
  const bool gone = syscall(SYS_tgkill, getpid(), static_cast<pid_t>(owner & 0xffffffffu), 0) != 0 && errno == ESRCH;
  errno = saved_errno;
  return !gone;
}

namespace {

NoDestroy<MeasureMutex> g_create_mu;  // one measurement at a time (context.cc takes it after g_primary_mu)
// The thread that holds the gate closed: its own counting operations (a
// driver calling back into a hooked entry point) must not wait for it.
[[gnu::tls_model("initial-exec")]] constinit thread_local bool t_measuring = false;

std::uint64_t committed_on(int entry) noexcept {
  const int slot = g_process.slot.load(std::memory_order_acquire);
  if (entry < 0 || slot < 0 || g_process.region == nullptr) return 0;
  // In use only: allocations served from the spare quota lease move NVML's
  // count but not committed_bytes (limiter/lease.h).
  const Slot& s = g_process.region->slots[slot];
  const std::uint64_t committed = s.committed_bytes[entry].load(std::memory_order_acquire);
  const std::uint64_t lease = s.lease[entry].word.load(std::memory_order_acquire);
  const std::uint64_t not_used = limiter::lease_spare(lease) + limiter::lease_owed(lease);
  return committed > not_used ? committed - not_used : 0;
}

std::uint32_t host_pid() noexcept {
  static std::atomic<std::uint32_t> cached{0};
  std::uint32_t pid = cached.load(std::memory_order_relaxed);
  if (pid != 0) return pid;
  // NVML reports host pids: the first NSpid field is our pid in the
  // outermost namespace this /proc can see (read without stdio: no heap).
  platform::procfs::NsPids ids{};
  if (platform::procfs::read_nspid(0, &ids) != 0) return 0;
  cached.store(ids.outermost, std::memory_order_relaxed);
  return ids.outermost;
}

// This process's device usage on `ordinal` according to NVML, or false.
// *graphics (when given): NVML also lists the process with a graphics
// context there (memory a graphics API allocates and frees without a CUDA
// call: see measured_bytes).
bool nvml_usage(CUdevice ordinal, std::uint64_t* out, bool* graphics = nullptr) noexcept {
  // No memory quota on this device: nothing to enforce, NVML stays untouched (issue 9).
  const int entry = device_entry(ordinal);
  if (entry < 0 || g_process.region->devices[entry].quota_bytes.load(std::memory_order_relaxed) == kUnlimited)
    return false;
  // done: NVML usable; failed: unusable (nothing is measured).
  static constinit platform::OnceFlag nvml_once;
  if (nvml_once.claim()) {
    const bool ok = load_nvml() && real_nvmlInit_v2 != nullptr && real_nvmlDeviceGetHandleByUUID != nullptr &&
                    real_nvmlDeviceGetComputeRunningProcesses_v3 != nullptr && real_nvmlInit_v2() == NVML_SUCCESS;
    if (ok)
      nvml_once.complete();
    else
      nvml_once.fail();
  }
  // Another thread loading NVML: wait for it, bounded (1 s), else measure nothing.
  if (nvml_once.wait(platform::monotonic_ns, 1'000'000'000) != platform::OnceFlag::kDone) return false;
  CUuuid u{};
  if (real_cuDeviceGetUuid_v2(&u, ordinal) != CUDA_SUCCESS) return false;
  char uuid[platform::kUuidTextSize];
  platform::format_uuid(reinterpret_cast<const std::uint8_t*>(u.bytes), uuid);
  nvmlDevice_t dev{};
  if (real_nvmlDeviceGetHandleByUUID(uuid, &dev) != NVML_SUCCESS) return false;
  nvmlProcessInfo_t procs[256];
  unsigned int count = 256;
  if (real_nvmlDeviceGetComputeRunningProcesses_v3(dev, &count, procs) != NVML_SUCCESS) return false;
  const std::uint32_t me = host_pid();
  *out = 0;
  for (unsigned i = 0; i < count && i < 256; ++i) {
    if (procs[i].pid == me) {
      *out = procs[i].usedGpuMemory;
      break;
    }
  }
  if (graphics != nullptr) {
    *graphics = false;
    count = 256;
    if (real_nvmlDeviceGetGraphicsRunningProcesses_v3 != nullptr &&
        real_nvmlDeviceGetGraphicsRunningProcesses_v3(dev, &count, procs) == NVML_SUCCESS) {
      for (unsigned i = 0; i < count && i < 256; ++i) *graphics = *graphics || procs[i].pid == me;
    }
  }
  return true;  // not listed: holds nothing yet
}

}  // namespace

MeasureMutex& measure_mutex() noexcept { return *g_create_mu; }

// The sum of every count of counting operations (measure.h), read after a
// barrier in every thread of the process; *busy when one is in flight
// (counters of exited threads left odd do not count). False when the
// barrier cannot be issued: nothing then proves a measurement undisturbed.
static bool read_op_counts(std::uint64_t* sum, bool* busy) noexcept {
  const bool per_thread = g_counting_state.load(std::memory_order_relaxed) == 2;
  if (per_thread && syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0) return false;
  std::uint64_t total = g_counting_ops.load(std::memory_order_seq_cst);
  bool in_flight = (total & 0xffffffffu) != 0;
  if (per_thread) {
    for (OpCounter& c : g_op_counters) {
      const std::uint64_t v = c.ops.load(std::memory_order_acquire);
      total += v;
      if ((v & 1) != 0 && op_counter_owner_alive(c.owner.load(std::memory_order_relaxed))) in_flight = true;
    }
  }
  *sum = total;
  *busy = in_flight;
  return true;
}

// Read by every counting operation, written only by measurements: a line of its own.
alignas(64) constinit std::atomic<std::uint32_t> g_measure_gate{0};
// modules.cc's uses found placed and drops (measure.h): a line of their own.
alignas(64) constinit std::atomic<std::uint32_t> g_placed_uses{0};
constinit std::atomic<std::uint32_t> g_drops_in_flight{0};

// Waiting at the gate and for operations in flight blocks, never spins: a
// spinning waiter burns the container's CPU quota for as long as a
// measurement lasts (seconds, when an operation in flight waits for the
// device). The gate's waiters sleep on the gate word (a private futex: the
// gate is the process's own); the measurer wakes them when it opens it.
static std::uint32_t* gate_word() noexcept { return reinterpret_cast<std::uint32_t*>(&g_measure_gate); }

void MeasureMutex::unlock() noexcept {
  if (t_measuring) {
    g_measure_gate.store(0, std::memory_order_seq_cst);
    t_measuring = false;
    const int saved_errno = errno;
    syscall(SYS_futex, gate_word(), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    errno = saved_errno;
  }
  mu_.unlock();
}

// Sleeps while the gate holds `closed`, until it changes, a wake, or
// monotonic time `until`.
static void sleep_on_gate(std::uint32_t closed, std::uint64_t until) noexcept {
  const std::uint64_t now = platform::monotonic_ns();
  if (now >= until) return;
  const std::uint64_t left = until - now;
  timespec ts{static_cast<time_t>(left / 1'000'000'000), static_cast<long>(left % 1'000'000'000)};
  syscall(SYS_futex, gate_word(), FUTEX_WAIT_PRIVATE, closed, &ts, nullptr, 0);
}

// A child forked while another thread measured would find the gate closed
// and the mutex held forever (no thread of the child measures): both start
// anew there. Registered at the first measurement (pthread_atfork may
// allocate: never during bootstrap).
static void measure_reset_in_child() noexcept {
  g_measure_gate.store(0, std::memory_order_relaxed);
  // A library is placed measured before any use finds it placed, so this
  // handler is registered before a use can be in flight in another thread.
  g_placed_uses.store(0, std::memory_order_relaxed);
  g_drops_in_flight.store(0, std::memory_order_relaxed);
  t_measuring = false;
  new (&*g_create_mu) MeasureMutex;
}
static std::atomic<bool> g_measure_atfork{false};

void wait_measure_gate(std::atomic<std::uint64_t>* c) noexcept {
  if (t_measuring) return;  // the measurer's own thread (measured call calling back)
  const int saved_errno = errno;
  const std::uint64_t give_up = platform::monotonic_ns() + 4 * kDrainNs;  // a measurement stuck in the driver
  for (;;) {
    // Take the mark back: this operation has not touched the driver.
    if (c == &g_counting_ops)
      g_counting_ops.fetch_sub(1, std::memory_order_seq_cst);
    else
      c->store(c->load(std::memory_order_relaxed) - 1, std::memory_order_release);
    for (std::uint32_t closed;
         (closed = g_measure_gate.load(std::memory_order_acquire)) != 0 && platform::monotonic_ns() < give_up;)
      sleep_on_gate(closed, give_up);
    if (c == &g_counting_ops) {
      g_counting_ops.fetch_add(1, std::memory_order_seq_cst);
      if (g_measure_gate.load(std::memory_order_seq_cst) == 0) break;
    } else {
      c->store(c->load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      std::atomic_signal_fence(std::memory_order_seq_cst);
      if (g_measure_gate.load(std::memory_order_relaxed) == 0) break;
    }
    if (platform::monotonic_ns() >= give_up) break;  // go on: the measurement sees us and is not exact
  }
  errno = saved_errno;
}

// The measurer's wait for operations in flight (they take microseconds, a
// synchronisation or a destroy as long as the device's work): polls the op
// counters with a sleep that doubles from 10 us to 1 ms until none is in
// flight or `ns` passed; true when quiet. *ops gets their counts as last
// read. Each poll costs a membarrier and a read of the counters, so a long
// wait costs about 1 % of a CPU.
static bool drain_ops(std::uint64_t ns, std::uint64_t* ops) noexcept {
  bool busy = true, readable = false;
  const std::uint64_t deadline = platform::monotonic_ns() + ns;
  platform::Backoff backoff(10'000, 1'000'000);
  while ((readable = read_op_counts(ops, &busy)) && busy && platform::monotonic_ns() < deadline) backoff.pause();
  return readable && !busy;
}

bool close_gate_and_drain(std::uint64_t* ops_out) noexcept {
  const int saved_errno = errno;
  if (!g_measure_atfork.exchange(true, std::memory_order_acq_rel))
    pthread_atfork(nullptr, nullptr, measure_reset_in_child);
  // Close the gate (counting operations starting from now on wait), then let
  // those already in flight finish (bounded: they take microseconds, but a
  // synchronisation or a destroy waits for the device's work).
  if (counting_on()) {
    t_measuring = true;
    g_measure_gate.store(1, std::memory_order_seq_cst);
  }
  std::uint64_t ops = 0;
  const bool quiet = drain_ops(kDrainNs, &ops);
  errno = saved_errno;
  if (ops_out != nullptr) *ops_out = ops;
  return counting_on() && quiet;  // without the bracket nothing proves quiet
}

CUresult gated_call(const char* what, CUresult (*fn)(void* ctx) noexcept, void* ctx) noexcept {
  std::lock_guard<MeasureMutex> gate(*g_create_mu);
  if (!close_gate_and_drain(nullptr) && counting_on())
    GPUSLICE_WARN_CAPPED(3, "%s: an operation stayed in flight for 2 s; it went on without waiting for it", what);
  return fn(ctx);
}

Measure measure_before(CUdevice ordinal) noexcept {
  Measure m{};
  m.quiet = close_gate_and_drain(&m.ops);
  m.committed = committed_on(device_entry(ordinal));
  m.nvml = nvml_usage(ordinal, &m.before, &m.graphics);
  return m;
}

// Waits (bounded) until no counting operation of the process is in flight;
// true when none is. The gate stays as it is (closed by a measurement).
static bool wait_quiet(std::uint64_t ns) noexcept {
  const int saved_errno = errno;
  std::uint64_t ops = 0;
  const bool quiet = drain_ops(ns, &ops);
  errno = saved_errno;
  return quiet;
}

std::uint64_t measured_bytes(CUdevice ordinal, int entry, const Measure& m, std::atomic<std::uint64_t>* remembered,
                             bool* exact_out, std::uint64_t prepaid) noexcept {
  if (exact_out != nullptr) *exact_out = false;
  std::uint64_t after = 0;
  bool graphics = m.graphics;
  if (!m.nvml || !nvml_usage(ordinal, &after, graphics ? nullptr : &graphics)) return 0;
  std::uint64_t ops_now = 0;
  bool busy = true;
  const int saved_errno = errno;
  const bool exact = m.quiet && read_op_counts(&ops_now, &busy) && ops_now == m.ops;
  errno = saved_errno;
  const std::uint64_t raw = after > m.before ? after - m.before : 0;
  if (exact && graphics) {
    // NVML lists the process with a graphics context (before or after): a
    // graphics API of the process may have freed memory meanwhile with no
    // CUDA call (vkFreeMemory in another thread), which leaves the
    // difference short by it, or allocated some (counted in the object:
    // docs/memory-accounting.md). Never below the remembered size, and not
    // remembered; waiting cannot tell (the process's other graphics memory
    // is beyond its count too).
    const std::uint64_t floor = remembered != nullptr ? remembered->load(std::memory_order_relaxed) : 0;
    return raw > floor ? raw : floor;
  }
  if (exact) {
    if (raw != 0 && remembered != nullptr) remembered->store(raw, std::memory_order_relaxed);
    if (exact_out != nullptr) *exact_out = true;
    return raw;
  }
  // Disturbed: an operation stayed in flight past kDrainNs (or, past its
  // own wait, ran meanwhile). The difference can then be short by whatever
  // such an operation released inside the call and had not settled in our
  // count by now, so neither it nor the figures below are trusted alone.
  std::uint64_t fallback = 0;
  if (remembered != nullptr) fallback = remembered->load(std::memory_order_relaxed);
  if (fallback == 0) {
    // What our own counted operations moved meanwhile, taken out.
    const std::int64_t moved = static_cast<std::int64_t>(committed_on(entry) - m.committed);
    const std::int64_t corrected = static_cast<std::int64_t>(raw) - moved;
    fallback = corrected > 0 ? static_cast<std::uint64_t>(corrected) : 0;
  }
  // Settle: the gate is still closed (the caller holds measure_mutex()), so
  // wait for the operations in flight to finish and their counts to settle,
  // then take what the process holds beyond everything counted for it (less
  // what was already reserved for this object: `prepaid`) as this object's
  // size, if that is more. At that quiet moment the process's count then
  // covers all it holds on the device: never short. An operation still in
  // flight after kSettleNs (a driver call that does not return) leaves the
  // same figure taken now; it is warned about.
  // Meanwhile the object is counted at the fallback (taken back before the
  // caller charges what this returns), so the wait delays no count.
  const std::uint64_t interim = fallback > prepaid ? fallback - prepaid : 0;
  const bool held_interim = interim != 0 && charge(entry, interim);
  std::uint64_t now = after;
  const bool quiet = wait_quiet(kSettleNs);
  if (!quiet)
    GPUSLICE_WARN_CAPPED(3,
                         "a measurement of implicit device memory waited %llu s for an operation in flight; "
                         "counted what the process held beyond its count then",
                         static_cast<unsigned long long>((kDrainNs + kSettleNs) / 1'000'000'000));
  if (!nvml_usage(ordinal, &now)) now = after;
  std::uint64_t counted = committed_on(entry);
  if (held_interim) {
    counted = counted > interim ? counted - interim : 0;
    release(entry, interim);
  }
  const std::uint64_t others = counted > prepaid ? counted - prepaid : 0;
  const std::uint64_t beyond = now > others ? now - others : 0;
  return beyond > fallback ? beyond : fallback;
}

}  // namespace gpuslice::hook
