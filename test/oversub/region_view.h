// A container's region mapped read-write (as the agent maps it), for the
// oversubscription tests to read its counters.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "gpuslice/region.h"
#include "shm/region_file.h"

namespace gpuslice::test {

struct RegionView {
  explicit RegionView(const std::string& path) {
    shm::Error err{};
    region = shm::attach_existing(path.c_str(), true, &err);
    EXPECT_NE(region, nullptr) << err.message;
  }
  ~RegionView() {
    if (region != nullptr) shm::detach(region);
  }
  RegionView(const RegionView&) = delete;
  RegionView& operator=(const RegionView&) = delete;
  DeviceState& dev() { return region->devices[0]; }
  Region* region = nullptr;
};

}  // namespace gpuslice::test
