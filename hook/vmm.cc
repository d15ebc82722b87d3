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
// a reference to the original. An export is published in the container's
// registry of shared allocations (limiter/shared_allocs.h): its bytes move
// from this process's share to the entry, which every process of the
// container that imports it joins; the bytes leave the count when the last
// holder of the container lets go (or dies: the reaper). A handle imported
// from elsewhere (another container, or an entry the registry could not hold)
// is charged to this process for each mapping of it, from cuMemMap to
// cuMemUnmap, because the mapping keeps it alive even after the exporter
// released it.
// Host-located physical memory (CU_MEM_LOCATION_TYPE_HOST*) does not use the
// card and is never counted.
// gpuslice: hot path (no heap, no locks)
#include <cuda.h>
#include <sys/stat.h>

#include <cstring>

#include "hook/oversub.h"
#include "hook/wrap.h"
#include "limiter/shared_allocs.h"

namespace gpuslice::hook {
namespace {

using Handle = CUmemGenericAllocationHandle;

struct Physical {
  std::uint64_t bytes;  // counted at creation (0 for foreign imports: charged per mapping)
  int entry;
  int refs;  // handle references + live mappings
  bool foreign;
  bool exported;  // g_exports may name it
  int shared;     // entry of Region::shared it holds, + 1 (0: none)
};
struct Alias {
  Handle root;  // an import of this process's own export -> the allocation it names
};
struct Mapping {
  std::uint64_t size;
  Handle root;            // the physical allocation it maps (0: one we do not count)
  std::uint64_t charged;  // bytes charged for this mapping (foreign memory)
  int entry;
};
struct Export {
  Handle root;
  CUmemAllocationHandleType type;
  std::uint64_t dev, ino;   // POSIX fd: the file it names
  std::uint8_t fabric[64];  // CU_MEM_HANDLE_TYPE_FABRIC: the handle bytes
};

// One table each (include/platform/pointer_table.h): no heap, no mutex. An operation
// that touches several records (a release dropping the last reference, an
// unmap) takes them one at a time; the orders below keep every record
// reachable from what still references it.
constinit NoDestroy<platform::PointerTable<Physical>> g_physical;  // root handle -> counted allocation
constinit NoDestroy<platform::PointerTable<Alias>> g_alias;        // imported handle -> root
constinit NoDestroy<platform::PointerTable<Mapping>> g_mappings;   // mapped address -> mapping
constinit NoDestroy<platform::PointerTable<Export>> g_exports;     // export_key(identity) -> export
// How many of this process's physical records hold each shared entry: the
// slot's bit goes with the last of them.
constinit std::atomic<int> g_shared_refs[kMaxShared] = {};

// One more record of this process holds shared entry `e`.
void hold_shared(int e) noexcept { g_shared_refs[e].fetch_add(1); }

// One record less; the last lets go of the entry, and the last holder of the
// container releases its bytes.
void drop_shared(int e, int entry) noexcept {
  if (g_shared_refs[e].fetch_sub(1) != 1) return;
  const int slot = g_process.slot.load(std::memory_order_acquire);
  if (slot < 0 || g_process.region == nullptr) return;
  const std::uint64_t freed = limiter::shared_leave(g_process.region, slot, e);
  if (freed != 0) oversub_freed(entry, limiter::AllocKind::vmm, freed);
}

Handle root_of(Handle h) noexcept {
  Alias a{};
  return g_alias->find(h, &a) ? a.root : h;
}

void forget_exports_of(Handle root) noexcept {
  g_exports->for_each_unlocked([&](std::uint64_t key, const Export& e) {
    if (e.root == root) g_exports->update(key, [&](Export& now) { return now.root == root; });
  });
}

// Drop one reference; the bytes go back to the budget with the last one.
void unref(Handle root) noexcept {
  Physical last{};
  bool gone = false;
  g_physical->update(root, [&](Physical& p) {
    if (--p.refs > 0) return false;
    last = p;
    gone = true;
    return true;
  });
  if (!gone) return;
  if (last.bytes != 0) {
    release(last.entry, last.bytes);
    oversub_freed(last.entry, limiter::AllocKind::vmm, last.bytes);  // wake the container's waiters
  }
  if (last.shared != 0) drop_shared(last.shared - 1, last.entry);
  if (last.exported) forget_exports_of(root);
}

bool add_ref(Handle root) noexcept {
  return g_physical->update(root, [](Physical& p) {
    ++p.refs;
    return false;
  });
}

bool is_device_located(const CUmemAllocationProp* prop) noexcept {
  return prop != nullptr && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
}

bool fd_identity(int fd, std::uint64_t* dev, std::uint64_t* ino) noexcept {
  struct stat st {};
  if (fstat(fd, &st) != 0) return false;
  *dev = st.st_dev;
  *ino = st.st_ino;
  return true;
}

// The table key of an export's identity (a hash: two identities that
// collide keep the first; the second's re-import counts as foreign memory,
// charged at map, never less).
std::uint64_t export_key(const Export& e) noexcept {
  std::uint64_t k = platform::table_detail::mix(static_cast<std::uint64_t>(e.type) + 1);
  if (e.type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    k = platform::table_detail::mix(k ^ e.dev);
    k = platform::table_detail::mix(k ^ e.ino);
  } else {
    for (std::size_t i = 0; i < sizeof e.fabric; i += 8) {
      std::uint64_t w;
      std::memcpy(&w, e.fabric + i, 8);
      k = platform::table_detail::mix(k ^ w);
    }
  }
  return k == 0 || k == ~std::uint64_t{0} ? 1 : k;
}

bool same_identity(const Export& a, const Export& b) noexcept {
  if (a.type != b.type) return false;
  if (a.type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return a.dev == b.dev && a.ino == b.ino;
  return std::memcmp(a.fabric, b.fabric, sizeof a.fabric) == 0;
}

// The identity `os_handle` names for `type`, if it is one we can recognise.
bool identity_of(void* os_handle, CUmemAllocationHandleType type, Export* out) noexcept {
  *out = Export{};
  out->type = type;
  if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    const int fd = static_cast<int>(reinterpret_cast<std::intptr_t>(os_handle));
    return fd_identity(fd, &out->dev, &out->ino);
  }
  if (type == CU_MEM_HANDLE_TYPE_FABRIC && os_handle != nullptr) {
    std::memcpy(out->fabric, os_handle, sizeof out->fabric);
    return true;
  }
  return false;
}

// The export of this process that `os_handle` names, if any.
bool find_export(void* os_handle, CUmemAllocationHandleType type, Export* out) noexcept {
  Export wanted{};
  if (!identity_of(os_handle, type, &wanted)) return false;
  return g_exports->find(export_key(wanted), out) && same_identity(*out, wanted);
}

// Forget the mappings in [at, end), one at a time.
void unmapped(std::uint64_t at, std::uint64_t end) noexcept {
  // Usually a chain: an unmap covers whole adjacent mappings (the driver
  // unmaps only entire mapped ranges), each starting where the last ended.
  while (at < end) {
    Mapping m{};
    if (!g_mappings->erase(at, &m) || m.size == 0) break;
    if (m.charged != 0) {
      release(m.entry, m.charged);
      oversub_freed(m.entry, limiter::AllocKind::vmm, m.charged);
    }
    unref(m.root);
    at = m.size > end - at ? end : at + m.size;
  }
  if (at >= end) return;
  // A mapping we could not record broke the chain: look for the rest.
  g_mappings->for_each_unlocked([&](std::uint64_t key, const Mapping&) {
    if (key < at || key >= end) return;
    Mapping m{};
    if (!g_mappings->erase(key, &m)) return;
    if (m.charged != 0) release(m.entry, m.charged);
    unref(m.root);
  });
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
  // A handle value the driver reuses is a new allocation: the old one was
  // released behind our back, and what it held went with it.
  g_alias->erase(*handle, nullptr);
  const Physical fresh{r.bytes, r.entry, 1, false, false, 0};
  if (!gpuslice::platform::record(*g_physical, *handle, fresh, [](const Physical& stale) {
        if (stale.bytes != 0) release(stale.entry, stale.bytes);
        if (stale.shared != 0) drop_shared(stale.shared - 1, stale.entry);
      })) {
    // No memory for our bookkeeping: undo rather than lose track.
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
    const Handle root = root_of(handle);
    unref(root);
    if (!g_physical->find(root, nullptr)) g_alias->erase(handle, nullptr);
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
  if (rc == CUDA_SUCCESS && handle != nullptr) add_ref(root_of(*handle));
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
  const void* os_handle = type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                              ? reinterpret_cast<void*>(static_cast<std::intptr_t>(*static_cast<int*>(shareable)))
                              : shareable;
  if (!identity_of(const_cast<void*>(os_handle), type, &e)) return rc;
  e.root = root_of(handle);
  // Marked first, so that the last release of the allocation finds the record.
  // Without the record a re-import counts as foreign memory: charged at map, never less.
  Physical p{};
  if (g_physical->update(e.root, [&](Physical& now) { return now.exported = true, p = now, false; }))
    g_exports->upsert(export_key(e), e, [&](Export& now, bool) {
      if (same_identity(now, e)) now = e;  // the same file or fabric handle exported again
    });
  // Published once, at the first export of memory this process counted: its
  // bytes become the container's shared entry (one count, whoever holds it).
  const int slot = g_process.slot.load(std::memory_order_acquire);
  if (p.bytes == 0 || p.foreign || p.shared != 0 || slot < 0 || g_process.region == nullptr) return rc;
  const int shared = gpuslice::limiter::shared_publish(g_process.region, slot, p.entry, export_key(e), p.bytes);
  if (shared < 0) return rc;  // table full: the importers are charged per mapping, never less
  hold_shared(shared);
  if (!g_physical->update(e.root, [&](Physical& now) { return now.bytes = 0, now.shared = shared + 1, false; }))
    drop_shared(shared, p.entry);  // released meanwhile: the entry goes with it
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os_handle,
                                                                CUmemAllocationHandleType type) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuMemImportFromShareableHandle == nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  rc = real_cuMemImportFromShareableHandle(handle, os_handle, type);
  if (rc != CUDA_SUCCESS || handle == nullptr) return rc;
  // Our own export imported again: one more reference to the original.
  Export e{};
  if (find_export(os_handle, type, &e) && add_ref(e.root)) {
    if (*handle != e.root) g_alias->upsert(*handle, Alias{e.root}, [&](Alias& a, bool) { a.root = e.root; });
    return rc;
  }
  // Which device the memory is on, for foreign memory.
  CUmemAllocationProp prop{};
  const bool device_memory = real_cuMemGetAllocationPropertiesFromHandle != nullptr &&
                             real_cuMemGetAllocationPropertiesFromHandle(&prop, *handle) == CUDA_SUCCESS &&
                             is_device_located(&prop);
  const int entry = device_memory ? device_entry(prop.location.id) : -1;
  if (entry < 0) return rc;
  // Exported by another process of this container: join its entry, charged nothing.
  const int slot = g_process.slot.load(std::memory_order_acquire);
  Export wanted{};
  const int shared = slot >= 0 && g_process.region != nullptr && identity_of(os_handle, type, &wanted)
                         ? gpuslice::limiter::shared_join(g_process.region, slot, entry, export_key(wanted))
                         : -1;
  if (shared >= 0) hold_shared(shared);
  bool again = false;
  g_physical->upsert(*handle, Physical{0, entry, 0, shared < 0, false, shared + 1}, [&](Physical& p, bool inserted) {
    ++p.refs;
    again = !inserted;
  });
  if (again && shared >= 0) drop_shared(shared, entry);  // the handle's record holds it already (or not: foreign)
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                          CUmemGenericAllocationHandle handle, unsigned long long flags) {
  CountingOp op;
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  // Foreign memory is charged for the mapping, before the driver maps it.
  const Handle root = root_of(handle);
  Physical p{};
  const int foreign_entry = g_physical->find(root, &p) && p.foreign ? p.entry : -1;
  if (foreign_entry >= 0 && !reserve(foreign_entry, size)) return CUDA_ERROR_OUT_OF_MEMORY;
  rc = real_cuMemMap(ptr, size, offset, handle, flags);
  if (rc != CUDA_SUCCESS) {
    if (foreign_entry >= 0) release(foreign_entry, size);
    return rc;
  }
  // The mapping holds a reference; one whose allocation we do not count (or
  // that was released meanwhile) is recorded without one, so that an unmap of
  // several adjacent mappings finds each of them.
  const bool counted = add_ref(root);
  if (!counted && foreign_entry >= 0) release(foreign_entry, size);
  const Mapping m{size, counted ? root : 0, counted && foreign_entry >= 0 ? size : 0, foreign_entry};
  if (!gpuslice::platform::record(*g_mappings, ptr, m, [](const Mapping& stale) {  // an unmap we never saw
        if (stale.charged != 0) release(stale.entry, stale.charged);
        unref(stale.root);
      })) {
    // Without the mapping record the handle's release frees the bytes early;
    // the agent's reconciliation would still see what the device holds.
    if (m.charged != 0) release(m.entry, m.charged);
    unref(m.root);
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  CountingOp op;
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemUnmap(ptr, size);
  if (rc == CUDA_SUCCESS) unmapped(ptr, size > ~std::uint64_t{0} - ptr ? ~std::uint64_t{0} : ptr + size);
  return rc;
}
