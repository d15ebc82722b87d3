// Pins the region ABI: every offset and size is hard-coded here, so that an
// accidental change of include/gpuslice/region.h fails loudly. A deliberate
// change bumps kRegionAbiVersion and updates this file in the same commit.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpuslice/region.h"
#include "shm/region_file.h"

namespace gpuslice {
namespace {

#define EXPECT_FIELD(Type, field, offset, size)          \
  EXPECT_EQ(offsetof(Type, field), std::size_t{offset}); \
  EXPECT_EQ(sizeof(Type::field), std::size_t{size})

TEST(RegionLayout, Constants) {
  EXPECT_EQ(kRegionMagic, 0x45434c5353555047ull);
  EXPECT_EQ(kRegionAbiVersion, 5u);
  EXPECT_EQ(kMaxShared, 64u);
  EXPECT_EQ(kMaxDeparted, 64u);
  EXPECT_EQ(kMaxDevices, 16u);
  EXPECT_EQ(kMaxSlots, 1024u);
  EXPECT_EQ(kUnlimited, ~std::uint64_t{0});
  EXPECT_EQ(static_cast<std::uint32_t>(SmPolicy::hard), 0u);
  EXPECT_EQ(static_cast<std::uint32_t>(SmPolicy::elastic), 1u);
  EXPECT_EQ(kSlotFree, 0u);
  EXPECT_EQ(kSlotClaiming, 1u);
  EXPECT_EQ(kSlotLive, 2u);
  EXPECT_EQ(kSlotReaping, 3u);
}

TEST(RegionLayout, Sizes) {
  EXPECT_EQ(sizeof(RegionHeader), 512u);
  EXPECT_EQ(sizeof(DeviceState), 512u);
  EXPECT_EQ(alignof(DeviceState), 64u);
  EXPECT_EQ(sizeof(Slot), 896u);
  EXPECT_EQ(alignof(Slot), 64u);
  EXPECT_EQ(sizeof(DepartedProcess), 16u);
  EXPECT_EQ(sizeof(Region), 931328u);
}

TEST(RegionLayout, Header) {
  EXPECT_FIELD(RegionHeader, magic, 0, 8);
  EXPECT_FIELD(RegionHeader, abi_version, 8, 4);
  EXPECT_FIELD(RegionHeader, header_size, 12, 4);
  EXPECT_FIELD(RegionHeader, total_size, 16, 8);
  EXPECT_FIELD(RegionHeader, max_devices, 24, 4);
  EXPECT_FIELD(RegionHeader, max_slots, 28, 4);
  EXPECT_FIELD(RegionHeader, created_ns, 32, 8);
  EXPECT_FIELD(RegionHeader, container_name, 40, 64);
  EXPECT_FIELD(RegionHeader, agent_heartbeat_ns, 104, 8);
  EXPECT_FIELD(RegionHeader, live_slots, 112, 4);
  EXPECT_FIELD(RegionHeader, reserved0, 116, 4);
  EXPECT_FIELD(RegionHeader, reaper_lock, 120, 8);
  EXPECT_FIELD(RegionHeader, slots_reaped, 128, 8);
  EXPECT_FIELD(RegionHeader, priority, 136, 4);
  EXPECT_FIELD(RegionHeader, reserved2, 140, 4);
  EXPECT_FIELD(RegionHeader, priority_held_ns, 144, 8);
  EXPECT_FIELD(RegionHeader, priority_held_until_ns, 152, 8);
  EXPECT_FIELD(RegionHeader, departed_next, 160, 8);
  EXPECT_FIELD(RegionHeader, reserved3, 168, 24);
  EXPECT_FIELD(RegionHeader, lease_holders, 192, 128);
  EXPECT_FIELD(RegionHeader, reserved1, 320, 192);
}

TEST(RegionLayout, DeviceState) {
  EXPECT_FIELD(DeviceState, uuid_state, 0, 4);
  EXPECT_FIELD(DeviceState, reserved0, 4, 4);
  EXPECT_FIELD(DeviceState, uuid, 8, 16);
  EXPECT_FIELD(DeviceState, quota_bytes, 24, 8);
  EXPECT_FIELD(DeviceState, sm_limit_pct, 32, 4);
  EXPECT_FIELD(DeviceState, sm_policy, 36, 4);
  EXPECT_FIELD(DeviceState, cost_scale_ppm, 40, 8);
  EXPECT_FIELD(DeviceState, scale_updated_ns, 48, 8);
  EXPECT_FIELD(DeviceState, elastic_permille, 56, 4);
  EXPECT_FIELD(DeviceState, reserved1, 60, 4);
  EXPECT_FIELD(DeviceState, used_bytes, 64, 8);
  EXPECT_FIELD(DeviceState, peak_used_bytes, 72, 8);
  EXPECT_FIELD(DeviceState, oom_refusals, 80, 8);
  EXPECT_FIELD(DeviceState, accounting_errors, 88, 8);
  EXPECT_FIELD(DeviceState, lease_epoch, 96, 8);
  EXPECT_FIELD(DeviceState, context_size_bytes, 104, 8);
  EXPECT_FIELD(DeviceState, record_refusals, 112, 8);
  EXPECT_FIELD(DeviceState, first_context, 120, 8);
  EXPECT_FIELD(DeviceState, tokens_ns, 128, 8);
  EXPECT_FIELD(DeviceState, last_refill_ns, 136, 8);
  EXPECT_FIELD(DeviceState, credited_ns, 144, 8);
  EXPECT_FIELD(DeviceState, reserved3, 152, 40);
  EXPECT_FIELD(DeviceState, throttled_ns, 192, 8);
  EXPECT_FIELD(DeviceState, launches, 200, 8);
  EXPECT_FIELD(DeviceState, reserved4, 208, 48);
  EXPECT_FIELD(DeviceState, util_permille, 256, 8);
  EXPECT_FIELD(DeviceState, util_updated_ns, 264, 8);
  EXPECT_FIELD(DeviceState, device_util_permille, 272, 8);
  EXPECT_FIELD(DeviceState, feedback_owner_pid, 280, 4);
  EXPECT_FIELD(DeviceState, reserved5, 284, 4);
  EXPECT_FIELD(DeviceState, feedback_heartbeat_ns, 288, 8);
  EXPECT_FIELD(DeviceState, agent_extra_bytes, 296, 8);
  EXPECT_FIELD(DeviceState, reserved6, 304, 16);
  EXPECT_FIELD(DeviceState, resident_limit_bytes, 320, 8);
  EXPECT_FIELD(DeviceState, spilled_bytes, 328, 8);
  EXPECT_FIELD(DeviceState, oversub_waits, 336, 8);
  EXPECT_FIELD(DeviceState, oversub_wait_ns, 344, 8);
  EXPECT_FIELD(DeviceState, oversub_timeouts, 352, 8);
  EXPECT_FIELD(DeviceState, oversub_waiting, 360, 4);
  EXPECT_FIELD(DeviceState, free_generation, 364, 4);
  EXPECT_FIELD(DeviceState, oversub_policy, 368, 4);
  EXPECT_FIELD(DeviceState, spills, 376, 8);
  EXPECT_FIELD(DeviceState, spilled_in_bytes, 384, 8);
  EXPECT_FIELD(DeviceState, spilled_out_bytes, 392, 8);
  EXPECT_FIELD(DeviceState, reserved8, 400, 48);
  EXPECT_FIELD(DeviceState, reserved_future, 448, 64);
}

TEST(RegionLayout, Slot) {
  EXPECT_FIELD(Slot, state, 0, 4);
  EXPECT_FIELD(Slot, pid, 4, 4);
  EXPECT_FIELD(Slot, pidns_inode, 8, 8);
  EXPECT_FIELD(Slot, start_time, 16, 8);
  EXPECT_FIELD(Slot, host_pid, 24, 4);
  EXPECT_FIELD(Slot, reserved0, 28, 4);
  EXPECT_FIELD(Slot, shared_held, 32, 8);
  EXPECT_FIELD(Slot, reserved1, 40, 24);
  EXPECT_FIELD(Slot, seq, 64, 8);
  EXPECT_FIELD(Slot, claim_generation, 72, 4);
  EXPECT_FIELD(Slot, refills, 76, 4);
  EXPECT_FIELD(Slot, oversub_waiting, 80, 32);
  EXPECT_FIELD(Slot, reserved2, 112, 16);
  EXPECT_FIELD(Slot, committed_bytes, 128, 128);
  EXPECT_FIELD(Slot, context_bytes, 256, 128);
  EXPECT_FIELD(Slot, nvml_used_bytes, 384, 128);
  EXPECT_FIELD(Slot, spilled_bytes, 512, 128);
  EXPECT_FIELD(Slot, lease, 640, 256);
  EXPECT_FIELD(Slot::Lease, word, 0, 8);
  EXPECT_FIELD(Slot::Lease, cap_bytes, 8, 8);
}

TEST(RegionLayout, DepartedProcess) {
  EXPECT_FIELD(DepartedProcess, pid, 0, 4);
  EXPECT_FIELD(DepartedProcess, seq, 4, 4);
  EXPECT_FIELD(DepartedProcess, departed_ns, 8, 8);
}

TEST(RegionLayout, Region) {
  EXPECT_FIELD(Region, header, 0, 512);
  EXPECT_FIELD(Region, devices, 512, 8192);
  EXPECT_FIELD(Region, slots, 8704, 917504);
  EXPECT_FIELD(Region, departed, 926208, 1024);
  EXPECT_FIELD(Region, shared, 927232, 4096);
  EXPECT_FIELD(SharedAlloc, state, 0, 8);
  EXPECT_FIELD(SharedAlloc, key, 8, 8);
  EXPECT_FIELD(SharedAlloc, charged_bytes, 16, 8);
  EXPECT_FIELD(SharedAlloc, device, 24, 4);
}

// ABI v2's reason to exist: words written on different paths never share a
// cache line with words read or written on the hot paths.
TEST(RegionLayout, HotWordsHaveTheirOwnCacheLines) {
  auto line = [](std::size_t offset) { return offset / 64; };
  const std::size_t tokens = line(offsetof(DeviceState, tokens_ns));
  EXPECT_NE(tokens, line(offsetof(DeviceState, cost_scale_ppm)));
  EXPECT_NE(tokens, line(offsetof(DeviceState, sm_limit_pct)));
  EXPECT_NE(tokens, line(offsetof(DeviceState, launches)));
  EXPECT_NE(tokens, line(offsetof(DeviceState, used_bytes)));
  const std::size_t used = line(offsetof(DeviceState, used_bytes));
  EXPECT_NE(used, line(offsetof(DeviceState, agent_extra_bytes)));
  EXPECT_NE(used, line(offsetof(DeviceState, util_permille)));
  EXPECT_NE(used, line(offsetof(DeviceState, quota_bytes)));
  EXPECT_NE(line(offsetof(Slot, seq)), line(offsetof(Slot, pid)));
  EXPECT_NE(line(offsetof(Slot, seq)), line(offsetof(Slot, host_pid)));
  // ABI v3: a device's lease word and cap share one line of the slot's own,
  // away from the seqlock bracket and the identity.
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    const std::size_t lease = offsetof(Slot, lease) + d * sizeof(Slot::Lease);
    EXPECT_EQ(line(lease), line(lease + offsetof(Slot::Lease, cap_bytes)));
    EXPECT_NE(line(lease), line(offsetof(Slot, seq)));
    EXPECT_NE(line(lease), line(offsetof(Slot, pid)));
  }
}

// A region written by an earlier release (ABI v1 to v4: v4 gave the lease
// word a STALE bit an earlier release would read as amount, v5 put shared
// allocations' bytes in no slot, where a v4 reaper would drop them) is refused by
// everybody who maps regions through shm/ (the library, the agent,
// gpuslice-smi), with one line naming the file and both versions.
struct OldAbi {
  std::uint32_t version, header_size;
  std::uint64_t total_size;
};

class OldRegion : public ::testing::TestWithParam<OldAbi> {};

TEST_P(OldRegion, IsRefusedNamingTheFileAndBothVersions) {
  const OldAbi old = GetParam();
  char dir[] = "/tmp/gpuslice-layout-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/old.region";
  // The old header: same magic and first words, its own version and sizes.
  std::vector<unsigned char> file(sizeof(Region), 0);
  RegionHeader h{};
  h.magic = kRegionMagic;
  h.abi_version = old.version;
  h.header_size = old.header_size;
  h.total_size = old.total_size;
  h.max_devices = kMaxDevices;
  h.max_slots = kMaxSlots;
  std::memcpy(file.data(), &h, sizeof h);
  const int fd = open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, file.data(), old.total_size), static_cast<ssize_t>(old.total_size));
  close(fd);
  const std::string found = "version " + std::to_string(old.version);
  for (bool writable : {false, true}) {
    shm::Error err{};
    Region* r = shm::attach_existing(path.c_str(), writable, &err);
    EXPECT_EQ(r, nullptr);
    if (r != nullptr) shm::detach(r);
    const std::string message = err.message;
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(found), std::string::npos) << message;
    EXPECT_NE(message.find("expected version 5"), std::string::npos) << message;
  }
  shm::Error err{};
  EXPECT_EQ(shm::attach(path.c_str(), "c", &err), nullptr);
  EXPECT_NE(std::string(err.message).find("expected version 5"), std::string::npos) << err.message;
  unlink(path.c_str());
  rmdir(dir);
}

INSTANTIATE_TEST_SUITE_P(RegionLayout, OldRegion,
                         ::testing::Values(OldAbi{1, 248, 463104}, OldAbi{2, 512, 665088}, OldAbi{3, 512, 927232},
                                           OldAbi{4, 512, 927232}),
                         [](const ::testing::TestParamInfo<OldAbi>& info) {
                           return "AbiV" + std::to_string(info.param.version);
                         });

// Every shared field is a lock-free atomic of a fixed width (or plain bytes
// written before publication): no process can leave a lock held.
TEST(RegionLayout, AtomicsAreLockFreeAndPlain) {
  EXPECT_TRUE(std::atomic<std::uint64_t>::is_always_lock_free);
  EXPECT_TRUE(std::atomic<std::uint32_t>::is_always_lock_free);
  EXPECT_EQ(sizeof(std::atomic<std::uint64_t>), 8u);
  EXPECT_EQ(sizeof(std::atomic<std::uint32_t>), 4u);
  EXPECT_TRUE(std::is_standard_layout_v<Region>);
}

}  // namespace
}  // namespace gpuslice
