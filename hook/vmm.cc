// Virtual memory management (cuMemCreate): what PyTorch's expandable segments,
// vLLM's allocator and NCCL use. Counted as the driver frees: a physical
// allocation is counted from cuMemCreate until every reference to it is gone:
// its handle's references (cuMemCreate, each cuMemRetainAllocationHandle, each
// import of an export made by this process, each minus one cuMemRelease) and
// each live mapping (the driver keeps mapped memory alive after cuMemRelease;
// releasing right after mapping is a common idiom).
//
// Imports: a shareable handle exported by this process and imported again
// (same fd by inode, or same fabric bytes) is the same memory: the import adds
// a reference to the original. A handle imported from another process is
// memory that process allocated; this process is charged for each mapping of
// it, from cuMemMap to cuMemUnmap, because the mapping keeps it alive even
// after the exporter released it (docs/memory.md: when exporter and importer
// share a container, the memory is counted twice while both hold it).
// Host-located physical memory (CU_MEM_LOCATION_TYPE_HOST*) does not use the
// card and is never counted.
#include <cuda.h>
#include <sys/stat.h>

#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "hook/oversub.h"
#include "hook/wrap.h"

namespace gpuslice::hook {
namespace {

struct Physical {
  std::uint64_t bytes;  // counted at creation (0 for foreign imports: charged per mapping)
  int entry;
  int refs;             // handle references + live mappings
  bool foreign;
};
struct Mapping {
  std::size_t size;
  CUmemGenericAllocationHandle root;  // the physical allocation it maps
  std::uint64_t charged;              // bytes charged for this mapping (foreign memory)
  int entry;
};
struct Export {
  CUmemGenericAllocationHandle root;
  CUmemAllocationHandleType type;
  std::uint64_t dev, ino;                 // POSIX fd: the file it names
  std::uint8_t fabric[64];                // CU_MEM_HANDLE_TYPE_FABRIC: the handle bytes
};

// VMM calls cost microseconds in the driver; a process-local mutex here is
// never shared with another process and never held across a driver call.
NoDestroy<std::mutex> g_mu;
NoDestroy<std::unordered_map<CUmemGenericAllocationHandle, Physical>> g_physical;
NoDestroy<std::unordered_map<CUmemGenericAllocationHandle, CUmemGenericAllocationHandle>> g_alias;  // import -> root
NoDestroy<std::map<CUdeviceptr, Mapping>> g_mappings;
NoDestroy<std::vector<Export>> g_exports;

CUmemGenericAllocationHandle root_of_locked(CUmemGenericAllocationHandle h) noexcept {
  auto a = g_alias->find(h);
  return a == g_alias->end() ? h : a->second;
}

// Drop one reference; the bytes go back to the budget with the last one.
void unref_locked(CUmemGenericAllocationHandle root) noexcept {
  auto it = g_physical->find(root);
  if (it == g_physical->end()) return;
  if (--it->second.refs == 0) {
    if (it->second.bytes != 0) release(it->second.entry, it->second.bytes);
    g_physical->erase(it);
    for (auto e = g_exports->begin(); e != g_exports->end();) {
      e = e->root == root ? g_exports->erase(e) : e + 1;
    }
  }
}

bool is_device_located(const CUmemAllocationProp* prop) noexcept {
  return prop != nullptr && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
}

bool fd_identity(int fd, std::uint64_t* dev, std::uint64_t* ino) noexcept {
  struct stat st{};
  if (fstat(fd, &st) != 0) return false;
  *dev = st.st_dev;
  *ino = st.st_ino;
  return true;
}

// The export of this process that `os_handle` names, if any.
const Export* find_export_locked(void* os_handle, CUmemAllocationHandleType type) noexcept {
  if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    std::uint64_t dev = 0, ino = 0;
    const int fd = static_cast<int>(reinterpret_cast<std::intptr_t>(os_handle));
    if (!fd_identity(fd, &dev, &ino)) return nullptr;
    for (const Export& e : *g_exports) {
      if (e.type == type && e.dev == dev && e.ino == ino) return &e;
    }
  } else if (type == CU_MEM_HANDLE_TYPE_FABRIC && os_handle != nullptr) {
    for (const Export& e : *g_exports) {
      if (e.type == type && std::memcmp(e.fabric, os_handle, sizeof e.fabric) == 0) return &e;
    }
  }
  return nullptr;
}

}  // namespace
}  // namespace gpuslice::hook

using namespace gpuslice::hook;

GPUSLICE_EXPORT CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                                             const CUmemAllocationProp* prop, unsigned long long flags) {
  CountingOp op;
  if (handle == nullptr || !is_device_located(prop)) {
    CUresult rc = ensure_ready();
    return rc != CUDA_SUCCESS ? rc : real_cuMemCreate(handle, size, prop, flags);
  }
  Reservation r;
  CUresult rc = reserve_on_ordinal(prop->location.id, size, &r);
  if (rc != CUDA_SUCCESS) return rc;
  if (!resident_admits(r.entry)) {  // over the device-resident allowance: VMM memory cannot spill
    release(r.entry, r.bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  rc = real_cuMemCreate(handle, size, prop, flags);
  if (rc != CUDA_SUCCESS) {
    release(r.entry, r.bytes);
    return rc;
  }
  try {
    std::lock_guard<std::mutex> lock(*g_mu);
    g_alias->erase(*handle);  // a handle value the driver reuses is a new allocation
    (*g_physical)[*handle] = Physical{r.bytes, r.entry, 1, false};
  } catch (...) {
    // Out of host memory for our bookkeeping: undo rather than lose track.
    real_cuMemRelease(*handle);
    release(r.entry, r.bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  CountingOp op;
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemRelease(handle);
  if (rc == CUDA_SUCCESS) {
    std::lock_guard<std::mutex> lock(*g_mu);
    const CUmemGenericAllocationHandle root = root_of_locked(handle);
    unref_locked(root);
    if (g_physical->find(root) == g_physical->end()) g_alias->erase(handle);
  }
  return rc;
}

// Returns the handle that maps `addr`, with one more reference (the same
// handle value; cuMemRelease must be called once more).
GPUSLICE_EXPORT CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuMemRetainAllocationHandle == nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  rc = real_cuMemRetainAllocationHandle(handle, addr);
  if (rc == CUDA_SUCCESS && handle != nullptr) {
    std::lock_guard<std::mutex> lock(*g_mu);
    auto it = g_physical->find(root_of_locked(*handle));
    if (it != g_physical->end()) ++it->second.refs;
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                                              CUmemAllocationHandleType type,
                                                              unsigned long long flags) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuMemExportToShareableHandle == nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  rc = real_cuMemExportToShareableHandle(shareable, handle, type, flags);
  if (rc != CUDA_SUCCESS || shareable == nullptr) return rc;
  Export e{};
  e.type = type;
  bool known = false;
  if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    known = fd_identity(*static_cast<int*>(shareable), &e.dev, &e.ino);
  } else if (type == CU_MEM_HANDLE_TYPE_FABRIC) {
    std::memcpy(e.fabric, shareable, sizeof e.fabric);
    known = true;
  }
  if (!known) return rc;
  try {
    std::lock_guard<std::mutex> lock(*g_mu);
    e.root = root_of_locked(handle);
    if (g_physical->count(e.root) != 0) g_exports->push_back(e);
  } catch (...) {
    // Without the record a re-import counts as foreign memory: charged at map, never less.
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle,
                                                                void* os_handle, CUmemAllocationHandleType type) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuMemImportFromShareableHandle == nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  rc = real_cuMemImportFromShareableHandle(handle, os_handle, type);
  if (rc != CUDA_SUCCESS || handle == nullptr) return rc;
  // Which device the memory is on, for foreign memory.
  CUmemAllocationProp prop{};
  const bool device_memory = real_cuMemGetAllocationPropertiesFromHandle != nullptr &&
                             real_cuMemGetAllocationPropertiesFromHandle(&prop, *handle) == CUDA_SUCCESS &&
                             is_device_located(&prop);
  const int entry = device_memory ? device_entry(prop.location.id) : -1;
  try {
    std::lock_guard<std::mutex> lock(*g_mu);
    if (const Export* e = find_export_locked(os_handle, type)) {
      auto it = g_physical->find(e->root);
      if (it != g_physical->end()) {
        ++it->second.refs;
        if (*handle != e->root) (*g_alias)[*handle] = e->root;
        return rc;
      }
    }
    if (entry >= 0) {
      auto [it, inserted] = g_physical->try_emplace(*handle, Physical{0, entry, 0, true});
      ++it->second.refs;
      (void)inserted;
    }
  } catch (...) {
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                          CUmemGenericAllocationHandle handle, unsigned long long flags) {
  CountingOp op;
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  // Foreign memory is charged for the mapping, before the driver maps it.
  int foreign_entry = -1;
  CUmemGenericAllocationHandle root = handle;
  {
    std::lock_guard<std::mutex> lock(*g_mu);
    root = root_of_locked(handle);
    auto it = g_physical->find(root);
    if (it != g_physical->end() && it->second.foreign) foreign_entry = it->second.entry;
  }
  if (foreign_entry >= 0 && !reserve(foreign_entry, size)) return CUDA_ERROR_OUT_OF_MEMORY;
  rc = real_cuMemMap(ptr, size, offset, handle, flags);
  if (rc != CUDA_SUCCESS) {
    if (foreign_entry >= 0) release(foreign_entry, size);
    return rc;
  }
  std::lock_guard<std::mutex> lock(*g_mu);
  auto it = g_physical->find(root);
  if (it == g_physical->end()) {
    if (foreign_entry >= 0) release(foreign_entry, size);  // released meanwhile: nothing to hold it by
    return rc;
  }
  try {
    (*g_mappings)[ptr] = Mapping{size, root, foreign_entry >= 0 ? size : 0, foreign_entry};
    ++it->second.refs;
  } catch (...) {
    // Without the mapping record the handle's release frees the bytes
    // early; the agent's reconciliation would still see what the device holds.
    if (foreign_entry >= 0) release(foreign_entry, size);
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  CountingOp op;
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemUnmap(ptr, size);
  if (rc == CUDA_SUCCESS) {
    // One unmap may cover several adjacent mappings.
    std::lock_guard<std::mutex> lock(*g_mu);
    auto it = g_mappings->lower_bound(ptr);
    while (it != g_mappings->end() && it->first < ptr + size) {
      if (it->second.charged != 0) release(it->second.entry, it->second.charged);
      unref_locked(it->second.root);
      it = g_mappings->erase(it);
    }
  }
  return rc;
}
