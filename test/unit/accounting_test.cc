// Reserve / release / charge on the shared region: exact at the quota, under
// threads and under processes.
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "limiter/memory_accounting.h"
#include "support.h"

namespace gpuslice::test {
namespace {

using limiter::charge;
using limiter::release;
using limiter::reserve;

class Accounting : public RegionFixture {
 protected:
  void SetUp() override {
    RegionFixture::SetUp();
    slot_ = shm::claim_slot(region_, self_);
    ASSERT_GE(slot_, 0);
  }
  std::uint64_t committed(int slot, int dev) const { return region_->slots[slot].committed_bytes[dev].load(); }
  std::uint64_t sum_committed(int dev) const {
    std::uint64_t sum = 0;
    for (const Slot& s : region_->slots) sum += s.committed_bytes[dev].load();
    return sum;
  }
  int slot_ = -1;
};

TEST_F(Accounting, WholeQuotaUsableToTheByte) {
  const int dev = make_device(region_, 0, 1000);
  ASSERT_GE(dev, 0);
  EXPECT_TRUE(reserve(region_, slot_, dev, 600, self_));
  EXPECT_TRUE(reserve(region_, slot_, dev, 399, self_));
  EXPECT_TRUE(reserve(region_, slot_, dev, 1, self_));
  EXPECT_EQ(limiter::used_bytes(region_, dev), 1000u);
  EXPECT_FALSE(reserve(region_, slot_, dev, 1, self_));
  EXPECT_EQ(region_->devices[dev].oom_refusals.load(), 1u);
  EXPECT_EQ(limiter::used_bytes(region_, dev), 1000u);
  release(region_, slot_, dev, 1);
  EXPECT_TRUE(reserve(region_, slot_, dev, 1, self_));
  EXPECT_FALSE(reserve(region_, slot_, dev, ~std::uint64_t{0}, self_));  // no overflow into admission
  EXPECT_EQ(committed(slot_, dev), 1000u);
  EXPECT_EQ(region_->devices[dev].peak_used_bytes.load(), 1000u);
  release(region_, slot_, dev, 1000);
  EXPECT_EQ(limiter::used_bytes(region_, dev), 0u);
  EXPECT_EQ(committed(slot_, dev), 0u);
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 0u);
  EXPECT_EQ(limiter::quota_bytes(region_, dev), 1000u);
}

TEST_F(Accounting, BiggerThanQuotaIsRefusedAtOnce) {
  const int dev = make_device(region_, 0, 1000);
  EXPECT_FALSE(reserve(region_, slot_, dev, 1001, self_));
  EXPECT_EQ(region_->devices[dev].oom_refusals.load(), 1u);
  EXPECT_FALSE(limiter::try_reserve(region_, slot_, dev, 1001));
  EXPECT_EQ(region_->devices[dev].oom_refusals.load(), 1u);  // try_reserve does not count
}

TEST_F(Accounting, UnlimitedStillCounts) {
  const int dev = make_device(region_, 0, kUnlimited);
  EXPECT_TRUE(reserve(region_, slot_, dev, std::uint64_t{1} << 62, self_));
  EXPECT_TRUE(reserve(region_, slot_, dev, std::uint64_t{1} << 62, self_));
  EXPECT_EQ(limiter::used_bytes(region_, dev), std::uint64_t{1} << 63);
  EXPECT_FALSE(reserve(region_, slot_, dev, std::uint64_t{1} << 63, self_));  // would wrap
  EXPECT_EQ(limiter::quota_bytes(region_, dev), kUnlimited);
}

TEST_F(Accounting, AgentExtraCountsAgainstQuota) {
  const int dev = make_device(region_, 0, 1000);
  region_->devices[dev].agent_extra_bytes.store(300);
  EXPECT_FALSE(reserve(region_, slot_, dev, 701, self_));
  EXPECT_TRUE(reserve(region_, slot_, dev, 700, self_));
  EXPECT_EQ(limiter::used_bytes(region_, dev), 1000u);
  region_->devices[dev].agent_extra_bytes.store(5000);
  EXPECT_FALSE(reserve(region_, slot_, dev, 1, self_));
  EXPECT_EQ(limiter::used_bytes(region_, dev), 5700u);
}

TEST_F(Accounting, ReleaseNeverUnderflows) {
  const int dev = make_device(region_, 0, 1000);
  ASSERT_TRUE(reserve(region_, slot_, dev, 100, self_));
  release(region_, slot_, dev, 250);  // more than committed: clamped, counted
  EXPECT_EQ(committed(slot_, dev), 0u);
  EXPECT_EQ(limiter::used_bytes(region_, dev), 0u);
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 1u);
  release(region_, slot_, dev, 1);
  EXPECT_EQ(limiter::used_bytes(region_, dev), 0u);
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 2u);
  // used damaged below committed (by hand): still no wrap-around.
  ASSERT_TRUE(reserve(region_, slot_, dev, 100, self_));
  region_->devices[dev].used_bytes.store(10);
  release(region_, slot_, dev, 100);
  EXPECT_EQ(limiter::used_bytes(region_, dev), 0u);
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 3u);
  release(region_, slot_, dev, 0);
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 3u);
}

TEST_F(Accounting, ChargeIgnoresQuotaButSaysSo) {
  const int dev = make_device(region_, 0, 1000);
  EXPECT_TRUE(charge(region_, slot_, dev, 1000));
  EXPECT_FALSE(charge(region_, slot_, dev, 1));
  EXPECT_EQ(limiter::used_bytes(region_, dev), 1001u);
  EXPECT_EQ(committed(slot_, dev), 1001u);
  EXPECT_FALSE(limiter::try_reserve(region_, slot_, dev, 1));
  release(region_, slot_, dev, 1001);
  EXPECT_EQ(limiter::used_bytes(region_, dev), 0u);
}

TEST_F(Accounting, ReleaseAllAndBadArguments) {
  const int d0 = make_device(region_, 0, 1000), d1 = make_device(region_, 1, kUnlimited);
  ASSERT_TRUE(reserve(region_, slot_, d0, 10, self_));
  ASSERT_TRUE(reserve(region_, slot_, d1, 20, self_));
  region_->slots[slot_].context_bytes[d1].store(5);
  limiter::release_all(region_, slot_);
  EXPECT_EQ(limiter::used_bytes(region_, d0), 0u);
  EXPECT_EQ(limiter::used_bytes(region_, d1), 0u);
  EXPECT_EQ(region_->slots[slot_].context_bytes[d1].load(), 0u);
  EXPECT_FALSE(reserve(region_, -1, d0, 1, self_));
  EXPECT_FALSE(reserve(region_, slot_, 16, 1, self_));
  EXPECT_FALSE(reserve(nullptr, slot_, d0, 1, self_));
  EXPECT_FALSE(charge(region_, static_cast<int>(kMaxSlots), d0, 1));
  release(region_, slot_, -3, 1);
  EXPECT_EQ(limiter::used_bytes(region_, 99), 0u);
  EXPECT_EQ(limiter::quota_bytes(region_, -1), kUnlimited);
}

// Threads with their own slots, or sharing one (threads of one process do).
void race_threads(Region* r, const shm::ProcessIdentity& self, int dev, std::uint64_t quota, bool shared_slot) {
  constexpr int kThreads = 8;
  constexpr int kIterations = 20000;
  const int common = shm::claim_slot(r, self);
  ASSERT_GE(common, 0);
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> max_seen{0};
  std::thread watcher([&] {
    while (!stop.load()) {
      const std::uint64_t used = r->devices[dev].used_bytes.load();
      if (used > max_seen.load()) max_seen.store(used);
    }
  });
  std::vector<std::thread> threads;
  std::atomic<std::uint64_t> granted{0}, refused{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const int slot =
          shared_slot ? common : shm::claim_slot(r, dead_identity(self, static_cast<std::uint64_t>(t + 1)));
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      std::vector<std::uint64_t> held;
      for (int i = 0; i < kIterations; ++i) {
        if (!held.empty() && (rng() % 2 == 0 || held.size() > 8)) {
          limiter::release(r, slot, dev, held.back());
          held.pop_back();
        } else {
          const std::uint64_t bytes = 1 + rng() % (quota / 6);
          if (limiter::try_reserve(r, slot, dev, bytes)) {
            held.push_back(bytes);
            granted.fetch_add(1);
          } else {
            refused.fetch_add(1);
          }
        }
      }
      for (std::uint64_t b : held) limiter::release(r, slot, dev, b);
    });
  }
  for (auto& t : threads) t.join();
  stop.store(true);
  watcher.join();
  EXPECT_LE(max_seen.load(), quota);
  EXPECT_LE(r->devices[dev].peak_used_bytes.load(), quota);
  EXPECT_GT(refused.load(), 0u);  // the quota was actually contended
  EXPECT_GT(granted.load(), 0u);
  EXPECT_EQ(r->devices[dev].used_bytes.load(), 0u);
  EXPECT_EQ(r->devices[dev].accounting_errors.load(), 0u);
  for (const Slot& s : r->slots) {
    EXPECT_EQ(s.committed_bytes[dev].load(), 0u);
    EXPECT_EQ(s.seq.load() & shm::kSeqInflightMask, 0u);
  }
}

TEST_F(Accounting, ThreadsWithOwnSlotsNeverExceedQuota) {
  race_threads(region_, self_, make_device(region_, 0, 1 << 20), 1 << 20, false);
}

TEST_F(Accounting, ThreadsSharingOneSlotNeverExceedQuota) {
  race_threads(region_, self_, make_device(region_, 0, 1 << 20), 1 << 20, true);
}

TEST_F(Accounting, ProcessesNeverExceedQuota) {
  constexpr std::uint64_t kQuota = 1 << 20;
  constexpr int kChildren = 6;
  const int dev = make_device(region_, 0, kQuota);
  Signal go;
  std::vector<pid_t> pids;
  for (int c = 0; c < kChildren; ++c) {
    pids.push_back(fork_child([&, c] {
      go.close_write();
      go.wait(10000);
      shm::ProcessIdentity me{};
      shm::read_identity(0, &me);
      const int slot = shm::claim_slot(region_, me);
      if (slot < 0) return 1;
      std::mt19937_64 rng(static_cast<std::uint64_t>(c));
      std::vector<std::uint64_t> held;
      std::uint64_t mine = 0;
      for (int i = 0; i < 8000; ++i) {
        if (region_->devices[dev].used_bytes.load() > kQuota) return 2;
        if (!held.empty() && (rng() % 2 == 0 || held.size() > 8)) {
          limiter::release(region_, slot, dev, held.back());
          mine -= held.back();
          held.pop_back();
        } else {
          const std::uint64_t bytes = 1 + rng() % (kQuota / 5);
          if (limiter::reserve(region_, slot, dev, bytes, me)) {
            held.push_back(bytes);
            mine += bytes;
          }
        }
        if (region_->slots[slot].committed_bytes[dev].load() != mine) return 3;
      }
      // Half of the children exit holding memory (a clean exit without frees).
      if (c % 2 == 0) limiter::release_all(region_, slot);
      return 0;
    }));
  }
  go.close_write();
  for (pid_t pid : pids) EXPECT_EQ(wait_child(pid), 0);
  EXPECT_LE(region_->devices[dev].peak_used_bytes.load(), kQuota);
  EXPECT_EQ(region_->devices[dev].used_bytes.load(), sum_committed(dev));
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 0u);
  // The exited holders are reaped (some already by their siblings' refused
  // reservations): exactly nothing is left.
  EXPECT_GE(limiter::reap_dead(region_, self_), 0);
  EXPECT_EQ(region_->header.slots_reaped.load(), static_cast<std::uint64_t>(kChildren));
  EXPECT_EQ(region_->devices[dev].used_bytes.load(), 0u);
}

}  // namespace
}  // namespace gpuslice::test
