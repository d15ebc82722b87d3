// gpuslice-instructions: the instructions libgpuslice.so adds to a call, counted
// by valgrind's callgrind (deterministic: the same on any machine and under any
// load, where times vary threefold between machines). For each call and
// configuration it runs four children under callgrind — native and wrapped,
// N and 2N iterations, instrumentation on around the loop alone — and prints
// (Ir(2N) - Ir(N)) / N for each side and their difference: what a call costs,
// free of set-up and first-call work. Against the simulated driver only: the
// native column is the simulator's, never a GPU driver's.
//
//   gpuslice-instructions                      every case, markdown table
//   gpuslice-instructions --iterations 20000 --only pair-quota
//   gpuslice-instructions --only pair-quota --live 1000000   beside a million live allocations
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <valgrind/callgrind.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "child_env.h"
#include "fixture.h"

namespace fs = std::filesystem;
using namespace gpuslice::microbench;

namespace {

struct Case {
  const char* name;
  const char* what;
  bool quota;     // GPUSLICE_MEMORY_LIMIT set
  bool sm_limit;  // GPUSLICE_SM_LIMIT set
};

// sm-limit 90 with 0-us kernels: the bucket never runs dry, so the limited
// launch is measured with tokens available.
const Case kCases[] = {
    {"launch-unlimited", "cuLaunchKernel, no limits", false, false},
    {"launch-limited", "cuLaunchKernel, GPUSLICE_SM_LIMIT=90, tokens available", false, true},
    {"pair-quota", "cuMemAlloc(1 MiB) + cuMemFree, GPUSLICE_MEMORY_LIMIT=8Gi", true, false},
    {"pair-unlimited", "cuMemAlloc(1 MiB) + cuMemFree, no limits", false, false},
};

const Case* find_case(const std::string& name) {
  for (const Case& c : kCases) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "gpuslice-instructions: %s\n", why.c_str());
  std::exit(2);
}

// --- child: one side of one case, N iterations, under callgrind ------------

void check(CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) fail(std::string(what) + " failed: CUresult " + std::to_string(rc));
}

void run_loop(const Calls& calls, const Fixture& f, const std::string& name, long n) {
  CUstream stream = f.streams.front();
  if (name.rfind("launch", 0) == 0) {
    for (long i = 0; i < n; ++i) check(calls.launch(f.empty, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr), "launch");
  } else {
    for (long i = 0; i < n; ++i) {
      CUdeviceptr p = 0;
      check(calls.alloc(&p, 1 << 20), "cuMemAlloc");
      check(calls.free(p), "cuMemFree");
    }
  }
}

int child_main(const std::string& driver, const std::string& library, const std::string& name, bool wrapped, long n,
               long live) {
  Fixture f;
  setup_fixture(f, driver, library);
  const Calls& calls = wrapped ? f.wrapped : f.native;
  // --live: allocations held through the loop (512 B each), so that a call
  // is counted beside that many records (issue 35: flat from 10^3 to 10^6).
  for (long i = 0; i < live; ++i) {
    CUdeviceptr p = 0;
    check(calls.alloc(&p, 512), "cuMemAlloc (live)");
  }
  run_loop(calls, f, name, 1000);  // first calls, lazy binding, the library's slow starts
  f.stream_synchronize(f.streams.front());
  CALLGRIND_ZERO_STATS;
  CALLGRIND_START_INSTRUMENTATION;
  run_loop(calls, f, name, n);
  CALLGRIND_STOP_INSTRUMENTATION;
  CALLGRIND_DUMP_STATS_AT("loop");
  return 0;
}

// --- parent ------------------------------------------------------------------

// The instructions of the dump named "loop" in a callgrind output file.
long long loop_instructions(const std::string& out_prefix) {
  long long best = -1;
  for (const auto& entry : fs::directory_iterator(fs::path(out_prefix).parent_path())) {
    const std::string path = entry.path().string();
    if (path.rfind(out_prefix, 0) != 0) continue;
    std::ifstream in(path);
    bool loop = false;
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("desc: Trigger:", 0) == 0) loop = line.find("loop") != std::string::npos;
      if (loop && line.rfind("totals:", 0) == 0) {
        best = std::max(best, std::atoll(line.c_str() + line.find(':') + 1));
      }
    }
  }
  return best;
}

long long count(const std::string& valgrind, const std::string& driver, const std::string& library, const Case& c,
                bool wrapped, long n, long live, const std::string& dir) {
  const std::string tag = std::string(c.name) + (wrapped ? ".wrapped." : ".native.") + std::to_string(n);
  const std::string out_prefix = dir + "/" + tag + ".cg";
  const std::string log = dir + "/" + tag + ".log";
  const std::string fake_dir = fs::path(driver).parent_path().string();
  std::map<std::string, std::string> set{
      {"LD_LIBRARY_PATH", fake_dir},
      {"GPUSLICE_REAL_LIBCUDA", driver},
      {"GPUSLICE_REAL_LIBNVML", fake_dir + "/libnvidia-ml.so.1"},
      {"GPUSLICE_REGION", dir + "/" + tag + ".region"},
      {"FAKECUDA_STATE", dir + "/" + tag + ".state"},
  };
  if (c.quota) set["GPUSLICE_MEMORY_LIMIT"] = "8Gi";
  if (c.sm_limit) set["GPUSLICE_SM_LIMIT"] = "90";
  gpuslice::tools::ChildEnvRules rules;
  rules.keep_library_path = false;
  std::vector<std::string> vars = gpuslice::tools::child_environment(set, rules);
  std::vector<char*> envp = gpuslice::tools::envp_of(vars);
  std::vector<std::string> args{valgrind,
                                "--tool=callgrind",
                                "--instr-atstart=no",
                                "--callgrind-out-file=" + out_prefix + ".%p",
                                fs::read_symlink("/proc/self/exe").string(),
                                "--child",
                                "--driver",
                                driver,
                                "--lib",
                                library,
                                "--only",
                                c.name,
                                "--iterations",
                                std::to_string(n),
                                "--live",
                                std::to_string(live)};
  if (wrapped) args.push_back("--wrapped");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) fail("cannot start " + valgrind + ": " + std::strerror(rc));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  const long long ir = loop_instructions(out_prefix);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || ir < 0) {
    std::ifstream in(log);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    fail(std::string(c.name) + (wrapped ? " wrapped" : " native") + " failed under callgrind:\n" + text);
  }
  return ir;
}

std::string exe_dir() { return fs::read_symlink("/proc/self/exe").parent_path().string(); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gpuslice-instructions: instructions libgpuslice.so adds per call (callgrind, simulated driver)"};
  std::string driver = fs::path(exe_dir()).parent_path().string() + "/fakecuda/libcuda.so.1";
  std::string library = fs::path(exe_dir()).parent_path().string() + "/lib/libgpuslice.so";
  std::string valgrind = "valgrind";
  std::vector<std::string> only;
  long iterations = 10000;
  long live = 0;
  bool child = false;
  bool wrapped = false;
  app.add_option("--driver", driver, "the simulated libcuda.so.1");
  app.add_option("--lib", library, "libgpuslice.so");
  app.add_option("--valgrind", valgrind, "the valgrind program");
  app.add_option("--only", only, "cases to count (default: all)")->delimiter(',');
  app.add_option("--iterations", iterations, "N: each side runs N and 2N calls")->check(CLI::Range(100L, 10000000L));
  app.add_option("--live", live, "allocations (512 B) held through the loop")->check(CLI::Range(0L, 10000000L));
  app.add_flag("--child", child)->group("");
  app.add_flag("--wrapped", wrapped)->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "gpuslice-instructions: %s\n", e.what());
    return 2;
  }
  for (const std::string& name : only) {
    if (find_case(name) == nullptr) fail("--only: no case " + name);
  }
  try {
    if (child) return child_main(driver, library, only.at(0), wrapped, iterations, live);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  if (!fs::exists(driver)) fail("--driver: no driver at " + driver);
  if (!fs::exists(library)) fail("--lib: no libgpuslice.so at " + library);
  char pattern[] = "/tmp/gpuslice-instructions.XXXXXX";
  if (mkdtemp(pattern) == nullptr) fail("cannot create a private directory");
  const std::string dir = pattern;
  std::printf(
      "Instructions per call (callgrind, (Ir(2N) - Ir(N)) / N, N = %ld, %ld live allocations; simulated driver)\n\n",
      iterations, live);
  std::printf("| case | what | native | wrapped | added |\n|---|---|---:|---:|---:|\n");
  for (const Case& c : kCases) {
    if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
    double per[2];
    for (int side = 0; side < 2; ++side) {
      const long long one = count(valgrind, driver, library, c, side == 1, iterations, live, dir);
      const long long two = count(valgrind, driver, library, c, side == 1, 2 * iterations, live, dir);
      per[side] = static_cast<double>(two - one) / static_cast<double>(iterations);
    }
    std::printf("| %s | %s | %.1f | %.1f | %+.1f |\n", c.name, c.what, per[0], per[1], per[1] - per[0]);
    std::fflush(stdout);
  }
  fs::remove_all(dir);
  return 0;
}
