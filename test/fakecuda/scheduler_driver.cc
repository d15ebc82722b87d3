// The driver side of the realistic profile's scheduler (scheduler.h): launches and
// markers become scheduler entries; synchronisation advances the simulation and
// sleeps until the awaited work has run. Ideal-profile code never comes here.
#include <sched.h>
#include <time.h>

#include "driver.h"

namespace gpuslice::fakecuda {

namespace {

constexpr std::uint64_t kMinPollNs = 2000;        // shortest wait between checks
constexpr std::uint64_t kSpinBelowNs = 200000;    // shorter waits yield instead of sleeping
constexpr std::uint64_t kReapEveryNs = 20000000;  // waiters reap dead processes this often

std::uint64_t own_slot_bits() { return std::uint64_t{static_cast<std::uint32_t>(runtime().slot)}; }

// Process-unique keys for streams and contexts across every process's entries.
std::uint64_t key_of(std::uint64_t id) { return (own_slot_bits() + 1) << 40 | id; }

SchedStreamInfo info_for(CUstream_st* stream) {
  Runtime& r = runtime();
  SchedStreamInfo info;
  info.key = key_of(stream->id);
  info.ctx_key = key_of(stream->ctx->id);
  info.pids = (std::uint64_t{r.submitter.host_pid} << 32) | r.submitter.pid;
  info.slot = static_cast<std::uint32_t>(r.slot);
  info.slot_generation = r.state->header().slot[r.slot].generation.load(std::memory_order_relaxed);
  info.legacy = stream == stream->ctx->null_stream;
  info.blocking = (stream->flags & CU_STREAM_NON_BLOCKING) == 0;
  return info;
}

void note_ticket(CUstream_st* stream, std::uint64_t ticket) {
  stream->last_ticket.store(ticket, std::memory_order_release);
  stream->ctx->last_ticket.store(ticket, std::memory_order_release);
}

// Waits about `ns`: a timed sleep when it is long, else yielding until then
// (a sleep overshoots by the timer slack, ~50 us, more than short kernels
// last; the real driver's default synchronisation also spins when it can).
// `blocking`: always a sleep (an event created with CU_EVENT_BLOCKING_SYNC:
// "a CPU thread that uses cuEventSynchronize() to wait on an event created
// with this flag will block until the event has actually been completed",
// cuEventCreate's documentation; it never spins).
void wait_for(std::uint64_t ns, bool blocking = false) {
  if (ns < kMinPollNs) ns = kMinPollNs;
  if (blocking) {
    timespec ts{static_cast<time_t>(ns / 1000000000ull), static_cast<long>(ns % 1000000000ull)};
    nanosleep(&ts, nullptr);
    return;
  }
  if (ns >= kSpinBelowNs) {
    timespec ts{static_cast<time_t>((ns - kSpinBelowNs / 2) / 1000000000ull),
                static_cast<long>((ns - kSpinBelowNs / 2) % 1000000000ull)};
    nanosleep(&ts, nullptr);
    return;
  }
  const std::uint64_t until = mono_ns() + ns;
  while (mono_ns() < until) sched_yield();
}

// Polls `pending` (called with the lock held, after advancing) until it reports
// nothing left, sleeping for the remaining run time it reports: a lower bound on
// the wait, so the caller never oversleeps the uncontended finish.
template <typename Pending>
void wait_until_idle(std::uint32_t dev, Pending&& pending, bool blocking = false) {
  State& s = state();
  std::uint64_t last_reap = mono_ns();
  for (;;) {
    SchedPending left{0, 0};
    {
      State::Lock lock(s);
      if (!lock.ok()) return;
      std::uint64_t now = mono_ns();
      // A long wait may be behind a dead process's queued work: reap it (the
      // driver discards an exited process's work) rather than wait for it.
      if (now - last_reap > kReapEveryNs) {
        s.reap_locked(runtime().slot);
        last_reap = now;
      }
      sched_advance_locked(s, dev, now);
      left = pending();
    }
    if (left.entries == 0) return;
    wait_for(left.remaining_ns, blocking);
  }
}

SchedPending stream_pending_locked(CUstream_st* stream) {
  if (stream == stream->ctx->null_stream) {
    return sched_context_pending_locked(state(), stream->ctx->device, key_of(stream->ctx->id),
                                        stream->ctx->last_ticket.load(std::memory_order_acquire));
  }
  return sched_stream_pending_locked(state(), stream->ctx->device, key_of(stream->id),
                                     stream->last_ticket.load(std::memory_order_acquire));
}

std::uint64_t submit(CUstream_st* stream, const SchedEntry& entry, SchedTarget* where = nullptr) {
  const SchedStreamInfo info = info_for(stream);
  State& s = state();
  const std::uint32_t dev = stream->ctx->device;
  const std::uint64_t depth = s.header().queue_depth;
  for (;;) {
    std::uint64_t wait_ns = kMinPollNs;
    {
      State::Lock lock(s);
      if (!lock.ok()) return 0;
      const std::uint64_t now = mono_ns();
      sched_advance_locked(s, dev, now);
      // The stream's hardware queue: a launch beyond `depth` pending ones blocks.
      SchedPending queued = sched_stream_pending_locked(s, dev, info.key, ~std::uint64_t{0});
      if (depth == 0 || queued.entries < depth) {
        std::uint64_t ticket = sched_submit_locked(s, dev, info, entry, where);
        if (ticket != 0) {
          // Zero-length work (an event on an idle stream) completes now, not at
          // whichever call next advances the device.
          if (entry.remaining_ns == 0) sched_advance_locked(s, dev, now);
          note_ticket(stream, ticket);
          return ticket;
        }
      }
      if (queued.entries > 0) wait_ns = queued.remaining_ns / queued.entries;
    }
    wait_for(wait_ns);
  }
}

}  // namespace

CUresult sched_launch(CUstream_st* stream, std::uint64_t duration_ns, std::uint64_t blocks) {
  SchedEntry entry;
  entry.kind = SchedKind::kernel;
  const StateHeader& header = state().header();
  static std::atomic<std::uint64_t> launches{0};
  std::uint64_t index = launches.fetch_add(1, std::memory_order_relaxed) ^ (own_slot_bits() << 48);
  entry.remaining_ns = jittered_ns(header, stream->ctx->device, index, duration_ns) + header.launch_cost_ns;
  entry.blocks = blocks > 0xffffffffull ? 0xffffffffu : static_cast<std::uint32_t>(blocks);
  return submit(stream, entry) != 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
}

void sched_stream_wait(CUstream_st* stream) {
  wait_until_idle(stream->ctx->device, [&] { return stream_pending_locked(stream); });
}

SchedWait sched_wait_of_locked(const CUstream_st* stream) {
  const CUctx_st* ctx = stream->ctx;
  const bool legacy = stream == ctx->null_stream;
  const std::atomic<std::uint64_t>& ticket = legacy ? ctx->last_ticket : stream->last_ticket;
  return SchedWait{ctx->device, legacy, key_of(legacy ? ctx->id : stream->id), ticket.load(std::memory_order_acquire)};
}

namespace {
SchedPending wait_pending_locked(const SchedWait& wait) {
  return wait.legacy ? sched_context_pending_locked(state(), wait.device, wait.key, wait.up_to)
                     : sched_stream_pending_locked(state(), wait.device, wait.key, wait.up_to);
}
}  // namespace

bool sched_wait_done(const SchedWait& wait) {
  State& s = state();
  State::Lock lock(s);
  if (!lock.ok()) return true;
  sched_advance_locked(s, wait.device, mono_ns());
  return wait_pending_locked(wait).entries == 0;
}

void sched_wait(const SchedWait& wait) {
  wait_until_idle(wait.device, [&] { return wait_pending_locked(wait); });
}

void sched_context_wait(CUctx_st* ctx) {
  std::uint64_t up_to = ctx->last_ticket.load(std::memory_order_acquire);
  std::uint64_t key = key_of(ctx->id);
  wait_until_idle(ctx->device, [&] { return sched_context_pending_locked(state(), ctx->device, key, up_to); });
}

void sched_event_record(CUevent_st* event, CUstream_st* stream) {
  event->time_ns.store(0, std::memory_order_release);
  event->device = stream->ctx->device;
  SchedEntry marker;
  marker.kind = SchedKind::marker;
  SchedTarget where;
  std::uint64_t ticket = submit(stream, marker, &where);
  event->where = where;
  event->ticket.store(ticket, std::memory_order_release);
}

bool sched_event_done(CUevent_st* event) {
  std::uint64_t ticket = event->ticket.load(std::memory_order_acquire);
  if (ticket == 0) return true;
  State& s = state();
  State::Lock lock(s);
  if (!lock.ok()) return true;
  sched_advance_locked(s, event->device, mono_ns());
  std::uint64_t end = 0;
  if (!sched_ticket_done_locked(s, event->device, event->where, ticket, &end)) return false;
  event->time_ns.store(end, std::memory_order_release);
  event->ticket.store(0, std::memory_order_release);
  return true;
}

void sched_event_wait(CUevent_st* event) {
  std::uint64_t ticket = event->ticket.load(std::memory_order_acquire);
  if (ticket == 0) return;
  wait_until_idle(
      event->device,
      [&] {
        std::uint64_t end = 0;
        if (sched_ticket_done_locked(state(), event->device, event->where, ticket, &end)) return SchedPending{0, 0};
        // Still queued on its stream: wait at least for the work ahead of it there.
        const SchedStream& queue = sched_device(state(), event->device).streams[event->where.stream];
        SchedPending ahead = sched_stream_pending_locked(state(), event->device, queue.info.key, ticket);
        return SchedPending{ahead.entries > 0 ? ahead.entries : 1, ahead.remaining_ns};
      },
      (event->flags & CU_EVENT_BLOCKING_SYNC) != 0);
  sched_event_done(event);
}

void sched_stream_wait_event(CUstream_st* stream, CUevent_st* event) {
  std::uint64_t ticket = event->ticket.load(std::memory_order_acquire);
  if (ticket == 0) return;  // already complete (or never recorded): nothing to wait for
  // Only events of the same device are modelled as dependencies.
  if (event->device != stream->ctx->device) return;
  SchedEntry entry;
  entry.kind = SchedKind::wait;
  entry.wait_ticket = ticket;
  entry.wait_on = event->where;
  submit(stream, entry);
}

}  // namespace gpuslice::fakecuda
