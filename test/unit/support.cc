#include "support.h"

#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>

namespace gpuslice::test {

TempDir::TempDir() {
  const char* base = getenv("TMPDIR");
  std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/gpuslice-test-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp: " << strerror(errno);
  }
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  // Make everything removable again (tests make directories read-only).
  for (auto it = std::filesystem::recursive_directory_iterator(path_, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_directory(ec)) chmod(it->path().c_str(), 0755);
  }
  chmod(path_.c_str(), 0755);
  std::filesystem::remove_all(path_, ec);
}

void RegionFixture::SetUp() {
  path_ = dir_.file("region");
  shm::Error err{};
  region_ = shm::attach(path_.c_str(), "unit", &err);
  ASSERT_NE(region_, nullptr) << err.message;
  ASSERT_TRUE(shm::read_identity(0, &self_));
}

void RegionFixture::TearDown() { shm::detach(region_); }

pid_t fork_child(const std::function<int()>& body) {
  fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    int rc = 255;
    rc = body();
    _exit(rc);
  }
  return pid;
}

int wait_child(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1000;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1000;
}

Signal::Signal() {
  if (pipe2(fds_, O_CLOEXEC) != 0) ADD_FAILURE() << "pipe2";
}

Signal::~Signal() {
  close_read();
  close_write();
}

void Signal::notify() {
  const char c = 1;
  if (write(fds_[1], &c, 1) != 1) _exit(250);
}

bool Signal::wait(int timeout_ms) {
  pollfd p{fds_[0], POLLIN, 0};
  if (poll(&p, 1, timeout_ms) != 1) return false;
  char c;
  return read(fds_[0], &c, 1) == 1;
}

void Signal::close_read() {
  if (fds_[0] >= 0) close(fds_[0]);
  fds_[0] = -1;
}

void Signal::close_write() {
  if (fds_[1] >= 0) close(fds_[1]);
  fds_[1] = -1;
}

int make_device(Region* r, int n, std::uint64_t quota) {
  std::uint8_t uuid[16] = {};
  uuid[0] = 0xab;
  uuid[15] = static_cast<std::uint8_t>(n);
  uuid[14] = static_cast<std::uint8_t>(n >> 8);
  return shm::device_index(r, uuid, quota, 100, SmPolicy::hard);
}

shm::ProcessIdentity dead_identity(const shm::ProcessIdentity& self, std::uint64_t salt) {
  shm::ProcessIdentity id = self;
  id.start_time = self.start_time + salt;
  return id;
}

}  // namespace gpuslice::test
