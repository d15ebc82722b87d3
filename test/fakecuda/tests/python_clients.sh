#!/bin/sh
# Runs NVIDIA's Python bindings against the fake; skipped (77) without the venv.
python="$1"
script="$2"
if [ ! -x "$python" ] || ! "$python" -c "import cuda.bindings.driver, pynvml" 2>/dev/null; then
  echo "skipped: no venv with cuda-bindings and nvidia-ml-py at $python (see test/clients/requirements.txt)"
  exit 77
fi
rm -f "$FAKECUDA_STATE"
"$python" "$script"
status=$?
rm -f "$FAKECUDA_STATE"
exit $status
