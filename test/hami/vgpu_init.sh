#!/bin/sh
# What HAMi's device plugin does to the node at every start (postStart hook,
# docker/vgpu-init.sh of Project-HAMi/HAMi), with the source directory as an
# argument instead of the image's /k8s-vgpu/lib/nvidia/: every file of the
# source is copied to the destination with a plain `cp` when it is missing
# or its MD5 differs. cp opens an existing destination with O_TRUNC and
# writes into the same inode: whatever maps that file sees its bytes change.
# Like the original, a failed cp does not change the exit status (the last
# command of each branch is an echo).
# Usage: vgpu_init.sh SOURCE_DIR DEST_DIR
src=${1%/}/ dest=${2%/}/
[ -d "$dest" ] || mkdir -p "$dest"
find "$src" -type f | while read -r f; do
  rel=${f#"$src"}
  d=$dest$rel
  if [ ! -f "$d" ]; then
    mkdir -p "$(dirname "$d")"
    cp "$f" "$d"
    echo "Copied: $f -> $d"
  elif [ "$(md5sum "$f" | cut -d ' ' -f 1)" != "$(md5sum "$d" | cut -d ' ' -f 1)" ]; then
    cp "$f" "$d"
    echo "Copied: $f -> $d"
  else
    echo "Skipped (same MD5): $f"
  fi
done
