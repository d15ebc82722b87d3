#!/usr/bin/env bash
# bench/gpu/pack.sh: build gpuslice HERE and pack what bench/gpu/run.sh needs on
# the GPU machine into build-gpu-carry/ (ignored by git through 'build*/'), to be
# carried with the device tool's `carry` (docs/results-gpu.md).
#
#   bench/gpu/pack.sh [--build DIR] [--all]
#
# Why build here: the GPU machine reaches no package registry, and the tools'
# dependencies (CLI11, nlohmann-json, cpp-httplib, GoogleTest, Google Benchmark)
# are Debian packages; both machines are x86-64, and the packed binaries need
# only libc, libstdc++ and libgcc_s there. The bundle holds bin/, lib/,
# fakecuda/, the CTest files (for the conformance tests), ORIGIN (the folders the
# CTest files name; run.sh links them there) and COMMIT.
set -eu -o pipefail

die() { echo "pack.sh: $*" >&2; exit 2; }
build="build-gpu"
all=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) [ $# -ge 2 ] || die "--build needs a folder"; build=$2; shift ;;
    --all) all=1 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1'" ;;
  esac
  shift
done
[ -f bench/gpu/run.sh ] || die "run it from the repository root"
bundle="build-gpu-carry"
jobs=${JOBS:-2}

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache
fi
grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$build/CMakeCache.txt" ||
  echo "pack.sh: warning: $build is not a Release build: figures measured with it are not representative" >&2
grep -q '^GPUSLICE_SANITIZE:STRING=$' "$build/CMakeCache.txt" ||
  die "$build is a sanitizer build; pack a plain Release build"

targets=(gpuslice fakecuda fakecuda_nvml fakecuda-ctl gpuslice-bench gpuslice-microbench gpuslice-smi)
# The programs of the conformance tests (their tests are discovered when they
# are built, so ask the build system for the targets, not CTest).
while read -r t; do
  [ -n "$t" ] && targets+=("$t")
done < <(cmake --build "$build" --target help 2>/dev/null |
         sed -n 's/^\.\.\. //; s/:.*$//; s/ .*$//; /conformance/p' | sort -u)
if [ "$all" = 1 ]; then
  nice cmake --build "$build" -j"$jobs"
else
  nice cmake --build "$build" -j"$jobs" --target "${targets[@]}"
fi

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/fakecuda"
cp -a "$build/lib/." "$bundle/lib/"
cp -a "$build"/fakecuda/*.so* "$bundle/fakecuda/"
if [ "$all" = 1 ]; then
  cp -a "$build/bin/." "$bundle/bin/"
else
  for t in "${targets[@]}"; do
    [ -f "$build/bin/$t" ] && cp -a "$build/bin/$t" "$bundle/bin/"
  done
fi
find "$bundle/bin" "$bundle/lib" "$bundle/fakecuda" -type f -exec strip --strip-unneeded {} + 2>/dev/null || true
# CTest files, in their folders, with the test lists gtest_discover_tests
# writes (PRE_TEST mode: at the first ctest run, so run one now). A list older
# than its program is rediscovered with this machine's CMake modules, which the
# GPU machine lacks: the lists are copied after the programs (and run.sh touches them).
ctest --test-dir "$build" -N > /dev/null 2>&1 || true
(cd "$build" && find . -path '*/CMakeFiles' -prune -o \
   \( -name CTestTestfile.cmake -o -name '*_include.cmake' -o -name '*_tests.cmake' \) -print0) |
  while IFS= read -r -d '' f; do
    mkdir -p "$bundle/$(dirname "$f")" && cp "$build/$f" "$bundle/$f"
  done
# Shared libraries beyond libc/libstdc++/libgcc (libbenchmark): into syslib/,
# which run.sh puts on LD_LIBRARY_PATH.
mkdir -p "$bundle/syslib"
find "$bundle/bin" "$bundle/lib" "$bundle/fakecuda" -type f -exec ldd {} + 2>/dev/null |
  awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r name path; do
    case "$name" in
      libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*) ;;
      *) case "$path" in "$(cd "$build" && pwd)"/*) ;; *) cp -L "$path" "$bundle/syslib/$name" ;; esac ;;
    esac
  done

commit=unknown
if head=$(git rev-parse HEAD 2>/dev/null); then
  commit=$head
  git diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
fi
echo "$commit" > "$bundle/COMMIT"
# Source first: the build folder may lie inside it.
printf 'source=%s\nbuild=%s\n' "$PWD" "$(cd "$build" && pwd)" > "$bundle/ORIGIN"

bundle_kib=$(du -sk "$bundle" | cut -f1)
tree_kib=$( (git ls-files -z 2>/dev/null || true) | xargs -0 -r du -ck 2>/dev/null | tail -1 | cut -f1)
tree_kib=${tree_kib:-0}
echo "pack.sh: $bundle: ${bundle_kib} KiB; tracked tree about ${tree_kib} KiB; device limit 65536 KiB in all"
[ $((bundle_kib + tree_kib)) -lt 60000 ] || echo "pack.sh: warning: close to or over the 64 MiB the device tool carries" >&2
newest=$(find "$bundle/bin" "$bundle/lib" "$bundle/fakecuda" "$bundle/syslib" -type f -exec objdump -T {} + 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
echo "pack.sh: the newest glibc symbol version the bundle needs: $newest (the GPU machine's glibc must be as new)"
echo "pack.sh: now call the device tool: command 'bash bench/gpu/run.sh --out \$OUT', carry [\"$bundle\"], timeout_s 600"
