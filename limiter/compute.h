// The compute token bucket of a (container, device): pure logic on the shared
// region, no driver. Tokens are nanoseconds of device time; they refill at the
// container's share of wall-clock time and are spent by the container's
// kernels. See docs/limiter.md for the design and its reasoning.
//
// Every process of the container spends from the same DeviceState, lock-free:
// a launch is one fetch_sub on tokens_ns. A launch that drives the balance
// below zero keeps its debit (it has reserved its place) and sleeps until the
// refill has paid the debt back. A process killed at any instruction leaves at
// most one launch's debit or one refill interval's credit behind: the bucket
// stays usable and self-corrects as time passes.
#pragma once

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"

namespace gpuslice::limiter {

// --- tunables (docs/limiter.md explains each choice) ---
// Prior device time of one wave of thread blocks, before any measurement. It
// is deliberately cheap: an underestimate is repaid by the true-up (see
// compute_control.h), an overestimate would be credit lost to the bucket cap.
inline constexpr std::uint64_t kNominalWaveNs = 20'000;
// Bucket capacity = share x this: the largest burst after an idle period
// (30% -> 15 ms of device time), small against the one-second window.
inline constexpr std::uint64_t kBurstWindowNs = 50'000'000;
// Sleep bounds of a throttled launch: at least this much (so a container of
// tiny kernels sleeps once per batch rather than once per launch, and never
// spins), at most this much before the limit and policy are read again.
inline constexpr std::uint64_t kMinSleepNs = 200'000;
inline constexpr std::uint64_t kMaxSleepNs = 20'000'000;
// Refills closer together than this are skipped (one CAS per interval).
inline constexpr std::uint64_t kMinRefillNs = 20'000;
inline constexpr std::uint32_t kFullPermille = 1000;

// DeviceState words of this layer (see region.h and docs/limiter.md): the
// cumulative credit (spent = credited - tokens, how the controller measures
// what was admitted), the elastic grant, the feedback owner's heartbeat (a
// stale one lets another process take the role over) and when the cost scale
// was last measured (0 = still the prior: launches are admitted cautiously).
inline std::atomic<std::uint64_t>& credited_ns(DeviceState& d) noexcept { return d.credited_ns; }
inline std::atomic<std::uint32_t>& elastic_permille(DeviceState& d) noexcept { return d.elastic_permille; }
inline std::atomic<std::uint64_t>& feedback_heartbeat_ns(DeviceState& d) noexcept { return d.feedback_heartbeat_ns; }
inline std::atomic<std::uint64_t>& scale_updated_ns(DeviceState& d) noexcept { return d.scale_updated_ns; }
// What the bucket has admitted so far (provisional prices plus true-ups less
// refunds): credited - tokens. Every credit moves credited_ns and tokens_ns
// together, every spend or refund moves tokens_ns alone.
inline std::int64_t spent_total(const DeviceState& d) noexcept {
  return static_cast<std::int64_t>(d.credited_ns.load(std::memory_order_relaxed) -
                                   static_cast<std::uint64_t>(d.tokens_ns.load(std::memory_order_relaxed)));
}

// True when the entry has a compute limit (1..99 %); 0 and >= 100 are unlimited.
inline bool is_limited(const DeviceState& d) noexcept {
  const std::uint32_t pct = d.sm_limit_pct.load(std::memory_order_relaxed);
  return pct != 0 && pct < 100;
}

// The rate the bucket refills at, in permille of wall-clock time; 0 when
// unlimited. Under the elastic policy the controller may grant more than the
// configured share (never less).
std::uint32_t refill_permille(DeviceState& d) noexcept;
// Capacity of the bucket at a refill rate.
std::int64_t capacity_ns(std::uint32_t permille) noexcept;

// Credits the device time accrued since last_refill_ns (one CAS elects the
// thread that credits an interval), capped at capacity.
void refill(DeviceState& d, std::uint64_t now_ns) noexcept;
// Adds `delta` (either sign) to the balance, keeping it at most `cap`, and
// records what was actually added in credited_ns. Returns that amount.
std::int64_t credit(DeviceState& d, std::int64_t delta, std::int64_t cap) noexcept;

// --- the launch path ---
// Spends `cost`: one atomic read-modify-write. True when the balance stays
// >= 0: the launch may go at once. Otherwise the debit stands and the caller
// must wait_for_credit() (or refund, for a launch that is not going to run).
// (DeviceState::launches is counted by the caller, batched: it is statistics,
// not worth a second RMW on the hot line per launch.)
inline bool spend(DeviceState& d, std::int64_t cost) noexcept {
  return d.tokens_ns.fetch_sub(cost, std::memory_order_relaxed) >= cost;
}
// Gives back a spend whose launch failed or will not run.
inline void refund(DeviceState& d, std::int64_t cost) noexcept {
  d.tokens_ns.fetch_add(cost, std::memory_order_relaxed);
}

// --- prices a thread takes ahead ---
// A launch of a small price also takes the price of its thread's next
// kAheadLaunches - 1 launches, in the same RMW, while the balance has them;
// the thread spends those from its own credit (hook/launch.cc), so the shared
// word moves once per kAheadLaunches small launches instead of once per
// launch (with 32 threads on 2 cores that contended RMW was 77% of
// admission's time). Only prices up to kAheadMaxNs / kAheadLaunches are taken
// ahead: a thread never holds more than kAheadMaxNs of device time, and large
// kernels, whose launch rate is low, keep one RMW each. Taken early, not lost:
// the controller's true-up refunds a window's provisional spend and charges
// what the device measured (compute_control.h), and a thread's credit goes
// back to the bucket when the thread exits.
inline constexpr std::int64_t kAheadLaunches = 16;
inline constexpr std::int64_t kAheadMaxNs = 64'000;
constexpr std::int64_t ahead_for(std::int64_t cost) noexcept {
  return cost > 0 && cost <= kAheadMaxNs / kAheadLaunches ? cost * (kAheadLaunches - 1) : 0;
}
// Spends `cost` and, when the balance has it as well, `ahead` more: one RMW.
// Returns what was taken ahead: `ahead`, or 0 when the balance was short of
// it (then only `cost` is debited). *go is spend()'s answer for `cost`:
// whether the launch may go at once. A balance seen short beforehand is not
// asked for `ahead` at all: debited and given back, it would look to other
// threads like a debt for as long as this one is preempted in between.
inline std::int64_t spend_ahead(DeviceState& d, std::int64_t cost, std::int64_t ahead, bool* go) noexcept {
  if (d.tokens_ns.load(std::memory_order_relaxed) < cost + ahead) {
    *go = spend(d, cost);
    return 0;
  }
  const std::int64_t before = d.tokens_ns.fetch_sub(cost + ahead, std::memory_order_relaxed);
  *go = before >= cost;
  if (before >= cost + ahead) return ahead;
  refund(d, ahead);
  return 0;
}

using ClockFn = std::uint64_t (*)() noexcept;         // CLOCK_MONOTONIC ns
using SleepFn = void (*)(std::uint64_t ns) noexcept;  // relative sleep, never spins
// Sleeps until the balance is out of debt (refilling as time passes), or the
// limit is lifted. Re-reads limit and policy at least every kMaxSleepNs.
// Returns the nanoseconds slept (also added to DeviceState::throttled_ns).
std::uint64_t wait_for_credit(DeviceState& d, ClockFn clock, SleepFn sleep) noexcept;

// --- pricing ---
// Reciprocal of an SM count for nominal_ns(): ceil(2^32 / sms).
inline std::uint64_t sm_reciprocal(std::uint32_t sms) noexcept {
  if (sms == 0) sms = 1;
  return ((std::uint64_t{1} << 32) + sms - 1) / sms;
}
// Prior device time of a kernel of `blocks` thread blocks: its waves (blocks
// over SMs, rounded up) times kNominalWaveNs. A multiply by the reciprocal,
// not a division: an estimate one wave off for grids past 2^32 blocks is fine.
inline std::uint64_t nominal_ns(std::uint64_t blocks, std::uint64_t sm_recip) noexcept {
  if (blocks == 0) blocks = 1;
  if (blocks > 0xffffffffull) blocks = 0xffffffffull;
  const std::uint64_t waves = (((blocks - 1) * sm_recip) >> 32) + 1;
  return waves * kNominalWaveNs;
}
// Price of a launch: the nominal estimate corrected by the measured scale.
inline std::int64_t price_ns(std::uint64_t nominal, std::uint64_t scale_ppm) noexcept {
  // Signed conversions: one instruction each on x86-64 (unsigned ones are not).
  const double p = static_cast<double>(static_cast<std::int64_t>(nominal >> 1)) *
                   static_cast<double>(static_cast<std::int64_t>(scale_ppm >> 1)) * 4e-6;
  if (p < 1.0) return 1;
  if (p > 4e15) return static_cast<std::int64_t>(4e15);  // ~46 days: far beyond any kernel
  return static_cast<std::int64_t>(p);
}

}  // namespace gpuslice::limiter
