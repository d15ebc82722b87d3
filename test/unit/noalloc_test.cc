// Bootstrap never allocates: the preload library parses options, attaches the
// region and claims a slot before (and while) the application's malloc may be
// initialising or itself interposed. This binary interposes malloc and counts
// calls made by the armed thread. Built only without sanitizers (they
// interpose malloc themselves).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

#include "limiter/alloc_table.h"
#include "limiter/memory_accounting.h"
#include "limiter/options/options.h"
#include "limiter/options/file.h"
#include "shm/region_file.h"
#include "support.h"

extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void __libc_free(void*);
}

namespace {
thread_local bool g_armed = false;
thread_local std::size_t g_allocations = 0;
}  // namespace

extern "C" {
void* malloc(std::size_t n) {
  if (g_armed) ++g_allocations;
  return __libc_malloc(n);
}
void* calloc(std::size_t n, std::size_t size) {
  if (g_armed) ++g_allocations;
  return __libc_calloc(n, size);
}
void* realloc(void* p, std::size_t n) {
  if (g_armed) ++g_allocations;
  return __libc_realloc(p, n);
}
void free(void* p) { __libc_free(p); }
}

namespace gpuslice::test {
namespace {

class Armed {
 public:
  Armed() {
    g_allocations = 0;
    g_armed = true;
  }
  ~Armed() { g_armed = false; }
  std::size_t count() const { return g_allocations; }
};

TEST(NoAlloc, InterposerWorks) {
  Armed armed;
  std::string* s = new std::string(100, 'x');
  delete s;
  EXPECT_GT(armed.count(), 0u);
}

TEST(NoAlloc, Bootstrap) {
  TempDir dir;
  const std::string path = dir.file("nested/region");
  std::vector<std::string> strings = {"GPUSLICE_MEMORY_LIMIT=0=8Gi,1=4Gi", "CUDA_DEVICE_SM_LIMIT_2=30",
                                      "GPUSLICE_REGION=" + path, "GPUSLICE_LOG_LEVEL=debug", "GPUSLICE_TYPO=1"};
  std::vector<char*> envp;
  for (auto& s : strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  static options::Options options;  // 13 KiB: static storage, as in the hook
  static char listing[8192];
  shm::Error err{};
  limiter::AllocTable table;
  std::uint8_t uuid[16] = {1, 2, 3};
  {
    Armed armed;
    ASSERT_TRUE(options::parse_options(envp.data(), &options, &err));
    ASSERT_GT(options::format_effective_options(options, listing, sizeof listing), 0);
    bool created = false;
    Region* r = shm::attach(options.region, "noalloc", &err, &created);
    ASSERT_NE(r, nullptr) << err.message;
    ASSERT_TRUE(created);
    Region* again = shm::attach(options.region, "noalloc", &err);
    ASSERT_NE(again, nullptr);
    shm::ProcessIdentity self{};
    ASSERT_TRUE(shm::read_identity(0, &self));
    const int slot = shm::claim_slot(r, self);
    ASSERT_GE(slot, 0);
    const int dev = shm::device_index(r, uuid, options.memory_limit[0], options.sm_limit[0], options.sm_policy);
    ASSERT_GE(dev, 0);
    ASSERT_TRUE(limiter::reserve(r, slot, dev, 1 << 20, self));
    ASSERT_FALSE(limiter::reserve(r, slot, dev, options.memory_limit[0], self));  // refusal path reaps
    ASSERT_TRUE(limiter::charge(r, slot, dev, 4096));
    ASSERT_TRUE(table.insert(0x1000, {1 << 20, dev, limiter::AllocKind::linear}));
    limiter::AllocRecord rec{};
    ASSERT_TRUE(table.find(0x1000, &rec));
    ASSERT_TRUE(table.erase(0x1000, &rec));
    limiter::release(r, slot, dev, rec.bytes);
    const int dead = shm::claim_slot(r, dead_identity(self));
    ASSERT_TRUE(limiter::charge(r, dead, dev, 77));
    ASSERT_EQ(limiter::reap_dead(r, self), 1);
    ASSERT_FALSE(shm::validate_header(r, 100, &err));
    limiter::release_all(r, slot);
    shm::release_slot(r, slot);
    shm::detach(again);
    shm::detach(r);
    EXPECT_EQ(armed.count(), 0u) << "bootstrap allocated";
  }
}

// The configuration file is read into the caller's static buffer.
TEST(NoAlloc, ConfigurationFile) {
  TempDir dir;
  const std::string good = dir.file("good.conf");
  const std::string bad = dir.file("bad.conf");
  {
    std::FILE* f = std::fopen(good.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("# limits\nGPUSLICE_MEMORY_LIMIT=256Mi\nCUDA_DEVICE_SM_LIMIT=30\nGPUSLICE_LOG_LEVEL=debug\n", f);
    std::fclose(f);
    f = std::fopen(bad.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("GPUSLICE_MEMORY_LIMIT=0\n", f);
    std::fclose(f);
  }
  std::string named = "GPUSLICE_CONFIG_FILE=" + bad;
  char* with_named[] = {named.data(), nullptr};
  char* empty[] = {nullptr};
  static options::Options options;
  static options::ConfigFileBuffer buffer;
  static char listing[8192];
  const std::string absent = dir.file("absent.conf");
  shm::Error err{};
  Armed armed;
  ASSERT_TRUE(options::load_options(empty, good.c_str(), &buffer, &options, &err)) << err.message;
  ASSERT_GT(options::format_effective_options(options, listing, sizeof listing), 0);
  EXPECT_FALSE(options::load_options(with_named, good.c_str(), &buffer, &options, &err));
  EXPECT_TRUE(options::load_options(empty, absent.c_str(), &buffer, &options, &err));
  EXPECT_EQ(armed.count(), 0u) << "reading the configuration file allocated";
}

TEST(NoAlloc, ErrorPaths) {
  static options::Options options;
  shm::Error err{};
  char bad[] = "GPUSLICE_MEMORY_LIMIT=8gb";
  char* envp[] = {bad, nullptr};
  Armed armed;
  EXPECT_FALSE(options::parse_options(envp, &options, &err));
  EXPECT_EQ(shm::attach("/proc/definitely/not/here/region", "x", &err), nullptr);
  EXPECT_EQ(shm::attach_existing("/nonexistent-gpuslice-region", false, &err), nullptr);
  EXPECT_EQ(armed.count(), 0u);
}

}  // namespace
}  // namespace gpuslice::test
