// Graph price table. See compute_graphs.h.
#include "limiter/compute_graphs.h"

namespace gpuslice::limiter {

bool GraphCostTable::insert(std::uintptr_t key, const GraphCost& cost) noexcept {
  if (key <= kWriting) return false;
  const unsigned h = home(key);
  // An executable address the driver reuses after a destroy we did not see:
  // overwrite its record in place.
  for (unsigned i = 0; i < kProbe; ++i) {
    Slot& s = slots_[(h + i) & (kSlots - 1)];
    const std::uintptr_t k = s.key.load(std::memory_order_acquire);
    if (k == key) {
      s.nominal_ns.store(cost.nominal_ns, std::memory_order_relaxed);
      s.kernels.store(cost.kernels, std::memory_order_relaxed);
      return true;
    }
    if (k == kEmpty) break;
  }
  for (unsigned i = 0; i < kProbe; ++i) {
    Slot& s = slots_[(h + i) & (kSlots - 1)];
    std::uintptr_t k = s.key.load(std::memory_order_relaxed);
    if (k != kEmpty && k != kTombstone) continue;
    // Claim, fill, then publish the key (release): a reader that finds the
    // key sees the values.
    if (!s.key.compare_exchange_strong(k, kWriting, std::memory_order_acquire)) continue;
    s.nominal_ns.store(cost.nominal_ns, std::memory_order_relaxed);
    s.kernels.store(cost.kernels, std::memory_order_relaxed);
    s.key.store(key, std::memory_order_release);
    return true;
  }
  return false;
}

bool GraphCostTable::find(std::uintptr_t key, GraphCost* out) const noexcept {
  const unsigned h = home(key);
  for (unsigned i = 0; i < kProbe; ++i) {
    const Slot& s = slots_[(h + i) & (kSlots - 1)];
    const std::uintptr_t k = s.key.load(std::memory_order_acquire);
    if (k == key) {
      out->nominal_ns = s.nominal_ns.load(std::memory_order_relaxed);
      out->kernels = s.kernels.load(std::memory_order_relaxed);
      return true;
    }
    // A slot being written may become anything; keep probing past it.
    if (k == kEmpty) return false;
  }
  return false;
}

void GraphCostTable::erase(std::uintptr_t key) noexcept {
  const unsigned h = home(key);
  for (unsigned i = 0; i < kProbe; ++i) {
    Slot& s = slots_[(h + i) & (kSlots - 1)];
    std::uintptr_t k = s.key.load(std::memory_order_acquire);
    if (k == key) {
      s.key.compare_exchange_strong(k, kTombstone, std::memory_order_release);
      return;
    }
    if (k == kEmpty) return;
  }
}

bool GraphNodePrices::find(std::uintptr_t exec, std::uintptr_t node, GraphCost* out) const noexcept {
  Record r{};
  // PointerTable::find is logically const (it takes the shard's lock).
  if (!const_cast<platform::PointerTable<Record>&>(table_).find(node_key(exec, node), &r) || r.exec != exec ||
      r.node != node)
    return false;
  *out = r.cost;
  return true;
}

bool GraphNodePrices::set(std::uintptr_t exec, std::uintptr_t node, const GraphCost& now) noexcept {
  switch (table_.put(node_key(exec, node), Record{now, exec, node}, nullptr)) {
    case platform::PointerTable<Record>::Put::inserted: live_.fetch_add(1, std::memory_order_relaxed); return true;
    case platform::PointerTable<Record>::Put::replaced:  // the same node changed again (or a colliding pair's record)
      return true;
    case platform::PointerTable<Record>::Put::full: break;
  }
  return false;
}

void GraphNodePrices::forget(std::uintptr_t exec) noexcept {
  if (live_.load(std::memory_order_relaxed) == 0) return;
  table_.for_each_unlocked([&](std::uint64_t key, const Record& seen) {
    if (seen.exec != exec) return;
    bool erased = false;
    table_.update(key, [&](Record& now) { return erased = now.exec == exec; });
    if (erased) live_.fetch_sub(1, std::memory_order_relaxed);
  });
}

namespace {
constinit GraphCostTable g_table;  // constant-initialised: no constructor to run, no heap
// Never destroyed: a CUDA call made during exit may still reach it.
union NodePricesStorage {
  GraphNodePrices value;
  constexpr NodePricesStorage() : value() {}
  ~NodePricesStorage() {}
};
constinit NodePricesStorage g_node_prices;
}  // namespace

GraphCostTable& graph_costs() noexcept { return g_table; }
GraphNodePrices& graph_node_prices() noexcept { return g_node_prices.value; }

}  // namespace gpuslice::limiter
