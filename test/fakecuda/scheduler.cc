// The realistic profile's device scheduler; the model is described in
// scheduler.h and README.md ("Realistic profile").
#include "scheduler.h"

#include "timeline.h"

namespace gpuslice::fakecuda {

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void init_locked(SchedDevice& sd) {
  if (sd.initialized != 0) return;
  for (std::uint32_t i = 0; i < kSchedEntries; ++i) sd.entries[i].next = i + 1 < kSchedEntries ? i + 1 : kNoEntry;
  sd.free_head = 0;
  for (SchedStream& s : sd.streams) s.head = s.tail = kNoEntry;
  sd.initialized = 1;
}

const SchedEntry& head_of(const SchedDevice& sd, const SchedStream& s) { return sd.entries[s.head]; }

// Removes a stream's head entry; gives the stream slot back once it is empty.
void pop_head(SchedDevice& sd, SchedStream& s) {
  std::uint32_t index = s.head;
  SchedEntry& e = sd.entries[index];
  s.remaining_ns -= e.remaining_ns;
  s.head = e.next;
  if (s.head == kNoEntry) s.tail = kNoEntry;
  --s.count;
  e.next = sd.free_head;
  sd.free_head = index;
  --sd.pending;
  if (s.count == 0) {
    s.used = 0;
    ++s.generation;  // waits on its entries now read as done
  }
}

bool target_pending(const SchedDevice& sd, SchedTarget where, std::uint64_t ticket) {
  if (where.stream >= kSchedStreams) return false;
  const SchedStream& s = sd.streams[where.stream];
  return s.used != 0 && s.generation == where.generation && head_of(sd, s).ticket <= ticket;
}

// May the head of `s` run now? Stream order holds by construction; the legacy
// stream waits for every earlier entry of its context, a blocking stream for
// earlier legacy-stream entries, a wait entry for the entry it waits on.
bool head_runnable(const SchedDevice& sd, const SchedStream& s) {
  const SchedEntry& head = head_of(sd, s);
  if (head.kind == SchedKind::wait && target_pending(sd, head.wait_on, head.wait_ticket)) return false;
  if (!s.info.legacy && !s.info.blocking) return true;
  for (const SchedStream& other : sd.streams) {
    if (other.used == 0 || &other == &s || other.info.ctx_key != s.info.ctx_key) continue;
    if (!s.info.legacy && !other.info.legacy) continue;
    if (head_of(sd, other).ticket < head.ticket) return false;
  }
  return true;
}

bool owner_gone(const StateHeader& header, const SchedStream& s) {
  const ProcSlot& slot = header.slot[s.info.slot];
  return slot.state.load(std::memory_order_acquire) == 0 ||
         slot.generation.load(std::memory_order_relaxed) != s.info.slot_generation;
}

void log_done(SchedDevice& sd, std::uint64_t ticket, std::uint64_t end_ns) {
  SchedDone& slot = sd.done[ticket % kDoneLog];
  slot.ticket = ticket;
  slot.end_ns = end_ns;
}

void close_segment(State& state, std::uint32_t dev, SchedDevice& sd) {
  if (sd.segment_start_ns != 0 && sd.now_ns > sd.segment_start_ns) {
    timeline_append(state, dev, sd.segment_start_ns, sd.now_ns, sd.segment_pids);
  }
  sd.segment_start_ns = 0;
}

// Drops the work of processes that are gone (the driver discards an exited
// process's queued work) and completes every runnable zero-length head.
void settle(State& state, std::uint32_t dev, SchedDevice& sd) {
  DeviceShared& device = state.device(dev);
  for (SchedStream& s : sd.streams) {
    if (s.used == 0 || !owner_gone(state.header(), s)) continue;
    while (s.used != 0) pop_head(sd, s);
  }
  bool changed = true;
  while (changed) {
    changed = false;
    for (SchedStream& s : sd.streams) {
      while (s.used != 0 && head_of(sd, s).remaining_ns == 0 && head_runnable(sd, s)) {
        const SchedEntry& head = head_of(sd, s);
        log_done(sd, head.ticket, sd.now_ns);
        if (head.kind == SchedKind::kernel) device.kernels.fetch_add(1, std::memory_order_relaxed);
        pop_head(sd, s);
        changed = true;
      }
    }
  }
}

}  // namespace

std::size_t sched_bytes(std::uint32_t devices) {
  return (std::size_t{devices} * sizeof(SchedDevice) + 4095) & ~std::size_t{4095};
}

SchedDevice& sched_device(State& state, std::uint32_t dev) {
  auto* base = reinterpret_cast<char*>(&state.header()) + state.header().sched_offset;
  SchedDevice& sd = reinterpret_cast<SchedDevice*>(base)[dev];
  init_locked(sd);
  return sd;
}

std::uint64_t jittered_ns(const StateHeader& header, std::uint32_t dev, std::uint64_t index,
                          std::uint64_t duration_ns) {
  if (header.jitter_pct == 0 || duration_ns == 0) return duration_ns;
  std::uint64_t r = splitmix64(header.seed ^ (std::uint64_t{dev} << 56) ^ splitmix64(index));
  // u in [-1, 1] with 2^-53 resolution.
  double u = static_cast<double>(r >> 11) / static_cast<double>(std::uint64_t{1} << 53) * 2.0 - 1.0;
  double scaled = static_cast<double>(duration_ns) * (1.0 + u * header.jitter_pct / 100.0);
  return scaled < 1.0 ? 1 : static_cast<std::uint64_t>(scaled);
}

void sched_advance_locked(State& state, std::uint32_t dev, std::uint64_t now) {
  StateHeader& header = state.header();
  SchedDevice& sd = sched_device(state, dev);
  DeviceShared& device = state.device(dev);
  if (sd.now_ns == 0) sd.now_ns = now;
  for (;;) {
    settle(state, dev, sd);
    if (sd.now_ns >= now) break;
    // Streams whose head is a runnable kernel, and the contexts they belong to.
    std::uint32_t ready[kSchedStreams];
    std::uint32_t ready_count = 0;
    bool current_runnable = false;
    std::uint64_t next_ctx = 0, lowest_ctx = 0;
    std::uint32_t contexts = 0;
    std::uint64_t seen_ctx = 0;
    for (std::uint32_t i = 0; i < kSchedStreams; ++i) {
      const SchedStream& s = sd.streams[i];
      if (s.used == 0 || head_of(sd, s).kind != SchedKind::kernel || !head_runnable(sd, s)) continue;
      ready[ready_count++] = i;
      std::uint64_t key = s.info.ctx_key;
      if (key == sd.current_ctx) current_runnable = true;
      if (lowest_ctx == 0 || key < lowest_ctx) lowest_ctx = key;
      if (key > sd.current_ctx && (next_ctx == 0 || key < next_ctx)) next_ctx = key;
      if (contexts < 2 && key != seen_ctx) {  // only "one or more than one" matters
        ++contexts;
        seen_ctx = key;
      }
    }
    if (ready_count == 0) {  // idle until now
      close_segment(state, dev, sd);
      sd.now_ns = now;
      break;
    }
    const std::uint64_t slice = header.timeslice_ns;
    bool slice_over = sd.now_ns - sd.slice_start_ns >= slice;
    // Alone on the device, a context keeps it; a newcomer waits out the current slice.
    if (slice_over && contexts == 1 && current_runnable) sd.slice_start_ns = sd.now_ns;
    if (!current_runnable || (slice_over && contexts > 1)) {
      // Round-robin: the next context key after the current one, wrapping.
      std::uint64_t next = next_ctx != 0 ? next_ctx : lowest_ctx;
      if (next != sd.current_ctx) close_segment(state, dev, sd);
      sd.current_ctx = next;
      sd.slice_start_ns = sd.now_ns;
    }
    // Running set: ready heads of the current context in ticket order, while their blocks fit.
    std::uint32_t running[kSchedStreams];
    std::uint32_t running_count = 0;
    for (std::uint32_t k = 0; k < ready_count; ++k) {
      if (sd.streams[ready[k]].info.ctx_key == sd.current_ctx) running[running_count++] = ready[k];
    }
    for (std::uint32_t a = 1; a < running_count; ++a) {  // insertion sort by head ticket
      std::uint32_t moving = running[a];
      std::uint32_t b = a;
      while (b > 0 && head_of(sd, sd.streams[running[b - 1]]).ticket > head_of(sd, sd.streams[moving]).ticket) {
        running[b] = running[b - 1];
        --b;
      }
      running[b] = moving;
    }
    std::uint64_t step = now - sd.now_ns;
    if (contexts > 1) {
      std::uint64_t slice_left = sd.slice_start_ns + slice - sd.now_ns;
      if (slice_left < step) step = slice_left;
    }
    std::uint64_t blocks = 0;
    std::uint32_t admitted = 0;
    for (; admitted < running_count; ++admitted) {
      const SchedEntry& e = head_of(sd, sd.streams[running[admitted]]);
      std::uint64_t b = e.blocks < header.sms ? e.blocks : header.sms;
      if (admitted > 0 && blocks + b > header.sms) break;
      blocks += b;
      if (e.remaining_ns < step) step = e.remaining_ns;
    }
    const SchedStream& first = sd.streams[running[0]];
    if (sd.segment_start_ns == 0) {
      sd.segment_start_ns = sd.now_ns;
      sd.segment_pids = first.info.pids;
    }
    for (std::uint32_t k = 0; k < admitted; ++k) {
      SchedStream& s = sd.streams[running[k]];
      sd.entries[s.head].remaining_ns -= step;
      s.remaining_ns -= step;
    }
    sd.now_ns += step;
    device.busy_total_ns.fetch_add(step, std::memory_order_relaxed);
    header.slot[first.info.slot].busy_ns[dev].fetch_add(step, std::memory_order_relaxed);
  }
  // Publish the open segment so far, so queries see it; it continues from here.
  if (sd.segment_start_ns != 0 && sd.now_ns > sd.segment_start_ns) {
    timeline_append(state, dev, sd.segment_start_ns, sd.now_ns, sd.segment_pids);
    sd.segment_start_ns = sd.now_ns;
  }
  device.busy_until_ns.store(sd.now_ns, std::memory_order_relaxed);
}

void sched_catch_up(State& state) {
  if (!sched_enabled(state.header())) return;
  State::Lock lock(state);
  if (!lock.ok()) return;
  std::uint64_t now = mono_ns();
  for (std::uint32_t d = 0; d < state.device_count(); ++d) sched_advance_locked(state, d, now);
}

std::uint64_t sched_submit_locked(State& state, std::uint32_t dev, const SchedStreamInfo& info, SchedEntry entry,
                                  SchedTarget* where) {
  SchedDevice& sd = sched_device(state, dev);
  if (sd.free_head == kNoEntry) return 0;
  std::uint32_t index = kSchedStreams;
  std::uint32_t unused = kSchedStreams;
  for (std::uint32_t i = 0; i < kSchedStreams; ++i) {
    const SchedStream& s = sd.streams[i];
    if (s.used != 0 && s.info.key == info.key) {
      index = i;
      break;
    }
    if (s.used == 0 && unused == kSchedStreams) unused = i;
  }
  if (index == kSchedStreams) {
    if (unused == kSchedStreams) return 0;
    index = unused;
    SchedStream& s = sd.streams[index];
    s.info = info;
    s.remaining_ns = 0;
    s.head = s.tail = kNoEntry;
    s.count = 0;
    s.used = 1;
  }
  SchedStream& s = sd.streams[index];
  std::uint32_t slot = sd.free_head;
  sd.free_head = sd.entries[slot].next;
  entry.ticket = ++sd.next_ticket;
  entry.next = kNoEntry;
  sd.entries[slot] = entry;
  if (s.tail == kNoEntry) {
    s.head = slot;
  } else {
    sd.entries[s.tail].next = slot;
  }
  s.tail = slot;
  ++s.count;
  s.remaining_ns += entry.remaining_ns;
  ++sd.pending;
  if (where != nullptr) *where = SchedTarget{index, s.generation};
  return entry.ticket;
}

SchedPending sched_stream_pending_locked(State& state, std::uint32_t dev, std::uint64_t stream_key,
                                         std::uint64_t up_to) {
  SchedDevice& sd = sched_device(state, dev);
  for (const SchedStream& s : sd.streams) {
    if (s.used == 0 || s.info.key != stream_key) continue;
    if (sd.entries[s.tail].ticket <= up_to) return SchedPending{s.count, s.remaining_ns};
    SchedPending pending{0, 0};
    for (std::uint32_t i = s.head; i != kNoEntry && sd.entries[i].ticket <= up_to; i = sd.entries[i].next) {
      ++pending.entries;
      pending.remaining_ns += sd.entries[i].remaining_ns;
    }
    return pending;
  }
  return SchedPending{0, 0};
}

SchedPending sched_context_pending_locked(State& state, std::uint32_t dev, std::uint64_t ctx_key, std::uint64_t up_to) {
  SchedDevice& sd = sched_device(state, dev);
  SchedPending total{0, 0};
  for (const SchedStream& s : sd.streams) {
    if (s.used == 0 || s.info.ctx_key != ctx_key) continue;
    SchedPending one = sched_stream_pending_locked(state, dev, s.info.key, up_to);
    total.entries += one.entries;
    total.remaining_ns += one.remaining_ns;
  }
  return total;
}

bool sched_ticket_done_locked(State& state, std::uint32_t dev, SchedTarget where, std::uint64_t ticket,
                              std::uint64_t* end_ns) {
  SchedDevice& sd = sched_device(state, dev);
  if (target_pending(sd, where, ticket)) return false;
  const SchedDone& done = sd.done[ticket % kDoneLog];
  // A completion older than the log (or dropped with its process) reads as "now".
  *end_ns = done.ticket == ticket ? done.end_ns : sd.now_ns;
  return true;
}

}  // namespace gpuslice::fakecuda
