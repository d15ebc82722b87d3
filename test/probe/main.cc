// gpuslice-probe: the one table of scenarios (probe.h says how the program is
// run). A row names the family and the scenario, the scenario's arguments
// (what Args reads them as), whether the program calls cuInit(0) first, and
// the call; the family's file says what the scenario does and prints.
#include <cuda.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "probe.h"

namespace gpuslice::probe {

namespace {

struct Scenario {
  const char* family;
  const char* name;
  const char* usage;  // its arguments; [word] is optional
  bool init;          // cuInit(0) first; false where the scenario's own first CUDA calls are the point
  int (*run)(const Args&);
};

constexpr bool kInit = true;
constexpr bool kOwnInit = false;

// One row per scenario, families in alphabetical order.
const Scenario kScenarios[] = {
    {"allowance", "spill-race", "HOLD_MIB CHURN_MIB MAIN_MIB ROUNDS LIMIT_MIB", kInit,
     [](const Args& a) { return allowance::spill_race(a.mib(0), a.mib(1), a.mib(2), a.number<long>(3), a.mib(4)); }},

    {"compute", "stream-device", "other-current|no-context KERNEL_US MAX_LAUNCHES SECONDS", kInit,
     [](const Args& a) {
       return compute::stream_device(a.text(0), a.number<unsigned>(1), a.number<long>(2), a.real(3));
     }},
    {"compute", "null-config", "", kOwnInit, [](const Args&) { return compute::null_config(); }},
    {"compute", "entry-points", "", kInit, [](const Args&) { return compute::entry_points(); }},
    {"compute", "legacy-launch", "NAME KERNEL_US LAUNCHES", kInit,
     [](const Args& a) { return compute::legacy_launch(a.text(0), a.number<unsigned>(1), a.number<long>(2)); }},
    {"compute", "churn", "KERNEL_US KERNELS", kInit,
     [](const Args& a) { return compute::churn(a.number<unsigned>(0), a.number<long>(1)); }},
    {"compute", "launch-then-exit", "thread|main LAUNCHES", kInit,
     [](const Args& a) { return compute::launch_then_exit(a.text(0), a.number<long>(1)); }},

    {"context", "peak", "HOLD_MIB TRIES FREE_AFTER_MS", kInit,
     [](const Args& a) { return context::peak(a.mib(0), a.number<int>(1), a.number<int>(2)); }},
    {"context", "destroy-vs-realloc", "ROUNDS", kInit,
     [](const Args& a) { return context::destroy_vs_realloc(a.number<int>(0)); }},
    {"context", "tries", "N", kInit, [](const Args& a) { return context::tries(a.number<int>(0)); }},

    {"implicit", "measure-vs-release", "ctx|module KIND ROUNDS", kInit,
     [](const Args& a) { return implicit::measure_vs_release(a.text(0), a.text(1), a.number<int>(2)); }},
    {"implicit", "set-limit", "MIB", kInit, [](const Args& a) { return implicit::set_limit(a.mib(0)); }},
    {"implicit", "lazy-library", "MIB global|kernel|launch|launch-ex|launch-stream|graph|graph-kern", kInit,
     [](const Args& a) { return implicit::lazy_library(a.mib(0), a.text(1)); }},
    {"implicit", "library-per-context", "MIB destroy|reset", kInit,
     [](const Args& a) { return implicit::library_per_context(a.mib(0), a.text(1)); }},
    {"implicit", "module-load", "MIB", kInit, [](const Args& a) { return implicit::module_load(a.mib(0)); }},
    {"implicit", "reset-vs-place", "ROUNDS", kInit,
     [](const Args& a) { return implicit::reset_vs_place(a.number<int>(0)); }},
    {"implicit", "unload-vs-reuse", "ROUNDS", kInit,
     [](const Args& a) { return implicit::unload_vs_reuse(a.number<int>(0)); }},
    {"implicit", "dead-handle-place", "ROUNDS", kInit,
     [](const Args& a) { return implicit::dead_handle_place(a.number<int>(0)); }},
    {"implicit", "shortcut-vs-drop", "ROUNDS reset|release|reset-at-load|kernel", kInit,
     [](const Args& a) { return implicit::shortcut_vs_drop(a.number<int>(0), a.text(1)); }},
    {"implicit", "double-unload", "ROUNDS", kInit,
     [](const Args& a) { return implicit::double_unload(a.number<int>(0)); }},
    {"implicit", "array-level-reuse", "MIB MIPMAPS ROUNDS", kInit,
     [](const Args& a) { return implicit::array_level_reuse(a.mib(0), a.number<int>(1), a.number<int>(2)); }},

    {"memory", "vmm-retain", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::vmm_retain(a.mib(0), a.number<int>(1)); }},
    {"memory", "vmm-import", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::vmm_import(a.mib(0), a.number<int>(1)); }},
    {"memory", "pool-destroy-live", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::pool_destroy_live(a.mib(0), a.number<int>(1), false); }},
    {"memory", "pool-destroy-live-sync", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::pool_destroy_live(a.mib(0), a.number<int>(1), true); }},
    {"memory", "pool-other-device", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::pool_other_device(a.mib(0), a.number<int>(1), false); }},
    {"memory", "pool-foreign-pool", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::pool_other_device(a.mib(0), a.number<int>(1), true); }},
    {"memory", "host-located", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::host_located(a.mib(0), a.number<int>(1)); }},
    {"memory", "module-memory", "MIB", kInit, [](const Args& a) { return memory::module_memory(a.mib(0)); }},
    {"memory", "pool-failed", "MIB", kInit, [](const Args& a) { return memory::pool_failed(a.mib(0)); }},
    {"memory", "free-async-linear", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::free_async_linear(a.mib(0), a.number<int>(1)); }},
    {"memory", "ctx-destroy-live", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::ctx_destroy_live(a.mib(0), a.number<int>(1), false, false); }},
    {"memory", "ctx-destroy-live-array", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::ctx_destroy_live(a.mib(0), a.number<int>(1), false, true); }},
    {"memory", "primary-reset-live", "MIB ROUNDS", kInit,
     [](const Args& a) { return memory::ctx_destroy_live(a.mib(0), a.number<int>(1), true, false); }},
    {"memory", "ctx-race", "TRIES", kInit, [](const Args& a) { return memory::ctx_race(a.number<int>(0)); }},
    {"memory", "refused-free-reuse", "MIB DELAY_MS", kInit,
     [](const Args& a) { return memory::refused_free_reuse(a.mib(0), a.number<int>(1)); }},

    {"gate", "stuck-release", "MIB [keep]", kInit,
     [](const Args& a) { return gate::stuck_release(a.mib(0), a.flag(1, "keep")); }},
    {"gate", "hold-cpu", "THREADS [drain]", kInit,
     [](const Args& a) { return gate::hold_cpu(a.number<int>(0), a.flag(1, "drain")); }},

    {"holder", "fork-child", "MIB", kInit, [](const Args& a) { return holder::fork_child(a.mib(0)); }},
    {"holder", "fork-late", "GO", kInit, [](const Args& a) { return holder::fork_late(a.text(0)); }},
    {"holder", "main-exits", "MIB", kInit, [](const Args& a) { return holder::main_exits(a.mib(0)); }},

    {"monitor", "hold", "MIB HOLD_MS [checkpoint]", kInit,
     [](const Args& a) { return monitor::hold(a.mib(0), a.number<unsigned>(1), a.flag(2, "checkpoint"), false); }},
    {"monitor", "hold-managed", "MIB HOLD_MS", kInit,
     [](const Args& a) { return monitor::hold(a.mib(0), a.number<unsigned>(1), false, true); }},

    {"pool", "reclaim", "MIB_POOL MIB_ALLOC", kInit, [](const Args& a) { return pool::reclaim(a.mib(0), a.mib(1)); }},
    {"pool", "threshold", "MIB", kInit, [](const Args& a) { return pool::threshold(a.mib(0)); }},
    {"pool", "set-mempool", "MIB", kInit, [](const Args& a) { return pool::set_mempool(a.mib(0)); }},
    {"pool", "driver-oom", "MIB_HELD MIB_MORE", kInit,
     [](const Args& a) { return pool::driver_oom(a.mib(0), a.mib(1)); }},
    {"pool", "threads", "ROUNDS", kInit, [](const Args& a) { return pool::threads(a.number<int>(0)); }},
    {"pool", "oversize", "ROUNDS MIB", kInit, [](const Args& a) { return pool::oversize(a.number<int>(0), a.mib(1)); }},
    {"pool", "coarse", "MIB", kInit, [](const Args& a) { return pool::coarse(a.mib(0)); }},
    {"pool", "reuse", "MIB_A MIB_B SYNC_A", kInit,
     [](const Args& a) { return pool::reuse(a.mib(0), a.mib(1), a.number<int>(2) != 0); }},

    {"pool-race", "reconcile-order", "MIB", kInit, [](const Args& a) { return pool_race::reconcile_order(a.mib(0)); }},
    {"pool-race", "set-mempool", "MIB", kInit, [](const Args& a) { return pool_race::set_mempool(a.mib(0)); }},
    {"pool-race", "allowance-wait", "MIB_A MIB_B", kInit,
     [](const Args& a) { return pool_race::allowance_wait(a.mib(0), a.mib(1)); }},
    {"pool-race", "refused-growth", "LINEAR_MIB POOL_MIB MIB", kInit,
     [](const Args& a) { return pool_race::refused_growth(a.mib(0), a.mib(1), a.mib(2)); }},
    {"pool-race", "inflight-growth", "MIB", kInit, [](const Args& a) { return pool_race::inflight_growth(a.mib(0)); }},
    {"pool-race", "freed-after-sweep", "MIB DELAY_MS", kInit,
     [](const Args& a) { return pool_race::freed_after_sweep(a.mib(0), a.number<int>(1)); }},
    {"pool-race", "allocated-during-sweep", "MIB DELAY_MS", kInit,
     [](const Args& a) { return pool_race::allocated_during_sweep(a.mib(0), a.number<int>(1)); }},
    {"pool-race", "freed-while-recording", "MIB DELAY_MS", kInit,
     [](const Args& a) { return pool_race::freed_while_recording(a.mib(0), a.number<int>(1)); }},
    {"pool-race", "destroyed-while-growing", "MIB DELAY_MS", kInit,
     [](const Args& a) { return pool_race::destroyed_while_growing(a.mib(0), a.number<int>(1)); }},
    {"pool-race", "failed-in-flight", "MIB", kInit,
     [](const Args& a) { return pool_race::failed_in_flight(a.mib(0)); }},
    {"pool-race", "refused-free-freed-meanwhile", "MIB", kInit,
     [](const Args& a) { return pool_race::refused_free_freed_meanwhile(a.mib(0)); }},
    {"pool-race", "freed-during-sync", "MIB [memfree]", kInit,
     [](const Args& a) { return pool_race::freed_during_sync(a.mib(0), a.flag(1, "memfree")); }},
    {"pool-race", "settled-after-trim", "MIB DELAY_MS", kInit,
     [](const Args& a) { return pool_race::settled_after_trim(a.mib(0), a.number<int>(1)); }},
    {"reserve", "thread-exit", "THREADS MIB BIG_MIB", kInit,
     [](const Args& a) { return reserve::thread_exit(a.number<int>(0), a.mib(1), a.mib(2)); }},
    {"reserve", "idle", "THREADS MIB BIG_MIB", kInit,
     [](const Args& a) { return reserve::idle(a.number<int>(0), a.mib(1), a.mib(2)); }},
    {"reserve", "shown", "BYTES", kInit, [](const Args& a) { return reserve::shown(a.number<std::size_t>(0)); }},
    {"reserve", "shown-held", "BYTES READY GO", kInit,
     [](const Args& a) { return reserve::shown_held(a.number<std::size_t>(0), a.text(1), a.text(2)); }},
    {"reserve", "lowered", "THREADS MIB READY GO", kInit,
     [](const Args& a) { return reserve::lowered(a.number<int>(0), a.mib(1), a.text(2), a.text(3)); }},
};

int usage(const char* why) {
  if (why != nullptr) std::fprintf(stderr, "gpuslice-probe: %s\n", why);
  std::fprintf(stderr, "usage: gpuslice-probe FAMILY SCENARIO ARGS...\n");
  for (const Scenario& s : kScenarios)
    std::fprintf(stderr, "  %s %s%s%s\n", s.family, s.name, *s.usage != '\0' ? " " : "", s.usage);
  return 64;
}

}  // namespace
}  // namespace gpuslice::probe

int main(int argc, char** argv) {
  using namespace gpuslice::probe;
  if (argc < 3) return usage(argc == 1 ? nullptr : "a family and a scenario are needed");
  for (const Scenario& s : kScenarios) {
    if (std::strcmp(s.family, argv[1]) != 0 || std::strcmp(s.name, argv[2]) != 0) continue;
    try {
      const Args args(s.usage, std::vector<std::string>(argv + 3, argv + argc));
      // A row reads every argument in its call's argument list: a bad one
      // throws before the scenario's body runs.
      if (s.init) check(cuInit(0), "cuInit");
      return s.run(args);
    } catch (const BadArgument& e) {
      std::fprintf(stderr, "gpuslice-probe %s %s: %s (usage: %s %s %s)\n", s.family, s.name, e.what(), s.family, s.name,
                   s.usage);
      return 64;
    }
  }
  const std::string why = std::string("no scenario '") + argv[1] + " " + argv[2] + "'";
  return usage(why.c_str());
}
