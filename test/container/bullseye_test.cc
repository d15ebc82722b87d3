// The same containers from an image with an older glibc: a Debian bullseye
// root (glibc 2.31, the glibc of the Ubuntu 20.04-era CUDA base images), its
// own python3 driving the driver API through ctypes (cuda_probe.py). The
// preload library must load into every program of such an image and enforce
// the slice's quota, under /etc/ld.so.preload and under LD_PRELOAD.
// Skipped (77) where the runtime cannot run or no bullseye root can be had
// (test/deploy/bullseye_rootfs.sh needs root and a Debian mirror); a library
// or simulated driver that cannot load under glibc 2.31 is a skip saying so
// (the glibc floor is separate work), never a pass.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "podman_world.h"

using gpuslice::container_test::Image;
using gpuslice::container_test::WorldSuite;
using gpuslice::test::field;
using gpuslice::test::lines_with;
using gpuslice::test::Result;

namespace {

constexpr unsigned long long kMi = 1ull << 20;
constexpr int kOutOfMemory = 2;  // CUDA_ERROR_OUT_OF_MEMORY

std::string mib(unsigned long long n) { return std::to_string(n * kMi); }

class Bullseye : public WorldSuite<Image::bullseye> {
 protected:
  static void SetUpTestSuite() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    // The sanitized library needs this machine's sanitizer runtime and glibc.
    std::printf("SKIPPED: a sanitizer build's library cannot load into an old-glibc image\n");
    std::fflush(stdout);
    std::_Exit(77);
#endif
    WorldSuite::SetUpTestSuite();
  }

  // Runs the probe; "" or why the old glibc could not load what it needs.
  static std::string run_probe(const std::string& slice, Result* r) {
    *r = world->run({world->vendor_device, slice}, {"/usr/bin/python3", "/usr/local/bin/cuda_probe.py", "init", "ctx",
                                                    "0", "meminfo", "alloc", mib(200), "alloc", mib(100)});
    if (r->err.find("GLIBC_") != std::string::npos && r->err.find("not found") != std::string::npos) {
      return "this libgpuslice.so needs a newer glibc than the image's 2.31: " + r->err;
    }
    if (r->err.find("GLIBCXX_") != std::string::npos || r->err.find("libstdc++") != std::string::npos) {
      return "this libgpuslice.so needs a newer libstdc++ than the image's: " + r->err;
    }
    if (r->out.rfind("load rc=-1", 0) == 0) {
      return "the simulated driver does not load under the image's glibc: " + r->out;
    }
    return "";
  }
};

TEST_F(Bullseye, PreloadFileVariantLoadsAndEnforcesTheQuota) {
  Result r;
  if (const std::string why = run_probe(world->a.device, &r); !why.empty()) GTEST_SKIP() << why;
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(field(line(r, "init"), "rc"), "0") << r.describe();
  EXPECT_EQ(field(line(r, "meminfo"), "total"), mib(256)) << r.describe();
  const auto allocs = lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 2u) << r.describe();
  EXPECT_EQ(field(allocs[0], "rc"), "0") << r.describe();
  EXPECT_EQ(field(allocs[1], "rc"), std::to_string(kOutOfMemory)) << "200 + 100 MiB against 256: " << r.describe();
}

TEST_F(Bullseye, LdPreloadVariantLoadsAndEnforcesTheQuota) {
  Result r;
  if (const std::string why = run_probe(world->b.device, &r); !why.empty()) GTEST_SKIP() << why;
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(field(line(r, "meminfo"), "total"), mib(128)) << r.describe();
  const auto allocs = lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 2u) << r.describe();
  EXPECT_EQ(field(allocs[0], "rc"), std::to_string(kOutOfMemory)) << "200 MiB against 128: " << r.describe();
  EXPECT_EQ(field(allocs[1], "rc"), "0") << r.describe();
}

}  // namespace
