// Tampered regions (tools/agent/tamper.h): a process of the container
// rewrites its limits in its region file; the agent puts back the limits the
// container was given within a cycle, counts and logs it, and keeps the
// operator's changes made with gpuslice-smi set.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstddef>
#include <memory>

#include "agent.h"
#include "agent_test_util.h"
#include "grant.h"
#include "limiter/priority.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

// Another process opens the region file and writes one field, as a process of
// the container can: its own region is its to write.
template <class T>
bool write_field(const std::string& path, std::size_t offset, T value) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(path.c_str(), O_RDWR);
    _exit(fd >= 0 && pwrite(fd, &value, sizeof value, static_cast<off_t>(offset)) == sizeof value ? 0 : 1);
  }
  int status = 0;
  return pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

std::size_t device_field(int dev, std::size_t field) {
  return offsetof(Region, devices) + static_cast<std::size_t>(dev) * sizeof(DeviceState) + field;
}
constexpr std::size_t kQuota = offsetof(DeviceState, quota_bytes);
constexpr std::size_t kSmLimit = offsetof(DeviceState, sm_limit_pct);
constexpr std::size_t kPriority = offsetof(RegionHeader, priority);

std::uint32_t low() { return static_cast<std::uint32_t>(Priority::low); }
std::uint32_t high() { return static_cast<std::uint32_t>(Priority::high); }

// A sandbox and a container's region with one device entry (256 MiB, 30 %
// of the SMs); start() starts the agent and runs the cycle that takes the
// limits it was given.
class AgentTamper : public ::testing::Test {
 protected:
  void SetUp() override {
    r = make_region(path, "t");
    ASSERT_NE(r, nullptr);
    dev = add_device(r, 0x60, 256 * kMi, 30);
    ASSERT_GE(dev, 0);
  }
  void TearDown() override {
    if (r != nullptr) shm::detach(r);
  }
  // A new entry published for the device with other limits (unlimited, all
  // the SMs): the next cycle gives it the device's limits, two repairs.
  void published_again_gets_the_given_limits(agent::Agent& a) {
    const int again = add_device(r, 0x60, kUnlimited, 100);
    ASSERT_GE(again, 0);
    ASSERT_NE(again, dev);
    a.cycle();
    EXPECT_EQ(r->devices[again].quota_bytes.load(), 256 * kMi);
    EXPECT_EQ(r->devices[again].sm_limit_pct.load(), 30u);
    EXPECT_EQ(a.stats().tamper.repairs, 2u);
  }
  agent::Agent& start() {
    agent_ = std::make_unique<agent::Agent>(config_for(box, false));
    agent_->start();
    agent_->cycle();
    return *agent_;
  }

  // What every test names (box, path, r, dev), as the tests had them.
  Sandbox box;
  const std::string path = container_region(box);
  Region* r = nullptr;
  int dev = -1;
  std::unique_ptr<agent::Agent> agent_;
};

TEST_F(AgentTamper, LimitsRewrittenByTheContainerAreRestoredWithinACycle) {
  r->header.priority.store(low());
  agent::Agent& a = start();  // the limits it was given
  ASSERT_TRUE(write_field<std::uint64_t>(path, device_field(dev, kQuota), 1024 * kMi));
  ASSERT_EQ(r->devices[dev].quota_bytes.load(), 1024 * kMi) << "the container can write its region";
  a.cycle();
  EXPECT_EQ(r->devices[dev].quota_bytes.load(), 256 * kMi);
  EXPECT_EQ(a.stats().tamper.repairs, 1u);
  EXPECT_NE(a.metrics_text().find("gpuslice_agent_tamper_repairs_total{container=\"t\",region=\"pod-1/c.region\"} 1"),
            std::string::npos)
      << a.metrics_text();

  // Compute limit and priority, then the quota again: each counted.
  ASSERT_TRUE(write_field<std::uint32_t>(path, device_field(dev, kSmLimit), 100));
  ASSERT_TRUE(write_field<std::uint32_t>(path, kPriority, high()));
  a.cycle();
  EXPECT_EQ(r->devices[dev].sm_limit_pct.load(), 30u);
  EXPECT_EQ(r->header.priority.load(), low());
  EXPECT_EQ(a.stats().tamper.repairs, 3u);
  ASSERT_TRUE(write_field<std::uint64_t>(path, device_field(dev, kQuota), kUnlimited));
  a.cycle();
  EXPECT_EQ(r->devices[dev].quota_bytes.load(), 256 * kMi);
  EXPECT_EQ(a.stats().tamper.repairs, 4u);
  a.cycle();
  EXPECT_EQ(a.stats().tamper.repairs, 4u) << "nothing rewritten since";
}

TEST_F(AgentTamper, GpusliceSmiSetIsKept) {
  r->header.priority.store(low());
  agent::Agent& a = start();
  const test::Result set = test::run({test::bin("gpuslice-smi"), "set", "--region", path, "--memory", "512Mi",
                                      "--sm-limit", "50", "--priority", "high"},
                                     {});
  ASSERT_EQ(set.exit_code, 0) << set.describe();
  for (int i = 0; i < 3; ++i) a.cycle();
  EXPECT_EQ(r->devices[dev].quota_bytes.load(), 512 * kMi) << "the operator's change is kept";
  EXPECT_EQ(r->devices[dev].sm_limit_pct.load(), 50u);
  EXPECT_EQ(r->header.priority.load(), high());
  EXPECT_EQ(a.stats().tamper.repairs, 0u);
  EXPECT_EQ(a.stats().tamper.grants_applied, 2u) << "one record for the limits, one for the priority";
  // Records are consumed; what is not a record is removed.
  const std::string grants = region_dir(box) + "/.gpuslice-grants";
  write_file(grants + "/junk", "x");
  write_file(grants + "/1-2-3-4", "not a record");
  a.cycle();
  EXPECT_FALSE(file_exists(grants + "/junk"));
  EXPECT_FALSE(file_exists(grants + "/1-2-3-4")) << "no region of that file: kept 30 s, then removed (written at 3 ns)";
  // ... and is what a later rewrite is restored to.
  ASSERT_TRUE(write_field<std::uint64_t>(path, device_field(dev, kQuota), 4096 * kMi));
  a.cycle();
  EXPECT_EQ(r->devices[dev].quota_bytes.load(), 512 * kMi);
  EXPECT_EQ(a.stats().tamper.repairs, 1u);
}

// The limits are kept per device: an entry abandoned and published again for
// the same UUID with other limits (what a first process could have written)
// gets the limits the device was given.
TEST_F(AgentTamper, AnEntryPublishedAgainForTheSameDeviceKeepsItsLimits) {
  agent::Agent& a = start();
  ASSERT_TRUE(
      write_field<std::uint32_t>(path, device_field(dev, offsetof(DeviceState, uuid_state)), shm::kDeviceAbandoned));
  ASSERT_NO_FATAL_FAILURE(published_again_gets_the_given_limits(a));
}

// In two steps: the entry's UUID rewritten (a cycle passes), then a new entry
// published for the device. The device's limits are still the given ones.
TEST_F(AgentTamper, AnEntryWhoseUuidWasRewrittenLeavesItsDevicesLimitsKept) {
  agent::Agent& a = start();
  std::uint8_t other[16];
  uuid_bytes(0x61, other);
  using Uuid = std::array<std::uint8_t, 16>;
  const bool rewritten = write_field<Uuid>(path, device_field(dev, offsetof(DeviceState, uuid)), std::to_array(other));
  ASSERT_TRUE(rewritten);
  a.cycle();
  ASSERT_NO_FATAL_FAILURE(published_again_gets_the_given_limits(a));
}

// smi records its change before writing it: an agent cycle between the two
// finds the record and the region's old value, which is not the container's
// doing (neither put back nor counted); the value smi then writes is kept.
TEST_F(AgentTamper, ARecordedChangeNotWrittenYetIsNoTampering) {
  agent::Agent& a = start();
  const std::string dir = agent::find_grant_dir(path);
  ASSERT_EQ(dir, region_dir(box) + "/.gpuslice-grants");
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  agent::Grant g;
  g.lines.push_back(grant_line(agent::GrantLine::quota, 0x60, 128 * kMi));
  std::string why;
  ASSERT_TRUE(agent::write_grant(dir, st.st_dev, st.st_ino, g, &why)) << why;
  a.cycle();
  EXPECT_EQ(r->devices[dev].quota_bytes.load(), 256 * kMi) << "smi writes it itself";
  EXPECT_EQ(a.stats().tamper.repairs, 0u);
  EXPECT_EQ(a.stats().tamper.grants_applied, 1u);
  r->devices[dev].quota_bytes.store(128 * kMi);  // smi's own store
  a.cycle();
  a.cycle();
  EXPECT_EQ(r->devices[dev].quota_bytes.load(), 128 * kMi);
  EXPECT_EQ(a.stats().tamper.repairs, 0u);
}

}  // namespace
