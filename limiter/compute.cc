// Token bucket: refill, credit and the throttled wait. See compute.h.
#include "limiter/compute.h"

namespace gpuslice::limiter {

std::uint32_t refill_permille(DeviceState& d) noexcept {
  const std::uint32_t pct = d.sm_limit_pct.load(std::memory_order_relaxed);
  if (pct == 0 || pct >= 100) return 0;
  const std::uint32_t share = pct * 10;
  if (d.sm_policy.load(std::memory_order_relaxed) == static_cast<std::uint32_t>(SmPolicy::elastic)) {
    // The controller's grant, clamped to [share, everything]: a stale or
    // garbage word can never take a container below its configured share.
    const std::uint32_t granted = elastic_permille(d).load(std::memory_order_relaxed);
    if (granted > share) return granted > kFullPermille ? kFullPermille : granted;
  }
  return share;
}

std::int64_t capacity_ns(std::uint32_t permille) noexcept {
  return static_cast<std::int64_t>(kBurstWindowNs / kFullPermille * permille);
}

std::int64_t credit(DeviceState& d, std::int64_t delta, std::int64_t cap) noexcept {
  std::int64_t old = d.tokens_ns.load(std::memory_order_relaxed);
  std::int64_t next;
  do {
    next = old + delta;
    // A balance above the cap (the limit was lowered) is brought down to it;
    // debt is never capped: it is repaid by refills.
    if (next > cap) next = cap;
  } while (!d.tokens_ns.compare_exchange_weak(old, next, std::memory_order_relaxed));
  const std::int64_t added = next - old;
  credited_ns(d).fetch_add(static_cast<std::uint64_t>(added), std::memory_order_relaxed);
  return added;
}

void refill(DeviceState& d, std::uint64_t now_ns) noexcept {
  std::uint64_t last = d.last_refill_ns.load(std::memory_order_relaxed);
  if (now_ns <= last || now_ns - last < kMinRefillNs) return;
  // Whoever moves last_refill_ns credits the interval; a process killed right
  // after the CAS loses that one interval's credit, nothing else.
  if (!d.last_refill_ns.compare_exchange_strong(last, now_ns, std::memory_order_relaxed)) return;
  const std::uint32_t permille = refill_permille(d);
  if (permille == 0) return;
  const std::int64_t cap = capacity_ns(permille);
  // A fresh entry (last == 0) starts empty: a new container's first second
  // is not a burst. A long idle period fills the bucket (capped).
  if (last == 0) return;
  const std::uint64_t elapsed = now_ns - last;
  const std::int64_t add =
      elapsed >= 1'000'000'000'000ull ? cap : static_cast<std::int64_t>(elapsed * permille / kFullPermille);
  credit(d, add, cap);
}

std::uint64_t wait_for_credit(DeviceState& d, ClockFn clock, SleepFn sleep) noexcept {
  std::uint64_t slept = 0;
  for (;;) {
    const std::uint64_t now = clock();
    refill(d, now);
    const std::int64_t balance = d.tokens_ns.load(std::memory_order_relaxed);
    if (balance >= 0) break;
    const std::uint32_t permille = refill_permille(d);
    if (permille == 0) break;  // the limit was lifted while we waited
    // Wall time until the refill pays the debt back.
    std::uint64_t need = static_cast<std::uint64_t>(-balance) * kFullPermille / permille;
    if (need < kMinSleepNs) need = kMinSleepNs;
    if (need > kMaxSleepNs) need = kMaxSleepNs;
    sleep(need);
    const std::uint64_t after = clock();
    slept += after > now ? after - now : 0;
  }
  if (slept != 0) d.throttled_ns.fetch_add(slept, std::memory_order_relaxed);
  return slept;
}

}  // namespace gpuslice::limiter
