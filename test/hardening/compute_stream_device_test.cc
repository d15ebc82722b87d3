// Issue 9, "launches on a device that is not the current context's": a
// kernel launched into a stream of device 1 runs on device 1 (cuda.h,
// cuLaunchKernel: a context-less CUkernel runs in hStream's context), whatever
// context is current, or with none current. Its price must come out of device
// 1's bucket. Device 0 is left unlimited so that charging the wrong device
// shows as device 1 running everything it was given.
//
// The probe launches at most 30000 kernels of 100 us (3 s of device time) as
// fast as it can for 1.5 s. At 10 % device 1 may run about 0.15 s of it, plus
// what is admitted at the prior price before the first measurement; the bound
// (1.0 s) is far above that and far below the 3 s an uncharged run queues.
// Labelled `timing` (wall-clock shares).
#include <gtest/gtest.h>

#include "compute_support.h"

using namespace gpuslice::test;
using namespace gpuslice::test::hardening;

namespace {

class StreamOfAnotherDevice : public ::testing::TestWithParam<const char*> {};

TEST_P(StreamOfAnotherDevice, IsChargedToTheStreamsDevice) {
  Sandbox box;
  Env env = merge(box.env(), {{"FAKECUDA_DEVICES", "2"}, {"GPUSLICE_SM_LIMIT", "0=100,1=10"}});
  Result r = run({bin("gpuslice-probe"), "compute", "stream-device", GetParam(), "100", "30000", "1.5"}, env, 90000);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::uint64_t launches = unsigned_number(r, "probe", "launches", 0);
  const long pid = static_cast<long>(unsigned_number(r, "probe", "pid", 0));
  ASSERT_GT(launches, 0u) << r.describe();
  const std::uint64_t busy = device_busy_ns(box, 1, pid);
  EXPECT_GT(busy, 0u) << "nothing ran on device 1: " << r.describe();
  EXPECT_LE(busy, 1'000'000'000u) << "device 1 ran " << busy / 1e6 << " ms of " << launches
                                  << " launches under a 10% limit in about 1.5 s: " << r.describe();
  EXPECT_EQ(device_busy_ns(box, 0, pid), 0u) << "work ran on device 0";
}

INSTANTIATE_TEST_SUITE_P(Launches, StreamOfAnotherDevice, ::testing::Values("other-current", "no-context"),
                         [](const auto& info) {
                           return std::string(info.param) == "no-context" ? "NoCurrentContext"
                                                                          : "OtherDevicesContextCurrent";
                         });

}  // namespace
