#!/usr/bin/env bash
# Runs every test of a GoogleTest program at once, each in its own process
# (GoogleTest's sharding: GTEST_TOTAL_SHARDS = the number of tests,
# GTEST_SHARD_INDEX = 0..N-1, one test a shard), then prints each shard's
# output in order; fails if any shard fails. For timing tests whose cases
# mostly sleep on a simulated device of their own (long_launch_test's take
# ~4% of a core each), so that they need not wait for one another.
#   run_shards.sh PROGRAM [ARGS...]
set -u
count=$("$@" --gtest_list_tests | grep -c '^  ')
if [ "$count" -eq 0 ]; then
  echo "run_shards.sh: $1 lists no tests" >&2
  exit 1
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
pids=()
for ((i = 0; i < count; i++)); do
  GTEST_TOTAL_SHARDS=$count GTEST_SHARD_INDEX=$i "$@" >"$out/$i" 2>&1 &
  pids+=($!)
done
rc=0
for ((i = 0; i < count; i++)); do
  wait "${pids[$i]}" || rc=1
  echo "== shard $((i + 1)) of $count"
  cat "$out/$i"
done
exit $rc
