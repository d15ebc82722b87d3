// The realistic profile (README "Realistic profile"): strict knobs, time-slicing
// between contexts, concurrency inside a context, jitter, launch cost, the
// per-stream hardware queue, periodic NVML samples, context memory, dropped work
// of exited processes. Device times are read from events, which carry simulated
// completion times, so most checks are exact whatever the machine's load.
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "common.h"
#include "nvml_abi.h"

using namespace fakecuda_test;

// Every sched_yield of this process (the simulated driver's short waits spin
// with it), counted: libcuda's calls resolve to this definition first.
std::atomic<long> g_yields{0};
extern "C" int sched_yield() {
  g_yields.fetch_add(1, std::memory_order_relaxed);
  return static_cast<int>(syscall(SYS_sched_yield));
}

namespace {

constexpr const char* kImage =
    ".entry spin_50000us\n.entry spin_20000us\n.entry spin_10000us\n.entry spin_5000us\n.entry spin_1000us\n";

class Realistic : public FakeCuda {
 protected:
  void SetUp() override {
    FakeCuda::SetUp();
    setenv("FAKECUDA_PROFILE", "realistic", 1);
    // Exact arithmetic unless a test asks for jitter or launch cost.
    setenv("FAKECUDA_JITTER_PCT", "0", 1);
    setenv("FAKECUDA_LAUNCH_COST_US", "0", 1);
    setenv("FAKECUDA_TIMESLICE_US", "2000", 1);
  }
  CUfunction Function(const char* name) {
    if (module_ == nullptr) {
      EXPECT_CU(cuModuleLoadData(&module_, kImage));
    }
    CUfunction f = nullptr;
    EXPECT_CU(cuModuleGetFunction(&f, module_, name));
    return f;
  }
  CUmodule module_ = nullptr;
};

CUresult Launch(CUfunction f, CUstream stream, unsigned blocks = 1) {
  return cuLaunchKernel(f, blocks, 1, 1, 128, 1, 1, 0, stream, nullptr, nullptr);
}

CUevent Record(CUstream stream) {
  CUevent event = nullptr;
  EXPECT_CU(cuEventCreate(&event, 0));
  EXPECT_CU(cuEventRecord(event, stream));
  return event;
}

float Ms(CUevent a, CUevent b) {
  float ms = -1;
  EXPECT_CU(cuEventElapsedTime(&ms, a, b));
  return ms;
}

std::uint64_t NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

TEST_F(Realistic, BadKnobIsRefusedNamingTheVariable) {
  setenv("FAKECUDA_TIMESLICE_US", "2ms", 1);
  testing::internal::CaptureStderr();
  EXPECT_EQ(cuInit(0), CUDA_ERROR_INVALID_VALUE);
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("FAKECUDA_TIMESLICE_US='2ms'"), std::string::npos) << err;
}

TEST_F(FakeCuda, UnknownProfileIsRefused) {
  setenv("FAKECUDA_PROFILE", "fast", 1);
  testing::internal::CaptureStderr();
  EXPECT_EQ(cuInit(0), CUDA_ERROR_INVALID_VALUE);
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("FAKECUDA_PROFILE='fast': expected ideal or realistic"), std::string::npos) << err;
}

TEST_F(FakeCuda, SchedulerKnobNeedsTheRealisticProfile) {
  setenv("FAKECUDA_PROFILE", "ideal", 1);
  setenv("FAKECUDA_QUEUE_DEPTH", "8", 1);
  testing::internal::CaptureStderr();
  EXPECT_EQ(cuInit(0), CUDA_ERROR_INVALID_VALUE);
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("FAKECUDA_QUEUE_DEPTH='8': expected only with FAKECUDA_PROFILE=realistic"), std::string::npos)
      << err;
}

TEST_F(Realistic, ContextsHoldMemoryByDefault) {
  unsetenv("FAKECUDA_CONTEXT_MEMORY");
  InitWithContext();
  EXPECT_EQ(fakecuda_device_used_bytes(0), 512 * kMiB);
  EXPECT_STREQ(fakecuda_profile(), "realistic");
}

// Occupies `stream` with a 50 ms kernel on every SM and returns an event at its
// end: work queued behind it starts at one simulated instant whatever the
// wall-clock gaps between the launch calls (as long as they total under 50 ms).
CUevent Gate(CUfunction spin50ms, CUstream stream) {
  EXPECT_CU(Launch(spin50ms, stream, 4096));
  return Record(stream);
}

// True if everything submitted so far arrived before `gate` completed (an
// event on an idle stream completes when recorded); otherwise the machine was
// too slow for an exact check and the caller skips.
float ArrivalAfterGate(CUevent gate) {
  CUstream idle = nullptr;
  EXPECT_CU(cuStreamCreate(&idle, CU_STREAM_NON_BLOCKING));
  CUevent now = Record(idle);
  EXPECT_CU(cuEventSynchronize(gate));
  return Ms(gate, now);
}
#define SKIP_IF_LATE(gate)                                  \
  if (float late_ms = ArrivalAfterGate(gate); late_ms >= 0) \
  GTEST_SKIP() << "launches arrived " << late_ms << " ms after the 50 ms gate ended: machine too loaded"

// Two contexts with a 20 ms kernel each, released at one instant: the device
// alternates on 2 ms slices, so both end within one slice of the 40 ms mark;
// run to completion in order (the ideal profile), the first would end at 20 ms.
TEST_F(Realistic, ContextsShareTheDeviceOnTimeSlices) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  CUcontext a = nullptr, b = nullptr;
  InitWithContext(&a);
  CUfunction fa = Function("spin_20000us");
  CUfunction gate_kernel = Function("spin_50000us");
  CUstream sa = nullptr, sb = nullptr;
  ASSERT_CU(cuStreamCreate(&sa, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(cuCtxCreate(&b, nullptr, 0, 0));  // now current
  CUmodule mb = nullptr;
  ASSERT_CU(cuModuleLoadData(&mb, kImage));
  CUfunction fb = nullptr;
  ASSERT_CU(cuModuleGetFunction(&fb, mb, "spin_20000us"));
  ASSERT_CU(cuStreamCreate(&sb, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(cuCtxSetCurrent(a));
  CUevent gate = Gate(gate_kernel, sa);
  ASSERT_CU(Launch(fa, sa));
  CUevent a_end = Record(sa);
  ASSERT_CU(cuCtxSetCurrent(b));
  ASSERT_CU(cuStreamWaitEvent(sb, gate, 0));
  ASSERT_CU(Launch(fb, sb));
  CUevent b_end = Record(sb);
  SKIP_IF_LATE(gate);
  ASSERT_CU(cuStreamSynchronize(sb));
  ASSERT_CU(cuCtxSetCurrent(a));
  ASSERT_CU(cuStreamSynchronize(sa));
  float a_ms = Ms(gate, a_end);
  float b_ms = Ms(gate, b_end);
  EXPECT_NEAR(std::max(a_ms, b_ms), 40.0f, 0.01f) << "the device is never idle";
  EXPECT_GE(std::min(a_ms, b_ms), 40.0f - 2.0f - 0.01f) << "A was not preempted: a=" << a_ms << " b=" << b_ms;
}

TEST_F(Realistic, StreamsOfOneContextRunTogetherWhenTheirBlocksFit) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  setenv("FAKECUDA_SMS", "100", 1);
  InitWithContext();
  CUfunction f = Function("spin_10000us");
  CUfunction gate_kernel = Function("spin_50000us");
  CUstream s1 = nullptr, s2 = nullptr;
  ASSERT_CU(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
  // 40 + 60 blocks fit on 100 SMs: both run at once.
  CUevent start = Gate(gate_kernel, s1);
  ASSERT_CU(cuStreamWaitEvent(s2, start, 0));
  ASSERT_CU(Launch(f, s1, 40));
  ASSERT_CU(Launch(f, s2, 60));
  CUevent end1 = Record(s1);
  CUevent end2 = Record(s2);
  SKIP_IF_LATE(start);
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_NEAR(Ms(start, end1), 10.0f, 0.01f);
  EXPECT_NEAR(Ms(start, end2), 10.0f, 0.01f);
  // 60 + 60 blocks do not fit: the second waits for the first.
  CUevent again = Gate(gate_kernel, s1);
  ASSERT_CU(cuStreamWaitEvent(s2, again, 0));
  ASSERT_CU(Launch(f, s1, 60));
  ASSERT_CU(Launch(f, s2, 60));
  CUevent end3 = Record(s2);
  SKIP_IF_LATE(again);
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_NEAR(Ms(again, end3), 20.0f, 0.01f);
  // One stream keeps its order: two 40-block kernels run one after the other.
  CUevent seq0 = Gate(gate_kernel, s1);
  ASSERT_CU(Launch(f, s1, 40));
  ASSERT_CU(Launch(f, s1, 40));
  CUevent seq1 = Record(s1);
  SKIP_IF_LATE(seq0);
  ASSERT_CU(cuStreamSynchronize(s1));
  EXPECT_NEAR(Ms(seq0, seq1), 20.0f, 0.01f);
}

TEST_F(Realistic, JitterIsBoundedAndLaunchesCostDeviceTime) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  setenv("FAKECUDA_JITTER_PCT", "10", 1);
  setenv("FAKECUDA_LAUNCH_COST_US", "5", 1);
  setenv("FAKECUDA_SEED", "42", 1);
  InitWithContext();
  CUfunction f = Function("spin_1000us");
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, 0));
  std::vector<CUevent> marks{Gate(Function("spin_50000us"), s)};
  for (int i = 0; i < 20; ++i) {
    ASSERT_CU(Launch(f, s));
    marks.push_back(Record(s));
  }
  SKIP_IF_LATE(marks[0]);
  ASSERT_CU(cuStreamSynchronize(s));
  float lo = 1e9f, hi = 0, sum = 0;
  for (std::size_t i = 1; i < marks.size(); ++i) {
    float ms = Ms(marks[i - 1], marks[i]);
    lo = std::min(lo, ms);
    hi = std::max(hi, ms);
    sum += ms;
  }
  EXPECT_GE(lo, 0.9f + 0.005f - 0.001f);
  EXPECT_LE(hi, 1.1f + 0.005f + 0.001f);
  EXPECT_GT(hi - lo, 0.02f) << "run times should vary";
  EXPECT_NEAR(sum / 20, 1.005f, 0.05f);
}

// Launch cost without jitter: every kernel takes exactly its time plus the cost.
TEST_F(Realistic, LaunchCostIsExact) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  setenv("FAKECUDA_LAUNCH_COST_US", "7", 1);
  InitWithContext();
  CUfunction f = Function("spin_1000us");
  CUevent a = Gate(Function("spin_50000us"), nullptr);
  for (int i = 0; i < 4; ++i) ASSERT_CU(Launch(f, nullptr));
  CUevent b = Record(nullptr);
  SKIP_IF_LATE(a);
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_NEAR(Ms(a, b), 4 * 1.007f, 0.002f);
}

// A stream holds at most FAKECUDA_QUEUE_DEPTH pending launches; the next blocks.
TEST_F(Realistic, FullHardwareQueueBlocksTheLaunch) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  setenv("FAKECUDA_QUEUE_DEPTH", "2", 1);
  InitWithContext();
  CUfunction f = Function("spin_20000us");
  std::uint64_t t0 = NowNs();
  for (int i = 0; i < 6; ++i) ASSERT_CU(Launch(f, nullptr));
  std::uint64_t waited = NowNs() - t0;
  // The 6th launch can only enter once 4 kernels (20 ms) have run.
  EXPECT_GE(waited, 20000000ull - 100000ull);
  ASSERT_CU(cuCtxSynchronize());
}

unsigned long long RealtimeMicros() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec * 1000000ull + ts.tv_nsec / 1000;
}

// NVML samples on its own period: integer percents, one timestamp per period,
// only periods that have ended, NOT_FOUND for anything newer than the last.
TEST_F(Realistic, NvmlSamplesOnItsOwnPeriod) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  setenv("FAKECUDA_NVML_PERIOD_MS", "20", 1);
  InitWithContext();
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t device = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &device), NVML_SUCCESS);
  CUfunction f = Function("spin_10000us");
  for (int i = 0; i < 5; ++i) ASSERT_CU(Launch(f, nullptr));  // 50 ms of work
  ASSERT_CU(cuCtxSynchronize());
  struct timespec pause_for {
    0, 45000000
  };  // two more periods end
  nanosleep(&pause_for, nullptr);
  nvmlProcessUtilizationSample_t samples[64];
  unsigned count = 64;
  ASSERT_EQ(nvmlDeviceGetProcessUtilization(device, samples, &count, 0), NVML_SUCCESS);
  ASSERT_GT(count, 0u);
  unsigned long long now_us = RealtimeMicros();
  unsigned long long last = 0;
  double busy_ms = 0;
  for (unsigned i = 0; i < count; ++i) {
    EXPECT_EQ(samples[i].pid, static_cast<unsigned>(getpid()));
    EXPECT_LE(samples[i].timeStamp, now_us) << "a sample of a period that has not ended";
    EXPECT_GE(samples[i].smUtil, 1u);
    EXPECT_LE(samples[i].smUtil, 100u);
    if (last != 0) {
      EXPECT_GT(samples[i].timeStamp, last);
      EXPECT_EQ((samples[i].timeStamp - last) % 20000, 0u) << "stamps are period ends";
    }
    last = samples[i].timeStamp;
    busy_ms += samples[i].smUtil * 20.0 / 100.0;
  }
  // 50 ms of work in at most 4 periods, each rounded to a whole percent (0.1 ms).
  EXPECT_NEAR(busy_ms, 50.0, 0.5);
  unsigned again = 64;
  EXPECT_EQ(nvmlDeviceGetProcessUtilization(device, samples, &again, last), NVML_ERROR_NOT_FOUND);
  // Utilisation rates cover the last full period: a long kernel fills it.
  CUfunction g = Function("spin_20000us");
  for (int i = 0; i < 10; ++i) ASSERT_CU(Launch(g, nullptr));  // 200 ms
  nanosleep(&pause_for, nullptr);
  nvmlUtilization_t rates{};
  ASSERT_EQ(nvmlDeviceGetUtilizationRates(device, &rates), NVML_SUCCESS);
  EXPECT_EQ(rates.gpu, 100u);
  nvmlShutdown();
}

// The driver discards the queued work of a process that exits (normally or
// killed): it is never run, nor charged, and does not delay anyone else.
void ExpectQueuedWorkDropped(const char* how) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  ASSERT_CU(cuInit(0));
  Child child = Child::Spawn({how, "200000", "5"});  // 1 s of kernels, never synchronised
  int pid = std::atoi(child.ReadLine().c_str());
  ASSERT_GT(pid, 0);
  if (std::string(how) == "launchhang") {
    child.Kill();
  } else {
    ASSERT_EQ(child.Wait(), 0);
  }
  CUcontext ctx = nullptr;
  ASSERT_CU(cuCtxCreate(&ctx, nullptr, 0, 0));
  CUmodule module = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, kImage));
  CUfunction f = nullptr;
  ASSERT_CU(cuModuleGetFunction(&f, module, "spin_1000us"));
  ASSERT_CU(Launch(f, nullptr));
  ASSERT_CU(cuCtxSynchronize());
  std::uint64_t child_busy = fakecuda_busy_ns(0, pid, 0, ~0ull);
  EXPECT_LT(child_busy, 1000000000ull) << "the exited process's 1 s of kernels ran";
}

TEST_F(Realistic, QueuedWorkOfAnExitedProcessIsDropped) { ExpectQueuedWorkDropped("launchexit"); }
TEST_F(Realistic, QueuedWorkOfAKilledProcessIsDropped) { ExpectQueuedWorkDropped("launchhang"); }

}  // namespace

namespace {

// Modules hold device memory for their globals and code (realistic profile):
// what `.global` declarations in the image add up to, plus the image, rounded
// up to 64 KiB; freed with the module. Libraries likewise, on the current
// context's device. NVML's per-process figure includes it.
TEST_F(Realistic, ModulesHoldMemoryForGlobalsAndCode) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  InitWithContext();
  const std::string image =
      ".version 7.0\n.target sm_75\n.address_size 64\n"
      ".visible .global .align 8 .b8 buf[1048576];\n"
      ".global .u32 counters[16];\n"
      ".visible .entry k() { ld.global.u32 %r1, [counters]; ret; }\n";
  const unsigned long long expected = (1048576ull + 64 + image.size() + 65535) / 65536 * 65536;
  CUmodule module = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, image.c_str()));
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected);
  CUdeviceptr buf = 0, counters = 0;
  size_t size = 0;
  ASSERT_CU(cuModuleGetGlobal(&buf, &size, module, "buf"));
  EXPECT_EQ(size, 1048576u);
  ASSERT_CU(cuModuleGetGlobal(&counters, &size, module, "counters"));
  EXPECT_EQ(size, 64u);
  EXPECT_EQ(counters, buf + 1048576);
  EXPECT_EQ(cuModuleGetGlobal(&buf, &size, module, "absent"), CUDA_ERROR_NOT_FOUND);
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 2 * expected);
  ASSERT_CU(cuLibraryGetGlobal(&buf, &size, library, "buf"));
  EXPECT_EQ(size, 1048576u);
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t device = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &device), NVML_SUCCESS);
  nvmlProcessInfo_t infos[8];
  unsigned count = 8;
  ASSERT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(device, &count, infos), NVML_SUCCESS);
  ASSERT_EQ(count, 1u);
  EXPECT_EQ(infos[0].usedGpuMemory, 2 * expected);
  nvmlShutdown();
  ASSERT_CU(cuModuleUnload(module));
  ASSERT_CU(cuLibraryUnload(library));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

// The libraries of the placement tests: a 1 MiB global and one kernel; a
// copy of it in a context holds the image and the global, rounded up to 64 KiB.
constexpr char kLibraryImage[] = ".visible .global .align 8 .b8 buf[1048576];\n.visible .entry k() { ret; }\n";
constexpr unsigned long long kLibraryCopyBytes = (1048576ull + (sizeof(kLibraryImage) - 1) + 65535) / 65536 * 65536;

// A library loaded with no context current holds nothing until its first
// use in a context; a launch of one of its kernels, resolved with no context
// current (cuLibraryGetKernel) and cast to CUfunction, is such a use: the
// library is placed on the launch's device then, once.
TEST_F(Realistic, LaunchOfAnUnresolvedKernelPlacesItsLibrary) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  CUcontext ctx = nullptr;
  InitWithContext(&ctx);
  CUcontext popped = nullptr;
  ASSERT_CU(cuCtxPopCurrent(&popped));
  const std::string image = kLibraryImage;
  const unsigned long long expected = kLibraryCopyBytes;
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUkernel kernel = nullptr;
  ASSERT_CU(cuLibraryGetKernel(&kernel, library, "k"));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  ASSERT_CU(cuCtxSetCurrent(ctx));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  const auto f = reinterpret_cast<CUfunction>(kernel);
  ASSERT_CU(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected);
  ASSERT_CU(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected);
  ASSERT_CU(cuCtxSynchronize());
  ASSERT_CU(cuLibraryUnload(library));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

// NVIDIA's context-independent loading (CUDA 12, cuLibraryLoadData, lazy
// loading): a library is loaded into each context that uses it, at its first
// use there; each context's copy holds its own globals and code
// (cuLibraryGetGlobal: "for the requested library and the current context").
TEST_F(Realistic, ALibraryIsPlacedInEachContextAtItsFirstUseThere) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  CUcontext a = nullptr, b = nullptr;
  InitWithContext(&a);
  ASSERT_CU(cuCtxCreate(&b, nullptr, 0, 0));  // current: b
  CUcontext popped = nullptr;
  ASSERT_CU(cuCtxPopCurrent(&popped));
  ASSERT_CU(cuCtxPopCurrent(&popped));
  const std::string image = kLibraryImage;
  const unsigned long long expected = kLibraryCopyBytes;
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  CUdeviceptr in_a = 0, in_b = 0, again = 0;
  ASSERT_CU(cuCtxSetCurrent(a));
  ASSERT_CU(cuLibraryGetGlobal(&in_a, nullptr, library, "buf"));
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected);
  ASSERT_CU(cuLibraryGetGlobal(&again, nullptr, library, "buf"));
  EXPECT_EQ(again, in_a);
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected) << "placed once per context";
  ASSERT_CU(cuCtxSetCurrent(b));
  ASSERT_CU(cuLibraryGetGlobal(&in_b, nullptr, library, "buf"));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 2 * expected) << "b's first use loads b's own copy";
  EXPECT_NE(in_b, in_a) << "each context's copy has its own globals";
  CUkernel kernel = nullptr;
  CUfunction f = nullptr;
  ASSERT_CU(cuLibraryGetKernel(&kernel, library, "k"));
  ASSERT_CU(cuKernelGetFunction(&f, kernel));
  ASSERT_CU(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(fakecuda_device_used_bytes(0), 2 * expected);
  ASSERT_CU(cuLibraryUnload(library));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u) << "cuLibraryUnload frees every context's copy";
  ASSERT_CU(cuCtxDestroy(b));
  ASSERT_CU(cuCtxDestroy(a));
}

// A launch (or cuKernelGetFunction, cuLibraryGetModule) in a context that
// has not used the library yet is such a first use there.
TEST_F(Realistic, ALaunchInASecondContextPlacesTheLibraryThere) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  CUcontext a = nullptr, b = nullptr;
  InitWithContext(&a);
  const std::string image = kLibraryImage;
  const unsigned long long expected = kLibraryCopyBytes;
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected) << "placed in the context current at the load";
  CUkernel kernel = nullptr;
  ASSERT_CU(cuLibraryGetKernel(&kernel, library, "k"));
  ASSERT_CU(cuCtxCreate(&b, nullptr, 0, 0));  // current: b
  ASSERT_CU(cuLaunchKernel(reinterpret_cast<CUfunction>(kernel), 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(fakecuda_device_used_bytes(0), 2 * expected);
  CUcontext c = nullptr;
  ASSERT_CU(cuCtxCreate(&c, nullptr, 0, 0));  // current: c
  CUmodule module = nullptr;
  ASSERT_CU(cuLibraryGetModule(&module, library));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 3 * expected);
  CUfunction f = nullptr;
  ASSERT_CU(cuKernelGetFunction(&f, kernel));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 3 * expected);
  ASSERT_CU(cuCtxDestroy(c));
  ASSERT_CU(cuCtxDestroy(b));
  ASSERT_CU(cuLibraryUnload(library));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  ASSERT_CU(cuCtxDestroy(a));
}

// A context's copy of a library goes with the context (cuCtxDestroy,
// cuDevicePrimaryCtxReset); the library stays loaded, and its next use in a
// context loads a copy there again.
TEST_F(Realistic, AContextsCopyOfALibraryGoesWithTheContext) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  CUcontext a = nullptr, b = nullptr;
  InitWithContext(&a);
  const std::string image = kLibraryImage;
  const unsigned long long expected = kLibraryCopyBytes;
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  ASSERT_CU(cuCtxCreate(&b, nullptr, 0, 0));
  CUdeviceptr buf = 0;
  ASSERT_CU(cuLibraryGetGlobal(&buf, nullptr, library, "buf"));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 2 * expected);
  ASSERT_CU(cuCtxDestroy(b));
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected) << "b's copy went with b";
  ASSERT_CU(cuCtxSetCurrent(a));
  ASSERT_CU(cuLibraryGetGlobal(&buf, nullptr, library, "buf"));
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected) << "a's copy stays";
  ASSERT_CU(cuCtxDestroy(a));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u) << "a's copy went with a";
  CUdevice dev = 0;
  CUcontext primary = nullptr;
  ASSERT_CU(cuDevicePrimaryCtxRetain(&primary, dev));
  ASSERT_CU(cuCtxSetCurrent(primary));
  ASSERT_CU(cuLibraryGetGlobal(&buf, nullptr, library, "buf"));
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected) << "loaded again in the primary context";
  ASSERT_CU(cuDevicePrimaryCtxReset(dev));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u) << "the primary context's copy went with its reset";
  ASSERT_CU(cuDevicePrimaryCtxRetain(&primary, dev));
  ASSERT_CU(cuCtxSetCurrent(primary));
  CUkernel kernel = nullptr;
  ASSERT_CU(cuLibraryGetKernel(&kernel, library, "k"));
  ASSERT_CU(cuLaunchKernel(reinterpret_cast<CUfunction>(kernel), 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(cuCtxSynchronize());
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected) << "a launch after the reset loads it again";
  ASSERT_CU(cuLibraryUnload(library));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  ASSERT_CU(cuDevicePrimaryCtxRelease(dev));
}

// cuLibraryGetModule returns "the module handle associated with the current
// context" and a module lives as long as "the context it was loaded in"
// (cuFuncGetModule); a module's data is allocated at its load, not lazily
// (cuModuleLoad). So cuModuleGetGlobal places nothing: it answers from the
// copy the context already holds, and a context without one gets an invalid
// handle (issue 32, seed 1,131,053: a module handle gone with its context and
// recycled as a library's placed a copy at cuModuleGetGlobal, unmeasured).
TEST_F(Realistic, ModuleGetGlobalPlacesNoLibraryCopy) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  CUcontext a = nullptr, b = nullptr;
  InitWithContext(&a);
  const std::string image = kLibraryImage;
  const unsigned long long expected = kLibraryCopyBytes;
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUmodule module = nullptr;
  ASSERT_CU(cuLibraryGetModule(&module, library));
  CUdeviceptr in_a = 0, got = 0;
  ASSERT_CU(cuLibraryGetGlobal(&in_a, nullptr, library, "buf"));
  ASSERT_CU(cuModuleGetGlobal(&got, nullptr, module, "buf"));
  EXPECT_EQ(got, in_a) << "a's module answers for a's copy";
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected);
  ASSERT_CU(cuCtxCreate(&b, nullptr, 0, 0));  // current: b, no copy there
  EXPECT_EQ(cuModuleGetGlobal(&got, nullptr, module, "buf"), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected) << "nothing placed in b by a's module";
  // The seed: a module gone with its context, its handle recycled as a
  // library's (loaded with no context current, so not placed yet).
  CUcontext c = nullptr;
  ASSERT_CU(cuCtxCreate(&c, nullptr, 0, 0));
  CUmodule gone = nullptr;
  ASSERT_CU(cuModuleLoadData(&gone, image.c_str()));
  ASSERT_CU(cuCtxDestroy(c));
  for (CUcontext popped = nullptr; cuCtxPopCurrent(&popped) == CUDA_SUCCESS && popped != nullptr;) {}
  CUlibrary second = nullptr;
  ASSERT_CU(cuLibraryLoadData(&second, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  ASSERT_CU(cuCtxSetCurrent(b));
  EXPECT_NE(cuModuleGetGlobal(&got, nullptr, gone, "buf"), CUDA_SUCCESS);
  EXPECT_EQ(fakecuda_device_used_bytes(0), expected) << "a stale module handle places nothing";
  ASSERT_CU(cuLibraryUnload(second));
  ASSERT_CU(cuLibraryUnload(library));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  ASSERT_CU(cuCtxDestroy(b));
  ASSERT_CU(cuCtxDestroy(a));
}

// The chaos reports' holdings (fakecuda_holdings) name a library's copies by
// the CUlibrary the program holds, so that they can be matched with the
// program's records; a module by its CUmodule (issue 32, seed 1,120,703: the
// report named the library's inner module, a pointer no program knows).
TEST_F(Realistic, HoldingsNameALibraryByItsHandle) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  InitWithContext();
  const std::string image = kLibraryImage;
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUmodule module = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, image.c_str()));
  char text[2048];
  fakecuda_holdings(text, sizeof(text));
  char lib_line[64], mod_line[64];
  std::snprintf(lib_line, sizeof(lib_line), "    library %p held ", static_cast<void*>(library));
  std::snprintf(mod_line, sizeof(mod_line), "    module %p held ", static_cast<void*>(module));
  EXPECT_NE(std::strstr(text, lib_line), nullptr) << text;
  EXPECT_NE(std::strstr(text, mod_line), nullptr) << text;
  ASSERT_CU(cuModuleUnload(module));
  ASSERT_CU(cuLibraryUnload(library));
}

TEST_F(FakeCuda, IdealModulesHoldNoMemory) {
  unsetenv("FAKECUDA_PROFILE");
  unsetenv("FAKECUDA_MODULE_MEMORY");
  InitWithContext();
  CUmodule module = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, ".global .b8 buf[1048576];\n.entry noop\n"));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  EXPECT_STREQ(fakecuda_profile(), "ideal");
  CUdeviceptr buf = 0;
  size_t size = 0;
  ASSERT_CU(cuModuleGetGlobal(&buf, &size, module, "buf"));
  EXPECT_EQ(size, 1048576u);
}

}  // namespace

namespace {

// Two processes with 200 ms of kernels each: while both have work, the device
// alternates between them, each charged only for the slices it ran (about half
// of the time each), and the device's busy time is never counted twice.
// The test queries that read the schedule (fakecuda_query.h): the kernels
// still pending (a process's own left out on request), the device time they
// still owe, and the busy intervals of the timeline with their process.
TEST_F(Realistic, PendingKernelsAndBusySegmentsReadTheSchedule) {
  InitWithContext();
  CUfunction gate_kernel = Function("spin_50000us");
  CUfunction f = Function("spin_5000us");
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const std::uint64_t t0 = NowNs();
  CUevent gate = Gate(gate_kernel, s);
  ASSERT_CU(Launch(f, s));
  ASSERT_CU(Launch(f, s));
  const std::uint64_t pending = fakecuda_pending_kernels(0, 0);
  const std::uint64_t owed = fakecuda_pending_ns(0);
  const std::uint64_t others = fakecuda_pending_kernels(0, static_cast<int>(getpid()));
  SKIP_IF_LATE(gate);
  EXPECT_EQ(pending, 3u) << "the gate and two launches";
  EXPECT_EQ(others, 0u) << "all of them this process's";
  EXPECT_GT(owed, 10'000'000u);
  EXPECT_LE(owed, 60'000'000u);
  ASSERT_CU(cuStreamSynchronize(s));
  EXPECT_EQ(fakecuda_pending_kernels(0, 0), 0u);
  EXPECT_EQ(fakecuda_pending_ns(0), 0u);
  std::uint64_t seg[3 * 16] = {};
  const std::size_t n = fakecuda_busy_segments(0, t0, NowNs(), seg, 16);
  ASSERT_GE(n, 1u);
  ASSERT_LE(n, 16u);
  std::uint64_t busy = 0;
  for (std::size_t k = 0; k < n; ++k) {
    EXPECT_EQ(seg[3 * k + 2], static_cast<std::uint64_t>(getpid()));
    EXPECT_LT(seg[3 * k], seg[3 * k + 1]);
    busy += seg[3 * k + 1] - seg[3 * k];
  }
  EXPECT_EQ(busy, 60'000'000u) << "the gate's 50 ms and two 5 ms kernels, nothing else";
}

// cuEventSynchronize on an event created with CU_EVENT_BLOCKING_SYNC blocks
// (cuEventCreate's documentation): the thread sleeps, it never spins; the
// default event's short waits do (sched_yield), as the driver's default
// synchronisation may. Before, both spun for the last 200 us of the wait.
TEST_F(Realistic, ABlockingSyncEventIsWaitedForAsleep) {
  InitWithContext();
  CUfunction f = Function("spin_1000us");
  CUstream s = nullptr;
  ASSERT_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent blocking = nullptr, spinning = nullptr;
  ASSERT_CU(cuEventCreate(&blocking, CU_EVENT_BLOCKING_SYNC));
  ASSERT_CU(cuEventCreate(&spinning, CU_EVENT_DEFAULT));
  ASSERT_CU(Launch(f, s));  // the first wait of a process is never short enough to spin: not measured
  ASSERT_CU(cuStreamSynchronize(s));
  ASSERT_CU(Launch(f, s));
  ASSERT_CU(cuEventRecord(spinning, s));
  g_yields.store(0);
  ASSERT_CU(cuEventSynchronize(spinning));
  const long default_yields = g_yields.load();
  ASSERT_CU(Launch(f, s));
  ASSERT_CU(cuEventRecord(blocking, s));
  g_yields.store(0);
  ASSERT_CU(cuEventSynchronize(blocking));
  const long blocking_yields = g_yields.load();
  EXPECT_EQ(cuEventQuery(blocking), CUDA_SUCCESS);
  EXPECT_EQ(blocking_yields, 0) << "a blocking-sync event's wait spun";
  std::printf("yields: blocking %ld, default %ld\n", blocking_yields, default_yields);
  if (default_yields == 0) GTEST_SKIP() << "the default event's wait slept past the kernel's end (loaded machine)";
}

TEST_F(Realistic, ProcessesAreChargedForTheSlicesTheyRan) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "0", 1);
  ASSERT_CU(cuInit(0));
  Child a = Child::Spawn({"spin", "20000", "10"});
  Child b = Child::Spawn({"spin", "20000", "10"});
  unsigned long long pid[2] = {}, start[2] = {}, end[2] = {};
  Child* children[2] = {&a, &b};
  for (int i = 0; i < 2; ++i) {
    std::string line = children[i]->ReadLine();
    ASSERT_EQ(std::sscanf(line.c_str(), "%llu %llu %llu", &pid[i], &start[i], &end[i]), 3) << line;
  }
  EXPECT_EQ(a.Wait(), 0);
  EXPECT_EQ(b.Wait(), 0);
  for (int i = 0; i < 2; ++i) {
    std::uint64_t total = fakecuda_busy_ns(0, static_cast<int>(pid[i]), 0, ~0ull);
    EXPECT_NEAR(static_cast<double>(total), 200e6, 1e3) << "each process ran exactly its own work";
  }
  const std::uint64_t first = std::min(start[0], start[1]);
  const std::uint64_t last = std::max(end[0], end[1]);
  EXPECT_LE(fakecuda_busy_ns(0, 0, first, last), last - first) << "busy time counted twice";
  // Both were submitting and waiting in [max start, min end]: there they share.
  const std::uint64_t lo = std::max(start[0], start[1]) + 5000000;
  const std::uint64_t hi = std::min(end[0], end[1]) - 5000000;
  if (hi < lo + 50000000) GTEST_SKIP() << "the two processes overlapped less than 50 ms (loaded machine)";
  for (int i = 0; i < 2; ++i) {
    double share = static_cast<double>(fakecuda_busy_ns(0, static_cast<int>(pid[i]), lo, hi)) / (hi - lo);
    EXPECT_NEAR(share, 0.5, 0.1) << "process " << i;
  }
}

}  // namespace
