// A second, unprivileged user against the grant directory (tools/agent/grant.h):
// the agent (root) reads `.gpuslice-grants` at the top of its region
// directory and gpuslice-smi (root) writes records there. Where that region
// directory is writable by another user (a misconfigured host path, a
// world-writable parent), that user (uid 65534 here, in a forked child) plants
// or swaps in a symbolic link, a FIFO, a huge file, a directory of its own or
// a record for a region, and races the writer and the reader. Root acts on
// what it opened (openat O_NOFOLLOW, fstat), never follows the user's link,
// never blocks on a FIFO, and refuses clearly. Needs root (skipped otherwise).
#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "agent.h"
#include "agent_test_util.h"
#include "grant.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

constexpr uid_t kUser = 65534;
constexpr std::uint64_t kGiven = 256 * kMi;
constexpr std::uint64_t kForged = 8192 * kMi;

// Runs fn as the second user in a child; its exit status (fn's return), -1 if it died.
int as_user(const std::function<int()>& fn) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgroups(0, nullptr) != 0 || setresgid(kUser, kUser, kUser) != 0 || setresuid(kUser, kUser, kUser) != 0)
      _exit(100);
    _exit(fn());
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// The names in a directory (for "nothing was written or removed there").
std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* e = readdir(d)) {
      if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") names.push_back(e->d_name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// What this process (the agent in it) writes to stderr while fn runs.
std::string stderr_of(const std::string& file, const std::function<void()>& fn) {
  std::fflush(stderr);
  const int saved = dup(2);
  const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (saved < 0 || fd < 0 || dup2(fd, 2) < 0) return "(stderr not captured)";
  close(fd);
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  return read_file(file);
}

// A record raising the region's quota: what the user would like root to act on.
std::string forged_record() {
  agent::Grant g;
  g.lines.push_back(grant_line(agent::GrantLine::quota, 0x60, kForged));
  return agent::grant_text(g);
}

class GrantDirSecondUser : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root (to be root, and another user)";
    alarm(120);  // bounded: a cycle or a command blocked on a FIFO fails the test
    ASSERT_EQ(chmod(box.dir().c_str(), 0755), 0);
    cfg = config_for(box, false);
    // The misconfiguration the user needs: the region directory is writable by all.
    ASSERT_EQ(chmod(region_dir(box).c_str(), 0777), 0);
    r = make_region(path, "g");
    ASSERT_NE(r, nullptr);
    dev = add_device(r, 0x60, kGiven, 30);
    ASSERT_GE(dev, 0);
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    record_name = agent::grant_name(st.st_dev, st.st_ino, 1, 1);
    // Another root directory the user would like root to write into or clean
    // up: a record for the region (root's own) and a file that is not one.
    ASSERT_EQ(mkdir(victim.c_str(), 0700), 0);
    write_file(victim + "/" + record_name, forged_record());
    write_file(victim + "/keep", "root's");
    victim_before = listing(victim);
  }
  void TearDown() override {
    alarm(0);
    if (r != nullptr) shm::detach(r);
  }
  agent::Agent& start_agent() {
    agent_ = std::make_unique<agent::Agent>(cfg);
    agent_->start();
    agent_->cycle();
    return *agent_;
  }
  test::Result smi_set(const std::string& memory) {
    return test::run({test::bin("gpuslice-smi"), "set", "--region", path, "--memory", memory}, {}, 20000);
  }
  std::uint64_t quota() const { return r->devices[dev].quota_bytes.load(); }

  Sandbox box;
  const std::string path = container_region(box);
  const std::string grants = region_dir(box) + "/" + agent::kGrantDirName;
  const std::string victim = box.path("victim");
  agent::AgentConfig cfg;
  Region* r = nullptr;
  int dev = -1;
  std::string record_name;
  std::vector<std::string> victim_before;
  std::unique_ptr<agent::Agent> agent_;
};

// A link planted for the grant directory before the agent made it: neither
// the agent nor smi follows it (the agent would otherwise read the record in
// the other directory and remove every other file there); smi refuses the
// change with the reason instead of making one the agent will put back.
TEST_F(GrantDirSecondUser, ALinkForTheGrantDirectoryIsNeverFollowed) {
  ASSERT_EQ(as_user([&] { return symlink(victim.c_str(), grants.c_str()) == 0 ? 0 : 1; }), 0);
  agent::Agent& a = start_agent();
  for (int i = 0; i < 3; ++i) a.cycle();
  EXPECT_EQ(listing(victim), victim_before) << "nothing read, written or removed through the link";
  EXPECT_EQ(quota(), kGiven);
  EXPECT_EQ(a.stats().tamper.grants_applied, 0u);
  const test::Result set = smi_set("512Mi");
  EXPECT_EQ(set.exit_code, 1) << set.describe();
  EXPECT_NE(set.err.find(".gpuslice-grants"), std::string::npos) << set.err;
  EXPECT_NE(set.err.find("nothing changed"), std::string::npos) << set.err;
  EXPECT_EQ(quota(), kGiven) << "refused: not changed behind the agent's back";
  EXPECT_EQ(listing(victim), victim_before) << "smi wrote nothing through the link";
}

// A FIFO, then a huge (sparse) file, in place of the grant directory: the
// agent's cycles and smi return (bounded by alarm()), and smi refuses.
TEST_F(GrantDirSecondUser, AFifoOrAHugeFileForTheGrantDirectoryBlocksNothing) {
  ASSERT_EQ(as_user([&] { return mkfifo(grants.c_str(), 0666) == 0 ? 0 : 1; }), 0);
  agent::Agent& a = start_agent();
  a.cycle();
  test::Result set = smi_set("512Mi");
  EXPECT_FALSE(set.timed_out);
  EXPECT_EQ(set.exit_code, 1) << set.describe();
  EXPECT_NE(set.err.find(".gpuslice-grants"), std::string::npos) << set.err;
  EXPECT_EQ(quota(), kGiven);
  ASSERT_EQ(as_user([&] {
              if (unlink(grants.c_str()) != 0) return 1;
              const int fd = open(grants.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0666);
              return fd >= 0 && ftruncate(fd, off_t{1} << 40) == 0 && close(fd) == 0 ? 0 : 2;
            }),
            0);
  a.cycle();
  set = smi_set("512Mi");
  EXPECT_EQ(set.exit_code, 1) << set.describe();
  EXPECT_EQ(quota(), kGiven);
  EXPECT_EQ(a.stats().tamper.grants_applied, 0u);
}

// The agent's grant directory, once opened, made world-writable: the user
// drops a FIFO, a link and a huge file under a record's name, its own record
// and, what it cannot make itself, a root-owned record moved in. The agent
// stops reading a directory anyone may write (it checks what it holds, not
// only what it once opened), blocks on nothing and follows nothing; smi
// refuses to record there.
TEST_F(GrantDirSecondUser, AGrantDirectoryMadeWorldWritableIsNoLongerTrusted) {
  agent::Agent& a = start_agent();
  ASSERT_EQ(listing(grants), std::vector<std::string>{}) << "the agent made its grant directory";
  ASSERT_EQ(chmod(grants.c_str(), 0777), 0);
  const std::string victim_file = victim + "/keep";
  ASSERT_EQ(as_user([&] {
              const std::string base = grants + "/" + record_name;
              if (mkfifo((base + "0").c_str(), 0666) != 0) return 1;
              if (symlink(victim_file.c_str(), (base + "1").c_str()) != 0) return 2;
              const int fd = open((base + "2").c_str(), O_WRONLY | O_CREAT | O_EXCL, 0666);
              if (fd < 0 || ftruncate(fd, off_t{1} << 40) != 0 || close(fd) != 0) return 3;
              const std::string text = forged_record();
              const int own = open((base + "3").c_str(), O_WRONLY | O_CREAT | O_EXCL, 0666);
              if (own < 0 || write(own, text.data(), text.size()) != static_cast<ssize_t>(text.size())) return 4;
              return close(own) == 0 ? 0 : 5;
            }),
            0);
  // A root-owned record in the directory anyone may write (as a hard link or
  // a rename by a root process would put it there).
  ASSERT_EQ(rename((victim + "/" + record_name).c_str(), (grants + "/" + record_name + "4").c_str()), 0);
  const std::string log = stderr_of(box.path("agent.log"), [&] {
    for (int i = 0; i < 3; ++i) a.cycle();
  });
  EXPECT_NE(log.find("grant directory " + grants +
                     ": it is no longer owned by uid 0 and writable by its owner only: "
                     "its records are no longer read"),
            std::string::npos)
      << log;
  EXPECT_EQ(quota(), kGiven) << "no record from a world-writable directory is taken";
  EXPECT_EQ(a.stats().tamper.grants_applied, 0u);
  EXPECT_EQ(read_file(victim_file), "root's") << "the link was not followed";
  const test::Result set = smi_set("512Mi");
  EXPECT_EQ(set.exit_code, 1) << set.describe();
  EXPECT_NE(set.err.find(".gpuslice-grants"), std::string::npos) << set.err;
  EXPECT_EQ(quota(), kGiven);
}

// The remedy the agent's error names: the unfit directory removed, the agent
// gives up what it held and makes it again, and smi's records are read there.
TEST_F(GrantDirSecondUser, AGrantDirectoryRemovedIsMadeAgainAndRead) {
  agent::Agent& a = start_agent();
  ASSERT_EQ(rmdir(grants.c_str()), 0);
  a.cycle();
  usleep(1'100'000);  // the agent looks for a missing grant directory once a second
  a.cycle();
  struct stat st {};
  ASSERT_EQ(lstat(grants.c_str(), &st), 0) << "made again";
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  const test::Result set = smi_set("512Mi");
  ASSERT_EQ(set.exit_code, 0) << set.describe();
  for (int i = 0; i < 3; ++i) a.cycle();
  EXPECT_EQ(quota(), 512 * kMi) << "the operator's change is kept";
  EXPECT_EQ(a.stats().tamper.grants_applied, 1u);
  EXPECT_EQ(a.stats().tamper.repairs, 0u);
}

// The user swaps things in and out for the grant directory (the agent's own
// directory renamed away and back, a link to root's other directory, a FIFO,
// its own directory holding a forged record) while the agent cycles and smi
// records changes: nothing is read or written through the link, no forged
// record is taken, nothing blocks, and smi either records (exit 0) or refuses.
TEST_F(GrantDirSecondUser, SwapsRacingTheAgentAndSmiRedirectNothing) {
  agent::Agent& a = start_agent();
  const std::string dir = region_dir(box);
  ASSERT_EQ(as_user([&] {
              if (symlink(victim.c_str(), (dir + "/alt-link").c_str()) != 0) return 1;
              if (mkfifo((dir + "/alt-fifo").c_str(), 0666) != 0) return 2;
              if (mkdir((dir + "/alt-dir").c_str(), 0777) != 0 || chmod((dir + "/alt-dir").c_str(), 0777) != 0)
                return 3;
              const std::string text = forged_record();
              const int fd = open((dir + "/alt-dir/" + record_name).c_str(), O_WRONLY | O_CREAT | O_EXCL, 0666);
              if (fd < 0 || write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) return 4;
              return close(fd) == 0 ? 0 : 5;
            }),
            0);
  // Every path made before fork(): the child only renames and sleeps.
  const std::string away = dir + "/root-grants";
  const std::string alts[] = {dir + "/alt-link", dir + "/alt-fifo", dir + "/alt-dir"};
  const pid_t racer = fork();
  if (racer == 0) {
    if (setgroups(0, nullptr) != 0 || setresgid(kUser, kUser, kUser) != 0 || setresuid(kUser, kUser, kUser) != 0)
      _exit(100);
    for (unsigned i = 0;; ++i) {
      const char* alt = alts[i % 3].c_str();
      // Root's directory out, the alternative in, and back.
      rename(grants.c_str(), away.c_str());
      rename(alt, grants.c_str());
      usleep(500);
      rename(grants.c_str(), alt);
      rename(away.c_str(), grants.c_str());
    }
  }
  ASSERT_GT(racer, 0);
  int recorded = 0, refused = 0;
  for (int i = 0; i < 20; ++i) {
    const test::Result set = smi_set(std::to_string(300 + i) + "Mi");
    EXPECT_FALSE(set.timed_out);
    if (set.exit_code == 0) {
      ++recorded;
    } else {
      ++refused;
      EXPECT_EQ(set.exit_code, 1) << set.describe();
      EXPECT_NE(set.err.find("nothing changed"), std::string::npos) << set.err;
    }
    for (int c = 0; c < 3; ++c) a.cycle();
    EXPECT_NE(quota(), kForged) << "a forged record was taken";
  }
  kill(racer, SIGKILL);
  waitpid(racer, nullptr, 0);
  EXPECT_EQ(listing(victim), victim_before) << "nothing read, written or removed through the link";
  EXPECT_NE(quota(), kForged);
  EXPECT_EQ(recorded + refused, 20);
  std::printf("smi set under the swaps: %d recorded, %d refused\n", recorded, refused);
}

}  // namespace
