#include <cstdio>
#include <cstdlib>

#include "fuzz_target.h"

namespace gpuslice::fuzz {

void fail(const char* what) {
  std::fprintf(stderr, "fuzz invariant failed: %s\n", what);
  std::abort();
}

}  // namespace gpuslice::fuzz
