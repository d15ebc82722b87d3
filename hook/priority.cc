// Priority between tenants on the launch path. See hook/priority.h,
// limiter/priority.h (the decisions) and docs/priority.md (the design).
//
// Per device this process keeps: its container's activity file on the board
// (written with pwrite, at most every kPublishSlackNs), the neighbours' files
// of the other levels, one table per level (read with pread, at most every
// kRecheckNs per launch path; the directories are scanned by the background
// refresh only, in bounded steps, never on the launch path) and, while a
// higher-priority neighbour is present, a ring of event markers recorded in
// front of its launches that bounds how much of its work is queued on the
// device.
#include "hook/priority.h"

#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "gpuslice/priority_board.h"
#include "hook/log.h"
#include "hook/real.h"
#include "hook/runtime.h"
#include "limiter/compute.h"
#include "limiter/priority.h"
#include "platform/clock.h"
#include "platform/once.h"
#include "platform/text.h"
#include "platform/uuid.h"
#include "shm/priority_board.h"

namespace gpuslice::hook {
namespace {

using limiter::Verdict;

constexpr int kLevels = 3;  // low, normal, high: one table each
constexpr int kMaxPeers = kLevels * shm::kLevelPeers;
constexpr unsigned kRing = 32;  // > kMaxBoundLaunches
constexpr std::uint64_t kLockPollNs = 20'000;
// How late a thread blocked on an event usually wakes after it completes
// (Linux's default timer slack, 50 us).
constexpr std::uint64_t kWakeNs = 50'000;
static_assert(kRing > limiter::kMaxBoundLaunches);

// A marker is recorded in front of each launch. `sample`: it was recorded
// right after the previous launch on the same stream, and that launch was
// queued behind earlier work: the time between the two markers is then that
// launch's device time.
struct Marker {
  CUevent event;
  CUstream stream;
  bool sample;
};
// "Right after": the marker of the next launch comes within this of the previous launch.
constexpr std::uint64_t kAdjacentNs = 100'000;

struct alignas(64) PrioDevice {
  std::atomic<int> engaged{0};
  std::atomic<int> verdict{0};  // limiter::Verdict
  std::atomic<std::uint64_t> checked_ns{0};
  std::atomic<std::uint64_t> published_until{0};
  std::atomic<std::uint64_t> horizon{0};     // when our queued work should be done (ring_lock writes)
  std::atomic<int> lower_present{0};         // a lower-priority neighbour is present
  std::atomic<int> tight{0};                 // a higher neighbour launched recently: the tight bound
  std::atomic<DeviceState*> state{nullptr};  // the container's entry (its SM limit)
  // This container's own file (board_lock).
  std::atomic<std::uint32_t> board_lock{0};
  // The neighbours' tables (peers_lock). The background refresh holds it for
  // a scan step (bounded, but up to a few ms in a flooded directory); the
  // launch path only tries it and goes on with the previous verdict when it
  // is busy: it never waits behind a directory.
  std::atomic<std::uint32_t> peers_lock{0};
  bool named = false;
  char uuid[shm::kUuidTextSize] = {};
  char own_name[shm::kBoardNameMax] = {};
  int own_fd = -1;
  Priority own_level = Priority::unset;
  shm::LevelScan levels[kLevels];  // [level - 1]: the neighbours' files, per level
  pid_t own_pid = 0;                // the process that holds the liveness lock on own_fd
  std::uint64_t held_ns = 0, holds = 0;
  // Markers (ring_lock).
  std::atomic<std::uint32_t> ring_lock{0};
  unsigned head = 0, tail = 0;
  Marker ring[kRing] = {};
  limiter::InflightEstimate estimate;
  std::uint64_t last_launch_ns = 0;
  CUstream last_stream = nullptr;
  bool last_queued = false;  // the previous launch was queued behind earlier work
  std::uint64_t backlog = 0;  // when the lower neighbours' work queued ahead of this burst should be done
  std::uint64_t prev_start_ns = 0;  // when our latest launch started (or will), 0 = unknown
  std::uint64_t late_ns = 0;        // moving average of how late we launched after the previous one's end
  bool prev_start_seen = false;     // prev_start_ns was observed (nothing of ours queued), not predicted
};
PrioDevice g_prio[kMaxDevices];

std::atomic<std::uint32_t> g_level{static_cast<std::uint32_t>(Priority::normal)};
shm::OnceFlag g_setup;  // the board directory and this process's names
char g_board[shm::kBoardPathMax];
Priority g_env_level = Priority::normal;
std::uint64_t g_region_dev = 0, g_region_ino = 0;
std::atomic<pid_t> g_exiting{0};  // the process whose exit-time removal ran: it never recreates a file

struct EventApi {
  decltype(&::cuEventCreate) create = nullptr;
  decltype(&::cuEventRecord) record = nullptr;
  decltype(&::cuEventQuery) query = nullptr;
  decltype(&::cuEventSynchronize) synchronize = nullptr;
  decltype(&::cuEventDestroy_v2) destroy = nullptr;
  decltype(&::cuEventElapsedTime) elapsed = nullptr;
  decltype(&::cuStreamIsCapturing) is_capturing = nullptr;
  bool usable() const { return create && record && query && synchronize && destroy; }
} g_events;

using shm::sleep_ns;
std::uint64_t mono_ns() noexcept { return shm::monotonic_ns(); }

// Short critical sections only; a waiter sleeps, never spins.
void lock(std::atomic<std::uint32_t>& l) noexcept {
  for (;;) {
    std::uint32_t expected = 0;
    if (l.compare_exchange_strong(expected, 1, std::memory_order_acquire)) return;
    sleep_ns(kLockPollNs);
  }
}
void unlock(std::atomic<std::uint32_t>& l) noexcept { l.store(0, std::memory_order_release); }
bool try_lock(std::atomic<std::uint32_t>& l) noexcept {
  std::uint32_t expected = 0;
  return l.compare_exchange_strong(expected, 1, std::memory_order_acquire);
}

Priority level_of_option(int index) noexcept {
  switch (index) {
    case limiter::kPriorityHigh: return Priority::high;
    case limiter::kPriorityLow: return Priority::low;
    default: return Priority::normal;
  }
}

// The board directory: GPUSLICE_PRIORITY_BOARD from the option table.
void read_board_path() noexcept {
  const Config& cfg = config();
  const char* value = cfg.valid ? cfg.options.priority_board : shm::kDefaultPriorityBoard;
  if (!shm::copy_string(g_board, sizeof g_board, value))
    shm::copy_string(g_board, sizeof g_board, shm::kDefaultPriorityBoard);
}

template <class T>
void resolve(T* out, const char* name) noexcept {
  *out = reinterpret_cast<T>(real_dlsym(driver_handle(), name));
}

void after_fork_in_child() noexcept {
  // CUDA does not survive fork(): the child's markers are gone. The
  // neighbours' files stay open; its own is reopened at its next publication,
  // so that it takes its own liveness lock (the parent's lives on the shared
  // open file description, and names the parent's pid).
  for (PrioDevice& p : g_prio) {
    if (p.own_fd >= 0) close(p.own_fd);
    p.own_fd = -1;
    p.published_until.store(0, std::memory_order_relaxed);
    p.ring_lock.store(0, std::memory_order_relaxed);
    p.board_lock.store(0, std::memory_order_relaxed);
    p.peers_lock.store(0, std::memory_order_relaxed);
    // The directory descriptors' positions are shared with the parent: the
    // child scans with its own (at its next refresh).
    for (shm::LevelScan& level : p.levels) shm::close_level(&level);
    p.head = p.tail = 0;
    for (Marker& m : p.ring) m = Marker{};
    p.estimate = limiter::InflightEstimate{};
    p.last_launch_ns = 0;
    p.last_stream = nullptr;
    p.last_queued = false;
    p.backlog = 0;
    p.prev_start_ns = 0;
    p.late_ns = 0;
    p.horizon.store(0, std::memory_order_relaxed);
  }
}

void setup_once() noexcept {
  read_board_path();
  g_env_level = config().valid ? level_of_option(config().options.priority) : Priority::normal;
  struct stat st;
  if (stat(config().options.region, &st) == 0) {
    g_region_dev = static_cast<std::uint64_t>(st.st_dev);
    g_region_ino = static_cast<std::uint64_t>(st.st_ino);
  }
  resolve(&g_events.create, "cuEventCreate");
  resolve(&g_events.record, "cuEventRecord");
  resolve(&g_events.query, "cuEventQuery");
  resolve(&g_events.synchronize, "cuEventSynchronize");
  resolve(&g_events.destroy, "cuEventDestroy_v2");
  resolve(&g_events.elapsed, "cuEventElapsedTime");
  resolve(&g_events.is_capturing, "cuStreamIsCapturing");
  pthread_atfork(nullptr, nullptr, after_fork_in_child);
}

// The container's level: the region's word (the agent or gpuslice-smi may
// change it); the first process records its GPUSLICE_PRIORITY there.
Priority current_level(Region* r) noexcept {
  std::uint32_t word = r->header.priority.load(std::memory_order_relaxed);
  if (word == 0) {
    r->header.priority.compare_exchange_strong(word, static_cast<std::uint32_t>(g_env_level),
                                               std::memory_order_relaxed);
    word = r->header.priority.load(std::memory_order_relaxed);
  }
  return limiter::priority_from_word(word, g_env_level);
}

void unlink_own(PrioDevice& p) noexcept {
  char path[shm::kBoardPathMax];
  shm::Text t(path, sizeof path);
  t.str(g_board).ch('/').str(shm::level_directory(p.own_level)).ch('/').str(p.own_name);
  if (!t.truncated()) unlink(path);
}

// board_lock held. Opens this container's file at `self` (moving it if the
// level changed) when it must publish.
void ensure_own_file(PrioDevice& p, Priority self, bool publish) noexcept {
  if (p.own_fd >= 0 && p.own_level != self) {
    close(p.own_fd);
    p.own_fd = -1;
    unlink_own(p);  // else it would still count at its old level for kPresentNs
    p.published_until.store(0, std::memory_order_relaxed);
  }
  if (p.own_fd >= 0 || !publish || !p.named ) return;
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
Verdict evaluate(PrioDevice& p, Priority self, std::uint64_t now, bool* engaged, bool scan) noexcept {
  if (scan) {
    for (Priority level : {Priority::high, Priority::normal, Priority::low}) {
      shm::LevelScan& table = p.levels[static_cast<int>(level) - 1];
      // Files of our own level are not neighbours that matter.
      if (level == self) shm::close_level(&table);
      else shm::scan_level(g_board, level, p.uuid, nullptr, &table);
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
  const Verdict v = limiter::judge(self, samples, n, now);
  p.verdict.store(static_cast<int>(v), std::memory_order_relaxed);
  p.checked_ns.store(now, std::memory_order_relaxed);
  return v;
}

// The launch path's look at the board: only files already open, never a
// directory. While the background refresh is scanning (peers_lock busy), the
// previous verdict stands (a held launch looks again 250 us later).
Verdict recheck(PrioDevice& p, Priority self, std::uint64_t now) noexcept {
  if (!try_lock(p.peers_lock)) return static_cast<Verdict>(p.verdict.load(std::memory_order_relaxed));
  bool engaged = true;
  const Verdict v = evaluate(p, self, now, &engaged, false);
  unlock(p.peers_lock);
  return v;
}

void publish(PrioDevice& p, Priority self, std::uint64_t now) noexcept {
  // Limited on this device (a 40% high container gets its 40%): it holds
  // nobody, lower containers get the remainder, bounded next to it.
  const DeviceState* state = p.state.load(std::memory_order_relaxed);
  if (state != nullptr && limiter::is_limited(*state)) {
    const std::uint64_t last = p.published_until.load(std::memory_order_relaxed);  // here: when written
    if (last != 0 && now >= last && now - last < limiter::kPresenceRefreshNs) return;
    lock(p.board_lock);
    ensure_own_file(p, self, true);
    if (p.own_fd >= 0 && shm::write_activity(p.own_fd, self, 0, now)) p.published_until.store(now, std::memory_order_relaxed);
    unlock(p.board_lock);
    return;
  }
  const std::uint64_t until = limiter::next_publication(p.published_until.load(std::memory_order_relaxed),
                                                        p.horizon.load(std::memory_order_relaxed), now);
  if (until == 0) return;
  lock(p.board_lock);
  ensure_own_file(p, self, true);
  if (p.own_fd >= 0 && shm::write_activity(p.own_fd, self, until, now))
    p.published_until.store(until, std::memory_order_relaxed);
  unlock(p.board_lock);
}

CUstream target_stream(CUstream s, bool ptsz) noexcept { return ptsz && s == nullptr ? CU_STREAM_PER_THREAD : s; }

bool capturing(CUstream s) noexcept {
  if (g_events.is_capturing == nullptr) return false;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return g_events.is_capturing(s, &status) == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
}

// ring_lock held. Retires the head marker (waiting for it when `wait`);
// learns the device time of the launch in front of it when it can.
bool retire_head(PrioDevice& p, bool wait) noexcept {
  Marker& m = p.ring[p.head % kRing];
  CUresult rc = g_events.query(m.event);
  if (rc == CUDA_ERROR_NOT_READY) {
    if (!wait) return false;
    rc = g_events.synchronize(m.event);
  }
  if (rc != CUDA_SUCCESS) {  // its context is gone: so is the work behind it
    if (m.event != nullptr) g_events.destroy(m.event);
    m.event = nullptr;
  } else if (m.sample && g_events.elapsed != nullptr) {
    // The marker before it is complete too (same stream, recorded earlier),
    // and still alive: the ring never reuses the slot behind the head.
    const Marker& prev = p.ring[(p.head + kRing - 1) % kRing];
    float ms = 0;
    if (prev.event != nullptr && g_events.elapsed(&ms, prev.event, m.event) == CUDA_SUCCESS && ms > 0)
      limiter::observe_launch(p.estimate, static_cast<std::uint64_t>(static_cast<double>(ms) * 1e6));
  }
  ++p.head;
  return true;
}

// Records a marker in front of this launch (it completes when everything
// queued before on the stream has run) and learns launch costs from completed
// markers. False when no marker could be recorded.
bool record_marker(PrioDevice& p, CUstream s, bool ptsz) noexcept {
  if (!g_events.usable()) return false;
  const CUstream stream = target_stream(s, ptsz);
  lock(p.ring_lock);
  if (capturing(stream)) {  // the launch does not run; a record would become a graph node
    unlock(p.ring_lock);
    return false;
  }
  while (p.head != p.tail && retire_head(p, false)) {
  }
  const std::uint64_t now = mono_ns();
  if (p.tail - p.head < kRing - 1) {
    Marker& m = p.ring[p.tail % kRing];
    if (m.event == nullptr && g_events.create(&m.event, CU_EVENT_BLOCKING_SYNC) != CUDA_SUCCESS) m.event = nullptr;
    if (m.event != nullptr && g_events.record(m.event, stream) == CUDA_SUCCESS) {
      m.stream = stream;
      m.sample = p.last_queued && p.last_stream == stream && p.last_launch_ns != 0 &&
                 now - p.last_launch_ns < kAdjacentNs;
      ++p.tail;
      // Pending right after its record: this launch will queue behind earlier work.
      p.last_queued = g_events.query(m.event) == CUDA_ERROR_NOT_READY;
    } else if (m.event != nullptr) {
      // E.g. an event of another context than the stream's: the next marker
      // is created in the context current then.
      g_events.destroy(m.event);
      m.event = nullptr;
      p.last_queued = false;
    }
  }
  p.last_stream = stream;
  unlock(p.ring_lock);
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
bool bound_wait(PrioDevice& p, bool tight) noexcept {
  if (!g_events.usable()) return false;
  lock(p.ring_lock);
  const unsigned limit = limiter::bound_launches(p.estimate, tight);
  bool waited = false;
  const unsigned keep = limit == 1 && p.estimate.avg_ns > limiter::kTightLeadNs ? 1 : limit - 1;
  while (p.tail - p.head > keep) {
    waited = true;
    retire_head(p, true);
  }
  if (p.tail - p.head > limit - 1 && !retire_head(p, false)) {  // the previous launch is still queued or running
    const std::uint64_t now = mono_ns();
    const std::uint64_t end = p.prev_start_ns != 0 ? p.prev_start_ns + p.estimate.avg_ns : 0;
    // The lead: at least kTightLeadNs, more when this thread has been waking
    // late (a host short of CPU): twice its usual lateness.
    // At most half a launch: the higher tenant waits behind 1.5 launches at worst.
    std::uint64_t lead = 2 * p.late_ns > limiter::kTightLeadNs ? 2 * p.late_ns : limiter::kTightLeadNs;
    if (lead > p.estimate.avg_ns / 2) lead = p.estimate.avg_ns / 2;
    if (end == 0 || end > now + limiter::kMaxPublishAheadNs) {
      retire_head(p, true);  // start unknown: wait for its end
    } else if (end > now + lead) {
      sleep_ns(end - lead - now);
    }
    waited = true;
  }
  unlock(p.ring_lock);
  return waited;
}

// When the lower neighbours' queued work should be done (their own
// publications), read now: a burst that starts queues behind it.
std::uint64_t read_lower_backlog(PrioDevice& p, Priority self, std::uint64_t now) noexcept {
  limiter::PeerSample samples[kMaxPeers];
  std::size_t n = 0;
  if (!try_lock(p.peers_lock)) return 0;  // a scan step is running: no backlog known this burst
  for (const shm::LevelScan& table : p.levels) {
    for (int i = 0; i < table.count; ++i) {
      const shm::PeerFile& peer = table.files[i];
      if (static_cast<std::uint32_t>(peer.level) >= static_cast<std::uint32_t>(self)) continue;
      PriorityActivity rec;
      if (shm::read_activity(peer.fd, &rec))
        samples[n++] = limiter::PeerSample{peer.level, rec.active_until_ns, rec.last_launch_ns};
    }
  }
  unlock(p.peers_lock);
  return limiter::lower_backlog(self, samples, n, now);
}

// This launch goes now: extends the horizon (when our queued work should be
// done) by its expected device time. A launch that starts a burst (nothing of
// ours queued) queues behind what lower neighbours have queued.
void note_launch(PrioDevice& p, Priority self, bool marked) noexcept {
  std::uint64_t now = mono_ns();
  std::uint64_t backlog = 0;
  if (p.lower_present.load(std::memory_order_relaxed) != 0 && p.horizon.load(std::memory_order_relaxed) <= now)
    backlog = read_lower_backlog(p, self, now);
  lock(p.ring_lock);
  now = mono_ns();
  if (backlog != 0) p.backlog = backlog;
  std::uint64_t horizon = p.horizon.load(std::memory_order_relaxed);
  if (backlog > horizon) horizon = backlog;
  backlog = p.backlog;  // the burst's, read at its first launch
  horizon = limiter::extend_horizon(horizon, now, p.estimate.avg_ns);
  // The estimate must not drift ahead of the queue: with k markers pending,
  // at most k + 1 of our launches (this one included) are unfinished, queued
  // behind the lower neighbours' backlog at most.
  if (marked) {
    const std::uint64_t most =
        (backlog > now ? backlog : now) + static_cast<std::uint64_t>(p.tail - p.head + 1) * p.estimate.avg_ns;
    if (horizon > most) horizon = most;
  }
  p.horizon.store(horizon, std::memory_order_relaxed);
  // When this launch starts running: now if nothing of ours is queued, at
  // the predicted end of the one queued (bound_wait's lead), else unknown.
  while (p.head != p.tail && retire_head(p, false)) {
  }
  const unsigned pending = p.tail - p.head;
  // Queued behind earlier work of ours now, as it goes (not when its marker
  // was recorded: bound_wait may have slept since): only then does the next
  // marker bracket this launch's device time alone.
  if (marked) p.last_queued = pending != 0;
  std::uint64_t start = 0;
  if (marked && pending == 0) {
    // The previous launch is done: it took at most now - its start. An
    // estimate above that (a sample that shared the device under time
    // slicing) would make bound_wait sleep past its end, with no sample to
    // correct it (a launch behind nothing is not measured): clamp it there
    // when that start was seen (it went behind nothing), move it a quarter of
    // the way when it was only predicted (a prediction may be late).
    if (p.prev_start_ns != 0 && now - p.prev_start_ns < p.estimate.avg_ns) {
      if (p.prev_start_seen) p.estimate.avg_ns = now - p.prev_start_ns;
      else limiter::observe_launch(p.estimate, now - p.prev_start_ns);
    }
    // How late this thread came (the device idled for us meanwhile): the
    // lead hides this much, up to a whole launch (two in flight).
    if (p.prev_start_ns != 0) {
      const std::uint64_t end = p.prev_start_ns + p.estimate.avg_ns;
      std::uint64_t late = now > end ? now - end : 0;
      if (late > p.estimate.avg_ns) late = p.estimate.avg_ns;
      p.late_ns = (3 * p.late_ns + late) / 4;
    }
    start = now;
  } else if (marked && pending == 1 && p.prev_start_ns != 0) {
    // Behind the previous one: from its predicted end, unless that is long
    // past (it was delayed: then we cannot tell).
    const std::uint64_t end = p.prev_start_ns + p.estimate.avg_ns;
    if (end + limiter::kTightLeadNs >= now) start = end > now ? end : now;
    p.late_ns = 3 * p.late_ns / 4;  // on time
  }
  p.prev_start_ns = start;
  p.prev_start_seen = marked && pending == 0;
  p.last_launch_ns = now;
  unlock(p.ring_lock);
}

// Sleeps in kHoldPollNs steps while a higher neighbour is active; accounts
// the time. Returns the verdict that let it go.
Verdict hold(PrioDevice& p, Priority self, std::uint64_t now) noexcept {
  Region* r = g_process.region;
  const std::uint64_t began = now;
  Verdict v = Verdict::held;
  while (v == Verdict::held) {
    r->header.priority_held_until_ns.store(now + 2 * limiter::kHoldPollNs, std::memory_order_relaxed);
    sleep_ns(limiter::kHoldPollNs);
    now = mono_ns();
    v = recheck(p, self, now);
  }
  const std::uint64_t held = now - began;
  r->header.priority_held_ns.fetch_add(held, std::memory_order_relaxed);
  lock(p.ring_lock);
  p.prev_start_ns = 0;  // our queue drained while held: the next launch's lateness means nothing
  unlock(p.ring_lock);
  lock(p.board_lock);
  p.held_ns += held;
  ++p.holds;
  if (p.own_fd >= 0) shm::write_held(p.own_fd, p.held_ns, p.holds);
  unlock(p.board_lock);
  return v;
}

[[gnu::noinline, gnu::cold]] void admit_slow(PrioDevice& p, CUstream s, bool ptsz) noexcept {
  // The level may have been changed at run time (gpuslice-smi set --priority).
  const Priority self = current_level(g_process.region);
  g_level.store(static_cast<std::uint32_t>(self), std::memory_order_relaxed);
  std::uint64_t now = mono_ns();
  Verdict v = static_cast<Verdict>(p.verdict.load(std::memory_order_relaxed));
  // A high container only needs the board to know whether a lower one is
  // present (then its markers measure what it queues): every rescan period.
  const std::uint64_t every = self == Priority::high ? limiter::kRescanNs : limiter::kRecheckNs;
  if (now - p.checked_ns.load(std::memory_order_relaxed) >= every) v = recheck(p, self, now);
  if (self == Priority::high) v = Verdict::free;
  if (v == Verdict::held) v = hold(p, self, now);
  // Markers while somebody cares: a higher neighbour (our queue must stay
  // short) or a lower one (our activity must cover our queued work).
  if (v != Verdict::free || p.lower_present.load(std::memory_order_relaxed) != 0) {
    const bool marked = record_marker(p, s, ptsz);
    // A bound wait lasts up to one of our launches: a higher neighbour may
    // have become active meanwhile, and this launch must not slip in front of
    // its burst. Look again after a wait (the held loop drains our queue).
    // Next to a serving higher tenant (tight) look every time, not every
    // kRecheckNs: a launch that needed no wait would otherwise go on a
    // verdict up to 0.2 ms old, possibly into its burst.
    const bool tight = p.tight.load(std::memory_order_relaxed) != 0;
    if (marked && v != Verdict::free && (bound_wait(p, tight) || tight)) {
      now = mono_ns();
      if (recheck(p, self, now) == Verdict::held) hold(p, self, now);
    }
    note_launch(p, self, marked);
  }
  publish(p, self, mono_ns());
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
  const Priority self = current_level(r);
  g_level.store(static_cast<std::uint32_t>(self), std::memory_order_relaxed);
  const std::uint64_t now = mono_ns();
  bool any = false;
  for (std::uint32_t entry = 0; entry < kMaxDevices; ++entry) {
    const int ordinal = ordinal_of_entry(static_cast<int>(entry));
    if (ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices) continue;
    PrioDevice& p = g_prio[ordinal];
    lock(p.board_lock);
    p.state.store(&r->devices[entry], std::memory_order_relaxed);
    if (!p.named) {
      shm::format_uuid(r->devices[entry].uuid, p.uuid);
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
    unlock(p.board_lock);
    bool engaged = false;
    lock(p.peers_lock);
    evaluate(p, self, now, &engaged, true);
    unlock(p.peers_lock);
    // A high or low container publishes always (its neighbours must find it
    // even before it finds them); a normal one only next to another level.
    lock(p.board_lock);
    ensure_own_file(p, self, engaged);
    unlock(p.board_lock);
    p.engaged.store(engaged ? 1 : 0, std::memory_order_relaxed);
    any = any || engaged;
  }
  return any;
}

bool priority_board_present() noexcept {
  if (!g_setup.done()) return false;
  struct stat st;
  return stat(g_board, &st) == 0 && S_ISDIR(st.st_mode);
}

void priority_admit(int ordinal, CUstream stream, bool ptsz) noexcept {
  if (static_cast<unsigned>(ordinal) >= kMaxDevices) return;
  PrioDevice& p = g_prio[ordinal];
  if (p.engaged.load(std::memory_order_relaxed) == 0) return;
  admit_slow(p, stream, ptsz);
}

// At exit (and dlclose) this process's activity files go, unless another
// process of its container still holds them: files no longer accumulate one
// per container and device. A process killed without running destructors
// leaves its file to the readers and the agent (nobody holds its liveness
// lock any more). Takes no lock that could wait: a device whose board lock is
// held by a thread stuck in a launch keeps its file.
[[gnu::destructor]] void priority_at_exit() noexcept {
  if (!g_setup.done()) return;
  const pid_t self = getpid();
  g_exiting.store(self, std::memory_order_relaxed);
  for (PrioDevice& p : g_prio) {
    std::uint32_t expected = 0;
    if (!p.board_lock.compare_exchange_strong(expected, 1, std::memory_order_acquire)) continue;
    if (p.own_fd >= 0 && p.own_pid == self) {  // never a vfork child's or a parent's file
      shm::remove_own_activity(g_board, p.own_level, p.own_name, p.own_fd);
      close(p.own_fd);
      p.own_fd = -1;
    }
    unlock(p.board_lock);
  }
}

}  // namespace gpuslice::hook
