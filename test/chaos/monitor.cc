// The invariant monitor (README.md; test/fakecuda/README.md, "Chaos mode and
// invariant monitor"): an observer of the simulated driver (fakecuda_query.h,
// "Observers") that every program of the chaos suite links. The simulator
// knows what every process really holds on every device (its state file,
// read through its query API); a process belongs to the container whose
// gpuslice region its environment names (GPUSLICE_REGION, as the library
// reads it), and the monitor reads that region itself. With
// FAKECUDA_MONITOR=1 every grant of device memory (under the state lock, so
// all processes' grants are checked in one order) and a background sampler
// check, per container and device:
//   quota: the device holds at most the region's limit (quota, or the
//          device-resident allowance when smaller). An explicit allocation
//          that ends above it by more than the implicit grants of the last
//          lag and the managed grants in flight is a violation at once;
//          memory the library can only measure after the fact (contexts,
//          modules) may stand above it while the call that made it is in
//          flight (monitor_call_begin/end) and for at most the lag after;
//          memory outside CUDA (graphics) by its bytes; managed memory
//          only in flight (the library advises what it spills to the host
//          right after the call: until the granting thread's next change of
//          device memory).
//          A limit lowered at run time applies after the lag to driver calls
//          begun after it (one begun before may grant later: its bytes raise
//          the ceiling, up to the highest limit in force since it began),
//          and memory held above it is allowed until freed.
//   count: gpuslice's count of what the device may hold (used_bytes less
//          the bytes it counts as spilled, i.e. served as managed memory
//          advised to the host, plus agent_extra_bytes) is not below what
//          the device holds, beyond what calls.cc excuses (bytes granted
//          inside calls in flight, memory outside CUDA, graphics frees inside
//          measurements, processes in their exit handlers): at once when the
//          program brackets its calls (FAKECUDA_MONITOR_CALLS=1), else for
//          more than the lag.
// A violation prints the seed, the invariant, the numbers and this process's
// last operations to stderr and appends them to the report file; the count of
// violations is kept in <state>.monitor.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <gpuslice/region.h>

#include "fakecuda_query.h"
#include "monitor.h"
#include "limiter/lease.h"
#include "monitor_internal.h"

namespace gpuslice::chaos {
namespace internal {

MonitorConfig g_config;
MonitorShared* g_shared = nullptr;
int g_slot = -1;              // this process's slot in the simulator's state
std::uint32_t g_devices = 0;  // the simulated machine's devices
namespace {
const Region* g_region = nullptr;  // mapped read-only once it exists
int g_region_fd = -1;              // its description, kept: the slots' file locks are probed through it
int g_region_device[kSimDevices];  // fake device -> region entry; -1 unknown
std::atomic<int> g_reports{0};

std::uint64_t fnv1a(const char* text) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (; *text != '\0'; ++text) h = (h ^ static_cast<unsigned char>(*text)) * 0x100000001b3ull;
  return h == 0 ? 1 : h;
}

bool parse_ms(const char* name, std::uint64_t lo, std::uint64_t hi, std::uint64_t& out, char* error, std::size_t len) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return true;
  char* end = nullptr;
  errno = 0;
  unsigned long long value = std::strtoull(v, &end, 10);
  if (v[0] < '0' || v[0] > '9' || errno != 0 || *end != '\0' || value < lo || value > hi) {
    std::snprintf(error, len, "%s='%s': expected an integer %llu-%llu", name, v, static_cast<unsigned long long>(lo),
                  static_cast<unsigned long long>(hi));
    return false;
  }
  out = value;
  return true;
}

// A variable that is 0 or 1 (unset: `out` unchanged).
bool parse_flag(const char* name, bool& out, char* error, std::size_t len) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return true;
  if (std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0) {
    std::snprintf(error, len, "%s='%s': expected 0 or 1", name, v);
    return false;
  }
  out = v[0] == '1';
  return true;
}

MonitorShared* map_shared(const char* state_path) {
  char path[1100];
  std::snprintf(path, sizeof(path), "%s.monitor", state_path);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return nullptr;
  struct stat st {};
  if (fstat(fd, &st) != 0 ||
      (static_cast<std::size_t>(st.st_size) < sizeof(MonitorShared) && ftruncate(fd, sizeof(MonitorShared)) != 0)) {
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, sizeof(MonitorShared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return nullptr;
  auto* shared = static_cast<MonitorShared*>(p);
  shared->magic.store(kMonitorMagic, std::memory_order_relaxed);
  return shared;
}

}  // namespace

const Region* region() {
  if (g_region != nullptr) return g_region;
  int fd = open(g_config.region, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st {};
  void* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) >= sizeof(Region)) {
    p = mmap(nullptr, sizeof(Region), PROT_READ, MAP_SHARED, fd, 0);
  }
  if (p == MAP_FAILED) {
    close(fd);
    return nullptr;
  }
  auto* r = static_cast<const Region*>(p);
  if (r->header.magic != kRegionMagic || r->header.abi_version != kRegionAbiVersion) {
    munmap(p, sizeof(Region));
    close(fd);
    return nullptr;
  }
  g_region_fd = fd;
  g_region = r;
  return g_region;
}

int region_fd() { return region() != nullptr ? g_region_fd : -1; }

int region_device(std::uint32_t dev, const Region& r) {
  if (g_region_device[dev] >= 0) return g_region_device[dev];
  unsigned char uuid[16];
  if (fakecuda_device_uuid(static_cast<int>(dev), uuid) == 0) return -1;
  for (int i = 0; i < static_cast<int>(gpuslice::kMaxDevices); ++i) {
    const DeviceState& d = r.devices[i];
    if (d.uuid_state.load(std::memory_order_acquire) == 2 && std::memcmp(d.uuid, uuid, 16) == 0) {
      g_region_device[dev] = i;
      return i;
    }
  }
  return -1;
}

bool member(int i, std::uint32_t dev, fakecuda_slot_info* slot) {
  if (fakecuda_slot_info_get(i, dev, slot) == 0 || slot->claimed == 0) return false;
  return g_shared->member_container[i].load(std::memory_order_acquire) == g_config.container &&
         g_shared->member_generation[i].load(std::memory_order_acquire) == slot->generation;
}

bool member_alive(int i, std::uint32_t dev, fakecuda_slot_info* slot) {
  return member(i, dev, slot) && (i == g_slot || fakecuda_slot_alive(i) != 0);
}

// Device bytes held by the live processes of this container, and of them the
// managed grants in flight. State lock held.
std::uint64_t container_total(std::uint32_t dev, std::uint64_t* own, std::uint64_t* in_flight, Excused* excused) {
  std::uint64_t total = 0;
  // A count check's reads (excused asked for) are kept for its report (holders.cc).
  if (excused != nullptr) ++g_seen_serial;
  const int high = fakecuda_slots_high_locked();  // no slot above it was ever claimed
  for (int i = 0; i < high; ++i) {
    // A process's managed grant in flight before what it holds: its advice
    // to the host (an uncharge, made without the state lock) lowers what it
    // holds first and then lands the grant (release, in land_managed), so a
    // landed grant read here is missing from the held bytes read after it.
    // The other order could read the held bytes before the advice and the
    // flight after its landing: an excess of the whole grant, which the
    // device never held beside the rest (the campaign's six `spill` seeds).
    const std::uint64_t flying = g_shared->managed_in_flight[i][dev].load(std::memory_order_acquire);
    if (g_config.read_delay_us != 0) usleep(static_cast<useconds_t>(g_config.read_delay_us));
    fakecuda_slot_info slot{};
    if (!member_alive(i, dev, &slot)) continue;
    const std::uint64_t held = slot.held_bytes;
    if (i == g_slot && own != nullptr) *own = held;
    total += held;
    if (in_flight != nullptr) *in_flight += flying;
    if (excused != nullptr) {
      std::uint64_t ex = count_excused(i, dev, held, excused);
      const Region* r = region();
      const int rd = r != nullptr ? region_device(dev, *r) : -1;
      std::uint64_t word = 0;
      const long long counted = slot_counted(i, slot.pid, rd, &word);
      // No live gpuslice slot: a dead process whose files another task still releases (calls.cc)?
      if (counted < 0 && held > ex) {
        const std::uint64_t released = released_excused(i, slot.pid, slot.generation, held - ex);
        excused->released += released;
        ex += released;
      }
      g_seen[i] = Seen{g_seen_serial, slot.generation, slot.pid, held, ex, counted, word};
    }
  }
  return total;
}

Watch* watch_for(std::uint32_t dev, std::uint64_t limit, std::uint64_t total) {
  const std::uint64_t key = g_config.container * 31 + dev + 1;
  for (std::uint32_t probe = 0; probe < kWatches; ++probe) {
    Watch& w = g_shared->watch[(key + probe) % kWatches];
    std::uint64_t seen = w.key.load(std::memory_order_acquire);
    if (seen == key) return &w;
    if (seen == 0) {
      // Claimed under the state lock: no other grant check runs concurrently.
      w.limit_seen.store(limit, std::memory_order_relaxed);
      w.ceiling.store(limit > total ? limit : total, std::memory_order_relaxed);
      w.key.store(key, std::memory_order_release);
      return &w;
    }
  }
  return nullptr;
}

void note_limit(Watch& w, std::uint64_t limit, std::uint64_t now) {
  const std::uint64_t before = w.limit_seen.load(std::memory_order_relaxed);
  if (before == limit) return;
  const std::uint64_t n = w.changes.load(std::memory_order_relaxed);
  w.change_seen_ns[n % kLimitChanges].store(now, std::memory_order_relaxed);
  w.limit_before[n % kLimitChanges].store(before, std::memory_order_relaxed);
  w.changes.store(n + 1, std::memory_order_release);
  w.limit_seen.store(limit, std::memory_order_relaxed);
  w.grace_until_ns.store(now + g_config.lag_ns, std::memory_order_relaxed);
}

std::uint64_t highest_limit_since(const Watch& w, std::uint64_t limit, std::uint64_t began) {
  const std::uint64_t n = w.changes.load(std::memory_order_acquire);
  std::uint64_t highest = limit;
  // Newest first: a change whose lag ended by `began` (and every older one)
  // admitted nothing begun then.
  for (std::uint64_t k = 0; k < n; ++k) {
    if (k == kLimitChanges) return kUnlimited;  // older changes forgotten: unknown
    const std::uint32_t e = static_cast<std::uint32_t>((n - 1 - k) % kLimitChanges);
    if (w.change_seen_ns[e].load(std::memory_order_relaxed) + g_config.lag_ns <= began) break;
    const std::uint64_t before = w.limit_before[e].load(std::memory_order_relaxed);
    if (before > highest) highest = before;
  }
  return highest;
}

// What gpuslice counts as possibly on the device: used_bytes less what it
// counts as spilled (host memory), plus agent_extra_bytes. Spilled bytes are
// read as the library reads them for the allowance (in, used, out), so the
// figure is never below the library's own at any instant.
std::uint64_t resident_used(const DeviceState& d) {
  const std::uint64_t in = d.spilled_in_bytes.load(std::memory_order_seq_cst);
  const std::uint64_t used = d.used_bytes.load(std::memory_order_seq_cst);
  const std::uint64_t out = d.spilled_out_bytes.load(std::memory_order_seq_cst);
  const std::uint64_t spilled = in > out ? in - out : 0;
  return used > spilled ? used - spilled : 0;
}
std::uint64_t resident_count(const DeviceState& d) {
  return resident_used(d) + d.agent_extra_bytes.load(std::memory_order_acquire);
}

// The managed grants in flight the check that reports excused, and its
// count check's excuses and count (state lock held).
std::uint64_t g_check_in_flight = 0, g_check_count = 0;
std::atomic<void (*)()> g_check_between_reads{nullptr};

// Two excuses rise before the count drops: memory a program declares
// outside CUDA before the import that counted it is destroyed (gpuslice
// gives the count back; the graphics memory stays on the device until the
// program frees it), and an exit begun before gpuslice's exit release. A
// check that read them with the processes, before the count, misses one
// declared in between while the count it reads shows the release (seed
// 2,600,536: 11 MiB imported, its import destroyed between the reads, the
// graphics free after). So a process's excuses are read again after the
// count, the larger of the two reads kept (a call's bytes cannot rise
// meanwhile: grants take the state lock the check holds). State lock held.
void excuses_after_count(std::uint32_t dev, Excused* excused) {
  const int high = fakecuda_slots_high_locked();
  for (int i = 0; i < high; ++i) {
    Seen& seen = g_seen[i];
    if (seen.serial != g_seen_serial) continue;
    fakecuda_slot_info slot{};
    if (!member_alive(i, dev, &slot) || slot.generation != seen.generation) continue;
    const std::uint64_t again = count_excused(i, dev, seen.held, nullptr);
    if (again <= seen.excused) continue;
    excused->after_reads += again - seen.excused;
    seen.excused = again;
  }
}
std::atomic<void (*)(char*, std::size_t)> g_describer{nullptr};
Excused g_check_excused;

void report(const char* invariant, const char* detail, std::uint32_t dev, int region_dev, std::uint64_t total,
            std::uint64_t own, std::uint64_t limit, const DeviceState& d, const Grant* grant) {
  g_shared->violations.fetch_add(1, std::memory_order_relaxed);
  const int n = g_reports.fetch_add(1, std::memory_order_relaxed);
  if (n >= 20) return;
  static char text[16384];  // state lock held: one report at a time
  const unsigned long long resident = d.resident_limit_bytes.load(std::memory_order_relaxed);
  int used = std::snprintf(
      text, sizeof(text),
      "fakecuda-monitor: VIOLATION (%s) seed=%llu stream=%llu pid=%d thread=t%u container=%s device=%u (region entry "
      "%d)\n  %s\n  device holds %llu bytes for the container (this process %llu); limit %llu (quota %llu, resident "
      "allowance %llu in the region); gpuslice count %llu (used_bytes %llu - spilled %llu + agent_extra_bytes "
      "%llu)\n  grant: %s%llu bytes in %s\n"
      "  replay: the same FAKECUDA_CHAOS_SEED and schedule (test/chaos/README.md)\n",
      invariant, static_cast<unsigned long long>(fakecuda_chaos_seed()),
      static_cast<unsigned long long>(fakecuda_chaos_stream()), static_cast<int>(getpid()), fakecuda_thread_ordinal(),
      g_config.region, dev, region_dev, detail, static_cast<unsigned long long>(total),
      static_cast<unsigned long long>(own), static_cast<unsigned long long>(limit),
      static_cast<unsigned long long>(d.quota_bytes.load(std::memory_order_relaxed)), resident,
      static_cast<unsigned long long>(resident_count(d)),
      static_cast<unsigned long long>(d.used_bytes.load(std::memory_order_relaxed)),
      static_cast<unsigned long long>(d.spilled_in_bytes.load(std::memory_order_relaxed) -
                                      d.spilled_out_bytes.load(std::memory_order_relaxed)),
      static_cast<unsigned long long>(d.agent_extra_bytes.load(std::memory_order_relaxed)),
      grant == nullptr ? "none (background check) "
                       : (grant->implicit ? "implicit " : (grant->managed ? "managed " : "")),
      static_cast<unsigned long long>(grant != nullptr ? grant->bytes : 0), grant != nullptr ? grant->call : "-");
  if (used < 0) return;
  // Set by check() just before its reports: a refusal's report has no such figure.
  if (const int m = std::strcmp(invariant, "refusal") == 0
                        ? 0
                        : std::snprintf(text + used, sizeof(text) - used,
                                        "  managed grants in flight (excused) at the check: %llu bytes; memory "
                                        "outside CUDA (excused): %llu bytes\n",
                                        static_cast<unsigned long long>(g_check_in_flight),
                                        static_cast<unsigned long long>(g_check_excused.outside));
      m > 0 && static_cast<std::size_t>(used + m) < sizeof(text))
    used += m;
  if (std::strcmp(invariant, "count") == 0) {
    const int m = std::snprintf(
        text + used, sizeof(text) - used,
        "  at the check: gpuslice count %llu (above, and below, read at this report); excused from the count: %llu "
        "(in calls in flight %llu, outside CUDA %llu, measured short %llu, processes in their exit handlers %llu, "
        "declared between the reads %llu, dead processes whose files another task still releases %llu)\n",
        static_cast<unsigned long long>(g_check_count), static_cast<unsigned long long>(g_check_excused.total()),
        static_cast<unsigned long long>(g_check_excused.calls),
        static_cast<unsigned long long>(g_check_excused.outside),
        static_cast<unsigned long long>(g_check_excused.measured_short),
        static_cast<unsigned long long>(g_check_excused.exiting),
        static_cast<unsigned long long>(g_check_excused.after_reads),
        static_cast<unsigned long long>(g_check_excused.released));
    if (m > 0 && static_cast<std::size_t>(used + m) < sizeof(text)) used += m;
  }
  used = append_processes(text, sizeof(text), used, dev, region_dev);
  if (std::strcmp(invariant, "refusal") == 0) used = append_overcounters(text, sizeof(text), used, dev, region_dev);
  // What the device holds for this process, object by object, and (at a
  // checkpoint, its threads parked) what the program holds: the object a
  // count above the device's is of (issue 32's open shapes).
  if (static_cast<std::size_t>(used) + 64 < sizeof(text)) {
    used += std::snprintf(text + used, sizeof(text) - used, "  the simulator's holdings of pid %d:\n",
                          static_cast<int>(getpid()));
    fakecuda_holdings(text + used, sizeof(text) - used);
    used = static_cast<int>(std::strlen(text));
  }
  if (void (*describe)(char*, std::size_t) = g_describer.load(std::memory_order_acquire);
      describe != nullptr && std::strstr(invariant, "checkpoint") != nullptr &&
      static_cast<std::size_t>(used) + 64 < sizeof(text)) {
    used += std::snprintf(text + used, sizeof(text) - used, "  the program's holdings (its threads parked):\n");
    describe(text + used, sizeof(text) - used);
    used = static_cast<int>(std::strlen(text));
  }
  if (static_cast<std::size_t>(used) < sizeof(text)) {
    int m = std::snprintf(text + used, sizeof(text) - used, "  last %d operations of pid %d, oldest first:\n",
                          g_config.ring, static_cast<int>(getpid()));
    if (m > 0) used += m;
  }
  if (static_cast<std::size_t>(used) < sizeof(text)) {
    fakecuda_recent_operations(text + used, sizeof(text) - used, g_config.ring);
    used = static_cast<int>(std::strlen(text));
  }
  ssize_t ignored = write(2, text, static_cast<std::size_t>(used));
  int fd = open(g_config.report, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd >= 0) {
    ignored = write(fd, text, static_cast<std::size_t>(used));
    close(fd);
  }
  (void)ignored;
}

namespace {

// State lock held.
// A check found the condition whose run `since`/`seen` track: returns when
// the run began (now, for a new run: nothing seen, or last seen more than
// lag/2 ago).
std::uint64_t sighting(std::atomic<std::uint64_t>& since, std::atomic<std::uint64_t>& seen, std::uint64_t now,
                       std::uint64_t lag) {
  std::uint64_t begun = since.load(std::memory_order_relaxed);
  const std::uint64_t last = seen.load(std::memory_order_relaxed);
  if (begun == 0 || last == 0 || (now > last && now - last > lag / 2)) {
    begun = now;
    since.store(now, std::memory_order_relaxed);
  }
  seen.store(now, std::memory_order_relaxed);
  return begun;
}

void check(std::uint32_t dev, const Grant* grant) {
  const gpuslice::Region* r = region();
  if (r == nullptr || dev >= gpuslice::kMaxDevices) return;
  const int rd = region_device(dev, *r);
  if (rd < 0) return;
  const DeviceState& d = r->devices[rd];
  g_shared->checks.fetch_add(1, std::memory_order_relaxed);
  std::uint64_t own = 0, in_flight = 0;
  Excused excused;
  // What the device holds is read under the state lock, and gpuslice counts
  // an allocation before the driver grants it (under that lock): the count,
  // read after it and after the excuses (a call's bytes are excused until
  // gpuslice counted them), is never below the count in force then. But a
  // free (the driver's uncharge, then gpuslice's uncount) takes no lock: one
  // landing during the reads may be in the device's figure and out of the
  // count; so may a process that died after its bytes were read, its slot
  // reaped by gpuslice before the count was. So the reads are made again (4
  // times at most) while the machine's uncharges moved or a process died
  // during them; still moving, the count is not judged.
  std::uint64_t total = 0;
  std::uint64_t count = 0;
  bool count_settled = false;
  for (int attempt = 0; attempt < 4 && !count_settled; ++attempt) {
    own = in_flight = 0;
    excused = Excused{};
    const std::uint64_t moved = g_shared->uncharges.load(std::memory_order_acquire);
    total = container_total(dev, &own, &in_flight, &excused);
    if (void (*hook)() = g_check_between_reads.load(std::memory_order_acquire); hook != nullptr) hook();
    count = resident_count(d);
    excuses_after_count(dev, &excused);
    count_settled = total <= count + excused.total() || (g_shared->uncharges.load(std::memory_order_acquire) == moved &&
                                                         live_processes(dev) == excused.processes);
  }
  std::uint64_t limit = d.quota_bytes.load(std::memory_order_acquire);
  const std::uint64_t resident = d.resident_limit_bytes.load(std::memory_order_acquire);
  if (resident != 0 && resident < limit) limit = resident;
  if (g_config.resident_env < limit) limit = g_config.resident_env;
  Watch* w = watch_for(dev, limit, total);
  if (w == nullptr) return;
  const std::uint64_t now = fakecuda_now_ns();
  const std::uint64_t lag = g_config.lag_ns;
  note_limit(*w, limit, now);
  // Implicit grants of the last `lag`: an explicit grant may find the device
  // above the limit by at most their sum (the library measures them after
  // the call and then counts them, or destroys what does not fit).
  if (now >= w->implicit_until_ns.load(std::memory_order_relaxed))
    w->implicit_bytes.store(0, std::memory_order_relaxed);
  if (grant != nullptr && grant->implicit && grant->bytes > 0) {
    w->implicit_until_ns.store(now + lag, std::memory_order_relaxed);
    w->implicit_bytes.fetch_add(grant->bytes, std::memory_order_relaxed);
  }
  // Managed grants in flight likewise: the library's spill holds the device
  // from the driver's allocation until its advice to the host, the granting
  // thread's next change of device memory; any check may find the device
  // above the limit by their sum. Memory the library admitted as resident
  // beyond the limit stays after that. And memory a process holds outside
  // CUDA (a graphics allocation before its import): gpuslice cannot know of
  // it, and refuses its import when it does not fit; excused by its bytes
  // while so held (monitor_outside_begin/end), however long. And implicit
  // grants inside calls still in flight (monitor_call_begin/end): gpuslice
  // measures them after the driver's call and counts or destroys them before
  // the call returns, however long the process waits for a CPU in between.
  // And a dead process's memory while another task still releases its files
  // (released_excused: for the lag): gpuslice, its slot reaped, may admit
  // others meanwhile.
  const std::uint64_t transient = in_flight + excused.outside + excused.implicit_calls + excused.released;
  g_check_in_flight = in_flight;
  g_check_excused = excused;
  g_check_count = count;
  g_seen_report = g_seen_serial;  // its reports name the holders from these reads (holders.cc)
  const std::uint64_t implicit_recent = w->implicit_bytes.load(std::memory_order_relaxed);
  // The ceiling is the limit, or more while memory held above a lowered
  // limit is not yet freed; a raised limit raises it at once.
  std::uint64_t ceiling = w->ceiling.load(std::memory_order_relaxed);
  if (ceiling < limit) ceiling = limit;
  // A grant whose driver call began before the lag of a limit change ended
  // may have been admitted under the limit it replaced: the driver may take
  // any time to grant it (seed 352: 155 ms), and nothing takes it away. It
  // raises the ceiling by its own bytes, at most to what the device holds
  // and to the highest limit in force since its call began (one begun under
  // a limit lowered, then raised a little, fitted the lower one). During the
  // lag as after it: no other excess is excused by a change.
  if (grant != nullptr && grant->began_ns != 0 && grant->began_ns < w->grace_until_ns.load(std::memory_order_relaxed) &&
      total > ceiling) {
    std::uint64_t raised = total - ceiling < grant->bytes ? total : ceiling + grant->bytes;
    const std::uint64_t highest = highest_limit_since(*w, limit, grant->began_ns);
    if (raised > highest) raised = highest > ceiling ? highest : ceiling;
    ceiling = raised;
    w->ceiling.store(ceiling, std::memory_order_relaxed);
  }
  if (limit != kUnlimited && total > ceiling + transient) {
    if (grant != nullptr && !grant->implicit && total > ceiling + implicit_recent + transient) {
      report("quota", "an allocation the driver granted left the container above its limit", dev, rd, total, own,
             ceiling, d, grant);
    } else {
      const std::uint64_t since = sighting(w->excess_since_ns, w->excess_seen_ns, now, lag);
      if (since != now && now - since > lag && w->excess_reported.load(std::memory_order_relaxed) != since) {
        w->excess_reported.store(since, std::memory_order_relaxed);
        report("quota", "the container stayed above its limit longer than FAKECUDA_MONITOR_LAG_MS", dev, rd, total, own,
               ceiling, d, grant);
      }
    }
  } else {
    w->excess_since_ns.store(0, std::memory_order_relaxed);  // none, or what managed grants in flight explain
    if (total <= ceiling) {
      const std::uint64_t lowered = total < ceiling ? total : ceiling;
      w->ceiling.store(lowered > limit ? lowered : limit, std::memory_order_relaxed);
    }
  }
  g_shared->count_judged.fetch_add(count_settled ? 1 : 0, std::memory_order_relaxed);
  g_shared->count_released.fetch_add(excused.released != 0 ? 1 : 0, std::memory_order_relaxed);
  g_shared->count_unsettled.fetch_add(count_settled ? 0 : 1, std::memory_order_relaxed);
  if (!count_settled) {
    // Not judged: the run of sightings neither grows nor ends.
  } else if (total > count + excused.total()) {
    const std::uint64_t since = sighting(w->deficit_since_ns, w->deficit_seen_ns, now, lag);
    const bool at_once = g_config.calls;
    if ((at_once || (since != now && now - since > lag)) &&
        w->deficit_reported.load(std::memory_order_relaxed) != since) {
      w->deficit_reported.store(since, std::memory_order_relaxed);
      report("count",
             at_once ? "gpuslice's count is below what the device holds beyond what calls in flight and the "
                       "documented transients excuse"
                     : "gpuslice's count stayed below what the device holds longer than FAKECUDA_MONITOR_LAG_MS",
             dev, rd, total, own, ceiling, d, grant);
    }
  } else {
    w->deficit_since_ns.store(0, std::memory_order_relaxed);
  }
  g_seen_report = 0;
}

bool call_is(const char* call, const char* name) { return call != nullptr && std::strcmp(call, name) == 0; }

// Entry points (or their helpers) that allocate on the program's request; a
// grant anywhere else (contexts, module/library placement) is implicit.
bool explicit_call(const char* call) {
  static const char* const kExplicit[] = {"alloc_common",           "cuMemAllocManaged", "create_array",
                                          "cuMipmappedArrayCreate", "alloc_async",       "cuMemCreate"};
  for (const char* name : kExplicit) {
    if (call_is(call, name)) return true;
  }
  return false;
}

// This thread's managed grant in flight (MonitorShared::managed_in_flight).
thread_local std::uint64_t t_managed_in_flight = 0;
thread_local std::uint32_t t_managed_dev = 0;
thread_local int t_managed_slot = -1;  // a forked child's copy is not its own

// A change of device memory by this thread ends its managed grant's flight.
void land_managed() {
  if (t_managed_in_flight != 0 && g_shared != nullptr && g_slot >= 0 && t_managed_slot == g_slot)
    g_shared->managed_in_flight[g_slot][t_managed_dev].fetch_sub(t_managed_in_flight, std::memory_order_release);
  t_managed_in_flight = 0;
}

// The simulator's observer (fakecuda_query.h): after every grant to this
// program, under the state lock; the simulator records the operation before
// and runs its chaos point after.
void charged(int slot, unsigned dev, std::uint64_t bytes, int context, const char* call, const char* previous_call) {
  if (g_config.on && slot == g_slot) {
    Grant grant{bytes, context != 0 || !explicit_call(call),
                call_is(call, "cuMemAllocManaged") ||
                    (call_is(call, "alloc_common") && call_is(previous_call, "cuMemAllocManaged")),
                call, fakecuda_call_began_ns()};
    land_managed();
    // Graphics memory is outside CUDA (monitor_outside_begin), not a driver call's.
    note_call_charge(dev, bytes, grant.implicit && !call_is(call, "fakecuda_graphics_alloc"));
    if (grant.managed && bytes > 0 && dev < kSimDevices) {
      g_shared->managed_in_flight[g_slot][dev].fetch_add(bytes, std::memory_order_relaxed);
      t_managed_in_flight = bytes;
      t_managed_dev = dev;
      t_managed_slot = g_slot;
    }
    check(dev, &grant);
  }
}

void uncharged(int slot, unsigned dev, std::uint64_t bytes, int, const char*) {
  if (g_config.on && slot == g_slot) {
    land_managed();
    g_shared->uncharges.fetch_add(1, std::memory_order_acq_rel);  // before gpuslice uncounts (check())
    if (dev < kSimDevices) g_shared->freed[slot][dev].fetch_add(bytes, std::memory_order_relaxed);
    note_uncharge(dev, bytes);
  }
}

void sampler() {
  for (;;) {
    usleep(static_cast<useconds_t>(g_config.interval_ms * 1000));
    if (fakecuda_initialized() == 0) return;
    answer_dump_request();
    if (fakecuda_state_lock() == 0) continue;
    fakecuda_reap_locked();
    for (std::uint32_t dev = 0; dev < g_devices; ++dev) check(dev, nullptr);
    fakecuda_state_unlock();
  }
}

// GPUSLICE_MEMORY_RESIDENT when it is one plain size (the simulator's size
// grammar: digits, then nothing, B, K/M/G/T base 1000 or Ki/Mi/Gi/Ti base 1024).
bool parse_size(const char* text, std::uint64_t& out) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0) return false;
  struct Suffix {
    const char* name;
    std::uint64_t scale;
  };
  static constexpr Suffix kSuffixes[] = {
      {"", 1},
      {"B", 1},
      {"K", 1000ull},
      {"M", 1000ull * 1000},
      {"G", 1000ull * 1000 * 1000},
      {"T", 1000ull * 1000 * 1000 * 1000},
      {"Ki", 1ull << 10},
      {"Mi", 1ull << 20},
      {"Gi", 1ull << 30},
      {"Ti", 1ull << 40},
  };
  for (const Suffix& suffix : kSuffixes) {
    if (std::strcmp(end, suffix.name) == 0) {
      if (value > ~std::uint64_t{0} / suffix.scale) return false;
      out = value * suffix.scale;
      return true;
    }
  }
  return false;
}

// cuInit, after the simulator's own variables: FAKECUDA_MONITOR*.
int configure(const char* state_path, char* error, std::size_t len) {
  MonitorConfig config;
  const char* on = std::getenv("FAKECUDA_MONITOR");
  if (on != nullptr && on[0] != '\0' && std::strcmp(on, "0") != 0) {
    if (std::strcmp(on, "1") != 0) {
      std::snprintf(error, len, "FAKECUDA_MONITOR='%s': expected 0 or 1", on);
      return -1;
    }
    config.on = true;
  }
  std::uint64_t lag_ms = 250;
  std::uint64_t ring = 32;
  if (!parse_ms("FAKECUDA_MONITOR_LAG_MS", 1, 60000, lag_ms, error, len) ||
      !parse_ms("FAKECUDA_MONITOR_INTERVAL_MS", 0, 1000, config.interval_ms, error, len) ||
      !parse_ms("FAKECUDA_MONITOR_RING", 1, 256, ring, error, len) ||
      !parse_ms("FAKECUDA_MONITOR_READ_DELAY_US", 0, 10000, config.read_delay_us, error, len)) {
    return -1;
  }
  if (!parse_flag("FAKECUDA_MONITOR_REFUSALS", config.judge_refusals, error, len) ||
      !parse_flag("FAKECUDA_MONITOR_CALLS", config.calls, error, len) ||
      !parse_flag("FAKECUDA_MONITOR_OVERCOUNT", config.overcount, error, len))
    return -1;
  config.lag_ns = lag_ms * 1000000;
  config.ring = static_cast<int>(ring);
  const char* report = std::getenv("FAKECUDA_MONITOR_REPORT");
  if (report != nullptr && report[0] != '\0') {
    std::snprintf(config.report, sizeof(config.report), "%s", report);
  } else {
    std::snprintf(config.report, sizeof(config.report), "%s.violations", state_path);
  }
  // The container: the region the library would use (README.md's table).
  const char* region = std::getenv("GPUSLICE_REGION");
  if (region == nullptr || region[0] == '\0') region = std::getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
  if (region == nullptr || region[0] == '\0') region = "/dev/shm/gpuslice.region";
  std::snprintf(config.region, sizeof(config.region), "%s", region);
  config.container = fnv1a(config.region);
  if (const char* v = std::getenv("GPUSLICE_MEMORY_RESIDENT"); v != nullptr && v[0] != '\0') {
    std::uint64_t bytes = 0;
    if (parse_size(v, bytes) && bytes > 0) config.resident_env = bytes;
  }
  if (const char* v = std::getenv("GPUSLICE_OVERSUBSCRIBE"); v != nullptr && std::strcmp(v, "spill") == 0)
    config.spill = true;
  if (config.on) {
    g_shared = map_shared(state_path);
    if (g_shared == nullptr) {
      std::snprintf(error, len, "FAKECUDA_MONITOR=1: cannot map %s.monitor: %s", state_path, std::strerror(errno));
      return -1;
    }
  }
  g_config = config;
  return 0;
}

// cuInit, once this process owns its slot: registers it with the monitor.
int attach(int slot, unsigned devices) {
  g_slot = slot;
  g_devices = devices < kSimDevices ? devices : kSimDevices;
  for (int& d : g_region_device) d = -1;
  if (!g_config.on || g_shared == nullptr || slot < 0 || slot >= static_cast<int>(kSimSlots)) return 0;
  fakecuda_slot_info info{};
  fakecuda_slot_info_get(slot, 0, &info);
  g_shared->member_generation[slot].store(0, std::memory_order_release);
  for (auto& bytes : g_shared->managed_in_flight[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->freed[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->requesting[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->request_begun[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->request_ended[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->release_begun[slot]) bytes.store(0, std::memory_order_relaxed);
  for (auto& bytes : g_shared->release_ended[slot]) bytes.store(0, std::memory_order_relaxed);
  g_shared->unknown_begun[slot].store(0, std::memory_order_relaxed);
  g_shared->unknown_ended[slot].store(0, std::memory_order_relaxed);
  g_shared->pools[slot].store(0, std::memory_order_relaxed);
  g_shared->dump_asked[slot].store(0, std::memory_order_relaxed);
  calls_attach(slot);
  g_shared->member_container[slot].store(g_config.container, std::memory_order_release);
  g_shared->member_generation[slot].store(info.generation, std::memory_order_release);
  if (g_config.interval_ms > 0) std::thread(sampler).detach();
  return 1;
}

constexpr fakecuda_observer kObserver = {configure, attach, charged, uncharged};

// Every program that links the monitor registers it before main(), so that
// FAKECUDA_MONITOR=1 works in it as in any other (the simulator refuses the
// variable in a program without it).
[[gnu::constructor]] void register_monitor() { fakecuda_set_observer(&kObserver); }

}  // namespace
}  // namespace internal

using namespace internal;

namespace {
// monitor_measured_short: this process's own (a forked child's start at 0).
std::atomic<std::uint64_t> g_measured_short[kSimDevices];
std::atomic<int> g_measured_short_slot{-1};
}  // namespace

void monitor_measured_short(unsigned dev, std::uint64_t bytes) {
  if (!g_config.on || g_slot < 0 || dev >= g_devices) return;
  if (g_measured_short_slot.exchange(g_slot, std::memory_order_relaxed) != g_slot) {
    for (auto& b : g_measured_short) b.store(0, std::memory_order_relaxed);
  }
  g_measured_short[dev].store(bytes, std::memory_order_relaxed);
  g_shared->measured_short[g_slot][dev].store(bytes, std::memory_order_release);
}

// Quiescent (monitor.h): what the process holds on each device must not exceed
// its slot's committed_bytes (spare lease included) less its spilled bytes,
// plus monitor_measured_short's bytes; exact, no lag. With
// FAKECUDA_MONITOR_OVERCOUNT=1, the other way too (overcount.cc).
int monitor_checkpoint() {
  if (!g_config.on || g_slot < 0) return -1;
  // Every check runs under the state lock (the region mapping and the watch
  // table are shared by this process's threads).
  if (fakecuda_state_lock() == 0) return 0;
  struct Unlock {
    ~Unlock() { fakecuda_state_unlock(); }
  } unlock;
  const gpuslice::Region* r = region();
  if (r == nullptr) return 0;
  const std::uint32_t pid = static_cast<std::uint32_t>(getpid());
  const gpuslice::Slot* own = nullptr;
  for (std::uint32_t i = 0; i < gpuslice::kMaxSlots; ++i) {
    const gpuslice::Slot& slot = r->slots[i];
    if (slot.state.load(std::memory_order_acquire) == gpuslice::kSlotLive &&
        slot.pid.load(std::memory_order_acquire) == pid) {
      own = &slot;
      break;
    }
  }
  int found = 0;
  for (std::uint32_t dev = 0; dev < g_devices; ++dev) {
    check(dev, nullptr);
    fakecuda_slot_info mine{};
    fakecuda_slot_info_get(g_slot, dev, &mine);
    const std::uint64_t held = mine.held_bytes;
    const int rd = region_device(dev, *r);
    if (rd < 0) continue;
    if (g_config.overcount && own != nullptr) found += overcount_at_checkpoint(dev, rd, held, *r, *own);
    if (held == 0) continue;
    // Less what it counts as spilled: host memory, never held by the device.
    std::uint64_t committed = own != nullptr ? own->committed_bytes[rd].load(std::memory_order_acquire) : 0;
    const std::uint64_t spilled = own != nullptr ? own->spilled_bytes[rd].load(std::memory_order_acquire) : 0;
    committed = committed > spilled ? committed - spilled : 0;
    const std::uint64_t short_by = g_measured_short_slot.load(std::memory_order_relaxed) == g_slot
                                       ? g_measured_short[dev].load(std::memory_order_relaxed)
                                       : 0;
    if (held > committed + short_by) {
      ++found;
      Watch* w = watch_for(dev, r->devices[rd].quota_bytes.load(std::memory_order_relaxed), 0);
      char detail[320];
      std::snprintf(detail, sizeof(detail),
                    "the quiescent process holds %llu bytes on the device; gpuslice committed %llu for it, spilled "
                    "memory left out, %llu freed by its graphics API during measurements allowed (%s)",
                    static_cast<unsigned long long>(held), static_cast<unsigned long long>(committed),
                    static_cast<unsigned long long>(short_by),
                    own != nullptr ? "its slot's committed_bytes" : "it has no live gpuslice slot");
      g_check_in_flight = 0;
      g_check_excused = Excused{};
      report("count at checkpoint", detail, dev, rd, container_total(dev, nullptr), held,
             w != nullptr ? w->ceiling.load(std::memory_order_relaxed) : 0, r->devices[rd], nullptr);
    }
  }
  return found;
}

void monitor_describer(void (*describe)(char* out, std::size_t len)) {
  internal::g_describer.store(describe, std::memory_order_release);
}

}  // namespace gpuslice::chaos
