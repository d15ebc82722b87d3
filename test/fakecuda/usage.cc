// Per-process views of the shared state, shared by the fake NVML, fakecuda-ctl
// and the fakecuda_* test API so they cannot disagree.
#include <dirent.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "state.h"

namespace gpuslice::fakecuda {

int collect_usage_locked(State& state, int dev, ProcessUsage* out, int max) {
  int count = 0;
  StateHeader& header = state.header();
  const int high = state.slots_high();
  for (int i = 0; i < high; ++i) {
    const ProcSlot& slot = header.slot[i];
    if (slot.state.load(std::memory_order_acquire) == 0) continue;
    for (std::uint32_t d = 0; d < header.devices; ++d) {
      if (dev >= 0 && d != static_cast<std::uint32_t>(dev)) continue;
      std::uint32_t contexts = slot.contexts[d].load(std::memory_order_relaxed);
      std::uint64_t alloc = slot.alloc_bytes[d].load(std::memory_order_relaxed);
      std::uint64_t context = slot.context_bytes[d].load(std::memory_order_relaxed);
      // Like NVML: a process is on a device when it has a context or memory there.
      if (contexts == 0 && alloc == 0 && context == 0) continue;
      if (count < max) {
        out[count] = ProcessUsage{slot.pid.load(std::memory_order_relaxed),
                                  slot.host_pid.load(std::memory_order_relaxed),
                                  d,
                                  contexts,
                                  alloc + context,
                                  context,
                                  slot.busy_ns[d].load(std::memory_order_relaxed),
                                  slot.graphics[d].load(std::memory_order_relaxed),
                                  slot.start_time.load(std::memory_order_relaxed),
                                  slot.pidns_inode.load(std::memory_order_relaxed)};
      }
      ++count;
    }
  }
  return count;
}

namespace {

// The last NSpid field (the pid in the process's own namespace) and field 22
// of /proc/<pid>/stat (its start time); false if either cannot be read.
bool inner_pid_and_start(const char* pid, std::uint32_t* inner, std::uint64_t* start) {
  char path[300], line[1024];
  std::snprintf(path, sizeof(path), "/proc/%s/status", pid);
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return false;
  bool found = false;
  while (!found && std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "NSpid:", 6) != 0) continue;
    char* p = line + 6;
    for (char* end = p;; p = end) {
      const unsigned long v = std::strtoul(p, &end, 10);
      if (end == p) break;
      *inner = static_cast<std::uint32_t>(v);
      found = true;
    }
  }
  std::fclose(f);
  std::snprintf(path, sizeof(path), "/proc/%s/stat", pid);
  f = std::fopen(path, "re");
  if (!found || f == nullptr) {
    if (f != nullptr) std::fclose(f);
    return false;
  }
  const std::size_t n = std::fread(line, 1, sizeof(line) - 1, f);
  std::fclose(f);
  line[n] = '\0';
  const char* p = std::strrchr(line, ')');
  if (p == nullptr) return false;
  for (int field = 2; *p != '\0' && field < 22; ++p) {
    if (*p == ' ') ++field;
  }
  *start = std::strtoull(p, nullptr, 10);
  return true;
}

}  // namespace

std::uint32_t host_pid_seen_here(const ProcessUsage& u) {
  struct stat own {};
  if (u.host_pid != u.pid || u.pidns_inode == 0 || stat("/proc/self/ns/pid", &own) != 0 ||
      own.st_ino == u.pidns_inode) {
    return u.host_pid;
  }
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return u.host_pid;
  std::uint32_t found = u.host_pid;
  while (const dirent* e = readdir(proc)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    char path[300];
    std::snprintf(path, sizeof(path), "/proc/%s/ns/pid", e->d_name);
    struct stat ns {};
    std::uint32_t inner = 0;
    std::uint64_t start = 0;
    if (stat(path, &ns) != 0 || ns.st_ino != u.pidns_inode) continue;
    if (!inner_pid_and_start(e->d_name, &inner, &start) || inner != u.pid || start != u.start_time) continue;
    found = static_cast<std::uint32_t>(std::strtoul(e->d_name, nullptr, 10));
    break;
  }
  closedir(proc);
  return found;
}

}  // namespace gpuslice::fakecuda
