#include "fixture.h"

#include <dlfcn.h>

#include <time.h>

#include <chrono>
#include <stdexcept>

namespace gpuslice::microbench {

namespace {

void* open(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error("dlopen " + path + ": " + (why != nullptr ? why : "?"));
  }
  return handle;
}

template <class Fn>
void take(void* handle, const char* symbol, Fn& out) {
  out = reinterpret_cast<Fn>(dlsym(handle, symbol));
  if (out == nullptr) throw std::runtime_error(std::string("missing symbol ") + symbol);
}

// Raw (versioned) symbol names: what the driver and the library both export.
void take_calls(void* handle, Calls& c) {
  take(handle, "cuInit", c.init);
  take(handle, "cuLaunchKernel", c.launch);
  take(handle, "cuLaunchKernelEx", c.launch_ex);
  take(handle, "cuGraphLaunch", c.graph_launch);
  take(handle, "cuMemAlloc_v2", c.alloc);
  take(handle, "cuMemFree_v2", c.free);
  take(handle, "cuMemAllocAsync", c.alloc_async);
  take(handle, "cuMemFreeAsync", c.free_async);
  take(handle, "cuMemGetInfo_v2", c.get_info);
  take(handle, "cuGetProcAddress_v2", c.get_proc_address);
}

void check(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) throw std::runtime_error(std::string(what) + " failed: CUresult " + std::to_string(rc));
}

// The simulated driver goes by the names (spin_50us = 50 us of device time);
// a real GPU runs the bodies: spin_50us waits 50 us on %globaltimer.
constexpr const char* kPtx =
    ".version 7.0\n.target sm_50\n.address_size 64\n"
    ".visible .entry empty()\n{\n  ret;\n}\n"
    ".visible .entry spin_50us()\n{\n"
    "  .reg .pred %p<2>;\n  .reg .b64 %rd<4>;\n"
    "  mov.u64 %rd1, %globaltimer;\n  add.u64 %rd2, %rd1, 50000;\n"
    "$Lspin:\n  mov.u64 %rd3, %globaltimer;\n  setp.lt.u64 %p1, %rd3, %rd2;\n  @%p1 bra $Lspin;\n"
    "  ret;\n}\n";

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

void setup_fixture(Fixture& f, const std::string& driver_path, const std::string& library_path) {
  void* driver = open(driver_path);
  take_calls(driver, f.native);
  void* library = open(library_path);
  take_calls(library, f.wrapped);
  if (f.wrapped.launch == f.native.launch) throw std::runtime_error("the library's cuLaunchKernel is the driver's");

  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) retain = nullptr;
  decltype(&::cuModuleLoadData) load = nullptr;
  decltype(&::cuModuleGetFunction) get_function = nullptr;
  decltype(&::cuStreamCreate) stream_create = nullptr;
  decltype(&::cuStreamBeginCapture) begin_capture = nullptr;
  decltype(&::cuStreamEndCapture) end_capture = nullptr;
  decltype(&::cuGraphInstantiateWithFlags) instantiate = nullptr;
  take(driver, "cuDeviceGet", device_get);
  take(driver, "cuDevicePrimaryCtxRetain", retain);
  take(driver, "cuModuleLoadData", load);
  take(driver, "cuModuleGetFunction", get_function);
  take(driver, "cuStreamCreate", stream_create);
  take(driver, "cuStreamBeginCapture_v2", begin_capture);
  take(driver, "cuStreamEndCapture", end_capture);
  take(driver, "cuGraphInstantiateWithFlags", instantiate);
  take(driver, "cuCtxSetCurrent", f.set_current);
  take(driver, "cuStreamSynchronize", f.stream_synchronize);

  // Through the wrapper: this is where the library bootstraps (options,
  // region, slot), failing closed if its configuration is bad.
  check(f.wrapped.init(0), "cuInit through libgpuslice.so");
  CUdevice device = 0;
  check(device_get(&device, 0), "cuDeviceGet");
  check(retain(&f.ctx, device), "cuDevicePrimaryCtxRetain");
  check(f.set_current(f.ctx), "cuCtxSetCurrent");
  CUmodule module = nullptr;
  check(load(&module, kPtx), "cuModuleLoadData");
  check(get_function(&f.empty, module, "empty"), "cuModuleGetFunction");
  check(get_function(&f.spin, module, "spin_50us"), "cuModuleGetFunction");
  // One stream (and graph) per benchmark thread, plus one for the calibration load.
  for (int i = 0; i <= kMaxThreads; ++i) {
    CUstream stream = nullptr;
    check(stream_create(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    f.streams.push_back(stream);
    // A graph of one empty kernel, captured as applications capture them.
    check(begin_capture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
    check(f.native.launch(f.empty, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr), "cuLaunchKernel (capture)");
    CUgraph graph = nullptr;
    check(end_capture(stream, &graph), "cuStreamEndCapture");
    CUgraphExec exec = nullptr;
    check(instantiate(&exec, graph, 0), "cuGraphInstantiateWithFlags");
    f.graphs.push_back(exec);
  }
  std::size_t free_bytes = 0;
  check(f.native.get_info(&free_bytes, &f.total_native), "cuMemGetInfo");
  check(f.wrapped.get_info(&free_bytes, &f.quota_seen), "cuMemGetInfo through libgpuslice.so");
}

double start_calibration_load(Fixture& f, double warmup_s) {
  f.stop_load.store(false);
  f.load = std::thread([&f] {
    f.set_current(f.ctx);
    CUstream stream = f.streams.back();
    while (!f.stop_load.load(std::memory_order_relaxed)) {
      f.native.launch(f.spin, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr);
      const timespec pause{0, 2'000'000};
      nanosleep(&pause, nullptr);
    }
  });
  CUstream stream = f.streams.front();
  const double until = now_s() + warmup_s;
  while (now_s() < until) {
    for (int i = 0; i < 1000; ++i) f.wrapped.launch(f.empty, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr);
  }
  constexpr int kProbe = 20000;
  const double t0 = now_s();
  for (int i = 0; i < kProbe; ++i) f.wrapped.launch(f.empty, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr);
  return (now_s() - t0) * 1e9 / kProbe;
}

void stop_calibration_load(Fixture& f) {
  f.stop_load.store(true);
  if (f.load.joinable()) f.load.join();
}

}  // namespace gpuslice::microbench
