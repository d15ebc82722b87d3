// gpuslice-probe gate: a measurement of implicit memory whose gate times out (another
// thread's counting operation stays in flight longer than measure.h's
// kDrainNs, 2 s) while that operation releases device memory inside the
// measured call and settles its count only after it, for
// test/hardening/implicit_memory_test.cc (MeasureGate.*). Runs under the
// preload library with FAKECUDA_POOL_QUERY_DELAY_US set, which delays the
// pool reconciliation after the synchronisation (the release's bookkeeping).
//
//   stuck-release MIB
//       thread B: a 96 MiB stream-ordered allocation, a 2.5 s kernel and the
//       free on one stream, then cuStreamSynchronize (in flight 2.5 s; the
//       pool is trimmed at its end, then reconciled, ~1.5 s later with
//       FAKECUDA_POOL_QUERY_DELAY_US=1500000). The main thread, 100 ms
//       after B's synchronisation began, loads a module with a MIB global
//       with cuModuleLoad from a FIFO that a third thread writes 3 s after
//       it began: the measurement's gate times out at ~2.1 s, the trim lands
//       inside the load (which returns at ~3 s), its count is settled at ~4 s. Prints rc, what gpuslice counts
//       (counted = cuMemGetInfo's total - free) and what the device holds
//       (held) once everything is quiet.
//       With `keep`, a fourth thread first allocates and frees 2 MiB, which
//       stay spare in the slot's lease (counted, not on the device) through
//       the measurement, and allocates 2 MiB again (from it) once the load
//       returned: the settle must not take the spare bytes for memory on the
//       device.
//
//   hold-cpu THREADS [drain]
//       The main thread loads a 1 MiB module from a FIFO that a writer fills
//       2 s later: the measurement's gate stays closed meanwhile. THREADS
//       threads, started into the load (below), each call cuMemAlloc (a
//       counting operation: it waits at the gate) and cuMemFree. With
//       `drain`, another thread is in cuStreamSynchronize (a counting
//       operation in flight) for the first 1.5 s of the load: the
//       measurement waits for it before it calls the driver. Prints the
//       CPU time the waiting took beside its wall time:
//       "hold-cpu rc=RC waiters=N waited_s=W waiters_cpu_s=C load_s=L
//       measurer_cpu_s=M early=E" (W and C: the sums over the waiters'
//       cuMemAlloc calls; L and M: the main thread's cuModuleLoad; E: the
//       waiters whose cuMemAlloc returned before the image was written, the
//       gate still closed). The waiters call 300 ms after the load began (at
//       200 ms at the earliest); the image is written at 2 s, and never
//       before every waiter has been in its call for 1 s (many threads start
//       slowly under a sanitizer).
#include <cuda.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "probe.h"

namespace gpuslice::probe::gate {

int stuck_release(std::size_t bytes, bool keep) {
  using clock = std::chrono::steady_clock;
  const CUcontext ctx = use_primary(0);
  const CUstream stream = new_stream();
  const CUfunction spin = module_kernel(".entry spin_2500000us\n", "spin_2500000us");
  char fifo[] = "/tmp/gpuslice-probe-gate.XXXXXX";
  if (mkdtemp(fifo) == nullptr) return 2;
  const std::string path = std::string(fifo) + "/image";
  if (mkfifo(path.c_str(), 0600) != 0) return 2;
  const std::string image = image_with_global(bytes);

  std::atomic<int> keeper_step{0};  // 1: keeping 2 MiB; 2: the load returned; 3: allocated again
  std::thread keeper;
  if (keep) {
    keeper = std::thread([&] {
      cuCtxSetCurrent(ctx);
      CUdeviceptr k = 0;
      check(cuMemAlloc(&k, 2 * kMi), "cuMemAlloc(keeper)");
      check(cuMemFree(k), "cuMemFree(keeper)");
      keeper_step.store(1);
      while (keeper_step.load() != 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      check(cuMemAlloc(&k, 2 * kMi), "cuMemAlloc(keeper, again)");
      keeper_step.store(3);
      while (keeper_step.load() != 4) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      check(cuMemFree(k), "cuMemFree(keeper, again)");
    });
    while (keeper_step.load() != 1) std::this_thread::yield();
  }
  std::atomic<bool> syncing{false};
  std::thread b([&] {
    cuCtxSetCurrent(ctx);
    CUdeviceptr p = 0;
    check(cuMemAllocAsync(&p, 96 * kMi, stream), "cuMemAllocAsync");
    check(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr), "cuLaunchKernel");
    check(cuMemFreeAsync(p, stream), "cuMemFreeAsync");
    syncing.store(true);
    check(cuStreamSynchronize(stream), "cuStreamSynchronize");  // trims the 96 MiB at ~2.5 s
  });
  while (!syncing.load()) std::this_thread::yield();
  const auto synced = clock::now();  // the kernel runs until ~2.5 s from here
  std::thread writer([&] {
    std::this_thread::sleep_until(synced + std::chrono::milliseconds(3000));
    FILE* f = std::fopen(path.c_str(), "w");  // blocks until the load opens it
    if (f == nullptr) return;
    std::fputs(image.c_str(), f);
    std::fclose(f);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CUmodule module = nullptr;
  const CUresult rc = cuModuleLoad(&module, path.c_str());
  const double load_s = std::chrono::duration<double>(clock::now() - synced).count();
  b.join();
  writer.join();
  unlink(path.c_str());
  rmdir(fifo);
  if (keep) {
    keeper_step.store(2);
    while (keeper_step.load() != 3) std::this_thread::yield();
  }
  const long long counted = counted_used(), h = held();
  if (keep) {
    keeper_step.store(4);
    keeper.join();
  }
  if (module != nullptr) check(cuModuleUnload(module), "cuModuleUnload");
  const long long unloaded = counted_used(), unloaded_held = held();
  std::printf("stuck-release rc=%d load_s=%.2f counted=%lld held=%lld unloaded=%lld unloaded_held=%lld\n",
              static_cast<int>(rc), load_s, counted, h, unloaded, unloaded_held);
  return 0;
}

namespace {

double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace

int hold_cpu(int threads, bool drain) {
  using clock = std::chrono::steady_clock;
  const CUcontext ctx = use_primary(0);
  const CUstream stream = new_stream();
  const CUfunction spin = module_kernel(".entry spin_1500000us\n", "spin_1500000us");
  char fifo[] = "/tmp/gpuslice-probe-gate.XXXXXX";
  if (mkdtemp(fifo) == nullptr) return 2;
  const std::string path = std::string(fifo) + "/image";
  if (mkfifo(path.c_str(), 0600) != 0) return 2;
  const std::string image = image_with_global(kMi);

  std::thread syncer;
  if (drain) {
    check(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr), "cuLaunchKernel");
    std::atomic<bool> syncing{false};
    syncer = std::thread([&] {
      cuCtxSetCurrent(ctx);
      syncing.store(true);
      check(cuStreamSynchronize(stream), "cuStreamSynchronize");
    });
    while (!syncing.load()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // inside its synchronisation
  }
  const auto start = clock::now();
  // Many threads start slowly (a sanitizer build): the waiters call only once
  // the load (and so the measurement) began, and the image is written 2 s
  // after the start but never before every waiter has been in its call for
  // 1 s (bounded: 30 s).
  std::atomic<bool> loading{false};
  std::atomic<int> calling{0};
  std::atomic<long long> written_ns{0};  // when the writer got the FIFO open: the load cannot end before
  std::thread writer([&] {
    while (calling.load() < threads && clock::now() < start + std::chrono::seconds(30))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::this_thread::sleep_until(
        std::max(start + std::chrono::milliseconds(2000), clock::now() + std::chrono::seconds(1)));
    FILE* f = std::fopen(path.c_str(), "w");  // blocks until the load opens it
    if (f == nullptr) return;
    written_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count());
    std::fputs(image.c_str(), f);
    std::fclose(f);
  });
  std::atomic<long long> waited_ns{0}, cpu_ns{0};
  std::vector<long long> returned_ns(static_cast<std::size_t>(threads), 0);
  std::vector<std::thread> waiters;
  for (int i = 0; i < threads; ++i) {
    waiters.emplace_back([&, i] {
      cuCtxSetCurrent(ctx);
      while (!loading.load()) std::this_thread::yield();
      std::this_thread::sleep_until(
          std::max(start + std::chrono::milliseconds(200), clock::now() + std::chrono::milliseconds(300)));
      const auto t0 = clock::now();
      const double c0 = thread_cpu_s();
      CUdeviceptr p = 0;
      calling.fetch_add(1);
      check(cuMemAlloc(&p, kMi), "cuMemAlloc(waiter)");
      returned_ns[static_cast<std::size_t>(i)] =
          std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count();
      cpu_ns.fetch_add(static_cast<long long>((thread_cpu_s() - c0) * 1e9));
      waited_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count());
      check(cuMemFree(p), "cuMemFree(waiter)");
    });
  }
  const double m0 = thread_cpu_s();
  CUmodule module = nullptr;
  loading.store(true);
  const CUresult rc = cuModuleLoad(&module, path.c_str());
  const double measurer_cpu = thread_cpu_s() - m0;
  const double load_s = std::chrono::duration<double>(clock::now() - start).count();
  for (std::thread& t : waiters) t.join();
  writer.join();
  if (syncer.joinable()) syncer.join();
  unlink(path.c_str());
  rmdir(fifo);
  if (module != nullptr) check(cuModuleUnload(module), "cuModuleUnload");
  int early = 0;  // waiters whose cuMemAlloc returned before the image was written: the gate still closed
  for (long long ns : returned_ns) early += ns < written_ns.load() ? 1 : 0;
  std::printf("hold-cpu rc=%d waiters=%d waited_s=%.3f waiters_cpu_s=%.3f load_s=%.3f measurer_cpu_s=%.3f early=%d\n",
              static_cast<int>(rc), threads, static_cast<double>(waited_ns.load()) * 1e-9,
              static_cast<double>(cpu_ns.load()) * 1e-9, load_s, measurer_cpu, early);
  return 0;
}

}  // namespace gpuslice::probe::gate
