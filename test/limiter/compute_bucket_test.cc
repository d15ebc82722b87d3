// The compute token bucket (limiter/compute.h): refill, spend, credit, the
// throttled wait, and pricing. Pure logic on a region in memory.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "limiter/compute.h"

using namespace gpuslice;
using namespace gpuslice::limiter;

namespace {

std::unique_ptr<DeviceState> limited_state(std::uint32_t pct, SmPolicy policy = SmPolicy::hard) {
  auto d = std::make_unique<DeviceState>();
  d->sm_limit_pct.store(pct);
  d->sm_policy.store(static_cast<std::uint32_t>(policy));
  d->cost_scale_ppm.store(1'000'000);
  return d;
}

// A scripted clock: sleep advances it.
std::atomic<std::uint64_t> g_clock{0};
std::vector<std::uint64_t> g_sleeps;
DeviceState* g_lift_on_sleep = nullptr;
std::uint64_t fake_clock() noexcept { return g_clock.load(); }
void fake_sleep(std::uint64_t ns) noexcept {
  g_sleeps.push_back(ns);
  g_clock.fetch_add(ns);
  if (g_lift_on_sleep != nullptr) g_lift_on_sleep->sm_limit_pct.store(100);
}

}  // namespace

TEST(ComputeBucket, UnlimitedUnlessOneToNinetyNine) {
  EXPECT_FALSE(is_limited(*limited_state(0)));
  EXPECT_FALSE(is_limited(*limited_state(100)));
  EXPECT_FALSE(is_limited(*limited_state(250)));
  EXPECT_TRUE(is_limited(*limited_state(1)));
  EXPECT_TRUE(is_limited(*limited_state(99)));
  EXPECT_EQ(refill_permille(*limited_state(100)), 0u);
  EXPECT_EQ(refill_permille(*limited_state(30)), 300u);
}

TEST(ComputeBucket, FreshEntryStartsEmptyThenRefillsAtTheShare) {
  auto d = limited_state(30);
  const std::uint64_t t0 = 5'000'000'000;
  refill(*d, t0);
  EXPECT_EQ(d->tokens_ns.load(), 0);  // no burst for a new container
  EXPECT_EQ(d->last_refill_ns.load(), t0);
  EXPECT_EQ(capacity_ns(300), 15'000'000);  // 30% of 50 ms
  refill(*d, t0 + 10'000'000);              // 10 ms at 30%
  EXPECT_EQ(d->tokens_ns.load(), 3'000'000);
  EXPECT_EQ(credited_ns(*d).load(), 3'000'000u);
  refill(*d, t0 + 10'000'000 + kMinRefillNs / 2);  // too close: skipped
  EXPECT_EQ(d->tokens_ns.load(), 3'000'000);
  refill(*d, t0 + 10'000'000'000ull);  // long idle: capped
  EXPECT_EQ(d->tokens_ns.load(), capacity_ns(300));
}

TEST(ComputeBucket, SpendKeepsTheDebitAndRefundUndoesIt) {
  auto d = limited_state(50);
  d->tokens_ns.store(1'000);
  EXPECT_TRUE(spend(*d, 600));
  EXPECT_FALSE(spend(*d, 600));  // balance -200: the launch must wait
  EXPECT_EQ(d->tokens_ns.load(), -200);
  refund(*d, 600);
  EXPECT_EQ(d->tokens_ns.load(), 400);
}

// A small price takes its thread's next launches' prices with it, in one
// RMW, while the balance has them; short of them it takes only its own (the
// rest given back), and a launch into debt keeps spend()'s answer.
TEST(ComputeBucket, SpendAheadTakesTheNextPricesOnlyWhileTheBalanceHasThem) {
  EXPECT_EQ(ahead_for(100), 100 * (kAheadLaunches - 1));
  EXPECT_EQ(ahead_for(kAheadMaxNs / kAheadLaunches), kAheadMaxNs / kAheadLaunches * (kAheadLaunches - 1));
  EXPECT_EQ(ahead_for(kAheadMaxNs / kAheadLaunches + 1), 0) << "a large price is spent alone";
  EXPECT_EQ(ahead_for(0), 0);
  auto d = limited_state(50);
  bool go = false;
  d->tokens_ns.store(10'000);
  EXPECT_EQ(spend_ahead(*d, 100, 1'500, &go), 1'500);
  EXPECT_TRUE(go);
  EXPECT_EQ(d->tokens_ns.load(), 10'000 - 1'600);
  d->tokens_ns.store(1'000);  // has this launch's price, not the next ones'
  EXPECT_EQ(spend_ahead(*d, 100, 1'500, &go), 0);
  EXPECT_TRUE(go);
  EXPECT_EQ(d->tokens_ns.load(), 900);
  d->tokens_ns.store(50);  // not even this launch's: the debit stands, as spend()'s
  EXPECT_EQ(spend_ahead(*d, 100, 1'500, &go), 0);
  EXPECT_FALSE(go);
  EXPECT_EQ(d->tokens_ns.load(), -50) << "only this launch's price stays debited";
}

TEST(ComputeBucket, CreditCapsPositiveBalancesOnlyAndTracksWhatItAdded) {
  auto d = limited_state(50);
  d->tokens_ns.store(-5'000);
  EXPECT_EQ(credit(*d, 3'000, 10'000), 3'000);
  EXPECT_EQ(d->tokens_ns.load(), -2'000);
  EXPECT_EQ(credit(*d, 50'000, 10'000), 12'000);  // capped at 10'000
  EXPECT_EQ(d->tokens_ns.load(), 10'000);
  // The limit was lowered: a balance above the new cap comes down to it.
  EXPECT_EQ(credit(*d, 0, 4'000), -6'000);
  EXPECT_EQ(d->tokens_ns.load(), 4'000);
  EXPECT_EQ(credit(*d, -9'000, 4'000), -9'000);  // debt is never capped
  EXPECT_EQ(d->tokens_ns.load(), -5'000);
  EXPECT_EQ(static_cast<std::int64_t>(credited_ns(*d).load()), 3'000 + 12'000 - 6'000 - 9'000);
}

TEST(ComputeBucket, ElasticGrantNeverBelowTheShareNorAboveTheDevice) {
  auto d = limited_state(30, SmPolicy::elastic);
  EXPECT_EQ(refill_permille(*d), 300u);
  elastic_permille(*d).store(800);
  EXPECT_EQ(refill_permille(*d), 800u);
  elastic_permille(*d).store(100);  // below the share: ignored
  EXPECT_EQ(refill_permille(*d), 300u);
  elastic_permille(*d).store(5000);  // garbage: clamped
  EXPECT_EQ(refill_permille(*d), 1000u);
  d->sm_policy.store(static_cast<std::uint32_t>(SmPolicy::hard));
  EXPECT_EQ(refill_permille(*d), 300u);  // hard ignores the grant
}

TEST(ComputeBucket, WaitSleepsUntilTheDebtIsRepaid) {
  auto d = limited_state(25);
  g_clock = 1'000'000'000;
  g_sleeps.clear();
  g_lift_on_sleep = nullptr;
  d->last_refill_ns.store(g_clock.load());
  d->tokens_ns.store(-1'000'000);  // 1 ms of debt at 25%: 4 ms of wall time
  const std::uint64_t slept = wait_for_credit(*d, fake_clock, fake_sleep);
  ASSERT_EQ(g_sleeps.size(), 1u);
  EXPECT_EQ(g_sleeps[0], 4'000'000u);
  EXPECT_EQ(slept, 4'000'000u);
  EXPECT_EQ(d->throttled_ns.load(), 4'000'000u);
  EXPECT_GE(d->tokens_ns.load(), 0);
}

TEST(ComputeBucket, WaitSleepsAtLeastTheMinimumAndAtMostTheMaximum) {
  auto d = limited_state(90);
  g_clock = 1'000'000'000;
  g_sleeps.clear();
  g_lift_on_sleep = nullptr;
  d->last_refill_ns.store(g_clock.load());
  d->tokens_ns.store(-10);  // tiny debt: one minimum sleep, never a spin
  wait_for_credit(*d, fake_clock, fake_sleep);
  ASSERT_EQ(g_sleeps.size(), 1u);
  EXPECT_EQ(g_sleeps[0], kMinSleepNs);
  g_sleeps.clear();
  d->tokens_ns.store(-1'000'000'000);  // huge debt: re-checks the limit every kMaxSleepNs
  wait_for_credit(*d, fake_clock, fake_sleep);
  ASSERT_GT(g_sleeps.size(), 1u);
  for (std::uint64_t s : g_sleeps) EXPECT_LE(s, kMaxSleepNs);
}

TEST(ComputeBucket, WaitEndsWhenTheLimitIsLifted) {
  auto d = limited_state(10);
  g_clock = 1'000'000'000;
  g_sleeps.clear();
  d->last_refill_ns.store(g_clock.load());
  d->tokens_ns.store(-1'000'000'000);
  g_lift_on_sleep = d.get();
  wait_for_credit(*d, fake_clock, fake_sleep);
  g_lift_on_sleep = nullptr;
  EXPECT_EQ(g_sleeps.size(), 1u);
}

// Concurrent spenders, refunders and crediters: the spent total (credited -
// tokens) is exactly what was spent and not refunded, whatever interleaving.
TEST(ComputeBucket, ConcurrentAccountingIsExact) {
  auto d = limited_state(50);
  constexpr int kThreads = 4, kOps = 20000;
  std::atomic<std::int64_t> net{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::int64_t mine = 0;
      for (int i = 0; i < kOps; ++i) {
        const std::int64_t cost = 100 + (i * 7 + t) % 900;
        spend(*d, cost);
        mine += cost;
        if (i % 5 == 0) {
          refund(*d, cost);
          mine -= cost;
        }
        if (i % 3 == 0) credit(*d, 500, capacity_ns(500));
        if (i % 97 == 0) refill(*d, 1'000'000'000ull + static_cast<std::uint64_t>(i) * 100'000);
      }
      net += mine;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(spent_total(*d), net.load());
}

TEST(ComputePricing, WavesFollowTheSmCount) {
  const std::uint64_t r132 = sm_reciprocal(132), r16 = sm_reciprocal(16);
  EXPECT_EQ(nominal_ns(1, r132), kNominalWaveNs);
  EXPECT_EQ(nominal_ns(132, r132), kNominalWaveNs);
  EXPECT_EQ(nominal_ns(133, r132), 2 * kNominalWaveNs);
  EXPECT_EQ(nominal_ns(264, r132), 2 * kNominalWaveNs);
  EXPECT_EQ(nominal_ns(265, r132), 3 * kNominalWaveNs);
  EXPECT_EQ(nominal_ns(132, r16), 9 * kNominalWaveNs);  // same grid, small GPU: more waves
  EXPECT_EQ(nominal_ns(0, r132), kNominalWaveNs);
  EXPECT_GT(nominal_ns(~0ull, r132), 0u);  // clamped, no overflow
  EXPECT_EQ(nominal_ns(1, sm_reciprocal(0)), kNominalWaveNs);
}

TEST(ComputePricing, PriceAppliesTheScaleAndStaysPositive) {
  EXPECT_EQ(price_ns(20'000, 1'000'000), 20'000);
  EXPECT_EQ(price_ns(20'000, 50'000'000), 1'000'000);
  EXPECT_EQ(price_ns(20'000, 1), 1);
  EXPECT_GT(price_ns(~0ull, ~0ull), 0);
}
