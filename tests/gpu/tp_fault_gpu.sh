#!/usr/bin/env bash
# tests/gpu/tp_fault_gpu.sh — CTest gpu_tp_fault_rotate_by_row (label gpu): tests/verify/tp_fault_test.sh
# with the traces recorded on the CUDA backend at emulated TP 8 (gemm=fp32_dot, so the TP 1
# replay's logits move by fp32 rounding alone): bisect on the GPU trace with the collective-order
# fault names the all-reduce as parallelism; the clean GPU trace: no defect found.
# usage: tp_fault_gpu.sh LOCKSTEP PYTHON SRC      Skips (exit 77) without CUDA or a GPU.
set -uo pipefail
L=${1:?usage: tp_fault_gpu.sh LOCKSTEP PYTHON SRC} PY=${2:?} SRC=${3:?}
source "$(dirname "$0")/gpu_probe.sh"
gpu_probe "$L" "$SRC/models/lockstep-tiny-v32"
exec bash "$SRC/tests/verify/tp_fault_test.sh" "$L" "$PY" "$SRC" --backend cuda --kernel gemm=fp32_dot
