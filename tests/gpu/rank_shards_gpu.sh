#!/usr/bin/env bash
# tests/gpu/rank_shards_gpu.sh — CTest gpu_rank_shards (label gpu): rank shards recorded on the
# CUDA backend, whose decode steps hand the taps over in lent pinned buffers with GPU-made
# summaries (engine/cuda_tap_capture.h) — the recorder splits those rows into the shards too.
# lockstep-tiny-v32 at emulated TP 4, three requests batched, full capture: the sharded trace
# diffs identical to the one-file recording of the same run, and h5py reads every rank-split
# tap's stitched values bit for bit the one-file trace's, each row hashing to its summary.
# usage: rank_shards_gpu.sh LOCKSTEP SRC      Skips (exit 77) without CUDA or a GPU.
set -uo pipefail
L=${1:?usage: rank_shards_gpu.sh LOCKSTEP SRC} SRC=${2:?}
M="$SRC/models/lockstep-tiny-v32"
source "$(dirname "$0")/gpu_probe.sh"
gpu_probe "$L" "$M"
PY=$(h5py_python xxhash) || exit 1
set -e
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
/usr/bin/python3 -c "
import json
for r in range(3):
    print(json.dumps({'prompt_ids': [(7 * i + 13 * r + 3) % 6000 for i in range(10 + 3 * r)], 'max_tokens': 12}))
" > "$W/prompts.jsonl"
rec() { "$L" record -m "$M" --prompts "$W/prompts.jsonl" -t 0 --ignore-eos --backend cuda --emulate-tp 4 -q "$@"; }
rec --rank-shards -o "$W/run.h5"
rec -o "$W/plain.h5"
"$L" diff "$W/plain.h5" "$W/run.h5" > "$W/diff.txt" || { echo "FAIL: diff"; cat "$W/diff.txt"; exit 1; }
grep -q identical "$W/diff.txt" || { echo "FAIL: not identical"; cat "$W/diff.txt"; exit 1; }
HDF5_PLUGIN_PATH=${HDF5_PLUGIN_PATH:-} "$PY" - "$W/run.h5" "$W/plain.h5" <<'PYEOF'
import sys, h5py, numpy as np, xxhash
s, p = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
taps = [n for n in s["taps"] if "shards" in s["taps"][n].attrs]
assert len(taps) == 20, taps
rows = 0
for n in taps:
    a, b = s["taps"][n]["values"][...], p["taps"][n]["values"][...]
    assert s["taps"][n]["values"].is_virtual and np.array_equal(a.view(np.uint32), b.view(np.uint32)), n
    assert all(xxhash.xxh3_64_intdigest(r.tobytes()) == h for r, h in zip(a, s["taps"][n]["summary"]["hash"])), n
    rows += len(a)
print(f"PASS: {len(taps)} rank-split taps ({rows} rows) recorded on the GPU in 4 shards read as the one-file trace")
PYEOF
