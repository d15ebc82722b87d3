"""Step `frameworks`: each framework under GPUSLICE_MEMORY_LIMIT=4Gi in a process
of its own, filling device memory until the framework's own out-of-memory error.

  python3 bench/gpu/memory_steps.py frameworks --build B --work W --budget S [--simulated]
  python3 bench/gpu/memory_steps.py probe NAME     (internal: one framework, one JSON line)

Every probe reports what the framework says the device total is, what the
driver says in the same process (cuMemGetInfo through the preloaded library:
total == quota is the proof that gpuslice was in effect), how much it could
allocate (usable/quota: below 1 by the context memory gpuslice charges), and
the exception it got at the quota. Frameworks are imported lazily: a missing
one is reported as "skipped: <framework> not installed".
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import cudrv  # noqa: E402
from common import GIB, MIB  # noqa: E402

QUOTA = "4Gi"
QUOTA_BYTES = 4 * GIB
CHUNK = 64 * MIB
FINE = 2 * MIB
# An unenforced quota must not fill an 80 GiB card: stop well past the quota.
CEILING = 2 * QUOTA_BYTES + 256 * MIB

PROBES = [
    # name, extra environment, what it exercises
    ("torch", {}, "PyTorch caching allocator (cudaMalloc)"),
    ("torch_expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
     "PyTorch expandable segments (VMM: cuMemCreate/cuMemMap)"),
    ("torch_async", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
     "PyTorch cudaMallocAsync backend (stream-ordered pool)"),
    ("jax", {}, "JAX default preallocation (75% of the visible total)"),
    ("cupy", {}, "CuPy default memory pool"),
    ("numba", {}, "numba-cuda device arrays"),
    ("cuda_core", {}, "cuda-core Device.allocate (device memory resource, pool)"),
]


def fill(alloc, is_oom):
    """Allocates CHUNK, then FINE pieces until the framework refuses; returns
    (held objects, record)."""
    held, usable, record = [], 0, {"oom": None}
    start = time.monotonic()
    for size in (CHUNK, FINE):
        while usable + size <= CEILING:
            try:
                held.append(alloc(size))
            except Exception as e:  # the framework's own error type, checked below
                if not is_oom(e):
                    raise
                record["oom"] = "%s: %s" % (type(e).__module__ + "." + type(e).__name__, str(e).strip()[:300])
                break
            usable += size
    record.update({"usable_bytes": usable, "usable_over_quota": round(usable / QUOTA_BYTES, 4),
                   "hit_ceiling": usable + FINE > CEILING, "fill_s": round(time.monotonic() - start, 2)})
    return held, record


def driver_view():
    """cuMemGetInfo in this process, through whatever the loader gives ctypes."""
    try:
        free, total = cudrv.Driver().open().mem_info()
        return {"driver_total": total, "driver_free": free}
    except Exception as e:
        return {"driver_error": "%s: %s" % (type(e).__name__, e)}


def oom_text(e):
    text = str(e).lower()
    return "out of memory" in text or "out_of_memory" in text or "resource_exhausted" in text


def probe_torch():
    torch = common.lazy_import("torch")
    if torch is None:
        return {"skipped": "torch not installed"}
    if not torch.cuda.is_available():
        return {"error": "torch.cuda.is_available() is False"}
    free, total = torch.cuda.mem_get_info()
    out = {"framework_total": total, "framework_free_before": free, "version": torch.__version__,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    out.update(driver_view())
    held, record = fill(lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"),
                        lambda e: isinstance(e, torch.cuda.OutOfMemoryError))
    out.update(record)
    out["oom_is_torch_OutOfMemoryError"] = record["oom"] is not None and "OutOfMemoryError" in record["oom"]
    out["reserved_at_oom"] = torch.cuda.memory_reserved()
    # The process must stay usable after the refusal.
    del held[-8:]
    x = torch.ones(1 << 20, device="cuda")
    out["healthy_after_oom"] = float(x.sum().item()) == float(1 << 20)
    return out


def probe_jax():
    jax = common.lazy_import("jax")
    if jax is None:
        return {"skipped": "jax not installed"}
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if not devices:
        return {"error": "JAX sees no GPU (devices: %s)" % jax.devices()}
    import jax.numpy as jnp
    stats = devices[0].memory_stats() or {}
    out = {"version": jax.__version__, "bytes_limit": stats.get("bytes_limit"),
           "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "default (true)")}
    if stats.get("bytes_limit"):
        out["bytes_limit_over_quota"] = round(stats["bytes_limit"] / QUOTA_BYTES, 4)
    out.update(driver_view())
    if "driver_total" in out:
        out["driver_used_after_prealloc"] = out["driver_total"] - out["driver_free"]

    def alloc(n):
        return jnp.zeros((n,), dtype=jnp.uint8).block_until_ready()

    held, record = fill(alloc, oom_text)
    out.update(record)
    return out


def probe_cupy():
    cp = common.lazy_import("cupy")
    if cp is None:
        return {"skipped": "cupy not installed"}
    free, total = cp.cuda.runtime.memGetInfo()
    out = {"version": cp.__version__, "framework_total": total, "framework_free_before": free}
    out.update(driver_view())
    pool = cp.get_default_memory_pool()
    held, record = fill(lambda n: cp.empty(n, dtype=cp.uint8),
                        lambda e: isinstance(e, cp.cuda.memory.OutOfMemoryError))
    out.update(record)
    out["pool_total_bytes"] = pool.total_bytes()
    del held
    pool.free_all_blocks()
    out["framework_free_after_release"] = cp.cuda.runtime.memGetInfo()[0]
    return out


def probe_numba():
    numba_cuda = common.lazy_import("numba.cuda")
    if numba_cuda is None:
        return {"skipped": "numba-cuda not installed"}
    import numpy as np
    free, total = numba_cuda.current_context().get_memory_info()
    out = {"framework_total": total, "framework_free_before": free}
    out.update(driver_view())
    held, record = fill(lambda n: numba_cuda.device_array(n, dtype=np.uint8), oom_text)
    out.update(record)
    return out


def probe_cuda_core():
    core = common.lazy_import("cuda.core")
    if core is None:
        return {"skipped": "cuda-core not installed"}
    Device = getattr(core, "Device", None)
    if Device is None:
        Device = common.lazy_import("cuda.core.experimental").Device
    device = Device(0)
    device.set_current()
    stream = device.create_stream()
    out = {"memory_resource": type(device.memory_resource).__name__}
    out.update(driver_view())
    held, record = fill(lambda n: device.allocate(n, stream=stream), oom_text)
    stream.sync()
    out.update(record)
    return out


# These reach the driver API directly (no libcudart), so they also run on the
# simulated driver under --simulated, when installed.
DRIVER_API_ONLY = ("numba", "cuda_core")

PROBE_FUNCS = {"torch": probe_torch, "torch_expandable": probe_torch, "torch_async": probe_torch,
               "jax": probe_jax, "cupy": probe_cupy, "numba": probe_numba, "cuda_core": probe_cuda_core}


def judge(name, r):
    """(status, loaded, note) of one probe's record."""
    if "skipped" in r:
        return "skipped", None, "skipped: " + r["skipped"]
    if "error" in r:
        return "fail", None, r["error"]
    totals = [r.get(k) for k in ("driver_total", "framework_total") if r.get(k) is not None]
    loaded = bool(totals) and all(t == QUOTA_BYTES for t in totals)
    problems = []
    if not loaded:
        problems.append("total seen %s, not the quota %d" % (totals, QUOTA_BYTES))
    if r.get("hit_ceiling") or r.get("usable_bytes", 0) > QUOTA_BYTES:
        problems.append("allocated past the quota")
    if r.get("oom") is None:
        problems.append("no out-of-memory error")
    if name.startswith("torch") and not r.get("oom_is_torch_OutOfMemoryError"):
        problems.append("not torch.cuda.OutOfMemoryError")
    if name.startswith("torch") and not r.get("healthy_after_oom"):
        problems.append("unusable after the refusal")
    return ("ok" if not problems else "fail"), loaded, "; ".join(problems)


def step_frameworks(step):
    results, statuses, loaded_list = {}, [], []
    for index, (name, extra, what) in enumerate(PROBES):
        if step.simulated and name not in DRIVER_API_ONLY:
            results[name] = {"status": "skipped", "what": what, "note": "skipped: --simulated: needs the real CUDA "
                             "runtime, which cannot run on the simulated driver (no cuGetExportTable)"}
            statuses.append("skipped")
            continue
        timeout = min(90.0, step.left() / (len(PROBES) - index)) - 1
        if timeout < 8:
            results[name] = {"status": "timeout", "note": "no time left in the step's budget", "what": what}
            statuses.append("timeout")
            continue
        env = step.gpuslice_env("fw-" + name, GPUSLICE_MEMORY_LIMIT=QUOTA, **extra)
        if step.simulated:
            env["FAKECUDA_MEMORY"] = "80Gi"  # the quota, not the simulated device, must refuse
        code, out, err = common.run([sys.executable, os.path.abspath(__file__), "probe", name], env, timeout,
                                    log=os.path.join(step.scratch, name + ".log"))
        record = common.last_json_line(out) or {"error": "exit %s, no result: %s" % (
            "timeout" if code is None else code, common.tail(err, 6))}
        status, loaded, note = judge(name, record)
        if code is None:
            status = "timeout"
        record.update({"status": status, "gpuslice_loaded": loaded, "note": note, "what": what})
        results[name] = record
        statuses.append(status)
        if loaded is not None:
            loaded_list.append(loaded)
    ran = [s for s in statuses if s != "skipped"]
    status = "skipped" if not ran else ("ok" if all(s == "ok" for s in ran) else "fail")
    loaded = all(loaded_list) if loaded_list else None
    grouped = {}
    for n, r in results.items():
        if r["status"] != "ok":
            grouped.setdefault(r["note"], []).append(n)
    bad = ["%s: %s" % (", ".join(names), note) for note, names in grouped.items()]
    return step.finish(status, results, loaded,
                       "cuMemGetInfo (driver) and the framework's own total == 4Gi in %d/%d probes"
                       % (sum(loaded_list), len(loaded_list)), message="; ".join(bad)[:600])


def probe_main(name):
    try:
        record = PROBE_FUNCS[name]()
    except Exception as e:
        import traceback
        record = {"error": "%s: %s" % (type(e).__name__, str(e)[:400]), "traceback": traceback.format_exc()[-1500:]}
    record["preloaded"] = common.library_mapped()
    common.emit(record)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "probe" and sys.argv[2] in PROBE_FUNCS:
        sys.exit(probe_main(sys.argv[2]))
    sys.exit(common.main_dispatch({"frameworks": step_frameworks}))
