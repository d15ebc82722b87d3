#include "worker.h"

#include <unistd.h>

#include <algorithm>
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

constexpr std::uint64_t kBarrierTimeoutNs = 120ull * 1000 * 1000 * 1000;

// The driver, a context on device 0, one stream and the bench's module.
class Session {
 public:
  explicit Session(unsigned spin_micros = 0) : api(load_driver_api()) {
    GPUSLICE_BENCH_CHECK(api, api.cuInit(0));
    GPUSLICE_BENCH_CHECK(api, api.cuDeviceGet(&device, 0));
    GPUSLICE_BENCH_CHECK(api, api.cuDevicePrimaryCtxRetain(&ctx, device));
    GPUSLICE_BENCH_CHECK(api, api.cuCtxSetCurrent(ctx));
    GPUSLICE_BENCH_CHECK(api, api.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device));
    GPUSLICE_BENCH_CHECK(api, api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    std::vector<unsigned> spins;
    if (spin_micros != 0) spins.push_back(spin_micros);
    const std::string ptx = kernels_ptx(spins);
    GPUSLICE_BENCH_CHECK(api, api.cuModuleLoadData(&module, ptx.c_str()));
    GPUSLICE_BENCH_CHECK(api, api.cuModuleGetFunction(&empty, module, kEmptyKernel));
    if (spin_micros != 0) {
      GPUSLICE_BENCH_CHECK(api, api.cuModuleGetFunction(&spin, module, spin_kernel_name(spin_micros).c_str()));
      spin_duration_ns = std::uint64_t{spin_micros} * 1000;
    }
  }
  ~Session() {
    if (stream != nullptr) api.cuStreamDestroy(stream);
    if (module != nullptr) api.cuModuleUnload(module);
    if (ctx != nullptr) api.cuDevicePrimaryCtxRelease(device);
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  CUresult launch_empty() { return api.cuLaunchKernel(empty, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr); }

  // One block per SM: a kernel that occupies the whole GPU for its duration
  // (with `share` streams, 1/share of it: kernels of different streams may
  // then run side by side, as on a GPU).
  CUresult launch_spin(CUstream on = nullptr, unsigned share = 1) {
    void* params[] = {&spin_duration_ns};
    const unsigned blocks = static_cast<unsigned>(sms) / share;
    return api.cuLaunchKernel(spin, blocks == 0 ? 1 : blocks, 1, 1, 128, 1, 1, 0, on != nullptr ? on : stream, params,
                              nullptr);
  }

  DriverApi api;
  CUdevice device = 0;
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  CUmodule module = nullptr;
  CUfunction empty = nullptr;
  CUfunction spin = nullptr;
  std::uint64_t spin_duration_ns = 0;
  int sms = 0;
};

std::uint64_t start_time(const json& spec) {
  if (!spec.contains("barrier")) return platform::monotonic_ns();
  const json& barrier = spec["barrier"];
  const std::uint64_t start =
      barrier_arrive_and_wait(barrier.at("dir").get<std::string>(), barrier.at("index").get<int>(), kBarrierTimeoutNs);
  platform::sleep_until_ns(start);
  return start;
}

json probe(const json&) {
  Session s;
  DriverApi& api = s.api;
  char name[256] = {};
  GPUSLICE_BENCH_CHECK(api, api.cuDeviceGetName(name, sizeof(name), s.device));
  int version = 0;
  GPUSLICE_BENCH_CHECK(api, api.cuDriverGetVersion(&version));
  size_t total = 0;
  GPUSLICE_BENCH_CHECK(api, api.cuDeviceTotalMem(&total, s.device));
  size_t free_bytes = 0;
  size_t visible_total = 0;
  GPUSLICE_BENCH_CHECK(api, api.cuMemGetInfo(&free_bytes, &visible_total));
  return json{{"device_name", name},  {"simulated", api.simulated()}, {"driver_version", version},
              {"total_bytes", total}, {"free_bytes", free_bytes},     {"sms", s.sms},
              {"pid", getpid()}};
}

// Empty-kernel launches: the host-side cost of one cuLaunchKernel call
// (batches, queue drained between batches and not timed), launch + sync
// round trip, and sustained launches per second including the final drain
// (best of 5 runs).
json launch(const json& spec) {
  Session s;
  DriverApi& api = s.api;
  const int batches = spec.value("batches", 200);
  const int batch = spec.value("batch", 100);
  const int roundtrips = spec.value("roundtrips", 200);
  const int throughput_launches = spec.value("throughput_launches", 20000);
  for (int i = 0; i < 1000; ++i) GPUSLICE_BENCH_CHECK(api, s.launch_empty());
  GPUSLICE_BENCH_CHECK(api, api.cuStreamSynchronize(s.stream));

  std::vector<double> call_ns;
  for (int b = 0; b < batches; ++b) {
    const std::uint64_t t0 = platform::monotonic_ns();
    for (int i = 0; i < batch; ++i) GPUSLICE_BENCH_CHECK(api, s.launch_empty());
    const std::uint64_t t1 = platform::monotonic_ns();
    call_ns.push_back(static_cast<double>(t1 - t0) / batch);
    GPUSLICE_BENCH_CHECK(api, api.cuStreamSynchronize(s.stream));
  }
  std::vector<double> roundtrip_ns;
  for (int r = 0; r < roundtrips; ++r) {
    const std::uint64_t t0 = platform::monotonic_ns();
    GPUSLICE_BENCH_CHECK(api, s.launch_empty());
    GPUSLICE_BENCH_CHECK(api, api.cuStreamSynchronize(s.stream));
    roundtrip_ns.push_back(static_cast<double>(platform::monotonic_ns() - t0));
  }
  std::vector<double> per_s;
  for (int run = 0; run < 5; ++run) {
    // At most ~0.5 s per run, however slow launches are.
    const std::uint64_t t0 = platform::monotonic_ns();
    int launched = 0;
    while (launched < throughput_launches && (launched % 1000 != 0 || platform::monotonic_ns() - t0 < 500000000ull)) {
      GPUSLICE_BENCH_CHECK(api, s.launch_empty());
      ++launched;
    }
    GPUSLICE_BENCH_CHECK(api, api.cuStreamSynchronize(s.stream));
    per_s.push_back(launched / (static_cast<double>(platform::monotonic_ns() - t0) / 1e9));
  }
  return json{{"call_ns", median(call_ns)},
              {"call_ns_p90", quantile(call_ns, 0.9)},
              {"roundtrip_ns", median(roundtrip_ns)},
              // Best of 5: another process on the machine only ever slows a run down.
              {"launches_per_s", *std::max_element(per_s.begin(), per_s.end())}};
}

// cuMemAlloc/cuMemFree (batches of allocations, then of frees) and cuMemGetInfo.
json memops(const json& spec) {
  Session s;
  DriverApi& api = s.api;
  const auto bytes = spec.value<std::size_t>("alloc_bytes", std::size_t{1} << 20);
  const int batches = spec.value("batches", 200);
  const int batch = spec.value("batch", 50);
  std::vector<CUdeviceptr> pointers(static_cast<std::size_t>(batch));
  std::vector<double> alloc_ns;
  std::vector<double> free_ns;
  for (int b = 0; b < batches + 5; ++b) {
    const std::uint64_t t0 = platform::monotonic_ns();
    for (CUdeviceptr& p : pointers) GPUSLICE_BENCH_CHECK(api, api.cuMemAlloc(&p, bytes));
    const std::uint64_t t1 = platform::monotonic_ns();
    for (CUdeviceptr p : pointers) GPUSLICE_BENCH_CHECK(api, api.cuMemFree(p));
    const std::uint64_t t2 = platform::monotonic_ns();
    if (b < 5) continue;  // warm-up
    alloc_ns.push_back(static_cast<double>(t1 - t0) / batch);
    free_ns.push_back(static_cast<double>(t2 - t1) / batch);
  }
  std::vector<double> info_ns;
  size_t free_bytes = 0;
  size_t total = 0;
  for (int b = 0; b < batches + 5; ++b) {
    const std::uint64_t t0 = platform::monotonic_ns();
    for (int i = 0; i < batch; ++i) GPUSLICE_BENCH_CHECK(api, api.cuMemGetInfo(&free_bytes, &total));
    if (b >= 5) info_ns.push_back(static_cast<double>(platform::monotonic_ns() - t0) / batch);
  }
  return json{{"alloc_ns", median(alloc_ns)},
              {"free_ns", median(free_ns)},
              {"getinfo_ns", median(info_ns)},
              {"alloc_bytes", bytes}};
}

// Allocate until out of memory: `chunk`-sized allocations, then halving the
// size down to `min_chunk`, so the usable total is known to within min_chunk.
// Allocations are held until start + hold_ns so that processes racing for one
// quota all hold theirs at the same time.
json quota(const json& spec) {
  Session s;
  DriverApi& api = s.api;
  auto chunk = spec.value<std::size_t>("chunk", std::size_t{2} << 20);
  const auto min_chunk = spec.value<std::size_t>("min_chunk", std::size_t{64} << 10);
  const auto hold_ns = spec.value<std::uint64_t>("hold_ns", 0);
  size_t free_before = 0;
  size_t total_seen = 0;
  GPUSLICE_BENCH_CHECK(api, api.cuMemGetInfo(&free_before, &total_seen));
  const std::uint64_t start = start_time(spec);
  std::vector<CUdeviceptr> held;
  std::uint64_t usable = 0;
  CUresult refusal = CUDA_SUCCESS;
  // Stop at a size limit well past any sane quota: a missing quota must not
  // take the whole (real) GPU.
  const std::uint64_t ceiling = spec.value<std::uint64_t>("ceiling_bytes", std::uint64_t{1} << 40);
  while (chunk >= min_chunk && usable < ceiling) {
    CUdeviceptr p = 0;
    CUresult rc = api.cuMemAlloc(&p, chunk);
    if (rc == CUDA_SUCCESS) {
      held.push_back(p);
      usable += chunk;
      continue;
    }
    if (refusal == CUDA_SUCCESS) refusal = rc;
    if (rc != CUDA_ERROR_OUT_OF_MEMORY) break;
    chunk /= 2;
  }
  const std::uint64_t done = platform::monotonic_ns();
  size_t free_at_oom = 0;
  size_t total_at_oom = 0;
  GPUSLICE_BENCH_CHECK(api, api.cuMemGetInfo(&free_at_oom, &total_at_oom));
  if (hold_ns != 0) platform::sleep_until_ns(start + hold_ns);
  for (CUdeviceptr p : held) GPUSLICE_BENCH_CHECK(api, api.cuMemFree(p));
  return json{{"usable_bytes", usable},
              {"allocations", held.size()},
              {"refusal", refusal == CUDA_SUCCESS ? "none" : error_name(api, refusal)},
              {"total_seen", total_seen},
              {"free_before", free_before},
              {"free_at_oom", free_at_oom},
              {"total_at_oom", total_at_oom},
              {"fill_ns", done - start},
              {"hit_ceiling", usable >= ceiling}};
}

// Back-to-back spin kernels with at most `depth` in flight, from the start for
// run_ns, round robin over `streams` streams; device busy time of this process
// in each window. On the simulated
// driver busy time comes from its timeline (exact). On a real GPU it is the
// sum of the kernels' event-timed durations, each counted in the window in
// which it was launched (the queue is at most depth kernels, so the edge error
// is at most depth * kernel_us per window).
json spin(const json& spec) {
  const auto kernel_us = spec.value<unsigned>("kernel_us", 1000);
  Session s(kernel_us);
  DriverApi& api = s.api;
  const auto depth = static_cast<std::size_t>(spec.value("depth", 4));
  const auto run_ns = spec.at("run_ns").get<std::uint64_t>();
  const auto windows = spec.at("windows").get<std::vector<std::vector<std::uint64_t>>>();
  const auto stream_count = static_cast<unsigned>(std::max(1, spec.value("streams", 1)));
  std::vector<CUstream> streams{s.stream};
  while (streams.size() < stream_count) {
    CUstream extra = nullptr;
    GPUSLICE_BENCH_CHECK(api, api.cuStreamCreate(&extra, CU_STREAM_NON_BLOCKING));
    streams.push_back(extra);
  }
  struct InFlight {
    CUevent begin = nullptr;
    CUevent end = nullptr;
    CUstream stream = nullptr;
    std::uint64_t launched_ns = 0;
    bool pending = false;
  };
  std::vector<InFlight> ring(depth);
  for (InFlight& k : ring) {
    GPUSLICE_BENCH_CHECK(api, api.cuEventCreate(&k.begin, CU_EVENT_DEFAULT));
    GPUSLICE_BENCH_CHECK(api, api.cuEventCreate(&k.end, CU_EVENT_DEFAULT));
  }
  // One warm-up kernel outside any window (JIT, first-launch costs).
  GPUSLICE_BENCH_CHECK(api, s.launch_spin());
  GPUSLICE_BENCH_CHECK(api, api.cuStreamSynchronize(s.stream));

  const std::uint64_t start = start_time(spec);
  // A tenant that arrives later (the noisy neighbour) keeps the common start
  // so that every process's windows are the same instants.
  if (const auto delay = spec.value<std::uint64_t>("delay_ns", 0); delay != 0) platform::sleep_until_ns(start + delay);
  // Optional: busy time in bins of bin_ns from the start to the end of the
  // last window (the share over time that --plots draws).
  const auto bin_ns = spec.value<std::uint64_t>("bin_ns", 0);
  std::uint64_t end_of_windows = 0;
  for (const auto& w : windows) end_of_windows = std::max(end_of_windows, start + w[1]);
  const std::size_t bin_count =
      bin_ns == 0 ? 0 : static_cast<std::size_t>((end_of_windows - start + bin_ns - 1) / bin_ns);
  std::vector<double> bin_busy_ns(bin_count, 0.0);
  std::vector<double> event_busy_ns(windows.size(), 0.0);
  auto retire = [&](InFlight& k) {
    GPUSLICE_BENCH_CHECK(api, api.cuEventSynchronize(k.end));
    float ms = 0;
    GPUSLICE_BENCH_CHECK(api, api.cuEventElapsedTime(&ms, k.begin, k.end));
    for (std::size_t w = 0; w < windows.size(); ++w) {
      if (k.launched_ns >= start + windows[w][0] && k.launched_ns < start + windows[w][1]) {
        event_busy_ns[w] += static_cast<double>(ms) * 1e6;
      }
    }
    // A GPU's bins: each kernel's event-timed duration in the bin it was launched in.
    if (!api.simulated() && bin_ns != 0 && k.launched_ns >= start) {
      const std::size_t b = static_cast<std::size_t>((k.launched_ns - start) / bin_ns);
      if (b < bin_count) bin_busy_ns[b] += static_cast<double>(ms) * 1e6;
    }
    k.pending = false;
  };
  // On the simulated driver, each window's busy time is read from the
  // timeline in slices as the run goes: the timeline is a ring, and with the
  // realistic profile (one entry per scheduler catch-up) a 5 s window can be
  // older than the ring by the end of the run.
  std::vector<double> timeline_busy_ns(windows.size(), 0.0);
  std::uint64_t read_until = start;
  auto read_timeline = [&](std::uint64_t upto) {
    if (!api.simulated() || upto <= read_until) return;
    for (std::size_t w = 0; w < windows.size(); ++w) {
      const std::uint64_t t0 = std::max(start + windows[w][0], read_until);
      const std::uint64_t t1 = std::min(start + windows[w][1], upto);
      if (t1 > t0) timeline_busy_ns[w] += static_cast<double>(api.fake_busy_ns(0, getpid(), t0, t1));
    }
    for (std::size_t b = (read_until - start) / std::max<std::uint64_t>(bin_ns, 1); b < bin_count; ++b) {
      const std::uint64_t t0 = std::max(start + b * bin_ns, read_until);
      const std::uint64_t t1 = std::min(std::min(start + (b + 1) * bin_ns, upto), end_of_windows);
      if (t0 >= upto) break;
      if (t1 > t0) bin_busy_ns[b] += static_cast<double>(api.fake_busy_ns(0, getpid(), t0, t1));
    }
    read_until = upto;
  };
  constexpr std::uint64_t kReadSliceNs = 200'000'000;
  std::uint64_t launched = 0;
  std::uint64_t in_launch_ns = 0;
  const std::uint64_t stop = start + run_ns;
  for (std::uint64_t i = 0; platform::monotonic_ns() < stop; ++i) {
    if (const std::uint64_t now = platform::monotonic_ns(); now - read_until >= kReadSliceNs) read_timeline(now);
    InFlight& k = ring[i % depth];
    if (k.pending) retire(k);
    k.stream = streams[i % streams.size()];
    k.launched_ns = platform::monotonic_ns();
    GPUSLICE_BENCH_CHECK(api, api.cuEventRecord(k.begin, k.stream));
    GPUSLICE_BENCH_CHECK(api, s.launch_spin(k.stream, stream_count));
    in_launch_ns += platform::monotonic_ns() - k.launched_ns;
    GPUSLICE_BENCH_CHECK(api, api.cuEventRecord(k.end, k.stream));
    k.pending = true;
    ++launched;
  }
  for (InFlight& k : ring) {
    if (k.pending) retire(k);
  }
  if (api.simulated()) {
    // Work still queued at `stop` runs after it: wait until the windows are over.
    platform::sleep_until_ns(end_of_windows);
    read_timeline(end_of_windows);
  }
  json result_windows = json::array();
  for (std::size_t w = 0; w < windows.size(); ++w) {
    const std::uint64_t t0 = start + windows[w][0];
    const std::uint64_t t1 = start + windows[w][1];
    const double busy = api.simulated() ? timeline_busy_ns[w] : event_busy_ns[w];
    result_windows.push_back(
        json{{"busy_ns", busy}, {"length_ns", t1 - t0}, {"share", busy / static_cast<double>(t1 - t0)}});
  }
  for (InFlight& k : ring) {
    api.cuEventDestroy(k.begin);
    api.cuEventDestroy(k.end);
  }
  for (std::size_t i = 1; i < streams.size(); ++i) api.cuStreamDestroy(streams[i]);
  json result{{"windows", result_windows},
              {"launched", launched},
              {"in_launch_ns", in_launch_ns},
              {"share_source", api.simulated() ? "timeline" : "events"},
              {"pid", getpid()}};
  if (bin_ns != 0) {
    json shares = json::array();
    for (std::size_t b = 0; b < bin_count; ++b) {
      const std::uint64_t length = std::min(start + (b + 1) * bin_ns, end_of_windows) - (start + b * bin_ns);
      shares.push_back(bin_busy_ns[b] / static_cast<double>(length));
    }
    result["timeline"] = json{{"bin_ns", bin_ns}, {"shares", shares}};
  }
  return result;
}

}  // namespace

json run_worker(const json& spec) {
  const std::string task = spec.at("task").get<std::string>();
  if (task == "probe") return probe(spec);
  if (task == "launch") return launch(spec);
  if (task == "memops") return memops(spec);
  if (task == "quota") return quota(spec);
  if (task == "spin") return spin(spec);
  throw std::runtime_error("unknown worker task '" + task + "'");
}

}  // namespace gpuslice::bench
