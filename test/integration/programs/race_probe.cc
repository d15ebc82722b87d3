// race_probe threads N BYTES: N threads make the process's first CUDA call at
// once (cuInit, context, one allocation each) and it prints how many got memory.
// race_probe fork CHUNK: see below.
#include <cuda.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

CUresult init_and_alloc(unsigned long long bytes, CUdeviceptr* p) {
  CUresult rc = cuInit(0);
  if (rc != CUDA_SUCCESS) return rc;
  CUcontext ctx = nullptr;
  if ((rc = cuDevicePrimaryCtxRetain(&ctx, 0)) != CUDA_SUCCESS) return rc;
  if ((rc = cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) return rc;
  return cuMemAlloc(p, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (std::strcmp(argv[1], "threads") == 0) {
    const int n = std::atoi(argv[2]);
    const unsigned long long bytes = std::strtoull(argv[3], nullptr, 0);
    std::atomic<int> ok{0}, start{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i)
      threads.emplace_back([&] {
        while (start.load() == 0) {}
        CUdeviceptr p = 0;
        if (init_and_alloc(bytes, &p) == CUDA_SUCCESS) ok.fetch_add(1);
      });
    start.store(1);
    for (auto& t : threads) t.join();
    std::printf("threads ok=%d\n", ok.load());
    return 0;
  }
  // fork: the parent bootstraps gpuslice (a query before cuInit) but never
  // initialises CUDA; the child fills the quota and dies without cleanup; then
  // the parent must get the whole quota, on its own account.
  const unsigned long long chunk = std::strtoull(argv[2], nullptr, 0);
  size_t f = 0, t = 0;
  std::printf("parent-query rc=%d\n", cuMemGetInfo(&f, &t));
  auto fill = [&](const char* who) {
    CUdeviceptr q = 0;
    unsigned long long total = 0;
    CUresult rc = init_and_alloc(chunk, &q);
    while (rc == CUDA_SUCCESS) {
      total += chunk;
      rc = cuMemAlloc(&q, chunk);
    }
    std::printf("%s bytes=%llu rc=%d\n", who, total, rc);
    std::fflush(stdout);
  };
  pid_t child = fork();
  if (child == 0) {
    fill("child");
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  fill("parent");
  return 0;
}
