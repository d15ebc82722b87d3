// Two real users on one node without containers (docs/security.md, "Who may
// join or change a region"): in a directory shared by users (sticky,
// world-writable, the documented bare-metal set-up) a job's region is its
// user's alone, and so is its activity file on the priority board. Needs root
// (to create the users and switch to them): skipped otherwise.
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "gpuslice/region.h"
#include "harness.h"
#include "shm/priority_board.h"
#include "shm/region_file.h"

namespace {

using namespace gpuslice;

struct User {
  uid_t uid = 0;
  gid_t gid = 0;
};

bool user(const char* name, User* out) {
  if (getpwnam(name) == nullptr) {
    const std::string cmd =
        std::string("useradd --system --no-create-home --shell /usr/sbin/nologin ") + name + " >/dev/null 2>&1";
    if (system(cmd.c_str()) != 0) return false;
  }
  const passwd* pw = getpwnam(name);
  if (pw == nullptr) return false;
  *out = User{pw->pw_uid, pw->pw_gid};
  return true;
}

// Runs fn in a child that is `u` (no supplementary groups); its result.
int as(const User& u, const std::function<int()>& fn) {
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (setgroups(0, nullptr) != 0 || setresgid(u.gid, u.gid, u.gid) != 0 || setresuid(u.uid, u.uid, u.uid) != 0)
      _exit(90);
    _exit(fn());
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int smi(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  static std::string path = test::bin("gpuslice-smi");
  argv.push_back(path.data());
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const int null = open("/dev/null", O_WRONLY);
  dup2(null, 1);
  dup2(null, 2);
  execv(argv[0], argv.data());
  return 127;
}

class Users : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "two users need root to create them and switch to them";
    if (!user("gpuslice-job1", &a_) || !user("gpuslice-job2", &b_))
      GTEST_SKIP() << "cannot create the test users gpuslice-job1/gpuslice-job2 (useradd failed)";
    char tmpl[] = "/tmp/gpuslice-users-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ASSERT_EQ(chmod(dir_.c_str(), 0755), 0);
    shared_ = dir_ + "/shared";  // like /dev/shm: every user may create, none may remove another's
    ASSERT_EQ(mkdir(shared_.c_str(), 0755), 0);
    ASSERT_EQ(chmod(shared_.c_str(), 01777), 0);
  }
  void TearDown() override {
    if (!dir_.empty()) {
      ASSERT_EQ(system(("rm -rf '" + dir_ + "'").c_str()), 0);
    }
  }
  User a_, b_;
  std::string dir_, shared_;
};

std::uint32_t priority_word(const std::string& path) {
  shm::Error err{};
  Region* r = shm::attach_existing(path.c_str(), false, &err);
  if (r == nullptr) return ~0u;
  const std::uint32_t w = r->header.priority.load();
  shm::detach(r);
  return w;
}

// The case: user 2 ran `gpuslice-smi set` on user 1's job region.
TEST_F(Users, AnotherUserCanNeitherJoinNorChangeAJobsRegion) {
  const std::string region = shared_ + "/job1.region";
  ASSERT_EQ(as(a_,
               [&] {
                 shm::Error err{};
                 Region* r = shm::attach(region.c_str(), "job1", &err);
                 return r != nullptr ? 0 : 1;
               }),
            0);
  struct stat st;
  ASSERT_EQ(stat(region.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, a_.uid);
  EXPECT_EQ(st.st_mode & 07777, 0600u) << "a region in a directory shared by users is its creator's alone";
  // User 2: cannot join it (a process of theirs naming it fails closed) ...
  EXPECT_EQ(as(b_,
               [&] {
                 shm::Error err{};
                 return shm::attach(region.c_str(), "x", &err) == nullptr ? 0 : 1;
               }),
            0);
  // ... nor change its limits.
  EXPECT_NE(as(b_, [&] { return smi({"set", "--region", region, "--priority", "low"}); }), 0);
  EXPECT_NE(as(b_, [&] { return smi({"set", "--region", region, "--memory", "1Mi"}); }), 0);
  EXPECT_EQ(priority_word(region), 0u);
  // The job's own user may, and so may root (the agent).
  EXPECT_EQ(as(a_, [&] { return smi({"set", "--region", region, "--priority", "low"}); }), 0);
  EXPECT_EQ(priority_word(region), 1u);
  EXPECT_EQ(as(User{0, 0}, [&] { return smi({"set", "--region", region, "--priority", "high"}); }), 0);
  EXPECT_EQ(priority_word(region), 3u);
}

// User 2 creates the region user 1's job will name, first, open to all:
// user 1's process refuses to join it (user 2 would control its limits).
TEST_F(Users, ARegionPlantedByAnotherUserIsNotJoined) {
  const std::string region = shared_ + "/job1.region";
  ASSERT_EQ(as(b_,
               [&] {
                 shm::Error err{};
                 Region* r = shm::attach(region.c_str(), "planted", &err);
                 return r != nullptr && chmod(region.c_str(), 0666) == 0 ? 0 : 1;
               }),
            0);
  EXPECT_EQ(as(a_,
               [&] {
                 shm::Error err{};
                 if (shm::attach(region.c_str(), "job1", &err) != nullptr) return 1;
                 return std::strstr(err.message, "owned by uid") != nullptr ? 0 : 2;
               }),
            0);
  // Outside a shared directory (a container's own, or a job directory the
  // operator gave a user) regions stay 0666: every user of the container
  // shares it.
  const std::string own = dir_ + "/own";
  ASSERT_EQ(mkdir(own.c_str(), 0755), 0);
  shm::Error err{};
  Region* r = shm::attach((own + "/c.region").c_str(), "c", &err);
  ASSERT_NE(r, nullptr) << err.message;
  shm::detach(r);
  struct stat st;
  ASSERT_EQ(stat((own + "/c.region").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0666u);
}

// The board: another user can neither write, remove nor plant a user's
// activity file.
TEST_F(Users, AnotherUsersActivityFileCannotBeForgedOrRemoved) {
  const std::string board = shared_ + "/board";
  const char* uuid = "GPU-11111111-2222-3333-4444-555555555555";
  char mine[shm::kBoardNameMax], planted[shm::kBoardNameMax];
  ASSERT_TRUE(shm::activity_name(uuid, 1, 1, mine));
  ASSERT_TRUE(shm::activity_name(uuid, 1, 2, planted));
  // User 1 publishes (the library creates the board 01777 whatever the umask).
  int go[2];
  ASSERT_EQ(pipe(go), 0);
  const pid_t writer = fork();
  ASSERT_GE(writer, 0);
  if (writer == 0) {
    close(go[1]);
    umask(022);
    if (setgroups(0, nullptr) != 0 || setresgid(a_.gid, a_.gid, a_.gid) != 0 || setresuid(a_.uid, a_.uid, a_.uid) != 0)
      _exit(90);
    shm::Error err{};
    const int fd = shm::open_own_activity(board.c_str(), Priority::high, mine, "job1", &err);
    char c;
    (void)!read(go[0], &c, 1);
    _exit(fd >= 0 ? 0 : 1);
  }
  close(go[0]);
  const std::string path = board + "/high/" + mine;
  struct stat st {};
  for (int i = 0; i < 500 && stat(path.c_str(), &st) != 0; ++i) usleep(10 * 1000);
  ASSERT_EQ(st.st_uid, a_.uid);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  struct stat dir {};
  ASSERT_EQ(stat((board + "/high").c_str(), &dir), 0);
  EXPECT_EQ(dir.st_mode & 07777, 01777u) << "created sticky and world-writable, not through the umask";
  EXPECT_EQ(as(b_, [&] { return open(path.c_str(), O_WRONLY) < 0 ? 0 : 1; }), 0) << "forged";
  EXPECT_EQ(as(b_, [&] { return unlink(path.c_str()) != 0 ? 0 : 1; }), 0) << "removed";
  // A file user 2 plants under the name user 1 will use, writable by all: user
  // 1 never writes into it (user 2 could then forge its activity).
  EXPECT_EQ(as(b_,
               [&] {
                 const int fd = open((board + "/high/" + planted).c_str(), O_CREAT | O_WRONLY, 0666);
                 return fd >= 0 && fchmod(fd, 0666) == 0 ? 0 : 1;
               }),
            0);
  EXPECT_EQ(as(a_,
               [&] {
                 shm::Error err{};
                 const int fd = shm::open_own_activity(board.c_str(), Priority::high, planted, "job1", &err);
                 if (fd < 0) return std::strstr(err.message, "another user") != nullptr ? 0 : 2;
                 struct stat own;
                 return fstat(fd, &own) == 0 && own.st_uid == geteuid() ? 0 : 1;  // replaced, never written
               }),
            0);
  ASSERT_EQ(stat((board + "/high/" + planted).c_str(), &st), 0);
  EXPECT_TRUE(st.st_uid == a_.uid || st.st_size == 0) << "user 1 wrote into user 2's file";
  close(go[1]);
  int status = 0;
  ASSERT_EQ(waitpid(writer, &status, 0), writer);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

}  // namespace
