// Memory oversubscription: the policies of oversub.h.
// gpuslice: hot path (no heap, no locks)
#include "hook/oversub.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "hook/config.h"
#include "hook/log.h"
#include "hook/region.h"
#include "limiter/agent_extra.h"
#include "limiter/memory_accounting.h"
#include "platform/clock.h"

namespace gpuslice::hook {

namespace {

constexpr std::uint64_t kWaitSliceNs = 20'000'000;  // re-try at least this often: frees elsewhere wake nobody

std::uint64_t now_ns() noexcept { return platform::monotonic_ns(); }

DeviceState& device(int entry) noexcept { return g_process.region->devices[entry]; }

// Publishes this process's settings for the device in the region (the first
// process to set them wins, like the quota), so that smi and the agent show them.
std::atomic<bool> g_published[kMaxDevices];  // this process published entry's settings

int slot_index() noexcept { return g_process.slot.load(std::memory_order_acquire); }

void publish(int entry) noexcept {
  if (g_published[entry].load(std::memory_order_relaxed)) return;
  g_published[entry].store(true, std::memory_order_relaxed);
  const options::Options& o = config().options;
  const int ordinal = ordinal_of_entry(entry);
  DeviceState& d = device(entry);
  if (ordinal >= 0) {
    std::uint64_t expected = 0;
    const std::uint64_t allowance = o.memory_resident[ordinal];
    if (allowance != kUnlimited) d.resident_limit_bytes.compare_exchange_strong(expected, allowance);
  }
  std::uint32_t none = 0;
  if (o.oversubscribe != options::kOversubscribeFail)
    d.oversub_policy.compare_exchange_strong(none, static_cast<std::uint32_t>(o.oversubscribe));
  // Processes started without the options may hold spare quota leases taken
  // before the allowance was there: spare is not resident, but the resident
  // amount (used - spilled) counts it. Take them back (and stop new ones:
  // a device with an allowance grants none).
  const std::uint64_t limit = d.resident_limit_bytes.load(std::memory_order_seq_cst);
  if (limit != 0 && limit != kUnlimited) limiter::revoke_leases(g_process.region, slot_index(), entry);
}

// Dead processes' memory must not keep the allowance full: reap them before
// refusing, spilling or waiting, as the quota path does, and again while
// waiting (a holder may die meanwhile). At most once per wait slice per
// process: under `spill` being over the allowance is the steady state, and a
// reap costs a slot-lock probe and a /proc read per live slot.
std::atomic<std::uint64_t> g_last_reap_ns{0};

void reap_if_due() noexcept {
  const std::uint64_t now = now_ns();
  std::uint64_t last = g_last_reap_ns.load(std::memory_order_relaxed);
  if (last != 0 && now - last < kWaitSliceNs) return;
  if (!g_last_reap_ns.compare_exchange_strong(last, now, std::memory_order_relaxed)) return;  // another thread reaps
  limiter::reap_dead(g_process.region, g_process.self);
}

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t seen, std::uint64_t ns) noexcept {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000ull), static_cast<long>(ns % 1'000'000'000ull)};
  // Shared futex (no FUTEX_PRIVATE_FLAG): the word is in the region, mapped by every process.
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

// Sleeps until memory of the container is freed (a free bumps the device's
// free generation and wakes it: account.cc), a slice passes or the deadline
// does. Returns false once the deadline has passed.
bool wait_for_memory(int entry, std::uint64_t deadline, bool* counted) noexcept {
  DeviceState& d = device(entry);
  const std::uint64_t now = now_ns();
  if (now >= deadline) return false;
  if (!*counted) {
    d.oversub_waits.fetch_add(1, std::memory_order_relaxed);
    *counted = true;
  }
  // Counted in our slot too: a process killed in here is taken out of the
  // device's count by the reaper.
  const int slot = slot_index();
  limiter::begin_wait(g_process.region, slot, entry);
  const std::uint32_t seen = d.free_generation.load(std::memory_order_seq_cst);
  const std::uint64_t left = deadline - now;
  futex_wait(&d.free_generation, seen, left < kWaitSliceNs ? left : kWaitSliceNs);
  limiter::end_wait(g_process.region, slot, entry);
  d.oversub_wait_ns.fetch_add(now_ns() - now, std::memory_order_relaxed);
  return true;
}

// A wait may outlast a change of the quota (gpuslice-smi set): a reservation
// made under the old quota is on no device yet, so after a wait it reaches
// the driver only while the container, it included, fits the quota in force
// (else it waits on, or times out). Without a wait the driver call follows
// the admission at once, as on every other path.
bool fits_quota(int entry) noexcept {
  const std::uint64_t quota = limiter::quota_bytes(g_process.region, entry);
  return quota == kUnlimited || limiter::used_bytes(g_process.region, entry) <= quota;
}

}  // namespace

bool over_allowance(int entry) noexcept {
  publish(entry);
  DeviceState& d = device(entry);
  const std::uint64_t limit = d.resident_limit_bytes.load(std::memory_order_relaxed);
  if (limit == 0 || limit == kUnlimited) return false;
  // The live agent's extra is memory on the device beyond our count: resident,
  // as admission against the quota counts it (limiter/agent_extra.h).
  const std::uint64_t resident = limiter::resident_bytes(g_process.region, entry);
  const std::uint64_t extra = limiter::agent_extra_in_force(g_process.region, d);
  return resident > limit || extra > limit - resident;
}

CUresult alloc_oversubscribed(limiter::AllocTable& table, const Reservation& r, std::uint64_t* key,
                              limiter::AllocKind kind, RealAllocFn real_alloc, RealAllocFn spill, void* ctx) noexcept {
  const options::Options& o = config().options;
  const std::uint64_t deadline = now_ns() + std::uint64_t{o.oversubscribe_wait} * 1'000'000ull;
  bool waited = false;
  for (;;) {
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    bool over = over_allowance(r.entry);
    if (over) {
      reap_if_due();
      over = over_allowance(r.entry);
    }
    if (!over && waited) over = !fits_quota(r.entry);
    if (!over) {
      rc = real_alloc(ctx);
      if (rc != CUDA_ERROR_OUT_OF_MEMORY) {
        commit(table, rc, r, rc == CUDA_SUCCESS ? *key : 0, kind);
        return rc;
      }
    }
    // The device (or the container's allowance on it) is full.
    if (o.oversubscribe == options::kOversubscribeSpill && spill != nullptr) {
      rc = spill(ctx);
      if (rc == CUDA_SUCCESS) {
        limiter::count_spilled(g_process.region, slot_index(), r.entry, r.bytes);
        commit(table, rc, r, *key, limiter::AllocKind::spilled);
        return rc;
      }
    } else if (o.oversubscribe == options::kOversubscribeWait) {
      if (wait_for_memory(r.entry, deadline, &waited)) continue;
      device(r.entry).oversub_timeouts.fetch_add(1, std::memory_order_relaxed);
    }
    release(r.entry, r.bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
}

bool resident_admits(int entry, bool may_wait) noexcept {
  if (!oversubscribing()) return true;
  const options::Options& o = config().options;
  const bool wait = may_wait && o.oversubscribe == options::kOversubscribeWait;
  const std::uint64_t deadline = now_ns() + std::uint64_t{o.oversubscribe_wait} * 1'000'000ull;
  bool waited = false;
  for (;;) {
    bool over = over_allowance(entry);
    if (over) {
      reap_if_due();
      over = over_allowance(entry);
    }
    if (!over && (!waited || fits_quota(entry))) return true;
    if (!wait || !wait_for_memory(entry, deadline, &waited)) {
      if (wait) device(entry).oversub_timeouts.fetch_add(1);
      return false;
    }
  }
}

}  // namespace gpuslice::hook
