// This process's side of the priority board: its container's activity files
// and the neighbours' tables (hook/priority_board.h). The board's file format
// and directory scan are shm/priority_board.h's; the decisions from what the
// files say are limiter/priority.h's.
#include "hook/priority_board.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>

#include "hook/config.h"
#include "hook/log.h"
#include "hook/region.h"
#include "limiter/compute.h"
#include "platform/clock.h"
#include "platform/text.h"
#include "shm/priority_lease.h"

namespace gpuslice::hook::board {
namespace {

using limiter::Verdict;

Device g_devices[kMaxDevices];

std::atomic<bool> g_set_up{false};  // setup() ran: g_board and the names below are set
char g_board[shm::kBoardPathMax];
Priority g_env_level = Priority::normal;
// GPUSLICE_PRIORITY_HANDOFF, read once by setup(): off, no wake word is
// mapped (a launch wakes nobody, a booking sleeps to its slot).
std::atomic<bool> g_handoff{false};
std::uint64_t g_region_dev = 0, g_region_ino = 0;
std::atomic<pid_t> g_exiting{0};  // the process whose exit-time removal ran: it never recreates a file

// The board directory: GPUSLICE_PRIORITY_BOARD from the option table.
void read_board_path() noexcept {
  const Config& cfg = config();
  const char* value = cfg.valid ? cfg.options.priority_board : shm::kDefaultPriorityBoard;
  if (!platform::copy_string(g_board, sizeof g_board, value))
    platform::copy_string(g_board, sizeof g_board, shm::kDefaultPriorityBoard);
}

// own_lock held. Opens this container's file at `self` (moving it if the
// level changed) when it must publish.
void ensure_own_file(Device& p, Priority self, bool publish) noexcept {
  if (p.own_fd >= 0 && p.own_level != self) {
    // Else it would still count at its old level for kPresentNs.
    shm::unlink_activity(g_board, p.own_level, p.own_name, p.own_fd);
    close(p.own_fd);
    p.own_fd = -1;
    p.published_until.store(0, std::memory_order_relaxed);
  }
  if (p.own_fd >= 0 || !publish || !p.named) return;
  if (g_exiting.load(std::memory_order_relaxed) != 0 && g_exiting.load(std::memory_order_relaxed) == getpid()) return;
  shm::Error err;
  p.own_fd = shm::open_own_activity(g_board, self, p.own_name, config().options.container_name, &err);
  if (p.own_fd < 0) {
    GPUSLICE_WARN_CAPPED(2, "%s; this container's priority %s is not published (neighbours do not see it)",
                         err.message + 10 /* without "gpuslice: " */, limiter::priority_name(self));
    return;
  }
  p.own_level = self;
  p.own_pid = getpid();
}

// peers_lock held. With `scan` (the background refresh only, never the launch
// path) takes one bounded step of each other level's scan; then reads the
// neighbours already open and decides.
Verdict evaluate(Device& p, Priority self, std::uint64_t now, bool* engaged, bool scan) noexcept {
  if (scan) {
    for (Priority level : {Priority::high, Priority::normal, Priority::low}) {
      shm::LevelScan& table = p.levels[static_cast<int>(level) - 1];
      // Files of our own level are not neighbours that matter.
      if (level == self)
        shm::close_level(&table);
      else
        shm::scan_level(g_board, level, p.uuid, nullptr, &table);
    }
  }
  limiter::PeerSample samples[kMaxPeers];
  std::size_t n = 0;
  for (const shm::LevelScan& table : p.levels) {
    for (int i = 0; i < table.count; ++i) {
      const shm::PeerFile& peer = table.files[i];
      if (peer.level == self) continue;
      PriorityActivity rec;
      if (!shm::read_activity(peer.fd, &rec)) continue;
      // The level is the directory's, never what the file says about itself.
      limiter::PeerSample& sample = samples[n++];
      sample = limiter::PeerSample{peer.level, rec.active_until_ns, rec.last_launch_ns};
      // Only a word that could hold us is worth a syscall: was its writer killed?
      if (rec.active_until_ns > now && static_cast<std::uint32_t>(sample.level) > static_cast<std::uint32_t>(self))
        sample.writer_alive = shm::writer_alive(peer.fd, rec);
    }
  }
  *engaged = self != Priority::normal || limiter::engaged(self, samples, n, now);
  bool lower = false;
  for (std::size_t i = 0; i < n; ++i)
    lower = lower || (static_cast<std::uint32_t>(samples[i].level) < static_cast<std::uint32_t>(self) &&
                      limiter::peer_present(samples[i], now));
  p.lower_present.store(lower ? 1 : 0, std::memory_order_relaxed);
  p.tight.store(limiter::higher_recent(self, samples, n, now) ? 1 : 0, std::memory_order_relaxed);
  p.held_until.store(limiter::held_until(self, samples, n, now), std::memory_order_relaxed);
  const Verdict v = limiter::judge(self, samples, n, now);
  p.verdict.store(static_cast<int>(v), std::memory_order_relaxed);
  p.checked_ns.store(now, std::memory_order_relaxed);
  return v;
}

// lease_lock held. Opens the level's lease file (again: another level, a fork
// child, a file its last user removed) unless a recent open failed.
void ensure_lease(Device& p, Priority self, std::uint64_t now) noexcept {
  const pid_t pid = getpid();
  if (g_exiting.load(std::memory_order_relaxed) == pid) return;  // its exit-time removal ran
  if (p.lease_fd >= 0 && (p.lease_level != self || p.lease_pid != pid || shm::lease_unlinked(p.lease_fd))) {
    // Another level's timetable, the parent's descriptor (its locks would be
    // the parent's too), or a file its last user removed: a new one.
    if (p.lease_pid == pid && p.lease_level != self) shm::remove_lease(g_board, p.lease_level, p.uuid, p.lease_fd);
    shm::unmap_wake_word(p.lease_wake.exchange(nullptr, std::memory_order_relaxed));
    close(p.lease_fd);
    p.lease_fd = -1;
  }
  if (p.lease_fd < 0 && now >= p.lease_retry_ns) {
    shm::Error err;
    p.lease_fd = shm::open_lease(g_board, self, p.uuid, &err);
    if (p.lease_fd < 0) {
      p.lease_retry_ns = now + limiter::kRescanNs * 10;
      GPUSLICE_WARN_CAPPED(2, "%s; launches of this %s container keep the per-process bound",
                           err.message + 10 /* without "gpuslice: " */, limiter::priority_name(self));
    } else {
      p.lease_level = self;
      p.lease_pid = pid;
      if (g_handoff.load(std::memory_order_relaxed))
        p.lease_wake.store(shm::map_wake_word(p.lease_fd), std::memory_order_relaxed);
    }
  }
}

void refresh_lease(Device& p, Priority self, bool bounded_level, std::uint64_t now) noexcept {
  bool shared = false;
  if (bounded_level && p.named) {
    p.lease_lock.lock();
    ensure_lease(p, self, now);
    shared = p.lease_fd >= 0 && shm::lease_shared(p.lease_fd);
    p.lease_lock.unlock();
  }
  p.lease_shared.store(shared ? 1 : 0, std::memory_order_relaxed);
}

// The device token's read-change-write (claim, launched, unclaim): under the
// lease lock, by the process that opened the lease file, under that file's
// lock (`tries` tries). change(record, our pid) says whether to write the
// record back. True when the record was read and, if asked, written.
template <class Change>
bool update_lease(Device& p, unsigned tries, Change&& change) noexcept {
  p.lease_lock.lock();
  bool ok = false;
  const pid_t self = getpid();
  if (p.lease_fd >= 0 && p.lease_pid == self && shm::lock_lease(p.lease_fd, tries)) {
    shm::PriorityLease rec;
    shm::read_lease(p.lease_fd, &rec);
    ok = !change(rec, static_cast<std::uint32_t>(self)) || shm::write_lease(p.lease_fd, rec);
    shm::unlock_lease(p.lease_fd);
  }
  p.lease_lock.unlock();
  return ok;
}

}  // namespace

Device& device(int ordinal) noexcept { return g_devices[ordinal]; }

bool handoff() noexcept { return g_handoff.load(std::memory_order_relaxed); }

void setup() noexcept {
  read_board_path();
  g_env_level = config().valid ? config().options.priority : Priority::normal;
  g_handoff.store(config().valid && config().options.priority_handoff, std::memory_order_relaxed);
  // The region this process mapped, not what its path names now.
  struct stat st;
  const int region_fd = g_region_fd.load(std::memory_order_acquire);
  if (region_fd >= 0 ? fstat(region_fd, &st) == 0 : stat(config().options.region, &st) == 0) {
    g_region_dev = static_cast<std::uint64_t>(st.st_dev);
    g_region_ino = static_cast<std::uint64_t>(st.st_ino);
  }
  g_set_up.store(true, std::memory_order_release);
}

bool present() noexcept {
  if (!g_set_up.load(std::memory_order_acquire)) return false;
  struct stat st;
  return stat(g_board, &st) == 0 && S_ISDIR(st.st_mode);
}

void after_fork_in_child() noexcept {
  // The neighbours' files stay open; its own is reopened at its next
  // publication, so that it takes its own liveness lock (the parent's lives
  // on the shared open file description, and names the parent's pid).
  for (Device& p : g_devices) {
    if (p.own_fd >= 0) close(p.own_fd);
    p.own_fd = -1;
    p.published_until.store(0, std::memory_order_relaxed);
    p.own_lock.reset();
    p.peers_lock.reset();
    p.lease_lock.reset();  // the lease descriptor is reopened at the next booking (lease_pid)
    // The directory descriptors' positions are shared with the parent: the
    // child scans with its own (at its next refresh).
    for (shm::LevelScan& level : p.levels) shm::close_level(&level);
  }
}

Priority current_level(Region* r) noexcept {
  std::uint32_t word = r->header.priority.load(std::memory_order_relaxed);
  if (word == 0) {
    r->header.priority.compare_exchange_strong(word, static_cast<std::uint32_t>(g_env_level),
                                               std::memory_order_relaxed);
    word = r->header.priority.load(std::memory_order_relaxed);
  }
  return limiter::priority_from_word(word, g_env_level);
}

bool refresh(Device& p, Region* r, int entry, Priority self, std::uint64_t now) noexcept {
  p.own_lock.lock();
  p.state.store(&r->devices[entry], std::memory_order_relaxed);
  if (!p.named) {
    platform::format_uuid(r->devices[entry].uuid, p.uuid);
    p.named = shm::activity_name(p.uuid, g_region_dev, g_region_ino, p.own_name);
  }
  // Readers and the agent remove files nobody holds a liveness lock on; one
  // it removed just as we opened it is recreated (neighbours must see us).
  struct stat own;
  if (p.own_fd >= 0 && fstat(p.own_fd, &own) == 0 && own.st_nlink == 0) {
    close(p.own_fd);
    p.own_fd = -1;
    p.published_until.store(0, std::memory_order_relaxed);
  }
  p.own_lock.unlock();
  bool engaged = false;
  p.peers_lock.lock();
  evaluate(p, self, now, &engaged, true);
  p.peers_lock.unlock();
  // A high or low container publishes always (its neighbours must find it
  // even before it finds them); a normal one only next to another level.
  p.own_lock.lock();
  ensure_own_file(p, self, engaged);
  p.own_lock.unlock();
  // A container below high may be bounded: it counts itself in its level's
  // lease file, and books there when another process does too.
  refresh_lease(p, self, engaged && self != Priority::high, now);
  return engaged;
}

Verdict recheck(Device& p, Priority self, std::uint64_t now) noexcept {
  if (!p.peers_lock.try_lock()) return static_cast<Verdict>(p.verdict.load(std::memory_order_relaxed));
  bool engaged = true;
  const Verdict v = evaluate(p, self, now, &engaged, false);
  p.peers_lock.unlock();
  return v;
}

std::uint64_t read_lower_backlog(Device& p, Priority self, std::uint64_t now) noexcept {
  limiter::PeerSample samples[kMaxPeers];
  std::size_t n = 0;
  if (!p.peers_lock.try_lock()) return 0;  // a scan step is running: no backlog known this burst
  for (const shm::LevelScan& table : p.levels) {
    for (int i = 0; i < table.count; ++i) {
      const shm::PeerFile& peer = table.files[i];
      if (static_cast<std::uint32_t>(peer.level) >= static_cast<std::uint32_t>(self)) continue;
      PriorityActivity rec;
      if (shm::read_activity(peer.fd, &rec))
        samples[n++] = limiter::PeerSample{peer.level, rec.active_until_ns, rec.last_launch_ns};
    }
  }
  p.peers_lock.unlock();
  return limiter::lower_backlog(self, samples, n, now);
}

void publish(Device& p, Priority self, std::uint64_t now, std::uint64_t horizon) noexcept {
  // Limited on this device (a 40% high container gets its 40%): it holds
  // nobody, lower containers get the remainder, bounded next to it.
  const DeviceState* state = p.state.load(std::memory_order_relaxed);
  if (state != nullptr && limiter::is_limited(*state)) {
    const std::uint64_t last = p.published_until.load(std::memory_order_relaxed);  // here: when written
    if (last != 0 && now >= last && now - last < limiter::kPresenceRefreshNs) return;
    p.own_lock.lock();
    ensure_own_file(p, self, true);
    if (p.own_fd >= 0 && shm::write_activity(p.own_fd, self, 0, now))
      p.published_until.store(now, std::memory_order_relaxed);
    p.own_lock.unlock();
    return;
  }
  const std::uint64_t until =
      limiter::next_publication(p.published_until.load(std::memory_order_relaxed), horizon, now);
  if (until == 0) return;
  p.own_lock.lock();
  ensure_own_file(p, self, true);
  if (p.own_fd >= 0 && shm::write_activity(p.own_fd, self, until, now))
    p.published_until.store(until, std::memory_order_relaxed);
  p.own_lock.unlock();
}

bool book(Device& p, Priority self, std::uint64_t now, std::uint64_t launch_ns, std::uint64_t* start,
          std::uint32_t* seq, std::uint32_t* shift_us) noexcept {
  if (!p.named) return false;
  p.lease_lock.lock();
  ensure_lease(p, self, now);
  bool booked = false;
  // Another process books within a few syscalls; one stopped inside a booking
  // is not waited for (about 0.5 ms of tries, then this launch goes unbooked).
  if (p.lease_fd >= 0 && shm::lock_lease(p.lease_fd, 48)) {
    shm::PriorityLease rec;
    shm::read_lease(p.lease_fd, &rec);
    const limiter::Slot slot = limiter::book_slot(rec.booked_until_ns, now, launch_ns);
    rec.booked_until_ns = slot.until_ns;
    ++rec.bookings;
    booked = shm::write_lease(p.lease_fd, rec);
    shm::unlock_lease(p.lease_fd);
    *start = slot.start_ns;
    *seq = rec.wake_seq;
    *shift_us = rec.lag_shift_us;
  }
  p.lease_lock.unlock();
  return booked;
}

bool claim(Device& p, std::uint64_t now, std::uint64_t launch_ns, std::uint64_t allow, limiter::Claim* c) noexcept {
  return update_lease(p, 48, [&](shm::PriorityLease& rec, std::uint32_t self) {
    // The holder's liveness costs a lock query, only while the token looks taken.
    const bool alive = !limiter::token_taken(rec, now, true) || rec.token_pid == self ||
                       shm::lease_user_alive(p.lease_fd, rec.token_pid);
    *c = limiter::claim_lease(rec, now, launch_ns, allow, self, alive);
    return c->go;
  });
}

std::uint64_t launched(Device& p, const limiter::Claim& c, std::uint64_t launch_ns) noexcept {
  bool moved = false;
  std::uint64_t end = 0;
  update_lease(p, 16, [&](shm::PriorityLease& rec, std::uint32_t self) {
    moved = limiter::launched_lease(rec, c, platform::monotonic_ns(), launch_ns, self, &end);
    return moved;
  });
  // After the lock: the woken booking reads the record at once.
  if (moved) shm::wake_one(p.lease_wake.load(std::memory_order_relaxed));
  return moved ? end : 0;
}

void correct(Device& p, std::uint32_t shift_at_claim, std::uint64_t lag_ns) noexcept {
  update_lease(p, 16, [&](shm::PriorityLease& rec, std::uint32_t) {
    return limiter::correct_lease(rec, shift_at_claim, lag_ns, platform::monotonic_ns());
  });
}

bool wait_turn(Device& p, std::uint32_t seq, std::uint64_t ns) noexcept {
  // Only a wake hands the turn on (one per launch): a word that moved before
  // this thread slept (its wake went to another waiter) is read again and
  // waited on, a few times at most, then the rest is slept.
  const std::uint64_t until = platform::monotonic_ns() + ns;
  for (int tries = 0; tries < 4; ++tries) {
    const shm::Wake w = shm::wait_wake(p.lease_wake.load(std::memory_order_relaxed), seq, ns);
    if (w == shm::Wake::woken) return true;
    if (w != shm::Wake::moved) {
      if (w == shm::Wake::unavailable) platform::sleep_ns(ns);
      return false;
    }
    const std::uint64_t now = platform::monotonic_ns();
    if (now >= until) return false;
    ns = until - now;
    p.lease_lock.lock();
    shm::PriorityLease rec;
    rec.wake_seq = seq + 1;
    if (p.lease_fd >= 0) shm::read_lease(p.lease_fd, &rec);
    p.lease_lock.unlock();
    seq = rec.wake_seq;
  }
  platform::sleep_ns(ns);
  return false;
}

std::uint64_t launched_until(Device& p) noexcept {
  // The descriptor is read under lease_lock (another thread may replace it);
  // a pread, no file lock: a torn record reads as nothing launched.
  p.lease_lock.lock();
  shm::PriorityLease rec;
  rec.launched_until_ns = 0;
  if (p.lease_fd >= 0) shm::read_lease(p.lease_fd, &rec);
  p.lease_lock.unlock();
  return rec.launched_until_ns;
}

void unclaim(Device& p, const limiter::Claim& c, std::uint64_t launch_ns) noexcept {
  update_lease(p, 48, [&](shm::PriorityLease& rec, std::uint32_t self) {
    return limiter::unclaim_lease(rec, c, launch_ns, self);
  });
}

void record_hold(Device& p, std::uint64_t held_ns) noexcept {
  p.own_lock.lock();
  p.held_ns += held_ns;
  ++p.holds;
  if (p.own_fd >= 0) shm::write_held(p.own_fd, p.held_ns, p.holds);
  p.own_lock.unlock();
}

// At exit (and dlclose) this process's activity files go, unless another
// process of its container still holds them: files no longer accumulate one
// per container and device. A process killed without running destructors
// leaves its file to the readers and the agent (nobody holds its liveness
// lock any more). Takes no lock that could wait: a device whose own lock is
// held by a thread stuck in a launch keeps its file.
[[gnu::destructor]] void remove_own_files_at_exit() noexcept {
  if (!g_set_up.load(std::memory_order_acquire)) return;
  const pid_t self = getpid();
  g_exiting.store(self, std::memory_order_relaxed);
  for (Device& p : g_devices) {
    if (!p.own_lock.try_lock()) continue;
    if (p.own_fd >= 0 && p.own_pid == self) {  // never a vfork child's or a parent's file
      shm::remove_own_activity(g_board, p.own_level, p.own_name, p.own_fd);
      close(p.own_fd);
      p.own_fd = -1;
    }
    p.own_lock.unlock();
    if (!p.lease_lock.try_lock()) continue;
    if (p.lease_fd >= 0 && p.lease_pid == self) {
      shm::remove_lease(g_board, p.lease_level, p.uuid, p.lease_fd);
      shm::unmap_wake_word(p.lease_wake.exchange(nullptr, std::memory_order_relaxed));
      close(p.lease_fd);
      p.lease_fd = -1;
    }
    p.lease_lock.unlock();
  }
}

}  // namespace gpuslice::hook::board
