// include/platform/procfs: the one /proc parser of the library, the agent and the tools.
// Hostile comm names (spaces, parentheses, newlines) and malformed files.
#include "platform/procfs.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <atomic>
#include <filesystem>
#include <thread>

namespace platform = gpuslice::platform;

namespace {

// A stat line of `comm` with state `state` and start time `start` (field 22).
std::string stat_line(const std::string& comm, char state, const std::string& start) {
  std::string s = "4242 (";
  s.append(comm).append(") ").push_back(state);
  for (int field = 4; field < 22; ++field) s.append(" ").append(std::to_string(field * 3));
  s.append(" ").append(start).append(" 123 456 789\n");
  return s;
}

bool parse(const std::string& text, platform::procfs::Stat* out) {
  return platform::procfs::parse_stat(text.data(), text.size(), out);
}
bool nspid(const std::string& text, platform::procfs::NsPids* out) {
  return platform::procfs::parse_nspid(text.data(), text.size(), out);
}

}  // namespace

TEST(ProcStat, ReadsPidStateAndStartTime) {
  platform::procfs::Stat s;
  ASSERT_TRUE(parse(stat_line("python3", 'S', "987654321"), &s));
  EXPECT_EQ(s.pid, 4242u);
  EXPECT_EQ(s.state, 'S');
  EXPECT_EQ(s.start_time, 987654321u);
  EXPECT_EQ(s.num_threads, 60u);  // field 20 of the synthetic line
  EXPECT_EQ(s.flags, 27u);        // field 9
}

// In its exit (the chaos monitor's mid-exit): a SIGKILLed process's leader
// runs its exit with its files closed before it is a zombie (state R, field
// 9's PF_EXITING 0x4: ASan CI, seed 21 of the agent's subset); a zombie
// leader counts only while other threads still exit.
std::string stat_with(char state, unsigned flags, unsigned threads) {
  std::string s = "4242 (w) ";
  s.push_back(state);
  for (int field = 4; field < 22; ++field) {
    const unsigned v = field == 9 ? flags : field == 20 ? threads : 1u;
    s.append(" ").append(std::to_string(v));
  }
  return s.append(" 777 1 2\n");
}
TEST(ProcStat, InExitCoversALeaderRunningItsExitBeforeItIsAZombie) {
  const auto judged = [](char state, unsigned flags, unsigned threads) {
    platform::procfs::Stat s;
    EXPECT_TRUE(parse(stat_with(state, flags, threads), &s));
    EXPECT_EQ(s.flags, flags);
    EXPECT_EQ(s.num_threads, threads);
    return platform::procfs::in_exit(s);
  };
  EXPECT_TRUE(judged('R', 0x4 | 0x400000, 3));  // PF_EXITING (a SIGKILL's exit, files closed)
  EXPECT_TRUE(judged('D', 0x4, 1));
  EXPECT_TRUE(judged('Z', 0x4, 2));        // a zombie leader, one thread still exiting
  EXPECT_FALSE(judged('Z', 0x4, 1));       // all gone but the leader: dead
  EXPECT_FALSE(judged('R', 0x400000, 3));  // running, not exiting
  EXPECT_FALSE(judged('S', 0x40, 1));
  EXPECT_FALSE(judged('X', 0x4, 1));
}

// Field 20 is the thread group's size: what /proc/self/task lists (counted
// by the kernel, whatever helper threads a runtime such as TSan runs).
TEST(ProcStat, OwnThreadCount) {
  std::atomic<bool> stop{false};
  std::thread t([&] {
    while (!stop.load()) usleep(1000);
  });
  platform::procfs::Stat s;
  ASSERT_EQ(platform::procfs::read_stat(0, &s), 0);
  std::uint64_t tasks = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) tasks += entry.exists() ? 1 : 0;
  EXPECT_GE(s.num_threads, 2u);
  EXPECT_EQ(s.num_threads, tasks);
  stop.store(true);
  t.join();
}

TEST(ProcStat, CommWithSpacesAndParenthesesEndsAtTheLastParenthesis) {
  platform::procfs::Stat s;
  ASSERT_TRUE(parse(stat_line("a) Z 1 (b", 'R', "77"), &s));  // a fake state and fields inside comm
  EXPECT_EQ(s.state, 'R');
  EXPECT_EQ(s.start_time, 77u);
  ASSERT_TRUE(parse(stat_line(") ) )", 'Z', "5"), &s));
  EXPECT_EQ(s.state, 'Z');
  EXPECT_EQ(s.start_time, 5u);
  ASSERT_TRUE(parse(stat_line("two\nlines", 'D', "9"), &s));  // comm may hold any byte but NUL
  EXPECT_EQ(s.state, 'D');
  EXPECT_EQ(s.start_time, 9u);
  ASSERT_TRUE(parse(stat_line("", 'S', "1"), &s));
  EXPECT_EQ(s.start_time, 1u);
}

TEST(ProcStat, TheLastFieldNeedsNoSeparator) {
  std::string line = stat_line("x", 'S', "31337");
  line.resize(line.find(" 123 456"));
  platform::procfs::Stat s;
  ASSERT_TRUE(parse(line, &s));
  EXPECT_EQ(s.start_time, 31337u);
}

TEST(ProcStat, MalformedLinesAreRefused) {
  platform::procfs::Stat s;
  s.start_time = 11;
  EXPECT_FALSE(parse("", &s));
  EXPECT_FALSE(parse("4242", &s));
  EXPECT_FALSE(parse("4242 (no closing S 1 2 3", &s));
  const std::string fields = stat_line("", 'S', "1").substr(9);  // " 12 15 ... 1 123 456 789\n"
  platform::procfs::Stat ok;
  ASSERT_TRUE(parse("4242 (comm) S" + fields, &ok));  // the cases below differ from it in one place
  EXPECT_FALSE(parse("x242 (comm) S" + stat_line("", 'S', "1").substr(9), &s));  // pid not a number
  EXPECT_FALSE(parse("4242 comm) S" + stat_line("", 'S', "1").substr(9), &s));   // no '('
  EXPECT_FALSE(parse(stat_line("c", 'S', "12x"), &s));                           // junk in field 22
  EXPECT_FALSE(parse(stat_line("c", 'S', ""), &s));                              // empty field 22
  EXPECT_FALSE(parse(stat_line("c", 'S', "99999999999999999999999"), &s));       // overflows 64 bits
  std::string cut = stat_line("c", 'S', "1");
  cut.resize(cut.find(" 60 "));  // ends at field 20
  EXPECT_FALSE(parse(cut, &s));
  EXPECT_FALSE(parse("4242 (c)  S 1 2", &s));                                        // two spaces: no state
  EXPECT_FALSE(parse("99999999999 (c) S" + stat_line("", 'S', "1").substr(9), &s));  // pid beyond 32 bits
  EXPECT_EQ(s.start_time, 11u) << "a refused line leaves the output alone";
}

TEST(ProcStat, ThisProcess) {
  platform::procfs::Stat s;
  ASSERT_EQ(platform::procfs::read_stat(0, &s), 0);
  EXPECT_EQ(s.pid, static_cast<std::uint32_t>(getpid()));
  EXPECT_EQ(s.state, 'R');
  EXPECT_GT(s.start_time, 0u);
  platform::procfs::Stat by_pid;
  ASSERT_EQ(platform::procfs::read_stat(static_cast<std::uint32_t>(getpid()), &by_pid), 0);
  EXPECT_EQ(by_pid.start_time, s.start_time);
}

TEST(ProcStat, AMissingProcessIsENOENT) {
  platform::procfs::Stat s;
  EXPECT_EQ(platform::procfs::read_stat(0x7ffffff0u, &s), ENOENT);
}

TEST(ProcNsPid, OutermostAndInnermost) {
  platform::procfs::NsPids p;
  ASSERT_TRUE(nspid("Name:\tx\nNStgid:\t1234\t56\t7\nNSpid:\t1234\t56\t7\nNSpgid:\t1\n", &p));
  EXPECT_EQ(p.outermost, 1234u);
  EXPECT_EQ(p.innermost, 7u);
  ASSERT_TRUE(nspid("NSpid:\t99\n", &p));  // first line, one namespace
  EXPECT_EQ(p.outermost, 99u);
  EXPECT_EQ(p.innermost, 99u);
  ASSERT_TRUE(nspid("Pid:\t5\nNSpid:  8 9", &p));  // spaces, no final newline
  EXPECT_EQ(p.outermost, 8u);
  EXPECT_EQ(p.innermost, 9u);
}

TEST(ProcNsPid, MissingOrMalformedLinesAreRefused) {
  platform::procfs::NsPids p;
  p.outermost = 3;
  EXPECT_FALSE(nspid("", &p));
  EXPECT_FALSE(nspid("Name:\tNSpid: 5\nPid:\t5\n", &p));  // only at a line's start
  EXPECT_FALSE(nspid("NSpid:\n", &p));
  EXPECT_FALSE(nspid("NSpid:\t12x\n", &p));
  EXPECT_FALSE(nspid("NSpid:\t0\n", &p));
  EXPECT_FALSE(nspid("NSpid:\t4294967296\n", &p));
  EXPECT_EQ(p.outermost, 3u);
}

TEST(ProcNsPid, ThisProcess) {
  platform::procfs::NsPids p;
  ASSERT_EQ(platform::procfs::read_nspid(0, &p), 0);
  EXPECT_EQ(p.innermost, static_cast<std::uint32_t>(getpid()));
  EXPECT_NE(p.outermost, 0u);
}

TEST(ProcFile, ReadsWholeAndCutsAtTheBuffer) {
  char path[] = "/tmp/procfs_test_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "0123456789", 10), 10);
  close(fd);
  char buf[32];
  EXPECT_EQ(platform::procfs::read_file(path, buf, sizeof buf), 10);
  EXPECT_STREQ(buf, "0123456789");
  char small[5];
  EXPECT_EQ(platform::procfs::read_file(path, small, sizeof small), 4);
  EXPECT_STREQ(small, "0123");
  unlink(path);
  EXPECT_EQ(platform::procfs::read_file(path, buf, sizeof buf), -ENOENT);
}

TEST(ProcFile, Paths) {
  char buf[64];
  platform::procfs::path(buf, sizeof buf, 0, "stat");
  EXPECT_STREQ(buf, "/proc/self/stat");
  platform::procfs::path(buf, sizeof buf, 4242, "ns/pid");
  EXPECT_STREQ(buf, "/proc/4242/ns/pid");
}
