// External resource interoperability (the driver API's "External Resource
// Interoperability" group) over a simulated graphics allocator:
//   fakecuda_graphics_alloc   device memory a graphics API (Vulkan) allocates
//                             for this process: charged to it, so NVML shows it
//                             as the process's (a C+G process), never seen by
//                             a CUDA allocation call, and lists the process
//                             among those with a graphics context;
//   fakecuda_graphics_export_fd  an OPAQUE_FD referencing it (vkGetMemoryFdKHR);
//   fakecuda_graphics_free    the graphics API's free (vkFreeMemory);
//   fakecuda_graphics_semaphore  an OPAQUE_FD semaphore (vkGetSemaphoreFdKHR).
// The memory stays on the device while the graphics API or an import holds it.
// Only OPAQUE_FD handles of this process's own graphics allocator are
// modelled; everything the documentation leaves open is refused.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>

#include "driver.h"

struct CUextMemory_st {
  static constexpr std::uint32_t kAlive = 0xE7E7E7E7;
  std::uint64_t graphics = 0;  // id of the graphics allocation
  std::uint64_t size = 0;      // CUDA_EXTERNAL_MEMORY_HANDLE_DESC::size
  std::uint32_t device = 0;
  CUctx_st* ctx = nullptr;
};

struct CUextSemaphore_st {
  static constexpr std::uint32_t kAlive = 0xE5E5E5E5;
  std::uint64_t pending = 0;  // signals not yet waited for
};

using namespace gpuslice::fakecuda;

namespace {

struct GraphicsAlloc {
  std::uint32_t device = 0;
  std::uint64_t bytes = 0;
  int fd = -1;                // the memfd whose inode names the allocation
  bool freed = false;         // the graphics API freed it
  std::uint32_t imports = 0;  // live CUexternalMemory objects on it
};

// All under the runtime mutex.
std::map<std::uint64_t, GraphicsAlloc> g_graphics;  // id -> allocation
std::map<ino_t, std::uint64_t> g_by_inode;          // memfd inode -> id
std::map<ino_t, bool> g_semaphore_inodes;
std::uint64_t g_next_id = 1;
HandlePool<CUextMemory_st> g_memories;
HandlePool<CUextSemaphore_st> g_semaphores;

bool inode_of(int fd, ino_t* out) {
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0) return false;
  *out = st.st_ino;
  return true;
}

// The process's live graphics allocations on a device: NVML lists a process
// that has any among those with a graphics context (nvml.cc).
std::atomic<std::uint32_t>& graphics_count(std::uint32_t dev) {
  return state().header().slot[runtime().slot].graphics[dev];
}

// The device memory goes when neither the graphics API nor an import holds it.
void maybe_release_locked(std::uint64_t id) {
  auto it = g_graphics.find(id);
  if (it == g_graphics.end() || !it->second.freed || it->second.imports != 0) return;
  uncharge_device(it->second.device, it->second.bytes);
  graphics_count(it->second.device).fetch_sub(1, std::memory_order_relaxed);
  ino_t inode = 0;
  if (inode_of(it->second.fd, &inode)) g_by_inode.erase(inode);
  close(it->second.fd);
  g_graphics.erase(it);
}

}  // namespace

extern "C" uint64_t fakecuda_graphics_alloc(int dev, uint64_t bytes) {
  if (!initialized() || bytes == 0) return 0;
  if (!valid_device(dev)) return 0;
  std::lock_guard guard(runtime().mu);
  const int fd = memfd_create("fakecuda-graphics", MFD_CLOEXEC);
  ino_t inode = 0;
  if (!inode_of(fd, &inode)) {
    if (fd >= 0) close(fd);
    return 0;
  }
  if (charge_device(static_cast<std::uint32_t>(dev), bytes) != CUDA_SUCCESS) {
    close(fd);
    return 0;
  }
  graphics_count(static_cast<std::uint32_t>(dev)).fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t id = g_next_id++;
  g_graphics[id] = GraphicsAlloc{static_cast<std::uint32_t>(dev), bytes, fd, false, 0};
  g_by_inode[inode] = id;
  return id;
}

extern "C" int fakecuda_graphics_export_fd(uint64_t id) {
  std::lock_guard guard(runtime().mu);
  auto it = g_graphics.find(id);
  if (it == g_graphics.end() || it->second.freed) return -1;
  return fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
}

extern "C" int fakecuda_graphics_free(uint64_t id) {
  std::lock_guard guard(runtime().mu);
  auto it = g_graphics.find(id);
  if (it == g_graphics.end() || it->second.freed) return -1;
  it->second.freed = true;
  maybe_release_locked(id);
  return 0;
}

extern "C" int fakecuda_graphics_semaphore(void) {
  std::lock_guard guard(runtime().mu);
  const int fd = memfd_create("fakecuda-semaphore", MFD_CLOEXEC);
  ino_t inode = 0;
  if (!inode_of(fd, &inode)) return -1;
  g_semaphore_inodes[inode] = true;
  return fd;
}

extern "C" CUresult cuImportExternalMemory(CUexternalMemory* extMem_out,
                                           const CUDA_EXTERNAL_MEMORY_HANDLE_DESC* memHandleDesc) {
  if (extMem_out == nullptr || memHandleDesc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  const CUDA_EXTERNAL_MEMORY_HANDLE_DESC& d = *memHandleDesc;
  // Win32, D3D, NvSciBuf handles: not on this platform or not modelled.
  if (d.type != CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD) return CUDA_ERROR_NOT_SUPPORTED;
  if ((d.flags & ~static_cast<unsigned>(CUDA_EXTERNAL_MEMORY_DEDICATED)) != 0 || d.size == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (unsigned r : d.reserved) {
    if (r != 0) return CUDA_ERROR_INVALID_VALUE;
  }
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  ino_t inode = 0;
  if (!inode_of(d.handle.fd, &inode)) return CUDA_ERROR_INVALID_HANDLE;
  auto by = g_by_inode.find(inode);
  // Not a memory object of this process's graphics allocator (another
  // process's, or anything else): not modelled.
  if (by == g_by_inode.end()) return CUDA_ERROR_INVALID_HANDLE;
  GraphicsAlloc& g = g_graphics[by->second];
  if (d.size > g.bytes) return CUDA_ERROR_INVALID_VALUE;
  // Memory of another device than the current context's: undocumented.
  if (g.device != ctx->device) return CUDA_ERROR_NOT_SUPPORTED;
  CUextMemory_st* m = g_memories.make();
  m->graphics = by->second;
  m->size = d.size;
  m->device = ctx->device;
  m->ctx = memory_owner(ctx);
  ++g.imports;
  close(d.handle.fd);  // ownership of the descriptor passes to the driver on success
  *extMem_out = m;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuExternalMemoryGetMappedBuffer(CUdeviceptr* devPtr, CUexternalMemory extMem,
                                                    const CUDA_EXTERNAL_MEMORY_BUFFER_DESC* bufferDesc) {
  if (devPtr == nullptr || bufferDesc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(extMem)) return CUDA_ERROR_INVALID_HANDLE;
  const CUDA_EXTERNAL_MEMORY_BUFFER_DESC& b = *bufferDesc;
  if (b.flags != 0 || b.size == 0 || b.offset > extMem->size || b.size > extMem->size - b.offset) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // A new address onto memory already charged: it holds no device bytes of
  // its own (freed with cuMemFree, which returns nothing to the device).
  const CUdeviceptr base = reserve_address(extMem->device, b.size, 512);
  if (base == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  Allocation a;
  a.size = b.size;
  a.held = 0;
  a.device = extMem->device;
  a.ctx = extMem->ctx;
  a.kind = AllocKind::linear;  // held 0: its range goes back by size (memory.cc)
  register_allocation_locked(base, a);
  *devPtr = base;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuDestroyExternalMemory(CUexternalMemory extMem) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(extMem)) return CUDA_ERROR_INVALID_HANDLE;
  const std::uint64_t id = extMem->graphics;
  g_memories.retire(extMem);
  auto it = g_graphics.find(id);
  if (it != g_graphics.end() && it->second.imports > 0) --it->second.imports;
  maybe_release_locked(id);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuImportExternalSemaphore(CUexternalSemaphore* extSem_out,
                                              const CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC* semHandleDesc) {
  if (extSem_out == nullptr || semHandleDesc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (semHandleDesc->type != CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD) return CUDA_ERROR_NOT_SUPPORTED;
  if (semHandleDesc->flags != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard guard(runtime().mu);
  ino_t inode = 0;
  if (!inode_of(semHandleDesc->handle.fd, &inode) || g_semaphore_inodes.count(inode) == 0) {
    return CUDA_ERROR_INVALID_HANDLE;
  }
  g_semaphore_inodes.erase(inode);
  close(semHandleDesc->handle.fd);  // ownership passes to the driver on success
  *extSem_out = g_semaphores.make();
  return CUDA_SUCCESS;
}

namespace {

CUresult check_semaphores_locked(const CUexternalSemaphore* sems, const void* params, unsigned n) {
  if (n != 0 && (sems == nullptr || params == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  for (unsigned i = 0; i < n; ++i) {
    if (!alive(sems[i])) return CUDA_ERROR_INVALID_HANDLE;
  }
  return CUDA_SUCCESS;
}

}  // namespace

extern "C" CUresult cuSignalExternalSemaphoresAsync(const CUexternalSemaphore* extSemArray,
                                                    const CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS* paramsArray,
                                                    unsigned int numExtSems, CUstream stream) {
  if (!initialized()) return uninitialized_error();
  CUstream_st* s = nullptr;
  if (CUresult rc = resolve_stream(stream, false, &s); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  if (CUresult rc = check_semaphores_locked(extSemArray, paramsArray, numExtSems); rc != CUDA_SUCCESS) return rc;
  for (unsigned i = 0; i < numExtSems; ++i) ++extSemArray[i]->pending;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuWaitExternalSemaphoresAsync(const CUexternalSemaphore* extSemArray,
                                                  const CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS* paramsArray,
                                                  unsigned int numExtSems, CUstream stream) {
  if (!initialized()) return uninitialized_error();
  CUstream_st* s = nullptr;
  if (CUresult rc = resolve_stream(stream, false, &s); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  if (CUresult rc = check_semaphores_locked(extSemArray, paramsArray, numExtSems); rc != CUDA_SUCCESS) return rc;
  // A wait nothing signalled would wait for a graphics queue that is not
  // simulated: refused rather than completed.
  for (unsigned i = 0; i < numExtSems; ++i) {
    if (extSemArray[i]->pending == 0) return CUDA_ERROR_NOT_SUPPORTED;
  }
  for (unsigned i = 0; i < numExtSems; ++i) --extSemArray[i]->pending;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuDestroyExternalSemaphore(CUexternalSemaphore extSem) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(extSem)) return CUDA_ERROR_INVALID_HANDLE;
  g_semaphores.retire(extSem);
  return CUDA_SUCCESS;
}
