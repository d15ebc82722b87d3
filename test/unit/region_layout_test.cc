// Pins the region ABI: every offset and size is hard-coded here, so that an
// accidental change of include/gpuslice/region.h fails loudly. A deliberate
// change bumps kRegionAbiVersion and updates this file in the same commit.
#include <gtest/gtest.h>

#include <cstddef>

#include "gpuslice/region.h"

namespace gpuslice {
namespace {

#define EXPECT_FIELD(Type, field, offset, size)           \
  EXPECT_EQ(offsetof(Type, field), std::size_t{offset}); \
  EXPECT_EQ(sizeof(Type::field), std::size_t{size})

TEST(RegionLayout, Constants) {
  EXPECT_EQ(kRegionMagic, 0x45434c5353555047ull);
  EXPECT_EQ(kRegionAbiVersion, 1u);
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
  EXPECT_EQ(sizeof(RegionHeader), 248u);
  EXPECT_EQ(sizeof(DeviceState), 256u);
  EXPECT_EQ(alignof(DeviceState), 64u);
  EXPECT_EQ(sizeof(Slot), 448u);
  EXPECT_EQ(alignof(Slot), 64u);
  EXPECT_EQ(sizeof(Region), 463104u);
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
  EXPECT_FIELD(RegionHeader, reserved1, 160, 88);
}

TEST(RegionLayout, DeviceState) {
  EXPECT_FIELD(DeviceState, uuid_state, 0, 4);
  EXPECT_FIELD(DeviceState, reserved0, 4, 4);
  EXPECT_FIELD(DeviceState, uuid, 8, 16);
  EXPECT_FIELD(DeviceState, quota_bytes, 24, 8);
  EXPECT_FIELD(DeviceState, used_bytes, 32, 8);
  EXPECT_FIELD(DeviceState, agent_extra_bytes, 40, 8);
  EXPECT_FIELD(DeviceState, oom_refusals, 48, 8);
  EXPECT_FIELD(DeviceState, peak_used_bytes, 56, 8);
  EXPECT_FIELD(DeviceState, accounting_errors, 64, 8);
  EXPECT_FIELD(DeviceState, reserved1, 72, 8);
  EXPECT_FIELD(DeviceState, sm_limit_pct, 128, 4);
  EXPECT_FIELD(DeviceState, sm_policy, 132, 4);
  EXPECT_FIELD(DeviceState, tokens_ns, 136, 8);
  EXPECT_FIELD(DeviceState, last_refill_ns, 144, 8);
  EXPECT_FIELD(DeviceState, cost_scale_ppm, 152, 8);
  EXPECT_FIELD(DeviceState, throttled_ns, 160, 8);
  EXPECT_FIELD(DeviceState, launches, 168, 8);
  EXPECT_FIELD(DeviceState, queued_ns, 176, 8);
  EXPECT_FIELD(DeviceState, credited_ns, 184, 8);
  EXPECT_FIELD(DeviceState, util_permille, 192, 8);
  EXPECT_FIELD(DeviceState, util_updated_ns, 200, 8);
  EXPECT_FIELD(DeviceState, device_util_permille, 208, 8);
  EXPECT_FIELD(DeviceState, feedback_owner_pid, 216, 4);
  EXPECT_FIELD(DeviceState, elastic_permille, 220, 4);
  EXPECT_FIELD(DeviceState, feedback_heartbeat_ns, 224, 8);
  EXPECT_FIELD(DeviceState, scale_updated_ns, 232, 8);
  EXPECT_FIELD(DeviceState, reserved4, 240, 16);
}

TEST(RegionLayout, Slot) {
  EXPECT_FIELD(Slot, state, 0, 4);
  EXPECT_FIELD(Slot, pid, 4, 4);
  EXPECT_FIELD(Slot, pidns_inode, 8, 8);
  EXPECT_FIELD(Slot, start_time, 16, 8);
  EXPECT_FIELD(Slot, host_pid, 24, 4);
  EXPECT_FIELD(Slot, reserved0, 28, 4);
  EXPECT_FIELD(Slot, seq, 32, 8);
  EXPECT_FIELD(Slot, reserved1, 40, 24);
  EXPECT_FIELD(Slot, committed_bytes, 64, 128);
  EXPECT_FIELD(Slot, context_bytes, 192, 128);
  EXPECT_FIELD(Slot, nvml_used_bytes, 320, 128);
}

TEST(RegionLayout, Region) {
  EXPECT_FIELD(Region, header, 0, 248);
  EXPECT_FIELD(Region, devices, 256, 4096);
  EXPECT_FIELD(Region, slots, 4352, 458752);
}

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
