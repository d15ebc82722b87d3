// Test probes of the simulated driver (README "Chaos mode and invariant
// monitor"): a seeded perturbation of the schedule at every entry point and
// every change of device memory (chaos.cc), and one registered observer
// called at every change of device memory (observer.cc; fakecuda_query.h,
// "Observers"), such as the chaos suite's invariant monitor. Both are off by
// default; then an entry point pays one relaxed load and a predictable branch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace gpuslice::fakecuda {

class State;

// True when chaos or an observer is on (set once by cuInit).
extern std::atomic<bool> g_probes_on;

void probe_entry_slow(const char* call);
// At the entry of a driver call (driver.h: initialized()). `call` is the
// function that checks initialisation: the entry point or its helper.
inline void probe_entry(const char* call) {
  if (__builtin_expect(g_probes_on.load(std::memory_order_relaxed), 0)) probe_entry_slow(call);
}

// cuInit, before anything else: reads FAKECUDA_CHAOS_*, then configures the
// observer (which reads its own variables); refuses FAKECUDA_MONITOR=1 without
// one. false + one line naming the variable on a bad value.
bool probes_configure(const char* state_path, char* error, std::size_t error_len);
// cuInit, once the process owns its slot: attaches the observer and turns the
// probes on.
void probes_attach(State* state, int slot);

// --- chaos.cc ---
struct ChaosConfig {
  std::uint64_t seed = 0;  // 0 = off
  std::uint32_t yield_ppm = 0;
  std::uint32_t sleep_ppm = 0;
  std::uint32_t sleep_max_us = 0;
  std::uint64_t stream = 0;
  char calls[512] = {};  // comma-separated call names to perturb; empty = all
};
bool chaos_configure(ChaosConfig& config, char* error, std::size_t error_len);
const ChaosConfig& chaos_config();
bool chaos_on();
// A preemption point: yields or sleeps with the configured probabilities,
// decided by (seed, process stream, thread ordinal, the thread's point count).
void chaos_point(const char* call);
// The calling thread's ordinal in this process (1, 2, ... in order of first use).
std::uint32_t chaos_thread_ordinal();

// Per-process ring of recent operations (fakecuda_recent_operations: the
// monitor prints it with a violation).
enum class OpKind : std::uint32_t {
  call = 0,
  charge = 1,
  uncharge = 2,
  context_charge = 3,
  context_uncharge = 4,
  chaos_yield = 5,  // a chaos decision (bytes: the thread's point count)
  chaos_sleep = 6,  // bytes: microseconds
};
void ring_record(OpKind kind, const char* call, std::uint32_t dev, std::uint64_t bytes);
// Appends the last `count` operations, oldest first, to `out` (NUL-terminated).
void ring_format(char* out, std::size_t len, int count);
// Name of the last entry point the calling thread entered (and the one before).
const char* last_call();
const char* previous_call();
// When (CLOCK_MONOTONIC ns) the calling thread entered its last entry point; 0: none yet.
std::uint64_t call_began_ns();

}  // namespace gpuslice::fakecuda
