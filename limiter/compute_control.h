// The feedback controller of a (container, device) compute bucket: pure logic,
// driven with measurements by one elected process of the container (the
// feedback owner, see compute_feedback.h). See docs/limiter.md.
//
// Each step takes one measurement window (the container's device time and
// everybody else's, from the node agent or NVML) and
//   1. trues the bucket up: the provisional prices charged at launch since the
//      last step are given back and the measured device time is charged
//      instead. Over any run of steps the bucket has then been charged exactly
//      what the container used, whatever the estimate was: the integral of the
//      error is zero, so the achieved share converges on the target.
//   2. re-estimates the price scale (measured device time per nominal
//      nanosecond) from decayed sums, so that launches are paced smoothly
//      between steps instead of in bursts followed by repayment. The sums
//      forget in proportion to new admissions, not to time: the device time
//      of a launch that runs for many steps (a 0.5 s graph) is measured
//      against its own price, however long after its admission it runs
//      (issue 35: a time horizon of a few steps had forgotten the price when
//      the device time came, and the scale ended 10^3 x too high). Where the
//      measurement is too coarse to update the scale (whole percents of a
//      tiny share), what it does support — at most its resolution of device
//      time — still bounds the scale from above.
//   3. under the elastic policy, grants idle capacity beyond the share and
//      takes it back as soon as another tenant's use grows.
#pragma once

#include <cstdint>

#include "gpuslice/region.h"

namespace gpuslice::limiter {

// --- tunables (docs/limiter.md) ---
inline constexpr std::uint64_t kControlPeriodNs = 50'000'000;      // owner's step period
inline constexpr std::uint64_t kOwnerTimeoutNs = 500'000'000;      // stale heartbeat: take over
inline constexpr double kScaleDecay = 0.6;                         // per step, for the estimate's sums
inline constexpr std::uint64_t kMinScalePpm = 1'000;               // 0.001 x nominal
inline constexpr std::uint64_t kMaxScalePpm = 100'000'000'000ull;  // 1e5 x nominal (2 s per wave)
// Device time the sums need before they set the scale, and admissions (nominal
// ns): below, the measurement is noise.
inline constexpr double kScaleMinBusyNs = 200'000.0;
inline constexpr double kScaleMinUnitsNs = 1'000.0;
// Without that signal, the scale is lowered to what the measurement supports
// once the price predicts this many times more device time than was measured
// (with the measurement's resolution): a scale learnt on long launches, or
// any too high, is not kept by a container it throttles below what NVML can
// see (issue 35: 100 us kernels paced at 50 ms, 0.2% of the device, forever).
inline constexpr double kScaleUnsupported = 4.0;
// Processes' queues (limiter::kQueueCostNs of priced work each) the bound
// assumes may be admitted but not yet run.
inline constexpr double kQueueSlack = 4.0;
// A new owner (control_begin) finds at most this many bucket capacities of
// debt (share x 50 ms each: repaid in that many x 50 ms of wall time,
// whatever the share): the provisional prices charged before its baseline
// are never trued up by it, so a larger debt would be paid twice, and one
// priced at a wrong scale could be minutes long (issue 35).
inline constexpr std::int64_t kInheritedDebtCapacities = 20;
// A new baseline's scale sums start at the first window with idle device time
// (kSettleIdlePermille and more), at the latest after this much measured time.
inline constexpr std::uint32_t kSettleIdlePermille = 50;
inline constexpr std::uint64_t kSettleNs = 2'000'000'000;
// Elastic policy, in permille of the device.
inline constexpr std::uint32_t kElasticOthersActive = 20;  // another tenant is present above this
inline constexpr std::uint32_t kElasticHeadroom = 50;      // idle capacity left to newcomers
inline constexpr std::uint32_t kElasticGrowth = 20;        // others' growth that revokes the grant
inline constexpr std::uint32_t kElasticStep = 100;         // additive increase per step

struct Measurement {
  std::uint64_t window_ns = 0;  // wall-clock time the measurement covers
  std::uint64_t busy_ns = 0;    // device time of the container's kernels in it
  std::uint64_t others_ns = 0;  // device time of every other process's kernels in it
  // How far busy_ns may be from the truth by the source's rounding (NVML's
  // whole percent of each sample period; the agent's permille): a busy_ns
  // below it is no evidence of device time.
  std::uint64_t resolution_ns = 0;
};

// Controller memory, private to the owner process. A new owner starts afresh
// from what the region holds (the scale, the balance).
struct ControlState {
  bool primed = false;
  std::int64_t spent_mark = 0;  // credited - tokens at the previous step
  double busy_sum = 0;          // decayed measured device time
  double units_sum = 0;         // decayed nominal ns admitted
  double resolution_sum = 0;    // decayed resolution of the measured device time
  // A new baseline (control_begin) may find work admitted before it still
  // queued or running (a departed process's 2 s kernel): its device time has
  // no price in the sums and would inflate the scale. The sums start once the
  // device has been seen idle (every queue drained), or after kSettleNs.
  bool settled = false;
  std::uint64_t unsettled_ns = 0;
  std::uint32_t others_prev = 0;
  std::uint32_t granted = 0;  // elastic grant in permille (0 = the share)
};

struct StepResult {
  std::int64_t adjust_ns = 0;   // credit added by the true-up (negative: charged)
  std::uint64_t scale_ppm = 0;  // published price scale
  std::uint32_t granted_permille = 0;
  std::uint32_t busy_permille = 0;
  std::uint32_t others_permille = 0;
};

// Records the baseline of a first step (on election, or after a measurement
// gap), and bounds the debt inherited (kInheritedDebtCapacities).
void control_begin(DeviceState& d, ControlState& s) noexcept;
// One step; the caller guarantees consecutive measurements are contiguous.
// `now_ns` stamps a scale update (scale_updated_ns).
StepResult control_step(DeviceState& d, ControlState& s, const Measurement& m, std::uint64_t now_ns) noexcept;
// The elastic rule alone (exposed for tests): the next grant from the current
// one, the configured share and one window's utilisation, all in permille.
std::uint32_t elastic_grant(std::uint32_t granted, std::uint32_t share, std::uint32_t busy, std::uint32_t others,
                            std::uint32_t others_prev) noexcept;

// Feedback-owner election on DeviceState::feedback_owner_pid, lock-free. True
// when `self` owns the role after the call (it refreshed the heartbeat). A
// stalled or dead owner loses the role once its heartbeat is older than
// kOwnerTimeoutNs; a stalled one that wakes finds it gone and stops.
bool hold_feedback(DeviceState& d, std::uint32_t self, std::uint64_t now_ns) noexcept;
void drop_feedback(DeviceState& d, std::uint32_t self) noexcept;

}  // namespace gpuslice::limiter
