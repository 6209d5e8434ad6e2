#!/usr/bin/env bash
# bench/tp_gpus.sh — decode tokens/s of a V3-shaped model larger than one GPU over N GPUs
# (`--tp-ranks N --tp-launch processes --backend cuda`: a process a GPU over NCCL), at batch 1 and
# 64, with each step's GPU time in the collective (--gpu-profile's "gather" phase, rank 0) — the
# figures of docs/performance.md "Tensor parallelism over GPUs". Random bf16 weights drawn on each
# GPU: models/shapes/deepseek-v3-10l's dimensions (V3's), with as many of its 10 layers as N GPUs
# hold at 80 % of their memory (an MoE layer is 23 GB in bf16: 8 layers, 124 GB, on two H100s;
# all 10, 165 GB, on two H200s — more than one GPU holds either way); LAYERS=n sets the count.
#
# usage: bench/tp_gpus.sh LOCKSTEP [N=all GPUs] [OUT=.]
#   TRANSPORT=shm LAYERS=4 bench/tp_gpus.sh LOCKSTEP 2    the script's check on one GPU: two
#   processes sharing it over shared memory (host-staged gathers; not a multi-GPU figure)
# NCCL_NVLS_ENABLE=0 is set here.
set -euo pipefail
L=${1:?usage: tp_gpus.sh LOCKSTEP [N] [OUT]}
gpus=$(nvidia-smi -L | grep -c '^GPU')
N=${2:-$gpus}
OUT=${3:-.}
TRANSPORT=${TRANSPORT:-nccl}
SRC=$(cd "$(dirname "$0")/.." && pwd)
export NCCL_NVLS_ENABLE=0
[ "$N" -ge 2 ] || { echo "tp_gpus: N = $N: nothing to spread over (needs 2 or more)"; exit 77; }
if [ "$TRANSPORT" = nccl ] && [ "$gpus" -lt "$N" ]; then
  echo "tp_gpus: $gpus GPU(s) here, TP $N over NCCL needs $N (TRANSPORT=shm shares one)"; exit 77
fi
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | sort -n | head -1)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/tp_gpus_devices.txt"
M="$OUT/deepseek-v3-shaped"
mkdir -p "$M"
read -r layers size_gb < <(python3 - "$SRC/models/shapes/deepseek-v3-10l/config.json" "$M/config.json" "$N" "$mem_mib" "${LAYERS:-}" <<'PY'
import json, sys
src, dst, n, mem_mib, forced = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
c = json.load(open(src))
gpu_gb = mem_mib * 1.048576 / 1000
dense = c["first_k_dense_replace"]
def size_gb(layers):  # bf16: a dense layer 1.2 GB, an MoE layer 23 GB, embedding (fp32) + lm_head 5.5 GB
    return 5.5 + 1.2 * min(layers, dense) + 23.0 * max(0, layers - dense)
if forced:
    layers = int(forced)
else:
    layers = dense + 1
    while layers < c["num_hidden_layers"] and size_gb(layers + 1) / n < 0.8 * gpu_gb:
        layers += 1
c["num_hidden_layers"] = layers
json.dump(c, open(dst, "w"), indent=1)
print(layers, round(size_gb(layers)))
PY
)
echo "model: V3's dimensions, $layers layers (~$size_gb GB in bf16; one GPU: $((mem_mib / 1024)) GiB), TP $N over $TRANSPORT" | tee "$OUT/tp_gpus_model.txt"
for batch in 1 64; do
  python3 -c "
import json
for r in range($batch):
    print(json.dumps({'prompt_ids': [(37 * i + 101 * r + 5) % 129000 + 2 for i in range(64)], 'max_tokens': 32}))
" > "$OUT/prompts-$batch.jsonl"
  for gemm in bf16 bf16_dot; do
    log="$OUT/tp_gpus-b$batch-$gemm.log"
    "$L" generate -m "$M" --random-weights --backend cuda --tp-ranks "$N" --tp-launch processes \
      --tp-transport "$TRANSPORT" --prompts "$OUT/prompts-$batch.jsonl" --ignore-eos --max-batch "$batch" \
      --kv-cache bf16 --kernel gemm=$gemm --gpu-profile > /dev/null 2> "$log" ||
      { echo "FAIL: batch $batch gemm=$gemm: $(tail -2 "$log")"; exit 1; }
    echo "TP $N ($TRANSPORT), batch $batch, gemm=$gemm: $(grep -o 'decode [0-9.]* tokens/s' "$log"); $(grep -i 'gather' "$log" | head -1)"
  done
done
