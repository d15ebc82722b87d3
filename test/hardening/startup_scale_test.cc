// Start-up beside live processes (issue 35): with a memory quota, a process's
// first context is counted at the size measured exactly once in the container
// (hook/context.cc, DeviceState::first_context), so a start asks NVML for no
// process list, however many processes live (a list is O(processes)); and
// the count stays exact (cuMemGetInfo's free figure).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr unsigned long long kMi = 1ull << 20;

// fakecuda-ctl counters' field (read without reaping: counts nothing itself).
unsigned long long counter(const Env& env, const std::string& name) {
  Result r = run({bin("fakecuda-ctl"), "counters"}, env);
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  const std::string key = "\"" + name + "\": ";
  const std::size_t at = r.out.find(key);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no " << name << " in " << r.out;
    return 0;
  }
  return std::stoull(r.out.substr(at + key.size()));
}

struct Start {
  unsigned long long nvml_lists;
  unsigned long long free;
};

// `live` processes hold a context and 1 MiB each; then one more starts
// (cuInit, primary context, 1 MiB, cuMemGetInfo): what NVML process lists
// its start asked for, and what its cuMemGetInfo said was free.
Start start_beside(int live, unsigned context_mib) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "2Gi"},
                                    {"FAKECUDA_MEMORY", "8Gi"},
                                    {"FAKECUDA_CONTEXT_MEMORY", std::to_string(context_mib) + "Mi"}});
  std::vector<pid_t> holders;
  for (int i = 0; i < live; ++i) {
    const std::string n = std::to_string(i);
    holders.push_back(spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(kMi), "touch",
                             box.path("ready" + n), "waitfile", box.path("exit")},
                            env, box.path("out" + n)));
    // One after another: the first measures the container's first context.
    EXPECT_TRUE(await_file(box.path("ready" + n), 60000)) << "holder " << n;
  }
  const unsigned long long before = counter(env, "nvml_process_lists");
  Result r = run({bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(kMi), "meminfo"}, env);
  const unsigned long long after = counter(env, "nvml_process_lists");
  run({"/usr/bin/touch", box.path("exit")}, {});
  for (std::size_t i = 0; i < holders.size(); ++i) wait(holders[i], box.path("out" + std::to_string(i)));
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  const std::vector<std::string> info = lines_with(r.out, "meminfo ");
  EXPECT_EQ(info.size(), 1u) << r.describe();
  return {after - before, info.empty() ? 0 : std::stoull(field(info[0], "free"))};
}

// Before: each start listed NVML's processes twice (before and after its
// context), whatever was known of the container's contexts. Contexts of
// 64 MiB, and of none (the ideal profile's default: a size known too).
TEST(StartupScale, AStartBesideLiveProcessesListsNoNvmlProcesses) {
  for (unsigned context_mib : {64u, 0u}) {
    for (int live : {1, 12}) {
      const Start s = start_beside(live, context_mib);
      EXPECT_EQ(s.nvml_lists, 0u) << "a start beside " << live << " live processes listed NVML's processes ("
                                  << context_mib << " MiB contexts)";
      // Exact: every process counts its context and 1 MiB.
      const unsigned long long used = static_cast<unsigned long long>(live + 1) * (context_mib + 1) * kMi;
      EXPECT_EQ(s.free, 2048 * kMi - used) << "beside " << live << " live processes";
    }
  }
}

}  // namespace
}  // namespace gpuslice::test
