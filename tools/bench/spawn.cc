#include "spawn.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "child_env.h"

namespace gpuslice::bench {

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string last_line(const std::string& text) {
  std::string trimmed = text;
  while (!trimmed.empty() && (trimmed.back() == '\n' || trimmed.back() == ' ')) trimmed.pop_back();
  auto newline = trimmed.rfind('\n');
  return newline == std::string::npos ? trimmed : trimmed.substr(newline + 1);
}

}  // namespace

std::string Workers::fresh_path(const std::string& stem) {
  return context_.tmp_dir + "/" + stem + "." + std::to_string(counter_++);
}

std::string Workers::fresh_dir(const std::string& stem) {
  std::string dir = fresh_path(stem);
  if (mkdir(dir.c_str(), 0700) != 0) throw std::runtime_error("cannot create " + dir + ": " + std::strerror(errno));
  return dir;
}

pid_t Workers::start(const nlohmann::json& spec, const WorkerEnv& env) {
  // Every measurement sets its own quota, limit, region, simulated device and
  // library path: none is inherited.
  std::map<std::string, std::string> set = env.vars;
  if (!context_.ld_library_path.empty()) set["LD_LIBRARY_PATH"] = context_.ld_library_path;
  if (env.preload) set["LD_PRELOAD"] = context_.library;
  tools::ChildEnvRules rules;
  rules.keep_log_level = true;
  rules.keep_library_path = false;
  rules.keep_fakecuda_profile = true;
  std::vector<std::string> vars = tools::child_environment(set, rules);
  std::vector<char*> envp = tools::envp_of(vars);

  const std::string spec_text = spec.dump();
  std::string exe = context_.exe;
  std::string flag = "--worker";
  std::string arg = spec_text;
  char* argv[] = {exe.data(), flag.data(), arg.data(), nullptr};

  Running files{fresh_path("worker-out"), fresh_path("worker-err")};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, files.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&actions, 2, files.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start worker " + exe + ": " + std::strerror(rc));
  running_[pid] = files;
  return pid;
}

nlohmann::json Workers::finish(pid_t pid) {
  auto it = running_.find(pid);
  if (it == running_.end()) throw std::logic_error("finish() of an unknown worker");
  const Running files = it->second;
  running_.erase(it);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  const std::string out = slurp(files.out);
  const std::string err = slurp(files.err);
  if (context_.verbose && !err.empty()) std::fprintf(stderr, "%s", err.c_str());
  nlohmann::json result = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  const bool clean_exit = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (clean_exit && result.is_object() && !result.contains("error")) {
    if (!err.empty()) result["stderr"] = last_line(err);
    return result;
  }
  std::string why;
  if (result.is_object() && result.contains("error")) {
    why = result["error"].get<std::string>();
  } else if (WIFSIGNALED(status)) {
    why = std::string("worker killed by signal ") + strsignal(WTERMSIG(status));
  } else {
    why = "worker exited with status " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  if (!err.empty()) why += " [stderr: " + last_line(err) + "]";
  return nlohmann::json{{"error", why}};
}

}  // namespace gpuslice::bench
