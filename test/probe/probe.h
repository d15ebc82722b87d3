// gpuslice-probe, the one probe program: the programs the tests run under the
// preload library, against the simulated driver they link directly (as an
// application links libcuda). Every scenario is a row of one table
// (main.cc); each family of scenarios lives in its own file (memory.cc,
// pool.cc, ...), whose opening comment says what each of its scenarios does
// and prints. This header holds what they share (defined in probe.cc: a
// setup step or a figure the families take is written there once) and
// declares each family's scenarios for the table.
//
//   gpuslice-probe FAMILY SCENARIO ARGS...    (no argument: the table)
//
// Exit status: what the scenario returns (0: its CUDA calls behaved as
// documented, the test judges the printed numbers), 2 when a setup call
// failed (check), 64 for a wrong command line.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace gpuslice::probe {

inline constexpr std::size_t kMi = std::size_t{1} << 20;
inline constexpr std::size_t kKi = std::size_t{1} << 10;

// A setup call that must succeed: otherwise prints the call and its result
// and exits 2 (the test reports a setup failure, not a verdict).
void check(CUresult rc, const char* what);

// Setup steps the families share, each check()ed. A CUdevice is its ordinal
// (cuDeviceGet's answer in the simulator and in NVIDIA's driver).
CUcontext primary(CUdevice dev);      // the primary context of `dev`, retained
CUcontext use_primary(CUdevice dev);  // the same, made current in this thread
CUstream new_stream();                // a non-blocking stream of the current context
CUmemoryPool new_pool(int dev);       // a created pool of pinned memory on `dev`
CUmemoryPool new_pool(int dev, std::uint64_t release_threshold);
void set_release_threshold(CUmemoryPool pool, std::uint64_t bytes);
// A module image whose global `big` holds `bytes` (and an entry `k`): the
// simulator places that much device memory for it when it is loaded.
std::string image_with_global(std::size_t bytes);
// `name` of a module loaded from `image` into the current context.
CUfunction module_kernel(const std::string& image, const std::string& name);

// The two figures the scenarios print and compare. counted: what gpuslice
// charges the container on the current context's device (cuMemGetInfo's
// total - free under the library). held: what the simulated device holds for
// this process on `dev` (fakecuda_process_used_bytes), contexts included or
// allocations only.
long long counted_used();
long long held(int dev = 0);
long long held_allocations(int dev = 0);

// The rounds of a race in which gpuslice counted less than device 0 holds for
// the process (the count short), and the largest such gap.
struct Shortfall {
  int rounds = 0;
  long long max = 0;
  // Compares counted_used() with held(); returns whether they differ.
  bool observe();
};

// A thread that runs `step` again and again with `ctx` current until stopped
// (at the latest by the destructor). pause() returns once it waits between
// two steps, resume() once it runs again: the main thread looks at the
// figures meanwhile.
class Churn {
 public:
  Churn(CUcontext ctx, std::function<void()> step);
  ~Churn();
  Churn(const Churn&) = delete;
  Churn& operator=(const Churn&) = delete;
  void pause();
  void resume();
  void stop();

 private:
  std::atomic<bool> stop_{false}, pause_{false};
  std::atomic<int> paused_{0};
  std::thread thread_;  // last: starts once the flags exist
};

// A command line the table refuses: names the argument and what was expected.
struct BadArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A scenario's arguments (the words after its name), read strictly against
// the names of its usage line ("MIB ROUNDS [checkpoint]"): a word that is not
// what its place expects (or does not fit the type read) throws BadArgument
// naming the place.
class Args {
 public:
  Args(const char* usage, std::vector<std::string> words);
  std::size_t size() const { return words_.size(); }
  std::size_t mib(std::size_t i) const;  // a count of MiB, in bytes
  template <class T = long long>
  T number(std::size_t i) const {
    const long long value = whole(i);
    if (!std::in_range<T>(value))
      out_of_range(i, static_cast<long long>(std::numeric_limits<T>::min()),
                   static_cast<unsigned long long>(std::numeric_limits<T>::max()));
    return static_cast<T>(value);
  }
  double real(std::size_t i) const;
  const std::string& text(std::size_t i) const;
  // An optional last word: absent, or exactly `word`.
  bool flag(std::size_t i, const char* word) const;

 private:
  std::string name(std::size_t i) const;
  long long whole(std::size_t i) const;
  [[noreturn]] void out_of_range(std::size_t i, long long lo, unsigned long long hi) const;
  std::vector<std::string> names_, words_;
};

// Each family's scenarios (the table in main.cc gives their arguments).
namespace allowance {
int spill_race(std::size_t hold, std::size_t churn_size, std::size_t size, long rounds, std::uint64_t limit);
}
namespace compute {
int stream_device(const std::string& mode, unsigned us, long max_launches, double seconds);
int null_config();
int entry_points();
int legacy_launch(const std::string& name, unsigned us, long count);
int churn(unsigned us, long kernels);
int launch_then_exit(const std::string& where, long launches);
}  // namespace compute
namespace context {
int peak(std::size_t hold, int n, int free_after_ms);
int destroy_vs_realloc(int rounds);
int tries(int n);
}  // namespace context
namespace implicit {
int measure_vs_release(const std::string& measured, const std::string& kind, int rounds);
int set_limit(std::size_t bytes);
int lazy_library(std::size_t bytes, const std::string& how);
int library_per_context(std::size_t bytes, const std::string& how);
int module_load(std::size_t bytes);
int reset_vs_place(int rounds);
int unload_vs_reuse(int rounds);
int double_unload(int rounds);
int dead_handle_place(int rounds);
int shortcut_vs_drop(int rounds, const std::string& how);
int array_level_reuse(std::size_t bytes, int mipmaps, int rounds);
}  // namespace implicit
namespace memory {
int vmm_retain(std::size_t bytes, int rounds);
int vmm_import(std::size_t bytes, int rounds);
int pool_destroy_live(std::size_t bytes, int rounds, bool sync_free);
int pool_other_device(std::size_t bytes, int rounds, bool foreign_pool);
int host_located(std::size_t bytes, int rounds);
int module_memory(std::size_t bytes);
int pool_failed(std::size_t bytes);
int free_async_linear(std::size_t bytes, int rounds);
int ctx_destroy_live(std::size_t bytes, int rounds, bool primary_reset, bool arrays);
int ctx_race(int tries);
int refused_free_reuse(std::size_t bytes, int delay_ms);
}  // namespace memory
namespace gate {
int stuck_release(std::size_t bytes, bool keep);
int hold_cpu(int threads, bool drain);
}  // namespace gate
namespace reserve {
int thread_exit(int threads, std::size_t bytes, std::size_t big);
int idle(int threads, std::size_t bytes, std::size_t big);
int shown(std::size_t bytes);
int shown_held(std::size_t bytes, const std::string& ready, const std::string& go);
int lowered(int threads, std::size_t bytes, const std::string& ready, const std::string& go);
}  // namespace reserve
namespace holder {
int fork_child(std::size_t bytes);
int fork_late(const std::string& go);
[[noreturn]] int main_exits(std::size_t bytes);
}  // namespace holder
namespace monitor {
int hold(std::size_t bytes, unsigned hold_ms, bool checkpoint, bool managed);
}
namespace pool {
int reclaim(std::size_t pool_bytes, std::size_t alloc_bytes);
int threshold(std::size_t bytes);
int set_mempool(std::size_t bytes);
int driver_oom(std::size_t held_bytes, std::size_t more_bytes);
int threads(int rounds);
int oversize(int rounds, std::size_t big);
int coarse(std::size_t bytes);
int reuse(std::size_t freed, std::size_t bytes, bool sync_a);
}  // namespace pool
namespace pool_race {
int reconcile_order(std::size_t bytes);
int set_mempool(std::size_t bytes);
int allowance_wait(std::size_t a, std::size_t b);
int refused_growth(std::size_t linear, std::size_t pool_bytes, std::size_t bytes);
int inflight_growth(std::size_t bytes);
int freed_after_sweep(std::size_t bytes, int delay_ms);
int allocated_during_sweep(std::size_t bytes, int delay_ms);
int freed_while_recording(std::size_t bytes, int delay_ms);
int destroyed_while_growing(std::size_t bytes, int delay_ms);
int failed_in_flight(std::size_t bytes);
int refused_free_freed_meanwhile(std::size_t bytes);
int freed_during_sync(std::size_t bytes, bool memfree);
int settled_after_trim(std::size_t bytes, int delay_ms);
}  // namespace pool_race

}  // namespace gpuslice::probe
