#!/usr/bin/env python3
"""CTest gpuslice_bench_plots: the SVG files that `gpuslice-bench --quick
--plots DIR` wrote (the gpuslice_bench_quick run) exist, parse as SVG, hold
as many data series and limit lines as the JSON report of the same run has
data for, and say "simulated driver" when the run was on the simulator.
Exits 77 (skipped) when the bench's Python has no matplotlib: then no plots
were made, and gpuslice_bench_quick ran without --plots.

  check_plots.py --python <bench's python> --report <report.json> --dir <DIR>
"""
import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

SKIP = 77
SVG_NS = "{http://www.w3.org/2000/svg}"


def ok(section):
    return isinstance(section, dict) and "error" not in section


def expected(report):
    """{file: (series, limit lines)} from what the report holds."""
    out = {}
    sweep = report["compute_sweep"]
    points = [p for p in sweep["points"] if ok(p) and "timeline" in p]
    series = len(points)
    limits = len(points)
    tenants = report.get("tenants", {})
    if ok(tenants.get("gpuslice")) and "timelines" in tenants["gpuslice"]:
        series += 2
        limits += 2
    out["share_over_time.svg"] = (series, limits)
    cases = [c for c in ("alone_native", "alone_gpuslice", "neighbour_native", "neighbour_gpuslice")
             if ok(report["priority"].get(c))]
    out["priority_latency_cdf.svg"] = (sum(bool(report["priority"][c].get(k)) for c in cases
                                           for k in ("latency_samples_ms", "device_latency_samples_ms")), 0)
    o = report["oversubscription"]
    policies = [p for p in ("spill", "wait") if ok(o.get(p))]
    out["memory_over_time.svg"] = (sum(3 + ("device_bytes" in o[p]) for p in policies), 2 * len(policies))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    probe = subprocess.run([args.python, "-c", "import matplotlib"], capture_output=True) \
        if os.access(args.python, os.X_OK) else None
    if probe is None or probe.returncode != 0:
        print("SKIPPED: no matplotlib for %s (tools/setup.sh <build> installs it into <build>/venv from "
              "tools/bench/requirements.txt): gpuslice-bench --plots cannot draw here" % args.python)
        return SKIP
    with open(args.report) as f:
        report = json.load(f)
    failures = []
    for name, (series, limits) in expected(report).items():
        path = os.path.join(args.dir, name)
        if not os.path.isfile(path):
            failures.append("%s: missing" % path)
            continue
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:
            failures.append("%s: not XML: %s" % (path, e))
            continue
        if root.tag != SVG_NS + "svg":
            failures.append("%s: root element is %s, expected an SVG <svg>" % (path, root.tag))
            continue
        ids = [e.get("id", "") for e in root.iter()]
        got_series = sum(i.startswith("series-") for i in ids)
        got_limits = sum(i.startswith("limit-") for i in ids)
        if (got_series, got_limits) != (series, limits) or series == 0:
            failures.append("%s: %d series and %d limit lines, expected %d and %d (from the report)"
                            % (path, got_series, got_limits, series, limits))
        text = " ".join("".join(e.itertext()) for e in root.iter(SVG_NS + "text"))
        if report.get("device") == "simulated" and "simulated driver" not in text:
            failures.append("%s: measured on the simulated driver but its text never says so" % path)
        print("%s: %d series, %d limit lines" % (name, got_series, got_limits))
    for f in failures:
        print("FAIL: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
