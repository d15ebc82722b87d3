// gpuslice-probe implicit: memory the driver takes without an allocation call
// (contexts, modules, lazily placed libraries) under the preload library, for
// test/hardening/implicit_memory_test.cc. Links the simulated driver
// directly, as an application links libcuda. Each scenario prints
// "key=value" lines (counted = cuMemGetInfo's total - free; held =
// fakecuda_process_used_bytes) and exits 0, or 2 when a setup call failed.
//
//   measure-vs-release MEASURED KIND ROUNDS
//       the main thread creates a context (MEASURED=ctx) or loads a module
//       with a 64 MiB global (MEASURED=module), compares the count with what
//       the device holds (the other thread paused), and undoes it, ROUNDS
//       times; meanwhile another thread releases device memory by KIND:
//       ctx-destroy, primary-release, sync-trim, pool-trim, module-unload,
//       library-unload, array-reclaim (an array creation that trims the
//       process's idle pool reserve before gpuslice refuses it)
//   set-limit MIB
//       cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, MIB) in a created context,
//       then the context destroyed
//   lazy-library MIB HOW
//       a library with a MIB global loaded with no context current, then
//       placed by its first use: HOW = global (cuLibraryGetGlobal),
//       kernel (cuLibraryGetKernel + cuKernelGetFunction), or a launch of a
//       kernel resolved with no context current (cuLibraryGetKernel) cast to
//       CUfunction: launch (cuLaunchKernel, NULL stream), launch-ex
//       (cuLaunchKernelEx, a stream), launch-stream (cuLaunchKernel into a
//       stream of the context, none current in the thread); or a graph
//       kernel node naming it: graph (as func), graph-kern (as kern, func
//       NULL), the graph instantiated and launched into a stream
//   library-per-context MIB HOW
//       a library with a MIB global loaded with no context current, placed
//       (cuLibraryGetGlobal) in the primary context and in a second one,
//       then the second one goes: HOW = destroy (a created context,
//       cuCtxDestroy), reset (the primary context is the second one: first
//       placed in a created context, then cuDevicePrimaryCtxReset); the
//       library is then used again in the context that stays, in a new
//       context (the handle may come back), and unloaded. Prints counted and
//       held after each step
//   module-load MIB
//       cuModuleLoadData of an image with a MIB global in the primary
//       context; prints rc, counted and held after it
//   reset-vs-place ROUNDS
//       another thread resets the primary context (current in the main
//       thread) and retains it again while the main thread places a lazily
//       loaded library with cuLibraryGetGlobal; run with a sleep at
//       cuLibraryGetGlobal's entry so the context comes back inside the call.
//       Prints the rounds whose placement succeeded (placed) and those that
//       left the count below the device (shorts)
//   unload-vs-reuse ROUNDS
//       thread A unloads a placed library while thread B, as soon as the
//       device usage drops, loads another one lazily (the driver hands it the
//       handle A's library had) and places it with cuLibraryGetGlobal; run
//       with FAKECUDA_CHAOS_CALLS=cuLibraryUnload and sleeps, so that A is
//       still inside cuLibraryUnload (after the driver released the handle)
//       meanwhile. Prints the rounds in which B reused the handle while A was
//       in the call (hits) and those that left the count below the device
//       (shorts)
//   double-unload ROUNDS
//       two threads unload the same placed library at once (one of them is
//       refused: CUDA_ERROR_INVALID_HANDLE), then a library loaded lazily
//       gets the handle back and is placed: prints the rounds that left the
//       count below the device (shorts)
//   shortcut-vs-drop ROUNDS HOW
//       a library placed (and counted) in the primary context, used again
//       there with cuLibraryGetGlobal (the "placed already" shortcut) while
//       another thread drops the primary context and retains it again (the
//       same handle): HOW = reset (cuDevicePrimaryCtxReset) or release (the
//       last cuDevicePrimaryCtxRelease) or reset-at-load (a reset, the
//       library placed and counted by its load: a context current at the
//       "lazy" load, as in the torture worker); run with a sleep at
//       cuLibraryGetGlobal's entry so that the drop lands inside the use.
//       HOW = kernel: no second thread; a kernel resolved
//       (cuKernelGetFunction) in the primary context, which is reset and
//       retained again, then resolved again (the thread's last resolved
//       kernel in the same context handle). Prints the rounds that left the
//       count below the device (shorts)
//   dead-handle-place ROUNDS
//       a lazily loaded library unloaded before its first use, then
//       cuLibraryGetGlobal on its handle (CUDA_ERROR_INVALID_HANDLE: no
//       library has it) while another thread's graphics API allocates 1 MiB
//       (run with a sleep at cuLibraryGetGlobal's entry: NVML's usage grows
//       inside the measured call), freed after; then a library loaded lazily
//       gets the handle back and is placed. Prints the rounds in which the
//       handle came back (reused) and those that left the count below the
//       device (shorts)
//   array-level-reuse MIB MIPMAPS ROUNDS
//       a MIB array in a created context and MIPMAPS mipmapped arrays (no
//       level asked yet) in the primary one; the created context destroyed,
//       its sweep asking about the array and the mipmapped arrays, ROUNDS
//       times. Prints the rounds in which a level 0 had the dead array's
//       handle (reused) and those that left the count above the device
//       (overs, the largest: max_over)
#include <cuda.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "fakecuda_query.h"
#include "probe.h"

namespace gpuslice::probe::implicit {

// A library loaded with no context current, so that the driver places it
// only at its first use (CUDA 12.2+ default); `home` is current again after.
CUlibrary load_lazily(const std::string& image, CUcontext home) {
  CUcontext none = nullptr;
  check(cuCtxPopCurrent(&none), "cuCtxPopCurrent");
  CUlibrary lib = nullptr;
  check(cuLibraryLoadData(&lib, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0), "cuLibraryLoadData");
  check(cuCtxSetCurrent(home), "cuCtxSetCurrent");
  return lib;
}

// Places a lazily loaded library in the current context: its first use.
void place(CUlibrary lib) {
  CUdeviceptr p = 0;
  size_t size = 0;
  check(cuLibraryGetGlobal(&p, &size, lib, "big"), "cuLibraryGetGlobal");
}

// One release of device memory of `kind` by the churn thread, undone before it returns.
void release_once(const std::string& kind, CUcontext home, CUstream stream, CUmemoryPool pool,
                  const std::string& image) {
  // Several at once, then released back to back: more releases fall inside
  // the main thread's measurement.
  if (kind == "ctx-destroy") {
    CUcontext c[4] = {};
    for (CUcontext& x : c) cuCtxCreate(&x, nullptr, 0, 0);
    for (CUcontext x : c)
      if (x != nullptr) cuCtxDestroy(x);
    cuCtxSetCurrent(home);
  } else if (kind == "primary-release") {
    CUcontext c = nullptr;
    if (cuDevicePrimaryCtxRetain(&c, 0) == CUDA_SUCCESS) cuDevicePrimaryCtxRelease(0);
  } else if (kind == "sync-trim") {
    CUdeviceptr p = 0;
    if (cuMemAllocAsync(&p, 64 * kMi, stream) == CUDA_SUCCESS) cuMemFreeAsync(p, stream);
    cuStreamSynchronize(stream);  // trims the pool to its threshold (0)
  } else if (kind == "pool-trim") {
    CUdeviceptr p = 0;
    if (cuMemAllocFromPoolAsync(&p, 64 * kMi, pool, stream) == CUDA_SUCCESS) cuMemFreeAsync(p, stream);
    cuMemPoolTrimTo(pool, 0);
  } else if (kind == "module-unload") {
    CUmodule m[4] = {};
    for (CUmodule& x : m) cuModuleLoadData(&x, image.c_str());
    for (CUmodule x : m)
      if (x != nullptr) cuModuleUnload(x);
  } else if (kind == "array-reclaim") {
    // The pool keeps 64 MiB idle (threshold: everything); an array too big
    // for what is left of the quota makes gpuslice trim this process's
    // pools before it refuses (reserve()'s reclaim): a release inside an
    // array creation.
    CUdeviceptr p = 0;
    if (cuMemAllocFromPoolAsync(&p, 64 * kMi, pool, stream) == CUDA_SUCCESS) cuMemFreeAsync(p, stream);
    cuStreamSynchronize(stream);
    CUDA_ARRAY3D_DESCRIPTOR d{};
    d.Width = 16384;
    d.Height = 7200;  // 1,800 MiB of float4: beyond the 2 GiB quota with the home context
    d.Format = CU_AD_FORMAT_FLOAT;
    d.NumChannels = 4;
    CUarray a = nullptr;
    if (cuArray3DCreate(&a, &d) == CUDA_SUCCESS) cuArrayDestroy(a);
  } else if (kind == "library-unload") {
    CUlibrary l[4] = {};
    for (CUlibrary& x : l) cuLibraryLoadData(&x, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0);
    for (CUlibrary x : l)
      if (x != nullptr) cuLibraryUnload(x);
  }
}

int measure_vs_release(const std::string& measured, const std::string& kind, int rounds) {
  // Not the primary context: "primary-release" must destroy it each time.
  CUcontext home = nullptr;
  check(cuCtxCreate(&home, nullptr, 0, 0), "cuCtxCreate");
  const CUstream stream = new_stream();
  const CUmemoryPool pool = new_pool(0, ~std::uint64_t{0});  // keeps everything until trimmed
  const std::string churn_image = image_with_global(96 * kMi);
  const std::string image = image_with_global(64 * kMi);

  Churn churn(home, [&] { release_once(kind, home, stream, pool, churn_image); });
  Shortfall shorts;
  int mismatches = 0, refused = 0;
  for (int i = 0; i < rounds; ++i) {
    CUcontext ctx = nullptr;
    CUmodule mod = nullptr;
    CUresult rc = CUDA_SUCCESS;
    if (measured == "ctx")
      rc = cuCtxCreate(&ctx, nullptr, 0, 0);
    else
      rc = cuModuleLoadData(&mod, image.c_str());
    churn.pause();
    cuCtxSetCurrent(home);
    if (shorts.observe()) ++mismatches;
    if (rc != CUDA_SUCCESS) ++refused;
    if (ctx != nullptr) check(cuCtxDestroy(ctx), "cuCtxDestroy");
    if (mod != nullptr) check(cuModuleUnload(mod), "cuModuleUnload");
    cuCtxSetCurrent(home);
    churn.resume();
  }
  churn.stop();
  std::printf("measure-vs-release measured=%s kind=%s rounds=%d refused=%d shorts=%d max_short=%lld mismatches=%d\n",
              measured.c_str(), kind.c_str(), rounds, refused, shorts.rounds, shorts.max, mismatches);
  return 0;
}

int lazy_library(std::size_t bytes, const std::string& how) {
  const std::string image = image_with_global(bytes);
  CUlibrary lib = nullptr;
  // No context current: the driver loads the library lazily (CUDA 12.2+ default).
  check(cuLibraryLoadData(&lib, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0), "cuLibraryLoadData");
  // launch*: the kernel is resolved with no context current (nothing placed
  // yet) and launched as a CUfunction, as the CUDA 12+ runtime does.
  const bool launch = how.rfind("launch", 0) == 0 || how.rfind("graph", 0) == 0;
  CUkernel kernel = nullptr;
  if (launch) check(cuLibraryGetKernel(&kernel, lib, "k"), "cuLibraryGetKernel");
  const CUcontext ctx = use_primary(0);
  const CUstream stream = launch ? new_stream() : nullptr;
  const long long loaded = counted_used(), loaded_held = held();
  CUresult rc = CUDA_SUCCESS;
  const auto f = reinterpret_cast<CUfunction>(kernel);
  if (how == "launch") {
    rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr);
  } else if (how == "launch-ex") {
    CUlaunchConfig config{};
    config.gridDimX = config.gridDimY = config.gridDimZ = 1;
    config.blockDimX = config.blockDimY = config.blockDimZ = 1;
    config.hStream = stream;
    rc = cuLaunchKernelEx(&config, f, nullptr, nullptr);
  } else if (how == "launch-stream") {
    // Into a stream of the context, with no context current in this thread.
    CUcontext popped = nullptr;
    check(cuCtxPopCurrent(&popped), "cuCtxPopCurrent");
    rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr);
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  }
  if (how == "graph" || how == "graph-kern") {
    // A graph with one kernel node naming the kernel: as `func` (cast to
    // CUfunction) or as `kern` (func NULL), instantiated and launched.
    CUgraph graph = nullptr;
    check(cuGraphCreate(&graph, 0), "cuGraphCreate");
    CUDA_KERNEL_NODE_PARAMS params{};
    if (how == "graph")
      params.func = f;
    else
      params.kern = kernel;
    params.gridDimX = params.gridDimY = params.gridDimZ = 1;
    params.blockDimX = params.blockDimY = params.blockDimZ = 1;
    CUgraphNode node = nullptr;
    rc = cuGraphAddKernelNode(&node, graph, nullptr, 0, &params);
    CUgraphExec exec = nullptr;
    if (rc == CUDA_SUCCESS) rc = cuGraphInstantiateWithFlags(&exec, graph, 0);
    if (rc == CUDA_SUCCESS) rc = cuGraphLaunch(exec, stream);
    if (exec != nullptr) {
      cuStreamSynchronize(stream);
      cuGraphExecDestroy(exec);
    }
    cuGraphDestroy(graph);
  }
  if (launch) cuStreamSynchronize(stream);
  if (launch) {
    // nothing more: the launch placed it (or was refused)
  } else if (how == "global") {
    CUdeviceptr p = 0;
    size_t size = 0;
    rc = cuLibraryGetGlobal(&p, &size, lib, "big");
  } else {
    CUkernel k = nullptr;
    rc = cuLibraryGetKernel(&k, lib, "k");
    CUfunction f = nullptr;
    if (rc == CUDA_SUCCESS) rc = cuKernelGetFunction(&f, k);
  }
  const long long placed = counted_used(), placed_held = held();
  // A second use places nothing more.
  CUdeviceptr p = 0;
  size_t size = 0;
  const CUresult again = cuLibraryGetGlobal(&p, &size, lib, "big");
  const long long again_counted = counted_used(), again_held = held();
  cuLibraryUnload(lib);  // already unloaded when a placement was refused
  const long long unloaded = counted_used(), unloaded_held = held();
  std::printf(
      "lazy-library how=%s rc=%d again_rc=%d loaded=%lld loaded_held=%lld placed=%lld placed_held=%lld "
      "again=%lld again_held=%lld unloaded=%lld unloaded_held=%lld\n",
      how.c_str(), static_cast<int>(rc), static_cast<int>(again), loaded, loaded_held, placed, placed_held,
      again_counted, again_held, unloaded, unloaded_held);
  return 0;
}

// NVIDIA's driver loads a library into each context that uses it, and a
// context's copy goes with the context: the count follows the device.
int library_per_context(std::size_t bytes, const std::string& how) {
  const std::string image = image_with_global(bytes);
  CUlibrary lib = nullptr;
  check(cuLibraryLoadData(&lib, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0), "cuLibraryLoadData");
  CUdeviceptr p = 0;
  size_t size = 0;
  const bool reset = how == "reset";
  CUcontext created = nullptr;
  // stays: the context that is kept; goes: the second one.
  if (reset) {
    check(cuCtxCreate(&created, nullptr, 0, 0), "cuCtxCreate");
  } else {
    use_primary(0);
  }
  const CUresult first_rc = cuLibraryGetGlobal(&p, &size, lib, "big");
  const long long first = counted_used(), first_held = held();
  if (reset) {
    use_primary(0);
  } else {
    check(cuCtxCreate(&created, nullptr, 0, 0), "cuCtxCreate");
  }
  const CUresult second_rc = cuLibraryGetGlobal(&p, &size, lib, "big");
  const long long second = counted_used(), second_held = held();
  if (reset) {
    check(cuDevicePrimaryCtxReset(0), "cuDevicePrimaryCtxReset");
    check(cuCtxSetCurrent(created), "cuCtxSetCurrent");
  } else {
    check(cuCtxDestroy(created), "cuCtxDestroy");
    use_primary(0);
  }
  const long long gone = counted_used(), gone_held = held();
  const CUresult again_rc = cuLibraryGetGlobal(&p, &size, lib, "big");
  const long long again = counted_used(), again_held = held();
  // A new context (a created one's handle may come back; the primary
  // context's handle does) used again.
  CUcontext fresh = nullptr;
  if (reset) {
    use_primary(0);
  } else {
    check(cuCtxCreate(&fresh, nullptr, 0, 0), "cuCtxCreate");
  }
  const CUresult fresh_rc = cuLibraryGetGlobal(&p, &size, lib, "big");
  const long long renewed = counted_used(), renewed_held = held();
  cuLibraryUnload(lib);
  const long long unloaded = counted_used(), unloaded_held = held();
  std::printf(
      "library-per-context how=%s rc=%d,%d,%d,%d first=%lld first_held=%lld second=%lld second_held=%lld "
      "gone=%lld gone_held=%lld again=%lld again_held=%lld renewed=%lld renewed_held=%lld unloaded=%lld "
      "unloaded_held=%lld\n",
      how.c_str(), static_cast<int>(first_rc), static_cast<int>(second_rc), static_cast<int>(again_rc),
      static_cast<int>(fresh_rc), first, first_held, second, second_held, gone, gone_held, again, again_held, renewed,
      renewed_held, unloaded, unloaded_held);
  if (fresh != nullptr) cuCtxDestroy(fresh);
  if (reset && created != nullptr) cuCtxDestroy(created);
  return 0;
}

// cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, MIB) in a created context: what
// the driver reserves for the heap is counted (or the call refused over the
// quota, the previous limit kept), and released with the context.
int set_limit(std::size_t bytes) {
  CUcontext ctx = nullptr;
  check(cuCtxCreate(&ctx, nullptr, 0, 0), "cuCtxCreate");
  const long long before = counted_used(), before_held = held();
  const CUresult rc = cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, bytes);
  size_t limit = 0;
  check(cuCtxGetLimit(&limit, CU_LIMIT_MALLOC_HEAP_SIZE), "cuCtxGetLimit");
  const long long set = counted_used(), set_held = held();
  check(cuCtxDestroy(ctx), "cuCtxDestroy");
  use_primary(0);
  const long long destroyed = counted_used(), destroyed_held = held();
  std::printf(
      "set-limit rc=%d limit=%zu before=%lld before_held=%lld set=%lld set_held=%lld destroyed=%lld "
      "destroyed_held=%lld\n",
      static_cast<int>(rc), limit, before, before_held, set, set_held, destroyed, destroyed_held);
  return 0;
}

// Thread A unloads a placed library; thread B loads and places another one in
// the window where the driver has released A's handle (B gets it back) but
// A's cuLibraryUnload has not returned.
int unload_vs_reuse(int rounds) {
  const CUcontext home = use_primary(0);
  const std::string image_a = image_with_global(24 * kMi), image_b = image_with_global(40 * kMi);
  int hits = 0, reused = 0;
  Shortfall shorts;
  for (int i = 0; i < rounds; ++i) {
    const CUlibrary a = load_lazily(image_a, home);
    place(a);
    CUlibrary b = nullptr;
    const long long before = held();
    std::atomic<bool> go{false}, a_done{false};
    bool hit = false;
    std::thread tb([&] {
      while (!go.load()) std::this_thread::yield();
      while (held() >= before) std::this_thread::yield();  // A's library left the device: its handle is free
      CUcontext popped = nullptr;
      cuCtxSetCurrent(home);
      cuCtxPopCurrent(&popped);
      if (cuLibraryLoadData(&b, image_b.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0) != CUDA_SUCCESS) return;
      hit = b == a && !a_done.load();  // A's handle, A still inside cuLibraryUnload
      cuCtxSetCurrent(home);
      CUdeviceptr q = 0;
      size_t qsize = 0;
      cuLibraryGetGlobal(&q, &qsize, b, "big");
    });
    go.store(true);
    check(cuLibraryUnload(a), "cuLibraryUnload");
    a_done.store(true);
    tb.join();
    if (b == a) ++reused;
    if (hit) ++hits;
    shorts.observe();
    if (b != nullptr) cuLibraryUnload(b);
  }
  std::printf("unload-vs-reuse rounds=%d reused=%d hits=%d shorts=%d max_short=%lld\n", rounds, reused, hits,
              shorts.rounds, shorts.max);
  return 0;
}

// Two threads unload the same placed library at once; a library loaded next
// gets the handle back and is placed.
int double_unload(int rounds) {
  const CUcontext home = use_primary(0);
  const std::string image_a = image_with_global(24 * kMi), image_b = image_with_global(40 * kMi);
  int reused = 0, refused = 0;
  Shortfall shorts;
  for (int i = 0; i < rounds; ++i) {
    const CUlibrary a = load_lazily(image_a, home);
    place(a);
    CUlibrary b = nullptr;
    std::atomic<int> ready{0};
    CUresult rc[2] = {};
    std::thread t[2];
    for (int k = 0; k < 2; ++k)
      t[k] = std::thread([&, k] {
        ready.fetch_add(1);
        while (ready.load() < 2) std::this_thread::yield();
        rc[k] = cuLibraryUnload(a);
      });
    for (std::thread& x : t) x.join();
    if (rc[0] != CUDA_SUCCESS || rc[1] != CUDA_SUCCESS) ++refused;
    b = load_lazily(image_b, home);
    if (b == a) ++reused;
    place(b);
    shorts.observe();
    check(cuLibraryUnload(b), "cuLibraryUnload");
  }
  std::printf("double-unload rounds=%d refused=%d reused=%d shorts=%d max_short=%lld\n", rounds, refused, reused,
              shorts.rounds, shorts.max);
  return 0;
}

// A use of an unloaded library's handle places nothing; measured while the
// process's usage moves for another reason, it must not leave a record of
// a placement for that handle: the next library the driver gives the
// handle to would look placed already.
int dead_handle_place(int rounds) {
  const CUcontext home = use_primary(0);
  const std::string image_a = image_with_global(8 * kMi), image_b = image_with_global(40 * kMi);
  int reused = 0, invalid = 0;
  Shortfall shorts;
  for (int i = 0; i < rounds; ++i) {
    const CUlibrary a = load_lazily(image_a, home);
    check(cuLibraryUnload(a), "cuLibraryUnload");  // never placed
    std::atomic<bool> calling{false};
    std::uint64_t graphics = 0;
    std::thread g([&] {
      while (!calling.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // inside the call (its entry sleeps)
      graphics = fakecuda_graphics_alloc(0, kMi);
    });
    CUdeviceptr p = 0;
    size_t size = 0;
    calling.store(true);
    if (cuLibraryGetGlobal(&p, &size, a, "big") == CUDA_ERROR_INVALID_HANDLE) ++invalid;
    g.join();
    if (graphics != 0) fakecuda_graphics_free(graphics);
    const CUlibrary b = load_lazily(image_b, home);
    if (b == a) ++reused;
    place(b);
    shorts.observe();
    check(cuLibraryUnload(b), "cuLibraryUnload");
  }
  std::printf("dead-handle-place rounds=%d invalid=%d reused=%d shorts=%d max_short=%lld\n", rounds, invalid, reused,
              shorts.rounds, shorts.max);
  return 0;
}

int module_load(std::size_t bytes) {
  use_primary(0);
  const std::string image = image_with_global(bytes);
  CUmodule mod = nullptr;
  const CUresult rc = cuModuleLoadData(&mod, image.c_str());
  const long long c = counted_used(), h = held();
  std::printf("module-load rc=%d counted=%lld held=%lld\n", static_cast<int>(rc), c, h);
  if (rc == CUDA_SUCCESS) cuModuleUnload(mod);
  return 0;
}

int reset_vs_place(int rounds) {
  const CUcontext home = use_primary(0);
  const std::string image = image_with_global(32 * kMi);
  int placed = 0;
  Shortfall shorts;
  for (int i = 0; i < rounds; ++i) {
    const CUlibrary lib = load_lazily(image, home);
    std::atomic<int> phase{0};
    std::thread b([&] {
      cuDevicePrimaryCtxReset(0);  // the main thread's current context is gone
      phase.store(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      CUcontext again = nullptr;
      cuDevicePrimaryCtxRetain(&again, 0);  // and back, same handle
    });
    while (phase.load() == 0) std::this_thread::yield();
    CUdeviceptr p = 0;
    size_t size = 0;
    if (cuLibraryGetGlobal(&p, &size, lib, "big") == CUDA_SUCCESS) ++placed;
    b.join();
    check(cuCtxSetCurrent(home), "cuCtxSetCurrent");
    shorts.observe();
    cuLibraryUnload(lib);
  }
  std::printf("reset-vs-place rounds=%d placed=%d shorts=%d max_short=%lld\n", rounds, placed, shorts.rounds,
              shorts.max);
  return 0;
}

// A use of a library placed in the current context already goes to the
// driver unmeasured; a drop of that context inside the use (and a new one
// at the same handle) must not let the driver place it there unmeasured.
int shortcut_vs_drop(int rounds, const std::string& how) {
  const CUcontext home = use_primary(0);
  const std::string image = image_with_global(32 * kMi);
  const bool at_load = how == "reset-at-load";
  const bool reset = how == "reset" || at_load;
  int placed = 0, same = 0;
  Shortfall shorts;
  for (int i = 0; i < rounds && how == "kernel"; ++i) {
    const CUlibrary lib = load_lazily(image, home);
    CUkernel k = nullptr;
    CUfunction f = nullptr;
    check(cuLibraryGetKernel(&k, lib, "k"), "cuLibraryGetKernel");
    check(cuKernelGetFunction(&f, k), "cuKernelGetFunction");  // placed, counted; remembered by the thread
    check(cuDevicePrimaryCtxReset(0), "cuDevicePrimaryCtxReset");
    CUcontext again = nullptr;
    check(cuDevicePrimaryCtxRetain(&again, 0), "cuDevicePrimaryCtxRetain");
    if (again == home) ++same;
    check(cuCtxSetCurrent(home), "cuCtxSetCurrent");
    if (cuKernelGetFunction(&f, k) == CUDA_SUCCESS) ++placed;  // placed in the new context
    shorts.observe();
    cuLibraryUnload(lib);
  }
  for (int i = 0; i < rounds && how != "kernel"; ++i) {
    CUlibrary lib = nullptr;
    if (at_load) {
      // The torture worker's "lazy" load after its "context" class (its
      // cuCtxSetCurrent replaced the new context at the top of a two-deep
      // stack by the primary): the pop leaves the primary context current,
      // so the load places the library and is measured there.
      check(cuCtxPushCurrent(home), "cuCtxPushCurrent");
      lib = load_lazily(image, home);
    } else {
      lib = load_lazily(image, home);
      place(lib);  // measured: placed in the primary context and counted
    }
    std::atomic<bool> calling{false};
    CUcontext again = nullptr;
    std::thread b([&] {
      while (!calling.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // inside the use (its entry sleeps)
      if (reset)
        cuDevicePrimaryCtxReset(0);
      else
        cuDevicePrimaryCtxRelease(0);  // the last reference: destroyed
      cuDevicePrimaryCtxRetain(&again, 0);
    });
    CUdeviceptr p = 0;
    size_t size = 0;
    calling.store(true);
    if (cuLibraryGetGlobal(&p, &size, lib, "big") == CUDA_SUCCESS) ++placed;
    b.join();
    if (again == home) ++same;
    check(cuCtxSetCurrent(home), "cuCtxSetCurrent");
    shorts.observe();
    cuLibraryUnload(lib);
  }
  std::printf("shortcut-vs-drop how=%s rounds=%d placed=%d same=%d shorts=%d max_short=%lld\n", how.c_str(), rounds,
              placed, same, shorts.rounds, shorts.max);
  return 0;
}

// The destroy's sweep asks a live mipmapped array about its level 0 (the
// driver makes that level then) and the destroyed context's array whether
// it is still known: the level may take the dead array's handle.
int array_level_reuse(std::size_t bytes, int mipmaps, int rounds) {
  const CUcontext primary = use_primary(0);
  int reused = 0, overs = 0;
  long long max_over = 0;
  for (int round = 0; round < rounds; ++round) {
    CUcontext ctx = nullptr;
    check(cuCtxCreate(&ctx, nullptr, 0, 0), "cuCtxCreate");
    CUDA_ARRAY_DESCRIPTOR d{};
    d.Width = bytes / 4096;
    d.Height = 1024;
    d.Format = CU_AD_FORMAT_UNSIGNED_INT32;
    d.NumChannels = 1;
    CUarray array = nullptr;
    check(cuArrayCreate(&array, &d), "cuArrayCreate");
    check(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
    std::vector<CUmipmappedArray> m(static_cast<std::size_t>(mipmaps));
    CUDA_ARRAY3D_DESCRIPTOR md{};
    md.Width = 64;
    md.Height = 64;
    md.Format = CU_AD_FORMAT_UNSIGNED_INT8;
    md.NumChannels = 1;
    for (CUmipmappedArray& one : m) check(cuMipmappedArrayCreate(&one, &md, 1), "cuMipmappedArrayCreate");
    check(cuCtxDestroy(ctx), "cuCtxDestroy");
    bool hit = false;
    for (CUmipmappedArray one : m) {
      CUarray level = nullptr;
      hit |= cuMipmappedArrayGetLevel(&level, one, 0) == CUDA_SUCCESS && level == array;
    }
    reused += hit ? 1 : 0;
    const long long over = counted_used() - held();
    if (over > 0) ++overs;
    if (over > max_over) max_over = over;
    for (CUmipmappedArray one : m) check(cuMipmappedArrayDestroy(one), "cuMipmappedArrayDestroy");
  }
  std::printf("array-level-reuse rounds=%d reused=%d overs=%d max_over=%lld counted=%lld held=%lld\n", rounds, reused,
              overs, max_over, counted_used(), held());
  return 0;
}

}  // namespace gpuslice::probe::implicit
