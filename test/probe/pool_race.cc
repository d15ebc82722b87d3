// gpuslice-probe pool-race: stream-ordered allocation racing the library's slow paths,
// with a window widened by the simulated driver's test knobs
// (FAKECUDA_POOL_QUERY_DELAY_US, FAKECUDA_ALLOC_ASYNC_DELAY_US), for
// test/hardening/pool_race_test.cc. Prints "key=value" lines (counted =
// cuMemGetInfo's total - free; held = what the simulated device holds for
// this process, contexts left out) and exits 0, or 2 when a setup call failed.
//
//   reconcile-order MIB
//       a synchronisation's reconciliation reads the pool's reserve (the
//       answer delayed) while another thread allocates MIB on the fast path
//       and frees it
//   set-mempool MIB
//       cuMemAllocAsync of MIB (delayed in the driver) while another thread
//       makes a second pool current; then MIB more from the new current pool
//   allowance-wait MIB_A MIB_B
//       a pool allocation waiting for the resident allowance while another
//       thread frees the same pool's memory and synchronises
//   refused-growth LINEAR_MIB POOL_MIB MIB
//       LINEAR_MIB of cuMemAlloc and POOL_MIB freed back to the default pool
//       (the quota full); a thread asks the pool for MIB, is refused, and
//       reclaims (a second pool's reconciliation delayed) while this one
//       synchronises (the driver trims the default pool, whose
//       reconciliation skips it: the refused thread holds it)
//   inflight-growth MIB
//       MIB freed back to the default pool; a thread's cuMemAllocAsync of MIB
//       fits the count (delayed in the driver); meanwhile this one grows the
//       pool for MIB more (counted for both), gets the freed reserve and
//       frees it; the delayed one gets it too and frees it: the driver never
//       held more than MIB
//   freed-after-sweep MIB DELAY_MS
//       a created context's cuMemAlloc of MIB goes with its destroy (another
//       thread); its sweep's address queries are delayed (by DELAY_MS:
//       FAKECUDA_ADDRESS_RANGE_DELAY_US, before and after the look-up) and
//       so is the driver's part of cuMemFreeAsync (FAKECUDA_FREE_ASYNC_DELAY_US,
//       >= 3 x DELAY_MS): once the sweep took the record out, this thread
//       takes the address with a pool allocation and frees it before the
//       sweep's next question; the free ends after the sweep's last one
//       (same: 1 when the pool allocation got the context allocation's address)
//   allocated-during-sweep MIB DELAY_MS
//       the same context allocation; once the sweep took its record out, this
//       thread's pool allocation takes the address in the driver, and its
//       reserve queries (FAKECUDA_POOL_QUERY_DELAY_US, >= 2 x DELAY_MS) keep
//       it from being recorded until after the sweep's last question: counted
//       and held printed while it is still allocated
//   freed-while-recording MIB DELAY_MS
//       the same context allocation, its destroy finished; a thread's pool
//       allocation takes the address in the driver and its reserve query
//       (FAKECUDA_POOL_QUERY_DELAY_US, > DELAY_MS) keeps it unrecorded while
//       this thread frees the address it had (a stale pointer: the
//       context's allocation went with the destroy), which frees the pool
//       allocation in the driver; then the pool is trimmed: counted and held
//       printed with nothing allocated
//   destroyed-while-growing MIB DELAY_MS
//       a created pool's cuMemPoolDestroy (another thread) holds the pool's
//       mutex while its last reserve query is answered late
//       (FAKECUDA_POOL_QUERY_DELAY_US, > DELAY_MS); meanwhile, after
//       DELAY_MS, this thread asks that pool for MIB (more than it counts:
//       the slow path waits for the mutex); the driver refuses it, the pool
//       destroyed: counted and held printed with nothing allocated
//   failed-in-flight MIB
//       MIB freed back to the default pool; a thread's cuMemAllocAsync of MIB
//       on a second stream fits the count (delayed in the driver); meanwhile
//       this one grows the pool for MIB more (counted for both) and gets the
//       freed reserve, then destroys the second stream: the delayed
//       allocation fails; after a synchronisation, counted and held printed
//       with this one's MIB allocated
//   refused-free-freed-meanwhile MIB
//       MIB from the default pool; a thread frees it with cuMemFreeAsync on
//       a destroyed stream (delayed in the driver: FAKECUDA_FREE_ASYNC_DELAY_US,
//       > 100 ms; the driver refuses it), while this one frees the same
//       pointer with cuMemFree (as a program's stale pointer at the address
//       would); after a trim, counted and held printed with nothing allocated
//   settled-after-trim MIB DELAY_MS
//       MIB from the default pool and freed (counted, the pool keeps it); a
//       created context's cuMemAlloc of MIB at that address goes with its
//       destroy; a thread's pool allocation takes the address on the fast
//       path, its reserve query answered late (FAKECUDA_POOL_QUERY_DELAY_US
//       = DELAY_MS) and its record's settle later still
//       (FAKECUDA_ADDRESS_RANGE_DELAY_US, >= DELAY_MS / 2); meanwhile a
//       synchronisation reconciles the pool (its query late too), this
//       thread frees the stale pointer (the driver frees the pool
//       allocation), and once that reconciliation ended another
//       synchronisation trims the freed memory: counted and held printed
//       once all returned, with nothing allocated
//   freed-during-sync MIB [memfree]
//       MIB from the default pool, reconciled at a synchronisation (counted
//       at its reserve); a thread frees it with cuMemFreeAsync (memfree:
//       cuMemFree), whose return is delayed after the free
//       (FAKECUDA_FREE_ASYNC_RETURN_DELAY_US, FAKECUDA_FREE_RETURN_DELAY_US:
//       > 100 ms), while this one synchronises (the driver trims the freed
//       reserve): counted and held printed once both returned, with nothing
//       allocated
#include <cuda.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "probe.h"

namespace gpuslice::probe::pool_race {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

int reconcile_order(std::size_t bytes) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, bytes, s), "cuMemAllocAsync");  // counted: the pool grew
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");            // still counted: the pool keeps it
  // The sync trims the pool (threshold 0); its reconciliation reads the
  // reserve (0), and its answer comes late: meanwhile this thread allocates
  // on the fast path (the count still covers it) and frees.
  std::thread sync([&] {
    cuCtxSetCurrent(ctx);
    cuStreamSynchronize(s);
  });
  sleep_ms(100);
  const CUresult rc = cuMemAllocAsync(&p, bytes, s);
  if (rc == CUDA_SUCCESS) cuMemFreeAsync(p, s);
  sync.join();
  std::printf("reconcile-order rc=%d counted=%lld held=%lld\n", static_cast<int>(rc), counted_used(),
              held_allocations());
  return 0;
}

int set_mempool(std::size_t bytes) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  const std::uint64_t keep = ~std::uint64_t{0};
  CUmemoryPool first = nullptr;
  check(cuDeviceGetMemPool(&first, 0), "cuDeviceGetMemPool");
  set_release_threshold(first, keep);
  const CUmemoryPool second = new_pool(0, keep);
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, bytes, s), "cuMemAllocAsync");  // the first pool grows (counted) and keeps it
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");
  CUresult rc1 = CUDA_SUCCESS;
  CUdeviceptr p1 = 0;
  std::thread alloc([&] {
    cuCtxSetCurrent(ctx);
    rc1 = cuMemAllocAsync(&p1, bytes, s);  // fits the first pool's count: its fast path
  });
  sleep_ms(100);  // the driver is still before its look at the current pool
  check(cuDeviceSetMemPool(0, second), "cuDeviceSetMemPool");
  alloc.join();
  CUdeviceptr p2 = 0;
  const CUresult rc2 = cuMemAllocAsync(&p2, bytes, s);
  std::printf("set-mempool rc1=%d rc2=%d counted=%lld held=%lld\n", static_cast<int>(rc1), static_cast<int>(rc2),
              counted_used(), held_allocations());
  return 0;
}

// Under GPUSLICE_OVERSUBSCRIBE=wait: one thread holds MIB_A of a pool; a
// second asks the same pool for MIB_B beyond the resident allowance and
// waits; the first frees its allocation and synchronises (the pool is
// trimmed, and the reconciliation gives its count back): the waiter goes on.
int allowance_wait(std::size_t a, std::size_t b) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  CUdeviceptr pa = 0;
  check(cuMemAllocAsync(&pa, a, s), "cuMemAllocAsync");
  CUresult rc = CUDA_SUCCESS;
  long long waited_ms = 0;
  std::thread waiter([&] {
    cuCtxSetCurrent(ctx);
    CUdeviceptr pb = 0;
    const auto t0 = std::chrono::steady_clock::now();
    rc = cuMemAllocAsync(&pb, b, s);
    waited_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    if (rc == CUDA_SUCCESS) cuMemFreeAsync(pb, s);
  });
  sleep_ms(200);
  check(cuMemFreeAsync(pa, s), "cuMemFreeAsync");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  waiter.join();
  std::printf("allowance-wait rc=%d waited_ms=%lld\n", static_cast<int>(rc), waited_ms);
  return 0;
}

int refused_growth(std::size_t linear, std::size_t pool_bytes, std::size_t bytes) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  const CUmemoryPool other = new_pool(0);  // reconciled by the refusal's reclaim: its reserve query is delayed
  CUdeviceptr lin = 0, p = 0;
  check(cuMemAlloc(&lin, linear), "cuMemAlloc");
  check(cuMemAllocAsync(&p, pool_bytes, s), "cuMemAllocAsync");  // the default pool grows (counted)
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");                 // still counted: the pool keeps it
  CUresult rc = CUDA_SUCCESS;
  std::thread grower([&] {
    cuCtxSetCurrent(ctx);
    CUdeviceptr q = 0;
    rc = cuMemAllocAsync(&q, bytes, s);  // needs growth beyond the quota: refused
    if (rc == CUDA_SUCCESS) cuMemFreeAsync(q, s);
  });
  sleep_ms(100);                                         // the grower is in its reclaim, holding the default pool
  check(cuStreamSynchronize(s), "cuStreamSynchronize");  // the driver trims the default pool to nothing
  grower.join();
  (void)other;
  std::printf("refused-growth rc=%d counted=%lld held=%lld\n", static_cast<int>(rc), counted_used(),
              held_allocations());
  return 0;
}

// A growth counts for the allocations in flight (`outstanding`), and the
// reconciliation after it keeps that count though the driver reused the
// pool's free reserve for this one: once both are freed, the pool is counted
// above what the driver holds for it until the next synchronisation.
int inflight_growth(std::size_t bytes) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  CUmemoryPool pool = nullptr;
  check(cuDeviceGetMemPool(&pool, 0), "cuDeviceGetMemPool");
  CUdeviceptr p = 0;
  check(cuMemAllocFromPoolAsync(&p, bytes, pool, s), "cuMemAllocFromPoolAsync");  // the pool grows (counted)
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");                                  // and keeps it
  CUresult rc = CUDA_SUCCESS;
  std::thread late([&] {
    cuCtxSetCurrent(ctx);
    CUdeviceptr q = 0;
    rc = cuMemAllocAsync(&q, bytes, s);  // fits the count: the fast path; delayed in the driver
    if (rc == CUDA_SUCCESS) cuMemFreeAsync(q, s);
  });
  sleep_ms(100);  // the late one is in `outstanding`, not yet in the driver
  check(cuMemAllocFromPoolAsync(&p, bytes, pool, s), "cuMemAllocFromPoolAsync");  // grows the count
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");
  late.join();
  std::printf("inflight-growth rc=%d counted=%lld held=%lld\n", static_cast<int>(rc), counted_used(),
              held_allocations());
  return 0;
}

// The stage of the two sweep races below: the primary context current, a
// stream and the device's pool; a created context holding `bytes` that
// another thread is destroying (its implicit-free sweep under way).
struct DyingContext {
  CUstream s = nullptr;
  CUmemoryPool pool = nullptr;
  CUdeviceptr gone = 0;  // the context's allocation, going with it
  CUresult destroyed = CUDA_SUCCESS;
  std::thread destroy;
  explicit DyingContext(std::size_t bytes) {
    const CUcontext primary = use_primary(0);
    s = new_stream();
    check(cuDeviceGetMemPool(&pool, 0), "cuDeviceGetMemPool");
    CUcontext ctx = nullptr;
    check(cuCtxCreate(&ctx, nullptr, 0, 0), "cuCtxCreate");
    check(cuMemAlloc(&gone, bytes), "cuMemAlloc");
    check(cuCtxSetCurrent(primary), "cuCtxSetCurrent");
    destroy = std::thread([this, ctx] { destroyed = cuCtxDestroy(ctx); });
  }
};

// A record the implicit-free sweep put back (limiter::settle_record: the
// address known again, held by a pool allocation of ours being freed) and
// asked about for the last time before that free ended: a record of nothing
// unless the free itself settles it.
int freed_after_sweep(std::size_t bytes, int delay_ms) {
  DyingContext d(bytes);
  const CUstream s = d.s;
  // The sweep's questions are answered at D (gone), 3D, 5D (each returned
  // D later); the record taken out at 2D, put back at 4D. Between 2D and 3D
  // (after the second question's look at our pool records) this thread
  // allocates at the address and starts freeing it: nothing to take out.
  sleep_ms(delay_ms * 2 + delay_ms / 5);
  CUdeviceptr p = 0;
  check(cuMemAllocFromPoolAsync(&p, bytes, d.pool, s), "cuMemAllocFromPoolAsync");
  sleep_ms(delay_ms / 4);
  const CUresult rc = cuMemFreeAsync(p, s);  // its driver part ends after the third question (5D)
  d.destroy.join();
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  check(cuMemPoolTrimTo(d.pool, 0), "cuMemPoolTrimTo");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  std::printf("freed-after-sweep rc=%d destroyed=%d same=%d counted=%lld held=%lld\n", static_cast<int>(rc),
              static_cast<int>(d.destroyed), p == d.gone ? 1 : 0, counted_used(), held_allocations());
  return 0;
}

// A record the implicit-free sweep put back while the address was a pool
// allocation of ours in flight (in the driver, not yet recorded: the sweep's
// questions find it known): a record of nothing while that allocation lives,
// unless the allocation itself settles it.
int allocated_during_sweep(std::size_t bytes, int delay_ms) {
  DyingContext d(bytes);
  const CUstream s = d.s;
  // The sweep's questions are answered at D (gone), 3D, 5D; the record taken
  // out at 2D, put back at 4D. This allocation is in the driver before 3D
  // and recorded after 4D (its reserve queries).
  sleep_ms(delay_ms * 2 + delay_ms / 5);
  CUdeviceptr p = 0;
  const CUresult rc = cuMemAllocFromPoolAsync(&p, bytes, d.pool, s);
  d.destroy.join();
  std::printf("allocated-during-sweep rc=%d destroyed=%d same=%d counted=%lld held=%lld\n", static_cast<int>(rc),
              static_cast<int>(d.destroyed), p == d.gone ? 1 : 0, counted_used(), held_allocations());
  if (rc == CUDA_SUCCESS) cuMemFreeAsync(p, s);
  cuStreamSynchronize(s);
  return 0;
}

// A program's stale free (a pointer of a destroyed context) of an address
// that a pool allocation of ours had taken in the driver and not recorded
// yet: the driver freed the pool allocation, and the record made after it
// counted it on (its pool counted above its reserve at the next trim, and
// at a refusal's reclaim: issue 32's pools shape in the chaos suite).
int freed_while_recording(std::size_t bytes, int delay_ms) {
  DyingContext d(bytes);
  d.destroy.join();
  CUdeviceptr p = 0;
  CUresult rc = CUDA_ERROR_UNKNOWN;
  std::thread alloc([&] {
    check(cuCtxSetCurrent(use_primary(0)), "cuCtxSetCurrent");
    rc = cuMemAllocFromPoolAsync(&p, bytes, d.pool, d.s);  // recorded after the delayed reserve query
  });
  sleep_ms(delay_ms);
  const CUresult stale = cuMemFree(d.gone);  // the driver frees whatever holds the address now
  alloc.join();
  check(cuStreamSynchronize(d.s), "cuStreamSynchronize");
  check(cuMemPoolTrimTo(d.pool, 0), "cuMemPoolTrimTo");
  check(cuStreamSynchronize(d.s), "cuStreamSynchronize");
  std::printf("freed-while-recording rc=%d stale=%d destroyed=%d same=%d counted=%lld held=%lld\n",
              static_cast<int>(rc), static_cast<int>(stale), static_cast<int>(d.destroyed), p == d.gone ? 1 : 0,
              counted_used(), held_allocations());
  return 0;
}

// A program's allocation from a pool it is destroying (another thread): the
// growth waited for the pool's mutex while the destroy held it, then counted
// its chunks on the destroyed pool's record after the destroy had released
// that record's count (finalize_if_drained: exactly once); the driver
// refused the allocation and the chunks stayed counted until the process
// ended.
int destroyed_while_growing(std::size_t bytes, int delay_ms) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  const CUmemoryPool pool = new_pool(0);
  CUresult destroyed = CUDA_ERROR_UNKNOWN;
  std::thread destroy([&] {
    cuCtxSetCurrent(ctx);
    destroyed = cuMemPoolDestroy(pool);  // its reconciliation's reserve query answered late
  });
  sleep_ms(delay_ms);
  CUdeviceptr p = 0;
  const CUresult rc = cuMemAllocFromPoolAsync(&p, bytes, pool, s);
  destroy.join();
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  std::printf("destroyed-while-growing rc=%d destroyed=%d counted=%lld held=%lld\n", static_cast<int>(rc),
              static_cast<int>(destroyed), counted_used(), held_allocations());
  return 0;
}

// A growth counted an allocation then in flight on the fast path, and the
// reconciliation after it kept that count (the allocation in
// `outstanding`); the allocation then failed in the driver, and the pool
// stayed counted a whole allocation above its reserve, unmarked, so that
// synchronisations skipped it (issue 32: the chaos suite's pools shape,
// seed 2,005,047: 18 MiB counted, 14 MiB reserved and outstanding).
int failed_in_flight(std::size_t bytes) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  const CUstream s2 = new_stream();
  CUmemoryPool pool = nullptr;
  check(cuDeviceGetMemPool(&pool, 0), "cuDeviceGetMemPool");
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, bytes, s), "cuMemAllocAsync");  // counted: the pool grew
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");            // still counted: the pool keeps it
  CUresult rc = CUDA_ERROR_UNKNOWN;
  CUdeviceptr pa = 0;
  std::thread alloc([&] {
    cuCtxSetCurrent(ctx);
    rc = cuMemAllocAsync(&pa, bytes, s2);  // fits the count: the fast path, delayed in the driver
  });
  sleep_ms(100);
  CUdeviceptr q = 0;
  check(cuMemAllocFromPoolAsync(&q, bytes, pool, s), "cuMemAllocFromPoolAsync");  // grows the count for both
  check(cuStreamDestroy(s2), "cuStreamDestroy");  // the delayed allocation's stream: it fails
  alloc.join();
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  std::printf("failed-in-flight rc=%d counted=%lld held=%lld\n", static_cast<int>(rc), counted_used(),
              held_allocations());
  check(cuMemFreeAsync(q, s), "cuMemFreeAsync");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  return 0;
}

// A pool free the driver refused (its stream gone with a context) puts the
// record back; a free without a record (another thread's, a stale pointer at
// the address) freed the allocation in the driver while the record was out,
// and the record put back after it counted a pool allocation the device no
// longer held (issue 32, the chaos suite's pools shape: seed 2,004,964's
// record of nothing, a candidate).
int refused_free_freed_meanwhile(std::size_t bytes) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  const CUstream gone = new_stream();
  CUmemoryPool pool = nullptr;
  check(cuDeviceGetMemPool(&pool, 0), "cuDeviceGetMemPool");
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, bytes, s), "cuMemAllocAsync");
  check(cuStreamDestroy(gone), "cuStreamDestroy");
  CUresult refused = CUDA_ERROR_UNKNOWN;
  std::thread free_async([&] {
    cuCtxSetCurrent(ctx);
    refused = cuMemFreeAsync(p, gone);  // its record out while the driver waits, then refused
  });
  sleep_ms(100);
  const CUresult freed = cuMemFree(p);  // no record (the other free holds it): the driver frees it
  free_async.join();
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  check(cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo");
  std::printf("refused-free-freed-meanwhile refused=%d freed=%d counted=%lld held=%lld\n", static_cast<int>(refused),
              static_cast<int>(freed), counted_used(), held_allocations());
  return 0;
}

// A free without a record (a stale pointer) freed a pool allocation of ours
// still unrecorded; a synchronisation trimmed its memory while the pool was
// clean (reconciled since that allocation's mark) and skipped it; the record
// settled after (settle_freed_behind) gave its bytes back to `outstanding`
// only: the pool stayed counted at the reserve it no longer held until the
// next synchronisation.
int settled_after_trim(std::size_t bytes, int delay_ms) {
  {
    use_primary(0);
    const CUstream s0 = new_stream();
    CUdeviceptr first = 0;
    check(cuMemAllocAsync(&first, bytes, s0), "cuMemAllocAsync");  // counted: the pool grew
    check(cuMemFreeAsync(first, s0), "cuMemFreeAsync");            // the pool keeps it; the address is free
  }
  DyingContext d(bytes);
  d.destroy.join();
  const CUcontext ctx = use_primary(0);
  CUdeviceptr p = 0;
  CUresult rc = CUDA_ERROR_UNKNOWN;
  std::thread alloc([&] {
    cuCtxSetCurrent(ctx);
    rc = cuMemAllocAsync(&p, bytes, d.s);  // fits the count: the fast path, recorded late, settled later
  });
  sleep_ms(delay_ms / 10);
  std::thread first_sync([&] {
    cuCtxSetCurrent(ctx);
    cuStreamSynchronize(d.s);  // reconciles the pool (the allocation outstanding): clean
  });
  std::thread second_sync([&] {
    cuCtxSetCurrent(ctx);
    sleep_ms(delay_ms + delay_ms / 2);  // after the first reconciliation, before the settle
    cuStreamSynchronize(d.s);           // the driver trims the freed allocation's memory
  });
  sleep_ms(delay_ms / 10);
  const CUresult stale = cuMemFree(d.gone);  // no record: the driver frees the pool allocation at the address
  alloc.join();
  first_sync.join();
  second_sync.join();
  std::printf("settled-after-trim rc=%d stale=%d same=%d counted=%lld held=%lld\n", static_cast<int>(rc),
              static_cast<int>(stale), p == d.gone ? 1 : 0, counted_used(), held_allocations());
  return 0;
}

// A synchronisation between the driver's free of a pool allocation and the
// library's: the driver trimmed the freed reserve, and the reconciliation
// skipped the pool, unmarked since the last one (the free marked it only
// once back); the pool stayed counted at the reserve it no longer held until
// the next synchronisation (issue 32, the chaos suite's pools shape: seed
// 2,005,144, `counted` 4 MiB, nothing outstanding, no reserve).
int freed_during_sync(std::size_t bytes, bool memfree) {
  const CUcontext ctx = use_primary(0);
  const CUstream s = new_stream();
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, bytes, s), "cuMemAllocAsync");  // counted: the pool grew
  check(cuStreamSynchronize(s), "cuStreamSynchronize");     // reconciled: counted at the reserve, unmarked
  CUresult freed = CUDA_ERROR_UNKNOWN;
  std::thread free_async([&] {
    cuCtxSetCurrent(ctx);
    freed = memfree ? cuMemFree(p) : cuMemFreeAsync(p, s);  // freed in the driver at once, back late
  });
  sleep_ms(100);
  check(cuStreamSynchronize(s), "cuStreamSynchronize");  // the driver trims the freed reserve
  free_async.join();
  std::printf("freed-during-sync freed=%d counted=%lld held=%lld\n", static_cast<int>(freed), counted_used(),
              held_allocations());
  return 0;
}

}  // namespace gpuslice::probe::pool_race
