"""Gathers the steps' JSON files of one run into <out>/results.json and a
markdown <out>/summary.md. Run by run.sh after every step, so that a run cut
short still leaves a summary of what finished.

  python3 bench/gpu/summary.py --work W --out O --steps facts,bench,... [--simulated] [--started EPOCH]
"""

import argparse
import json
import os
import sys
import time

GIB = 1 << 30


def load(work, steps):
    records = []
    for name in steps:
        path = os.path.join(work, name + ".json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    records.append(json.load(f))
                continue
            except ValueError as e:
                records.append({"step": name, "status": "error", "message": "unreadable JSON: %s" % e})
                continue
        records.append({"step": name, "status": "pending", "message": "not run (yet)"})
    return records


def fmt(value, pattern="%s"):
    return "—" if value is None else pattern % value


def loaded_text(record):
    value = record.get("gpuslice_loaded")
    return {True: "yes", False: "**NO**", None: "n/a"}[value] if value in (True, False, None) else str(value)


def bench_lines(results):
    labels = [("launch_added_ns", "launch %+.1f ns"), ("alloc_added_ns", "alloc %+.1f ns"),
              ("quota_shared_over_bytes", "racing processes over the quota by %s bytes"),
              ("sweep_mean_abs_error_points", "sweep mean |error| %.2f pt"),
              ("sweep_max_abs_error_points", "max %.2f pt"), ("tenants_jain", "two-tenant Jain %.3f"),
              ("noisy_slowdown", "noisy-neighbour slowdown %.3f"),
              ("p99_ratio_native", "inference p99 next to training / alone: native %.2fx"),
              ("p99_ratio_gpuslice", "gpuslice %.2fx"), ("training_harvest_gpuslice", "training harvest %.3f")]
    lines = []
    for tag, r in results.items():
        if not isinstance(r, dict) or "device" not in r:
            lines.append("- `%s`: %s" % (tag, r.get("error") if isinstance(r, dict) else r))
            continue
        parts = [pattern % r[key] for key, pattern in labels if r.get(key) is not None]
        if r.get("quota_accuracy"):
            parts.append("quota usable/quota " + ", ".join(fmt(a, "%.4f") for a in r["quota_accuracy"]))
        if r.get("sweep_points"):
            parts.append("%s us kernels: " % r.get("sweep_kernel_us") + ", ".join(
                "%s%%→%s" % (p["limit"], fmt(p["share"] and round(p["share"] * 100, 1)))
                for p in r["sweep_points"]))
        lines.append("- `%s` on %s (%s): %s%s" % (tag, r.get("device_name"), r.get("device"), "; ".join(parts),
                                                  " — " + r["error"] if r.get("error") else ""))
    return lines


def frameworks_lines(results):
    lines = ["| probe | status | total seen (driver / framework) | usable/quota | error at the quota | note |",
             "|---|---|---|---:|---|---|"]
    for name, r in results.items():
        totals = "%s / %s" % (fmt(r.get("driver_total") and round(r["driver_total"] / GIB, 3), "%s GiB"),
                              fmt(r.get("framework_total") and round(r["framework_total"] / GIB, 3), "%s GiB"))
        extra = ""
        if r.get("bytes_limit_over_quota") is not None:
            extra = " (JAX bytes_limit %.3f of the quota)" % r["bytes_limit_over_quota"]
        lines.append("| %s | %s | %s | %s | %s | %s%s |" % (
            name, r.get("status"), totals, fmt(r.get("usable_over_quota"), "%.4f"),
            (r.get("oom") or "—").replace("|", "/").replace("\n", " ")[:90], r.get("note", ""), extra))
    return lines


def compute_lines(results):
    lines = ["| run | median step (ms) | ratio vs native | ideal | error | note |", "|---|---:|---:|---:|---:|---|"]
    for row in results.get("runs", []):
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            row["run"], fmt(row.get("median_ms"), "%.3f"), fmt(row.get("ratio"), "%.3f"), fmt(row.get("ideal"), "%.3f"),
            fmt(row.get("error_pct"), "%+.1f%%"), row.get("error") or ""))
    return lines


def concurrency_lines(r):
    return ["- %s processes for %s s under one %.0f GiB quota: %s with a context (%s refused), %s failed, "
            "hung %s; %s allocations, %s refusals, %s launches" % (
                r.get("processes"), r.get("seconds"), r.get("quota_bytes", 0) / GIB, r.get("with_context"),
                r.get("contexts_refused"), r.get("failed"), r.get("hung"), r.get("allocs"), r.get("refusals"),
                r.get("launches")),
            "- NVML from outside (%s samples): workers' max sum %.3f GiB%s, device used max +%.3f GiB; after exit: "
            "%s pids left, used %+d bytes vs before" % (
                r.get("nvml_samples"), r.get("nvml_max_workers_sum_bytes", 0) / GIB,
                " (per-process figures not available)" if r.get("nvml_per_process_unavailable") else "",
                r.get("nvml_max_device_used_delta_bytes", 0) / GIB, len(r.get("after_left_over_pids", [])),
                r.get("after_used_delta_bytes", 0))]


def render(records, simulated, started):
    facts = next((r for r in records if r["step"] == "facts"), {}).get("results", {})
    lines = ["# gpuslice real-GPU evidence run" + (" — SIMULATED DRIVER, NOT A GPU" if simulated else ""), ""]
    if simulated:
        lines += ["**Simulated:** every figure below comes from the simulated driver (test/fakecuda); "
                  "none is a GPU measurement.", ""]
    lines += ["- when: %s UTC" % time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
              "- device: %s" % (facts.get("nvidia_smi_query") or facts.get("device") or "?"),
              "- CUDA (driver): %s; nvcc: %s; torch: %s" % (
                  facts.get("cuda_driver_version"), facts.get("nvcc"), (facts.get("torch") or {}).get("torch")),
              "- gpuslice commit: %s" % (facts.get("build_commit") or facts.get("source_commit")),
              "", "| step | status | gpuslice loaded | evidence | duration (s) | message |",
              "|---|---|---|---|---:|---|"]
    for r in records:
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            r["step"], r.get("status"), loaded_text(r), (r.get("loaded_evidence") or "").replace("|", "/"),
            fmt(r.get("duration_s")), (r.get("message") or "").replace("|", "/").replace("\n", " ")[:300]))
    for r in records:
        results = r.get("results") or {}
        if r.get("status") in ("pending", "skipped", "error") or not results:
            continue
        if r["step"] == "bench":
            lines += ["", "## gpuslice-bench", ""] + bench_lines(results)
        elif r["step"] == "frameworks":
            lines += ["", "## Frameworks under GPUSLICE_MEMORY_LIMIT=4Gi", ""] + frameworks_lines(results)
        elif r["step"] == "compute":
            lines += ["", "## Compute (PyTorch loop, window %s s; unlimited overhead %s%%)" % (
                results.get("window_s"), fmt(results.get("unlimited_overhead_pct"))), ""] + compute_lines(results)
        elif r["step"] == "concurrency":
            lines += ["", "## Concurrency smoke", ""] + concurrency_lines(results)
        elif r["step"] == "conformance":
            lines += ["", "## Conformance tests", "", "```", results.get("output_tail", "")[-1500:], "```"]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", required=True)
    parser.add_argument("--simulated", action="store_true")
    parser.add_argument("--started", type=float, default=time.time())
    args = parser.parse_args()
    records = load(args.work, [s for s in args.steps.split(",") if s])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json.tmp"), "w") as f:
        json.dump({"simulated": args.simulated, "started": args.started, "steps": records}, f, indent=2,
                  default=str)
        f.write("\n")
    os.replace(os.path.join(args.out, "results.json.tmp"), os.path.join(args.out, "results.json"))
    with open(os.path.join(args.out, "summary.md.tmp"), "w") as f:
        f.write(render(records, args.simulated, args.started))
    os.replace(os.path.join(args.out, "summary.md.tmp"), os.path.join(args.out, "summary.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
