// Bootstrap is safe however the first CUDA call arrives: from another
// library's constructor, from many threads at once, in a forked child; and
// our dlsym keeps RTLD_NEXT working for other interposers.
#include <gtest/gtest.h>

#include "probe.h"

using namespace gpuslice::test;

namespace {

TEST(Bootstrap, FirstCallFromAnotherLibrarysConstructor) {
  Sandbox box;
  Result r = run({bin("ctor_main")}, merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "8Mi"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "ctor", "oversize_rc"), "2") << r.describe();
  EXPECT_EQ(value(r, "ctor", "alloc_rc"), "0") << r.describe();
}

TEST(Bootstrap, ManyThreadsMakeTheFirstCallAtOnce) {
  Sandbox box;
  Result r = run({bin("race_probe"), "threads", "16", std::to_string(kMi)},
                 merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "8Mi"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "threads", "ok"), "8") << r.describe();
}

TEST(Bootstrap, ForkedChildAccountsOnItsOwnSlot) {
  Sandbox box;
  Result r =
      run({bin("race_probe"), "fork", std::to_string(kMi)}, merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "8Mi"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "child", "bytes"), std::to_string(8 * kMi)) << r.describe();
  EXPECT_EQ(value(r, "parent", "bytes"), std::to_string(8 * kMi))
      << "the dead child's memory is its own, reaped, not the parent's\n"
      << r.describe();
}

TEST(Bootstrap, RtldNextStillMeansNextAfterTheCaller) {
  Sandbox box;
  Result native = run({bin("layer_main")}, box.env(false), 10000);
  Result wrapped = run({bin("layer_main")}, box.env(), 10000);
  EXPECT_EQ(value(native, "layered", "value"), "101") << native.describe();
  EXPECT_EQ(value(wrapped, "layered", "value"), "101") << wrapped.describe();
}

}  // namespace
