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
    for (std::uintptr_t i = 0; i < 1000; ++i)
      ASSERT_TRUE(t->insert(0x10000 + (round * 1000 + i) * 64, GraphCost{i, 1}));
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

// cuGraphExec*NodeSetParams as hook/graph.cc prices it: a node's new price
// replaces its old one in the executable's cost (the source graph's price
// when the node was never changed, else its last change's).
struct Repricer {
  GraphCostTable& execs;
  GraphNodePrices& nodes;
  GraphCost source;  // what the node costs in the graph the executable came from
  void set_node(std::uintptr_t exec, std::uintptr_t node, GraphCost now) {
    GraphCost cost, before = source;
    ASSERT_TRUE(execs.find(exec, &cost));
    nodes.find(exec, node, &before);
    execs.insert(exec, reprice(cost, before, now));
    nodes.set(exec, node, now);
  }
};

// cuGraphExec*NodeSetParams: a second change replaces the first instead of adding.
TEST(GraphCosts, NodeChangesReplaceTheNodesPrice) {
  auto execs = std::make_unique<GraphCostTable>();
  auto nodes = std::make_unique<GraphNodePrices>();
  Repricer r{*execs, *nodes, GraphCost{100, 1}};
  const std::uintptr_t exec = 0x7000, node = 0x9000;
  execs->insert(exec, GraphCost{300, 3});  // three nodes of 100
  r.set_node(exec, node, GraphCost{1000, 1});
  GraphCost c;
  ASSERT_TRUE(execs->find(exec, &c));
  EXPECT_EQ(c.nominal_ns, 1200u);
  r.set_node(exec, node, GraphCost{1000, 1});
  ASSERT_TRUE(execs->find(exec, &c));
  EXPECT_EQ(c.nominal_ns, 1200u) << "the same change twice is charged once";
  r.set_node(exec, node, GraphCost{50, 1});
  ASSERT_TRUE(execs->find(exec, &c));
  EXPECT_EQ(c.nominal_ns, 250u);
  EXPECT_EQ(c.kernels, 3u);
  EXPECT_NE(node_key(exec, node), node_key(node, exec));
  EXPECT_GT(node_key(0, 0), 2u);
}

// The node prices used to live in a fixed table of 4096 slots that nothing
// ever erased: after a few thousand changed nodes (executables created,
// changed and destroyed over a long run) a change was no longer recorded, and
// the next change of the same node subtracted the source graph's price
// instead of the last change's: the executable's price drifted. Now each
// executable's node prices go with it, and the table stays exact and small.
TEST(GraphCosts, NodePricesAreErasedWithTheirExecutableAndStayExact) {
  auto execs = std::make_unique<GraphCostTable>();
  auto nodes = std::make_unique<GraphNodePrices>();
  Repricer r{*execs, *nodes, GraphCost{100, 1}};
  constexpr std::uintptr_t kExecs = 20'000;  // 5x the old table's capacity, 2 nodes each
  std::size_t mapped_after_first = 0;
  for (std::uintptr_t i = 0; i < kExecs; ++i) {
    const std::uintptr_t exec = 0x7f0000000000 + (i % 64) * 0x1000;  // the driver reuses addresses
    const std::uintptr_t node_a = 0x500000 + i * 0x40, node_b = node_a + 0x20;
    ASSERT_TRUE(execs->insert(exec, GraphCost{300, 3}));  // three nodes of 100
    nodes->forget(exec);                                  // priced from its graph (hook/graph.cc price())
    r.set_node(exec, node_a, GraphCost{1000, 1});
    r.set_node(exec, node_b, GraphCost{10, 1});
    r.set_node(exec, node_a, GraphCost{2000, 1});  // replaces 1000, not the graph's 100
    GraphCost c;
    ASSERT_TRUE(execs->find(exec, &c));
    ASSERT_EQ(c.nominal_ns, 2110u) << "executable " << i << ": 2000 + 10 + 100";
    ASSERT_EQ(c.kernels, 3u);
    if (i % 3 != 0) {  // destroyed (a third of them are left to be re-instantiated over)
      execs->erase(exec);
      nodes->forget(exec);
    }
    if (i == 63) mapped_after_first = nodes->mapped_bytes();
  }
  EXPECT_LE(nodes->size(), 2 * 64u) << "at most the live executables' changed nodes";
  EXPECT_LE(nodes->mapped_bytes(), 2 * mapped_after_first + 4096 * 64) << "bounded by the peak live count";
  GraphCost c;
  EXPECT_FALSE(nodes->find(0x7f0000000000, 0x500000, &c)) << "the first executable's node went with it";
}

TEST(GraphCosts, ForgettingOneExecutableKeepsTheOthers) {
  GraphNodePrices nodes;
  for (std::uintptr_t e = 1; e <= 100; ++e) {
    for (std::uintptr_t n = 1; n <= 5; ++n) ASSERT_TRUE(nodes.set(e * 0x1000, n * 0x40, GraphCost{e * 10 + n, 1}));
  }
  EXPECT_EQ(nodes.size(), 500u);
  nodes.forget(42 * 0x1000);
  EXPECT_EQ(nodes.size(), 495u);
  GraphCost c;
  EXPECT_FALSE(nodes.find(42 * 0x1000, 0x40, &c));
  ASSERT_TRUE(nodes.find(43 * 0x1000, 0x80, &c));
  EXPECT_EQ(c.nominal_ns, 432u);
  EXPECT_FALSE(nodes.find(43 * 0x1000, 0x1000, &c)) << "another pair";
}
