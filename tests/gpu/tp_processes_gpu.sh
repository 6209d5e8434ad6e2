#!/usr/bin/env bash
# tests/gpu/tp_processes_gpu.sh — CTest gpu_tp_processes (label gpu): the CUDA backend's ranks as
# processes (`--tp-ranks 2 --tp-launch processes --backend cuda`, cli/rank_launch.h), as a
# multi-GPU run has them. On one GPU the two processes share it and meet in shared memory
# (NCCL refuses two ranks on one GPU, and the launcher says so when asked for it); with two or
# more GPUs they run over NCCL, one GPU each, with CUDA graphs. Either way the trace of
# lockstep-tiny-v32 (three requests, full capture, bf16_dot and cuBLAS fp32 products) diffs
# identical to emulated TP 2's on one GPU: every tensor's content hash, cache row and token; and
# a --rank-shards recording opens in h5py, its stitched taps emulated TP 2's values.
# usage: tp_processes_gpu.sh LOCKSTEP SRC      Skips (exit 77) without CUDA or a GPU.
set -uo pipefail
L=${1:?usage: tp_processes_gpu.sh LOCKSTEP SRC} SRC=${2:?}
M="$SRC/models/lockstep-tiny-v32"
source "$(dirname "$0")/gpu_probe.sh"
gpu_probe "$L" "$M"
PY=$(h5py_python) || exit 1
export NCCL_NVLS_ENABLE=0
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
printf '%s\n' '{"prompt": "hello there", "max_tokens": 10}' '{"prompt": "the cat sat on", "max_tokens": 7}' \
  '{"prompt": "<div class=", "max_tokens": 12}' > "$W/p.jsonl"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
transports="shm"
[ "$gpus" -ge 2 ] && transports="shm nccl"
rec() { "$L" record -m "$M" --prompts "$W/p.jsonl" -t 0 --ignore-eos --backend cuda -q "$@"; }
for gemm in bf16_dot fp32; do
  rec --kernel gemm=$gemm --emulate-tp 2 -o "$W/emu-$gemm.h5" || fail "record --emulate-tp 2 ($gemm)"
  for t in $transports; do
    rec --kernel gemm=$gemm --tp-ranks 2 --tp-launch processes --tp-transport $t -o "$W/$t-$gemm.h5" \
      2> "$W/$t-$gemm.err" || fail "record --tp-launch processes --tp-transport $t ($gemm): $(tail -2 "$W/$t-$gemm.err")"
    "$L" diff "$W/emu-$gemm.h5" "$W/$t-$gemm.h5" > "$W/d.txt" || fail "diff $t ($gemm): $(tail -3 "$W/d.txt")"
    grep -q "^identical" "$W/d.txt" || fail "$t ($gemm) not identical to emulated TP 2: $(tail -3 "$W/d.txt")"
    echo "ok: $t, gemm=$gemm: the processes' trace is emulated TP 2's"
  done
done
# Rank shards from the processes (each rank process writes its own): h5py reads the stitched taps
# as virtual datasets, bit for bit the emulation's one-file trace, and each shard names its
# writer (rank r, a process of its own).
last=${transports##* }
rec --kernel gemm=bf16_dot --tp-ranks 2 --tp-launch processes --tp-transport "$last" --rank-shards \
  -o "$W/shards.h5" 2> "$W/shards.err" || fail "record --rank-shards over $last: $(tail -2 "$W/shards.err")"
[ -f "$W/shards.h5.rank1" ] || fail "--rank-shards over $last wrote no rank 1 shard"
HDF5_PLUGIN_PATH=${HDF5_PLUGIN_PATH:-} "$PY" - "$W/shards.h5" "$W/emu-bf16_dot.h5" <<'PYEOF' || fail "h5py on the stitched trace"
import sys, h5py, numpy as np
s, e = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
taps = [n for n in s["taps"] if "shards" in s["taps"][n].attrs]
assert taps, "no rank-split taps"
for n in taps:
    v = s["taps"][n]["values"]
    assert v.is_virtual, n
    assert np.array_equal(v[...].view(np.uint32), e["taps"][n]["values"][...].view(np.uint32)), n
m = [h5py.File(f"{sys.argv[1]}.rank{r}", "r")["meta"].attrs for r in (0, 1)]
txt = lambda a, k: a[k].decode() if isinstance(a[k], bytes) else str(a[k])
assert [txt(a, "shard_writer_rank") for a in m] == ["0", "1"], [txt(a, "shard_writer_rank") for a in m]
assert txt(m[0], "shard_writer_pid") != txt(m[1], "shard_writer_pid"), "one process wrote both shards"
print(f"ok: h5py reads {len(taps)} stitched taps of the processes' shards as emulated TP 2's values; "
      f"shard r written by rank r (pids {txt(m[0], 'shard_writer_pid')}, {txt(m[1], 'shard_writer_pid')})")
PYEOF
if [ "$gpus" -lt 2 ]; then
  e=$("$L" generate -m "$M" --prompt hi -n 2 --backend cuda --tp-ranks 2 --tp-launch processes --tp-transport nccl \
      -q 2>&1); rc=$?
  [ $rc -ne 0 ] && [[ $e == *"need a GPU each"* ]] || fail "nccl on one GPU: rc $rc: $e"
  echo "ok: one GPU here: NCCL not run (refused with: $e)"
fi
echo "ok: ranks as processes on $gpus GPU(s) ($transports) give emulated TP 2's trace"
