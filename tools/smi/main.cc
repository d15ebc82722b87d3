// gpuslice-smi: see smi.h and docs/agent.md.
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <optional>

#include "cli.h"
#include "region_io.h"
#include "smi.h"
#include "units.h"

using namespace std::string_literals;

using namespace gpuslice::smi;
using gpuslice::tools::usage_error;

namespace {

// "2", "0.5" (seconds, like nvidia-smi -l) or a duration ("500ms", "2s").
bool parse_interval(const std::string& text, std::uint64_t* ns) {
  if (gpuslice::agent::parse_duration(text, ns)) return *ns > 0;
  return gpuslice::agent::parse_duration(text + "s", ns) && *ns > 0;
}

volatile sig_atomic_t g_stop = 0;
void on_stop(int) { g_stop = 1; }

int show(const std::string& region, const std::string& region_dir, bool json, bool watch, std::uint64_t interval_ns,
         long count) {
  const bool tty = isatty(STDOUT_FILENO) != 0;
  if (watch) {
    struct sigaction sa {};
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
  }
  for (long round = 0; !g_stop; ++round) {
    Snapshot snap;
    std::string error;
    std::vector<std::string> skipped;
    if (!region_dir.empty()) {
      if (!read_region_dir(region_dir, &snap.regions, &skipped, &error)) {
        std::fprintf(stderr, "%s\n", error.c_str());
        return kExitNoRegion;
      }
    } else {
      Shown one;
      if (!read_region(region, &one, &error)) {
        std::fprintf(stderr, "%s\n", error.c_str());
        return kExitNoRegion;
      }
      snap.regions.push_back(std::move(one));
    }
    snap.now_ns = gpuslice::agent::monotonic_ns();
    if (round == 0 || !watch) {
      for (const std::string& s : skipped) std::fprintf(stderr, "%s\n", s.c_str());
    }
    std::string text = json ? render_json(snap) : render_table(snap);
    if (watch && tty && !json)
      text = "\033[H\033[2J"s + text;  // redraw in place
    else if (watch && round > 0 && !json)
      text = "\n"s + text;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    if (!watch || (count > 0 && round + 1 >= count)) break;
    timespec ts{static_cast<time_t>(interval_ns / 1'000'000'000), static_cast<long>(interval_ns % 1'000'000'000)};
    while (!g_stop && nanosleep(&ts, &ts) != 0) {}
  }
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "gpuslice-smi: what gpuslice regions hold (memory quota and use, SM limit and measured utilisation, "
      "processes) and run-time changes to a container's limits.\n"
      "Without --region/--region-dir it shows this container's region: $GPUSLICE_REGION, else the default "
      "path. Exit status: 0 ok, 1 failed, 2 missing or invalid region, 64 usage error.",
      "gpuslice-smi"};
  gpuslice::tools::add_version_flag(app);
  std::string region, region_dir, watch_value;
  bool json = false;
  long count = 0;
  app.add_option("--region", region, "Region file to show (default: $GPUSLICE_REGION, else /dev/shm/gpuslice.region)");
  app.add_option("--region-dir", region_dir, "Show every region below this directory (the node's view)");
  app.add_flag("--json", json, "One JSON document (per refresh) instead of the table");
  CLI::Option* watch =
      app.add_option("--watch", watch_value, "Refresh every INTERVAL (seconds or e.g. 500ms; default 1s)")
          ->expected(0, 1)
          ->option_text("[INTERVAL]");
  app.add_option("--count", count, "With --watch: stop after this many refreshes");

  SetRequest set;
  CLI::App* set_cmd = app.add_subcommand("set", "Change a running container's limits through its region");
  set_cmd->add_option("--region", set.region, "Region file (default: $GPUSLICE_REGION, else the default path)");
  set_cmd->add_option("--device", set.device,
                      "Device entry number (as in --json) or UUID; default: every device in use");
  set_cmd->add_option("--memory", set.memory, "Memory quota: size (8Gi, 500M, ...) or 'unlimited'");
  set_cmd->add_option("--sm-limit", set.sm_limit, "Compute share 1-100 (%) or 'unlimited'");
  set_cmd->add_option("--sm-policy", set.policy, "hard | elastic");
  set_cmd->add_option("--priority", set.priority, "high | normal | low (the whole container; docs/priority.md)");

  bool options_json = false, options_markdown = false;
  CLI::App* options_cmd = app.add_subcommand("options", "List every environment option with its default and doc");
  options_cmd->add_flag("--json", options_json, "As JSON");
  options_cmd->add_flag("--markdown", options_markdown, "As the README's Markdown table");
  app.require_subcommand(0, 1);

  if (const std::optional<int> stop = gpuslice::tools::parse(app, argc, argv)) return *stop;

  if (*options_cmd) {
    const std::string text = options_json       ? render_options_json()
                             : options_markdown ? render_options_markdown()
                                                : render_options_text();
    std::fwrite(text.data(), 1, text.size(), stdout);
    return kExitOk;
  }
  if (*set_cmd) {
    if (set.region.empty()) set.region = default_region_path();
    return run_set(set);
  }
  if (!region.empty() && !region_dir.empty()) return usage_error(app, "--region and --region-dir exclude each other");
  std::uint64_t interval_ns = 1'000'000'000;
  const bool watching = watch->count() > 0;
  if (watching && !watch_value.empty() && !parse_interval(watch_value, &interval_ns)) {
    return usage_error(app,
                       "--watch '"s + watch_value + "': expected seconds (e.g. 2, 0.5) or a duration (e.g. 500ms)");
  }
  if (count < 0) return usage_error(app, "--count: expected a positive number");
  if (region.empty() && region_dir.empty()) region = default_region_path();
  return show(region, region_dir, json, watching, interval_ns, count);
}
