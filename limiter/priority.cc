// gpuslice::Priority between tenants: the decisions. See priority.h and docs/priority.md.
#include "limiter/priority.h"

#include "limiter/options/options.h"
#include "shm/priority_lease.h"

namespace gpuslice::limiter {

const char* priority_name(gpuslice::Priority p) noexcept {
  for (const options::Word<gpuslice::Priority>& w : options::words::priority) {
    if (w.value == p) return w.text;
  }
  return "unset";
}

gpuslice::Priority priority_from_word(std::uint32_t word, gpuslice::Priority fallback) noexcept {
  if (word >= static_cast<std::uint32_t>(gpuslice::Priority::low) &&
      word <= static_cast<std::uint32_t>(gpuslice::Priority::high))
    return static_cast<gpuslice::Priority>(word);
  return fallback;
}

std::uint64_t extend_horizon(std::uint64_t horizon_ns, std::uint64_t now_ns, std::uint64_t launch_ns) noexcept {
  return (horizon_ns > now_ns ? horizon_ns : now_ns) + launch_ns;
}

std::uint64_t next_publication(std::uint64_t published_until_ns, std::uint64_t horizon_ns, std::uint64_t now_ns,
                               std::uint64_t linger_ns) noexcept {
  std::uint64_t until = (horizon_ns > now_ns ? horizon_ns : now_ns) + linger_ns;
  if (until > now_ns + kMaxPublishAheadNs) until = now_ns + kMaxPublishAheadNs;
  if (published_until_ns != 0 && until < published_until_ns + kPublishSlackNs) return 0;
  return until;
}

bool peer_active(const PeerSample& p, std::uint64_t now_ns) noexcept {
  // A word far in the future is not believed: no file can hold others for
  // longer than kMaxAheadNs past its writer's last store.
  return p.writer_alive && p.active_until_ns > now_ns && p.active_until_ns - now_ns <= kMaxAheadNs;
}

bool peer_present(const PeerSample& p, std::uint64_t now_ns) noexcept {
  if (peer_active(p, now_ns)) return true;
  if (p.last_launch_ns == 0 || p.last_launch_ns > now_ns + kMaxAheadNs) return false;
  return p.last_launch_ns > now_ns || now_ns - p.last_launch_ns < kPresentNs;
}

Verdict judge(gpuslice::Priority self, const PeerSample* peers, std::size_t count, std::uint64_t now_ns) noexcept {
  Verdict v = Verdict::free;
  for (std::size_t i = 0; i < count; ++i) {
    const PeerSample& p = peers[i];
    if (static_cast<std::uint32_t>(p.level) <= static_cast<std::uint32_t>(self)) continue;
    if (peer_active(p, now_ns)) return Verdict::held;
    if (peer_present(p, now_ns)) v = Verdict::bounded;
  }
  return v;
}

bool engaged(gpuslice::Priority self, const PeerSample* peers, std::size_t count, std::uint64_t now_ns) noexcept {
  for (std::size_t i = 0; i < count; ++i) {
    if (peers[i].level != self && peer_present(peers[i], now_ns)) return true;
  }
  return false;
}

std::uint64_t lower_backlog(gpuslice::Priority self, const PeerSample* peers, std::size_t count,
                            std::uint64_t now_ns) noexcept {
  std::uint64_t until = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const PeerSample& p = peers[i];
    if (static_cast<std::uint32_t>(p.level) >= static_cast<std::uint32_t>(self) || !peer_active(p, now_ns)) continue;
    const std::uint64_t done = p.active_until_ns > kLingerNs ? p.active_until_ns - kLingerNs : 0;
    if (done > now_ns && done > until) until = done;
  }
  return until;
}

std::uint64_t held_until(gpuslice::Priority self, const PeerSample* peers, std::size_t count,
                         std::uint64_t now_ns) noexcept {
  std::uint64_t until = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const PeerSample& p = peers[i];
    if (static_cast<std::uint32_t>(p.level) <= static_cast<std::uint32_t>(self) || !peer_active(p, now_ns)) continue;
    if (p.active_until_ns > until) until = p.active_until_ns;
  }
  return until;
}

std::uint64_t hold_sleep_ns(std::uint64_t held_until_ns, std::uint64_t now_ns, std::uint64_t spread_ns) noexcept {
  // Unknown, or already past while the verdict still holds (a look that
  // found the tables busy kept the previous verdict): look again as before.
  if (held_until_ns <= now_ns) return kHoldPollNs;
  std::uint64_t ns = held_until_ns - now_ns + spread_ns;
  if (ns < kHoldMinSleepNs) ns = kHoldMinSleepNs;
  if (ns > kHoldMaxSleepNs) ns = kHoldMaxSleepNs;
  return ns;
}

bool higher_recent(gpuslice::Priority self, const PeerSample* peers, std::size_t count, std::uint64_t now_ns) noexcept {
  for (std::size_t i = 0; i < count; ++i) {
    const PeerSample& p = peers[i];
    if (static_cast<std::uint32_t>(p.level) <= static_cast<std::uint32_t>(self)) continue;
    if (peer_active(p, now_ns)) return true;
    if (p.last_launch_ns == 0 || p.last_launch_ns > now_ns + kMaxAheadNs) continue;  // not believed
    if (p.last_launch_ns > now_ns || now_ns - p.last_launch_ns < kRecentNs) return true;
  }
  return false;
}

void observe_launch(InflightEstimate& e, std::uint64_t duration_ns) noexcept {
  if (duration_ns == 0) return;
  if (e.avg_ns == 0) {
    e.avg_ns = duration_ns;
    return;
  }
  // One sample counts at most double: a launch that shared the device with
  // another tenant's (time-sliced, or queued in between) must not inflate the
  // estimate, and with it how long a high one holds the others.
  if (duration_ns > 2 * e.avg_ns) duration_ns = 2 * e.avg_ns;
  e.avg_ns = (3 * e.avg_ns + duration_ns) / 4;
}

void observe_booked(InflightEstimate& e, std::uint64_t duration_ns) noexcept {
  if (duration_ns == 0) return;
  if (e.avg_ns == 0 && duration_ns > kLeaseUnmeasuredNs) duration_ns = kLeaseUnmeasuredNs;
  if (e.booked_samples % kBookedWindow == 0) {
    e.booked_prev_ns = e.booked_min_ns;
    e.booked_min_ns = duration_ns;
  } else if (duration_ns < e.booked_min_ns) {
    e.booked_min_ns = duration_ns;
  }
  ++e.booked_samples;
  e.avg_ns = e.booked_prev_ns != 0 && e.booked_prev_ns < e.booked_min_ns ? e.booked_prev_ns : e.booked_min_ns;
}

std::uint32_t bound_launches(const InflightEstimate& e, bool tight) noexcept {
  const std::uint32_t least = tight ? kTightMinBoundLaunches : kMinBoundLaunches;
  if (e.avg_ns == 0) return least;
  const std::uint64_t n = (tight ? kTightBoundWorkNs : kBoundWorkNs) / e.avg_ns;
  if (n < least) return least;
  if (n > kMaxBoundLaunches) return kMaxBoundLaunches;
  return static_cast<std::uint32_t>(n);
}

Slot book_slot(std::uint64_t booked_until_ns, std::uint64_t now_ns, std::uint64_t launch_ns) noexcept {
  const std::uint64_t d = launch_ns != 0 ? launch_ns : kLeaseUnmeasuredNs;
  const bool believed = booked_until_ns > now_ns && booked_until_ns - now_ns <= kLeaseMaxAheadNs;
  const std::uint64_t start = believed ? booked_until_ns : now_ns;
  return Slot{start, start + d};
}

std::uint64_t unclaim_slot(std::uint64_t launched_until_ns, std::uint64_t claimed_until_ns,
                           std::uint64_t launch_ns) noexcept {
  const std::uint64_t d = launch_ns != 0 ? launch_ns : kLeaseUnmeasuredNs;
  if (launched_until_ns != claimed_until_ns || claimed_until_ns < d) return launched_until_ns;
  return claimed_until_ns - d;
}

Slot claim_slot(std::uint64_t launched_until_ns, std::uint64_t now_ns, std::uint64_t launch_ns,
                std::uint64_t allow_ns) noexcept {
  const std::uint64_t d = launch_ns != 0 ? launch_ns : kLeaseUnmeasuredNs;
  const bool believed = launched_until_ns > now_ns && launched_until_ns - now_ns <= kLeaseMaxAheadNs;
  if (!believed) return Slot{0, now_ns + d};
  if (launched_until_ns - now_ns > allow_ns) return Slot{launched_until_ns, 0};
  return Slot{0, launched_until_ns + d};
}

std::uint64_t lease_allow(std::uint64_t launch_ns, bool tight, std::uint64_t late_ns) noexcept {
  const std::uint64_t d = launch_ns != 0 ? launch_ns : kLeaseUnmeasuredNs;
  std::uint64_t lead = 2 * late_ns;
  if (lead > d / 2) lead = d / 2;
  if (lead < kLeaseLeadNs) lead = kLeaseLeadNs;
  if (tight) return lead;
  return d < kBoundWorkNs && kBoundWorkNs - d > lead ? kBoundWorkNs - d : lead;
}

bool token_taken(const shm::PriorityLease& rec, std::uint64_t now_ns, bool holder_alive) noexcept {
  return rec.token_pid != 0 && holder_alive && rec.token_until_ns > now_ns &&
         rec.token_until_ns - now_ns <= kLeaseTokenNs;
}

Claim claim_lease(shm::PriorityLease& rec, std::uint64_t now_ns, std::uint64_t launch_ns, std::uint64_t allow_ns,
                  std::uint32_t pid, bool holder_alive) noexcept {
  Claim c;
  c.lag_shift_us = rec.lag_shift_us;
  if (token_taken(rec, now_ns, holder_alive)) {
    c.token_taken = true;
    c.busy_until_ns = rec.token_until_ns;
    return c;
  }
  const Slot slot = claim_slot(rec.launched_until_ns, now_ns, launch_ns, allow_ns);
  if (slot.start_ns != 0) {
    c.busy_until_ns = slot.start_ns;
    return c;
  }
  const std::uint64_t d = launch_ns != 0 ? launch_ns : kLeaseUnmeasuredNs;
  c.go = true;
  c.claimed_ns = slot.until_ns;
  c.start_ns = slot.until_ns - d;
  rec.launched_until_ns = slot.until_ns;
  rec.token_pid = pid;
  rec.token_until_ns = c.token_until_ns = now_ns + kLeaseTokenNs;
  return c;
}

bool launched_lease(shm::PriorityLease& rec, const Claim& c, std::uint64_t now_ns, std::uint64_t launch_ns,
                    std::uint32_t pid, std::uint64_t* end_ns) noexcept {
  if (!c.go || rec.token_pid != pid || rec.token_until_ns != c.token_until_ns) return false;
  const std::uint64_t d = launch_ns != 0 ? launch_ns : kLeaseUnmeasuredNs;
  const std::uint64_t end = (c.start_ns > now_ns ? c.start_ns : now_ns) + d;
  if (end > rec.launched_until_ns) rec.launched_until_ns = end;
  if (end_ns != nullptr) *end_ns = end;
  rec.token_pid = 0;
  rec.token_until_ns = 0;
  ++rec.wake_seq;
  return true;
}

bool correct_lease(shm::PriorityLease& rec, std::uint32_t shift_at_claim, std::uint64_t lag_ns,
                   std::uint64_t now_ns) noexcept {
  if (rec.lag_shift_us != shift_at_claim || lag_ns < kLeaseLagFixNs || lag_ns > kLeaseMaxAheadNs) return false;
  // Launches queued since ours run lag_ns later than counted: until when the
  // device is busy with them. Past: it has caught up (a gap in the timetable).
  const std::uint64_t busy_until = rec.launched_until_ns + lag_ns;
  if (busy_until <= now_ns || busy_until - now_ns > kLeaseMaxAheadNs) return false;
  const std::uint64_t us = (lag_ns + 999) / 1000;
  rec.launched_until_ns += us * 1000;
  if (rec.booked_until_ns > now_ns && rec.booked_until_ns - now_ns <= kLeaseMaxAheadNs)
    rec.booked_until_ns += us * 1000;
  rec.lag_shift_us += static_cast<std::uint32_t>(us);
  return true;
}

bool follow_correction(std::uint64_t* start_ns, std::uint64_t now_ns, std::uint32_t now_us, std::uint32_t then_us,
                       std::uint64_t busy_until_ns) noexcept {
  const std::uint64_t moved = lag_moved_ns(now_us, then_us);
  if (moved == 0 || moved > kLeaseMaxAheadNs) return false;
  const std::uint64_t start = *start_ns + moved;
  if (start > now_ns + kLeaseMaxAheadNs || busy_until_ns > start) return false;
  *start_ns = start;
  return true;
}

std::uint64_t handoff_at(std::uint64_t launched_until_ns, std::uint64_t now_ns, std::uint64_t allow_ns) noexcept {
  const bool believed = launched_until_ns > now_ns && launched_until_ns - now_ns <= kLeaseMaxAheadNs;
  if (!believed || launched_until_ns - now_ns <= allow_ns) return now_ns;
  return launched_until_ns - allow_ns;
}

bool unclaim_lease(shm::PriorityLease& rec, const Claim& c, std::uint64_t launch_ns, std::uint32_t pid) noexcept {
  if (!c.go) return false;
  const std::uint64_t back = unclaim_slot(rec.launched_until_ns, c.claimed_ns, launch_ns);
  bool changed = back != rec.launched_until_ns;
  rec.launched_until_ns = back;
  if (rec.token_pid == pid && rec.token_until_ns == c.token_until_ns) {
    rec.token_pid = 0;
    rec.token_until_ns = 0;
    changed = true;
  }
  return changed;
}

}  // namespace gpuslice::limiter
