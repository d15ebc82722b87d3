// gpuslice-probe holder: a process that dies while its device memory stays
// on the device, for the node agent's reaping tests
// (test/agent/agent_liveness_test.cc).
//   fork-child MIB
//       allocates MIB with cuMemAlloc in the primary context, forks a child
//       that only sleeps (it keeps the driver's files, as any forked child
//       does: a DataLoader worker), prints "hold rc=R child=PID" and sleeps
//       until killed (at most 10 minutes).
//   fork-late GO
//       allocates and frees 1 MiB (its slot is claimed), forks a child, prints
//       "forked child=PID" and returns (its exit releases its slot). The child
//       waits for the file GO (at most 60 s), then makes its first CUDA call
//       (cuMemAlloc: the driver refuses a forked child, gpuslice claims the
//       child's slot first), prints "child rc=R" and sleeps until killed: a
//       DataLoader worker that outlives its parent, for the agent's region
//       removal (test/agent/agent_regions_test.cc).
//   main-exits MIB
//       allocates MIB the same way, starts a thread that only sleeps, prints
//       "hold rc=R" and leaves main with pthread_exit: the thread group's
//       leader is a zombie while the thread runs on, holding the memory.
#include <cuda.h>
#include <pthread.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "probe.h"

namespace gpuslice::probe::holder {
namespace {

CUresult allocate(std::size_t bytes) {
  use_primary(0);
  CUdeviceptr p = 0;
  return cuMemAlloc(&p, bytes);  // never freed: the process is killed
}

void* sleep_on(void*) {
  for (int i = 0; i < 600; ++i) sleep(1);  // bounded: the test kills it long before
  return nullptr;
}

}  // namespace

int fork_child(std::size_t bytes) {
  const CUresult rc = allocate(bytes);
  std::fflush(stdout);
  const pid_t child = fork();
  if (child == 0) {
    sleep_on(nullptr);
    _exit(0);
  }
  std::printf("hold rc=%d child=%d\n", static_cast<int>(rc), static_cast<int>(child));
  std::fflush(stdout);
  sleep_on(nullptr);
  return 0;
}

int fork_late(const std::string& go) {
  use_primary(0);
  CUdeviceptr p = 0;
  check(cuMemAlloc(&p, std::size_t{1} << 20), "cuMemAlloc");
  check(cuMemFree(p), "cuMemFree");
  std::fflush(stdout);
  const pid_t child = fork();
  if (child == 0) {
    for (int i = 0; i < 12000 && access(go.c_str(), F_OK) != 0; ++i) usleep(5000);
    CUdeviceptr q = 0;
    std::printf("child rc=%d\n", static_cast<int>(cuMemAlloc(&q, std::size_t{1} << 20)));
    std::fflush(stdout);
    sleep_on(nullptr);
    _exit(0);
  }
  std::printf("forked child=%d\n", static_cast<int>(child));
  return 0;
}

int main_exits(std::size_t bytes) {
  const CUresult rc = allocate(bytes);
  pthread_t worker;
  check(pthread_create(&worker, nullptr, sleep_on, nullptr) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN, "pthread_create");
  std::printf("hold rc=%d\n", static_cast<int>(rc));
  std::fflush(stdout);
  pthread_exit(nullptr);
}

}  // namespace gpuslice::probe::holder
