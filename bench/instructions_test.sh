#!/usr/bin/env bash
# gpuslice-instructions counts what the library adds: the quota'd allocation
# pair must cost more wrapped than native (a library that forwarded
# nothing, or a count of the wrong loop, shows +0), and a bad flag is refused.
set -euo pipefail
tool=$1
out=$("$tool" --iterations 200 --only pair-quota,launch-unlimited)
echo "$out"
for case in pair-quota launch-unlimited; do
  row=$(grep "^| $case |" <<<"$out") || { echo "no row for $case"; exit 1; }
  added=$(awk -F'|' '{gsub(/ /, "", $6); print $6}' <<<"$row")
  native=$(awk -F'|' '{gsub(/ /, "", $4); print $4}' <<<"$row")
  awk -v a="$added" -v n="$native" 'BEGIN { exit !(a > 5 && n > 50) }' ||
    { echo "$case: added $added over native $native: expected the library to add instructions"; exit 1; }
done
err=$(mktemp)
trap 'rm -f "$err"' EXIT
if "$tool" --only no-such-case 2>"$err"; then echo "an unknown case was accepted"; exit 1; fi
grep -q -- "--only: no case no-such-case" "$err" || { cat "$err"; exit 1; }
echo "instructions_test: ok"
