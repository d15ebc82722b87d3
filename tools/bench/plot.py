#!/usr/bin/env python3
"""SVG plots of a gpuslice-bench JSON report (gpuslice-bench --plots DIR).

  share_over_time.svg       compute share over time against each limit
  priority_latency_cdf.svg  inference burst latency CDF, alone and next to training
  memory_over_time.svg      a container's memory past its resident allowance, spill and wait

Each data series is an SVG group whose id starts with "series-", each limit
line one whose id starts with "limit-" (what the bench's CTest counts). A
figure measured on the simulated driver says so in its title. Exit status 3
when matplotlib cannot be imported (gpuslice-bench names the fix).
"""
import argparse
import json
import os
import sys

MIB = 1 << 20
NO_MATPLOTLIB = 3
PRIORITY_CASES = (
    ("alone_native", "alone, native", "#7f7f7f", ":"),
    ("alone_gpuslice", "alone, gpuslice", "#2ca02c", ":"),
    ("neighbour_native", "next to training, native", "#d62728", "-"),
    ("neighbour_gpuslice", "next to training, gpuslice (high over low)", "#1f77b4", "-"),
)


def where_measured(report):
    """The title's note: simulated driver (and profile), or the GPU's name."""
    if report.get("device") == "simulated":
        note = "simulated driver, %s profile, no GPU" % report.get("profile", "ideal")
    else:
        note = "GPU: %s" % report.get("device_name", "?")
    if report.get("quick"):
        note += "; --quick run"
    return note


def ok(section):
    return isinstance(section, dict) and "error" not in section


def bins(timeline):
    """Bin start times (s) and shares (%) of a worker's timeline, as steps."""
    width = timeline["bin_ns"] / 1e9
    shares = [100.0 * s for s in timeline["shares"]]
    times = [i * width for i in range(len(shares) + 1)]
    return times, shares + shares[-1:]


def plot_share(report, plt):
    """One small panel per limit (its share, dashed: the limit, grey: no
    limit), then one with the two tenants."""
    sweep = report.get("compute_sweep")
    tenants = report.get("tenants")
    tenant_lines = ok(tenants) and ok(tenants.get("gpuslice")) and "timelines" in tenants["gpuslice"]
    if not ok(sweep):
        return None
    points = [p for p in sweep.get("points", []) if ok(p) and "timeline" in p]
    if not points:
        return None
    cells = len(points) + (1 if tenant_lines else 0)
    cols = min(4, cells)
    rows = (cells + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.5 * rows + 0.9), squeeze=False)
    flat = [ax for row in axes for ax in row]
    warmup = sweep.get("warmup_s", 0)
    bin_ms = points[0]["timeline"]["bin_ns"] / 1e6
    for ax, p in zip(flat, points):
        if "native_timeline" in sweep:
            t, y = bins(sweep["native_timeline"])
            ax.step(t, y, where="post", color="0.6", linewidth=0.8, label="no limit (native)",
                    gid="reference-native-%d" % p["limit"])
        t, y = bins(p["timeline"])
        ax.step(t, y, where="post", color="#1f77b4", linewidth=1.4, label="achieved",
                gid="series-limit-%d" % p["limit"])
        ax.axhline(p["limit"], color="#d62728", linestyle="--", linewidth=1.0, label="limit",
                   gid="limit-%d" % p["limit"])
        ax.axvspan(warmup, warmup + sweep["window_s"], color="0.93", zorder=0, label="measurement window")
        ax.set_title("GPUSLICE_SM_LIMIT=%d: %.1f%% in the window" % (p["limit"], 100 * p["share"]), fontsize=9)
        ax.set_ylim(0, 105)
        ax.set_yticks(range(0, 101, 25))
        ax.tick_params(labelsize=7)
    if tenant_lines:
        ax = flat[len(points)]
        for name, timeline, limit, color in zip(("A", "B"), tenants["gpuslice"]["timelines"], tenants["limits"],
                                                ("#1f77b4", "#ff7f0e")):
            t, y = bins(timeline)
            ax.step(t, y, where="post", color=color, linewidth=1.4, label="tenant %s" % name,
                    gid="series-tenant-%s" % name)
            ax.axhline(limit, color=color, linestyle="--", linewidth=1.0, gid="limit-tenant-%s" % name)
        ax.set_title("two containers, %d%% and %d%%, one device" % tuple(tenants["limits"]), fontsize=9)
        ax.set_ylim(0, 105)
        ax.set_yticks(range(0, 101, 25))
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    for ax in flat[cells:]:
        ax.set_visible(False)
    for r in range(rows):
        axes[r][0].set_ylabel("device share (%%, %g ms bins)" % bin_ms, fontsize=8)
    for ax in flat[:cells]:
        ax.set_xlabel("time since start (s)", fontsize=8)
    handles, labels = flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle("Achieved compute share over time against the limit (%s)" % where_measured(report), fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def cdf(samples):
    xs = sorted(samples)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def plot_priority(report, plt):
    priority = report.get("priority")
    if not isinstance(priority, dict):
        return None
    kinds = (("latency_samples_ms", "wall clock: first launch to the synchronize's return"),
             ("device_latency_samples_ms", "device: event before the first kernel to event after the last"))
    if not any(ok(priority.get(case)) and kinds[0][0] in priority[case] for case, _, _, _ in PRIORITY_CASES):
        return None
    from matplotlib.ticker import FuncFormatter
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), sharey=True)
    everything = [v for case, _, _, _ in PRIORITY_CASES if ok(priority.get(case))
                  for key, _ in kinds for v in priority[case].get(key, [])]
    for ax, (key, what) in zip(axes, kinds):
        for case, label, color, style in PRIORITY_CASES:
            result = priority.get(case)
            if not ok(result) or not result.get(key):
                continue
            x, y = cdf(result[key])
            ax.step(x, y, where="post", color=color, linestyle=style, linewidth=1.5,
                    label="%s (p99 %.1f ms)" % (label, x[min(len(x) - 1, round(0.99 * (len(x) - 1)))]),
                    gid="series-%s-%s" % ("wall" if key == "latency_samples_ms" else "device", case))
        ax.set_xscale("log")
        # Room on the right for the legend.
        ax.set_xlim(min(everything) * 0.8, max(everything) * 6)
        plain = FuncFormatter(lambda v, _: "%g" % v)
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: "%g" % v if str("%g" % v)[0] in "25" else ""))
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.set_xlabel("burst latency (ms, log scale)")
        ax.set_title(what, fontsize=9)
        ax.grid(True, which="both", color="0.9", linewidth=0.6)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("fraction of bursts at or below")
    inference = priority.get("inference", {})
    training = priority.get("training", {})
    fig.suptitle("Priority: inference bursts (%s x %s us kernels) alone and next to training (%s us kernels) (%s)"
                 % (inference.get("kernels_per_burst", "?"), inference.get("kernel_us", "?"),
                    training.get("kernel_us", "?"), where_measured(report)), fontsize=10)
    fig.tight_layout()
    return fig


def spans(times, flags):
    """[start, end) time spans where flags are set."""
    out, begin = [], None
    for i, flag in enumerate(flags):
        if flag and begin is None:
            begin = times[i]
        if not flag and begin is not None:
            out.append((begin, times[i]))
            begin = None
    if begin is not None:
        out.append((begin, times[-1]))
    return out


def plot_memory(report, plt):
    from matplotlib.patches import Patch
    section = report.get("oversubscription")
    if not ok(section):
        return None
    cases = [c for c in ("spill", "wait") if ok(section.get(c))]
    if not cases:
        return None
    fig, axes = plt.subplots(1, len(cases), figsize=(6.5 * len(cases), 4.8), sharey=True, squeeze=False)
    for ax, policy in zip(axes[0], cases):
        c = section[policy]
        t = [v / 1000.0 for v in c["t_ms"]]
        counted = [v / MIB for v in c["counted_bytes"]]
        spilled = [v / MIB for v in c["spilled_bytes"]]
        resident = [u - s for u, s in zip(counted, spilled)]
        for begin, end in spans(t, [w > 0 for w in c["waiting"]]):
            ax.axvspan(begin, end, color="#ffe8a8", zorder=0)
        ax.plot(t, counted, color="black", linewidth=1.5, label="counted against the quota", gid="series-%s-counted" % policy)
        ax.plot(t, resident, color="#1f77b4", linewidth=1.5, label="resident: counted - spilled (a waiting\n"
                "allocation is counted while it waits)",
                gid="series-%s-resident" % policy)
        ax.plot(t, spilled, color="#d62728", linewidth=1.5, label="spilled to host memory", gid="series-%s-spilled" % policy)
        if "device_bytes" in c:
            ax.plot(t, [v / MIB for v in c["device_bytes"]], color="#2ca02c", linestyle=":", linewidth=1.8,
                    label="held by the simulated device", gid="series-%s-device" % policy)
        ax.axhline(section["resident_limit_bytes"] / MIB, color="#1f77b4", linestyle="--", linewidth=0.9,
                   label="resident allowance (GPUSLICE_MEMORY_RESIDENT)", gid="limit-%s-allowance" % policy)
        ax.axhline(section["quota_bytes"] / MIB, color="black", linestyle="--", linewidth=0.9,
                   label="quota (GPUSLICE_MEMORY_LIMIT)", gid="limit-%s-quota" % policy)
        handles, _ = ax.get_legend_handles_labels()
        if any(w > 0 for w in c["waiting"]):
            handles.append(Patch(color="#ffe8a8", label="an allocation waiting (GPUSLICE_OVERSUBSCRIBE=wait)"))
        ax.set_xlabel("time since start (s)")
        ax.set_title("GPUSLICE_OVERSUBSCRIBE=%s: grower got %d/%d chunks, %d spills, %d waits"
                     % (policy, c["grower_granted"], section["grower_chunks"], c["spills"], c["waits"]), fontsize=9)
        ax.legend(handles=handles, fontsize=7, loc="upper left")
        ax.set_ylim(0, section["quota_bytes"] / MIB * 1.25)
    axes[0][0].set_ylabel("container memory on device 0 (MiB)")
    fig.suptitle("Memory past a resident allowance: one process allocates %d x %d MiB while another frees %d x %d MiB (%s)"
                 % (section["grower_chunks"], section["chunk_bytes"] // MIB, section["holder_chunks"],
                    section["chunk_bytes"] // MIB, where_measured(report)), fontsize=10)
    fig.tight_layout()
    return fig


PLOTS = (("share_over_time.svg", plot_share), ("priority_latency_cdf.svg", plot_priority),
         ("memory_over_time.svg", plot_memory))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, help="gpuslice-bench JSON report (--json-file)")
    parser.add_argument("--out", required=True, help="directory for the SVG files")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("svg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print("gpuslice-bench-plot: matplotlib is not installed for %s (%s)" % (sys.executable, e), file=sys.stderr)
        return NO_MATPLOTLIB
    # Text as text (searchable, small) and reproducible files: no date, fixed ids.
    matplotlib.rcParams["svg.fonttype"] = "none"
    matplotlib.rcParams["svg.hashsalt"] = "gpuslice-bench"
    try:
        with open(args.report) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        print("gpuslice-bench-plot: cannot read the report %s: %s" % (args.report, e), file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    for name, draw in PLOTS:
        fig = draw(report, plt)
        if fig is None:
            if not args.quiet:
                print("gpuslice-bench-plot: %s: the report has no data for it (section not run or failed)" % name,
                      file=sys.stderr)
            continue
        path = os.path.join(args.out, name)
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)
        if not args.quiet:
            print("gpuslice-bench-plot: wrote %s" % path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
