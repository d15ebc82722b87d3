#!/usr/bin/env bash
# Start-up CPU beside N live processes (issue 35; docs/scale.md): for each N,
# N processes of one container hold a context and 1 MiB, then nine more start
# one after another, each measuring the CPU time (getrusage) of its cuInit,
# primary context and first cuMemAlloc (gpuslice-startup-cpu). Native (the
# simulated driver alone) and wrapped (the preload library, with and without
# a quota: with one, contexts are measured through NVML). Medians in µs, then
# the least figures (the first cuMemGetInfo column is a median in both).
# STARTUP_CPU_APART=1 in the environment: the holders run on other simulated
# devices (other state files) than the measured processes, in the same
# region, so that the simulator's start does not grow with them: "added" is
# then the library's alone.
# STARTUP_CPU_REPS=R: R measured starts per figure (default 9).
# usage: bench/startup_cpu.sh [BUILD_DIR] [N...]   (default: build, 1 16 256 1023)
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
shift || true
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(1 16 256 1023)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # N MODE(native|quota|plain) -> the bench's line
  local n=$1 mode=$2 dir="$work/run"
  rm -rf "$dir" && mkdir -p "$dir"
  (
    export LD_LIBRARY_PATH=$build/fakecuda FAKECUDA_STATE=$dir/fake.state GPUSLICE_REGION=$dir/c.region
    export FAKECUDA_MEMORY=64Gi GPUSLICE_PRIORITY_BOARD=$dir/board
    [ "$mode" != native ] && export LD_PRELOAD=$build/lib/libgpuslice.so
    [ "$mode" = quota ] && export GPUSLICE_MEMORY_LIMIT=32Gi
    "$build/bin/gpuslice-startup-cpu" run "$n" "${STARTUP_CPU_REPS:-9}"
  )
}
field() { sed -n "s/.*$1=\([0-9-]*\).*/\1/p"; }
header() {
  echo "| live processes | native µs | gpuslice µs | added µs | gpuslice + quota µs | added µs | first cuMemGetInfo µs (quota) |"
  echo "|---:|---:|---:|---:|---:|---:|---:|"
}
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
medians=() least=()
for n in "${counts[@]}"; do
  a=$(run "$n" native) b=$(run "$n" plain) q=$(run "$n" quota)
  m=$(echo "$q" | field median_first_meminfo_us)
  for stat in median_cpu_us min_cpu_us; do
    x=$(echo "$a" | field $stat) y=$(echo "$b" | field $stat) z=$(echo "$q" | field $stat)
    line="| $n | $x | $y | $((y - x)) | $z | $((z - x)) | $m |"
    if [ $stat = median_cpu_us ]; then medians+=("$line"); else least+=("$line"); fi
  done
done
echo "Medians:"
header
printf '%s\n' "${medians[@]}"
echo "Least of the starts (load only adds to a start's CPU time):"
header
printf '%s\n' "${least[@]}"
