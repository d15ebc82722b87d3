// Green contexts and SM resources (cuda.h 13.0, "Green Contexts"): a device's
// SM resource, split by count at the documented granularity, a descriptor of
// the parts, and green contexts over it. A green context retains the device's
// primary context (released when it is destroyed); its CUcontext
// (cuCtxFromGreenCtx) is "a normal primary context but with the resources of
// the green context", so what it allocates belongs to the primary context
// (driver.h memory_owner), while its launches run in it on its device. What the
// header leaves open is refused (README, "Green contexts").
#include <cstring>

#include "driver.h"

using namespace gpuslice::fakecuda;

struct CUgreenCtx_st {
  CUctx_st* ctx = nullptr;  // its CUcontext (cuCtxFromGreenCtx)
  std::uint64_t id = 0;
  bool destroyed = false;
};

struct CUdevResourceDesc_st {
  std::uint32_t device = 0;  // physical
  unsigned sms = 0;
};

namespace {

// What the simulator keeps in a CUdevResource's opaque padding.
struct ResourceTag {
  std::uint32_t magic;
  std::uint32_t device;  // physical
  std::uint32_t split;   // the split that produced it (0: none; such a part cannot be split again)
};
constexpr std::uint32_t kResourceMagic = 0x46435253;  // "FCRS"
static_assert(sizeof(ResourceTag) <= sizeof(CUdevResource::_internal_padding));

// cuda.h's guideline for compute capability 9.0+ (the simulated device's):
// "The minimum count is 8 SMs and must be a multiple of 8".
constexpr unsigned kMinPartition = 8;
constexpr unsigned kAlignment = 8;

std::atomic<std::uint32_t> g_next_split{1};

// Green contexts are never freed: a destroyed one stays marked (streams made
// in it answer CONTEXT_IS_DESTROYED, and its handle is never reused).
std::mutex g_green_mu;
std::vector<std::unique_ptr<CUgreenCtx_st>> g_greens;
std::vector<std::unique_ptr<CUdevResourceDesc_st>> g_descs;

void fill(CUdevResource* out, std::uint32_t device, unsigned sms, std::uint32_t split) {
  std::memset(out, 0, sizeof(*out));
  out->type = CU_DEV_RESOURCE_TYPE_SM;
  out->sm.smCount = sms;
  out->sm.minSmPartitionSize = kMinPartition;
  out->sm.smCoscheduledAlignment = kAlignment;
  const ResourceTag tag{kResourceMagic, device, split};
  std::memcpy(out->_internal_padding, &tag, sizeof(tag));
}

bool read_tag(const CUdevResource* r, ResourceTag* tag) {
  std::memcpy(tag, r->_internal_padding, sizeof(*tag));
  return tag->magic == kResourceMagic;
}

bool live_green(CUgreenCtx h) {
  std::lock_guard guard(g_green_mu);
  for (auto& g : g_greens)
    if (g.get() == h) return !g->destroyed;
  return false;
}

}  // namespace

extern "C" CUresult cuDeviceGetDevResource(CUdevice device, CUdevResource* resource, CUdevResourceType type) {
  if (!initialized()) return uninitialized_error();
  if (resource == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_RESOURCE_TYPE;
  fill(resource, physical_device(device), state().header().sms, 0);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxGetDevResource(CUcontext hCtx, CUdevResource* resource, CUdevResourceType type) {
  if (!initialized()) return uninitialized_error();
  if (resource == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (hCtx == nullptr || !alive(hCtx) || !hCtx->active.load(std::memory_order_acquire))
    return CUDA_ERROR_INVALID_CONTEXT;
  if (type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_RESOURCE_TYPE;
  fill(resource, hCtx->device, hCtx->base != nullptr ? hCtx->sm_count : state().header().sms, 0);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGreenCtxGetDevResource(CUgreenCtx hCtx, CUdevResource* resource, CUdevResourceType type) {
  if (!initialized()) return uninitialized_error();
  if (resource == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!live_green(hCtx)) return CUDA_ERROR_INVALID_CONTEXT;
  if (type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_RESOURCE_TYPE;
  fill(resource, hCtx->ctx->device, hCtx->ctx->sm_count, 0);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuDevSmResourceSplitByCount(CUdevResource* result, unsigned int* nbGroups,
                                                const CUdevResource* input, CUdevResource* remaining,
                                                unsigned int useFlags, unsigned int minCount) {
  if (!initialized()) return uninitialized_error();
  if (nbGroups == nullptr || input == nullptr) return CUDA_ERROR_INVALID_VALUE;
  ResourceTag tag{};
  if (input->type != CU_DEV_RESOURCE_TYPE_SM || !read_tag(input, &tag)) return CUDA_ERROR_INVALID_RESOURCE_TYPE;
  // "the output results cannot be split again without first creating a
  // descriptor and a green context": the error is not documented (the model's).
  if (tag.split != 0) return CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION;
  // IGNORE_SM_COSCHEDULING lowers the granularity by an undocumented amount.
  if (useFlags & CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING) return CUDA_ERROR_NOT_SUPPORTED;
  if ((useFlags & ~static_cast<unsigned>(CU_DEV_SM_RESOURCE_SPLIT_MAX_POTENTIAL_CLUSTER_SIZE)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  const unsigned total = input->sm.smCount;
  if (minCount > total) return CUDA_ERROR_INVALID_VALUE;
  // Rounded up to the alignment, never below the minimum partition.
  unsigned group = (minCount + kAlignment - 1) / kAlignment * kAlignment;
  if (group < kMinPartition) group = kMinPartition;
  const unsigned possible = total / group;
  if (result == nullptr) {
    *nbGroups = possible;
    return CUDA_SUCCESS;
  }
  const unsigned made = *nbGroups < possible ? *nbGroups : possible;
  const std::uint32_t split = g_next_split.fetch_add(1, std::memory_order_relaxed);
  for (unsigned i = 0; i < made; ++i) fill(&result[i], tag.device, group, split);
  if (remaining != nullptr) fill(remaining, tag.device, total - made * group, split);
  *nbGroups = made;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuDevResourceGenerateDesc(CUdevResourceDesc* phDesc, CUdevResource* resources,
                                              unsigned int nbResources) {
  if (!initialized()) return uninitialized_error();
  if (phDesc == nullptr || resources == nullptr || nbResources == 0) return CUDA_ERROR_INVALID_VALUE;
  ResourceTag first{};
  unsigned sms = 0;
  for (unsigned i = 0; i < nbResources; ++i) {
    ResourceTag tag{};
    if (resources[i].type != CU_DEV_RESOURCE_TYPE_SM || !read_tag(&resources[i], &tag))
      return CUDA_ERROR_INVALID_RESOURCE_TYPE;
    if (i == 0) first = tag;
    if (tag.device != first.device) return CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION;
    // Several SM resources must come out of one split.
    if (nbResources > 1 && (tag.split == 0 || tag.split != first.split))
      return CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION;
    sms += resources[i].sm.smCount;
  }
  std::lock_guard guard(g_green_mu);
  g_descs.push_back(std::make_unique<CUdevResourceDesc_st>());
  g_descs.back()->device = first.device;
  g_descs.back()->sms = sms;
  *phDesc = g_descs.back().get();
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGreenCtxCreate(CUgreenCtx* phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags) {
  if (!initialized()) return uninitialized_error();
  if (phCtx == nullptr || desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  {
    std::lock_guard guard(g_green_mu);
    bool known = false;
    for (auto& d : g_descs) known = known || d.get() == desc;
    if (!known) return CUDA_ERROR_INVALID_VALUE;
  }
  if (flags != CU_GREEN_CTX_DEFAULT_STREAM) return CUDA_ERROR_INVALID_VALUE;  // "Required", the only flag
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (desc->device != physical_device(dev)) return CUDA_ERROR_INVALID_VALUE;  // resources of another device
  CUctx_st* primary = nullptr;
  if (CUresult rc = primary_retain(dev, &primary); rc != CUDA_SUCCESS) return rc;
  Runtime& r = runtime();
  CUctx_st* ctx = nullptr;
  {
    std::lock_guard guard(r.mu);
    ctx = r.contexts.make();
    ctx->device = primary->device;
    ctx->flags = primary->flags;
    ctx->base = primary;
    ctx->sm_count = desc->sms;
    ctx->id = next_object_id_locked();
    ctx->null_stream = make_null_stream_locked(ctx);
    ctx->active.store(true, std::memory_order_release);
  }
  std::lock_guard guard(g_green_mu);
  g_greens.push_back(std::make_unique<CUgreenCtx_st>());
  CUgreenCtx_st* green = g_greens.back().get();
  green->ctx = ctx;
  {
    std::lock_guard registry(r.mu);
    green->id = next_object_id_locked();
  }
  ctx->green = green;
  *phCtx = green;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGreenCtxDestroy(CUgreenCtx hCtx) {
  if (!initialized()) return uninitialized_error();
  {
    std::lock_guard guard(g_green_mu);
    bool known = false;
    for (auto& g : g_greens) known = known || g.get() == hCtx;
    if (!known) return CUDA_ERROR_INVALID_CONTEXT;
    if (hCtx->destroyed) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    hCtx->destroyed = true;
  }
  CUctx_st* ctx = hCtx->ctx;
  context_wait_idle(ctx);
  Runtime& r = runtime();
  {
    std::lock_guard guard(r.mu);
    // Its streams stay (cuda.h: not destroyed; every later call on them,
    // cuStreamDestroy included, is CONTEXT_IS_DESTROYED); its default stream goes.
    ctx->active.store(false, std::memory_order_release);
    if (alive(ctx->null_stream)) r.streams.retire(ctx->null_stream);
    ctx->null_stream = nullptr;
  }
  return primary_release(device_ordinal(ctx->device), false);
}

extern "C" CUresult cuCtxFromGreenCtx(CUcontext* pContext, CUgreenCtx hCtx) {
  if (!initialized()) return uninitialized_error();
  if (pContext == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!live_green(hCtx)) return CUDA_ERROR_INVALID_CONTEXT;
  *pContext = hCtx->ctx;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGreenCtxStreamCreate(CUstream* phStream, CUgreenCtx greenCtx, unsigned int flags, int priority) {
  if (!initialized()) return uninitialized_error();
  if (phStream == nullptr || flags != CU_STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;  // "must be specified"
  if (!live_green(greenCtx)) return CUDA_ERROR_INVALID_CONTEXT;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  CUstream_st* stream = r.streams.make();
  stream->ctx = greenCtx->ctx;
  stream->flags = flags;
  stream->priority = priority < -5 ? -5 : (priority > 0 ? 0 : priority);  // clamped, as cuStreamCreateWithPriority
  stream->id = next_object_id_locked();
  *phStream = stream;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuGreenCtxGetId(CUgreenCtx greenCtx, unsigned long long* greenCtxId) {
  if (!initialized()) return uninitialized_error();
  if (greenCtxId == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (greenCtx == nullptr) {  // "the Id of the current green context"
    CUctx_st* ctx = nullptr;
    if (current_context(&ctx) != CUDA_SUCCESS || ctx->green == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    greenCtx = ctx->green;
  }
  {
    std::lock_guard guard(g_green_mu);
    bool known = false;
    for (auto& g : g_greens) known = known || g.get() == greenCtx;
    if (!known) return CUDA_ERROR_INVALID_CONTEXT;
    if (greenCtx->destroyed) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  }
  *greenCtxId = greenCtx->id;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuStreamGetGreenCtx(CUstream hStream, CUgreenCtx* phCtx) {
  if (!initialized()) return uninitialized_error();
  if (phCtx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, false, &stream); rc != CUDA_SUCCESS) return rc;
  *phCtx = stream->ctx->green;
  return CUDA_SUCCESS;
}
