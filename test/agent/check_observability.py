#!/usr/bin/env python3
"""The alert rules and the Grafana dashboard in deploy/ against the agent.

Usage: check_observability.py BUILD_DIR SOURCE_DIR PROMTOOL

- Every metric a rule or a dashboard query names is one the agent exports
  (read from `gpuslice-agent --once`, not from a list kept here), and every
  recording rule a query names is defined: no dashboard drifting from the code.
- Every dashboard query is valid PromQL (promtool parses it as a rule, with
  Grafana's variables substituted).
- `promtool check rules` and `promtool test rules` pass.
- `promtool check metrics` passes on a live exposition of a container holding
  memory (naming conventions, HELP/TYPE, units in names).

Exit 77 (skipped) without promtool (tools/setup.sh installs Debian's prometheus).
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import yaml

METRIC = re.compile(r"\b(gpuslice_[a-z0-9_]+)\b")
RECORDED = re.compile(r"\b([a-z_]+:[a-z0-9_:]+)\b")
failures = []


def fail(what):
    failures.append(what)
    print("FAIL:", what)


def exported_families(build):
    with tempfile.TemporaryDirectory() as empty:
        out = subprocess.run(
            [f"{build}/bin/gpuslice-agent", "--once", "--no-nvml", "--region-dir", empty,
             "--listen", "off", "--priority-board", ""],
            check=True, capture_output=True, text=True, timeout=60).stdout
    return {line.split()[2] for line in out.splitlines() if line.startswith("# TYPE ")}


def grafana_to_promql(expr):
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?[a-z_]+\}?", ".*", expr)


def dashboard_queries(dash):
    """(where, PromQL) for every panel target and templating query."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"panel '{p.get('title')}' {t.get('refId')}", t["expr"]))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v.get("type") == "query" and q:
            m = re.fullmatch(r"label_values\((.*),\s*[a-z_]+\)", q.strip())
            out.append((f"variable '{v['name']}'", m.group(1) if m else q))
    return out


def unknown_names(where, expr, families, recorded):
    return ([f"{where}: '{n}' is not a metric gpuslice-agent exports" for n in METRIC.findall(expr) if n not in families]
            + [f"{where}: recording rule '{n}' is not defined in deploy/prometheus"
               for n in RECORDED.findall(expr) if n not in recorded])


def check_names(where, expr, families, recorded):
    for problem in unknown_names(where, expr, families, recorded):
        fail(problem)


def live_exposition(build, tmp):
    """One container holding memory and refused once, seen by one agent cycle."""
    env = dict(os.environ, FAKECUDA_STATE=f"{tmp}/fakecuda.state", LD_LIBRARY_PATH=f"{build}/fakecuda")
    regions = pathlib.Path(tmp, "regions", "0b7b9c4e-7d1f-4b5a-9c1e-2f3a4b5c6d7e")
    regions.mkdir(parents=True)
    probe_env = dict(env, LD_PRELOAD=f"{build}/lib/libgpuslice.so", GPUSLICE_REGION=f"{regions}/trainer.region",
                     GPUSLICE_CONTAINER_NAME="trainer", GPUSLICE_MEMORY_LIMIT="64Mi")
    ready, end = f"{tmp}/ready", f"{tmp}/end"
    probe = subprocess.Popen([f"{build}/bin/cuprobe", "init", "ctx", "0", "alloc", str(48 << 20), "alloc",
                              str(32 << 20), "touch", ready, "waitfile", end], env=probe_env,
                             stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while not os.path.exists(ready) and time.time() < deadline and probe.poll() is None:
            time.sleep(0.02)
        text = subprocess.run([f"{build}/bin/gpuslice-agent", "--once", "--nvml", f"{build}/fakecuda/libnvidia-ml.so.1",
                               "--region-dir", f"{tmp}/regions", "--listen", "off", "--priority-board", ""],
                              env=env, check=True, capture_output=True, text=True, timeout=60).stdout
    finally:
        pathlib.Path(end).touch()
        probe.wait(timeout=30)
    return text


def main():
    build, source, promtool = sys.argv[1:4]
    if not promtool or not os.access(promtool, os.X_OK):
        print("promtool not found: skipped (tools/setup.sh installs Debian's prometheus package)")
        return 77
    prom_dir = pathlib.Path(source, "deploy", "prometheus")
    rules_file = prom_dir / "gpuslice-rules.yaml"
    dash = json.loads(pathlib.Path(source, "deploy", "grafana", "gpuslice-dashboard.json").read_text())
    families = exported_families(build)
    if len(families) < 20:
        fail(f"the agent's exposition lists only {len(families)} metric families")

    rules = yaml.safe_load(rules_file.read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    for g in rules["groups"]:
        for r in g["rules"]:
            check_names(f"rule '{r.get('record') or r.get('alert')}'", r["expr"], families, recorded)

    queries = dashboard_queries(dash)
    if len(queries) < 10:
        fail(f"the dashboard has only {len(queries)} queries")
    for where, q in queries:
        check_names(where, q, families, recorded)

    # The checker itself must be able to fail: a made-up name is caught.
    if len(unknown_names("self-test", "rate(gpuslice_no_such_metric_total[5m]) + gpuslice:no_such:rule",
                         families, recorded)) != 2:
        print("FAIL: the name check did not catch a made-up metric and rule")
        return 1

    with tempfile.TemporaryDirectory() as tmp:
        as_rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(q)} for i, (_, q) in enumerate(queries)]}]}
        path = pathlib.Path(tmp, "dashboard-queries.yaml")
        path.write_text(yaml.safe_dump(as_rules))
        r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            fail("dashboard queries are not valid PromQL:\n" + r.stdout + r.stderr)

        for args, cwd in (([promtool, "check", "rules", str(rules_file)], None),
                          ([promtool, "test", "rules", "gpuslice-rules.test.yaml"], prom_dir)):
            r = subprocess.run(args, capture_output=True, text=True, cwd=cwd)
            print(r.stdout.strip())
            if r.returncode != 0:
                fail(" ".join(args[1:]) + " failed:\n" + r.stdout + r.stderr)

        text = live_exposition(build, tmp)
        if 'gpuslice_oom_refusals_total{container="trainer"' not in text or "gpuslice_memory_quota_bytes{" not in text:
            fail("the live exposition lacks the container's series:\n" + text)
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        if r.returncode != 0 or r.stdout.strip() or r.stderr.strip():
            fail("promtool check metrics:\n" + r.stdout + r.stderr)

    print(f"{len(families)} exported families; {len(recorded)} recording rules; {len(queries)} dashboard queries")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
