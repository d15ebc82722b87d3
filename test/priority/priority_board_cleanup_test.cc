// The agent removes priority-board files of containers or devices gone for
// longer than its grace period (tools/agent/board_cleanup.h): stale = not
// written for the grace period AND no live process holds its liveness lock.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <string>

#include "board_cleanup.h"
#include "shm/priority_board.h"

namespace {

using gpuslice::Priority;
using namespace gpuslice::shm;
using gpuslice::agent::clean_priority_board;

constexpr std::uint64_t kSec = 1'000'000'000;
constexpr std::uint64_t kGrace = 60 * kSec;

std::uint64_t wall_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * kSec + static_cast<std::uint64_t>(ts.tv_nsec);
}

class BoardCleanupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gpuslice-cleanup-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    const std::string cmd = "rm -rf '" + dir_ + "'";
    ASSERT_EQ(system(cmd.c_str()), 0);
  }
  // A container's file as the library writes it; the fd holds its liveness lock.
  int publish(Priority level, std::uint64_t key) {
    char name[kBoardNameMax];
    EXPECT_TRUE(activity_name("GPU-11111111-2222-3333-4444-555555555555", 1, key, name));
    Error err{};
    const int fd = open_own_activity(dir_.c_str(), level, name, "test", &err);
    EXPECT_GE(fd, 0) << err.message;
    EXPECT_TRUE(write_activity(fd, level, 1, 1));
    paths_[key] = dir_ + "/" + level_directory(level) + "/" + name;
    return fd;
  }
  void age(std::uint64_t key, std::uint64_t seconds) {
    const timespec times[2] = {{static_cast<time_t>(time(nullptr) - static_cast<time_t>(seconds)), 0},
                               {static_cast<time_t>(time(nullptr) - static_cast<time_t>(seconds)), 0}};
    ASSERT_EQ(utimensat(AT_FDCWD, paths_[key].c_str(), times, 0), 0);
  }
  bool exists(std::uint64_t key) {
    struct stat st;
    return lstat(paths_[key].c_str(), &st) == 0;
  }
  std::string dir_;
  std::string paths_[8];
};

TEST_F(BoardCleanupTest, RemovesOnlyFilesUnusedForTheGraceWithNobodyAlive) {
  close(publish(Priority::high, 1));  // writer gone, old: removed
  age(1, 120);
  close(publish(Priority::low, 2));                // writer gone, recent: kept
  const int alive = publish(Priority::normal, 3);  // old but its writer lives (idle): kept
  age(3, 120);
  const auto r = clean_priority_board(dir_, wall_ns(), kGrace);
  EXPECT_EQ(r.examined, 3u);
  EXPECT_EQ(r.removed, 1u);
  EXPECT_FALSE(exists(1));
  EXPECT_TRUE(exists(2));
  EXPECT_TRUE(exists(3));
  // Once its last process is gone it goes too.
  close(alive);
  EXPECT_EQ(clean_priority_board(dir_, wall_ns(), kGrace).removed, 1u);
  EXPECT_FALSE(exists(3));
  // A later pass finds nothing more to do.
  EXPECT_EQ(clean_priority_board(dir_, wall_ns(), kGrace).removed, 0u);
  EXPECT_TRUE(exists(2));
}

TEST_F(BoardCleanupTest, LeavesOtherFilesLinksAndMissingBoardsAlone) {
  close(publish(Priority::high, 1));
  age(1, 120);
  const std::string other = dir_ + "/high/notes.txt";
  const int fd = open(other.c_str(), O_CREAT | O_WRONLY, 0644);
  ASSERT_GE(fd, 0);
  close(fd);
  const timespec old[2] = {{1, 0}, {1, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, other.c_str(), old, 0), 0);
  const std::string link = dir_ + "/high/GPU-x.1-1.act";
  ASSERT_EQ(symlink(paths_[1].c_str(), link.c_str()), 0);
  const auto r = clean_priority_board(dir_, wall_ns(), kGrace);
  EXPECT_EQ(r.removed, 1u);  // the activity file only
  struct stat st;
  EXPECT_EQ(lstat(other.c_str(), &st), 0);
  EXPECT_EQ(lstat(link.c_str(), &st), 0);
  EXPECT_EQ(clean_priority_board(dir_ + "/missing", wall_ns(), kGrace).examined, 0u);
  EXPECT_EQ(clean_priority_board("", wall_ns(), kGrace).examined, 0u);
}

}  // namespace
