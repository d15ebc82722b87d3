// Chaos mode (README "Chaos mode and invariant monitor"): seeded, reproducible
// perturbation of the schedule at the entry of every driver call and at every
// change of device memory (the point where a call's effect is visible and the
// call has not returned yet), plus the per-process ring of recent operations
// that the monitor prints with a violation.
#include "chaos.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace gpuslice::fakecuda {

std::atomic<bool> g_probes_on{false};

namespace {

ChaosConfig g_chaos;
std::atomic<bool> g_chaos_on{false};
std::atomic<std::uint32_t> g_next_thread{1};
std::atomic<std::uint64_t> g_forks{0};  // fork generations of this process's lineage

thread_local std::uint32_t t_ordinal = 0;
thread_local std::uint64_t t_points = 0;
thread_local const char* t_last_call = "";
thread_local const char* t_previous_call = "";
thread_local std::uint64_t t_call_began_ns = 0;

std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

bool fail(char* error, std::size_t len, const char* name, const char* value, const char* expected) {
  std::snprintf(error, len, "%s='%s': expected %s", name, value, expected);
  return false;
}

// Strict unsigned integer in [lo, hi].
bool parse_uint(const char* name, const char* text, std::uint64_t lo, std::uint64_t hi, const char* expected,
                std::uint64_t& out, char* error, std::size_t len) {
  if (text[0] < '0' || text[0] > '9') return fail(error, len, name, text, expected);
  char* end = nullptr;
  errno = 0;
  unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < lo || value > hi) return fail(error, len, name, text, expected);
  out = value;
  return true;
}

// A percentage 0-100 with at most 4 decimals, as parts per million.
bool parse_pct(const char* name, const char* text, std::uint32_t& ppm, char* error, std::size_t len) {
  const char* expected = "a percentage 0-100 (at most 4 decimals, e.g. 2.5)";
  std::uint64_t whole = 0;
  std::uint64_t frac = 0;
  int digits = 0;
  const char* p = text;
  if (*p < '0' || *p > '9') return fail(error, len, name, text, expected);
  while (*p >= '0' && *p <= '9' && whole <= 100) whole = whole * 10 + static_cast<std::uint64_t>(*p++ - '0');
  if (*p == '.') {
    ++p;
    while (*p >= '0' && *p <= '9' && digits < 4) {
      frac = frac * 10 + static_cast<std::uint64_t>(*p++ - '0');
      ++digits;
    }
    if (digits == 0) return fail(error, len, name, text, expected);
  }
  while (digits < 4) {
    frac *= 10;
    ++digits;
  }
  const std::uint64_t value = whole * 10000 + frac;
  if (*p != '\0' || value > 1000000) return fail(error, len, name, text, expected);
  ppm = static_cast<std::uint32_t>(value);
  return true;
}

bool call_selected(const char* call) {
  if (g_chaos.calls[0] == '\0') return true;
  const std::size_t n = std::strlen(call);
  for (const char* p = g_chaos.calls; *p != '\0';) {
    const char* comma = std::strchr(p, ',');
    const std::size_t len = comma != nullptr ? static_cast<std::size_t>(comma - p) : std::strlen(p);
    if (len == n && std::strncmp(p, call, n) == 0) return true;
    if (comma == nullptr) break;
    p = comma + 1;
  }
  return false;
}

void after_fork_in_child() { g_forks.fetch_add(1, std::memory_order_relaxed); }

[[gnu::constructor]] void register_fork_handler() { pthread_atfork(nullptr, nullptr, after_fork_in_child); }

// --- ring of recent operations ---
constexpr std::uint32_t kRing = 256;
struct RingOp {
  std::atomic<std::uint64_t> seq{0};  // index + 1 once written
  std::atomic<const char*> call{nullptr};
  std::atomic<std::uint32_t> kind{0};
  std::atomic<std::uint32_t> thread{0};
  std::atomic<std::uint32_t> dev{0};
  std::atomic<std::uint64_t> bytes{0};
  std::atomic<std::uint64_t> time_ns{0};
};
RingOp g_ring[kRing];
std::atomic<std::uint64_t> g_ring_next{0};

}  // namespace

bool chaos_configure(ChaosConfig& config, char* error, std::size_t len) {
  config = ChaosConfig{};
  const char* seed = std::getenv("FAKECUDA_CHAOS_SEED");
  if (seed == nullptr || seed[0] == '\0') return true;
  if (!parse_uint("FAKECUDA_CHAOS_SEED", seed, 0, ~std::uint64_t{0}, "an integer 0-18446744073709551615 (0 = off)",
                  config.seed, error, len)) {
    return false;
  }
  config.yield_ppm = 100000;  // defaults: README
  config.sleep_ppm = 20000;
  config.sleep_max_us = 50;
  if (const char* v = std::getenv("FAKECUDA_CHAOS_YIELD_PCT"); v != nullptr && v[0] != '\0') {
    if (!parse_pct("FAKECUDA_CHAOS_YIELD_PCT", v, config.yield_ppm, error, len)) return false;
  }
  if (const char* v = std::getenv("FAKECUDA_CHAOS_SLEEP_PCT"); v != nullptr && v[0] != '\0') {
    if (!parse_pct("FAKECUDA_CHAOS_SLEEP_PCT", v, config.sleep_ppm, error, len)) return false;
  }
  if (config.yield_ppm + config.sleep_ppm > 1000000) {
    std::snprintf(error, len, "FAKECUDA_CHAOS_YIELD_PCT + FAKECUDA_CHAOS_SLEEP_PCT: expected at most 100 together");
    return false;
  }
  std::uint64_t value = 0;
  if (const char* v = std::getenv("FAKECUDA_CHAOS_SLEEP_US"); v != nullptr && v[0] != '\0') {
    if (!parse_uint("FAKECUDA_CHAOS_SLEEP_US", v, 1, 100000, "an integer 1-100000 (microseconds)", value, error, len)) {
      return false;
    }
    config.sleep_max_us = static_cast<std::uint32_t>(value);
  }
  if (const char* v = std::getenv("FAKECUDA_CHAOS_STREAM"); v != nullptr && v[0] != '\0') {
    if (!parse_uint("FAKECUDA_CHAOS_STREAM", v, 0, ~std::uint64_t{0}, "an integer (this process's stream)",
                    config.stream, error, len)) {
      return false;
    }
  }
  if (const char* v = std::getenv("FAKECUDA_CHAOS_CALLS"); v != nullptr && v[0] != '\0') {
    if (std::strlen(v) >= sizeof(config.calls)) {
      return fail(error, len, "FAKECUDA_CHAOS_CALLS", v, "a comma-separated list shorter than 512 characters");
    }
    std::snprintf(config.calls, sizeof(config.calls), "%s", v);
  }
  g_chaos = config;
  g_chaos_on.store(config.seed != 0, std::memory_order_release);
  return true;
}

const ChaosConfig& chaos_config() { return g_chaos; }
bool chaos_on() { return g_chaos_on.load(std::memory_order_relaxed); }

std::uint32_t chaos_thread_ordinal() {
  if (t_ordinal == 0) t_ordinal = g_next_thread.fetch_add(1, std::memory_order_relaxed);
  return t_ordinal;
}

void chaos_point(const char* call) {
  if (!g_chaos_on.load(std::memory_order_acquire) || !call_selected(call)) return;
  const std::uint64_t point = ++t_points;
  std::uint64_t h = mix(g_chaos.seed);
  h = mix(h ^ g_chaos.stream);
  h = mix(h ^ (g_forks.load(std::memory_order_relaxed) << 48) ^ chaos_thread_ordinal());
  h = mix(h ^ point);
  const std::uint32_t u = static_cast<std::uint32_t>(h % 1000000);
  if (u < g_chaos.yield_ppm) {
    ring_record(OpKind::chaos_yield, call, 0, point);
    sched_yield();
  } else if (u < g_chaos.yield_ppm + g_chaos.sleep_ppm) {
    const std::uint64_t us = 1 + (h >> 24) % g_chaos.sleep_max_us;
    ring_record(OpKind::chaos_sleep, call, 0, us);
    timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>((us % 1000000) * 1000)};
    nanosleep(&ts, nullptr);
  }
}

void probe_entry_slow(const char* call) {
  t_call_began_ns = now_ns();
  t_previous_call = t_last_call;
  t_last_call = call;
  ring_record(OpKind::call, call, 0, 0);
  chaos_point(call);
}

const char* last_call() { return t_last_call; }
const char* previous_call() { return t_previous_call; }
std::uint64_t call_began_ns() { return t_call_began_ns; }

void ring_record(OpKind kind, const char* call, std::uint32_t dev, std::uint64_t bytes) {
  const std::uint64_t index = g_ring_next.fetch_add(1, std::memory_order_relaxed);
  RingOp& op = g_ring[index % kRing];
  op.seq.store(0, std::memory_order_relaxed);
  op.call.store(call, std::memory_order_relaxed);
  op.kind.store(static_cast<std::uint32_t>(kind), std::memory_order_relaxed);
  op.thread.store(chaos_thread_ordinal(), std::memory_order_relaxed);
  op.dev.store(dev, std::memory_order_relaxed);
  op.bytes.store(bytes, std::memory_order_relaxed);
  op.time_ns.store(now_ns(), std::memory_order_relaxed);
  op.seq.store(index + 1, std::memory_order_release);
}

void ring_format(char* out, std::size_t len, int count) {
  static const char* const kKinds[] = {"call", "charge", "uncharge", "context charge", "context uncharge"};
  std::size_t used = 0;
  out[0] = '\0';
  const std::uint64_t end = g_ring_next.load(std::memory_order_acquire);
  if (count > static_cast<int>(kRing)) count = kRing;
  const std::uint64_t begin = end > static_cast<std::uint64_t>(count) ? end - count : 0;
  const std::uint64_t now = now_ns();
  for (std::uint64_t i = begin; i < end && used + 1 < len; ++i) {
    const RingOp& op = g_ring[i % kRing];
    if (op.seq.load(std::memory_order_acquire) != i + 1) continue;  // being rewritten
    const std::uint32_t kind = op.kind.load(std::memory_order_relaxed);
    const char* call = op.call.load(std::memory_order_relaxed);
    const double ago_ms = static_cast<double>(now - op.time_ns.load(std::memory_order_relaxed)) / 1e6;
    int n;
    if (kind == static_cast<std::uint32_t>(OpKind::chaos_yield) ||
        kind == static_cast<std::uint32_t>(OpKind::chaos_sleep)) {
      const bool yield = kind == static_cast<std::uint32_t>(OpKind::chaos_yield);
      n = std::snprintf(out + used, len - used, "    -%.3fms t%u   chaos: %s %llu%s (in %s)\n", ago_ms,
                        op.thread.load(std::memory_order_relaxed), yield ? "yield at point" : "sleep",
                        static_cast<unsigned long long>(op.bytes.load(std::memory_order_relaxed)), yield ? "" : " us",
                        call != nullptr ? call : "?");
    } else if (kind == 0) {
      n = std::snprintf(out + used, len - used, "    -%.3fms t%u %s\n", ago_ms,
                        op.thread.load(std::memory_order_relaxed), call != nullptr ? call : "?");
    } else {
      n = std::snprintf(out + used, len - used, "    -%.3fms t%u   %s dev%u %llu bytes (in %s)\n", ago_ms,
                        op.thread.load(std::memory_order_relaxed), kKinds[kind < 5 ? kind : 0],
                        op.dev.load(std::memory_order_relaxed),
                        static_cast<unsigned long long>(op.bytes.load(std::memory_order_relaxed)),
                        call != nullptr ? call : "?");
    }
    if (n < 0) break;
    used += static_cast<std::size_t>(n);
    if (used >= len) {
      used = len - 1;
      break;
    }
  }
}

}  // namespace gpuslice::fakecuda
