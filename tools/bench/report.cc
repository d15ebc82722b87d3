#include "report.h"

#include <cmath>
#include <string>

namespace gpuslice::bench {

namespace {

using nlohmann::json;

std::string format(const char* fmt, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), fmt, value);
  return text;
}

std::string duration(double ns) {
  if (ns < 1e3) return format("%.0f ns", ns);
  if (ns < 1e6) return format("%.2f us", ns / 1e3);
  return format("%.2f ms", ns / 1e6);
}

std::string bytes(double b) {
  if (b >= 1024.0 * 1024 * 1024) return format("%.2f GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return format("%.1f MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return format("%.1f KiB", b / 1024.0);
  return format("%.0f B", b);
}

std::string percent(double fraction, const char* fmt = "%.1f%%") { return format(fmt, fraction * 100.0); }

std::string rate(double per_s) {
  if (per_s >= 1e6) return format("%.2f M/s", per_s / 1e6);
  if (per_s >= 1e3) return format("%.1f k/s", per_s / 1e3);
  return format("%.0f /s", per_s);
}

bool ok(const json& j) { return j.is_object() && !j.contains("error"); }

std::string error_of(const json& j) {
  if (j.is_object() && j.contains("error")) return "error: " + j["error"].get<std::string>();
  return "error: no result";
}

void row(std::FILE* out, const std::string& name, const std::string& a, const std::string& b, const std::string& c) {
  std::fprintf(out, "  %-34s %-13s %-13s %s\n", name.c_str(), a.c_str(), b.c_str(), c.c_str());
}

// A latency row: native, wrapped, added.
void latency_row(std::FILE* out, const std::string& name, const json& native, const json& wrapped, const char* key) {
  if (!ok(native) || !ok(wrapped)) {
    row(out, name, ok(native) ? duration(native[key].get<double>()) : "-", "-",
        ok(native) ? error_of(wrapped) : error_of(native));
    return;
  }
  const double n = native[key].get<double>();
  const double w = wrapped[key].get<double>();
  // Appended, not "+" + string: GCC 12 at -O3 warns (-Wrestrict) on the latter.
  std::string delta(w >= n ? "+" : "-");
  delta += duration(std::fabs(w - n));
  delta += format(" (%+.1f%%)", n > 0 ? (w - n) / n * 100 : 0);
  row(out, name, duration(n), duration(w), delta);
}

void print_header(const json& r, std::FILE* out) {
  std::fprintf(out, "gpuslice-bench %s on %s: %s", r.value("version", "").c_str(),
               r.value("device", "") == "simulated" ? "the SIMULATED driver (fakecuda, no GPU)" : "a real GPU",
               r.value("device_name", "?").c_str());
  if (r.contains("sms")) std::fprintf(out, ", %d SMs", r["sms"].get<int>());
  if (r.contains("total_bytes")) std::fprintf(out, ", %s", bytes(r["total_bytes"].get<double>()).c_str());
  if (r.contains("driver_version")) std::fprintf(out, ", driver API %d", r["driver_version"].get<int>());
  if (r.contains("profile")) {
    std::fprintf(out, "\n  simulated profile: %s (FAKECUDA_PROFILE; figures are simulated, not a GPU's)",
                 r["profile"].get<std::string>().c_str());
  }
  std::fprintf(out, "\n  driver: %s\n  library: %s\n", r.value("driver", "").c_str(), r.value("library", "").c_str());
  if (r.value("quick", false)) std::fprintf(out, "  --quick: short windows, few points; not for publishing\n");
}

void print_latency(const json& r, std::FILE* out) {
  std::fprintf(out, "\n%-36s %-13s %-13s %s\n", "Latency and throughput (median)", "native", "gpuslice", "added");
  if (r.contains("launch")) {
    const json& l = r["launch"];
    latency_row(out, "empty-kernel launch, per call", l["native"], l["gpuslice"], "call_ns");
    // Empty kernels give the compute limiter no device time to calibrate on:
    // this row shows its cautious start (docs/benchmarks.md).
    latency_row(out, "  same, GPUSLICE_SM_LIMIT=90 (*)", l["native"], l["gpuslice_sm_limit_90"], "call_ns");
    latency_row(out, "launch + cuStreamSynchronize", l["native"], l["gpuslice"], "roundtrip_ns");
    if (ok(l["native"]) && ok(l["gpuslice"])) {
      const double n = l["native"]["launches_per_s"].get<double>();
      const double w = l["gpuslice"]["launches_per_s"].get<double>();
      row(out, "launch throughput (best of 5)", rate(n), rate(w), format("%+.1f%%", (w - n) / n * 100));
    }
  }
  if (r.contains("memory")) {
    const json& m = r["memory"];
    latency_row(out, "cuMemAlloc (1 MiB)", m["native"], m["gpuslice"], "alloc_ns");
    latency_row(out, "cuMemFree", m["native"], m["gpuslice"], "free_ns");
    latency_row(out, "cuMemGetInfo", m["native"], m["gpuslice"], "getinfo_ns");
    std::fprintf(out, "  (gpuslice memory rows run with GPUSLICE_MEMORY_LIMIT=%s)\n", m.value("quota", "").c_str());
  }
  if (r.contains("launch")) {
    std::fprintf(out,
                 "  (*) wall time per call, empty kernels only: the compute limiter prices launches by an\n"
                 "      estimate until it has measured device time, so these launches are paced, not free\n");
  }
}

void print_quota(const json& q, std::FILE* out) {
  std::fprintf(out, "\nMemory quota: cuMemAlloc in %s chunks, halving to %s, until refused\n",
               bytes(q["chunk_bytes"].get<double>()).c_str(), bytes(q["min_chunk_bytes"].get<double>()).c_str());
  std::fprintf(out, "  %-11s %-12s %-13s %-20s %-12s %s\n", "quota", "usable", "(usable+used", "cuMemGetInfo total",
               "used before", "refused with");
  std::fprintf(out, "  %-11s %-12s %-13s\n", "", "", " before)/quota");
  for (const json& s : q["single"]) {
    if (!ok(s)) {
      std::fprintf(out, "  %-11s %s\n", bytes(s["quota_bytes"].get<double>()).c_str(), error_of(s).c_str());
      continue;
    }
    // What the container already held (a context's memory on a real GPU) when the fill began.
    const double used_before = s["total_seen"].get<double>() - s["free_before"].get<double>();
    std::fprintf(out, "  %-11s %-12s %-13s %-20s %-12s %s%s\n", bytes(s["quota_bytes"].get<double>()).c_str(),
                 bytes(s["usable_bytes"].get<double>()).c_str(), percent(s["accuracy"].get<double>(), "%.2f%%").c_str(),
                 bytes(s["total_seen"].get<double>()).c_str(), bytes(used_before).c_str(),
                 s["refusal"].get<std::string>().c_str(),
                 s["over_quota_bytes"].get<std::uint64_t>() > 0 ? "  OVER QUOTA" : "");
  }
  const json& s = q["shared"];
  std::fprintf(out, "  %d processes racing for one %s quota: ", s["processes"].get<int>(),
               bytes(s["quota_bytes"].get<double>()).c_str());
  if (!ok(s)) {
    std::fprintf(out, "%s\n", error_of(s).c_str());
    return;
  }
  std::fprintf(
      out, "%s usable in total, %s held at the last refusal (%s), %s over the quota%s\n",
      bytes(s["usable_bytes"].get<double>()).c_str(), bytes(s.value("held_at_last_refusal_bytes", 0.0)).c_str(),
      percent(s["accuracy"].get<double>(), "%.2f%%").c_str(), bytes(s["over_quota_bytes"].get<double>()).c_str(),
      s["all_held_at_once"].get<bool>() ? "" : " (warning: fills did not overlap)");
}

void print_sweep(const json& s, std::FILE* out) {
  std::fprintf(out,
               "\nCompute limit: spin_%uus kernels back to back, %.1f s window after %.1f s, device share from %s\n",
               s["kernel_us"].get<unsigned>(), s["window_s"].get<double>(), s.value("warmup_s", 0.0),
               s.value("share_source", "") == "timeline" ? "the simulated device timeline" : "event timings");
  std::fprintf(out, "  %d process(es) per container, %d stream(s) each, %d kernels queued per process\n",
               s.value("processes", 1), s.value("streams", 1), s.value("queued_kernels", 4));
  const std::string startup = format("first %.0f ms", s.value("startup_window_s", 0.0) * 1000);
  std::fprintf(out, "  %-8s %-10s %-10s %-14s %s\n", "limit", "achieved", "error", "verdict", startup.c_str());
  if (s.contains("native_share")) {
    std::fprintf(out, "  %-8s %-10s %-10s %-14s %s\n", "none", percent(s["native_share"].get<double>()).c_str(), "",
                 "(native)", percent(s.value("native_startup_share", 0.0)).c_str());
  } else {
    std::fprintf(out, "  %-8s native run failed: %s\n", "none", s.value("native_error", "").c_str());
  }
  for (const json& p : s["points"]) {
    const std::string limit = std::to_string(p["limit"].get<int>()) + "%";
    if (!ok(p)) {
      std::fprintf(out, "  %-8s %s\n", limit.c_str(), error_of(p).c_str());
      continue;
    }
    std::fprintf(out, "  %-8s %-10s %-10s %-14s %s\n", limit.c_str(), percent(p["share"].get<double>()).c_str(),
                 format("%+.1f pt", p["error_points"].get<double>()).c_str(), p["verdict"].get<std::string>().c_str(),
                 percent(p.value("startup_share", 0.0)).c_str());
  }
  if (s.contains("mean_abs_error_points")) {
    std::fprintf(out, "  mean |error| %.1f pt, max %.1f pt (ok = within %.0f pt)\n",
                 s["mean_abs_error_points"].get<double>(), s["max_abs_error_points"].get<double>(),
                 s["tolerance_points"].get<double>());
  }
}

void print_tenants(const json& t, std::FILE* out) {
  const auto limits = t["limits"].get<std::vector<int>>();
  const std::string title =
      "Two tenants, limits " + std::to_string(limits[0]) + "% and " + std::to_string(limits[1]) + "%";
  std::fprintf(out, "\n%-36s %-10s %-10s %s\n", title.c_str(), "A", "B", "Jain's index");
  auto line = [&](const char* name, const json& j, const char* jain_note) {
    if (!ok(j)) {
      std::fprintf(out, "  %-34s %s\n", name, error_of(j).c_str());
      return;
    }
    std::fprintf(out, "  %-34s %-10s %-10s %.3f %s\n", name, percent(j["shares"][0].get<double>()).c_str(),
                 percent(j["shares"][1].get<double>()).c_str(), j["jain"].get<double>(), jain_note);
  };
  line("native, no limits", t["native"], "(of shares)");
  line("gpuslice", t["gpuslice"], "(of share/limit)");
  if (ok(t["gpuslice"])) {
    std::fprintf(out, "  B/A ratio %.2f (target %.2f)\n", t["gpuslice"]["ratio"].get<double>(),
                 t["gpuslice"]["target_ratio"].get<double>());
  }
}

void print_noisy(const json& n, std::FILE* out) {
  std::fprintf(out, "\nNoisy neighbour: A alone, then B (no limit) joins\n");
  std::fprintf(out, "  %-34s %-10s %-10s %-10s %s\n", "", "A alone", "A with B", "slowdown", "B");
  auto line = [&](const std::string& name, const json& j) {
    if (!ok(j)) {
      std::fprintf(out, "  %-34s %s\n", name.c_str(), error_of(j).c_str());
      return;
    }
    std::fprintf(out, "  %-34s %-10s %-10s %-10s %s\n", name.c_str(), percent(j["alone_share"].get<double>()).c_str(),
                 percent(j["with_neighbour_share"].get<double>()).c_str(), percent(j["slowdown"].get<double>()).c_str(),
                 percent(j["neighbour_share"].get<double>()).c_str());
  };
  line("native, A unlimited", n["native"]);
  line("gpuslice, A at " + std::to_string(n["limit"].get<int>()) + "%", n["gpuslice"]);
}

}  // namespace

void print_table(const json& report, std::FILE* out) {
  print_header(report, out);
  if (report.contains("launch") || report.contains("memory")) print_latency(report, out);
  if (report.contains("quota")) print_quota(report["quota"], out);
  if (report.contains("compute_sweep")) print_sweep(report["compute_sweep"], out);
  if (report.contains("tenants")) print_tenants(report["tenants"], out);
  if (report.contains("noisy_neighbour")) print_noisy(report["noisy_neighbour"], out);
  if (report.contains("errors") && !report["errors"].empty()) {
    std::fprintf(out, "\n%zu measurement(s) failed; see the error lines above.\n", report["errors"].size());
  }
}

}  // namespace gpuslice::bench
