// Streams, events and synchronisation. Work is simulated on the device timeline
// (timeline.h); a stream only remembers when its last submitted work ends, and
// synchronising sleeps in real time until then, so contention between
// processes sharing a device is real.
#include <time.h>

#include <cerrno>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

struct PerThreadStream {
  CUctx_st* ctx = nullptr;
  CUstream_st* stream = nullptr;
};
// CU_STREAM_PER_THREAD / _ptsz: one stream per (thread, context).
thread_local PerThreadStream t_per_thread[8];
thread_local unsigned t_per_thread_next = 0;

void atomic_max(std::atomic<std::uint64_t>& target, std::uint64_t value) {
  std::uint64_t current = target.load(std::memory_order_relaxed);
  while (current < value && !target.compare_exchange_weak(current, value, std::memory_order_acq_rel)) {}
}

[[gnu::noinline, gnu::cold]] CUstream_st* make_per_thread_stream_locked(CUctx_st* ctx) {
  Runtime& r = runtime();
  CUstream_st* stream = r.streams.make();
  stream->ctx = ctx;
  stream->special = true;
  stream->id = next_object_id_locked();
  PerThreadStream& slot = t_per_thread[t_per_thread_next++ % 8];
  slot.ctx = ctx;
  slot.stream = stream;
  return stream;
}

CUstream_st* per_thread_stream(CUctx_st* ctx, bool locked) {
  for (PerThreadStream& slot : t_per_thread) {
    if (slot.ctx == ctx && alive(slot.stream) && slot.stream->ctx == ctx) return slot.stream;
  }
  if (locked) return make_per_thread_stream_locked(ctx);
  std::lock_guard guard(runtime().mu);
  return make_per_thread_stream_locked(ctx);
}

// resolve_stream; `locked`: the runtime mutex is held.
CUresult resolve(CUstream handle, bool per_thread_default, bool locked, CUstream_st** out) {
  CUctx_st* ctx = nullptr;
  if (handle == nullptr || handle == CU_STREAM_LEGACY || handle == CU_STREAM_PER_THREAD) {
    if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
    bool per_thread = handle == CU_STREAM_PER_THREAD || (handle == nullptr && per_thread_default);
    *out = per_thread ? per_thread_stream(ctx, locked) : ctx->null_stream;
    return CUDA_SUCCESS;
  }
  if (!alive(handle)) return CUDA_ERROR_INVALID_HANDLE;
  if (!alive(handle->ctx) || !handle->ctx->active.load(std::memory_order_acquire)) {
    return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  }
  *out = handle;
  return CUDA_SUCCESS;
}

// Legacy (null) streams synchronise with all work of their context.
std::uint64_t stream_end(const CUstream_st* stream) {
  if (stream == stream->ctx->null_stream) return stream->ctx->last_end_ns.load(std::memory_order_acquire);
  return stream->last_end_ns.load(std::memory_order_acquire);
}

// What a synchronisation or a query waits for, read with the runtime mutex
// held: another thread's cuDevicePrimaryCtxReset (or cuCtxDestroy) retires a
// context's streams under that mutex and a later create rebuilds their cells,
// so nothing of the stream is read after it is dropped (ThreadSanitizer found
// stream_end and resolve_stream reading retired and recycled cells). NVIDIA
// leaves a reset while other threads use the device to the caller; here a
// stream of a reset context is invalid: INVALID_HANDLE, or for the legacy
// stream the current context's error (INVALID_CONTEXT), never a crash.
struct Wait {
  std::uint64_t end_ns;  // ideal profile
  SchedWait sched;       // realistic profile (and the device)
  const void* frees_of;  // whose pool frees it observes (nullptr: every stream's)
};

CUresult resolve_wait(CUstream hStream, bool ptsz, Wait* out) {
  std::lock_guard guard(runtime().mu);
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve(hStream, ptsz, true, &stream); rc != CUDA_SUCCESS) return rc;
  if (stream->capture.load(std::memory_order_acquire) != nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  out->end_ns = stream_end(stream);
  out->sched = sched_wait_of_locked(stream);
  out->frees_of = stream == stream->ctx->null_stream ? nullptr : stream;
  return CUDA_SUCCESS;
}

CUresult stream_synchronize(CUstream hStream, bool ptsz) {
  if (!initialized()) return uninitialized_error();
  Wait wait{};
  if (CUresult rc = resolve_wait(hStream, ptsz, &wait); rc != CUDA_SUCCESS) return rc;
  if (realistic()) {
    sched_wait(wait.sched);
  } else {
    sleep_until(wait.end_ns);
  }
  pools_observe_frees(wait.sched.device, wait.frees_of);
  pools_trim_at_sync(wait.sched.device);
  return CUDA_SUCCESS;
}

CUresult stream_query(CUstream hStream, bool ptsz) {
  if (!initialized()) return uninitialized_error();
  Wait wait{};
  if (CUresult rc = resolve_wait(hStream, ptsz, &wait); rc != CUDA_SUCCESS) return rc;
  if (realistic()) return sched_wait_done(wait.sched) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
  return mono_ns() >= wait.end_ns ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult stream_create(CUstream* phStream, unsigned int flags, int priority) {
  if (phStream == nullptr || (flags & ~static_cast<unsigned>(CU_STREAM_NON_BLOCKING)) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  CUstream_st* stream = r.streams.make();
  stream->ctx = ctx;
  stream->flags = flags;
  // Priorities outside [greatest, least] = [-5, 0] are clamped, as documented.
  stream->priority = priority < -5 ? -5 : (priority > 0 ? 0 : priority);
  stream->id = next_object_id_locked();
  *phStream = stream;
  return CUDA_SUCCESS;
}

CUresult stream_wait_event(CUstream hStream, CUevent hEvent, bool ptsz) {
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  if (!alive(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
  if (realistic()) {
    sched_stream_wait_event(stream, hEvent);
    return CUDA_SUCCESS;
  }
  note_stream_work(stream, hEvent->time_ns.load(std::memory_order_acquire));
  return CUDA_SUCCESS;
}

CUresult event_record(CUevent hEvent, CUstream hStream, bool ptsz) {
  if (!initialized()) return uninitialized_error();
  if (!alive(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  if (stream->capture.load(std::memory_order_acquire) != nullptr) return CUDA_SUCCESS;  // not part of the graph model
  if (realistic()) {
    sched_event_record(hEvent, stream);
    return CUDA_SUCCESS;
  }
  // The event completes when the stream reaches it: after its queued work, or now.
  std::uint64_t now = mono_ns();
  std::uint64_t end = stream_end(stream);
  hEvent->time_ns.store(end > now ? end : now, std::memory_order_release);
  return CUDA_SUCCESS;
}

CUresult elapsed_time(float* pMilliseconds, CUevent hStart, CUevent hEnd) {
  if (pMilliseconds == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(hStart) || !alive(hEnd)) return CUDA_ERROR_INVALID_HANDLE;
  if (((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING) != 0) return CUDA_ERROR_INVALID_HANDLE;
  if (realistic() && (!sched_event_done(hStart) || !sched_event_done(hEnd))) return CUDA_ERROR_NOT_READY;
  std::uint64_t start = hStart->time_ns.load(std::memory_order_acquire);
  std::uint64_t end = hEnd->time_ns.load(std::memory_order_acquire);
  if (start == 0 || end == 0) return CUDA_ERROR_INVALID_HANDLE;
  std::uint64_t now = mono_ns();
  if (now < start || now < end) return CUDA_ERROR_NOT_READY;
  *pMilliseconds = static_cast<float>((static_cast<double>(end) - static_cast<double>(start)) / 1e6);
  return CUDA_SUCCESS;
}

}  // namespace

namespace gpuslice::fakecuda {

void sleep_until(std::uint64_t end_ns) {
  if (end_ns <= mono_ns()) return;
  timespec deadline{};
  deadline.tv_sec = static_cast<time_t>(end_ns / 1000000000ull);
  deadline.tv_nsec = static_cast<long>(end_ns % 1000000000ull);
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, nullptr) == EINTR) {}
}

void stream_wait_idle(CUstream_st* stream) {
  if (realistic()) {
    sched_stream_wait(stream);
  } else {
    sleep_until(stream_end(stream));
  }
}

void note_stream_work(CUstream_st* stream, std::uint64_t end_ns) {
  atomic_max(stream->last_end_ns, end_ns);
  atomic_max(stream->ctx->last_end_ns, end_ns);
}

CUresult resolve_stream(CUstream handle, bool per_thread_default, CUstream_st** out) {
  return resolve(handle, per_thread_default, false, out);
}

void streams_release_context_locked(CUctx_st* ctx) {
  Runtime& r = runtime();
  r.streams.for_each_live([&](CUstream_st* stream) {
    if (stream->ctx == ctx) r.streams.retire(stream);
  });
  r.events.for_each_live([&](CUevent_st* event) {
    if (event->ctx == ctx) r.events.retire(event);
  });
  ctx->null_stream = nullptr;
}

}  // namespace gpuslice::fakecuda

extern "C" CUresult cuStreamCreate(CUstream* phStream, unsigned int Flags) { return stream_create(phStream, Flags, 0); }

extern "C" CUresult cuStreamCreateWithPriority(CUstream* phStream, unsigned int flags, int priority) {
  return stream_create(phStream, flags, priority);
}

extern "C" CUresult cuStreamDestroy_v2(CUstream hStream) {
  if (!initialized()) return uninitialized_error();
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  if (!alive(hStream) || hStream->special) return CUDA_ERROR_INVALID_HANDLE;
  // A stream of a destroyed green context (green.cc): cuda.h 13.0 answers
  // CONTEXT_IS_DESTROYED, cuStreamDestroy included (the stream leaks).
  if (!hStream->ctx->active.load(std::memory_order_acquire)) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  // Queued work still completes on the device timeline; only the handle goes.
  r.streams.retire(hStream);
  return CUDA_SUCCESS;
}
extern "C" CUresult cuStreamDestroy(CUstream hStream) { return cuStreamDestroy_v2(hStream); }

extern "C" CUresult cuStreamSynchronize(CUstream hStream) { return stream_synchronize(hStream, false); }
extern "C" CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return stream_synchronize(hStream, true); }
extern "C" CUresult cuStreamQuery(CUstream hStream) { return stream_query(hStream, false); }
extern "C" CUresult cuStreamQuery_ptsz(CUstream hStream) { return stream_query(hStream, true); }

extern "C" CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  (void)Flags;
  return stream_wait_event(hStream, hEvent, false);
}
extern "C" CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  (void)Flags;
  return stream_wait_event(hStream, hEvent, true);
}

extern "C" CUresult cuStreamGetCtx(CUstream hStream, CUcontext* pctx) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, false, &stream); rc != CUDA_SUCCESS) return rc;
  *pctx = stream->ctx;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuStreamGetFlags(CUstream hStream, unsigned int* flags) {
  if (flags == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, false, &stream); rc != CUDA_SUCCESS) return rc;
  *flags = stream->flags;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuStreamGetPriority(CUstream hStream, int* priority) {
  if (priority == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, false, &stream); rc != CUDA_SUCCESS) return rc;
  *priority = stream->priority;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuStreamGetId(CUstream hStream, unsigned long long* streamId) {
  if (streamId == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, false, &stream); rc != CUDA_SUCCESS) return rc;
  *streamId = stream->id;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuStreamGetDevice(CUstream hStream, CUdevice* device) {
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, false, &stream); rc != CUDA_SUCCESS) return rc;
  *device = device_ordinal(stream->ctx->device);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuEventCreate(CUevent* phEvent, unsigned int Flags) {
  constexpr unsigned kKnown = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (phEvent == nullptr || (Flags & ~kKnown) != 0) return CUDA_ERROR_INVALID_VALUE;
  if ((Flags & CU_EVENT_INTERPROCESS) != 0 && (Flags & CU_EVENT_DISABLE_TIMING) == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  CUevent_st* event = r.events.make();
  event->ctx = ctx;
  event->flags = Flags;
  *phEvent = event;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuEventDestroy_v2(CUevent hEvent) {
  if (!initialized()) return uninitialized_error();
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  if (!alive(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
  r.events.retire(hEvent);
  return CUDA_SUCCESS;
}
extern "C" CUresult cuEventDestroy(CUevent hEvent) { return cuEventDestroy_v2(hEvent); }

extern "C" CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, false); }
extern "C" CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, true); }
extern "C" CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
  if ((flags & ~static_cast<unsigned>(CU_EVENT_RECORD_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
  return event_record(hEvent, hStream, false);
}
extern "C" CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags) {
  if ((flags & ~static_cast<unsigned>(CU_EVENT_RECORD_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
  return event_record(hEvent, hStream, true);
}

extern "C" CUresult cuEventQuery(CUevent hEvent) {
  if (!initialized()) return uninitialized_error();
  if (!alive(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
  if (realistic()) return sched_event_done(hEvent) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
  std::uint64_t time = hEvent->time_ns.load(std::memory_order_acquire);
  return time == 0 || mono_ns() >= time ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

extern "C" CUresult cuEventSynchronize(CUevent hEvent) {
  if (!initialized()) return uninitialized_error();
  if (!alive(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
  if (realistic()) {
    sched_event_wait(hEvent);
  } else {
    sleep_until(hEvent->time_ns.load(std::memory_order_acquire));
  }
  if (alive(hEvent->ctx)) pools_trim_at_sync(hEvent->ctx->device);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuEventElapsedTime(float* pMilliseconds, CUevent hStart, CUevent hEnd) {
  return elapsed_time(pMilliseconds, hStart, hEnd);
}
extern "C" CUresult cuEventElapsedTime_v2(float* pMilliseconds, CUevent hStart, CUevent hEnd) {
  return elapsed_time(pMilliseconds, hStart, hEnd);
}
