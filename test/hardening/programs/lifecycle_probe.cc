// lifecycle_probe MODE ...: programs that reach gpuslice's lifecycle edges
// (test/hardening/lifecycle_test.cc). Each prints "<mode> key=value" lines.
//   deadlock LIB          thread A makes the first CUDA call while the main
//                         thread dlopens LIB, whose constructor calls the driver
//   deadlock-launch LIB   the same with the first kernel launch
//   null-arrays           cu*ArrayCreate with NULL out-parameters, first call
//   fork-exit VARIANT     parent holds 6 MiB; a child made by VARIANT (_Fork,
//                         vfork, clone) calls exit(); then the parent fills up
//   fork-inherit VARIANT  parent bootstraps without CUDA; the child fills the
//                         quota and dies; then the parent fills up
//   exec                  holds 6 MiB, then execs itself as "fill"
//   fill                  fills the quota 1 MiB at a time, prints the total
//   hold BYTES            allocates BYTES and returns from main holding them
//   truncate              allocates, truncates the region file, allocates again
//   quiet                 context, allocation, 20 launches, synchronise; then
//                         reports gpuslice's thread and whether NVML got loaded
//   share BYTES [UID|-] [HOLD_MS]  (as UID when given) allocates BYTES, prints
//                         rc, then holds it HOLD_MS before exiting
#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

extern "C" {
// Shared with the deadlock library's constructor (dlsym(RTLD_DEFAULT, ...)).
[[gnu::visibility("default")]] std::atomic<int> lifecycle_thread_tid{0};
[[gnu::visibility("default")]] std::atomic<int> lifecycle_in_ctor{0};
[[gnu::visibility("default")]] std::atomic<int> lifecycle_thread_done{0};
[[gnu::visibility("default")]] CUfunction lifecycle_function = nullptr;
}

namespace {

constexpr unsigned long long kMi = 1ull << 20;

CUresult init_context() {
  CUresult rc = cuInit(0);
  if (rc != CUDA_SUCCESS) return rc;
  CUcontext ctx = nullptr;
  if ((rc = cuDevicePrimaryCtxRetain(&ctx, 0)) != CUDA_SUCCESS) return rc;
  return cuCtxSetCurrent(ctx);
}

unsigned long long fill(unsigned long long chunk) {
  unsigned long long total = 0;
  CUdeviceptr p = 0;
  while (total < 64 * kMi && cuMemAlloc(&p, chunk) == CUDA_SUCCESS) total += chunk;
  return total;
}

pid_t make_child(const char* variant) {
  if (std::strcmp(variant, "_Fork") == 0) return _Fork();
  if (std::strcmp(variant, "vfork") == 0) return vfork();
  if (std::strcmp(variant, "clone") == 0) return static_cast<pid_t>(syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0));
  return fork();
}

// launch=false: thread A makes the process's first CUDA call (cuInit);
// launch=true: the process has a context, and A makes its first launch.
int deadlock(const char* lib, bool launch) {
  std::atomic<int> thread_rc{-1};
  CUcontext ctx = nullptr;
  if (launch) {
    CUmodule module = nullptr;
    if (init_context() != CUDA_SUCCESS || cuCtxGetCurrent(&ctx) != CUDA_SUCCESS ||
        cuModuleLoadData(&module, "spin_10us") != CUDA_SUCCESS ||
        cuModuleGetFunction(&lifecycle_function, module, "spin_10us") != CUDA_SUCCESS)
      return 3;
  }
  std::thread a([&] {
    lifecycle_thread_tid.store(static_cast<int>(syscall(SYS_gettid)));
    if (launch) cuCtxSetCurrent(ctx);
    // Start the call once the constructor holds the loader lock (spinning,
    // so that "sleeping" means blocked in the call).
    while (lifecycle_in_ctor.load() == 0) sched_yield();
    thread_rc.store(launch ? cuLaunchKernel(lifecycle_function, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr)
                           : cuInit(0));
    lifecycle_thread_done.store(1);
  });
  void* h = dlopen(lib, RTLD_NOW);
  a.join();
  auto ctor_rc = h ? reinterpret_cast<int*>(dlsym(h, "lifecycle_ctor_rc")) : nullptr;
  std::printf("deadlock loaded=%d ctor_rc=%d thread_rc=%d\n", h != nullptr, ctor_rc ? *ctor_rc : -2, thread_rc.load());
  return 0;
}

int fork_exit(const char* variant) {
  if (init_context() != CUDA_SUCCESS) return 3;
  CUdeviceptr p = 0;
  for (int i = 0; i < 6; ++i)
    if (cuMemAlloc(&p, kMi) != CUDA_SUCCESS) return 4;
  std::fflush(stdout);
  pid_t child = make_child(variant);
  if (child == 0) exit(0);  // runs every destructor, gpuslice's included
  if (child < 0) return 5;
  int status = 0;
  waitpid(child, &status, 0);
  std::printf("fork-exit variant=%s extra_bytes=%llu\n", variant, fill(kMi));
  return 0;
}

int fork_inherit(const char* variant) {
  size_t f = 0, t = 0;
  std::printf("fork-inherit parent_query_rc=%d\n", cuMemGetInfo(&f, &t));  // bootstraps gpuslice only
  std::fflush(stdout);
  pid_t child = make_child(variant);
  if (child == 0) {
    unsigned long long got = init_context() == CUDA_SUCCESS ? fill(kMi) : 0;
    char line[128];
    int n = std::snprintf(line, sizeof line, "fork-inherit child_bytes=%llu\n", got);
    ssize_t ignored = write(1, line, static_cast<size_t>(n));
    (void)ignored;
    _exit(0);  // dies without any cleanup
  }
  if (child < 0) return 5;
  int status = 0;
  waitpid(child, &status, 0);
  if (init_context() != CUDA_SUCCESS) return 3;
  std::printf("fork-inherit parent_bytes=%llu\n", fill(kMi));
  return 0;
}

int hold(unsigned long long bytes) {
  if (init_context() != CUDA_SUCCESS) return 3;
  CUdeviceptr p = 0;
  std::printf("hold rc=%d\n", cuMemAlloc(&p, bytes));
  return 0;
}

int truncate_region() {
  if (init_context() != CUDA_SUCCESS) return 3;
  CUdeviceptr p = 0, q = 0;
  std::printf("truncate first_rc=%d\n", cuMemAlloc(&p, kMi));
  const char* path = std::getenv("GPUSLICE_REGION");
  if (path == nullptr || truncate(path, 0) != 0) return 6;  // what a careless process could do
  std::fflush(stdout);
  usleep(50 * 1000);
  std::printf("truncate second_rc=%d\n", cuMemAlloc(&q, kMi));
  std::printf("truncate free_rc=%d\n", cuMemFree(p));
  std::printf("truncate survived=1\n");
  return 0;
}

bool has_thread(const char* name) {
  // /proc/<pid>/task/<tid>/comm of every thread of this process.
  char path[384];
  char self_task[64];
  std::snprintf(self_task, sizeof self_task, "/proc/%d/task", static_cast<int>(getpid()));
  DIR* dir = opendir(self_task);
  if (dir == nullptr) return false;
  bool found = false;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::snprintf(path, sizeof path, "%s/%s/comm", self_task, e->d_name);
    FILE* f = std::fopen(path, "re");
    if (f == nullptr) continue;
    char comm[32] = {};
    if (std::fgets(comm, sizeof comm, f) != nullptr && std::strncmp(comm, name, std::strlen(name)) == 0) found = true;
    std::fclose(f);
  }
  closedir(dir);
  return found;
}

int quiet() {
  if (init_context() != CUDA_SUCCESS) return 3;
  CUdeviceptr p = 0;
  const CUresult alloc_rc = cuMemAlloc(&p, kMi);
  CUmodule module = nullptr;
  CUfunction f = nullptr;
  if (cuModuleLoadData(&module, "spin_10us") != CUDA_SUCCESS ||
      cuModuleGetFunction(&f, module, "spin_10us") != CUDA_SUCCESS)
    return 4;
  int launched = 0;
  for (int i = 0; i < 20; ++i)
    if (cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr) == CUDA_SUCCESS) ++launched;
  cuCtxSynchronize();
  usleep(50 * 1000);  // a feedback thread, if any, has started by now
  std::printf("quiet alloc_rc=%d launched=%d feedback_thread=%d nvml_loaded=%d\n", alloc_rc, launched,
              has_thread("gpuslice"), dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD) != nullptr);
  return 0;
}

int share(unsigned long long bytes, const char* uid, int hold_ms) {
  if (uid != nullptr && std::strcmp(uid, "-") != 0) {
    const auto id = static_cast<uid_t>(std::strtoul(uid, nullptr, 10));
    if (setresgid(id, id, id) != 0 || setresuid(id, id, id) != 0) return 7;
  }
  if (init_context() != CUDA_SUCCESS) return 3;
  CUdeviceptr p = 0;
  std::printf("share uid=%u rc=%d\n", static_cast<unsigned>(getuid()), cuMemAlloc(&p, bytes));
  std::fflush(stdout);
  if (hold_ms > 0) usleep(static_cast<useconds_t>(hold_ms) * 1000);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2) return 2;
  const char* mode = argv[1];
  if (std::strcmp(mode, "deadlock") == 0 && argc > 2) return deadlock(argv[2], false);
  if (std::strcmp(mode, "deadlock-launch") == 0 && argc > 2) return deadlock(argv[2], true);
  if (std::strcmp(mode, "null-arrays") == 0) {
    std::printf("null-arrays array=%d array3d=%d mipmapped=%d\n", cuArrayCreate(nullptr, nullptr),
                cuArray3DCreate(nullptr, nullptr), cuMipmappedArrayCreate(nullptr, nullptr, 1));
    return 0;
  }
  if (std::strcmp(mode, "fork-exit") == 0 && argc > 2) return fork_exit(argv[2]);
  if (std::strcmp(mode, "fork-inherit") == 0 && argc > 2) return fork_inherit(argv[2]);
  if (std::strcmp(mode, "hold") == 0 && argc > 2) return hold(std::strtoull(argv[2], nullptr, 0));
  if (std::strcmp(mode, "truncate") == 0) return truncate_region();
  if (std::strcmp(mode, "quiet") == 0) return quiet();
  if (std::strcmp(mode, "fill") == 0) {
    if (init_context() != CUDA_SUCCESS) return 3;
    std::printf("fill bytes=%llu\n", fill(kMi));
    return 0;
  }
  if (std::strcmp(mode, "exec") == 0) {
    if (init_context() != CUDA_SUCCESS) return 3;
    CUdeviceptr p = 0;
    for (int i = 0; i < 6; ++i)
      if (cuMemAlloc(&p, kMi) != CUDA_SUCCESS) return 4;
    std::fflush(stdout);
    char* const args[] = {argv[0], const_cast<char*>("fill"), nullptr};
    execv("/proc/self/exe", args);
    return 5;
  }
  if (std::strcmp(mode, "share") == 0 && argc > 2)
    return share(std::strtoull(argv[2], nullptr, 0), argc > 3 ? argv[3] : nullptr, argc > 4 ? std::atoi(argv[4]) : 0);
  return 2;
}
