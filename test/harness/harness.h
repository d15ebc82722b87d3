// Runs programs the way a container runs them: as a child process with
// LD_PRELOAD=<build>/lib/libgpuslice.so and LD_LIBRARY_PATH=<build>/fakecuda,
// a private simulated machine (FAKECUDA_STATE) and region (GPUSLICE_REGION),
// plus whatever environment a test adds. Captures exit status and output.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace gpuslice::test {

std::string build_dir();
std::string preload_library();             // <build>/lib/libgpuslice.so
std::string fakecuda_dir();                // <build>/fakecuda
std::string bin(const std::string& name);  // <build>/bin/<name>

struct Result {
  int exit_code = -1;  // -1 if killed by a signal
  int signal = 0;
  bool timed_out = false;
  std::string out;
  std::string err;
  std::string describe() const;  // for assertion messages
};

using Env = std::map<std::string, std::string>;

// A fresh directory for one test's simulated machine and region; removed at the end.
class Sandbox {
 public:
  Sandbox();
  ~Sandbox();
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;
  const std::string& dir() const { return dir_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // Environment for a child: the simulated driver on the library path, this
  // sandbox's machine state and region, preload on unless `preload` is false.
  Env env(bool preload = true) const;

 private:
  std::string dir_;
};

// Runs argv with the parent's environment minus LD_PRELOAD/GPUSLICE_*/FAKECUDA_*/CUDA_DEVICE_*,
// plus `env` (an empty value unsets). Waits up to timeout_ms, then SIGKILLs.
Result run(const std::vector<std::string>& argv, const Env& env, int timeout_ms = 60000);

// Starts argv in the background with the same environment rules; returns its pid.
// Its stdout goes to `out_path` if non-empty.
pid_t spawn(const std::vector<std::string>& argv, const Env& env, const std::string& out_path = "");
// Waits for a spawned child; returns its Result (out read from out_path if given).
Result wait(pid_t pid, const std::string& out_path = "", int timeout_ms = 60000);

// A child driven line by line (a rank of a multi-process test): its stdin and
// stdout are pipes; each command is a line, each answer a "<word> rc=R" line.
// Started with the same environment rules as run(); SIGKILLed at the end.
class Conversation {
 public:
  Conversation(const std::vector<std::string>& argv, const Env& env);
  ~Conversation();
  Conversation(const Conversation&) = delete;
  Conversation& operator=(const Conversation&) = delete;
  // Sends `command` and returns the rc of the answer (-1000: no answer within
  // 60 s, -1001: the child is gone, -1002: an answer without "rc=").
  int ask(const std::string& command);
  int answer();                                      // the rc of the next answer line
  const std::string& last() const { return last_; }  // that line, for messages
  void kill9();                                      // SIGKILL and reap
  void quit();                                       // "quit", then reap
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buffer_, last_;
};

Env merge(Env base, const Env& extra);

// Lines of `text` starting with `prefix`.
std::vector<std::string> lines_with(const std::string& text, const std::string& prefix);
// Value of "key=<value>" inside a line, or "" if absent.
std::string field(const std::string& line, const std::string& key);

// --- Probe programs: running one, reading what it printed ---
//
// A probe (gpuslice-probe, cuprobe, lifecycle_probe, ...) prints one line per
// step: "<op> key=value key=value ...". The one helper that runs a probe and
// the one parser of what it printed, shared by every test folder.

// A program of <build>/bin and the arguments every run of it starts with (the
// family of gpuslice-probe, say), run under the preload library with a limit.
struct Probe {
  std::vector<std::string> command;  // {"gpuslice-probe", "pool"}: bin() of the first word
  int timeout_ms = 60000;
  // In `box` (box.env(), then `extra` over it), `args` after the command.
  Result operator()(const Sandbox& box, const Env& extra, const std::vector<std::string>& args = {}) const;
  // With `env` as the whole environment (a test that builds it itself).
  Result with_env(const Env& env, const std::vector<std::string>& args) const;
};

// The value of `key` on the nth line of `op` (a line starting "<op> ") that
// carries `key`, or "" if there is none.
std::string value(const Result& r, const std::string& op, const std::string& key, std::size_t nth = 0);
// The value of `key` on every line of `op` that carries it, in order.
std::vector<std::string> values(const Result& r, const std::string& op, const std::string& key);
// value() as a number; `absent` if there is none. Junk throws (the test fails).
long long number(const Result& r, const std::string& op, const std::string& key, long long absent = -1);
unsigned long long unsigned_number(const Result& r, const std::string& op, const std::string& key,
                                   unsigned long long absent = ~0ull);

// The whole of the file at `path` (bytes as they are), "" if it cannot be read.
std::string read_text(const std::string& path);

// Waits up to timeout_ms for `path` to exist (a probe's "touch" step).
bool await_file(const std::string& path, int timeout_ms);

}  // namespace gpuslice::test
