#!/usr/bin/env bash
# The formatter: every C and C++ file git tracks, in the checked-in style
# (.clang-format at the top of the tree: Google's, 120 columns).
#   tools/format.sh           rewrite the files that differ
#   tools/format.sh --check   change nothing; exit 1 naming each file that
#                             differs (CTest docs.format, so .ci/run runs it)
# The tree is formatted with clang-format 14 (Debian bookworm's
# clang-format package, which tools/setup.sh installs); another major
# version formats some constructs differently, so the check skips (exit 77)
# rather than report files it would format otherwise. Outside a git work
# tree (a source tarball) there is no file list: skipped too.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=fix
case "${1:-}" in
  --check) mode=check ;;
  "") ;;
  *) echo "usage: tools/format.sh [--check]" >&2; exit 2 ;;
esac
want=14
formatter=""
for candidate in clang-format-$want clang-format; do
  if command -v "$candidate" >/dev/null; then formatter=$candidate; break; fi
done
if [ -z "$formatter" ]; then
  echo "tools/format.sh: no clang-format on PATH (tools/setup.sh installs Debian's clang-format package): skipped" >&2
  exit 77
fi
version=$("$formatter" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -1)
if [ "$version" != "$want" ]; then
  echo "tools/format.sh: $formatter is version ${version:-unknown}; the tree is formatted with clang-format $want: skipped" >&2
  exit 77
fi
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "tools/format.sh: not a git work tree, so no list of tracked files: skipped" >&2
  exit 77
fi
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.c')
if [ "$mode" = fix ]; then
  "$formatter" -i "${files[@]}"
  exit 0
fi
# Batches of files, one clang-format process each, as many at a time as there
# are cores (a process per file, one after another, took 20 s of CTest's time
# starting processes; this takes 2). Each batch's diagnostics go to a file of
# their own, and every differing file is named in them ("FILE:LINE:COL:
# error: code should be clang-formatted").
diag=$(mktemp -d)
trap 'rm -rf "$diag"' EXIT
status=0
printf '%s\0' "${files[@]}" |
  xargs -0 -n 32 -P "$(nproc)" sh -c 'out=$(mktemp -p "$1"); shift; "$0" --dry-run -Werror "$@" >/dev/null 2>"$out"' \
    "$formatter" "$diag" || status=$?
mapfile -t bad < <(cat "$diag"/* |
  sed -n 's/^\(.*\):[0-9][0-9]*:[0-9][0-9]*: error: code should be clang-formatted.*/\1/p' | sort -u)
if [ "$status" -ne 0 ] && [ "${#bad[@]}" -eq 0 ]; then
  # It failed without naming a file (a file or .clang-format it could not read).
  echo "tools/format.sh --check: $formatter failed:" >&2
  cat "$diag"/* >&2
  exit 1
fi
if [ "${#bad[@]}" -gt 0 ]; then
  echo "tools/format.sh --check: ${#bad[@]} of ${#files[@]} files differ from .clang-format:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "run tools/format.sh to rewrite them" >&2
  exit 1
fi
echo "tools/format.sh --check: all ${#files[@]} C/C++ files match .clang-format"
