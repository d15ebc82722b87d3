// mounts.h against a made-up /proc: the directory's file system and path
// from our own mount table, a mount of it (or below it) in another
// namespace, one namespace read once, escapes in mountinfo paths.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <string>

#include "agent_test_util.h"
#include "mounts.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

std::string devno(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(stat(path.c_str(), &st), 0) << path;
  return std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
}

void mkdirs(const std::string& path) { test::run({"/bin/mkdir", "-p", path}, {}); }

std::string real(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) != nullptr ? buf : path;
}

// A process of the made-up /proc in mount namespace `ns` with these mounts.
void process(const std::string& proc, int pid, const std::string& ns, const std::string& mountinfo) {
  const std::string dir = proc + "/" + std::to_string(pid);
  mkdirs(dir + "/ns");
  ASSERT_EQ(symlink(("mnt:[" + ns + "]").c_str(), (dir + "/ns/mnt").c_str()), 0);
  write_file(dir + "/mountinfo", mountinfo);
}

TEST(AgentMounts, DirectoryMountedInAnotherNamespaceIsInUse) {
  Sandbox box;
  const std::string pods = real(box.path("")) + "/regions";
  mkdirs(pods + "/pod a");
  mkdirs(pods + "/pod-b/sub");
  mkdirs(pods + "/pod-c");
  const std::string dev = devno(pods);
  // Our own table: the file system at /, so paths inside it are the paths.
  const std::string proc = box.path("proc");
  mkdirs(proc + "/self");
  write_file(proc + "/self/mountinfo", "1 0 " + dev + " / / rw - fs none rw\n");
  // A container's namespace: "pod a" bound at /run/gpuslice (the space escaped).
  process(
      proc, 100, "7",
      "1 0 " + dev + " / / rw - fs none rw\n2 1 " + dev + " " + pods + "/pod\\040a /run/gpuslice rw - fs none rw\n");
  // A second process of it: not read again (its mountinfo would fail).
  mkdirs(proc + "/101/ns");
  ASSERT_EQ(symlink("mnt:[7]", (proc + "/101/ns/mnt").c_str()), 0);
  // Another namespace: a directory below pod-b, and pod-c's path on another
  // file system (not the same directory).
  process(
      proc, 200, "8",
      "1 0 " + dev + " " + pods + "/pod-b/sub /x rw - fs none rw\n3 1 250:99 " + pods + "/pod-c /y rw - fs none rw\n");
  const auto used = agent::mounted_somewhere({pods + "/pod a", pods + "/pod-b", pods + "/pod-c", pods}, proc);
  ASSERT_EQ(used.size(), 4u);
  EXPECT_TRUE(used[0]) << "bound into a container";
  EXPECT_TRUE(used[1]) << "a directory below it is bound";
  EXPECT_FALSE(used[2]) << "only a same-named path of another file system";
  EXPECT_TRUE(used[3]) << "holds mounted directories";
  // The container's namespace gone: free.
  test::run({"/bin/rm", "-rf", proc + "/100", proc + "/101"}, {});
  EXPECT_FALSE(agent::mounted_somewhere({pods + "/pod a"}, proc)[0]);
}

TEST(AgentMounts, WhatCannotBeKnownCountsAsMounted) {
  Sandbox box;
  const std::string pods = real(box.path("")) + "/regions";
  mkdirs(pods + "/pod");
  const std::string proc = box.path("proc");
  mkdirs(proc + "/self");
  // Our own table does not name the directory's file system.
  write_file(proc + "/self/mountinfo", "1 0 250:99 / / rw - fs none rw\n");
  EXPECT_TRUE(agent::mounted_somewhere({pods + "/pod"}, proc)[0]);
  EXPECT_EQ(agent::mountinfo_unescape("a\\040b\\011c\\134d\\0"), std::string("a b\tc\\d\\0"));
}

}  // namespace
