"""Step `compute`: a PyTorch training-like loop (a small transformer's forward,
backward and AdamW step) natively, under gpuslice without a compute limit, at
GPUSLICE_SM_LIMIT 25/50/75, two such processes at 30 and 60 at once, and a
CUDA-graph-captured forward loop natively and at 50%.

  python3 bench/gpu/compute_steps.py compute --build B --work W --budget S [--simulated]
  python3 bench/gpu/compute_steps.py loop --mode train|graph --warmup S --seconds S [--barrier DIR --parties N]

The figure is the median step time over the measurement window; its ratio to
the native median should be 100/limit (4x, 2x, 1.33x) and the unlimited run's
overhead under 1%. The gpuslice runs also carry GPUSLICE_MEMORY_LIMIT=64Gi,
far above what the loop uses, so that torch.cuda.mem_get_info() showing 64 GiB
proves the library was in effect.
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import GIB  # noqa: E402

CHECK_QUOTA = "64Gi"
CHECK_QUOTA_BYTES = 64 * GIB


def build_model(torch, graph):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d=1024, heads=16):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(a)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)]).cuda()
    x = torch.randn(16, 256, 1024, device="cuda")
    if graph:
        model = model.to(torch.bfloat16).eval()
        static_x = x.to(torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            model(static_x)
        return g.replay
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def loop_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["train", "graph"], default="train")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--barrier", default="")
    parser.add_argument("--parties", type=int, default=1)
    args = parser.parse_args(argv)
    torch = common.lazy_import("torch")
    if torch is None:
        common.emit({"skipped": "torch not installed"})
        return 0
    free, total = torch.cuda.mem_get_info()
    step = build_model(torch, args.mode == "graph")
    end = time.monotonic() + args.warmup
    while time.monotonic() < end:
        step()
        torch.cuda.synchronize()
    if args.barrier:  # keep running until every party is warm, then measure together
        open(os.path.join(args.barrier, "ready.%d" % os.getpid()), "w").close()
        give_up = time.monotonic() + 60
        while len(os.listdir(args.barrier)) < args.parties and time.monotonic() < give_up:
            step()
            torch.cuda.synchronize()
    times = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if not times:
        common.emit({"error": "no step finished in the %.1f s window" % args.seconds})
        return 1
    times.sort()
    common.emit({"mode": args.mode, "steps": len(times), "median_ms": statistics.median(times) * 1e3,
                 "p10_ms": times[len(times) // 10] * 1e3, "p90_ms": times[(len(times) * 9) // 10] * 1e3,
                 "total": total, "free_before": free, "preloaded": common.library_mapped(),
                 "device": torch.cuda.get_device_name(0)})
    return 0


def step_compute(step):
    if step.simulated:
        return step.finish("skipped", message="skipped: --simulated: PyTorch needs the real CUDA runtime; "
                           "the simulated compute limiter is measured by gpuslice-bench's sweep")
    if importlib.util.find_spec("torch") is None:  # the probes import it; this process need not
        return step.finish("skipped", message="skipped: torch not installed")
    # 7 process slots, each about 14 s of import, CUDA and cuBLAS start-up and
    # warm-up before its window (the pair runs side by side).
    window = max(2.0, min(8.0, step.left() / 7 - 14))
    warmup = 2.0
    me = os.path.abspath(__file__)
    loop = [sys.executable, me, "loop", "--warmup", str(warmup), "--seconds", str(window)]
    runs = {}

    def start(tag, env, mode="train", barrier=None, parties=1):
        argv = loop + ["--mode", mode]
        if barrier:
            argv += ["--barrier", barrier, "--parties", str(parties)]
        log = open(os.path.join(step.scratch, tag + ".log"), "w")
        proc = common.spawn(argv, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True)
        return proc, log

    def collect(tag, proc, log, timeout):
        try:
            out, _ = proc.communicate(timeout=max(5, timeout))
        except subprocess.TimeoutExpired:
            common.kill_group(proc)
            out, _ = proc.communicate()
            runs[tag] = {"error": "timeout"}
            return
        finally:
            log.close()
        runs[tag] = common.last_json_line(out) or {"error": "exit %s, see %s.log" % (proc.returncode, tag)}

    def one(tag, env, mode="train"):
        if step.left() < window + 15:
            runs[tag] = {"error": "no time left in the step's budget"}
            return
        proc, log = start(tag, env, mode)
        collect(tag, proc, log, min(step.left() - 2, window + 50))

    def limited(tag, sm, **extra):
        env = step.gpuslice_env("compute-" + tag, GPUSLICE_MEMORY_LIMIT=CHECK_QUOTA, **extra)
        if sm is not None:
            env["GPUSLICE_SM_LIMIT"] = str(sm)
        return env

    one("native", step.native_env())
    one("unlimited", limited("unlimited", None))
    for sm in (25, 50, 75):
        one("sm%d" % sm, limited("sm%d" % sm, sm))
    one("graph_native", step.native_env(), "graph")
    one("graph_sm50", limited("graph_sm50", 50), "graph")
    if step.left() > window + 25:
        barrier = os.path.join(step.scratch, "barrier")
        os.makedirs(barrier, exist_ok=True)
        pair = [("pair_sm30", 30), ("pair_sm60", 60)]
        procs = [(tag,) + start(tag, limited(tag, sm), barrier=barrier, parties=2) for tag, sm in pair]
        for tag, proc, log in procs:
            collect(tag, proc, log, min(step.left() - 2, window + 50))
    else:
        runs["pair_sm30"] = runs["pair_sm60"] = {"error": "no time left in the step's budget"}
    return report(step, runs, window)


def report(step, runs, window):
    expected = {"unlimited": 1.0, "sm25": 4.0, "sm50": 2.0, "sm75": 100 / 75, "pair_sm30": 100 / 30,
                "pair_sm60": 100 / 60, "graph_sm50": 2.0}
    table, loaded_list = [], []
    for tag, r in runs.items():
        row = {"run": tag, "median_ms": r.get("median_ms"), "steps": r.get("steps"), "error": r.get("error")}
        base = runs.get("graph_native" if tag.startswith("graph") else "native", {})
        if r.get("median_ms") and base.get("median_ms") and tag in expected:
            row["ratio"] = round(r["median_ms"] / base["median_ms"], 3)
            row["ideal"] = round(expected[tag], 3)
            row["error_pct"] = round((row["ratio"] / expected[tag] - 1) * 100, 1)
        if tag not in ("native", "graph_native") and "total" in r:
            row["total_seen"] = r["total"]
            loaded_list.append(r["total"] == CHECK_QUOTA_BYTES)
        table.append(row)
    overhead = next((row.get("error_pct") for row in table if row["run"] == "unlimited"), None)
    errors = [row["run"] for row in table if row["error"]]
    loaded = all(loaded_list) if loaded_list else None
    status = "ok" if not errors and loaded else "fail"
    return step.finish(status, {"window_s": window, "runs": table, "unlimited_overhead_pct": overhead,
                                "raw": runs}, loaded,
                       "torch.cuda.mem_get_info total == 64Gi in %d/%d gpuslice runs"
                       % (sum(loaded_list), len(loaded_list)),
                       message="failed runs: %s" % ", ".join(errors) if errors else "")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "loop":
        try:
            sys.exit(loop_main(sys.argv[2:]))
        except Exception as e:  # one JSON line either way: the step reads it
            common.emit({"error": "%s: %s" % (type(e).__name__, str(e)[:400])})
            raise
    sys.exit(common.main_dispatch({"compute": step_compute}))
