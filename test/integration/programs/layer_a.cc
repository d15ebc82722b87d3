// Two libraries defining the same function, the first forwarding to the next
// with dlsym(RTLD_NEXT): the pattern other interposers (profilers, libfaketime)
// rely on. With a dlsym override that calls glibc's from its own frame, "next"
// is computed relative to the preload library and this recurses forever.
#include <dlfcn.h>

extern "C" int layered(void) {
  auto next = reinterpret_cast<int (*)(void)>(dlsym(RTLD_NEXT, "layered"));
  return next ? 1 + next() : -1000;
}
