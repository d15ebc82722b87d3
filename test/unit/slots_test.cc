// Process identity, liveness, slot claims and device entries.
#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <atomic>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "platform/procfs.h"
#include "support.h"

namespace gpuslice::test {
namespace {

using shm::Liveness;

// Field 22 of /proc/<pid>/stat, parsed independently of the library.
std::uint64_t start_time_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  std::istringstream fields(line.substr(line.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 22; ++i) fields >> field;
  return std::stoull(field);
}

TEST(Identity, Self) {
  shm::ProcessIdentity id{};
  ASSERT_TRUE(shm::read_identity(0, &id));
  EXPECT_EQ(id.pid, static_cast<std::uint32_t>(getpid()));
  EXPECT_EQ(id.start_time, start_time_of(getpid()));
  struct stat st;
  ASSERT_EQ(stat("/proc/self/ns/pid", &st), 0);
  EXPECT_EQ(id.pidns_inode, st.st_ino);
  shm::ProcessIdentity by_pid{};
  ASSERT_TRUE(shm::read_identity(static_cast<std::uint32_t>(getpid()), &by_pid));
  EXPECT_EQ(by_pid.pid, id.pid);
  EXPECT_EQ(by_pid.start_time, id.start_time);
  EXPECT_EQ(by_pid.pidns_inode, id.pidns_inode);
}

// comm may contain spaces and parentheses: fields resume after the last ')'.
TEST(Identity, CommWithSpacesAndParentheses) {
  Signal ready, done;
  const pid_t pid = fork_child([&] {
    prctl(PR_SET_NAME, "a) (b c) 3 4", 0, 0, 0);
    ready.notify();
    done.wait(10000);
    return 0;
  });
  ASSERT_TRUE(ready.wait(10000));
  shm::ProcessIdentity id{};
  ASSERT_TRUE(shm::read_identity(static_cast<std::uint32_t>(pid), &id));
  EXPECT_EQ(id.pid, static_cast<std::uint32_t>(pid));
  EXPECT_EQ(id.start_time, start_time_of(pid));
  done.notify();
  EXPECT_EQ(wait_child(pid), 0);
}

TEST(Identity, MissingProcess) {
  const pid_t pid = fork_child([] { return 0; });
  ASSERT_EQ(wait_child(pid), 0);
  shm::ProcessIdentity id{};
  EXPECT_FALSE(shm::read_identity(static_cast<std::uint32_t>(pid), &id));
}

class SlotLiveness : public RegionFixture {};

TEST_F(SlotLiveness, SelfIsAlive) {
  const int slot = shm::claim_slot(region_, self_);
  ASSERT_GE(slot, 0);
  EXPECT_EQ(shm::slot_liveness(region_->slots[slot], self_), Liveness::alive);
}

TEST_F(SlotLiveness, ReusedPidWithAnotherStartTimeIsDead) {
  const int slot = shm::claim_slot(region_, dead_identity(self_));
  ASSERT_GE(slot, 0);
  EXPECT_EQ(shm::slot_liveness(region_->slots[slot], self_), Liveness::dead);
}

TEST_F(SlotLiveness, ExitedAndZombieChildrenAreDead) {
  Signal ready;
  const pid_t pid = fork_child([&] {
    shm::ProcessIdentity me{};
    shm::read_identity(0, &me);
    const int slot = shm::claim_slot(region_, me);
    ready.notify();
    return slot >= 0 ? 0 : 1;
  });
  ASSERT_TRUE(ready.wait(10000));
  int slot = -1;
  for (int i = 0; i < static_cast<int>(kMaxSlots); ++i) {
    if (region_->slots[i].pid.load() == static_cast<std::uint32_t>(pid)) slot = i;
  }
  ASSERT_GE(slot, 0);
  // Not waited for yet: a zombie once it exits.
  for (int i = 0; i < 2000 && shm::slot_liveness(region_->slots[slot], self_) == Liveness::alive; ++i) usleep(1000);
  EXPECT_EQ(shm::slot_liveness(region_->slots[slot], self_), Liveness::dead);
  EXPECT_EQ(wait_child(pid), 0);
  EXPECT_EQ(shm::slot_liveness(region_->slots[slot], self_), Liveness::dead);
}

// After a SIGKILL (or pthread_exit in main) /proc/<pid> shows the thread
// group's leader as a zombie while its other threads still run — and still
// hold the address space and the device memory. Found by the chaos suite
// (kill class): such a process was reaped and its memory given to others.
TEST_F(SlotLiveness, ZombieLeaderWithLiveThreadsIsAlive) {
  int release[2];
  ASSERT_EQ(pipe(release), 0);
  Signal ready;
  const pid_t pid = fork_child([&] {
    shm::ProcessIdentity me{};
    shm::read_identity(0, &me);
    if (shm::claim_slot(region_, me) < 0) return 1;
    std::thread([fd = release[0]] {
      char c;
      while (read(fd, &c, 1) < 0 && errno == EINTR) {}
      _exit(0);  // the whole process, whatever helper threads a runtime (TSan) keeps
    }).detach();
    ready.notify();
    syscall(SYS_exit, 0);  // the leader thread alone ends (no unwinding); the process lives on
    return 1;
  });
  close(release[0]);
  ASSERT_TRUE(ready.wait(10000));
  int slot = -1;
  for (int i = 0; i < static_cast<int>(kMaxSlots); ++i) {
    if (region_->slots[i].pid.load() == static_cast<std::uint32_t>(pid)) slot = i;
  }
  ASSERT_GE(slot, 0);
  platform::procfs::Stat st;
  for (int i = 0; i < 2000 && platform::procfs::read_stat(static_cast<std::uint32_t>(pid), &st) == 0 && st.state != 'Z';
       ++i) {
    usleep(1000);
  }
  ASSERT_EQ(st.state, 'Z') << "the leader did not become a zombie";
  EXPECT_GE(st.num_threads, 2u);
  EXPECT_EQ(shm::slot_liveness(region_->slots[slot], self_), Liveness::alive) << "a thread still runs";
  ASSERT_EQ(write(release[1], "x", 1), 1);  // the last thread ends: now the process is gone
  close(release[1]);
  for (int i = 0; i < 2000 && shm::slot_liveness(region_->slots[slot], self_) == Liveness::alive; ++i) usleep(1000);
  EXPECT_EQ(shm::slot_liveness(region_->slots[slot], self_), Liveness::dead);
  EXPECT_EQ(wait_child(pid), 0);
}

TEST_F(SlotLiveness, OtherOrUnknownNamespaceIsUnknown) {
  shm::ProcessIdentity other = dead_identity(self_);
  other.pidns_inode = self_.pidns_inode + 1;
  const int a = shm::claim_slot(region_, other);
  ASSERT_GE(a, 0);
  EXPECT_EQ(shm::slot_liveness(region_->slots[a], self_), Liveness::unknown);
  other.pidns_inode = 0;
  const int b = shm::claim_slot(region_, other);
  ASSERT_GE(b, 0);
  EXPECT_EQ(shm::slot_liveness(region_->slots[b], self_), Liveness::unknown);
  shm::ProcessIdentity blind = self_;
  blind.pidns_inode = 0;  // an observer without /proc
  EXPECT_EQ(shm::slot_liveness(region_->slots[a], blind), Liveness::unknown);
}

// The one rule (shm::judge_liveness), over facts as /proc gives them: the
// library and the node agent both judge through it.
TEST(JudgeLiveness, OneRuleOverTheFacts) {
  constexpr std::uint64_t kNs = 4026531836u, kStart = 12345;
  auto facts = [](int error, char state, std::uint64_t threads, std::uint64_t start, std::uint64_t ns) {
    platform::procfs::Process p;
    p.error = error;
    p.stat.state = state;
    p.stat.num_threads = threads;
    p.stat.start_time = start;
    p.pidns_inode = ns;
    return p;
  };
  using shm::SlotLock;
  const auto judge = [&](const platform::procfs::Process& p, SlotLock lock) {
    return shm::judge_liveness(p, kNs, kStart, lock);
  };
  const auto running = facts(0, 'S', 4, kStart, kNs);
  const auto gone = facts(ENOENT, 0, 0, 0, 0);
  EXPECT_EQ(judge(running, SlotLock::unknown), Liveness::alive);
  EXPECT_EQ(judge(gone, SlotLock::unknown), Liveness::dead);
  EXPECT_EQ(judge(facts(ESRCH, 0, 0, 0, 0), SlotLock::free), Liveness::dead);
  EXPECT_EQ(judge(facts(EACCES, 0, 0, 0, 0), SlotLock::free), Liveness::alive) << "cannot be proved dead";
  // A forked child holds the slot's lock: alive whatever /proc says of the parent.
  EXPECT_EQ(judge(gone, SlotLock::held), Liveness::alive);
  EXPECT_EQ(judge(facts(0, 'Z', 1, kStart, kNs), SlotLock::held), Liveness::alive);
  // Zombies: dead as the last of their threads, alive while others run.
  EXPECT_EQ(judge(facts(0, 'Z', 1, kStart, kNs), SlotLock::free), Liveness::dead);
  EXPECT_EQ(judge(facts(0, 'X', 1, kStart, kNs), SlotLock::unknown), Liveness::dead);
  EXPECT_EQ(judge(facts(0, 'Z', 2, kStart, kNs), SlotLock::free), Liveness::alive);
  // The pid reused: another start time, or another namespace (when read).
  EXPECT_EQ(judge(facts(0, 'S', 1, kStart + 1, kNs), SlotLock::free), Liveness::dead);
  EXPECT_EQ(judge(facts(0, 'Z', 3, kStart + 1, kNs), SlotLock::free), Liveness::dead);
  EXPECT_EQ(judge(facts(0, 'S', 1, kStart, kNs + 1), SlotLock::free), Liveness::dead);
  EXPECT_EQ(judge(facts(0, 'S', 1, kStart, 0), SlotLock::free), Liveness::alive) << "namespace not read";
  // Start time 0 is unknown; a mask compares the low bits only.
  EXPECT_EQ(shm::judge_liveness(facts(0, 'S', 1, 999, kNs), kNs, 0, SlotLock::free), Liveness::alive);
  EXPECT_EQ(shm::judge_liveness(facts(0, 'S', 1, 0x100 | 0x2a, kNs), kNs, 0x2a, SlotLock::free, 0xff), Liveness::alive);
}

// The slot lock is probed through the descriptor the caller passes (the
// library's, or the node agent's own): nothing process-global.
TEST_F(SlotLiveness, SlotLockSeenThroughTheCallersOwnDescriptor) {
  const int slot = shm::claim_slot(region_, self_);
  ASSERT_GE(slot, 0);
  const int owner = open(path_.c_str(), O_RDWR | O_CLOEXEC);
  const int agent = open(path_.c_str(), O_RDONLY | O_CLOEXEC);  // an observer that never registered anything
  ASSERT_GE(owner, 0);
  ASSERT_GE(agent, 0);
  EXPECT_EQ(shm::probe_slot_lock(agent, slot), shm::SlotLock::free);
  ASSERT_TRUE(shm::lock_slot_file(owner, slot));
  EXPECT_EQ(shm::probe_slot_lock(agent, slot), shm::SlotLock::held);
  EXPECT_EQ(shm::probe_slot_lock(owner, slot), shm::SlotLock::free) << "its own description's lock is never reported";
  EXPECT_EQ(shm::probe_slot_lock(-1, slot), shm::SlotLock::unknown);
  EXPECT_EQ(shm::probe_slot_lock(agent, -1), shm::SlotLock::unknown);
  EXPECT_EQ(shm::slot_liveness(region_->slots[slot], shm::Observer(self_, agent), shm::SlotLock::held),
            Liveness::alive);
  shm::unlock_slot_file(owner, slot);
  EXPECT_EQ(shm::probe_slot_lock(agent, slot), shm::SlotLock::free);
  close(owner);
  close(agent);
}

class Slots : public RegionFixture {};

TEST_F(Slots, ClaimWritesIdentity) {
  const int slot = shm::claim_slot(region_, self_);
  ASSERT_GE(slot, 0);
  const Slot& s = region_->slots[slot];
  EXPECT_EQ(s.state.load(), kSlotLive);
  EXPECT_EQ(s.pid.load(), self_.pid);
  EXPECT_EQ(s.pidns_inode.load(), self_.pidns_inode);
  EXPECT_EQ(s.start_time.load(), self_.start_time);
  EXPECT_EQ(region_->header.live_slots.load(), 1u);
  shm::release_slot(region_, slot);
  EXPECT_EQ(s.state.load(), kSlotFree);
  EXPECT_EQ(s.pid.load(), 0u);
  EXPECT_EQ(region_->header.live_slots.load(), 0u);
}

TEST_F(Slots, AllSlotsThenNone) {
  std::set<int> seen;
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
    const int slot = shm::claim_slot(region_, dead_identity(self_, i + 1));
    ASSERT_GE(slot, 0);
    EXPECT_TRUE(seen.insert(slot).second);
  }
  EXPECT_EQ(shm::claim_slot(region_, self_), -1);
  shm::release_slot(region_, 500);
  EXPECT_EQ(shm::claim_slot(region_, self_), 500);
}

TEST_F(Slots, ReleaseKeepsSlotThatHoldsMemory) {
  const int slot = shm::claim_slot(region_, self_);
  ASSERT_GE(slot, 0);
  region_->slots[slot].committed_bytes[3].store(10);
  shm::release_slot(region_, slot);
  EXPECT_EQ(region_->slots[slot].state.load(), kSlotLive);  // left for the reaper
  region_->slots[slot].committed_bytes[3].store(0);
  region_->slots[slot].seq.store(1);  // an operation in flight
  shm::release_slot(region_, slot);
  EXPECT_EQ(region_->slots[slot].state.load(), kSlotLive);
  region_->slots[slot].seq.store(shm::kSeqGeneration);
  shm::release_slot(region_, slot);
  EXPECT_EQ(region_->slots[slot].state.load(), kSlotFree);
  shm::release_slot(region_, -1);  // ignored
  shm::release_slot(region_, static_cast<int>(kMaxSlots));
}

TEST_F(Slots, ThreadsClaimDistinctSlots) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = static_cast<int>(kMaxSlots) / kThreads;
  std::vector<std::vector<int>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        // Same pid for everybody: all start probing at the same slot.
        got[t].push_back(shm::claim_slot(region_, dead_identity(self_, static_cast<std::uint64_t>(t * 1000 + i + 1))));
      }
    });
  }
  for (auto& t : threads) t.join();
  std::set<int> all;
  for (const auto& v : got) {
    for (int s : v) {
      ASSERT_GE(s, 0);
      EXPECT_TRUE(all.insert(s).second) << "slot " << s << " claimed twice";
    }
  }
  EXPECT_EQ(all.size(), kMaxSlots);
  EXPECT_EQ(region_->header.live_slots.load(), kMaxSlots);
}

TEST_F(Slots, ProcessesClaimDistinctSlots) {
  constexpr int kChildren = 6;
  constexpr int kPerChild = 100;
  Signal go;
  std::vector<pid_t> pids;
  for (int c = 0; c < kChildren; ++c) {
    pids.push_back(fork_child([&, c] {
      go.close_write();
      go.wait(10000);
      for (int i = 0; i < kPerChild; ++i) {
        if (shm::claim_slot(region_, dead_identity(self_, static_cast<std::uint64_t>(c * 1000 + i + 1))) < 0) return 1;
      }
      return 0;
    }));
  }
  go.close_write();
  for (pid_t pid : pids) EXPECT_EQ(wait_child(pid), 0);
  std::set<std::uint64_t> start_times;
  int live = 0;
  for (const Slot& s : region_->slots) {
    if (s.state.load() != kSlotLive) continue;
    ++live;
    EXPECT_TRUE(start_times.insert(s.start_time.load()).second);
  }
  EXPECT_EQ(live, kChildren * kPerChild);
}

std::array<std::uint8_t, 16> uuid_of(int n) {
  std::array<std::uint8_t, 16> u{};
  u[0] = 0x42;
  u[15] = static_cast<std::uint8_t>(n);
  return u;
}

class Devices : public RegionFixture {};

TEST_F(Devices, ClaimFindAndFill) {
  const auto a = uuid_of(1), b = uuid_of(2);
  const int ia = shm::device_index(region_, a.data(), 1000, 30, SmPolicy::elastic);
  ASSERT_EQ(ia, 0);
  const DeviceState& d = region_->devices[ia];
  EXPECT_EQ(d.uuid_state.load(), shm::kDevicePublished);
  EXPECT_EQ(std::memcmp(d.uuid, a.data(), 16), 0);
  EXPECT_EQ(d.quota_bytes.load(), 1000u);
  EXPECT_EQ(d.sm_limit_pct.load(), 30u);
  EXPECT_EQ(d.sm_policy.load(), static_cast<std::uint32_t>(SmPolicy::elastic));
  EXPECT_EQ(d.cost_scale_ppm.load(), 1'000'000u);
  // Found again, the first process's settings stand.
  EXPECT_EQ(shm::device_index(region_, a.data(), 5, 5, SmPolicy::hard), ia);
  EXPECT_EQ(d.quota_bytes.load(), 1000u);
  EXPECT_EQ(shm::device_index(region_, b.data(), kUnlimited, 100, SmPolicy::hard), 1);
  for (int n = 3; n <= static_cast<int>(kMaxDevices); ++n) {
    EXPECT_EQ(shm::device_index(region_, uuid_of(n).data(), 1, 100, SmPolicy::hard), n - 1);
  }
  EXPECT_EQ(shm::device_index(region_, uuid_of(99).data(), 1, 100, SmPolicy::hard), -1);
  EXPECT_EQ(shm::device_index(region_, uuid_of(7).data(), 1, 100, SmPolicy::hard), 6);
}

TEST_F(Devices, StalledWriterIsAbandonedNotDuplicated) {
  // A writer that claimed entry 0 and died before publishing.
  region_->devices[0].uuid_state.store(shm::kDeviceWriting);
  const auto a = uuid_of(1);
  EXPECT_EQ(shm::device_index(region_, a.data(), 1, 100, SmPolicy::hard, 20'000'000), 1);
  EXPECT_EQ(region_->devices[0].uuid_state.load(), shm::kDeviceAbandoned);
  // Never waited for again, never reused.
  EXPECT_EQ(shm::device_index(region_, a.data(), 1, 100, SmPolicy::hard, 20'000'000), 1);
  EXPECT_EQ(shm::device_index(region_, uuid_of(2).data(), 1, 100, SmPolicy::hard, 20'000'000), 2);
}

TEST_F(Devices, ThreadsAgreeOnEntries) {
  constexpr int kThreads = 8;
  std::atomic<int> ready{0};
  std::vector<std::array<int, 8>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) {}
      for (int i = 0; i < 8; ++i) {
        const int n = (i + t) % 8;  // every thread in another order
        got[t][n] = shm::device_index(region_, uuid_of(n).data(), 1, 100, SmPolicy::hard);
      }
    });
  }
  for (auto& t : threads) t.join();
  std::set<int> distinct;
  for (int n = 0; n < 8; ++n) {
    for (int t = 1; t < kThreads; ++t) EXPECT_EQ(got[t][n], got[0][n]);
    distinct.insert(got[0][n]);
  }
  EXPECT_EQ(distinct.size(), 8u);
  EXPECT_EQ(*distinct.rbegin(), 7);  // no entry wasted
}

TEST_F(Devices, ProcessesAgreeOnEntries) {
  constexpr int kChildren = 6;
  Signal go;
  std::vector<pid_t> pids;
  for (int c = 0; c < kChildren; ++c) {
    pids.push_back(fork_child([&, c] {
      go.close_write();
      go.wait(10000);
      for (int i = 0; i < 10; ++i) {
        const int n = (i * 7 + c) % 10;
        if (shm::device_index(region_, uuid_of(n).data(), 1, 100, SmPolicy::hard) < 0) return 1;
      }
      return 0;
    }));
  }
  go.close_write();
  for (pid_t pid : pids) EXPECT_EQ(wait_child(pid), 0);
  std::set<int> seen;
  for (std::uint32_t i = 0; i < kMaxDevices; ++i) {
    const DeviceState& d = region_->devices[i];
    if (i < 10) {
      ASSERT_EQ(d.uuid_state.load(), shm::kDevicePublished) << i;
      EXPECT_TRUE(seen.insert(d.uuid[15]).second) << "UUID published twice";
    } else {
      EXPECT_EQ(d.uuid_state.load(), shm::kDeviceFree);
    }
  }
}

}  // namespace
}  // namespace gpuslice::test
