// Prices of instantiated CUDA graphs, looked up by cuGraphLaunch. A graph is
// priced once, when it is instantiated (hook/graph.cc walks its nodes): the
// sum of its kernels' nominal device time. Process-local (graph executables
// are), lock-free and heap-free: a fixed open-addressing table keyed by the
// CUgraphExec pointer value, erased at cuGraphExecDestroy (its tombstones are
// reused). It stays lock-free rather than a PointerTable because every
// cuGraphLaunch of a limited container reads it: a shard lock there would add
// a locked instruction to each launch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "platform/pointer_table.h"

namespace gpuslice::limiter {

struct GraphCost {
  std::uint64_t nominal_ns = 0;  // sum of the kernel nodes' nominal_ns()
  std::uint32_t kernels = 0;     // kernel nodes, child graphs included
};

class GraphCostTable {
 public:
  static constexpr unsigned kSlots = 4096;
  static constexpr unsigned kProbe = 64;  // bounded probing keeps lookups O(1) under churn

  // Records (or replaces) the price of `key`. False when the neighbourhood is
  // full: launches of that graph are then priced as one unknown kernel.
  bool insert(std::uintptr_t key, const GraphCost& cost) noexcept;
  bool find(std::uintptr_t key, GraphCost* out) const noexcept;
  void erase(std::uintptr_t key) noexcept;

 private:
  static constexpr std::uintptr_t kEmpty = 0;
  static constexpr std::uintptr_t kTombstone = 1;
  static constexpr std::uintptr_t kWriting = 2;
  struct Slot {
    std::atomic<std::uintptr_t> key{kEmpty};
    std::atomic<std::uint64_t> nominal_ns{0};
    std::atomic<std::uint32_t> kernels{0};
  };
  static unsigned home(std::uintptr_t key) noexcept {
    return static_cast<unsigned>(((key >> 4) * 0x9e3779b97f4a7c15ull) >> 52) & (kSlots - 1);
  }
  Slot slots_[kSlots];
};

// The process's table.
GraphCostTable& graph_costs() noexcept;

// Node parameters changed inside an executable (cuGraphExec*NodeSetParams)
// change its price: the node's price in that executable, so that a second
// change replaces the first one's price instead of adding to it. One record
// per changed node, keyed by node_key(exec, node) in a process-private
// PointerTable (the one table design), and erased with its executable: at
// its destroy, and when it is priced again from a graph (instantiated at a
// reused address, updated). A record that cannot be kept (no memory) or a
// key collision misprices one node; the controller's true-up charges
// measured device time whatever the price was.
class GraphNodePrices {
 public:
  constexpr GraphNodePrices() noexcept = default;
  // The price `node` got in `exec` at its last change, if any.
  bool find(std::uintptr_t exec, std::uintptr_t node, GraphCost* out) const noexcept;
  // Records `node`'s price in `exec` (replacing an earlier change's).
  bool set(std::uintptr_t exec, std::uintptr_t node, const GraphCost& now) noexcept;
  // Forgets every node price of `exec`; free when no node was ever changed.
  void forget(std::uintptr_t exec) noexcept;
  std::size_t size() const noexcept { return live_.load(std::memory_order_relaxed); }
  std::size_t mapped_bytes() const noexcept { return table_.mapped_bytes(); }

 private:
  struct Record {
    GraphCost cost;
    std::uintptr_t exec;  // the key is a hash: a record is only its own pair's
    std::uintptr_t node;
  };
  platform::PointerTable<Record> table_;
  std::atomic<std::size_t> live_{0};
};
GraphNodePrices& graph_node_prices() noexcept;
inline std::uintptr_t node_key(std::uintptr_t exec, std::uintptr_t node) noexcept {
  const std::uintptr_t k = (exec * 0x9e3779b97f4a7c15ull) ^ (node + (node << 17) + 0x632be59bd9b4e019ull);
  return k <= 2 ? k + 3 : k;  // never one of the tables' reserved keys
}
// Replaces one node's price `old_node` by `new_node` in an executable's cost.
inline GraphCost reprice(GraphCost cost, const GraphCost& old_node, const GraphCost& new_node) noexcept {
  cost.nominal_ns =
      (cost.nominal_ns >= old_node.nominal_ns ? cost.nominal_ns - old_node.nominal_ns : 0) + new_node.nominal_ns;
  cost.kernels = (cost.kernels >= old_node.kernels ? cost.kernels - old_node.kernels : 0) + new_node.kernels;
  return cost;
}

}  // namespace gpuslice::limiter
