// This process's side of the priority board (docs/priority.md): per device,
// its container's activity file (written with pwrite, at most every
// kPublishSlackNs) and the neighbours' files of the other levels, one table
// per level (read with pread, at most every kRecheckNs per launch path; the
// directories are scanned by the background refresh only, in bounded steps,
// never on the launch path). It reads and writes files and decides from what
// they say (limiter/priority.h); when a launch waits is the gate's
// (priority_gate.cc), which never touches a file itself.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>

#include "gpuslice/priority_board.h"
#include "gpuslice/region.h"
#include "hook/sleep_lock.h"
#include "limiter/priority.h"
#include "platform/uuid.h"
#include "shm/priority_board.h"

namespace gpuslice::hook::board {

inline constexpr int kLevels = 3;  // low, normal, high: one table each
inline constexpr int kMaxPeers = kLevels * shm::kLevelPeers;

struct alignas(64) Device {
  // The latest look at the neighbours (written under peers_lock, read by the
  // gate without it).
  std::atomic<int> verdict{0};  // limiter::Verdict
  std::atomic<std::uint64_t> checked_ns{0};
  std::atomic<int> lower_present{0};         // a lower-priority neighbour is present
  std::atomic<int> tight{0};                 // a higher neighbour launched recently: the tight bound
  std::atomic<std::uint64_t> held_until{0};  // when the active higher neighbours' activity ends (0: none)
  std::atomic<int> lease_shared{0};          // another process of our level uses the lease file (refresh)
  std::atomic<DeviceState*> state{nullptr};  // the container's entry (its SM limit)
  std::atomic<std::uint64_t> published_until{0};
  // This container's own file (own_lock).
  SleepLock own_lock;
  // The neighbours' tables (peers_lock). The background refresh holds it for
  // a scan step (bounded, but up to a few ms in a flooded directory); the
  // launch path only tries it and goes on with the previous verdict when it
  // is busy: it never waits behind a directory.
  SleepLock peers_lock;
  bool named = false;
  char uuid[platform::kUuidTextSize] = {};
  char own_name[shm::kBoardNameMax] = {};
  int own_fd = -1;
  Priority own_level = Priority::unset;
  shm::LevelScan levels[kLevels];  // [level - 1]: the neighbours' files, per level
  pid_t own_pid = 0;               // the process that holds the liveness lock on own_fd
  std::uint64_t held_ns = 0, holds = 0;
  // The level's lease file on this device (lease_lock): the timetable its
  // bounded containers book their launches in (book()).
  SleepLock lease_lock;
  int lease_fd = -1;
  Priority lease_level = Priority::unset;
  pid_t lease_pid = 0;  // the process that opened lease_fd (a fork child opens its own)
  // Its wake word (shm::map_wake_word; the handoff): set with lease_fd, read
  // without the lock by a waiting booking (a mapping replaced meanwhile only
  // ends that bounded wait early or late).
  std::atomic<const std::uint32_t*> lease_wake{nullptr};
  std::uint64_t lease_retry_ns = 0;  // an open that failed is tried again after this
};
Device& device(int ordinal) noexcept;  // ordinal < kMaxDevices

// Once, at the first refresh: the board directory (GPUSLICE_PRIORITY_BOARD),
// GPUSLICE_PRIORITY and this container's key (its region file).
void setup() noexcept;
// GPUSLICE_PRIORITY_HANDOFF as setup() read it: whether a booking waits on
// the wake word (and a launch wakes one), or sleeps to its slot (default).
bool handoff() noexcept;
// Whether setup() ran and the board directory exists.
bool present() noexcept;
// In a fork child: the child takes its own liveness lock at its next
// publication and scans with its own directory descriptors.
void after_fork_in_child() noexcept;

// The container's level: the region's word (the agent or gpuslice-smi may
// change it); the first process records its GPUSLICE_PRIORITY there.
Priority current_level(Region* r) noexcept;

// The background refresh of one device (region entry `entry`): keeps its
// own file alive, takes one bounded scan step of each other level, decides.
// Returns whether the device needs the launch slow path (engaged).
bool refresh(Device& b, Region* r, int entry, Priority self, std::uint64_t now) noexcept;
// The launch path's look: only files already open, never a directory. While
// a scan step runs, the previous verdict stands.
limiter::Verdict recheck(Device& b, Priority self, std::uint64_t now) noexcept;
// When the lower neighbours' queued work should be done (their own
// publications), or 0 (none, or a scan step is running).
std::uint64_t read_lower_backlog(Device& b, Priority self, std::uint64_t now) noexcept;
// Publishes this container's activity: until `horizon` (when its queued work
// should be done) plus the linger, or only its presence when it has an SM
// limit on the device. Writes at most every kPublishSlackNs.
void publish(Device& b, Priority self, std::uint64_t now, std::uint64_t horizon) noexcept;
// Books this process's next launch of launch_ns (0: not measured) in its
// level's timetable on the device (limiter::book_slot): *start is when it
// should start running. False when there is no timetable (the lease file
// cannot be opened, or its lock stays taken): the per-process bound applies.
// *seq: the lease's wake word as the booking left it (wait_turn); *shift_us:
// its lag_shift_us (a later correction moves the slot: limiter::lag_moved_ns).
bool book(Device& b, Priority self, std::uint64_t now, std::uint64_t launch_ns, std::uint64_t* start,
          std::uint32_t* seq, std::uint32_t* shift_us) noexcept;
// A booking waits for its slot, at most ns: true when a launch of its level
// woke it (the handoff); false at the timeout (or after a plain sleep when
// there is no wake word). A word that moved past `seq` before it slept (that
// launch woke another waiter) is read again and waited on.
bool wait_turn(Device& b, std::uint32_t seq, std::uint64_t ns) noexcept;
// When the level's launched work should end (the record's launched_until, read
// without the lock), 0 when unknown.
std::uint64_t launched_until(Device& b) noexcept;
// A booked launch whose slot came (limiter::claim_lease): when the level's
// device token is free and the launches its level has already launched on
// the device should be done by now + allow, it takes the token and claims its
// place behind them (c->go); otherwise c->busy_until_ns says until when they
// run, or (c->token_taken) until when the token lasts at most. False when
// there is no timetable or its lock stayed taken (`tries` of ~10 us).
bool claim(Device& b, std::uint64_t now, std::uint64_t launch_ns, std::uint64_t allow, limiter::Claim* c) noexcept;
// The claimed launch went to the driver (limiter::launched_lease): the
// level's launched work is counted from now, the token is given back. When
// the lock stays taken the token expires by itself (kLeaseTokenNs). Then it
// wakes one booking that waits for its slot (the handoff, when on).
// Returns when the timetable says that launch ends (0: the token was not the
// claim's any more, or the lock stayed taken).
std::uint64_t launched(Device& b, const limiter::Claim& c, std::uint64_t launch_ns) noexcept;
// A booked launch of the claim `shift_at_claim` (Claim::lag_shift_us) ended
// lag_ns later than the timetable said: the timetable moves by as much
// (limiter::correct_lease), unless another correction came first.
void correct(Device& b, std::uint32_t shift_at_claim, std::uint64_t lag_ns) noexcept;
// A claimed launch that is held after all (a higher neighbour became active
// between its look at the board and its claim) gives its place and the token
// back (limiter::unclaim_lease).
void unclaim(Device& b, const limiter::Claim& c, std::uint64_t launch_ns) noexcept;
// A launch was held for held_ns: the file's statistics.
void record_hold(Device& b, std::uint64_t held_ns) noexcept;

}  // namespace gpuslice::hook::board
