// refusal_overlap: the invariant monitor's refusal check against a request
// that overlapped the refused one and ended before it was judged
// (chaos_test.cc, ChaosMonitor.*Overlapping*). No gpuslice: the program holds
// 48 MiB of the container's device memory and reports two requests to the
// monitor directly, each refused: A of 24 MiB, then B of 8 MiB.
//   refusal_overlap overlap   B begins while A is in flight; A ends first
//   refusal_overlap apart     B begins after A ended
//   refusal_overlap absorbed MIB   only B, with MIB MiB reported as memory
//                                  allocated outside CUDA that gpuslice
//                                  measured into a live object (monitor_absorbed)
//   refusal_overlap reclaim    B (1 MiB) frees 16 MiB more inside its request
//                              (as the library's reclaim trims pools before
//                              lowering their count), then A (8 MiB) is refused
//   refusal_overlap noreclaim  the same with the 16 MiB freed before B began
//   refusal_overlap extra-ends        only B, refused while the agent's extra
//                                     (16 MiB, heartbeat fresh) was in force;
//                                     the same cycle writes 0 before B is judged
//   refusal_overlap extra-gone        the same with the 0 written before B began
//   refusal_overlap extra-next-cycle  the 0 written by a next cycle (a new
//                                     heartbeat) during B
//   refusal_overlap mid-exit-ends PID     only B; PID (its leader a zombie,
//                                         another thread alive) is SIGKILLed
//                                         during B and is dead when B is judged
//   refusal_overlap dead-before PID       the same with PID dead before B began
// Prints "judged a=R b=R" (1: a violation reported; -1: not asked).
//   refusal_overlap measured-short FREED_MIB ALLOWED_MIB   (run under
//     gpuslice, the simulator's chaos sleeping in module_load) another
//     thread frees FREED_MIB of graphics memory never imported inside an
//     8 MiB module's measured load; ALLOWED_MIB is reported as freed during measurements
//     (monitor_measured_short); prints "checkpoint=N" (violations found).
//   refusal_overlap undercount MIB [WAIT_MS]   (run under gpuslice,
//     FAKECUDA_MONITOR_CALLS=1) 8 MiB allocated; its slot (and the device's
//     sum) then counts MIB MiB less than the process holds (as a count given
//     back before the driver freed) for 50 ms, or with WAIT_MS until another
//     process's report named it and it wrote its last operations there
//     (answer_dump_request, as its sampler does; WAIT_MS at most), restored
//     after; prints "undercount pid=P dumped=D cut=C" (C: bytes taken out).
//   refusal_overlap undercount-used MIB [WAIT_MS]   the same with its slot
//     untouched: the device's sum alone (used_bytes) counts MIB MiB less (as
//     bytes out of used_bytes before leaving a slot); prints the same line.
//   refusal_overlap overcount-held MIB WAIT_MS   (run under gpuslice) 8 MiB
//     allocated; its slot (and the device's sum) then counts MIB MiB more than
//     it holds (as an over-count of the library's) until another process's
//     refusal report named it and it wrote its operations and holdings there
//     (WAIT_MS at most), restored after; prints "overcount-held ready=1 pid=P"
//     once counted, then "overcount-held pid=P dumped=D"
//   refusal_overlap overcount ADD_KIB POOLS   (run under gpuslice) 1 MiB
//     allocated and freed (its lease spare), a checkpoint; POOLS said
//     (monitor_pools) and ADD_KIB KiB added to its slot's committed_bytes,
//     a checkpoint; prints "overcount spare=S slack=B before=N after=M"
//     (S its lease's spare, B committed less held, N and M violations).
// The count direction (FAKECUDA_MONITOR_CALLS=1; this program plays
// gpuslice's part, counting in the region what it holds after its start):
//   refusal_overlap stalled-call MS   a call (monitor_call_begin/end) is
//     granted 8 MiB, then stalls MS ms before it counts them and returns
//   refusal_overlap returned-uncounted  a call is granted 8 MiB and returns
//     without counting them
//   refusal_overlap context MS DESTROY   a call creates a context (implicit
//     memory: FAKECUDA_CONTEXT_MEMORY), counts it, stalls MS ms and, with
//     DESTROY 1, destroys it before it returns (as gpuslice destroys what
//     does not fit); with 0 it returns keeping it; then 300 ms
//   refusal_overlap outside MIB [HELD]   HELD MiB (default 8) allocated outside
//     CUDA (a graphics allocation) held 300 ms, MIB MiB of them said to be
//     (monitor_outside_begin)
//   refusal_overlap release-outside DECLARE   8 MiB of graphics memory
//     imported (counted); then, inside a count check between its reads of
//     the processes and of the count (the monitor's test hook), its count
//     given back as gpuslice does when the import is destroyed, the memory
//     declared outside CUDA first with DECLARE 1 (as the worker does), not
//     with 0; freed 50 ms later; prints "release-outside hooked=H"
// A dead process whose files another task releases (calls.cc, released_excused):
//   refusal_overlap mm-holder DIR   (run under gpuslice) 24 MiB allocated; a
//     task sharing its memory, its own descriptors closed (CLONE_VM: as a
//     reader of /proc/<pid>/stat holding its mm at its last exit_mm), is
//     made; prints "mm-holder pid=P holder=H", then sleeps until killed.
//     Once DIR/release exists the holder unmaps the region file — its last
//     reference: gpuslice's slot lock goes — and keeps the simulator's
//     state file mapped (its lock, the device memory's), as the kernel's
//     release of its files rescheduled between the two leaves them; writes
//     DIR/released; exits once DIR/exit exists (60 s at most).
//   refusal_overlap reap-hold MS   (run under gpuslice) its first
//     cuMemGetInfo (gpuslice reaps the dead's slots first), 4 MiB allocated,
//     held MS ms (the sampler checks), freed; prints "reap-hold done"
#include <cuda.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <gpuslice/region.h>

#include "fakecuda_query.h"
#include "limiter/lease.h"
#include "monitor.h"
#include "monitor_internal.h"

namespace {
std::atomic<int> g_step{0};
// release-outside: the count check's test hook gives the import's count back (once).
std::atomic<std::atomic<std::uint64_t>*> g_hook_used{nullptr};
std::atomic<bool> g_hook_declare{false};
std::atomic<bool> g_hook_ran{false};
void release_between_reads() {
  std::atomic<std::uint64_t>* used = g_hook_used.load();
  if (used == nullptr || g_hook_ran.exchange(true)) return;
  if (g_hook_declare.load()) gpuslice::chaos::monitor_outside_begin(0, 8u << 20);
  used->fetch_sub(8u << 20);
}
void await(int step) {
  while (g_step.load() < step) std::this_thread::yield();
}

// The container's region (GPUSLICE_REGION), mapped writable: this program
// plays the agent's part in it. nullptr when it cannot.
gpuslice::Region* map_region() {
  const char* path = std::getenv("GPUSLICE_REGION");
  if (path == nullptr) return nullptr;
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return nullptr;
  void* mapped = mmap(nullptr, sizeof(gpuslice::Region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return mapped == MAP_FAILED ? nullptr : static_cast<gpuslice::Region*>(mapped);
}
// This process's live slot in r (the last that names it), or nullptr.
gpuslice::Slot* own_slot(gpuslice::Region* r) {
  gpuslice::Slot* own = nullptr;
  for (gpuslice::Slot& slot : r->slots) {
    if (slot.state.load() == gpuslice::kSlotLive && slot.pid.load() == static_cast<std::uint32_t>(getpid()))
      own = &slot;
  }
  return own;
}
// A cycle of the agent: its heartbeat, then the device's extra.
void agent_cycle(gpuslice::Region* r, std::uint64_t extra) {
  r->header.agent_heartbeat_ns.store(fakecuda_now_ns());
  r->devices[0].agent_extra_bytes.store(extra);
}
// /proc/<pid>/stat: a zombie with its last thread gone (waited for 5 s at most).
bool await_dead(pid_t pid) {
  for (int i = 0; i < 1000; ++i) {
    char path[64], text[512];
    std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return true;
    const ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (n > 0) {
      text[n] = '\0';
      const char* paren = std::strrchr(text, ')');
      unsigned long threads = 0;
      char state = 0;
      // Fields 3 (state) and 20 (threads) after the command's ')'.
      if (paren != nullptr &&
          std::sscanf(paren + 1, " %c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %lu", &state,
                      &threads) == 2 &&
          state == 'Z' && threads <= 1)
        return true;
    }
    usleep(5000);
  }
  return false;
}

// The count-direction modes (see the top).
int count_direction(int argc, char** argv) {
  using gpuslice::chaos::monitor_call_begin;
  using gpuslice::chaos::monitor_call_end;
  gpuslice::Region* r = map_region();
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  monitor_call_begin();  // the start: its context, counted before it "returns"
  if (r == nullptr || cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    std::printf("init failed\n");
    return 1;
  }
  std::atomic<std::uint64_t>& used = r->devices[0].used_bytes;
  used.fetch_add(fakecuda_process_used_bytes(0, 0));
  monitor_call_end();
  constexpr std::uint64_t kBytes = 8u << 20;
  CUdeviceptr p = 0;
  if (std::strcmp(argv[1], "context") == 0) {
    if (argc != 4) return 2;
    monitor_call_begin();
    const std::uint64_t before = fakecuda_process_used_bytes(0, 0);
    CUcontext made = nullptr;
    if (cuCtxCreate(&made, nullptr, 0, dev) != CUDA_SUCCESS) return 1;
    const std::uint64_t bytes = fakecuda_process_used_bytes(0, 0) - before;
    used.fetch_add(bytes);
    usleep(static_cast<useconds_t>(std::strtoul(argv[2], nullptr, 10) * 1000));
    const bool destroy = std::strcmp(argv[3], "1") == 0;
    if (destroy) {
      cuCtxDestroy(made);
      used.fetch_sub(bytes);
    }
    cuCtxSetCurrent(ctx);
    monitor_call_end();
    usleep(300 * 1000);
    if (!destroy) cuCtxDestroy(made);
  } else if (std::strcmp(argv[1], "outside") == 0) {
    if (argc != 3 && argc != 4) return 2;
    const std::uint64_t declared = std::strtoull(argv[2], nullptr, 10) << 20;
    const std::uint64_t held = argc == 4 ? std::strtoull(argv[3], nullptr, 10) << 20 : kBytes;
    gpuslice::chaos::monitor_outside_begin(0, declared);
    const std::uint64_t gfx = fakecuda_graphics_alloc(0, held);
    if (gfx == 0) return 1;
    usleep(300 * 1000);
    fakecuda_graphics_free(gfx);
    gpuslice::chaos::monitor_outside_end(0, declared);
  } else if (std::strcmp(argv[1], "release-outside") == 0) {
    if (argc != 3) return 2;
    gpuslice::chaos::monitor_outside_begin(0, kBytes);
    const std::uint64_t gfx = fakecuda_graphics_alloc(0, kBytes);
    if (gfx == 0) return 1;
    used.fetch_add(kBytes);  // imported: counted from here on
    gpuslice::chaos::monitor_outside_end(0, kBytes);
    usleep(20 * 1000);
    g_hook_declare.store(std::strcmp(argv[2], "1") == 0);
    g_hook_used.store(&used);
    gpuslice::chaos::internal::g_check_between_reads.store(release_between_reads);
    for (int i = 0; i < 2000 && !g_hook_ran.load(); ++i) usleep(1000);
    usleep(50 * 1000);  // more checks: the memory outside CUDA, its count given back
    fakecuda_graphics_free(gfx);
    if (g_hook_declare.load()) gpuslice::chaos::monitor_outside_end(0, kBytes);
    std::printf("release-outside hooked=%d\n", g_hook_ran.load() ? 1 : 0);
  } else {
    const bool stalled = std::strcmp(argv[1], "stalled-call") == 0;
    if (stalled && argc != 3) return 2;
    monitor_call_begin();
    if (cuMemAlloc(&p, kBytes) != CUDA_SUCCESS) return 1;
    if (stalled) {
      usleep(static_cast<useconds_t>(std::strtoul(argv[2], nullptr, 10) * 1000));
      used.fetch_add(kBytes);
    }
    monitor_call_end();
  }
  usleep(50 * 1000);  // the sampler's checks (every 5 ms) after the call returned
  std::printf("done\n");
  return 0;
}

// mm-holder: what the holder unmaps, and the files it waits for (set before
// it is made; it shares this memory and makes raw system calls only).
constexpr int kMaxRanges = 8;
std::uintptr_t g_range_start[kMaxRanges], g_range_end[kMaxRanges];
int g_ranges = 0;
char g_release[1024], g_released[1024], g_exit[1024];
alignas(64) char g_holder_stack[1 << 16];

bool await_file(const char* path) {
  const timespec ms{0, 1000000};
  for (int i = 0; i < 60000; ++i) {
    if (syscall(SYS_faccessat, AT_FDCWD, path, F_OK, 0) == 0) return true;
    syscall(SYS_nanosleep, &ms, nullptr);
  }
  return false;
}
int holder(void*) {
  syscall(SYS_close_range, 0u, ~0u, 0u);  // the mm only, as a /proc reader's mmget (nor the test's output)
  if (await_file(g_release)) {
    for (int i = 0; i < g_ranges; ++i) syscall(SYS_munmap, g_range_start[i], g_range_end[i] - g_range_start[i]);
    const long fd = syscall(SYS_openat, AT_FDCWD, g_released, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0) syscall(SYS_close, fd);
    await_file(g_exit);
  }
  syscall(SYS_exit_group, 0);
  return 0;
}

int released_files(int argc, char** argv) {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  gpuslice::chaos::monitor_call_begin();  // the start: its context, counted before it "returns"
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    std::printf("init failed\n");
    return 1;
  }
  gpuslice::chaos::monitor_call_end();
  CUdeviceptr p = 0;
  if (std::strcmp(argv[1], "reap-hold") == 0) {
    std::size_t free_bytes = 0, total_bytes = 0;
    cuMemGetInfo(&free_bytes, &total_bytes);
    if (cuMemAlloc(&p, 4u << 20) != CUDA_SUCCESS) return 1;
    usleep(static_cast<useconds_t>(std::strtoul(argv[2], nullptr, 10) * 1000));
    cuMemFree(p);
    std::printf("reap-hold done\n");
    return 0;
  }
  const char* region = std::getenv("GPUSLICE_REGION");
  struct stat region_stat {};
  if (argc != 3 || region == nullptr || stat(region, &region_stat) != 0 || cuMemAlloc(&p, 24u << 20) != CUDA_SUCCESS)
    return 1;
  // Every mapping of the region file (gpuslice's, and the monitor's own).
  if (FILE* maps = std::fopen("/proc/self/maps", "re")) {
    char line[1024];
    while (std::fgets(line, sizeof(line), maps) != nullptr && g_ranges < kMaxRanges) {
      unsigned long start = 0, end = 0, inode = 0;
      if (std::sscanf(line, "%lx-%lx %*s %*s %*s %lu", &start, &end, &inode) == 3 && inode == region_stat.st_ino) {
        g_range_start[g_ranges] = start;
        g_range_end[g_ranges++] = end;
      }
    }
    std::fclose(maps);
  }
  std::snprintf(g_release, sizeof(g_release), "%s/release", argv[2]);
  std::snprintf(g_released, sizeof(g_released), "%s/released", argv[2]);
  std::snprintf(g_exit, sizeof(g_exit), "%s/exit", argv[2]);
  const pid_t h = clone(holder, g_holder_stack + sizeof(g_holder_stack), CLONE_VM | SIGCHLD, nullptr);
  if (g_ranges == 0 || h < 0) return 1;
  std::printf("mm-holder pid=%d holder=%d\n", static_cast<int>(getpid()), static_cast<int>(h));
  std::fflush(stdout);
  for (int i = 0; i < 600; ++i) usleep(100 * 1000);  // killed long before
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using gpuslice::chaos::monitor_request_begin;
  using gpuslice::chaos::monitor_request_end;
  if (argc < 2 || argc > 4) return 2;
  if (std::strcmp(argv[1], "stalled-call") == 0 || std::strcmp(argv[1], "returned-uncounted") == 0 ||
      std::strcmp(argv[1], "outside") == 0 || std::strcmp(argv[1], "context") == 0 ||
      std::strcmp(argv[1], "release-outside") == 0)
    return count_direction(argc, argv);
  if ((std::strcmp(argv[1], "mm-holder") == 0 || std::strcmp(argv[1], "reap-hold") == 0) && argc == 3)
    return released_files(argc, argv);
  const bool overlap = std::strcmp(argv[1], "overlap") == 0;
  const bool absorbed = std::strcmp(argv[1], "absorbed") == 0 && argc == 3;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUdeviceptr held = 0;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS ||
      cuMemAlloc(&held, 48u << 20) != CUDA_SUCCESS) {
    std::printf("init failed\n");
    return 1;
  }
  int a = -1, b = -1;
  if (std::strcmp(argv[1], "measured-short") == 0) {
    if (argc != 4) return 2;
    const std::uint64_t gfx = fakecuda_graphics_alloc(0, std::strtoull(argv[2], nullptr, 10) << 20);
    if (gfx == 0) return 1;
    // A measured call first (NVML is loaded then), then the load the free
    // lands in: while the simulator's chaos sleeps at its entry (after
    // gpuslice read NVML, before the driver places the module).
    if (cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE, 1u << 20) != CUDA_SUCCESS) return 1;
    std::thread other([&] {
      char ops[512];
      for (int i = 0; i < 1000000; ++i) {
        fakecuda_recent_operations(ops, sizeof(ops), 1);
        if (std::strstr(ops, "sleep") != nullptr && std::strstr(ops, "(in module_load)") != nullptr) break;
        usleep(10);
      }
      fakecuda_graphics_free(gfx);
    });
    CUmodule module = nullptr;
    const CUresult rc = cuModuleLoadData(&module, ".global .align 8 .b8 g[8388608];\n.entry k\n");
    other.join();
    gpuslice::chaos::monitor_measured_short(0, std::strtoull(argv[3], nullptr, 10) << 20);
    std::size_t free_b = 0, total_b = 0;
    cuMemGetInfo(&free_b, &total_b);
    std::printf("load rc=%d held=%llu counted=%zu checkpoint=%d\n", static_cast<int>(rc),
                static_cast<unsigned long long>(fakecuda_process_used_bytes(0, 0)), total_b - free_b,
                gpuslice::chaos::monitor_checkpoint());
    return 0;
  }
  if (std::strcmp(argv[1], "overcount-held") == 0) {
    if (argc != 4) return 2;
    gpuslice::Region* r = map_region();
    CUdeviceptr p = 0;
    if (r == nullptr || cuMemAlloc(&p, 8u << 20) != CUDA_SUCCESS) return 1;
    gpuslice::Slot* own = own_slot(r);
    if (own == nullptr) return 1;
    // Counted, not held: MIB MiB more in the slot and the device's sum.
    const std::uint64_t add = std::strtoull(argv[2], nullptr, 10) << 20;
    own->committed_bytes[0].fetch_add(add);
    r->devices[0].used_bytes.fetch_add(add);
    std::printf("overcount-held ready=1 pid=%d\n", static_cast<int>(getpid()));
    std::fflush(stdout);
    bool dumped = false;
    for (unsigned long waited = 0; waited < std::strtoul(argv[3], nullptr, 10) && !dumped; waited += 5) {
      usleep(5 * 1000);
      dumped = gpuslice::chaos::internal::answer_dump_request();
    }
    own->committed_bytes[0].fetch_sub(add);
    r->devices[0].used_bytes.fetch_sub(add);
    std::printf("overcount-held pid=%d dumped=%d\n", static_cast<int>(getpid()), dumped ? 1 : 0);
    return cuMemFree(p) == CUDA_SUCCESS ? 0 : 1;
  }
  if (std::strcmp(argv[1], "undercount") == 0 || std::strcmp(argv[1], "undercount-used") == 0) {
    if (argc != 3 && argc != 4) return 2;
    const bool slot_too = std::strcmp(argv[1], "undercount") == 0;
    gpuslice::Region* r = map_region();
    CUdeviceptr p = 0;
    if (r == nullptr || cuMemAlloc(&p, 8u << 20) != CUDA_SUCCESS) return 1;
    gpuslice::Slot* own = own_slot(r);
    if (own == nullptr) return 1;
    // The slot counts what the process holds less MIB MiB (its spare lease out too).
    const std::uint64_t counted = own->committed_bytes[0].load();
    const std::uint64_t target = fakecuda_process_used_bytes(0, 0) - (std::strtoull(argv[2], nullptr, 10) << 20);
    const std::uint64_t cut = counted - target;
    if (slot_too) own->committed_bytes[0].fetch_sub(cut);
    r->devices[0].used_bytes.fetch_sub(cut);
    bool dumped = false;
    if (argc == 4) {
      for (unsigned long waited = 0; waited < std::strtoul(argv[3], nullptr, 10) && !dumped; waited += 5) {
        usleep(5 * 1000);
        dumped = gpuslice::chaos::internal::answer_dump_request();
      }
    } else {
      usleep(50 * 1000);  // the sampler's checks (every 5 ms)
    }
    if (slot_too) own->committed_bytes[0].fetch_add(cut);
    r->devices[0].used_bytes.fetch_add(cut);
    std::printf("undercount pid=%d dumped=%d cut=%llu\n", static_cast<int>(getpid()), dumped ? 1 : 0,
                static_cast<unsigned long long>(cut));
    return 0;
  }
  if (std::strcmp(argv[1], "overcount") == 0) {
    if (argc != 4) return 2;
    gpuslice::Region* r = map_region();
    CUdeviceptr small = 0;
    if (r == nullptr || cuMemAlloc(&small, 1u << 20) != CUDA_SUCCESS || cuMemFree(small) != CUDA_SUCCESS) return 1;
    gpuslice::Slot* own = own_slot(r);
    if (own == nullptr) return 1;
    const std::uint64_t spare = gpuslice::limiter::lease_spare(own->lease[0].word.load());
    const std::uint64_t slack = own->committed_bytes[0].load() - fakecuda_process_used_bytes(0, 0);
    const int before = gpuslice::chaos::monitor_checkpoint();
    // Counted, not held: ADD_KIB more in the slot (and the device's sum).
    const std::uint64_t add = std::strtoull(argv[2], nullptr, 10) << 10;
    gpuslice::chaos::monitor_pools(static_cast<unsigned>(std::strtoul(argv[3], nullptr, 10)));
    own->committed_bytes[0].fetch_add(add);
    r->devices[0].used_bytes.fetch_add(add);
    const int after = gpuslice::chaos::monitor_checkpoint();
    own->committed_bytes[0].fetch_sub(add);
    r->devices[0].used_bytes.fetch_sub(add);
    std::printf("overcount spare=%llu slack=%llu before=%d after=%d\n", static_cast<unsigned long long>(spare),
                static_cast<unsigned long long>(slack), before, after);
    return 0;
  }
  const bool reclaim = std::strcmp(argv[1], "reclaim") == 0;
  if (reclaim || std::strcmp(argv[1], "noreclaim") == 0) {
    CUdeviceptr more = 0;
    if (cuMemAlloc(&more, 16u << 20) != CUDA_SUCCESS) return 1;
    if (!reclaim) cuMemFree(more);
    std::thread tb([&] {
      monitor_request_begin(0, 1u << 20);
      if (reclaim) cuMemFree(more);
      g_step.store(1);
      await(2);
      b = monitor_request_end(false, "cuMemAlloc");
    });
    await(1);
    monitor_request_begin(0, 8u << 20);
    a = monitor_request_end(true, "cuMemAlloc");
    g_step.store(2);
    tb.join();
    std::printf("judged a=%d b=%d\n", a, b);
    return 0;
  }
  if (std::strncmp(argv[1], "extra-", 6) == 0) {
    gpuslice::Region* r = map_region();
    if (r == nullptr) return 1;
    agent_cycle(r, 16u << 20);
    if (std::strcmp(argv[1], "extra-gone") == 0) r->devices[0].agent_extra_bytes.store(0);
    monitor_request_begin(0, 8u << 20);  // refused here, the extra in force
    if (std::strcmp(argv[1], "extra-ends") == 0) r->devices[0].agent_extra_bytes.store(0);
    if (std::strcmp(argv[1], "extra-next-cycle") == 0) agent_cycle(r, 0);
    b = monitor_request_end(true, "cuMemAlloc");
    std::printf("judged a=%d b=%d\n", a, b);
    return 0;
  }
  if (std::strcmp(argv[1], "mid-exit-ends") == 0 || std::strcmp(argv[1], "dead-before") == 0) {
    if (argc != 3) return 2;
    const pid_t pid = static_cast<pid_t>(std::atoi(argv[2]));
    const bool during = std::strcmp(argv[1], "mid-exit-ends") == 0;
    if (!during && (kill(pid, SIGKILL) != 0 || !await_dead(pid))) return 1;
    monitor_request_begin(0, 8u << 20);  // refused here, the process mid-exit
    if (during && (kill(pid, SIGKILL) != 0 || !await_dead(pid))) return 1;
    b = monitor_request_end(true, "cuMemAlloc");
    std::printf("judged a=%d b=%d\n", a, b);
    return 0;
  }
  if (absorbed) {
    gpuslice::chaos::monitor_absorbed(0, std::strtoull(argv[2], nullptr, 10) << 20);
    monitor_request_begin(0, 8u << 20);
    b = monitor_request_end(true, "cuMemAlloc");
    std::printf("judged a=%d b=%d\n", a, b);
    return 0;
  }
  std::thread ta([&] {
    monitor_request_begin(0, 24u << 20);
    g_step.store(1);
    if (overlap) await(2);
    a = monitor_request_end(true, "cuMemAlloc");
    g_step.store(3);
  });
  std::thread tb([&] {
    await(overlap ? 1 : 3);
    monitor_request_begin(0, 8u << 20);
    if (overlap) {
      g_step.store(2);
      await(3);
    }
    b = monitor_request_end(true, "cuMemAlloc");
  });
  ta.join();
  tb.join();
  std::printf("judged a=%d b=%d\n", a, b);
  return 0;
}
