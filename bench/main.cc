// gpuslice-microbench: ns per call of libgpuslice.so's wrappers against the
// simulated driver's own entry points, in the same process (fixture.h).
//
// The library reads its options once, at its first hooked call, so each
// configuration (no limits; SM limit + memory quota; 8 processes on one
// region) runs in a child process started with that environment. The parent
// gathers the children's Google Benchmark JSON into one table (results.h).
//
//   gpuslice-microbench                 all configurations, markdown table
//   gpuslice-microbench --min-time 0.5 --repetitions 3 --json-file out.json
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cases.h"
#include "child_env.h"
#include "cli.h"
#include "fixture.h"
#include "results.h"

namespace fs = std::filesystem;
using namespace gpuslice::microbench;

namespace {

const std::vector<int> kThreads{1, 2, 8, 32};
constexpr int kProcesses = 8;
constexpr const char* kSmLimit = "90";  // kernels take 0 us: the bucket never runs dry
constexpr const char* kMemoryLimit = "8Gi";
constexpr std::size_t kMemoryLimitBytes = std::size_t{8} << 30;

struct Options {
  std::string driver;   // the simulated libcuda.so.1
  std::string library;  // libgpuslice.so
  double min_time = 0.2;
  int repetitions = 1;
  bool verbose = false;
  std::string json_file;
  std::vector<std::string> only;  // calls to measure (all when empty)
  std::string threads;            // "N,..." as given, passed on to the children
  std::vector<int> threads_only;  // its counts, checked (all when empty)
  int control_turns = kDefaultControlTurns;
  // child only
  bool child = false;
  std::string cases;
  std::string out;
  bool expect_quota = false;
  bool calibrate = false;
};

// A failure after the command line parsed (no driver, no library).
[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "gpuslice-microbench: %s\n", why.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& text, char by) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, by);) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string seconds(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

std::string join(const std::vector<std::string>& items, char by) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : std::string(1, by)) + item;
  return out;
}

// Strict: a value that is not a number in range, an unknown call or flag is
// an error naming the flag (CLI11), exit status 2, nothing measured.
std::optional<Options> parse(int argc, char** argv, int* status) {
  Options o;
  const fs::path dir = fs::read_symlink("/proc/self/exe").parent_path();
  o.driver = (dir / ".." / "fakecuda" / "libcuda.so.1").lexically_normal().string();
  o.library = (dir / ".." / "lib" / "libgpuslice.so").lexically_normal().string();
  CLI::App app{
      "gpuslice-microbench: ns per call of libgpuslice.so's wrappers against the driver's own entry points, "
      "native beside wrapped in one process. Prints markdown tables (docs/benchmarks.md).",
      "gpuslice-microbench"};
  app.add_option("--min-time", o.min_time, "seconds per benchmark and repetition [0.2]")->check(CLI::Range(0.01, 60.0));
  app.add_option("--repetitions", o.repetitions, "repetitions; N > 1: every cell is the median and its spread [1]")
      ->check(CLI::Range(1, 100));
  app.add_option("--json-file", o.json_file, "also write the results as JSON to FILE");
  app.add_flag("--verbose,-v", o.verbose, "print the children's logs");
  std::string only;
  app.add_option("--only", only,
                 "calls to measure, comma-separated, names as in the table (e.g. cuMemAlloc+cuMemFree)");
  app.add_option("--threads", o.threads, "thread counts to measure, comma-separated, each 1 to 32 [1,2,8,32]");
  app.add_option("--control-turns", o.control_turns,
                 "the control side's private delay before each native call, in empty loop turns [100]")
      ->check(CLI::Range(0, kMaxControlTurns));
  app.add_option("--driver", o.driver, "the driver to measure [<exe dir>/../fakecuda/libcuda.so.1, simulated]");
  app.add_option("--lib", o.library, "the library to measure [<exe dir>/../lib/libgpuslice.so]");
  // The parent starts one child per configuration with these.
  app.add_flag("--child", o.child)->group("");
  app.add_option("--cases", o.cases)->group("");
  app.add_option("--out", o.out)->group("");
  app.add_flag("--expect-quota", o.expect_quota)->group("");
  app.add_flag("--calibrate", o.calibrate)->group("");
  const auto checks = [&] {
    o.only = split(only, ',');
    if (!o.child) {
      for (const std::string& call : o.only) {
        bool known = false;
        for (const std::string& name : all_cases()) known = known || name == call;
        if (!known)
          throw CLI::ValidationError("--only",
                                     call + " is not a call of the table; expected one of " + join(all_cases(), ','));
      }
    }
    for (const std::string& t : split(o.threads, ',')) {
      char* end = nullptr;
      const long n = std::strtol(t.c_str(), &end, 10);
      if (*end != '\0' || n < 1 || n > kMaxThreads)
        throw CLI::ValidationError("--threads", t + " is not a thread count from 1 to " + std::to_string(kMaxThreads));
      o.threads_only.push_back(static_cast<int>(n));
    }
  };
  if (const std::optional<int> stop =
          gpuslice::tools::parse(app, argc, argv, gpuslice::tools::BadCommandLine::cli11, checks)) {
    *status = *stop;
    return std::nullopt;
  }
  return o;
}

// --- child: one configuration, environment already set by the parent ---------

int child_main(const Options& o, const char* argv0) {
  static Fixture fixture;  // outlives the benchmarks
  try {
    setup_fixture(fixture, o.driver, o.library);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpuslice-microbench: %s\n", e.what());
    return 1;
  }
  // A wrapper that silently ignored the configuration would make the limited
  // rows measure the unlimited path: check the quota is what cuMemGetInfo shows.
  if (o.expect_quota && fixture.quota_seen != kMemoryLimitBytes) {
    std::fprintf(stderr, "gpuslice-microbench: quota not in effect (cuMemGetInfo total %zu, expected %zu)\n",
                 fixture.quota_seen, kMemoryLimitBytes);
    return 1;
  }
  if (o.calibrate) {
    const double ns = start_calibration_load(fixture, 1.0);
    std::fprintf(stderr, "gpuslice-microbench: after calibration, %.0f wall ns per wrapped empty launch%s\n", ns,
                 ns > 5000 ? " (the limiter did NOT calibrate: these rows measure its cautious start)" : "");
  }
  CaseSet set;
  set.calls = split(o.cases, ',');
  set.threads = o.threads_only;
  set.control_turns = o.control_turns;
  register_cases(fixture, set);
  std::vector<std::string> args{argv0, "--benchmark_out=" + o.out, "--benchmark_out_format=json",
                                "--benchmark_min_time=" + seconds(o.min_time)};
  if (o.repetitions > 1) {
    args.push_back("--benchmark_repetitions=" + std::to_string(o.repetitions));
    // Every repetition is reported (and the aggregates): the parent shows
    // the median with its spread, so that a bimodal result is visible.
    // Repetitions of all cases in random order: a burst of load from another
    // process on the machine then spreads over native and wrapped alike.
    args.push_back("--benchmark_enable_random_interleaving=true");
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  int argc = static_cast<int>(argv.size());
  argv.push_back(nullptr);
  benchmark::Initialize(&argc, argv.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  stop_calibration_load(fixture);
  return 0;
}

// --- parent -------------------------------------------------------------------

struct Config {
  std::string name;
  std::vector<std::string> calls;
  std::vector<int> threads;
  bool limits;
  bool calibrate;
  int processes;
};

struct Child {
  pid_t pid;
  std::string out;
  std::string log;
};

std::string private_dir() {
  std::string pattern = (access("/dev/shm", W_OK) == 0 ? std::string("/dev/shm") : fs::temp_directory_path().string()) +
                        "/gpuslice-microbench.XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("cannot create a private directory");
  return pattern;
}

Child spawn_child(const Options& o, const Config& c, const std::string& dir, int index) {
  const std::string tag = c.name + "." + std::to_string(index);
  Child child{-1, dir + "/" + tag + ".json", dir + "/" + tag + ".log"};
  const std::string fake_dir = fs::path(o.driver).parent_path().string();
  std::map<std::string, std::string> set{
      {"LD_LIBRARY_PATH", fake_dir},
      {"GPUSLICE_REAL_LIBCUDA", o.driver},
      {"GPUSLICE_REAL_LIBNVML", fake_dir + "/libnvidia-ml.so.1"},
      // The processes of one configuration share its region and its simulated device.
      {"GPUSLICE_REGION", dir + "/" + c.name + ".region"},
      {"FAKECUDA_STATE", dir + "/" + c.name + ".state"},
  };
  if (c.limits) {
    set["GPUSLICE_SM_LIMIT"] = kSmLimit;
    set["GPUSLICE_MEMORY_LIMIT"] = kMemoryLimit;
  }
  gpuslice::tools::ChildEnvRules rules;
  rules.keep_log_level = true;
  rules.keep_library_path = false;
  rules.keep_fakecuda_profile = true;
  std::vector<std::string> vars = gpuslice::tools::child_environment(set, rules);
  std::vector<char*> envp = gpuslice::tools::envp_of(vars);

  std::vector<std::string> threads;
  for (int t : c.threads) threads.push_back(std::to_string(t));
  std::vector<std::string> args{fs::read_symlink("/proc/self/exe").string(),
                                "--child",
                                "--driver",
                                o.driver,
                                "--lib",
                                o.library,
                                "--cases",
                                join(c.calls, ','),
                                "--threads",
                                join(threads, ','),
                                "--out",
                                child.out,
                                "--min-time",
                                seconds(o.min_time),
                                "--repetitions",
                                std::to_string(o.repetitions),
                                "--control-turns",
                                std::to_string(o.control_turns)};
  if (c.limits) args.push_back("--expect-quota");
  if (c.calibrate) args.push_back("--calibrate");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, child.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  int rc = posix_spawn(&child.pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error(std::string("cannot start a child: ") + std::strerror(rc));
  return child;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Runs the configuration's processes together; false if one failed.
bool run_config(const Options& o, const Config& c, const std::string& dir, Results& results) {
  std::fprintf(stderr, "gpuslice-microbench: %s (%d process%s)\n", c.name.c_str(), c.processes,
               c.processes == 1 ? "" : "es");
  std::vector<Child> children;
  for (int i = 0; i < c.processes; ++i) children.push_back(spawn_child(o, c, dir, i));
  bool ok = true;
  for (const Child& child : children) {
    int status = 0;
    while (waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {}
    const std::string log = slurp(child.log);
    if (o.verbose) std::fprintf(stderr, "%s", log.c_str());
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !add_results(results, c.name, slurp(child.out))) {
      std::fprintf(stderr, "gpuslice-microbench: %s failed:\n%s\n", c.name.c_str(), log.c_str());
      ok = false;
    }
  }
  return ok;
}

std::string machine() {
  std::ifstream in("/proc/cpuinfo");
  std::string model = "unknown CPU";
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return model + ", " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + " CPUs online";
}

int parent_main(const Options& o) {
  if (!fs::exists(o.driver)) {
    fail("--driver: no driver at " + o.driver +
         " (build the simulated one with GPUSLICE_BUILD_TESTS=ON, or pass --driver)");
  }
  if (!fs::exists(o.library)) fail("--lib: no libgpuslice.so at " + o.library);
  auto wanted = [&](const std::vector<std::string>& names) {
    std::vector<std::string> out;
    for (const std::string& name : names) {
      bool keep = o.only.empty();
      for (const std::string& w : o.only) keep = keep || w == name;
      if (keep) out.push_back(name);
    }
    return out;
  };
  const std::vector<std::string> calls = wanted(all_cases());
  std::vector<std::string> limited_calls;
  for (const std::string& call : calls) {
    if (call != "cuGetProcAddress") limited_calls.push_back(call);  // not affected by limits
  }
  const std::vector<std::string> launch_calls = wanted({"cuLaunchKernel", "cuLaunchKernelEx", "cuGraphLaunch"});
  const std::vector<std::string> shared_calls = wanted({"cuLaunchKernel", "cuMemAlloc+cuMemFree"});
  const std::vector<int> threads = o.threads_only.empty() ? kThreads : o.threads_only;
  // "limited": the brief's case, empty kernels only, which leaves the compute
  // limiter in its uncalibrated start; "calibrated": the same with a light
  // real load so that it reaches its steady state (fixture.h).
  std::vector<Config> configs{
      {"unlimited", calls, threads, false, false, 1},
      {"limited", limited_calls, threads, true, false, 1},
      {"calibrated", launch_calls, threads, true, true, 1},
  };
  if (o.threads_only.empty()) {
    configs.push_back({"procs8", shared_calls, {1}, false, false, kProcesses});
    configs.push_back({"procs8_limited", shared_calls, {1}, true, true, kProcesses});
  }
  std::erase_if(configs, [](const Config& c) { return c.calls.empty(); });
  std::string dir;
  try {
    dir = private_dir();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpuslice-microbench: %s\n", e.what());
    return 1;
  }
  Results results;
  bool ok = true;
  double load[3] = {0, 0, 0};
  const bool have_load = getloadavg(load, 3) == 3;
  for (const Config& c : configs) ok = run_config(o, c, dir, results) && ok;
  double load_after[3] = {0, 0, 0};
  const bool have_load_after = getloadavg(load_after, 3) == 3;
  std::error_code ec;
  fs::remove_all(dir, ec);

  TableInfo info;
  info.machine = machine();
  info.command =
      "gpuslice-microbench --min-time " + seconds(o.min_time) + " --repetitions " + std::to_string(o.repetitions);
  if (!o.only.empty()) info.command += " --only " + join(o.only, ',');
  if (!o.threads.empty()) info.command += " --threads " + o.threads;
  if (o.control_turns != kDefaultControlTurns) info.command += " --control-turns " + std::to_string(o.control_turns);
  info.control_turns = o.control_turns;
  if (have_load && have_load_after) {
    char text[128];
    std::snprintf(text, sizeof text, "%.2f before, %.2f after (1-minute load average)", load[0], load_after[0]);
    info.load = text;
  }
  info.limits = std::string("GPUSLICE_SM_LIMIT=") + kSmLimit + " GPUSLICE_MEMORY_LIMIT=" + kMemoryLimit;
  void* driver = dlopen(o.driver.c_str(), RTLD_LAZY | RTLD_LOCAL);
  info.simulated = driver == nullptr || dlsym(driver, "fakecuda_busy_ns") != nullptr;
  info.min_time = o.min_time;
  info.repetitions = o.repetitions;
  print_tables(results, calls, threads, info, stdout);
  if (!o.json_file.empty()) {
    std::ofstream out(o.json_file);
    out << results_json(results, info).dump(2) << "\n";
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int status = 0;
  const std::optional<Options> options = parse(argc, argv, &status);
  if (!options) return status == 0 ? 0 : 2;
  return options->child ? child_main(*options, argv[0]) : parent_main(*options);
}
