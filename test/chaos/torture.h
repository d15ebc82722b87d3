// The chaos torture suite (test/chaos/README.md): a launcher that builds one
// container (a simulated machine + a gpuslice region) per seed, runs worker
// processes of it under libgpuslice.so with the simulator's chaos mode and
// invariant monitor on, and drives the container from outside (gpuslice-smi
// set, SIGKILL); and the workers, whose threads mix the operation classes the
// seed picks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpuslice::chaos {

// Every operation class, by name. Worker-side classes run in the workers'
// threads; "smi", "kill" and the agent classes are driven by the launcher; "resident-wait",
// "resident-spill" configure the container (GPUSLICE_OVERSUBSCRIBE with a
// GPUSLICE_MEMORY_RESIDENT below the quota).
inline const std::vector<std::string>& all_classes() {
  static const std::vector<std::string> classes = {
      "alloc",   "pitch",  "managed",    "pool",       "trim", "setpool", "vmm",    "array",         "context",
      "primary", "module", "library",    "fill",       "fork", "smi",     "kill",   "resident-wait", "resident-spill",
      "lease",   "agent",  "agent-fast", "agent-kill", "gap",  "ipc",     "interop"};
  return classes;
}
// The real gpuslice-agent beside the workers: at its deployed interval
// (100 ms), at 5 ms, SIGKILLed and restarted at random; "gap": the workers
// run in two waves with the container empty between them (the agent removes
// the region after its short grace).
inline bool agent_class(const std::string& c) {
  return c == "agent" || c == "agent-fast" || c == "agent-kill" || c == "gap";
}
inline bool launcher_class(const std::string& c) {
  return c == "smi" || c == "kill" || c == "resident-wait" || c == "resident-spill" || agent_class(c);
}

struct WorkerOptions {
  std::uint64_t seed = 1;
  int index = 0;
  int threads = 3;
  int ops = 150;
  std::uint64_t quota = 0;
  std::vector<std::string> classes;  // worker-side classes only
};

// Runs one worker process (cuInit ... threads ... clean exit). Returns the exit code.
int run_worker(const WorkerOptions& options, const char* self);

// splitmix64
inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Rng {
  std::uint64_t state;
  explicit Rng(std::uint64_t seed) : state(mix64(seed)) {}
  std::uint64_t next() { return state = mix64(state); }
  std::uint64_t below(std::uint64_t n) { return n == 0 ? 0 : next() % n; }
  bool chance(unsigned pct) { return below(100) < pct; }
};

}  // namespace gpuslice::chaos
