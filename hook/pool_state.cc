// Pool records, their registry, and the slow paths of pool accounting
// (pool_state.h has the model; docs/memory.md the reasoning).
#include "hook/pool_state.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <new>

#include "hook/address_gone.h"
#include "hook/log.h"
#include "hook/oversub.h"
#include "hook/wrap.h"
#include "limiter/memory_accounting.h"
#include "platform/clock.h"

namespace gpuslice::hook::pools {

constinit std::atomic<std::uint32_t> g_slots_used{0};
constinit PoolState g_states[kMaxPools];
// Handle -> slot, direct-mapped, slot + 1 (0 = empty). A hit is verified
// against the slot's handle, so a stale or colliding word only costs a miss.
constinit std::atomic<std::uint32_t> g_cache[1u << kCacheBits];
// The current pool of each device (what cuMemAllocAsync allocates from), or
// nullptr until the driver was asked.
constinit std::atomic<PoolState*> g_current[kMaxDevices];

namespace {
constinit NoDestroy<platform::PointerTable<PoolRecord>>
    g_records_storage;  // never destroyed: calls made during exit find it
}  // namespace
// Live allocations: device pointer -> its pool's slot and its size.
constinit platform::PointerTable<PoolRecord>& g_records = g_records_storage.value;

namespace {

// Slot allocation and the handle cache's misses (slow paths only).
constinit NoDestroy<std::mutex> g_registry_mu;

// The generation makes a current-pool lookup that raced with
// cuDeviceSetMemPool / destroy leave the cache empty.
std::atomic<std::uint32_t> g_current_gen[kMaxDevices];

// The pool whose mutex this thread holds while it reserves growth: the
// reclaim hook that reserve() runs before refusing must skip it.
[[gnu::tls_model("initial-exec")]] constinit thread_local PoolState* t_growing = nullptr;

void cache(CUmemoryPool pool, std::uint32_t index) noexcept {
  g_cache[cache_home(pool)].store(index + 1, std::memory_order_release);
}

PoolState* scan_locked(CUmemoryPool pool) noexcept {
  const std::uint32_t n = g_slots_used.load(std::memory_order_relaxed);
  for (std::uint32_t i = 0; i < n; ++i) {
    if (g_states[i].handle.load(std::memory_order_relaxed) == pool) {
      cache(pool, i);
      return &g_states[i];
    }
  }
  return nullptr;
}

// Pool bytes went back to the container's budget: allocations waiting for
// memory (GPUSLICE_OVERSUBSCRIBE=wait) may go on.
void give_back(int entry, std::uint64_t bytes) noexcept {
  release(entry, bytes);
  oversub_freed(entry, limiter::AllocKind::pool, bytes);
}

bool reserve_of(CUmemoryPool pool, std::uint64_t* out) noexcept {
  cuuint64_t v = 0;
  if (pool == nullptr || real_cuMemPoolGetAttribute == nullptr ||
      real_cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
    return false;
  *out = v;
  return true;
}

// A forked child holds none of its parent's memory in its own region slot,
// and CUDA does not survive fork(): it starts with no pools (the pointer
// records drop themselves in a child). Locks a parent's thread held at the
// fork are made anew. (Children made without fork handlers — _Fork, raw
// clone — keep the parent's records until their pools are reconciled.)
void reset_in_child() noexcept {
  new (&*g_registry_mu) std::mutex;
  for (PoolState& st : g_states) {
    new (&st.mu) std::mutex;
    st.handle.store(nullptr, std::memory_order_relaxed);
    st.in_use.store(0, std::memory_order_relaxed);
    st.outstanding.store(0, std::memory_order_relaxed);
    st.counted.store(0, std::memory_order_relaxed);
    st.dirty.store(0, std::memory_order_relaxed);
    st.made_current.store(0, std::memory_order_relaxed);
  }
  for (auto& w : g_cache) w.store(0, std::memory_order_relaxed);
  for (auto& c : g_current) c.store(nullptr, std::memory_order_relaxed);
  g_slots_used.store(0, std::memory_order_release);
}
std::atomic<bool> g_atfork_registered{false};

}  // namespace

PoolState* find_slow(CUmemoryPool pool) noexcept {
  if (pool == nullptr || g_slots_used.load(std::memory_order_acquire) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(*g_registry_mu);
  return scan_locked(pool);
}

PoolState* track(CUmemoryPool pool, int entry, bool host) noexcept {
  if (pool == nullptr) return nullptr;
  if (!g_atfork_registered.exchange(true, std::memory_order_acq_rel)) pthread_atfork(nullptr, nullptr, reset_in_child);
  std::lock_guard<std::mutex> lock(*g_registry_mu);
  if (PoolState* known = scan_locked(pool)) return known;
  const std::uint32_t n = g_slots_used.load(std::memory_order_relaxed);
  std::uint32_t i = 0;
  while (i < n && g_states[i].in_use.load(std::memory_order_acquire) != 0) ++i;
  if (i == kMaxPools) {
    GPUSLICE_WARN_CAPPED(1,
                         "more than %u memory pools in use at once; allocations from further pools are "
                         "refused with CUDA_ERROR_OUT_OF_MEMORY",
                         kMaxPools);
    return nullptr;
  }
  PoolState& st = g_states[i];
  st.outstanding.store(0, std::memory_order_relaxed);
  st.counted.store(0, std::memory_order_relaxed);
  st.dirty.store(0, std::memory_order_relaxed);
  st.destroyed.store(0, std::memory_order_relaxed);
  st.finalized.store(0, std::memory_order_relaxed);
  st.made_current.store(0, std::memory_order_relaxed);
  st.entry.store(entry, std::memory_order_relaxed);
  st.host.store(host ? 1 : 0, std::memory_order_relaxed);
  st.in_use.store(1, std::memory_order_relaxed);
  st.handle.store(pool, std::memory_order_release);
  if (i == n) g_slots_used.store(n + 1, std::memory_order_release);
  cache(pool, i);
  return &st;
}

PoolState* current_pool_slow(int ordinal, CUresult* rc) noexcept {
  if (ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices) {
    *rc = CUDA_ERROR_INVALID_DEVICE;
    return nullptr;
  }
  const std::uint32_t gen = g_current_gen[ordinal].load(std::memory_order_acquire);
  CUmemoryPool pool = nullptr;
  if ((*rc = real_cuDeviceGetMemPool(&pool, ordinal)) != CUDA_SUCCESS) return nullptr;
  const int entry = device_entry(ordinal);
  PoolState* st = entry >= 0 ? track(pool, entry, false) : nullptr;
  if (st == nullptr) {
    *rc = CUDA_ERROR_OUT_OF_MEMORY;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(*g_registry_mu);
  if (g_current_gen[ordinal].load(std::memory_order_relaxed) == gen)
    g_current[ordinal].store(st, std::memory_order_release);
  return st;
}

void forget_current(int ordinal) noexcept {
  if (ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices) return;
  std::lock_guard<std::mutex> lock(*g_registry_mu);
  g_current_gen[ordinal].fetch_add(1, std::memory_order_relaxed);
  g_current[ordinal].store(nullptr, std::memory_order_release);
}

void forget_current(const PoolState* st) noexcept {
  std::lock_guard<std::mutex> lock(*g_registry_mu);
  for (unsigned d = 0; d < kMaxDevices; ++d) {
    if (g_current[d].load(std::memory_order_relaxed) != st) continue;
    g_current_gen[d].fetch_add(1, std::memory_order_relaxed);
    g_current[d].store(nullptr, std::memory_order_release);
  }
}

PoolState* current_pool_after_destroy(int ordinal, CUresult* rc) noexcept {
  forget_current(ordinal);
  PoolState* st = current_pool_slow(ordinal, rc);
  if (st != nullptr && st->destroyed.load(std::memory_order_seq_cst) != 0) {
    *rc = CUDA_ERROR_OUT_OF_MEMORY;
    return nullptr;
  }
  return st;
}

Grow grow_locked(PoolState& st, std::uint64_t bytes, std::uint64_t* held) noexcept {
  const std::uint64_t c = st.counted.load(std::memory_order_seq_cst);
  const std::uint64_t now = st.outstanding.load(std::memory_order_seq_cst);  // ours included
  if (now <= c) return Grow::ok;  // another thread grew it meanwhile, or others' requests ended
  // Grow to cover what is outstanding, but by at most this allocation's own
  // chunks: another thread's request still in flight (perhaps one above the
  // quota, about to be refused) must not make this one fail. Every admitted
  // allocation stays covered: either the new value covers all that is
  // outstanding, or it adds this one's bytes to a value that covered the rest
  // (a fast-path allocation added before this one and not yet judged is
  // judged against the new value with this one's bytes in `outstanding`).
  std::uint64_t target = round_chunk(now);
  if (const std::uint64_t own = round_chunk(c + bytes); own < target) target = own;
  const std::uint64_t need = target - c;
  const int entry = st.entry.load(std::memory_order_relaxed);
  t_growing = &st;
  const bool ok = reserve(entry, need);
  t_growing = nullptr;
  if (!ok) return Grow::refused;
  // Over the device-resident allowance (pool memory cannot spill): under
  // `wait` the caller waits with `need` reserved but without the pool's
  // mutex, so that the pool's own frees and reconciliations can lower its
  // count meanwhile (a reconciliation only try-locks the mutex).
  if (oversubscribing() && over_allowance(entry)) {
    if (config().options.oversubscribe == options::kOversubscribeWait) {
      *held = need;
      return Grow::wait;
    }
    if (!resident_admits(entry)) {
      give_back(entry, need);
      return Grow::refused;
    }
  }
  st.counted.store(target, std::memory_order_seq_cst);
  return Grow::ok;
}

void reconcile_locked(PoolState& st, bool unknown_is_empty) noexcept {
  if (st.destroyed.load(std::memory_order_relaxed) != 0 || st.host.load(std::memory_order_relaxed) != 0) return;
  const std::uint64_t before = st.counted.load(std::memory_order_relaxed);
  // `outstanding` keeps `counted` from dropping below what allocations that
  // passed the fast path use, but never raises it: it also holds allocations
  // still in flight towards grow_locked(), which reserve their own chunks
  // against the quota (charge() here would admit them unchecked). Those that
  // passed the fast path saw `outstanding` <= counted <= `before`.
  const auto covered = [&st, before]() noexcept {
    const std::uint64_t in_use = round_chunk(st.outstanding.load(std::memory_order_seq_cst));
    return in_use < before ? in_use : before;
  };
  // The reserve read is only good with the `outstanding` reads after it if no
  // allocation or free of the pool came between them: a fast-path allocation
  // and its free there grow the reserve the first read missed and leave
  // `outstanding` as it was. Every allocation and free marks the pool dirty
  // (after its add, before its driver call; after its subtraction), so the
  // mark is cleared first and looked at after the last read: set, a lowered
  // count is put back and the reads taken again (3 tries), then nothing is
  // lowered until the next synchronisation looks again.
  std::uint64_t target = before;
  bool consistent = false;
  std::uint64_t reserved = 0;
  for (int attempt = 0; attempt < 3 && !consistent; ++attempt) {
    st.dirty.store(0, std::memory_order_seq_cst);
    reserved = 0;
    if (!reserve_of(st.handle.load(std::memory_order_relaxed), &reserved)) {
      if (!unknown_is_empty) {  // the driver cannot say: keep what is counted
        st.dirty.store(1, std::memory_order_relaxed);
        return;
      }
      reserved = 0;
    }
    target = reserved;
    const std::uint64_t in_use = covered();
    if (in_use > target) target = in_use;
    if (target < before) {
      // Lowering races with allocations that passed the fast-path test
      // against the old value: publish the new value, then look at
      // `outstanding` again (both seq_cst, as the fast path's add and load):
      // any allocation that saw the old value is in this second read and
      // stays covered.
      st.counted.store(target, std::memory_order_seq_cst);
      const std::uint64_t again = covered();
      if (again > target) {
        target = again;
        st.counted.store(target, std::memory_order_seq_cst);
      }
    }
    consistent = st.dirty.load(std::memory_order_seq_cst) == 0;
    if (!consistent && target < before) st.counted.store(before, std::memory_order_seq_cst);  // nothing released yet
  }
  if (!consistent) {
    if (target < before) target = before;          // raced by the pool's allocations: lower nothing now
    st.dirty.store(1, std::memory_order_relaxed);  // the next synchronisation looks again
  }
  if (target > before) st.counted.store(target, std::memory_order_seq_cst);
  // Counted above the driver's reserve (for allocations in flight, which the
  // driver may serve from the reserve: counted for nothing once they are
  // freed), or not read consistently: the pool's next free looks again.
  st.above_reserve.store(!consistent || target > reserved ? 1 : 0, std::memory_order_relaxed);
  // Still holding more than its allocations (a release threshold): a later
  // synchronisation may release the rest.
  if (target > round_chunk(st.outstanding.load(std::memory_order_relaxed))) mark_dirty(st);
  const int entry = st.entry.load(std::memory_order_relaxed);
  if (target < before) {
    give_back(entry, before - target);
  } else if (target > before && !charge(entry, target - before)) {
    GPUSLICE_WARN_CAPPED(3,
                         "a memory pool's reserve grew beyond what was reserved for it; the container is "
                         "over its quota until the pool is trimmed");
  }
}

// A pool another thread holds is left to it: a growth and a reconciliation
// read `outstanding` again after this free's mark (reconcile_locked).
void reconcile_after_free(PoolState& st) noexcept {
  if (!st.mu.try_lock()) return;
  if (st.in_use.load(std::memory_order_acquire) != 0) reconcile_locked(st, false);
  st.mu.unlock();
}

void finalize_if_drained(PoolState& st) noexcept {
  if (st.destroyed.load(std::memory_order_seq_cst) == 0) return;
  if (st.outstanding.load(std::memory_order_seq_cst) != 0) return;
  if (st.finalized.exchange(1, std::memory_order_acq_rel) != 0) return;
  const std::uint64_t c = st.counted.exchange(0, std::memory_order_acq_rel);
  if (c != 0 && st.host.load(std::memory_order_relaxed) == 0) give_back(st.entry.load(std::memory_order_relaxed), c);
  st.in_use.store(0, std::memory_order_release);  // the slot may serve a new pool
}

// Reclaims run by threads that hold a pool's mutex (growing it, t_growing:
// their reservation is being refused). A reclaim waits for a busy pool's
// mutex (lock_busy_pool) only while none runs: such a thread may be waiting
// for our reclaim to end (await_other_reclaims) with the mutex held.
std::atomic<std::uint32_t> g_growers_reclaiming{0};
struct GrowerReclaiming {
  const bool on = t_growing != nullptr;
  GrowerReclaiming() noexcept {
    if (on) g_growers_reclaiming.fetch_add(1, std::memory_order_seq_cst);
  }
  ~GrowerReclaiming() {
    if (on) g_growers_reclaiming.fetch_sub(1, std::memory_order_seq_cst);
  }
  GrowerReclaiming(const GrowerReclaiming&) = delete;
  GrowerReclaiming& operator=(const GrowerReclaiming&) = delete;
};

// A pool another thread holds: it grows it (the driver call and the settle,
// microseconds), reconciles or destroys it. A reconciliation that skipped it
// (a synchronisation's, a trim's) left its count above its reserve by all
// the driver trimmed, and a refusal that skipped it too refused with room
// (the chaos suite's `pool` + `fill` refusals, in this process or another).
// So reconciliations and the refusal's reclaim wait for it, bounded
// (kReclaimWaitNs), polling with a sleep that doubles from 10 to 200 us; a
// reclaim gives up (skips the pool) while another thread holding a pool's
// mutex is in its own reclaim (it may be waiting for ours).
bool lock_busy_pool(PoolState& st) noexcept {
  if (st.mu.try_lock()) return true;
  const std::uint32_t self = t_growing != nullptr ? 1u : 0u;
  const std::uint64_t deadline = platform::monotonic_ns() + kReclaimWaitNs;
  platform::Backoff backoff(10'000, 200'000);
  while (g_growers_reclaiming.load(std::memory_order_seq_cst) <= self && platform::monotonic_ns() < deadline) {
    backoff.pause();
    if (st.mu.try_lock()) return true;
  }
  return false;
}

void reconcile_dirty() noexcept {
  const std::uint32_t n = g_slots_used.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) {
    PoolState& st = g_states[i];
    if (st.dirty.load(std::memory_order_relaxed) == 0) continue;
    // Busy (another thread grows, reconciles or destroys it): waited for,
    // bounded (lock_busy_pool); given up, it stays dirty for the next sync.
    if (!lock_busy_pool(st)) continue;
    st.dirty.store(0, std::memory_order_relaxed);
    // A pool that still holds more than its allocations (a release threshold,
    // or a sync of another device that did not trim it) stays dirty: a later
    // synchronisation may release the rest.
    if (st.in_use.load(std::memory_order_acquire) != 0) reconcile_locked(st, false);
    if (st.counted.load(std::memory_order_relaxed) > round_chunk(st.outstanding.load(std::memory_order_relaxed)))
      st.dirty.store(1, std::memory_order_relaxed);
    st.mu.unlock();
  }
}

// Reclaims of this process in flight, and a word each one bumps at its end
// (a private futex: await_other_reclaims sleeps on it).
std::atomic<std::uint32_t> g_reclaiming{0};
std::atomic<std::uint32_t> g_reclaims_ended{0};

void await_other_reclaims() noexcept {
  const GrowerReclaiming grower;
  const std::uint64_t deadline = platform::monotonic_ns() + kReclaimWaitNs;
  for (;;) {
    const std::uint32_t seen = g_reclaims_ended.load(std::memory_order_seq_cst);
    if (g_reclaiming.load(std::memory_order_seq_cst) == 0) return;
    const std::uint64_t now = platform::monotonic_ns();
    if (now >= deadline) return;
    const std::uint64_t left = deadline - now;
    timespec ts{static_cast<time_t>(left / 1'000'000'000ull), static_cast<long>(left % 1'000'000'000ull)};
    syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&g_reclaims_ended), FUTEX_WAIT_PRIVATE, seen, &ts, nullptr, 0);
  }
}

bool reclaim_all() noexcept {
  const GrowerReclaiming grower;
  bool skipped = false;
  g_reclaiming.fetch_add(1, std::memory_order_seq_cst);
  struct Ended {
    ~Ended() {
      g_reclaiming.fetch_sub(1, std::memory_order_seq_cst);
      g_reclaims_ended.fetch_add(1, std::memory_order_seq_cst);
      syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&g_reclaims_ended), FUTEX_WAKE_PRIVATE, 0x7fffffff, nullptr,
              nullptr, 0);
    }
  } ended;
  const std::uint32_t n = g_slots_used.load(std::memory_order_acquire);
  for (std::uint32_t i = 0; i < n; ++i) {
    PoolState& st = g_states[i];
    if (&st == t_growing || st.in_use.load(std::memory_order_acquire) == 0 ||
        st.host.load(std::memory_order_relaxed) != 0 || st.destroyed.load(std::memory_order_relaxed) != 0)
      continue;
    if (!lock_busy_pool(st)) {
      skipped = true;
      continue;
    }
    CUmemoryPool pool = st.handle.load(std::memory_order_relaxed);
    if (pool != nullptr && st.destroyed.load(std::memory_order_relaxed) == 0 && real_cuMemPoolTrimTo != nullptr)
      real_cuMemPoolTrimTo(pool, 0);
    reconcile_locked(st, false);
    st.mu.unlock();
  }
  return skipped;
}

namespace {
// A record of memory the driver freed earlier without it (a free that found
// no record: a stale pointer at the address): a synchronisation since may
// have trimmed what that free gave back to the pool and skipped the pool,
// unmarked (the free could not mark it). Taken back as a free is, and the
// pool reconciled (freed(): a pool that may be counted above its reserve).
// Never under the pool's mutex (settle_freed_behind's callers hold none).
void freed_behind(PoolState& st, std::uint64_t bytes) noexcept {
  st.above_reserve.store(1, std::memory_order_relaxed);
  freed(st, bytes);
}
}  // namespace

// As a linear record is settled (limiter::settle_record: taken out before
// the driver is asked again; a new allocation at the address meanwhile is
// known to it, or recorded already and displaces ours).
void settle_freed_behind(CUdeviceptr ptr) noexcept {
  PoolRecord seen{};
  if (!g_records.find(ptr, &seen)) return;
  limiter::settle_record(
      g_records, ptr, seen, [](std::uint64_t key, const PoolRecord&) noexcept { return address_gone(key); },
      [](const PoolRecord& rec) noexcept { freed_behind(g_states[rec.slot], rec.bytes); });
}

// A record displaced by the stale-record rule (platform::record): its bytes
// went back to its pool (a cuMemFree racing with this allocation).
void settle_stale(const PoolRecord& rec) noexcept { freed(g_states[rec.slot], rec.bytes); }

namespace {

// The driver grows a pool in steps of its own choosing (the reserve size is
// implementation-defined): after a growth it may hold more than the chunks
// grow_locked() reserved. The excess is reserved against the quota (and the
// resident allowance: pool memory cannot spill; under `wait` this does not
// wait, the pool's mutex is held) before the allocation is handed out.
bool admit_excess(PoolState& st, std::uint64_t excess) noexcept {
  const int entry = st.entry.load(std::memory_order_relaxed);
  t_growing = &st;
  const bool ok = reserve(entry, excess);
  t_growing = nullptr;
  if (!ok) return false;
  if (oversubscribing() && over_allowance(entry) &&
      (config().options.oversubscribe == options::kOversubscribeWait || !resident_admits(entry))) {
    give_back(entry, excess);
    return false;
  }
  st.counted.fetch_add(excess, std::memory_order_seq_cst);
  return true;
}

// Holds the reserve the driver reports after a growth to what may be
// counted: true when it is counted (admitted, or trimmed back to the count).
bool settle_growth(PoolState& st) noexcept {
  CUmemoryPool pool = st.handle.load(std::memory_order_relaxed);
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::uint64_t reserved = 0;
    if (!reserve_of(pool, &reserved)) return true;  // the driver cannot say: reconcile_locked keeps the count
    const std::uint64_t c = st.counted.load(std::memory_order_seq_cst);
    if (reserved <= c || admit_excess(st, reserved - c)) return true;
    if (attempt == 0 && real_cuMemPoolTrimTo != nullptr)
      real_cuMemPoolTrimTo(pool, st.outstanding.load(std::memory_order_seq_cst));
  }
  return false;
}

// The allocation just made pushed the reserve past what may be counted:
// freed, in its stream's order, and the stream waited for so that the trim
// can release it (the driver keeps frees it has not seen complete).
void undo_growth(PoolState& st, CUdeviceptr dptr, std::uint64_t bytes, CUstream stream, bool per_thread) noexcept {
  st.outstanding.fetch_sub(bytes, std::memory_order_seq_cst);
  const auto free_async = per_thread ? real_cuMemFreeAsync_ptsz : real_cuMemFreeAsync;
  const auto synchronize = per_thread ? real_cuStreamSynchronize_ptsz : real_cuStreamSynchronize;
  const CUresult rc = free_async != nullptr ? free_async(dptr, stream) : CUDA_ERROR_NOT_SUPPORTED;
  if (rc == CUDA_SUCCESS && synchronize != nullptr) synchronize(stream);
  if (real_cuMemPoolTrimTo != nullptr)
    real_cuMemPoolTrimTo(st.handle.load(std::memory_order_relaxed), st.outstanding.load(std::memory_order_seq_cst));
  if (rc != CUDA_SUCCESS) {  // still allocated: stays counted (never short), the caller is told it failed
    GPUSLICE_WARN_CAPPED(3, "could not free a pool allocation refused after the pool's growth: %d",
                         static_cast<int>(rc));
    st.outstanding.fetch_add(bytes, std::memory_order_seq_cst);
  }
}

}  // namespace

CUresult alloc_growing(PoolState& st, std::uint64_t bytes, CUdeviceptr* dptr, CUstream stream, bool per_thread,
                       RealAllocFn real_alloc, void* ctx, bool* destroyed) noexcept {
  // A counting operation: its callers (pools.cc) bracket the whole
  // allocation, from the look at the pool to the settle (not nested here: a
  // nested bracket would read as finished while the outer one runs).
  // Not admitted yet: out of `outstanding` while this waits for the lock, so
  // that a request about to be refused (one above the quota, retried in a
  // loop) does not look outstanding to the pool's other allocations and
  // reconciliations all that time (they would grow the pool for it).
  st.outstanding.fetch_sub(bytes, std::memory_order_seq_cst);
  // Larger than the device's whole quota: refused without taking the lock or
  // showing in `outstanding` again (a program retrying it in a loop would
  // otherwise keep it there most of the time).
  if (bytes > limiter::quota_bytes(g_process.region, st.entry.load(std::memory_order_relaxed))) {
    finalize_if_drained(st);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (bytes > kHugeBytes) {   // no device has 2^48 bytes
    finalize_if_drained(st);  // destroyed meanwhile: we may have been its last
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  std::unique_lock<std::mutex> lock(st.mu);
  // Destroyed while this waited for the mutex (cuMemPoolDestroy holds it for
  // its last reconciliation and the driver call): the destroy may have
  // released the record's count already (finalize_if_drained, exactly once),
  // and a growth counted now would never be given back. Nothing is counted;
  // the caller treats the pool as destroyed, as when it saw the flag first.
  if (st.destroyed.load(std::memory_order_seq_cst) != 0) {
    lock.unlock();
    finalize_if_drained(st);  // we may have been its last
    *destroyed = true;
    return CUDA_ERROR_INVALID_VALUE;
  }
  st.outstanding.fetch_add(bytes, std::memory_order_seq_cst);
  std::uint64_t give_up = 0;  // waiting for the resident allowance: when it times out
  bool reconciled = false;    // refused once: the pool's count brought down, the growth tried again
  for (;;) {
    std::uint64_t held = 0;
    const Grow grown = grow_locked(st, bytes, &held);
    if (grown == Grow::ok) break;
    st.outstanding.fetch_sub(bytes, std::memory_order_seq_cst);
    const int entry = st.entry.load(std::memory_order_relaxed);
    bool admitted = false;
    if (grown == Grow::wait) {
      // Wait with `held` reserved (the allowance counts it) and the pool's
      // mutex free, then grow again from the start: the room may have gone
      // to another allocation meanwhile.
      lock.unlock();
      const std::uint64_t now = platform::monotonic_ns();
      if (give_up == 0) give_up = now + std::uint64_t{config().options.oversubscribe_wait} * 1'000'000ull;
      admitted = now < give_up && resident_admits(entry);
      give_back(entry, held);
      if (admitted) {
        lock.lock();
        st.outstanding.fetch_add(bytes, std::memory_order_seq_cst);
        continue;
      }
      lock.lock();
    }
    // Before refusing, the pool's own count is brought down to its reserve
    // (the reclaim that reserve() ran skipped this pool, whose mutex we
    // hold): the driver may have trimmed it meanwhile (a synchronisation of
    // another thread, whose reconciliation skipped the pool while we held it
    // and reclaimed), or a reconciliation kept it up for requests then in
    // `outstanding` that have ended since. Left as it was, those bytes stay
    // counted with nothing on the device until the next synchronisation:
    // this refusal, and any in the container meanwhile, refused with room.
    // If that gave bytes back, the growth is tried once more.
    if (!reconciled) {
      reconciled = true;
      const std::uint64_t before = st.counted.load(std::memory_order_seq_cst);
      reconcile_locked(st, false);
      if (st.counted.load(std::memory_order_seq_cst) < before) {
        st.outstanding.fetch_add(bytes, std::memory_order_seq_cst);
        continue;
      }
    }
    finalize_if_drained(st);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUresult rc = real_alloc(ctx);
  if (rc != CUDA_SUCCESS) {
    // Nothing was allocated: back to what the driver holds (nothing at all
    // for a pool it does not know), so a failed call changes no count.
    st.outstanding.fetch_sub(bytes, std::memory_order_seq_cst);
    reconcile_locked(st, true);
    finalize_if_drained(st);
    return rc;
  }
  // Settle on the reserve the driver reports: a reserve that grew by more
  // than the chunks we predicted is reserved now (or trimmed, or the
  // allocation refused), not charged unchecked at the next sync.
  if (!settle_growth(st)) {
    undo_growth(st, *dptr, bytes, stream, per_thread);
    *dptr = 0;
    reconcile_locked(st, false);
    finalize_if_drained(st);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  reconcile_locked(st, false);
  if (!record(*dptr, st, bytes)) record_failed();
  return rc;
}

CUresult settle_fast_growth(PoolState& st, std::uint64_t bytes, CUdeviceptr* dptr, CUstream stream,
                            bool per_thread) noexcept {
  std::lock_guard<std::mutex> lock(st.mu);
  if (!settle_growth(st)) {
    undo_growth(st, *dptr, bytes, stream, per_thread);
    *dptr = 0;
    reconcile_locked(st, false);
    finalize_if_drained(st);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (!record(*dptr, st, bytes)) record_failed();
  return CUDA_SUCCESS;
}

CUresult destroy(PoolState& st, CUmemoryPool pool) noexcept {
  {
    std::lock_guard<std::mutex> lock(st.mu);
    reconcile_locked(st, false);  // last look at its reserve
    // The driver may give the handle to the next pool created (by another
    // thread) as soon as this one is destroyed: the registry must not find
    // this record under it then (that pool would be charged here, then
    // again from nothing in a record of its own while its reserve held more).
    std::lock_guard<std::mutex> registry(*g_registry_mu);
    const CUresult rc = real_cuMemPoolDestroy(pool);
    if (rc != CUDA_SUCCESS) return rc;
    st.handle.store(nullptr, std::memory_order_release);  // lookups of the handle miss from now on
    st.destroyed.store(1, std::memory_order_seq_cst);
  }
  forget_current(&st);      // the driver makes the default pool current again
  finalize_if_drained(st);  // else the last free of an allocation from it does
  return CUDA_SUCCESS;
}

void reconcile_now(PoolState& st) noexcept {
  if (!lock_busy_pool(st)) {
    mark_dirty(st);  // busy past the bound: the next synchronisation looks again
    return;
  }
  reconcile_locked(st, false);
  st.mu.unlock();
}

void record_failed() noexcept {
  GPUSLICE_WARN_CAPPED(3, "pool allocation table full; the allocation stays counted until its pool is trimmed");
}

}  // namespace gpuslice::hook::pools
