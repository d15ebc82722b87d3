// gpuslice-bench: what gpuslice costs and how well it isolates, measured on
// the GPU at hand (or on the simulated driver when there is none), natively
// and under libgpuslice.so in one run. See docs/benchmarks.md.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli.h"
#include "kernels.h"
#include "oversub.h"
#include "plots.h"
#include "priority.h"
#include "report.h"
#include "scenarios.h"
#include "setup.h"
#include "spawn.h"
#include "worker.h"

using namespace gpuslice::bench;
using nlohmann::json;

namespace {

constexpr const char* kVersion = "0.1.0";
const char* const kSections[] = {"launch", "memory", "quota", "sweep", "tenants", "noisy", "priority", "oversub"};

int worker_main(const std::string& spec_text) {
  try {
    const json spec = json::parse(spec_text);
    const std::string task = spec.value("task", std::string());
    json result = task == "burst"                           ? run_burst_worker(spec)
                  : task == "memplan" || task == "memwatch" ? run_oversub_worker(spec)
                                                            : run_worker(spec);
    std::cout << result.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << json{{"error", e.what()}}.dump() << std::endl;
    return 1;
  }
}

// Every "error" in the report, with where it is ("compute_sweep/points/3").
void collect_errors(const json& node, const std::string& where, json& errors) {
  if (node.is_object()) {
    for (auto it = node.begin(); it != node.end(); ++it) {
      if (it.key() == "error" || it.key() == "native_error") {
        errors.push_back(json{{"where", where}, {"error", it.value()}});
      } else {
        collect_errors(it.value(), where.empty() ? it.key() : where + "/" + it.key(), errors);
      }
    }
  } else if (node.is_array()) {
    for (std::size_t i = 0; i < node.size(); ++i) collect_errors(node[i], where + "/" + std::to_string(i), errors);
  }
}

Plan make_plan(bool quick) {
  Plan plan;
  plan.quick = quick;
  if (quick) {
    plan.sweep_limits = {10, 50, 90};
    plan.quotas_mib = {256};
    plan.shared_quota_mib = 256;
    plan.window_s = 0.4;
    plan.warmup_s = 0.3;
    plan.launch_batches = 50;
    plan.memory_batches = 40;
  } else {
    plan.sweep_limits = {10, 20, 30, 40, 50, 60, 70, 80, 90};
    plan.quotas_mib = {256, 1024, 4096};
  }
  return plan;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "gpuslice-bench: launch/allocation overhead, memory-quota accuracy and compute-limit accuracy of\n"
      "libgpuslice.so, measured natively and under the library in one run. Runs on a real GPU, or on the\n"
      "simulated driver built next to it when no NVIDIA driver is installed."};
  std::string worker_spec;
  bool quick = false;
  bool as_json = false;
  bool quiet = false;
  bool verbose = false;
  bool keep = false;
  std::string library;
  std::string json_file;
  std::vector<std::string> only;
  std::vector<int> sweep;
  unsigned kernel_us = 0;
  double window_s = 0;
  bool print_ptx = false;
  std::string profile;
  std::vector<int> tenants;
  int procs = 1;
  int streams = 1;
  double queue_ms = 0;
  unsigned training_us = 0;
  app.add_option("--worker", worker_spec, "internal: run one measurement from a JSON spec")->group("");
  app.add_flag("--print-ptx", print_ptx, "print the kernels' PTX (for ptxas; the spin kernel per --kernel-us)")
      ->group("");
  app.add_flag("--quick", quick, "a few seconds: short windows, 3 sweep points (the CTest smoke test)");
  app.add_flag("--json", as_json, "print the JSON report on stdout instead of the table");
  app.add_option("--json-file", json_file, "also write the JSON report to this file");
  app.add_option("--lib", library, "libgpuslice.so to measure [default: $GPUSLICE_BENCH_LIB or <exe dir>/../lib]");
  std::string driver_name = "auto";
  app.add_option("--driver", driver_name,
                 "auto: the installed driver, else the simulated one next to this binary; real: fail without an "
                 "NVIDIA driver; simulated: the simulated one even on a GPU machine [auto]")
      ->check(CLI::IsMember({"auto", "real", "simulated"}));
  app.add_option("--only", only, "sections to run: launch memory quota sweep tenants noisy priority oversub")
      ->delimiter(',')
      ->check(CLI::IsMember({"launch", "memory", "quota", "sweep", "tenants", "noisy", "priority", "oversub"}));
  std::string plots_dir;
  std::string plots_from;
  app.add_option("--plots", plots_dir,
                 "also write SVG plots of the report into this directory (matplotlib, with <build>/venv/bin/python "
                 "or $GPUSLICE_BENCH_PYTHON; docs/benchmarks.md)");
  app.add_option("--plots-from", plots_from,
                 "make the --plots of this JSON report (a --json-file of an earlier run) instead of measuring")
      ->check(CLI::ExistingFile);
  app.add_option("--sweep", sweep, "SM limits for the compute sweep, e.g. 10,50,90")
      ->delimiter(',')
      ->check(CLI::Range(1, 99));
  app.add_option("--kernel-us", kernel_us, "spin kernel length in microseconds [1000]")
      ->check(CLI::Range(10u, 100000u));
  app.add_option("--window", window_s, "compute measurement window in seconds [1.5, --quick 0.4]")
      ->check(CLI::Range(0.05, 60.0));
  app.add_option("--profile", profile,
                 "the simulated driver's timing model (sets FAKECUDA_PROFILE for the workers) [$FAKECUDA_PROFILE, "
                 "else ideal]; see test/fakecuda/README.md")
      ->check(CLI::IsMember({"ideal", "realistic"}));
  app.add_option("--tenants", tenants, "SM limits of the two tenants, A,B [30,60]")
      ->delimiter(',')
      ->expected(2)
      ->check(CLI::Range(1, 99));
  app.add_option("--procs", procs, "processes per container in the compute sections [1]")->check(CLI::Range(1, 16));
  app.add_option("--streams", streams, "streams per process in the compute sections [1]")->check(CLI::Range(1, 8));
  app.add_option("--queue-ms", queue_ms, "device work each load process keeps queued, ms [20]")
      ->check(CLI::Range(0.0, 1000.0));
  app.add_option("--training-us", training_us,
                 "priority section: the low-priority tenant's kernel length in microseconds (a burst may wait "
                 "for one of them to finish: kernels are not preempted) [1000]")
      ->check(CLI::Range(10u, 100000u));
  app.add_flag("--quiet,-q", quiet, "no progress lines on stderr");
  app.add_flag("--verbose,-v", verbose, "echo the workers' stderr (gpuslice's own log lines)");
  app.add_flag("--keep-temp", keep, "keep the private directory of regions and simulated devices");
  app.set_version_flag("--version", kVersion);
  if (const std::optional<int> stop = gpuslice::tools::parse(app, argc, argv, gpuslice::tools::BadCommandLine::cli11))
    return *stop;

  if (!worker_spec.empty()) return worker_main(worker_spec);
  if (!plots_from.empty()) {
    if (plots_dir.empty()) {
      std::fprintf(stderr, "gpuslice-bench: --plots-from needs --plots DIR (where to write the SVG files)\n");
      return 1;
    }
    return write_plots(plots_from, plots_dir, quiet) ? 0 : 1;
  }
  if (print_ptx) {
    std::cout << kernels_ptx({kernel_us != 0 ? kernel_us : 1000u});
    return 0;
  }

  const DriverMode driver_mode = driver_name == "real"        ? DriverMode::real
                                 : driver_name == "simulated" ? DriverMode::simulated
                                                              : DriverMode::automatic;
  Plan plan = make_plan(quick);
  // A realistic simulated context holds 512 MiB of the quota (as on a GPU):
  // quotas that leave room for one, and for one per racing process.
  const char* profile_env = std::getenv("FAKECUDA_PROFILE");
  if (profile == "realistic" ||
      (profile.empty() && profile_env != nullptr && std::string(profile_env) == "realistic")) {
    plan.quotas_mib = quick ? std::vector<std::uint64_t>{1024} : std::vector<std::uint64_t>{1024, 2048, 4096};
    plan.shared_quota_mib = 4096;
  }
  for (const char* s : kSections) plan.sections.insert(s);
  if (!only.empty()) plan.sections = std::set<std::string>(only.begin(), only.end());
  if (!sweep.empty()) plan.sweep_limits = sweep;
  if (kernel_us != 0) plan.kernel_us = kernel_us;
  if (window_s != 0) plan.window_s = window_s;
  if (tenants.size() == 2) {
    plan.tenant_a_limit = tenants[0];
    plan.tenant_b_limit = tenants[1];
  }
  plan.procs = procs;
  plan.streams = streams;
  if (queue_ms != 0) plan.queue_ms = queue_ms;
  if (training_us != 0) plan.training_us = training_us;
  // The workers inherit FAKECUDA_PROFILE; --profile sets it for them.
  if (!profile.empty()) {
    setenv("FAKECUDA_PROFILE", profile.c_str(), 1);
  } else if (const char* env = std::getenv("FAKECUDA_PROFILE"); env != nullptr && *env != '\0') {
    profile = env;
    if (profile != "ideal" && profile != "realistic") {
      std::fprintf(stderr, "gpuslice-bench: FAKECUDA_PROFILE='%s': expected ideal or realistic\n", env);
      return 1;
    }
  } else {
    profile = "ideal";  // the simulated driver's default
  }

  BenchContext context;
  DriverChoice driver;
  try {
    context.exe = self_exe();
    context.library = find_library(library);
    driver = choose_driver(driver_mode);
    context.ld_library_path = driver.ld_library_path;
    context.tmp_dir = make_private_dir();
    context.verbose = verbose;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpuslice-bench: %s\n", e.what());
    return 1;
  }
  if (!driver.notice.empty() && !quiet) std::fprintf(stderr, "%s\n", driver.notice.c_str());

  Workers workers(context);
  json report{{"tool", "gpuslice-bench"},
              {"version", kVersion},
              {"quick", quick},
              {"driver", driver.description},
              {"library", context.library}};
  int status = 0;
  try {
    json probe =
        workers.run(json{{"task", "probe"}}, WorkerEnv{false, {{"FAKECUDA_STATE", workers.fresh_path("probe")}}});
    if (probe.contains("error")) {
      std::fprintf(stderr, "gpuslice-bench: cannot use the driver: %s\n", probe["error"].get<std::string>().c_str());
      remove_tree(context.tmp_dir);
      return 1;
    }
    report["device"] = probe["simulated"].get<bool>() ? "simulated" : "gpu";
    if (probe["simulated"].get<bool>()) {
      report["profile"] = profile;
      plan.profile = profile;
    }
    report["device_name"] = probe["device_name"];
    report["driver_version"] = probe["driver_version"];
    report["total_bytes"] = probe["total_bytes"];
    report["sms"] = probe["sms"];
    if (!quiet) {
      std::fprintf(stderr, "gpuslice-bench: %s (%s%s)\n", probe["device_name"].get<std::string>().c_str(),
                   probe["simulated"].get<bool>() ? "simulated driver, no GPU, profile " : "real GPU",
                   probe["simulated"].get<bool>() ? profile.c_str() : "");
    }

    Progress progress(plan_steps(plan) + priority_steps(plan) + oversub_steps(plan), quiet);
    if (plan.sections.count("launch")) report["launch"] = measure_launch(workers, plan, progress);
    if (plan.sections.count("memory")) report["memory"] = measure_memory(workers, plan, progress);
    if (plan.sections.count("quota")) report["quota"] = measure_quota(workers, plan, progress);
    if (plan.sections.count("sweep")) report["compute_sweep"] = measure_sweep(workers, plan, progress);
    if (plan.sections.count("tenants")) report["tenants"] = measure_tenants(workers, plan, progress);
    if (plan.sections.count("noisy")) report["noisy_neighbour"] = measure_noisy(workers, plan, progress);
    if (plan.sections.count("priority")) report["priority"] = measure_priority(workers, plan, progress);
    if (plan.sections.count("oversub")) report["oversubscription"] = measure_oversub(workers, plan, progress);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpuslice-bench: %s\n", e.what());
    report["fatal"] = e.what();
    status = 1;
  }
  json errors = json::array();
  collect_errors(report, "", errors);
  report["errors"] = errors;
  if (!errors.empty()) status = 1;

  if (as_json) {
    std::cout << report.dump(2) << std::endl;
  } else {
    print_table(report, stdout);
    print_priority_table(report, stdout);
    print_oversub_table(report, stdout);
  }
  if (!json_file.empty()) {
    std::FILE* f = std::fopen(json_file.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "gpuslice-bench: cannot write %s\n", json_file.c_str());
      status = 1;
    } else {
      std::fprintf(f, "%s\n", report.dump(2).c_str());
      std::fclose(f);
    }
  }
  if (!plots_dir.empty()) {
    // The plotting script reads the report from a file: the --json-file, or
    // one in the private directory.
    std::string source = json_file;
    if (source.empty() || status != 0) {
      source = context.tmp_dir + "/report.json";
      std::FILE* f = std::fopen(source.c_str(), "w");
      if (f != nullptr) {
        std::fprintf(f, "%s\n", report.dump().c_str());
        std::fclose(f);
      }
    }
    if (!write_plots(source, plots_dir, quiet)) status = 1;
  }
  if (keep) {
    std::fprintf(stderr, "gpuslice-bench: kept %s\n", context.tmp_dir.c_str());
  } else {
    remove_tree(context.tmp_dir);
  }
  return status;
}
