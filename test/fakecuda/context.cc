// Contexts: created contexts and per-device primary contexts, and the calling
// thread's context stack. Each live context holds FAKECUDA_CONTEXT_MEMORY of its
// device (a primary one while retained), and destroying a context frees what it
// owns, as the real driver does.
#include <algorithm>
#include <type_traits>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

// The calling thread's context stack. Trivially destructible on purpose: a
// std::vector here was destroyed with the thread's TLS at exit, and a CUDA call
// from a later destructor then crashed (issue 9); this one stays valid.
class ContextStack {
 public:
  bool empty() const { return size_ == 0; }
  CUctx_st*& back() { return entries_[size_ - 1]; }
  bool push_back(CUctx_st* ctx) {
    if (size_ == kDepth) return false;
    entries_[size_++] = ctx;
    return true;
  }
  void pop_back() { --size_; }
  void remove(CUctx_st* ctx) {
    unsigned out = 0;
    for (unsigned i = 0; i < size_; ++i) {
      if (entries_[i] != ctx) entries_[out++] = entries_[i];
    }
    size_ = out;
  }

 private:
  static constexpr unsigned kDepth = 256;
  CUctx_st* entries_[kDepth];
  unsigned size_;
};
static_assert(std::is_trivially_destructible_v<ContextStack>);
thread_local ContextStack t_stack;

CUresult charge_context(std::uint32_t dev) {
  Runtime& r = runtime();
  State& s = *r.state;
  State::Lock lock(s);
  if (!lock.ok()) return CUDA_ERROR_UNKNOWN;
  s.reap_locked(r.slot);
  if (!s.charge_locked(r.slot, dev, s.header().context_bytes, true)) return CUDA_ERROR_OUT_OF_MEMORY;
  s.header().slot[r.slot].contexts[dev].fetch_add(1, std::memory_order_relaxed);
  return CUDA_SUCCESS;
}

void uncharge_context(std::uint32_t dev) {
  Runtime& r = runtime();
  r.state->uncharge(r.slot, dev, r.state->header().context_bytes, true);
  r.state->header().slot[r.slot].contexts[dev].fetch_sub(1, std::memory_order_relaxed);
}

// Frees everything the context owns and its device memory. Runtime mutex held.
void teardown_context_locked(CUctx_st* ctx) {
  memory_release_context_locked(ctx);
  arrays_release_context_locked(ctx);
  modules_release_context_locked(ctx);
  streams_release_context_locked(ctx);
  ctx->active.store(false, std::memory_order_release);
  if (ctx->heap_extra != 0) uncharge_device(ctx->device, ctx->heap_extra);
  ctx->heap_extra = 0;
  ctx->limits[CU_LIMIT_MALLOC_HEAP_SIZE] = 0;
  ctx->peers.clear();  // peer access goes with the context
  uncharge_context(ctx->device);
}

CUresult create_context(CUcontext* pctx, unsigned int flags, CUdevice dev) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  const std::uint32_t device = physical_device(dev);
  if (CUresult rc = charge_context(device); rc != CUDA_SUCCESS) return rc;
  CUctx_st* ctx = r.contexts.make();
  ctx->device = device;
  ctx->flags = flags;
  ctx->id = next_object_id_locked();
  ctx->null_stream = make_null_stream_locked(ctx);
  ctx->active.store(true, std::memory_order_release);
  t_stack.push_back(ctx);
  *pctx = ctx;
  return CUDA_SUCCESS;
}

void wait_idle(CUctx_st* ctx) {
  if (realistic()) return sched_context_wait(ctx);
  sleep_until(ctx->last_end_ns.load(std::memory_order_acquire));
}

}  // namespace

namespace gpuslice::fakecuda {

CUstream_st* make_null_stream_locked(CUctx_st* ctx) {
  CUstream_st* stream = runtime().streams.make();
  stream->ctx = ctx;
  stream->special = true;
  stream->id = next_object_id_locked();
  return stream;
}

void context_wait_idle(CUctx_st* ctx) { wait_idle(ctx); }

CUresult current_context(CUctx_st** out) {
  if (t_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  CUctx_st* ctx = t_stack.back();
  if (!alive(ctx)) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (!ctx->active.load(std::memory_order_acquire)) return CUDA_ERROR_INVALID_CONTEXT;
  *out = ctx;
  return CUDA_SUCCESS;
}

CUresult resolve_context(CUcontext ctx, CUctx_st** out) {
  if (ctx == nullptr) return current_context(out);
  if (!alive(ctx) || !ctx->active.load(std::memory_order_acquire)) return CUDA_ERROR_INVALID_CONTEXT;
  *out = ctx;
  return CUDA_SUCCESS;
}

}  // namespace gpuslice::fakecuda

extern "C" CUresult cuCtxCreate_v2(CUcontext* pctx, unsigned int flags, CUdevice dev) {
  return create_context(pctx, flags, dev);
}

extern "C" CUresult cuCtxCreate(CUcontext* pctx, unsigned int flags, CUdevice_v1 dev) {
  return create_context(pctx, flags, dev);
}

extern "C" CUresult cuCtxCreate_v3(CUcontext* pctx, CUexecAffinityParam* paramsArray, int numParams, unsigned int flags,
                                   CUdevice dev) {
  if (numParams < 0 || (numParams > 0 && paramsArray == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  if (numParams > 0) return CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY;  // no SM partitioning simulated
  return create_context(pctx, flags, dev);
}

extern "C" CUresult cuCtxCreate_v4(CUcontext* pctx, CUctxCreateParams* ctxCreateParams, unsigned int flags,
                                   CUdevice dev) {
  if (ctxCreateParams != nullptr) {
    if (ctxCreateParams->numExecAffinityParams > 0) return CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY;
    if (ctxCreateParams->cigParams != nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  }
  return create_context(pctx, flags, dev);
}

extern "C" CUresult cuCtxDestroy_v2(CUcontext ctx) {
  if (!initialized()) return uninitialized_error();
  if (!alive(ctx) || ctx->primary || ctx->base != nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  wait_idle(ctx);
  Runtime& r = runtime();
  {
    std::lock_guard guard(r.mu);
    if (!alive(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    teardown_context_locked(ctx);
    r.contexts.retire(ctx);
  }
  // Only the calling thread's stack is popped; other threads keep a stale handle
  // and get CUDA_ERROR_CONTEXT_IS_DESTROYED, as with the real driver.
  t_stack.remove(ctx);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }

namespace gpuslice::fakecuda {

CUresult primary_retain(CUdevice dev, CUctx_st** out) {
  if (!initialized()) return uninitialized_error();
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  CUctx_st*& primary = r.primary[dev];
  if (primary == nullptr) {
    primary = r.contexts.make();
    primary->primary = true;
    primary->device = physical_device(dev);
    primary->id = next_object_id_locked();
  }
  if (primary->retain_count == 0) {
    if (CUresult rc = charge_context(primary->device); rc != CUDA_SUCCESS) return rc;
    if (!alive(primary->null_stream)) primary->null_stream = make_null_stream_locked(primary);
    primary->active.store(true, std::memory_order_release);
  }
  ++primary->retain_count;
  *out = primary;
  return CUDA_SUCCESS;
}

}  // namespace gpuslice::fakecuda

extern "C" CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* primary = nullptr;
  if (CUresult rc = primary_retain(dev, &primary); rc != CUDA_SUCCESS) return rc;
  *pctx = primary;
  return CUDA_SUCCESS;
}

namespace gpuslice::fakecuda {

CUresult primary_release(CUdevice dev, bool reset) {
  if (!initialized()) return uninitialized_error();
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Runtime& r = runtime();
  CUctx_st* primary = nullptr;
  {
    std::lock_guard guard(r.mu);
    primary = r.primary[dev];
    if (primary == nullptr || primary->retain_count == 0) return reset ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (!reset && primary->retain_count > 1) {
      --primary->retain_count;
      return CUDA_SUCCESS;
    }
  }
  wait_idle(primary);
  std::lock_guard guard(r.mu);
  if (primary->retain_count == 0) return CUDA_SUCCESS;
  primary->retain_count = 0;
  teardown_context_locked(primary);
  return CUDA_SUCCESS;
}

}  // namespace gpuslice::fakecuda

extern "C" CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return primary_release(dev, false); }
extern "C" CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return primary_release(dev, false); }
extern "C" CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { return primary_release(dev, true); }
extern "C" CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return primary_release(dev, true); }

extern "C" CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  if (flags == nullptr || active == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  CUctx_st* primary = r.primary[dev];
  *flags = primary != nullptr ? primary->flags : 0;
  *active = primary != nullptr && primary->retain_count > 0 ? 1 : 0;
  return CUDA_SUCCESS;
}

namespace {

CUresult primary_set_flags(CUdevice dev, unsigned int flags, bool allow_active) {
  if (!initialized()) return uninitialized_error();
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if ((flags & ~0xFFu) != 0) return CUDA_ERROR_INVALID_VALUE;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  CUctx_st*& primary = r.primary[dev];
  if (primary == nullptr) {
    primary = r.contexts.make();
    primary->primary = true;
    primary->device = physical_device(dev);
    primary->id = next_object_id_locked();
  }
  // Before CUDA 11 the flags of an active primary context could not change.
  if (!allow_active && primary->retain_count > 0) return CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE;
  primary->flags = flags;
  return CUDA_SUCCESS;
}

}  // namespace

extern "C" CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
  return primary_set_flags(dev, flags, true);
}
extern "C" CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
  return primary_set_flags(dev, flags, false);
}

extern "C" CUresult cuCtxGetCurrent(CUcontext* pctx) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  *pctx = t_stack.empty() ? nullptr : t_stack.back();
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxSetCurrent(CUcontext ctx) {
  if (!initialized()) return uninitialized_error();
  if (ctx == nullptr) {
    if (!t_stack.empty()) t_stack.pop_back();
    return CUDA_SUCCESS;
  }
  if (!alive(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  if (t_stack.empty()) {
    t_stack.push_back(ctx);
  } else {
    t_stack.back() = ctx;
  }
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  if (!initialized()) return uninitialized_error();
  if (!alive(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  // The fake's stack holds 256 contexts per thread; deeper is refused.
  return t_stack.push_back(ctx) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
extern "C" CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }

extern "C" CUresult cuCtxPopCurrent_v2(CUcontext* pctx) {
  if (!initialized()) return uninitialized_error();
  if (t_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (pctx != nullptr) *pctx = t_stack.back();
  t_stack.pop_back();
  return CUDA_SUCCESS;
}
extern "C" CUresult cuCtxPopCurrent(CUcontext* pctx) { return cuCtxPopCurrent_v2(pctx); }

extern "C" CUresult cuCtxGetDevice(CUdevice* device) {
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  *device = device_ordinal(ctx->device);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxGetDevice_v2(CUdevice* device, CUcontext ctx) {
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* resolved = nullptr;
  if (CUresult rc = resolve_context(ctx, &resolved); rc != CUDA_SUCCESS) return rc;
  *device = device_ordinal(resolved->device);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxSynchronize_v2(CUcontext ctx) {
  if (!initialized()) return uninitialized_error();
  CUctx_st* resolved = nullptr;
  if (CUresult rc = resolve_context(ctx, &resolved); rc != CUDA_SUCCESS) return rc;
  wait_idle(resolved);
  pools_observe_frees(resolved->device, nullptr);
  pools_trim_at_sync(resolved->device);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxSynchronize(void) { return cuCtxSynchronize_v2(nullptr); }

extern "C" CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int* version) {
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* resolved = nullptr;
  if (CUresult rc = resolve_context(ctx, &resolved); rc != CUDA_SUCCESS) return rc;
  *version = 3020;  // every context created through the _v2+ API reports 3020
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxGetFlags(unsigned int* flags) {
  if (flags == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  *flags = ctx->flags;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxGetId(CUcontext ctx, unsigned long long* ctxId) {
  if (ctxId == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* resolved = nullptr;
  if (CUresult rc = resolve_context(ctx, &resolved); rc != CUDA_SUCCESS) return rc;
  *ctxId = resolved->id;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxGetStreamPriorityRange(int* leastPriority, int* greatestPriority) {
  if (!initialized()) return uninitialized_error();
  if (leastPriority != nullptr) *leastPriority = 0;
  if (greatestPriority != nullptr) *greatestPriority = -5;
  return CUDA_SUCCESS;
}

namespace {
constexpr std::size_t kDefaultLimits[] = {1024, 1 << 20, 8 << 20, 2, 2048, 32, 0, 0, 0, 0};
}

extern "C" CUresult cuCtxGetLimit(size_t* pvalue, CUlimit limit) {
  if (pvalue == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (limit < 0 || limit >= CU_LIMIT_MAX) return CUDA_ERROR_UNSUPPORTED_LIMIT;
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  *pvalue = ctx->limits[limit] != 0 ? ctx->limits[limit] : kDefaultLimits[limit];
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
  if (!initialized()) return uninitialized_error();
  if (limit < 0 || limit >= CU_LIMIT_MAX) return CUDA_ERROR_UNSUPPORTED_LIMIT;
  if (limit == CU_LIMIT_SHMEM_SIZE || limit == CU_LIMIT_CIG_ENABLED) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  if (limit == CU_LIMIT_MALLOC_HEAP_SIZE) {
    // The device malloc heap is device memory the driver reserves for the
    // context (cuda.h: such reservations failing make cuCtxSetLimit return
    // CUDA_ERROR_OUT_OF_MEMORY). The default heap is part of the context's own
    // memory; a larger one holds the difference from now on.
    std::lock_guard guard(runtime().mu);
    const std::uint64_t extra = value > kDefaultLimits[limit] ? value - kDefaultLimits[limit] : 0;
    if (extra > ctx->heap_extra) {
      if (CUresult rc = charge_device(ctx->device, extra - ctx->heap_extra); rc != CUDA_SUCCESS) return rc;
    } else if (extra < ctx->heap_extra) {
      uncharge_device(ctx->device, ctx->heap_extra - extra);
    }
    ctx->heap_extra = extra;
  }
  ctx->limits[limit] = value;
  return CUDA_SUCCESS;
}
