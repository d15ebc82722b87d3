#!/usr/bin/env bash
# Start-up cost (issue 14): N processes of one container start at once; each
# runs cuInit, creates a context and makes one allocation (cuprobe), against
# the simulated driver, without and with the preload library (a 32 GiB quota,
# so contexts are measured too). Prints the wall time of the whole batch.
# usage: bench/startup.sh [BUILD_DIR] [N...]   (default: build, 1 16 64 256)
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
shift || true
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(1 16 64 256)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
batch() {  # N PRELOAD(0|1) -> wall ms
  local n=$1 preload=$2 dir="$work/run"
  rm -rf "$dir" && mkdir -p "$dir"
  (
    export LD_LIBRARY_PATH=$build/fakecuda FAKECUDA_STATE=$dir/fake.state GPUSLICE_REGION=$dir/c.region
    export FAKECUDA_MEMORY=64Gi GPUSLICE_PRIORITY_BOARD=$dir/board
    if [ "$preload" = 1 ]; then export LD_PRELOAD=$build/lib/libgpuslice.so GPUSLICE_MEMORY_LIMIT=32Gi; fi
    t0=$(date +%s%N)
    for i in $(seq "$n"); do "$build/bin/cuprobe" init ctx 0 alloc 1048576 > "$dir/o$i" 2>&1 & done
    wait
    t1=$(date +%s%N)
    ok=$(grep -l "alloc rc=0" "$dir"/o* | wc -l)
    [ "$ok" -eq "$n" ] || { echo "startup.sh: only $ok of $n processes allocated" >&2; exit 1; }
    echo $(( (t1 - t0) / 1000000 ))
  )
}
echo "| processes | native ms | gpuslice ms | added per process ms |"
echo "|---:|---:|---:|---:|"
for n in "${counts[@]}"; do
  a=$(batch "$n" 0); b=$(batch "$n" 1)
  echo "| $n | $a | $b | $(awk -v a="$a" -v b="$b" -v n="$n" 'BEGIN { printf "%.2f", (b - a) / n }') |"
done
