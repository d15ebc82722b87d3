#include "scenarios.h"

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "barrier.h"
#include "stats.h"

namespace gpuslice::bench {

namespace {

using nlohmann::json;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::uint64_t kBarrierTimeoutNs = 120ull * 1000 * 1000 * 1000;
constexpr std::uint64_t kBarrierLeadNs = 20ull * 1000 * 1000;
// A compute-limit point is "ok" within this many percentage points of its target (issue 10: none worse than 3).
constexpr double kTolerancePoints = 3.0;
// The share over time (report "timeline", docs/benchmarks.md "Plots") in bins of this much.
constexpr std::uint64_t kTimelineBinNs = 50'000'000;

std::uint64_t ns(double seconds) { return static_cast<std::uint64_t>(seconds * 1e9); }

// One simulated device per scenario (a fresh FAKECUDA_STATE file): a run never
// sees another's kernels or allocations. Ignored by a real driver.
std::string fresh_device(Workers& workers) { return workers.fresh_path("fakecuda.state"); }

WorkerEnv native(const std::string& device) { return WorkerEnv{false, {{"FAKECUDA_STATE", device}}}; }

// A container: its own region, and the options given.
WorkerEnv container(Workers& workers, const std::string& device, std::map<std::string, std::string> options = {}) {
  options["FAKECUDA_STATE"] = device;
  options["GPUSLICE_REGION"] = workers.fresh_path("gpuslice.region");
  return WorkerEnv{true, std::move(options)};
}

bool ok(const json& result) { return result.is_object() && !result.contains("error"); }

// Each process keeps plan.queue_ms of work queued (at least 4 kernels): a load
// process descheduled for a while on a busy machine must not leave the device
// idle, or what is measured is the host, not the limiter. At most 256 kernels
// (2 events each): under the 1024 launches a stream's queue holds.
json spin_spec(const Plan& plan, std::uint64_t run_ns, const std::vector<std::vector<std::uint64_t>>& windows) {
  const double kernels = plan.queue_ms * 1000.0 / plan.kernel_us;
  const int depth = std::clamp(static_cast<int>(std::ceil(kernels)), 4, 256);
  return json{{"task", "spin"},   {"kernel_us", plan.kernel_us}, {"depth", depth},          {"streams", plan.streams},
              {"run_ns", run_ns}, {"windows", windows},          {"bin_ns", kTimelineBinNs}};
}

double window_share(const json& result, std::size_t window) {
  return result.at("windows").at(window).at("share").get<double>();
}

// Runs tenants together (one barrier), each a container of plan.procs
// processes running its spec; per tenant, its processes' results added up
// (shares, launches), or the first error.
std::vector<json> run_tenants(Workers& workers, const Plan& plan, const std::vector<json>& specs,
                              const std::vector<WorkerEnv>& envs) {
  std::vector<json> all_specs;
  std::vector<WorkerEnv> all_envs;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    for (int p = 0; p < plan.procs; ++p) {
      all_specs.push_back(specs[t]);
      all_envs.push_back(envs[t]);
    }
  }
  const std::vector<json> results = run_together(workers, all_specs, all_envs);
  std::vector<json> merged;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    json sum;
    for (int p = 0; p < plan.procs; ++p) {
      const json& r = results[t * static_cast<std::size_t>(plan.procs) + static_cast<std::size_t>(p)];
      if (!ok(r)) {
        sum = r;
        break;
      }
      if (p == 0) {
        sum = r;
        continue;
      }
      for (std::size_t w = 0; w < sum["windows"].size(); ++w) {
        json& win = sum["windows"][w];
        win["busy_ns"] = win["busy_ns"].get<double>() + r["windows"][w]["busy_ns"].get<double>();
        win["share"] = win["share"].get<double>() + r["windows"][w]["share"].get<double>();
      }
      if (sum.contains("timeline") && r.contains("timeline")) {
        json& bins = sum["timeline"]["shares"];
        for (std::size_t b = 0; b < bins.size() && b < r["timeline"]["shares"].size(); ++b) {
          bins[b] = bins[b].get<double>() + r["timeline"]["shares"][b].get<double>();
        }
      }
      sum["launched"] = sum["launched"].get<std::uint64_t>() + r["launched"].get<std::uint64_t>();
      sum["in_launch_ns"] = sum["in_launch_ns"].get<std::uint64_t>() + r["in_launch_ns"].get<std::uint64_t>();
    }
    merged.push_back(sum);
  }
  return merged;
}

std::string verdict(double share, int limit, double unlimited_share) {
  const double error_points = share * 100.0 - limit;
  if (std::fabs(error_points) <= kTolerancePoints) return "ok";
  // Nothing held it back: it got what it gets without a limit.
  if (unlimited_share > 0 && share >= 0.9 * unlimited_share) return "not enforced";
  return error_points > 0 ? "over" : "under";
}

}  // namespace

std::vector<json> run_together(Workers& workers, std::vector<json> specs, const std::vector<WorkerEnv>& envs) {
  const std::string dir = workers.fresh_dir("barrier");
  std::vector<pid_t> pids;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    specs[i]["barrier"] = json{{"dir", dir}, {"index", i}};
    pids.push_back(workers.start(specs[i], envs[i]));
  }
  std::uint64_t start = 0;
  const bool released =
      barrier_release(dir, static_cast<int>(pids.size()), pids, kBarrierLeadNs, kBarrierTimeoutNs, &start);
  if (!released) {
    // Someone died in set-up: let the others time out rather than measure alone.
    for (pid_t pid : pids) kill(pid, SIGTERM);
  }
  std::vector<json> results;
  for (pid_t pid : pids) results.push_back(workers.finish(pid));
  return results;
}

void Progress::step(const std::string& what) {
  ++done_;
  if (!quiet_) std::fprintf(stderr, "[%2d/%d] %s\n", done_, total_, what.c_str());
}

int plan_steps(const Plan& plan) {
  int steps = 0;
  if (plan.sections.count("launch")) steps += 3;
  if (plan.sections.count("memory")) steps += 2;
  if (plan.sections.count("quota")) steps += static_cast<int>(plan.quotas_mib.size()) + 1;
  if (plan.sections.count("sweep")) steps += static_cast<int>(plan.sweep_limits.size()) + 1;
  if (plan.sections.count("tenants")) steps += 2;
  if (plan.sections.count("noisy")) steps += 2;
  return steps;
}

json measure_launch(Workers& workers, const Plan& plan, Progress& progress) {
  const json spec{{"task", "launch"},
                  {"batches", plan.launch_batches},
                  {"batch", 100},
                  {"roundtrips", plan.launch_batches},
                  {"throughput_launches", plan.quick ? 20000 : 200000}};
  json out;
  progress.step("empty-kernel launches, native");
  out["native"] = workers.run(spec, native(fresh_device(workers)));
  progress.step("empty-kernel launches, gpuslice (no limit)");
  out["gpuslice"] = workers.run(spec, container(workers, fresh_device(workers)));
  // Empty kernels take no device time, so a 90% limit always has tokens: this
  // is the cost of the limiter's bookkeeping alone.
  progress.step("empty-kernel launches, gpuslice (GPUSLICE_SM_LIMIT=90)");
  out["gpuslice_sm_limit_90"] =
      workers.run(spec, container(workers, fresh_device(workers), {{"GPUSLICE_SM_LIMIT", "90"}}));
  return out;
}

json measure_memory(Workers& workers, const Plan& plan, Progress& progress) {
  const json spec{{"task", "memops"}, {"alloc_bytes", kMiB}, {"batches", plan.memory_batches}, {"batch", 50}};
  json out;
  progress.step("cuMemAlloc/cuMemFree/cuMemGetInfo, native");
  out["native"] = workers.run(spec, native(fresh_device(workers)));
  // With a quota, so that the quota's path (reserve, table, visible total) is measured.
  progress.step("cuMemAlloc/cuMemFree/cuMemGetInfo, gpuslice (GPUSLICE_MEMORY_LIMIT=8Gi)");
  out["gpuslice"] = workers.run(spec, container(workers, fresh_device(workers), {{"GPUSLICE_MEMORY_LIMIT", "8Gi"}}));
  out["quota"] = "8Gi";
  return out;
}

json measure_quota(Workers& workers, const Plan& plan, Progress& progress) {
  constexpr std::uint64_t kChunk = 2 * kMiB;
  constexpr std::uint64_t kMinChunk = 64 * 1024;
  json out;
  out["chunk_bytes"] = kChunk;
  out["min_chunk_bytes"] = kMinChunk;
  json single = json::array();
  for (std::uint64_t mib : plan.quotas_mib) {
    const std::uint64_t quota = mib * kMiB;
    progress.step("memory quota " + std::to_string(mib) + " MiB: allocate until out of memory");
    // The ceiling keeps an unenforced quota from filling a real GPU.
    const json spec{
        {"task", "quota"}, {"chunk", kChunk}, {"min_chunk", kMinChunk}, {"ceiling_bytes", 2 * quota + 64 * kMiB}};
    json r = workers.run(
        spec, container(workers, fresh_device(workers), {{"GPUSLICE_MEMORY_LIMIT", std::to_string(mib) + "Mi"}}));
    json row{{"quota_bytes", quota}};
    if (ok(r)) {
      const auto usable = r["usable_bytes"].get<std::uint64_t>();
      // What the container held before the fill (its context; a module's
      // globals and code) counts against the quota too.
      const auto held = r["total_seen"].get<std::uint64_t>() - r["free_before"].get<std::uint64_t>();
      row["usable_bytes"] = usable;
      row["held_before_bytes"] = held;
      row["accuracy"] = static_cast<double>(usable + held) / static_cast<double>(quota);
      row["over_quota_bytes"] = usable + held > quota ? usable + held - quota : 0;
      row["total_seen"] = r["total_seen"];
      row["free_before"] = r["free_before"];
      row["refusal"] = r["refusal"];
      row["allocations"] = r["allocations"];
    } else {
      row["error"] = r["error"];
    }
    single.push_back(row);
  }
  out["single"] = single;

  // Several processes of one container race for one quota at the same instant
  // and hold what they got until all are done: the sum must not exceed it.
  const std::uint64_t quota = plan.shared_quota_mib * kMiB;
  progress.step(std::to_string(plan.quota_processes) + " processes racing for one " +
                std::to_string(plan.shared_quota_mib) + " MiB quota");
  const std::uint64_t hold_ns = ns(plan.quick ? 1.0 : 3.0);
  const json spec{{"task", "quota"},
                  {"chunk", kChunk},
                  {"min_chunk", kMinChunk},
                  {"hold_ns", hold_ns},
                  {"ceiling_bytes", 2 * quota + 64 * kMiB}};
  const WorkerEnv env = container(workers, fresh_device(workers),
                                  {{"GPUSLICE_MEMORY_LIMIT", std::to_string(plan.shared_quota_mib) + "Mi"}});
  std::vector<json> results =
      run_together(workers, std::vector<json>(static_cast<std::size_t>(plan.quota_processes), spec),
                   std::vector<WorkerEnv>(static_cast<std::size_t>(plan.quota_processes), env));
  json shared{{"quota_bytes", quota}, {"processes", plan.quota_processes}};
  std::uint64_t total = 0;
  std::uint64_t held_at_refusal = 0;
  bool overlapped = true;
  json per_process = json::array();
  for (const json& r : results) {
    if (!ok(r)) {
      shared["error"] = r["error"];
      break;
    }
    total += r["usable_bytes"].get<std::uint64_t>();
    // What the whole container held when this process was refused (contexts
    // and modules included); the last one refused sees the quota filled.
    const auto held = r["total_at_oom"].get<std::uint64_t>() - r["free_at_oom"].get<std::uint64_t>();
    held_at_refusal = std::max(held_at_refusal, held);
    overlapped = overlapped && r["fill_ns"].get<std::uint64_t>() < hold_ns;
    per_process.push_back(r["usable_bytes"]);
  }
  if (!shared.contains("error")) {
    shared["usable_bytes"] = total;
    shared["per_process_bytes"] = per_process;
    shared["held_at_last_refusal_bytes"] = held_at_refusal;
    shared["accuracy"] = static_cast<double>(held_at_refusal) / static_cast<double>(quota);
    shared["over_quota_bytes"] = held_at_refusal > quota ? held_at_refusal - quota : 0;
    // If one process finished filling after another had already freed, the
    // sum does not test concurrency: say so.
    shared["all_held_at_once"] = overlapped;
  }
  out["shared"] = shared;
  return out;
}

json measure_sweep(Workers& workers, const Plan& plan, Progress& progress) {
  const std::uint64_t warmup = ns(plan.warmup_s);
  const std::uint64_t window = ns(plan.window_s);
  // Window 0: the steady state after the warm-up. Window 1: the first 250 ms,
  // where a limiter that starts from an estimate overshoots or stalls (what a
  // short job sees).
  const std::uint64_t startup = std::min<std::uint64_t>(ns(0.25), warmup + window);
  const json spec = spin_spec(plan, warmup + window, {{warmup, warmup + window}, {0, startup}});
  json out{{"kernel_us", plan.kernel_us},
           {"window_s", plan.window_s},
           {"warmup_s", plan.warmup_s},
           {"startup_window_s", static_cast<double>(startup) / 1e9},
           {"tolerance_points", kTolerancePoints}};

  out["processes"] = plan.procs;
  out["streams"] = plan.streams;
  out["queued_kernels"] = spec["depth"];
  progress.step("compute: native, no limit");
  json unlimited = run_tenants(workers, plan, {spec}, {native(fresh_device(workers))})[0];
  double unlimited_share = 0;
  if (ok(unlimited)) {
    unlimited_share = window_share(unlimited, 0);
    out["native_share"] = unlimited_share;
    out["native_startup_share"] = window_share(unlimited, 1);
    out["share_source"] = unlimited["share_source"];
    if (unlimited.contains("timeline")) out["native_timeline"] = unlimited["timeline"];
  } else {
    out["native_error"] = unlimited["error"];
  }
  json points = json::array();
  std::vector<double> abs_errors;
  for (int limit : plan.sweep_limits) {
    progress.step("compute: GPUSLICE_SM_LIMIT=" + std::to_string(limit));
    json r =
        run_tenants(workers, plan, {spec},
                    {container(workers, fresh_device(workers), {{"GPUSLICE_SM_LIMIT", std::to_string(limit)}})})[0];
    json point{{"limit", limit}};
    if (ok(r)) {
      const double share = window_share(r, 0);
      point["share"] = share;
      point["startup_share"] = window_share(r, 1);
      point["error_points"] = share * 100.0 - limit;
      point["verdict"] = verdict(share, limit, unlimited_share);
      point["launched"] = r["launched"];
      point["in_launch_s"] = r["in_launch_ns"].get<double>() / 1e9;
      if (r.contains("timeline")) point["timeline"] = r["timeline"];
      out["share_source"] = r["share_source"];
      abs_errors.push_back(std::fabs(share * 100.0 - limit));
    } else {
      point["error"] = r["error"];
    }
    points.push_back(point);
  }
  out["points"] = points;
  if (!abs_errors.empty()) {
    double sum = 0;
    for (double e : abs_errors) sum += e;
    out["mean_abs_error_points"] = sum / static_cast<double>(abs_errors.size());
    out["max_abs_error_points"] = *std::max_element(abs_errors.begin(), abs_errors.end());
  }
  return out;
}

json measure_tenants(Workers& workers, const Plan& plan, Progress& progress) {
  const std::uint64_t warmup = ns(plan.warmup_s);
  const std::uint64_t window = ns(plan.window_s * (plan.quick ? 1.0 : 1.5));
  const json spec = spin_spec(plan, warmup + window, {{warmup, warmup + window}});
  const std::vector<int> limits{plan.tenant_a_limit, plan.tenant_b_limit};
  json out{{"limits", limits}};

  progress.step("two tenants, native (no limits)");
  {
    const std::string device = fresh_device(workers);
    std::vector<json> r = run_tenants(workers, plan, {spec, spec}, {native(device), native(device)});
    if (ok(r[0]) && ok(r[1])) {
      std::vector<double> shares{window_share(r[0], 0), window_share(r[1], 0)};
      out["native"] = json{{"shares", shares}, {"jain", jain_index(shares)}};
      if (r[0].contains("timeline") && r[1].contains("timeline")) {
        out["native"]["timelines"] = json::array({r[0]["timeline"], r[1]["timeline"]});
      }
    } else {
      out["native"] = json{{"error", ok(r[0]) ? r[1]["error"] : r[0]["error"]}};
    }
  }
  progress.step("two tenants, gpuslice (" + std::to_string(limits[0]) + "% and " + std::to_string(limits[1]) + "%)");
  {
    const std::string device = fresh_device(workers);
    std::vector<json> r = run_tenants(workers, plan, {spec, spec},
                                      {container(workers, device, {{"GPUSLICE_SM_LIMIT", std::to_string(limits[0])}}),
                                       container(workers, device, {{"GPUSLICE_SM_LIMIT", std::to_string(limits[1])}})});
    if (ok(r[0]) && ok(r[1])) {
      std::vector<double> shares{window_share(r[0], 0), window_share(r[1], 0)};
      // Fairness relative to the entitlement: 1.0 when both get the same
      // fraction of what their limit allows.
      std::vector<double> normalized{shares[0] * 100.0 / limits[0], shares[1] * 100.0 / limits[1]};
      out["gpuslice"] = json{{"shares", shares},
                             {"share_over_limit", normalized},
                             {"jain", jain_index(normalized)},
                             {"ratio", shares[0] > 0 ? shares[1] / shares[0] : 0.0},
                             {"target_ratio", static_cast<double>(limits[1]) / limits[0]}};
      if (r[0].contains("timeline") && r[1].contains("timeline")) {
        out["gpuslice"]["timelines"] = json::array({r[0]["timeline"], r[1]["timeline"]});
      }
    } else {
      out["gpuslice"] = json{{"error", ok(r[0]) ? r[1]["error"] : r[0]["error"]}};
    }
  }
  return out;
}

json measure_noisy(Workers& workers, const Plan& plan, Progress& progress) {
  // Tenant A runs for two phases; tenant B (no limit) joins for the second.
  const std::uint64_t warmup = ns(plan.warmup_s);
  const std::uint64_t phase = warmup + ns(plan.window_s);
  json a = spin_spec(plan, 2 * phase, {{warmup, phase}, {phase + warmup, 2 * phase}});
  json b = spin_spec(plan, 2 * phase, {{phase + warmup, 2 * phase}});
  b["delay_ns"] = phase;
  json out{{"limit", plan.noisy_limit}};

  auto summarize = [](const std::vector<json>& r) {
    if (!ok(r[0]) || !ok(r[1])) return json{{"error", ok(r[0]) ? r[1]["error"] : r[0]["error"]}};
    const double alone = window_share(r[0], 0);
    const double with = window_share(r[0], 1);
    return json{{"alone_share", alone},
                {"with_neighbour_share", with},
                {"neighbour_share", window_share(r[1], 0)},
                {"slowdown", alone > 0 ? 1.0 - with / alone : 0.0}};
  };
  progress.step("noisy neighbour, native (A alone, then B joins)");
  {
    const std::string device = fresh_device(workers);
    out["native"] = summarize(run_tenants(workers, plan, {a, b}, {native(device), native(device)}));
  }
  progress.step("noisy neighbour, gpuslice (A at " + std::to_string(plan.noisy_limit) + "%, then unlimited B joins)");
  {
    const std::string device = fresh_device(workers);
    out["gpuslice"] =
        summarize(run_tenants(workers, plan, {a, b},
                              {container(workers, device, {{"GPUSLICE_SM_LIMIT", std::to_string(plan.noisy_limit)}}),
                               container(workers, device)}));
  }
  return out;
}

}  // namespace gpuslice::bench
