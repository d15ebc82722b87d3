// The simulated driver's handle pool (test/fakecuda/driver.h): a destroyed
// handle is recycled at the same address, and its validity is checked
// without a lock (alive()) while another thread may be recycling it — as a
// program holding a stale handle does while another thread destroys it and
// creates a new object. Under ThreadSanitizer (the CI's TSan lane runs the
// `chaos` label) the former placement-new of the whole object, its validity
// word included, was a data race with alive(); the functional checks run in
// every build.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "driver.h"

namespace {

using gpuslice::fakecuda::alive;
using gpuslice::fakecuda::HandlePool;

TEST(SimulatorHandlePool, ARetiredHandleIsDeadAndIsRecycledAtTheSameAddress) {
  HandlePool<CUstream_st> pool;
  CUstream_st* s = pool.make();
  s->priority = -3;
  EXPECT_TRUE(alive(s));
  pool.retire(s);
  EXPECT_FALSE(alive(s));
  CUstream_st* again = pool.make();
  EXPECT_EQ(again, s) << "a real driver reuses a destroyed handle's address too";
  EXPECT_TRUE(alive(again));
  EXPECT_EQ(again->priority, 0) << "the recycled object starts fresh";
  int live = 0;
  pool.for_each_live([&](CUstream_st*) { ++live; });
  EXPECT_EQ(live, 1);
}

TEST(SimulatorHandlePool, ValidationOnAnotherThreadDoesNotRaceWithRecycling) {
  HandlePool<CUevent_st> pool;
  std::mutex mu;  // the driver's runtime mutex: make() and retire() run under it
  CUevent_st* h = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    h = pool.make();
  }
  std::atomic<bool> stop{false};
  std::atomic<long> seen_alive{0};
  std::thread checker([&] {
    long n = 0;
    while (!stop.load(std::memory_order_relaxed)) n += alive(h) ? 1 : 0;
    seen_alive.store(n);
  });
  for (int i = 0; i < 20000; ++i) {
    std::lock_guard<std::mutex> lock(mu);
    pool.retire(h);
    ASSERT_EQ(pool.make(), h);
  }
  stop.store(true);
  checker.join();
  EXPECT_TRUE(alive(h));
}

}  // namespace
