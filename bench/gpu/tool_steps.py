"""The steps that run built programs: machine facts, the simulator conformance
tests, gpuslice-bench, gpuslice-microbench, and NVML / nvidia-smi under the
library. Each writes <work>/<step>.json (common.Step.finish).

  python3 bench/gpu/tool_steps.py STEP --build B --work W --budget S [--simulated]
"""

import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import GIB, MIB  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
QUOTA = "4Gi"
QUOTA_BYTES = 4 * GIB


def probe(step, name, env, timeout=30):
    code, out, err = common.run([sys.executable, os.path.join(HERE, "probes.py"), name], env, timeout,
                                log=os.path.join(step.scratch, "probes.log"))
    record = common.last_json_line(out)
    if record is None:
        record = {"error": "probe %s printed no result (exit %s): %s" % (name, code, common.tail(err, 5))}
    return record


def git_commit(source):
    if shutil.which("git") is None:
        return None
    code, out, _ = common.run(["git", "-C", source, "rev-parse", "HEAD"], None, 10)
    return out.strip() if code == 0 and out.strip() else None


# --- facts ---------------------------------------------------------------------

def step_facts(step):
    facts = {"uname": os.uname().release, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    with open("/proc/cpuinfo") as cpuinfo:
        facts["cpu"] = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    commit_file = os.path.join(step.build, "COMMIT")
    facts["build_commit"] = open(commit_file).read().strip() if os.path.exists(commit_file) else None
    facts["source_commit"] = git_commit(step.args.source)
    # Do the carried binaries run here (glibc, libstdc++)?
    code, out, err = common.run([step.bin("gpuslice-bench"), "--version"], step.base_env(), 20)
    facts["binaries_run"] = code == 0
    if code != 0:
        facts["binaries_error"] = common.tail(out + err, 8)
        ldd = shutil.which("ldd")
        if ldd:
            facts["ldd"] = common.tail(common.run([ldd, step.bin("gpuslice-bench")], None, 10)[1], 20)
    facts["driver_api"] = probe(step, "driver", step.native_env())
    if step.simulated:
        facts["device"] = "simulated driver (test/fakecuda), no GPU"
    else:
        smi = shutil.which("nvidia-smi")
        if smi:
            code, out, err = common.run([smi, "--query-gpu=name,driver_version,memory.total,memory.used,"
                                        "compute_cap,clocks.max.sm,mig.mode.current",
                                         "--format=csv,noheader"], None, 20)
            facts["nvidia_smi_query"] = out.strip() or err.strip()
            code, out, err = common.run([smi], None, 20)
            match = re.search(r"CUDA Version:\s*([0-9.]+)", out)
            facts["cuda_driver_version"] = match.group(1) if match else None
            facts["nvidia_smi"] = common.tail(out, 30)
            code, out, _ = common.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                                      None, 20)
            facts["other_compute_processes"] = out.strip()
        else:
            facts["nvidia_smi_query"] = "nvidia-smi not found"
        nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc")
                                         else None)
        if nvcc:
            out = common.run([nvcc, "--version"], None, 20)[1]
            facts["nvcc"] = out.strip().splitlines()[-1] if out.strip() else None
        facts["python_packages"] = package_versions()
        code, out, err = common.run([sys.executable, "-c", "import torch, json; print(json.dumps({'torch': "
                                     "torch.__version__, 'cuda': torch.version.cuda, 'available': "
                                     "torch.cuda.is_available()}))"], step.native_env(), min(60, step.left()))
        facts["torch"] = common.last_json_line(out) or {"error": common.tail(err, 3)}
    problems = []
    if "error" in facts["driver_api"]:
        problems.append("driver API: " + facts["driver_api"]["error"])
    elif not step.simulated and "fakecuda" in facts["driver_api"].get("name", ""):
        problems.append("the libcuda.so.1 found is the simulated driver: nothing here is a GPU figure")
    if not facts["binaries_run"]:
        problems.append("the built programs do not run here (see binaries_error, ldd)")
    return step.finish("fail" if problems else "ok", facts, None, message="; ".join(problems))


def package_versions():
    from importlib import metadata
    out = {}
    for name in ("torch", "jax", "jaxlib", "jax-cuda13-plugin", "cupy-cuda13x", "numba", "numba-cuda", "cuda-core",
                 "cuda-bindings", "triton", "nvidia-ml-py"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# --- conformance -----------------------------------------------------------------

def step_conformance(step):
    ctest = shutil.which("ctest")
    if ctest is None:
        return step.finish("skipped", message="skipped: ctest not installed")
    if not os.path.exists(os.path.join(step.build, "CTestTestfile.cmake")):
        return step.finish("skipped", message="skipped: %s holds no CTest files" % step.build)
    if os.path.exists(os.path.join(step.build, "ORIGIN")):
        # A carried bundle (pack.sh): its discovered test lists must look newer
        # than the programs, or CTest rediscovers them with the build machine's
        # CMake modules, which are not here.
        for folder, _, files in os.walk(step.build):
            for name in files:
                if name.endswith("_tests.cmake"):
                    os.utime(os.path.join(folder, name))
    def count(selection):
        code, out, err = common.run([ctest, "--test-dir", step.build, "-N"] + selection, step.base_env(), 30)
        match = re.search(r"Total Tests:\s*(\d+)", out)
        return (int(match.group(1)) if match else 0), common.tail(out + err, 5)

    # By label; by name if no test carries the label (gtest_discover_tests of
    # CMake 3.25 splits a list of LABELS given in its PROPERTIES).
    selection = ["-L", "conformance"]
    listed, listing = count(selection)
    if listed == 0:
        selection = ["-R", "Conformance"]
        listed, listing = count(selection)
    if listed == 0:
        return step.finish("skipped", {"listing": listing},
                           message="skipped: no conformance test (label 'conformance' or name 'Conformance') "
                           "in this build")
    env = step.base_env()
    env.pop("FAKECUDA_STATE", None)
    if not step.simulated:
        env["GPUSLICE_TEST_REAL_DRIVER"] = "1"
    per_test = max(10, int(step.left() - 10))
    code, out, err = common.run([ctest, "--test-dir", step.build, "--output-on-failure", "--timeout", str(per_test)]
                                + selection, env, step.left() - 3, log=os.path.join(step.scratch, "ctest.log"))
    summary = re.search(r"(\d+)% tests passed, (\d+) tests? failed out of (\d+)", out)
    results = {"listed": listed, "selection": " ".join(selection), "real_driver": not step.simulated, "exit": code,
               "skipped_tests": len(re.findall(r"\*\*\*Skipped", out)),
               "output_tail": common.tail(out, 40)}
    if summary:
        results.update({"failed": int(summary.group(2)), "total": int(summary.group(3))})
    if code is None:
        return step.finish("timeout", results, message="ctest ran past the step's budget")
    message = "" if code == 0 else "%s of %s conformance tests failed" % (results.get("failed", "?"),
                                                                         results.get("total", listed))
    if results["skipped_tests"]:
        message = (message + "; " if message else "") + "%d skipped (see output_tail)" % results["skipped_tests"]
    return step.finish("ok" if code == 0 else "fail", results, message=message)


# --- gpuslice-bench ------------------------------------------------------------------

def bench_summary(report):
    """The figures docs/results-gpu.md tabulates, from one gpuslice-bench report."""
    def get(*path):
        node = report
        for key in path:
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and isinstance(key, int) and key < len(node):
                node = node[key]
            else:
                return None
        return node

    out = {"device": report.get("device"), "device_name": report.get("device_name"),
           "errors": len(report.get("errors", []))}
    for name, section, field in (("launch_added_ns", "launch", "call_ns"), ("alloc_added_ns", "memory", "alloc_ns")):
        native, wrapped = get(section, "native", field), get(section, "gpuslice", field)
        if isinstance(native, (int, float)) and isinstance(wrapped, (int, float)):
            out[name] = round(wrapped - native, 1)
    out["quota_accuracy"] = [row.get("accuracy") for row in get("quota", "single") or []]
    out["quota_shared_over_bytes"] = get("quota", "shared", "over_quota_bytes")
    out["sweep_kernel_us"] = get("compute_sweep", "kernel_us")
    out["sweep_mean_abs_error_points"] = get("compute_sweep", "mean_abs_error_points")
    out["sweep_max_abs_error_points"] = get("compute_sweep", "max_abs_error_points")
    out["sweep_points"] = [{"limit": p.get("limit"), "share": p.get("share"), "verdict": p.get("verdict")}
                           for p in get("compute_sweep", "points") or []]
    out["tenants_jain"] = get("tenants", "gpuslice", "jain")
    out["noisy_slowdown"] = get("noisy_neighbour", "gpuslice", "slowdown")
    return out


def quota_loaded(report):
    """gpuslice was in effect if cuMemGetInfo showed each quota as the total."""
    rows = (report.get("quota") or {}).get("single") or []
    seen = [(row.get("quota_bytes"), row.get("total_seen")) for row in rows if "total_seen" in row]
    if not seen:
        return None, "no quota row to check"
    loaded = all(quota == total for quota, total in seen)
    return loaded, "cuMemGetInfo total == quota in %d/%d quota runs" % (
        sum(quota == total for quota, total in seen), len(seen))


# One invocation per part, so that a part that runs long loses only itself;
# weights share the step's budget (what a part leaves unused goes to the next).
BENCH_PARTS = [
    ("overhead", ["--only", "launch,memory,quota"], 20),
    ("sweep-1ms", ["--only", "sweep"], 30),
    ("isolation", ["--only", "tenants,noisy"], 20),
    ("priority", ["--only", "priority"], 20),  # where this gpuslice-bench has the section
    ("sweep-50us", ["--only", "sweep", "--kernel-us", "50", "--window", "1.0"], 24),
]


def priority_summary(section):
    """p99 latency of the inference tenant next to training over its p99 alone."""
    def p99(case):
        return ((section.get(case) or {}).get("latency") or {}).get("p99_ms")

    out = {}
    for side in ("native", "gpuslice"):
        alone, shared = p99("alone_" + side), p99("neighbour_" + side)
        if alone and shared:
            out["p99_ratio_" + side] = round(shared / alone, 3)
    harvest = (section.get("neighbour_gpuslice") or {}).get("harvest")
    if harvest is not None:
        out["training_harvest_gpuslice"] = round(harvest, 4)
    return out


def step_bench(step):
    driver = "simulated" if step.simulated else "real"
    results, statuses, loaded_all, evidence = {}, [], [], []
    help_text = common.run([step.bin("gpuslice-bench"), "--help"], step.base_env(), 20)[1]
    parts = [p for p in BENCH_PARTS if p[0] != "priority" or "priority" in help_text]
    for index, (tag, extra, weight) in enumerate(parts):
        if step.simulated:
            extra = ["--quick"] + [a for a in extra if a not in ("--window", "1.0")]
        path = os.path.join(step.scratch, "bench-%s.json" % tag)
        timeout = step.left() * weight / sum(w for _, _, w in parts[index:]) - 1
        if timeout < 5:
            results[tag] = {"error": "not run: no time left in the step's budget"}
            statuses.append("timeout")
            continue
        code, out, err = common.run([step.bin("gpuslice-bench"), "--driver", driver, "--quiet", "--json-file", path]
                                    + extra, step.base_env(), timeout, log=os.path.join(step.scratch, "bench.log"))
        if not os.path.exists(path):
            results[tag] = {"exit": code, "error": ("timeout after %.0fs" % timeout) if code is None else
                            (common.tail(err, 10) or "no report written")}
            statuses.append("timeout" if code is None else "fail")
            continue
        with open(path) as f:
            report = json.load(f)
        results[tag] = {k: v for k, v in bench_summary(report).items() if v not in (None, [])}
        if isinstance(report.get("priority"), dict):
            results[tag].update(priority_summary(report["priority"]))
        results[tag]["exit"] = code
        results[tag]["table"] = out[-6000:]
        loaded, why = quota_loaded(report)
        if loaded is not None:
            loaded_all.append(loaded)
            evidence.append("%s: %s" % (tag, why))
        wrong_device = report.get("device") != ("simulated" if step.simulated else "gpu")
        if wrong_device:
            results[tag]["error"] = "ran on %s, expected %s" % (report.get("device"), driver)
        statuses.append("ok" if code == 0 and not wrong_device else "fail")
    loaded = all(loaded_all) if loaded_all else None
    status = "ok" if all(s == "ok" for s in statuses) and loaded is not False else \
        ("timeout" if "timeout" in statuses else "fail")
    return step.finish(status, results, loaded, "; ".join(evidence) or "no quota run finished",
                       message="" if status == "ok" else "parts: %s" % ", ".join(
                           "%s %s" % (tag, st) for (tag, _, _), st in zip(parts, statuses)))


# --- gpuslice-microbench -----------------------------------------------------------------

def driver_folder(step, found):
    """gpuslice-microbench starts its children with LD_LIBRARY_PATH set to the
    folder of --driver alone: give it a folder holding links to the real driver,
    the real NVML and the libraries the bundle carries (syslib/: libbenchmark)."""
    folder = os.path.join(step.scratch, "driver")
    os.makedirs(folder, exist_ok=True)
    links = {"libcuda.so.1": found["path"]}
    if found.get("nvml_path"):
        links["libnvidia-ml.so.1"] = found["nvml_path"]
    syslib = os.path.join(step.build, "syslib")
    if os.path.isdir(syslib):
        links.update({name: os.path.join(syslib, name) for name in os.listdir(syslib)})
    for name, target in links.items():
        os.symlink(target, os.path.join(folder, name))
    return os.path.join(folder, "libcuda.so.1")


def step_microbench(step):
    argv = [step.bin("gpuslice-microbench"), "--json-file", os.path.join(step.scratch, "microbench.json")]
    if step.simulated:
        argv += ["--min-time", "0.01"]
    else:
        found = probe(step, "libcuda", step.native_env())
        if "path" not in found:
            return step.finish("fail", found, message="cannot locate the real libcuda.so.1: %s" % found.get("error"))
        argv += ["--driver", driver_folder(step, found), "--min-time", "0.03"]
    code, out, err = common.run(argv, step.base_env(), step.left() - 2, log=os.path.join(step.scratch, "micro.log"))
    path = argv[2]
    results = {"exit": code, "table": out[-8000:]}
    if os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
        results["simulated_driver"] = report.get("simulated")
        results["rows"] = len(report.get("results", []))
    if code is None:
        return step.finish("timeout", results, message="gpuslice-microbench ran past the step's budget")
    # Its limited configurations refuse to run if cuMemGetInfo does not show the quota.
    loaded = code == 0 and "quota not in effect" not in err
    if code != 0:
        results["stderr"] = common.tail(err, 20)
    wrong = results.get("simulated_driver") is not None and results["simulated_driver"] != step.simulated
    status = "ok" if code == 0 and not wrong else "fail"
    return step.finish(status, results, loaded,
                       "the limited configurations check cuMemGetInfo total == 8Gi before measuring",
                       message="" if status == "ok" else "exit %s%s" % (code, ", wrong driver" if wrong else ""))


# --- NVML and nvidia-smi under the library ---------------------------------------------------

def step_nvml(step):
    env = step.gpuslice_env("nvml", GPUSLICE_MEMORY_LIMIT=QUOTA)
    results = {"quota_bytes": QUOTA_BYTES, "native": probe(step, "nvml", step.native_env()),
               "gpuslice": probe(step, "nvml", env)}
    checks = [results["gpuslice"].get("total") == QUOTA_BYTES]
    evidence = ["nvmlDeviceGetMemoryInfo total %s (quota %d)" % (results["gpuslice"].get("total"), QUOTA_BYTES)]
    smi = shutil.which("nvidia-smi")
    if step.simulated:
        results["nvidia_smi"] = "skipped: --simulated (no nvidia-smi for the simulated driver)"
    elif smi is None:
        results["nvidia_smi"] = "skipped: nvidia-smi not found"
    else:
        query = [smi, "--query-gpu=memory.total,memory.used,memory.free", "--format=csv,noheader,nounits"]
        code, native_out, _ = common.run(query, step.native_env(), 20)
        code, out, err = common.run(query, env, 20, log=os.path.join(step.scratch, "smi.log"))
        fields = [f.strip() for f in out.strip().split(",")] if code == 0 else []
        total_mib = int(fields[0]) if fields and fields[0].isdigit() else None
        results["nvidia_smi"] = {"native": native_out.strip(), "gpuslice": out.strip() or common.tail(err, 3),
                                 "total_mib": total_mib}
        checks.append(total_mib == QUOTA_BYTES // MIB)
        evidence.append("nvidia-smi memory.total %s MiB" % total_mib)
    loaded = all(checks)
    return step.finish("ok" if loaded else "fail", results, loaded, "; ".join(evidence),
                       message="" if loaded else "NVML under the library does not show the quota")


# --- green contexts ----------------------------------------------------------------

GREEN_SM_LIMIT = 25


def step_green(step):
    """A green context under the library (issue 36): its primary context counted
    (cuMemGetInfo's used against NVML's figure for the process), the quota shown,
    and spin kernels on its stream held near the SM limit. What only a GPU can
    confirm: that the driver retains the primary context as documented and that
    the real kernels' share follows the limit."""
    env = step.gpuslice_env("green", GPUSLICE_MEMORY_LIMIT=QUOTA, GPUSLICE_SM_LIMIT=GREEN_SM_LIMIT)
    r = probe(step, "green", env, timeout=max(10, int(step.left()) - 2))
    results = {"quota_bytes": QUOTA_BYTES, "sm_limit_percent": GREEN_SM_LIMIT, "gpuslice": r}
    if r.get("skipped"):
        return step.finish("skipped", results, None, "", message=r["skipped"])
    if r.get("error"):
        return step.finish("error", results, None, "", message=r["error"])
    loaded = r.get("total") == QUOTA_BYTES
    nvml = r.get("nvml_process")
    counted_ok = nvml is None or r.get("counted", 0) >= nvml * 0.9
    share_ok = r.get("share") is not None and r["share"] <= GREEN_SM_LIMIT / 100 * 1.6
    evidence = "cuMemGetInfo total %s (quota %d) in the green context" % (r.get("total"), QUOTA_BYTES)
    problems = []
    if not counted_ok:
        problems.append("gpuslice counts %s bytes, NVML %s: the primary context is not counted" % (r.get("counted"), nvml))
    if not share_ok:
        problems.append("kernels on the green stream took %s of the device under %d%%" % (r.get("share"), GREEN_SM_LIMIT))
    ok = loaded and counted_ok and share_ok
    return step.finish("ok" if ok else "fail", results, loaded, evidence, message="; ".join(problems))


STEPS = {"facts": step_facts, "conformance": step_conformance, "bench": step_bench,
         "microbench": step_microbench, "nvml": step_nvml, "green": step_green}

if __name__ == "__main__":
    sys.exit(common.main_dispatch(STEPS))
