"""Step `concurrency`: 16 processes of one container (one region, one 8 GiB
quota) allocate, free and launch kernels at once through the driver API; the
parent, not under the library, watches the device with NVML the whole time.

  python3 bench/gpu/concurrency.py concurrency --build B --work W --budget S [--simulated]
  python3 bench/gpu/concurrency.py worker SECONDS BARRIER   (internal: one process)

Passes when no process hangs or fails, every process that got a context saw
the quota as the device total, the processes' memory as NVML reports it never
exceeded the quota, and after they exit NVML shows none of them and the
device's used memory is back where it started. Runs on the real driver and on
the simulated one (ctypes only, no framework).
"""

import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import cudrv  # noqa: E402
from common import GIB, MIB  # noqa: E402

PROCESSES = 16
QUOTA = "8Gi"
QUOTA_BYTES = 8 * GIB
CHUNK = 64 * MIB
MAX_HELD = 16  # 1 GiB per process: 16 GiB asked of an 8 GiB quota
# The simulated device resembles the card: big enough that the quota, not the
# device, refuses; contexts that hold memory, as real ones do.
SIMULATED_DEVICE = {"FAKECUDA_MEMORY": "80Gi", "FAKECUDA_CONTEXT_MEMORY": "300Mi"}


def arrive(barrier):
    """Every worker creates its context before any allocates: then a refused
    context means the contexts alone did not fit, not that others were faster."""
    open(os.path.join(barrier, "ready.%d" % os.getpid()), "w").close()
    give_up = time.monotonic() + 30
    while len(os.listdir(barrier)) < PROCESSES and time.monotonic() < give_up:
        time.sleep(0.01)


def worker_main(seconds, barrier):
    record = {"pid": os.getpid(), "allocs": 0, "refusals": 0, "launches": 0, "max_held_bytes": 0}
    try:
        drv = cudrv.Driver().open()
    except cudrv.CudaError as e:
        record["context"] = "refused: " + e.name  # a context the quota cannot hold is refused, not a failure
        arrive(barrier)
        common.emit(record)
        return 0
    arrive(barrier)
    try:
        record["total_seen"] = drv.mem_info()[1]
        drv.load_spin()
        held, rng = [], random.Random(os.getpid())
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if len(held) < MAX_HELD and rng.random() < 0.7:
                ptr = drv.alloc(CHUNK)
                if ptr is None:
                    record["refusals"] += 1
                    if held:
                        drv.free(held.pop(rng.randrange(len(held))))
                else:
                    record["allocs"] += 1
                    held.append(ptr)
            elif held:
                drv.free(held.pop(rng.randrange(len(held))))
            record["max_held_bytes"] = max(record["max_held_bytes"], len(held) * CHUNK)
            for _ in range(4):
                drv.launch_spin()
            drv.synchronize()
            record["launches"] += 4
        for ptr in held:
            drv.free(ptr)
    except Exception as e:
        record["error"] = "%s: %s" % (type(e).__name__, e)
    common.emit(record)
    return 0 if "error" not in record else 1


class Watcher:
    """NVML from outside the container: device used memory and the workers' own."""

    def __init__(self, step):
        if step.simulated:
            os.environ["FAKECUDA_STATE"] = step.base_env()["FAKECUDA_STATE"]
            os.environ.update(SIMULATED_DEVICE)
            self.nvml = cudrv.Nvml(os.path.join(step.fake_dir, "libnvidia-ml.so.1"))
        else:
            self.nvml = cudrv.Nvml()
        self.baseline = self.nvml.memory()["used"]
        self.max_sum = 0
        self.max_delta = 0
        self.unavailable = False
        self.samples = 0

    def sample(self, pids):
        procs = self.nvml.processes()
        ours = [procs[p] for p in pids if p in procs]
        if any(v is None for v in ours):
            self.unavailable = True
        self.max_sum = max(self.max_sum, sum(v for v in ours if v is not None))
        self.max_delta = max(self.max_delta, self.nvml.memory()["used"] - self.baseline)
        self.samples += 1
        return procs


def step_concurrency(step):
    seconds = 20.0 if not step.simulated else 4.0
    seconds = min(seconds, max(2.0, step.left() - 20))
    env = step.gpuslice_env("concurrency", GPUSLICE_MEMORY_LIMIT=QUOTA)
    if step.simulated:
        env.update(SIMULATED_DEVICE)
    watcher = Watcher(step)  # creates the simulated machine before the workers, with its size
    me = os.path.abspath(__file__)
    barrier = os.path.join(step.scratch, "barrier")
    os.makedirs(barrier, exist_ok=True)
    procs = [common.spawn([sys.executable, me, "worker", str(seconds), barrier], env=env, stdout=subprocess.PIPE,
                          stderr=open(os.path.join(step.scratch, "worker%d.log" % i), "w"),
                          stdin=subprocess.DEVNULL, text=True)
             for i in range(PROCESSES)]
    pids = [p.pid for p in procs]
    deadline = time.monotonic() + seconds + 45  # start-up, the barrier (30 s at most), the window
    hung = []
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or step.left() < 3:
            hung = [p.pid for p in procs if p.poll() is None]
            for p in procs:
                common.kill_group(p)
            break
        watcher.sample(pids)
        time.sleep(0.02)
    records = []
    for p in procs:
        out = p.communicate()[0]
        records.append(common.last_json_line(out) or {"pid": p.pid, "error": "exit %s, no result" % p.returncode})
    # Memory must come back: NVML shows none of the workers, used back to baseline.
    settle_end = time.monotonic() + min(10.0, max(1.0, step.left() - 2))
    while True:
        procs_now = watcher.nvml.processes()
        left_over = [p for p in pids if p in procs_now]
        used_delta = watcher.nvml.memory()["used"] - watcher.baseline
        if (not left_over and abs(used_delta) <= 16 * MIB) or time.monotonic() > settle_end:
            break
        time.sleep(0.1)
    watcher.nvml.close()

    with_context = [r for r in records if "total_seen" in r]
    failed = [r for r in records if "error" in r]
    seen_quota = [r["total_seen"] == QUOTA_BYTES for r in with_context]
    watched = watcher.max_delta if watcher.unavailable else watcher.max_sum
    results = {
        "processes": PROCESSES, "seconds": seconds, "quota_bytes": QUOTA_BYTES, "chunk_bytes": CHUNK,
        "with_context": len(with_context), "contexts_refused": sum(1 for r in records if "context" in r),
        "failed": len(failed), "hung": hung,
        "allocs": sum(r.get("allocs", 0) for r in records), "refusals": sum(r.get("refusals", 0) for r in records),
        "launches": sum(r.get("launches", 0) for r in records),
        "nvml_samples": watcher.samples, "nvml_max_workers_sum_bytes": watcher.max_sum,
        "nvml_per_process_unavailable": watcher.unavailable, "nvml_max_device_used_delta_bytes": watcher.max_delta,
        "after_left_over_pids": left_over, "after_used_delta_bytes": used_delta,
        "errors": [r["error"] for r in failed][:4],
    }
    problems = []
    if hung:
        problems.append("%d processes hung" % len(hung))
    if failed:
        problems.append("%d processes failed" % len(failed))
    if not with_context:
        problems.append("no process got a context")
    if not all(seen_quota):
        problems.append("a process saw a total other than the quota")
    if watched > QUOTA_BYTES:
        problems.append("NVML saw %d bytes > quota" % watched)
    if results["refusals"] == 0:
        problems.append("the quota never refused (16 GiB asked of 8 GiB)")
    if left_over or abs(used_delta) > 16 * MIB:
        problems.append("memory not back after exit (%d pids, %+d bytes)" % (len(left_over), used_delta))
    if watcher.samples == 0:
        problems.append("NVML never sampled")
    loaded = bool(with_context) and all(seen_quota)
    return step.finish("ok" if not problems else "fail", results, loaded,
                       "cuMemGetInfo total == 8Gi in %d/%d processes with a context"
                       % (sum(seen_quota), len(with_context)), message="; ".join(problems))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        sys.exit(worker_main(float(sys.argv[2]), sys.argv[3]))
    sys.exit(common.main_dispatch({"concurrency": step_concurrency}))
