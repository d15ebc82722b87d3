// Per-cgroup device-memory limits (cgroup_limits.h).
#include "cgroup_limits.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace gpuslice::fakecuda {
namespace {

constexpr long kCgroup2Magic = 0x63677270;  // CGROUP2_SUPER_MAGIC (linux/magic.h)

}  // namespace

const char* cgroup_root() {
  const char* root = std::getenv("FAKECUDA_CGROUP_ROOT");
  if (root == nullptr || *root != '/') root = "/sys/fs/cgroup";
  struct statfs fs {};
  if (statfs(root, &fs) != 0 || fs.f_type != kCgroup2Magic) return "";
  return root;
}

bool cgroup_v2_path(const char* text, char* out, std::size_t len) {
  for (const char* line = text; line != nullptr && *line != '\0';) {
    const char* end = std::strchr(line, '\n');
    const std::size_t n = end != nullptr ? static_cast<std::size_t>(end - line) : std::strlen(line);
    if (n >= 3 && std::strncmp(line, "0::", 3) == 0 && n - 3 < len) {
      std::memcpy(out, line + 3, n - 3);
      out[n - 3] = '\0';
      return out[0] == '/';
    }
    line = end != nullptr ? end + 1 : nullptr;
  }
  return false;
}

std::uint64_t own_cgroup_ino() {
  const char* root = cgroup_root();
  if (*root == '\0') return 0;
  char text[4096];
  const int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const ssize_t n = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (n <= 0) return 0;
  text[n] = '\0';
  char path[2048];
  if (!cgroup_v2_path(text, path, sizeof(path))) return 0;
  char full[4096];
  if (std::snprintf(full, sizeof(full), "%s%s", root, path) >= static_cast<int>(sizeof(full))) return 0;
  struct stat st {};
  if (stat(full, &st) != 0 || !S_ISDIR(st.st_mode)) return 0;
  return st.st_ino;
}

CgroupLimit* cgroup_limit_locked(State& state, std::uint64_t ino) {
  if (ino == 0) return nullptr;
  for (CgroupLimit& e : state.header().cgroup_limit) {
    if (e.ino.load(std::memory_order_relaxed) == ino) return &e;
  }
  return nullptr;
}

std::uint64_t cgroup_used_locked(State& state, std::uint64_t ino, std::uint32_t dev) {
  std::uint64_t used = 0;
  const int high = state.slots_high();
  for (int i = 0; i < high; ++i) {
    const ProcSlot& slot = state.header().slot[i];
    if (slot.state.load(std::memory_order_acquire) == 0 || slot.cgroup_ino.load(std::memory_order_relaxed) != ino)
      continue;
    used += slot.alloc_bytes[dev].load(std::memory_order_relaxed) -
            slot.managed_bytes[dev].load(std::memory_order_relaxed) +
            slot.context_bytes[dev].load(std::memory_order_relaxed);
  }
  return used;
}

bool cgroup_admits_locked(State& state, int own_slot, std::uint32_t dev, std::uint64_t bytes) {
  if (state.header().driver_branch < kCgroupLimitsBranch) return true;
  const std::uint64_t ino = state.header().slot[own_slot].cgroup_ino.load(std::memory_order_relaxed);
  const CgroupLimit* e = cgroup_limit_locked(state, ino);
  if (e == nullptr || (e->limited.load(std::memory_order_relaxed) & (1u << dev)) == 0) return true;
  const std::uint64_t hard = e->hard[dev].load(std::memory_order_relaxed);
  const std::uint64_t used = cgroup_used_locked(state, ino, dev);
  return bytes <= hard && used <= hard - bytes;
}

bool cgroup_set_locked(State& state, std::uint64_t ino, std::uint32_t dev, std::uint64_t soft, std::uint64_t hard,
                       bool clear) {
  CgroupLimit* e = cgroup_limit_locked(state, ino);
  if (clear) {
    if (e != nullptr) {
      const std::uint32_t left = e->limited.load(std::memory_order_relaxed) & ~(1u << dev);
      e->limited.store(left, std::memory_order_relaxed);
      if (left == 0) e->ino.store(0, std::memory_order_relaxed);
    }
    return true;
  }
  if (e == nullptr) {
    for (CgroupLimit& free_entry : state.header().cgroup_limit) {
      if (free_entry.ino.load(std::memory_order_relaxed) == 0) {
        e = &free_entry;
        e->limited.store(0, std::memory_order_relaxed);
        e->ino.store(ino, std::memory_order_relaxed);
        break;
      }
    }
    if (e == nullptr) return false;
  }
  e->soft[dev].store(soft, std::memory_order_relaxed);
  e->hard[dev].store(hard, std::memory_order_relaxed);
  e->limited.fetch_or(1u << dev, std::memory_order_relaxed);
  return true;
}

}  // namespace gpuslice::fakecuda
