// limits_probe: a program of the container for limits_test.cc (issue 35:
// every limit reached, and answered clearly).
//   limits_probe table MARGIN_KIB BYTES COUNT
//       with the address space limited to what the process maps now plus
//       MARGIN_KIB (RLIMIT_AS), allocates BYTES up to COUNT times until a
//       refusal; lifts the limit, frees every allocation it was given, and
//       prints "table admitted=N rc=R free_before=F free_after=G": what
//       cuMemGetInfo said before the first allocation and after the last free
//       (equal when every admitted byte was released).
//   limits_probe init
//       cuInit and prints "init rc=R".
//   limits_probe alloc BYTES
//       a context on device 0, one allocation: prints "alloc rc=R", frees it.
//   limits_probe graphs COUNT
//       instantiates COUNT executables of a one-kernel graph, launches the
//       last one, prints "graphs made=N launch_rc=R", destroys them all.
#include <cuda.h>
#include <malloc.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

bool context() {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  return cuInit(0) == CUDA_SUCCESS && cuDeviceGet(&dev, 0) == CUDA_SUCCESS &&
         cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
}

// What the process maps now (VmSize, /proc/self/status), in bytes.
unsigned long long mapped_bytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "VmSize: %llu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib * 1024;
}

int table(unsigned long long margin_kib, size_t bytes, size_t count) {
  if (!context()) return 1;
  // The pointers, mapped before the limit.
  auto* ptrs = static_cast<CUdeviceptr*>(
      mmap(nullptr, count * sizeof(CUdeviceptr), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (ptrs == MAP_FAILED) return 1;
  std::memset(ptrs, 0, count * sizeof(CUdeviceptr));  // touched now: no fault under the limit
  size_t free_before = 0, free_after = 0, total = 0;
  if (cuMemGetInfo(&free_before, &total) != CUDA_SUCCESS) return 1;
  // The driver's own bookkeeping (malloc) is served from a heap grown now and
  // kept (no trimming, no mmap'd blocks): under the limit only new mappings
  // fail, as when a process's address space is nearly exhausted by its own
  // mappings while the driver still has room.
  mallopt(M_MMAP_THRESHOLD, 16 << 20);  // 1 MiB blocks from the heap (the most it takes: 32 MiB)
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 0);
  void* heap[256] = {};  // 256 MiB, under the trim threshold
  for (void*& block : heap) block = std::malloc(1 << 20);
  for (void* block : heap) std::free(block);
  rlimit old{};
  getrlimit(RLIMIT_AS, &old);
  rlimit tight = old;
  tight.rlim_cur = mapped_bytes() + margin_kib * 1024;
  if (setrlimit(RLIMIT_AS, &tight) != 0) return 1;
  size_t n = 0;
  CUresult rc = CUDA_SUCCESS;
  while (n < count && (rc = cuMemAlloc(&ptrs[n], bytes)) == CUDA_SUCCESS) ++n;
  setrlimit(RLIMIT_AS, &old);
  for (size_t i = 0; i < n; ++i) cuMemFree(ptrs[i]);
  cuMemGetInfo(&free_after, &total);
  std::printf("table admitted=%zu rc=%d free_before=%zu free_after=%zu\n", n, static_cast<int>(rc), free_before,
              free_after);
  // Room again (the limit lifted, the records freed): admitted again.
  CUdeviceptr again = 0;
  const CUresult again_rc = cuMemAlloc(&again, bytes);
  std::printf("again rc=%d\n", static_cast<int>(again_rc));
  if (again_rc == CUDA_SUCCESS) cuMemFree(again);
  return 0;
}

int graphs(size_t count) {
  if (!context()) return 1;
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  // A PTX image naming one kernel.
  if (cuModuleLoadData(&module, "// fake PTX\n.entry noop\n") != CUDA_SUCCESS ||
      cuModuleGetFunction(&fn, module, "noop") != CUDA_SUCCESS) {
    std::printf("graphs made=0 launch_rc=module\n");
    return 1;
  }
  CUgraph graph = nullptr;
  CUgraphNode node = nullptr;
  CUDA_KERNEL_NODE_PARAMS p{};
  p.func = fn;
  p.gridDimX = p.gridDimY = p.gridDimZ = 1;
  p.blockDimX = p.blockDimY = p.blockDimZ = 1;
  if (cuGraphCreate(&graph, 0) != CUDA_SUCCESS || cuGraphAddKernelNode(&node, graph, nullptr, 0, &p) != CUDA_SUCCESS)
    return 1;
  auto* execs = static_cast<CUgraphExec*>(std::calloc(count, sizeof(CUgraphExec)));
  size_t made = 0;
  while (made < count && cuGraphInstantiateWithFlags(&execs[made], graph, 0) == CUDA_SUCCESS) ++made;
  const CUresult rc = made == 0 ? CUDA_ERROR_INVALID_VALUE : cuGraphLaunch(execs[made - 1], nullptr);
  cuStreamSynchronize(nullptr);
  std::printf("graphs made=%zu launch_rc=%d\n", made, static_cast<int>(rc));
  for (size_t i = 0; i < made; ++i) cuGraphExecDestroy(execs[i]);
  std::free(execs);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "table") == 0 && argc == 5)
    return table(std::strtoull(argv[2], nullptr, 10), std::strtoull(argv[3], nullptr, 10),
                 std::strtoull(argv[4], nullptr, 10));
  if (std::strcmp(mode, "init") == 0) {
    const CUresult rc = cuInit(0);
    std::printf("init rc=%d\n", static_cast<int>(rc));
    return 0;
  }
  if (std::strcmp(mode, "alloc") == 0 && argc == 3) {
    CUdeviceptr p = 0;
    const CUresult rc = context() ? cuMemAlloc(&p, std::strtoull(argv[2], nullptr, 10)) : CUDA_ERROR_NOT_INITIALIZED;
    std::printf("alloc rc=%d\n", static_cast<int>(rc));
    if (rc == CUDA_SUCCESS) cuMemFree(p);
    return 0;
  }
  if (std::strcmp(mode, "graphs") == 0 && argc == 3) return graphs(std::strtoull(argv[2], nullptr, 10));
  std::fprintf(stderr, "usage: limits_probe table MARGIN_KIB BYTES COUNT | init | alloc BYTES | graphs COUNT\n");
  return 2;
}
