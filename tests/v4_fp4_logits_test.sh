#!/usr/bin/env bash
# tests/v4_fp4_logits_test.sh LOCKSTEP V4_MODEL_DIR [WORK_DIR]
#
# Issue 32's acceptance for the 4-bit expert formats: a DeepSeek-V4 model whose routed experts are
# MXFP4 (resp. NVFP4) gives the logits of the same model with those experts replaced by the fp32
# values an independent Python decoder reads from the same bytes; and gemm=mxfp4_dot (nvfp4_dot)
# on the unquantised model, which quantises the experts at load, gives the quantised checkpoint's
# logits bit for bit (the C++ and the Python quantisers write the same bytes).
#
#   1. tools/fixtures/fp4_formats.py quantize writes <work>/mxfp4 and <work>/nvfp4 (routed experts in
#      the published tensor names and dtypes, everything else copied) and each one's fp32 twin
#      <work>/mxfp4_twin, <work>/nvfp4_twin (experts = the Python decoder's values, F32).
#   2. lockstep record runs the same 40-token prompt greedily on the source, each model and its twin
#      for 32 tokens (--capture full --taps logits --logits full: the logits rows lockstep records, the
#      prompt's last position and each decode step), and lockstep export writes them as .npy.
#   3. The quantised model's logits must equal the twin's bit for bit (the C++ decode is exact and
#      tests/fp4_formats_test.cc checks it equals the Python decoder's values; what is left is the
#      forward pass reading the views) and the greedy tokens must agree.
#
# A lockstep that cannot run model_type deepseek_v4 prints "SKIP: ..." and exits 0 (CTest's
# SKIP_REGULAR_EXPRESSION), as does a missing model directory.
# Run it by hand: bash tests/v4_fp4_logits_test.sh build/lockstep models/lockstep-tiny-v4
set -euo pipefail
LOCKSTEP=${1:?usage: v4_fp4_logits_test.sh LOCKSTEP V4_MODEL_DIR [WORK_DIR]}
MODEL=${2:?usage: v4_fp4_logits_test.sh LOCKSTEP V4_MODEL_DIR [WORK_DIR]}
WORK=${3:-}
if [ -z "$WORK" ]; then
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
fi
PY=${LOCKSTEP_NUMPY_PYTHON:-/usr/bin/python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)

if [ ! -f "$MODEL/config.json" ]; then
  echo "SKIP: $MODEL has no config.json (pass a DeepSeek-V4 model directory)"
  exit 0
fi
if ! grep -q '"deepseek_v4"' "$MODEL/config.json"; then
  echo "v4_fp4_logits_test: $MODEL/config.json is not model_type deepseek_v4" >&2
  exit 1
fi

# The prompt: ids below the vocabulary, longer than a sliding window of 8 and several compression windows.
VOCAB=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL/config.json")
IDS=$("$PY" -c "import sys; v=int(sys.argv[1]); print(','.join(str((7*i+3)%v) for i in range(40)))" "$VOCAB")

run() {  # run MODEL_DIR NAME [GEMM] → $WORK/NAME.npy (logits), $WORK/NAME.tokens (greedy ids)
  local out
  if ! out=$("$LOCKSTEP" record -m "$1" --prompt-ids "$IDS" -n 32 -t 0 --ignore-eos --capture full --taps logits \
               --logits full --no-kv --kernel gemm="${3:-fp32}" -q -o "$WORK/$2.h5" 2>&1); then
    if grep -q "'deepseek_v4' is not supported" <<<"$out"; then
      echo "SKIP: lockstep does not run model_type deepseek_v4 yet: $(head -1 <<<"$out")"
      exit 0
    fi
    echo "$out" >&2
    exit 1
  fi
  "$LOCKSTEP" export "$WORK/$2.h5" -r 0 --tap logits -o "$WORK/$2.npy" >/dev/null
  "$PY" - "$WORK/$2.h5" > "$WORK/$2.tokens" <<'EOF'
import sys, h5py
with h5py.File(sys.argv[1], "r") as f:
    print(",".join(str(int(t)) for t in f["requests/0/final/generated"][()]))
EOF
}

# The source model first: it is what tells whether this lockstep runs DeepSeek-V4 at all (SKIP).
run "$MODEL" source
for fmt in mxfp4 nvfp4; do
  "$PY" "$HERE/tools/fixtures/fp4_formats.py" quantize --model "$MODEL" --out "$WORK/$fmt" --format "$fmt" \
    --twin "$WORK/${fmt}_twin" >/dev/null
  run "$WORK/$fmt" "$fmt"
  run "$WORK/${fmt}_twin" "${fmt}_twin"
  "$PY" - "$WORK/$fmt.npy" "$WORK/${fmt}_twin.npy" "$fmt" <<'EOF'
import sys
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
if a.shape != b.shape:
    sys.exit(f"{sys.argv[3]}: logits {a.shape} vs the twin's {b.shape}")
same = a.view(np.uint32) == b.view(np.uint32)
if not same.all():
    i = np.argwhere(~same)[0]
    d = np.max(np.abs(a.astype(np.float64) - b))
    sys.exit(f"{sys.argv[3]}: logits differ from the Python-decoded twin's at row {i[0]} col {i[1]} "
             f"({a[tuple(i)]} vs {b[tuple(i)]}; max |diff| {d:.3g} over {a.size} values)")
print(f"{sys.argv[3]}: {a.shape[0]} logits rows equal the twin's bit for bit")
EOF
  if ! cmp -s "$WORK/$fmt.tokens" "$WORK/${fmt}_twin.tokens"; then
    echo "$fmt: greedy tokens differ from the twin's: $(cat "$WORK/$fmt.tokens") vs $(cat "$WORK/${fmt}_twin.tokens")" >&2
    exit 1
  fi
  # gemm=<fmt>_dot on the source quantises its experts at load (kernels/fp4.h); the Python tool
  # quantised them by the same rules, written independently: the same bytes, the same logits.
  run "$MODEL" "${fmt}_dot" "${fmt}_dot"
  "$PY" - "$WORK/$fmt.npy" "$WORK/${fmt}_dot.npy" "$fmt" <<'EOF'
import sys
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
if a.shape != b.shape or not (a.view(np.uint32) == b.view(np.uint32)).all():
    sys.exit(f"{sys.argv[3]}: gemm={sys.argv[3]}_dot on the source differs from the {sys.argv[3]} checkpoint "
             f"(max |diff| {np.max(np.abs(a.astype(np.float64) - b)) if a.shape == b.shape else a.shape})")
print(f"{sys.argv[3]}: gemm={sys.argv[3]}_dot on the source gives the {sys.argv[3]} checkpoint's logits bit for bit")
EOF
done
"$PY" - "$WORK/source.npy" "$WORK/mxfp4.npy" "$WORK/nvfp4.npy" <<'EOF'
import sys
import numpy as np
src = np.load(sys.argv[1]).astype(np.float64)
for name, path in (("mxfp4", sys.argv[2]), ("nvfp4", sys.argv[3])):
    q = np.load(path).astype(np.float64)
    print(f"{name}: max |logits - source's| {np.max(np.abs(q - src)):.3g} (the quantisation's effect, for the record)")
EOF
echo "v4_fp4_logits_test: MXFP4 and NVFP4 experts give their Python-decoded twins' logits"
