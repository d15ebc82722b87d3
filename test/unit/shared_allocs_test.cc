// The container's table of shared allocations (limiter/shared_allocs.h):
// publish, join, leave, and a holder dead at each step of publish and close,
// reaped exactly (docs/shared-memory.md).
#include <gtest/gtest.h>

#include "limiter/memory_accounting.h"
#include "limiter/shared_allocs.h"
#include "support.h"

namespace gpuslice::test {
namespace {

using limiter::reap_dead;
using limiter::shared_charged;
using limiter::shared_join;
using limiter::shared_leave;
using limiter::shared_publish;

constexpr std::uint64_t kKey = 0x5eed;
constexpr std::uint64_t kB = 128 << 20;

std::uint64_t pack(std::uint64_t gen, int owner, SharedPhase phase) {
  return gen << 32 | static_cast<std::uint64_t>(owner + 1) << 8 | phase;
}

class SharedAllocs : public RegionFixture {
 protected:
  void SetUp() override {
    RegionFixture::SetUp();
    slot_ = shm::claim_slot(region_, self_);
    ASSERT_GE(slot_, 0);
    dev_ = make_device(region_, 0, std::uint64_t{1} << 30);
  }
  std::uint64_t used() const { return region_->devices[dev_].used_bytes.load(); }
  std::uint64_t committed(int slot) const { return region_->slots[slot].committed_bytes[dev_].load(); }
  // A slot of a dead identity holding `committed` bytes (added to used_bytes)
  // and the shared entries in `held`, built while invisible to reapers.
  int dead_slot(std::uint64_t salt, std::uint64_t bytes, std::uint64_t held) {
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      Slot& s = region_->slots[i];
      std::uint32_t free_state = kSlotFree;
      if (!s.state.compare_exchange_strong(free_state, kSlotClaiming)) continue;
      const shm::ProcessIdentity dead = dead_identity(self_, salt);
      s.pid.store(dead.pid);
      s.pidns_inode.store(dead.pidns_inode);
      s.committed_bytes[dev_].store(bytes);
      region_->devices[dev_].used_bytes.fetch_add(bytes);
      s.shared_held.store(held);
      s.start_time.store(dead.start_time);
      s.state.store(kSlotLive);
      return static_cast<int>(i);
    }
    return -1;
  }
  // Entry 0 as a process left it: state, charged bytes.
  void entry(std::uint64_t state, std::uint64_t charged) {
    SharedAlloc& a = region_->shared[0];
    a.key.store(kKey);
    a.device.store(static_cast<std::uint32_t>(dev_));
    a.charged_bytes.store(charged);
    a.state.store(state);
  }
  SharedPhase phase() const { return static_cast<SharedPhase>(region_->shared[0].state.load() & 0xff); }
  int slot_ = -1;
  int dev_ = -1;
};

TEST_F(SharedAllocs, PublishMovesTheBytesAndTheLastHolderReleasesThem) {
  ASSERT_TRUE(limiter::reserve(region_, slot_, dev_, kB, self_));
  const std::uint64_t before = used();
  const int e = shared_publish(region_, slot_, dev_, kKey, kB);
  ASSERT_GE(e, 0);
  EXPECT_EQ(used(), before) << "moved, not added";
  EXPECT_EQ(committed(slot_), before - kB);
  EXPECT_EQ(shared_charged(region_, dev_), kB);
  EXPECT_EQ(shared_publish(region_, slot_, dev_, kKey, kB), -1) << "one entry per key";
  EXPECT_EQ(shared_join(region_, slot_, dev_, kKey + 1), -1) << "unknown key";
  EXPECT_EQ(shared_join(region_, slot_, dev_, kKey), e);
  EXPECT_EQ(shared_leave(region_, slot_, e), kB) << "the only holder";
  EXPECT_EQ(used(), before - kB);
  EXPECT_EQ(shared_charged(region_, dev_), 0u);
  EXPECT_EQ(shared_join(region_, slot_, dev_, kKey), -1) << "closed";
}

TEST_F(SharedAllocs, ALiveHolderKeepsItWhenTheOtherLeaves) {
  entry(pack(0, -1, kSharedActive), kB);
  region_->devices[dev_].used_bytes.fetch_add(kB);
  ASSERT_GE(dead_slot(1, 0, 1), 0);  // another holder, not judged (no reaper runs here)
  ASSERT_EQ(shared_join(region_, slot_, dev_, kKey), 0);
  EXPECT_EQ(shared_leave(region_, slot_, 0), 0u);
  EXPECT_EQ(used(), kB);
  EXPECT_EQ(phase(), kSharedActive);
}

// The exporter killed between claiming the entry and charging it: the bytes
// are still its slot's, and go with it.
TEST_F(SharedAllocs, ExporterDeadBeforeChargingTheEntry) {
  const int dead = dead_slot(2, kB, 1);
  entry(pack(0, dead, kSharedClaiming), 0);
  EXPECT_EQ(reap_dead(region_, self_), 1);
  EXPECT_EQ(used(), 0u);
  EXPECT_EQ(phase(), kSharedFree);
}

// ... between charging the entry and taking the bytes from its slot: counted
// by both for an instant, closed by the reaper (nobody joins a claiming entry).
TEST_F(SharedAllocs, ExporterDeadBetweenChargingAndMoving) {
  const int dead = dead_slot(3, kB, 1);
  entry(pack(0, dead, kSharedClaiming), kB);
  EXPECT_EQ(reap_dead(region_, self_), 1);
  EXPECT_EQ(used(), 0u);
  EXPECT_EQ(shared_charged(region_, dev_), 0u);
}

// A holder killed while another lives: the entry and its bytes stay.
TEST_F(SharedAllocs, DeadHolderBesideALiveOneKeepsTheEntry) {
  entry(pack(0, -1, kSharedActive), kB);
  region_->devices[dev_].used_bytes.fetch_add(kB);
  dead_slot(4, 0, 1);
  ASSERT_EQ(shared_join(region_, slot_, dev_, kKey), 0);
  EXPECT_EQ(reap_dead(region_, self_), 1);
  EXPECT_EQ(used(), kB) << "we still hold it";
  EXPECT_EQ(phase(), kSharedActive);
  EXPECT_EQ(shared_leave(region_, slot_, 0), kB);
  EXPECT_EQ(used(), 0u);
}

// The last holder killed in the middle of closing, before or after it took
// the bytes out of the entry, and a reaper killed while closing: finished.
TEST_F(SharedAllocs, CloserDeadMidCloseIsFinished) {
  const int dead = dead_slot(5, 0, 0);
  entry(pack(0, dead, kSharedClosing), kB);
  region_->devices[dev_].used_bytes.fetch_add(kB);
  EXPECT_EQ(reap_dead(region_, self_), 1);
  EXPECT_EQ(used(), 0u);
  EXPECT_EQ(phase(), kSharedFree);
}

TEST_F(SharedAllocs, CloserDeadAfterTakingTheBytes) {
  const int dead = dead_slot(6, 0, 0);
  entry(pack(0, dead, kSharedClosing), 0);
  region_->devices[dev_].used_bytes.fetch_add(kB);  // its used -= b had not run
  EXPECT_EQ(reap_dead(region_, self_), 1);
  EXPECT_EQ(used(), 0u);
  EXPECT_EQ(phase(), kSharedFree);
}

TEST_F(SharedAllocs, ReaperDeadWhileClosingIsFinishedByTheNext) {
  entry(pack(0, -1, kSharedClosing), kB);
  region_->devices[dev_].used_bytes.fetch_add(kB);
  dead_slot(7, 0, 0);  // something to reap, so that a reaper runs
  EXPECT_EQ(reap_dead(region_, self_), 1);
  EXPECT_EQ(used(), 0u);
  EXPECT_EQ(phase(), kSharedFree);
}

// The table is in the region, which the container writes: an entry whose
// owner is no slot at all (a scribbled region) is read within the reaper's
// set of dead slots (under ASan an index past it fails the lane) and, since
// no slot can ever finish it, closed as abandoned.
TEST_F(SharedAllocs, AnOwnerPastTheSlotsIsAbandonedNeverAnIndex) {
  for (std::uint32_t e = 0; e < kMaxShared; ++e) {
    SharedAlloc& a = region_->shared[e];
    a.key.store(kKey + e);
    a.device.store(static_cast<std::uint32_t>(dev_));
    a.charged_bytes.store(0);
    a.state.store(pack(0, 0xfffff0 - static_cast<int>(e), e % 2 == 0 ? kSharedClaiming : kSharedClosing));
  }
  dead_slot(8, 0, 0);  // something to reap, so that a reaper runs
  EXPECT_EQ(reap_dead(region_, self_), 1);
  for (std::uint32_t e = 0; e < kMaxShared; ++e)
    EXPECT_EQ(region_->shared[e].state.load() & 0xff, kSharedFree) << "entry " << e;
}

}  // namespace
}  // namespace gpuslice::test
