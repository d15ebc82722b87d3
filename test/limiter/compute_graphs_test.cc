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

// cuGraphExec*NodeSetParams: a node's new price replaces its old one in the
// executable's cost; a second change replaces the first instead of adding.
TEST(GraphCosts, NodeChangesReplaceTheNodesPrice) {
  auto execs = std::make_unique<GraphCostTable>();
  auto nodes = std::make_unique<GraphCostTable>();
  const std::uintptr_t exec = 0x7000, node = 0x9000;
  execs->insert(exec, GraphCost{300, 3});  // three nodes of 100
  auto set_node = [&](GraphCost now) {
    GraphCost cost, before{100, 1};
    ASSERT_TRUE(execs->find(exec, &cost));
    const std::uintptr_t key = node_key(exec, node);
    nodes->find(key, &before);
    execs->insert(exec, reprice(cost, before, now));
    nodes->insert(key, now);
  };
  set_node(GraphCost{1000, 1});
  GraphCost c;
  ASSERT_TRUE(execs->find(exec, &c));
  EXPECT_EQ(c.nominal_ns, 1200u);
  set_node(GraphCost{1000, 1});
  ASSERT_TRUE(execs->find(exec, &c));
  EXPECT_EQ(c.nominal_ns, 1200u) << "the same change twice is charged once";
  set_node(GraphCost{50, 1});
  ASSERT_TRUE(execs->find(exec, &c));
  EXPECT_EQ(c.nominal_ns, 250u);
  EXPECT_EQ(c.kernels, 3u);
  EXPECT_NE(node_key(exec, node), node_key(node, exec));
  EXPECT_GT(node_key(0, 0), 2u);
}
