// Two real users on one node without containers (docs/security.md, "Who may
// join or change a region", "The library's file operations"): in a directory
// shared by users (sticky, world-writable, the documented bare-metal set-up;
// or another user's world-writable one) a job's region is its user's alone,
// and so is its activity file on the priority board; a level directory counts
// only when root's or the board owner's; a directory a root job creates
// cannot be swapped for a link before its mode is set. Needs root (to create
// the users and switch to them): skipped otherwise.
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
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

// A directory swapped between its creation and the change of its mode: this
// program's own mkdir and mkdirat (the library's code is linked in, so its
// calls land here) tell a waiting attacker process, once armed, the moment the
// directory named `name` was created, and go on only when it answers.
struct SwapOnCreate {
  std::string name;
  int go = -1;  // armed while >= 0
  int done = -1;
};
SwapOnCreate g_swap;

void created(const char* path, int rc) noexcept {
  if (rc != 0 || g_swap.go < 0) return;
  const char* slash = std::strrchr(path, '/');
  if (g_swap.name != (slash != nullptr ? slash + 1 : path)) return;
  const int saved = errno;
  const int go = g_swap.go;
  g_swap.go = -1;
  char c = 1;
  if (write(go, &c, 1) == 1) (void)!read(g_swap.done, &c, 1);
  errno = saved;
}

}  // namespace

extern "C" int mkdir(const char* path, mode_t mode) noexcept {
  const int rc = static_cast<int>(syscall(SYS_mkdirat, AT_FDCWD, path, mode));
  created(path, rc);
  return rc;
}

extern "C" int mkdirat(int dirfd, const char* path, mode_t mode) noexcept {
  const int rc = static_cast<int>(syscall(SYS_mkdirat, dirfd, path, mode));
  created(path, rc);
  return rc;
}

namespace {

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

// User `u`'s process that swaps a directory when the library has just created
// it (SwapOnCreate): arm() before the call, finish() after.
class Swapper {
 public:
  Swapper(const User& u, const std::string& name, std::function<int()> swap) {
    int go[2], done[2];
    if (pipe(go) != 0 || pipe(done) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(go[1]);
      close(done[0]);
      if (setgroups(0, nullptr) != 0 || setresgid(u.gid, u.gid, u.gid) != 0 || setresuid(u.uid, u.uid, u.uid) != 0)
        _exit(90);
      char c;
      if (read(go[0], &c, 1) != 1) _exit(0);  // never armed: nothing to do
      const int rc = swap();
      (void)!write(done[1], &c, 1);
      _exit(rc);
    }
    close(go[0]);
    close(done[1]);
    g_swap = SwapOnCreate{name, go[1], done[0]};
    go_ = go[1];
    done_ = done[0];
  }
  // The attacker's exit status: 0 when it swapped, 255 when the library never
  // created the directory.
  int finish() {
    g_swap.go = -1;
    close(go_);
    close(done_);
    int status = 0;
    if (pid_ <= 0 || waitpid(pid_, &status, 0) != pid_) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  bool swapped() const { return g_swap.go < 0; }

 private:
  pid_t pid_ = -1;
  int go_ = -1, done_ = -1;
};

int swap_for_link(const std::string& dir, const std::string& target) {
  if (rename(dir.c_str(), (dir + ".moved").c_str()) != 0) return 2;
  return symlink(target.c_str(), dir.c_str()) == 0 ? 0 : 3;
}

bool empty_dir(const std::string& path) {
  DIR* d = opendir(path.c_str());
  if (d == nullptr) return false;
  int n = 0;
  while (const dirent* e = readdir(d)) n += std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0;
  closedir(d);
  return n == 0;
}

// Issue 33: a root job creates a level directory in a board user 2 owns (their
// job created it first); user 2 swaps it for a link to a root-owned 0700
// directory between the creation and the change of mode. The mode change must
// never land there.
TEST_F(Users, ARootJobsLevelDirectoryCannotBeSwappedForALink) {
  const std::string board = dir_ + "/board", secret = dir_ + "/secret";
  ASSERT_EQ(mkdir(board.c_str(), 0755), 0);
  ASSERT_EQ(chmod(board.c_str(), 01777), 0);
  ASSERT_EQ(chown(board.c_str(), b_.uid, b_.gid), 0);
  ASSERT_EQ(mkdir(secret.c_str(), 0700), 0);
  ASSERT_EQ(chmod(secret.c_str(), 0700), 0);
  char name[shm::kBoardNameMax];
  ASSERT_TRUE(shm::activity_name("GPU-11111111-2222-3333-4444-555555555555", 1, 1, name));
  Swapper attacker(b_, "high", [&] { return swap_for_link(board + "/high", secret); });
  shm::Error err{};
  const int fd = shm::open_own_activity(board.c_str(), Priority::high, name, "root-job", &err);
  const bool swapped = attacker.swapped();
  EXPECT_EQ(attacker.finish(), 0);
  ASSERT_TRUE(swapped) << "the library never created <board>/high";
  struct stat st;
  ASSERT_EQ(stat(secret.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u) << "root's chmod followed user 2's link";
  EXPECT_TRUE(empty_dir(secret)) << "root's activity file landed in the link's target";
  EXPECT_LT(fd, 0) << "published through a swapped directory";
  EXPECT_NE(std::strstr(err.message, "/high"), nullptr) << err.message;
  if (fd >= 0) close(fd);
}

// The same race on the directories the library creates for a region path
// (mkdir -p, made 01777).
TEST_F(Users, ARootJobsRegionDirectoryCannotBeSwappedForALink) {
  const std::string theirs = dir_ + "/theirs", secret = dir_ + "/secret";
  ASSERT_EQ(mkdir(theirs.c_str(), 0755), 0);
  ASSERT_EQ(chown(theirs.c_str(), b_.uid, b_.gid), 0);
  ASSERT_EQ(mkdir(secret.c_str(), 0700), 0);
  ASSERT_EQ(chmod(secret.c_str(), 0700), 0);
  Swapper attacker(b_, "sub", [&] { return swap_for_link(theirs + "/sub", secret); });
  shm::Error err{};
  Region* r = shm::attach((theirs + "/sub/job.region").c_str(), "root-job", &err);
  const bool swapped = attacker.swapped();
  EXPECT_EQ(attacker.finish(), 0);
  ASSERT_TRUE(swapped) << "the library never created the directory";
  struct stat st;
  ASSERT_EQ(stat(secret.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u) << "root's chmod followed user 2's link";
  EXPECT_TRUE(empty_dir(secret)) << "root's region landed in the link's target";
  EXPECT_EQ(r, nullptr) << "a region made through a swapped directory";
  EXPECT_NE(std::strstr(err.message, "sub"), nullptr) << err.message;
  shm::detach(r);
}

// Issue 33: in a board of root (an operator's, or the agent's), the user whose
// job would create `high` would own it, and the sticky bit does not bind a
// directory's owner: they could remove every other user's activity file. A
// level directory counts only when root or the board's owner owns it.
TEST_F(Users, ALevelDirectoryOfAnotherUserIsNeverUsed) {
  const std::string board = shared_ + "/board";
  ASSERT_EQ(mkdir(board.c_str(), 0755), 0);
  ASSERT_EQ(chmod(board.c_str(), 01777), 0);  // root's, like /dev/shm
  const char* uuid = "GPU-11111111-2222-3333-4444-555555555555";
  char name_a[shm::kBoardNameMax], name_b[shm::kBoardNameMax];
  ASSERT_TRUE(shm::activity_name(uuid, 1, 1, name_a));
  ASSERT_TRUE(shm::activity_name(uuid, 1, 2, name_b));
  // User 1's job publishes first (the library may create `high`, owned by user
  // 1 then); or user 1 makes `high` by hand.
  (void)as(a_, [&] {
    shm::Error err{};
    return shm::open_own_activity(board.c_str(), Priority::high, name_a, "job1", &err) >= 0 ? 0 : 1;
  });
  const std::string high = board + "/high";
  ASSERT_EQ(as(a_,
               [&] {
                 return (mkdir(high.c_str(), 0777) == 0 && chmod(high.c_str(), 01777) == 0) || errno == EEXIST ? 0 : 1;
               }),
            0);
  struct stat st;
  ASSERT_EQ(lstat(high.c_str(), &st), 0);
  ASSERT_EQ(st.st_uid, a_.uid);
  // User 2's job at `high`: never publishes into user 1's directory ...
  int pipes[2];
  ASSERT_EQ(pipe(pipes), 0);
  const int b_result = as(b_, [&] {
    shm::Error err{};
    const int fd = shm::open_own_activity(board.c_str(), Priority::high, name_b, "job2", &err);
    (void)!write(pipes[1], err.message, std::strlen(err.message));
    return fd >= 0 ? 0 : 1;
  });
  close(pipes[1]);
  char message[600] = {};
  (void)!read(pipes[0], message, sizeof message - 1);
  close(pipes[0]);
  // ... where user 1 could remove it.
  const std::string b_file = high + "/" + name_b;
  const int removed = as(a_, [&] { return unlink(b_file.c_str()) == 0 ? 0 : 1; });
  EXPECT_NE(removed, 0) << "user 1 removed user 2's activity file from the level directory user 1 owns";
  EXPECT_EQ(b_result, 1) << "user 2 published into a level directory of user 1";
  EXPECT_NE(std::strstr(message, "owned by uid"), nullptr) << message;
  // A reader does not take it for a level either: user 1's files there hold nobody.
  shm::LevelScan scan;
  EXPECT_FALSE(shm::scan_level(board.c_str(), Priority::high, uuid, nullptr, &scan));
  shm::close_level(&scan);
}

// Levels a root job creates in root's board serve every user, and so do the
// levels of a board a user's job created (all three, at once, its own): the
// board's owner alone (root, or that user) may remove others' files.
TEST_F(Users, LevelsOfRootOrOfTheBoardsOwnerServeEveryUser) {
  const char* uuid = "GPU-11111111-2222-3333-4444-555555555555";
  char name_a[shm::kBoardNameMax], name_b[shm::kBoardNameMax], name_r[shm::kBoardNameMax];
  ASSERT_TRUE(shm::activity_name(uuid, 1, 1, name_a));
  ASSERT_TRUE(shm::activity_name(uuid, 1, 2, name_b));
  ASSERT_TRUE(shm::activity_name(uuid, 1, 3, name_r));
  auto publish = [&](const User& u, const std::string& board, const char* name) {
    return as(u, [&] {
      shm::Error err{};
      return shm::open_own_activity(board.c_str(), Priority::low, name, "job", &err) >= 0 ? 0 : 1;
    });
  };
  // Root's board, levels made by a root job.
  const std::string root_board = shared_ + "/root-board";
  ASSERT_EQ(publish(User{0, 0}, root_board, name_r), 0);
  EXPECT_EQ(publish(a_, root_board, name_a), 0);
  EXPECT_EQ(publish(b_, root_board, name_b), 0);
  EXPECT_NE(as(a_, [&] { return unlink((root_board + "/low/" + name_b).c_str()); }), 0);
  // User 1's job made the board: its three levels are user 1's; user 2 publishes there.
  const std::string user_board = shared_ + "/user-board";
  ASSERT_EQ(publish(a_, user_board, name_a), 0);
  for (const char* level : {"high", "normal", "low"}) {
    struct stat st;
    ASSERT_EQ(lstat((user_board + "/" + level).c_str(), &st), 0) << level;
    EXPECT_EQ(st.st_uid, a_.uid) << level;
    EXPECT_EQ(st.st_mode & 07777, 01777u) << level;
  }
  EXPECT_EQ(publish(b_, user_board, name_b), 0);
}

// Issue 33: user 2's directory, writable by every user but not sticky. User
// 1's job puts its region there; user 2 must not be able to rewrite its quota
// (nor make user 1's next process join one of theirs).
TEST_F(Users, ARegionInAnotherUsersOpenDirectoryIsNotTheirs) {
  const std::string open_dir = dir_ + "/open";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0755), 0);
  ASSERT_EQ(chown(open_dir.c_str(), b_.uid, b_.gid), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  const std::string region = open_dir + "/job1.region";
  ASSERT_EQ(as(a_,
               [&] {
                 shm::Error err{};
                 return shm::attach(region.c_str(), "job1", &err) != nullptr ? 0 : 1;
               }),
            0);
  // User 2 rewrites the quota in place ...
  EXPECT_NE(as(b_,
               [&] {
                 shm::Error err{};
                 Region* r = shm::attach_existing(region.c_str(), true, &err);
                 if (r == nullptr) return 1;
                 r->devices[0].quota_bytes.store(1u << 20);
                 return 0;
               }),
            0)
      << "user 2 opened user 1's region for writing";
  // ... or replaces the file with one of theirs, quota 1 MiB, open to all.
  ASSERT_EQ(as(b_,
               [&] {
                 if (unlink(region.c_str()) != 0) return 1;
                 shm::Error err{};
                 Region* r = shm::attach(region.c_str(), "planted", &err);
                 if (r == nullptr) return 2;
                 r->devices[0].quota_bytes.store(1u << 20);
                 return chmod(region.c_str(), 0666) == 0 ? 0 : 3;
               }),
            0);
  EXPECT_EQ(as(a_,
               [&] {
                 shm::Error err{};
                 if (shm::attach(region.c_str(), "job1", &err) != nullptr) return 1;
                 return std::strstr(err.message, "owned by uid") != nullptr ? 0 : 2;
               }),
            0)
      << "user 1's next process joined user 2's region";
}

// A process whose level changed removes its file at the old level only while
// the name still names that file (never another file put there meanwhile).
TEST(BoardFiles, ALevelChangeRemovesOnlyItsOwnFile) {
  char tmpl[] = "/tmp/gpuslice-board-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string board = std::string(tmpl) + "/board";
  char name[shm::kBoardNameMax];
  ASSERT_TRUE(shm::activity_name("GPU-11111111-2222-3333-4444-555555555555", 1, 1, name));
  const std::string path = board + "/high/" + name;
  shm::Error err{};
  int fd = shm::open_own_activity(board.c_str(), Priority::high, name, "c", &err);
  ASSERT_GE(fd, 3) << err.message;
  ASSERT_EQ(unlink(path.c_str()), 0);
  const int other = open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
  ASSERT_GE(other, 0);
  close(other);
  EXPECT_FALSE(shm::unlink_activity(board.c_str(), Priority::high, name, fd));
  struct stat st;
  EXPECT_EQ(stat(path.c_str(), &st), 0) << "removed a file that is not its own";
  close(fd);
  ASSERT_EQ(unlink(path.c_str()), 0);
  fd = shm::open_own_activity(board.c_str(), Priority::high, name, "c", &err);
  ASSERT_GE(fd, 3) << err.message;
  EXPECT_TRUE(shm::unlink_activity(board.c_str(), Priority::high, name, fd));
  EXPECT_NE(stat(path.c_str(), &st), 0);
  close(fd);
  ASSERT_EQ(system(("rm -rf '" + std::string(tmpl) + "'").c_str()), 0);
}

}  // namespace
