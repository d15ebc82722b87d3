#include "plots.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "setup.h"

extern char** environ;

namespace gpuslice::bench {

namespace {

// plot.py's exit status when it cannot import matplotlib.
constexpr int kNoMatplotlib = 3;

}  // namespace

bool write_plots(const std::string& report_path, const std::string& dir, bool quiet) {
  std::string python;
  const char* from_env = std::getenv("GPUSLICE_BENCH_PYTHON");
  if (from_env != nullptr && *from_env != '\0') {
    python = from_env;
  } else {
    python = exe_dir() + "/../venv/bin/python";
  }
  if (access(python.c_str(), X_OK) != 0) {
    std::fprintf(stderr,
                 "gpuslice-bench: --plots: no Python at %s (%s): run tools/setup.sh <build> to make <build>/venv "
                 "with matplotlib, or set GPUSLICE_BENCH_PYTHON to a Python that has it\n",
                 python.c_str(),
                 from_env != nullptr && *from_env != '\0' ? "GPUSLICE_BENCH_PYTHON" : "the build's venv");
    return false;
  }
  const std::string script = exe_dir() + "/gpuslice-bench-plot.py";
  if (access(script.c_str(), R_OK) != 0) {
    std::fprintf(stderr,
                 "gpuslice-bench: --plots: the plotting script %s is missing (the build copies "
                 "tools/bench/plot.py there)\n",
                 script.c_str());
    return false;
  }
  std::vector<std::string> args{python, script, "--report", report_path, "--out", dir};
  if (quiet) args.push_back("--quiet");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (const int rc = posix_spawn(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ); rc != 0) {
    std::fprintf(stderr, "gpuslice-bench: --plots: cannot run %s: %s\n", python.c_str(), std::strerror(rc));
    return false;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  if (WIFEXITED(status) && WEXITSTATUS(status) == kNoMatplotlib) {
    // plot.py said which Python lacks matplotlib; say how to get it.
    std::fprintf(stderr,
                 "gpuslice-bench: --plots needs matplotlib: tools/setup.sh installs it into <build>/venv "
                 "(pinned in tools/bench/requirements.txt); the report itself is complete\n");
  } else {
    std::fprintf(stderr, "gpuslice-bench: --plots: %s %s failed (exit status %d)\n", python.c_str(), script.c_str(),
                 WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  return false;
}

}  // namespace gpuslice::bench
