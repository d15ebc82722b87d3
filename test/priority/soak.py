#!/usr/bin/env python3
"""Node-scale soak on the SIMULATED driver (docs/soak.md), not a GPU.

Many containers on two simulated GPUs (realistic profile), mixed priorities,
memory quotas and SM limits; processes start, exit, are SIGKILLed and exec'd
throughout; the node agent runs and is restarted; `gpuslice-smi set` changes
limits mid-run; a hostile container floods the priority board and corrupts its
own region. Records:
  - memory: what the simulator itself reports per process, summed per
    container and device, never above the container's quota (the largest in
    force during the last 6 s: `smi set` raises it at times). Samples over
    the quota only with the contexts' memory counted are reported apart
    (memory_over_quota_with_contexts, docs/soak.md) and do not fail the run;
    allocations over the quota do;
  - the serving (high) tenants' burst latency p50/p99 (host, ms);
  - the agent's cycle time (its own metric) and resident memory over time;
  - what is left behind at the end: live slots, waiters, board files of the
    tenants, regions (after one agent pass with a 1 s grace).
Exit status 0 when nothing was violated and nothing was left behind.

  test/priority/soak.py --build BUILD [--seconds 300] [--containers 64] [--json FILE]
"""
import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

MI = 1 << 20


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--containers", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--agent-restarts", type=int, default=3)
    ap.add_argument("--json")
    return ap.parse_args()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.build = os.path.abspath(a.build)
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.root = tempfile.mkdtemp(prefix="gpuslice-soak-", dir=base)
        self.board = os.path.join(self.root, "board")
        self.regions = os.path.join(self.root, "regions")
        os.makedirs(self.regions)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GPUSLICE_", "FAKECUDA_", "CUDA_")) and k != "LD_PRELOAD"}
        env.update({"LD_LIBRARY_PATH": os.path.join(self.build, "fakecuda"),
                    "FAKECUDA_STATE": os.path.join(self.root, "fakecuda.state"),
                    "FAKECUDA_DEVICES": "2", "FAKECUDA_PROFILE": "realistic", "FAKECUDA_MEMORY": "80Gi"})
        self.env = env
        self.worker = os.path.join(self.build, "bin", "soak_worker")
        self.containers = []
        for i in range(a.containers):
            hostile = i == a.containers - 1
            prio = "low" if hostile else self.rng.choice(["high", "normal", "normal", "low", "low"])
            c = {"name": "hostile" if hostile else "c%02d" % i, "priority": prio,
                 # Each context holds 512 MiB on the realistic profile, counted in the quota.
                 "quota": self.rng.choice([1024, 1536, 2048]) * MI,
                 "sm": self.rng.choice(["100", "100", "50", "30"]) if prio != "high" else "100",
                 "device": i % 2, "hostile": hostile, "procs": []}
            c["dir"] = os.path.join(self.regions, c["name"])
            os.makedirs(c["dir"])
            c["region"] = os.path.join(c["dir"], "gpuslice.region")
            c["quotas"] = [(0.0, c["quota"])]  # (since, bytes)
            self.containers.append(c)
        self.by_pid = {}
        self.results = []
        self.bad_exits = []
        self.refused_at_start = 0
        self.context_over = []
        self.violations = []
        self.worst = {}
        self.agent = None
        self.agent_samples = []
        self.agent_unexpected_exits = 0
        self.port = free_port()
        self.flood_files = 0
        self.t0 = time.monotonic()

    def now(self):
        return time.monotonic() - self.t0

    # --- processes ---
    def container_env(self, c):
        e = dict(self.env)
        e.update({"LD_PRELOAD": os.path.join(self.build, "lib", "libgpuslice.so"),
                  "GPUSLICE_REGION": c["region"], "GPUSLICE_CONTAINER_NAME": c["name"],
                  "GPUSLICE_MEMORY_LIMIT": str(c["quota"]), "GPUSLICE_SM_LIMIT": c["sm"],
                  "GPUSLICE_PRIORITY": c["priority"], "GPUSLICE_PRIORITY_BOARD": self.board,
                  "GPUSLICE_LOG_LEVEL": "error"})
        return e

    def start(self, c):
        mode = "serve" if c["priority"] == "high" else "train"
        seconds = self.rng.uniform(1.0, 4.0)
        chunk = self.rng.choice([8, 16, 32]) * MI
        kernel = 200 if mode == "serve" else self.rng.choice([200, 1000])
        argv = [self.worker, mode, str(c["device"]), "%.2f" % seconds, str(chunk), str(kernel),
                str(self.rng.randrange(1 << 30))]
        if self.rng.random() < 0.2:  # exec'd: the library is loaded in sh first, then exec replaces it
            argv = ["/bin/sh", "-c", 'exec "$@"', "sh"] + argv
        p = subprocess.Popen(argv, env=self.container_env(c), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        p.container = c
        c["procs"].append(p)
        self.by_pid[p.pid] = c

    def reap(self):
        for c in self.containers:
            for p in list(c["procs"]):
                if p.poll() is None:
                    continue
                out, err = p.communicate()
                c["procs"].remove(p)
                if p.returncode == 0:
                    for line in out.splitlines():
                        if line.startswith("{"):
                            r = json.loads(line)
                            r["container"] = c["name"]
                            r["priority"] = c["priority"]
                            self.results.append(r)
                elif p.returncode in (3, 4):
                    # Refused at start: its context (512 MiB on the realistic
                    # profile) or its module did not fit in what the
                    # container's quota left (out of memory, as documented).
                    self.refused_at_start += 1
                elif p.returncode != -signal.SIGKILL and not c["hostile"]:
                    self.bad_exits.append({"container": c["name"], "rc": p.returncode, "stderr": err[-400:]})

    # --- the agent ---
    def start_agent(self):
        argv = [os.path.join(self.build, "bin", "gpuslice-agent"), "--region-dir", self.regions,
                "--priority-board", self.board, "--interval", "100ms", "--listen", "127.0.0.1:%d" % self.port,
                "--nvml", os.path.join(self.build, "fakecuda", "libnvidia-ml.so.1"), "--log-level", "error"]
        self.agent = subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop_agent(self):
        if self.agent is None:
            return
        self.agent.send_signal(signal.SIGTERM)
        try:
            self.agent.wait(10)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait()
        self.agent = None

    def sample_agent(self):
        if self.agent is None:
            return
        if self.agent.poll() is not None:
            self.agent_unexpected_exits += 1
            self.start_agent()
            return
        rss = 0
        try:
            with open("/proc/%d/status" % self.agent.pid) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) * 1024
        except OSError:
            pass
        cycle = None
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=1) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("gpuslice_agent_cycle_seconds "):
                        cycle = float(line.split()[1])
        except Exception:
            pass
        self.agent_samples.append({"t": round(self.now(), 1), "rss": rss, "cycle_s": cycle})

    # --- checks ---
    def quota_now(self, c):
        # The latest quota, or a larger one set within the last 6 s: memory
        # allocated under it may still be held (a worker lives at most ~4 s)
        # and lowering a quota frees nothing.
        t = self.now()
        return max([c["quotas"][-1][1]] + [q for since, q in c["quotas"] if since >= t - 6.0])

    @staticmethod
    def alive(pid):
        try:
            with open("/proc/%d/stat" % pid) as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def sample_memory(self):
        r = subprocess.run([os.path.join(self.build, "bin", "fakecuda-ctl"), "status"], env=self.env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            return
        used = {}
        allocs = {}
        self.last_procs = {}
        for p in json.loads(r.stdout)["processes"]:
            c = self.by_pid.get(p["host_pid"])
            if c is None or c["hostile"] or not self.alive(p["host_pid"]):
                # A process that exited or was killed (a zombie until this
                # script waits for it) holds no device memory on a GPU: the
                # driver frees it when the process's files close.
                continue
            key = (c["name"], p["device"])
            used[key] = used.get(key, 0) + p["used_bytes"]
            allocs[key] = allocs.get(key, 0) + p["used_bytes"] - p["context_bytes"]
            self.last_procs.setdefault(key, []).append(p)
        for (name, dev), b in used.items():
            c = next(x for x in self.containers if x["name"] == name)
            q = self.quota_now(c)
            self.worst[name] = max(self.worst.get(name, 0.0), b / q)
            if b > q and allocs[(name, dev)] <= q:
                # Over only with the contexts' memory: a context created
                # before the library could refuse it (the container's first
                # on the device is measured after creation, then destroyed
                # if it does not fit; docs/memory.md, "Contexts are admitted
                # before they are created"). Recorded, reported apart.
                self.context_over.append({"t": round(self.now(), 2), "container": name, "used": b, "quota": q})
            elif b > q:
                self.violations.append({"t": round(self.now(), 2), "container": name, "device": dev, "used": b,
                                        "quota": q, "processes": self.last_procs.get((name, dev))})

    # --- the hostile tenant ---
    def flood(self, uuids):
        low = os.path.join(self.board, "low")
        if not os.path.isdir(low) or not uuids:
            return
        for _ in range(200):
            if self.flood_files >= 5000:
                break
            u = self.rng.choice(uuids)
            open(os.path.join(low, "%s.f-%d.act" % (u, self.flood_files)), "w").close()
            self.flood_files += 1

    def corrupt(self):
        c = self.containers[-1]
        try:
            with open(c["region"], "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                for _ in range(16):
                    f.seek(self.rng.randrange(4096, max(4097, size)))
                    f.write(os.urandom(8))
        except OSError:
            pass

    def uuids(self):
        seen = set()
        for level in ("high", "normal", "low"):
            d = os.path.join(self.board, level)
            if os.path.isdir(d):
                for n in os.listdir(d):
                    if n.startswith("GPU-") and ".f-" not in n:
                        seen.add(n.split(".")[0])
        return sorted(seen)

    def smi_set(self):
        c = self.rng.choice(self.containers[:-1])
        smi = os.path.join(self.build, "bin", "gpuslice-smi")
        if self.rng.random() < 0.5:
            raised = c["quota"] * 2
            if subprocess.run([smi, "set", "--region", c["region"], "--memory", str(raised)], env=self.env,
                              capture_output=True).returncode == 0:
                c["quotas"].append((self.now(), raised))
                c["restore_at"] = self.now() + 2.0
        else:
            sm = self.rng.choice(["30", "50", "unlimited"])
            subprocess.run([smi, "set", "--region", c["region"], "--sm-limit", sm], env=self.env, capture_output=True)

    def restore(self):
        smi = os.path.join(self.build, "bin", "gpuslice-smi")
        for c in self.containers:
            if c.get("restore_at") and self.now() >= c["restore_at"]:
                if subprocess.run([smi, "set", "--region", c["region"], "--memory", str(c["quota"])], env=self.env,
                                  capture_output=True).returncode == 0:
                    c["quotas"].append((self.now(), c["quota"]))
                c["restore_at"] = None

    # --- the run ---
    def run(self):
        a = self.a
        self.start_agent()
        restarts = [a.seconds * (k + 1) / (a.agent_restarts + 1) for k in range(a.agent_restarts)]
        next_sample = next_agent = next_smi = next_flood = 0.0
        while self.now() < a.seconds:
            t = self.now()
            self.reap()
            for c in self.containers:
                want = 2 if c["hostile"] else 1 + (self.rng.random() < 0.3)
                while len(c["procs"]) < want:
                    self.start(c)
            if self.rng.random() < 0.05:  # a crash somewhere
                procs = [p for c in self.containers for p in c["procs"]]
                if procs:
                    self.rng.choice(procs).send_signal(signal.SIGKILL)
            if restarts and t >= restarts[0]:
                restarts.pop(0)
                self.stop_agent()
                self.start_agent()
            if t >= next_sample:
                self.sample_memory()
                next_sample = t + 0.25
            if t >= next_agent:
                self.sample_agent()
                next_agent = t + 1.0
            if t >= next_smi:
                self.smi_set()
                next_smi = t + 1.5
            self.restore()
            if t >= next_flood:
                self.flood(self.uuids())
                self.corrupt()
                next_flood = t + 0.5
            time.sleep(0.05)
        # Wind down: no new processes; let them finish (they run at most 4 s).
        deadline = time.monotonic() + 30
        while any(c["procs"] for c in self.containers) and time.monotonic() < deadline:
            self.reap()
            self.sample_memory()
            time.sleep(0.2)
        for c in self.containers:
            for p in c["procs"]:
                p.kill()
        self.reap()
        time.sleep(1.5)  # the agent reaps what killed processes left
        self.sample_agent()
        return self.leftovers()

    def locked(self, path):
        """Whether a live process holds a liveness lock on a board file."""
        import fcntl
        import struct
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            # struct flock: l_type, l_whence, l_start, l_len, l_pid; F_OFD_GETLK = 36.
            req = struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 1 << 20, 0, 0)
            res = fcntl.fcntl(fd, 36, req)
            return struct.unpack("hhqqi4x", res)[0] != fcntl.F_UNLCK
        except OSError:
            return True
        finally:
            os.close(fd)

    def leftovers(self):
        smi = os.path.join(self.build, "bin", "gpuslice-smi")
        r = subprocess.run([smi, "--region-dir", self.regions, "--json"], env=self.env, capture_output=True, text=True)
        slots = waiting = 0
        smi_error = None
        try:
            doc = json.loads(r.stdout)
            for reg in doc.get("regions", []):
                if reg.get("path", "").startswith("hostile/"):
                    continue
                slots += len(reg.get("processes", []))
                for d in reg.get("devices", []):
                    waiting += int(d.get("memory", {}).get("waiting", 0) or 0)
        except (ValueError, TypeError, AttributeError) as e:
            slots = waiting = -1
            smi_error = "%s: %s %s" % (e, r.stdout[:200], r.stderr[:200])
        # Every process has exited: a tenant file still held by someone is a
        # leak; files of killed processes (nobody holds them) wait for a reader
        # or the agent.
        held, stale = [], []
        for level in ("high", "normal", "low"):
            d = os.path.join(self.board, level)
            if os.path.isdir(d):
                for n in os.listdir(d):
                    if ".f-" in n:
                        continue
                    (held if self.locked(os.path.join(d, n)) else stale).append(level + "/" + n)
        self.stop_agent()
        # The agent with a 1 s grace for a few seconds: the regions nobody uses
        # and the stale board files (killed processes', the flood) go.
        agent = subprocess.Popen([os.path.join(self.build, "bin", "gpuslice-agent"), "--region-dir", self.regions,
                                  "--priority-board", self.board, "--grace", "1s", "--interval", "100ms",
                                  "--rescan", "200ms", "--no-nvml", "--listen", "off", "--log-level", "error"],
                                 env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(4)
        agent.send_signal(signal.SIGTERM)
        agent.wait()
        # The hostile container's region is garbage: the agent skips it (logged once), never removes it.
        regions_left = sum(1 for c in self.containers if os.path.exists(c["region"]) and not c["hostile"])
        board_left = sum(len(os.listdir(os.path.join(self.board, l))) for l in ("high", "normal", "low")
                         if os.path.isdir(os.path.join(self.board, l)))
        return {"live_slots": slots, "waiters": waiting, "smi_error": smi_error,
                "tenant_board_files_held_after_exit": held, "tenant_board_files_of_killed_processes": len(stale),
                "regions_after_agent": regions_left, "board_files_after_agent": board_left}

    def report(self, left):
        serve = [r for r in self.results if r["bursts"] > 0]
        p99s = sorted(r["p99_ms"] for r in serve)
        rss = [s["rss"] for s in self.agent_samples if s["rss"]]
        cycles = [s["cycle_s"] for s in self.agent_samples if s["cycle_s"] is not None]
        worst = sorted(self.worst.values())
        out = {
            "simulated": True, "seconds": self.a.seconds, "containers": self.a.containers,
            "processes_completed": len(self.results), "bad_exits": self.bad_exits[:10],
            "bad_exit_count": len(self.bad_exits),
            "memory_violations": self.violations[:10], "memory_violation_count": len(self.violations),
            "memory_over_quota_with_contexts_count": len(self.context_over),
            "memory_over_quota_with_contexts": self.context_over[:5],
            "memory_peak_over_quota_max": worst[-1] if worst else None,
            "memory_peak_over_quota_mean": sum(worst) / len(worst) if worst else None,
            "refusals": sum(r["refusals"] for r in self.results),
            "processes_refused_at_start": self.refused_at_start,
            "launch_errors": sum(r["errors"] for r in self.results),
            "serve_processes": len(serve),
            "serve_p99_ms_median": p99s[len(p99s) // 2] if p99s else None,
            "serve_p99_ms_worst": p99s[-1] if p99s else None,
            "agent_rss_bytes_first_last_max": [rss[0], rss[-1], max(rss)] if rss else None,
            "agent_samples": self.agent_samples,
            "agent_cycle_s_median_max": [sorted(cycles)[len(cycles) // 2], max(cycles)] if cycles else None,
            "agent_unexpected_exits": self.agent_unexpected_exits,
            "flood_files": self.flood_files,
            "leftovers": left,
        }
        ok = (not self.violations and not self.bad_exits and self.agent_unexpected_exits == 0 and
              left["live_slots"] == 0 and left["waiters"] == 0 and not left["tenant_board_files_held_after_exit"] and
              left["regions_after_agent"] == 0 and left["board_files_after_agent"] == 0)
        out["ok"] = ok
        return out


def main():
    a = parse_args()
    s = Soak(a)
    try:
        left = s.run()
        out = s.report(left)
    finally:
        s.stop_agent()
        for c in s.containers:
            for p in c["procs"]:
                p.kill()
        shutil.rmtree(s.root, ignore_errors=True)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
