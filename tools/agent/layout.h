// Where regions live on a node, and what their paths say about Kubernetes
// objects. Three layouts, each a root directory with one subdirectory per
// owner:
//   gpuslice        <region-dir>/<pod-uid>/<file>   (deploy/: subPathExpr $(POD_UID)),
//                   or <region-dir>/<file> (bare metal)
//   hami-containers <hami-root>/containers/<pod-uid>_<container>/<file>
//                   (HAMi's device plugin: the per-container host directory it
//                   mounts at <hook path>/vgpu, holding the file named by
//                   CUDA_DEVICE_MEMORY_SHARED_CACHE)
//   hami-claims     <hami-root>/claims/<claim-uid>/<file>
//                   (HAMi's DRA kubelet plugin: one directory per ResourceClaim)
#pragma once

#include <string>

namespace gpuslice::agent {

enum class Layout { gpuslice, hami_containers, hami_claims };

// What a region's subdirectory tells about its owner; empty when unknown.
struct OwnerLabels {
  std::string pod_uid;
  std::string container;  // from the path (HAMi); the region header's name wins when set
  std::string claim_uid;
};

// A Kubernetes object UID as the API server writes it (RFC 4122 text form:
// 8-4-4-4-12 lowercase or uppercase hex digits).
bool is_kubernetes_uid(const std::string& text);

// Labels from the subdirectory name under a layout's root ("" = top level).
OwnerLabels owner_labels(Layout layout, const std::string& sub);

// HAMi's DRA plugin removes a claim's directory itself; its device plugin
// re-creates the container's directory at every Allocate. gpuslice removes
// only its own empty pod directories.
inline bool removes_empty_subdirs(Layout layout) { return layout == Layout::gpuslice; }

const char* layout_name(Layout layout);

}  // namespace gpuslice::agent
