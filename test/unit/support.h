// Helpers shared by the unit tests: temporary directories, forked children,
// a fresh region per test.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>

#include "gpuslice/region.h"
#include "shm/region_file.h"

namespace gpuslice::test {

// A fresh directory under $TMPDIR (or /tmp), removed with its content.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A region in its own temporary directory.
class RegionFixture : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  TempDir dir_;
  std::string path_;
  Region* region_ = nullptr;
  shm::ProcessIdentity self_{};
};

// Runs body in a forked child that exits with its return value (0-255) and
// never returns into the test framework.
pid_t fork_child(const std::function<int()>& body);
// Exit status of a child (-signal if it was killed).
int wait_child(pid_t pid);

// A one-shot pipe: the child writes one byte when ready, the parent waits.
class Signal {
 public:
  Signal();
  ~Signal();
  void notify();              // write one byte
  bool wait(int timeout_ms);  // read one byte
  void close_read();
  void close_write();

 private:
  int fds_[2];
};

// Device entry with a fresh UUID derived from n, with the given quota.
int make_device(Region* r, int n, std::uint64_t quota);

// Identity of a process that is certainly dead: our own pid with another
// start time (a reused pid).
shm::ProcessIdentity dead_identity(const shm::ProcessIdentity& self, std::uint64_t salt = 1);

}  // namespace gpuslice::test
