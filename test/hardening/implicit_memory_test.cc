// Memory the driver takes without an allocation call (contexts, modules,
// libraries placed lazily), measured from NVML: never counted short, whatever
// the process releases meanwhile; placed memory is counted where the driver
// places it (docs/memory.md, "Contexts, modules and libraries").
// Each scenario runs gpuslice-probe implicit under the preload library.
#include <cuda.h>
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr long long kMi = 1ll << 20;

const Probe probe{{"gpuslice-probe", "implicit"}, 150000};

const Env kDevice = {{"GPUSLICE_MEMORY_LIMIT", "2Gi"},
                     {"FAKECUDA_MEMORY", "16Gi"},
                     {"FAKECUDA_CONTEXT_MEMORY", "256Mi"},
                     {"FAKECUDA_MODULE_MEMORY", "1"}};

// kDevice with the simulator sleeping `us` µs at the entry of every `call`
// (chaos seed `seed`, no yields): widens a race window so a test forces it.
Env sleep_in(const std::string& call, const char* seed, const char* us) {
  Env env = kDevice;
  env["FAKECUDA_CHAOS_SEED"] = seed;
  env["FAKECUDA_CHAOS_CALLS"] = call;
  env["FAKECUDA_CHAOS_YIELD_PCT"] = "0";
  env["FAKECUDA_CHAOS_SLEEP_PCT"] = "100";
  env["FAKECUDA_CHAOS_SLEEP_US"] = us;
  return env;
}

// A context (or module) measured while another thread of the process releases
// device memory in a way that is not an allocation or a free: the release is
// a counting operation too, so no measurement overlaps it, and the count
// equals what the device holds after every creation. Before, the release
// made the new context look smaller (often 0): the device held up to its
// whole size beyond the count.
struct Case {
  const char* measured;
  const char* kind;
};
class MeasuredWhileReleasing : public ::testing::TestWithParam<Case> {};

TEST_P(MeasuredWhileReleasing, IsNeverCountedShort) {
  Sandbox box;
  Result r = probe(box, kDevice, {"measure-vs-release", GetParam().measured, GetParam().kind, "300"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "measure-vs-release", "rounds"), 300) << r.out;
  EXPECT_EQ(number(r, "measure-vs-release", "refused"), 0) << r.out;
  EXPECT_EQ(number(r, "measure-vs-release", "shorts"), 0) << r.out;
  EXPECT_EQ(number(r, "measure-vs-release", "mismatches"), 0) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Releases, MeasuredWhileReleasing,
                         ::testing::Values(Case{"ctx", "ctx-destroy"}, Case{"ctx", "primary-release"},
                                           Case{"ctx", "sync-trim"}, Case{"ctx", "pool-trim"},
                                           Case{"ctx", "module-unload"}, Case{"ctx", "library-unload"},
                                           Case{"module", "ctx-destroy"}, Case{"module", "sync-trim"}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = std::string(info.param.measured) + "_" + info.param.kind;
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

// An array creation that does not fit what is left of the quota makes
// gpuslice trim the process's idle pool reserve before it refuses
// (reserve()'s reclaim): a release of device memory. Array creations were
// not counting operations, so a context or module measured meanwhile took
// the trimmed reserve for its own shrinkage: counted up to 64 MiB short
// (forced: a sleep at the measured call's entry widens the measurement;
// before the fix 92 and 66 of the 200 rounds were short). The chaos suite's rare
// "count at checkpoint" with `array`, `pool` and `context`/`library`
// (issue 20, seeds 4763 and 7201 of 10,000).
class ArrayReclaim : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};
TEST_P(ArrayReclaim, DuringAMeasurementIsNeverCountedShort) {
  Sandbox box;
  Env env = sleep_in(GetParam().second, "5", "5000");
  Result r = probe(box, env, {"measure-vs-release", GetParam().first, "array-reclaim", "200"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "measure-vs-release", "rounds"), 200) << r.out;
  EXPECT_EQ(number(r, "measure-vs-release", "refused"), 0) << r.out;
  EXPECT_EQ(number(r, "measure-vs-release", "shorts"), 0) << r.out;
}
INSTANTIATE_TEST_SUITE_P(Measured, ArrayReclaim,
                         ::testing::Values(std::make_pair("module", "module_load"),
                                           std::make_pair("ctx", "create_context")),
                         [](const auto& info) { return std::string(info.param.first); });

// A library loaded with no context current is placed at its first use: what
// the placement takes is counted then (and released at unload), and a
// placement beyond the quota is refused with CUDA_ERROR_OUT_OF_MEMORY,
// leaving nothing on the device. Before, it was never counted: a 1 GiB global
// left the device 1 GiB over the quota.
class LazyLibrary : public ::testing::TestWithParam<const char*> {};

TEST_P(LazyLibrary, PlacementIsCounted) {
  Sandbox box;
  Result r = probe(box, kDevice, {"lazy-library", "512", GetParam()});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "lazy-library", "rc"), 0) << r.out;
  EXPECT_EQ(number(r, "lazy-library", "again_rc"), 0) << r.out;
  EXPECT_GE(number(r, "lazy-library", "placed_held") - number(r, "lazy-library", "loaded_held"), 512 * kMi) << r.out;
  EXPECT_EQ(number(r, "lazy-library", "placed"), number(r, "lazy-library", "placed_held")) << r.out;
  EXPECT_EQ(number(r, "lazy-library", "again"), number(r, "lazy-library", "again_held")) << r.out;
  EXPECT_EQ(number(r, "lazy-library", "unloaded"), number(r, "lazy-library", "unloaded_held")) << r.out;
}

TEST_P(LazyLibrary, PlacementBeyondTheQuotaIsRefused) {
  Sandbox box;
  Result r = probe(box, kDevice, {"lazy-library", "3072", GetParam()});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "lazy-library", "rc"), static_cast<long long>(CUDA_ERROR_OUT_OF_MEMORY)) << r.out;
  EXPECT_LE(number(r, "lazy-library", "placed_held"), 2048 * kMi) << r.out;
  EXPECT_EQ(number(r, "lazy-library", "placed"), number(r, "lazy-library", "placed_held")) << r.out;
  EXPECT_EQ(number(r, "lazy-library", "unloaded"), number(r, "lazy-library", "unloaded_held")) << r.out;
}

// A placement is resident device memory: with a 1 GiB device-resident
// allowance (quota 2 GiB, 256 MiB context) a 1 GiB global does not fit, and
// the library is unloaded (placements are not waited for: their size is
// known only once placed). Before, the allowance was not checked: 1,280 MiB
// resident (chaos suite, resident-wait with library).
TEST_P(LazyLibrary, PlacementBeyondTheResidentAllowanceIsRefused) {
  Sandbox box;
  Env env = kDevice;
  env["GPUSLICE_MEMORY_RESIDENT"] = "1Gi";
  env["GPUSLICE_OVERSUBSCRIBE"] = "fail";
  Result r = probe(box, env, {"lazy-library", "1024", GetParam()});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "lazy-library", "rc"), static_cast<long long>(CUDA_ERROR_OUT_OF_MEMORY)) << r.out;
  EXPECT_LE(number(r, "lazy-library", "placed_held"), 1024 * kMi) << r.out;
  EXPECT_EQ(number(r, "lazy-library", "placed"), number(r, "lazy-library", "placed_held")) << r.out;
}

// "launch*": the first use is a launch of a kernel resolved with no context
// current (cuLibraryGetKernel), cast to CUfunction (the CUDA 12+ runtime's
// way): the driver places the library then. Before, that placement was never
// counted (the simulator did not model it either): the device held the
// library beyond the count, and a 3 GiB one was launched past a 2 GiB quota.
// "graph*": the kernel is named by a graph's kernel node (as func, or as
// kern), instantiated and launched; gpuslice places it measured before the
// instantiation. Before, the graph's launch placed it uncounted (512 MiB
// beyond the count; a 3 GiB library past the 2 GiB quota).
INSTANTIATE_TEST_SUITE_P(FirstUse, LazyLibrary,
                         ::testing::Values("global", "kernel", "launch", "launch-ex", "launch-stream", "graph",
                                           "graph-kern"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

// The same for a module loaded in a context, under `wait` too (refused at
// once, not waited for).
class ModuleOverAllowance : public ::testing::TestWithParam<const char*> {};
TEST_P(ModuleOverAllowance, IsRefused) {
  Sandbox box;
  Env env = kDevice;
  env["GPUSLICE_MEMORY_RESIDENT"] = "1Gi";
  env["GPUSLICE_OVERSUBSCRIBE"] = GetParam();
  env["GPUSLICE_OVERSUBSCRIBE_WAIT"] = "200ms";
  Result r = probe(box, env, {"module-load", "1024"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "module-load", "rc"), static_cast<long long>(CUDA_ERROR_OUT_OF_MEMORY)) << r.out;
  EXPECT_LE(number(r, "module-load", "held"), 1024 * kMi) << r.out;
  EXPECT_EQ(number(r, "module-load", "counted"), number(r, "module-load", "held")) << r.out;
}
INSTANTIATE_TEST_SUITE_P(Policies, ModuleOverAllowance, ::testing::Values("fail", "spill", "wait"));

// cuCtxSetLimit makes the driver reserve device memory (a 1 GiB malloc heap):
// counted from the call to the context's destruction; beyond the quota the
// call is refused and the previous limit kept. Before, nothing was counted:
// a 3 GiB heap left the device 1 GiB (and more) over a 2 GiB quota.
// A library unloaded in one thread while another loads one lazily and places
// it: the driver hands the new library the handle the old one had before
// cuLibraryUnload returns (forced: the simulator sleeps at that return point).
// Before, the old library's record was taken only after the driver call, so
// the new one's first use found it ("placed already") and went unmeasured:
// the device held the new library's 40 MiB beyond the count (chaos suite,
// class `library`, seeds 2 and 6 of 1-10).
TEST(LazyLibraryHandleReuse, PlacementIsCountedWhenTheHandleComesBack) {
  Sandbox box;
  Env env = sleep_in("cuLibraryUnload", "7", "20000");
  Result r = probe(box, env, {"unload-vs-reuse", "20"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "unload-vs-reuse", "rounds"), 20) << r.out;
  // The handle came back every round. (Before the fix the load landed inside
  // A's cuLibraryUnload in every round: hits=20; a load with no context now
  // waits for the unload in flight, under the measurement gate, so hits is 0.)
  EXPECT_GE(number(r, "unload-vs-reuse", "reused"), 15) << r.out;
  EXPECT_EQ(number(r, "unload-vs-reuse", "shorts"), 0) << r.out;
}

// Two threads unload the same library at once: the driver refuses one
// (CUDA_ERROR_INVALID_HANDLE). Before, the refused one put the records it
// had taken back (the library was gone), so the next library given the
// handle looked placed already and its placement went uncounted (chaos
// suite, class `library`, ~2% of the seeds once the handle-reuse race above
// was fixed). Forced: the simulator sleeps at cuLibraryUnload's entry, after
// gpuslice took the records and before the driver call.
TEST(LazyLibraryHandleReuse, RefusedUnloadOfAnUnloadedLibraryKeepsNothing) {
  Sandbox box;
  Env env = sleep_in("cuLibraryUnload", "11", "5000");
  Result r = probe(box, env, {"double-unload", "30"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "double-unload", "rounds"), 30) << r.out;
  EXPECT_EQ(number(r, "double-unload", "refused"), 30) << r.out;  // exactly one of the two, every round
  EXPECT_GE(number(r, "double-unload", "reused"), 20) << r.out;
  EXPECT_EQ(number(r, "double-unload", "shorts"), 0) << r.out;
}

// A use of a library handle no library has (unloaded before its first use:
// CUDA_ERROR_INVALID_HANDLE) places nothing. Measured while the process's
// usage grew for another reason (here a graphics allocation of another
// thread inside the call, forced by a sleep at cuLibraryGetGlobal's entry;
// in the chaos suite a disturbed measurement's settle), it was charged and
// recorded as a placement of that handle; the next library the driver gave
// the handle to then looked placed already, and its placement went
// unmeasured: 40 MiB on the device, 1 MiB counted (issue 32, seeds
// 2,100,176 and 2,100,553's shape: a live slot one placement short).
TEST(LazyLibraryHandleReuse, AUseOfAnUnloadedLibraryRecordsNoPlacement) {
  Sandbox box;
  Env env = sleep_in("cuLibraryGetGlobal", "5", "10000");
  Result r = probe(box, env, {"dead-handle-place", "20"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "dead-handle-place", "rounds"), 20) << r.out;
  EXPECT_EQ(number(r, "dead-handle-place", "invalid"), 20) << r.out;
  EXPECT_GE(number(r, "dead-handle-place", "reused"), 15) << r.out;
  EXPECT_EQ(number(r, "dead-handle-place", "shorts"), 0) << r.out;
}

// The main thread's current (primary) context is reset by another thread
// and retained again (the same handle) while the main thread places a lazily
// loaded library: the library looked at the context before the call (none:
// "the driver's answer", unmeasured) and the driver placed the library in
// the context that came back meanwhile (forced: a sleep at
// cuLibraryGetGlobal's entry). Now the look is repeated with the gate closed
// and the call made under it. (Chaos suite, library,primary: 5 of 150 seeds
// one placement short before.)
TEST(LazyLibraryContextComesBack, PlacementIsNeverUnmeasured) {
  Sandbox box;
  Env env = sleep_in("cuLibraryGetGlobal", "3", "10000");
  Result r = probe(box, env, {"reset-vs-place", "30"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "reset-vs-place", "rounds"), 30) << r.out;
  EXPECT_EQ(number(r, "reset-vs-place", "shorts"), 0) << r.out;
}

// A library placed (and counted) in the primary context is used there again
// (the "placed already" shortcut: no measurement) while another thread drops
// the primary context (a reset, or the last release) and retains it again:
// the same handle. The driver freed the library's copy with the context; the
// use, still inside the driver (forced: a sleep at cuLibraryGetGlobal's
// entry), placed it again in the new context, and nobody measured it: 32 MiB
// on the device beyond the count (issue 32, seed 1,120,116). Now a drop
// waits for the shortcut uses in flight, and a use that finds a drop in
// flight is measured.
TEST(LazyLibraryShortcut, ADropInsideAPlacedUseLeavesNothingUnmeasured) {
  for (const char* how : {"reset", "release", "reset-at-load"}) {
    Sandbox box;
    Env env = sleep_in("cuLibraryGetGlobal", "7", "10000");
    Result r = probe(box, env, {"shortcut-vs-drop", "10", how});
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_EQ(number(r, "shortcut-vs-drop", "rounds"), 10) << r.out;
    EXPECT_EQ(number(r, "shortcut-vs-drop", "placed"), 10) << r.out;
    EXPECT_EQ(number(r, "shortcut-vs-drop", "same"), 10) << r.out;  // the new context has the handle
    EXPECT_EQ(number(r, "shortcut-vs-drop", "shorts"), 0) << r.out;
  }
}

// The thread's last resolved kernel goes to the driver unmeasured while its
// library is not unloaded and the context handle is the same: the primary
// context reset and retained again (the same handle, its copy of the library
// gone with the old one) resolved the kernel again, and the driver placed the
// library in the new context unmeasured. A context drop now invalidates it.
TEST(LazyLibraryShortcut, AKernelResolvedAgainAfterADropIsMeasured) {
  Sandbox box;
  Result r = probe(box, kDevice, {"shortcut-vs-drop", "5", "kernel"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "shortcut-vs-drop", "placed"), 5) << r.out;
  EXPECT_EQ(number(r, "shortcut-vs-drop", "same"), 5) << r.out;
  EXPECT_EQ(number(r, "shortcut-vs-drop", "shorts"), 0) << r.out;
}

// A measurement whose gate times out: another thread's synchronisation waits
// 2.5 s for a kernel (longer than the 2 s the gate waits), then trims 96 MiB
// of pool reserve inside the measured module load and settles its count only
// ~1.5 s later (FAKECUDA_POOL_QUERY_DELAY_US delays the reconciliation). The
// disturbed measurement now waits for the synchronisation to finish and
// counts what the process holds beyond its count: the module, exactly.
// Before, the fallback (the difference minus what the counted bytes had
// moved by then) counted it as 0: 32 MiB on the device beyond the count
// (gpuslice-probe gate). Alone, and while 2 MiB another thread freed stay
// counted but not on the device (`keep`: the slot's spare lease; once the
// thread's own reserve): the settle must not take those bytes for memory on
// the device (before: the module counted 2 MiB short).
class MeasureGate : public ::testing::TestWithParam<const char*> {};

TEST_P(MeasureGate, ATimedOutMeasurementIsNeverCountedShort) {
  Sandbox box;
  Env env = kDevice;
  env["FAKECUDA_POOL_QUERY_DELAY_US"] = "1500000";
  std::vector<std::string> args{bin("gpuslice-probe"), "gate", "stuck-release", "32"};
  if (std::string(GetParam()) == "keep") args.push_back("keep");
  Result r = run(args, merge(box.env(), env), 60000);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "stuck-release", "rc"), 0) << r.out;
  EXPECT_GE(number(r, "stuck-release", "held") - number(r, "stuck-release", "unloaded_held"), 32 * kMi) << r.out;
  EXPECT_GE(number(r, "stuck-release", "counted"), number(r, "stuck-release", "held")) << r.out;
  EXPECT_EQ(number(r, "stuck-release", "unloaded"), number(r, "stuck-release", "unloaded_held")) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Threads, MeasureGate, ::testing::Values("alone", "keep"),
                         [](const auto& info) { return std::string(info.param); });

// NVIDIA's driver loads a library into each context that uses it, and a
// context's copy goes with the context (the simulator does so since r10):
// what gpuslice counted for that copy goes too, and a new context (whose
// handle may be the old one's) is measured again at its first use.
// "destroy": a created context destroyed; "reset": the primary context reset.
class LibraryPerContext : public ::testing::TestWithParam<const char*> {};

TEST_P(LibraryPerContext, ACopyIsCountedWhileItsContextLives) {
  Sandbox box;
  Result r = probe(box, kDevice, {"library-per-context", "256", GetParam()});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const char* s = "library-per-context";
  EXPECT_EQ(r.out.find("rc=0,0,0,0") != std::string::npos, true) << r.out;
  EXPECT_GE(number(r, s, "second_held") - number(r, s, "first_held"), 256 * kMi) << r.out;
  EXPECT_EQ(number(r, s, "first"), number(r, s, "first_held")) << r.out;
  EXPECT_EQ(number(r, s, "second"), number(r, s, "second_held")) << r.out;
  EXPECT_EQ(number(r, s, "gone"), number(r, s, "gone_held")) << r.out;
  EXPECT_EQ(number(r, s, "again"), number(r, s, "again_held")) << r.out;
  EXPECT_EQ(number(r, s, "renewed"), number(r, s, "renewed_held")) << r.out;
  EXPECT_EQ(number(r, s, "unloaded"), number(r, s, "unloaded_held")) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Gone, LibraryPerContext, ::testing::Values("destroy", "reset"),
                         [](const auto& info) { return std::string(info.param); });

TEST(ResourceLimit, MallocHeapIsCountedUntilTheContextGoes) {
  Sandbox box;
  Result r = probe(box, kDevice, {"set-limit", "1024"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "set-limit", "rc"), 0) << r.out;
  EXPECT_EQ(number(r, "set-limit", "limit"), 1024 * kMi) << r.out;
  EXPECT_GE(number(r, "set-limit", "set_held") - number(r, "set-limit", "before_held"), 1000 * kMi) << r.out;
  EXPECT_EQ(number(r, "set-limit", "set"), number(r, "set-limit", "set_held")) << r.out;
  EXPECT_EQ(number(r, "set-limit", "destroyed"), number(r, "set-limit", "destroyed_held")) << r.out;
}

TEST(ResourceLimit, MallocHeapBeyondTheQuotaIsRefused) {
  Sandbox box;
  Result r = probe(box, kDevice, {"set-limit", "3072"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "set-limit", "rc"), static_cast<long long>(CUDA_ERROR_OUT_OF_MEMORY)) << r.out;
  EXPECT_EQ(number(r, "set-limit", "limit"), 8 * kMi) << r.out;  // the default, kept
  EXPECT_LE(number(r, "set-limit", "set_held"), 2048 * kMi) << r.out;
  EXPECT_EQ(number(r, "set-limit", "set"), number(r, "set-limit", "set_held")) << r.out;
}

// A resource limit's reservation is resident device memory, like a module's
// placement: with a 1 GiB device-resident allowance a 1 GiB malloc heap does
// not fit beside the 256 MiB context, under any policy (refused at once, not
// waited for: its size is known only once reserved), and the previous limit
// is kept. Before, only the quota was checked: the heap was admitted and the
// container held 1,272 MiB resident on a 1 GiB allowance.
class ResourceLimitOverAllowance : public ::testing::TestWithParam<const char*> {};
TEST_P(ResourceLimitOverAllowance, IsRefused) {
  Sandbox box;
  Env env = kDevice;
  env["GPUSLICE_MEMORY_RESIDENT"] = "1Gi";
  env["GPUSLICE_OVERSUBSCRIBE"] = GetParam();
  env["GPUSLICE_OVERSUBSCRIBE_WAIT"] = "200ms";
  Result r = probe(box, env, {"set-limit", "1024"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "set-limit", "rc"), static_cast<long long>(CUDA_ERROR_OUT_OF_MEMORY)) << r.out;
  EXPECT_EQ(number(r, "set-limit", "limit"), 8 * kMi) << r.out;  // the default, kept
  EXPECT_LE(number(r, "set-limit", "set_held"), 1024 * kMi) << r.out;
  EXPECT_EQ(number(r, "set-limit", "set"), number(r, "set-limit", "set_held")) << r.out;
}
INSTANTIATE_TEST_SUITE_P(Policies, ResourceLimitOverAllowance, ::testing::Values("fail", "spill", "wait"));

// A context destroyed with a 22 MiB array in it, while the primary context
// holds mipmapped arrays: the destroy's sweep asks each mipmapped array
// about its level 0, which the driver makes then, in the handle the dead
// array had; the sweep's question about the array ("still known?") was
// answered by that level and its 22 MiB stayed counted for nothing (chaos
// suite, over-count check, seed 1,051,629: a process counting 23,068,672
// bytes it did not hold). A round fails unless the array is asked first.
TEST(ArrayLevelReuse, ADeadArrayIsNotKeptByALevelInItsHandle) {
  Sandbox box;
  Result r = probe(box, kDevice, {"array-level-reuse", "22", "15", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "array-level-reuse", "rounds"), 8) << r.out;
  EXPECT_GE(number(r, "array-level-reuse", "reused"), 1) << "no level took the dead array's handle\n" << r.out;
  EXPECT_EQ(number(r, "array-level-reuse", "overs"), 0) << r.out;
  EXPECT_EQ(number(r, "array-level-reuse", "counted"), number(r, "array-level-reuse", "held")) << r.out;
}

}  // namespace
}  // namespace gpuslice::test
