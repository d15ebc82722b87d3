// The graph price table (limiter/compute_graphs.h).
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "limiter/compute_graphs.h"

using namespace gpuslice::limiter;

TEST(GraphCosts, InsertFindEraseAndReuse) {
  auto t = std::make_unique<GraphCostTable>();
  GraphCost c;
  EXPECT_FALSE(t->find(0x1000, &c));
  EXPECT_TRUE(t->insert(0x1000, GraphCost{200'000, 10}));
  ASSERT_TRUE(t->find(0x1000, &c));
  EXPECT_EQ(c.nominal_ns, 200'000u);
  EXPECT_EQ(c.kernels, 10u);
  EXPECT_TRUE(t->insert(0x1000, GraphCost{40'000, 2}));  // re-instantiated at the same address
  ASSERT_TRUE(t->find(0x1000, &c));
  EXPECT_EQ(c.kernels, 2u);
  t->erase(0x1000);
  EXPECT_FALSE(t->find(0x1000, &c));
  EXPECT_TRUE(t->insert(0x1000, GraphCost{1, 1}));
  EXPECT_TRUE(t->find(0x1000, &c));
  EXPECT_FALSE(t->insert(0, GraphCost{1, 1}));  // reserved keys
}

TEST(GraphCosts, ChurnKeepsWorkingWithTombstones) {
  auto t = std::make_unique<GraphCostTable>();
  for (std::uintptr_t round = 0; round < 50; ++round) {
    for (std::uintptr_t i = 0; i < 1000; ++i) ASSERT_TRUE(t->insert(0x10000 + (round * 1000 + i) * 64, GraphCost{i, 1}));
    for (std::uintptr_t i = 0; i < 1000; ++i) t->erase(0x10000 + (round * 1000 + i) * 64);
  }
  GraphCost c;
  EXPECT_TRUE(t->insert(0xdead0, GraphCost{7, 7}));
  EXPECT_TRUE(t->find(0xdead0, &c));
}

TEST(GraphCosts, ConcurrentInsertFindErase) {
  auto t = std::make_unique<GraphCostTable>();
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      for (std::uintptr_t i = 0; i < 20000; ++i) {
        const std::uintptr_t key = 0x100000 + (static_cast<std::uintptr_t>(th) << 32) + (i % 500) * 16;
        t->insert(key, GraphCost{key, 3});
        GraphCost c;
        if (t->find(key, &c) && c.kernels != 3) ++mismatches;
        if (i % 3 == 0) t->erase(key);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}
