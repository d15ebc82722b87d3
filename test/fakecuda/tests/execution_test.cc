// Modules, launches, streams, events, graphs and capture on the simulated timeline.
#include <atomic>
#include <chrono>
#include <thread>

#include "common.h"

using namespace fakecuda_test;

namespace {

constexpr const char* kImage = "// fake PTX\n.entry spin_25000us\n.entry spin_1000us\n.entry noop\n";

struct Kernels {
  CUmodule module = nullptr;
  CUfunction spin25ms = nullptr, spin1ms = nullptr, noop = nullptr;
};

Kernels Load() {
  Kernels k;
  EXPECT_CU(cuModuleLoadData(&k.module, kImage));
  EXPECT_CU(cuModuleGetFunction(&k.spin25ms, k.module, "spin_25000us"));
  EXPECT_CU(cuModuleGetFunction(&k.spin1ms, k.module, "spin_1000us"));
  EXPECT_CU(cuModuleGetFunction(&k.noop, k.module, "noop"));
  return k;
}

CUresult Launch(CUfunction f, CUstream stream = nullptr) {
  return cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 0, stream, nullptr, nullptr);
}

TEST_F(FakeCuda, ModulesAndFunctions) {
  InitWithContext();
  Kernels k = Load();
  CUfunction missing = nullptr;
  EXPECT_EQ(cuModuleGetFunction(&missing, k.module, "absent"), CUDA_ERROR_NOT_FOUND);
  const char* name = nullptr;
  EXPECT_CU(cuFuncGetName(&name, k.spin25ms));
  EXPECT_STREQ(name, "spin_25000us");
  int value = 0;
  EXPECT_CU(cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, k.noop));
  EXPECT_EQ(value, 1024);
  CUfunction again = nullptr;
  EXPECT_CU(cuModuleGetFunction(&again, k.module, "spin_25000us"));
  EXPECT_EQ(again, k.spin25ms);
  char path[] = "/tmp/fakecuda-module-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, kImage, strlen(kImage)), static_cast<ssize_t>(strlen(kImage)));
  close(fd);
  CUmodule from_file = nullptr;
  EXPECT_CU(cuModuleLoad(&from_file, path));
  unlink(path);
  EXPECT_EQ(cuModuleLoad(&from_file, "/nonexistent/module"), CUDA_ERROR_FILE_NOT_FOUND);
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, kImage, nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUkernel kernel = nullptr;
  ASSERT_CU(cuLibraryGetKernel(&kernel, library, "spin_1000us"));
  CUfunction from_kernel = nullptr;
  ASSERT_CU(cuKernelGetFunction(&from_kernel, kernel));
  EXPECT_CU(Launch(from_kernel));
  EXPECT_CU(Launch(reinterpret_cast<CUfunction>(kernel)));
  EXPECT_CU(cuModuleUnload(k.module));
  EXPECT_EQ(Launch(k.noop), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_CU(cuCtxSynchronize());
}

TEST_F(FakeCuda, LaunchesTakeSimulatedTimeAndSynchronizeSleeps) {
  InitWithContext();
  Kernels k = Load();
  CUstream stream = nullptr;
  ASSERT_CU(cuStreamCreate(&stream, 0));
  CUevent start = nullptr, stop = nullptr;
  ASSERT_CU(cuEventCreate(&start, CU_EVENT_DEFAULT));
  ASSERT_CU(cuEventCreate(&stop, CU_EVENT_DEFAULT));
  uint64_t t0 = fakecuda_now_ns();
  ASSERT_CU(cuEventRecord(start, stream));
  ASSERT_CU(Launch(k.spin25ms, stream));
  ASSERT_CU(Launch(k.spin25ms, stream));
  ASSERT_CU(cuEventRecord(stop, stream));
  uint64_t after_launch = fakecuda_now_ns();
  EXPECT_LT(after_launch - t0, 25000000u);  // launches return at once (loose: sanitizers, loaded CI)
  EXPECT_EQ(cuStreamQuery(stream), CUDA_ERROR_NOT_READY);
  EXPECT_EQ(cuEventQuery(stop), CUDA_ERROR_NOT_READY);
  float ms = 0;
  EXPECT_EQ(cuEventElapsedTime(&ms, start, stop), CUDA_ERROR_NOT_READY);
  ASSERT_CU(cuStreamSynchronize(stream));
  uint64_t t1 = fakecuda_now_ns();
  EXPECT_GE(t1 - t0, 50000000u);
  EXPECT_CU(cuStreamQuery(stream));
  EXPECT_CU(cuEventQuery(stop));
  EXPECT_CU(cuEventElapsedTime(&ms, start, stop));
  EXPECT_NEAR(ms, 50.0, 0.5);
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, t1), 50000000u);
  EXPECT_EQ(fakecuda_busy_ns(0, getpid(), t0, t1), 50000000u);
  EXPECT_EQ(fakecuda_busy_ns(1, 0, t0, t1), 0u);
  // A 0 us kernel takes no device time.
  ASSERT_CU(Launch(k.noop, stream));
  EXPECT_CU(cuStreamQuery(stream));
  CUevent untimed = nullptr;
  ASSERT_CU(cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING));
  ASSERT_CU(cuEventRecord(untimed, nullptr));
  EXPECT_CU(cuEventSynchronize(untimed));
  EXPECT_EQ(cuEventElapsedTime(&ms, start, untimed), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_CU(cuEventDestroy(untimed));
  EXPECT_CU(cuEventDestroy(start));
  EXPECT_CU(cuEventDestroy(stop));
  EXPECT_CU(cuStreamDestroy(stream));
  EXPECT_EQ(cuStreamSynchronize(stream), CUDA_ERROR_INVALID_HANDLE);
}

TEST_F(FakeCuda, SpecialStreamsAndLaunchVariants) {
  InitWithContext();
  Kernels k = Load();
  uint64_t t0 = fakecuda_now_ns();
  EXPECT_CU(Launch(k.spin1ms, CU_STREAM_LEGACY));
  EXPECT_CU(Launch(k.spin1ms, CU_STREAM_PER_THREAD));
  EXPECT_CU(cuLaunchKernel_ptsz(k.spin1ms, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  EXPECT_CU(cuLaunchCooperativeKernel(k.spin1ms, 2, 1, 1, 64, 1, 1, 0, nullptr, nullptr));
  EXPECT_CU(cuLaunchCooperativeKernel_ptsz(k.spin1ms, 2, 1, 1, 64, 1, 1, 0, nullptr, nullptr));
  EXPECT_EQ(cuLaunchCooperativeKernel(k.spin1ms, 1000000, 1, 1, 1024, 1, 1, 0, nullptr, nullptr),
            CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
  CUlaunchAttribute attr{};
  attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
  attr.value.cooperative = 1;
  CUlaunchConfig config{};
  config.gridDimX = config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = config.blockDimY = config.blockDimZ = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  EXPECT_CU(cuLaunchKernelEx(&config, k.spin1ms, nullptr, nullptr));
  EXPECT_CU(cuLaunchKernelEx_ptsz(&config, k.spin1ms, nullptr, nullptr));
  EXPECT_EQ(cuLaunchKernel(k.spin1ms, 1, 1, 1, 2048, 1, 1, 0, nullptr, nullptr, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuLaunchKernel(k.spin1ms, 0, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_CU(cuStreamSynchronize_ptsz(nullptr));
  EXPECT_CU(cuCtxSynchronize());
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, fakecuda_now_ns()), 7000000u);
  CUcontext ctx = nullptr;
  EXPECT_CU(cuCtxPopCurrent(&ctx));
  EXPECT_EQ(Launch(k.spin1ms), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_F(FakeCuda, GraphsRunTheirKernelsInOrder) {
  InitWithContext();
  Kernels k = Load();
  CUgraph graph = nullptr;
  ASSERT_CU(cuGraphCreate(&graph, 0));
  CUDA_KERNEL_NODE_PARAMS params{};
  params.func = k.spin1ms;
  params.gridDimX = params.gridDimY = params.gridDimZ = 1;
  params.blockDimX = params.blockDimY = params.blockDimZ = 32;
  CUgraphNode first = nullptr, second = nullptr;
  ASSERT_CU(cuGraphAddKernelNode(&first, graph, nullptr, 0, &params));
  CUDA_KERNEL_NODE_PARAMS_v1 legacy{};
  memcpy(&legacy, &params, sizeof(legacy));
  legacy.func = k.spin25ms;
  using AddV1 = CUresult (*)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t, const CUDA_KERNEL_NODE_PARAMS_v1*);
  auto add_v1 = reinterpret_cast<AddV1>(dlsym(RTLD_DEFAULT, "cuGraphAddKernelNode"));
  ASSERT_CU(add_v1(&second, graph, &first, 1, &legacy));
  size_t count = 0;
  ASSERT_CU(cuGraphGetNodes(graph, nullptr, &count));
  EXPECT_EQ(count, 2u);
  CUgraphNodeType type;
  EXPECT_CU(cuGraphNodeGetType(second, &type));
  EXPECT_EQ(type, CU_GRAPH_NODE_TYPE_KERNEL);
  CUDA_KERNEL_NODE_PARAMS got{};
  EXPECT_CU(cuGraphKernelNodeGetParams(second, &got));
  EXPECT_EQ(got.func, k.spin25ms);
  CUgraphExec exec = nullptr, exec2 = nullptr;
  ASSERT_CU(cuGraphInstantiateWithFlags(&exec, graph, 0));
  CUDA_GRAPH_INSTANTIATE_PARAMS iparams{};
  ASSERT_CU(cuGraphInstantiateWithParams(&exec2, graph, &iparams));
  EXPECT_EQ(iparams.result_out, CUDA_GRAPH_INSTANTIATE_SUCCESS);
  uint64_t t0 = fakecuda_now_ns();
  ASSERT_CU(cuGraphLaunch(exec, nullptr));
  ASSERT_CU(cuGraphLaunch_ptsz(exec2, nullptr));
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, fakecuda_now_ns()), 52000000u);
  EXPECT_CU(cuGraphExecDestroy(exec));
  EXPECT_CU(cuGraphExecDestroy(exec2));
  EXPECT_CU(cuGraphDestroy(graph));
}

TEST_F(FakeCuda, CaptureRecordsLaunchesInsteadOfRunningThem) {
  InitWithContext();
  Kernels k = Load();
  CUstream stream = nullptr;
  ASSERT_CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  EXPECT_EQ(cuStreamBeginCapture(nullptr, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  uint64_t t0 = fakecuda_now_ns();
  ASSERT_CU(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CUstreamCaptureStatus status;
  EXPECT_CU(cuStreamIsCapturing(stream, &status));
  EXPECT_EQ(status, CU_STREAM_CAPTURE_STATUS_ACTIVE);
  for (int i = 0; i < 3; ++i) ASSERT_CU(Launch(k.spin1ms, stream));
  EXPECT_EQ(cuStreamSynchronize(stream), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, fakecuda_now_ns() + 100000000), 0u);
  CUgraph graph = nullptr;
  ASSERT_CU(cuStreamEndCapture(stream, &graph));
  EXPECT_CU(cuStreamIsCapturing(stream, &status));
  EXPECT_EQ(status, CU_STREAM_CAPTURE_STATUS_NONE);
  size_t count = 0;
  ASSERT_CU(cuGraphGetNodes(graph, nullptr, &count));
  EXPECT_EQ(count, 3u);
  CUgraphExec exec = nullptr;
  ASSERT_CU(cuGraphInstantiate(&exec, graph, 0));
  ASSERT_CU(cuGraphLaunch(exec, stream));
  ASSERT_CU(cuStreamSynchronize(stream));
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, fakecuda_now_ns()), 3000000u);
}

TEST_F(FakeCuda, ConcurrentLaunchersShareOneTimeline) {
  CUcontext ctx = nullptr;
  InitWithContext(&ctx);
  Kernels k = Load();
  uint64_t t0 = fakecuda_now_ns();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      EXPECT_CU(cuCtxSetCurrent(ctx));
      for (int i = 0; i < 50; ++i)
        EXPECT_CU(cuLaunchKernel_ptsz(k.spin1ms, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
      EXPECT_CU(cuStreamSynchronize_ptsz(CU_STREAM_PER_THREAD));
    });
  }
  std::thread reader([&] {
    for (int i = 0; i < 50; ++i) (void)fakecuda_busy_ns(0, 0, t0, fakecuda_now_ns());
  });
  for (auto& thread : threads) thread.join();
  reader.join();
  uint64_t t1 = fakecuda_now_ns();
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, t1 + 1000000000), 200000000u);
  EXPECT_GE(t1 - t0, 200000000u);  // one kernel at a time
  EXPECT_GE(fakecuda_busy_until_ns(0), t0 + 200000000u);
}

// cuDevicePrimaryCtxReset destroys the primary context's streams while another
// thread synchronises them (chaos class `primary` with streams elsewhere): a
// stream of a reset context is invalid (INVALID_HANDLE, or the context's
// errors for the legacy stream), never a crash, and the simulator reads no
// retired or recycled stream (ThreadSanitizer found stream_end and
// resolve_stream reading them unlocked). Bounded: a fixed number of resets.
TEST_F(FakeCuda, SynchronizeRacingPrimaryResetSeesAnInvalidStreamNeverACrash) {
  ASSERT_CU(cuInit(0));
  CUcontext primary = nullptr;
  ASSERT_CU(cuDevicePrimaryCtxRetain(&primary, 0));
  ASSERT_CU(cuCtxSetCurrent(primary));
  CUstream first = nullptr;
  ASSERT_CU(cuStreamCreate(&first, 0));
  std::atomic<CUstream> published{first};
  std::atomic<bool> stop{false};
  std::atomic<int> unexpected{0}, calls{0}, ok{0};
  auto judge = [&](CUresult rc) {
    calls.fetch_add(1);
    if (rc == CUDA_SUCCESS) {
      ok.fetch_add(1);
    } else if (rc != CUDA_ERROR_INVALID_HANDLE && rc != CUDA_ERROR_CONTEXT_IS_DESTROYED &&
               rc != CUDA_ERROR_INVALID_CONTEXT) {
      unexpected.fetch_add(1);
    }
  };
  std::vector<std::thread> syncers;
  for (int t = 0; t < 2; ++t) {
    syncers.emplace_back([&] {
      if (cuCtxSetCurrent(primary) != CUDA_SUCCESS) unexpected.fetch_add(1);
      while (!stop.load()) {
        judge(cuStreamSynchronize(nullptr));
        judge(cuStreamSynchronize(published.load()));
        judge(cuStreamQuery(CU_STREAM_LEGACY));
        judge(cuStreamQuery(published.load()));
      }
    });
  }
  // Each reset waits for a synchronisation since the last one (bounded: 60 s
  // in all), so the two always overlap, however the threads are scheduled.
  constexpr int kResets = 300;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int seen = 0;
  for (int i = 0; i < kResets; ++i) {
    while (calls.load() == seen && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    seen = calls.load();
    ASSERT_CU(cuDevicePrimaryCtxReset(0));
    CUcontext again = nullptr;
    ASSERT_CU(cuDevicePrimaryCtxRetain(&again, 0));  // a new legacy stream, in a recycled cell
    ASSERT_EQ(again, primary);
    CUstream stream = nullptr;
    ASSERT_CU(cuStreamCreate(&stream, 0));
    published.store(stream);
  }
  stop.store(true);
  for (auto& thread : syncers) thread.join();
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_GE(calls.load(), kResets);
  EXPECT_GT(ok.load(), 0);
  EXPECT_CU(cuStreamSynchronize(published.load()));
}

}  // namespace
