// The realistic profile's device scheduler (README "Realistic profile"): a
// discrete-event simulation of one device, advanced lazily to "now" by whichever
// process touches it (launch, synchronise, NVML query). Because work is only
// ever added at the current simulated time, the simulation is exact whoever
// advances it and however late.
//
// Model: pending launches of every process, in submission (ticket) order. The
// device runs one context at a time; when several contexts have runnable work
// it switches round-robin every `timeslice_ns` (a kernel is preempted at the
// boundary and resumed later); busy time goes to the context that ran. Inside
// the running context, the head launch of each stream runs concurrently while
// their block counts fit in the SM count (the first always runs); a stream's
// launches run in order; the legacy stream waits for all earlier work of its
// context and blocking streams wait for earlier legacy-stream work. Events and
// stream waits are zero-length entries.
//
// Everything here is under State's robust mutex (plain fields, one lock).
#pragma once

#include <cstdint>

#include "state.h"

namespace gpuslice::fakecuda {

inline constexpr std::uint32_t kSchedEntries = 8192;  // pending launches per device
inline constexpr std::uint32_t kDoneLog = 8192;       // completion times kept for events

enum class SchedKind : std::uint8_t { kernel = 1, marker = 2, wait = 3 };

struct SchedEntry {
  std::uint64_t ticket = 0;       // device-wide submission order, from 1
  std::uint64_t ctx_key = 0;      // (slot + 1) << 40 | context id
  std::uint64_t stream_key = 0;   // (slot + 1) << 40 | stream id
  std::uint64_t remaining_ns = 0;
  std::uint64_t wait_ticket = 0;  // kind wait: runnable once this ticket completed
  std::uint64_t pids = 0;         // host_pid << 32 | pid, as on the ring
  std::uint32_t slot = 0;
  std::uint32_t generation = 0;   // the slot's generation at submission
  std::uint32_t blocks = 1;       // grid size, for the occupancy model
  SchedKind kind = SchedKind::kernel;
  std::uint8_t legacy = 0;        // on its context's legacy (NULL) stream
  std::uint8_t blocking = 0;      // on a stream without CU_STREAM_NON_BLOCKING
  std::uint8_t pad = 0;
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
  std::uint32_t segment_slot;
  std::uint32_t count;  // pending entries, sorted by ticket
  SchedEntry entries[kSchedEntries];
  SchedDone done[kDoneLog];  // indexed by ticket % kDoneLog
};

inline bool sched_enabled(const StateHeader &header) {
  return header.profile == static_cast<std::uint32_t>(Profile::realistic);
}
SchedDevice &sched_device(State &state, std::uint32_t dev);
std::size_t sched_bytes(std::uint32_t devices);

// Runs the simulation of `dev` up to max(now, simulated time). Lock held.
void sched_advance_locked(State &state, std::uint32_t dev, std::uint64_t now);
// Brings every device up to now (takes the lock). No-op for the ideal profile.
void sched_catch_up(State &state);
// Appends an entry at the simulated now; returns its ticket, 0 if the table is full.
std::uint64_t sched_submit_locked(State &state, std::uint32_t dev, SchedEntry entry);

// What is still pending among entries matching a key with ticket <= up_to.
struct SchedPending {
  std::uint64_t entries;       // how many
  std::uint64_t remaining_ns;  // their summed remaining run time (a lower bound on the wait)
};
enum class SchedMatch { stream, context, ticket };
SchedPending sched_pending_locked(State &state, std::uint32_t dev, SchedMatch match, std::uint64_t key,
                                  std::uint64_t up_to);
// True (and its completion time) once `ticket` has completed; false while pending.
bool sched_ticket_done_locked(State &state, std::uint32_t dev, std::uint64_t ticket, std::uint64_t *end_ns);

// Per-kernel run time under the profile's jitter: duration * (1 + u * pct / 100),
// u uniform in [-1, 1], deterministic in (seed, dev, index).
std::uint64_t jittered_ns(const StateHeader &header, std::uint32_t dev, std::uint64_t index,
                          std::uint64_t duration_ns);

}  // namespace gpuslice::fakecuda
