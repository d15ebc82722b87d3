#!/bin/sh
# Reproduces docs/benchmarks.md "Board floods" (SIMULATED driver, not a GPU):
# gpuslice-bench --only priority, while its inference (high) tenant runs next
# to the training (low) tenant, N empty files named like activity files of
# the device appear in the board's low/ directory (the issue's attack).
#   bench/priority/flood_bench.sh <build> <files> [profile] [json-out]
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
python3 - "$bench" "$files" 2>>"$tmp/table" <<'PY' &
import os, re, sys, time, glob
bench, n = sys.argv[1], int(sys.argv[2])
# The bench's private directory (/dev/shm/gpuslice-bench.XXXXXX, or under
# TMPDIR): named in its workers' command lines. Other benches may run on the
# machine: only ours is flooded.
def private_dir():
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % pid) as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            if ppid != bench:
                continue
            with open("/proc/%s/cmdline" % pid) as f:
                m = re.search(r'"dir":"([^"]*gpuslice-bench\.[A-Za-z0-9]+)/', f.read())
            if m:
                return m.group(1)
        except (OSError, IndexError):
            pass
    return None
root = None
done = set()
while os.path.exists("/proc/" + bench):
    if root is None:
        root = private_dir()
    for act in glob.glob(os.path.join(root or "/nonexistent", "priority-board.*", "low", "*.act")):
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
sleep 0.2
kill $flooder 2>/dev/null || true
grep -E "neighbour|alone|case|flooded" "$tmp/table" || cat "$tmp/table"
