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
//      between steps instead of in bursts followed by repayment.
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
// Elastic policy, in permille of the device.
inline constexpr std::uint32_t kElasticOthersActive = 20;  // another tenant is present above this
inline constexpr std::uint32_t kElasticHeadroom = 50;      // idle capacity left to newcomers
inline constexpr std::uint32_t kElasticGrowth = 20;        // others' growth that revokes the grant
inline constexpr std::uint32_t kElasticStep = 100;         // additive increase per step

struct Measurement {
  std::uint64_t window_ns = 0;  // wall-clock time the measurement covers
  std::uint64_t busy_ns = 0;    // device time of the container's kernels in it
  std::uint64_t others_ns = 0;  // device time of every other process's kernels in it
};

// Controller memory, private to the owner process. A new owner starts afresh
// from what the region holds (the scale, the balance).
struct ControlState {
  bool primed = false;
  std::int64_t spent_mark = 0;  // credited - tokens at the previous step
  double busy_sum = 0;          // decayed measured device time
  double units_sum = 0;         // decayed nominal ns admitted
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

// Records the baseline of a first step (on election, or after a measurement gap).
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
