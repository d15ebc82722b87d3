// A library whose constructor calls the driver while another thread of the
// process is in gpuslice's first bootstrap (lifecycle_probe deadlock). The
// constructor runs under the loader lock; it first waits (bounded) until that
// thread is blocked — inside dlopen of the driver, waiting for this very lock.
// LIFECYCLE_CTOR=dlsym looks cuInit up with dlsym on the driver's handle
// instead of calling it; =launch launches a kernel (the other thread is in
// its first launch).
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" {
[[gnu::visibility("default")]] int lifecycle_ctor_rc = -1;
}

namespace {

char thread_state(int tid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/stat", tid);
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return '?';
  char buf[512] = {};
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  return close != nullptr && close[1] == ' ' ? close[2] : '?';
}

}  // namespace

__attribute__((constructor)) static void call_driver_under_loader_lock() {
  auto* tid = static_cast<std::atomic<int>*>(dlsym(RTLD_DEFAULT, "lifecycle_thread_tid"));
  auto* in_ctor = static_cast<std::atomic<int>*>(dlsym(RTLD_DEFAULT, "lifecycle_in_ctor"));
  auto* done = static_cast<std::atomic<int>*>(dlsym(RTLD_DEFAULT, "lifecycle_thread_done"));
  if (tid == nullptr || in_ctor == nullptr || done == nullptr) return;
  in_ctor->store(1);
  // Up to 5 s for the other thread to start and block; it blocks on the
  // loader lock we hold (or, with the fix, never needs us).
  for (int i = 0; i < 500 && done->load() == 0 && (tid->load() == 0 || thread_state(tid->load()) != 'S'); ++i)
    usleep(10 * 1000);
  if (done->load() == 0) usleep(100 * 1000);
  const char* how = std::getenv("LIFECYCLE_CTOR");
  if (how != nullptr && std::strcmp(how, "launch") == 0) {
    auto* f = static_cast<CUfunction*>(dlsym(RTLD_DEFAULT, "lifecycle_function"));
    lifecycle_ctor_rc = f ? cuLaunchKernel(*f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr) : -3;
    return;
  }
  if (how != nullptr && std::strcmp(how, "dlsym") == 0) {
    void* h = dlopen("libcuda.so.1", RTLD_NOW);
    auto init = h ? reinterpret_cast<CUresult (*)(unsigned)>(dlsym(h, "cuInit")) : nullptr;
    lifecycle_ctor_rc = init ? init(0) : -3;
  } else {
    lifecycle_ctor_rc = cuInit(0);
  }
}
