// nccl_rank RANK N DIR MIB KERNEL_US SECONDS: one rank of an NCCL/vLLM-shaped
// job (nccl_shaped_test.cc): one process per device, each rank on device RANK
// of N (all N visible, as NCCL runs). It creates MIB of VMM memory with a
// POSIX-fd handle type on its device, maps it, listens on DIR/rank<RANK>.sock,
// hands its descriptor (SCM_RIGHTS) to the previous rank and imports the next
// rank's, mapping it with access for its own device (a peer mapping). Then it
// allocates 8 MiB blocks on its device until refused, and launches spin_<US>us
// kernels on a stream of its device for SECONDS (at most 30000). Prints
//   import rc=R          the next rank's memory imported, mapped, access set
//   fill bytes=B         what cuMemAlloc got beside the shared memory
//   launches n=N pid=P
// Every wait is bounded (30 s); a rank that cannot finish exits non-zero.
#include <cuda.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fd_passing.h"

namespace {

double now_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

sockaddr_un address(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
  return a;
}

// Accepts one peer (bounded) and sends it `fd`.
int serve(int listener, int fd) {
  pollfd p{listener, POLLIN, 0};
  if (poll(&p, 1, 30000) != 1) return -1;
  const int peer = accept(listener, nullptr, nullptr);
  if (peer < 0) return -1;
  const int rc = gpuslice::test::send_fd(peer, fd) ? 0 : -1;
  close(peer);
  return rc;
}

// Connects to `path` (retrying for up to 30 s) and receives a descriptor.
int receive(const std::string& path) {
  const sockaddr_un a = address(path);
  for (const double end = now_s() + 30; now_s() < end; usleep(10000)) {
    const int s = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
      close(s);
      continue;
    }
    const int fd = gpuslice::test::receive_fd(s);
    close(s);
    return fd;
  }
  return -1;
}

CUresult map(CUmemGenericAllocationHandle h, size_t bytes, int dev, CUdeviceptr* va) {
  CUresult rc = cuMemAddressReserve(va, bytes, 0, 0, 0);
  if (rc == CUDA_SUCCESS) rc = cuMemMap(*va, bytes, 0, h, 0);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (rc == CUDA_SUCCESS) rc = cuMemSetAccess(*va, bytes, &access, 1);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) return 2;
  const int rank = std::atoi(argv[1]), n = std::atoi(argv[2]);
  const std::string dir = argv[3];
  const size_t bytes = std::strtoull(argv[4], nullptr, 10) << 20;
  const int us = std::atoi(argv[5]);
  const double seconds = std::atof(argv[6]);
  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, rank) != CUDA_SUCCESS ||
      cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
    return 3;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = rank;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle mine = 0;
  CUdeviceptr mine_va = 0;
  int fd = -1;
  if (cuMemCreate(&mine, bytes, &prop, 0) != CUDA_SUCCESS || map(mine, bytes, rank, &mine_va) != CUDA_SUCCESS ||
      cuMemExportToShareableHandle(&fd, mine, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS)
    return 4;
  const std::string own = dir + "/rank" + std::to_string(rank) + ".sock";
  const int listener = socket(AF_UNIX, SOCK_STREAM, 0);
  const sockaddr_un a = address(own);
  if (bind(listener, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 || listen(listener, 4) != 0) return 5;
  int served = -1;
  std::thread server([&] { served = serve(listener, fd); });
  const int peer_fd = receive(dir + "/rank" + std::to_string((rank + 1) % n) + ".sock");
  server.join();
  if (served != 0 || peer_fd < 0) return 6;
  CUmemGenericAllocationHandle theirs = 0;
  CUdeviceptr theirs_va = 0;
  CUresult rc = cuMemImportFromShareableHandle(&theirs, reinterpret_cast<void*>(static_cast<intptr_t>(peer_fd)),
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (rc == CUDA_SUCCESS) rc = map(theirs, bytes, rank, &theirs_va);
  std::printf("import rc=%d\n", rc);
  std::vector<CUdeviceptr> blocks;
  for (CUdeviceptr p = 0; blocks.size() < 4096 && cuMemAlloc(&p, 8 << 20) == CUDA_SUCCESS;) blocks.push_back(p);
  std::printf("fill bytes=%zu\n", blocks.size() << 23);
  for (CUdeviceptr p : blocks) cuMemFree(p);
  const std::string name = "spin_" + std::to_string(us) + "us";
  const std::string image = "// fake PTX\n.entry " + name + "\n";
  CUmodule mod = nullptr;
  CUfunction f = nullptr;
  CUstream s = nullptr;
  if (cuModuleLoadData(&mod, image.c_str()) != CUDA_SUCCESS ||
      cuModuleGetFunction(&f, mod, name.c_str()) != CUDA_SUCCESS ||
      cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
    return 7;
  long launches = 0;
  for (const double end = now_s() + seconds; launches < 30000 && now_s() < end; ++launches)
    if (cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr) != CUDA_SUCCESS) return 8;
  std::printf("launches n=%ld pid=%ld\n", launches, static_cast<long>(getpid()));
  std::fflush(stdout);
  cuStreamSynchronize(s);
  cuMemUnmap(theirs_va, bytes);
  cuMemRelease(theirs);
  cuMemUnmap(mine_va, bytes);
  cuMemRelease(mine);
  unlink(own.c_str());
  return 0;
}
