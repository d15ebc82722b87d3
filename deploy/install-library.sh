#!/bin/sh
# Installs libgpuslice.so (or a one-line ld.so.preload) on a node without ever
# writing over a file in place: processes have the installed library mapped,
# and overwriting its inode (cp onto it, install(1) into it, a truncating
# write) changes the code under them: they die (SIGSEGV/SIGBUS). Every install
# and upgrade path of gpuslice goes through this script (docs/deploy.md,
# "Upgrading"):
#   1. copy to a hidden temporary file in the destination's directory,
#   2. rename(2) it onto the destination: one atomic step, a new inode; the
#      old inode lives on for the processes that map it, and a process
#      starting meanwhile finds either the old or the new file, never none
#      (a missing /etc/ld.so.preload entry would run it unlimited).
# --protect also marks the installed file immutable (chattr +i), so that an
# in-place copy by someone else fails instead of crashing the processes that
# map it: HAMi's vgpu-init.sh (the device plugin's start-up) does a plain
# `cp` onto <hook>/vgpu/libvgpu.so.<version> whenever the checksums differ.
# That cp then fails with "Operation not permitted" and the script goes on
# (its exit status is that of its last echo). Needs CAP_LINUX_IMMUTABLE and a
# file system with the flag (ext4, xfs, btrfs, tmpfs since Linux 6.0); without
# them the file is installed unprotected and a warning says so.
#
# Usage:
#   install-library.sh [--protect] [--mode MODE] SOURCE DEST...
#   install-library.sh [--protect] --line TEXT DEST...    a file holding one line
#   install-library.sh --release DEST...                  clear the flag (rollback)
# Exit 0 when every DEST holds the content (changed or already equal), 1 on a
# failure (named on stderr), 64 on a usage error.
set -u
protect=0 mode=0644 line="" have_line=0 release=0
usage() { echo "install-library.sh: $*" >&2; echo "usage: install-library.sh [--protect] [--mode MODE] (SOURCE | --line TEXT) DEST... | --release DEST..." >&2; exit 64; }
while [ $# -gt 0 ]; do
  case $1 in
    --protect) protect=1 ;;
    --mode) [ $# -ge 2 ] || usage "--mode needs a value"; mode=$2; shift ;;
    --line) [ $# -ge 2 ] || usage "--line needs a value"; line=$2; have_line=1; shift ;;
    --release) release=1 ;;
    --) shift; break ;;
    -*) usage "unknown option $1" ;;
    *) break ;;
  esac
  shift
done

immutable() {  # is the file marked immutable?
  flags=$(lsattr -d "$1" 2>/dev/null) || return 1
  case ${flags%% *} in *i*) return 0 ;; esac
  return 1
}

if [ "$release" = 1 ]; then
  [ $# -ge 1 ] || usage "--release needs at least one DEST"
  rc=0
  for dest in "$@"; do
    if immutable "$dest"; then
      chattr -i "$dest" || { echo "install-library.sh: cannot clear the immutable flag of $dest" >&2; rc=1; }
    fi
  done
  exit $rc
fi

# Nothing is written outside the destinations' directories (the DaemonSets
# run with a read-only root file system).
source=""
if [ "$have_line" = 1 ]; then
  [ $# -ge 1 ] || usage "--line needs at least one DEST"
else
  [ $# -ge 2 ] || usage "expected SOURCE and at least one DEST"
  source=$1
  shift
  [ -f "$source" ] || { echo "install-library.sh: SOURCE $source: no such file" >&2; exit 1; }
fi

protect_file() {
  immutable "$1" && return 0
  if ! chattr +i "$1" 2>/dev/null; then
    echo "install-library.sh: warning: cannot mark $1 immutable (needs CAP_LINUX_IMMUTABLE and a file system" \
      "that supports it): an in-place copy onto it (HAMi's vgpu-init.sh) would crash the processes mapping it" >&2
  fi
  return 0
}

rc=0
for dest in "$@"; do
  dir=$(dirname "$dest")
  [ -d "$dir" ] || { echo "install-library.sh: DEST $dest: no such directory $dir" >&2; rc=1; continue; }
  tmp="$dir/.$(basename "$dest").gpuslice-new.$$"
  if [ "$have_line" = 1 ]; then
    # The line's content, compared without a file: printf into the temporary only when it differs.
    if [ -f "$dest" ] && [ "$(cat "$dest")" = "$line" ] && [ "$(wc -l <"$dest")" -eq 1 ]; then
      [ "$protect" = 1 ] && protect_file "$dest"
      continue
    fi
  elif [ -f "$dest" ] && cmp -s "$source" "$dest"; then
    [ "$protect" = 1 ] && protect_file "$dest"
    continue
  fi
  if [ "$have_line" = 1 ]; then
    written() { printf '%s\n' "$line" >"$tmp"; }
  else
    written() { cp "$source" "$tmp"; }
  fi
  if ! { written && chmod "$mode" "$tmp"; }; then
    echo "install-library.sh: cannot write $tmp" >&2
    rm -f "$tmp"
    rc=1
    continue
  fi
  sync "$tmp" 2>/dev/null || sync
  # An immutable destination cannot be replaced: clear the flag just before
  # the rename (the window is the two calls' length).
  immutable "$dest" && chattr -i "$dest" 2>/dev/null
  if ! mv -f "$tmp" "$dest"; then
    echo "install-library.sh: cannot rename $tmp onto $dest" >&2
    rm -f "$tmp"
    [ "$protect" = 1 ] && [ -f "$dest" ] && protect_file "$dest"
    rc=1
    continue
  fi
  [ "$protect" = 1 ] && protect_file "$dest"
  echo "install-library.sh: installed $dest"
done
exit $rc
