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
#include <cuda.h>
#include <sys/stat.h>
#include <unistd.h>

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

}  // namespace gpuslice::probe::gate
