// gpuslice::Priority between tenants: the pure decisions, no driver, no files, an
// injected clock (docs/priority.md). The preload library
// (hook/priority_board.cc) feeds them what the priority board holds
// (shm/priority_board.h); its gate (hook/priority_gate.cc) acts on them.
//
// Per device, a container is
//   - *active* while its published active_until_ns is in the future: until
//     kLingerNs after the work it has queued is expected to have run (its
//     launches' measured device time), at most kMaxPublishAheadNs ahead;
//   - *present* while it launched within the last kPresentNs.
// A container with a higher-priority neighbour that is
//   - active: is HELD: its new launches wait (bounded sleeps) until no higher
//     neighbour is active;
//   - only present: is BOUNDED: it keeps at most about kBoundWorkNs of work in
//     flight, so that a higher neighbour's next burst waits behind at most that;
//   - absent: is FREE: nothing is done (for a normal container, not even the
//     slow path).
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpuslice/priority_board.h"

namespace gpuslice::shm {
struct PriorityLease;
}

namespace gpuslice::limiter {

// --- tunables (docs/priority.md explains each) ---
// A container stays active this long after its queued work is expected to
// have run (or after its latest launch, before any measurement): covers the
// estimate's error (jitter, a lower tenant's publication lagging by up to
// kPublishSlackNs) and the gap between a synchronize and the next launch. The
// lower tenants' bounded work queued ahead of a burst is not in the linger: it
// is in the horizon, read from their own publications (lower_backlog).
inline constexpr std::uint64_t kLingerNs = 1'500'000;
// A container with an SM limit on the device has its share; it holds nobody
// (lower containers get the remainder) and only publishes its presence, this
// often, so that they stay bounded next to it.
inline constexpr std::uint64_t kPresenceRefreshNs = 100'000'000;
// It never publishes activity further ahead than this: the longest a killed
// process (whose queued work dies with its context) can keep others held.
inline constexpr std::uint64_t kMaxPublishAheadNs = 8'000'000;
// A publication is skipped unless it extends active_until by at least this
// much: at most ~2000 writes per second per process, whatever the launch rate.
inline constexpr std::uint64_t kPublishSlackNs = 500'000;
// An active_until further ahead than this is not believed (a corrupt word, a
// clock of another time namespace): it cannot hold anyone.
inline constexpr std::uint64_t kMaxAheadNs = kMaxPublishAheadNs + 2'000'000;
// A neighbour counts as present this long after its latest launch.
inline constexpr std::uint64_t kPresentNs = 30'000'000'000;
// A held launch sleeps this long between looks at the board (reaction and
// release within a few of these).
inline constexpr std::uint64_t kHoldPollNs = 250'000;
// ... unless the board says until when the holder is active: then it sleeps
// until then (plus a spread of up to kHoldSpreadNs, from its pid, so that the
// held containers of a level do not all wake at once), at most this long (a
// holder that is killed releases it at its next look).
inline constexpr std::uint64_t kHoldMaxSleepNs = 1'000'000;
inline constexpr std::uint64_t kHoldMinSleepNs = 20'000;
inline constexpr std::uint64_t kHoldSpreadNs = 64'000;
// The held/free verdict is re-read from the board at most this often per
// process on the launch path.
inline constexpr std::uint64_t kRecheckNs = 200'000;
// Board directories are rescanned for new files this often.
inline constexpr std::uint64_t kRescanNs = 100'000'000;
// In-flight bound of a lower-priority container next to a present
// higher-priority one that has not launched for kRecentNs: about this much
// device time...
inline constexpr std::uint64_t kBoundWorkNs = 1'000'000;
// ... as a number of launches, between these (before any measurement: the
// minimum). Two, not one: with a single launch in flight the device idles
// while the process wakes up from its wait and launches the next.
inline constexpr std::uint32_t kMinBoundLaunches = 2;
// While a higher neighbour launched within kRecentNs (it is bursting, its next
// burst is likely soon) the bound is TIGHT: about kTightBoundWorkNs, at least
// one launch. Each burst of the higher one waits behind at most that (or one
// of our launches, when a single one is longer), which costs us the wake-up gap
// between our launches (measured on the simulator: docs/priority.md).
inline constexpr std::uint64_t kTightBoundWorkNs = 700'000;
inline constexpr std::uint32_t kTightMinBoundLaunches = 1;
inline constexpr std::uint64_t kRecentNs = 100'000'000;
// With a tight bound of one launch, the next launch may queue this long before
// the previous one's predicted end (hook/priority_gate.cc: hides the process's
// wake-up gap; the higher tenant may wait behind that much more).
inline constexpr std::uint64_t kTightLeadNs = 150'000;
inline constexpr std::uint32_t kMaxBoundLaunches = 16;

// --- the level's shared in-flight budget (docs/priority.md, "Many tenants") ---
// While bounded, a container's launches on a device take turns with every
// other bounded container of its level there: each launch books the next slot
// of the level's timetable (one word, `booked_until`, in a lease file of the
// level's directory) and goes kLeaseLeadNs (tight) before its slot starts, so
// that the level keeps about one launch queued on the device however many
// containers it has. A launch not measured yet books this much:
inline constexpr std::uint64_t kLeaseUnmeasuredNs = 500'000;
// A booked_until further ahead than this is not believed (a corrupt word, a
// clock of another time namespace): the booking starts now.
inline constexpr std::uint64_t kLeaseMaxAheadNs = 1'000'000'000;
// How long before its slot a booked launch is queued while tight (hides the
// process's wake-up); more (up to half a launch) when it has been waking late.
inline constexpr std::uint64_t kLeaseLeadNs = 80'000;
// The least lag of the device behind the level's timetable that moves the
// timetable (correct_lease): half the lead.
inline constexpr std::uint64_t kLeaseLagFixNs = kLeaseLeadNs / 2;
// A claimed launch holds the level's device token until it has gone to the
// driver, at most this long (a holder stopped between its claim and its
// launch; one killed frees it at once: its presence lock goes).
inline constexpr std::uint64_t kLeaseTokenNs = 2'000'000;
// A claim that finds the token taken looks again this much later at least
// (hook/priority_gate.cc: one launch less the lead when that is longer; the
// holder's launch runs that long anyway).
inline constexpr std::uint64_t kLeaseTokenPollNs = 40'000;
// A bounded launch that cannot book or claim (the lock stays taken, the
// token too) waits, at most this long in all, then goes with the per-process
// bound: never a launch beside the level's budget before then.
inline constexpr std::uint64_t kLeaseGiveUpNs = 20'000'000;

struct Slot {
  std::uint64_t start_ns;  // when the launch should start running
  std::uint64_t until_ns;  // the level's new booked_until
};
// Books a launch of launch_ns (0: not measured) behind `booked_until_ns`.
Slot book_slot(std::uint64_t booked_until_ns, std::uint64_t now_ns, std::uint64_t launch_ns) noexcept;
// A claimed launch that is held after all gives its place back: the level's
// new launched_until, when the one stored is still the claim's
// (claimed_until_ns: nobody claimed behind it); else launched_until_ns as it is.
std::uint64_t unclaim_slot(std::uint64_t launched_until_ns, std::uint64_t claimed_until_ns,
                           std::uint64_t launch_ns) noexcept;
// A booked launch whose slot came, at now_ns, with the level's launched work
// ending at launched_until_ns: it goes (start_ns 0, until_ns the new
// launched_until) when that is at most allow_ns away; otherwise start_ns is
// when that work should be done. An end further ahead than kLeaseMaxAheadNs
// is not believed.
Slot claim_slot(std::uint64_t launched_until_ns, std::uint64_t now_ns, std::uint64_t launch_ns,
                std::uint64_t allow_ns) noexcept;
// A booked launch whose slot came claims its place on the level's record
// (under its lock): it goes (`go`, rec.launched_until extended, `claimed`
// the new word) when claim_slot lets it and the level's device token is free
// (claim_token: it takes it), else `busy_until` says until when the level's
// launched work runs, and `token_taken` that another launch holds the token.
// `holder_alive`: the token's process may still live (lease_user_alive; true
// when it is this process).
struct Claim {
  bool go = false;
  bool token_taken = false;
  std::uint64_t busy_until_ns = 0;
  std::uint64_t claimed_ns = 0;      // the claim's launched_until
  std::uint64_t start_ns = 0;        // when the claimed launch should start running
  std::uint64_t token_until_ns = 0;  // the token's word as the claim wrote it (whose it is)
  std::uint32_t lag_shift_us = 0;    // the record's lag_shift_us at the claim, go or not (correct_lease)
};
Claim claim_lease(shm::PriorityLease& rec, std::uint64_t now_ns, std::uint64_t launch_ns, std::uint64_t allow_ns,
                  std::uint32_t pid, bool holder_alive) noexcept;
// The claim's launch went to the driver at now_ns: the level's launched work
// ends when it does, counted from then (a thread that lost its CPU between
// its claim and its launch ran later than claimed), the token is free, and
// the wake word moves (the caller wakes one waiting booking: the handoff).
// Nothing when the token is not the claim's any more (it expired and another
// launch took it). True when rec changed.
// *end_ns (when given) is when the timetable says this launch ends.
bool launched_lease(shm::PriorityLease& rec, const Claim& c, std::uint64_t now_ns, std::uint64_t launch_ns,
                    std::uint32_t pid, std::uint64_t* end_ns = nullptr) noexcept;
// The timetable is open-loop: it counts each launch as its process's
// estimate (the least of its samples: the shortest kernels, when their run
// times vary), never what the device did. A booked launch that ended lag_ns
// later than the timetable said (seen from its own markers) shows the device
// that far behind it, and every launch queued since as late: the level's
// launched_until and booked_until move by lag_ns and lag_shift_us adds it
// (bookings made before move their slots by as much: lag_moved_ns). Once per
// lag: only when no correction was made since the launch was claimed
// (`shift_at_claim`, Claim::lag_shift_us), and only a lag of kLeaseLagFixNs or
// more (a smaller one is within the lead); not when the device has caught up
// since (launched_until + lag_ns is past). True when rec changed.
bool correct_lease(shm::PriorityLease& rec, std::uint32_t shift_at_claim, std::uint64_t lag_ns,
                   std::uint64_t now_ns) noexcept;
// How far corrections moved the timetable since lag_shift_us read `then`.
constexpr std::uint64_t lag_moved_ns(std::uint32_t now_us, std::uint32_t then_us) noexcept {
  return static_cast<std::uint64_t>(static_cast<std::uint32_t>(now_us - then_us)) * 1000;
}
// A booking whose claim found the timetable moved by corrections since it
// booked (lag_shift_us `then_us` → `now_us`) and the level busy until
// busy_until_ns: when its slot, moved by as much, is still its turn, *start
// moves and true. Only by what corrections can move: a word that went back
// or jumped (read from another level's lease after a change of priority, or
// written by a neighbour), or a slot moved more than kLeaseMaxAheadNs ahead
// of now, is not followed (false: the caller books again; never a long sleep).
bool follow_correction(std::uint64_t* start_ns, std::uint64_t now_ns, std::uint32_t now_us, std::uint32_t then_us,
                       std::uint64_t busy_until_ns) noexcept;
// When a booking woken by the handoff (a launch of its level went: the
// lease's wake word moved) claims: allow_ns before the level's launched work
// should end (the device's pace, not its own slot's), now when that is
// nearer, past or not believed. The claim condition is claim_slot's either way.
std::uint64_t handoff_at(std::uint64_t launched_until_ns, std::uint64_t now_ns, std::uint64_t allow_ns) noexcept;
// A claimed launch held after all: its place (unclaim_slot) and the token back.
bool unclaim_lease(shm::PriorityLease& rec, const Claim& c, std::uint64_t launch_ns, std::uint32_t pid) noexcept;
// Whether the token is taken at now_ns: a holder, not expired (a stopped
// process keeps others waiting kLeaseTokenNs at most; a word further ahead
// is not believed), not known dead.
bool token_taken(const shm::PriorityLease& rec, std::uint64_t now_ns, bool holder_alive) noexcept;

// How long before its slot's start a booked launch may be queued: the lead
// (tight: kLeaseLeadNs, or twice the thread's recent lateness, at most half a
// launch), or while relaxed enough that the level keeps about kBoundWorkNs
// queued.
std::uint64_t lease_allow(std::uint64_t launch_ns, bool tight, std::uint64_t late_ns) noexcept;

// The words are GPUSLICE_PRIORITY's (options.def; options::parse_word
// parses them): "high", "normal", "low", else "unset".
const char* priority_name(gpuslice::Priority p) noexcept;
// A region word as a level: unset and garbage read as `fallback`.
gpuslice::Priority priority_from_word(std::uint32_t word, gpuslice::Priority fallback) noexcept;

// --- writer side ---
// When the work this process has queued is expected to be done: each launch
// at now_ns adds its measured device time (0 before any measurement) behind
// what is already queued.
std::uint64_t extend_horizon(std::uint64_t horizon_ns, std::uint64_t now_ns, std::uint64_t launch_ns) noexcept;
// The active_until to publish after a launch at now_ns with that horizon, or
// 0 when the one already published is recent enough (no write).
std::uint64_t next_publication(std::uint64_t published_until_ns, std::uint64_t horizon_ns, std::uint64_t now_ns,
                               std::uint64_t linger_ns = kLingerNs) noexcept;

// --- reader side ---
struct PeerSample {
  gpuslice::Priority level;       // from the board directory the file is in
  std::uint64_t active_until_ns;  // as read
  std::uint64_t last_launch_ns;   // as read
  // False when the process that wrote active_until_ns is known to be gone
  // (its liveness lock is free, shm/priority_board.h): it holds nobody any
  // more. Only ever narrows "active": a reader that cannot tell keeps true.
  bool writer_alive = true;
};

enum class Verdict : int { free = 0, bounded = 1, held = 2 };

bool peer_active(const PeerSample& p, std::uint64_t now_ns) noexcept;
bool peer_present(const PeerSample& p, std::uint64_t now_ns) noexcept;
// What `self` must do on this device given its neighbours.
Verdict judge(gpuslice::Priority self, const PeerSample* peers, std::size_t count, std::uint64_t now_ns) noexcept;
// Whether a container at `self` must take the launch slow path on a device
// with these neighbours: any neighbour of another level present (a lower one
// must see our activity, a higher one may hold us).
bool engaged(gpuslice::Priority self, const PeerSample* peers, std::size_t count, std::uint64_t now_ns) noexcept;
// When the work that neighbours of lower priority than `self` have queued
// should be done (their active_until less the linger), or 0 when none is
// active: a launch of `self` starting a burst queues behind it.
std::uint64_t lower_backlog(gpuslice::Priority self, const PeerSample* peers, std::size_t count,
                            std::uint64_t now_ns) noexcept;
// Until when `self` is held: the latest active_until of an active neighbour
// of higher priority, 0 when none is active.
std::uint64_t held_until(gpuslice::Priority self, const PeerSample* peers, std::size_t count,
                         std::uint64_t now_ns) noexcept;
// How long a held launch sleeps before its next look at the board: until
// held_until_ns plus spread_ns, within [kHoldMinSleepNs, kHoldMaxSleepNs];
// kHoldPollNs when that is not known (0) or already past (a stale verdict).
std::uint64_t hold_sleep_ns(std::uint64_t held_until_ns, std::uint64_t now_ns, std::uint64_t spread_ns) noexcept;
// Whether a neighbour of higher priority than `self` launched within kRecentNs
// (then the in-flight bound is the tight one).
bool higher_recent(gpuslice::Priority self, const PeerSample* peers, std::size_t count, std::uint64_t now_ns) noexcept;

// --- in-flight bound ---
// Device time per launch of this process, measured between event markers
// (hook/priority_gate.cc). Only ever used by one thread at a time.
struct InflightEstimate {
  std::uint64_t avg_ns = 0;  // 0: nothing measured yet
  // Booked launches (observe_booked): the least sample of the current window
  // of kBookedWindow samples and of the previous one.
  std::uint64_t booked_min_ns = 0, booked_prev_ns = 0;
  std::uint32_t booked_samples = 0;
};
inline constexpr std::uint32_t kBookedWindow = 8;
// One launch took duration_ns of device time (queued behind the previous).
void observe_launch(InflightEstimate& e, std::uint64_t duration_ns) noexcept;
// A booked launch took duration_ns between the markers around it: its own
// device time plus whatever it waited for behind other containers' work
// (the level's previous launch, by design: it is queued lease_allow() early;
// more when that one was late). So the estimate is the least sample of the
// last kBookedWindow to 2 × kBookedWindow: it drops at once and rises within
// two windows when the launches get longer. The first sample counts at most
// kLeaseUnmeasuredNs (a container that has just become bounded waits behind
// whatever its level queued before: not its own device time).
void observe_booked(InflightEstimate& e, std::uint64_t duration_ns) noexcept;
// Launches the process may keep in flight while bounded: the relaxed bound,
// or (`tight`) the one next to a recently active higher neighbour.
std::uint32_t bound_launches(const InflightEstimate& e, bool tight = false) noexcept;

}  // namespace gpuslice::limiter
