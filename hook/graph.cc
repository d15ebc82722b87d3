// Graph instantiation: the moment a CUDA graph's work becomes known. Each
// instantiate wrapper walks the graph (kernel nodes, child graphs, recursively)
// and records the executable's nominal price in limiter::graph_costs(), which
// cuGraphLaunch (launch.cc) spends from the container's bucket. Graphs made by
// stream capture are ordinary graphs by then, so they are priced the same way.
// Work the walk cannot see (conditional bodies, device-side launches, nodes
// changed after instantiation) is still charged by the controller's true-up,
// from measured device time.
// gpuslice: hot path (no heap, no locks)
#include <cuda.h>

#include "hook/modules.h"
#include "hook/wrap.h"
#include "limiter/compute.h"
#include "limiter/compute_graphs.h"

using namespace gpuslice;
using namespace gpuslice::hook;

namespace {

constexpr int kMaxDepth = 8;
constexpr std::size_t kStackNodes = 128;

// The graph inspection entry points (not hooked: hook/real.h's internal
// list) and one walk over a graph's kernel nodes, child graphs included
// (recursively, to kMaxDepth), for pricing and for placement alike.
// `on_kernel(params)` gets each kernel node's parameters, or nullptr where
// the driver would not give them; a result other than CUDA_SUCCESS stops the
// walk and is returned.
struct GraphNodes {
  decltype(&::cuGraphGetNodes) get_nodes;
  decltype(&::cuGraphNodeGetType) node_type;
  decltype(&::cuGraphKernelNodeGetParams_v2) kernel_params;
  decltype(&::cuGraphChildGraphNodeGetGraph) child_graph;

  bool usable() const noexcept { return get_nodes != nullptr && node_type != nullptr && kernel_params != nullptr; }

  template <class OnKernel>
  CUresult walk(CUgraph graph, int depth, OnKernel&& on_kernel) const noexcept {
    std::size_t count = 0;
    if (depth > kMaxDepth || get_nodes(graph, nullptr, &count) != CUDA_SUCCESS || count == 0) return CUDA_SUCCESS;
    CUgraphNode local[kStackNodes];
    CUgraphNode* nodes = local;
    // A large graph's node list goes to mmap'd pages, never malloc (the rule
    // of every wrapper: the process's malloc may itself be interposed).
    const std::size_t map_bytes = count > kStackNodes ? count * sizeof(CUgraphNode) : 0;
    if (map_bytes != 0) {
      nodes = static_cast<CUgraphNode*>(platform::table_detail::map_pages(map_bytes));
      if (nodes == nullptr) return CUDA_SUCCESS;
    }
    CUresult rc = CUDA_SUCCESS;
    if (get_nodes(graph, nodes, &count) == CUDA_SUCCESS) {
      for (std::size_t i = 0; i < count && rc == CUDA_SUCCESS; ++i) rc = visit(nodes[i], depth, on_kernel);
    }
    if (map_bytes != 0) platform::table_detail::unmap_pages(nodes, map_bytes);
    return rc;
  }

  template <class OnKernel>
  CUresult visit(CUgraphNode node, int depth, OnKernel&& on_kernel) const noexcept {
    CUgraphNodeType type;
    if (node_type(node, &type) != CUDA_SUCCESS) return CUDA_SUCCESS;
    if (type == CU_GRAPH_NODE_TYPE_KERNEL) {
      CUDA_KERNEL_NODE_PARAMS params{};
      return on_kernel(kernel_params(node, &params) == CUDA_SUCCESS ? &params : nullptr);
    }
    if (type == CU_GRAPH_NODE_TYPE_GRAPH && child_graph != nullptr) {
      CUgraph child = nullptr;
      if (child_graph(node, &child) == CUDA_SUCCESS && child != nullptr) return walk(child, depth + 1, on_kernel);
    }
    return CUDA_SUCCESS;
  }
};

GraphNodes graph_nodes() noexcept {
  return GraphNodes{real_cuGraphGetNodes, real_cuGraphNodeGetType, real_cuGraphKernelNodeGetParams_v2,
                    real_cuGraphChildGraphNodeGetGraph};
}

// Pricing: each kernel node at its grid's waves on the executable's device
// (a node whose parameters cannot be read: one block).
struct Pricer {
  std::uint64_t sm_recip;
  limiter::GraphCost* cost;
  CUresult operator()(const CUDA_KERNEL_NODE_PARAMS* params) const noexcept {
    const std::uint64_t blocks =
        params != nullptr ? std::uint64_t{params->gridDimX} * params->gridDimY * params->gridDimZ : 1;
    cost->nominal_ns += limiter::nominal_ns(blocks, sm_recip);
    cost->kernels += 1;
    return CUDA_SUCCESS;
  }
};

// A kernel node may name a CUkernel (as `func` cast to CUfunction, or as
// `kern` with `func` NULL: the CUDA 12+ runtime's lazily loaded kernels)
// whose library was never placed in the node's context: the driver places it
// when the graph is instantiated or first launched. Before instantiating,
// each such kernel's library is placed measured in that context (modules.h),
// so the placement is counted whichever the driver's moment is; one that does
// not fit refuses the instantiation (CUDA_ERROR_OUT_OF_MEMORY). Only while
// modules.h's check is on (a CUkernel was handed out and not yet seen placed
// everywhere); otherwise nothing is walked.
// A kernel node's kernel: `func`, else `kern` in `ctx` (NULL: the current one).
template <class Params>  // CUDA_KERNEL_NODE_PARAMS_v2 or _v3: func, kern, ctx alike
CUresult place_node_params(const Params* params) noexcept {
  if (__builtin_expect((g_kernel_check.load(std::memory_order_relaxed) & 1) == 0, 1)) return CUDA_SUCCESS;
  if (params->func != nullptr) return place_node_kernel(params->func, nullptr);
  return place_node_kernel(reinterpret_cast<CUfunction>(params->kern), params->ctx);
}

// Kernels of `graph` placed measured (above): CUDA_SUCCESS, or
// CUDA_ERROR_OUT_OF_MEMORY when a placement does not fit.
CUresult place_graph_kernels(CUgraph graph) noexcept {
  if (__builtin_expect((g_kernel_check.load(std::memory_order_relaxed) & 1) == 0, 1) || graph == nullptr)
    return CUDA_SUCCESS;
  const GraphNodes g = graph_nodes();
  if (!g.usable()) return CUDA_SUCCESS;
  return g.walk(graph, 0, [](const CUDA_KERNEL_NODE_PARAMS* params) {
    return params != nullptr ? place_node_params(params) : CUDA_SUCCESS;
  });
}

// SM count of the device the executable was instantiated for (the current
// context's): the same waves arithmetic as a direct launch on it.
std::uint64_t current_sm_reciprocal() noexcept {
  CUdevice dev = 0;
  int sms = 0;
  if (real_cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
      real_cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS || sms <= 0)
    sms = 1;
  return limiter::sm_reciprocal(static_cast<std::uint32_t>(sms));
}

void price(CUgraphExec exec, CUgraph graph) noexcept {
  if (exec == nullptr || graph == nullptr) return;
  const GraphNodes g = graph_nodes();
  limiter::GraphCost cost;
  if (g.usable()) g.walk(graph, 0, Pricer{current_sm_reciprocal(), &cost});
  // Priced from the graph: earlier node changes (of this executable, or of
  // one destroyed at this address behind our back) no longer apply.
  limiter::graph_node_prices().forget(reinterpret_cast<std::uintptr_t>(exec));
  if (__builtin_expect(limiter::graph_costs().insert(reinterpret_cast<std::uintptr_t>(exec), cost), 1)) return;
  // The table of prices is full (its capacity, or a full neighbourhood):
  // said once, never silent (issue 35). The controller's true-up still
  // charges the device time such a launch measures.
  GPUSLICE_WARN_CAPPED(1,
                       "the graph price table is full (%u executables): launches of graph executables "
                       "instantiated past it are priced as one wave of one kernel, and only the measured "
                       "device time corrects their charge",
                       limiter::GraphCostTable::kSlots);
}

// After cuGraphExec*NodeSetParams succeeded: `node` now costs `now` in `exec`.
// What it cost before is its last such change, else what the source graph
// holds (the executable was instantiated, or updated, from it).
void reprice_node(CUgraphExec exec, CUgraphNode node, const limiter::GraphCost& now) noexcept {
  limiter::GraphCost cost;
  const auto exec_key = reinterpret_cast<std::uintptr_t>(exec);
  if (!limiter::graph_costs().find(exec_key, &cost)) return;  // unpriced: launched at the prior
  const auto node_id = reinterpret_cast<std::uintptr_t>(node);
  limiter::GraphCost before;
  if (!limiter::graph_node_prices().find(exec_key, node_id, &before)) {
    const GraphNodes g = graph_nodes();
    if (g.usable()) g.visit(node, 0, Pricer{current_sm_reciprocal(), &before});
  }
  limiter::graph_costs().insert(exec_key, limiter::reprice(cost, before, now));
  limiter::graph_node_prices().set(exec_key, node_id, now);
}

limiter::GraphCost kernel_cost(unsigned gx, unsigned gy, unsigned gz) noexcept {
  limiter::GraphCost c;
  c.nominal_ns = limiter::nominal_ns(std::uint64_t{gx} * gy * gz, current_sm_reciprocal());
  c.kernels = 1;
  return c;
}

CUresult priced(CUresult rc, CUgraphExec* exec, CUgraph graph) noexcept {
  if (rc == CUDA_SUCCESS && exec != nullptr) price(*exec, graph);
  return rc;
}

}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph,
                                                             unsigned long long flags) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphInstantiateWithFlags == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if ((rc = place_graph_kernels(graph)) != CUDA_SUCCESS) return rc;
  return priced(real_cuGraphInstantiateWithFlags(exec, graph, flags), exec, graph);
}
// CUDA 10-11's forms (error node and log buffer), still resolvable by old runtimes.
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphInstantiate(CUgraphExec* exec, CUgraph graph, CUgraphNode* error_node,
                                                    char* log, size_t log_size) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphInstantiate == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if ((rc = place_graph_kernels(graph)) != CUDA_SUCCESS) return rc;
  return priced(real_cuGraphInstantiate(exec, graph, error_node, log, log_size), exec, graph);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphInstantiate_v2(CUgraphExec* exec, CUgraph graph, CUgraphNode* error_node,
                                                       char* log, size_t log_size) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphInstantiate_v2 == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if ((rc = place_graph_kernels(graph)) != CUDA_SUCCESS) return rc;
  return priced(real_cuGraphInstantiate_v2(exec, graph, error_node, log, log_size), exec, graph);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphInstantiateWithParams(CUgraphExec* exec, CUgraph graph,
                                                              CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphInstantiateWithParams == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if ((rc = place_graph_kernels(graph)) != CUDA_SUCCESS) return rc;
  return priced(real_cuGraphInstantiateWithParams(exec, graph, params), exec, graph);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphInstantiateWithParams_ptsz(CUgraphExec* exec, CUgraph graph,
                                                                   CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphInstantiateWithParams_ptsz == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if ((rc = place_graph_kernels(graph)) != CUDA_SUCCESS) return rc;
  return priced(real_cuGraphInstantiateWithParams_ptsz(exec, graph, params), exec, graph);
}
// An update may swap the executable's kernels: price it again from the new graph.
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph graph,
                                                      CUgraphExecUpdateResultInfo* info) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphExecUpdate_v2 == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if ((rc = place_graph_kernels(graph)) != CUDA_SUCCESS) return rc;
  rc = real_cuGraphExecUpdate_v2(exec, graph, info);
  if (rc == CUDA_SUCCESS) price(exec, graph);
  return rc;
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec exec) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  // Forget first: once destroyed, the driver may hand the address out again.
  limiter::graph_costs().erase(reinterpret_cast<std::uintptr_t>(exec));
  limiter::graph_node_prices().forget(reinterpret_cast<std::uintptr_t>(exec));
  CountingOp op;  // frees what the executable held on the device: no measurement may overlap it
  return real_cuGraphExecDestroy(exec);
}
// Returns the device's cached graph memory to the driver: the device's usage
// drops, so no measurement of implicit memory (measure.h) may overlap it.
GPUSLICE_EXPORT CUresult CUDAAPI cuDeviceGraphMemTrim(CUdevice device) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuDeviceGraphMemTrim == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  CountingOp op;
  return real_cuDeviceGraphMemTrim(device);
}

// Kernel node parameters changed in an executable: its price changes with the grid.
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphExecKernelNodeSetParams(CUgraphExec exec, CUgraphNode node,
                                                                const CUDA_KERNEL_NODE_PARAMS_v1* params) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphExecKernelNodeSetParams == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if (params != nullptr && (rc = place_node_kernel(params->func, nullptr)) != CUDA_SUCCESS) return rc;
  rc = real_cuGraphExecKernelNodeSetParams(exec, node, params);
  if (rc == CUDA_SUCCESS && params != nullptr)
    reprice_node(exec, node, kernel_cost(params->gridDimX, params->gridDimY, params->gridDimZ));
  return rc;
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node,
                                                                   const CUDA_KERNEL_NODE_PARAMS_v2* params) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphExecKernelNodeSetParams_v2 == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if (params != nullptr && (rc = place_node_params(params)) != CUDA_SUCCESS) return rc;
  rc = real_cuGraphExecKernelNodeSetParams_v2(exec, node, params);
  if (rc == CUDA_SUCCESS && params != nullptr)
    reprice_node(exec, node, kernel_cost(params->gridDimX, params->gridDimY, params->gridDimZ));
  return rc;
}
// The generic form: kernel nodes by their grid, child graph nodes by walking
// the new child graph; other node types hold no kernels.
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphExecNodeSetParams(CUgraphExec exec, CUgraphNode node,
                                                          CUgraphNodeParams* params) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGraphExecNodeSetParams == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  if (params != nullptr && params->type == CU_GRAPH_NODE_TYPE_KERNEL &&
      (rc = place_node_params(&params->kernel)) != CUDA_SUCCESS)
    return rc;
  if (params != nullptr && params->type == CU_GRAPH_NODE_TYPE_GRAPH &&
      (rc = place_graph_kernels(params->graph.graph)) != CUDA_SUCCESS)
    return rc;
  rc = real_cuGraphExecNodeSetParams(exec, node, params);
  if (rc != CUDA_SUCCESS || params == nullptr) return rc;
  if (params->type == CU_GRAPH_NODE_TYPE_KERNEL) {
    reprice_node(exec, node, kernel_cost(params->kernel.gridDimX, params->kernel.gridDimY, params->kernel.gridDimZ));
  } else if (params->type == CU_GRAPH_NODE_TYPE_GRAPH && params->graph.graph != nullptr) {
    const GraphNodes g = graph_nodes();
    limiter::GraphCost now;
    if (g.usable()) g.walk(params->graph.graph, 1, Pricer{current_sm_reciprocal(), &now});
    reprice_node(exec, node, now);
  }
  return rc;
}
