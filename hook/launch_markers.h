// The launch side's driver layer, shared by admission (launch.cc), the
// compute limiter's queue bound (launch_queue.cc) and priority's gate
// (priority_gate.cc): the stream a launch really goes to, its context and
// device, whether that stream is being captured, and rings of event markers
// recorded with the launches (a marker completes when the work queued before
// it on its stream has run). Every driver call goes through
// hook/real.h's real_ pointers, resolved with the rest at load time: none of
// these entry points is looked up by name later.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "hook/real.h"
#include "hook/sleep_lock.h"

namespace gpuslice::hook {

// The stream a launch really goes to: the per-thread default stream for a
// _ptsz launch on the null stream.
inline CUstream target_stream(CUstream s, bool ptsz) noexcept {
  return ptsz && s == nullptr ? CU_STREAM_PER_THREAD : s;
}

// The null, legacy and per-thread streams: the current context's, whichever
// that is when the work is queued (the driver has no context to tell for them).
inline bool current_context_stream(CUstream s) noexcept {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  return v == 0 || v == reinterpret_cast<std::uintptr_t>(CU_STREAM_LEGACY) ||
         v == reinterpret_cast<std::uintptr_t>(CU_STREAM_PER_THREAD);
}

// The ordinal of the current context's device; -1 when no context is current.
inline int current_ordinal() noexcept {
  CUdevice dev = 0;
  return real_cuCtxGetDevice(&dev) == CUDA_SUCCESS ? static_cast<int>(dev) : -1;
}

// The device of a stream that is not a current_context_stream(), asked of
// the driver (uncached: launch::stream_ordinal() caches the answer):
// cuStreamGetDevice (CUDA 12.8+), else the stream's context made current for
// one cuCtxGetDevice. -1 when the driver cannot tell.
[[gnu::noinline, gnu::cold]] int ask_stream_ordinal(CUstream s) noexcept;

// Launches into a capturing stream do not run: an event record there would
// become a node of the user's graph. False when the driver cannot tell.
bool capturing(CUstream s, bool ptsz) noexcept;

// The event API a marker needs (create, record, query, destroy); without it
// nothing tells when queued work completes.
bool markers_available() noexcept;
// ... and cuEventSynchronize, for a thread that blocks until a marker completes.
bool marker_waits_available() noexcept;

enum class MarkerState {
  done,     // the work queued before it has run
  pending,  // not yet
  gone,     // the driver no longer knows the event (its context was destroyed): the work behind it cannot run
};
MarkerState query_marker(CUevent event) noexcept;
// Blocks with the driver's synchronisation (the thread wakes when it completes, no polling).
MarkerState wait_marker(CUevent event) noexcept;

// Creates *event in the current context with `flags` unless it has one
// already; false when there is none.
bool ensure_marker_event(CUevent* event, unsigned flags) noexcept;
// Records *event on `target` (a target_stream()); when the driver refuses
// (e.g. an event of another context than the stream's), destroys it and sets
// it to null, so that the next one is created afresh.
CUresult record_marker_event(CUevent* event, CUstream target) noexcept;
// An event created with `flags` in the context of stream `s` (that context
// pushed for the call when it is not the current one; the current one for a
// current_context_stream()). CUDA_ERROR_INVALID_HANDLE when the driver cannot
// tell the stream's context, CUDA_ERROR_INVALID_CONTEXT when it cannot be
// made current.
CUresult create_event_for_stream(CUstream s, unsigned flags, CUevent* out) noexcept;
// Records *event (created with `flags` in the current context unless it has
// one already) on `target`, a target_stream(); when the driver refuses it
// (an event of another context than the stream's: a stream of another
// context, or device, than the current one), records one created in the
// stream's own context instead. *event is null after a failure.
CUresult record_marker_on_stream(CUevent* event, unsigned flags, CUstream target) noexcept;
// Destroys *event, if any, and sets it to null.
void drop_marker_event(CUevent* event) noexcept;
// The device time between two completed markers of one stream (events
// created with timing); false when the driver cannot tell.
bool marker_elapsed_ns(CUevent from, CUevent to, std::uint64_t* ns) noexcept;

// A ring of markers, oldest (head) to newest (tail). `Slot` holds `CUevent
// event` and what its owner keeps about the launch it follows; N is a power
// of two, so that the free-running 32-bit indices wrap with it. The owner
// holds `lock` around every use.
template <class Slot, unsigned N>
struct MarkerRing {
  static_assert(N != 0 && (N & (N - 1)) == 0);
  static constexpr unsigned kSize = N;
  SleepLock lock;
  std::uint32_t head = 0, tail = 0;
  Slot slots[N] = {};

  unsigned pending() const noexcept { return tail - head; }
  bool empty() const noexcept { return head == tail; }
  Slot& oldest() noexcept { return slots[head % N]; }
  // The slot retired just before the oldest: never reused while the oldest is pending.
  const Slot& before_oldest() const noexcept { return slots[(head + N - 1) % N]; }
  Slot& next() noexcept { return slots[tail % N]; }  // where the next marker goes
  void push() noexcept { ++tail; }
  void pop() noexcept { ++head; }
  // In a fork child (CUDA does not survive fork(): the events are gone). The
  // lock is the owner's to reset.
  void clear() noexcept {
    head = tail = 0;
    for (Slot& s : slots) s = Slot{};
  }
};

}  // namespace gpuslice::hook
