#!/usr/bin/env bash
# run_client.sh BUILD_DIR SCRIPT [helper-held-bytes]
# Runs a third-party client script with the project's pinned venv under the
# preload library, against a private simulated machine and region. Exit 77
# (skipped) when the venv is missing: tools/setup.sh creates it.
set -euo pipefail
build=$1 script=$2 held=${3:-0}
py=$build/venv/bin/python
if [ ! -x "$py" ]; then
  echo "SKIP: $py missing; run tools/setup.sh $build first"
  exit 77
fi
box=$(mktemp -d /tmp/gpuslice-client-XXXXXX)
trap 'kill $helper 2>/dev/null || true; rm -rf "$box"' EXIT
helper=
export LD_LIBRARY_PATH=$build/fakecuda FAKECUDA_STATE=$box/fakecuda.state GPUSLICE_REGION=$box/region \
       GPUSLICE_MEMORY_LIMIT=64Mi
if [ "$held" -gt 0 ]; then
  LD_PRELOAD=$build/lib/libgpuslice.so "$build/bin/cuprobe" init ctx 0 alloc "$held" touch "$box/held" sleep 60000 >/dev/null &
  helper=$!
  for _ in $(seq 1 500); do [ -e "$box/held" ] && break; sleep 0.01; done
fi
LD_PRELOAD=$build/lib/libgpuslice.so "$py" "$script" "$held"
