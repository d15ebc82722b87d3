// The priority board's files (shm/priority_board.h): a container's level is
// the directory its file is in, never what the file says; short or foreign
// files are ignored; vanished files are forgotten.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "limiter/priority.h"
#include "shm/priority_board.h"

namespace {

using gpuslice::Priority;
using gpuslice::PriorityActivity;
using namespace gpuslice::shm;

constexpr char kUuid[] = "GPU-11111111-2222-3333-4444-555555555555";
constexpr char kOther[] = "GPU-99999999-2222-3333-4444-555555555555";

class Board : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gpuslice-board-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (LevelScan& l : levels_) close_level(&l);
    std::string cmd = "rm -rf '" + dir_ + "'";
    ASSERT_EQ(system(cmd.c_str()), 0);
  }
  int publish(Priority level, std::uint64_t key, const char* uuid = kUuid) {
    char name[kBoardNameMax];
    EXPECT_TRUE(activity_name(uuid, 1, key, name));
    Error err{};
    const int fd = open_own_activity(dir_.c_str(), level, name, "test", &err);
    EXPECT_GE(fd, 0) << err.message;
    return fd;
  }
  // Scans every level to the end of a pass; the table's files are then peers_.
  void scan_all() {
    count_ = 0;
    for (Priority p : {Priority::high, Priority::normal, Priority::low}) {
      LevelScan& l = levels_[static_cast<int>(p) - 1];
      for (int i = 0; i < 100; ++i) {
        scan_level(dir_.c_str(), p, kUuid, nullptr, &l);
        if (!l.in_pass) break;
      }
      for (int i = 0; i < l.count; ++i) peers_[count_++] = l.files[i];
    }
  }
  std::string dir_;
  LevelScan levels_[3];
  PeerFile peers_[3 * kLevelPeers];
  int count_ = 0;
};

TEST_F(Board, NameIsPerContainerAndDevice) {
  char a[kBoardNameMax], b[kBoardNameMax];
  ASSERT_TRUE(activity_name(kUuid, 0x2a, 0x1234, a));
  ASSERT_TRUE(activity_name(kOther, 0x2a, 0x1234, b));
  EXPECT_STREQ(a, "GPU-11111111-2222-3333-4444-555555555555.2a-1234.act");
  EXPECT_STRNE(a, b);
}

TEST_F(Board, PublishedActivityIsReadBack) {
  const int fd = publish(Priority::high, 7);
  ASSERT_TRUE(write_activity(fd, Priority::high, 123, 100));
  ASSERT_TRUE(write_held(fd, 5, 2));
  scan_all();
  ASSERT_EQ(count_, 1);
  EXPECT_EQ(peers_[0].level, Priority::high);
  PriorityActivity rec;
  ASSERT_TRUE(read_activity(peers_[0].fd, &rec));
  EXPECT_EQ(rec.active_until_ns, 123u);
  EXPECT_EQ(rec.last_launch_ns, 100u);
  EXPECT_EQ(rec.held_ns, 5u);
  EXPECT_EQ(rec.level, static_cast<std::uint32_t>(Priority::high));
  EXPECT_STREQ(rec.container_name, "test");
  EXPECT_EQ(rec.writer_pid, static_cast<std::uint32_t>(getpid()));
  close(fd);
}

// A writer killed at any instruction holds nobody: its liveness lock dies
// with it, and readers ask the kernel (no timeout to wait out).
TEST_F(Board, KilledWriterIsSeenGone) {
  int ready[2], hold[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(hold), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    char name[kBoardNameMax];
    Error err{};
    if (!activity_name(kUuid, 1, 9, name)) _exit(2);
    const int fd = open_own_activity(dir_.c_str(), Priority::high, name, "victim", &err);
    if (fd < 0 || !write_activity(fd, Priority::high, ~0ull >> 1, 1)) _exit(3);
    char c = 1;
    if (write(ready[1], &c, 1) != 1) _exit(4);
    (void)!read(hold[0], &c, 1);  // until killed
    _exit(0);
  }
  close(ready[1]);
  close(hold[0]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  scan_all();
  ASSERT_EQ(count_, 1);
  PriorityActivity rec;
  ASSERT_TRUE(read_activity(peers_[0].fd, &rec));
  EXPECT_EQ(rec.writer_pid, static_cast<std::uint32_t>(child));
  EXPECT_TRUE(writer_alive(peers_[0].fd, rec));
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_FALSE(writer_alive(peers_[0].fd, rec));
  EXPECT_FALSE(any_writer_alive(peers_[0].fd));
  // The next scan drops it from the table.
  scan_all();
  EXPECT_EQ(count_, 0);
  // Another process of the container starting later replaces the dead file
  // with a new one (the directory changes: readers look again), alive.
  char name[kBoardNameMax];
  ASSERT_TRUE(activity_name(kUuid, 1, 9, name));
  Error err{};
  const int fd = open_own_activity(dir_.c_str(), Priority::high, name, "victim", &err);
  ASSERT_GE(fd, 0) << err.message;
  ASSERT_TRUE(write_activity(fd, Priority::high, 5, 1));
  scan_all();
  ASSERT_EQ(count_, 1);
  ASSERT_TRUE(read_activity(peers_[0].fd, &rec));
  EXPECT_EQ(rec.writer_pid, static_cast<std::uint32_t>(getpid()));
  EXPECT_TRUE(writer_alive(peers_[0].fd, rec));
  close(fd);
  close(ready[0]);
  close(hold[1]);
}

// A low container that writes "I am high" into its own file is still low:
// readers take the level from the directory it can write to.
TEST_F(Board, LowCannotClaimHighThroughItsFile) {
  const int fd = publish(Priority::low, 8);
  PriorityActivity forged;
  ASSERT_EQ(pread(fd, &forged, sizeof forged, 0), static_cast<ssize_t>(sizeof forged));
  forged.level = static_cast<std::uint32_t>(Priority::high);
  const std::uint64_t now = 1'000'000'000;
  forged.active_until_ns = now + 1'000'000;
  forged.last_launch_ns = now;
  ASSERT_EQ(pwrite(fd, &forged, sizeof forged, 0), static_cast<ssize_t>(sizeof forged));
  scan_all();
  ASSERT_EQ(count_, 1);
  EXPECT_EQ(peers_[0].level, Priority::low);
  PriorityActivity rec;
  ASSERT_TRUE(read_activity(peers_[0].fd, &rec));
  const gpuslice::limiter::PeerSample sample{peers_[0].level, rec.active_until_ns, rec.last_launch_ns};
  // A normal container next to it is not held (it is merely engaged: it must publish).
  EXPECT_EQ(gpuslice::limiter::judge(Priority::normal, &sample, 1, now), gpuslice::limiter::Verdict::free);
  EXPECT_TRUE(gpuslice::limiter::engaged(Priority::normal, &sample, 1, now));
  close(fd);
}

TEST_F(Board, OtherDevicesShortFilesAndLinksAreIgnored) {
  close(publish(Priority::high, 1, kOther));  // another GPU
  ASSERT_EQ(mkdir((dir_ + "/high").c_str(), 0777) == 0 || errno == EEXIST, true);
  // A short file with the right name: never a record, never opened.
  const std::string short_path = dir_ + "/high/" + kUuid + ".0-2.act";
  const int fd = open(short_path.c_str(), O_CREAT | O_WRONLY, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "xx", 2), 2);
  close(fd);
  // A symbolic link to a valid record is not followed.
  const int valid = publish(Priority::normal, 3);
  ASSERT_EQ(symlink((dir_ + "/normal/" + kUuid + ".1-3.act").c_str(), (dir_ + "/high/" + kUuid + ".0-4.act").c_str()),
            0);
  scan_all();
  int high = 0;
  for (int i = 0; i < count_; ++i) high += peers_[i].level == Priority::high;
  EXPECT_EQ(high, 0);  // neither the short file, nor the link, nor the other GPU's
  close(valid);
}

TEST_F(Board, VanishedFilesAreForgotten) {
  const int fd = publish(Priority::high, 9);
  scan_all();
  ASSERT_EQ(count_, 1);
  scan_all();  // rescans do not duplicate
  ASSERT_EQ(count_, 1);
  const std::string path = dir_ + "/high/" + kUuid + ".1-9.act";
  ASSERT_EQ(unlink(path.c_str()), 0);
  scan_all();
  EXPECT_EQ(count_, 0);
  close(fd);
}

TEST_F(Board, OwnFileIsSkipped) {
  char name[kBoardNameMax];
  ASSERT_TRUE(activity_name(kUuid, 1, 10, name));
  const int fd = publish(Priority::low, 10);
  LevelScan& low = levels_[0];
  scan_level(dir_.c_str(), Priority::low, kUuid, name, &low);
  EXPECT_EQ(low.count, 0);
  close(fd);
}

TEST_F(Board, UnwritableBoardIsAClearError) {
  Error err{};
  char name[kBoardNameMax];
  ASSERT_TRUE(activity_name(kUuid, 1, 11, name));
  // A regular file where the board directory should be.
  const std::string file = dir_ + "/not-a-dir";
  close(open(file.c_str(), O_CREAT | O_WRONLY, 0644));
  EXPECT_LT(open_own_activity(file.c_str(), Priority::high, name, "", &err), 0);
  EXPECT_NE(std::strstr(err.message, "not-a-dir"), nullptr) << err.message;
  EXPECT_NE(std::strstr(err.message, "expected"), nullptr) << err.message;
}

}  // namespace
