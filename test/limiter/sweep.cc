// gpuslice-limiter-sweep: the compute limiter's accuracy on the SIMULATED
// driver (test/fakecuda), the figures recorded in docs/limiter.md. Each case
// runs spinload processes under libgpuslice.so on a fresh simulated machine
// and reads the device time each container got from the simulated timeline.
//
//   gpuslice-limiter-sweep [--seconds W] [--only SUBSTRING]
//
// Prints a Markdown table: case, launch path, kernel, target, achieved.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "scenarios.h"

using namespace gpuslice::test;
using namespace gpuslice::test::limiter;

namespace {

double g_window = 5.0;
const char* g_only = nullptr;
int g_failures = 0;
std::vector<std::string> g_notes;  // printed after the table

bool wanted(const std::string& name) { return g_only == nullptr || name.find(g_only) != std::string::npos; }

void row_ok(const std::string& name, const std::string& path, const std::string& kernel, const std::string& target,
            double achieved, bool ok) {
  if (!ok) ++g_failures;
  std::printf("| %s | %s | %s | %s | %.1f | %s |\n", name.c_str(), path.c_str(), kernel.c_str(), target.c_str(),
              achieved, ok ? "ok" : "OUT");
  std::fflush(stdout);
}

void row(const std::string& name, const std::string& path, const std::string& kernel, const std::string& target,
         double achieved, double tolerance, double target_value) {
  row_ok(name, path, kernel, target, achieved,
         achieved >= target_value - tolerance && achieved <= target_value + tolerance);
}

bool check_ran(const std::vector<ContainerResult>& results) {
  for (const auto& c : results)
    for (const auto& p : c.procs)
      if (p.result.exit_code != 0 || p.start_ns == 0) {
        std::fprintf(stderr, "sweep: a load process failed:\n%s\n", c.describe().c_str());
        ++g_failures;
        return false;
      }
  return true;
}

// One container of `procs` spinload processes at `limit`, measured over the window.
void single(const std::string& name, const std::string& path, const std::string& via, unsigned kernel_us,
            unsigned limit, unsigned procs = 1, std::vector<std::string> extra = {}) {
  if (!wanted(name)) return;
  Machine m;
  Container c{"c", std::to_string(limit), "", {}, {}};
  auto args = spin(path, kernel_us, g_window + 0.3, via);
  args.insert(args.end(), extra.begin(), extra.end());
  for (unsigned i = 0; i < procs; ++i) c.procs.push_back(Proc{args, 0});
  auto results = m.run({c});
  if (!check_ran(results)) return;
  const std::uint64_t t0 = results[0].first_start();
  const std::uint64_t t1 = t0 + static_cast<std::uint64_t>(g_window * 1e9);
  std::string kernel = std::to_string(kernel_us) + " us";
  if (path.rfind("graph", 0) == 0) kernel = "graph of 10 x " + kernel;
  row(name, path + (via == "procaddr" ? " (cuGetProcAddress)" : ""), kernel,
      std::to_string(limit) + (procs > 1 ? " (" + std::to_string(procs) + " processes)" : ""),
      m.share(results[0], t0, t1), 2.0, limit);
}

void pair(const std::string& name, const std::string& limit_a, const std::string& limit_b, unsigned kernel_us) {
  if (!wanted(name)) return;
  Machine m;
  Container a{"a", limit_a, "", {Proc{spin("kernel", kernel_us, g_window + 0.3), 0}}, {}};
  Container b{"b", limit_b, "", {Proc{spin("kernel", kernel_us, g_window + 0.3), 0}}, {}};
  auto results = m.run({a, b});
  if (!check_ran(results)) return;
  const std::uint64_t t0 = std::max(results[0].first_start(), results[1].first_start());
  const std::uint64_t t1 = t0 + static_cast<std::uint64_t>(g_window * 1e9);
  const double sa = m.share(results[0], t0, t1), sb = m.share(results[1], t0, t1);
  const std::string kernel = std::to_string(kernel_us) + " us";
  row(name + " / a", "kernel", kernel, limit_a, sa, 3.0, std::stod(limit_a));
  if (limit_b.empty())
    row(name + " / b (unlimited: the rest)", "kernel", kernel, "100 - a", sb, 3.0, 100.0 - sa);
  else
    row(name + " / b", "kernel", kernel, limit_b, sb, 3.0, std::stod(limit_b));
}

// Elastic: a 30% elastic container alone, then a second (unlimited) container
// joins. Reports the share alone, the time until the first one is back at
// <= 33% (every 100 ms window after it), and its share afterwards.
void elastic(const std::string& name, const std::string& other_limit) {
  if (!wanted(name)) return;
  Machine m;
  const double alone = 3.0, together = 3.0;
  Container a{"a", "30", "elastic", {Proc{spin("kernel", 1000, alone + together + 0.3), 0}}, {}};
  Container b{"b", other_limit, "", {Proc{spin("kernel", 1000, together + 0.3), alone}}, {}};
  auto results = m.run({a, b});
  if (!check_ran(results)) return;
  const std::uint64_t ta = results[0].first_start(), tb = results[1].first_start();
  const double s_alone = m.share(results[0], ta + 1'000'000'000, tb);
  row_ok(name + " / alone (after 1 s)", "kernel", "1000 us", "30 elastic: > 90", s_alone, s_alone > 90.0);
  // Settling time: last 100 ms window above 33% after the second one started.
  // Settling time: end of the last 250 ms window (sliding by 50 ms) in which
  // the first container was above 33% after the second one started.
  std::uint64_t settle = 0;
  const std::uint64_t step = 100'000'000, width = 250'000'000, slide = 50'000'000;
  for (std::uint64_t t = tb; t + width <= tb + static_cast<std::uint64_t>(together * 1e9); t += slide)
    if (m.share(results[0], t, t + width) > 33.0) settle = t + width - tb;
  std::string series;
  for (std::uint64_t t = tb - 5 * step; t + step <= tb + static_cast<std::uint64_t>(together * 1e9); t += step)
    series += (t == tb ? " |" : " ") + std::to_string(static_cast<int>(m.share(results[0], t, t + step) + 0.5));
  g_notes.push_back(name + ": the first container's share per 100 ms (| = the second one starts):" + series);
  const double s_after = m.share(results[0], tb + 1'000'000'000, tb + static_cast<std::uint64_t>(together * 1e9));
  row(name + " / with a second container (its share 1 s on)", "kernel", "1000 us", "30 (<= 33)", s_after, 3.0, 30.0);
  std::printf("| %s / time back to <= 33%% (250 ms windows) | kernel | 1000 us | < 1000 ms | %.0f ms | %s |\n",
              name.c_str(), static_cast<double>(settle) / 1e6, settle < 1'000'000'000 ? "ok" : "OUT");
  if (settle >= 1'000'000'000) ++g_failures;
  const double sb = m.share(results[1], tb + 1'000'000'000, tb + static_cast<std::uint64_t>(together * 1e9));
  std::printf("| %s / the second container | kernel | 1000 us | %s | %.1f | info |\n", name.c_str(),
              other_limit.empty() ? "unlimited" : other_limit.c_str(), sb);
  std::fflush(stdout);
}

// A client that never waits for its work: the queue bound must hold its queue
// (and so its share) however fast it launches.
void deep_queue(const std::string& name, unsigned limit) {
  if (!wanted(name)) return;
  Machine m;
  Container c{"c", std::to_string(limit), "", {Proc{spin("kernel", 1000, g_window + 0.3, "symbol", 0), 0}}, {}};
  auto results = m.run({c});
  if (!check_ran(results)) return;
  const std::uint64_t t0 = results[0].first_start();
  const std::uint64_t t1 = t0 + static_cast<std::uint64_t>(g_window * 1e9);
  row(name, "kernel, never synchronises", "1000 us", std::to_string(limit), m.share(results[0], t0, t1), 2.0, limit);
  // Work still queued when it stopped launching = what ran after its last launch.
  const std::uint64_t end = results[0].procs[0].end_ns;
  const double tail_ms = static_cast<double>(m.busy_ns(end, end + 10'000'000'000ull)) / 1e6;
  std::printf("| %s / work queued at exit | kernel | 1000 us | bounded | %.1f ms | %s |\n", name.c_str(), tail_ms,
              tail_ms < 100 ? "ok" : "OUT");
  if (tail_ms >= 100) ++g_failures;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
      g_window = std::atof(argv[++i]);
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      g_only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: gpuslice-limiter-sweep [--seconds W] [--only SUBSTRING]\n");
      return 2;
    }
  }
  std::printf(
      "Simulated driver (test/fakecuda), not a GPU. Window %.1f s from the first launch; achieved = "
      "device time on the simulated timeline / window.\n\n",
      g_window);
  std::printf(
      "| case | launch path | kernel | target %% | achieved %% | within tolerance |\n|---|---|---|---|---|---|\n");
  for (unsigned limit : {10u, 25u, 50u, 75u, 90u})
    single("1000us-" + std::to_string(limit), "kernel", "symbol", 1000, limit);
  for (unsigned limit : {10u, 25u, 50u, 75u, 90u})
    single("20us-" + std::to_string(limit), "kernel", "symbol", 20, limit);
  for (unsigned limit : {10u, 25u, 50u, 75u, 90u}) single("ex-" + std::to_string(limit), "ex", "symbol", 1000, limit);
  for (unsigned limit : {10u, 25u, 50u, 75u, 90u})
    single("graph-" + std::to_string(limit), "graph", "symbol", 100, limit);
  single("4procs-40", "kernel", "symbol", 1000, 40, 4);
  single("ptsz-50", "kernel_ptsz", "symbol", 1000, 50);
  single("ex_ptsz-50", "ex_ptsz", "symbol", 1000, 50);
  single("coop-50", "coop", "symbol", 1000, 50);
  single("coop_ptsz-50", "coop_ptsz", "procaddr", 1000, 50);
  single("procaddr-50", "kernel", "procaddr", 1000, 50);
  single("graph_ptsz-50", "graph_ptsz", "procaddr", 100, 50);
  single("4threads-40", "kernel", "symbol", 200, 40, 1, {"--threads", "4"});
  pair("30+70", "30", "70", 1000);
  pair("30+unlimited", "30", "", 1000);
  elastic("elastic", "");
  deep_queue("deep-queue-30", 30);
  for (const std::string& note : g_notes) std::printf("\n%s\n", note.c_str());
  std::printf("\n%d case(s) out of tolerance\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
