#!/usr/bin/env bash
# tests/cli/first_hour_test.sh — what a new user meets in the first hour (issue 28): --help that
# shows defaults, typos refused before a model loads, greedy degen as one sample with a legend,
# inspect in natural order and words, a forced replay that says what the change did to the
# logits and the text, a moved model folder named as such, and the trace size said up front.
# Usage: first_hour_test.sh LOCKSTEP_BINARY SOURCE_DIR
set -u
LS=$1
SRC=$2
FIX=$SRC/tests/fixtures/models
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fail=1; }
P=$'<!DOCTYPE html>\n<html>\n<head>\n<title>Counter</title>'

# --help shows every default: generate's 64 tokens, degen's 256, record's capture mode.
"$LS" generate --help | grep -- "--max-tokens" | grep -qF "[default: 64]" && ok "generate --help: -n default 64" ||
  bad "generate --help shows no default for --max-tokens"
"$LS" degen --help | grep -- "--max-tokens" | grep -qF "[default: 256]" && ok "degen --help: -n default 256" ||
  bad "degen --help shows no default for --max-tokens"
"$LS" record --help | grep -- "--capture" | grep -qF "[default: full]" && ok "record --help: capture default" ||
  bad "record --help shows no default for --capture"
"$LS" generate --help | grep -q "INT:" && bad "generate --help prints validator noise (INT:…)" || ok "help has no INT:… noise"
# -t is --temperature wherever it exists; export's tensor is --tap only.
"$LS" export --help | grep -qE -- "-t,--tap" && bad "export still has -t for --tap" || ok "export: no -t"

# Typos fail before the model loads: no 'loaded' line, and fast even with a missing model.
for args in "--kernel attn_decode=nope" "--fault no_such_fault" "--kv-cache fp4" "--prompts $TMP/none.jsonl"; do
  # shellcheck disable=SC2086
  "$LS" generate -m /nonexistent/model -p hi $args >"$TMP/o" 2>"$TMP/e"
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -lt 128 ] && ! grep -q "not a model directory" "$TMP/e" && [ "$(wc -l <"$TMP/e")" -eq 1 ]; then
    ok "generate $args: refused before the model: $(cat "$TMP/e")"
  else
    bad "generate $args (rc $rc): $(cat "$TMP/e")"
  fi
done
"$LS" record -m /nonexistent/model -p hi --kernel gemm=nope -o "$TMP/x.h5" 2>"$TMP/e"
grep -q "gemm" "$TMP/e" && ! grep -q "not a model directory" "$TMP/e" && ok "record checks kernels first" ||
  bad "record: $(cat "$TMP/e")"
"$LS" degen -m /nonexistent/model -p hi --temperatures 0,abc 2>"$TMP/e"
grep -q -- "--temperatures" "$TMP/e" && ok "degen checks --temperatures first" || bad "degen: $(cat "$TMP/e")"

# degen at temperature 0: one greedy sample, a legend under the table.
"$LS" degen -p "$P" --samples 4 -n 64 --temperatures 0,1.0 >"$TMP/degen.txt" 2>/dev/null
if grep -E "^T=0 +1 \(greedy\)" "$TMP/degen.txt" >/dev/null && grep -E "^T=1 +4 " "$TMP/degen.txt" >/dev/null &&
  grep -q "^degenerate: the share of samples" "$TMP/degen.txt"; then
  ok "degen: greedy is one sample, legend printed"
else
  bad "degen table: $(cat "$TMP/degen.txt")"
fi

# record says what the capture will weigh; inspect lists layers in natural order and the
# policy in words. This part reads V3.2's FP8 latent cache: lockstep-tiny-v32 (the default,
# V4, is checked below).
V32=$SRC/models/lockstep-tiny-v32
"$LS" record -m "$V32" -p "$P" -n 24 -t 0 --kv-cache fp8_e4m3 -o "$TMP/run.h5" 2>"$TMP/rec.err" >/dev/null
grep -q "this capture takes ~.* a position before compression" "$TMP/rec.err" && ok "record estimates the trace size" ||
  bad "record gave no size estimate: $(cat "$TMP/rec.err")"
"$LS" inspect "$TMP/run.h5" >"$TMP/inspect.txt"
grep -q "^capture: full; layers all, positions all" "$TMP/inspect.txt" && ok "inspect: capture policy in words" ||
  bad "inspect capture line: $(grep capture "$TMP/inspect.txt")"
grep -q "9223372036854775807" "$TMP/inspect.txt" && bad "inspect prints INT64_MAX" || ok "inspect: no INT64_MAX"
"$LS" inspect "$TMP/run.h5" --json | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)
assert j["capture_policy"]["layers"][1] is None, j["capture_policy"]
kv = [t for t in j["tensors"] if t["path"].startswith("kv/")]
assert kv and all(isinstance(t["attrs"]["token_bytes"], int) for t in kv), kv[:1]
paths = [t["path"] for t in j["tensors"]]
import re
def key(p): return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p)]
assert paths == sorted(paths, key=key), paths
' && ok "inspect --json: open range null, KV byte counts as numbers, natural order" || bad "inspect --json"

# export dequantises an FP8 cache part with its scales: checked against an independent numpy
# decoder of OCP E4M3 applied to the stored codes and scales (h5py), and against the fp32 latent
# tap within E4M3's rounding (3 mantissa bits: relative error ≤ 2^-4 of the tile's scale × 448).
"$LS" export "$TMP/run.h5" --request 0 --tap kv/layers.1.latent -o "$TMP/lat.npy" 2>/dev/null &&
  "$LS" export "$TMP/run.h5" --request 0 --tap kv/layers.1.latent --raw -o "$TMP/lat_raw.npy" 2>/dev/null &&
  "$LS" export "$TMP/run.h5" --request 0 --tap layers.1.attn.latent -o "$TMP/lat_f32.npy" 2>/dev/null ||
  bad "export of the FP8 latent failed"
HDF5_PLUGIN_PATH=$(dirname "$LS")/hdf5-plugins /usr/bin/python3 - "$TMP" <<'PY' && ok "export dequantises FP8 with its scales" || bad "FP8 export"
import sys, numpy as np, h5py
d = sys.argv[1]
deq, raw, ref = np.load(f"{d}/lat.npy"), np.load(f"{d}/lat_raw.npy"), np.load(f"{d}/lat_f32.npy")
assert deq.dtype == np.float32 and raw.dtype == np.uint8 and deq.shape == raw.shape, (deq.dtype, raw.dtype)
def e4m3(b):  # OCP E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7F/0xFF NaN
    b = b.astype(np.int64); s = np.where(b & 0x80, -1.0, 1.0); e = (b >> 3) & 0xF; m = b & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, s * v)
f = h5py.File(f"{d}/run.h5", "r")
summ = f["kv/layers.1.latent.scales/summary"][...]
sc = f["kv/layers.1.latent.scales/values"][...][summ["request"] == 0]
sc = sc[np.argsort(summ["position"][summ["request"] == 0], kind="stable")]
want = e4m3(raw) * np.repeat(sc, 128, axis=1)[:, : raw.shape[1]]
assert np.array_equal(want.astype(np.float32), deq), "export's dequantisation differs from the independent decoder"
n = min(len(ref), len(deq))  # the tap holds every position the cache does
err = np.abs(deq[:n] - ref[:n]).max() / np.abs(ref[:n]).max()
assert err < 2 ** -3, err
PY
# The default model (DeepSeek-V4) with FlashMLA's MODEL1 cache: export gives the whole row, the
# 448 nope values dequantised with their UE8M0 exponents (2^(s-127) a 64-value tile) and the
# 64 BF16 RoPE values after them — checked against the same kind of independent decoder of the
# three stored parts, and against the fp32 K = V tap (layers.0.attn.kv) within E4M3's rounding.
"$LS" record -p "$P" -n 24 -t 0 --kv-cache fp8_e4m3 -o "$TMP/v4.h5" -q 2>/dev/null &&
  "$LS" export "$TMP/v4.h5" --request 0 --tap kv/layers.0.window -o "$TMP/win.npy" 2>/dev/null &&
  "$LS" export "$TMP/v4.h5" --request 0 --tap layers.0.attn.kv -o "$TMP/kv_f32.npy" 2>/dev/null ||
  bad "record or export of the default (V4) model's MODEL1 window failed"
HDF5_PLUGIN_PATH=$(dirname "$LS")/hdf5-plugins /usr/bin/python3 - "$TMP" <<'PY' && ok "export dequantises V4's MODEL1 rows whole" || bad "MODEL1 export"
import sys, numpy as np, h5py
d = sys.argv[1]
deq, ref = np.load(f"{d}/win.npy"), np.load(f"{d}/kv_f32.npy")
def e4m3(b):
    b = b.astype(np.int64); s = np.where(b & 0x80, -1.0, 1.0); e = (b >> 3) & 0xF; m = b & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, s * v)
f = h5py.File(f"{d}/v4.h5", "r")
def part(name):
    summ = f[name + "/summary"][...]
    mine = summ["request"] == 0
    return f[name + "/values"][...][mine][np.argsort(summ["position"][mine], kind="stable")]
codes, exps, rope = part("kv/layers.0.window"), part("kv/layers.0.window.scales"), part("kv/layers.0.window.rope")
nope = e4m3(codes) * np.repeat(2.0 ** (exps.astype(np.int64) - 127), 64, axis=1)[:, : codes.shape[1]]
tail = (rope.astype(np.uint32) << 16).view(np.float32)
want = np.concatenate([nope, tail], axis=1).astype(np.float32)
assert deq.dtype == np.float32 and deq.shape == want.shape == (codes.shape[0], 512), (deq.shape, want.shape)
assert np.array_equal(want, deq), "export's MODEL1 row differs from the independent decoder"
n = min(len(ref), len(deq))
err = np.abs(deq[:n] - ref[:n]).max() / np.abs(ref[:n]).max()
assert 0 < err < 2 ** -3, err
PY
# `inspect … | head -1`: a reader that goes away is no crash. Its stdout is a pipe whose read end
# is closed before it starts, so its first write meets SIGPIPE every time.
/usr/bin/python3 - "$LS" "$TMP/v4.h5" <<'PY' && ok "a closed pipe is not reported as a crash" || bad "inspect into a closed pipe"
import os, subprocess, sys
r, w = os.pipe()
os.close(r)
p = subprocess.run([sys.argv[1], "inspect", sys.argv[2]], stdout=w, stderr=subprocess.PIPE, text=True)
os.close(w)
assert p.returncode == -13, p.returncode  # killed by SIGPIPE, as any Unix filter
assert "crash" not in p.stderr, p.stderr
PY
"$LS" export "$TMP/run.h5" --request 0 --tap logits -o "$TMP/l.npy" 2>"$TMP/e"
grep -q "logits.topk_ids" "$TMP/e" && ok "export of top-k logits points at the top-k datasets" || bad "export logits: $(cat "$TMP/e")"

# A model with 12 layers, so that string order (layers.10 before layers.2) and natural order
# differ: v3_basic's config with num_hidden_layers 12, its layers' tensors repeated.
M=$TMP/deep
mkdir -p "$M"
/usr/bin/python3 - "$FIX/v3_basic" "$M" <<'PY' || bad "could not make a 12-layer fixture"
import json, re, struct, sys
src, dst = sys.argv[1], sys.argv[2]
cfg = json.load(open(f"{src}/config.json"))
n = cfg["num_hidden_layers"]
cfg["num_hidden_layers"] = 12
json.dump(cfg, open(f"{dst}/config.json", "w"))
raw = open(f"{src}/model.safetensors", "rb").read()
hlen = struct.unpack("<Q", raw[:8])[0]
head = json.loads(raw[8:8 + hlen])
data = raw[8 + hlen:]
out_head, blobs, off = {}, [], 0
def put(name, info):
    global off
    b = data[info["data_offsets"][0]:info["data_offsets"][1]]
    out_head[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [off, off + len(b)]}
    blobs.append(b); off += len(b)
for name, info in head.items():
    if name == "__metadata__":
        continue
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if not m:
        put(name, info)
    else:  # layers past the fixture's are copies of its last (a MoE layer past first_k_dense_replace)
        i = int(m.group(1))
        for L in [i] + (list(range(n, 12)) if i == n - 1 else []):
            put(f"model.layers.{L}.{m.group(2)}", info)
h = json.dumps(out_head).encode()
h += b" " * ((8 - len(h) % 8) % 8)
open(f"{dst}/model.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
PY
"$LS" record -m "$M" --prompt-ids 5,6,7,8 -n 3 -o "$TMP/deep.h5" -q 2>"$TMP/e" || bad "record on the 12-layer model: $(cat "$TMP/e")"
"$LS" inspect "$TMP/deep.h5" | grep -oE "taps/layers\.[0-9]+\.resid_out" | sed -E 's/taps\/layers\.([0-9]+)\..*/\1/' |
  tr '\n' ' ' >"$TMP/order"
[ "$(cat "$TMP/order")" = "0 1 2 3 4 5 6 7 8 9 10 11 " ] && ok "inspect: layers in natural order" ||
  bad "inspect layer order: $(cat "$TMP/order")"

# replay checks its kernel overrides before the model loads (the model folder is gone here).
"$LS" replay "$TMP/run.h5" --mode forced --kernel attn_decode=nope -m /nonexistent/model -o "$TMP/z.h5" 2>"$TMP/e"
grep -q "attn_decode=nope: unknown variant" "$TMP/e" && ok "replay checks --kernel first" || bad "replay --kernel: $(cat "$TMP/e")"

# A forced replay says how many positions flipped, the KL, and what happens to the text.
"$LS" replay "$TMP/run.h5" --mode forced --kv-cache bf16 -o "$TMP/f.h5" >"$TMP/forced.txt" 2>/dev/null
head -1 "$TMP/forced.txt" | grep -qE "with kv_cache=bf16: [0-9]+ of [0-9]+ positions changed their most likely token.*mean KL .* nats, max .*Text: " &&
  ok "forced replay: flips, KL and the text" || bad "forced replay verdict: $(head -1 "$TMP/forced.txt")"

# The recorded model folder moved: say so and suggest --model.
cp -r "$SRC/models/lockstep-tiny-v32" "$TMP/model"
"$LS" record -m "$TMP/model" -p "$P" -n 4 -o "$TMP/moved.h5" -q
mv "$TMP/model" "$TMP/model-elsewhere"
"$LS" replay "$TMP/moved.h5" -o "$TMP/m2.h5" 2>"$TMP/e" >/dev/null
rc=$?
[ $rc -ne 0 ] && grep -q "recorded model folder .* is not there; pass the model's folder with --model" "$TMP/e" &&
  ok "replay: moved model folder named" || bad "replay of a moved model (rc $rc): $(cat "$TMP/e")"
"$LS" replay "$TMP/moved.h5" -o "$TMP/m3.h5" -m "$TMP/model-elsewhere" -q >/dev/null && ok "replay --model finds it" ||
  bad "replay --model DIR failed"

# Numbers are checked as numbers: NaN and infinite thresholds and temperatures are refused, and a
# replay may not overwrite its own recording.
expect_bad() {  # description, expected substring, command...
  local what=$1 want=$2
  shift 2
  "$@" >/dev/null 2>"$TMP/e"
  local rc=$?
  if [ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -qF -- "$want" "$TMP/e"; then ok "$what refused: $(head -1 "$TMP/e")"; else
    bad "$what (rc $rc): $(cat "$TMP/e")"
  fi
}
expect_bad "diff --rel-l2 nan" "finite" "$LS" diff "$TMP/run.h5" "$TMP/run.h5" --rel-l2 nan
expect_bad "replay --kl inf" "finite" "$LS" replay "$TMP/run.h5" --mode forced --kl inf -o "$TMP/z2.h5"
expect_bad "generate -t inf" "finite" "$LS" generate -p hi -t inf
expect_bad "replay --temperature -1" "--temperature" "$LS" replay "$TMP/run.h5" --mode free --temperature -1 -o "$TMP/z3.h5"
cp "$TMP/run.h5" "$TMP/self.h5"
expect_bad "replay -o <the trace itself>" "is the trace being replayed" "$LS" replay "$TMP/self.h5" -o "$TMP/self.h5"
cmp -s "$TMP/run.h5" "$TMP/self.h5" && ok "the recording is untouched" || bad "replay -o overwrote the recording"

# Every trace names the lockstep version that wrote it: record's, replay's.
for t in "$TMP/run.h5" "$TMP/f.h5"; do
  [ -f "$t" ] || continue
  "$LS" inspect "$t" | head -1 | grep -q "written by lockstep [0-9]" && ok "$(basename "$t") names its writer's version" ||
    bad "$(basename "$t"): $("$LS" inspect "$t" | head -1)"
done

exit $fail
