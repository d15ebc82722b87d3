// The agent beside memory shared between processes of one container (issue
// 36): the exporter's allocation is counted in the container's table of
// shared allocations, not in its slot, while NVML shows it as the
// exporter's. That is no bypass: the agent must neither report one nor see
// memory beyond the container's count.
#include <gtest/gtest.h>

#include "agent.h"
#include "agent_test_util.h"
#include "limiter/memory_accounting.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;

namespace {

// One rank of test/hardening/programs/shared_peer.cc, driven over its stdin.
test::Conversation rank(std::vector<std::string> args, const test::Env& env) {
  args.insert(args.begin(), test::bin("shared_peer"));
  return test::Conversation(args, env);
}

TEST(AgentReconcile, MemorySharedWithinTheContainerIsNoBypass) {
  test::Sandbox box;
  const test::Env env =
      test::merge(box.env(), {{"GPUSLICE_REGION", container_region(box)}, {"GPUSLICE_MEMORY_LIMIT", "512Mi"}});
  const std::string socket = box.path("s");
  auto exporter = rank({"export", "vmm", std::to_string(128 * kMi), socket}, env);
  ASSERT_EQ(exporter.answer(), 0);
  auto importer = rank({"import", "vmm", socket, std::to_string(128 * kMi)}, env);
  ASSERT_EQ(exporter.ask("serve"), 0);
  ASSERT_EQ(importer.answer(), 0);
  auto cfg = config_for(box);
  cfg.bypass_tolerance_bytes = 32 * kMi;
  agent::Agent a(cfg);
  a.start();
  ASSERT_TRUE(a.stats().nvml_available);
  a.cycle();
  a.cycle();
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  const int dev = first_device(r);
  ASSERT_GE(dev, 0);
  EXPECT_EQ(a.stats().bypass_reports, 0u) << "the exporter's NVML figure includes the shared 128 MiB";
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 0u);
  EXPECT_EQ(limiter::used_bytes(r, dev), 128 * kMi) << "counted once";
  shm::detach(r);
}

}  // namespace
