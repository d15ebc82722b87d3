// implicit_free_race: a program of the container for implicit_free_race_test.cc.
//   implicit_free_race pointer|array|mipmap|module ROUNDS MIB [keep]
// Each round: the primary context current, one allocation of MIB MiB
// (cuMemAlloc, a 2D float array of that size, a one-level mipmapped array
// of it, or a module with a global of that size); a second thread frees it
// (cuMemFree, cuArrayDestroy, cuMipmappedArrayDestroy, cuModuleUnload;
// with `keep` it frees nothing) while this one
// resets the primary context (cuDevicePrimaryCtxReset: the driver frees
// everything the context owned).
// Run with the simulator's chaos mode sleeping at the free's entry
// (FAKECUDA_CHAOS_CALLS), the reset lands inside the free: the driver then
// refuses the free, the memory being gone already. With `keep` the reset
// alone frees it (the library's sweep after it must see that). Prints per round
// "round N free_rc=R", then "race hits=H" (rounds whose free the driver refused)
// and "after big_rc=R used=U": an allocation of MIB MiB once every round is
// over, and cuMemGetInfo's total - free before it.
//
//   implicit_free_race reuse ROUNDS MIB
// Each round: one allocation of MIB MiB (pointer p), then a reset of the
// primary context (the driver frees p); a second thread allocates MIB MiB
// again (the driver hands out p's address again), and while its cuMemAlloc
// has yet to return (the simulator's FAKECUDA_ALLOC_RETURN_DELAY_US), this
// one frees p (a use after the reset: the driver frees the second thread's
// allocation). Then, before anything is freed again, "round N reused=0|1
// stale_free_rc=R probe_rc=R used=U": whether the address came back, the
// stale free's result, an allocation of MIB MiB (freed at once) and
// cuMemGetInfo's total - free before it. Last, the second thread's pointer is freed
// ("owner_free_rc=R": the driver no longer knows it).
//
//   implicit_free_race span ROUNDS MIB
// As reuse, but the stale free began before the reset: a second thread frees
// p (its record taken; the simulator's chaos sleep at free_common's entry
// holds it before its driver call) while this one resets the primary
// context and then allocates MIB MiB again (cuMemAlloc: the address comes
// back, in a context the program created; FAKECUDA_ALLOC_RETURN_DELAY_US
// holds its return). p and the probes
// are pitched allocations (no return delay). Per round "round N hit=0|1
// probe_rc=R used=U": hit when the stale free freed the new allocation.
//
//   implicit_free_race create ROUNDS MIB [mipmap]
// Each round: a second thread creates a 2D float array (or a one-level
// mipmapped array) of MIB MiB in the primary context, and while its creation
// has yet to return (the simulator's FAKECUDA_ARRAY_RETURN_DELAY_US: the
// array made, its handle not yet recorded by the caller's library) this one
// resets the primary context (the driver frees the array). Then "round N
// create_rc=R gone=0|1 probe_rc=R used=U": the creation's result, whether
// the driver no longer knows the array (the race exercised), an allocation
// of MIB MiB (freed at once) and cuMemGetInfo's total - free before it.
//
//   implicit_free_race stale-array ROUNDS MIB
// Each round: an array a of MIB MiB, then a reset of the primary context
// (the driver frees a); a second thread creates another array, which the
// driver gives a's handle, and while that creation has yet to return
// (FAKECUDA_ARRAY_RETURN_DELAY_US) this one destroys a (a use after the
// reset: the driver destroys the second thread's array). Then "round N
// reused=0|1 create_rc=R stale_destroy_rc=R gone=0|1 probe_rc=R used=U".
#include <cuda.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

bool current(CUdevice dev) {
  CUcontext ctx = nullptr;
  return cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
}

// A 2D array of `mib` MiB: 1024 floats a row, 1 MiB per 256 rows.
CUDA_ARRAY3D_DESCRIPTOR array_desc(std::size_t mib) {
  CUDA_ARRAY3D_DESCRIPTOR d{};
  d.Width = 1024;
  d.Height = 256 * mib;
  d.Format = CU_AD_FORMAT_FLOAT;
  d.NumChannels = 1;
  return d;
}

// A thread making `call` in `ctx`, returned once it is about to and then
// `settle_us` later (the call held in the driver by a FAKECUDA_* delay).
template <class Call>
std::thread in_driver(CUcontext ctx, unsigned settle_us, Call call) {
  std::atomic<bool> entering{false};
  std::thread t([&entering, ctx, call]() mutable {
    cuCtxSetCurrent(ctx);
    entering.store(true);  // the last use of `entering`: it ends with this function
    call();
  });
  while (!entering.load()) usleep(100);
  usleep(settle_us);
  return t;
}

CUresult pitched(CUdeviceptr* p, std::size_t mib) {
  size_t pitch = 0;
  return cuMemAllocPitch(p, &pitch, std::size_t{1} << 20, mib, 4);
}

// What the container is shown (cuMemGetInfo, read before the probe: its
// record at a reused address would settle it), then whether `mib` MiB more
// is admitted (freed at once).
struct Shown {
  CUresult probe_rc;
  std::size_t used;
};
Shown shown_then_probe(std::size_t mib, bool pitch = false) {
  std::size_t free_bytes = 0, total = 0;
  cuMemGetInfo(&free_bytes, &total);
  CUdeviceptr probe = 0;
  const CUresult rc = pitch ? pitched(&probe, mib) : cuMemAlloc(&probe, mib << 20);
  if (rc == CUDA_SUCCESS) cuMemFree(probe);
  return {rc, total - free_bytes};
}

int reuse(CUdevice dev, int rounds, std::size_t mib) {
  for (int round = 0; round < rounds; ++round) {
    CUdeviceptr p = 0;
    if (cuMemAlloc(&p, mib << 20) != CUDA_SUCCESS) {
      std::printf("round %d alloc refused\n", round);
      return 1;
    }
    cuDevicePrimaryCtxReset(dev);
    if (!current(dev)) return 1;
    CUcontext ctx = nullptr;
    cuCtxGetCurrent(&ctx);
    CUdeviceptr q = 0;
    CUresult q_rc = CUDA_SUCCESS;
    // 100 ms: the owner's allocation is made, its cuMemAlloc not returned.
    std::thread owner = in_driver(ctx, 100000, [&] { q_rc = cuMemAlloc(&q, mib << 20); });
    const CUresult stale_rc = cuMemFree(p);
    owner.join();
    const Shown shown = shown_then_probe(mib);
    std::printf("round %d reused=%d q_rc=%d stale_free_rc=%d probe_rc=%d used=%zu\n", round,
                q_rc == CUDA_SUCCESS && q == p ? 1 : 0, static_cast<int>(q_rc), static_cast<int>(stale_rc),
                static_cast<int>(shown.probe_rc), shown.used);
    if (q_rc == CUDA_SUCCESS) std::printf("round %d owner_free_rc=%d\n", round, static_cast<int>(cuMemFree(q)));
  }
  return 0;
}

int span(CUdevice dev, int rounds, std::size_t mib) {
  // The new allocations go to a context of their own: a retain of the reset
  // primary context would be measured, and a measurement waits for the free
  // in flight (hook/measure.h), which would then come first.
  CUcontext other = nullptr;
  if (cuCtxCreate(&other, nullptr, 0, dev) != CUDA_SUCCESS || !current(dev)) return 1;
  int hits = 0;
  for (int round = 0; round < rounds; ++round) {
    if (!current(dev)) return 1;
    CUdeviceptr p = 0;
    if (pitched(&p, mib) != CUDA_SUCCESS) {
      std::printf("round %d alloc refused\n", round);
      return 1;
    }
    CUcontext ctx = nullptr;
    cuCtxGetCurrent(&ctx);
    CUresult stale_rc = CUDA_SUCCESS;
    // The chaos sleep holds the free at the driver's entry.
    std::thread freer = in_driver(ctx, 2000, [&] { stale_rc = cuMemFree(p); });
    cuDevicePrimaryCtxReset(dev);
    cuCtxSetCurrent(other);
    CUdeviceptr q = 0;
    const CUresult q_rc = cuMemAlloc(&q, mib << 20);  // returns after the free woke
    freer.join();
    CUdeviceptr base = 0;
    size_t size = 0;
    const bool hit = q_rc == CUDA_SUCCESS && q == p && stale_rc == CUDA_SUCCESS &&
                     cuMemGetAddressRange(&base, &size, q) != CUDA_SUCCESS;
    hits += hit ? 1 : 0;
    const Shown shown = shown_then_probe(mib, /*pitch=*/true);
    std::printf("round %d hit=%d probe_rc=%d used=%zu reused=%d q_rc=%d stale_free_rc=%d\n", round, hit ? 1 : 0,
                static_cast<int>(shown.probe_rc), shown.used, q == p ? 1 : 0, static_cast<int>(q_rc),
                static_cast<int>(stale_rc));
    if (q_rc == CUDA_SUCCESS) cuMemFree(q);
  }
  std::printf("span hits=%d\n", hits);
  return 0;
}

int create(CUdevice dev, int rounds, std::size_t mib, bool mipmap) {
  for (int round = 0; round < rounds; ++round) {
    if (!current(dev)) return 1;
    CUcontext ctx = nullptr;
    cuCtxGetCurrent(&ctx);
    const CUDA_ARRAY3D_DESCRIPTOR d = array_desc(mib);
    CUarray a = nullptr;
    CUmipmappedArray m = nullptr;
    CUresult create_rc = CUDA_SUCCESS;
    // 100 ms: the array is made, its creation not returned.
    std::thread creator = in_driver(
        ctx, 100000, [&] { create_rc = mipmap ? cuMipmappedArrayCreate(&m, &d, 1) : cuArray3DCreate(&a, &d); });
    cuDevicePrimaryCtxReset(dev);
    creator.join();
    if (!current(dev)) return 1;
    CUDA_ARRAY3D_DESCRIPTOR seen{};
    CUarray level = nullptr;
    const bool gone = create_rc == CUDA_SUCCESS && (mipmap ? cuMipmappedArrayGetLevel(&level, m, 0) != CUDA_SUCCESS
                                                           : cuArray3DGetDescriptor(&seen, a) != CUDA_SUCCESS);
    const Shown shown = shown_then_probe(mib);
    std::printf("round %d create_rc=%d gone=%d probe_rc=%d used=%zu\n", round, static_cast<int>(create_rc),
                gone ? 1 : 0, static_cast<int>(shown.probe_rc), shown.used);
  }
  return 0;
}

int stale_array(CUdevice dev, int rounds, std::size_t mib) {
  const CUDA_ARRAY3D_DESCRIPTOR d = array_desc(mib);
  for (int round = 0; round < rounds; ++round) {
    if (!current(dev)) return 1;
    CUarray a = nullptr;
    if (cuArray3DCreate(&a, &d) != CUDA_SUCCESS) {
      std::printf("round %d alloc refused\n", round);
      return 1;
    }
    cuDevicePrimaryCtxReset(dev);
    if (!current(dev)) return 1;
    CUcontext ctx = nullptr;
    cuCtxGetCurrent(&ctx);
    CUarray b = nullptr;
    CUresult create_rc = CUDA_SUCCESS;
    // 100 ms: the array is made, its creation not returned.
    std::thread creator = in_driver(ctx, 100000, [&] { create_rc = cuArray3DCreate(&b, &d); });
    const CUresult stale_rc = cuArrayDestroy(a);
    creator.join();
    CUDA_ARRAY3D_DESCRIPTOR seen{};
    const bool gone = create_rc == CUDA_SUCCESS && cuArray3DGetDescriptor(&seen, b) != CUDA_SUCCESS;
    const Shown shown = shown_then_probe(mib);
    std::printf("round %d reused=%d create_rc=%d stale_destroy_rc=%d gone=%d probe_rc=%d used=%zu\n", round,
                b == a ? 1 : 0, static_cast<int>(create_rc), static_cast<int>(stale_rc), gone ? 1 : 0,
                static_cast<int>(shown.probe_rc), shown.used);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) return 2;
  const bool array = std::strcmp(argv[1], "array") == 0;
  const bool mipmap = std::strcmp(argv[1], "mipmap") == 0;
  const bool module = std::strcmp(argv[1], "module") == 0;
  const bool keep = argc == 5 && std::strcmp(argv[4], "keep") == 0;
  const int rounds = std::atoi(argv[2]);
  const std::size_t mib = std::strtoull(argv[3], nullptr, 10);
  CUdevice dev = 0;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS || !current(dev)) {
    std::printf("init failed\n");
    return 1;
  }
  if (std::strcmp(argv[1], "span") == 0) return span(dev, std::atoi(argv[2]), std::strtoull(argv[3], nullptr, 10));
  if (std::strcmp(argv[1], "reuse") == 0) return reuse(dev, std::atoi(argv[2]), std::strtoull(argv[3], nullptr, 10));
  if (std::strcmp(argv[1], "stale-array") == 0) return stale_array(dev, rounds, mib);
  if (std::strcmp(argv[1], "create") == 0)
    return create(dev, rounds, mib, argc == 5 && std::strcmp(argv[4], "mipmap") == 0);
  int hits = 0;
  for (int round = 0; round < rounds; ++round) {
    CUdeviceptr p = 0;
    CUarray a = nullptr;
    CUmipmappedArray m = nullptr;
    CUmodule mod = nullptr;
    CUresult rc;
    const CUDA_ARRAY3D_DESCRIPTOR d = array_desc(mib);
    if (array) {
      rc = cuArray3DCreate(&a, &d);
    } else if (mipmap) {
      rc = cuMipmappedArrayCreate(&m, &d, 1);
    } else if (module) {
      const std::string image = ".global .align 8 .b8 big[" + std::to_string(mib << 20) + "];\n.entry k\n";
      rc = cuModuleLoadData(&mod, image.c_str());
    } else {
      rc = cuMemAlloc(&p, mib << 20);
    }
    if (rc != CUDA_SUCCESS) {
      std::printf("round %d alloc_rc=%d\n", round, static_cast<int>(rc));
      break;  // refused: what the earlier rounds left counted (reported below)
    }
    CUcontext ctx = nullptr;
    cuCtxGetCurrent(&ctx);
    std::atomic<bool> entering{false};
    CUresult free_rc = CUDA_SUCCESS;
    std::thread freer([&] {
      cuCtxSetCurrent(ctx);
      entering.store(true);
      if (keep) return;
      free_rc = array    ? cuArrayDestroy(a)
                : mipmap ? cuMipmappedArrayDestroy(m)
                : module ? cuModuleUnload(mod)
                         : cuMemFree(p);
    });
    while (!keep && !entering.load()) usleep(100);
    usleep(2000);  // the freer is inside the driver's entry (the chaos sleep)
    cuDevicePrimaryCtxReset(dev);
    freer.join();
    if (!current(dev)) return 1;
    if (free_rc != CUDA_SUCCESS) ++hits;
    std::printf("round %d free_rc=%d\n", round, static_cast<int>(free_rc));
  }
  std::size_t free_bytes = 0, total = 0;
  cuMemGetInfo(&free_bytes, &total);
  CUdeviceptr big = 0;
  const CUresult big_rc = cuMemAlloc(&big, mib << 20);
  std::printf("race hits=%d\nafter big_rc=%d used=%zu\n", hits, static_cast<int>(big_rc), total - free_bytes);
  return 0;
}
