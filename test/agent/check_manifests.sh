#!/bin/sh
# deploy/ offline validation: yamllint (syntax and style) on every YAML file,
# then check_manifests.py (the fields the node setup relies on). kubectl
# --dry-run would need a cluster. Exit 77 (skipped) without the tools.
set -eu
deploy=$1 yamllint=$2 python=$3 checker=$4
if [ -z "$yamllint" ] || [ ! -x "$yamllint" ] || [ -z "$python" ]; then
  echo "yamllint or python3 not found: skipped (tools/setup.sh installs them)"
  exit 77
fi
"$yamllint" --strict -c "$deploy/.yamllint" "$deploy"
exec "$python" "$checker" "$deploy"
