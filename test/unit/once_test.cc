// include/platform/once.h: the one-time initialisation state of the preload library.
#include "platform/once.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

using gpuslice::platform::OnceFlag;

namespace {

std::uint64_t g_fake_now = 0;
std::uint64_t fake_clock() noexcept { return g_fake_now += 1'000; }  // 1 us per reading

}  // namespace

TEST(OnceFlag, ExactlyOneOfManyThreadsClaimsIt) {
  OnceFlag once;
  std::atomic<int> claims{0};
  std::atomic<int> seen_done{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      if (once.claim()) {
        claims.fetch_add(1);
        once.complete();
      } else if (once.wait() == OnceFlag::kDone) {
        seen_done.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(claims.load(), 1);
  EXPECT_EQ(seen_done.load(), 7) << "every other thread waited for the run and saw it done";
  EXPECT_TRUE(once.done());
  EXPECT_FALSE(once.claim());
}

TEST(OnceFlag, AFailureNeverOverwritesASuccess) {
  OnceFlag once;
  ASSERT_TRUE(once.claim());
  once.complete();
  once.fail();  // a second runner (after a bounded wait gave up) failed
  EXPECT_EQ(once.state(), OnceFlag::kDone);
  OnceFlag failed;
  ASSERT_TRUE(failed.claim());
  failed.fail();
  EXPECT_EQ(failed.state(), OnceFlag::kFailed);
  failed.complete();  // ... and a success wins over a failure
  EXPECT_EQ(failed.state(), OnceFlag::kDone);
}

TEST(OnceFlag, ResetLetsTheNextCallerTryAgain) {
  OnceFlag once;
  ASSERT_TRUE(once.claim());
  EXPECT_FALSE(once.claim());
  once.reset();  // nothing to initialise yet (no device), or a forked child
  EXPECT_EQ(once.wait(), OnceFlag::kIdle);
  EXPECT_TRUE(once.claim());
}

TEST(OnceFlag, ABoundedWaitGivesUpOnARunThatDoesNotEnd) {
  OnceFlag once;
  ASSERT_TRUE(once.claim());  // "another thread", stuck (waiting for the loader lock we hold)
  g_fake_now = 0;
  EXPECT_EQ(once.wait(fake_clock, 50'000), OnceFlag::kRunning);
  EXPECT_GE(g_fake_now, 50'000u);
  EXPECT_LE(g_fake_now, 53'000u) << "gave up at the limit, not much later";
}

TEST(OnceFlag, WaitReturnsAtOnceWhenNotRunning) {
  OnceFlag once;
  g_fake_now = 0;
  EXPECT_EQ(once.wait(fake_clock, 1), OnceFlag::kIdle);
  EXPECT_EQ(g_fake_now, 0u);
}
