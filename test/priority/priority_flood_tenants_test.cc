// Tenants next to a flooded priority board (docs/priority.md, "What a scan
// costs"): what a tenant writes into its own level's directory costs the
// others nothing per file, and cannot hide a tenant of another level. The cost
// is measured deterministically with inotify (the files opened, the directory
// reads), not with a clock. Label `timing` (tenant processes on the simulated
// device), but nothing here depends on the machine's load except the held test's
// generous shares.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpuslice/priority_board.h"
#include "gpuslice/region.h"
#include "scenarios.h"
#include "shm/priority_board.h"
#include "shm/region_file.h"

namespace {

using namespace gpuslice::test;
using namespace gpuslice::test::limiter;

constexpr std::uint64_t kMs = 1'000'000;

Container tenant(const Machine& m, const std::string& name, const std::string& priority, Proc proc) {
  Container c;
  c.name = name;
  c.procs = {proc};
  c.extra = {{"GPUSLICE_PRIORITY_BOARD", m.sandbox().path("board")}};
  if (!priority.empty()) c.extra["GPUSLICE_PRIORITY"] = priority;
  return c;
}

std::vector<std::string> list(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') names.push_back(e->d_name);
  closedir(d);
  return names;
}

// The simulated device's "GPU-…" name, from the files of a low tenant killed
// before it could remove them (its activity file and its level's lease
// file), which go.
std::string device_uuid(Machine& m) {
  const auto r = m.run({tenant(m, "probe", "low", Proc{spin("kernel", 200, 5.0, "symbol", 1.0), 0, 0.4})});
  std::string uuid;
  for (const std::string& name : list(m.sandbox().path("board") + "/low")) {
    uuid = name.substr(0, name.find('.'));
    unlink((m.sandbox().path("board") + "/low/" + name).c_str());
  }
  return uuid;
}

// `count` empty files named like activity files of the device, in `dir`,
// whose directory then looks unchanged for a while (mtime 10 s ago).
void flood(const std::string& dir, const std::string& uuid, int count) {
  mkdir(dir.c_str(), 01777);
  for (int i = 0; i < count; ++i) {
    const std::string path = dir + "/" + uuid + ".f-" + std::to_string(i) + ".act";
    close(open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644));
  }
  struct timespec t[2];
  clock_gettime(CLOCK_REALTIME, &t[0]);
  t[0].tv_sec -= 10;
  t[1] = t[0];
  utimensat(AT_FDCWD, dir.c_str(), t, 0);
}

struct Events {
  int opens = 0;      // files of the directory opened
  int dir_reads = 0;  // reads of the directory itself (getdents)
  bool overflow = false;
};

Events drain(int fd) {
  Events ev;
  alignas(inotify_event) char buf[65536];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break;
    for (ssize_t off = 0; off < n;) {
      const auto* e = reinterpret_cast<const inotify_event*>(buf + off);
      off += static_cast<ssize_t>(sizeof *e + e->len);
      if (e->mask & IN_Q_OVERFLOW) ev.overflow = true;
      if ((e->mask & IN_OPEN) && !(e->mask & IN_ISDIR)) ++ev.opens;
      if ((e->mask & IN_ACCESS) && (e->mask & IN_ISDIR)) ++ev.dir_reads;
    }
  }
  return ev;
}

// A high tenant launching for 1.5 s next to `files` empty files in low/:
// none is ever opened (neither on its launch path nor by its background
// refresh), and the directory is read for one pass only (it does not change).
// Before: every file was opened, fstat'ed and closed every 100 ms.
void high_next_to_a_flood(int files) {
  Machine m;
  const std::string uuid = device_uuid(m);
  ASSERT_FALSE(uuid.empty());
  const std::string low = m.sandbox().path("board") + "/low";
  flood(low, uuid, files);
  const int in = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  ASSERT_GE(in, 0);
  ASSERT_GE(inotify_add_watch(in, low.c_str(), IN_OPEN | IN_ACCESS), 0);
  const auto r = m.run({tenant(m, "high", "high", Proc{spin("kernel", 200, 1.5, "symbol", 2.0), 0, 0})});
  ASSERT_EQ(r[0].procs[0].result.exit_code, 0) << r[0].procs[0].result.describe();
  const Events ev = drain(in);
  close(in);
  EXPECT_FALSE(ev.overflow);
  EXPECT_EQ(ev.opens, 0) << "files of low/ opened next to a flood of " << files;
  // One pass: ~80-byte entries, 4 KiB per read, plus the read that ends it.
  const int one_pass = files * 80 / 4096 + 2;
  EXPECT_LE(ev.dir_reads, one_pass) << files << " files";
  EXPECT_GT(ev.dir_reads, 0);  // it did look (the measure is real)
}

TEST(PriorityFlood, TwoThousandFilesInLowAreNeverOpenedByAHighTenant) { high_next_to_a_flood(2000); }
TEST(PriorityFlood, TwentyThousandFilesInLowAreNeverOpenedByAHighTenant) { high_next_to_a_flood(20000); }

// Files in low/ cannot hide a high tenant from a normal one: neither 32 files
// of live writers (this test holds their liveness locks, as a low container
// would) nor 10,000 more: levels have separate tables. Before, 32 files filled
// the one shared table and the normal tenant was never held.
TEST(PriorityFlood, FilesInLowCannotHideHighFromNormal) {
  Machine m;
  const std::string uuid = device_uuid(m);
  ASSERT_FALSE(uuid.empty());
  const std::string low = m.sandbox().path("board") + "/low";
  flood(low, uuid, 10000);
  std::vector<int> held;
  for (int i = 0; i < 32; ++i) {
    char name[gpuslice::shm::kBoardNameMax];
    ASSERT_TRUE(gpuslice::shm::activity_name(uuid.c_str(), 7, static_cast<std::uint64_t>(i), name));
    gpuslice::shm::Error err{};
    const int fd = gpuslice::shm::open_own_activity(m.sandbox().path("board").c_str(), gpuslice::Priority::low, name,
                                                    "flood", &err);
    ASSERT_GE(fd, 0) << err.message;
    held.push_back(fd);
  }
  const auto r = m.run({tenant(m, "normal", "", Proc{spin("kernel", 1000, 2.2, "symbol", 20.0), 0, 0}),
                        tenant(m, "high", "high", Proc{spin("kernel", 200, 1.0, "symbol", 2.0), 0.6, 0})});
  for (int fd : held) close(fd);
  const ProcResult& normal = r[0].procs[0];
  const ProcResult& high = r[1].procs[0];
  ASSERT_EQ(normal.result.exit_code, 0) << normal.result.describe();
  ASSERT_EQ(high.result.exit_code, 0) << high.result.describe();
  gpuslice::shm::Error err{};
  gpuslice::Region* region = gpuslice::shm::attach_existing(m.region_path("normal").c_str(), false, &err);
  ASSERT_NE(region, nullptr) << err.message;
  const std::uint64_t held_ns = region->header.priority_held_ns.load();
  gpuslice::shm::detach(region);
  EXPECT_GT(held_ns, 100 * kMs) << "the normal tenant was never held";
  EXPECT_GT(m.share(r[1], high.start_ns + 200 * kMs, high.end_ns), 50.0)
      << "normal " << m.share(r[0], high.start_ns + 200 * kMs, high.end_ns);
}

// Writers remove their files at exit; a killed writer's file is left (its
// liveness lock is free) and replaced by the next process of its container.
TEST(PriorityFlood, ActivityFilesAreRemovedByTheirWritersAtExit) {
  Machine m;
  const auto r = m.run({tenant(m, "low", "low", Proc{spin("kernel", 200, 0.4, "symbol", 1.0), 0, 0}),
                        tenant(m, "high", "high", Proc{spin("kernel", 200, 0.4, "symbol", 1.0), 0, 0})});
  ASSERT_EQ(r[0].procs[0].result.exit_code, 0) << r[0].procs[0].result.describe();
  ASSERT_EQ(r[1].procs[0].result.exit_code, 0) << r[1].procs[0].result.describe();
  EXPECT_EQ(list(m.sandbox().path("board") + "/low"), std::vector<std::string>{});
  EXPECT_EQ(list(m.sandbox().path("board") + "/high"), std::vector<std::string>{});
}

}  // namespace
