"""Shared plumbing of the evidence script's steps: arguments, environments, child
processes with hard time limits, and the one JSON file each step leaves behind.

A step's JSON (<work>/<step>.json):
  step, status (ok | fail | error | skipped | timeout), simulated, duration_s,
  gpuslice_loaded (true | false | null when the step does not involve it),
  loaded_evidence (how that was decided), message, results (step-specific).
"""

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time

GIB = 1 << 30
MIB = 1 << 20


def parse_args(steps):
    parser = argparse.ArgumentParser(description="one step of bench/gpu/run.sh")
    parser.add_argument("step", choices=sorted(steps))
    parser.add_argument("--build", required=True, help="gpuslice build tree: bin/, lib/, fakecuda/")
    parser.add_argument("--work", required=True, help="folder for this run's JSON, logs, regions")
    parser.add_argument("--budget", type=float, required=True, help="seconds this step may take")
    parser.add_argument("--simulated", action="store_true", help="simulated driver, no GPU")
    parser.add_argument("--source", default=os.getcwd(), help="repository root")
    return parser.parse_args()


class Step:
    """One step: its deadline, its environments, its result file."""

    def __init__(self, args, name):
        self.name = name
        self.args = args
        self.build = os.path.abspath(args.build)
        self.work = os.path.abspath(args.work)
        self.simulated = args.simulated
        self.started = time.monotonic()
        self.deadline = self.started + args.budget
        self.library = os.path.join(self.build, "lib", "libgpuslice.so")
        self.fake_dir = os.path.join(self.build, "fakecuda")
        self.scratch = os.path.join(self.work, name)
        os.makedirs(self.scratch, exist_ok=True)

    def left(self):
        return self.deadline - time.monotonic()

    def bin(self, name):
        return os.path.join(self.build, "bin", name)

    def base_env(self, device_state="device"):
        """The parent's environment minus anything of gpuslice or the simulator;
        with --simulated, the simulated driver first on the library path and a
        simulated machine of this step's own (FAKECUDA_STATE)."""
        env = {k: v for k, v in os.environ.items()
               if k != "LD_PRELOAD" and not k.startswith(("GPUSLICE_", "FAKECUDA_", "CUDA_DEVICE_"))}
        env["PYTHONUNBUFFERED"] = "1"
        if self.simulated:
            old = env.get("LD_LIBRARY_PATH", "")
            env["LD_LIBRARY_PATH"] = self.fake_dir + (":" + old if old else "")
            env["FAKECUDA_STATE"] = os.path.join(self.scratch, device_state + ".state")
        return env

    def native_env(self, **extra):
        env = self.base_env()
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def gpuslice_env(self, region, **extra):
        """A container: the library preloaded, a region of its own under the scratch folder."""
        env = self.base_env()
        env["LD_PRELOAD"] = self.library
        env["GPUSLICE_REGION"] = os.path.join(self.scratch, region + ".region")
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def finish(self, status, results=None, loaded=None, evidence="", message=""):
        record = {
            "step": self.name,
            "status": status,
            "simulated": self.simulated,
            "duration_s": round(time.monotonic() - self.started, 2),
            "gpuslice_loaded": loaded,
            "loaded_evidence": evidence,
            "message": message,
            "results": results if results is not None else {},
        }
        path = os.path.join(self.work, self.name + ".json")
        with open(path + ".tmp", "w") as out:
            json.dump(record, out, indent=2, default=str)
            out.write("\n")
        os.replace(path + ".tmp", path)
        shown = {True: "yes", False: "NO", None: "n/a"}.get(loaded, str(loaded))
        print("step %s: %s, gpuslice loaded: %s%s" % (self.name, status, shown, (" — " + message) if message else ""),
              flush=True)
        return 0 if status in ("ok", "skipped") else 1


def spawn(argv, **kwargs):
    """Popen in a process group of its own, its id noted in $GPUSLICE_GPU_PIDS
    (set by run.sh), which kills what is left of a step's groups after it."""
    proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
    pids = os.environ.get("GPUSLICE_GPU_PIDS")
    if pids:
        with open(pids, "a") as f:
            f.write("%d\n" % proc.pid)
    return proc


def run(argv, env, timeout, cwd=None, log=None):
    """Runs argv in a process group of its own; kills the whole group at the
    timeout. Returns (returncode or None on timeout, stdout text, stderr text)."""
    timeout = max(1.0, timeout)
    proc = spawn(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 stdin=subprocess.DEVNULL, text=True, errors="replace")
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        code = None
    if log is not None:
        with open(log, "a") as f:
            f.write("$ %s\n--- stdout\n%s--- stderr\n%s--- exit %s\n\n" % (" ".join(argv), out, err, code))
    return code, out, err


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def last_json_line(text):
    """The last line of `text` that parses as a JSON object, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


def lazy_import(module):
    """The module, or None when it is not installed (ImportError of the module
    itself); any other failure while importing propagates."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.split(".")[0] == e.name.split(".")[0]:
            return None
        raise


def library_mapped():
    """Whether libgpuslice.so is mapped into this process."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libgpuslice.so" in line for line in maps)
    except OSError:
        return False


def emit(record):
    """A probe's one result line on stdout (parsed by last_json_line)."""
    print(json.dumps(record, default=str), flush=True)


def main_dispatch(steps):
    args = parse_args(steps)
    step = Step(args, args.step)
    try:
        return steps[args.step](step)
    except Exception as e:  # a broken step must still leave its JSON behind
        import traceback
        return step.finish("error", {"traceback": traceback.format_exc()[-4000:]},
                           message="%s: %s" % (type(e).__name__, e))


if __name__ == "__main__":
    sys.exit("common.py is a module of bench/gpu; run bench/gpu/run.sh")
