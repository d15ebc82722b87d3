// The cost of a board scan (shm/priority_board.h, docs/priority.md "What a
// scan costs"): bounded per call whatever the directory holds, nothing while
// the directory does not change; files of dead writers are reaped, live ones
// taken, each level in its own table.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "shm/priority_board.h"

namespace {

using gpuslice::Priority;
using namespace gpuslice::shm;

constexpr char kUuid[] = "GPU-11111111-2222-3333-4444-555555555555";

class BoardScan : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gpuslice-scan-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    close_level(&scan_);
    for (int fd : fds_) close(fd);
    ASSERT_EQ(system(("rm -rf '" + dir_ + "'").c_str()), 0);
  }
  std::string level(Priority p) const { return dir_ + "/" + level_directory(p); }
  // A file of a live writer (this process holds its liveness lock).
  int live(Priority p, std::uint64_t key) {
    char name[kBoardNameMax];
    EXPECT_TRUE(activity_name(kUuid, 1, key, name));
    Error err{};
    const int fd = open_own_activity(dir_.c_str(), p, name, "t", &err);
    EXPECT_GE(fd, 0) << err.message;
    fds_.push_back(fd);
    return fd;
  }
  void file(Priority p, const std::string& key, std::size_t size, int age_s) {
    mkdir(level(p).c_str(), 01777);
    const std::string path = level(p) + "/" + kUuid + "." + key + ".act";
    const int fd = open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    close(fd);
    if (age_s != 0) age(path, age_s);
  }
  static void age(const std::string& path, int seconds) {
    struct timespec t[2];
    clock_gettime(CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= seconds;
    t[1] = t[0];
    ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), t, AT_SYMLINK_NOFOLLOW), 0);
  }
  // Calls scan_level until a pass ends; returns the calls' costs.
  std::vector<ScanCost> pass(Priority p) {
    std::vector<ScanCost> costs;
    for (int i = 0; i < 1000; ++i) {
      ScanCost c;
      scan_level(dir_.c_str(), p, kUuid, nullptr, &scan_, &c);
      costs.push_back(c);
      if (c.passed || (!scan_.in_pass && c.dir_reads == 0)) break;
    }
    return costs;
  }
  std::string dir_;
  LevelScan scan_;
  std::vector<int> fds_;
};

// 20,000 empty files and one live file: no call reads more than its bounds,
// none of the empty files is opened, the live one is found; then, with the
// directory unchanged, a call costs no directory read, stat or open at all.
TEST_F(BoardScan, FloodIsBoundedPerCallAndFreeOnceSettled) {
  for (int i = 0; i < 20000; ++i) file(Priority::low, "f-" + std::to_string(i), 0, 0);
  live(Priority::low, 77);
  age(level(Priority::low), 10);  // the directory's last change is old
  unsigned opens = 0, entries = 0;
  const auto costs = pass(Priority::low);
  ASSERT_TRUE(costs.back().passed);
  EXPECT_GT(costs.size(), 1u) << "20,000 names take more than one call";
  for (const ScanCost& c : costs) {
    EXPECT_LE(c.entries, kScanEntries + 4096 / 24) << "at most one 4 KiB buffer past the bound";
    opens += c.opens;
    entries += c.entries;
  }
  EXPECT_GE(entries, 20001u);
  EXPECT_EQ(opens, 1u) << "only the file of a record's size";
  ASSERT_EQ(scan_.count, 1);
  for (int i = 0; i < 5; ++i) {
    ScanCost c;
    ASSERT_TRUE(scan_level(dir_.c_str(), Priority::low, kUuid, nullptr, &scan_, &c));
    EXPECT_EQ(c.dir_reads + c.stats + c.opens, 0u) << "call " << i;
  }
  EXPECT_EQ(scan_.count, 1);
}

// Files nobody holds and nobody wrote for kReapAgeNs are removed by a reader
// that may write the directory; recent ones and live ones stay.
TEST_F(BoardScan, StaleFilesAreReapedLiveAndRecentOnesStay) {
  file(Priority::high, "old-empty", 0, 60);
  file(Priority::high, "old-dead", sizeof(gpuslice::PriorityActivity), 60);
  file(Priority::high, "new-dead", sizeof(gpuslice::PriorityActivity), 0);
  live(Priority::high, 5);
  age(level(Priority::high) + "/" + kUuid + ".1-5.act", 60);  // idle for a minute, but alive
  const auto costs = pass(Priority::high);
  unsigned reaped = 0;
  for (const ScanCost& c : costs) reaped += c.reaped;
  EXPECT_EQ(reaped, 2u);
  struct stat st;
  EXPECT_NE(stat((level(Priority::high) + "/" + kUuid + ".old-empty.act").c_str(), &st), 0);
  EXPECT_NE(stat((level(Priority::high) + "/" + kUuid + ".old-dead.act").c_str(), &st), 0);
  EXPECT_EQ(stat((level(Priority::high) + "/" + kUuid + ".new-dead.act").c_str(), &st), 0);
  EXPECT_EQ(stat((level(Priority::high) + "/" + kUuid + ".1-5.act").c_str(), &st), 0);
  EXPECT_EQ(scan_.count, 1) << "the live file only";
}

// A level's table holds at most kLevelPeers files; more live files of that
// level are left out of it (its own directory's problem), and the next pass
// takes them when a place frees.
TEST_F(BoardScan, TableIsBoundedAndRefilledWhenAPlaceFrees) {
  for (int i = 0; i < kLevelPeers + 8; ++i) live(Priority::low, static_cast<std::uint64_t>(i));
  pass(Priority::low);
  EXPECT_EQ(scan_.count, kLevelPeers);
  // One writer of the table exits (its lock goes with its descriptor).
  struct stat st;
  int closed = -1;
  for (std::size_t i = 0; i < fds_.size() && closed < 0; ++i) {
    ASSERT_EQ(fstat(fds_[i], &st), 0);
    if (st.st_ino == scan_.files[0].ino) {
      close(fds_[i]);
      closed = static_cast<int>(i);
    }
  }
  ASSERT_GE(closed, 0);
  fds_.erase(fds_.begin() + closed);
  pass(Priority::low);
  pass(Priority::low);
  EXPECT_EQ(scan_.count, kLevelPeers) << "a file left out before took the free place";
}

// Writers remove their own file at exit, unless another process of the
// container still holds it.
TEST_F(BoardScan, WriterRemovesItsFileWhenItIsTheLast) {
  char name[kBoardNameMax];
  ASSERT_TRUE(activity_name(kUuid, 1, 9, name));
  const std::string path = level(Priority::normal) + "/" + name;
  Error err{};
  const int fd = open_own_activity(dir_.c_str(), Priority::normal, name, "t", &err);
  ASSERT_GE(fd, 0) << err.message;
  // Another process of the container holds it too.
  int go[2];
  ASSERT_EQ(pipe(go), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(go[1]);
    Error e{};
    const int cfd = open_own_activity(dir_.c_str(), Priority::normal, name, "t", &e);
    char c;
    (void)!read(go[0], &c, 1);
    _exit(cfd >= 0 ? 0 : 1);
  }
  close(go[0]);
  usleep(100 * 1000);  // the child has its lock by now (checked below: the file stays)
  struct stat st;
  EXPECT_FALSE(remove_own_activity(dir_.c_str(), Priority::normal, name, fd));
  EXPECT_EQ(stat(path.c_str(), &st), 0) << "another process of the container holds it";
  close(go[1]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_TRUE(hold_liveness(fd));
  EXPECT_TRUE(remove_own_activity(dir_.c_str(), Priority::normal, name, fd));
  EXPECT_NE(stat(path.c_str(), &st), 0);
  close(fd);
}

}  // namespace
