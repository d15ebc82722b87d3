// Creating, attaching and validating the region file.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "support.h"

namespace gpuslice::test {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
  }
  closedir(d);
  return names;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A valid region's bytes, from a real attach.
std::string valid_region_bytes(const TempDir& dir) {
  const std::string path = dir.file("template");
  shm::Error err{};
  Region* r = shm::attach(path.c_str(), "template", &err);
  EXPECT_NE(r, nullptr) << err.message;
  shm::detach(r);
  std::string bytes = read_file(path);
  unlink(path.c_str());
  return bytes;
}

// Creates the region file at `path` by a real attach, and leaves it unused.
void create_region_file(const std::string& path) {
  shm::Error err{};
  int fd = -1;
  Region* r = shm::attach(path.c_str(), "n", &err, nullptr, &fd);
  ASSERT_NE(r, nullptr) << err.message;
  shm::end_attach(fd);
  close(fd);
  shm::detach(r);
}

template <class T>
void poke(std::string& bytes, std::size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
}

TEST(RegionFile, CreatesAndInitialises) {
  TempDir dir;
  const std::string path = dir.file("sub/dir/region");  // parents are created
  shm::Error err{};
  bool created = false;
  Region* r = shm::attach(path.c_str(), "my-container", &err, &created);
  ASSERT_NE(r, nullptr) << err.message;
  EXPECT_TRUE(created);
  EXPECT_EQ(r->header.magic, kRegionMagic);
  EXPECT_EQ(r->header.abi_version, kRegionAbiVersion);
  EXPECT_EQ(r->header.header_size, sizeof(RegionHeader));
  EXPECT_EQ(r->header.total_size, sizeof(Region));
  EXPECT_EQ(r->header.max_devices, kMaxDevices);
  EXPECT_EQ(r->header.max_slots, kMaxSlots);
  EXPECT_NE(r->header.created_ns, 0u);
  EXPECT_STREQ(r->header.container_name, "my-container");
  EXPECT_EQ(r->slots[17].state.load(), kSlotFree);
  EXPECT_EQ(r->devices[3].uuid_state.load(), 0u);

  // A second attach maps the same file and does not create it.
  Region* again = shm::attach(path.c_str(), "other-name", &err, &created);
  ASSERT_NE(again, nullptr) << err.message;
  EXPECT_FALSE(created);
  EXPECT_STREQ(again->header.container_name, "my-container");  // recorded at creation only
  r->devices[0].oom_refusals.fetch_add(7);
  EXPECT_EQ(again->devices[0].oom_refusals.load(), 7u);
  shm::detach(again);
  shm::detach(r);
  EXPECT_EQ(list_dir(dir.file("sub/dir")), std::vector<std::string>{"region"});  // no temporary left behind
}

// Every user of the container shares the region (docs/security.md): 0666
// whatever the creator's umask, which the library never touches.
TEST(RegionFile, ModeIs0666WhateverTheUmaskWithoutChangingIt) {
  TempDir dir;
  const mode_t saved = umask(077);
  shm::Error err{};
  Region* r = shm::attach(dir.file("region").c_str(), "", &err);
  ASSERT_NE(r, nullptr) << err.message;
  shm::detach(r);
  struct stat st;
  ASSERT_EQ(stat(dir.file("region").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666u);
  EXPECT_EQ(st.st_size, static_cast<off_t>(sizeof(Region)));
  const mode_t after = umask(saved);
  EXPECT_EQ(after, 077u);  // the library never touched it
}

TEST(RegionFile, LongContainerNameIsTruncated) {
  TempDir dir;
  shm::Error err{};
  const std::string name(200, 'n');
  Region* r = shm::attach(dir.file("region").c_str(), name.c_str(), &err);
  ASSERT_NE(r, nullptr) << err.message;
  EXPECT_EQ(std::strlen(r->header.container_name), 63u);
  shm::detach(r);
}

TEST(RegionFile, ThreadsRaceToCreate) {
  for (int round = 0; round < 5; ++round) {
    TempDir dir;
    const std::string path = dir.file("region");
    constexpr int kThreads = 12;
    std::atomic<int> ready{0};
    std::atomic<int> creators{0};
    std::vector<Region*> regions(kThreads, nullptr);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        ready.fetch_add(1);
        while (ready.load() < kThreads) {}
        shm::Error err{};
        bool created = false;
        regions[i] = shm::attach(path.c_str(), "race", &err, &created);
        if (created) creators.fetch_add(1);
        EXPECT_NE(regions[i], nullptr) << err.message;
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(creators.load(), 1);
    for (Region* r : regions) {
      ASSERT_NE(r, nullptr);
      r->devices[1].oom_refusals.fetch_add(1);
    }
    for (Region* r : regions) EXPECT_EQ(r->devices[1].oom_refusals.load(), static_cast<std::uint64_t>(kThreads));
    for (Region* r : regions) shm::detach(r);
    EXPECT_EQ(list_dir(dir.path()), std::vector<std::string>{"region"});
  }
}

TEST(RegionFile, ProcessesRaceToCreate) {
  for (int round = 0; round < 5; ++round) {
    TempDir dir;
    const std::string path = dir.file("a/region");
    constexpr int kChildren = 8;
    Signal go;
    std::vector<pid_t> pids;
    for (int i = 0; i < kChildren; ++i) {
      pids.push_back(fork_child([&] {
        go.close_write();
        go.wait(10000);  // all start together when the pipe closes
        shm::Error err{};
        bool created = false;
        Region* r = shm::attach(path.c_str(), "race", &err, &created);
        if (r == nullptr) return 2;
        r->devices[2].oom_refusals.fetch_add(1);
        shm::detach(r);
        return created ? 1 : 0;
      }));
    }
    go.close_write();  // EOF wakes every child at once
    int creators = 0;
    for (pid_t pid : pids) {
      const int rc = wait_child(pid);
      ASSERT_TRUE(rc == 0 || rc == 1) << "child failed: " << rc;
      creators += rc;
    }
    EXPECT_EQ(creators, 1);
    shm::Error err{};
    Region* r = shm::attach_existing(path.c_str(), false, &err);
    ASSERT_NE(r, nullptr) << err.message;
    EXPECT_EQ(r->devices[2].oom_refusals.load(), static_cast<std::uint64_t>(kChildren));
    shm::detach(r);
    EXPECT_EQ(list_dir(dir.file("a")), std::vector<std::string>{"region"});
  }
}

class RegionValidation : public ::testing::Test {
 protected:
  void expect_rejected(const std::string& bytes, const std::string& what, const std::string& expected) {
    const std::string path = dir_.file("bad.region");
    write_file(path, bytes);
    shm::Error err{};
    EXPECT_EQ(shm::attach(path.c_str(), "x", &err), nullptr);
    const std::string message = err.message;
    EXPECT_THAT(message, HasSubstr("gpuslice: GPUSLICE_REGION=" + path + ": "));
    EXPECT_THAT(message, HasSubstr(what));
    EXPECT_THAT(message, HasSubstr(expected));
    EXPECT_EQ(message.find('\n'), std::string::npos);
    // The tools' read-only path says the same.
    EXPECT_EQ(shm::attach_existing(path.c_str(), false, &err), nullptr);
    EXPECT_THAT(std::string(err.message), HasSubstr(what));
    // And the file is left alone.
    EXPECT_EQ(read_file(path), bytes);
  }
  TempDir dir_;
};

TEST_F(RegionValidation, BadMagic) {
  std::string bytes = valid_region_bytes(dir_);
  poke<std::uint64_t>(bytes, 0, 0x1122334455667788ull);
  expect_rejected(bytes, "bad magic 0x1122334455667788", "expected magic 0x45434c5353555047");
}

TEST_F(RegionValidation, ForeignFileOfAnySize) {
  expect_rejected("hello, this is not a region at all", "bad magic", "expected magic");
}

TEST_F(RegionValidation, OtherAbiVersion) {
  std::string bytes = valid_region_bytes(dir_);
  poke<std::uint32_t>(bytes, offsetof(RegionHeader, abi_version), kRegionAbiVersion + 1);
  expect_rejected(bytes, "region ABI version " + std::to_string(kRegionAbiVersion + 1),
                  "expected version " + std::to_string(kRegionAbiVersion));
}

// The size the library expects (region_layout_test pins it).
const std::string kRegionSize = std::to_string(sizeof(Region));

TEST_F(RegionValidation, Empty) {
  expect_rejected("", "holds only 0 bytes", "expected a gpuslice region of " + kRegionSize + " bytes");
}

TEST_F(RegionValidation, TruncatedHeader) {
  std::string bytes = valid_region_bytes(dir_);
  expect_rejected(bytes.substr(0, 100), "truncated header: file holds 100 bytes",
                  "expected a gpuslice region of " + kRegionSize);
}

TEST_F(RegionValidation, TruncatedBody) {
  std::string bytes = valid_region_bytes(dir_);
  expect_rejected(bytes.substr(0, 4096), "wrong size: file holds 4096 bytes",
                  "expected total_size " + kRegionSize + " bytes");
}

TEST_F(RegionValidation, GrownFile) {
  std::string bytes = valid_region_bytes(dir_) + std::string(4096, '\0');
  expect_rejected(bytes, "wrong size: file holds " + std::to_string(sizeof(Region) + 4096) + " bytes",
                  "expected total_size " + kRegionSize);
}

TEST_F(RegionValidation, HeaderFields) {
  const std::string good = valid_region_bytes(dir_);
  std::string bytes = good;
  poke<std::uint32_t>(bytes, offsetof(RegionHeader, header_size), 1024);
  expect_rejected(bytes, "header_size 1024", "expected 512");
  bytes = good;
  poke<std::uint64_t>(bytes, offsetof(RegionHeader, total_size), 1);
  expect_rejected(bytes, "total_size 1", "expected " + kRegionSize);
  bytes = good;
  poke<std::uint32_t>(bytes, offsetof(RegionHeader, max_devices), 8);
  expect_rejected(bytes, "max_devices 8", "expected 16");
  bytes = good;
  poke<std::uint32_t>(bytes, offsetof(RegionHeader, max_slots), 4096);
  expect_rejected(bytes, "max_slots 4096", "expected 1024");
  bytes = good;
  std::memset(bytes.data() + offsetof(RegionHeader, container_name), 'x', 64);
  expect_rejected(bytes, "container_name is not NUL-terminated", "expected at most 63 bytes");
}

TEST_F(RegionValidation, NotARegularFile) {
  const std::string path = dir_.file("adir");
  ASSERT_EQ(mkdir(path.c_str(), 0755), 0);
  shm::Error err{};
  EXPECT_EQ(shm::attach(path.c_str(), "x", &err), nullptr);
  EXPECT_THAT(std::string(err.message), HasSubstr(path));
  EXPECT_THAT(std::string(err.message), HasSubstr("expected"));
}

TEST_F(RegionValidation, ParentIsAFile) {
  write_file(dir_.file("file"), "x");
  const std::string path = dir_.file("file/region");
  shm::Error err{};
  EXPECT_EQ(shm::attach(path.c_str(), "x", &err), nullptr);
  EXPECT_THAT(std::string(err.message), HasSubstr("GPUSLICE_REGION=" + path));
  EXPECT_THAT(std::string(err.message), HasSubstr("Not a directory (ENOTDIR)"));
}

TEST_F(RegionValidation, RelativeAndEmptyPaths) {
  shm::Error err{};
  EXPECT_EQ(shm::attach("", "x", &err), nullptr);
  EXPECT_THAT(std::string(err.message), HasSubstr("empty path, expected"));
  const std::string huge = "/" + std::string(5000, 'a');
  EXPECT_EQ(shm::attach(huge.c_str(), "x", &err), nullptr);
  EXPECT_THAT(std::string(err.message), HasSubstr("path too long"));
}

// Root ignores directory permissions: drop to nobody in a child for the test.
TEST_F(RegionValidation, UnwritableDirectory) {
  const std::string locked = dir_.file("locked");
  ASSERT_EQ(mkdir(locked.c_str(), 0755), 0);
  const std::string path = locked + "/region";
  std::string message;
  if (geteuid() == 0) {
    ASSERT_EQ(chmod(dir_.path().c_str(), 0755), 0);
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = fork_child([&] {
      close(fds[0]);
      if (setgid(65534) != 0 || setuid(65534) != 0) return 3;
      shm::Error err{};
      Region* r = shm::attach(path.c_str(), "x", &err);
      const std::size_t n = std::strlen(err.message);
      if (write(fds[1], err.message, n) != static_cast<ssize_t>(n)) return 4;
      return r == nullptr ? 0 : 1;
    });
    close(fds[1]);
    char buf[600] = {};
    std::size_t got = 0;
    ssize_t n;
    while ((n = read(fds[0], buf + got, sizeof buf - 1 - got)) > 0) got += static_cast<std::size_t>(n);
    close(fds[0]);
    ASSERT_EQ(wait_child(pid), 0);
    message = buf;
  } else {
    ASSERT_EQ(chmod(locked.c_str(), 0555), 0);
    shm::Error err{};
    EXPECT_EQ(shm::attach(path.c_str(), "x", &err), nullptr);
    message = err.message;
  }
  EXPECT_THAT(message, HasSubstr("gpuslice: GPUSLICE_REGION=" + path + ": cannot create a file in " + locked));
  EXPECT_THAT(message, HasSubstr("Permission denied (EACCES)"));
  EXPECT_THAT(message, HasSubstr("expected a directory writable by uid"));
}

TEST(RegionFile, AttachExistingDoesNotCreate) {
  TempDir dir;
  const std::string path = dir.file("region");
  shm::Error err{};
  EXPECT_EQ(shm::attach_existing(path.c_str(), true, &err), nullptr);
  EXPECT_THAT(std::string(err.message),
              HasSubstr("No such file or directory (ENOENT), expected an existing region file"));
  EXPECT_TRUE(list_dir(dir.path()).empty());
  Region* created = shm::attach(path.c_str(), "n", &err);
  ASSERT_NE(created, nullptr);
  Region* ro = shm::attach_existing(path.c_str(), false, &err);
  ASSERT_NE(ro, nullptr) << err.message;
  created->devices[0].used_bytes.store(42);
  EXPECT_EQ(ro->devices[0].used_bytes.load(), 42u);
  shm::detach(ro);
  shm::detach(created);
}

// The joining lock (docs/agent.md, "Removal"): a process that created or
// opened the region (attach with a descriptor) holds it until end_attach; a
// remover (the agent, its own description) cannot take it meanwhile.
TEST(RegionFile, AJoiningProcessHoldsTheRegionUntilEndAttach) {
  TempDir dir;
  const std::string path = dir.file("region");
  shm::Error err{};
  for (int round = 0; round < 2; ++round) {  // 0: creates it, 1: opens it
    int fd = -1;
    bool created = false;
    Region* r = shm::attach(path.c_str(), "n", &err, &created, &fd);
    ASSERT_NE(r, nullptr) << err.message;
    EXPECT_EQ(created, round == 0);
    const int remover = open(path.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(remover, 0);
    EXPECT_FALSE(shm::lock_for_removal(remover)) << "round " << round;
    shm::end_attach(fd);
    EXPECT_TRUE(shm::lock_for_removal(remover)) << "round " << round;
    shm::unlock_for_removal(remover);
    close(remover);
    close(fd);
    shm::detach(r);
  }
}

// Issue 32 (seed 2,600,448; docs/log/2026-11-29-two-regions.md): the remover
// may go on (read the slots, rename or unlink the region) only while it holds
// the joining lock. A failed take followed by a probe that finds the lock free
// (the joiner that held it let go in between) is not a lock: a joiner arriving
// then joins and claims a slot the remover's read of the slots missed, in a
// region renamed away right after. Here joiners come and go on their own
// descriptions while a remover asks again and again; whenever it is told it
// may remove, a third description must be refused the joining lock.
TEST(RegionFile, ARemoverToldItMayRemoveAlwaysHoldsTheJoiningLock) {
  TempDir dir;
  const std::string path = dir.file("region");
  ASSERT_NO_FATAL_FAILURE(create_region_file(path));
  const int remover = open(path.c_str(), O_RDWR | O_CLOEXEC);
  const int checker = open(path.c_str(), O_RDWR | O_CLOEXEC);
  const int joiner_fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(remover, 0);
  ASSERT_GE(checker, 0);
  ASSERT_GE(joiner_fd, 0);
  std::atomic<bool> stop{false};
  std::thread joiner([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      if (shm::begin_attach(joiner_fd) == shm::Join::held) shm::end_attach(joiner_fd);
    }
  });
  int granted = 0;
  int unlocked_grants = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (int i = 0; i < 200000 && unlocked_grants == 0 && std::chrono::steady_clock::now() < deadline; ++i) {
    if (!shm::lock_for_removal(remover)) continue;
    ++granted;
    if (shm::begin_attach(checker) == shm::Join::held) {
      ++unlocked_grants;
      shm::end_attach(checker);
    }
    shm::unlock_for_removal(remover);
  }
  stop = true;
  joiner.join();
  close(joiner_fd);
  close(checker);
  close(remover);
  EXPECT_GT(granted, 0) << "the remover was never told it may remove: the test tested nothing";
  EXPECT_EQ(unlocked_grants, 0) << "told it may remove (of " << granted
                                << " grants) while a joiner could still take the joining lock";
}

// A remover (the agent) descheduled while it holds the joining lock must not
// fail a process's start: the joiner waits for it, then joins (the remover
// here gives the region up without renaming it) — seen in a chaos seed where
// a loaded agent held the lock across the joiner's few rounds of yields and
// cuInit failed ("keeps appearing and disappearing").
TEST(RegionFile, AJoinerWaitsForARemoverHoldingTheLock) {
  TempDir dir;
  const std::string path = dir.file("region");
  ASSERT_NO_FATAL_FAILURE(create_region_file(path));
  const int remover = open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(remover, 0);
  ASSERT_TRUE(shm::lock_for_removal(remover));
  std::atomic<bool> done{false};
  Region* joined = nullptr;
  bool created = true;
  int fd = -1;
  shm::Error join_err{};
  std::thread joiner([&] {
    joined = shm::attach(path.c_str(), "n", &join_err, &created, &fd);
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const bool returned_while_locked = done.load();
  shm::unlock_for_removal(remover);
  joiner.join();
  close(remover);
  EXPECT_FALSE(returned_while_locked) << "the joiner gave up while the remover held the lock: " << join_err.message;
  ASSERT_NE(joined, nullptr) << join_err.message;
  EXPECT_FALSE(created);
  shm::end_attach(fd);
  close(fd);
  shm::detach(joined);
}

TEST(RegionHeaderValidation, DirectCalls) {
  TempDir dir;
  std::string good = valid_region_bytes(dir);
  shm::Error err{};
  EXPECT_TRUE(shm::validate_header(good.data(), good.size(), &err)) << err.message;
  EXPECT_STREQ(err.message, "");
  EXPECT_FALSE(shm::validate_header(nullptr, 0, &err));
  EXPECT_THAT(std::string(err.message), HasSubstr("gpuslice: region header: file holds only 0 bytes"));
  for (std::size_t n : {1u, 7u, 8u, 200u, 247u, 248u, 4096u}) {
    EXPECT_FALSE(shm::validate_header(good.data(), n, &err)) << n;
    EXPECT_THAT(std::string(err.message), HasSubstr("expected")) << n;
  }
}

}  // namespace
}  // namespace gpuslice::test
