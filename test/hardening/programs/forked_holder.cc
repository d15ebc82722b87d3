// forked_holder: a program of the container for forked_holder_test.cc.
//   forked_holder hold BYTES   allocates BYTES, forks a child that only
//                              sleeps (it keeps the driver's files, as any
//                              forked child does), prints
//                              "hold rc=R child=PID" and sleeps until killed
//   forked_holder alloc BYTES  allocates BYTES, prints "alloc rc=R", frees, exits
#include <cuda.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const size_t bytes = std::strtoull(argv[2], nullptr, 10);
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    std::printf("%s rc=init\n", argv[1]);
    return 1;
  }
  CUdeviceptr p = 0;
  const CUresult rc = cuMemAlloc(&p, bytes);
  if (std::strcmp(argv[1], "alloc") == 0) {
    std::printf("alloc rc=%d\n", static_cast<int>(rc));
    if (rc == CUDA_SUCCESS) cuMemFree(p);
    return 0;
  }
  std::fflush(stdout);
  const pid_t child = fork();
  if (child == 0) {
    for (int i = 0; i < 600; ++i) sleep(1);  // bounded: the test kills it long before
    _exit(0);
  }
  std::printf("hold rc=%d child=%d\n", static_cast<int>(rc), static_cast<int>(child));
  std::fflush(stdout);
  for (int i = 0; i < 600; ++i) sleep(1);
  return 0;
}
