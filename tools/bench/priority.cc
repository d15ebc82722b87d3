#include "priority.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "barrier.h"
#include "driver_api.h"
#include "kernels.h"
#include "platform/clock.h"
#include "stats.h"

namespace gpuslice::bench {

namespace {

using nlohmann::json;

constexpr std::uint64_t kMs = 1'000'000;
constexpr std::uint64_t kBarrierTimeoutNs = 120ull * 1000 * kMs;
constexpr std::uint64_t kBarrierLeadNs = 20 * kMs;
// Reaction and release are found on the simulated timeline in steps of this
// much, at most kScanSteps steps from the event (each step is a timeline query).
constexpr std::uint64_t kScanStepNs = 250'000;
constexpr int kScanSteps = 40;
constexpr std::size_t kScanBursts = 40;

struct Shape {
  unsigned kernel_us = 200;  // inference kernels
  int kernels = 20;          // per burst
  int bursts = 200;
  std::uint64_t gap_min_ns = 5 * kMs;
  std::uint64_t gap_max_ns = 50 * kMs;
  unsigned training_us = 1000;        // the low tenant's kernels
  int training_depth = 16;            // ... and how many it keeps queued (natively)
  std::uint64_t lead_ns = 300 * kMs;  // the training tenant ramps up first
};

Shape shape(const Plan& plan) {
  Shape s;
  s.training_us = plan.training_us;
  if (plan.quick) {  // a few seconds in all: the CTest smoke test runs every section
    s.bursts = 15;
    s.lead_ns = 200 * kMs;
  }
  return s;
}

// --- worker side ---

struct BurstSession {
  explicit BurstSession(unsigned micros) : api(load_driver_api()) {
    GPUSLICE_BENCH_CHECK(api, api.cuInit(0));
    GPUSLICE_BENCH_CHECK(api, api.cuDeviceGet(&device, 0));
    GPUSLICE_BENCH_CHECK(api, api.cuDevicePrimaryCtxRetain(&ctx, device));
    GPUSLICE_BENCH_CHECK(api, api.cuCtxSetCurrent(ctx));
    GPUSLICE_BENCH_CHECK(api, api.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device));
    GPUSLICE_BENCH_CHECK(api, api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    const std::string ptx = kernels_ptx({micros});
    GPUSLICE_BENCH_CHECK(api, api.cuModuleLoadData(&module, ptx.c_str()));
    GPUSLICE_BENCH_CHECK(api, api.cuModuleGetFunction(&spin, module, spin_kernel_name(micros).c_str()));
    duration_ns = std::uint64_t{micros} * 1000;
  }
  ~BurstSession() {
    if (stream != nullptr) api.cuStreamDestroy(stream);
    if (module != nullptr) api.cuModuleUnload(module);
    if (ctx != nullptr) api.cuDevicePrimaryCtxRelease(device);
  }
  BurstSession(const BurstSession&) = delete;
  BurstSession& operator=(const BurstSession&) = delete;
  void launch() {
    void* params[] = {&duration_ns};
    GPUSLICE_BENCH_CHECK(
        api, api.cuLaunchKernel(spin, static_cast<unsigned>(sms), 1, 1, 128, 1, 1, 0, stream, params, nullptr));
  }
  DriverApi api;
  CUdevice device = 0;
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  CUmodule module = nullptr;
  CUfunction spin = nullptr;
  std::uint64_t duration_ns = 0;
  int sms = 0;
};

// Device time of every other process in [t0, t1) (simulated timeline).
std::uint64_t others_busy(const DriverApi& api, std::uint64_t t0, std::uint64_t t1) {
  const std::uint64_t all = api.fake_busy_ns(0, 0, t0, t1);
  const std::uint64_t own = api.fake_busy_ns(0, getpid(), t0, t1);
  return all > own ? all - own : 0;
}

json quantiles_ms(const std::vector<double>& ns) {
  if (ns.empty()) return json{{"n", 0}};
  return json{{"n", ns.size()},
              {"p50_ms", quantile(ns, 0.5) / 1e6},
              {"p90_ms", quantile(ns, 0.9) / 1e6},
              {"p99_ms", quantile(ns, 0.99) / 1e6},
              {"max_ms", *std::max_element(ns.begin(), ns.end()) / 1e6}};
}

}  // namespace

// Bursts of `kernels` launches of kernel_us, each followed by a stream
// synchronize, separated by random idle gaps (uniform in [gap_min, gap_max],
// fixed seed: every case sees the same gaps). Latency = first launch to the
// synchronize's return. On the simulated driver, with `neighbour`, also reads
// the timeline: the neighbours' share of the device in the gaps (harvest),
// how long after a burst's first launch they still ran (reaction) and how
// long after a burst's end they started again (release).
json run_burst_worker(const json& spec) {
  BurstSession s(spec.value<unsigned>("kernel_us", 200));
  const int kernels = spec.value("kernels", 20);
  const int bursts = spec.value("bursts", 100);
  const auto gap_min = spec.value<std::uint64_t>("gap_min_ns", 5 * kMs);
  const auto gap_max = spec.value<std::uint64_t>("gap_max_ns", 50 * kMs);
  const bool neighbour = spec.value("neighbour", false);
  // Warm-up outside the measurement.
  s.launch();
  GPUSLICE_BENCH_CHECK(s.api, s.api.cuStreamSynchronize(s.stream));
  std::uint64_t start = platform::monotonic_ns();
  if (spec.contains("barrier")) {
    const json& b = spec["barrier"];
    start = barrier_arrive_and_wait(b.at("dir").get<std::string>(), b.at("index").get<int>(), kBarrierTimeoutNs);
  }
  platform::sleep_until_ns(start + spec.value<std::uint64_t>("lead_ns", 0));
  std::mt19937_64 rng(spec.value<std::uint64_t>("seed", 42));
  std::uniform_int_distribution<std::uint64_t> gap(gap_min, gap_max);
  std::vector<double> latency, device_latency;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> busy_spans;  // [first launch, sync return)
  // Device-side latency: from an event recorded before the first launch to one
  // after the last. On the simulated driver both are exact simulated instants
  // (the first completes at its record: the stream is idle), so this leaves
  // out the host's wake-up from the synchronize, which dominates the p99 on a
  // loaded machine. (On a GPU the first event's timestamp may itself wait for
  // the context's time slice: there it is not the burst's latency.)
  CUevent begin = nullptr, end = nullptr;
  GPUSLICE_BENCH_CHECK(s.api, s.api.cuEventCreate(&begin, CU_EVENT_DEFAULT));
  GPUSLICE_BENCH_CHECK(s.api, s.api.cuEventCreate(&end, CU_EVENT_DEFAULT));
  for (int b = 0; b < bursts; ++b) {
    const std::uint64_t t0 = platform::monotonic_ns();
    GPUSLICE_BENCH_CHECK(s.api, s.api.cuEventRecord(begin, s.stream));
    for (int k = 0; k < kernels; ++k) s.launch();
    GPUSLICE_BENCH_CHECK(s.api, s.api.cuEventRecord(end, s.stream));
    GPUSLICE_BENCH_CHECK(s.api, s.api.cuStreamSynchronize(s.stream));
    const std::uint64_t t1 = platform::monotonic_ns();
    latency.push_back(static_cast<double>(t1 - t0));
    float ms = 0;
    GPUSLICE_BENCH_CHECK(s.api, s.api.cuEventElapsedTime(&ms, begin, end));
    device_latency.push_back(static_cast<double>(ms) * 1e6);
    busy_spans.emplace_back(t0, t1);
    platform::sleep_ns(gap(rng));
  }
  s.api.cuEventDestroy(begin);
  s.api.cuEventDestroy(end);
  // Every burst's latency in ms (in burst order, rounded to the ns): the
  // CDF that --plots draws.
  auto samples_ms = [](const std::vector<double>& ns) {
    json a = json::array();
    for (double v : ns) a.push_back(std::round(v) / 1e6);
    return a;
  };
  json out{{"latency", quantiles_ms(latency)},
           {"device_latency", quantiles_ms(device_latency)},
           {"latency_samples_ms", samples_ms(latency)},
           {"device_latency_samples_ms", samples_ms(device_latency)},
           {"alone_ideal_ms", static_cast<double>(kernels) * static_cast<double>(s.duration_ns) / 1e6},
           {"pid", getpid()}};
  if (!neighbour || !s.api.simulated()) return out;
  // Harvest: the neighbours' device time inside the gaps.
  double gap_total = 0, gap_used = 0;
  for (std::size_t i = 0; i + 1 < busy_spans.size(); ++i) {
    const std::uint64_t a = busy_spans[i].second, b = busy_spans[i + 1].first;
    gap_total += static_cast<double>(b - a);
    gap_used += static_cast<double>(others_busy(s.api, a, b));
  }
  out["harvest"] = gap_total > 0 ? gap_used / gap_total : 0.0;
  std::vector<double> reaction, release;
  for (std::size_t i = 0; i + 1 < busy_spans.size() && i < kScanBursts; ++i) {
    const auto [t0, t1] = busy_spans[i];
    // Reaction: the first step after the burst's first launch in which no
    // neighbour ran (they had been held and their queue had drained).
    for (int k = 0; k < kScanSteps && t0 + k * kScanStepNs < t1; ++k) {
      const std::uint64_t a = t0 + k * kScanStepNs;
      if (others_busy(s.api, a, a + kScanStepNs) == 0) {
        reaction.push_back(static_cast<double>(k * kScanStepNs));
        break;
      }
    }
    // Release: the first step after the burst's end in which a neighbour ran.
    const std::uint64_t next = busy_spans[i + 1].first;
    for (int k = 0; k < kScanSteps && t1 + k * kScanStepNs < next; ++k) {
      const std::uint64_t a = t1 + k * kScanStepNs;
      if (others_busy(s.api, a, a + kScanStepNs) != 0) {
        release.push_back(static_cast<double>(k * kScanStepNs));
        break;
      }
    }
  }
  out["reaction"] = quantiles_ms(reaction);
  out["release"] = quantiles_ms(release);
  out["reaction_scanned"] = std::min(busy_spans.size(), kScanBursts);
  return out;
}

namespace {

// --- orchestrator side ---

bool ok(const json& r) { return r.is_object() && !r.contains("error"); }

// Starts `specs` together (one barrier) and returns their results in order.
std::vector<json> together(Workers& workers, std::vector<json> specs, const std::vector<WorkerEnv>& envs) {
  const std::string dir = workers.fresh_dir("barrier");
  std::vector<pid_t> pids;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    specs[i]["barrier"] = json{{"dir", dir}, {"index", i}};
    pids.push_back(workers.start(specs[i], envs[i]));
  }
  std::uint64_t start = 0;
  if (!barrier_release(dir, static_cast<int>(pids.size()), pids, kBarrierLeadNs, kBarrierTimeoutNs, &start)) {
    for (pid_t pid : pids) kill(pid, SIGTERM);
  }
  std::vector<json> results;
  for (pid_t pid : pids) results.push_back(workers.finish(pid));
  return results;
}

json burst_spec(const Shape& s, bool neighbour) {
  return json{{"task", "burst"},      {"kernel_us", s.kernel_us},   {"kernels", s.kernels},
              {"bursts", s.bursts},   {"gap_min_ns", s.gap_min_ns}, {"gap_max_ns", s.gap_max_ns},
              {"lead_ns", s.lead_ns}, {"neighbour", neighbour},     {"seed", 42}};
}

// The training tenant: the bench's spin worker, deep queue, for longer than
// the bursts can take.
json training_spec(const Shape& s) {
  const std::uint64_t run_ns =
      s.lead_ns + static_cast<std::uint64_t>(s.bursts) * (s.gap_max_ns + 2 * s.kernels * s.kernel_us * 1000ull) +
      500 * kMs;
  return json{{"task", "spin"},
              {"kernel_us", s.training_us},
              {"depth", s.training_depth},
              {"run_ns", run_ns},
              {"windows", json::array({json::array({s.lead_ns, run_ns})})}};
}

WorkerEnv env_for(Workers& workers, const std::string& device, const std::string& board, const char* priority) {
  if (priority == nullptr) return WorkerEnv{false, {{"FAKECUDA_STATE", device}}};
  return WorkerEnv{true,
                   {{"FAKECUDA_STATE", device},
                    {"GPUSLICE_REGION", workers.fresh_path("gpuslice.region")},
                    {"GPUSLICE_PRIORITY", priority},
                    {"GPUSLICE_PRIORITY_BOARD", board}}};
}

json with_neighbour(Workers& workers, const Shape& s, bool gpuslice) {
  const std::string device = workers.fresh_path("fakecuda.state");
  const std::string board = workers.fresh_dir("priority-board");
  const auto r = together(workers, {training_spec(s), burst_spec(s, true)},
                          {env_for(workers, device, board, gpuslice ? "low" : nullptr),
                           env_for(workers, device, board, gpuslice ? "high" : nullptr)});
  if (!ok(r[0])) return json{{"error", r[0].value("error", std::string("training tenant failed"))}};
  if (!ok(r[1])) return json{{"error", r[1].value("error", std::string("inference tenant failed"))}};
  json out = r[1];
  out["training_share"] = r[0]["windows"][0]["share"];
  return out;
}

}  // namespace

int priority_steps(const Plan& plan) { return plan.sections.count("priority") ? 4 : 0; }

json measure_priority(Workers& workers, const Plan& plan, Progress& progress) {
  const Shape s = shape(plan);
  json out{{"inference", json{{"kernel_us", s.kernel_us},
                              {"kernels_per_burst", s.kernels},
                              {"bursts", s.bursts},
                              {"gap_ms", json::array({s.gap_min_ns / kMs, s.gap_max_ns / kMs})}}},
           {"training", json{{"kernel_us", s.training_us}, {"queued_kernels", s.training_depth}}}};
  const std::string board = workers.fresh_dir("priority-board");
  progress.step("priority: inference bursts alone, native");
  out["alone_native"] =
      workers.run(burst_spec(s, false), env_for(workers, workers.fresh_path("fakecuda.state"), board, nullptr));
  progress.step("priority: inference bursts alone, gpuslice (GPUSLICE_PRIORITY=high)");
  out["alone_gpuslice"] =
      workers.run(burst_spec(s, false), env_for(workers, workers.fresh_path("fakecuda.state"), board, "high"));
  progress.step("priority: inference next to a saturating training tenant, native");
  out["neighbour_native"] = with_neighbour(workers, s, false);
  progress.step("priority: inference (high) next to training (low), gpuslice");
  out["neighbour_gpuslice"] = with_neighbour(workers, s, true);
  auto p99 = [&](const char* key) -> double {
    const json& r = out[key];
    return ok(r) && r.contains("latency") ? r["latency"].value("p99_ms", 0.0) : 0.0;
  };
  if (p99("alone_native") > 0) {
    out["p99_ratio_native"] = p99("neighbour_native") / p99("alone_native");
    out["p99_ratio_gpuslice"] = p99("neighbour_gpuslice") / p99("alone_native");
  }
  auto device_p99 = [&](const char* key) -> double {
    const json& r = out[key];
    return ok(r) && r.contains("device_latency") ? r["device_latency"].value("p99_ms", 0.0) : 0.0;
  };
  if (device_p99("alone_native") > 0) {
    out["device_p99_ratio_native"] = device_p99("neighbour_native") / device_p99("alone_native");
    out["device_p99_ratio_gpuslice"] = device_p99("neighbour_gpuslice") / device_p99("alone_native");
  }
  return out;
}

void print_priority_table(const json& report, std::FILE* out) {
  if (!report.contains("priority")) return;
  const json& p = report["priority"];
  const bool simulated = report.value("device", std::string()) == "simulated";
  std::fprintf(out,
               "\nPriority (%s): inference = %d x %d us kernels per burst then synchronize, %s ms idle gaps;\n"
               "training = %d us kernels, %d queued natively\n",
               simulated ? "SIMULATED driver" : "GPU", p["inference"]["kernels_per_burst"].get<int>(),
               p["inference"]["kernel_us"].get<int>(), p["inference"]["gap_ms"].dump().c_str(),
               p["training"]["kernel_us"].get<int>(), p["training"]["queued_kernels"].get<int>());
  std::fprintf(out, "  %-34s %9s %9s %9s %9s %9s %13s %13s\n", "case", "p50 ms", "p90 ms", "p99 ms", "harvest", "train",
               "reaction p50/99", "release p50/99");
  for (const char* key : {"alone_native", "alone_gpuslice", "neighbour_native", "neighbour_gpuslice"}) {
    if (!p.contains(key)) continue;
    const json& r = p[key];
    if (!ok(r)) {
      std::fprintf(out, "  %-34s error: %s\n", key, r.value("error", std::string("?")).c_str());
      continue;
    }
    char harvest[16] = "-", train[16] = "-", reaction[32] = "-", release[32] = "-";
    if (r.contains("harvest")) std::snprintf(harvest, sizeof harvest, "%.1f%%", 100 * r["harvest"].get<double>());
    if (r.contains("training_share"))
      std::snprintf(train, sizeof train, "%.1f%%", 100 * r["training_share"].get<double>());
    auto pair = [](const json& q, char* buf, std::size_t cap) {
      if (q.value("n", 0) > 0)
        std::snprintf(buf, cap, "%.2f/%.2f", q["p50_ms"].get<double>(), q["p99_ms"].get<double>());
    };
    if (r.contains("reaction")) pair(r["reaction"], reaction, sizeof reaction);
    if (r.contains("release")) pair(r["release"], release, sizeof release);
    std::fprintf(out, "  %-34s %9.2f %9.2f %9.2f %9s %9s %15s %14s\n", key, r["latency"]["p50_ms"].get<double>(),
                 r["latency"].value("p90_ms", 0.0), r["latency"]["p99_ms"].get<double>(), harvest, train, reaction,
                 release);
  }
  if (p.contains("p99_ratio_native"))
    std::fprintf(out, "  p99 next to training / p99 alone (native): native %.2fx, gpuslice %.2fx\n",
                 p["p99_ratio_native"].get<double>(), p["p99_ratio_gpuslice"].get<double>());
  if (p.contains("device_p99_ratio_native"))
    std::fprintf(out, "  device-side (events) p99 alone %.2f ms; next to training: native %.2fx, gpuslice %.2fx%s\n",
                 p["alone_native"]["device_latency"].value("p99_ms", 0.0), p["device_p99_ratio_native"].get<double>(),
                 p["device_p99_ratio_gpuslice"].get<double>(), simulated ? "" : " (GPU: see the source)");
}

}  // namespace gpuslice::bench
