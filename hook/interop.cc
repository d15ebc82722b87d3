// External memory (graphics interop: Vulkan, OptiX, ggml's Vulkan backend).
// Memory a graphics API allocated is on the device and NVML attributes it to
// the process, but no CUDA allocation call made it: gpuslice counts it when
// the process imports it into CUDA (cuImportExternalMemory, desc.size bytes on
// the current context's device), refusing the import over the quota or the
// device-resident allowance (at once under `wait` too: the memory is already
// on the device), and gives the bytes back at cuDestroyExternalMemory. A
// buffer mapped onto it (cuExternalMemoryGetMappedBuffer) adds no memory and is freed with cuMemFree,
// which finds its record of 0 bytes and releases nothing; a counted record at
// the address the driver gave the buffer is stale and released
// (hook/memory.h, take_address_uncounted). Semaphores pass through.
// docs/memory.md, "Graphics interop".
// gpuslice: hot path (no heap, no locks)
#include <cuda.h>

#include "hook/memory.h"
#include "hook/oversub.h"
#include "hook/wrap.h"

using namespace gpuslice;
using namespace gpuslice::hook;

namespace {
constinit NoDestroy<limiter::AllocTable> g_imports;  // CUexternalMemory -> counted bytes
}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuImportExternalMemory(CUexternalMemory* extMem_out,
                                                        const CUDA_EXTERNAL_MEMORY_HANDLE_DESC* memHandleDesc) {
  CountingOp op;
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  // Arguments the driver refuses go to it unchanged (its own error).
  if (extMem_out == nullptr || memHandleDesc == nullptr || memHandleDesc->size == 0)
    return real_cuImportExternalMemory(extMem_out, memHandleDesc);
  // Over the quota the import is refused before the driver takes the
  // descriptor: the caller still owns it (ownership passes only on success).
  Reservation r;
  rc = reserve_on_current(memHandleDesc->size, &r);
  if (rc != CUDA_SUCCESS) return rc;
  // Device memory that cannot spill, like VMM memory: over the device-resident
  // allowance it is refused, under `wait` too (after the reap of dead
  // holders): the graphics API put it on the device before the import, so
  // waiting cannot make it fit and only keeps the container above the
  // allowance while the program, blocked here, cannot free it.
  if (!resident_admits(r.entry, /*may_wait=*/false)) {
    release(r.entry, r.bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  rc = real_cuImportExternalMemory(extMem_out, memHandleDesc);
  commit(*g_imports, rc, r, rc == CUDA_SUCCESS ? reinterpret_cast<std::uint64_t>(*extMem_out) : 0,
         limiter::AllocKind::vmm);  // a memory object, like a VMM handle
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuDestroyExternalMemory(CUexternalMemory extMem) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  // No driver query tells a destroyed external memory object from a live
  // one: a refused destroy keeps its count (the safe side).
  return free_counted(
      *g_imports, reinterpret_cast<std::uint64_t>(extMem), [&] { return real_cuDestroyExternalMemory(extMem); },
      [](std::uint64_t, const limiter::AllocRecord&) noexcept { return false; });
}

// No memory of its own: the address is new to the driver's map, so a record
// of ours there is of memory gone (a destroyed context's allocation, whose
// sweep asked about the address after the driver handed it to this buffer).
// The buffer takes the address with a record of 0 bytes (take_address_
// uncounted): erasing the stale one instead missed it while a sweep held it
// out to ask the driver, and the sweep then put it back (TSan, 2 of 8 rounds).
GPUSLICE_EXPORT CUresult CUDAAPI cuExternalMemoryGetMappedBuffer(CUdeviceptr* devPtr, CUexternalMemory extMem,
                                                                 const CUDA_EXTERNAL_MEMORY_BUFFER_DESC* bufferDesc) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuExternalMemoryGetMappedBuffer(devPtr, extMem, bufferDesc);
  if (rc == CUDA_SUCCESS && devPtr != nullptr) take_address_uncounted(*devPtr);
  return rc;
}
