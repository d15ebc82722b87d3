#!/usr/bin/env python3
"""A real Prometheus server scrapes a running gpuslice-agent.

Usage: prometheus_test.py BUILD_DIR SOURCE_DIR PROMETHEUS

On the simulated GPU: four containers (one limited and refused, one spilling
to host memory, a high-priority one and a low-priority one beside it) and a
fifth whose process is SIGKILLed. Debian's Prometheus, on loopback, scrapes
the agent every second with deploy/prometheus/gpuslice-rules.yaml loaded; the
test then asks Prometheus's HTTP API, as a dashboard or an alert would:

- the documented series exist with the labels container, region, device,
  uuid and pod_uid, and the values the containers caused;
- counters never decrease over the run (no resets);
- the rules load and evaluate without error;
- the killed container's series go stale once the agent has removed its
  region (docs/agent.md: a region nobody uses for --grace is removed).
- a container whose region file's name is not UTF-8 blinds nobody: every
  scrape stays up, and its series carry the name escaped (docs/security.md).

Exit 77 (skipped) without the prometheus binary.
"""
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

MI = 1 << 20
PODS = {
    "limited": "11111111-2222-4333-8444-555555555501",
    "spiller": "11111111-2222-4333-8444-555555555502",
    "serving": "11111111-2222-4333-8444-555555555503",
    "training": "11111111-2222-4333-8444-555555555504",
    "victim": "11111111-2222-4333-8444-555555555505",
    "hostile": "11111111-2222-4333-8444-555555555506",
}
HOSTILE_NAME = b"\xff\xfe.region"  # renamed so by its container: a name Prometheus cannot take as it is
COUNTERS = ["gpuslice_oom_refusals_total", "gpuslice_launches_total", "gpuslice_priority_held_seconds_total",
            "gpuslice_throttled_seconds_total", "gpuslice_agent_cycles_total"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def eventually(what, predicate, seconds):
    deadline = time.time() + seconds
    last = None
    while time.time() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (OSError, ValueError, KeyError) as e:
            last = e
        time.sleep(0.25)
    raise AssertionError(f"timed out after {seconds} s waiting for {what} (last: {last!r})")


class Prom:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def query(self, q):
        body = json.loads(get(f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": q})))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def values(self, q):
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in self.query(q)}

    def one(self, q):
        r = self.query(q)
        return float(r[0]["value"][1]) if len(r) == 1 else None


def main():
    build, source, prometheus = (os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3])
    if not prometheus or not os.access(prometheus, os.X_OK):
        print("prometheus not found: skipped (tools/setup.sh installs Debian's prometheus package)")
        return 77
    tmp = tempfile.mkdtemp(prefix="gpuslice-prom-")
    procs = []
    probes = {}
    try:
        env = dict(os.environ, FAKECUDA_STATE=f"{tmp}/fakecuda.state", LD_LIBRARY_PATH=f"{build}/fakecuda")
        board = f"{tmp}/board"
        agent_port, prom_port = free_port(), free_port()
        regions = pathlib.Path(tmp, "regions")
        for name, pod in PODS.items():
            (regions / pod).mkdir(parents=True)

        agent = subprocess.Popen([f"{build}/bin/gpuslice-agent", "--region-dir", str(regions), "--interval", "100ms",
                                  "--rescan", "200ms", "--grace", "1s", "--listen", f"127.0.0.1:{agent_port}",
                                  "--nvml", f"{build}/fakecuda/libnvidia-ml.so.1", "--priority-board", board],
                                 env=env, stdout=open(f"{tmp}/agent.log", "w"), stderr=subprocess.STDOUT)
        procs.append(agent)

        def container(name, ops, **options):
            penv = dict(env, LD_PRELOAD=f"{build}/lib/libgpuslice.so", GPUSLICE_CONTAINER_NAME=name,
                        GPUSLICE_REGION=f"{regions}/{PODS[name]}/{name}.region", GPUSLICE_PRIORITY_BOARD=board,
                        **options)
            p = subprocess.Popen([f"{build}/bin/cuprobe", "init", "ctx", "0", *ops], env=penv,
                                 stdout=open(f"{tmp}/{name}.out", "w"), stderr=subprocess.STDOUT)
            procs.append(p)
            probes[name] = p
            return p

        end = f"{tmp}/end"
        container("limited", ["alloc", str(48 * MI), "alloc", str(32 * MI), "waitfile", end],
                  GPUSLICE_MEMORY_LIMIT="64Mi")
        container("spiller", ["alloc", str(16 * MI), "alloc", str(64 * MI), "waitfile", end],
                  GPUSLICE_MEMORY_LIMIT="256Mi", GPUSLICE_OVERSUBSCRIBE="spill", GPUSLICE_MEMORY_RESIDENT="32Mi")
        # The serving container launches first; the training one starts while
        # it is active and is held.
        container("serving", ["function", "spin_500us", "launch", "20000", "waitfile", end], GPUSLICE_PRIORITY="high",
                  GPUSLICE_SM_LIMIT="90")
        container("training", ["sleep", "500", "function", "spin_500us", "launch", "20000", "waitfile", end],
                  GPUSLICE_PRIORITY="low")
        container("victim", ["alloc", str(8 * MI), "waitfile", end], GPUSLICE_MEMORY_LIMIT="32Mi")
        hostile_ready = f"{tmp}/hostile.ready"
        container("hostile", ["alloc", str(4 * MI), "touch", hostile_ready, "waitfile", end],
                  GPUSLICE_MEMORY_LIMIT="16Mi")
        eventually("the hostile container's region", lambda: os.path.exists(hostile_ready), 30)
        hostile_dir = os.fsencode(regions / PODS["hostile"])
        os.rename(hostile_dir + b"/hostile.region", hostile_dir + b"/" + HOSTILE_NAME)

        config = pathlib.Path(tmp, "prometheus.yml")
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(pathlib.Path(source, "deploy", "prometheus", "gpuslice-rules.yaml"))],
            "scrape_configs": [{"job_name": "gpuslice-agent",
                                "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
        }))
        prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                                stdout=open(f"{tmp}/prometheus.log", "w"), stderr=subprocess.STDOUT)
        procs.append(prom)
        p = Prom(prom_port)
        eventually("Prometheus ready", lambda: "Ready" in get(f"{p.base}/-/ready"), 60)
        eventually("a successful scrape of the agent", lambda: p.one('up{job="gpuslice-agent"}') == 1, 60)

        # The series the containers caused, with their labels.
        eventually("the limited container's refusal",
                   lambda: (p.one('gpuslice_oom_refusals_total{container="limited"}') or 0) >= 1, 60)
        assert p.one('gpuslice_memory_quota_bytes{container="limited"}') == 64 * MI
        assert p.one('gpuslice_memory_counted_bytes{container="limited"}') == 48 * MI
        eventually("spilled memory", lambda: (p.one('gpuslice_memory_spilled_bytes{container="spiller"}') or 0) > 0, 30)
        assert p.one('gpuslice_memory_resident_limit_bytes{container="spiller"}') == 32 * MI
        # The hold's length depends on how the two launch streams interleave
        # (test/priority measures it); here: the series are there for both.
        eventually("the priority series of both tenants", lambda: all(
            p.one(f'gpuslice_priority_held_seconds_total{{container="{c}"}}') is not None
            for c in ("serving", "training")), 30)
        assert p.one('gpuslice_priority_level{container="serving"}') == 3
        assert p.one('gpuslice_priority_level{container="training"}') == 1
        assert p.one('gpuslice_sm_limit_percent{container="serving"}') == 90
        eventually("launches counted", lambda: (p.one('gpuslice_launches_total{container="serving"}') or 0) > 0, 30)
        for r in p.query("gpuslice_memory_used_bytes"):
            labels = r["metric"]
            for label in ("container", "region", "device", "uuid", "pod_uid"):
                assert labels.get(label), f"gpuslice_memory_used_bytes without '{label}': {labels}"
            assert labels["pod_uid"] == PODS[labels["container"]], labels
            assert labels["uuid"].startswith("GPU-"), labels
        # The hostile name: scraped (escaped), and every other container's series with it.
        hostile = eventually("the series of the region named with bytes that are not UTF-8",
                             lambda: [r for r in p.query('gpuslice_memory_quota_bytes{container="hostile"}')
                                      if "xff" in r["metric"]["region"]], 30)
        assert hostile[0]["metric"]["region"] == f"{PODS['hostile']}/\\xff\\xfe.region", hostile
        assert float(hostile[0]["value"][1]) == 16 * MI, hostile
        assert p.one('gpuslice_memory_quota_bytes{container="limited"}') == 64 * MI
        assert p.one('up{job="gpuslice-agent"}') == 1
        for name in ("gpuslice_agent_cycle_seconds", "gpuslice_agent_regions", "gpuslice_device_sm_utilization_ratio"):
            assert p.query(name), f"no series {name}"

        # Rules: loaded, evaluated, healthy.
        rules = json.loads(get(f"{p.base}/api/v1/rules"))["data"]["groups"]
        evaluated = [r for g in rules for r in g["rules"]]
        assert len(evaluated) >= 15, f"only {len(evaluated)} rules loaded"
        eventually("every rule evaluated without error", lambda: all(
            r.get("health") == "ok" for g in json.loads(get(f"{p.base}/api/v1/rules"))["data"]["groups"]
            for r in g["rules"]), 30)
        ratio = eventually("the recording rule's series",
                           lambda: p.one('gpuslice:memory_used:ratio{container="limited"}'), 30)
        assert abs(ratio - 0.75) < 1e-9, ratio  # 48 of 64 MiB

        # A killed process: its container's series go stale once the agent reaps
        # the slot and removes the unused region (--grace 1s here).
        assert p.query('gpuslice_memory_used_bytes{container="victim"}')
        probes["victim"].send_signal(signal.SIGKILL)
        probes["victim"].wait()
        eventually("the killed container's series to go stale",
                   lambda: not p.query('gpuslice_memory_used_bytes{container="victim"}'), 60)
        assert p.query('gpuslice_memory_used_bytes{container="limited"}'), "a live container's series went away"

        # Counters only grow over everything scraped so far.
        time.sleep(2)
        for c in COUNTERS:
            resets = p.values(f"resets({c}[5m])")
            assert resets, f"no samples of {c}"
            assert all(v == 0 for v in resets.values()), f"{c} decreased: {resets}"
        series = len(p.query('{__name__=~"gpuslice_.+"}'))
        print(f"prometheus scraped {int(p.one('count(up)') or 0)} target(s); {series} gpuslice series; "
              f"{len(evaluated)} rules ok")
        return 0
    except AssertionError as e:
        print("FAIL:", e)
        for log in ("agent.log", "prometheus.log", *[f"{n}.out" for n in PODS]):
            path = pathlib.Path(tmp, log)
            if path.exists():
                print(f"--- {log} (last lines)\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return 1
    finally:
        pathlib.Path(tmp, "end").touch()
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
