// spinload: saturates a (simulated) device through one chosen launch path for
// a given time, then exits. A well-behaved saturating client: it keeps at most
// --inflight-ms of its own work queued (two batches, each closed by an event)
// so that the device never idles on its account; --inflight-ms 0 never waits
// (a deep-queue client, for the queue-bound test).
//
//   spinload [--path kernel|kernel_ptsz|ex|ex_ptsz|coop|coop_ptsz|graph|graph_ptsz]
//            [--via symbol|procaddr] [--kernel-us N] [--seconds S] [--inflight-ms M]
//            [--graph-kernels K] [--grid G] [--device D] [--threads T]
//
// Prints one line: "spinload pid=<pid> start_ns=<first launch, CLOCK_MONOTONIC>
// end_ns=<last launch> launches=<kernels> errors=<failed calls>".
#include <cuda.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Args {
  std::string path = "kernel";
  std::string via = "symbol";
  unsigned kernel_us = 1000;
  double seconds = 5.0;
  double inflight_ms = 10.0;
  unsigned graph_kernels = 10;
  unsigned grid = 1;
  int device = 0;
  unsigned threads = 1;
};

using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    CUstream, void**, void**);
using LaunchExFn = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using LaunchCoopFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  CUstream, void**);
using GraphLaunchFn = CUresult (*)(CUgraphExec, CUstream);
using InstantiateFn = CUresult (*)(CUgraphExec*, CUgraph, unsigned long long);

struct Api {
  LaunchKernelFn kernel = nullptr;
  LaunchExFn ex = nullptr;
  LaunchCoopFn coop = nullptr;
  GraphLaunchFn graph = nullptr;
  InstantiateFn instantiate = nullptr;
};

std::uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

[[noreturn]] void die(const char* what, CUresult rc) {
  std::fprintf(stderr, "spinload: %s failed: %d\n", what, static_cast<int>(rc));
  std::exit(2);
}
void check(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) die(what, rc);
}

bool per_thread(const Args& a) { return a.path.size() > 5 && a.path.compare(a.path.size() - 5, 5, "_ptsz") == 0; }
std::string base_path(const Args& a) { return per_thread(a) ? a.path.substr(0, a.path.size() - 5) : a.path; }

template <class T>
void proc(const char* name, bool ptds, T* out) {
  void* p = nullptr;
  CUdriverProcAddressQueryResult status{};
  const cuuint64_t flags = ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
  check(cuGetProcAddress_v2(name, &p, 13000, flags, &status), name);
  if (p == nullptr || status != CU_GET_PROC_ADDRESS_SUCCESS) die(name, CUDA_ERROR_NOT_FOUND);
  *out = reinterpret_cast<T>(p);
}

Api resolve(const Args& a) {
  Api api;
  const bool ptds = per_thread(a);
  if (a.via == "procaddr") {
    proc("cuLaunchKernel", ptds, &api.kernel);
    proc("cuLaunchKernelEx", ptds, &api.ex);
    proc("cuLaunchCooperativeKernel", ptds, &api.coop);
    proc("cuGraphLaunch", ptds, &api.graph);
    proc("cuGraphInstantiate", ptds, &api.instantiate);
    return api;
  }
  api.kernel = ptds ? cuLaunchKernel_ptsz : cuLaunchKernel;
  api.ex = ptds ? cuLaunchKernelEx_ptsz : cuLaunchKernelEx;
  api.coop = ptds ? cuLaunchCooperativeKernel_ptsz : cuLaunchCooperativeKernel;
  api.graph = ptds ? cuGraphLaunch_ptsz : cuGraphLaunch;
  api.instantiate = cuGraphInstantiateWithFlags;
  return api;
}

struct Totals {
  std::atomic<std::uint64_t> launches{0};
  std::atomic<std::uint64_t> errors{0};
  std::atomic<std::uint64_t> start{~0ull};
  std::atomic<std::uint64_t> end{0};
};

void worker(const Args& a, const Api& api, CUcontext ctx, CUfunction f, Totals* totals) {
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  const bool ptds = per_thread(a);
  const std::string kind = base_path(a);
  CUstream stream = nullptr;
  check(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  // Launches go to the per-thread default stream for _ptsz paths (null stream
  // + per-thread semantics), to our own stream otherwise.
  CUstream launch_stream = ptds && kind != "graph" ? nullptr : stream;
  CUstream event_stream = ptds && kind != "graph" ? CU_STREAM_PER_THREAD : stream;

  CUgraphExec exec = nullptr;
  unsigned per_unit = 1;
  if (kind == "graph") {
    // A graph made by stream capture, relaunched in a loop.
    check(cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
    for (unsigned i = 0; i < a.graph_kernels; ++i)
      check(api.kernel(f, a.grid, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr), "capture launch");
    CUgraph graph = nullptr;
    check(cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
    check(api.instantiate(&exec, graph, 0), "cuGraphInstantiate");
    per_unit = a.graph_kernels;
  }
  CUlaunchConfig config{};
  config.gridDimX = a.grid;
  config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = 32;
  config.blockDimY = config.blockDimZ = 1;
  config.hStream = launch_stream;

  const double unit_us = static_cast<double>(a.kernel_us) * per_unit;
  unsigned batch = 1;
  if (a.inflight_ms > 0) {
    const double b = a.inflight_ms * 1000.0 / 2.0 / unit_us;
    batch = b < 1 ? 1 : static_cast<unsigned>(b);
  }
  CUevent events[2];
  check(cuEventCreate(&events[0], CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  check(cuEventCreate(&events[1], CU_EVENT_DISABLE_TIMING), "cuEventCreate");

  const std::uint64_t start = now_ns();
  const std::uint64_t stop = start + static_cast<std::uint64_t>(a.seconds * 1e9);
  std::uint64_t cur = totals->start.load();
  while (start < cur && !totals->start.compare_exchange_weak(cur, start)) {}
  std::uint64_t launches = 0, errors = 0, batches = 0;
  unsigned in_batch = 0;
  while (now_ns() < stop) {
    CUresult rc;
    if (kind == "kernel") {
      rc = api.kernel(f, a.grid, 1, 1, 32, 1, 1, 0, launch_stream, nullptr, nullptr);
    } else if (kind == "ex") {
      rc = api.ex(&config, f, nullptr, nullptr);
    } else if (kind == "coop") {
      rc = api.coop(f, a.grid, 1, 1, 32, 1, 1, 0, launch_stream, nullptr);
    } else {
      rc = api.graph(exec, stream);
    }
    if (rc != CUDA_SUCCESS) {
      ++errors;
      continue;
    }
    launches += per_unit;
    if (a.inflight_ms > 0 && ++in_batch >= batch) {
      in_batch = 0;
      check(cuEventRecord(events[batches % 2], event_stream), "cuEventRecord");
      ++batches;
      if (batches >= 2) check(cuEventSynchronize(events[batches % 2]), "cuEventSynchronize");
    }
  }
  const std::uint64_t end = now_ns();
  totals->launches += launches;
  totals->errors += errors;
  std::uint64_t e = totals->end.load();
  while (end > e && !totals->end.compare_exchange_weak(e, end)) {}
}

bool parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (i + 1 >= argc) return false;
    const char* v = argv[++i];
    if (k == "--path")
      a->path = v;
    else if (k == "--via")
      a->via = v;
    else if (k == "--kernel-us")
      a->kernel_us = static_cast<unsigned>(std::strtoul(v, nullptr, 10));
    else if (k == "--seconds")
      a->seconds = std::strtod(v, nullptr);
    else if (k == "--inflight-ms")
      a->inflight_ms = std::strtod(v, nullptr);
    else if (k == "--graph-kernels")
      a->graph_kernels = static_cast<unsigned>(std::strtoul(v, nullptr, 10));
    else if (k == "--grid")
      a->grid = static_cast<unsigned>(std::strtoul(v, nullptr, 10));
    else if (k == "--device")
      a->device = std::atoi(v);
    else if (k == "--threads")
      a->threads = static_cast<unsigned>(std::strtoul(v, nullptr, 10));
    else
      return false;
  }
  const std::string b = base_path(*a);
  return (b == "kernel" || b == "ex" || b == "coop" || b == "graph") && (a->via == "symbol" || a->via == "procaddr") &&
         a->kernel_us > 0 && a->threads > 0 && a->graph_kernels > 0 && a->grid > 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: spinload [--path kernel|kernel_ptsz|ex|ex_ptsz|coop|coop_ptsz|graph|graph_ptsz] "
                 "[--via symbol|procaddr] [--kernel-us N] [--seconds S] [--inflight-ms M] [--graph-kernels K] "
                 "[--grid G] [--device D] [--threads T]\n");
    return 2;
  }
  check(cuInit(0), "cuInit");
  const Api api = resolve(a);
  CUdevice dev = 0;
  check(cuDeviceGet(&dev, a.device), "cuDeviceGet");
  CUcontext ctx = nullptr;
  check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  const std::string name = "spin_" + std::to_string(a.kernel_us) + "us";
  CUmodule module = nullptr;
  check(cuModuleLoadData(&module, name.c_str()), "cuModuleLoadData");
  CUfunction f = nullptr;
  check(cuModuleGetFunction(&f, module, name.c_str()), "cuModuleGetFunction");

  Totals totals;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < a.threads; ++t) threads.emplace_back(worker, std::cref(a), std::cref(api), ctx, f, &totals);
  for (auto& t : threads) t.join();
  std::printf("spinload pid=%d start_ns=%llu end_ns=%llu launches=%llu errors=%llu\n", static_cast<int>(getpid()),
              static_cast<unsigned long long>(totals.start.load()), static_cast<unsigned long long>(totals.end.load()),
              static_cast<unsigned long long>(totals.launches.load()),
              static_cast<unsigned long long>(totals.errors.load()));
  std::fflush(stdout);
  return totals.errors.load() == 0 ? 0 : 1;
}
