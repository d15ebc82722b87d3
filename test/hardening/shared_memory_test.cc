// Memory shared between processes (issue 36), as the programs users run share
// it: NCCL's VMM pattern (cuMemCreate with a POSIX-fd handle type, export,
// import in a peer process, map, set access) and legacy CUDA IPC (vLLM's
// custom all-reduce, torch.multiprocessing: cuIpcGetMemHandle / OpenMemHandle
// / CloseMemHandle). Each rank is a real process (programs/shared_peer.cc)
// driven line by line; handles travel over a Unix socket. Every read is
// bounded by a timeout; the assertions are on what the quota admits.
#include <cuda.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "harness.h"

using namespace gpuslice::test;

namespace {

constexpr unsigned long long kMi = 1ull << 20;

// One rank (programs/shared_peer.cc): its stdin and stdout are pipes.
class Peer : public Conversation {
 public:
  Peer(std::vector<std::string> args, const Env& env) : Conversation(with_binary(std::move(args)), env) {}

 private:
  static std::vector<std::string> with_binary(std::vector<std::string> args) {
    args.insert(args.begin(), bin("shared_peer"));
    return args;
  }
};

// An exporter holding `bytes` and an importer mapping them, both of `env`'s container (or the importer of `importer_env`'s).
struct Pair {
  Peer exporter, importer;
  Pair(const char* kind, unsigned long long bytes, const std::string& socket, const Env& env, const Env& importer_env)
      : exporter({"export", kind, std::to_string(bytes), socket}, env),
        importer(std::string(kind) == "vmm" ? std::vector<std::string>{"import", kind, socket, std::to_string(bytes)}
                                            : std::vector<std::string>{"import", kind, socket},
                 importer_env) {}
};

// The largest allocation `peer` is admitted, to within `step`, below `limit`.
bool admits(Peer& peer, unsigned long long bytes) { return peer.ask("alloc " + std::to_string(bytes)) == 0; }

class SharedMemory : public ::testing::Test {
 protected:
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "512Mi"}});

  // Starts a pair and connects it; asserts every step.
  void connect(Pair& p) {
    ASSERT_EQ(p.exporter.answer(), 0) << p.exporter.last();
    ASSERT_EQ(p.exporter.ask("serve"), 0) << p.exporter.last();
    ASSERT_EQ(p.importer.answer(), 0) << p.importer.last();
  }
};

// NCCL's pattern: 128 MiB created and exported by one rank, imported and
// mapped by another of the same container. The device holds 128 MiB: the
// container may allocate up to quota - 128 MiB more, not quota - 256 MiB.
TEST_F(SharedMemory, VmmImportInTheSameContainerIsCountedOnce) {
  Pair p("vmm", 128 * kMi, box.path("s"), env, env);
  connect(p);
  EXPECT_TRUE(admits(p.importer, 384 * kMi)) << "512 MiB quota, 128 MiB shared: 384 MiB must fit";
  EXPECT_FALSE(admits(p.importer, 386 * kMi)) << "above the quota";
}

// Release orders: the memory stays on the device (and counted) until the
// last holder of the container lets go, in either order.
TEST_F(SharedMemory, VmmExporterReleasesFirst) {
  Pair p("vmm", 128 * kMi, box.path("s"), env, env);
  connect(p);
  ASSERT_EQ(p.exporter.ask("release"), 0);
  EXPECT_FALSE(admits(p.importer, 386 * kMi)) << "the importer's mapping keeps the 128 MiB on the device";
  EXPECT_TRUE(admits(p.importer, 384 * kMi));
  ASSERT_EQ(p.importer.ask("release"), 0);
  EXPECT_TRUE(admits(p.importer, 512 * kMi)) << "every holder let go";
}

TEST_F(SharedMemory, VmmImporterReleasesFirst) {
  Pair p("vmm", 128 * kMi, box.path("s"), env, env);
  connect(p);
  ASSERT_EQ(p.importer.ask("release"), 0);
  EXPECT_FALSE(admits(p.exporter, 386 * kMi)) << "the exporter still holds its 128 MiB";
  EXPECT_TRUE(admits(p.exporter, 384 * kMi));
  ASSERT_EQ(p.exporter.ask("release"), 0);
  EXPECT_TRUE(admits(p.exporter, 512 * kMi));
}

// A holder SIGKILLed: its slot is reaped, but memory another live process
// of the container maps stays counted.
TEST_F(SharedMemory, VmmImporterKilled) {
  Pair p("vmm", 128 * kMi, box.path("s"), env, env);
  connect(p);
  p.importer.kill9();
  EXPECT_FALSE(admits(p.exporter, 386 * kMi)) << "the exporter still holds its 128 MiB";
  EXPECT_TRUE(admits(p.exporter, 384 * kMi)) << "the dead importer's share is reclaimed";
}

TEST_F(SharedMemory, VmmExporterKilledWhileTheImporterMaps) {
  Pair p("vmm", 128 * kMi, box.path("s"), env, env);
  connect(p);
  p.exporter.kill9();
  EXPECT_FALSE(admits(p.importer, 386 * kMi)) << "the importer's mapping keeps the 128 MiB on the device";
  ASSERT_EQ(p.importer.ask("release"), 0);
  EXPECT_TRUE(admits(p.importer, 512 * kMi));
}

// NCCL with more ranks: one buffer mapped by three other ranks is still
// 128 MiB; it leaves the count only with the last of its four holders,
// whichever order they go in (one of them SIGKILLed).
TEST_F(SharedMemory, VmmFourHoldersCountedOnceUntilTheLast) {
  const std::string socket = box.path("s");
  Peer exporter({"export", "vmm", std::to_string(128 * kMi), socket}, env);
  ASSERT_EQ(exporter.answer(), 0) << exporter.last();
  std::vector<std::unique_ptr<Peer>> importers;
  for (int i = 0; i < 3; ++i) {
    importers.push_back(
        std::make_unique<Peer>(std::vector<std::string>{"import", "vmm", socket, std::to_string(128 * kMi)}, env));
    ASSERT_EQ(exporter.ask("serve"), 0) << exporter.last();
    ASSERT_EQ(importers.back()->answer(), 0) << importers.back()->last();
  }
  EXPECT_TRUE(admits(exporter, 384 * kMi)) << "four holders, one allocation";
  EXPECT_FALSE(admits(exporter, 386 * kMi));
  importers[0]->kill9();
  ASSERT_EQ(exporter.ask("release"), 0);
  ASSERT_EQ(importers[1]->ask("release"), 0);
  EXPECT_FALSE(admits(*importers[2], 386 * kMi)) << "the last holder still maps it";
  EXPECT_TRUE(admits(*importers[2], 384 * kMi));
  ASSERT_EQ(importers[2]->ask("release"), 0);
  EXPECT_TRUE(admits(exporter, 512 * kMi)) << "every holder let go";
}

// Every holder SIGKILLed: the reaper closes the entry, and the memory
// (gone from the device with its last holder) leaves the count.
TEST_F(SharedMemory, VmmEveryHolderKilled) {
  Pair p("vmm", 128 * kMi, box.path("s"), env, env);
  connect(p);
  p.exporter.kill9();
  p.importer.kill9();
  Peer third({"export", "vmm", std::to_string(2 * kMi), box.path("t")}, env);
  ASSERT_EQ(third.answer(), 0) << third.last();
  EXPECT_TRUE(admits(third, 510 * kMi)) << "the dead holders' shared memory is reclaimed";
}

// cuMemCreate located on the host (CU_MEM_LOCATION_TYPE_HOST, HOST_NUMA):
// pinned host memory, never read as a device ordinal, never counted.
TEST_F(SharedMemory, HostLocatedCreateIsNotCounted) {
  Peer peer({"export", "vmm", std::to_string(2 * kMi), box.path("s")}, env);
  ASSERT_EQ(peer.answer(), 0) << peer.last();
  ASSERT_EQ(peer.ask("host " + std::to_string(256 * kMi)), 0) << peer.last();
  EXPECT_TRUE(admits(peer, 510 * kMi)) << "512 MiB of host memory counted against the device";
}

// An importer in another container is charged to that container too (its
// mapping keeps the memory alive whatever the exporter's container does, and
// neither container can see the other's holders): each container counts
// what it holds, and the exporter's is not relieved.
TEST_F(SharedMemory, VmmImportFromAnotherContainerIsChargedToBoth) {
  Sandbox other;
  const Env other_env = merge(env, {{"GPUSLICE_REGION", other.path("other.region")}});
  Pair p("vmm", 128 * kMi, box.path("s"), env, other_env);
  connect(p);
  EXPECT_FALSE(admits(p.importer, 386 * kMi)) << "the importing container holds the mapping";
  EXPECT_TRUE(admits(p.importer, 384 * kMi));
  EXPECT_FALSE(admits(p.exporter, 386 * kMi)) << "the exporting container holds the allocation";
  EXPECT_TRUE(admits(p.exporter, 384 * kMi));
  ASSERT_EQ(p.exporter.ask("release"), 0);
  EXPECT_FALSE(admits(p.importer, 386 * kMi)) << "still mapped by the importer";
  EXPECT_TRUE(admits(p.exporter, 512 * kMi)) << "the exporting container let go";
}

// Legacy IPC: the memory is the exporter's. The importer is charged nothing
// for opening it; its cuMemFree of the opened pointer is refused and
// releases nothing; closing it changes no count.
TEST_F(SharedMemory, LegacyIpcImporterIsNotCharged) {
  Sandbox other;
  const Env other_env = merge(env, {{"GPUSLICE_REGION", other.path("other.region")}});
  Pair p("ipc", 128 * kMi, box.path("s"), env, other_env);
  connect(p);
  EXPECT_TRUE(admits(p.importer, 512 * kMi)) << "the importer's container holds none of it";
  EXPECT_FALSE(admits(p.exporter, 386 * kMi)) << "the exporter's 128 MiB";
  EXPECT_TRUE(admits(p.exporter, 384 * kMi));
  EXPECT_NE(p.importer.ask("free"), 0) << "cuMemFree of an opened IPC pointer";
  EXPECT_FALSE(admits(p.exporter, 386 * kMi)) << "the importer's free released nothing";
  ASSERT_EQ(p.importer.ask("release"), 0);
  EXPECT_NE(p.importer.ask("release"), 0) << "closed twice";
  EXPECT_FALSE(admits(p.exporter, 386 * kMi));
  EXPECT_TRUE(admits(p.importer, 512 * kMi));
  ASSERT_EQ(p.exporter.ask("release"), 0);
  EXPECT_TRUE(admits(p.exporter, 512 * kMi));
}

TEST_F(SharedMemory, LegacyIpcSameContainer) {
  Pair p("ipc", 128 * kMi, box.path("s"), env, env);
  connect(p);
  EXPECT_EQ(p.exporter.ask("self"), static_cast<int>(CUDA_ERROR_INVALID_CONTEXT)) << "opening its own handle";
  EXPECT_TRUE(admits(p.importer, 384 * kMi)) << "counted once: the exporter's allocation";
  EXPECT_FALSE(admits(p.importer, 386 * kMi));
  ASSERT_EQ(p.importer.ask("release"), 0);
  EXPECT_FALSE(admits(p.importer, 386 * kMi)) << "closing released nothing of the exporter's";
  p.exporter.kill9();
  EXPECT_TRUE(admits(p.importer, 512 * kMi)) << "the dead exporter's memory is reclaimed";
}

}  // namespace
