#!/usr/bin/env bash
# tests/gpu/tp_fault_gpu.sh — CTest gpu_tp_fault_rotate_by_row (label gpu): tests/verify/tp_fault_test.sh
# with the traces recorded on the CUDA backend at emulated TP 8 (gemm=fp32_dot, so the TP 1
# replay's logits move by fp32 rounding alone): bisect on the GPU trace with the collective-order
# fault names the all-reduce as parallelism; the clean GPU trace: no defect found.
# usage: tp_fault_gpu.sh LOCKSTEP PYTHON SRC      Skips (exit 77) without CUDA or a GPU.
set -uo pipefail
L=${1:?usage: tp_fault_gpu.sh LOCKSTEP PYTHON SRC} PY=${2:?} SRC=${3:?}
probe=$("$L" generate --backend cuda -m "$SRC/models/lockstep-tiny-v32" --prompt hi -n 1 --quiet 2>&1)
if [ $? -ne 0 ]; then
  case $probe in
    *"without CUDA"*|*"no CUDA device"*|*"CUDA driver"*) echo "SKIP: $probe"; exit 77 ;;
  esac
  echo "FAIL: probe: $probe"; exit 1
fi
exec bash "$SRC/tests/verify/tp_fault_test.sh" "$L" "$PY" "$SRC" --backend cuda --kernel gemm=fp32_dot
