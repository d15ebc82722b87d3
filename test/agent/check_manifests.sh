#!/bin/sh
# deploy/ offline validation: yamllint (syntax and style) on every YAML file,
# then check_manifests.py (the fields the node setup relies on), then each
# kustomization rendered by `kubectl kustomize` through the same checks.
# kubectl --dry-run would need a cluster. Exit 77 (skipped) without the tools.
set -eu
deploy=$1 yamllint=$2 python=$3 checker=$4
if [ -z "$yamllint" ] || [ ! -x "$yamllint" ] || [ -z "$python" ]; then
  echo "yamllint or python3 not found: skipped (tools/setup.sh installs them)"
  exit 77
fi
"$yamllint" --strict -c "$deploy/.yamllint" "$deploy"
"$python" "$checker" "$deploy"
# Each kustomization renders (kubectl kustomize, offline), and what it renders
# passes the same checks. Skipped without kubectl.
kubectl=${5:-}
if [ -z "$kubectl" ] || [ ! -x "$kubectl" ]; then
  echo "kubectl not found: kustomizations not rendered"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for k in $(find "$deploy" -name kustomization.yaml | sort); do
  dir=$(dirname "$k")
  mkdir -p "$out/$dir"
  "$kubectl" kustomize "$dir" >"$out/$dir/rendered.yaml" || { echo "kubectl kustomize $dir failed"; exit 1; }
  "$python" "$checker" --rendered "$out/$dir"
done
