// Priority between tenants: the decisions (limiter/priority.h) with an
// injected clock, and the option with its HAMi alias. No driver, no files.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "limiter/options/options.h"
#include "limiter/priority.h"

namespace {

using gpuslice::Priority;
using namespace gpuslice::limiter;
using namespace gpuslice::options;

constexpr std::uint64_t kMs = 1'000'000;
constexpr std::uint64_t kT0 = 1'000'000 * kMs;  // an arbitrary CLOCK_MONOTONIC instant

// A neighbour that launched at `at` (nothing measured yet) and published as the library does.
PeerSample launched(Priority level, std::uint64_t at) {
  return PeerSample{level, next_publication(0, extend_horizon(0, at, 0), at), at};
}

// GPUSLICE_PRIORITY's words (options.def), as `gpuslice-smi set --priority`
// parses them too: stored as the ABI's levels.
TEST(PriorityParse, WordsAnyCase) {
  Priority p = Priority::unset;
  EXPECT_TRUE(parse_word(words::priority, "high", &p));
  EXPECT_EQ(p, Priority::high);
  EXPECT_TRUE(parse_word(words::priority, "LOW", &p));
  EXPECT_EQ(p, Priority::low);
  EXPECT_TRUE(parse_word(words::priority, "Normal", &p));
  EXPECT_EQ(p, Priority::normal);
  EXPECT_FALSE(parse_word(words::priority, "urgent", &p));
  EXPECT_FALSE(parse_word(words::priority, "", &p));
  EXPECT_FALSE(parse_word(words::priority, "high ", &p));
  EXPECT_EQ(p, Priority::normal);  // a refused word leaves the value as it was
}

TEST(PriorityParse, RegionWord) {
  EXPECT_EQ(priority_from_word(0, Priority::low), Priority::low);  // not recorded yet: the environment's
  EXPECT_EQ(priority_from_word(3, Priority::low), Priority::high);
  EXPECT_EQ(priority_from_word(77, Priority::normal), Priority::normal);  // garbage
}

// The option table's GPUSLICE_PRIORITY and HAMi's CUDA_TASK_PRIORITY alias.
Priority parsed_priority(std::vector<std::string> vars, bool* ok) {
  std::vector<char*> envp;
  for (std::string& v : vars) envp.push_back(v.data());
  envp.push_back(nullptr);
  static Options options;
  gpuslice::shm::Error err{};
  *ok = parse_options(envp.data(), &options, &err);
  return options.priority;
}

TEST(PriorityOption, DefaultAndAlias) {
  bool ok = false;
  EXPECT_EQ(parsed_priority({}, &ok), Priority::normal);
  EXPECT_TRUE(ok);
  EXPECT_EQ(parsed_priority({"GPUSLICE_PRIORITY=low"}, &ok), Priority::low);
  EXPECT_TRUE(ok);
  EXPECT_EQ(parsed_priority({"CUDA_TASK_PRIORITY=0"}, &ok), Priority::high);
  EXPECT_TRUE(ok);
  EXPECT_EQ(parsed_priority({"CUDA_TASK_PRIORITY=1"}, &ok), Priority::low);
  EXPECT_TRUE(ok);
  // Ours wins over the alias.
  EXPECT_EQ(parsed_priority({"CUDA_TASK_PRIORITY=1", "GPUSLICE_PRIORITY=high"}, &ok), Priority::high);
  EXPECT_TRUE(ok);
  parsed_priority({"GPUSLICE_PRIORITY=urgent"}, &ok);
  EXPECT_FALSE(ok);
}

TEST(PriorityJudge, HeldWhileHigherActive) {
  const PeerSample high = launched(Priority::high, kT0);
  EXPECT_EQ(judge(Priority::low, &high, 1, kT0 + 1 * kMs), Verdict::held);
  EXPECT_EQ(judge(Priority::normal, &high, 1, kT0 + 1 * kMs), Verdict::held);
  // Nobody holds a high container, nor one of the same level.
  EXPECT_EQ(judge(Priority::high, &high, 1, kT0 + 1 * kMs), Verdict::free);
  const PeerSample low = launched(Priority::low, kT0);
  EXPECT_EQ(judge(Priority::low, &low, 1, kT0 + 1 * kMs), Verdict::free);
  EXPECT_EQ(judge(Priority::high, &low, 1, kT0 + 1 * kMs), Verdict::free);
}

TEST(PriorityJudge, ReleasedAfterTheLingerThenBounded) {
  const PeerSample high = launched(Priority::high, kT0);
  EXPECT_EQ(judge(Priority::low, &high, 1, kT0 + kLingerNs - 1), Verdict::held);
  // Idle for the linger: released, but its next burst is near: bounded.
  EXPECT_EQ(judge(Priority::low, &high, 1, kT0 + kLingerNs), Verdict::bounded);
  EXPECT_EQ(judge(Priority::low, &high, 1, kT0 + kPresentNs - 1), Verdict::bounded);
  // Gone for good: free.
  EXPECT_EQ(judge(Priority::low, &high, 1, kT0 + kPresentNs), Verdict::free);
}

TEST(PriorityJudge, KilledHolderReleasesWithinAFewMs) {
  // A process killed right after publishing cannot hold anyone longer than
  // what it published, and it never publishes more than kMaxPublishAheadNs
  // ahead, however much work it had queued (that work dies with it).
  std::uint64_t horizon = 0;
  for (int i = 0; i < 1000; ++i) horizon = extend_horizon(horizon, kT0, 5 * kMs);  // 5 s queued
  const PeerSample dead{Priority::high, next_publication(0, horizon, kT0), kT0};
  EXPECT_EQ(dead.active_until_ns - kT0, kMaxPublishAheadNs);
  EXPECT_EQ(judge(Priority::low, &dead, 1, kT0 + kMaxPublishAheadNs - 1), Verdict::held);
  EXPECT_NE(judge(Priority::low, &dead, 1, kT0 + kMaxPublishAheadNs), Verdict::held);
  EXPECT_LE(kMaxPublishAheadNs, 10 * kMs);
}

// A held launch sleeps until the holder's published activity ends (the
// latest of the active higher neighbours'), never past kHoldMaxSleepNs: a
// holder killed meanwhile releases it at its next look; before, it looked
// every kHoldPollNs however long the hold (hundreds of held containers woke
// 4,000 times a second each).
TEST(PriorityJudge, AHeldLaunchSleepsUntilTheHoldersActivityEnds) {
  const PeerSample high = launched(Priority::high, kT0);
  PeerSample normal = launched(Priority::normal, kT0);
  normal.active_until_ns = high.active_until_ns + 300'000;
  const PeerSample peers[] = {high, normal};
  EXPECT_EQ(held_until(Priority::low, peers, 2, kT0 + 1), high.active_until_ns + 300'000);
  EXPECT_EQ(held_until(Priority::normal, peers, 2, kT0 + 1), high.active_until_ns);
  EXPECT_EQ(held_until(Priority::high, peers, 2, kT0 + 1), 0u);
  EXPECT_EQ(held_until(Priority::normal, peers, 2, high.active_until_ns), 0u) << "expired: holds nobody";
  const std::uint64_t until = kT0 + 600'000;
  EXPECT_EQ(hold_sleep_ns(until, kT0, 0), 600'000u);
  EXPECT_EQ(hold_sleep_ns(until, kT0, 30'000), 630'000u);  // the pid's spread
  EXPECT_EQ(hold_sleep_ns(kT0 + 50 * kMs, kT0, 0), kHoldMaxSleepNs);
  EXPECT_EQ(hold_sleep_ns(kT0 + 1'000, kT0, 0), kHoldMinSleepNs);  // about to end: a short sleep, no spin
  EXPECT_EQ(hold_sleep_ns(kT0 - 1, kT0, 0), kHoldPollNs);          // past, yet held: a stale verdict, look as before
  EXPECT_EQ(hold_sleep_ns(0, kT0, 0), kHoldPollNs);                // not known
  EXPECT_LE(kHoldMaxSleepNs + kHoldSpreadNs, 2 * kMs);
}

TEST(PriorityJudge, KilledWriterHoldsNobodyAtOnce) {
  // The reader learnt from the kernel that the writer's liveness lock is free
  // (shm::writer_alive): its word holds nobody, whatever it says; the
  // container is still present (its next process would be bounded next to).
  PeerSample dead = launched(Priority::high, kT0);
  ASSERT_EQ(judge(Priority::low, &dead, 1, kT0 + 1), Verdict::held);
  dead.writer_alive = false;
  EXPECT_FALSE(peer_active(dead, kT0 + 1));
  EXPECT_EQ(judge(Priority::low, &dead, 1, kT0 + 1), Verdict::bounded);
}

TEST(PriorityPublish, ActiveCoversQueuedWork) {
  // 20 launches of 200 us at once: active until they should have run, plus the linger.
  std::uint64_t horizon = 0;
  for (int i = 0; i < 20; ++i) horizon = extend_horizon(horizon, kT0, 200'000);
  EXPECT_EQ(horizon, kT0 + 4 * kMs);
  EXPECT_EQ(next_publication(0, horizon, kT0), kT0 + 4 * kMs + kLingerNs);
  // Work done long ago does not count: the horizon restarts from now.
  EXPECT_EQ(extend_horizon(horizon, kT0 + 100 * kMs, 200'000), kT0 + 100 * kMs + 200'000);
}

TEST(PriorityJudge, FarFutureWordIsNotBelieved) {
  // A corrupt word, or a clock of another time namespace, holds nobody.
  const PeerSample liar{Priority::high, kT0 + 10'000 * kMs, kT0};
  EXPECT_FALSE(peer_active(liar, kT0));
  EXPECT_NE(judge(Priority::low, &liar, 1, kT0), Verdict::held);
  const PeerSample edge{Priority::high, kT0 + kMaxAheadNs, kT0};
  EXPECT_TRUE(peer_active(edge, kT0));
}

TEST(PriorityJudge, AnyActiveHigherHolds) {
  std::vector<PeerSample> peers = {launched(Priority::low, kT0 + 5 * kMs), launched(Priority::normal, kT0),
                                   launched(Priority::high, kT0 + 5 * kMs)};
  EXPECT_EQ(judge(Priority::low, peers.data(), peers.size(), kT0 + 6 * kMs), Verdict::held);
  EXPECT_EQ(judge(Priority::normal, peers.data(), peers.size(), kT0 + 6 * kMs), Verdict::held);
  peers.pop_back();
  // The normal one is idle (past its linger) but present: the low one is bounded.
  EXPECT_EQ(judge(Priority::low, peers.data(), peers.size(), kT0 + 6 * kMs), Verdict::bounded);
  EXPECT_EQ(judge(Priority::normal, peers.data(), peers.size(), kT0 + 6 * kMs), Verdict::free);
}

TEST(PriorityEngaged, NormalOnlyNextToAnotherLevel) {
  const PeerSample normal = launched(Priority::normal, kT0);
  const PeerSample low = launched(Priority::low, kT0);
  EXPECT_FALSE(engaged(Priority::normal, nullptr, 0, kT0));
  EXPECT_FALSE(engaged(Priority::normal, &normal, 1, kT0));
  EXPECT_TRUE(engaged(Priority::normal, &low, 1, kT0));
  EXPECT_FALSE(engaged(Priority::normal, &low, 1, kT0 + kPresentNs));  // long gone
}

TEST(PriorityPublish, RateLimited) {
  const std::uint64_t first = next_publication(0, 0, kT0);
  EXPECT_EQ(first, kT0 + kLingerNs);
  EXPECT_EQ(next_publication(first, 0, kT0 + kPublishSlackNs / 2), 0u);  // recent enough: no write
  EXPECT_EQ(next_publication(first, 0, kT0 + kPublishSlackNs), kT0 + kPublishSlackNs + kLingerNs);
}

TEST(PriorityBound, LearnsTheLaunchCost) {
  InflightEstimate e;
  EXPECT_EQ(bound_launches(e), kMinBoundLaunches);  // nothing measured: the minimum
  observe_launch(e, 0);                             // no information
  EXPECT_EQ(e.avg_ns, 0u);
  for (int i = 0; i < 20; ++i) observe_launch(e, 100'000);
  EXPECT_EQ(e.avg_ns, 100'000u);
  EXPECT_EQ(bound_launches(e), 10u);  // 1 ms of work
  // An outlier (the launch shared the device) moves the estimate by a quarter of double at most.
  observe_launch(e, 50 * kMs);
  EXPECT_EQ(e.avg_ns, 125'000u);
  for (int i = 0; i < 40; ++i) observe_launch(e, 5 * kMs);
  EXPECT_EQ(bound_launches(e), kMinBoundLaunches);  // long kernels: the minimum
  for (int i = 0; i < 40; ++i) observe_launch(e, 2'000);
  EXPECT_EQ(bound_launches(e), kMaxBoundLaunches);  // tiny kernels: capped
}

TEST(PriorityBound, TightNextToARecentlyActiveHigher) {
  InflightEstimate e;
  EXPECT_EQ(bound_launches(e, true), kTightMinBoundLaunches);  // nothing measured
  for (int i = 0; i < 20; ++i) observe_launch(e, 100'000);
  EXPECT_EQ(bound_launches(e, true), kTightBoundWorkNs / 100'000);  // kTightBoundWorkNs of work
  EXPECT_EQ(bound_launches(e, false), 10u);
  for (int i = 0; i < 40; ++i) observe_launch(e, 1 * kMs);
  EXPECT_EQ(bound_launches(e, true), 1u);  // one 1 ms launch, never none
  EXPECT_EQ(bound_launches(e, false), kMinBoundLaunches);
  // Which bound: tight while a higher neighbour launched within kRecentNs.
  const PeerSample high = launched(Priority::high, kT0);
  EXPECT_TRUE(higher_recent(Priority::low, &high, 1, kT0 + kRecentNs - 1));
  EXPECT_FALSE(higher_recent(Priority::low, &high, 1, kT0 + kRecentNs));
  EXPECT_EQ(judge(Priority::low, &high, 1, kT0 + kRecentNs), Verdict::bounded);  // still bounded, relaxed
  EXPECT_FALSE(higher_recent(Priority::high, &high, 1, kT0 + 1));
  const PeerSample low = launched(Priority::low, kT0);
  EXPECT_FALSE(higher_recent(Priority::normal, &low, 1, kT0 + 1));
}

TEST(PriorityPublish, BurstQueuesBehindTheLowerBacklog) {
  // A low neighbour published that its queued work is done 0.8 ms from now.
  const PeerSample low{Priority::low, kT0 + 800'000 + kLingerNs, kT0};
  EXPECT_EQ(lower_backlog(Priority::high, &low, 1, kT0), kT0 + 800'000);
  EXPECT_EQ(lower_backlog(Priority::low, &low, 1, kT0), 0u);             // not lower than itself
  EXPECT_EQ(lower_backlog(Priority::high, &low, 1, kT0 + 800'000), 0u);  // done
  // Not believed beyond kMaxAheadNs; a dead writer has no backlog either.
  const PeerSample liar{Priority::low, kT0 + 1000 * kMs, kT0};
  EXPECT_EQ(lower_backlog(Priority::high, &liar, 1, kT0), 0u);
  PeerSample dead = low;
  dead.writer_alive = false;
  EXPECT_EQ(lower_backlog(Priority::high, &dead, 1, kT0), 0u);
}

}  // namespace
