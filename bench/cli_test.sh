#!/usr/bin/env bash
# gpuslice-microbench's command line is strict: a bad value, an unknown call
# or flag ends it with status 2 and one line naming the flag, before anything
# is measured; a good --control-turns reaches the children and the JSON.
set -u
bin=$1
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=0

refused() {  # refused REGEX ARGS...: status 2 and REGEX in the output
  local want=$1
  shift
  local out rc
  out=$("$bin" "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -qE -- "$want" <<<"$out"; then
    echo "FAIL: gpuslice-microbench $* -> status $rc, expected 2 and /$want/:"
    echo "$out"
    failed=1
  fi
}

refused '^--repetitions: .*1 to 100' --repetitions x
refused '^--repetitions: .*1 to 100' --repetitions 0
refused '^--min-time: ' --min-time 0.2x
refused '^--threads: 33 is not a thread count from 1 to 32' --threads 1,33
refused '^--threads: x is not a thread count' --threads 1,x
refused '^--only: cuFoo is not a call of the table' --only cuFoo
refused '^--control-turns: .*0 to 100000' --control-turns -1
refused 'not expected: --bogus' --bogus
refused '^gpuslice-microbench: --driver: no driver at /nonexistent' --driver /nonexistent/libcuda.so.1

# A short real run with the longest delay: the turns reach the children (the
# control side costs tens of microseconds more than the native one) and come
# back in the JSON and the reproduce line.
if ! "$bin" --only cuLaunchKernel --threads 1 --min-time 0.01 --control-turns 100000 \
  --json-file "$scratch/out.json" >"$scratch/out.txt" 2>&1; then
  echo "FAIL: the short run failed:"
  cat "$scratch/out.txt"
  failed=1
elif ! grep -q -- '--control-turns 100000' "$scratch/out.txt" ||
  ! python3 - "$scratch/out.json" <<'PY'; then
import json, sys
d = json.load(open(sys.argv[1]))
assert d["control_turns"] == 100000, d["control_turns"]
rows = {(r["config"], r["side"]): r["cpu_ns"] for r in d["results"] if r["call"] == "cuLaunchKernel"}
native, control = rows[("unlimited", "native")], rows[("unlimited", "control")]
assert control > native + 5000, (native, control)  # 100000 empty turns: ~30 us a call
PY
  echo "FAIL: --control-turns 100000 did not reach the control side, the JSON or the reproduce line:"
  cat "$scratch/out.txt" "$scratch/out.json"
  failed=1
fi
exit "$failed"
