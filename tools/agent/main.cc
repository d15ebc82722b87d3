// gpuslice-agent: the node agent (see agent.h and docs/agent.md).
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <time.h>

#include <cstdio>
#include <optional>
#include <string>

#include "agent.h"
#include "cli.h"
#include "http.h"
#include "limiter/options/options.h"
#include "log.h"
#include "region_io.h"
#include "units.h"

using namespace std::string_literals;

using namespace gpuslice::agent;
using gpuslice::tools::usage_error;

namespace {

// One pidfd per watched process: make room for thousands.
void raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace

int main(int argc, char** argv) {
  AgentConfig cfg;
  std::string interval = "100ms", rescan = "1s", grace = "5m", tolerance = "768Mi", listen = kDefaultListen;
  std::string level = "info", metrics = "full", enforce = "report";
  bool no_nvml = false, once = false;
  CLI::App app{
      "gpuslice-agent: the gpuslice node agent. Watches every container's region, writes measured GPU "
      "utilisation and NVML-reconciled memory into them, reaps dead processes, removes unused regions and "
      "serves /metrics and /healthz.",
      "gpuslice-agent"};
  gpuslice::tools::add_version_flag(app);
  app.add_option("--region-dir", cfg.region_dir, "Directory holding the regions (<dir>/<file> or <dir>/<pod>/<file>)")
      ->capture_default_str();
  app.add_option("--hami-root", cfg.hami_root,
                 "Also watch HAMi's host directory (<hook path>/vgpu, e.g. /usr/local/vgpu): "
                 "<root>/containers/<pod-uid>_<container>/ and <root>/claims/<claim-uid>/");
  app.add_option("--interval", interval, "Cycle period (e.g. 100ms, 1s)")->capture_default_str();
  app.add_option("--rescan", rescan, "How often the region directory is re-read")->capture_default_str();
  app.add_option("--grace", grace, "Remove a region nobody has used for this long (0 = never)")->capture_default_str();
  app.add_option("--priority-board", cfg.priority_board,
                 "Priority board whose stale files (unused for --grace) are removed; '' = none")
      ->capture_default_str();
  app.add_option(
         "--bypass-tolerance", tolerance,
         "Report a process holding more than its accounted memory plus this (context memory); --enforce acts on a "
         "container over its quota plus this")
      ->capture_default_str();
  app.add_option("--enforce", enforce,
                 "report | kill: a container above its quota plus --bypass-tolerance (NVML) for --enforce-cycles "
                 "cycles is reported, or has its unregistered (else largest) process killed")
      ->capture_default_str();
  app.add_option("--enforce-cycles", cfg.enforce_cycles, "Consecutive cycles over quota before --enforce acts")
      ->capture_default_str();
  app.add_option("--listen", listen, "host:port for /metrics and /healthz ('off' = no HTTP endpoint)")
      ->capture_default_str();
  app.add_option("--nvml", cfg.nvml_library, "NVML library to dlopen")->capture_default_str();
  app.add_flag("--no-nvml", no_nvml, "Run without NVML: reaping and metrics only");
  app.add_option("--max-regions", cfg.max_regions, "Most regions watched at once")->capture_default_str();
  app.add_option("--metrics", metrics,
                 "full | basic: basic leaves out per-region series no shipped rule or dashboard uses "
                 "(for thousands of containers per node)")
      ->capture_default_str();
  app.add_option("--log-level", level, "error | warn | info | debug")->capture_default_str();
  app.add_flag("--once", once, "Run one cycle, print the metrics to stdout and exit");
  std::string backstop = "on";
  app.add_option("--driver-backstop", backstop,
                 "on | off: set the driver's per-cgroup memory limit (R615+) to each container's quota")
      ->capture_default_str();
  if (const std::optional<int> stop = gpuslice::tools::parse(app, argc, argv)) return *stop;
  if (!parse_duration(interval, &cfg.interval_ns) || cfg.interval_ns < 1'000'000) {
    return usage_error(app, "--interval '"s + interval + "': expected a duration of at least 1ms (e.g. 100ms)");
  }
  if (!parse_duration(rescan, &cfg.rescan_ns))
    return usage_error(app, "--rescan '"s + rescan + "': expected a duration");
  if (!parse_duration(grace, &cfg.grace_ns))
    return usage_error(app, "--grace '"s + grace + "': expected a duration or 0");
  if (!gpuslice::options::parse_size(tolerance.c_str(), &cfg.bypass_tolerance_bytes)) {
    return usage_error(app, "--bypass-tolerance '"s + tolerance + "': expected a size (e.g. 768Mi)");
  }
  if (enforce != "report" && enforce != "kill")
    return usage_error(app, "--enforce '"s + enforce + "': expected report or kill");
  cfg.enforce = enforce == "kill" ? EnforceMode::kill : EnforceMode::report;
  if (cfg.enforce_cycles < 1 || cfg.enforce_cycles > 1000)
    return usage_error(app, "--enforce-cycles: expected 1 to 1000");
  LogLevel log_level;
  if (!parse_log_level(level, &log_level))
    return usage_error(app, "--log-level '"s + level + "': expected error|warn|info|debug");
  if (cfg.max_regions == 0) return usage_error(app, "--max-regions: expected at least 1");
  if (metrics != "full" && metrics != "basic")
    return usage_error(app, "--metrics '"s + metrics + "': expected full or basic");
  cfg.metrics_basic = metrics == "basic";
  if (backstop != "on" && backstop != "off")
    return usage_error(app, "--driver-backstop '"s + backstop + "': expected on or off");
  cfg.driver_backstop = backstop == "on";
  if (!cfg.hami_root.empty() && cfg.hami_root[0] != '/') {
    return usage_error(app,
                       "--hami-root '"s + cfg.hami_root + "': expected an absolute directory (e.g. /usr/local/vgpu)");
  }
  while (cfg.hami_root.size() > 1 && cfg.hami_root.back() == '/') cfg.hami_root.pop_back();
  set_log_level(log_level);
  cfg.use_nvml = !no_nvml;
  std::string host;
  int port = -1;
  if (listen != "off" && !once) {
    std::string why;
    if (!parse_listen(listen, &host, &port, &why)) return usage_error(app, "--listen '"s + listen + "': " + why);
  }

  // Termination signals are taken synchronously by the main loop; blocked
  // before any thread starts so that every thread inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a scraper that hangs up mid-response must not kill the agent
  raise_fd_limit();
  // Buffers of /metrics and the status page (megabytes at thousands of
  // regions) are mapped and given back when freed, instead of staying in a
  // thread's arena at their peak (docs/agent.md, "Scale").
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);

  Agent agent(cfg);
  agent.start();
  if (once) {
    agent.cycle();
    std::fputs(agent.metrics_text().c_str(), stdout);
    return 0;
  }
  HttpServer http(agent);
  if (port >= 0) {
    std::string why;
    if (!http.start(host, port, &why)) {
      log(LogLevel::error, "%s", why.c_str());
      return 1;
    }
    log(LogLevel::info, "serving /metrics and /healthz on %s:%d", host.c_str(), http.port());
  }
  log(LogLevel::info, "watching %s%s%s every %s (grace %s)", cfg.region_dir.c_str(),
      cfg.hami_root.empty() ? "" : " and HAMi's ", cfg.hami_root.c_str(), format_duration(cfg.interval_ns).c_str(),
      format_duration(cfg.grace_ns).c_str());
  std::uint64_t next = monotonic_ns();
  for (;;) {
    agent.cycle();
    http.sample_history();
    next += cfg.interval_ns;
    std::uint64_t now = monotonic_ns();
    if (next < now) next = now;  // overran: skip the missed cycles instead of bursting
    const std::uint64_t wait = next - now;
    timespec ts{static_cast<time_t>(wait / 1'000'000'000), static_cast<long>(wait % 1'000'000'000)};
    const int sig = sigtimedwait(&stop_signals, nullptr, &ts);
    if (sig == SIGINT || sig == SIGTERM) {
      log(LogLevel::info, "stopping (signal %d)", sig);
      break;
    }
  }
  http.stop();
  return 0;
}
