"""CTest driver for bench/gpu/run.sh --simulated (bench/gpu/CMakeLists.txt).

  python3 bench/gpu/check_simulated.py BUILD OUT [--skip STEP,...]

1. Runs the script's driver-level steps on the simulated driver of BUILD and
   checks each left its result, that gpuslice was in effect where it should be,
   and that the framework steps were skipped with a message saying why.
2. Runs the NVML step with a build tree whose libgpuslice.so is missing (the
   preload silently does nothing) and checks the script reports "not loaded"
   instead of passing: a bypass must not pass as a result.
Run from the repository root.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

MUST_PASS_LOADED = ["bench", "microbench", "nvml", "concurrency"]
MUST_SKIP = ["compute"]


def run_script(args, timeout):
    proc = subprocess.run(["bash", "bench/gpu/run.sh", "--simulated"] + args, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def load(out):
    with open(os.path.join(out, "results.json")) as f:
        return {r["step"]: r for r in json.load(f)["steps"]}


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: check_simulated.py BUILD OUT [--skip STEP,...]")
    build, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    skip = ["conformance"]  # run by CI on its own; nested here it would double the time
    if len(sys.argv) == 5 and sys.argv[3] == "--skip":
        skip += [s for s in sys.argv[4].split(",") if s]
    shutil.rmtree(out, ignore_errors=True)
    problems = []

    code, text = run_script(["--build", build, "--out", out, "--skip", ",".join(skip)], 150)
    steps = load(out)
    with open(os.path.join(out, "summary.md")) as f:
        summary = f.read()
    if "SIMULATED" not in summary.splitlines()[0]:
        problems.append("summary.md's title does not say SIMULATED")
    if not os.path.exists(os.path.join(out, "steps.tar.gz")):
        problems.append("no steps.tar.gz")
    for name in MUST_PASS_LOADED:
        if name in skip:
            continue
        r = steps.get(name, {})
        if r.get("status") != "ok" or r.get("gpuslice_loaded") is not True or r.get("simulated") is not True:
            problems.append("%s: status %s, loaded %s, simulated %s: %s" % (
                name, r.get("status"), r.get("gpuslice_loaded"), r.get("simulated"), r.get("message")))
    if steps.get("facts", {}).get("status") != "ok":
        problems.append("facts: %s" % steps.get("facts"))
    # PyTorch, JAX and CuPy need the CUDA runtime: skipped, saying why; numba-cuda
    # and cuda-core run on the simulated driver where installed, else are skipped.
    fw = steps.get("frameworks", {})
    for name, r in (fw.get("results") or {}).items():
        runtime = name not in ("numba", "cuda_core")
        if (runtime and "skipped: --simulated" not in r.get("note", "")) or \
                (not runtime and r.get("status") not in ("ok", "skipped")):
            problems.append("frameworks/%s: %s: %s" % (name, r.get("status"), r.get("note")))
    if fw.get("status") not in ("ok", "skipped") or len(fw.get("results") or {}) != 7:
        problems.append("frameworks: %s: %s" % (fw.get("status"), fw.get("message")))
    for name in MUST_SKIP:
        r = steps.get(name, {})
        if r.get("status") != "skipped" or "skipped: --simulated" not in r.get("message", ""):
            problems.append("%s: expected a clear skip, got %s: %s" % (name, r.get("status"), r.get("message")))
    if code != 0 and not problems:
        problems.append("run.sh exited %d although every step passed" % code)
    if problems:
        print(text[-6000:])

    # A tree whose library is missing: LD_PRELOAD of a missing file only warns.
    with tempfile.TemporaryDirectory() as bare:
        for sub in ("bin", "fakecuda"):
            os.symlink(os.path.join(build, sub), os.path.join(bare, sub))
        os.mkdir(os.path.join(bare, "lib"))
        bypass_out = os.path.join(out, "bypass")
        code, text = run_script(["--build", bare, "--out", bypass_out, "--only", "nvml"], 60)
        r = load(bypass_out).get("nvml", {})
        if code == 0 or r.get("status") != "fail" or r.get("gpuslice_loaded") is not False:
            problems.append("without libgpuslice.so the nvml step said status %s, loaded %s (expected fail, "
                            "not loaded)" % (r.get("status"), r.get("gpuslice_loaded")))
            print(text[-3000:])

    for p in problems:
        print("FAIL: " + p)
    if not problems:
        print("bench/gpu/run.sh --simulated: every driver-level step ran with gpuslice in effect; "
              "a missing library is reported as not loaded")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
