#!/usr/bin/env python3
"""DeepSeek-V4's KV cache in each format, through the debugging loop (issue 32's acceptance).

Usage: v4_kv_cache_test.py LOCKSTEP SOURCE_DIR WORK_DIR   (HDF5_PLUGIN_PATH names our plugin)

On models/lockstep-tiny-v4 (V4-Flash's row shape: head_dim 512, rope 64; window 64, CSA 4, HCA 16),
a 90-token prompt and 24 greedy tokens:
  * --kv-cache fp8_e4m3 stores the window and compressed rows as FlashMLA's MODEL1: for every row
    the trace holds (kv/layers.L.window and .compressed, with .rope and .scales), its bytes equal
    tools/fixtures/v4_kv_formats.py's encoder (written from FlashMLA's tests/quant.py, sharing
    nothing with the C++) applied to the fp32 row the engine computed (taps attn.kv, the window's
    row, and attn.compressor.entry, the compressed row at the position that closes its window) —
    read with h5py, not through lockstep;
  * --kernel indexer=fp8_paged stores the CSA indexer's compressed keys in vLLM's FP8 paged layout
    (132 B for 128 dims): each recorded key (kv/layers.L.indexer_k, .scales) equals the encoder's
    bytes for the engine's fp32 key (tap attn.indexer.key);
  * record → exact replay is bit-identical in fp32, bf16 and fp8_e4m3, and with FP8 index keys
    (exit 0, "bit-identical");
  * `lockstep verify` (V4's golden twins, the stored rows decoded independently) finds each clean;
  * forced replays FP8 → BF16 and BF16 → fp32 report the logits' KL, top-1 agreement and a first
    divergence in layer 0 (the first layer whose cache differs), as JSON numbers.
"""
import json
import os
import subprocess
import sys

import numpy as np
import h5py

lockstep, src, work = sys.argv[1:4]
sys.path.insert(0, os.path.join(src, "tests", "traces"))
sys.path.insert(0, os.path.join(src, "tools", "fixtures"))
from check_trace import read_table  # noqa: E402  (reads a table, the crash sidecar merged)
from v4_kv_formats import encode_index_fp8, encode_model1  # noqa: E402  (the independent encoders)

os.makedirs(work, exist_ok=True)
model = os.path.join(src, "models", "lockstep-tiny-v4")
cfg = json.load(open(os.path.join(model, "config.json")))
D, RD = cfg["head_dim"], int(cfg["head_dim"] * cfg["partial_rotary_factor"])
NOPE = D - RD
ids = ",".join(str((11 * i + 5) % cfg["vocab_size"]) for i in range(90))
failures = []


def run(*args, ok=(0,)):
    p = subprocess.run([lockstep, *args], capture_output=True, text=True)
    if p.returncode not in ok:
        sys.exit(f"FAIL: lockstep {' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p


def record(fmt, extra=(), name=None):
    out = os.path.join(work, f"{name or fmt}.h5")
    run("record", "-m", model, "--prompt-ids", ids, "-n", "24", "-t", "0", "--ignore-eos", "--kv-cache", fmt,
        "--capture", "full", "-q", "-o", out, *extra)
    return out


def by_position(f, name):
    """{position: stored row} of request 0."""
    s = read_table(f, None, name + "/summary")
    v = read_table(f, None, name + "/values")
    return {int(p): v[i] for i, (r, p) in enumerate(zip(s["request"], s["position"])) if int(r) == 0}


# 1. MODEL1 bytes against the independent encoder.
fp8 = record("fp8_e4m3")
compared = {"window": 0, "compressed": 0}
with h5py.File(fp8, "r") as f:
    for layer in range(cfg["num_hidden_layers"]):
        for stream, tap in (("window", "attn.kv"), ("compressed", "attn.compressor.entry")):
            kv = f"kv/layers.{layer}.{stream}"
            if kv not in f:
                continue
            part = f[kv].attrs["part"]
            part = part.decode() if isinstance(part, bytes) else part
            if part != "nope_e4m3" or int(f[kv].attrs["token_bytes"]) != NOPE + 2 * RD + (NOPE + 63) // 64 + 1:
                failures.append(f"{kv}: part {part!r}, token_bytes {f[kv].attrs['token_bytes']}: not MODEL1")
                continue
            nope, rope, scales = by_position(f, kv), by_position(f, kv + ".rope"), by_position(f, kv + ".scales")
            rows = by_position(f, f"taps/layers.{layer}.{tap}")
            if not nope or set(nope) != set(rows):
                failures.append(f"{kv}: rows at {sorted(nope)[:5]}…, the tap {tap} at {sorted(rows)[:5]}…")
                continue
            for pos, x in rows.items():
                page = encode_model1(np.asarray(x, dtype=np.float32)[None, :], 1, D, RD)[0]
                data, slot = page[:NOPE + 2 * RD], page[NOPE + 2 * RD:NOPE + 2 * RD + (NOPE + 63) // 64 + 1]
                got = (np.asarray(nope[pos], np.uint8), np.asarray(rope[pos]).astype("<u2").view(np.uint8),
                       np.asarray(scales[pos], np.uint8))
                want = (data[:NOPE], data[NOPE:], slot[:-1])
                for what, g, w in zip(("e4m3 values", "bf16 rope", "ue8m0 scales"), got, want):
                    if g.shape != w.shape or not np.array_equal(g, w):
                        bad = int(np.argmax(g != w)) if g.shape == w.shape else -1
                        failures.append(f"{kv} position {pos}: {what} differ from the encoder's at byte {bad}")
                compared[stream] += 1
for stream, n in compared.items():
    if n == 0:
        failures.append(f"no {stream} row compared")
print(f"MODEL1: {compared['window']} window and {compared['compressed']} compressed rows equal the independent encoder's bytes")

# 1b. FP8 index keys against the independent encoder.
fp8k = record("fp8_e4m3", ("--kernel", "indexer=fp8_paged"), name="fp8_keys")
keys = 0
with h5py.File(fp8k, "r") as f:
    for layer in range(cfg["num_hidden_layers"]):
        kv = f"kv/layers.{layer}.indexer_k"
        if kv not in f:
            continue
        vals, scales = by_position(f, kv), by_position(f, kv + ".scales")
        rows = by_position(f, f"taps/layers.{layer}.attn.indexer.key")
        if not vals or set(vals) != set(rows):
            failures.append(f"{kv}: rows at {sorted(vals)[:5]}…, the tap at {sorted(rows)[:5]}…")
            continue
        for pos, x in rows.items():
            x = np.asarray(x, dtype=np.float32)
            page = encode_index_fp8(x[None, :], 1)[0]
            got = np.concatenate([np.asarray(vals[pos], np.uint8), np.asarray(scales[pos], "<f4").view(np.uint8)])
            if not np.array_equal(got, page):
                failures.append(f"{kv} position {pos}: FP8 key bytes differ from the encoder's at byte {int(np.argmax(got != page))}")
            keys += 1
if keys == 0:
    failures.append("no FP8 index key compared")
print(f"FP8 index keys: {keys} keys equal the independent encoder's bytes")

# 2. Exact replay, each format.
traces = {"fp8_e4m3": fp8, "fp8_keys": fp8k}
for fmt in ("fp32", "bf16"):
    traces[fmt] = record(fmt)
for fmt, t in traces.items():
    p = run("replay", t, "--mode", "exact", "-q", "-o", os.path.join(work, f"{fmt}.exact.h5"))
    if "bit-identical" not in p.stdout + p.stderr:
        failures.append(f"exact replay of the {fmt} trace: not bit-identical: {(p.stdout + p.stderr).strip()[-400:]}")
    else:
        print(f"{fmt}: exact replay bit-identical")

# 2b. verify's V4 twins (the cache rows against an independent decoder) find every trace clean.
for fmt, t in traces.items():
    p = run("verify", t, "-q", ok=(0, 3))
    if p.returncode != 0:
        failures.append(f"verify of the {fmt} trace: exit {p.returncode}: {(p.stdout + p.stderr).strip()[-600:]}")
    else:
        print(f"{fmt}: verify clean")

# 3. Forced replays across formats: numbers, not strings; the divergence starts in layer 0.
for src_fmt, to in (("fp8_e4m3", "bf16"), ("bf16", "fp32")):
    p = run("replay", traces[src_fmt], "--mode", "forced", "--kv-cache", to, "--json", "-o",
            os.path.join(work, f"{src_fmt}-{to}.h5"), ok=(0, 3))
    doc = json.loads(p.stdout)
    ls, fd = doc.get("logit_summary") or {}, doc.get("first_divergence") or {}
    label = f"forced {src_fmt} → {to}"
    for key in ("mean_kl", "max_kl", "same_top_pct"):
        if not isinstance(ls.get(key), (int, float)):
            failures.append(f"{label}: logit_summary.{key} = {ls.get(key)!r}")
    if doc.get("identical") is not False:
        failures.append(f"{label}: identical = {doc.get('identical')!r} although the cache format changed")
    if fd.get("layer") != 0 or not isinstance(fd.get("position"), int):
        failures.append(f"{label}: first divergence {fd}")
    print(f"{label}: mean KL {ls.get('mean_kl')}, same top-1 {ls.get('same_top_pct')}%, "
          f"first divergence {fd.get('tensor')} at position {fd.get('position')}")

if failures:
    print("FAIL:\n  " + "\n  ".join(failures[:20]))
    sys.exit(1)
print("v4_kv_cache_test: PASS")
