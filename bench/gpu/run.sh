#!/usr/bin/env bash
# bench/gpu/run.sh: the real-GPU evidence for gpuslice in one command (issue 15,
# docs/results-gpu.md). Run from the repository root.
#
#   bench/gpu/run.sh [--simulated] [--out DIR] [--build DIR] [--only a,b] [--skip a,b] [--total SECONDS]
#
# Steps, each in its own process with its own time budget; a failing step does
# not stop the others; each leaves <work>/<step>.json and says whether gpuslice
# was really in effect (e.g. cuMemGetInfo's total equal to the quota):
#   facts        nvidia-smi, driver, CUDA, PyTorch and framework versions; do the built binaries run here
#   conformance  the tests labelled 'conformance' (GPUSLICE_TEST_REAL_DRIVER=1 on a GPU), if the build has any
#   bench        gpuslice-bench --driver real: latency, quota, sweep with 1 ms and 50 us kernels, tenants, noisy
#   microbench   gpuslice-microbench against the real libcuda.so.1
#   nvml         NVML and nvidia-smi under the library show the quota
#   green        a green context (CUDA 12.4+): its primary context counted, spin kernels on its stream at SM 25
#   frameworks   PyTorch (3 allocators), JAX, CuPy, numba-cuda, cuda-core under GPUSLICE_MEMORY_LIMIT=4Gi
#   compute      PyTorch loop native / unlimited / SM 25,50,75 / two processes 30+60 / CUDA graph at 50%
#   concurrency  16 processes under one 8 GiB quota for 20 s, watched with NVML from outside
#
# --simulated runs the driver-level steps (facts, conformance, bench,
# microbench, nvml, green, concurrency) on the simulated driver of the build tree and
# skips the framework steps; figures from it are simulated, never GPU figures.
#
# Output (at most 4 files, for the device tool's 8-file limit): DIR/summary.md,
# DIR/results.json (every step's JSON), DIR/steps.tar.gz (per-step JSON and
# logs), DIR/run.log. The summary is rewritten after every step.
set -u -o pipefail

die() { echo "run.sh: $*" >&2; exit 2; }

simulated=0
out=""
build=""
only=""
skip=""
total=""
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --simulated) simulated=1 ;;
    --out) [ $# -ge 2 ] || die "--out needs a folder"; out=$2; shift ;;
    --build) [ $# -ge 2 ] || die "--build needs a build folder"; build=$2; shift ;;
    --only) [ $# -ge 2 ] || die "--only needs step names"; only=$2; shift ;;
    --skip) [ $# -ge 2 ] || die "--skip needs step names"; skip=$2; shift ;;
    --total) [ $# -ge 2 ] || die "--total needs seconds"; total=$2; shift ;;
    --keep-work) keep=1 ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

[ -f bench/gpu/run.sh ] || die "run it from the repository root (bench/gpu/run.sh not found in $PWD)"
here=$PWD
python=${PYTHON:-python3}
command -v "$python" >/dev/null || die "$python not found (set PYTHON)"

# Steps in order, with their budgets in seconds: real GPU, then --simulated.
steps=(facts conformance bench microbench nvml green frameworks compute concurrency)
declare -A real_budget=([facts]=25 [conformance]=30 [bench]=140 [microbench]=30 [nvml]=15 [green]=10
                        [frameworks]=90 [compute]=140 [concurrency]=45)
declare -A sim_budget=([facts]=15 [conformance]=30 [bench]=75 [microbench]=40 [nvml]=10 [green]=10
                       [frameworks]=30 [compute]=5 [concurrency]=30)
declare -A module=([facts]=tool_steps [conformance]=tool_steps [bench]=tool_steps [microbench]=tool_steps
                   [nvml]=tool_steps [green]=tool_steps [frameworks]=memory_steps [compute]=compute_steps
                   [concurrency]=concurrency)
if [ "$simulated" = 1 ]; then total=${total:-240}; else total=${total:-530}; fi
case "$total" in ''|*[!0-9]*) die "--total must be whole seconds, not '$total'" ;; esac

for list in "$only" "$skip"; do
  for s in ${list//,/ }; do
    [ -n "${module[$s]:-}" ] || die "unknown step '$s' (steps: ${steps[*]})"
  done
done
selected=()
for s in "${steps[@]}"; do
  if [ -n "$only" ] && [[ ",$only," != *",$s,"* ]]; then continue; fi
  if [[ ",$skip," == *",$s,"* ]]; then continue; fi
  selected+=("$s")
done
[ ${#selected[@]} -gt 0 ] || die "no step selected"

# The build tree: --build, else the carried bundle (bench/gpu/pack.sh), else build/.
if [ -z "$build" ]; then
  if [ -f build-gpu-carry/lib/libgpuslice.so ]; then build="build-gpu-carry"; else build="build"; fi
fi
[ -d "$build" ] || die "no build tree at '$build' (bench/gpu/pack.sh makes one to carry; or pass --build)"
build=$(cd "$build" && pwd)
for f in lib/libgpuslice.so bin/gpuslice-bench; do
  [ -e "$build/$f" ] || echo "run.sh: warning: $build/$f is missing: steps that need it will fail" >&2
done
if [ "$simulated" = 1 ] && [ ! -e "$build/fakecuda/libcuda.so.1" ]; then
  die "--simulated needs the simulated driver at $build/fakecuda/libcuda.so.1 (build with GPUSLICE_BUILD_TESTS=ON)"
fi

# Libraries the bundle carries because the GPU machine lacks them (pack.sh).
if [ -d "$build/syslib" ]; then
  export LD_LIBRARY_PATH="$build/syslib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# A packed bundle's CTest files and test programs name the folders it was built
# in: recreate those paths as links when they do not exist here.
if [ -f "$build/ORIGIN" ]; then
  while IFS='=' read -r key path; do
    target=$build
    [ "$key" = source ] && target=$here
    if [ -n "$path" ] && [ ! -e "$path" ] && [ ! -L "$path" ]; then
      mkdir -p "$(dirname "$path")" 2>/dev/null && ln -s "$target" "$path" 2>/dev/null &&
        echo "run.sh: linked $path -> $target (the bundle was built there)"
    fi
  done < "$build/ORIGIN"
fi

out=${out:-${OUT:-/tmp/gpuslice-gpu-evidence}}
mkdir -p "$out" || die "cannot create $out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpuslice-gpu.XXXXXX") || die "cannot create a work folder"
started=$(date +%s)
deadline=$((started + total))
exec > >(tee "$out/run.log") 2>&1

mode_flag=()
[ "$simulated" = 1 ] && mode_flag=(--simulated)
echo "run.sh: $( [ "$simulated" = 1 ] && echo 'SIMULATED driver' || echo 'real GPU') run, build $build," \
     "steps ${selected[*]}, total budget ${total}s, work $work, out $out"

summarize() {
  "$python" bench/gpu/summary.py --work "$work" --out "$out" --steps "$(IFS=,; echo "${selected[*]}")" \
    --started "$started" "${mode_flag[@]}" || echo "run.sh: summary.py failed"
}

# A step that died without its JSON still gets one.
placeholder() {  # step status message
  printf '{"step": "%s", "status": "%s", "simulated": %s, "gpuslice_loaded": null, "message": "%s", "results": {}}\n' \
    "$1" "$2" "$( [ "$simulated" = 1 ] && echo true || echo false)" "$3" > "$work/$1.json"
}

status=0
export GPUSLICE_GPU_PIDS="$work/pids"
: > "$GPUSLICE_GPU_PIDS"
for s in "${selected[@]}"; do
  if [ "$simulated" = 1 ]; then budget=${sim_budget[$s]}; else budget=${real_budget[$s]}; fi
  left=$((deadline - $(date +%s) - 5))
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt 5 ]; then
    placeholder "$s" timeout "not run: the run's total budget (${total}s) was spent"
    echo "step $s: not run, no time left"
    status=1
    summarize
    continue
  fi
  echo "=== $s (budget ${budget}s) $(date -u +%H:%M:%S)"
  t0=$(date +%s)
  timeout -k 5 $((budget + 15)) "$python" "bench/gpu/${module[$s]}.py" "$s" --build "$build" --work "$work" \
    --budget "$budget" --source "$here" "${mode_flag[@]}"
  rc=$?
  if [ ! -s "$work/$s.json" ]; then
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      placeholder "$s" timeout "killed after $((budget + 15))s"
    else
      placeholder "$s" error "exited $rc without a result"
    fi
  fi
  # What the step started and left running (it was killed, or a child hung)
  # must not load the GPU under the next step: its process groups, by id.
  while read -r pid; do
    kill -KILL -- "-$pid" 2>/dev/null
  done < "$work/pids"
  : > "$work/pids"
  [ "$rc" = 0 ] || status=1
  echo "=== $s done in $(( $(date +%s) - t0 ))s (exit $rc)"
  summarize
done

tar -czf "$out/steps.tar.gz" -C "$work" --exclude='*.state' --exclude='*.region' . 2>/dev/null ||
  echo "run.sh: could not pack $work"
if [ "$keep" = 1 ]; then echo "run.sh: kept $work"; else rm -rf "$work"; fi
echo "run.sh: finished in $(( $(date +%s) - started ))s; results in $out"
echo
cat "$out/summary.md"
exit "$status"
