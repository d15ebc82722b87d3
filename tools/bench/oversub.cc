#include "oversub.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "barrier.h"
#include "driver_api.h"
#include "gpuslice/region.h"
#include "platform/clock.h"
#include "shm/region_file.h"

namespace gpuslice::bench {

namespace {

using nlohmann::json;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::uint64_t kMs = 1'000'000;
constexpr std::uint64_t kBarrierTimeoutNs = 120'000 * kMs;
// The schedule, in steps (a step is 100 ms, 50 ms with --quick): the holder
// holds 4 chunks from the start and frees one at 5.5, 7.5, 9.5 and 11.5; the
// grower allocates a chunk at 1, 2, ..., 8 (a waiting allocation delays the
// next ones), frees all at 13; both exit at 14, the watcher stops at 14.5.
// The allowance is both contexts plus 8 chunks: the grower's 5th chunk is
// the first past it, and once the holder has freed everything all 8 fit.
constexpr std::uint64_t kChunk = 64 * kMiB;
constexpr int kHolderChunks = 4;
constexpr int kGrowerChunks = 8;
constexpr double kHolderFrees[] = {5.5, 7.5, 9.5, 11.5};
constexpr double kGrowerFreeAll = 13;
constexpr double kEnd = 14;
constexpr double kWatchEnd = 14.5;

bool ok(const json& r) { return r.is_object() && !r.contains("error"); }

// --- worker side ---

json memplan(const json& spec) {
  DriverApi api = load_driver_api();
  CUdevice device = 0;
  CUcontext ctx = nullptr;
  GPUSLICE_BENCH_CHECK(api, api.cuInit(0));
  GPUSLICE_BENCH_CHECK(api, api.cuDeviceGet(&device, 0));
  GPUSLICE_BENCH_CHECK(api, api.cuDevicePrimaryCtxRetain(&ctx, device));
  GPUSLICE_BENCH_CHECK(api, api.cuCtxSetCurrent(ctx));
  size_t free_bytes = 0, total = 0;
  GPUSLICE_BENCH_CHECK(api, api.cuMemGetInfo(&free_bytes, &total));
  std::uint64_t start = platform::monotonic_ns();
  if (spec.contains("barrier")) {
    const json& b = spec["barrier"];
    start = barrier_arrive_and_wait(b.at("dir").get<std::string>(), b.at("index").get<int>(), kBarrierTimeoutNs);
  }
  std::deque<CUdeviceptr> held;
  json done = json::array();
  for (const json& action : spec.value("actions", json::array())) {
    const auto at = action.at("at_ns").get<std::uint64_t>();
    platform::sleep_until_ns(start + at);
    const std::string op = action.at("op").get<std::string>();
    const std::uint64_t began = platform::monotonic_ns();
    CUresult rc = CUDA_SUCCESS;
    if (op == "alloc") {
      CUdeviceptr p = 0;
      rc = api.cuMemAlloc(&p, action.at("bytes").get<std::size_t>());
      if (rc == CUDA_SUCCESS) held.push_back(p);
    } else if (op == "free" && !held.empty()) {
      rc = api.cuMemFree(held.front());
      held.pop_front();
    } else if (op == "freeall") {
      for (CUdeviceptr p : held) {
        if (const CUresult r = api.cuMemFree(p); r != CUDA_SUCCESS && rc == CUDA_SUCCESS) rc = r;
      }
      held.clear();
    }
    const std::uint64_t ended = platform::monotonic_ns();
    done.push_back(json{{"op", op},
                        {"at_ms", static_cast<double>(at) / 1e6},
                        {"began_ms", static_cast<double>(began - start) / 1e6},
                        {"done_ms", static_cast<double>(ended - start) / 1e6},
                        {"rc", rc == CUDA_SUCCESS ? "CUDA_SUCCESS" : error_name(api, rc)}});
  }
  for (CUdeviceptr p : held) api.cuMemFree(p);
  api.cuDevicePrimaryCtxRelease(device);
  return json{{"context_bytes", total - free_bytes}, {"total_seen", total}, {"actions", done}, {"pid", getpid()}};
}

json memwatch(const json& spec) {
  const auto region_path = spec.at("region").get<std::string>();
  const auto interval = spec.at("interval_ns").get<std::uint64_t>();
  const auto run_ns = spec.at("run_ns").get<std::uint64_t>();
  // The simulated driver's own count of the device's memory (no context of
  // ours: the query reads the shared state), and of it managed memory: the
  // simulator holds a managed allocation on the device from cuMemAllocManaged
  // until it is advised to the host (a GPU places nothing there before it is
  // touched), so a spill in flight (its driver allocation made, its advice
  // not yet) shows there as a chunk over the allowance
  // (docs/memory-accounting.md, "Chaos testing"). Both in one pass: the
  // managed figure is never more than the managed part of the held bytes.
  // Absent on a real driver.
  using DeviceManaged = std::uint64_t (*)(int, std::uint64_t*);
  DeviceManaged device_managed = nullptr;
  if (void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL); handle != nullptr) {
    device_managed = reinterpret_cast<DeviceManaged>(dlsym(handle, "fakecuda_device_managed_bytes"));
  }
  std::uint64_t start = platform::monotonic_ns();
  if (spec.contains("barrier")) {
    const json& b = spec["barrier"];
    start = barrier_arrive_and_wait(b.at("dir").get<std::string>(), b.at("index").get<int>(), kBarrierTimeoutNs);
  }
  // The container's processes made the region before the barrier; tolerate a slow one.
  Region* region = nullptr;
  shm::Error err{};
  for (int i = 0; i < 200 && region == nullptr; ++i) {
    region = shm::attach_existing(region_path.c_str(), false, &err);
    if (region == nullptr) platform::sleep_ns(5 * kMs);
  }
  if (region == nullptr) throw std::runtime_error(err.message);
  const DeviceState& d = region->devices[0];
  json t_ms = json::array(), counted = json::array(), spilled = json::array(), waiting = json::array(),
       device = json::array(), managed = json::array();
  for (std::uint64_t k = 0; k * interval <= run_ns; ++k) {
    platform::sleep_until_ns(start + k * interval);
    t_ms.push_back(static_cast<double>(platform::monotonic_ns() - start) / 1e6);
    // spilled first: a spill adds to used_bytes before spilled_bytes, so this
    // order never shows more spilled than counted.
    const std::uint64_t s = d.spilled_bytes.load(std::memory_order_acquire);
    const std::uint64_t u = d.used_bytes.load(std::memory_order_acquire);
    counted.push_back(u);
    spilled.push_back(s);
    waiting.push_back(d.oversub_waiting.load(std::memory_order_acquire));
    if (device_managed != nullptr) {
      std::uint64_t held = 0;
      managed.push_back(device_managed(0, &held));
      device.push_back(held);
    }
  }
  json out{{"t_ms", t_ms},
           {"counted_bytes", counted},
           {"spilled_bytes", spilled},
           {"waiting", waiting},
           {"quota_bytes", d.quota_bytes.load()},
           {"resident_limit_bytes", d.resident_limit_bytes.load()},
           {"spills", d.spills.load()},
           {"waits", d.oversub_waits.load()},
           {"wait_ms", static_cast<double>(d.oversub_wait_ns.load()) / 1e6},
           {"wait_timeouts", d.oversub_timeouts.load()}};
  if (device_managed != nullptr) {
    out["device_bytes"] = device;
    out["device_managed_bytes"] = managed;
  }
  shm::detach(region);
  return out;
}

// --- orchestrator side ---

json action(double step, std::uint64_t step_ns, const char* op, std::uint64_t bytes = 0) {
  json a{{"at_ns", static_cast<std::uint64_t>(std::llround(step * static_cast<double>(step_ns)))}, {"op", op}};
  if (bytes != 0) a["bytes"] = bytes;
  return a;
}

// One policy: holder, grower and watcher together; the watcher's samples with
// what they add up to.
json run_case(Workers& workers, const std::string& policy, std::uint64_t quota, std::uint64_t allowance,
              std::uint64_t step_ns) {
  json holder{{"task", "memplan"}, {"actions", json::array()}};
  for (int i = 0; i < kHolderChunks; ++i) holder["actions"].push_back(action(0, step_ns, "alloc", kChunk));
  for (double at : kHolderFrees) holder["actions"].push_back(action(at, step_ns, "free"));
  holder["actions"].push_back(action(kEnd, step_ns, "freeall"));
  json grower{{"task", "memplan"}, {"actions", json::array()}};
  for (int i = 1; i <= kGrowerChunks; ++i) grower["actions"].push_back(action(i, step_ns, "alloc", kChunk));
  grower["actions"].push_back(action(kGrowerFreeAll, step_ns, "freeall"));
  grower["actions"].push_back(action(kEnd, step_ns, "freeall"));
  const std::string device = workers.fresh_path("fakecuda.state");
  const std::string region = workers.fresh_path("gpuslice.region");
  const WorkerEnv member{true,
                         {{"FAKECUDA_STATE", device},
                          {"GPUSLICE_REGION", region},
                          {"GPUSLICE_MEMORY_LIMIT", std::to_string(quota)},
                          {"GPUSLICE_MEMORY_RESIDENT", std::to_string(allowance)},
                          {"GPUSLICE_OVERSUBSCRIBE", policy},
                          {"GPUSLICE_OVERSUBSCRIBE_WAIT", "10s"}}};
  const json watcher{{"task", "memwatch"},
                     {"region", region},
                     {"interval_ns", step_ns / 10},
                     {"run_ns", static_cast<std::uint64_t>(kWatchEnd * static_cast<double>(step_ns))}};
  const std::vector<json> r = run_together(workers, {holder, grower, watcher},
                                           {member, member, WorkerEnv{false, {{"FAKECUDA_STATE", device}}}});
  const char* names[] = {"holder", "grower", "watcher"};
  for (int i = 0; i < 3; ++i) {
    if (!ok(r[i])) return json{{"error", std::string(names[i]) + ": " + r[i].value("error", std::string("failed"))}};
  }
  json out = r[2];
  out["policy"] = policy;
  out["holder"] = r[0]["actions"];
  out["grower"] = r[1]["actions"];
  std::uint64_t max_counted = 0, max_resident = 0, max_spilled = 0, max_device = 0, max_unmanaged = 0, max_managed = 0;
  double waiting_ms = 0;
  const json& t = out["t_ms"];
  for (std::size_t i = 0; i < t.size(); ++i) {
    const auto u = out["counted_bytes"][i].get<std::uint64_t>();
    const auto s = out["spilled_bytes"][i].get<std::uint64_t>();
    max_counted = std::max(max_counted, u);
    max_spilled = std::max(max_spilled, s);
    max_resident = std::max(max_resident, u > s ? u - s : 0);
    if (out.contains("device_bytes")) {
      const auto dev = out["device_bytes"][i].get<std::uint64_t>();
      const auto m = out["device_managed_bytes"][i].get<std::uint64_t>();
      max_device = std::max(max_device, dev);
      max_managed = std::max(max_managed, m);
      max_unmanaged = std::max(max_unmanaged, dev > m ? dev - m : 0);
    }
    if (out["waiting"][i].get<int>() > 0 && i + 1 < t.size()) waiting_ms += t[i + 1].get<double>() - t[i].get<double>();
  }
  out["max_counted_bytes"] = max_counted;
  out["max_resident_bytes"] = max_resident;
  out["max_spilled_bytes"] = max_spilled;
  out["waiting_sampled_ms"] = waiting_ms;
  if (out.contains("device_bytes")) {
    out["max_device_bytes"] = max_device;
    // What gpuslice admitted as resident (the spill's managed memory in
    // flight left out), and that memory: at most the grower's one chunk.
    out["max_device_resident_bytes"] = max_unmanaged;
    out["max_device_managed_bytes"] = max_managed;
  }
  int granted = 0;
  double longest_delay = 0;
  for (const json& a : out["grower"]) {
    if (a["op"] != "alloc") continue;
    if (a["rc"] == "CUDA_SUCCESS") ++granted;
    longest_delay = std::max(longest_delay, a["done_ms"].get<double>() - a["at_ms"].get<double>());
  }
  out["grower_granted"] = granted;
  out["grower_longest_alloc_ms"] = longest_delay;
  return out;
}

}  // namespace

json run_oversub_worker(const json& spec) {
  const std::string task = spec.at("task").get<std::string>();
  if (task == "memplan") return memplan(spec);
  return memwatch(spec);
}

int oversub_steps(const Plan& plan) { return plan.sections.count("oversub") ? 3 : 0; }

json measure_oversub(Workers& workers, const Plan& plan, Progress& progress) {
  const std::uint64_t step_ns = (plan.quick ? 50 : 100) * kMs;
  // What one process's context counts against the quota (512 MiB on the
  // realistic simulated profile, none on the ideal one, hundreds of MiB on a
  // GPU): the allowance leaves room for two of them.
  progress.step("oversubscription: what a context counts");
  const json probe =
      workers.run(json{{"task", "memplan"}}, WorkerEnv{true,
                                                       {{"FAKECUDA_STATE", workers.fresh_path("fakecuda.state")},
                                                        {"GPUSLICE_REGION", workers.fresh_path("gpuslice.region")},
                                                        {"GPUSLICE_MEMORY_LIMIT", "8Gi"}}});
  if (!ok(probe)) return json{{"error", "context probe: " + probe.value("error", std::string("failed"))}};
  const auto context = probe["context_bytes"].get<std::uint64_t>();
  const std::uint64_t contexts = (2 * context + kMiB - 1) / kMiB * kMiB;
  const std::uint64_t allowance = contexts + (kHolderChunks + kGrowerChunks - 4) * kChunk;
  const std::uint64_t quota = allowance + 8 * kChunk;
  json out{{"context_bytes", context},
           {"quota_bytes", quota},
           {"resident_limit_bytes", allowance},
           {"chunk_bytes", kChunk},
           {"step_ms", static_cast<double>(step_ns) / 1e6},
           {"holder_chunks", kHolderChunks},
           {"holder_frees_at_steps", std::vector<double>(std::begin(kHolderFrees), std::end(kHolderFrees))},
           {"grower_chunks", kGrowerChunks},
           {"grower_free_all_at_step", kGrowerFreeAll}};
  progress.step("oversubscription: GPUSLICE_OVERSUBSCRIBE=spill past the resident allowance");
  out["spill"] = run_case(workers, "spill", quota, allowance, step_ns);
  progress.step("oversubscription: GPUSLICE_OVERSUBSCRIBE=wait past the resident allowance");
  out["wait"] = run_case(workers, "wait", quota, allowance, step_ns);
  return out;
}

void print_oversub_table(const json& report, std::FILE* out) {
  if (!report.contains("oversubscription")) return;
  const json& o = report["oversubscription"];
  if (!ok(o)) {
    std::fprintf(out, "\nOversubscription: error: %s\n", o.value("error", std::string("?")).c_str());
    return;
  }
  const bool simulated = report.value("device", std::string()) == "simulated";
  auto mib = [](const json& v) { return v.get<double>() / static_cast<double>(kMiB); };
  std::fprintf(out,
               "\nOversubscription (%s): quota %.0f MiB, resident allowance %.0f MiB (2 contexts of %.0f MiB + "
               "%.0f MiB);\n  holder frees %d x %.0f MiB, grower allocates %d x %.0f MiB\n",
               simulated ? "SIMULATED driver" : "GPU", mib(o["quota_bytes"]), mib(o["resident_limit_bytes"]),
               mib(o["context_bytes"]), mib(o["resident_limit_bytes"]) - 2 * mib(o["context_bytes"]),
               o["holder_chunks"].get<int>(), mib(o["chunk_bytes"]), o["grower_chunks"].get<int>(),
               mib(o["chunk_bytes"]));
  std::fprintf(out, "  %-8s %-10s %-14s %-14s %-12s %-8s %-8s %s\n", "policy", "granted", "max counted", "max resident",
               "max spilled", "spills", "waits", "longest alloc");
  for (const char* policy : {"spill", "wait"}) {
    if (!o.contains(policy)) continue;
    const json& c = o[policy];
    if (!ok(c)) {
      std::fprintf(out, "  %-8s error: %s\n", policy, c.value("error", std::string("?")).c_str());
      continue;
    }
    const std::string granted =
        std::to_string(c["grower_granted"].get<int>()) + "/" + std::to_string(o["grower_chunks"].get<int>());
    std::fprintf(out, "  %-8s %-10s %-14.0f %-14.0f %-12.0f %-8d %-8d %.0f ms\n", policy, granted.c_str(),
                 mib(c["max_counted_bytes"]), mib(c["max_resident_bytes"]), mib(c["max_spilled_bytes"]),
                 c["spills"].get<int>(), c["waits"].get<int>(), c["grower_longest_alloc_ms"].get<double>());
  }
  std::fprintf(out,
               "  (MiB; resident = counted - spilled, from the region; a waiting allocation is counted while it "
               "waits)\n");
}

}  // namespace gpuslice::bench
