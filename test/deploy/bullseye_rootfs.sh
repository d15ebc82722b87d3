#!/usr/bin/env bash
# Makes (once) and prints the path of a Debian bullseye root: glibc 2.31, the
# glibc of Ubuntu 20.04-era CUDA base images, with python3 and ctypes. Used by
# the old-glibc tests (test/deploy) and reusable by any test that needs an
# image with an older glibc than the build machine's (e.g. `tar -C ROOT -c .
# | podman import - NAME`).
#
#   test/deploy/bullseye_rootfs.sh [DIR]     (default: <repo>/build/bullseye-root)
#
# The root is cached: DIR/.gpuslice-rootfs-complete marks a finished one,
# reused as it is by later runs (delete DIR to make it again). Concurrent
# callers wait for one another (flock on DIR.lock). Made with debootstrap
# (minbase, about 45 MB downloaded, at most BULLSEYE_ROOTFS_TIMEOUT seconds,
# default 600) from the mirror debootstrap uses by default, or
# $GPUSLICE_DEBIAN_MIRROR; debootstrap is installed with apt-get if missing.
# Needs root. Exits 77 with a one-line reason where the root cannot be made
# (not root, no debootstrap, no network); anything else non-zero is an error.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
root=${1:-$here/build/bullseye-root}
marker=$root/.gpuslice-rootfs-complete
limit=${BULLSEYE_ROOTFS_TIMEOUT:-600}

skip() {
  echo "bullseye_rootfs.sh: cannot make the bullseye root at $root: $*" >&2
  exit 77
}

if [ -f "$marker" ]; then
  echo "$root"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || skip "debootstrap and chroot need root"
mkdir -p "$(dirname "$root")" || exit 1
exec 9>"$root.lock" || exit 1
flock 9 || exit 1
if [ -f "$marker" ]; then  # made by the caller we waited for
  echo "$root"
  exit 0
fi

if ! command -v debootstrap >/dev/null 2>&1; then
  echo "bullseye_rootfs.sh: installing debootstrap" >&2
  { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq debootstrap; } \
    >/dev/null 2>&1 || skip "debootstrap is not installed and apt-get could not install it"
fi

partial=$root.partial
rm -rf "$partial" "$root"
echo "bullseye_rootfs.sh: debootstrap bullseye into $root (once; cached)" >&2
started=$(date +%s)
# python3 with ctypes (libpython3.9-stdlib): the probe runs on the root's own
# interpreter, linked against its own glibc.
if ! timeout "$limit" debootstrap --variant=minbase --include=python3-minimal,libpython3.9-stdlib \
    bullseye "$partial" ${GPUSLICE_DEBIAN_MIRROR:+"$GPUSLICE_DEBIAN_MIRROR"} > "$root.log" 2>&1; then
  tail -n 5 "$root.log" >&2
  rm -rf "$partial"
  skip "debootstrap failed or took over ${limit}s (no network or no mirror?); log: $root.log"
fi
# The downloaded packages are not part of the root.
rm -f "$partial"/var/cache/apt/archives/*.deb
version=$(chroot "$partial" /usr/bin/python3 -c 'import ctypes; l = ctypes.CDLL("libc.so.6"); l.gnu_get_libc_version.restype = ctypes.c_char_p; print(l.gnu_get_libc_version().decode())') \
  || { rm -rf "$partial"; echo "bullseye_rootfs.sh: the new root's python3 does not run" >&2; exit 1; }
mv "$partial" "$root" || exit 1
echo "glibc $version" > "$marker"
echo "bullseye_rootfs.sh: made in $(( $(date +%s) - started ))s, glibc $version" >&2
echo "$root"
