// Minimal graphs: kernel (and empty) nodes, instantiation as an ordered list of
// kernels, launch = each kernel on the device timeline in insertion order, and
// stream capture of kernel launches. Dependencies are accepted and validated
// but execution is always sequential, which is what a device running one kernel
// at a time does anyway.
#include <algorithm>
#include <cstring>

#include "driver.h"

struct CUgraphNode_st {
  static constexpr std::uint32_t kAlive = 0x6D6D6D6D;
  CUgraph_st* graph = nullptr;
  CUgraphNodeType type = CU_GRAPH_NODE_TYPE_EMPTY;
  CUDA_KERNEL_NODE_PARAMS params{};
};

struct CUgraph_st {
  static constexpr std::uint32_t kAlive = 0x6A6A6A6A;
  std::vector<CUgraphNode_st*> nodes;
};

struct CUgraphExec_st {
  static constexpr std::uint32_t kAlive = 0x6E6E6E6E;
  std::vector<CUfunc_st*> kernels;
};

using namespace gpuslice::fakecuda;

namespace {

HandlePool<CUgraph_st> g_graphs;  // runtime mutex
HandlePool<CUgraphNode_st> g_nodes;
HandlePool<CUgraphExec_st> g_execs;

CUfunc_st* node_function(const CUDA_KERNEL_NODE_PARAMS& params) {
  if (params.func != nullptr) return function_from_handle(params.func);
  return function_from_handle(reinterpret_cast<CUfunction>(params.kern));
}

CUresult add_node_locked(CUgraphNode* phGraphNode, CUgraph hGraph, const CUgraphNode* dependencies,
                         size_t numDependencies, CUgraphNodeType type, const CUDA_KERNEL_NODE_PARAMS* params) {
  if (!alive(hGraph)) return CUDA_ERROR_INVALID_VALUE;
  if (numDependencies > 0 && dependencies == nullptr) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < numDependencies; ++i) {
    if (!alive(dependencies[i]) || dependencies[i]->graph != hGraph) return CUDA_ERROR_INVALID_VALUE;
  }
  if (type == CU_GRAPH_NODE_TYPE_KERNEL) {
    if (node_function(*params) == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (params->gridDimX == 0 || params->gridDimY == 0 || params->gridDimZ == 0 || params->blockDimX == 0 ||
        params->blockDimY == 0 || params->blockDimZ == 0) {
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  CUgraphNode_st* node = g_nodes.make();
  node->graph = hGraph;
  node->type = type;
  if (params != nullptr) node->params = *params;
  hGraph->nodes.push_back(node);
  if (phGraphNode != nullptr) *phGraphNode = node;
  return CUDA_SUCCESS;
}

CUresult instantiate(CUgraphExec* phGraphExec, CUgraph hGraph) {
  if (phGraphExec == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hGraph)) return CUDA_ERROR_INVALID_VALUE;
  CUgraphExec_st* exec = g_execs.make();
  for (CUgraphNode_st* node : hGraph->nodes) {
    if (node->type == CU_GRAPH_NODE_TYPE_KERNEL) exec->kernels.push_back(node_function(node->params));
  }
  *phGraphExec = exec;
  return CUDA_SUCCESS;
}

CUresult graph_launch(CUgraphExec hGraphExec, CUstream hStream, bool ptsz) {
  if (!initialized()) return uninitialized_error();
  if (!alive(hGraphExec)) return CUDA_ERROR_INVALID_VALUE;
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  for (CUfunc_st* function : hGraphExec->kernels) {
    if (!alive(function)) return CUDA_ERROR_INVALID_HANDLE;  // its module was unloaded
    // A node naming a CUkernel of a library not used in the launch's context
    // yet: loaded into it now, as a direct launch loads it
    // (launch.cc; README "Modules").
    CUmod_st* module = function->module;
    if (module != nullptr && module->ctx == nullptr && !library_placed_in(module, stream->ctx)) {
      if (CUresult rc = place_library_at_launch(function, stream->ctx); rc != CUDA_SUCCESS) return rc;
    }
  }
  for (CUfunc_st* function : hGraphExec->kernels) {
    if (stream->capture.load(std::memory_order_acquire) != nullptr) {
      CUDA_KERNEL_NODE_PARAMS params{};
      params.func = function;
      params.gridDimX = params.gridDimY = params.gridDimZ = 1;
      params.blockDimX = params.blockDimY = params.blockDimZ = 1;
      if (CUresult rc = capture_kernel_node(stream, params); rc != CUDA_SUCCESS) return rc;
    } else {
      launch_on_stream(function, stream, 1);  // graph nodes keep no grid: one block each
    }
  }
  return CUDA_SUCCESS;
}

CUresult begin_capture(CUstream hStream, CUstreamCaptureMode mode, bool ptsz) {
  if (!initialized()) return uninitialized_error();
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  // The legacy stream synchronises with everything: it cannot be captured.
  if (stream == stream->ctx->null_stream) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  std::lock_guard guard(runtime().mu);
  if (stream->capture.load(std::memory_order_relaxed) != nullptr) return CUDA_ERROR_ILLEGAL_STATE;
  stream->capture_id = next_object_id_locked();
  stream->capture.store(g_graphs.make(), std::memory_order_release);
  return CUDA_SUCCESS;
}

CUresult end_capture(CUstream hStream, CUgraph* phGraph, bool ptsz) {
  if (phGraph == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  CUgraph_st* graph = stream->capture.load(std::memory_order_relaxed);
  if (graph == nullptr) return CUDA_ERROR_ILLEGAL_STATE;
  stream->capture.store(nullptr, std::memory_order_release);
  *phGraph = graph;
  return CUDA_SUCCESS;
}

CUresult is_capturing(CUstream hStream, CUstreamCaptureStatus* captureStatus, bool ptsz) {
  if (captureStatus == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  *captureStatus = stream->capture.load(std::memory_order_acquire) != nullptr ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                                                                              : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

CUDA_KERNEL_NODE_PARAMS from_v1(const CUDA_KERNEL_NODE_PARAMS_v1& v1) {
  CUDA_KERNEL_NODE_PARAMS params{};
  std::memcpy(&params, &v1, sizeof(v1));  // v2 extends v1 with kern and ctx
  return params;
}

}  // namespace

namespace gpuslice::fakecuda {

CUresult capture_kernel_node(CUstream_st* stream, const CUDA_KERNEL_NODE_PARAMS& params) {
  std::lock_guard guard(runtime().mu);
  CUgraph_st* graph = stream->capture.load(std::memory_order_acquire);
  if (graph == nullptr) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  return add_node_locked(nullptr, graph, nullptr, 0, CU_GRAPH_NODE_TYPE_KERNEL, &params);
}

}  // namespace gpuslice::fakecuda

static_assert(sizeof(CUDA_KERNEL_NODE_PARAMS_v1) <= sizeof(CUDA_KERNEL_NODE_PARAMS));

extern "C" CUresult cuGraphCreate(CUgraph* phGraph, unsigned int flags) {
  if (phGraph == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  *phGraph = g_graphs.make();
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGraphDestroy(CUgraph hGraph) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hGraph)) return CUDA_ERROR_INVALID_VALUE;
  for (CUgraphNode_st* node : hGraph->nodes) g_nodes.retire(node);
  hGraph->nodes.clear();
  g_graphs.retire(hGraph);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGraphAddKernelNode_v2(CUgraphNode* phGraphNode, CUgraph hGraph, const CUgraphNode* dependencies,
                                            size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS* nodeParams) {
  if (phGraphNode == nullptr || nodeParams == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  return add_node_locked(phGraphNode, hGraph, dependencies, numDependencies, CU_GRAPH_NODE_TYPE_KERNEL, nodeParams);
}

extern "C" CUresult cuGraphAddKernelNode(CUgraphNode* phGraphNode, CUgraph hGraph, const CUgraphNode* dependencies,
                                         size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v1* nodeParams) {
  if (nodeParams == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUDA_KERNEL_NODE_PARAMS params = from_v1(*nodeParams);
  return cuGraphAddKernelNode_v2(phGraphNode, hGraph, dependencies, numDependencies, &params);
}

extern "C" CUresult cuGraphAddEmptyNode(CUgraphNode* phGraphNode, CUgraph hGraph, const CUgraphNode* dependencies,
                                        size_t numDependencies) {
  if (phGraphNode == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  return add_node_locked(phGraphNode, hGraph, dependencies, numDependencies, CU_GRAPH_NODE_TYPE_EMPTY, nullptr);
}

extern "C" CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode* nodes, size_t* numNodes) {
  if (numNodes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hGraph)) return CUDA_ERROR_INVALID_VALUE;
  if (nodes == nullptr) {
    *numNodes = hGraph->nodes.size();
    return CUDA_SUCCESS;
  }
  size_t copied = std::min(*numNodes, hGraph->nodes.size());
  for (size_t i = 0; i < *numNodes; ++i) nodes[i] = i < copied ? hGraph->nodes[i] : nullptr;
  *numNodes = copied;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType* type) {
  if (type == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(hNode)) return CUDA_ERROR_INVALID_VALUE;
  *type = hNode->type;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS* nodeParams) {
  if (nodeParams == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(hNode) || hNode->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_INVALID_VALUE;
  *nodeParams = hNode->params;
  if (nodeParams->func == nullptr) nodeParams->func = reinterpret_cast<CUfunction>(nodeParams->kern);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGraphKernelNodeGetParams(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS_v1* nodeParams) {
  if (nodeParams == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUDA_KERNEL_NODE_PARAMS params{};
  CUresult rc = cuGraphKernelNodeGetParams_v2(hNode, &params);
  if (rc == CUDA_SUCCESS) std::memcpy(nodeParams, &params, sizeof(*nodeParams));
  return rc;
}

extern "C" CUresult cuGraphInstantiateWithFlags(CUgraphExec* phGraphExec, CUgraph hGraph, unsigned long long flags) {
  (void)flags;
  return instantiate(phGraphExec, hGraph);
}

extern "C" CUresult cuGraphInstantiate(CUgraphExec* phGraphExec, CUgraph hGraph, CUgraphNode* phErrorNode,
                                       char* logBuffer, size_t bufferSize) {
  if (phErrorNode != nullptr) *phErrorNode = nullptr;
  if (logBuffer != nullptr && bufferSize > 0) logBuffer[0] = '\0';
  return instantiate(phGraphExec, hGraph);
}

extern "C" CUresult cuGraphInstantiate_v2(CUgraphExec* phGraphExec, CUgraph hGraph, CUgraphNode* phErrorNode,
                                          char* logBuffer, size_t bufferSize) {
  return cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

extern "C" CUresult cuGraphInstantiateWithParams(CUgraphExec* phGraphExec, CUgraph hGraph,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS* instantiateParams) {
  if (instantiateParams == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUresult rc = instantiate(phGraphExec, hGraph);
  instantiateParams->hErrNode_out = nullptr;
  instantiateParams->result_out = rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
  return rc;
}

extern "C" CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec* phGraphExec, CUgraph hGraph,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS* instantiateParams) {
  return cuGraphInstantiateWithParams(phGraphExec, hGraph, instantiateParams);
}

extern "C" CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hGraphExec)) return CUDA_ERROR_INVALID_VALUE;
  hGraphExec->kernels.clear();
  g_execs.retire(hGraphExec);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
  return graph_launch(hGraphExec, hStream, false);
}
extern "C" CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
  return graph_launch(hGraphExec, hStream, true);
}

extern "C" CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
  return begin_capture(hStream, mode, false);
}
extern "C" CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
  return begin_capture(hStream, mode, true);
}
// CUDA 10.0's form had no mode: it captured in global mode.
extern "C" CUresult cuStreamBeginCapture(CUstream hStream) {
  return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, false);
}
extern "C" CUresult cuStreamBeginCapture_ptsz(CUstream hStream) {
  return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, true);
}
extern "C" CUresult cuStreamEndCapture(CUstream hStream, CUgraph* phGraph) {
  return end_capture(hStream, phGraph, false);
}
extern "C" CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph* phGraph) {
  return end_capture(hStream, phGraph, true);
}
extern "C" CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus* captureStatus) {
  return is_capturing(hStream, captureStatus, false);
}
extern "C" CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus* captureStatus) {
  return is_capturing(hStream, captureStatus, true);
}
