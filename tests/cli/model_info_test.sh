#!/usr/bin/env bash
# tests/cli/model_info_test.sh — `lockstep model info` says what memory each backend needs, for a
# checkpoint and for a folder with only a config.json (models/shapes/*: the shapes, the dtypes
# the config declares), in text and in --json, with figures checked against what they count.
#   model_info_test.sh <lockstep> <source dir>
set -u
LS=$1
SRC=$2
fail=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fail=1; }

# A config-only folder: DeepSeek-V2-Lite's published shape, bf16 as its config declares.
v2=$SRC/models/shapes/deepseek-v2-lite
if out=$("$LS" model info "$v2" 2>&1); then ok "model info on a config-only folder"; else bad "model info $v2: $out"; fi
grep -q "parameters  total 15706484224" <<<"$out" && ok "V2-Lite: 15.7B parameters" || bad "V2-Lite parameters: $out"
grep -q "no checkpoint" <<<"$out" && ok "says there is no checkpoint" || bad "no-checkpoint note: $out"
grep -q "^memory      cpu   a checkpoint of 31.4 GB" <<<"$out" && ok "CPU: 31.4 GB of bf16" || bad "CPU line: $out"
grep -q "^            cuda  weights " <<<"$out" && ok "CUDA line" || bad "CUDA line: $out"

check_json() {  # dir, python assertions over j (the JSON) and f (the checkpoint's bytes, 0 without one)
  local dir=$1 what=$2 code=$3
  if "$LS" model info "$dir" --json | python3 -c "
import json, os, sys
j = json.load(sys.stdin)
p = os.path.join('$dir', 'model.safetensors'); f = os.path.getsize(p) if os.path.exists(p) else 0
m = j['memory']; cpu = m['cpu']; cuda = m['cuda']['weight_bytes']
$code
"; then ok "$what"; else bad "$what"; fi
}
# bf16 throughout and no router bias (softmax gate): the bytes are two a parameter.
check_json "$v2" "V2-Lite --json: 2 bytes a parameter, fp8 < bf16 < fp32 on the GPU" '
assert cpu["checkpoint_bytes"] == cpu["weight_bytes"] == 2 * j["parameters"]["total"], cpu
assert cuda["fp8"] < cuda["bf16"] < cuda["fp32"], cuda
assert cpu["fp8_copy_bytes"] > 0 and cpu["kv_cache_bytes_per_token"]["fp32"] == 27 * (512 + 64) * 4'
# A checkpoint: the CPU needs the file mapped; no FP8 copies of an FP8 checkpoint.
check_json "$SRC/models/lockstep-tiny-v32" "tiny-v32 --json: the mapped file's bytes" '
assert cpu["checkpoint_bytes"] == f == 14695968, (cpu, f)
assert cpu["weight_bytes"] <= f and cpu["fp8_copy_bytes"] > 0, cpu
assert cuda["fp8"] < cuda["bf16"] < cuda["fp32"], cuda'
check_json "$SRC/tests/fixtures/models/v3_fp8" "v3_fp8 --json: FP8 read as stored, no copies" '
assert cpu["checkpoint_bytes"] == f and cpu["fp8_copy_bytes"] == 0, cpu
assert j["weights"]["fp8_block_scaled_tensors"] == 72'
# A folder with a broken checkpoint is still an error, not a config-only folder.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$SRC/tests/fixtures/models/v3_basic/config.json" "$tmp/"
head -c 1000 "$SRC/tests/fixtures/models/v3_basic/model.safetensors" >"$tmp/model.safetensors"
if "$LS" model info "$tmp" >/dev/null 2>&1; then bad "a truncated checkpoint is refused"; else ok "a truncated checkpoint is refused"; fi
exit $fail
