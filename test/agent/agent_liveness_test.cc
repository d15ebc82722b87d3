// One definition of death (issue 32): the node agent reaps a slot only when
// the library would. Two processes whose device memory outlives what a pid
// says, each with the real gpuslice-agent running (20 ms cycles) against the
// simulated driver, which holds a process's memory as long as its files are
// open:
//   - a parent SIGKILLed after it forked a child that keeps the driver's
//     files (a DataLoader worker): its memory stays until the child exits;
//   - a process whose main thread left with pthread_exit while a worker
//     thread holds the memory: /proc/<pid> is a zombie leader, the thread
//     group still runs.
// A second process asking for more than the quota leaves must be refused
// while the memory is on the device, and admitted once it is gone.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "agent_test_util.h"
#include "platform/procfs.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Env;
using gpuslice::test::Sandbox;

namespace {

Env container_env(const Sandbox& box) {
  return test::merge(box.env(), {{"GPUSLICE_REGION", container_region(box)}, {"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
}

int busy_slots(const Region* r) {
  int n = 0;
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) n += r->slots[i].state.load() != kSlotFree;
  return n;
}

// The real agent, binary and all, for the life of a test.
class RunningAgent {
 public:
  explicit RunningAgent(const Sandbox& box) {
    mkdir(region_dir(box).c_str(), 0755);
    pid_ = test::spawn({test::bin("gpuslice-agent"), "--region-dir", region_dir(box), "--nvml", fake_nvml(),
                        "--interval", "20ms", "--listen", "off"},
                       box.env(false), box.path("agent.out"));
  }
  ~RunningAgent() {
    kill(pid_, SIGKILL);
    test::wait(pid_);
  }
  RunningAgent(const RunningAgent&) = delete;
  RunningAgent& operator=(const RunningAgent&) = delete;

 private:
  pid_t pid_ = -1;
};

// Waits until the agent has written its heartbeat into r `cycles` times more:
// it has had that many cycles to judge every slot.
bool agent_cycles(const Region* r, int cycles) {
  std::uint64_t last = r->header.agent_heartbeat_ns.load();
  int seen = 0;
  return eventually(
      [&] {
        const std::uint64_t now = r->header.agent_heartbeat_ns.load();
        if (now != last && now != 0) {
          last = now;
          ++seen;
        }
        return seen >= cycles;
      },
      20000);
}

// Gone, or a zombie that is the last of its threads (its files are closed).
bool gone(pid_t pid) {
  return eventually(
      [&] {
        platform::procfs::Stat st{};
        const int e = platform::procfs::read_stat(static_cast<std::uint32_t>(pid), &st);
        return e == ENOENT || e == ESRCH || (e == 0 && st.state == 'Z' && st.num_threads == 1);
      },
      10000);
}

// The leader is a zombie and its worker thread still runs.
bool zombie_leader_with_threads(pid_t pid) {
  return eventually(
      [&] {
        platform::procfs::Stat st{};
        return platform::procfs::read_stat(static_cast<std::uint32_t>(pid), &st) == 0 && st.state == 'Z' &&
               st.num_threads > 1;
      },
      10000);
}

test::Result alloc_32mi(const Env& env) {
  return test::run({test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(32 * kMi)}, env);
}

TEST(AgentLiveness, ForkedChildKeepsTheKilledParentsMemoryCounted) {
  Sandbox box;
  const Env env = container_env(box);
  RunningAgent agent(box);
  const std::string out = box.path("holder.out");
  const pid_t holder = test::spawn({test::bin("gpuslice-probe"), "holder", "fork-child", "48"}, env, out);
  std::string seen;
  ASSERT_TRUE(eventually(
      [&] {
        seen = read_file(out);
        return seen.find("child=") != std::string::npos;
      },
      20000))
      << seen;
  ASSERT_NE(seen.find("hold rc=0 child="), std::string::npos) << seen;
  const pid_t child = static_cast<pid_t>(std::stol(seen.substr(seen.find("child=") + 6)));
  ASSERT_GT(child, 0) << seen;
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  kill(holder, SIGKILL);
  test::wait(holder);

  // The agent has judged the dead parent's slot many times over.
  ASSERT_TRUE(agent_cycles(r, 10));
  EXPECT_EQ(busy_slots(r), 1) << "the agent reaped the slot whose memory the forked child still holds";
  // 48 MiB are still on the device: 32 MiB more would put the container at 80 MiB of 64.
  const test::Result refused = alloc_32mi(env);
  kill(child, SIGKILL);
  ASSERT_TRUE(gone(child));
  const test::Result fits = alloc_32mi(env);
  EXPECT_NE(refused.out.find("alloc rc=2"), std::string::npos)
      << "admitted while the dead parent's memory is still on the device (held by its forked child)\n"
      << refused.describe();
  EXPECT_NE(fits.out.find("alloc rc=0"), std::string::npos) << "the memory came back\n" << fits.describe();
  shm::detach(r);
}

TEST(AgentLiveness, ZombieLeaderWithARunningThreadIsNotReaped) {
  Sandbox box;
  const Env env = container_env(box);
  const std::string out = box.path("holder.out");
  const pid_t holder = test::spawn({test::bin("gpuslice-probe"), "holder", "main-exits", "48"}, env, out);
  std::string seen;
  ASSERT_TRUE(eventually(
      [&] {
        seen = read_file(out);
        return seen.find("hold rc=") != std::string::npos;
      },
      20000))
      << seen;
  ASSERT_NE(seen.find("hold rc=0"), std::string::npos) << seen;
  ASSERT_TRUE(zombie_leader_with_threads(holder));
  // An agent started now (or restarted: it is stateless) meets the zombie
  // leader in /proc first.
  RunningAgent agent(box);
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(agent_cycles(r, 10));
  EXPECT_EQ(busy_slots(r), 1) << "the agent reaped a process whose worker thread still holds its memory";
  const test::Result refused = alloc_32mi(env);
  kill(holder, SIGKILL);
  test::wait(holder);
  const test::Result fits = alloc_32mi(env);
  EXPECT_NE(refused.out.find("alloc rc=2"), std::string::npos)
      << "admitted while the process's worker thread still holds its memory on the device\n"
      << refused.describe();
  EXPECT_NE(fits.out.find("alloc rc=0"), std::string::npos) << "the memory came back\n" << fits.describe();
  shm::detach(r);
}

}  // namespace
