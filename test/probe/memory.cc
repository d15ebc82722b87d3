// gpuslice-probe memory: drives the device-memory paths an attacker (or an unusual but
// legitimate program) used to get around the quota or to be refused wrongly,
// for test/hardening/memory_bypass_test.cc. Links the simulated driver
// directly, as an application links libcuda; the preload library interposes
// at run time. One scenario per run; every scenario prints "key=value" lines
// and exits 0 when its CUDA calls behaved as documented (the test judges the
// numbers), 2 when a setup call failed.
//
//   vmm-retain MIB ROUNDS      create+map, retain, release twice (mapping holds it)
//   vmm-import MIB ROUNDS      create+map, export fd, import, release all handles
//   pool-destroy-live MIB ROUNDS  allocate from a new pool, destroy it with the allocation live
//   pool-destroy-live-sync MIB ROUNDS  the same, the last allocation freed with cuMemFree
//   pool-other-device MIB ROUNDS  cuMemAllocAsync on a device-1 stream, device 0 current
//   pool-foreign-pool MIB ROUNDS  cuMemAllocFromPoolAsync from device 1's pool, device-0 stream
//   host-located MIB ROUNDS  host-located pool and VMM allocations (never charged)
//   module-memory MIB        modules/libraries with a MIB global, loaded and unloaded
//   pool-failed MIB            failed cuMemAllocFromPoolAsync (NULL, destroyed pool), then MIB
//   free-async-linear MIB ROUNDS  cuMemAlloc, cuMemFreeAsync, sync, again
//   ctx-destroy-live MIB ROUNDS   cuCtxCreate, cuMemAlloc, cuCtxDestroy, again
//   primary-reset-live MIB ROUNDS primary retain, cuMemAlloc, cuDevicePrimaryCtxReset, again
//   ctx-destroy-live-array MIB ROUNDS  cuCtxCreate, cuArrayCreate, cuCtxDestroy, again
//   ctx-race TRIES             contexts created while another thread allocates and frees
//   refused-free-reuse MIB DELAY_MS  a free the driver refuses (its context destroyed meanwhile)
//                              while another thread allocates at the address and frees it
//                              (run with FAKECUDA_ADDRESS_RANGE_DELAY_US = DELAY_MS * 1000)
#include <cuda.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "probe.h"

namespace gpuslice::probe::memory {

CUmemAllocationProp device_prop(int dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// Creates `bytes` of physical memory and maps it at a fresh reservation.
CUresult create_and_map(std::size_t bytes, CUmemGenericAllocationHandle* h, CUdeviceptr* va) {
  const CUmemAllocationProp prop = device_prop(0);
  CUresult rc = cuMemCreate(h, bytes, &prop, 0);
  if (rc != CUDA_SUCCESS) return rc;
  check(cuMemAddressReserve(va, bytes, 0, 0, 0), "cuMemAddressReserve");
  check(cuMemMap(*va, bytes, 0, *h, 0), "cuMemMap");
  return CUDA_SUCCESS;
}

void report(const char* name, int ok, int rounds, CUresult last) {
  std::printf("%s succeeded=%d rounds=%d last_rc=%d counted=%lld\n", name, ok, rounds, static_cast<int>(last),
              counted_used());
}

int vmm_retain(std::size_t bytes, int rounds) {
  use_primary(0);
  int ok = 0;
  CUresult last = CUDA_SUCCESS;
  for (int i = 0; i < rounds; ++i) {
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    if ((last = create_and_map(bytes, &h, &va)) != CUDA_SUCCESS) continue;
    ++ok;
    CUmemGenericAllocationHandle again = 0;
    check(cuMemRetainAllocationHandle(&again, reinterpret_cast<void*>(va)), "cuMemRetainAllocationHandle");
    check(cuMemRelease(again), "cuMemRelease (retained)");
    check(cuMemRelease(h), "cuMemRelease");  // the mapping still holds the memory
  }
  report("vmm-retain", ok, rounds, last);
  return 0;
}

int vmm_import(std::size_t bytes, int rounds) {
  use_primary(0);
  int ok = 0;
  CUresult last = CUDA_SUCCESS;
  for (int i = 0; i < rounds; ++i) {
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    if ((last = create_and_map(bytes, &h, &va)) != CUDA_SUCCESS) continue;
    ++ok;
    int fd = -1;
    CUresult rc = cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (rc != CUDA_SUCCESS) {
      std::printf("vmm-import unsupported rc=%d\n", static_cast<int>(rc));
      return 0;
    }
    CUmemGenericAllocationHandle imported = 0;
    rc = cuMemImportFromShareableHandle(&imported, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc != CUDA_SUCCESS) {
      std::printf("vmm-import unsupported rc=%d\n", static_cast<int>(rc));
      return 0;
    }
    close(fd);
    check(cuMemUnmap(va, bytes), "cuMemUnmap");
    check(cuMemRelease(h), "cuMemRelease");  // the imported handle still holds the memory
  }
  report("vmm-import", ok, rounds, last);
  return 0;
}

int pool_destroy_live(std::size_t bytes, int rounds, bool sync_free) {
  use_primary(0);
  int ok = 0;
  CUresult last = CUDA_SUCCESS;
  CUdeviceptr first = 0;
  for (int i = 0; i < rounds; ++i) {
    const CUmemoryPool pool = new_pool(0);
    CUdeviceptr p = 0;
    last = cuMemAllocFromPoolAsync(&p, bytes, pool, nullptr);
    if (last == CUDA_SUCCESS) {
      ++ok;
      check(cuStreamSynchronize(nullptr), "cuStreamSynchronize");
      if (first == 0) first = p;
    }
    check(cuMemPoolDestroy(pool), "cuMemPoolDestroy");  // the allocation stays live
  }
  report("pool-destroy-live", ok, rounds, last);
  // Freeing the last outstanding allocation frees the destroyed pool.
  if (first != 0 && sync_free) {
    check(cuMemFree(first), "cuMemFree");  // a synchronous free of stream-ordered memory
  } else if (first != 0) {
    check(cuMemFreeAsync(first, nullptr), "cuMemFreeAsync");
    check(cuStreamSynchronize(nullptr), "cuStreamSynchronize");
  }
  CUdeviceptr again = 0;
  const CUresult rc = cuMemAlloc(&again, bytes);
  std::printf("after-free rc=%d counted=%lld\n", static_cast<int>(rc), counted_used());
  return 0;
}

int pool_other_device(std::size_t bytes, int rounds, bool foreign_pool) {
  use_primary(1);
  const CUstream s1 = new_stream();
  use_primary(0);  // device 0 current from here on
  const CUstream s0 = new_stream();
  CUmemoryPool pool1 = nullptr;
  if (foreign_pool) check(cuDeviceGetDefaultMemPool(&pool1, 1), "cuDeviceGetDefaultMemPool");
  int ok = 0;
  CUresult last = CUDA_SUCCESS;
  for (int i = 0; i < rounds; ++i) {
    CUdeviceptr p = 0;
    last = foreign_pool ? cuMemAllocFromPoolAsync(&p, bytes, pool1, s0) : cuMemAllocAsync(&p, bytes, s1);
    if (last == CUDA_SUCCESS) ++ok;
    cuStreamSynchronize(foreign_pool ? s0 : s1);
  }
  std::printf("%s succeeded=%d rounds=%d last_rc=%d device1_used=%lld\n",
              foreign_pool ? "pool-foreign-pool" : "pool-other-device", ok, rounds, static_cast<int>(last),
              held_allocations(1));
  return 0;
}

// Host-located pools and VMM memory (CUDA 13) hold nothing on a device.
int host_located(std::size_t bytes, int rounds) {
  use_primary(0);
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_HOST;
  CUmemoryPool pool = nullptr;
  check(cuMemPoolCreate(&pool, &props), "cuMemPoolCreate (host)");
  int pool_ok = 0, vmm_ok = 0;
  for (int i = 0; i < rounds; ++i) {
    CUdeviceptr p = 0;
    if (cuMemAllocFromPoolAsync(&p, bytes, pool, nullptr) == CUDA_SUCCESS) ++pool_ok;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CUmemGenericAllocationHandle h = 0;
    if (cuMemCreate(&h, bytes, &prop, 0) == CUDA_SUCCESS) ++vmm_ok;
  }
  cuStreamSynchronize(nullptr);
  std::printf("host-located pool_ok=%d vmm_ok=%d rounds=%d counted=%lld\n", pool_ok, vmm_ok, rounds, counted_used());
  return 0;
}

// Modules and libraries hold memory for their globals: counted while loaded.
int module_memory(std::size_t bytes) {
  use_primary(0);
  const std::string image = image_with_global(bytes);
  const long long before = counted_used();
  CUmodule m1 = nullptr, m2 = nullptr;
  const CUresult rc1 = cuModuleLoadData(&m1, image.c_str());
  const long long loaded = counted_used();
  const CUresult rc2 = cuModuleLoadData(&m2, image.c_str());
  const long long second = counted_used();
  if (rc1 == CUDA_SUCCESS) check(cuModuleUnload(m1), "cuModuleUnload");
  const long long unloaded = counted_used();
  CUlibrary lib = nullptr;
  const CUresult rc3 = cuLibraryLoadData(&lib, image.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  const long long library = counted_used();
  if (rc3 == CUDA_SUCCESS) check(cuLibraryUnload(lib), "cuLibraryUnload");
  std::printf(
      "module rc1=%d rc2=%d rc3=%d before=%lld loaded=%lld second=%lld unloaded=%lld library=%lld after=%lld "
      "held=%lld\n",
      static_cast<int>(rc1), static_cast<int>(rc2), static_cast<int>(rc3), before, loaded, second, unloaded, library,
      counted_used(), held());
  return 0;
}

int pool_failed(std::size_t bytes) {
  use_primary(0);
  const long long before = counted_used();
  CUdeviceptr p = 0;
  const CUresult null_rc = cuMemAllocFromPoolAsync(&p, bytes, nullptr, nullptr);
  const CUmemoryPool pool = new_pool(0);
  check(cuMemPoolDestroy(pool), "cuMemPoolDestroy");
  const CUresult destroyed_rc = cuMemAllocFromPoolAsync(&p, bytes, pool, nullptr);
  std::printf("pool-failed null_rc=%d destroyed_rc=%d before=%lld after=%lld\n", static_cast<int>(null_rc),
              static_cast<int>(destroyed_rc), before, counted_used());
  return 0;
}

int free_async_linear(std::size_t bytes, int rounds) {
  use_primary(0);
  int ok = 0;
  CUresult last = CUDA_SUCCESS;
  for (int i = 0; i < rounds; ++i) {
    CUdeviceptr p = 0;
    if ((last = cuMemAlloc(&p, bytes)) != CUDA_SUCCESS) continue;
    ++ok;
    check(cuMemFreeAsync(p, nullptr), "cuMemFreeAsync");
    check(cuStreamSynchronize(nullptr), "cuStreamSynchronize");
  }
  report("free-async-linear", ok, rounds, last);
  return 0;
}

int ctx_destroy_live(std::size_t bytes, int rounds, bool primary_reset, bool arrays) {
  int ok = 0;
  CUresult last = CUDA_SUCCESS;
  for (int i = 0; i < rounds; ++i) {
    CUcontext ctx = nullptr;
    if (primary_reset) {
      ctx = use_primary(0);
    } else {
      check(cuCtxCreate(&ctx, nullptr, 0, 0), "cuCtxCreate");
    }
    if (arrays) {
      // A 2D float array of about `bytes`.
      CUDA_ARRAY_DESCRIPTOR d{};
      d.Width = 16384;
      d.Height = bytes / (16384 * 4);
      d.Format = CU_AD_FORMAT_FLOAT;
      d.NumChannels = 1;
      CUarray a = nullptr;
      if ((last = cuArrayCreate(&a, &d)) == CUDA_SUCCESS) ++ok;
    } else {
      CUdeviceptr p = 0;
      if ((last = cuMemAlloc(&p, bytes)) == CUDA_SUCCESS) ++ok;
    }
    if (primary_reset) {
      check(cuDevicePrimaryCtxReset(0), "cuDevicePrimaryCtxReset");
    } else {
      check(cuCtxDestroy(ctx), "cuCtxDestroy");
    }
  }
  std::printf("%s%s succeeded=%d rounds=%d last_rc=%d\n", primary_reset ? "primary-reset-live" : "ctx-destroy-live",
              arrays ? "-array" : "", ok, rounds, static_cast<int>(last));
  return 0;
}

// Creates and destroys contexts while another thread allocates and frees;
// after each creation (the other thread paused) compares what gpuslice counts
// with what the simulated device holds for this process.
int ctx_race(int tries) {
  const CUcontext main_ctx = use_primary(0);
  Churn churn(main_ctx, [] {
    CUdeviceptr p = 0;
    if (cuMemAlloc(&p, 64 * kMi) == CUDA_SUCCESS) cuMemFree(p);
  });
  int mismatches = 0;
  for (int i = 0; i < tries; ++i) {
    CUcontext ctx = nullptr;
    check(cuCtxCreate(&ctx, nullptr, 0, 0), "cuCtxCreate");
    churn.pause();
    if (counted_used() != held()) ++mismatches;
    churn.resume();
    check(cuCtxDestroy(ctx), "cuCtxDestroy");
    cuCtxSetCurrent(main_ctx);
  }
  churn.stop();
  std::printf("ctx-race tries=%d mismatches=%d\n", tries, mismatches);
  return 0;
}

// A free of a pointer whose context another thread is destroying: the free
// takes the record out, the driver refuses it (the destroy freed the
// memory), and the library asks whether the address is still known. Each
// question sleeps D before its look-up and D after (the knob). The destroy's
// sweep asks at D (gone) and ends at 2D, its record already taken by the
// free (at 1.5D); the free's question looks at 2.5D, answers at 3.5D.
// Between, this thread allocates at the address (2.2D: known at the look)
// and frees it (3D): the answer "known" is stale when the record goes back.
int refused_free_reuse(std::size_t bytes, int delay_ms) {
  const auto sleep_ms = [](int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); };
  const CUcontext primary = use_primary(0);
  CUcontext ctx = nullptr;
  check(cuCtxCreate(&ctx, nullptr, 0, 0), "cuCtxCreate");
  CUdeviceptr gone = 0;
  check(cuMemAlloc(&gone, bytes), "cuMemAlloc");
  check(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
  CUresult destroyed = CUDA_SUCCESS, freed = CUDA_SUCCESS;
  std::thread destroy([&] { destroyed = cuCtxDestroy(ctx); });
  std::thread free_late([&] {
    cuCtxSetCurrent(primary);
    sleep_ms(delay_ms * 3 / 2);
    freed = cuMemFree(gone);
  });
  sleep_ms(delay_ms * 11 / 5);
  CUdeviceptr again = 0;
  check(cuMemAlloc(&again, bytes), "cuMemAlloc (again)");
  sleep_ms(delay_ms * 4 / 5);
  check(cuMemFree(again), "cuMemFree (again)");
  destroy.join();
  free_late.join();
  std::printf("refused-free-reuse destroyed=%d freed=%d same=%d counted=%lld held=%lld\n", static_cast<int>(destroyed),
              static_cast<int>(freed), again == gone ? 1 : 0, counted_used(), held_allocations());
  return 0;
}

}  // namespace gpuslice::probe::memory
