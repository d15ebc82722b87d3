#!/usr/bin/env bash
# Runs many seeded schedules of the chaos torture suite (README.md) and prints
# the count, the violations and the time. Usage:
#   test/chaos/run_many.sh [BUILD_DIR] [SEEDS] [chaos_torture options...]
#     BUILD_DIR  default: build;  SEEDS: A-B, default 1-1000
#   e.g. test/chaos/run_many.sh build 1-10000 --classes alloc,pitch,vmm,fill,fork,kill
# The output of every schedule goes to $LOG (default /tmp/chaos-<SEEDS>.log);
# a failed seed's report is there, under its "seed=" line.
set -euo pipefail
build=${1:-build}
seeds=${2:-1-1000}
shift $(( $# >= 2 ? 2 : $# ))
log=${LOG:-/tmp/chaos-${seeds}.log}
torture="$build/bin/chaos_torture"
[ -x "$torture" ] || { echo "run_many.sh: $torture not built (cmake --build $build --target chaos_torture)" >&2; exit 2; }
# Without the simulated NVML the library cannot measure contexts: every seed
# then fails on 16 MiB per process uncounted, which is no gpuslice defect.
[ -e "$build/fakecuda/libnvidia-ml.so.1" ] || { echo "run_many.sh: $build/fakecuda/libnvidia-ml.so.1 not built (cmake --build $build --target fakecuda_nvml)" >&2; exit 2; }
start=$(date +%s.%N)
set +e
"$torture" --seeds "$seeds" "$@" > "$log" 2>&1
rc=$?
set -e
end=$(date +%s.%N)
grep '^summary:' "$log" || { echo "run_many.sh: no summary (rc=$rc); see $log" >&2; exit 2; }
awk -v s="$start" -v e="$end" 'BEGIN { printf "wall_s=%.1f\n", e - s }'
grep -E '^seed=.* (violations=[1-9]|failures=[1-9]|hang=1)' "$log" | cut -c1-200 || true
echo "log: $log"
exit $rc
