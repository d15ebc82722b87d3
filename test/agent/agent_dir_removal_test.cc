// Issue 32: after --grace the agent removed an idle pod's region directory
// while the pod still ran, and the pod's next CUDA job failed: the directory
// was the source of a bind mount the runtime made into the container. A
// directory is removed only when no mount namespace of the node still has it
// mounted (docs/agent.md, "Removal"). "The pod still runs" is modelled by a
// process in its own mount namespace with the pod's directory bind-mounted,
// as the runtime does; "released" by that namespace ending.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "agent.h"
#include "agent_test_util.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Env;
using gpuslice::test::Sandbox;

namespace {

bool can_unshare_mount() {
  return test::run({"/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/true"}, {}, 10000).exit_code == 0;
}

TEST(AgentRemoval, PodDirectoryStillMountedSurvivesGraceAndGoesAfterRelease) {
  if (!can_unshare_mount()) GTEST_SKIP() << "unshare --mount is not permitted here (needs root)";
  Sandbox box;
  auto cfg = config_for(box, false);
  cfg.grace_ns = 200'000'000;
  agent::Agent a(cfg);
  a.start();
  const std::string pod_dir = region_dir(box) + "/pod-m";
  const std::string path = pod_dir + "/c.region";
  Region* idle = make_region(path, "c");
  ASSERT_NE(idle, nullptr);
  shm::detach(idle);

  // The container: its own mount namespace with the pod's directory bound at
  // <box>/ctr (as the runtime binds it at /run/gpuslice), alive until killed.
  const std::string ctr = box.path("ctr"), ready = box.path("mounted");
  ASSERT_EQ(mkdir(ctr.c_str(), 0755), 0);
  const pid_t pod =
      test::spawn({"/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                   "mount --bind '" + pod_dir + "' '" + ctr + "' && touch '" + ready + "' && exec sleep 600"},
                  {}, box.path("pod.out"));
  ASSERT_TRUE(eventually([&] { return file_exists(ready); }, 20000)) << read_file(box.path("pod.out"));

  // Idle past --grace: the region file goes.
  const std::string hidden = pod_dir + "/.c.region.gpuslice-removing";
  ASSERT_TRUE(eventually(
      [&] {
        a.cycle();
        return !file_exists(path) && !file_exists(hidden);
      },
      10000));
  EXPECT_EQ(a.stats().regions_removed, 1u);
  EXPECT_TRUE(file_exists(pod_dir)) << "the directory the pod still has mounted was removed";
  // More cycles, over several re-checks of the directory: it stays.
  for (int i = 0; i < 40; ++i) {
    a.cycle();
    usleep(50'000);
  }
  EXPECT_TRUE(file_exists(pod_dir)) << "the directory the pod still has mounted was removed";

  // The pod's next CUDA job, in its mount namespace, through its mount.
  const Env env = test::merge(box.env(), {{"GPUSLICE_REGION", ctr + "/c.region"}, {"GPUSLICE_MEMORY_LIMIT", "1Gi"}});
  const test::Result job = test::run({"/usr/bin/nsenter", "--target", std::to_string(pod), "--mount", "--",
                                      test::bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(16 * kMi)},
                                     env);
  EXPECT_NE(job.out.find("alloc rc=0"), std::string::npos) << job.describe();
  EXPECT_TRUE(file_exists(path)) << "the job's region is in the pod's directory, where the agent sees it";

  // Released: the pod's mount namespace is gone. The idle region and then
  // the directory go.
  kill(pod, SIGKILL);
  test::wait(pod);
  EXPECT_TRUE(eventually(
      [&] {
        a.cycle();
        return !file_exists(pod_dir);
      },
      30000))
      << "the released pod's directory stayed";
  EXPECT_EQ(a.stats().regions_removed, 2u);
}

}  // namespace
