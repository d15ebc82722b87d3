#!/usr/bin/env bash
# The fuzz lane (docs/security.md "Fuzzing"): builds the libFuzzer targets of
# test/unit/fuzz with clang in build-fuzz (ASan+UBSan, every library compiled
# with coverage feedback) and runs them all at once, each over its committed
# corpus (test/fuzz/corpus/<target>) for a short time. A crash, a leak, a
# hang or a failed invariant fails the lane and names the reproducer.
#   test/fuzz/run.sh [SECONDS]       seconds per target (default 15)
#   test/fuzz/run.sh --build          builds the targets and stops (.ci/run builds them
#                                    beside the ASan lane's tests, runs them last)
#   test/fuzz/run.sh --merge TARGET DIR...
#                                    rewrites test/fuzz/corpus/TARGET as the smallest set of
#                                    its inputs and DIRs' (a longer run's) with the same coverage
# Environment: GPUSLICE_FUZZ_BUILD (build directory, default build-fuzz).
set -euo pipefail
cd "$(dirname "$0")/../.."
targets=(options region config_file cdi agent_region grant)
build=${GPUSLICE_FUZZ_BUILD:-build-fuzz}
# 4 KiB holds every structure the targets take (an agent_region input lays
# the region's header, a device entry and two slots in 2.8 KiB).
max_len=4096

generator="Unix Makefiles"
if command -v ninja >/dev/null && ! grep -qs '^CMAKE_GENERATOR:INTERNAL=Unix Makefiles$' "$build/CMakeCache.txt"; then
  generator=Ninja
fi
# -O1 -g1 as in the sanitizer lanes; -fsanitize=fuzzer-no-link on every
# library: test/unit/fuzz/CMakeLists.txt then builds fuzz_<target>_libfuzzer.
CC=clang CXX=clang++ cmake -S . -B "$build" -G "$generator" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGPUSLICE_SANITIZE=address -DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link -DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DGPUSLICE_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target fuzz_libfuzzer
[ "${1:-}" = "--build" ] && exit 0

if [ "${1:-}" = "--merge" ]; then
  t=$2
  shift 2
  merged=$(mktemp -d)
  "$build/bin/fuzz_${t}_libfuzzer" -merge=1 -max_len=$max_len "$merged" "test/fuzz/corpus/$t" "$@" 2>&1 | tail -1
  if [ -z "$(ls -A "$merged")" ]; then
    echo "test/fuzz/run.sh: the merge of $t kept nothing; the corpus is left as it was" >&2
    exit 1
  fi
  rm -f "test/fuzz/corpus/$t"/*
  cp "$merged"/* "test/fuzz/corpus/$t/"
  rm -rf "$merged"
  du -sh "test/fuzz/corpus/$t" test/fuzz/corpus
  exit 0
fi

seconds=${1:-15}
out=$build/fuzz-out
rm -rf "$out"
declare -A pids
for t in "${targets[@]}"; do
  mkdir -p "$out/$t/new"
  # New inputs go to $out/$t/new; the committed corpus is read only.
  "$build/bin/fuzz_${t}_libfuzzer" -max_total_time="$seconds" -max_len=$max_len -timeout=30 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$out/$t/" "$out/$t/new" "test/fuzz/corpus/$t" >"$out/$t.log" 2>&1 &
  pids[$t]=$!
done
failed=0
for t in "${targets[@]}"; do
  if wait "${pids[$t]}"; then
    printf '%-13s %s\n' "$t" "$(grep -aE '^#[0-9]+[[:space:]]+DONE' "$out/$t.log" | tail -1)"
  else
    failed=1
    echo "== fuzz target $t FAILED; the end of its log ($out/$t.log):"
    grep -av '^INFO:' "$out/$t.log" | tail -40
    for f in "$out/$t"/crash-* "$out/$t"/leak-* "$out/$t"/timeout-* "$out/$t"/oom-*; do
      [ -e "$f" ] || continue
      echo "== reproducer: $f"
      echo "   replay: $build/bin/fuzz_${t}_libfuzzer $f   (or build/bin/fuzz_$t $f, without libFuzzer)"
    done
  fi
done
exit $failed
