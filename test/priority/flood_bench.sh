#!/bin/sh
# Reproduces docs/benchmarks.md "Board floods" (SIMULATED driver, not a GPU):
# gpuslice-bench --only priority, while its inference (high) tenant runs next
# to the training (low) tenant, N empty files named like activity files of
# the device appear in the board's low/ directory (the issue's attack).
#   test/priority/flood_bench.sh <build> <files> [profile] [json-out]
set -eu
build=$1
files=$2
profile=${3:-realistic}
out=${4:-/dev/null}
tmp=$(mktemp -d)
trap 'kill $flooder 2>/dev/null || true; rm -rf "$tmp"' EXIT INT TERM
TMPDIR=$tmp "$build/bin/gpuslice-bench" --only priority --profile "$profile" --json-file "$out" >"$tmp/table" 2>&1 &
bench=$!
# Flood every board whose low/ gets a tenant's file (its name gives the
# device's UUID), once.
python3 - "$tmp" "$files" <<'PY' &
import os, sys, time, glob
tmp, n = sys.argv[1], int(sys.argv[2])
done = set()
while True:
    for act in glob.glob(os.path.join(tmp, "*", "priority-board.*", "low", "*.act")):
        low = os.path.dirname(act)
        if low in done or n == 0:
            continue
        done.add(low)
        uuid = os.path.basename(act).split(".")[0]
        for i in range(n):
            open(os.path.join(low, "%s.f-%d.act" % (uuid, i)), "w").close()
        print("flooded %s with %d files" % (low, n), file=sys.stderr)
    time.sleep(0.01)
PY
flooder=$!
wait $bench
kill $flooder 2>/dev/null || true
grep -E "neighbour|alone|case" "$tmp/table" || cat "$tmp/table"
