// Issue 36, green contexts: kernels launched on a green context's stream
// (cuGreenCtxStreamCreate) of device 1, with device 0's context current, are
// charged to device 1 and throttled there (programs/green_probe.cc launch).
// As compute_stream_device_test: at most 30000 launches of 100 us (3 s of
// device time) for 1.5 s; at 10 % device 1 may run about 0.15 s plus what is
// admitted before the first measurement; the bound (1.0 s) is far above that
// and far below the 3 s an unthrottled run queues. Labelled `timing`.
#include <gtest/gtest.h>

#include "compute_support.h"

using namespace gpuslice::test;
using namespace gpuslice::test::hardening;

namespace {

TEST(GreenContextCompute, LaunchesOnItsStreamAreThrottledOnItsDevice) {
  Sandbox box;
  Env env = merge(box.env(), {{"FAKECUDA_DEVICES", "2"}, {"GPUSLICE_SM_LIMIT", "0=100,1=10"}});
  Result r = run({bin("green_probe"), "launch", "1", "100", "30000", "1.5"}, env, 90000);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const long pid = static_cast<long>(unsigned_number(r, "probe", "pid", 0));
  ASSERT_GT(unsigned_number(r, "probe", "launches", 0), 0u) << r.describe();
  const std::uint64_t busy = device_busy_ns(box, 1, pid);
  EXPECT_GT(busy, 0u) << "nothing ran on device 1: " << r.describe();
  EXPECT_LE(busy, 1'000'000'000u) << "device 1 ran " << busy / 1e6 << " ms under a 10% limit in about 1.5 s";
  EXPECT_EQ(device_busy_ns(box, 0, pid), 0u) << "work ran on device 0";
}

}  // namespace
