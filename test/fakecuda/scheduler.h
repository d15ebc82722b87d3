// The realistic profile's device scheduler (README "Realistic profile"): a
// discrete-event simulation of one device, advanced lazily to "now" by whichever
// process touches it (launch, synchronise, NVML query). Because work is only
// ever added at the current simulated time, the simulation is exact whoever
// advances it and however late.
//
// Model: per-stream FIFO queues of pending launches (device-wide tickets give
// submission order). The device runs one context at a time; when several
// contexts have runnable work it switches round-robin every `timeslice_ns` (a
// kernel is preempted at the boundary and resumed later); busy time goes to the
// context that ran. Inside the running context, the head launch of each stream
// runs concurrently while their block counts fit in the SM count (the first
// always runs); the legacy stream waits for all earlier work of its context and
// blocking streams wait for earlier legacy-stream work. Events and stream waits
// are zero-length entries. The cost of a step is in the number of streams with
// pending work, not in the number of pending launches.
//
// Everything here is under State's robust mutex (plain fields, one lock).
#pragma once

#include <cstdint>

#include "state.h"

namespace gpuslice::fakecuda {

inline constexpr std::uint32_t kSchedEntries = 65536;  // pending launches per device
inline constexpr std::uint32_t kSchedStreams = 256;    // streams with pending work per device
inline constexpr std::uint32_t kDoneLog = 65536;       // completion times kept for events (>= kSchedEntries)
inline constexpr std::uint32_t kNoEntry = 0xffffffffu;

enum class SchedKind : std::uint8_t { kernel = 1, marker = 2, wait = 3 };

// Where an entry lives, to ask later whether it has run.
struct SchedTarget {
  std::uint32_t stream = kNoEntry;  // index in SchedDevice::streams
  std::uint32_t generation = 0;     // that slot's generation at submission
};

struct SchedEntry {
  std::uint64_t ticket = 0;  // device-wide submission order, from 1
  std::uint64_t remaining_ns = 0;
  std::uint64_t wait_ticket = 0;  // kind wait: runnable once this ticket has run
  SchedTarget wait_on{};          // ... which lives here
  std::uint32_t next = kNoEntry;  // next entry of the same stream (or free list)
  std::uint32_t blocks = 1;       // grid size, for the occupancy model
  SchedKind kind = SchedKind::kernel;
};

// The submitting stream, as the scheduler needs it.
struct SchedStreamInfo {
  std::uint64_t key = 0;      // (slot + 1) << 40 | stream id
  std::uint64_t ctx_key = 0;  // (slot + 1) << 40 | context id
  std::uint64_t pids = 0;     // host_pid << 32 | pid, as on the ring
  std::uint32_t slot = 0;
  std::uint32_t slot_generation = 0;  // the process slot's generation
  bool legacy = false;                // its context's legacy (NULL) stream
  bool blocking = false;              // created without CU_STREAM_NON_BLOCKING
};

struct SchedStream {
  SchedStreamInfo info;
  std::uint64_t remaining_ns;  // sum over its pending entries
  std::uint32_t generation;    // bumped each time the slot is given back
  std::uint32_t head, tail, count;
  std::uint32_t used;
};

struct SchedDone {
  std::uint64_t ticket;
  std::uint64_t end_ns;
};

struct SchedDevice {
  std::uint64_t now_ns;       // simulated up to here
  std::uint64_t next_ticket;  // last ticket handed out
  std::uint64_t current_ctx;  // context holding the device (0: none)
  std::uint64_t slice_start_ns;
  std::uint64_t segment_start_ns;  // open busy segment of current_ctx (0: none)
  std::uint64_t segment_pids;
  std::uint32_t free_head;    // free entries
  std::uint32_t initialized;  // free list built
  std::uint32_t pending;      // entries in use
  std::uint32_t pad;
  SchedStream streams[kSchedStreams];
  SchedEntry entries[kSchedEntries];
  SchedDone done[kDoneLog];  // indexed by ticket % kDoneLog
};

inline bool sched_enabled(const StateHeader& header) {
  return header.profile == static_cast<std::uint32_t>(Profile::realistic);
}
SchedDevice& sched_device(State& state, std::uint32_t dev);
std::size_t sched_bytes(std::uint32_t devices);

// Runs the simulation of `dev` up to max(now, simulated time). Lock held.
void sched_advance_locked(State& state, std::uint32_t dev, std::uint64_t now);
// Brings every device up to now (takes the lock). No-op for the ideal profile.
void sched_catch_up(State& state);
// Appends an entry to its stream at the simulated now; returns its ticket (and
// where it lives), 0 if the device's tables are full.
std::uint64_t sched_submit_locked(State& state, std::uint32_t dev, const SchedStreamInfo& stream, SchedEntry entry,
                                  SchedTarget* where);

// What is still pending among a stream's (or a context's) entries with ticket <= up_to.
struct SchedPending {
  std::uint64_t entries;       // how many
  std::uint64_t remaining_ns;  // their summed remaining run time (a lower bound on the wait)
};
SchedPending sched_stream_pending_locked(State& state, std::uint32_t dev, std::uint64_t stream_key,
                                         std::uint64_t up_to);
SchedPending sched_context_pending_locked(State& state, std::uint32_t dev, std::uint64_t ctx_key, std::uint64_t up_to);
// True (and its completion time) once `ticket`, submitted at `where`, has run.
bool sched_ticket_done_locked(State& state, std::uint32_t dev, SchedTarget where, std::uint64_t ticket,
                              std::uint64_t* end_ns);

// Per-kernel run time under the profile's jitter: duration * (1 + u * pct / 100),
// u uniform in [-1, 1], deterministic in (seed, dev, index).
std::uint64_t jittered_ns(const StateHeader& header, std::uint32_t dev, std::uint64_t index, std::uint64_t duration_ns);

}  // namespace gpuslice::fakecuda
