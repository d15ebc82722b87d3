// The node's library file changes under running processes: gpuslice's own
// install and upgrade path (deploy/install-library.sh) replaces it by rename,
// and HAMi's device plugin, at every start, copies its own libvgpu.so.<version>
// onto the same path with a plain `cp` (vgpu_init.sh, HAMi's docker/vgpu-init.sh
// logic). A process with the library mapped (LD_PRELOAD of that path, as the
// container's bind mount of it) keeps making CUDA calls against the simulated
// driver meanwhile and must finish them all, limited, unharmed.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

using namespace std::string_literals;
using gpuslice::test::Result;
using gpuslice::test::Sandbox;

namespace {

constexpr char kInstall[] = GPUSLICE_DEPLOY_DIR "/install-library.sh";
constexpr char kVgpuInit[] = GPUSLICE_HAMI_SOURCE_DIR "/vgpu_init.sh";
constexpr unsigned long long kQuota = 64ull << 20;

void write_file(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

ino_t inode(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

bool immutable(const std::string& path) {
  const Result r = gpuslice::test::run({"/usr/bin/lsattr", "-d", path}, {}, 10000);
  return r.exit_code == 0 && r.out.substr(0, r.out.find(' ')).find('i') != std::string::npos;
}

// A HAMi node: <hook>/vgpu on the host and the device-plugin image's library directory.
struct Node {
  Sandbox box;
  std::string vgpu = box.path("vgpu");
  std::string target = vgpu + "/libvgpu.so.v2.5.0";  // what HAMi mounts at /usr/local/vgpu/libvgpu.so
  std::string image = box.path("k8s-vgpu-lib-nvidia");
  std::string ready = box.path("ready");
  std::string out = box.path("workload.out");
  std::string gpuslice = gpuslice::test::read_text(gpuslice::test::preload_library());

  Node() {
    mkdir(vgpu.c_str(), 0755);
    mkdir(image.c_str(), 0755);
    // HAMi-core as the image ships it: another library (here the simulated
    // NVML, any ELF file whose bytes differ does the same damage).
    write_file(image + "/libvgpu.so.v2.5.0",
               gpuslice::test::read_text(gpuslice::test::fakecuda_dir() + "/libnvidia-ml.so.1"));
    write_file(image + "/ld.so.preload", "/usr/local/vgpu/libvgpu.so\n");
  }
  ~Node() { gpuslice::test::run({kInstall, "--release", target}, {}, 10000); }

  Result install(const std::string& source, bool protect) const {
    std::vector<std::string> argv = {kInstall};
    if (protect) argv.push_back("--protect");
    argv.push_back(source);
    argv.push_back(target);
    return gpuslice::test::run(argv, {}, 30000);
  }

  // cuprobe with the library at the target path preloaded, a 64 MiB quota,
  // about 3 s of allocations, frees and memory queries.
  pid_t start_workload() const {
    std::vector<std::string> argv = {gpuslice::test::bin("cuprobe"), "init", "ctx", "0", "meminfo", "touch", ready};
    for (int i = 0; i < 150; ++i) {
      for (const char* a : {"alloc", "4194304", "meminfo", "free", "sleep", "20"}) argv.push_back(a);
    }
    const gpuslice::test::Env env = gpuslice::test::merge(
        box.env(false), {{"LD_PRELOAD", target}, {"GPUSLICE_MEMORY_LIMIT", std::to_string(kQuota)}});
    return gpuslice::test::spawn(argv, env, out);
  }

  bool wait_ready() const {
    for (int i = 0; i < 3000 && access(ready.c_str(), F_OK) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return access(ready.c_str(), F_OK) == 0;
  }
};

// Every operation of the workload succeeded and saw the quota.
void expect_unharmed(const Result& r) {
  EXPECT_EQ(r.signal, 0) << "the workload died: " << r.describe();
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  const auto infos = gpuslice::test::lines_with(r.out, "meminfo");
  EXPECT_EQ(infos.size(), 151u) << r.describe();
  for (const std::string& l : infos) {
    EXPECT_EQ(gpuslice::test::field(l, "rc"), "0") << l;
    EXPECT_EQ(gpuslice::test::field(l, "total"), std::to_string(kQuota)) << l;
  }
  EXPECT_EQ(gpuslice::test::lines_with(r.out, "alloc rc=0").size(), 150u) << r.describe();
}

TEST(HamiLifecycle, UpgradeByOurInstallKeepsRunningProcesses) {
  Node node;
  const std::string v1 = node.box.path("v1.so"), v2 = node.box.path("v2.so");
  write_file(v1, node.gpuslice);
  write_file(v2, node.gpuslice + "gpuslice next version");  // other bytes, same code
  ASSERT_EQ(node.install(v1, true).exit_code, 0);
  const ino_t before = inode(node.target);
  const pid_t pid = node.start_workload();
  ASSERT_TRUE(node.wait_ready()) << gpuslice::test::read_text(node.out);
  const Result up = node.install(v2, true);
  EXPECT_EQ(up.exit_code, 0) << up.describe();
  EXPECT_NE(inode(node.target), before) << "replaced by rename: a new inode";
  EXPECT_TRUE(gpuslice::test::read_text(node.target) == gpuslice::test::read_text(v2));
  expect_unharmed(gpuslice::test::wait(pid, node.out));
  // Nothing left behind but the library.
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(node.vgpu)) names.push_back(e.path().filename());
  EXPECT_EQ(names, std::vector<std::string>({"libvgpu.so.v2.5.0"}));
  // Installing the same content again changes nothing.
  const ino_t now = inode(node.target);
  EXPECT_EQ(node.install(v2, true).exit_code, 0);
  EXPECT_EQ(inode(node.target), now);
}

TEST(HamiLifecycle, HamiStartUpCopyDoesNotTouchTheProtectedLibrary) {
  Node node;
  const Result in = node.install(gpuslice::test::preload_library(), true);
  ASSERT_EQ(in.exit_code, 0) << in.describe();
  if (!immutable(node.target)) {
    GTEST_SKIP() << "cannot mark files immutable here (CAP_LINUX_IMMUTABLE or file-system support missing): " << in.err;
  }
  const pid_t pid = node.start_workload();
  ASSERT_TRUE(node.wait_ready()) << gpuslice::test::read_text(node.out);
  // The device plugin restarts: its copy is refused, and its script goes on.
  const Result hami = gpuslice::test::run({"/bin/sh", kVgpuInit, node.image, node.vgpu}, {}, 30000);
  EXPECT_EQ(hami.exit_code, 0) << hami.describe();
  EXPECT_NE(hami.err.find("Operation not permitted"), std::string::npos) << hami.describe();
  EXPECT_TRUE(gpuslice::test::read_text(node.target) == node.gpuslice) << "still gpuslice";
  EXPECT_EQ(gpuslice::test::read_text(node.vgpu + "/ld.so.preload"), "/usr/local/vgpu/libvgpu.so\n")
      << "the rest of HAMi's files are copied";
  expect_unharmed(gpuslice::test::wait(pid, node.out));
  // The drop-in's next round finds its library in place and does nothing.
  const ino_t now = inode(node.target);
  EXPECT_EQ(node.install(gpuslice::test::preload_library(), true).exit_code, 0);
  EXPECT_EQ(inode(node.target), now);
}

// What the protection prevents (and what the drop-in's copy-then-rename alone
// left open): HAMi's cp writes into the inode the process maps.
TEST(HamiLifecycle, HamiStartUpCopyOntoAnUnprotectedLibraryKillsRunningProcesses) {
  Node node;
  ASSERT_EQ(node.install(gpuslice::test::preload_library(), false).exit_code, 0);
  ASSERT_FALSE(immutable(node.target));
  const pid_t pid = node.start_workload();
  ASSERT_TRUE(node.wait_ready()) << gpuslice::test::read_text(node.out);
  const Result hami = gpuslice::test::run({"/bin/sh", kVgpuInit, node.image, node.vgpu}, {}, 30000);
  EXPECT_EQ(hami.exit_code, 0) << hami.describe();
  const Result r = gpuslice::test::wait(pid, node.out);
  EXPECT_NE(r.signal, 0) << "expected the workload to die once its library's bytes changed: " << r.describe();
}

TEST(HamiLifecycle, ReleaseLetsHamiRestoreItsLibraryForARollback) {
  Node node;
  ASSERT_EQ(node.install(gpuslice::test::preload_library(), true).exit_code, 0);
  const Result rel = gpuslice::test::run({kInstall, "--release", node.target}, {}, 10000);
  EXPECT_EQ(rel.exit_code, 0) << rel.describe();
  EXPECT_FALSE(immutable(node.target));
  const Result hami = gpuslice::test::run({"/bin/sh", kVgpuInit, node.image, node.vgpu}, {}, 30000);
  EXPECT_EQ(hami.exit_code, 0) << hami.describe();
  EXPECT_TRUE(gpuslice::test::read_text(node.target) == gpuslice::test::read_text(node.image + "/libvgpu.so.v2.5.0"))
      << "HAMi's copy is back";
}

TEST(HamiLifecycle, InstallWritesOneLineFilesByRenameToo) {
  Node node;
  const std::string preload = node.vgpu + "/ld.so.preload";
  write_file(preload, "/old/path.so\n");
  const ino_t before = inode(preload);
  const Result r = gpuslice::test::run({kInstall, "--line", "/usr/local/vgpu/libvgpu.so", preload}, {}, 10000);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(gpuslice::test::read_text(preload), "/usr/local/vgpu/libvgpu.so\n");
  EXPECT_NE(inode(preload), before);
  const ino_t installed = inode(preload);
  EXPECT_EQ(gpuslice::test::run({kInstall, "--line", "/usr/local/vgpu/libvgpu.so", preload}, {}, 10000).exit_code, 0);
  EXPECT_EQ(inode(preload), installed) << "the same line again changes nothing";
  const Result bad = gpuslice::test::run({kInstall, node.box.path("missing.so"), node.target}, {}, 10000);
  EXPECT_EQ(bad.exit_code, 1) << bad.describe();
  EXPECT_NE(bad.err.find("missing.so"), std::string::npos) << bad.describe();
  EXPECT_EQ(gpuslice::test::run({kInstall, "--bogus"}, {}, 10000).exit_code, 64);
}

}  // namespace
