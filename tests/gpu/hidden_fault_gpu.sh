#!/usr/bin/env bash
# tests/gpu/hidden_fault_gpu.sh — CTest gpu_hidden_faults (label gpu): the CUDA backend's hidden
# faults (kernels/hidden_fault.h, the cuda_* entries: bugs in its default kernels and launches,
# recorded nowhere) met the way a real GPU bug meets the debugger. For each, the faulty build
# records 4 requests × 40 tokens of lockstep-tiny-v32 with --backend cuda, and bisect — on that
# GPU trace alone, its golden twins running on the CPU — must name the op and the first
# (request, layer, position); the clean build's GPU trace of the same requests must say "no
# defect found" (tests/verify/hidden_fault_test.sh does each case).
# usage: hidden_fault_gpu.sh LOCKSTEP PYTHON SRC      Skips (exit 77) without CUDA or a GPU.
set -uo pipefail
L=${1:?usage: hidden_fault_gpu.sh LOCKSTEP PYTHON SRC} PY=${2:?} SRC=${3:?}
source "$(dirname "$0")/gpu_probe.sh"
gpu_probe "$L" "$SRC/models/lockstep-tiny-v32"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
flags=(-t 0 --backend cuda -m "$SRC/models/lockstep-tiny-v32")
bash "$SRC/tests/verify/hidden_fault_test.sh" --clean "$L" "$W/clean" "${flags[@]}" || { echo "FAIL: the clean GPU recording"; exit 1; }
status=0
# FAULT|OP|REQUEST|LAYER|POSITION: the first norm (layer 0's attn_norm at position 0); the latent
# path's key at the first position it shifts (1); layer 1, the first MoE layer, from position 0;
# and the config's softmax scale (both backends' fault) at the first row with two keys.
for case in "cuda_norm_mean_n_minus_1|attn_norm|0|0|0" \
            "cuda_latent_rope_pos_minus_1|rope_k|0|0|1" \
            "cuda_route_bias_in_weights|router|0|1|0" \
            "cuda_expert_down_k_tail|experts|0|1|0" \
            "softmax_scale_nope_dim|attention|0|0|1"; do
  IFS='|' read -r fault op req layer pos <<<"$case"
  if out=$(bash "$SRC/tests/verify/hidden_fault_test.sh" "$L" "$PY" "$SRC" "$W/clean" "$fault" "$op" "$req" "$layer" "$pos" \
             "${flags[@]}" 2>&1); then
    echo "$fault: ${out##*$'\n'}"
  else
    echo "FAIL $fault:"; echo "$out" | tail -20
    status=1
  fi
done
[ $status -eq 0 ] && echo "PASS: every CUDA hidden fault found on its GPU trace; the clean GPU trace: no defect found"
exit $status
