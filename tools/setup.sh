#!/usr/bin/env bash
# Installs what building and testing gpuslice needs on a fresh Debian 12
# machine of this kind (the CUDA 13 toolkit headers, CMake, GoogleTest and
# Google Benchmark are already there), and the pinned third-party clients the
# tests run under the library (cuda-bindings, nvidia-ml-py) into build/venv.
# Idempotent: re-running it does nothing that is already done.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}

need=()
# One package a line. podman + runc + busybox-static: the container tests
# (test/container) run real containers from an image built of files on this
# machine; runc because crun fails on hybrid cgroup layouts. ccache: compiler
# caching (CMakeLists.txt). prometheus (with promtool) and
# chromium-headless-shell: the observability tests (test/agent).
# clang-format: the formatter's check (tools/format.sh). valgrind:
# gpuslice-instructions counts the library's instructions with callgrind.
# clang + libclang-rt-dev (libFuzzer, the sanitizer runtimes): CI's fuzz lane
# (test/fuzz/run.sh). ninja-build: .ci/run's sanitizer lanes and the fuzz
# lane build with Ninja where it is installed (one build keeping both cores
# busy, instead of one make per folder draining to one job at its tail).
for pkg in \
    nlohmann-json3-dev \
    libcli11-dev \
    libcpp-httplib-dev \
    pkgconf \
    yamllint \
    ccache \
    prometheus \
    chromium-headless-shell \
    podman \
    runc \
    busybox-static \
    clang-format \
    clang \
    libclang-rt-dev \
    ninja-build \
    valgrind; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

venv=$build/venv
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$build"
  python3 -m venv "$venv"
fi
# Pinned Python packages of the test suites: third-party clients
# (test/clients) and the CDI schema check (test/hami).
stamp=$venv/.requirements
reqs=()
for req in "$here/test/clients/requirements.txt" "$here/test/hami/requirements.txt" "$here/tools/bench/requirements.txt"; do
  [ -f "$req" ] && reqs+=("$req")
done
if [ ${#reqs[@]} -gt 0 ] && ! cat "${reqs[@]}" | cmp -s - "$stamp"; then
  args=()
  for req in "${reqs[@]}"; do args+=(-r "$req"); done
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${args[@]}"
  cat "${reqs[@]}" > "$stamp"
fi
