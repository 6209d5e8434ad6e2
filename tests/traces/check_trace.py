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
    # A kill inside a flush can leave an extent written before the chunk index backing it:
    # then the tail has the rows. A torn flush can also leave the index pointing at chunks
    # past the end of file the superblock recorded, which HDF5 refuses to read: keep the
    # leading chunks that read. And a kill inside a flush that changed the index's structure
    # (its first chunk, a B-tree node split) can leave it unreadable: then the chunk
    # directory <trace>.chunks says where the chunks are.
    try:
        backed = d.id.get_num_chunks() * d.chunks[0]
    except Exception:
        backed = None
    if backed is None:
        main = read_recovered(f, path)
    else:
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


CHUNK_RECORD = np.dtype([("table", "<u8"), ("index", "<i8"), ("address", "<u8"), ("size", "<u8"),
                         ("filter_mask", "<u4"), ("check", "<u4")])


def read_recovered(f, path):
    """The rows of table `path` in the leading chunks its chunk directory lists (whole records
    only: `check` = low 32 bits of XXH3-64 of the record's first 36 bytes). Each chunk's bytes
    are read from the trace at `address` and decoded by HDF5 itself: written with
    write_direct_chunk into an in-memory dataset made with the table's own creation
    properties (shuffle + zstd), then read back."""
    d = f[path]
    empty = d[0:0]
    dir_path = f.filename + ".chunks"
    if not os.path.exists(dir_path):
        return empty
    raw = open(dir_path, "rb").read()
    if raw[:8] != b"lschunk1":
        return empty
    n = (len(raw) - 8) // CHUNK_RECORD.itemsize
    recs = np.frombuffer(raw, dtype=CHUNK_RECORD, count=n, offset=8)
    want = xxhash.xxh3_64_intdigest(path.encode())
    chunks = {}
    for i, r in enumerate(recs):
        at = 8 + i * CHUNK_RECORD.itemsize
        if int(r["check"]) != xxhash.xxh3_64_intdigest(raw[at:at + 36]) & 0xFFFFFFFF or int(r["table"]) != want:
            continue
        chunks[int(r["index"])] = r
    size = os.path.getsize(f.filename)
    lead = []
    while len(lead) in chunks:
        r = chunks[len(lead)]
        if int(r["filter_mask"]) != 0 or int(r["address"]) + int(r["size"]) > size:
            break
        lead.append(r)
    if not lead:
        return empty
    cr = d.chunks[0]
    shape = (len(lead) * cr,) + d.shape[1:]
    mem = h5py.File(f"recovered-{id(d)}", "w", driver="core", backing_store=False)
    space = h5py.h5s.create_simple(shape, shape)
    m = h5py.h5d.create(mem.id, b"t", d.id.get_type(), space, dcpl=d.id.get_create_plist())
    with open(f.filename, "rb") as trace:
        for r in lead:
            trace.seek(int(r["address"]))
            m.write_direct_chunk((int(r["index"]) * cr,) + (0,) * (len(shape) - 1), trace.read(int(r["size"])), 0)
    out = mem["t"][...]
    mem.close()
    return out


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
    assert list(f.attrs["format_version"]) == [1, 3]
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
        # Format 1.2: the part's byte counts are integers, and the parts tile the token's bytes.
        tb, off = f[path].attrs["token_bytes"], f[path].attrs["byte_offset"]
        assert isinstance(tb, np.integer) and isinstance(off, np.integer), f"{path}: token_bytes/byte_offset not integers"
        assert off == 0, f"{path}: the stream's first part starts at byte {off}"
        parts = [read_table(f, side, path + "/values")]
        if name.endswith(".latent") and fmt == "fp8_e4m3":
            parts += [read_table(f, side, path + ".scales/values"), read_table(f, side, path + ".rope/values")]
            assert parts[0].dtype == np.uint8 and parts[1].dtype == np.float32 and parts[2].dtype == np.uint16
        elif name.endswith(".latent") and fmt == "bf16":
            assert parts[0].dtype == np.uint16 and text(f[path].attrs["dtype"]) == "bf16"
        elif name.endswith(".indexer_k") and exp.get("fp8_index_keys"):
            # indexer=fp8_paged: e4m3 values, then a power-of-two fp32 scale per 128 of them.
            parts += [read_table(f, side, path + ".scales/values")]
            D = exp["index_head_dim"]
            assert parts[0].dtype == np.uint8 and parts[0].shape[1] == D, f"{path}: fp8 key values"
            assert parts[1].dtype == np.float32 and parts[1].shape[1] == (D + 127) // 128, f"{path}: key scales"
            mant, _ = np.frexp(parts[1])
            assert np.all(mant == 0.5), f"{path}: a key scale is not a power of two"
        sizes = [p.shape[1] * p.dtype.itemsize for p in parts]
        assert sum(sizes) == tb, f"{path}: parts hold {sum(sizes)} bytes a token, token_bytes says {tb}"
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
        fin = g["final"] if "final" in g else g  # format 1.1 / 1.0
        assert list(fin["generated"][...]) == want["generated"], f"request {rid}: generated tokens"
        assert text(fin.attrs["finish_reason"]) == want["finish_reason"]
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
