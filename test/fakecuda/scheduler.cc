// The realistic profile's device scheduler; the model is described in scheduler.h
// and README.md ("Realistic profile").
#include "scheduler.h"

#include <cstring>

#include "timeline.h"

namespace gpuslice::fakecuda {

namespace {

constexpr int kMaxStreams = 512;   // distinct streams considered per pass
constexpr int kMaxContexts = 128;  // distinct contexts considered per pass

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct ContextInfo {
  std::uint64_t key;
  bool any_earlier;     // an earlier pending entry of this context exists
  bool legacy_earlier;  // an earlier pending legacy-stream entry exists
  bool runnable;        // has a runnable kernel
};

bool ticket_pending(const SchedDevice &sd, std::uint64_t ticket) {
  std::uint32_t lo = 0;
  std::uint32_t hi = sd.count;
  while (lo < hi) {
    std::uint32_t mid = (lo + hi) / 2;
    if (sd.entries[mid].ticket < ticket) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < sd.count && sd.entries[lo].ticket == ticket;
}

void close_segment(State &state, std::uint32_t dev, SchedDevice &sd) {
  if (sd.segment_start_ns != 0 && sd.now_ns > sd.segment_start_ns) {
    timeline_append(state, dev, sd.segment_start_ns, sd.now_ns, sd.segment_pids);
  }
  sd.segment_start_ns = 0;
}

// One pass in ticket order: marks which entries may run now.
// runnable[i] is set for entries whose dependencies are met; dead owners' entries
// were dropped before (the driver discards an exited process's queued work).
void compute_runnable(SchedDevice &sd, bool *runnable, ContextInfo *contexts, int *context_count) {
  std::uint64_t streams[kMaxStreams];
  int stream_count = 0;
  *context_count = 0;
  for (std::uint32_t i = 0; i < sd.count; ++i) {
    SchedEntry &e = sd.entries[i];
    runnable[i] = false;
    bool first_of_stream = true;
    for (int s = 0; s < stream_count; ++s) {
      if (streams[s] == e.stream_key) {
        first_of_stream = false;
        break;
      }
    }
    if (first_of_stream) {
      if (stream_count == kMaxStreams) continue;  // considered in a later pass
      streams[stream_count++] = e.stream_key;
    }
    ContextInfo *ctx = nullptr;
    for (int c = 0; c < *context_count; ++c) {
      if (contexts[c].key == e.ctx_key) ctx = &contexts[c];
    }
    if (ctx == nullptr) {
      if (*context_count == kMaxContexts) continue;
      ctx = &contexts[(*context_count)++];
      *ctx = ContextInfo{e.ctx_key, false, false, false};
    }
    bool ok = first_of_stream;
    if (e.legacy != 0 && ctx->any_earlier) ok = false;
    if (e.legacy == 0 && e.blocking != 0 && ctx->legacy_earlier) ok = false;
    if (e.kind == SchedKind::wait && ticket_pending(sd, e.wait_ticket)) ok = false;
    runnable[i] = ok;
    if (ok && e.kind == SchedKind::kernel && e.remaining_ns > 0) ctx->runnable = true;
    ctx->any_earlier = true;
    if (e.legacy != 0) ctx->legacy_earlier = true;
  }
}

void log_done(SchedDevice &sd, std::uint64_t ticket, std::uint64_t end_ns) {
  SchedDone &slot = sd.done[ticket % kDoneLog];
  slot.ticket = ticket;
  slot.end_ns = end_ns;
}

// Removes entries flagged in `remove`, keeping ticket order.
void compact(SchedDevice &sd, const bool *remove) {
  std::uint32_t out = 0;
  for (std::uint32_t i = 0; i < sd.count; ++i) {
    if (remove[i]) continue;
    if (out != i) sd.entries[out] = sd.entries[i];
    ++out;
  }
  sd.count = out;
}

bool owner_gone(const StateHeader &header, const SchedEntry &e) {
  const ProcSlot &slot = header.slot[e.slot];
  return slot.state.load(std::memory_order_acquire) == 0 ||
         slot.generation.load(std::memory_order_relaxed) != e.generation;
}

}  // namespace

std::size_t sched_bytes(std::uint32_t devices) {
  return (std::size_t{devices} * sizeof(SchedDevice) + 4095) & ~std::size_t{4095};
}

SchedDevice &sched_device(State &state, std::uint32_t dev) {
  auto *base = reinterpret_cast<char *>(&state.header()) + state.header().sched_offset;
  return reinterpret_cast<SchedDevice *>(base)[dev];
}

std::uint64_t jittered_ns(const StateHeader &header, std::uint32_t dev, std::uint64_t index,
                          std::uint64_t duration_ns) {
  if (header.jitter_pct == 0 || duration_ns == 0) return duration_ns;
  std::uint64_t r = splitmix64(header.seed ^ (std::uint64_t{dev} << 56) ^ splitmix64(index));
  // u in [-1, 1] with 2^-53 resolution.
  double u = static_cast<double>(r >> 11) / static_cast<double>(std::uint64_t{1} << 53) * 2.0 - 1.0;
  double scaled = static_cast<double>(duration_ns) * (1.0 + u * header.jitter_pct / 100.0);
  return scaled < 1.0 ? 1 : static_cast<std::uint64_t>(scaled);
}

void sched_advance_locked(State &state, std::uint32_t dev, std::uint64_t now) {
  StateHeader &header = state.header();
  SchedDevice &sd = sched_device(state, dev);
  DeviceShared &device = state.device(dev);
  static thread_local bool runnable[kSchedEntries];
  static thread_local bool remove[kSchedEntries];
  static thread_local ContextInfo contexts[kMaxContexts];
  if (sd.now_ns == 0) sd.now_ns = now;
  for (;;) {
    // Drop entries of processes that are gone; complete zero-length runnable entries.
    int context_count = 0;
    bool changed = true;
    while (changed) {
      changed = false;
      std::memset(remove, 0, sd.count);
      bool any = false;
      for (std::uint32_t i = 0; i < sd.count; ++i) {
        if (owner_gone(header, sd.entries[i])) remove[i] = any = true;
      }
      if (any) compact(sd, remove);
      compute_runnable(sd, runnable, contexts, &context_count);
      std::memset(remove, 0, sd.count);
      for (std::uint32_t i = 0; i < sd.count; ++i) {
        if (runnable[i] && sd.entries[i].remaining_ns == 0) {
          log_done(sd, sd.entries[i].ticket, sd.now_ns);
          if (sd.entries[i].kind == SchedKind::kernel) device.kernels.fetch_add(1, std::memory_order_relaxed);
          remove[i] = changed = true;
        }
      }
      if (changed) compact(sd, remove);
    }
    if (sd.now_ns >= now) break;
    int runnable_contexts = 0;
    bool current_runnable = false;
    for (int c = 0; c < context_count; ++c) {
      if (!contexts[c].runnable) continue;
      ++runnable_contexts;
      if (contexts[c].key == sd.current_ctx) current_runnable = true;
    }
    if (runnable_contexts == 0) {  // idle until now
      close_segment(state, dev, sd);
      sd.now_ns = now;
      break;
    }
    const std::uint64_t slice = header.timeslice_ns;
    bool slice_over = sd.now_ns - sd.slice_start_ns >= slice;
    // Alone on the device, a context keeps it; a newcomer waits out the current slice.
    if (slice_over && runnable_contexts == 1 && current_runnable) sd.slice_start_ns = sd.now_ns;
    if (!current_runnable || (slice_over && runnable_contexts > 1)) {
      // Round-robin: the next context key after the current one, wrapping.
      std::uint64_t next = 0;
      std::uint64_t lowest = 0;
      for (int c = 0; c < context_count; ++c) {
        if (!contexts[c].runnable) continue;
        std::uint64_t key = contexts[c].key;
        if (lowest == 0 || key < lowest) lowest = key;
        if (key > sd.current_ctx && (next == 0 || key < next)) next = key;
      }
      if (next == 0) next = lowest;
      if (next != sd.current_ctx) close_segment(state, dev, sd);
      sd.current_ctx = next;
      sd.slice_start_ns = sd.now_ns;
    }
    // Running set: runnable kernels of the current context, in order, while their blocks fit.
    std::uint64_t blocks = 0;
    std::uint64_t step = now - sd.now_ns;
    if (runnable_contexts > 1) {
      std::uint64_t slice_left = sd.slice_start_ns + slice - sd.now_ns;
      if (slice_left < step) step = slice_left;
    }
    std::uint32_t running[kMaxStreams];
    int running_count = 0;
    for (std::uint32_t i = 0; i < sd.count && running_count < kMaxStreams; ++i) {
      const SchedEntry &e = sd.entries[i];
      if (!runnable[i] || e.ctx_key != sd.current_ctx || e.kind != SchedKind::kernel) continue;
      std::uint64_t b = e.blocks < header.sms ? e.blocks : header.sms;
      if (running_count > 0 && blocks + b > header.sms) break;
      blocks += b;
      running[running_count++] = i;
      if (e.remaining_ns < step) step = e.remaining_ns;
    }
    const SchedEntry &head = sd.entries[running[0]];
    if (sd.segment_start_ns == 0) {
      sd.segment_start_ns = sd.now_ns;
      sd.segment_pids = head.pids;
      sd.segment_slot = head.slot;
    }
    for (int k = 0; k < running_count; ++k) sd.entries[running[k]].remaining_ns -= step;
    sd.now_ns += step;
    device.busy_total_ns.fetch_add(step, std::memory_order_relaxed);
    header.slot[head.slot].busy_ns[dev].fetch_add(step, std::memory_order_relaxed);
  }
  // Publish the open segment so far, so queries see it; it continues from here.
  if (sd.segment_start_ns != 0 && sd.now_ns > sd.segment_start_ns) {
    timeline_append(state, dev, sd.segment_start_ns, sd.now_ns, sd.segment_pids);
    sd.segment_start_ns = sd.now_ns;
  }
  device.busy_until_ns.store(sd.now_ns, std::memory_order_relaxed);
}

void sched_catch_up(State &state) {
  if (!sched_enabled(state.header())) return;
  State::Lock lock(state);
  if (!lock.ok()) return;
  std::uint64_t now = mono_ns();
  for (std::uint32_t d = 0; d < state.device_count(); ++d) sched_advance_locked(state, d, now);
}

std::uint64_t sched_submit_locked(State &state, std::uint32_t dev, SchedEntry entry) {
  SchedDevice &sd = sched_device(state, dev);
  if (sd.count == kSchedEntries) return 0;
  entry.ticket = ++sd.next_ticket;
  sd.entries[sd.count++] = entry;
  return entry.ticket;
}

SchedPending sched_pending_locked(State &state, std::uint32_t dev, SchedMatch match, std::uint64_t key,
                                  std::uint64_t up_to) {
  SchedDevice &sd = sched_device(state, dev);
  SchedPending pending{0, 0};
  for (std::uint32_t i = 0; i < sd.count && sd.entries[i].ticket <= up_to; ++i) {
    const SchedEntry &e = sd.entries[i];
    bool hit = match == SchedMatch::stream ? e.stream_key == key
               : match == SchedMatch::context ? e.ctx_key == key
                                              : e.ticket == key;
    if (!hit) continue;
    ++pending.entries;
    pending.remaining_ns += e.remaining_ns;
  }
  return pending;
}

bool sched_ticket_done_locked(State &state, std::uint32_t dev, std::uint64_t ticket, std::uint64_t *end_ns) {
  SchedDevice &sd = sched_device(state, dev);
  if (ticket_pending(sd, ticket)) return false;
  const SchedDone &done = sd.done[ticket % kDoneLog];
  // A completion older than the log (or dropped with its process) reads as "now".
  *end_ns = done.ticket == ticket ? done.end_ns : sd.now_ns;
  return true;
}

}  // namespace gpuslice::fakecuda
