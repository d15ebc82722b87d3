// Legacy CUDA IPC (cuda.h, "Interprocess communication"): what vLLM's custom
// all-reduce and torch.multiprocessing use. The memory stays the exporter's
// (charged to its device and its process, as NVML shows it); an importer in
// another process maps it at an address of its own and is charged nothing.
// Events: an exported interprocess event opens as a local event with
// CU_EVENT_DISABLE_TIMING. Where cuda.h is silent the model refuses (README.md,
// "Legacy IPC").
#include <signal.h>
#include <unistd.h>

#include <cstring>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

constexpr std::uint64_t kMemMagic = 0x434d435049464b46ull;  // "FKFIPCMC"
constexpr std::uint64_t kEventMagic = 0x564543504946464bull;
// Opened mappings live above the VMM reservations (2^49...), never reused.
constexpr std::uint64_t kIpcBase = std::uint64_t{1} << 50;

// What a CUipcMemHandle (64 opaque bytes) carries in the model.
struct MemRecord {
  std::uint64_t magic;
  std::uint32_t exporter_pid;
  std::uint32_t device;
  std::uint64_t base;       // the exporter's address
  std::uint64_t size;       // the allocation's size
  std::uint64_t buffer_id;  // unique per allocation: a reused address gets a new handle
};
static_assert(sizeof(MemRecord) <= CU_IPC_HANDLE_SIZE);

struct EventRecord {
  std::uint64_t magic;
  std::uint32_t exporter_pid;
  std::uint32_t device;
};
static_assert(sizeof(EventRecord) <= CU_IPC_HANDLE_SIZE);

// An opened handle in this process (runtime mutex).
struct Opened {
  std::uint32_t exporter_pid;
  std::uint64_t buffer_id;
  std::uint64_t size;
  CUctx_st* ctx;
  int refs;
};
std::map<CUdeviceptr, Opened> g_opened;  // importer's address -> opened handle
std::uint64_t g_next_ipc = kIpcBase;

bool exporter_alive(std::uint32_t pid) { return pid != 0 && (kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM); }

}  // namespace

extern "C" CUresult cuIpcGetMemHandle(CUipcMemHandle* pHandle, CUdeviceptr dptr) {
  if (pHandle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  CUdeviceptr base = 0;
  const Allocation* a = find_allocation_locked(dptr, &base);
  // The base of a cuMemAlloc allocation (linear or pitched); pool, managed and
  // legacy 32-bit memory are not what cuda.h names here.
  if (a == nullptr || base != dptr || (a->kind != AllocKind::linear && a->kind != AllocKind::pitch)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  MemRecord record{kMemMagic, static_cast<std::uint32_t>(getpid()), a->device, base, a->held, a->buffer_id};
  std::memset(pHandle, 0, sizeof *pHandle);
  std::memcpy(pHandle->reserved, &record, sizeof record);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* pdptr, CUipcMemHandle handle, unsigned int Flags) {
  if (pdptr == nullptr || Flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  MemRecord record{};
  std::memcpy(&record, handle.reserved, sizeof record);
  if (record.magic != kMemMagic || record.size == 0) return CUDA_ERROR_INVALID_HANDLE;
  // A handle is for other processes: the exporter opening its own fails
  // (the real driver answers CUDA_ERROR_INVALID_CONTEXT; not stated by cuda.h).
  if (record.exporter_pid == static_cast<std::uint32_t>(getpid())) return CUDA_ERROR_INVALID_CONTEXT;
  if (!exporter_alive(record.exporter_pid)) return CUDA_ERROR_INVALID_HANDLE;  // its memory went with it
  // Peer mappings (a context on another device) are not modelled: refused.
  if (record.device != ctx->device) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard guard(runtime().mu);
  for (auto& [address, opened] : g_opened) {
    if (opened.exporter_pid != record.exporter_pid || opened.buffer_id != record.buffer_id) continue;
    // One context per device per other process may open it; the same one
    // again gets the same pointer with one more reference.
    if (opened.ctx != ctx) return CUDA_ERROR_INVALID_CONTEXT;
    ++opened.refs;
    *pdptr = address;
    return CUDA_SUCCESS;
  }
  const CUdeviceptr address = g_next_ipc;
  g_next_ipc += (record.size + (std::uint64_t{2} << 20) - 1) / (std::uint64_t{2} << 20) * (std::uint64_t{2} << 20);
  g_opened[address] = Opened{record.exporter_pid, record.buffer_id, record.size, ctx, 1};
  *pdptr = address;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuIpcOpenMemHandle(CUdeviceptr* pdptr, CUipcMemHandle handle, unsigned int Flags) {
  return cuIpcOpenMemHandle_v2(pdptr, handle, Flags);
}

// One reference less; the last one unmaps. Nothing is freed: the memory is the exporter's.
extern "C" CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  auto it = g_opened.find(dptr);
  if (it == g_opened.end()) return CUDA_ERROR_INVALID_VALUE;
  if (--it->second.refs == 0) g_opened.erase(it);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuIpcGetEventHandle(CUipcEventHandle* pHandle, CUevent event) {
  if (pHandle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(event)) return CUDA_ERROR_INVALID_HANDLE;
  constexpr unsigned kNeeded = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
  if ((event->flags & kNeeded) != kNeeded) return CUDA_ERROR_INVALID_VALUE;
  EventRecord record{kEventMagic, static_cast<std::uint32_t>(getpid()), event->ctx->device};
  std::memset(pHandle, 0, sizeof *pHandle);
  std::memcpy(pHandle->reserved, &record, sizeof record);
  return CUDA_SUCCESS;
}

// A local event with CU_EVENT_DISABLE_TIMING, freed with cuEventDestroy. Work
// recorded on it in another process is not linked (not modelled): it is
// complete until recorded here.
extern "C" CUresult cuIpcOpenEventHandle(CUevent* phEvent, CUipcEventHandle handle) {
  if (phEvent == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  EventRecord record{};
  std::memcpy(&record, handle.reserved, sizeof record);
  if (record.magic != kEventMagic) return CUDA_ERROR_INVALID_HANDLE;
  if (record.exporter_pid == static_cast<std::uint32_t>(getpid())) return CUDA_ERROR_INVALID_CONTEXT;
  if (record.device != ctx->device) return CUDA_ERROR_INVALID_VALUE;  // peer events not modelled
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  CUevent_st* event = r.events.make();
  event->ctx = ctx;
  event->flags = CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  *phEvent = event;
  return CUDA_SUCCESS;
}
