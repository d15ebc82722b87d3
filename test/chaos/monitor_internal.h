// The invariant monitor's shared state and helpers (monitor.cc), for its
// refusal check (refusal.cc): the words every process of the simulated
// machine shares in <state>.monitor, this process's configuration, and the
// reads of the simulator and the region that both checks make.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <gpuslice/region.h>

#include "fakecuda_query.h"

namespace gpuslice::chaos::internal {

// The simulated machine's process slots and devices (fakecuda_query.h).
inline constexpr std::uint32_t kSimSlots = FAKECUDA_MAX_SLOTS;
inline constexpr std::uint32_t kSimDevices = FAKECUDA_MAX_DEVICES;

inline constexpr std::uint64_t kMonitorMagic = 0x384f54494e4f4d46ull;  // "FMONITO8": released files
inline constexpr std::uint32_t kWatches = 256;
inline constexpr std::uint32_t kLimitChanges = 4;  // the last limit changes each watch keeps

// Shared by every process of the simulated machine: <state>.monitor.
struct Watch {                     // one (container, device)
  std::atomic<std::uint64_t> key;  // 0 = free
  std::atomic<std::uint64_t> limit_seen;
  std::atomic<std::uint64_t> ceiling;
  std::atomic<std::uint64_t> grace_until_ns;  // a limit change: calls begun before then may hold the old limit
  // The last kLimitChanges changes of the limit: when each was seen and the
  // limit in force before it (entry changes % kLimitChanges is the next).
  std::atomic<std::uint64_t> changes;
  std::atomic<std::uint64_t> change_seen_ns[kLimitChanges];
  std::atomic<std::uint64_t> limit_before[kLimitChanges];
  std::atomic<std::uint64_t> implicit_until_ns;  // implicit grants: excess up to implicit_bytes tolerated until then
  std::atomic<std::uint64_t> implicit_bytes;
  // A condition (excess, deficit) "stayed" only if checks saw it without a
  // gap longer than lag/2: since = when the run of sightings began, seen = the
  // last sighting. A check that finds it after a longer gap (no grant, the
  // sampler starved on a loaded machine) cannot tell it held meanwhile and
  // starts a new run, so a transient seen once and a new one seen much later
  // are never taken for one long one.
  std::atomic<std::uint64_t> excess_since_ns;
  std::atomic<std::uint64_t> excess_seen_ns;
  std::atomic<std::uint64_t> excess_reported;
  std::atomic<std::uint64_t> deficit_since_ns;
  std::atomic<std::uint64_t> deficit_seen_ns;
  std::atomic<std::uint64_t> deficit_reported;
};
struct MonitorShared {
  std::atomic<std::uint64_t> magic;
  std::atomic<std::uint64_t> violations;
  std::atomic<std::uint64_t> checks;
  std::atomic<std::uint64_t> member_container[kSimSlots];
  std::atomic<std::uint32_t> member_generation[kSimSlots];
  // Managed grants in flight, per process and device: granted, and the
  // granting thread has made no other change of device memory since (the
  // library's spill advises them to the host as its next step).
  std::atomic<std::uint64_t> managed_in_flight[kSimSlots][kSimDevices];
  Watch watch[kWatches];
  // For judging refusals (monitor_request_end): what each process freed so
  // far (monotone), the requests its threads have in flight (reported by the
  // program: monitor_request_begin/end), and the pools it uses (monitor_pools).
  std::atomic<std::uint64_t> freed[kSimSlots][kSimDevices];
  std::atomic<std::uint64_t> requesting[kSimSlots][kSimDevices];
  // The program's requests, monotone: bytes of those begun and of those
  // ended. The requests overlapping [t0, t1] are those begun by t1 less
  // those ended by t0 (a request that ended before the refusal was judged
  // may still have been reserved when gpuslice checked).
  std::atomic<std::uint64_t> request_begun[kSimSlots][kSimDevices];
  std::atomic<std::uint64_t> request_ended[kSimSlots][kSimDevices];
  // The program's frees (monitor_release_begin/end), monotone: bytes of
  // those begun and of those ended; frees of unknown size begun and ended.
  // The frees overlapping [t0, t1] are those begun by t1 less those ended by t0.
  std::atomic<std::uint64_t> release_begun[kSimSlots][kSimDevices];
  std::atomic<std::uint64_t> release_ended[kSimSlots][kSimDevices];
  std::atomic<std::uint64_t> unknown_begun[kSimSlots];
  std::atomic<std::uint64_t> unknown_ended[kSimSlots];
  std::atomic<std::uint32_t> pools[kSimSlots];
  std::atomic<std::uint64_t> absorbed[kSimSlots][kSimDevices];  // monitor_absorbed
  // Bytes the driver took back inside a request's own call (the library's
  // refusal path trims the process's pools before it lowers their count),
  // monotone: added at the uncharge, and again to `ended` when the request
  // ended (its count lowered by then). Overlapping [t0, t1]: begun by t1 less
  // ended by t0.
  std::atomic<std::uint64_t> reclaimed_begun[kSimSlots][kSimDevices];
  std::atomic<std::uint64_t> reclaimed_ended[kSimSlots][kSimDevices];
  std::atomic<std::uint64_t> refusals_judged;
  std::atomic<std::uint64_t> refusals_skipped;
  // Count checks judged, and not (the machine's frees moved during every read).
  std::atomic<std::uint64_t> count_judged;
  std::atomic<std::uint64_t> count_unsettled;
  // The count direction's excuses, per process (calls.cc): bytes granted to
  // its threads inside calls still in flight (monitor_call_begin/end), its
  // memory outside CUDA (monitor_outside_begin/end), what graphics frees took
  // out of measurements of live objects (monitor_measured_short), and 1 once
  // it runs its exit handlers.
  std::atomic<std::uint64_t> in_calls[kSimSlots][kSimDevices];
  std::atomic<std::uint64_t> in_calls_implicit[kSimSlots][kSimDevices];  // of in_calls, implicit grants
  std::atomic<std::uint64_t> outside[kSimSlots][kSimDevices];
  std::atomic<std::uint64_t> measured_short[kSimSlots][kSimDevices];
  std::atomic<std::uint32_t> exiting[kSimSlots];
  std::atomic<std::uint64_t> uncharges;  // every process's, monotone (check(): a free during its reads)
  // A report named this process as a holder the count misses (holders.cc):
  // the reporter's pid; its sampler appends its own last operations to the
  // report file and clears it.
  std::atomic<std::uint32_t> dump_asked[kSimSlots];
  // A dead process whose files another task still releases (calls.cc,
  // released_excused): when a check first found it so (0: not so), in which
  // generation of its simulator slot; and the region slot gpuslice last gave
  // it, as a count check found it live (index + 1, and its pid).
  std::atomic<std::uint64_t> released_since_ns[kSimSlots];
  std::atomic<std::uint32_t> released_generation[kSimSlots];
  std::atomic<std::uint32_t> region_slot_plus1[kSimSlots];
  std::atomic<std::uint32_t> region_slot_pid[kSimSlots];
  std::atomic<std::uint64_t> count_released;  // count checks that excused such a process (the summary's)
};

struct MonitorConfig {
  bool on = false;
  std::uint64_t lag_ns = 250'000'000;
  std::uint64_t interval_ms = 5;
  int ring = 32;
  char report[1100] = {};
  char region[1100] = {};
  std::uint64_t container = 0;
  // GPUSLICE_MEMORY_RESIDENT when it is one plain size: the allowance as
  // configured, even before (or without) the library publishing it.
  std::uint64_t resident_env = kUnlimited;
  // GPUSLICE_OVERSUBSCRIBE=spill: the quota bounds device + spilled memory.
  bool spill = false;
  // FAKECUDA_MONITOR_REFUSALS=0: refusals are counted, not judged (the quota
  // direction is checked all the same). For the classes whose refusals are
  // open findings (docs/memory-accounting.md, "Chaos testing").
  bool judge_refusals = true;
  // FAKECUDA_MONITOR_READ_DELAY_US (test knob): microseconds slept between
  // the two reads of a process's figures in container_total() (its managed
  // grants in flight and what it holds), widening the window in which its
  // threads change them (ChaosTorture.AManagedGrantLandingDuringACheckIsNoExcess).
  std::uint64_t read_delay_us = 0;
  // FAKECUDA_MONITOR_CALLS=1: every process brackets its calls
  // (monitor_call_begin/end), so a deficit beyond the excuses (calls.cc) is
  // a violation at once; without it, one that lasts longer than the lag.
  bool calls = false;
  // FAKECUDA_MONITOR_OVERCOUNT=1: monitor_checkpoint() also judges the other
  // direction, a process counting more than it holds (overcount.cc).
  bool overcount = false;
};

struct Grant {
  std::uint64_t bytes;
  bool implicit;  // context or module memory: measured by the library after the call
  bool managed;   // cuMemAllocManaged: spilled (advised to the host) after the call
  const char* call;
  std::uint64_t began_ns = 0;  // when the granting driver call began (fakecuda_call_began_ns); 0: unknown
};

extern MonitorConfig g_config;
extern MonitorShared* g_shared;
extern int g_slot;               // this process's slot in the simulator's state
extern std::uint32_t g_devices;  // the simulated machine's devices

// The region, mapped read-only once it exists; its entry for a fake device.
const Region* region();
// Its open description (read-only), kept for probing the slots' file locks; -1 without a region.
int region_fd();
int region_device(std::uint32_t dev, const Region& r);
// Whether simulator slot `i` is a process of this container (claimed, and
// recorded as a member in this generation); *slot gets its figures on `dev`.
// member_alive: and its process is alive (or is us). State lock held.
bool member(int i, std::uint32_t dev, fakecuda_slot_info* slot);
bool member_alive(int i, std::uint32_t dev, fakecuda_slot_info* slot);
// What a process may hold beyond gpuslice's count (calls.cc), in parts.
struct Excused {
  std::uint64_t calls = 0;           // granted inside calls in flight
  std::uint64_t outside = 0;         // memory outside CUDA (not imported)
  std::uint64_t measured_short = 0;  // graphics frees inside measurements of live objects
  std::uint64_t exiting = 0;         // all of a process in its exit handlers
  std::uint64_t released = 0;        // dead processes whose files another task still releases (for the lag)
  std::uint64_t implicit_calls = 0;  // of calls, implicit grants (the quota's excuse too)
  // Declared after the processes were read and before the count was: memory
  // outside CUDA, or an exit begun, ahead of a release the count already shows.
  std::uint64_t after_reads = 0;
  int processes = 0;  // the live processes these are of
  std::uint64_t total() const { return calls + outside + measured_short + exiting + released + after_reads; }
};
// Device bytes held by the live processes of this container (and of them the
// managed grants in flight, and what the count direction excuses). State lock held.
std::uint64_t container_total(std::uint32_t dev, std::uint64_t* own, std::uint64_t* in_flight = nullptr,
                              Excused* excused = nullptr);
// What the last count check's reads found of each process it counted
// (container_total with excused): the report prints it beside what it reads
// later, when a free may have landed (holders.cc). State lock held.
struct Seen {
  std::uint64_t serial = 0;  // g_seen_serial of that check; another: not counted by it
  std::uint32_t generation = 0;
  std::uint32_t pid = 0;
  std::uint64_t held = 0;
  std::uint64_t excused = 0;  // count_excused's total for it
  // gpuslice's live slot with its pid, read right after `held`: what it
  // counted as possibly resident (committed less owed less spilled); -1: none live.
  long long counted = -1;
  std::uint64_t lease_word = 0;  // its lease word then (limiter/lease.h)
};
extern Seen g_seen[kSimSlots];
// The live region slot of `pid` (a cached index, checked; else a scan):
// committed less owed (a thief's, limiter/lease.h) less spilled on region
// device `rd`, or -1 when it has none; *word gets its lease word.
long long slot_counted(std::uint32_t sim_slot, std::uint32_t pid, int rd, std::uint64_t* word);
extern std::uint64_t g_seen_serial;
extern std::uint64_t g_seen_report;  // the serial of the check reporting now; 0: a report of no count check
extern std::uint64_t g_check_count;  // the count that check read (monitor.cc: resident_count)
// Test hook: run by a count check after it read the processes and before it
// reads the count (state lock held), as another thread's moves landing there.
// Atomic: the test sets it from its main thread while the sampler checks.
extern std::atomic<void (*)()> g_check_between_reads;
// One line per process of the container (holders.cc): what the simulator
// says it holds, at the check and now, what gpuslice's slot with its pid
// counts, its /proc state; then the holders the count misses: processes the
// check counted with no live gpuslice slot, or holding more than their
// slot counts and their excuses. Returns the new length. State lock held.
int append_processes(char* text, std::size_t len, int used, std::uint32_t dev, int region_dev);
// A refusal's report (holders.cc): the live processes of the container whose
// slot counts more than the device holds for them, by how much; each other
// one is asked to write its last operations and holdings to the report
// file. Returns the new length. State lock held.
int append_overcounters(char* text, std::size_t len, int used, std::uint32_t dev, int region_dev);
// A process's sampler: its last operations appended to the report file when
// a report named it as a holder (holders.cc), and its holdings. True when it wrote them.
bool answer_dump_request();
// calls.cc: a process attached (its excuses start at 0); a grant to the
// calling thread (inside its call in flight: excused until the call ends);
// what process slot `slot`, holding `held` on `dev`, is excused (added to *parts).
void calls_attach(int slot);
void note_call_charge(unsigned dev, std::uint64_t bytes, bool implicit);
std::uint64_t count_excused(int slot, std::uint32_t dev, std::uint64_t held, Excused* parts);
// A process with no live gpuslice slot, `bytes` of its holdings not excused
// otherwise: all of them while it is dead by the liveness rule's /proc facts
// and another task still releases its files, for at most the lag after a
// check first found it so (calls.cc). State lock held.
std::uint64_t released_excused(int slot, std::uint32_t pid, std::uint32_t generation, std::uint64_t bytes);
// Whether the region slot gpuslice last gave `pid` (slot_counted records it)
// is free, or being reaped, with its file lock still held by another
// description: a task still holds the process's region description
// (shm::lock_slot_file). False when unknown (holders.cc).
bool region_lock_still_held(int sim_slot, std::uint32_t pid);
// The live processes of this container (container_total's). State lock held.
int live_processes(std::uint32_t dev);
Watch* watch_for(std::uint32_t dev, std::uint64_t limit, std::uint64_t total);
// A check read `limit`: a change from the last one seen starts its lag and
// is kept in the watch's ring. State lock held.
void note_limit(Watch& w, std::uint64_t limit, std::uint64_t now);
// The highest limit that may have admitted a driver call begun at `began`:
// the limit now, or one a change since replaced, until that change's lag
// ended; kUnlimited when the ring no longer reaches back to `began`.
std::uint64_t highest_limit_since(const Watch& w, std::uint64_t limit, std::uint64_t began);
// An uncharge of this process (the observer's): one inside the calling
// thread's request in flight counts as reclaimed (refusal.cc).
void note_uncharge(unsigned dev, std::uint64_t bytes);
// gpuslice's count of what the device may hold (without / with agent_extra_bytes).
std::uint64_t resident_used(const DeviceState& d);
std::uint64_t resident_count(const DeviceState& d);
// The quiescent process (monitor_checkpoint), holding `held` on `dev`
// (region device `rd`): its slot `own` counts no more than that plus the
// documented conservative slack (overcount.cc). Returns the violations
// found (reported). State lock held.
int overcount_at_checkpoint(std::uint32_t dev, int rd, std::uint64_t held, const Region& r, const Slot& own);
// Counts and prints a violation. State lock held.
void report(const char* invariant, const char* detail, std::uint32_t dev, int region_dev, std::uint64_t total,
            std::uint64_t own, std::uint64_t limit, const DeviceState& d, const Grant* grant);

}  // namespace gpuslice::chaos::internal
