// The count direction's excuses (monitor.h: monitor_call_begin/end,
// monitor_outside_begin/end; README.md, "The invariant monitor"): what the
// device may hold beyond gpuslice's count in a process without a miscount.
// gpuslice's promise is about calls that have returned: memory a driver call
// makes inside a call the library wraps (a context, a module's placement,
// measured after the driver's call) may be uncounted until that call
// returns, however long the process waits for a CPU in between. A program
// that brackets its calls (FAKECUDA_MONITOR_CALLS=1) has the bytes its
// threads were granted inside calls still in flight excused, and any other
// deficit judged at once; memory it holds outside CUDA (a graphics
// allocation before its import: the library cannot know of it) is excused
// by its bytes while it says so; memory a graphics free took out of a
// measurement (monitor_measured_short) by those bytes; a process in its exit
// handlers (gpuslice gives its count back before the driver frees its
// memory at the process's end) by all it holds; a dead process whose files
// another task still releases by all it holds, for the lag (released_excused).
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

#include "fakecuda_query.h"
#include "monitor.h"
#include "monitor_internal.h"
#include "platform/procfs.h"

namespace gpuslice::chaos {
using namespace internal;

namespace {

// The calling thread's calls in flight (nested) and the bytes granted to it
// inside them, per device, not yet given back to MonitorShared::in_calls.
thread_local int t_depth = 0;
thread_local int t_call_slot = -1;  // the slot the bytes were added to (a forked child's copy is not its own)
thread_local std::uint64_t t_call_bytes[kSimDevices];
thread_local std::uint64_t t_call_implicit[kSimDevices];  // of those, implicit grants
std::atomic<pid_t> g_attached_pid{0};  // a forked child that calls exit() is not the process that attached

void mark_exiting() {
  if (g_config.on && g_shared != nullptr && g_slot >= 0 && getpid() == g_attached_pid.load(std::memory_order_relaxed))
    g_shared->exiting[g_slot].store(1, std::memory_order_release);
}

}  // namespace

void internal::calls_attach(int slot) {
  for (auto& bytes : g_shared->in_calls[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->in_calls_implicit[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->outside[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->measured_short[slot]) bytes.store(0, std::memory_order_relaxed);
  g_shared->exiting[slot].store(0, std::memory_order_relaxed);
  g_attached_pid.store(getpid(), std::memory_order_relaxed);
  // atexit handlers run in the reverse order of their registration, and the
  // loader's destructor pass (gpuslice's release_at_exit among them) was
  // registered before main: this runs first.
  std::atexit(mark_exiting);
}

void internal::note_call_charge(unsigned dev, std::uint64_t bytes, bool implicit) {
  if (t_depth == 0 || dev >= kSimDevices || bytes == 0) return;
  if (t_call_slot != g_slot) {  // the first grant of this call (or a child's stale copy)
    for (auto& b : t_call_bytes) b = 0;
    for (auto& b : t_call_implicit) b = 0;
    t_call_slot = g_slot;
  }
  t_call_bytes[dev] += bytes;
  g_shared->in_calls[g_slot][dev].fetch_add(bytes, std::memory_order_relaxed);  // state lock held
  if (implicit) {
    t_call_implicit[dev] += bytes;
    g_shared->in_calls_implicit[g_slot][dev].fetch_add(bytes, std::memory_order_relaxed);
  }
}

std::uint64_t internal::count_excused(int slot, std::uint32_t dev, std::uint64_t held, Excused* parts) {
  if (parts != nullptr) ++parts->processes;
  if (g_shared->exiting[slot].load(std::memory_order_acquire) != 0) {
    if (parts != nullptr) parts->exiting += held;
    return held;
  }
  const std::uint64_t calls = g_shared->in_calls[slot][dev].load(std::memory_order_acquire);
  const std::uint64_t implicit = g_shared->in_calls_implicit[slot][dev].load(std::memory_order_acquire);
  const std::uint64_t outside = g_shared->outside[slot][dev].load(std::memory_order_acquire);
  const std::uint64_t short_by = g_shared->measured_short[slot][dev].load(std::memory_order_acquire);
  if (parts != nullptr) {
    parts->calls += calls;
    parts->implicit_calls += implicit;
    parts->outside += outside;
    parts->measured_short += short_by;
  }
  return calls + outside + short_by;
}

// Dead by the liveness rule's /proc facts (shm::judge_liveness: gone, or a
// zombie that is the last of its threads), its simulator slot still held:
// another task holds a reference to its files and releases them — a reader
// of /proc/<pid>/stat that held its mm at its last thread's exit_mm, or a
// child it forked, at its exit. The kernel releases one task's last
// references one at a time (task_work, in reverse order of their last
// fput: mappings by address, descriptors by number), and may reschedule
// between two, so the region's description, whose lock is the slot's
// liveness (shm::lock_slot_file), may go before the driver's, whose release
// frees the memory: gpuslice reaps while the device still holds it (seed
// 1,154,803). The real driver's files (mapped too) go the same way. Bounded
// by that task's release: excused for at most the lag after a check first
// found it; never while the region slot gpuslice gave it is left with its
// lock held (a task holds its region description: reaped too early).
std::uint64_t internal::released_excused(int slot, std::uint32_t pid, std::uint32_t generation, std::uint64_t bytes) {
  platform::procfs::Stat st;
  const int err = platform::procfs::read_stat(pid, &st);
  const bool dead = err == ENOENT || err == ESRCH ||
                    (err == 0 && (st.state == 'Z' || st.state == 'X' || st.state == 'x') && st.num_threads <= 1);
  if (!dead || region_lock_still_held(slot, pid)) {
    g_shared->released_since_ns[slot].store(0, std::memory_order_relaxed);
    return 0;
  }
  const std::uint64_t now = fakecuda_now_ns();
  std::uint64_t since = g_shared->released_since_ns[slot].load(std::memory_order_relaxed);
  if (since == 0 || g_shared->released_generation[slot].load(std::memory_order_relaxed) != generation) {
    since = now;
    g_shared->released_generation[slot].store(generation, std::memory_order_relaxed);
    g_shared->released_since_ns[slot].store(since, std::memory_order_relaxed);
  }
  return now - since <= g_config.lag_ns ? bytes : 0;
}

int internal::live_processes(std::uint32_t dev) {
  int n = 0;
  const int high = fakecuda_slots_high_locked();
  for (int i = 0; i < high; ++i) {
    fakecuda_slot_info slot{};
    if (member_alive(i, dev, &slot)) ++n;
  }
  return n;
}

void monitor_call_begin() { ++t_depth; }

void monitor_call_end() {
  if (t_depth == 0 || --t_depth != 0) return;
  if (t_call_slot < 0 || t_call_slot != g_slot || g_shared == nullptr) return void(t_call_slot = -1);
  // After gpuslice counted what the call made (the call returned): a check
  // that reads this after the count reads the count after it too.
  for (std::uint32_t dev = 0; dev < kSimDevices; ++dev) {
    if (t_call_bytes[dev] != 0) g_shared->in_calls[g_slot][dev].fetch_sub(t_call_bytes[dev], std::memory_order_release);
    t_call_bytes[dev] = 0;
    if (t_call_implicit[dev] != 0)
      g_shared->in_calls_implicit[g_slot][dev].fetch_sub(t_call_implicit[dev], std::memory_order_release);
    t_call_implicit[dev] = 0;
  }
  t_call_slot = -1;
}

void monitor_outside_begin(unsigned dev, std::uint64_t bytes) {
  if (g_config.on && g_slot >= 0 && dev < g_devices)
    g_shared->outside[g_slot][dev].fetch_add(bytes, std::memory_order_release);
}

void monitor_outside_end(unsigned dev, std::uint64_t bytes) {
  if (g_config.on && g_slot >= 0 && dev < g_devices)
    g_shared->outside[g_slot][dev].fetch_sub(bytes, std::memory_order_release);
}

}  // namespace gpuslice::chaos
