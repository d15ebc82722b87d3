// gpuslice-probe, the one probe program: the programs the tests run under the
// preload library, against the simulated driver they link directly (as an
// application links libcuda). Every scenario is a row of one table
// (main.cc); each family of scenarios lives in its own file (memory.cc,
// pool.cc, ...), whose opening comment says what each of its scenarios does
// and prints. This header holds what they share and declares each family's
// scenarios for the table.
//
//   gpuslice-probe FAMILY SCENARIO ARGS...    (no argument: the table)
//
// Exit status: what the scenario returns (0: its CUDA calls behaved as
// documented, the test judges the printed numbers), 2 when a setup call
// failed (check), 64 for a wrong command line.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpuslice::probe {

inline constexpr std::size_t kMi = std::size_t{1} << 20;
inline constexpr std::size_t kKi = std::size_t{1} << 10;

// A setup call that must succeed: otherwise prints the call and its result
// and exits 2 (the test reports a setup failure, not a verdict).
void check(CUresult rc, const char* what);

// The primary context of `dev`, retained (check()ed).
CUcontext primary(CUdevice dev);

// A command line the table refuses: names the argument and what was expected.
struct BadArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A scenario's arguments (the words after its name), read strictly against
// the names of its usage line ("MIB ROUNDS [checkpoint]"): a word that is not
// what its place expects throws BadArgument naming the place.
class Args {
 public:
  Args(const char* usage, std::vector<std::string> words);
  std::size_t size() const { return words_.size(); }
  std::size_t mib(std::size_t i) const;  // a count of MiB, in bytes
  long long number(std::size_t i) const;
  double real(std::size_t i) const;
  const std::string& text(std::size_t i) const;
  // An optional last word: absent, or exactly `word`.
  bool flag(std::size_t i, const char* word) const;

 private:
  std::string name(std::size_t i) const;
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
int module_load(std::size_t bytes);
int reset_vs_place(int rounds);
int unload_vs_reuse(int rounds);
int double_unload(int rounds);
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
}  // namespace memory
namespace gate {
int stuck_release(std::size_t bytes, bool keep);
}
namespace reserve {
int thread_exit(int threads, std::size_t bytes, std::size_t big);
}
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
}  // namespace pool
namespace pool_race {
int reconcile_order(std::size_t bytes);
int set_mempool(std::size_t bytes);
int allowance_wait(std::size_t a, std::size_t b);
}  // namespace pool_race

}  // namespace gpuslice::probe
