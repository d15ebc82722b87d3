#include "harness.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "child_env.h"

namespace gpuslice::test {

std::string build_dir() { return GPUSLICE_TEST_BUILD_DIR; }
std::string preload_library() { return build_dir() + "/lib/libgpuslice.so"; }
std::string fakecuda_dir() { return build_dir() + "/fakecuda"; }
std::string bin(const std::string& name) { return build_dir() + "/bin/" + name; }

std::string Result::describe() const {
  std::ostringstream s;
  s << "exit=" << exit_code << " signal=" << signal << (timed_out ? " TIMED OUT" : "") << "\n--- stdout\n"
    << out << "--- stderr\n"
    << err;
  return s.str();
}

Sandbox::Sandbox() {
  char tmpl[] = "/tmp/gpuslice-test-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
  dir_ = tmpl;
}

Sandbox::~Sandbox() {
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

Env Sandbox::env(bool preload) const {
  Env e{{"LD_LIBRARY_PATH", fakecuda_dir()},
        {"FAKECUDA_STATE", path("fakecuda.state")},
        {"GPUSLICE_REGION", path("container.region")},
        // Each test its own priority board: the node default is shared by every process.
        {"GPUSLICE_PRIORITY_BOARD", path("priority-board")}};
  if (preload) e["LD_PRELOAD"] = preload_library();
  // FAKECUDA_PROFILE=realistic ctest ...: the whole suite on that timing/memory model.
  if (const char* p = std::getenv("FAKECUDA_PROFILE"); p != nullptr && *p != '\0') e["FAKECUDA_PROFILE"] = p;
  return e;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

Env merge(Env base, const Env& extra) {
  for (const auto& [k, v] : extra) base[k] = v;
  return base;
}

namespace {

// The parent's environment less LD_PRELOAD, GPUSLICE_*, CUDA_DEVICE_* and
// FAKECUDA_* (tools/common/child_env.h), then `env` (an empty value unsets).
std::vector<std::string> child_environment(const Env& env) {
  Env set;
#if defined(__SANITIZE_ADDRESS__)
  // The preload library comes before libasan in a sanitized child: allowed.
  set["ASAN_OPTIONS"] = "verify_asan_link_order=0:detect_leaks=0";
#endif
  for (const auto& [k, v] : env) set[k] = v;
  return tools::child_environment(set, tools::ChildEnvRules{});
}

pid_t start(const std::vector<std::string>& argv, const Env& env, int out_fd, int err_fd, int in_fd = -1) {
  std::vector<std::string> envs = child_environment(env);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    if (out_fd >= 0) dup2(out_fd, 1);
    if (err_fd >= 0) dup2(err_fd, 2);
    const int in = in_fd >= 0 ? in_fd : open("/dev/null", O_RDONLY);
    if (in >= 0) dup2(in, 0);
    execve(cargv[0], cargv.data(), cenv.data());
    _exit(127);
  }
  return pid;
}

long long now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

void finish_status(int status, Result* r) {
  if (WIFEXITED(status)) r->exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r->signal = WTERMSIG(status);
}

}  // namespace

Result run(const std::vector<std::string>& argv, const Env& env, int timeout_ms) {
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = start(argv, env, out_pipe[1], err_pipe[1]);
  close(out_pipe[1]);
  close(err_pipe[1]);
  Result r;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  const long long deadline = now_ms() + timeout_ms;
  char buf[65536];
  while (open_fds > 0) {
    long long left = deadline - now_ms();
    if (left <= 0) {
      r.timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    if (poll(fds, 2, static_cast<int>(left)) < 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP))) continue;
      ssize_t n = read(fds[i].fd, buf, sizeof buf);
      if (n <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      } else {
        (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(n));
      }
    }
  }
  for (auto& f : fds)
    if (f.fd >= 0) close(f.fd);
  int status = 0;
  waitpid(pid, &status, 0);
  finish_status(status, &r);
  return r;
}

pid_t spawn(const std::vector<std::string>& argv, const Env& env, const std::string& out_path) {
  int fd = -1;
  if (!out_path.empty()) fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  pid_t pid = start(argv, env, fd, -1);
  if (fd >= 0) close(fd);
  return pid;
}

Result wait(pid_t pid, const std::string& out_path, int timeout_ms) {
  Result r;
  int status = 0;
  const long long deadline = now_ms() + timeout_ms;
  while (true) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (now_ms() > deadline) {
      r.timed_out = true;
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    usleep(2000);
  }
  finish_status(status, &r);
  if (!out_path.empty()) {
    std::ifstream in(out_path);
    std::stringstream ss;
    ss << in.rdbuf();
    r.out = ss.str();
  }
  return r;
}

Conversation::Conversation(const std::vector<std::string>& argv, const Env& env) {
  signal(SIGPIPE, SIG_IGN);  // a child that died answers -1001, never kills the test
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return;
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return;
  }
  pid_ = start(argv, env, out[1], -1, in[0]);
  close(in[0]);
  close(out[1]);
  to_ = in[1];
  from_ = out[0];
}

Conversation::~Conversation() {
  if (to_ >= 0) close(to_);
  if (from_ >= 0) close(from_);
  kill9();
}

int Conversation::ask(const std::string& command) {
  const std::string line = command + "\n";
  if (to_ < 0 || write(to_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return -1001;
  return answer();
}

int Conversation::answer() {
  std::string line;
  while (true) {
    const std::size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      break;
    }
    pollfd p{from_, POLLIN, 0};
    if (from_ < 0 || poll(&p, 1, 60000) <= 0) return -1000;
    char chunk[256];
    const ssize_t n = read(from_, chunk, sizeof chunk);
    if (n <= 0) return -1000;
    buffer_.append(chunk, static_cast<std::size_t>(n));
  }
  last_ = line;
  const std::size_t at = line.find("rc=");
  return at == std::string::npos ? -1002 : std::atoi(line.c_str() + at + 3);
}

void Conversation::kill9() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

void Conversation::quit() {
  if (pid_ <= 0) return;
  const std::string line = "quit\n";
  (void)!write(to_, line.data(), line.size());
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::vector<std::string> lines_with(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  return out;
}

std::string field(const std::string& line, const std::string& key) {
  const std::string k = key + "=";
  size_t pos = 0;
  while ((pos = line.find(k, pos)) != std::string::npos) {
    if (pos == 0 || line[pos - 1] == ' ') {
      size_t end = line.find(' ', pos);
      return line.substr(pos + k.size(), end == std::string::npos ? std::string::npos : end - pos - k.size());
    }
    pos += k.size();
  }
  return "";
}

Result Probe::operator()(const Sandbox& box, const Env& extra, const std::vector<std::string>& args) const {
  return with_env(merge(box.env(), extra), args);
}

Result Probe::with_env(const Env& env, const std::vector<std::string>& args) const {
  std::vector<std::string> argv = command;
  argv.front() = bin(argv.front());
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv, env, timeout_ms);
}

std::vector<std::string> values(const Result& r, const std::string& op, const std::string& key) {
  std::vector<std::string> out;
  for (const std::string& line : lines_with(r.out, op + " ")) {
    // field() reads "" for a key without a value too: look for the key itself.
    if (line.find(" " + key + "=") == std::string::npos) continue;
    out.push_back(field(line, key));
  }
  return out;
}

std::string value(const Result& r, const std::string& op, const std::string& key, std::size_t nth) {
  const std::vector<std::string> all = values(r, op, key);
  return nth < all.size() ? all[nth] : "";
}

long long number(const Result& r, const std::string& op, const std::string& key, long long absent) {
  const std::string v = value(r, op, key);
  return v.empty() ? absent : std::stoll(v);
}

unsigned long long unsigned_number(const Result& r, const std::string& op, const std::string& key,
                                   unsigned long long absent) {
  const std::string v = value(r, op, key);
  return v.empty() ? absent : std::stoull(v);
}

bool await_file(const std::string& path, int timeout_ms) {
  for (int i = 0; i < timeout_ms / 2 && access(path.c_str(), F_OK) != 0; ++i) usleep(2000);
  return access(path.c_str(), F_OK) == 0;
}

}  // namespace gpuslice::test
