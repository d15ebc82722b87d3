#!/bin/sh
# Runs a command the way a container set up by HAMi's device plugin runs it,
# in a private mount namespace (nothing leaks to the host):
#   /usr/local/vgpu            <- the host's <hook>/vgpu/containers/<pod-uid>_<container> (read-write)
#   /usr/local/vgpu/libvgpu.so <- the host's <hook>/vgpu/libvgpu.so (read-only)
#   /etc/ld.so.preload         <- the host's <hook>/vgpu/ld.so.preload
# /usr/local is a fresh tmpfs and /etc holds only the loader's files
# (ld.so.cache, ld.so.preload): enough for a program whose libraries come from
# LD_LIBRARY_PATH and the loader's cache. /tmp/vgpulock is not reproduced:
# gpuslice does not use it.
#
# Usage: hami_container.sh HOOK CONTAINER_DIR COMMAND [ARG...]
# Exit 77 (before running COMMAND) when no mount namespace can be made here
# (no unshare(1), no root and no unprivileged user namespaces).
set -u
hook=$1 cdir=$2
shift 2
command -v unshare >/dev/null 2>&1 || { echo "hami_container: unshare(1) not found" >&2; exit 77; }
if [ "$(id -u)" = 0 ]; then ns="--mount"; else ns="--user --map-root-user --mount"; fi
# shellcheck disable=SC2086
unshare $ns true 2>/dev/null || { echo "hami_container: cannot make a mount namespace here" >&2; exit 77; }
# shellcheck disable=SC2086,SC2016
exec unshare $ns --propagation private /bin/sh -c '
  hook=$1 cdir=$2
  shift 2
  fail() { echo "hami_container: $*" >&2; exit 77; }
  mount -t tmpfs -o size=4m,mode=0755 hami-usr-local /usr/local || fail "tmpfs on /usr/local"
  mkdir -p /usr/local/vgpu /usr/local/.etc || fail "mkdir"
  cp /etc/ld.so.cache /usr/local/.etc/ 2>/dev/null
  cp "$hook/vgpu/ld.so.preload" /usr/local/.etc/ld.so.preload || fail "copy ld.so.preload"
  mount --bind "$cdir" /usr/local/vgpu || fail "bind the container directory"
  # The runtime makes the file mount point inside the bind-mounted directory,
  # as it does under HAMi (an empty libvgpu.so appears in the host directory).
  [ -e /usr/local/vgpu/libvgpu.so ] || : >/usr/local/vgpu/libvgpu.so || fail "mount point"
  mount --bind "$hook/vgpu/libvgpu.so" /usr/local/vgpu/libvgpu.so || fail "bind libvgpu.so"
  mount --bind /usr/local/.etc /etc || fail "bind /etc"
  exec "$@"
' hami_container "$hook" "$cdir" "$@"
echo "hami_container: unshare failed" >&2
exit 77
