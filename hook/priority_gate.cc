// Priority between tenants on the launch path: the gate. See hook/priority_gate.h (its two calls),
// limiter/priority.h (the decisions) and docs/priority.md (the design).
//
// Per device, while the board (priority_board.h: this container's file, the
// neighbours' tables) says a higher-priority neighbour is active, a launch is
// held; while one is present, a ring of event markers recorded in front of
// this process's launches (launch_markers.h) bounds how much of its work is
// queued on the device, and measures its launches' device time, from which
// the board publishes until when this container counts as active.
// gpuslice: hot path (no heap, no locks)
#include "hook/priority_gate.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>

#include "hook/launch_markers.h"
#include "hook/priority_board.h"
#include "hook/config.h"
#include "hook/process.h"
#include "hook/region.h"
#include "limiter/compute.h"
#include "limiter/priority.h"
#include "platform/clock.h"
#include "platform/once.h"

namespace gpuslice::hook {
namespace {

using limiter::Verdict;

constexpr unsigned kRing = 32;  // > kMaxBoundLaunches
static_assert(kRing > limiter::kMaxBoundLaunches);

// A marker is recorded in front of each launch. `sample`: it was recorded
// right after the previous launch on the same stream, and that launch was
// queued behind earlier work: the time between the two markers is then that
// launch's device time.
struct Marker {
  CUevent event;
  CUstream stream;
  bool sample;
  // A booked launch's end marker (priority_after_launch): observe_booked.
  bool booked;
  // A booked end marker's: when the marker in front of the launch was
  // recorded (on an idle stream: it completed then), when the level's
  // timetable says the launch ends (0: unknown), and the claim's lag_shift_us.
  std::uint64_t begin_ns;
  std::uint64_t timetable_end_ns;
  std::uint32_t shift_us;
};
// "Right after": the marker of the next launch comes within this of the previous launch.
constexpr std::uint64_t kAdjacentNs = 100'000;

struct alignas(64) GateDevice {
  std::atomic<int> engaged{0};
  std::atomic<std::uint64_t> horizon{0};  // when our queued work should be done (markers.lock writes)
  // Markers, and what they measure (markers.lock).
  MarkerRing<Marker, kRing> markers;
  limiter::InflightEstimate estimate;
  std::uint64_t last_launch_ns = 0;
  CUstream last_stream = nullptr;
  bool last_queued = false;         // the previous launch was queued behind earlier work
  std::uint64_t backlog = 0;        // when the lower neighbours' work queued ahead of this burst should be done
  std::uint64_t prev_start_ns = 0;  // when our latest launch started (or will), 0 = unknown
  std::uint64_t late_ns = 0;        // moving average of how late we launched after the previous one's end
  bool prev_start_seen = false;     // prev_start_ns was observed (nothing of ours queued), not predicted
  // A launch booked in the level's timetable (lease_wait): its marker is the
  // newest while lease_tail == markers.tail (markers.lock).
  std::uint32_t lease_tail = 0;
  bool lease_marked = false;
  std::atomic<std::uint64_t> lease_late_ns{0};  // moving average: how late we woke for a booked slot
  // The booked launch's marker in front of it: when it was recorded; the
  // newest booked launch's end in the timetable, until its end marker retires.
  std::uint64_t lease_begin_ns = 0;
  std::uint64_t lease_end_ns = 0;
  // How much later than the timetable said a booked launch of ours ended
  // (retire_oldest), not yet told to the level (publish_lag), and its claim's lag_shift_us.
  std::uint64_t lag_ns = 0;
  std::uint64_t lag_seen_ns = 0;  // when that launch ended (publish_lag drops a stale lag)
  std::uint32_t lag_shift_us = 0;
  std::uint32_t lag_launches = 0;  // booked launches since learn_lag last looked
};
GateDevice g_gate[kMaxDevices];

// A launch that took the level's device token (lease_wait) gives it back
// once it has gone to the driver (priority_after_launch). One per thread: a
// thread makes one launch at a time. (Not initial-exec like the library's
// other thread-locals: that variant measured worse beside 256 tenants in 5
// of 8 alternated runs, unexplained, docs/log/2026-11-29-priority-256.md;
// only the slow path reads it.)
struct PendingClaim {
  limiter::Claim claim;
  std::uint64_t launch_ns = 0;
  int ordinal = -1;
};
thread_local PendingClaim t_pending;

platform::OnceFlag g_setup;  // the board's set-up and the fork handler

using platform::sleep_ns;
std::uint64_t mono_ns() noexcept { return platform::monotonic_ns(); }

void after_fork_in_child() noexcept {
  // CUDA does not survive fork(): the child's markers are gone.
  board::after_fork_in_child();
  for (GateDevice& g : g_gate) {
    g.markers.lock.reset();
    g.markers.clear();
    g.estimate = limiter::InflightEstimate{};
    g.last_launch_ns = 0;
    g.last_stream = nullptr;
    g.last_queued = false;
    g.backlog = 0;
    g.prev_start_ns = 0;
    g.late_ns = 0;
    g.lease_marked = false;
    g.lease_tail = 0;
    g.lease_begin_ns = 0;
    g.lease_end_ns = 0;
    g.lag_ns = 0;
    g.lag_seen_ns = 0;
    g.lag_shift_us = 0;
    g.lag_launches = 0;
    g.lease_late_ns.store(0, std::memory_order_relaxed);
    g.horizon.store(0, std::memory_order_relaxed);
  }
  t_pending.ordinal = -1;  // the forking thread's claim is its parent's
}

void setup_once() noexcept {
  board::setup();
  pthread_atfork(nullptr, nullptr, after_fork_in_child);
}

// markers.lock held. Retires the oldest marker (waiting for it when `wait`);
// learns the device time of the launch in front of it when it can.
bool retire_oldest(GateDevice& g, bool wait) noexcept {
  Marker& m = g.markers.oldest();
  MarkerState state = query_marker(m.event);
  if (state == MarkerState::pending) {
    if (!wait) return false;
    state = wait_marker(m.event);
  }
  if (state != MarkerState::done) {  // its context is gone: so is the work behind it
    drop_marker_event(&m.event);
  } else if (m.sample) {
    // The marker before it is complete too (same stream, recorded earlier),
    // and still alive: the ring never reuses the slot behind the oldest.
    std::uint64_t ns = 0;
    if (marker_elapsed_ns(g.markers.before_oldest().event, m.event, &ns)) {
      if (m.booked) {
        limiter::observe_booked(g.estimate, ns);
        // Its end on the host clock: the marker in front of it completed
        // when recorded (the stream had nothing of ours queued).
        const std::uint64_t end = m.begin_ns + ns;
        if (m.timetable_end_ns != 0 && end > m.timetable_end_ns) {
          g.lag_ns = end - m.timetable_end_ns;
          g.lag_seen_ns = end;
          g.lag_shift_us = m.shift_us;
        } else if (m.timetable_end_ns != 0) {
          g.lag_ns = 0;  // a later launch ended on time: an older lag is gone
        }
      } else {
        limiter::observe_launch(g.estimate, ns);
      }
    }
  }
  if (m.booked) g.lease_end_ns = 0;
  g.markers.pop();
  return true;
}

// markers.lock held. Retires the markers that completed, oldest first.
void retire_done(GateDevice& g) noexcept {
  while (!g.markers.empty() && retire_oldest(g, false)) {}
}

// markers.lock held. Retires every marker, waiting for each (the driver's
// blocking wait): nothing of this process's is left on the device.
void retire_all(GateDevice& g) noexcept {
  while (!g.markers.empty()) retire_oldest(g, true);
}

// Records a marker in front of this launch (it completes when everything
// queued before on the stream has run) and learns launch costs from completed
// markers. False when no marker could be recorded.
bool record_marker(GateDevice& g, CUstream s, bool ptsz, bool leased) noexcept {
  if (!marker_waits_available()) return false;
  const CUstream stream = target_stream(s, ptsz);
  g.markers.lock.lock();
  if (capturing(s, ptsz)) {  // the launch does not run; a record would become a graph node
    g.markers.lock.unlock();
    return false;
  }
  retire_done(g);
  const std::uint64_t now = mono_ns();
  if (g.markers.pending() < kRing - 1) {
    Marker& m = g.markers.next();
    if (ensure_marker_event(&m.event, CU_EVENT_BLOCKING_SYNC)) {
      if (record_marker_event(&m.event, stream) == CUDA_SUCCESS) {
        m.stream = stream;
        m.sample =
            g.last_queued && g.last_stream == stream && g.last_launch_ns != 0 && now - g.last_launch_ns < kAdjacentNs;
        m.booked = false;
        m.timetable_end_ns = 0;
        g.markers.push();
        // A booked launch: priority_after_launch() brackets it with the next one.
        g.lease_marked = leased;
        g.lease_begin_ns = now;
        g.lease_tail = g.markers.tail;
        // Pending right after its record: this launch will queue behind earlier work.
        g.last_queued = query_marker(m.event) == MarkerState::pending;
      } else {
        // E.g. an event of another context than the stream's (dropped): the
        // next marker is created in the context current then.
        g.last_queued = false;
      }
    }
  }
  g.last_stream = stream;
  g.markers.lock.unlock();
  return true;
}

// Waits with the driver's blocking synchronisation (no polling: the thread
// wakes when the marker completes) until at most bound_launches() - 1 markers
// are pending: then at most that many launches of ours are queued on the
// device. True when it had to wait.
//
// With a bound of one launch, waiting for the previous launch to finish
// leaves the device idle while this thread wakes up and launches (~0.1 ms per
// launch on the simulator, more when the process waits for a CPU). When the
// previous launch's start is known (it queued behind nothing of ours), the
// thread instead sleeps until kTightLeadNs before its predicted end and lets
// this launch queue then: two launches in flight during that lead only.
bool bound_wait(GateDevice& g, bool tight) noexcept {
  if (!marker_waits_available()) return false;
  g.markers.lock.lock();
  const unsigned limit = limiter::bound_launches(g.estimate, tight);
  bool waited = false;
  const unsigned keep = limit == 1 && g.estimate.avg_ns > limiter::kTightLeadNs ? 1 : limit - 1;
  while (g.markers.pending() > keep) {
    waited = true;
    retire_oldest(g, true);
  }
  if (g.markers.pending() > limit - 1 && !retire_oldest(g, false)) {  // the previous launch is still queued or running
    const std::uint64_t now = mono_ns();
    const std::uint64_t end = g.prev_start_ns != 0 ? g.prev_start_ns + g.estimate.avg_ns : 0;
    // The lead: at least kTightLeadNs, more when this thread has been waking
    // late (a host short of CPU): twice its usual lateness.
    // At most half a launch: the higher tenant waits behind 1.5 launches at worst.
    std::uint64_t lead = 2 * g.late_ns > limiter::kTightLeadNs ? 2 * g.late_ns : limiter::kTightLeadNs;
    if (lead > g.estimate.avg_ns / 2) lead = g.estimate.avg_ns / 2;
    if (end == 0 || end > now + limiter::kMaxPublishAheadNs) {
      retire_oldest(g, true);  // start unknown: wait for its end
    } else if (end > now + lead) {
      sleep_ns(end - lead - now);
    }
    waited = true;
  }
  g.markers.lock.unlock();
  return waited;
}

// This launch goes now: extends the horizon (when our queued work should be
// done) by its expected device time. A launch that starts a burst (nothing of
// ours queued) queues behind what lower neighbours have queued.
void note_launch(GateDevice& g, board::Device& b, Priority self, bool marked) noexcept {
  std::uint64_t now = mono_ns();
  std::uint64_t backlog = 0;
  if (b.lower_present.load(std::memory_order_relaxed) != 0 && g.horizon.load(std::memory_order_relaxed) <= now) {
    // A burst begins: active first (the lower neighbours stop launching at
    // their next look), then the reads of what they have queued.
    board::publish(b, self, now, now + g.estimate.avg_ns);
    backlog = board::read_lower_backlog(b, self, now);
  }
  g.markers.lock.lock();
  now = mono_ns();
  if (backlog != 0) g.backlog = backlog;
  std::uint64_t horizon = g.horizon.load(std::memory_order_relaxed);
  if (backlog > horizon) horizon = backlog;
  backlog = g.backlog;  // the burst's, read at its first launch
  horizon = limiter::extend_horizon(horizon, now, g.estimate.avg_ns);
  // The estimate must not drift ahead of the queue: with k markers pending,
  // at most k + 1 of our launches (this one included) are unfinished, queued
  // behind the lower neighbours' backlog at most.
  if (marked) {
    const std::uint64_t most =
        (backlog > now ? backlog : now) + static_cast<std::uint64_t>(g.markers.pending() + 1) * g.estimate.avg_ns;
    if (horizon > most) horizon = most;
  }
  g.horizon.store(horizon, std::memory_order_relaxed);
  // When this launch starts running: now if nothing of ours is queued, at
  // the predicted end of the one queued (bound_wait's lead), else unknown.
  retire_done(g);
  const unsigned pending = g.markers.pending();
  // Queued behind earlier work of ours now, as it goes (not when its marker
  // was recorded: bound_wait may have slept since): only then does the next
  // marker bracket this launch's device time alone.
  if (marked) g.last_queued = pending != 0;
  std::uint64_t start = 0;
  if (marked && pending == 0) {
    // The previous launch is done: it took at most now - its start. An
    // estimate above that (a sample that shared the device under time
    // slicing) would make bound_wait sleep past its end, with no sample to
    // correct it (a launch behind nothing is not measured): clamp it there
    // when that start was seen (it went behind nothing), move it a quarter of
    // the way when it was only predicted (a prediction may be late).
    if (g.prev_start_ns != 0 && now - g.prev_start_ns < g.estimate.avg_ns) {
      if (g.prev_start_seen)
        g.estimate.avg_ns = now - g.prev_start_ns;
      else
        limiter::observe_launch(g.estimate, now - g.prev_start_ns);
    }
    // How late this thread came (the device idled for us meanwhile): the
    // lead hides this much, up to a whole launch (two in flight).
    if (g.prev_start_ns != 0) {
      const std::uint64_t end = g.prev_start_ns + g.estimate.avg_ns;
      std::uint64_t late = now > end ? now - end : 0;
      if (late > g.estimate.avg_ns) late = g.estimate.avg_ns;
      g.late_ns = (3 * g.late_ns + late) / 4;
    }
    start = now;
  } else if (marked && pending == 1 && g.prev_start_ns != 0) {
    // Behind the previous one: from its predicted end, unless that is long
    // past (it was delayed: then we cannot tell).
    const std::uint64_t end = g.prev_start_ns + g.estimate.avg_ns;
    if (end + limiter::kTightLeadNs >= now) start = end > now ? end : now;
    g.late_ns = 3 * g.late_ns / 4;  // on time
  }
  g.prev_start_ns = start;
  g.prev_start_seen = marked && pending == 0;
  g.last_launch_ns = now;
  g.markers.lock.unlock();
}

// Sleeps while a higher neighbour is active: until its activity ends (as
// the board said at the latest look, plus a spread from the pid: the held
// containers of a level do not all wake together), at most kHoldMaxSleepNs
// between looks. Accounts the time. Returns the verdict that let it go.
Verdict hold(GateDevice& g, board::Device& b, Priority self, std::uint64_t now) noexcept {
  Region* r = g_process.region;
  const std::uint64_t began = now;
  const std::uint64_t spread = (static_cast<std::uint64_t>(getpid()) * 7919u) % limiter::kHoldSpreadNs;
  Verdict v = Verdict::held;
  while (v == Verdict::held) {
    const std::uint64_t ns = limiter::hold_sleep_ns(b.held_until.load(std::memory_order_relaxed), now, spread);
    r->header.priority_held_until_ns.store(now + 2 * ns, std::memory_order_relaxed);
    sleep_ns(ns);
    now = mono_ns();
    v = board::recheck(b, self, now);
  }
  const std::uint64_t held = now - began;
  r->header.priority_held_ns.fetch_add(held, std::memory_order_relaxed);
  g.markers.lock.lock();
  g.prev_start_ns = 0;  // our queue drained while held: the next launch's lateness means nothing
  g.markers.lock.unlock();
  board::record_hold(b, held);
  return v;
}

// Tells the level how much later than its timetable a booked launch of ours
// ended (board::correct: the timetable moves by as much, once per lag).
// A lag seen more than kLagFreshNs ago is dropped: the launches queued
// behind that one have run since (a process that books again only minutes
// later must not move a busy timetable by what the device did then).
constexpr std::uint64_t kLagFreshNs = 20'000'000;
void publish_lag(GateDevice& g, board::Device& b) noexcept {
  g.markers.lock.lock();
  const std::uint64_t lag = g.lag_ns, seen = g.lag_seen_ns;
  const std::uint32_t shift = g.lag_shift_us;
  g.lag_ns = 0;
  g.markers.lock.unlock();
  const std::uint64_t now = mono_ns();
  if (lag >= limiter::kLeaseLagFixNs && (seen >= now || now - seen <= kLagFreshNs)) board::correct(b, shift, lag);
}

// The level's timetable counts launches by estimates, never by what the
// device did: with run times that vary it runs ahead of the device, which
// falls a launch or more behind for as long as nothing idles it (each later
// launch queued on time behind a late one). A booked launch looks at its
// previous booked launch's end marker just after the timetable says it ended,
// when that comes well before its own turn (`at`): done, its markers tell how
// late it ended; not yet, it waits for it (the driver's blocking wait). Then
// it tells the level: the lag is seen one launch after it arose, not one turn
// of every container later. A look costs a wake-up, which beside many
// containers on few cores is what the host lacks (next to 256 low tenants on
// 2 cores, a look at every launch made the high tenant's thread wait for a
// CPU in its bursts): a booking with more than kLagLookers launches of its
// level booked ahead of it (`ahead`) looks at one launch in ahead /
// kLagLookers, so that the level looks about kLagLookers times per turn.
constexpr std::uint64_t kLagLookers = 16;
void learn_lag(GateDevice& g, board::Device& b, std::uint64_t at, std::uint64_t ahead) noexcept {
  g.markers.lock.lock();
  retire_done(g);
  const std::uint64_t end = g.lease_end_ns;
  const bool due = ++g.lag_launches >= ahead / kLagLookers;
  const bool look = due && !g.markers.empty() && end != 0 && end + limiter::kLeaseLeadNs < at;
  if (look) g.lag_launches = 0;
  g.markers.lock.unlock();
  if (!look) return publish_lag(g, b);
  const std::uint64_t now = mono_ns(), when = end + limiter::kLeaseLagFixNs / 2;
  if (when > now) sleep_ns(when - now);
  g.markers.lock.lock();
  retire_all(g);
  g.markers.lock.unlock();
  publish_lag(g, b);
}

// board::book, tried again after a kHoldPollNs sleep while the level's lock
// stays taken (its holder lacks a CPU: with hundreds of containers on a few
// cores, common): a launch that went unbooked would queue beside the level's,
// past the budget. The time this costs is counted in *stuck: past
// kLeaseGiveUpNs (a holder stopped for good) the launch goes with the
// per-process bound.
bool book_again(board::Device& b, Priority self, std::uint64_t* now, std::uint64_t d, std::uint64_t* start,
                std::uint32_t* seq, std::uint32_t* shift_us, std::uint64_t* stuck) noexcept {
  for (;;) {
    if (board::book(b, self, *now, d, start, seq, shift_us)) return true;
    if (b.lease_shared.load(std::memory_order_relaxed) == 0) return false;
    sleep_ns(limiter::kHoldPollNs);
    const std::uint64_t t = mono_ns();
    *stuck += t - *now;
    *now = t;
    if (*stuck >= limiter::kLeaseGiveUpNs) return false;
  }
}

// Bounded next to a higher neighbour: books this launch in the level's
// timetable on the device (board::book) and sleeps until its slot is
// lease_allow() away, or until a launch of its level wakes it (the handoff:
// each launch that goes wakes the longest-waiting booking, which then claims
// lease_allow() before that launch should end, the device's pace rather than
// its slot's); then, unless a higher neighbour has become active
// meanwhile (it is held, and books again), it takes the level's device token
// and claims its place behind what the level has launched (board::claim).
// When that is not nearly done (it, or a neighbour, woke late into another's
// slot) it books the next free slot; while another launch of the level holds
// the token (claimed, not yet gone to the driver) it looks again shortly. So
// the level's containers, however many, keep about one launch queued
// together, never two behind a claim whose thread lost its CPU: late
// wake-ups cost slots, never a second launch queued. A last look at the
// board after the claim (given back when held), a claim at once when a hold
// ends, and no launch while its own previous one is queued keep it so when
// the threads lack CPU (hundreds of containers, few cores). A launch that
// cannot book or claim (lock or token taken) waits, kLeaseGiveUpNs at most.
// False when there is no timetable: then the per-process bound applies.
bool lease_wait(GateDevice& g, board::Device& b, int ordinal, Priority self, bool tight) noexcept {
  g.markers.lock.lock();
  const std::uint64_t d = g.estimate.avg_ns;
  g.markers.lock.unlock();
  std::uint64_t now = mono_ns();
  std::uint64_t start = 0, stuck = 0;
  std::uint32_t seq = 0, shift = 0;
  if (!book_again(b, self, &now, d, &start, &seq, &shift, &stuck)) return false;
  const std::uint64_t allow = limiter::lease_allow(d, tight, g.lease_late_ns.load(std::memory_order_relaxed));
  learn_lag(g, b, start > allow ? start - allow : 0, start > now && d != 0 ? (start - now) / d : 0);
  now = mono_ns();
  // GPUSLICE_PRIORITY_HANDOFF (off: it sleeps to its slot); one handoff per
  // launch: refused, it sleeps to its slot.
  bool may_hand = board::handoff();
  for (int round = 0; round < 1024 && stuck < limiter::kLeaseGiveUpNs; ++round) {
    std::uint64_t at = start > allow ? start - allow : 0;
    bool handed = false;
    if (at > now) {
      if (may_hand)
        handed = board::wait_turn(b, seq, at - now);
      else
        sleep_ns(at - now);
      if (handed) {
        // Handed the turn: the level's launch went. The claim (the same
        // condition) one lead before it should end; a timed sleep to there.
        now = mono_ns();
        at = limiter::handoff_at(board::launched_until(b), now, allow);
        if (at > now) sleep_ns(at - now);
      }
      now = mono_ns();
      // How late the thread wakes: the lead hides up to that much.
      const std::uint64_t most = d != 0 ? d : limiter::kLeaseUnmeasuredNs;
      const std::uint64_t late = now - at < most ? now - at : most;
      const std::uint64_t avg = g.lease_late_ns.load(std::memory_order_relaxed);
      g.lease_late_ns.store((3 * avg + late) / 4, std::memory_order_relaxed);
    }
    if (board::recheck(b, self, now) == Verdict::held) {
      if (hold(g, b, self, now) == Verdict::free) return false;  // nobody higher any more
      // Its slot passed. Awake as the hold ends, it claims at once (the
      // first of the held ones goes; the others find the level's launch
      // queued and book again).
      now = mono_ns();
      start = now + allow;
      continue;
    }
    // Our own previous launch still queued when our slot comes: the device
    // is slower than the timetable (another level's work, e.g. a limited
    // higher neighbour that holds nobody, runs in between, or a launch of
    // the level that went late), which it cannot see. Going now would queue
    // a second launch of the level: this one waits for its own (the
    // driver's blocking wait), then claims.
    g.markers.lock.lock();
    retire_done(g);
    const bool behind = !g.markers.empty();
    retire_all(g);
    g.markers.lock.unlock();
    publish_lag(g, b);
    if (behind) {
      now = mono_ns();
      start = now + allow;
      continue;
    }
    limiter::Claim c;
    if (!board::claim(b, now, d, allow, &c)) {
      // The level's lock stayed taken: a new slot rather than a launch
      // beside the level's.
      const std::uint64_t t = mono_ns();
      stuck += t - now;
      now = t;
      if (!book_again(b, self, &now, d, &start, &seq, &shift, &stuck)) return false;
      continue;
    }
    if (c.go) {
      // A last look, as close to the launch as it can be: a higher
      // neighbour that became active since the look above (its burst began
      // while this thread claimed) must not find this launch in its burst.
      now = mono_ns();
      if (board::recheck(b, self, now) != Verdict::held) {
        t_pending.claim = c;
        t_pending.launch_ns = d;
        t_pending.ordinal = ordinal;
        return true;
      }
      board::unclaim(b, c, d);
      if (hold(g, b, self, now) == Verdict::free) return false;  // nobody higher any more
      now = mono_ns();
      start = now + allow;
      continue;
    }
    if (handed && start > now + allow) {
      // Handed the turn and refused (another claimed first): its own slot
      // is still booked and ahead; it sleeps to it, as without the handoff
      // (no second handoff: under load every launch would wake it again),
      // rather than polling the token or booking anew.
      may_hand = false;
      continue;
    }
    // The device ran behind the timetable and it moved (correct_lease): its
    // slot moved with it, still its turn (limiter::follow_correction).
    if (!c.token_taken && limiter::follow_correction(&start, now, c.lag_shift_us, shift, c.busy_until_ns)) {
      shift = c.lag_shift_us;
      continue;
    }
    if (c.token_taken) {
      // Another launch of the level claimed and has not gone yet: it gives
      // the token back within a few syscalls unless its thread lost its CPU
      // (or the driver call takes long). Its launch then runs at least d:
      // no claim can go before d - allow, so look again then, not sooner.
      const std::uint64_t dd = d != 0 ? d : limiter::kLeaseUnmeasuredNs;
      sleep_ns(dd > allow + limiter::kLeaseTokenPollNs ? dd - allow : limiter::kLeaseTokenPollNs);
      const std::uint64_t t = mono_ns();
      stuck += t - now;
      now = t;
      start = now + allow;
      continue;
    }
    // Taken: the next free slot, at the timetable's end (waiting for this
    // one's end instead, every late waker would wake together).
    if (!book_again(b, self, &now, d, &start, &seq, &shift, &stuck)) return false;
  }
  return false;
}

[[gnu::noinline, gnu::cold]] bool admit_slow(GateDevice& g, board::Device& b, CUstream s, bool ptsz) noexcept {
  // The level may have been changed at run time (gpuslice-smi set --priority).
  const Priority self = board::current_level(g_process.region);
  std::uint64_t now = mono_ns();
  Verdict v = static_cast<Verdict>(b.verdict.load(std::memory_order_relaxed));
  // A high container only needs the board to know whether a lower one is
  // present (then its markers measure what it queues): every rescan period.
  const std::uint64_t every = self == Priority::high ? limiter::kRescanNs : limiter::kRecheckNs;
  if (now - b.checked_ns.load(std::memory_order_relaxed) >= every) v = board::recheck(b, self, now);
  if (self == Priority::high) v = Verdict::free;
  if (v == Verdict::held) v = hold(g, b, self, now);
  // Markers while somebody cares: a higher neighbour (our queue must stay
  // short) or a lower one (our activity must cover our queued work).
  bool after = false;
  if (v != Verdict::free || b.lower_present.load(std::memory_order_relaxed) != 0) {
    const bool tight = b.tight.load(std::memory_order_relaxed) != 0;
    // Bounded: the level's timetable bounds what its containers queue
    // together (and this launch's marker is recorded once its slot comes).
    const bool leased = v == Verdict::bounded && b.lease_shared.load(std::memory_order_relaxed) != 0 &&
                        lease_wait(g, b, static_cast<int>(&g - g_gate), self, tight);
    const bool marked = record_marker(g, s, ptsz, leased);
    // A bound wait lasts up to one of our launches: a higher neighbour may
    // have become active meanwhile, and this launch must not slip in front of
    // its burst. Look again after a wait (the held loop drains our queue).
    // Next to a serving higher tenant (tight) look every time, not every
    // kRecheckNs: a launch that needed no wait would otherwise go on a
    // verdict up to 0.2 ms old, possibly into its burst.
    if (!leased && marked && v != Verdict::free && (bound_wait(g, tight) || tight)) {
      now = mono_ns();
      if (board::recheck(b, self, now) == Verdict::held) hold(g, b, self, now);
    }
    note_launch(g, b, self, marked);
    if (leased && marked) {
      // A launch that goes alone is never measured between its own markers:
      // priority_after_launch() records one behind it.
      g.markers.lock.lock();
      g.prev_start_ns = 0;  // the bound_wait lead's prediction does not apply to booked launches
      g.markers.lock.unlock();
    }
    after = leased;  // priority_after_launch() gives the level's token back
  }
  board::publish(b, self, mono_ns(), g.horizon.load(std::memory_order_relaxed));
  return after;
}

}  // namespace

bool priority_refresh() noexcept {
  if (g_ready.load(std::memory_order_acquire) != kReadyYes || !config().valid) return false;
  if (g_setup.claim()) {
    setup_once();
    g_setup.complete();
  }
  if (!g_setup.done()) return false;  // another thread is setting up
  Region* r = g_process.region;
  const Priority self = board::current_level(r);
  const std::uint64_t now = mono_ns();
  bool any = false;
  for (std::uint32_t entry = 0; entry < kMaxDevices; ++entry) {
    const int ordinal = ordinal_of_entry(static_cast<int>(entry));
    if (ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices) continue;
    const bool engaged = board::refresh(board::device(ordinal), r, static_cast<int>(entry), self, now);
    g_gate[ordinal].engaged.store(engaged ? 1 : 0, std::memory_order_relaxed);
    any = any || engaged;
  }
  return any;
}

bool priority_board_present() noexcept { return board::present(); }

bool priority_admit(int ordinal, CUstream stream, bool ptsz) noexcept {
  if (static_cast<unsigned>(ordinal) >= kMaxDevices) return false;
  GateDevice& g = g_gate[ordinal];
  if (g.engaged.load(std::memory_order_relaxed) == 0) return false;
  return admit_slow(g, board::device(ordinal), stream, ptsz);
}

void priority_after_launch(int ordinal, CUstream stream, bool ptsz, bool launched) noexcept {
  if (static_cast<unsigned>(ordinal) >= kMaxDevices) return;
  GateDevice& g = g_gate[ordinal];
  std::uint64_t timetable_end = 0;
  if (t_pending.ordinal == ordinal) {
    // Gone to the driver (or refused: nothing queued, the same for the level).
    t_pending.ordinal = -1;
    timetable_end = board::launched(board::device(ordinal), t_pending.claim, t_pending.launch_ns);
  }
  const CUstream target = target_stream(stream, ptsz);
  g.markers.lock.lock();
  // Only right behind this launch's own marker (no other thread's since):
  // the two then bracket the launch (and whatever it queued behind).
  if (launched && g.lease_marked && g.markers.tail == g.lease_tail && g.markers.pending() < kRing - 1) {
    Marker& m = g.markers.next();
    if (ensure_marker_event(&m.event, CU_EVENT_BLOCKING_SYNC) &&
        record_marker_event(&m.event, target) == CUDA_SUCCESS) {
      m.stream = target;
      m.sample = true;
      m.booked = true;
      m.begin_ns = g.lease_begin_ns;
      m.timetable_end_ns = timetable_end;
      m.shift_us = t_pending.claim.lag_shift_us;
      g.markers.push();
      g.lease_end_ns = timetable_end;
    }
  }
  g.lease_marked = false;
  g.last_queued = false;  // the next launch's marker brackets nothing of ours
  g.markers.lock.unlock();
}

}  // namespace gpuslice::hook
