#include "results.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <vector>

namespace gpuslice::microbench {

namespace {

using nlohmann::json;

// "cuLaunchKernel/gpuslice/threads:8" -> call, side.
bool split_name(const std::string& name, std::string* call, std::string* side) {
  auto first = name.find('/');
  if (first == std::string::npos) return false;
  auto second = name.find('/', first + 1);
  *call = name.substr(0, first);
  *side = name.substr(first + 1, second == std::string::npos ? std::string::npos : second - first - 1);
  return true;
}

std::string ns(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), value >= 100 ? "%.0f" : "%.1f", value);
  return text;
}

std::string added(double native, double wrapped) {
  char text[32];
  std::snprintf(text, sizeof(text), std::fabs(wrapped - native) >= 100 ? "%+.0f" : "%+.1f", wrapped - native);
  return text;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// " [min-max]" of the added ns over the repetitions: what makes a bimodal
// result visible. For a paired call, gpuslice - native of each repetition;
// otherwise the wrapped side's repetitions less the native median. Empty
// with one repetition.
std::string spread(const Measure* n, const Measure* w) {
  if (w->repetitions < 2) return "";
  char text[64];
  if (w->paired) {
    std::snprintf(text, sizeof(text), " [%s…%s]", added(0, w->min_added_ns).c_str(), added(0, w->max_added_ns).c_str());
  } else {
    std::snprintf(text, sizeof(text), " [%s…%s]", added(n->cpu_ns, w->min_cpu_ns).c_str(),
                  added(n->cpu_ns, w->max_cpu_ns).c_str());
  }
  return text;
}

const Measure* find(const Results& r, const std::string& config, const std::string& call, const std::string& side,
                    int threads) {
  auto it = r.find(Key{config, call, side, threads});
  return it == r.end() ? nullptr : &it->second;
}

// Table cells are built with snprintf: "literal" + std::string trips GCC 12's
// -Wrestrict false positive at -O3.
std::string error_text(const Measure* n, const Measure* w) { return !n->error.empty() ? n->error : w->error; }

// "native | gpuslice | added" cells of one configuration.
std::string cells(const Results& r, const std::string& config, const std::string& call, int threads) {
  const Measure* n = find(r, config, call, "native", threads);
  const Measure* w = find(r, config, call, "gpuslice", threads);
  if (n == nullptr || w == nullptr) return " - | - | - |";
  char text[256];
  if (!n->error.empty() || !w->error.empty()) {
    std::snprintf(text, sizeof(text), " error | %s | - |", error_text(n, w).c_str());
  } else {
    std::snprintf(text, sizeof(text), " %s | %s | %s%s |", ns(n->cpu_ns).c_str(), ns(w->cpu_ns).c_str(),
                  added(n->cpu_ns, w->cpu_ns).c_str(), spread(n, w).c_str());
  }
  return text;
}

// "added" cell of a configuration (wrapped minus that run's own native).
std::string added_cell(const Results& r, const std::string& config, const std::string& call, int threads) {
  const Measure* n = find(r, config, call, "native", threads);
  const Measure* w = find(r, config, call, "gpuslice", threads);
  if (n == nullptr || w == nullptr) return " - |";
  char text[256];
  if (!n->error.empty() || !w->error.empty()) {
    std::snprintf(text, sizeof(text), " error: %s |", error_text(n, w).c_str());
  } else {
    std::snprintf(text, sizeof(text), " %s%s |", added(n->cpu_ns, w->cpu_ns).c_str(), spread(n, w).c_str());
  }
  return text;
}

void target(std::FILE* out, const char* what, double value, double limit, const char* unit) {
  if (std::isnan(value)) {
    std::fprintf(out, "- %s: not measured\n", what);
    return;
  }
  std::fprintf(out, "- %s: %s %s (target <= %s %s): **%s**\n", what, ns(value).c_str(), unit, ns(limit).c_str(), unit,
               value <= limit ? "met" : "MISSED");
}

}  // namespace

bool add_results(Results& results, const std::string& config, const std::string& benchmark_json) {
  json doc = json::parse(benchmark_json, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains("benchmarks")) return false;
  struct Reps {
    std::vector<double> cpu, real, added;  // added: per paired repetition
    std::string error;
  };
  std::map<Key, Reps> seen;
  for (const json& b : doc["benchmarks"]) {
    // Aggregates are recomputed here from the repetitions themselves.
    if (b.value("run_type", "iteration") != "iteration") continue;
    std::string call;
    std::string side;
    if (!split_name(b.value("run_name", b.value("name", "")), &call, &side)) continue;
    const int threads = b.value("threads", 1);
    if (side == "paired") {  // both sides from one benchmark (cases.cc): CPU ns per call of each
      for (const char* s : {"native", "gpuslice", "control"}) {
        if (std::string(s) == "control" && !b.contains("control_ns")) continue;
        Reps& reps = seen[Key{config, call, s, threads}];
        const double pairs = b.value("pairs", 0.0);
        if (b.value("error_occurred", false) || pairs <= 0) {
          reps.error = b.value("error_message", "no pairs measured");
          continue;
        }
        const double ns = b.value(std::string(s) + "_ns", 0.0) / pairs;
        reps.cpu.push_back(ns);
        reps.real.push_back(ns);
        reps.added.push_back(
            (b.value(std::string(s) == "control" ? "control_ns" : "gpuslice_ns", 0.0) - b.value("native_ns", 0.0)) /
            pairs);
      }
      continue;
    }
    Reps& reps = seen[Key{config, call, side, threads}];
    if (b.value("error_occurred", false)) {
      reps.error = b.value("error_message", "error");
      continue;
    }
    reps.cpu.push_back(b.value("cpu_time", 0.0));
    reps.real.push_back(b.value("real_time", 0.0));
  }
  for (auto& [key, reps] : seen) {
    Measure& m = results[key];
    if (!reps.error.empty() || reps.cpu.empty()) {
      m.error = reps.error.empty() ? "no repetition" : reps.error;
      continue;
    }
    // Running mean of the medians over the processes of a multi-process configuration.
    const double n = m.samples;
    m.cpu_ns = (m.cpu_ns * n + median(reps.cpu)) / (n + 1);
    m.real_ns = (m.real_ns * n + median(reps.real)) / (n + 1);
    const auto [lo, hi] = std::minmax_element(reps.cpu.begin(), reps.cpu.end());
    m.min_cpu_ns = m.samples == 0 ? *lo : std::min(m.min_cpu_ns, *lo);
    m.max_cpu_ns = m.samples == 0 ? *hi : std::max(m.max_cpu_ns, *hi);
    if (!reps.added.empty()) {
      const auto [alo, ahi] = std::minmax_element(reps.added.begin(), reps.added.end());
      m.min_added_ns = !m.paired ? *alo : std::min(m.min_added_ns, *alo);
      m.max_added_ns = !m.paired ? *ahi : std::max(m.max_added_ns, *ahi);
      m.paired = true;
    }
    m.repetitions += static_cast<int>(reps.cpu.size());
    m.samples += 1;
  }
  return true;
}

void print_tables(const Results& r, const std::vector<std::string>& calls, const std::vector<int>& threads,
                  const TableInfo& info, std::FILE* out) {
  std::fprintf(out, "Machine: %s. %s\n", info.machine.c_str(),
               info.simulated ? "Simulated driver (test/fakecuda): the native column is the simulator's own cost, "
                                "not a GPU driver's."
                              : "Real NVIDIA driver.");
  std::fprintf(out,
               "CPU ns per call (Google Benchmark cpu_time; min_time %.2f s, %d repetition(s)%s). "
               "Limits: %s.%s%s\n\n",
               info.min_time, info.repetitions,
               info.repetitions > 1
                   ? ", median; [min…max] of the added ns over the repetitions: gpuslice - native of each "
                     "repetition for cuMemAlloc+cuMemFree (paired), else the gpuslice repetitions "
                     "less the native median"
                   : "",
               info.limits.c_str(), info.load.empty() ? "" : " Load average: ", info.load.c_str());
  std::fprintf(out,
               "\"added, limits\": with %s after the compute limiter has calibrated (launch rows; a light "
               "spin_50us load gives it device time to measure), else with the limits from the start. "
               "\"cold start\": empty kernels only, so the limiter never calibrates (see the notes).\n\n",
               info.limits.c_str());
  std::fprintf(out, "| call | threads | native | gpuslice | added | added, limits | added, limits, cold start |\n");
  std::fprintf(out, "|---|---:|---:|---:|---:|---:|---:|\n");
  for (const std::string& call : calls) {
    for (int t : threads) {
      if (find(r, "unlimited", call, "native", t) == nullptr) continue;
      std::fprintf(
          out, "| %s | %d |%s%s%s\n", call.c_str(), t, cells(r, "unlimited", call, t).c_str(),
          added_cell(r, find(r, "calibrated", call, "native", t) != nullptr ? "calibrated" : "limited", call, t)
              .c_str(),
          find(r, "calibrated", call, "native", t) != nullptr ? added_cell(r, "limited", call, t).c_str()
          : find(r, "limited", call, "native", t) != nullptr  ? " (same) |"
                                                              : " - |");
    }
  }
  bool any_procs = false;
  for (const auto& [key, m] : r) any_procs = any_procs || key.config.rfind("procs", 0) == 0;
  if (any_procs) {
    std::fprintf(out,
                 "\n%d processes sharing one region (and one simulated device), 1 thread each, mean of the "
                 "processes:\n\n",
                 8);
    std::fprintf(out, "| call | native | gpuslice | added | added, limits |\n");
    std::fprintf(out, "|---|---:|---:|---:|---:|\n");
    for (const std::string& call : calls) {
      if (find(r, "procs8", call, "native", 1) == nullptr) continue;
      std::fprintf(out, "| %s |%s%s\n", call.c_str(), cells(r, "procs8", call, 1).c_str(),
                   added_cell(r, "procs8_limited", call, 1).c_str());
    }
  }

  std::fprintf(out, "\nTargets (added = gpuslice - native, 1 thread):\n");
  auto add = [&](const char* config, const char* call) -> double {
    const Measure* n = find(r, config, call, "native", 1);
    const Measure* w = find(r, config, call, "gpuslice", 1);
    return n != nullptr && w != nullptr ? w->cpu_ns - n->cpu_ns : NAN;
  };
  target(out, "cuLaunchKernel added, no limit", add("unlimited", "cuLaunchKernel"), 10, "ns");
  target(out, "cuLaunchKernel added, SM limit with tokens available (calibrated)", add("calibrated", "cuLaunchKernel"),
         40, "ns");
  target(out, "cuLaunchKernel added, SM limit, cold start (0 us kernels only)", add("limited", "cuLaunchKernel"), 40,
         "ns");
  target(out, "cuMemAlloc+cuMemFree added, no quota", add("unlimited", "cuMemAlloc+cuMemFree"), 100, "ns");
  target(out, "cuMemAlloc+cuMemFree added, with quota", add("limited", "cuMemAlloc+cuMemFree"), 30, "ns");
  std::fprintf(out,
               "- contention, gpuslice CPU ns per call at 32 threads / at 1 thread (target <= 4x; native "
               "ratio in brackets):\n");
  for (const char* config : {"unlimited", "calibrated", "limited"}) {
    std::fprintf(out, "  - %s:", config);
    for (const std::string& call : calls) {
      const Measure* w1 = find(r, config, call, "gpuslice", 1);
      const Measure* w32 = find(r, config, call, "gpuslice", 32);
      const Measure* n1 = find(r, config, call, "native", 1);
      const Measure* n32 = find(r, config, call, "native", 32);
      if (w1 == nullptr || w32 == nullptr || n1 == nullptr || n32 == nullptr || w1->cpu_ns <= 0 || n1->cpu_ns <= 0)
        continue;
      const double ratio = w32->cpu_ns / w1->cpu_ns;
      std::fprintf(out, " %s %.1fx%s [%.1fx];", call.c_str(), ratio, ratio <= 4 ? "" : " **MISSED**",
                   n32->cpu_ns / n1->cpu_ns);
    }
    std::fprintf(out, "\n");
  }
  // Issue 23: a many-threaded framework in a container of few cores. The
  // wrapped cost at 32 threads within 1.5x of one thread's, for the calls
  // with limits (the added ns are shown: their ratio is noisy where they are small).
  std::fprintf(out,
               "- many threads (target: at 32 threads <= 1.5x of 1 thread's, with limits): gpuslice ns per call "
               "32/1, and in brackets the added ns at 1 -> 32 threads and their ratio:");
  for (const char* config : {"calibrated", "limited"}) {
    for (const std::string& call : calls) {
      if (config == std::string("limited") && find(r, "calibrated", call, "gpuslice", 1) != nullptr) continue;
      const Measure* w1 = find(r, config, call, "gpuslice", 1);
      const Measure* w32 = find(r, config, call, "gpuslice", 32);
      const Measure* n1 = find(r, config, call, "native", 1);
      const Measure* n32 = find(r, config, call, "native", 32);
      if (w1 == nullptr || w32 == nullptr || n1 == nullptr || n32 == nullptr || w1->cpu_ns <= 0) continue;
      const double ratio = w32->cpu_ns / w1->cpu_ns;
      const double a1 = w1->cpu_ns - n1->cpu_ns, a32 = w32->cpu_ns - n32->cpu_ns;
      char added_ratio[32] = "-";
      if (a1 > 0)
        std::snprintf(added_ratio, sizeof added_ratio, "%.2fx%s", a32 / a1, a32 <= 1.5 * a1 ? "" : " **MISSED**");
      std::fprintf(out, " %s %.2fx%s [%s -> %s: %s];", call.c_str(), ratio, ratio <= 1.5 ? "" : " **MISSED**",
                   added(n1->cpu_ns, w1->cpu_ns).c_str(), added(n32->cpu_ns, w32->cpu_ns).c_str(), added_ratio);
      // The paired call's control (cases.cc): a private delay before each
      // native call, no shared state; its growth is the simulator's.
      const Measure* c1 = find(r, config, call, "control", 1);
      const Measure* c32 = find(r, config, call, "control", 32);
      if (c1 != nullptr && c32 != nullptr && c1->cpu_ns > n1->cpu_ns)
        std::fprintf(out, " control (%d empty loop turns before each native call) [%s -> %s: %.2fx];",
                     info.control_turns, added(n1->cpu_ns, c1->cpu_ns).c_str(), added(n32->cpu_ns, c32->cpu_ns).c_str(),
                     (c32->cpu_ns - n32->cpu_ns) / (c1->cpu_ns - n1->cpu_ns));
    }
  }
  std::fprintf(out, "\n");
  std::fprintf(out, "\nReproduce: `%s`\n", info.command.c_str());
}

nlohmann::json results_json(const Results& results, const TableInfo& info) {
  json rows = json::array();
  for (const auto& [key, m] : results) {
    json row{{"config", key.config},
             {"call", key.call},
             {"side", key.side},
             {"threads", key.threads},
             {"cpu_ns", m.cpu_ns},
             {"real_ns", m.real_ns},
             {"min_cpu_ns", m.min_cpu_ns},
             {"max_cpu_ns", m.max_cpu_ns},
             {"repetitions", m.repetitions},
             {"paired", m.paired},
             {"min_added_ns", m.min_added_ns},
             {"max_added_ns", m.max_added_ns},
             {"processes", m.samples}};
    if (!m.error.empty()) row["error"] = m.error;
    rows.push_back(row);
  }
  return json{{"machine", info.machine},
              {"simulated", info.simulated},
              {"limits", info.limits},
              {"load", info.load},
              {"min_time", info.min_time},
              {"repetitions", info.repetitions},
              {"control_turns", info.control_turns},
              {"results", rows}};
}

}  // namespace gpuslice::microbench
