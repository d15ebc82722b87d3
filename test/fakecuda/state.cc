// Creating, attaching and maintaining the shared state file (see state.h).
#include "state.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "cgroup_limits.h"
#include "scheduler.h"

namespace gpuslice::fakecuda {

std::uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

namespace {

std::uint64_t fnv1a(const char* text) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (; *text != '\0'; ++text) {
    hash ^= static_cast<unsigned char>(*text);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

std::size_t ring_offset() { return (sizeof(StateHeader) + 4095) & ~std::size_t{4095}; }
std::size_t sched_offset_for(std::uint32_t devices) {
  return ring_offset() + std::size_t{devices} * kRingEntries * sizeof(RingEntry);
}
// The scheduler's tables exist only in realistic-profile files.
std::size_t total_size_for(const Config& config) {
  std::size_t total = sched_offset_for(config.devices);
  if (config.profile == Profile::realistic) total += sched_bytes(config.devices);
  return total;
}

bool slot_lock(int fd, int index, short type, int cmd) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = kSlotLockBase + index;
  lock.l_len = 1;
  return fcntl(fd, cmd, &lock) == 0;
}

}  // namespace

State* State::map_fd(int fd, char* error, std::size_t error_len) {
  // The real driver keeps device nodes open, which a program's stray write to
  // a standard descriptor it closed cannot corrupt; the state file the
  // simulator keeps instead stays above 2 so that it cannot be either.
  if (fd >= 0 && fd <= 2) {
    const int high = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    close(fd);
    fd = high;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < sizeof(StateHeader)) {
    std::snprintf(error, error_len, "fakecuda: state file too small or unreadable");
    close(fd);
    return nullptr;
  }
  void* map = mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    std::snprintf(error, error_len, "fakecuda: mmap of state file failed: %s", std::strerror(errno));
    close(fd);
    return nullptr;
  }
  auto* header = static_cast<StateHeader*>(map);
  if (header->magic != kStateMagic || header->abi_version != kStateAbiVersion ||
      header->header_size != sizeof(StateHeader) || header->total_size != static_cast<std::uint64_t>(st.st_size)) {
    std::snprintf(error, error_len,
                  "fakecuda: state file is not a fakecuda v%u state (magic/abi/size mismatch); remove it "
                  "(fakecuda-ctl reset)",
                  kStateAbiVersion);
    munmap(map, static_cast<std::size_t>(st.st_size));
    close(fd);
    return nullptr;
  }
  auto* state = new (std::nothrow) State();
  if (state == nullptr) {
    munmap(map, static_cast<std::size_t>(st.st_size));
    close(fd);
    std::snprintf(error, error_len, "fakecuda: out of host memory");
    return nullptr;
  }
  state->fd_ = fd;
  state->header_ = header;
  state->mapped_size_ = static_cast<std::size_t>(st.st_size);
  return state;
}

State* State::open_existing(const char* path, char* error, std::size_t error_len) {
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    std::snprintf(error, error_len, "fakecuda: cannot open state file %s: %s", path, std::strerror(errno));
    return nullptr;
  }
  return map_fd(fd, error, error_len);
}

State* State::open_or_create(const Config& config, char* error, std::size_t error_len) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    int fd = open(config.state_path, O_RDWR | O_CLOEXEC);
    if (fd >= 0) return map_fd(fd, error, error_len);
    if (errno != ENOENT) {
      std::snprintf(error, error_len, "fakecuda: cannot open state file %s: %s", config.state_path,
                    std::strerror(errno));
      return nullptr;
    }
    // Build the whole state in a private temporary file, then publish it with
    // link(), which fails if another first process won the race: every process
    // then maps one fully initialised file.
    char temp[sizeof(config.state_path) + 16];
    std::snprintf(temp, sizeof(temp), "%s.XXXXXX", config.state_path);
    int temp_fd = mkostemp(temp, O_CLOEXEC);
    if (temp_fd < 0) {
      std::snprintf(error, error_len, "fakecuda: cannot create state file next to %s: %s", config.state_path,
                    std::strerror(errno));
      return nullptr;
    }
    std::size_t total = total_size_for(config);
    void* map = MAP_FAILED;
    if (ftruncate(temp_fd, static_cast<off_t>(total)) == 0) {
      map = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, temp_fd, 0);
    }
    if (map == MAP_FAILED) {
      std::snprintf(error, error_len, "fakecuda: cannot size/map state file: %s", std::strerror(errno));
      close(temp_fd);
      unlink(temp);
      return nullptr;
    }
    // The file is zero-filled, which is the valid initial value of every atomic.
    auto* header = static_cast<StateHeader*>(map);
    header->abi_version = kStateAbiVersion;
    header->header_size = sizeof(StateHeader);
    header->total_size = total;
    header->devices = config.devices;
    header->sms = config.sms;
    header->integrated = config.integrated;
    header->memory_bytes = config.memory_bytes;
    header->context_bytes = config.context_bytes;
    header->uuid_seed = fnv1a(config.state_path);
    header->created_mono_ns = mono_ns();
    {
      timespec real{};
      clock_gettime(CLOCK_REALTIME, &real);
      header->created_real_ns =
          static_cast<std::uint64_t>(real.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(real.tv_nsec);
    }
    header->ring_offset = ring_offset();
    header->ring_entries = kRingEntries;
    header->profile = static_cast<std::uint32_t>(config.profile);
    header->jitter_pct = config.jitter_pct;
    header->module_memory = config.module_memory;
    header->seed = config.seed;
    header->nvml_period_ns = config.nvml_period_ns;
    header->timeslice_ns = config.timeslice_ns;
    header->launch_cost_ns = config.launch_cost_ns;
    header->queue_depth = config.queue_depth;
    header->sched_offset = sched_offset_for(config.devices);
    std::memcpy(header->driver_version, config.driver_version, sizeof(header->driver_version));
    header->driver_branch = config.driver_branch;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&header->mutex, &attr);
    pthread_mutexattr_destroy(&attr);
    header->magic = kStateMagic;
    munmap(map, total);
    if (link(temp, config.state_path) == 0) {
      unlink(temp);
      return map_fd(temp_fd, error, error_len);
    }
    int link_errno = errno;
    close(temp_fd);
    unlink(temp);
    if (link_errno != EEXIST) {
      std::snprintf(error, error_len, "fakecuda: cannot publish state file %s: %s", config.state_path,
                    std::strerror(link_errno));
      return nullptr;
    }
    // Lost the race: loop and attach to the winner's file.
  }
  std::snprintf(error, error_len, "fakecuda: state file %s keeps disappearing", config.state_path);
  return nullptr;
}

State::~State() {
  if (header_ != nullptr) munmap(header_, mapped_size_);
  if (fd_ >= 0) close(fd_);
}

RingEntry* State::ring(std::uint32_t index) {
  auto* base = reinterpret_cast<char*>(header_) + header_->ring_offset;
  return reinterpret_cast<RingEntry*>(base) + std::size_t{index} * header_->ring_entries;
}

bool State::lock() {
  int rc = pthread_mutex_lock(&header_->mutex);
  if (rc == EOWNERDEAD) {
    // The previous holder died inside a critical section. Each one leaves the
    // state valid after every single store, so marking it consistent is enough;
    // the dead owner's slot is reaped by the caller.
    pthread_mutex_consistent(&header_->mutex);
    rc = 0;
  }
  return rc == 0;
}

void State::unlock() { pthread_mutex_unlock(&header_->mutex); }

State::Lock::Lock(State& state) : state_(state) { locked_ = state_.lock(); }

State::Lock::~Lock() {
  if (locked_) state_.unlock();
}

bool State::slot_alive(int index) const {
  if (fd_ < 0) return true;  // cannot tell: never reap on a guess
  header_->slot_probes.fetch_add(1, std::memory_order_relaxed);
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = kSlotLockBase + index;
  lock.l_len = 1;
  if (fcntl(fd_, F_OFD_GETLK, &lock) != 0) return true;
  return lock.l_type != F_UNLCK;
}

int State::slots_high() const {
  const std::uint32_t high = header_->slots_high.load(std::memory_order_acquire);
  return static_cast<int>(high < kMaxSlots ? high : kMaxSlots);
}

int State::reap_locked(int own_slot) {
  int reaped = 0;
  const int high = slots_high();
  for (int i = 0; i < high; ++i) {
    ProcSlot& slot = header_->slot[i];
    if (i == own_slot || slot.state.load(std::memory_order_acquire) == 0) continue;
    if (slot_alive(i)) continue;
    // Like the real driver at process exit: everything the process held is freed.
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      slot.alloc_bytes[d].store(0, std::memory_order_relaxed);
      slot.context_bytes[d].store(0, std::memory_order_relaxed);
      slot.contexts[d].store(0, std::memory_order_relaxed);
      slot.busy_ns[d].store(0, std::memory_order_relaxed);
      slot.graphics[d].store(0, std::memory_order_relaxed);
      slot.managed_bytes[d].store(0, std::memory_order_relaxed);
      slot.managed_held_bytes[d].store(0, std::memory_order_relaxed);
    }
    slot.state.store(0, std::memory_order_release);
    ++reaped;
  }
  return reaped;
}

int State::claim_slot_locked(std::uint32_t pid, std::uint32_t host_pid, std::uint64_t start_time,
                             std::uint64_t pidns_inode, std::uint64_t cgroup_ino) {
  reap_locked(-1);
  for (int i = 0; i < static_cast<int>(kMaxSlots); ++i) {
    ProcSlot& slot = header_->slot[i];
    if (slot.state.load(std::memory_order_acquire) != 0) continue;
    // Liveness lock first: if we die before publishing, the slot is still free.
    if (!slot_lock(fd_, i, F_WRLCK, F_OFD_SETLK)) continue;
    // The mark first: a claimer that dies before publishing leaves it one
    // slot too high (harmless), never a live slot above it.
    if (header_->slots_high.load(std::memory_order_relaxed) < static_cast<std::uint32_t>(i) + 1)
      header_->slots_high.store(static_cast<std::uint32_t>(i) + 1, std::memory_order_release);
    slot.pid.store(pid, std::memory_order_relaxed);
    slot.host_pid.store(host_pid, std::memory_order_relaxed);
    slot.start_time.store(start_time, std::memory_order_relaxed);
    slot.pidns_inode.store(pidns_inode, std::memory_order_relaxed);
    slot.cgroup_ino.store(cgroup_ino, std::memory_order_relaxed);
    slot.generation.fetch_add(1, std::memory_order_relaxed);
    slot.state.store(1, std::memory_order_release);
    return i;
  }
  return -1;
}

std::uint64_t State::device_used_locked(std::uint32_t dev) const {
  std::uint64_t used = 0;
  const int high = slots_high();
  for (int i = 0; i < high; ++i) {
    const ProcSlot& slot = header_->slot[i];
    if (slot.state.load(std::memory_order_acquire) == 0) continue;
    used +=
        slot.alloc_bytes[dev].load(std::memory_order_relaxed) + slot.context_bytes[dev].load(std::memory_order_relaxed);
  }
  return used;
}

std::atomic<ChargeProbe> g_charge_probe{nullptr};
std::atomic<ChargeProbe> g_uncharge_probe{nullptr};

bool State::charge_locked(int own_slot, std::uint32_t dev, std::uint64_t bytes, bool context) {
  if (own_slot < 0 || dev >= header_->devices) return false;
  std::uint64_t used = device_used_locked(dev);
  if (bytes > header_->memory_bytes || used > header_->memory_bytes - bytes) return false;
  if (!cgroup_admits_locked(*this, own_slot, dev, bytes)) return false;
  ProcSlot& slot = header_->slot[own_slot];
  (context ? slot.context_bytes[dev] : slot.alloc_bytes[dev]).fetch_add(bytes, std::memory_order_relaxed);
  if (ChargeProbe probe = g_charge_probe.load(std::memory_order_acquire)) probe(*this, own_slot, dev, bytes, context);
  return true;
}

bool State::charge_managed_locked(int own_slot, std::uint32_t dev, std::uint64_t bytes) {
  if (own_slot < 0 || dev >= header_->devices) return false;
  const std::uint64_t used = device_used_locked(dev);
  if (bytes > header_->memory_bytes || used > header_->memory_bytes - bytes) return false;
  ProcSlot& slot = header_->slot[own_slot];
  slot.managed_bytes[dev].fetch_add(bytes, std::memory_order_relaxed);
  slot.managed_held_bytes[dev].fetch_add(bytes, std::memory_order_relaxed);
  slot.alloc_bytes[dev].fetch_add(bytes, std::memory_order_relaxed);
  if (ChargeProbe probe = g_charge_probe.load(std::memory_order_acquire)) probe(*this, own_slot, dev, bytes, false);
  return true;
}

// Two figures of the managed part, lowered on either side of the held bytes
// (uncharges take no lock): managed_bytes before them, so the cgroup limits'
// usage (held less managed) is never understated; managed_held_bytes after
// them, so a reader of it before the held bytes (device_managed_locked, the
// bench's watcher) never takes out more than the device still holds.
void State::uncharge_managed(int own_slot, std::uint32_t dev, std::uint64_t bytes) {
  if (own_slot < 0 || dev >= header_->devices || bytes == 0) return;
  ProcSlot& slot = header_->slot[own_slot];
  slot.managed_bytes[dev].fetch_sub(bytes, std::memory_order_seq_cst);
  uncharge(own_slot, dev, bytes, false);
  slot.managed_held_bytes[dev].fetch_sub(bytes, std::memory_order_seq_cst);
}

std::uint64_t State::device_managed_locked(std::uint32_t dev, std::uint64_t* used) const {
  std::uint64_t managed = 0, held = 0;
  const int high = slots_high();
  for (int i = 0; i < high; ++i) {
    const ProcSlot& slot = header_->slot[i];
    if (slot.state.load(std::memory_order_acquire) == 0) continue;
    managed += slot.managed_held_bytes[dev].load(std::memory_order_seq_cst);  // first: see uncharge_managed
    held +=
        slot.alloc_bytes[dev].load(std::memory_order_seq_cst) + slot.context_bytes[dev].load(std::memory_order_seq_cst);
  }
  *used = held;
  return managed;
}

void State::uncharge(int own_slot, std::uint32_t dev, std::uint64_t bytes, bool context) {
  if (own_slot < 0 || dev >= header_->devices || bytes == 0) return;
  ProcSlot& slot = header_->slot[own_slot];
  (context ? slot.context_bytes[dev] : slot.alloc_bytes[dev]).fetch_sub(bytes, std::memory_order_relaxed);
  if (ChargeProbe probe = g_uncharge_probe.load(std::memory_order_acquire)) probe(*this, own_slot, dev, bytes, context);
}

void State::release_slot(int own_slot) {
  if (own_slot < 0) return;
  Lock lock(*this);
  ProcSlot& slot = header_->slot[own_slot];
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    slot.alloc_bytes[d].store(0, std::memory_order_relaxed);
    slot.context_bytes[d].store(0, std::memory_order_relaxed);
    slot.contexts[d].store(0, std::memory_order_relaxed);
    slot.graphics[d].store(0, std::memory_order_relaxed);
    slot.managed_bytes[d].store(0, std::memory_order_relaxed);
    slot.managed_held_bytes[d].store(0, std::memory_order_relaxed);
  }
  slot.state.store(0, std::memory_order_release);
  slot_lock(fd_, own_slot, F_UNLCK, F_OFD_SETLK);
}

void State::forget_fd_after_fork() {
  // Not closed: like the real driver's device files, the descriptor (and the
  // parent's liveness lock on its open description) stays in the child until
  // it execs (O_CLOEXEC) or exits. A SIGKILLed parent's device memory is
  // freed only then, as the driver frees it when its files' last reference
  // goes. The child just never uses it.
  fd_ = -1;
}

ProcessIdentity current_process_identity() {
  ProcessIdentity id{};
  id.pid = static_cast<std::uint32_t>(getpid());
  id.host_pid = id.pid;
  if (FILE* status = std::fopen("/proc/self/status", "re")) {
    char line[512];
    while (std::fgets(line, sizeof(line), status) != nullptr) {
      unsigned first = 0;
      // NSpid lists this process's pid in each namespace, outermost (as seen by
      // this /proc's namespace) first: the host pid on real hardware.
      if (std::sscanf(line, "NSpid: %u", &first) == 1) {
        id.host_pid = first;
        break;
      }
    }
    std::fclose(status);
  }
  if (FILE* stat_file = std::fopen("/proc/self/stat", "re")) {
    char buffer[1024];
    std::size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, stat_file);
    buffer[n] = '\0';
    std::fclose(stat_file);
    // Field 22 (starttime) counted after the ')' that ends the command name.
    if (const char* p = std::strrchr(buffer, ')')) {
      int field = 2;
      for (; *p != '\0' && field < 22; ++p) {
        if (*p == ' ') ++field;
      }
      id.start_time = std::strtoull(p, nullptr, 10);
    }
  }
  struct stat ns {};
  if (stat("/proc/self/ns/pid", &ns) == 0) id.pidns_inode = ns.st_ino;
  id.cgroup_ino = own_cgroup_ino();
  return id;
}

}  // namespace gpuslice::fakecuda

namespace gpuslice::fakecuda {

namespace {
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

void device_uuid(const StateHeader& header, std::uint32_t dev, unsigned char out[16]) {
  std::uint64_t a = splitmix64(header.uuid_seed ^ (0x1000 + dev));
  std::uint64_t b = splitmix64(a ^ 0x5eed);
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<unsigned char>(a >> (8 * i));
    out[8 + i] = static_cast<unsigned char>(b >> (8 * i));
  }
  out[6] = static_cast<unsigned char>((out[6] & 0x0f) | 0x40);  // RFC 4122 version 4 shape
  out[8] = static_cast<unsigned char>((out[8] & 0x3f) | 0x80);
}

void device_uuid_string(const StateHeader& header, std::uint32_t dev, char* out, std::size_t len) {
  unsigned char u[16];
  device_uuid(header, dev, u);
  std::snprintf(out, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2],
                u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

}  // namespace gpuslice::fakecuda
