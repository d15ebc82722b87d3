// include/platform/clock.h: Backoff, the pause of the library's bounded polls
// (a measurement's drain, a busy pool's mutex, a placement drop).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "platform/clock.h"

using gpuslice::platform::Backoff;
using gpuslice::platform::monotonic_ns;

TEST(Backoff, EachPauseSleepsDoubleThePreviousUpToTheCap) {
  Backoff backoff(10'000, 200'000);
  const std::vector<std::uint64_t> expected{10'000, 20'000, 40'000, 80'000, 160'000, 200'000, 200'000};
  std::uint64_t total = 0;
  const std::uint64_t t0 = monotonic_ns();
  for (const std::uint64_t ns : expected) {
    EXPECT_EQ(backoff.pause(), ns);
    total += ns;
  }
  EXPECT_GE(monotonic_ns() - t0, total);  // each pause slept at least what it says
}

TEST(Backoff, APauseAboveHalfTheCapJumpsToTheCap) {
  Backoff backoff(640'000, 1'000'000);
  EXPECT_EQ(backoff.pause(), 640'000u);
  EXPECT_EQ(backoff.pause(), 1'000'000u);
  EXPECT_EQ(backoff.pause(), 1'000'000u);
}
