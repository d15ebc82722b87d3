// Runs workers: gpuslice-bench re-executed with --worker <spec>, natively or
// with libgpuslice.so in LD_PRELOAD, in an environment built from scratch for
// each run (no inherited quota or limit can leak into a measurement), with its
// stdout (the result) and stderr captured in the run's private directory.
#pragma once

#include <sys/types.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace gpuslice::bench {

struct BenchContext {
  std::string exe;              // this executable
  std::string library;          // libgpuslice.so
  std::string ld_library_path;  // for workers: where libcuda.so.1 is found ("" = none set)
  std::string tmp_dir;          // private to this run
  bool verbose = false;         // echo workers' stderr
};

struct WorkerEnv {
  bool preload = false;                     // LD_PRELOAD=libgpuslice.so
  std::map<std::string, std::string> vars;  // GPUSLICE_*, FAKECUDA_STATE, ...
};

class Workers {
 public:
  explicit Workers(BenchContext context) : context_(std::move(context)) {}

  // Starts a worker; throws std::runtime_error if it cannot be spawned.
  pid_t start(const nlohmann::json& spec, const WorkerEnv& env);
  // Waits for it: its JSON result, or {"error": "..."} if it failed.
  nlohmann::json finish(pid_t pid);
  nlohmann::json run(const nlohmann::json& spec, const WorkerEnv& env) { return finish(start(spec, env)); }

  // A new, unused path (or directory) in the run's private directory.
  std::string fresh_path(const std::string& stem);
  std::string fresh_dir(const std::string& stem);

  const BenchContext& context() const { return context_; }

 private:
  struct Running {
    std::string out;
    std::string err;
  };
  BenchContext context_;
  std::map<pid_t, Running> running_;
  unsigned counter_ = 0;
};

}  // namespace gpuslice::bench
