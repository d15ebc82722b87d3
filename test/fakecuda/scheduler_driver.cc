// The driver side of the realistic profile's scheduler (scheduler.h): launches and
// markers become scheduler entries; synchronisation advances the simulation and
// sleeps until the awaited work has run. Ideal-profile code never comes here.
#include <time.h>

#include "driver.h"

namespace gpuslice::fakecuda {

namespace {

constexpr std::uint64_t kMinPollNs = 5000;            // shortest sleep between checks
constexpr std::uint64_t kReapEveryNs = 20000000;      // waiters reap dead processes this often

std::uint64_t key_of(std::uint64_t id) { return (std::uint64_t{static_cast<std::uint32_t>(runtime().slot)} + 1) << 40 | id; }

SchedEntry entry_for(CUstream_st *stream, SchedKind kind) {
  Runtime &r = runtime();
  SchedEntry e;
  e.ctx_key = key_of(stream->ctx->id);
  e.stream_key = key_of(stream->id);
  e.pids = (std::uint64_t{r.submitter.host_pid} << 32) | r.submitter.pid;
  e.slot = static_cast<std::uint32_t>(r.slot);
  e.generation = r.state->header().slot[r.slot].generation.load(std::memory_order_relaxed);
  e.kind = kind;
  e.legacy = stream == stream->ctx->null_stream ? 1 : 0;
  e.blocking = (stream->flags & CU_STREAM_NON_BLOCKING) == 0 ? 1 : 0;
  return e;
}

void note_ticket(CUstream_st *stream, std::uint64_t ticket) {
  stream->last_ticket.store(ticket, std::memory_order_release);
  stream->ctx->last_ticket.store(ticket, std::memory_order_release);
}

void sleep_ns(std::uint64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000ull), static_cast<long>(ns % 1000000000ull)};
  nanosleep(&ts, nullptr);
}

// Polls `pending` (called with the lock held, after advancing) until it reports
// nothing left, sleeping for the remaining run time it reports: a lower bound on
// the wait, so the caller never oversleeps the uncontended finish.
template <typename Pending>
void wait_until_idle(std::uint32_t dev, Pending &&pending) {
  State &s = state();
  std::uint64_t last_reap = 0;
  for (;;) {
    SchedPending left{0, 0};
    {
      State::Lock lock(s);
      if (!lock.ok()) return;
      std::uint64_t now = mono_ns();
      // A dead process's queued work must not hold up everyone else forever.
      if (now - last_reap > kReapEveryNs) {
        s.reap_locked(runtime().slot);
        last_reap = now;
      }
      sched_advance_locked(s, dev, now);
      left = pending();
    }
    if (left.entries == 0) return;
    sleep_ns(left.remaining_ns > kMinPollNs ? left.remaining_ns : kMinPollNs);
  }
}

SchedPending stream_pending_locked(CUstream_st *stream) {
  if (stream == stream->ctx->null_stream) {
    return sched_pending_locked(state(), stream->ctx->device, SchedMatch::context, key_of(stream->ctx->id),
                                stream->ctx->last_ticket.load(std::memory_order_acquire));
  }
  return sched_pending_locked(state(), stream->ctx->device, SchedMatch::stream, key_of(stream->id),
                              stream->last_ticket.load(std::memory_order_acquire));
}

std::uint64_t submit(CUstream_st *stream, const SchedEntry &entry) {
  State &s = state();
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
      SchedPending queued = sched_pending_locked(s, dev, SchedMatch::stream, entry.stream_key, ~std::uint64_t{0});
      if (depth == 0 || queued.entries < depth) {
        std::uint64_t ticket = sched_submit_locked(s, dev, entry);
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
    sleep_ns(wait_ns > kMinPollNs ? wait_ns : kMinPollNs);
  }
}

}  // namespace

CUresult sched_launch(CUstream_st *stream, std::uint64_t duration_ns, std::uint64_t blocks) {
  SchedEntry entry = entry_for(stream, SchedKind::kernel);
  const StateHeader &header = state().header();
  static std::atomic<std::uint64_t> launches{0};
  std::uint64_t index = launches.fetch_add(1, std::memory_order_relaxed) ^ (std::uint64_t{entry.slot} << 48);
  entry.remaining_ns = jittered_ns(header, stream->ctx->device, index, duration_ns) + header.launch_cost_ns;
  entry.blocks = blocks > 0xffffffffull ? 0xffffffffu : static_cast<std::uint32_t>(blocks);
  return submit(stream, entry) != 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
}

bool sched_stream_idle(CUstream_st *stream) {
  State &s = state();
  State::Lock lock(s);
  if (!lock.ok()) return true;
  sched_advance_locked(s, stream->ctx->device, mono_ns());
  return stream_pending_locked(stream).entries == 0;
}

void sched_stream_wait(CUstream_st *stream) {
  wait_until_idle(stream->ctx->device, [&] { return stream_pending_locked(stream); });
}

void sched_context_wait(CUctx_st *ctx) {
  std::uint64_t up_to = ctx->last_ticket.load(std::memory_order_acquire);
  std::uint64_t key = key_of(ctx->id);
  wait_until_idle(ctx->device,
                  [&] { return sched_pending_locked(state(), ctx->device, SchedMatch::context, key, up_to); });
}

void sched_event_record(CUevent_st *event, CUstream_st *stream) {
  event->time_ns.store(0, std::memory_order_release);
  event->device = stream->ctx->device;
  event->ticket.store(submit(stream, entry_for(stream, SchedKind::marker)), std::memory_order_release);
}

bool sched_event_done(CUevent_st *event) {
  std::uint64_t ticket = event->ticket.load(std::memory_order_acquire);
  if (ticket == 0) return true;
  State &s = state();
  State::Lock lock(s);
  if (!lock.ok()) return true;
  sched_advance_locked(s, event->device, mono_ns());
  std::uint64_t end = 0;
  if (!sched_ticket_done_locked(s, event->device, ticket, &end)) return false;
  event->time_ns.store(end, std::memory_order_release);
  event->ticket.store(0, std::memory_order_release);
  return true;
}

void sched_event_wait(CUevent_st *event) {
  std::uint64_t ticket = event->ticket.load(std::memory_order_acquire);
  if (ticket == 0) return;
  wait_until_idle(event->device, [&] {
    return sched_pending_locked(state(), event->device, SchedMatch::ticket, ticket, ticket);
  });
  sched_event_done(event);
}

void sched_stream_wait_event(CUstream_st *stream, CUevent_st *event) {
  std::uint64_t ticket = event->ticket.load(std::memory_order_acquire);
  if (ticket == 0) return;  // already complete (or never recorded): nothing to wait for
  // Only events of the same device are modelled as dependencies.
  if (event->device != stream->ctx->device) return;
  SchedEntry entry = entry_for(stream, SchedKind::wait);
  entry.wait_ticket = ticket;
  submit(stream, entry);
}

}  // namespace gpuslice::fakecuda
