// Reaping dead slots exactly: processes SIGKILLed at random points, every
// instruction boundary of an accounting operation, dead reapers, racing reapers.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "limiter/memory_accounting.h"
#include "platform/procfs.h"
#include "support.h"

namespace gpuslice::test {
namespace {

using limiter::kReapBusy;
using limiter::reap_dead;

class Reaper : public RegionFixture {
 protected:
  void SetUp() override {
    RegionFixture::SetUp();
    slot_ = shm::claim_slot(region_, self_);
    ASSERT_GE(slot_, 0);
  }
  std::uint64_t used(int dev) const { return region_->devices[dev].used_bytes.load(); }
  std::uint64_t committed(int slot, int dev) const { return region_->slots[slot].committed_bytes[dev].load(); }
  int live_slots_except_mine() const {
    int n = 0;
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      if (static_cast<int>(i) != slot_ && region_->slots[i].state.load() != kSlotFree) ++n;
    }
    return n;
  }
  // A slot owned by an identity that is already dead, built while invisible
  // to reapers (claiming, no start time), then published.
  template <class F>
  int plant_dead_slot(std::uint64_t salt, F&& prepare) {
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      Slot& s = region_->slots[i];
      std::uint32_t free_state = kSlotFree;
      if (!s.state.compare_exchange_strong(free_state, kSlotClaiming)) continue;
      const shm::ProcessIdentity dead = dead_identity(self_, salt);
      s.pid.store(dead.pid);
      s.pidns_inode.store(dead.pidns_inode);
      prepare(static_cast<int>(i));
      s.start_time.store(dead.start_time);
      std::uint32_t claiming = kSlotClaiming;  // a reaper may already have judged it
      s.state.compare_exchange_strong(claiming, kSlotLive);
      return static_cast<int>(i);
    }
    return -1;
  }
  int slot_ = -1;
};

TEST_F(Reaper, NothingDeadNothingDone) {
  EXPECT_EQ(reap_dead(region_, self_), 0);
  EXPECT_EQ(region_->header.reaper_lock.load(), 0u);
}

TEST_F(Reaper, ExitedProcessIsReapedExactly) {
  const int dev = make_device(region_, 0, 1 << 20);
  ASSERT_TRUE(limiter::reserve(region_, slot_, dev, 1000, self_));
  const pid_t pid = fork_child([&] {
    shm::ProcessIdentity me{};
    shm::read_identity(0, &me);
    const int slot = shm::claim_slot(region_, me);
    return slot >= 0 && limiter::reserve(region_, slot, dev, 5000, me) ? 0 : 1;
  });
  ASSERT_EQ(wait_child(pid), 0);
  EXPECT_EQ(used(dev), 6000u);
  EXPECT_EQ(reap_dead(region_, self_), 1);
  EXPECT_EQ(used(dev), 1000u);
  EXPECT_EQ(live_slots_except_mine(), 0);
  EXPECT_EQ(region_->header.slots_reaped.load(), 1u);
  EXPECT_EQ(region_->header.live_slots.load(), 1u);
  EXPECT_EQ(region_->header.reaper_lock.load(), 0u);
  EXPECT_EQ(reap_dead(region_, self_), 0);
}

// A dead process whose forked child still has its files open (the driver's,
// and with them its device memory; here the region file's description that
// holds its slot lock) stays counted until that child is gone too.
TEST_F(Reaper, DeadProcessStaysCountedWhileItsForkedChildHoldsItsFiles) {
  const int dev = make_device(region_, 0, 1 << 20);
  ASSERT_TRUE(limiter::reserve(region_, slot_, dev, 1000, self_));
  const int own = open(path_.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(own, 0);
  const shm::Observer observer(self_, own);  // our own description shows the others' slot locks
  int hold[2];                               // the grandchild lives until the write end closes
  int report[2];                             // the child tells its child's pid
  ASSERT_EQ(pipe(hold), 0);
  ASSERT_EQ(pipe(report), 0);
  const pid_t pid = fork_child([&] {
    close(hold[1]);
    shm::ProcessIdentity me{};
    shm::read_identity(0, &me);
    const int fd = open(path_.c_str(), O_RDWR | O_CLOEXEC);
    const int slot = shm::claim_slot(region_, me);
    if (fd < 0 || slot < 0 || !limiter::reserve(region_, slot, dev, 5000, me) || !shm::lock_slot_file(fd, slot))
      return 1;
    const pid_t grandchild = fork();
    if (grandchild == 0) {
      char byte;
      while (read(hold[0], &byte, 1) > 0) {}
      _exit(0);
    }
    return write(report[1], &grandchild, sizeof grandchild) == sizeof grandchild ? 0 : 1;
  });
  close(hold[0]);
  ASSERT_EQ(wait_child(pid), 0);
  pid_t grandchild = -1;
  ASSERT_EQ(read(report[0], &grandchild, sizeof grandchild), static_cast<ssize_t>(sizeof grandchild));
  EXPECT_EQ(reap_dead(region_, observer), 0) << "dead, but its forked child holds its files";
  EXPECT_EQ(used(dev), 6000u);
  close(hold[1]);
  // Gone, or a zombie (reparented; its files are closed) that is the last of
  // its threads: either way released. A zombie leader alone is not enough:
  // its other threads (a sanitizer's background thread) may still be running
  // their exit, holding the files they share (CI saw this under TSan).
  bool gone = false;
  for (int i = 0; i < 500 && !gone; ++i) {
    gone = kill(grandchild, 0) != 0;
    platform::procfs::Stat st{};
    if (!gone && platform::procfs::read_stat(static_cast<std::uint32_t>(grandchild), &st) == 0 && st.state == 'Z' &&
        st.num_threads == 1)
      gone = true;
    if (!gone) usleep(10 * 1000);
  }
  ASSERT_TRUE(gone);
  EXPECT_EQ(reap_dead(region_, observer), 1);
  EXPECT_EQ(used(dev), 1000u);
  close(own);
  close(report[0]);
  close(report[1]);
}

// The heart of it: children in a tight reserve/release loop, SIGKILLed at
// random instructions; the reaper must restore the exact sum every time.
TEST_F(Reaper, SigkillAtRandomPointsIsRecoveredExactly) {
  const int d0 = make_device(region_, 0, std::uint64_t{1} << 40);
  const int d1 = make_device(region_, 1, kUnlimited);
  ASSERT_TRUE(limiter::reserve(region_, slot_, d0, 12345, self_));
  ASSERT_TRUE(limiter::reserve(region_, slot_, d1, 777, self_));
  std::mt19937_64 rng(2024);
  constexpr int kRounds = 50;
  constexpr int kChildren = 3;
  int zombie_rounds = 0;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<pid_t> pids;
    std::vector<std::unique_ptr<Signal>> ready;
    for (int c = 0; c < kChildren; ++c) {
      ready.push_back(std::make_unique<Signal>());
      Signal* r = ready.back().get();
      const std::uint64_t seed = rng();
      pids.push_back(fork_child([&, r, seed] {
        shm::ProcessIdentity me{};
        shm::read_identity(0, &me);
        const int slot = shm::claim_slot(region_, me);
        if (slot < 0) return 1;
        std::mt19937_64 local(seed);
        std::uint64_t held[2][16];
        int count[2] = {0, 0};
        r->notify();
        for (std::uint64_t i = 0;; ++i) {
          const int dev = static_cast<int>(local() & 1);
          const int which = dev == 0 ? d0 : d1;
          if (count[dev] == 16 || (count[dev] > 0 && (local() & 1))) {
            limiter::release(region_, slot, which, held[dev][--count[dev]]);
          } else {
            const std::uint64_t bytes = 1 + local() % 4096;
            const bool ok = (i % 7 == 0) ? limiter::charge(region_, slot, which, bytes) || true
                                         : limiter::reserve(region_, slot, which, bytes, me);
            if (ok) held[dev][count[dev]++] = bytes;
          }
        }
      }));
    }
    for (auto& r : ready) ASSERT_TRUE(r->wait(10000));
    for (pid_t pid : pids) {
      usleep(static_cast<useconds_t>(rng() % 300));
      kill(pid, SIGKILL);
    }
    const bool zombies = round % 3 == 0;  // nobody waits for them (a container without init)
    if (zombies) {
      ++zombie_rounds;
      for (int i = 0; i < 1000; ++i) {  // until they are really dead (zombies, every thread gone)
        bool all_dead = true;
        for (pid_t pid : pids) {
          platform::procfs::Stat st;
          if (platform::procfs::read_stat(static_cast<std::uint32_t>(pid), &st) != 0) continue;
          if (st.state != 'Z' || st.num_threads > 1) all_dead = false;
        }
        if (all_dead) break;
        usleep(1000);
      }
    } else {
      for (pid_t pid : pids) EXPECT_EQ(wait_child(pid), -SIGKILL);
    }
    ASSERT_EQ(reap_dead(region_, self_), kChildren) << "round " << round;
    ASSERT_EQ(used(d0), 12345u) << "round " << round;
    ASSERT_EQ(used(d1), 777u) << "round " << round;
    ASSERT_EQ(live_slots_except_mine(), 0);
    if (zombies) {
      for (pid_t pid : pids) EXPECT_EQ(wait_child(pid), -SIGKILL);
    }
  }
  EXPECT_GT(zombie_rounds, 0);
  EXPECT_EQ(region_->devices[d0].accounting_errors.load(), 0u);
  EXPECT_EQ(region_->devices[d1].accounting_errors.load(), 0u);
  limiter::release_all(region_, slot_);
  EXPECT_EQ(used(d0), 0u);
  EXPECT_EQ(used(d1), 0u);
}

// Every instruction boundary of every operation, deterministically: the
// atomic steps of reserve/charge, release and release_all, cut after k steps.
TEST_F(Reaper, DeathAfterEveryStepOfEveryOperation) {
  const int dev = make_device(region_, 0, 1 << 20);
  ASSERT_TRUE(limiter::reserve(region_, slot_, dev, 500, self_));
  enum class Op { reserve, release, release_all };
  std::uint64_t salt = 1;
  for (Op op : {Op::reserve, Op::release, Op::release_all}) {
    for (int steps = 0; steps <= 4; ++steps) {
      for (int concurrent = 1; concurrent <= 2; ++concurrent) {  // threads of the dead process mid-operation
        const int dead = plant_dead_slot(salt++, [&](int slot) {
          Slot& s = region_->slots[slot];
          DeviceState& d = region_->devices[dev];
          // What the dead process held when it was quiescent.
          d.used_bytes.fetch_add(1000);
          s.committed_bytes[dev].fetch_add(1000);
          for (int t = 0; t < concurrent; ++t) {
            const std::uint64_t b = op == Op::release_all ? 1000 / concurrent : 300;
            if (steps >= 1) s.seq.fetch_add(1);
            if (op == Op::reserve) {
              if (steps >= 2) d.used_bytes.fetch_add(b);
              if (steps >= 3) s.committed_bytes[dev].fetch_add(b);
            } else {
              if (steps >= 2) s.committed_bytes[dev].fetch_sub(b);
              if (steps >= 3) d.used_bytes.fetch_sub(b);
            }
            if (steps >= 4) s.seq.fetch_add(shm::kSeqGeneration - 1);
          }
        });
        ASSERT_GE(dead, 0);
        ASSERT_EQ(reap_dead(region_, self_), 1) << "op " << static_cast<int>(op) << " steps " << steps;
        ASSERT_EQ(used(dev), 500u) << "op " << static_cast<int>(op) << " steps " << steps;
        const Slot& s = region_->slots[dead];
        EXPECT_EQ(s.state.load(), kSlotFree);
        EXPECT_EQ(s.committed_bytes[dev].load(), 0u);
        EXPECT_EQ(s.seq.load() & shm::kSeqInflightMask, 0u);  // the next owner starts quiescent
        EXPECT_EQ(s.pid.load(), 0u);
      }
    }
  }
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 0u);
}

TEST_F(Reaper, ReserveReapsDeadSlotsThenSucceeds) {
  const int dev = make_device(region_, 0, 1 << 20);
  Signal ready;
  const pid_t pid = fork_child([&] {
    shm::ProcessIdentity me{};
    shm::read_identity(0, &me);
    const int slot = shm::claim_slot(region_, me);
    if (slot < 0 || !limiter::reserve(region_, slot, dev, 1 << 20, me)) return 1;
    ready.notify();
    pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10000));
  EXPECT_FALSE(limiter::reserve(region_, slot_, dev, 1, self_));  // the holder is alive: a real refusal
  EXPECT_EQ(region_->devices[dev].oom_refusals.load(), 1u);
  kill(pid, SIGKILL);
  EXPECT_EQ(wait_child(pid), -SIGKILL);
  EXPECT_TRUE(limiter::reserve(region_, slot_, dev, 1 << 20, self_));  // reaps, then admits
  EXPECT_EQ(region_->devices[dev].oom_refusals.load(), 1u);
  EXPECT_EQ(used(dev), 1u << 20);
  EXPECT_EQ(live_slots_except_mine(), 0);
}

TEST_F(Reaper, AllSlotsTakenByTheDead) {
  shm::release_slot(region_, slot_);
  const int dev = make_device(region_, 0, kUnlimited);
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
    const int slot = shm::claim_slot(region_, dead_identity(self_, i + 1));
    ASSERT_GE(slot, 0);
    region_->slots[slot].committed_bytes[dev].store(10);
    region_->devices[dev].used_bytes.fetch_add(10);
  }
  EXPECT_EQ(shm::claim_slot(region_, self_), -1);
  EXPECT_EQ(reap_dead(region_, self_), static_cast<int>(kMaxSlots));
  EXPECT_EQ(used(dev), 0u);
  EXPECT_GE(shm::claim_slot(region_, self_), 0);
  EXPECT_EQ(region_->header.live_slots.load(), 1u);
}

TEST_F(Reaper, OtherNamespacesAreLeftToTheAgent) {
  const int dev = make_device(region_, 0, kUnlimited);
  shm::ProcessIdentity foreign = dead_identity(self_);
  foreign.pidns_inode = self_.pidns_inode + 1;
  const int slot = shm::claim_slot(region_, foreign);
  ASSERT_GE(slot, 0);
  ASSERT_TRUE(limiter::charge(region_, slot, dev, 64));
  EXPECT_EQ(reap_dead(region_, self_), 0);
  EXPECT_EQ(used(dev), 64u);
  // The agent knows: its predicate decides.
  struct Ctx {
    int slot;
    Region* r;
  } ctx{slot, region_};
  auto is_dead = [](const Slot& s, shm::SlotLock, void* p) {
    auto* c = static_cast<Ctx*>(p);
    return &s == &c->r->slots[c->slot];
  };
  EXPECT_EQ(limiter::reap_slots(region_, is_dead, &ctx), 1);
  EXPECT_EQ(used(dev), 0u);
}

// A dead process of another namespace that died mid-operation: local reapers
// cannot take a consistent snapshot; they leave their dead slot marked and
// never block. The agent then finishes both, exactly.
TEST_F(Reaper, UnsettledSnapshotLeavesWorkForTheNext) {
  const int dev = make_device(region_, 0, kUnlimited);
  shm::ProcessIdentity foreign = dead_identity(self_);
  foreign.pidns_inode = self_.pidns_inode + 1;
  const int stuck = shm::claim_slot(region_, foreign);
  ASSERT_GE(stuck, 0);
  region_->slots[stuck].seq.fetch_add(1);
  region_->devices[dev].used_bytes.fetch_add(40);  // died after used, before committed
  const int local_dead = plant_dead_slot(99, [&](int s) {
    region_->slots[s].committed_bytes[dev].store(7);
    region_->devices[dev].used_bytes.fetch_add(7);
  });
  EXPECT_EQ(reap_dead(region_, self_), kReapBusy);
  EXPECT_EQ(region_->slots[local_dead].state.load(), kSlotReaping);
  EXPECT_EQ(region_->header.reaper_lock.load(), 0u);
  EXPECT_EQ(used(dev), 47u);
  auto is_dead = [](const Slot& s, shm::SlotLock, void* p) { return &s == static_cast<Slot*>(p); };
  EXPECT_EQ(limiter::reap_slots(region_, is_dead, &region_->slots[stuck]), 2);  // adopts the marked one
  EXPECT_EQ(used(dev), 0u);
}

TEST_F(Reaper, LiveLockHolderMeansBusy) {
  Signal ready, done;
  const pid_t pid = fork_child([&] {
    ready.notify();
    done.wait(10000);
    return 0;
  });
  ASSERT_TRUE(ready.wait(10000));
  shm::ProcessIdentity child{};
  ASSERT_TRUE(shm::read_identity(static_cast<std::uint32_t>(pid), &child));
  const int dead = plant_dead_slot(5, [](int) {});
  region_->header.reaper_lock.store(limiter::reaper_token(child));
  EXPECT_EQ(reap_dead(region_, self_), kReapBusy);
  EXPECT_EQ(region_->slots[dead].state.load(), kSlotLive);
  // Our own token: another thread of this process is reaping.
  region_->header.reaper_lock.store(limiter::reaper_token(self_));
  EXPECT_EQ(reap_dead(region_, self_), kReapBusy);
  // The holder dies: its lock is taken over.
  region_->header.reaper_lock.store(limiter::reaper_token(child));
  done.notify();
  EXPECT_EQ(wait_child(pid), 0);
  EXPECT_EQ(reap_dead(region_, self_), 1);
  EXPECT_EQ(region_->header.reaper_lock.load(), 0u);
}

// A reaper killed at each point of its own work: after marking, after fixing
// used_bytes, halfway through freeing. The next one finishes exactly once.
TEST_F(Reaper, DeadReaperIsFinishedExactlyOnce) {
  const int dev = make_device(region_, 0, kUnlimited);
  ASSERT_TRUE(limiter::charge(region_, slot_, dev, 3));
  for (int stage = 0; stage < 3; ++stage) {
    const int a = plant_dead_slot(100 + stage * 2, [&](int s) {
      region_->slots[s].committed_bytes[dev].store(100);
      region_->devices[dev].used_bytes.fetch_add(100);
    });
    const int b = plant_dead_slot(101 + stage * 2, [&](int s) {
      region_->slots[s].committed_bytes[dev].store(20);
      region_->slots[s].seq.fetch_add(1);              // died mid-reserve of 5,
      region_->devices[dev].used_bytes.fetch_add(25);  // after used, before committed
    });
    // The dead reaper's work so far.
    region_->slots[a].state.store(kSlotReaping);
    region_->slots[b].state.store(kSlotReaping);
    if (stage >= 1) region_->devices[dev].used_bytes.store(3);  // it had fixed used_bytes
    if (stage >= 2) {  // and freed one slot (counters and identity first, as the reaper does)
      region_->slots[a].committed_bytes[dev].store(0);
      region_->slots[a].start_time.store(0);
      region_->slots[a].pid.store(0);
      region_->slots[a].state.store(kSlotFree);
    }
    region_->header.reaper_lock.store(limiter::reaper_token(dead_identity(self_, 12345)));
    EXPECT_EQ(reap_dead(region_, self_), stage >= 2 ? 1 : 2) << "stage " << stage;
    EXPECT_EQ(used(dev), 3u) << "stage " << stage;
    EXPECT_EQ(region_->header.reaper_lock.load(), 0u);
    EXPECT_EQ(live_slots_except_mine(), 0);
  }
}

// Reapers racing each other and live allocators, while dead slots keep
// appearing (some mid-operation): at the end everything adds up to zero.
TEST_F(Reaper, RacingReapersAndAllocators) {
  const int dev = make_device(region_, 0, std::uint64_t{1} << 40);
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      const int slot = shm::claim_slot(region_, self_);  // live: our own identity
      std::mt19937_64 rng(static_cast<std::uint64_t>(w));
      std::vector<std::uint64_t> held;
      while (!stop.load()) {
        if (!held.empty() && (rng() & 1)) {
          limiter::release(region_, slot, dev, held.back());
          held.pop_back();
        } else if (held.size() < 32) {
          const std::uint64_t b = 1 + rng() % 1000;
          if (limiter::reserve(region_, slot, dev, b, self_)) held.push_back(b);
        }
      }
      for (std::uint64_t b : held) limiter::release(region_, slot, dev, b);
      shm::release_slot(region_, slot);
    });
  }
  std::atomic<int> reaped{0};
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&] {
      while (!stop.load()) {
        const int n = reap_dead(region_, self_);
        if (n > 0) reaped.fetch_add(n);
        std::this_thread::yield();
      }
    });
  }
  std::mt19937_64 rng(7);
  constexpr int kPlanted = 300;
  for (int i = 0; i < kPlanted; ++i) {
    const std::uint64_t held = rng() % 5000, inflight = rng() % 700;
    const int steps = static_cast<int>(rng() % 4);
    ASSERT_GE(plant_dead_slot(static_cast<std::uint64_t>(1000 + i),
                              [&](int s) {
                                Slot& slot = region_->slots[s];
                                region_->devices[dev].used_bytes.fetch_add(held);
                                slot.committed_bytes[dev].fetch_add(held);
                                if (steps >= 1) slot.seq.fetch_add(1);
                                if (steps >= 2) region_->devices[dev].used_bytes.fetch_add(inflight);
                                if (steps >= 3) slot.committed_bytes[dev].fetch_add(inflight);
                              }),
              0);
    if (i % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stop.store(true);
  for (auto& t : threads) t.join();
  for (int i = 0; i < 100 && live_slots_except_mine() != 0; ++i) {
    const int n = reap_dead(region_, self_);
    if (n > 0) reaped.fetch_add(n);
  }
  EXPECT_EQ(reaped.load(), kPlanted);
  EXPECT_EQ(live_slots_except_mine(), 0);
  EXPECT_EQ(used(dev), 0u);
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 0u);
}

// A start's sweep (issue 35): a few live slots judged, whatever the number
// of live processes; a dead one among them reaped exactly, one past the
// budget left for the next sweep, the agent or a full reap.
TEST_F(Reaper, SweepJudgesAtMostItsBudgetAndReapsWhatItFindsExactly) {
  const int dev = make_device(region_, 0, 1 << 30);
  ASSERT_TRUE(limiter::reserve(region_, slot_, dev, 1000, self_));
  while (shm::claim_slot(region_, self_) >= 0) {}  // every slot live: our own identity, alive
  const int d = (slot_ + 100) % static_cast<int>(kMaxSlots);
  shm::release_slot(region_, d);
  ASSERT_EQ(plant_dead_slot(7,
                            [&](int i) {
                              region_->slots[i].committed_bytes[dev].store(5000);
                              region_->devices[dev].used_bytes.fetch_add(5000);
                            }),
            d);
  ASSERT_EQ(used(dev), 6000u);
  const auto at = [](int i) { return static_cast<std::uint32_t>((i + kMaxSlots) % kMaxSlots); };
  EXPECT_EQ(limiter::reap_sweep(region_, self_, at(d + 1), 4), 0) << "not in its window";
  EXPECT_EQ(limiter::reap_sweep(region_, self_, at(d - 10), 4), 0) << "ten live slots before it: past the budget";
  EXPECT_EQ(limiter::reap_sweep(region_, self_, at(d - 100), 1000), 0) << "past the 64-slot window";
  EXPECT_EQ(used(dev), 6000u);
  EXPECT_EQ(region_->slots[d].state.load(), kSlotLive);
  EXPECT_EQ(limiter::reap_sweep(region_, self_, at(d - 3), 4), 1);
  EXPECT_EQ(used(dev), 1000u);
  EXPECT_EQ(region_->slots[d].state.load(), kSlotFree);
  EXPECT_EQ(live_slots_except_mine(), static_cast<int>(kMaxSlots) - 2);
  EXPECT_EQ(region_->header.reaper_lock.load(), 0u);
  EXPECT_EQ(region_->devices[dev].accounting_errors.load(), 0u);
}

}  // namespace
}  // namespace gpuslice::test
