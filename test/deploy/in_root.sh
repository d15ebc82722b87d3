#!/usr/bin/env bash
# Runs one command inside an old root (bullseye_rootfs.sh) the way a container
# of that image runs it: chrooted, with a clean environment, the build's
# preload library and simulated driver copied in. The cached root is never
# written: the command sees it through an overlay in a private mount namespace
# whose writable layer is SCRATCH/upper (the command's /tmp, its region and
# simulated machine included).
#
#   in_root.sh ROOT SCRATCH BUILD MODE [NAME=VALUE...] -- COMMAND [ARGS...]
#
# Inside the root: /opt/gpuslice/lib/libgpuslice.so, /opt/gpuslice/fakecuda/
# (on LD_LIBRARY_PATH), /opt/gpuslice/quota_probe.py. MODE: `none` (the
# library is not injected), `ld_preload` (LD_PRELOAD names it) or
# `ld_so_preload` (/etc/ld.so.preload names it: every program loads it). The
# command's environment is exactly LD_LIBRARY_PATH, PATH, the NAME=VALUE pairs
# and LD_PRELOAD in that mode. Exits with the command's status; 77 where no
# private mount namespace with an overlay can be made (needs root).
#
# IN_ROOT_CONF=FILE copies FILE to the root's /etc/gpuslice/gpuslice.conf (the
# library's default configuration file). IN_ROOT_BARE=1 installs the simulated
# driver where a real one is (/usr/lib/x86_64-linux-gnu) and gives the command
# no variable at all but the NAME=VALUE pairs (no PATH, no LD_LIBRARY_PATH).
# /dev/shm is a directory of the overlay (the default region and state go there).
set -euo pipefail
[ $# -ge 6 ] || { echo "usage: in_root.sh ROOT SCRATCH BUILD MODE [NAME=VALUE...] -- COMMAND..." >&2; exit 2; }
root=$1 scratch=$2 build=$3 mode=$4
shift 4
vars=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do vars+=("$1"); shift; done
[ "${1:-}" = "--" ] || { echo "in_root.sh: missing -- before the command" >&2; exit 2; }
shift
here=$(cd "$(dirname "$0")" && pwd)

case "$mode" in
  none|ld_so_preload) ;;
  ld_preload) vars+=("LD_PRELOAD=/opt/gpuslice/lib/libgpuslice.so") ;;
  *) echo "in_root.sh: MODE must be none, ld_preload or ld_so_preload, not '$mode'" >&2; exit 2 ;;
esac

mkdir -p "$scratch/upper" "$scratch/work" "$scratch/merged"
if ! unshare -m true 2>/dev/null; then
  echo "in_root.sh: cannot make a private mount namespace (unshare -m; needs root)" >&2
  exit 77
fi
# Everything below runs in the new mount namespace (private propagation:
# nothing is mounted on the host).
exec unshare -m --propagation private bash -euo pipefail -c '
  root=$1 scratch=$2 build=$3 mode=$4 here=$5 conf=$6 bare=$7
  shift 7
  merged=$scratch/merged
  if ! mount -t overlay overlay -o "lowerdir=$root,upperdir=$scratch/upper,workdir=$scratch/work" "$merged" 2>/dev/null; then
    echo "in_root.sh: cannot mount an overlay of $root (overlayfs; needs root)" >&2
    exit 77
  fi
  mount -t proc proc "$merged/proc"
  mkdir -p "$merged/opt/gpuslice/lib" "$merged/opt/gpuslice/fakecuda"
  cp "$build/lib/libgpuslice.so" "$merged/opt/gpuslice/lib/"
  cp -a "$build/fakecuda/." "$merged/opt/gpuslice/fakecuda/"
  cp "$here/quota_probe.py" "$merged/opt/gpuslice/"
  mkdir -p "$merged/dev/shm"
  if [ "$mode" = ld_so_preload ]; then
    echo /opt/gpuslice/lib/libgpuslice.so > "$merged/etc/ld.so.preload"
  fi
  if [ -n "$conf" ]; then
    mkdir -p "$merged/etc/gpuslice"
    cp "$conf" "$merged/etc/gpuslice/gpuslice.conf"
  fi
  if [ "$bare" = 1 ]; then
    cp -a "$build/fakecuda/." "$merged/usr/lib/x86_64-linux-gnu/"
    exec chroot "$merged" /usr/bin/env -i "$@"
  fi
  exec chroot "$merged" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/opt/gpuslice/fakecuda "$@"
' in_root "$root" "$scratch" "$build" "$mode" "$here" "${IN_ROOT_CONF:-}" "${IN_ROOT_BARE:-0}" "${vars[@]}" "$@"
