// gpuslice-smi and priority: `set --priority` rewrites the region's word;
// the table and JSON show the level and whether the container is held.
#include <gtest/gtest.h>
#include <time.h>

#include <nlohmann/json.hpp>
#include <string>

#include "gpuslice/priority_board.h"
#include "gpuslice/region.h"
#include "harness.h"
#include "shm/region_file.h"

namespace {

using namespace gpuslice;
using namespace std::string_literals;

std::uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

class PrioritySmi : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = box_.path("c.region");
    shm::Error err{};
    region_ = shm::attach(path_.c_str(), "train", &err);
    ASSERT_NE(region_, nullptr) << err.message;
  }
  void TearDown() override {
    if (region_ != nullptr) shm::detach(region_);
  }
  test::Result smi(std::vector<std::string> args) {
    args.insert(args.begin(), test::bin("gpuslice-smi"));
    return test::run(args, box_.env(false), 30000);
  }
  nlohmann::json shown() {
    const test::Result r = smi({"--region", path_, "--json"});
    EXPECT_EQ(r.exit_code, 0) << r.describe();
    return nlohmann::json::parse(r.out)["regions"][0];
  }
  test::Sandbox box_;
  std::string path_;
  Region* region_ = nullptr;
};

TEST_F(PrioritySmi, SetWritesTheRegionWord) {
  EXPECT_EQ(shown()["priority"], "normal");  // nothing recorded yet
  test::Result r = smi({"set", "--region", path_, "--priority", "low"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out, "gpuslice-smi: "s + path_ + ": priority normal -> low\n");
  EXPECT_EQ(region_->header.priority.load(), static_cast<std::uint32_t>(Priority::low));
  r = smi({"set", "--region", path_, "--priority", "HIGH"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(region_->header.priority.load(), static_cast<std::uint32_t>(Priority::high));
  EXPECT_EQ(shown()["priority"], "high");
}

TEST_F(PrioritySmi, BadLevelIsAUsageError) {
  const test::Result r = smi({"set", "--region", path_, "--priority", "urgent"});
  EXPECT_EQ(r.exit_code, 64);
  EXPECT_EQ(r.err, "gpuslice-smi: set: --priority 'urgent': expected high, normal or low\n");
  EXPECT_EQ(region_->header.priority.load(), 0u);
}

TEST_F(PrioritySmi, HeldIsShownWhileTheWordIsInTheFuture) {
  region_->header.priority.store(static_cast<std::uint32_t>(Priority::low));
  region_->header.priority_held_ns.store(2'500'000'000);
  region_->header.priority_held_until_ns.store(mono_ns() + 60'000'000'000ull);
  nlohmann::json j = shown();
  EXPECT_EQ(j["priority"], "low");
  EXPECT_EQ(j["priority_held"], true);
  EXPECT_EQ(j["priority_held_ns"], 2'500'000'000ull);
  region_->header.priority_held_until_ns.store(mono_ns() - 1);
  EXPECT_EQ(shown()["priority_held"], false);
}

}  // namespace
