// Google Benchmark JSON output of the child runs, gathered into one table of
// ns per call: native, wrapped, added, per configuration and thread count.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace gpuslice::microbench {

struct Measure {
  double cpu_ns = 0;      // CPU time per call (what one call costs the caller): median of the repetitions
  double real_ns = 0;     // wall time / calls of all threads (inverse throughput): median
  double min_cpu_ns = 0;  // spread of cpu_ns over the repetitions (of every process)
  double max_cpu_ns = 0;
  int repetitions = 0;  // repetitions seen (of every process)
  // Paired calls (both sides measured in the same blocks, cases.cc): the
  // spread of gpuslice - native per repetition, free of the load's drift.
  bool paired = false;
  double min_added_ns = 0;
  double max_added_ns = 0;
  int samples = 0;  // processes averaged
  std::string error;
};

// (configuration, call, side, threads) -> measure. Side: "native" | "gpuslice".
struct Key {
  std::string config;
  std::string call;
  std::string side;
  int threads;
  bool operator<(const Key& o) const {
    return std::tie(config, call, side, threads) < std::tie(o.config, o.call, o.side, o.threads);
  }
};
using Results = std::map<Key, Measure>;

// Adds one child's --benchmark_out JSON under `config`: per benchmark the
// median of its repetitions (the "iteration" entries) and their min and max.
// Repeated calls for the same config average the medians (the processes of a
// multi-process run) and widen the spread. Returns false if the file does
// not parse.
bool add_results(Results& results, const std::string& config, const std::string& benchmark_json);

struct TableInfo {
  std::string machine;    // CPU model and count
  std::string command;    // how to reproduce
  std::string limits;     // the limited configuration's options
  std::string load;       // the machine's load average around the run ("" unknown)
  bool simulated = true;  // the driver is test/fakecuda
  double min_time = 0;
  int repetitions = 1;
  int control_turns = 100;  // the control side's private delay (cases.cc)
};

// Markdown tables (the docs/benchmarks.md format) and the target check.
void print_tables(const Results& results, const std::vector<std::string>& calls, const std::vector<int>& threads,
                  const TableInfo& info, std::FILE* out);

// The same numbers as JSON (for tools and regression checks).
nlohmann::json results_json(const Results& results, const TableInfo& info);

}  // namespace gpuslice::microbench
