#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "checks.h"
#include "fuzz_target.h"

namespace gpuslice::fuzz {

void fail(const char* what) {
  // On the real stderr even while a target captures fd 2 (checks.h).
  const int fd = report_fd();
  const char prefix[] = "fuzz invariant failed: ";
  ssize_t ignored = write(fd, prefix, sizeof prefix - 1);
  ignored = write(fd, what, std::strlen(what));
  ignored = write(fd, "\n", 1);
  (void)ignored;
  run_fail_cleanup();
  std::abort();
}

}  // namespace gpuslice::fuzz
