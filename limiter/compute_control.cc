// Feedback controller: true-up, price scale, elastic grant, owner election.
// See compute_control.h and docs/limiter.md.
#include "limiter/compute_control.h"

#include <algorithm>

#include "limiter/compute.h"
#include "limiter/compute_queue.h"

namespace gpuslice::limiter {
namespace {

std::uint32_t permille_of(std::uint64_t part, std::uint64_t window) noexcept {
  if (window == 0) return 0;
  const std::uint64_t p = (part * kFullPermille + window / 2) / window;
  return p > kFullPermille ? kFullPermille : static_cast<std::uint32_t>(p);
}

// Step 2 of control_step(): the sums and the scale (see there).
void update_scale(DeviceState& d, ControlState& s, const Measurement& m, std::int64_t spent, std::uint64_t now_ns,
                  StepResult* r) noexcept {
  const std::uint64_t scale_prev = d.cost_scale_ppm.load(std::memory_order_relaxed);
  r->scale_ppm = scale_prev;
  const double units =
      spent > 0 && scale_prev > 0 ? static_cast<double>(spent) * 1e6 / static_cast<double>(scale_prev) : 0.0;
  double keep = kScaleDecay;
  if (s.units_sum > 0) {
    const double forget = units / s.units_sum;
    keep = forget >= 1.0 - kScaleDecay ? kScaleDecay : 1.0 - forget;
  }
  s.busy_sum = s.busy_sum * keep + static_cast<double>(m.busy_ns);
  s.units_sum = s.units_sum * keep + units;
  s.resolution_sum = s.resolution_sum * keep + static_cast<double>(m.resolution_ns);
  double scale = -1;
  // Enough signal: a few hundred microseconds of device time and admissions —
  // or a lot admitted (10 ms at the nominal price) that measurably used almost
  // no device time: kernels far cheaper than the prior, which would otherwise
  // never calibrate and keep every launch on the cautious path.
  if ((s.busy_sum >= kScaleMinBusyNs && s.busy_sum > s.resolution_sum && s.units_sum >= kScaleMinUnitsNs) ||
      s.units_sum >= 10'000'000.0) {
    scale = s.busy_sum / s.units_sum * 1e6;
  } else if (scale_prev > 0) {
    // Too little signal to measure the scale, but enough to bound it: the
    // launches admitted so far, less those that may not have run yet (those
    // still waiting for credit, and what the launch path lets processes
    // queue: kQueueSlack x kQueueCostNs at the current price), predict
    // scale x units of device time; the device measured at most busy +
    // resolution (never less than the signal floor). A prediction several
    // times that is a scale the measurement refutes: lower it to what the
    // measurement supports.
    const double price_unit = 1e6 / static_cast<double>(scale_prev);  // nominal ns per priced ns
    const double waiting =
        static_cast<double>(-std::min<std::int64_t>(d.tokens_ns.load(std::memory_order_relaxed), 0)) * price_unit;
    const double queued = kQueueSlack * static_cast<double>(kQueueCostNs) * price_unit;
    const double ran = s.units_sum - waiting - queued;
    const double supported = std::max(s.busy_sum + s.resolution_sum, kScaleMinBusyNs);
    if (ran >= kScaleMinUnitsNs && ran * static_cast<double>(scale_prev) * 1e-6 > kScaleUnsupported * supported)
      scale = supported / ran * 1e6;
  }
  if (scale >= 0) {
    if (scale < static_cast<double>(kMinScalePpm)) scale = static_cast<double>(kMinScalePpm);
    if (scale > static_cast<double>(kMaxScalePpm)) scale = static_cast<double>(kMaxScalePpm);
    r->scale_ppm = static_cast<std::uint64_t>(scale);
    d.cost_scale_ppm.store(r->scale_ppm, std::memory_order_relaxed);
    scale_updated_ns(d).store(now_ns == 0 ? 1 : now_ns, std::memory_order_relaxed);
  }
}

}  // namespace

void control_begin(DeviceState& d, ControlState& s) noexcept {
  s = ControlState{};
  const std::uint32_t permille = refill_permille(d);
  if (permille != 0) {
    // Prices charged before this baseline are never trued up by this
    // controller: their device time will be charged once more when it is
    // measured. Bounded, so that no launch, however mispriced, leaves the
    // container's next process a debt of minutes (issue 35).
    const std::int64_t floor = -kInheritedDebtCapacities * capacity_ns(permille);
    const std::int64_t balance = d.tokens_ns.load(std::memory_order_relaxed);
    if (balance < floor) credit(d, floor - balance, capacity_ns(permille));
  }
  // Nothing measured yet (the prior): no learnt scale to protect, and the
  // first launches must calibrate it at once.
  s.settled = scale_updated_ns(d).load(std::memory_order_relaxed) == 0;
  s.spent_mark = spent_total(d);
  s.granted = elastic_permille(d).load(std::memory_order_relaxed);
  s.primed = true;
}

std::uint32_t elastic_grant(std::uint32_t granted, std::uint32_t share, std::uint32_t busy, std::uint32_t others,
                            std::uint32_t others_prev) noexcept {
  if (granted < share) granted = share;
  const std::uint32_t used = busy + others;
  const std::uint32_t idle = used >= kFullPermille ? 0 : kFullPermille - used;
  const std::uint32_t room = others + kElasticHeadroom >= kFullPermille ? 0 : kFullPermille - others - kElasticHeadroom;
  if (others >= kElasticOthersActive && idle < kElasticHeadroom) {
    // The device is full and somebody else is on it. If their use grew they
    // want more: give everything back at once (back to the share within one
    // step). If it is steady, they are satisfied: keep at most what leaves
    // them headroom.
    if (others > others_prev + kElasticGrowth) return share;
    const std::uint32_t next = granted < room ? granted : room;
    return next > share ? next : share;
  }
  if (others >= kElasticOthersActive && idle < 2 * kElasticHeadroom) {
    // Just about the headroom with a neighbour: hold (a band, so that
    // measurement noise does not make the grant oscillate).
    const std::uint32_t next = granted < room ? granted : room;
    return next > share ? next : share;
  }
  // Idle capacity (or the device is ours alone): additive increase.
  const std::uint32_t next = granted + kElasticStep;
  return next > kFullPermille ? kFullPermille : next;
}

StepResult control_step(DeviceState& d, ControlState& s, const Measurement& m, std::uint64_t now_ns) noexcept {
  StepResult r;
  if (!s.primed) {
    control_begin(d, s);
    return r;
  }
  const std::int64_t total = spent_total(d);
  const std::int64_t spent = total - s.spent_mark;
  s.spent_mark = total;
  r.busy_permille = permille_of(m.busy_ns, m.window_ns);
  r.others_permille = permille_of(m.others_ns, m.window_ns);

  // 1. True-up: refund the provisional prices of the window, charge what the
  // container measurably used. credit() moves credited_ns with tokens_ns, so
  // the spent total (and the next window's mark) is unaffected.
  const std::uint32_t permille = refill_permille(d);
  if (permille != 0) {
    r.adjust_ns = credit(d, spent - static_cast<std::int64_t>(m.busy_ns), capacity_ns(permille));
  }

  // 2. Price scale = measured device time per nominal nanosecond, from
  // decayed sums, so that a window's misalignment (work admitted in one
  // window runs in the next) averages out instead of jerking the price. The
  // sums forget in proportion to what is admitted (at most 1 - kScaleDecay a
  // step, none in a step that admits nothing): a launch that runs for many
  // steps keeps its price in the sums until its device time has come.
  bool price = s.settled;
  if (!s.settled) {
    // Work admitted before the baseline may still be running: not this
    // controller's to price. Settled once the device had idle time (every
    // queue drained), or after kSettleNs; the settling window itself counts
    // only when the container measurably used nothing in it (nothing of the
    // earlier work can be in it then).
    s.unsettled_ns += m.window_ns;
    if (r.busy_permille + r.others_permille + kSettleIdlePermille <= kFullPermille || s.unsettled_ns >= kSettleNs) {
      s.settled = true;
      price = static_cast<double>(m.busy_ns) < kScaleMinBusyNs;
    }
  }
  if (price) {
    update_scale(d, s, m, spent, now_ns, &r);
  } else {
    r.scale_ppm = d.cost_scale_ppm.load(std::memory_order_relaxed);
  }

  // 3. Elastic grant.
  const std::uint32_t pct = d.sm_limit_pct.load(std::memory_order_relaxed);
  const bool elastic = d.sm_policy.load(std::memory_order_relaxed) == static_cast<std::uint32_t>(SmPolicy::elastic);
  if (elastic && pct != 0 && pct < 100) {
    s.granted = elastic_grant(s.granted, pct * 10, r.busy_permille, r.others_permille, s.others_prev);
    elastic_permille(d).store(s.granted, std::memory_order_relaxed);
  } else {
    s.granted = 0;
    if (elastic_permille(d).load(std::memory_order_relaxed) != 0)
      elastic_permille(d).store(0, std::memory_order_relaxed);
  }
  r.granted_permille = s.granted;
  s.others_prev = r.others_permille;
  return r;
}

bool hold_feedback(DeviceState& d, std::uint32_t self, std::uint64_t now_ns) noexcept {
  std::uint32_t owner = d.feedback_owner_pid.load(std::memory_order_acquire);
  if (owner != self) {
    const std::uint64_t beat = feedback_heartbeat_ns(d).load(std::memory_order_acquire);
    const bool stale = owner == 0 || beat == 0 || (now_ns > beat && now_ns - beat > kOwnerTimeoutNs);
    if (!stale) return false;
    // A contender that read the same stale owner loses this CAS. One that
    // reads the new owner before its first heartbeat may take over again:
    // at worst two processes run one step each, which the next step absorbs.
    if (!d.feedback_owner_pid.compare_exchange_strong(owner, self, std::memory_order_acq_rel)) return false;
  }
  feedback_heartbeat_ns(d).store(now_ns, std::memory_order_release);
  return true;
}

void drop_feedback(DeviceState& d, std::uint32_t self) noexcept {
  std::uint32_t owner = self;
  if (d.feedback_owner_pid.compare_exchange_strong(owner, 0, std::memory_order_acq_rel))
    feedback_heartbeat_ns(d).store(0, std::memory_order_release);
}

}  // namespace gpuslice::limiter
