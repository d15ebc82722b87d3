// The region directory as the agent sees it: valid regions are watched,
// anything else is skipped with one log line and never crashes the agent
// (garbage, truncation under a live mapping, random contents), unused regions
// are removed after the grace period, and the agent runs without NVML.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "agent.h"
#include "agent_test_util.h"
#include "limiter/memory_accounting.h"
#include "region_io.h"
#include "scan.h"

using namespace std::string_literals;

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

std::string header_bytes_with(std::uint32_t abi) {
  RegionHeader h{};
  h.magic = kRegionMagic;
  h.abi_version = abi;
  h.header_size = sizeof(RegionHeader);
  h.total_size = sizeof(Region);
  h.max_devices = kMaxDevices;
  h.max_slots = kMaxSlots;
  std::string out(reinterpret_cast<const char*>(&h), sizeof h);
  return out;
}

int count_lines(const std::string& text, const std::string& needle) {
  int n = 0;
  for (std::size_t pos = 0; (pos = text.find(needle, pos)) != std::string::npos; pos += needle.size()) ++n;
  return n;
}

TEST(AgentRegions, MalformedAndForeignFilesAreSkippedWithOneLineEach) {
  Sandbox box;
  const std::string dir = region_dir(box);
  mkdir(dir.c_str(), 0755);
  Region* good = make_region(dir + "/pod-a/c.region", "good");
  ASSERT_NE(good, nullptr);
  shm::detach(good);
  write_file(dir + "/garbage.region", "this is not a region at all, just some text\n");
  write_file(dir + "/empty.region", "");
  write_file(dir + "/short.region", header_bytes_with(kRegionAbiVersion));  // a header and nothing else
  std::string abi = header_bytes_with(99);
  abi.resize(sizeof(Region), '\0');
  write_file(dir + "/abi.region", abi);
  std::string big = header_bytes_with(kRegionAbiVersion);
  big.resize(sizeof(Region) + 1, '\0');
  write_file(dir + "/big.region", big);
  ASSERT_EQ(symlink((dir + "/pod-a/c.region").c_str(), (dir + "/link.region").c_str()), 0);
  ASSERT_EQ(mkfifo((dir + "/pod-a/fifo.region").c_str(), 0600), 0);    // opening it must not block the agent
  write_file(dir + "/.c.region.123-0.tmp", "a region being created");  // hidden: ignored silently

  // Many rescans: still one line per bad file.
  test::Result r = test::run({"/usr/bin/timeout", "-s", "TERM", "1", test::bin("gpuslice-agent"), "--region-dir", dir,
                              "--no-nvml", "--interval", "10ms", "--rescan", "10ms", "--listen", "off"},
                             {}, 20000);
  EXPECT_EQ(r.exit_code, 124) << r.describe();  // timeout's status: the agent ran until told to stop
  EXPECT_EQ(count_lines(r.err, "skipping"), 7) << r.err;
  for (const char* f : {"garbage.region: bad magic", "empty.region: file holds only 0 bytes",
                        "short.region: wrong size", "abi.region: region ABI version 99", "big.region: wrong size",
                        "link.region: a symbolic link", "fifo.region: not a regular file"}) {
    EXPECT_EQ(count_lines(r.err, "/"s + f), 1) << f << "\n" << r.err;
  }
  EXPECT_EQ(count_lines(r.err, ".tmp"), 0) << r.err;
  EXPECT_EQ(count_lines(r.err, "watching region pod-a/c.region"), 1) << r.err;
  EXPECT_EQ(count_lines(r.err, "stopping (signal 15)"), 1) << r.err;
}

TEST(AgentRegions, FileTruncatedUnderTheMappingIsDroppedNotFatal) {
  Sandbox box;
  agent::Agent a(config_for(box, false));
  a.start();
  const std::string path = region_dir(box) + "/t.region";
  Region* r = make_region(path, "shrinking");
  ASSERT_NE(r, nullptr);
  add_device(r, 0x10, 64 * kMi);
  add_slot(r, static_cast<std::uint32_t>(getpid()), own_pidns(), 1);  // start time 1: "pid reused", dead
  shm::detach(r);
  a.cycle();
  EXPECT_EQ(a.stats().regions, 1u);
  ASSERT_EQ(truncate(path.c_str(), 4096), 0);  // the owner shrinks it: touching the mapping raises SIGBUS
  a.cycle();
  EXPECT_GE(a.stats().regions_dropped_truncated, 1u);
  EXPECT_EQ(a.stats().regions, 0u);
  EXPECT_NE(a.metrics_text().find("gpuslice_agent_regions 0"), std::string::npos);
  // Full size again: the header survived (the rest is zeros), so it is a
  // valid, emptied region and is watched again.
  ASSERT_EQ(truncate(path.c_str(), sizeof(Region)), 0);
  a.cycle();
  EXPECT_EQ(a.stats().regions, 1u);
}

// The guard does not save the signal mask per read (a system call): a fault
// must still leave the thread's mask as it was and the next fault caught too.
TEST(AgentRegions, GuardedFaultLeavesTheSignalMaskAsItWas) {
  Sandbox box;
  const std::string path = box.path("pages");
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 8192), 0);
  void* map = mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(map, MAP_FAILED);
  ASSERT_EQ(ftruncate(fd, 0), 0);  // every page of the mapping now faults
  sigset_t marker, before, after;
  sigemptyset(&marker);
  sigaddset(&marker, SIGUSR2);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &marker, &before), 0);
  const auto* bytes = static_cast<const volatile unsigned char*>(map);
  int sum = 0;
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(agent::guarded([&] { sum += bytes[4096 * (i % 2)]; })) << "fault " << i;
    ASSERT_EQ(pthread_sigmask(SIG_BLOCK, nullptr, &after), 0);
    EXPECT_EQ(sigismember(&after, SIGUSR2), 1) << "fault " << i;
    EXPECT_EQ(sigismember(&after, SIGBUS), 0) << "fault " << i;
  }
  EXPECT_TRUE(agent::guarded([&] { sum += 1; }));
  EXPECT_EQ(sum, 1);
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
  munmap(map, 8192);
  close(fd);
}

// /metrics writes each value as the shortest text that reads back as the
// same number ("%.17g" wrote 0.050000000000000003 for 0.05): the same
// series in fewer bytes (docs/scale.md, "Agent regions").
TEST(AgentMetrics, ValuesAreWrittenInTheirShortestText) {
  Sandbox box;
  agent::Agent a(config_for(box, false));
  a.start();
  Region* r = make_region(region_dir(box) + "/pod-s/s.region", "short");
  ASSERT_NE(r, nullptr);
  const int dev = add_device(r, 0x20, 64 * kMi, 40);
  r->devices[dev].util_permille.store(50);
  r->devices[dev].util_updated_ns.store(1);
  r->devices[dev].throttled_ns.store(1'100'000'000);
  r->header.priority_held_ns.store(300'000'000);
  shm::detach(r);
  a.cycle();
  const std::string text = a.metrics_text();
  const std::string labels = "{container=\"short\",region=\"pod-s/s.region\"";
  for (const char* line :
       {"gpuslice_sm_utilization_ratio", "gpuslice_throttled_seconds_total", "gpuslice_priority_held_seconds_total"}) {
    EXPECT_NE(text.find("\n"s + line + labels), std::string::npos) << line << " missing in\n" << text;
  }
  EXPECT_NE(text.find("\"} 0.05\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\"} 1.1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\"} 0.3\n"), std::string::npos) << text;
  // Every value: no shorter text gives the same double.
  std::istringstream in(text);
  std::string line;
  int checked = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::string value = line.substr(line.rfind(' ') + 1);
    const double v = std::strtod(value.c_str(), nullptr);
    char shortest[64];
    const auto end = std::to_chars(shortest, shortest + sizeof shortest, v).ptr;
    EXPECT_EQ(value, std::string(shortest, end)) << line;
    ++checked;
  }
  EXPECT_GT(checked, 20);
}

// A rescan does not list a pod directory unchanged since it was last listed
// (scan.h, DirMemo), and sees every change a container can make to it:
// a file added, one added with the old mtime forged back, one removed, and
// a region dropped meanwhile (truncated) is looked at again.
TEST(AgentRegions, AnUnchangedPodDirectoryIsNotListedAgainAndEveryChangeIsSeen) {
  Sandbox box;
  const std::string dir = region_dir(box);
  const std::string pod = dir + "/pod-a";
  Region* a = make_region(pod + "/a.region", "a");
  ASSERT_NE(a, nullptr);
  add_device(a, 0x30, 64 * kMi);
  shm::detach(a);
  auto age = [&](std::int64_t back_s) {  // the pod directory's mtime, back_s seconds ago
    timespec now{};
    clock_gettime(CLOCK_REALTIME, &now);
    const timespec t[2] = {{now.tv_sec - back_s, 0}, {now.tv_sec - back_s, 0}};
    ASSERT_EQ(utimensat(AT_FDCWD, pod.c_str(), t, 0), 0);
  };
  auto live = [](agent::RegionSet& set) {
    std::size_t n = 0;
    for (const auto& t : set.regions()) n += t->dropped ? 0 : 1;
    return n;
  };
  age(10);
  agent::RegionSet set(dir, 16);
  set.rescan();
  EXPECT_EQ(live(set), 1u);
  EXPECT_EQ(set.dirs_listed(), 1u);
  set.rescan();
  EXPECT_EQ(set.dirs_unchanged(), 1u) << "an unchanged directory is not listed again";
  EXPECT_EQ(set.dirs_listed(), 1u);
  EXPECT_EQ(live(set), 1u);
  // Dropped (as a truncated region is): looked at again, and watched again.
  set.drop(*set.regions().front(), "test");
  set.sweep();
  set.rescan();
  EXPECT_EQ(set.dirs_listed(), 2u);
  EXPECT_EQ(live(set), 1u);
  set.rescan();
  EXPECT_EQ(set.dirs_unchanged(), 2u);
  // A file added, the directory's mtime then set back to what it was: its
  // ctime tells.
  struct stat before {};
  ASSERT_EQ(stat(pod.c_str(), &before), 0);
  Region* b = make_region(pod + "/b.region", "b");
  ASSERT_NE(b, nullptr);
  shm::detach(b);
  const timespec same[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(utimensat(AT_FDCWD, pod.c_str(), same, 0), 0);
  set.rescan();
  EXPECT_EQ(set.dirs_listed(), 3u);
  EXPECT_EQ(live(set), 2u) << "the file added behind a forged mtime is watched";
  // A file removed (the directory's mtime moves; made old again, it settles).
  age(10);
  set.rescan();
  EXPECT_EQ(set.dirs_listed(), 4u);
  set.rescan();
  EXPECT_EQ(set.dirs_unchanged(), 3u);
  ASSERT_EQ(unlink((pod + "/b.region").c_str()), 0);
  set.rescan();
  EXPECT_EQ(set.dirs_listed(), 5u);
  EXPECT_EQ(live(set), 1u) << "the removed file is gone";
}

TEST(AgentRegions, UnusedRegionIsRemovedAfterTheGracePeriodAndKeptWhileUsed) {
  Sandbox box;
  auto cfg = config_for(box, false);
  cfg.grace_ns = 200'000'000;
  agent::Agent a(cfg);
  a.start();
  const std::string used_path = region_dir(box) + "/pod-u/used.region";
  const std::string idle_path = region_dir(box) + "/pod-i/idle.region";
  Region* used = make_region(used_path, "used");
  Region* idle = make_region(idle_path, "idle");
  ASSERT_TRUE(used && idle);
  shm::ProcessIdentity self{};
  ASSERT_TRUE(shm::read_identity(0, &self));
  ASSERT_GE(shm::claim_slot(used, self), 0);  // this process: alive
  shm::detach(idle);
  a.cycle();
  EXPECT_EQ(a.stats().regions, 2u);
  const std::string hidden = region_dir(box) + "/pod-i/.idle.region.gpuslice-removing";
  ASSERT_TRUE(eventually(
      [&] {
        a.cycle();
        return !file_exists(idle_path) && !file_exists(hidden);
      },
      5000));
  EXPECT_FALSE(file_exists(region_dir(box) + "/pod-i")) << "the pod's empty directory goes too";
  EXPECT_TRUE(file_exists(used_path));
  EXPECT_EQ(a.stats().regions_removed, 1u);
  for (int i = 0; i < 10; ++i) a.cycle();
  EXPECT_TRUE(file_exists(used_path)) << "a region with a live process is never removed";
  shm::detach(used);
}

TEST(AgentRegions, RegionInUseAgainWhileBeingRemovedIsPutBack) {
  Sandbox box;
  auto cfg = config_for(box, false);
  cfg.grace_ns = 1;  // as soon as it is empty
  agent::Agent a(cfg);
  a.start();
  const std::string path = region_dir(box) + "/again.region";
  const std::string hidden = region_dir(box) + "/.again.region.gpuslice-removing";
  Region* r = make_region(path, "again");
  ASSERT_NE(r, nullptr);
  a.cycle();  // empty since now
  a.cycle();  // grace over: renamed away
  ASSERT_TRUE(file_exists(hidden));
  ASSERT_FALSE(file_exists(path));
  shm::ProcessIdentity self{};
  ASSERT_TRUE(shm::read_identity(0, &self));
  ASSERT_GE(shm::claim_slot(r, self), 0);  // a process that had it open starts using it
  a.cycle();
  EXPECT_TRUE(file_exists(path)) << "back under its name";
  EXPECT_FALSE(file_exists(hidden));
  shm::detach(r);
}

// Chaos seed 134082 (`gap` class, agent at 5 ms): a process of a second wave
// opened the idle region, and before it claimed its slot the agent renamed
// the region away and unlinked it; the process then counted into the
// unlinked file while the rest of its container created a fresh one: its
// memory was in no region anybody reads. A process between attach and claim
// holds the region (shm::end_attach), and the agent never removes it.
TEST(AgentRegions, RegionAProcessIsJoiningIsNeverRemoved) {
  Sandbox box;
  auto cfg = config_for(box, false);
  cfg.grace_ns = 1;  // as soon as it is empty
  agent::Agent a(cfg);
  a.start();
  const std::string path = region_dir(box) + "/join.region";
  Region* old = make_region(path, "join");
  ASSERT_NE(old, nullptr);
  shm::detach(old);  // the first wave is gone
  a.cycle();         // empty since now
  // The second wave's process: the library's attach, not yet its claim.
  shm::Error err{};
  int fd = -1;
  Region* r = shm::attach(path.c_str(), "join", &err, nullptr, &fd);
  ASSERT_NE(r, nullptr) << err.message;
  ASSERT_GE(fd, 0);
  for (int i = 0; i < 5; ++i) a.cycle();  // past the grace, several times over
  shm::ProcessIdentity self{};
  ASSERT_TRUE(shm::read_identity(0, &self));
  const int slot = shm::claim_slot(r, self);
  ASSERT_GE(slot, 0);
  EXPECT_TRUE(shm::lock_slot_file(fd, slot));
  shm::end_attach(fd);
  struct stat joined {};
  struct stat named {};
  ASSERT_EQ(fstat(fd, &joined), 0);
  EXPECT_GT(joined.st_nlink, 0u) << "the region this process joined was unlinked";
  ASSERT_EQ(stat(path.c_str(), &named), 0) << "the region this process joined was removed";
  EXPECT_EQ(named.st_ino, joined.st_ino) << "the container's name resolves to another region";
  for (int i = 0; i < 3; ++i) a.cycle();  // in use: kept
  ASSERT_EQ(stat(path.c_str(), &named), 0);
  EXPECT_EQ(named.st_ino, joined.st_ino);
  EXPECT_EQ(a.stats().regions_removed, 0u);
  shm::release_slot(r, slot);
  close(fd);
  shm::detach(r);
}

// A forked child (a DataLoader worker) whose parent exited makes its first
// CUDA call after the agent removed the idle region: the child claims its
// slot under the joining lock, in the region its container's name names (a
// new one here), never in the unlinked file it inherited, where nobody
// would count it (issue 32: the fork path claimed without the joining lock).
TEST(AgentRegions, AForkedChildJoinsTheRegionItsContainerNames) {
  Sandbox box;
  auto cfg = config_for(box, false);
  cfg.grace_ns = 1;  // as soon as it is empty
  agent::Agent a(cfg);
  a.start();
  const std::string path = container_region(box);
  const std::string go = box.path("go");
  const std::string out = box.path("fork.out");
  const test::Env env = test::merge(box.env(), {{"GPUSLICE_REGION", path}, {"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
  const test::Result parent =
      test::wait(test::spawn({test::bin("gpuslice-probe"), "holder", "fork-late", go}, env, out), out);
  ASSERT_EQ(parent.exit_code, 0) << parent.describe();
  const std::size_t at = parent.out.find("forked child=");
  ASSERT_NE(at, std::string::npos) << parent.describe();
  const pid_t child = static_cast<pid_t>(std::stol(parent.out.substr(at + 13)));
  ASSERT_GT(child, 0);
  // The parent released its slot at exit: the region is idle, and removed.
  for (int i = 0; i < 5 && a.stats().regions_removed == 0; ++i) a.cycle();
  EXPECT_EQ(a.stats().regions_removed, 1u);
  ASSERT_FALSE(file_exists(path));
  write_file(go, "");
  std::string seen;
  const bool called = eventually(
      [&] {
        seen = read_file(out);
        return seen.find("child rc=") != std::string::npos;
      },
      20000);
  Region* r = called ? attach(path) : nullptr;
  int slots = 0;
  for (std::uint32_t i = 0; r != nullptr && i < kMaxSlots; ++i)
    slots += r->slots[i].state.load() == kSlotLive && r->slots[i].pid.load() == static_cast<std::uint32_t>(child);
  kill(child, SIGKILL);
  ASSERT_TRUE(called) << seen;
  ASSERT_NE(r, nullptr) << "the child's slot is in no region its container's name names\n" << seen;
  EXPECT_EQ(slots, 1) << "the child's slot is in no region its container's name names\n" << seen;
  shm::detach(r);
}

TEST(AgentRegions, RunsWithoutNvmlAndSaysSoOnce) {
  Sandbox box;
  const std::string dir = region_dir(box);
  mkdir(dir.c_str(), 0755);
  Region* r = make_region(dir + "/c.region", "no-nvml");
  ASSERT_NE(r, nullptr);
  const int dev = add_device(r, 0x20, 64 * kMi);
  r->devices[dev].agent_extra_bytes.store(5 * kMi);  // left by an agent that had NVML
  shm::detach(r);
  test::Result res =
      test::run({"/usr/bin/timeout", "-s", "TERM", "0.5", test::bin("gpuslice-agent"), "--region-dir", dir, "--nvml",
                 "/nonexistent/libnvidia-ml.so.1", "--interval", "10ms", "--listen", "off"},
                {}, 20000);
  EXPECT_EQ(res.exit_code, 124) << res.describe();
  EXPECT_EQ(count_lines(res.err, "running without NVML"), 1) << res.err;
  r = attach(dir + "/c.region");
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 0u) << "nobody refreshes it without NVML: cleared";
  EXPECT_NE(r->header.agent_heartbeat_ns.load(), 0u);
  shm::detach(r);
}

// Random and half-valid region files: the agent (in this process) and
// gpuslice-smi (a child) must survive every one of them.
TEST(AgentRegions, HostileRegionContentsNeverCrashTheAgentOrSmi) {
  Sandbox box;
  auto cfg = config_for(box, true);
  agent::Agent a(cfg);
  a.start();
  std::mt19937_64 rng(20240611);
  const std::string path = region_dir(box) + "/fuzz.region";
  std::string buf(sizeof(Region), '\0');
  auto fill_random = [&](std::size_t from, std::size_t to) {
    for (std::size_t i = from; i < to; i += 8) {
      const std::uint64_t v = rng();
      std::memcpy(&buf[i], &v, std::min<std::size_t>(8, to - i));
    }
  };
  // A plausible NVML view naming this process and pid 1, for reconciliation paths.
  agent::GpuSample sample;
  sample.devices.resize(1);
  uuid_bytes(0x40, sample.devices[0].uuid);
  sample.devices[0].uuid_text = agent::format_uuid(sample.devices[0].uuid);
  sample.devices[0].processes = {{static_cast<std::uint32_t>(getpid()), 10 * kMi, true}, {1, 3 * kMi, true}};
  sample.devices[0].util_busy_ns = {{static_cast<std::uint32_t>(getpid()), 50'000'000}};
  sample.devices[0].util_window_ns = 100'000'000;
  sample.devices[0].util_known = sample.devices[0].processes_known = sample.devices[0].device_util_known = true;
  const std::uint64_t ns = own_pidns();
  int smi_runs = 0;
  for (int iter = 0; iter < 240; ++iter) {
    const int mode = iter % 4;
    std::size_t size = sizeof(Region);
    if (mode == 0) {
      size = std::uniform_int_distribution<std::size_t>(0, 2 * sizeof(RegionHeader))(rng);
      buf.assign(size, '\0');
      fill_random(0, size);
      if (size >= 8 && (rng() & 1)) std::memcpy(&buf[0], &kRegionMagic, 8);
    } else {
      buf.assign(sizeof(Region), '\0');
      fill_random(0, sizeof(Region));
      std::string h = header_bytes_with(kRegionAbiVersion);
      std::memcpy(&buf[0], h.data(), offsetof(RegionHeader, container_name));
      if (mode == 2) buf[offsetof(RegionHeader, container_name) + 63] = '\0';  // a valid name (of random bytes)
      if (mode == 3) {
        // Slots naming processes of our namespace, alive or not: the reaper runs on garbage.
        for (std::uint32_t s = 0; s < kMaxSlots; s += 7) {
          const std::size_t base = offsetof(Region, slots) + s * sizeof(Slot);
          const std::uint32_t state = kSlotLive;
          const std::uint32_t pid =
              (rng() & 1) ? static_cast<std::uint32_t>(getpid()) : static_cast<std::uint32_t>(rng() % 4'000'000);
          std::memcpy(&buf[base + offsetof(Slot, state)], &state, 4);
          std::memcpy(&buf[base + offsetof(Slot, pid)], &pid, 4);
          std::memcpy(&buf[base + offsetof(Slot, pidns_inode)], &ns, 8);
        }
        const std::uint32_t published = shm::kDevicePublished;
        std::memcpy(&buf[offsetof(Region, devices) + offsetof(DeviceState, uuid_state)], &published, 4);
        std::memcpy(&buf[offsetof(Region, devices) + offsetof(DeviceState, uuid)], sample.devices[0].uuid, 16);
      }
      if (rng() % 8 == 0) buf[rng() % sizeof(RegionHeader)] ^= static_cast<char>(1u << (rng() % 8));  // header bit flip
    }
    unlink(path.c_str());
    write_file(path, buf);
    a.cycle_with(&sample);
    if (rng() % 3 == 0) a.cycle_with(nullptr);
    ASSERT_LT(a.metrics_text().size(), std::size_t{1} << 24);
    if (iter % 12 == 0) {
      ++smi_runs;
      for (const char* format : {"--json", "--region"}) {
        std::vector<std::string> argv{test::bin("gpuslice-smi"), "--region", path};
        if (std::string(format) == "--json") argv.push_back("--json");
        test::Result r = test::run(argv, {}, 20000);
        ASSERT_TRUE(r.exit_code == 0 || r.exit_code == 2) << r.describe();
        EXPECT_EQ(r.signal, 0) << r.describe();
        if (r.exit_code == 0 && argv.back() == "--json") {
          EXPECT_FALSE(nlohmann::json::parse(r.out, nullptr, false).is_discarded()) << r.out.substr(0, 400);
        }
        if (r.exit_code == 2) {
          EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
        }
      }
    }
  }
  EXPECT_EQ(smi_runs, 20);
  // The smi view of a whole directory of bad files, too.
  test::Result r = test::run({test::bin("gpuslice-smi"), "--region-dir", region_dir(box)}, {}, 20000);
  EXPECT_TRUE(r.exit_code == 0) << r.describe();
}

}  // namespace
