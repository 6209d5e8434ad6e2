#!/usr/bin/env bash
# tests/python/torch_recorder_test.sh — lockstep.torch (python/lockstep/torch.py) on the V3 and
# V3.2 fixture models against lockstep's CPU reference; needs torch and transformers (the GPU
# machine: torch 2.11, transformers 5.17), h5py, numpy, xxhash and a lockstep binary (a CPU build
# is enough: the replay runs on the CPU). What it checks: tests/python/torch_recorder_test.py.
#
#   tests/python/torch_recorder_test.sh LOCKSTEP [PLUGIN_DIR (beside LOCKSTEP: hdf5-plugins or plugins)] [WORK_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
ls_bin=$(readlink -f "$1")
plugins=${2:-}
if [ -z "$plugins" ]; then
  for d in "$(dirname "$ls_bin")/hdf5-plugins" "$(dirname "$ls_bin")/plugins"; do
    [ -d "$d" ] && plugins=$d && break
  done
fi
work=${3:-$(mktemp -d)}
py=${PYTHON:-python3}
"$py" -c 'import torch, transformers, h5py, xxhash; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
exec "$py" "$here/torch_recorder_test.py" "$ls_bin" "$plugins" "$work" "$src" "${@:4}"
