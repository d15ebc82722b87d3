// Cross-process exactness: racing processes never overshoot, killed processes
// give their memory back, bad configuration fails closed without killing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "probe.h"

using namespace gpuslice::test;

namespace {

TEST(Processes, EightRacingProcessesShareTheQuotaExactly) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
  const std::string go = box.path("go"), release = box.path("release");
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int i = 0; i < 8; ++i) {
    outs.push_back(box.path("out" + std::to_string(i)));
    const std::string held = box.path("held" + std::to_string(i));
    pids.push_back(spawn({bin("cuprobe"), "init", "ctx", "0", "waitfile", go, "fill", "alloc", std::to_string(kMi),
                          "touch", held, "waitfile", release},
                         env, outs.back()));
  }
  run({"/usr/bin/touch", go}, {});
  unsigned long long peak = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string held = box.path("held" + std::to_string(i));
    for (int waited_ms = 0; access(held.c_str(), F_OK) != 0; ++waited_ms) {
      ASSERT_LT(waited_ms, 60000) << "process " << i << " never held its memory";
      peak = std::max(peak, device_used(box));
      usleep(1000);
    }
  }
  const unsigned long long held_total = device_used(box);
  run({"/usr/bin/touch", release}, {});
  unsigned long long sum = 0;
  for (int i = 0; i < 8; ++i) {
    Result r = wait(pids[i], outs[i]);
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    sum += std::stoull(value(r, "fill", "bytes"));
  }
  EXPECT_EQ(sum, 64 * kMi) << "together the processes get exactly the quota";
  EXPECT_EQ(held_total, 64 * kMi) << "the simulated device holds exactly the quota";
  EXPECT_LE(peak, 64 * kMi);
}

TEST(Processes, SigkillStormLeavesNothingBehind) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "32Mi"}});
  std::mt19937 rng(12345);
  for (int round = 0; round < 50; ++round) {
    std::vector<pid_t> pids;
    for (int i = 0; i < 3; ++i) {
      std::vector<std::string> argv{bin("cuprobe"), "init", "ctx", "0"};
      for (int k = 0; k < 40; ++k) {
        argv.push_back("alloc");
        argv.push_back(std::to_string(kMi));
        if (k % 3 == 2) argv.push_back("free");
      }
      argv.push_back("sleep");
      argv.push_back("10000");
      pids.push_back(spawn(argv, env, "/dev/null"));
    }
    usleep(std::uniform_int_distribution<int>(0, 30000)(rng));
    for (pid_t p : pids) kill(p, SIGKILL);
    for (pid_t p : pids) waitpid(p, nullptr, 0);
  }
  // Everyone is gone: the next process must be able to use the whole quota
  // (its first refused allocation reaps the dead slots) ...
  Result r = probe(Path::direct, env, {"init", "ctx", "0", "fill", "alloc", std::to_string(kMi)});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "fill", "bytes"), std::to_string(32 * kMi)) << r.describe();
  // ... and once it exits too, the device holds nothing.
  EXPECT_EQ(device_used(box), 0u);
}

TEST(Processes, KilledProcessMemoryReturnsWithoutWaitingForAnyone) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "16Mi"}});
  const std::string held = box.path("held");
  pid_t hog =
      spawn({bin("cuprobe"), "init", "ctx", "0", "fill", "alloc", std::to_string(kMi), "touch", held, "sleep", "60000"},
            env, "/dev/null");
  for (int waited_ms = 0; access(held.c_str(), F_OK) != 0; ++waited_ms) {
    if (waited_ms >= 60000) {
      kill(hog, SIGKILL);
      waitpid(hog, nullptr, 0);
      FAIL() << "the hog never held its memory";
    }
    usleep(1000);
  }
  kill(hog, SIGKILL);
  waitpid(hog, nullptr, 0);
  auto start = std::chrono::steady_clock::now();
  Result r = probe(Path::direct, env, {"init", "ctx", "0", "alloc", std::to_string(16 * kMi)}, 10000);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(value(r, "alloc", "rc"), "0") << r.describe();
  EXPECT_LT(took, std::chrono::seconds(5));
}

struct BadInput {
  const char* var;
  const char* value;
};
void PrintTo(const BadInput& b, std::ostream* os) { *os << b.var << "=" << b.value; }
const BadInput kBadInputs[] = {{"GPUSLICE_MEMORY_LIMIT", "lots"},    {"GPUSLICE_MEMORY_LIMIT", "8Gb!"},
                               {"GPUSLICE_MEMORY_LIMIT", "0=8Gi,x"}, {"GPUSLICE_MEMORY_LIMIT", "-5"},
                               {"CUDA_DEVICE_MEMORY_LIMIT", "12q"},  {"GPUSLICE_SM_LIMIT", "150"},
                               {"GPUSLICE_SM_POLICY", "sometimes"}};

class BadInputs : public ::testing::TestWithParam<BadInput> {};

TEST_P(BadInputs, FailClosedWithOneClearLineAndNoKill) {
  const BadInput bad = GetParam();
  Sandbox box;
  Result r = probe(Path::get_proc_address, merge(box.env(), {{bad.var, bad.value}}),
                   {"init", "ctx", "0", "alloc", std::to_string(kMi)});
  EXPECT_EQ(r.exit_code, 0) << "the process is never killed\n" << r.describe();
  EXPECT_EQ(value(r, "init", "rc"), "3") << "CUDA_ERROR_NOT_INITIALIZED\n" << r.describe();
  EXPECT_NE(value(r, "alloc", "rc"), "0") << "never unlimited by accident\n" << r.describe();
  EXPECT_NE(r.err.find(bad.var), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(bad.value), std::string::npos) << r.err;
  EXPECT_EQ(device_used(box), 0u);
}

INSTANTIATE_TEST_SUITE_P(Env, BadInputs, ::testing::ValuesIn(kBadInputs), [](const auto& info) {
  return std::string(info.param.var) + "_" + std::to_string(info.index);
});

TEST(Processes, CorruptRegionFailsClosed) {
  Sandbox box;
  {
    FILE* f = std::fopen(box.path("container.region").c_str(), "w");
    std::fputs("this is not a gpuslice region", f);
    std::fclose(f);
  }
  Result r = probe(Path::direct, merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "8Mi"}}), {"init"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(value(r, "init", "rc"), "3") << r.describe();
  EXPECT_NE(r.err.find("container.region"), std::string::npos) << r.err;
}

TEST(Processes, UnwritableRegionDirectoryFailsClosed) {
  Sandbox box;
  Result r = probe(Path::direct,
                   merge(box.env(), {{"GPUSLICE_REGION", "/proc/gpuslice/region"}, {"GPUSLICE_MEMORY_LIMIT", "8Mi"}}),
                   {"init"});
  EXPECT_EQ(value(r, "init", "rc"), "3") << r.describe();
  EXPECT_NE(r.err.find("/proc/gpuslice/region"), std::string::npos) << r.err;
}

TEST(Processes, WithoutTheLibraryTheProbeBehavesTheSame) {
  Sandbox box;
  const std::vector<std::string> ops{"init",    "ctx",      "0", "alloc", "1048576",
                                     "meminfo", "totalmem", "0", "free",  "sync"};
  for (Path p : {Path::direct, Path::get_proc_address}) {
    Result native = probe(p, box.env(false), ops);
    Result wrapped = probe(p, box.env(), ops);
    ASSERT_EQ(native.exit_code, 0) << native.describe();
    EXPECT_EQ(native.out, wrapped.out) << path_name(p);
  }
}

}  // namespace
