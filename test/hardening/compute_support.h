// Helpers shared by the compute hardening tests: the simulated device's own
// record of what ran (never the limiter's bookkeeping).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "harness.h"

namespace gpuslice::test::hardening {

// Device time (ns) the simulated timeline ran for `pid` on `device`, all time.
inline std::uint64_t device_busy_ns(const Sandbox& box, int device, long pid) {
  Result r =
      run({bin("fakecuda-ctl"), "busy", std::to_string(device), "0", "18446744073709551615", std::to_string(pid)},
          box.env(false), 30000);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  return std::strtoull(r.out.c_str(), nullptr, 10);
}

}  // namespace gpuslice::test::hardening
