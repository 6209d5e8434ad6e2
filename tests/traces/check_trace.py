#!/usr/bin/python3
"""tests/traces/check_trace.py — reads a lockstep trace with h5py, as a scientist would, and
checks it against what the engine produced (the capture driver's --expect JSON), using only
the rules written in docs/trace-format.md:

  * every tap row's XXH3-64 (python3-xxhash) equals the hash the driver took from the engine;
  * the KV cache bytes as stored (fp32 / bf16 as uint16 / fp8 as e4m3 ‖ scales ‖ rope) hash
    to what PagedKvCache held; bf16 decodes by `float32(bits << 16)` and equals the tap
    `attn.latent` rounded to nearest-even;
  * summaries: hash of each stored row, rms/min/max recomputed in numpy;
  * tokens, sampler rows and h5dump printing real values (not an empty DATA {}).

Usage: check_trace.py TRACE.h5 EXPECT.json   (HDF5_PLUGIN_PATH must name our zstd plugin)
Also importable: read_table() applies the tail rule for traces that did not close.
"""
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import xxhash


def text(v):
    """A string attribute: fixed-length UTF-8, which h5py returns as bytes."""
    return v.decode() if isinstance(v, (bytes, np.bytes_)) else str(v)


def read_table(f, side, path):
    """Rows of table `path` of trace `f`, with the sidecar's tail merged (docs/trace-format.md)."""
    d = f[path]
    if int(f.attrs["complete"]) == 1:
        return d[...]
    # A kill inside a flush can leave an extent written before the chunk index backing it,
    # or (for a table's first chunk) the index itself unwritten: then the tail has the rows.
    # A torn flush can also leave the index pointing at chunks past the end of file the
    # superblock recorded, which HDF5 refuses to read: keep the leading chunks that read.
    try:
        backed = d.id.get_num_chunks() * d.chunks[0]
    except Exception:
        backed = 0
    rows, parts = min(len(d), backed), []
    for start in range(0, rows, d.chunks[0]):
        try:
            parts.append(d[start:min(rows, start + d.chunks[0])])
        except OSError:
            break
    main = np.concatenate(parts) if parts else d[0:0]
    if side is None:
        return main
    for name, tail in side["tails"].items():
        if "count" not in tail.attrs or text(tail.attrs["target"]) != path:
            continue
        base, count = int(tail.attrs["base"]), int(tail.attrs["count"])
        n = len(main)
        if base <= n < base + count:
            return np.concatenate([main, tail[n - base:count]])
    return main


def open_trace(path):
    f = h5py.File(path, "r")
    side = h5py.File(path + ".tails", "r") if os.path.exists(path + ".tails") else None
    return f, side


def h(row):
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(row).tobytes())


def check_summaries(f, side, group):
    """Each stored row hashes to its summary; statistics match numpy. Returns rows checked."""
    checked = 0
    for name, g in f[group].items():
        summ = read_table(f, side, f"{group}/{name}/summary")
        if int(g.attrs["has_values"]) != 1:
            continue
        vals = read_table(f, side, f"{group}/{name}/values")
        # A kill inside a flush may leave one of the pair a few rows ahead (rows past the last
        # completed flush); the tensor's rows are those both hold. A complete trace: equal.
        n = min(len(vals), len(summ))
        if int(f.attrs["complete"]) == 1:
            assert n == len(summ) == len(vals), f"{group}/{name}: {len(vals)} value rows, {len(summ)} summary rows"
        dtype = text(g.attrs["dtype"])
        for i in range(n):
            assert h(vals[i]) == int(summ["hash"][i]), f"{group}/{name} row {i}: hash differs from its summary"
            if dtype in ("f32", "bf16"):
                x = decode(vals[i], dtype).astype(np.float64)
                x = x[np.isfinite(x)]
                if len(x):
                    # rms: same formula, summation order may differ → a float32 ULP or so
                    assert np.isclose(np.sqrt(np.mean(x * x)), summ["rms"][i], rtol=1e-6), f"{group}/{name} row {i}: rms"
                    assert np.float32(x.min()) == summ["min"][i] and np.float32(x.max()) == summ["max"][i]
            checked += 1
    return checked


def decode(row, dtype):
    if dtype == "bf16":  # the documented rule: the bits are the top half of an fp32
        return (row.astype(np.uint32) << 16).view(np.float32)
    return row


def rows_by_key(f, side, path):
    summ = read_table(f, side, path + "/summary")
    return {(int(r), int(p)): i for i, (r, p) in enumerate(zip(summ["request"], summ["position"]))}


def main():
    trace, expect_path = sys.argv[1], sys.argv[2]
    exp = json.load(open(expect_path))
    f, side = open_trace(trace)
    assert text(f.attrs["lockstep_trace"]) == "lockstep trace"
    assert list(f.attrs["format_version"]) == [1, 0]
    assert int(f.attrs["complete"]) == 1
    full = exp["capture"] == "full"

    # Taps: every row the engine emitted is in the trace, with the engine's bytes.
    n_tap_rows = 0
    for name, rows in exp["taps"].items():
        path = f"taps/{name}"
        assert path in f, f"{path} missing"
        key = rows_by_key(f, side, path)
        summ = read_table(f, side, path + "/summary")
        vals = read_table(f, side, path + "/values") if full else None
        for req, pos, want in rows:
            i = key[(req, pos)]
            assert int(summ["hash"][i]) == int(want), f"{path} ({req}, {pos}): summary hash"
            if full:
                assert h(vals[i]) == int(want), f"{path} ({req}, {pos}): stored values differ from the engine's"
            n_tap_rows += 1

    # KV cache as stored.
    fmt = exp["kv_format"]
    C, R = exp["kv_lora_rank"], exp["qk_rope_head_dim"]
    n_kv_rows = 0
    for name, rows in exp["kv"].items():
        path = f"kv/{name}"
        assert path in f, f"{path} missing"
        key = rows_by_key(f, side, path)
        if not full:
            continue
        parts = [read_table(f, side, path + "/values")]
        if name.endswith(".latent") and fmt == "fp8_e4m3":
            parts += [read_table(f, side, path + ".scales/values"), read_table(f, side, path + ".rope/values")]
            assert parts[0].dtype == np.uint8 and parts[1].dtype == np.float32 and parts[2].dtype == np.uint16
        elif name.endswith(".latent") and fmt == "bf16":
            assert parts[0].dtype == np.uint16 and text(f[path].attrs["dtype"]) == "bf16"
        for req, pos, want in rows:
            i = key[(req, pos)]
            token = b"".join(np.ascontiguousarray(p[i]).tobytes() for p in parts)
            assert xxhash.xxh3_64_intdigest(token) == int(want), f"{path} ({req}, {pos}): cache bytes differ"
            n_kv_rows += 1
        if name.endswith(".latent") and fmt == "bf16":
            # Decoded bf16 == the engine's fp32 latent (tap) rounded to nearest-even.
            layer = name.split(".")[1]
            tkey = rows_by_key(f, side, f"taps/layers.{layer}.attn.latent")
            tvals = read_table(f, side, f"taps/layers.{layer}.attn.latent/values")
            for (req, pos), i in key.items():
                lat = tvals[tkey[(req, pos)]].view(np.uint32)
                rne = ((lat.astype(np.uint64) + 0x7FFF + ((lat >> 16) & 1)) >> 16).astype(np.uint16)
                stored = parts[0][i][:C]
                assert np.array_equal(stored, rne), f"{path} ({req}, {pos}): bf16 latent is not RNE of the tap"
                assert np.allclose(decode(stored, "bf16"), lat.view(np.float32), rtol=2.0**-8, atol=0)

    # Requests and sampler rows.
    samp = read_table(f, side, "sampling")
    for rid, want in enumerate(exp["requests"]):
        g = f[f"requests/{rid}"]
        assert list(g["prompt"][...]) == want["prompt"]
        assert list(g["generated"][...]) == want["generated"], f"request {rid}: generated tokens"
        assert text(g.attrs["finish_reason"]) == want["finish_reason"]
        mine = samp[samp["request"] == rid]
        assert list(mine["token"][np.argsort(mine["token_index"])]) == want["generated"]
        assert np.all(mine["counter"] == mine["token_index"])  # Philox counter = token index
        assert np.all(mine["seed"] == 100 + rid)

    checked = check_summaries(f, side, "taps") + check_summaries(f, side, "kv")

    # h5dump (through HDF5_PLUGIN_PATH) prints the same numbers as h5py.
    out = subprocess.run(["h5dump", "-d", "/taps/embed/values", "-c", "1,4", trace], capture_output=True, text=True)
    if full:
        nums = [float(x) for x in re.findall(r"-?\d+\.?\d*(?:e[-+]?\d+)?", out.stdout.split("DATA {")[1].split("}")[0])[2:]]
        want = f["taps/embed/values"][0, :4]
        assert len(nums) == 4 and np.allclose(nums, want, rtol=1e-5), f"h5dump printed {nums}, h5py read {want}"

    print(f"{trace}: {n_tap_rows} tap rows, {n_kv_rows} KV rows match the engine; {checked} stored rows match "
          f"their summaries; {len(samp)} sampler rows")


if __name__ == "__main__":
    main()
