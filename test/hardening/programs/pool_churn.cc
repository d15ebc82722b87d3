// pool_churn SEED MS THREADS SETPOOL: THREADS threads of one process churn
// stream-ordered pools for MS milliseconds (test/hardening/pool_race_test.cc):
// cuMemAllocAsync, cuMemAllocFromPoolAsync from a pool of their own, both
// frees (cuMemFreeAsync, cuMemFree), stream and context synchronisation,
// cuMemPoolTrimTo, release thresholds, destroy and recreate of their pool,
// and with SETPOOL=1 cuDeviceSetMemPool among the pools. The decisions come
// from SEED.
// A test-local observer of the simulated driver (fakecuda_query.h,
// "Observers"; not the chaos monitor, which this program does not link)
// looks, at every change of this process's device memory on device 0 (under
// the state lock for a grant), at what the device holds for the process
// (allocations and its context) and compares it with GPUSLICE_MEMORY_LIMIT
// (whole MiB: "512Mi"). Prints one line:
//   churn checks=N violations=N max_held=BYTES max_over=BYTES ok=N oom=N
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "fakecuda_query.h"

namespace {

constexpr std::uint64_t kMi = std::uint64_t{1} << 20;

std::atomic<int> g_active{0};
std::atomic<int> g_slot{-1};
std::uint64_t g_quota = 0;
std::atomic<std::uint64_t> g_checks{0}, g_violations{0}, g_max_held{0};
char g_first[16384];  // the operations before the first violation

void look() {
  if (g_active.load(std::memory_order_acquire) == 0) return;
  fakecuda_slot_info s{};
  if (fakecuda_slot_info_get(g_slot.load(std::memory_order_relaxed), 0, &s) == 0) return;
  g_checks.fetch_add(1, std::memory_order_relaxed);
  std::uint64_t seen = g_max_held.load(std::memory_order_relaxed);
  while (s.held_bytes > seen && !g_max_held.compare_exchange_weak(seen, s.held_bytes)) {}
  if (s.held_bytes > g_quota && g_violations.fetch_add(1, std::memory_order_relaxed) == 0)
    fakecuda_recent_operations(g_first, sizeof(g_first), 40);  // printed at the end
}

int on_attach(int slot, unsigned) {
  g_slot.store(slot, std::memory_order_relaxed);
  return 1;
}
void on_charged(int, unsigned dev, std::uint64_t, int, const char*, const char*) {
  if (dev == 0) look();
}
void on_uncharged(int, unsigned dev, std::uint64_t, int, const char*) {
  if (dev == 0) look();
}
const fakecuda_observer kObserver{nullptr, on_attach, on_charged, on_uncharged};
[[gnu::constructor]] void register_observer() { fakecuda_set_observer(&kObserver); }

struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  std::uint64_t below(std::uint64_t n) { return next() % n; }
};

std::atomic<int> g_stop{0};
std::atomic<std::uint64_t> g_ok{0}, g_oom{0};
CUmemoryPool g_default = nullptr;

CUmemoryPool make_pool() {
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  CUmemoryPool pool = nullptr;
  return cuMemPoolCreate(&pool, &props) == CUDA_SUCCESS ? pool : nullptr;
}

void set_threshold(CUmemoryPool pool, std::uint64_t bytes) {
  cuuint64_t t = bytes;
  cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t);
}

std::uint64_t size_of(Rng& r) {
  switch (r.below(4)) {
    case 0: return 1 + r.below(kMi);            // under a chunk
    case 1: return (1 + r.below(8)) * 2 * kMi;  // whole chunks
    default: return 1 + r.below(24 * kMi);      // anything up to 24 MiB
  }
}

void churn(CUcontext ctx, std::uint64_t seed, int index, bool setpool) {
  cuCtxSetCurrent(ctx);
  Rng r{seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(index) * 0x2545f4914f6cdd1dull + 1};
  CUstream s = nullptr;
  cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  CUmemoryPool own = make_pool();
  struct Live {
    CUdeviceptr p;
    std::uint64_t bytes;
  };
  std::vector<Live> live;
  std::uint64_t held = 0;
  const auto free_one = [&] {
    if (live.empty()) return;
    const std::size_t i = r.below(live.size());
    const Live l = live[i];
    live[i] = live.back();
    live.pop_back();
    held -= l.bytes;
    if (r.below(4) == 0)
      cuMemFree(l.p);
    else
      cuMemFreeAsync(l.p, s);
  };
  while (g_stop.load(std::memory_order_relaxed) == 0) {
    const std::uint64_t op = r.below(100);
    if (op < 50) {
      if (held > 160 * kMi) {
        free_one();
        continue;
      }
      const std::uint64_t bytes = size_of(r);
      CUdeviceptr p = 0;
      const CUresult rc =
          (op < 28 || own == nullptr) ? cuMemAllocAsync(&p, bytes, s) : cuMemAllocFromPoolAsync(&p, bytes, own, s);
      if (rc == CUDA_SUCCESS) {
        live.push_back({p, bytes});
        held += bytes;
        g_ok.fetch_add(1, std::memory_order_relaxed);
      } else {
        g_oom.fetch_add(1, std::memory_order_relaxed);
      }
    } else if (op < 78) {
      free_one();
    } else if (op < 84) {
      cuStreamSynchronize(s);
    } else if (op < 86) {
      cuCtxSynchronize();
    } else if (op < 90) {
      cuMemPoolTrimTo(r.below(2) == 0 || own == nullptr ? g_default : own, r.below(3) * 16 * kMi);
    } else if (op < 94) {
      const std::uint64_t t = r.below(3) == 0 ? ~std::uint64_t{0} : r.below(3) * 32 * kMi;
      set_threshold(r.below(2) == 0 || own == nullptr ? g_default : own, t);
    } else if (op < 97) {
      if (own != nullptr) cuMemPoolDestroy(own);  // its allocations stay live, freed later
      own = make_pool();
    } else if (setpool) {
      cuDeviceSetMemPool(0, r.below(2) == 0 || own == nullptr ? g_default : own);
    }
  }
  while (!live.empty()) free_one();
  cuStreamSynchronize(s);
  if (own != nullptr) cuMemPoolDestroy(own);
  cuStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: pool_churn SEED MS THREADS SETPOOL\n");
    return 64;
  }
  const std::uint64_t seed = std::strtoull(argv[1], nullptr, 10);
  const int ms = std::atoi(argv[2]);
  const int threads = std::atoi(argv[3]);
  const bool setpool = std::atoi(argv[4]) != 0;
  const char* limit = std::getenv("GPUSLICE_MEMORY_LIMIT");
  g_quota = (limit != nullptr ? std::strtoull(limit, nullptr, 10) : 0) * kMi;
  if (g_quota == 0) {
    std::fprintf(stderr, "pool_churn: GPUSLICE_MEMORY_LIMIT=<n>Mi expected\n");
    return 64;
  }
  if (cuInit(0) != CUDA_SUCCESS) return 2;
  CUcontext ctx = nullptr;
  if (cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return 2;
  if (cuDeviceGetDefaultMemPool(&g_default, 0) != CUDA_SUCCESS) return 2;
  g_active.store(1, std::memory_order_release);
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back(churn, ctx, seed, i, setpool);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  g_stop.store(1, std::memory_order_relaxed);
  for (auto& t : pool) t.join();
  g_active.store(0, std::memory_order_release);
  const std::uint64_t max_held = g_max_held.load();
  std::printf("churn checks=%llu violations=%llu max_held=%llu max_over=%llu ok=%llu oom=%llu\n",
              static_cast<unsigned long long>(g_checks.load()), static_cast<unsigned long long>(g_violations.load()),
              static_cast<unsigned long long>(max_held),
              static_cast<unsigned long long>(max_held > g_quota ? max_held - g_quota : 0),
              static_cast<unsigned long long>(g_ok.load()), static_cast<unsigned long long>(g_oom.load()));
  if (g_first[0] != '\0') std::fprintf(stderr, "pool_churn: the operations before the first violation:\n%s", g_first);
  cuDevicePrimaryCtxRelease(0);
  return 0;
}
