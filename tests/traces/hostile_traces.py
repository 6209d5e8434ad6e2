#!/usr/bin/python3
"""tests/traces/hostile_traces.py — damaged and crafted traces through every command (issue 31).

A trace attached to a bug report is a stranger's file. This test records a small real trace
(two requests, full capture, fixture model), derives well over a hundred damaged or crafted
copies of it, and runs each through every command that opens a trace: inspect, inspect
--verify, replay, replay --mode forced, diff with the original, diff with itself, export,
export --summary. Each run must end in

  * exit 0, or a one-line error (exit 1 or 2: stderr non-empty, no 'terminate called', no
    abort), or exit 3 ("different") — never a signal (exit >= 128) or a hang (timeout);
  * peak memory (max RSS, /usr/bin/time) under MEM_BOUND_MB (docs/trace-format.md, "Memory");
  * for a case that lost, moved or changed rows, tensors, requests or prompts ("lossy"):
    no exit 0 from `diff ORIGINAL CASE` (it is different, or unreadable) and no exit 0 from
    `replay` (not "deterministic").

Cases known to fail still are listed in KNOWN (name -> why): they are run and reported, but
only an unexpected failure — or a known one that now passes — fails the test.

Usage: hostile_traces.py LOCKSTEP PLUGIN_DIR WORK_DIR MODEL_DIR [--only SUBSTR] [-j N]
"""
import concurrent.futures
import os
import random
import shutil
import subprocess
import sys

LS, PLUGIN, WORK, MODEL = sys.argv[1:5]
os.environ["HDF5_PLUGIN_PATH"] = PLUGIN
import h5py  # noqa: E402  (after HDF5_PLUGIN_PATH)
import numpy as np  # noqa: E402

ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
JOBS = int(sys.argv[sys.argv.index("-j") + 1]) if "-j" in sys.argv else 2
TIMEOUT_S = 60
MEM_BOUND_MB = 1024  # docs/trace-format.md: one command on a trace of this size
# Cases that still fail (issue 31), one "name  why" a line; regenerate with --write-known.
KNOWN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_known.txt")
KNOWN = {}
if os.path.exists(KNOWN_FILE):
    for line in open(KNOWN_FILE):
        if line.strip() and not line.startswith("#"):
            n, _, why = line.strip().partition(" ")
            KNOWN[n] = why.strip()

os.makedirs(WORK, exist_ok=True)
BASE = os.path.join(WORK, "base.h5")
CASES = os.path.join(WORK, "cases")
shutil.rmtree(CASES, ignore_errors=True)
os.makedirs(CASES)


def record():
    prompts = os.path.join(WORK, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.write('{"prompt_ids": [5, 6, 7], "id": "x"}\n')
        f.write('{"prompt_ids": [9, 10, 11, 12], "id": "y", "temperature": 0.7, "seed": 3}\n')
    subprocess.run([LS, "record", "-m", MODEL, "--prompts", prompts, "-n", "5", "-o", BASE, "-q"], check=True)


def zstd_frame(raw: bytes) -> bytes:
    p = subprocess.run(["zstd", "-q", "-c", "-1", "--content-size"], input=raw, stdout=subprocess.PIPE, check=True)
    return p.stdout


def zstd_zero_frame(nbytes: int) -> bytes:
    """A frame of nbytes zero bytes that states its size (made from a sparse file, not memory)."""
    src = os.path.join(WORK, "zeros.bin")
    with open(src, "wb") as f:
        f.truncate(nbytes)
    p = subprocess.run(["zstd", "-q", "-c", "-19", src], stdout=subprocess.PIPE, check=True)
    os.remove(src)
    return p.stdout


def shuffle(raw: bytes, esize: int) -> bytes:
    a = np.frombuffer(raw, np.uint8)
    n = len(a) // esize
    return a[: n * esize].reshape(n, esize).T.tobytes() + a[n * esize :].tobytes()


cases = []  # (name, path, lossy)


def case(name, lossy=True):
    """Decorator: a copy of the base trace edited in place by fn(path)."""

    def wrap(fn):
        p = os.path.join(CASES, name + ".h5")
        shutil.copyfile(BASE, p)
        fn(p)
        cases.append((name, p, lossy))
        return fn

    return wrap


def edit(path, fn):
    with h5py.File(path, "r+") as f:
        fn(f)


def rewrite(path, dpath, fn):
    """Rewrites a dataset's data (through the filter) after fn(array) edits it."""

    def go(f):
        a = f[dpath][...]
        fn(a)
        f[dpath][...] = a

    edit(path, go)


def tensors(path):
    with h5py.File(path, "r") as f:
        return [g + "/" + n for g in ("taps", "kv") for n in f[g]]


def make_cases():
    names = tensors(BASE)
    rng = random.Random(31)
    pick = [names[i] for i in sorted(rng.sample(range(len(names)), 4))]
    # --- rows moved, changed, lost (valid HDF5, values a stranger or a bug could write) ---
    for t in pick:
        s = t.replace("/", "_")

        @case("move_position_" + s)
        def _(p, t=t):
            rewrite(p, t + "/summary", lambda a: a["position"].__setitem__(slice(0, 1), a["position"][0] + 1000))

        @case("move_request_" + s)
        def _(p, t=t):
            rewrite(p, t + "/summary", lambda a: a["request"].__setitem__(slice(None), 1 - a["request"]))

        @case("rename_tensor_" + s)
        def _(p, t=t):
            edit(p, lambda f: f.move(t, t + "_renamed"))

        @case("delete_tensor_" + s)
        def _(p, t=t):
            edit(p, lambda f: f.__delitem__(t))

        @case("shrink_summary_" + s)
        def _(p, t=t):
            edit(p, lambda f: f[t + "/summary"].resize((f[t + "/summary"].shape[0] - 3,)))

        @case("shrink_values_" + s)
        def _(p, t=t):
            edit(p, lambda f: f[t + "/values"].resize(f[t + "/values"].shape[0] - 3, axis=0))

        @case("hash_changed_" + s)
        def _(p, t=t):
            rewrite(p, t + "/summary", lambda a: a["hash"].__setitem__(2, a["hash"][2] ^ np.uint64(1)))

        @case("value_changed_" + s, lossy=False)  # the hash still says the old value: --verify must see it
        def _(p, t=t):
            rewrite(p, t + "/values", lambda a: a.__setitem__((1, 0), a[1, 0] + 1 if a.dtype.kind != "f" else a[1, 0] * 2 + 1))

        @case("position_negative_" + s)
        def _(p, t=t):
            rewrite(p, t + "/summary", lambda a: a["position"].__setitem__(0, -5))

        @case("position_2e40_" + s)
        def _(p, t=t):
            rewrite(p, t + "/summary", lambda a: a["position"].__setitem__(0, 1 << 40))

        @case("position_int64max_" + s)
        def _(p, t=t):
            rewrite(p, t + "/summary", lambda a: a["position"].__setitem__(0, (1 << 63) - 1))

        @case("request_huge_" + s)
        def _(p, t=t):
            rewrite(p, t + "/summary", lambda a: a["request"].__setitem__(0, 2**31 - 1))

        @case("duplicate_row_" + s)
        def _(p, t=t):
            rewrite(p, t + "/summary", lambda a: a.__setitem__(1, a[0]))

    for lay in ("100000000000", "-1", "99999999999999999999", "4294967296"):

        @case("layer_index_" + lay.replace("-", "minus"))
        def _(p, lay=lay):
            edit(p, lambda f: f.move("taps/layers.1.resid_out", "taps/layers.%s.resid_out" % lay))

    for req in ("0", "1"):

        @case("delete_request_" + req)
        def _(p, req=req):
            edit(p, lambda f: f.__delitem__("requests/" + req))

        @case("prompt_changed_" + req)
        def _(p, req=req):
            rewrite(p, "requests/%s/prompt" % req, lambda a: a.__setitem__(0, a[0] + 1))

        @case("prompt_longer_" + req)
        def _(p, req=req):
            def go(f):
                a = f["requests/%s/prompt" % req][...]
                del f["requests/%s/prompt" % req]
                f["requests/%s/prompt" % req] = np.concatenate([a, a]).astype(np.int32)

            edit(p, go)

        @case("generated_changed_" + req)
        def _(p, req=req):
            rewrite(p, "requests/%s/final/generated" % req, lambda a: a.__setitem__(-1, a[-1] + 1))

        @case("request_renamed_" + req)
        def _(p, req=req):
            edit(p, lambda f: f.move("requests/" + req, "requests/7" + req))

    @case("sampling_token_changed")
    def _(p):
        rewrite(p, "sampling", lambda a: a["token"].__setitem__(3, a["token"][3] + 1))

    @case("sampling_shrunk")
    def _(p):
        edit(p, lambda f: f["sampling"].resize((f["sampling"].shape[0] - 2,)))

    @case("sampling_request_huge")
    def _(p):
        rewrite(p, "sampling", lambda a: a["request"].__setitem__(0, 2**31 - 1))

    @case("sampling_token_index_huge")
    def _(p):
        rewrite(p, "sampling", lambda a: a["token_index"].__setitem__(0, 1 << 62))

    # Sampling rows that disagree with their requests: another seed or temperature, a row
    # repeated, a request that generated more than its max_new_tokens (issue 31: CheckSampling).
    @case("sampling_seed_changed")
    def _(p):
        rewrite(p, "sampling", lambda a: a["seed"].__setitem__(0, a["seed"][0] + np.uint64(1)))

    @case("sampling_temperature_changed")
    def _(p):
        rewrite(p, "sampling", lambda a: a["temperature"].__setitem__(6, a["temperature"][6] + 0.25))

    @case("sampling_row_repeated")
    def _(p):
        rewrite(p, "sampling", lambda a: a.__setitem__(1, a[0]))

    @case("sampling_rows_swapped_requests")
    def _(p):
        rewrite(p, "sampling", lambda a: a["request"].__setitem__(slice(None), 1 - a["request"]))

    @case("request_max_new_tokens_below_generated")
    def _(p):
        edit(p, lambda f: f["requests/1"].attrs.__setitem__("max_new_tokens", np.int64(2)))

    @case("request_seed_2e64_minus_1")
    def _(p):
        edit(p, lambda f: f["requests/1"].attrs.__setitem__("seed", np.int64(-1)))

    @case("request_id_not_a_number")
    def _(p):
        edit(p, lambda f: f.move("requests/1", "requests/one"))

    @case("request_id_2e31")
    def _(p):
        edit(p, lambda f: f.move("requests/1", "requests/2147483648"))

    @case("prompt_2d")
    def _(p):
        def go(f):
            a = f["requests/0/prompt"][...]
            del f["requests/0/prompt"]
            f["requests/0/prompt"] = np.stack([a, a]).astype(np.int32)

        edit(p, go)

    @case("step_batch_width_5000", lossy=False)
    def _(p):
        def go(f):
            n = f["step_batch"].shape[0]
            del f["step_batch"]
            d = f.create_dataset("step_batch", shape=(n, 5000), maxshape=(None, 5000), dtype=np.int64, chunks=(8, 5000))
            d.attrs["chunk_rows"] = np.int64(8)

        edit(p, go)

    @case("format_major_2", lossy=False)
    def _(p):
        edit(p, lambda f: f.attrs.__setitem__("format_version", np.array([2, 0], np.int32)))

    @case("magic_missing", lossy=False)
    def _(p):
        edit(p, lambda f: f.attrs.__delitem__("lockstep_trace"))

    @case("summary_type_changed")
    def _(p):
        t = "taps/layers.0.attn.out/summary"

        def go(f):
            a = f[t][...]
            del f[t]
            b = np.zeros(a.shape, [("position", "<i4"), ("hash", "<u8")])
            b["position"] = a["position"]
            b["hash"] = a["hash"]
            d = f.create_dataset(t, data=b, maxshape=(None,), chunks=(64,))
            d.attrs["chunk_rows"] = np.int64(64)

        edit(p, go)

    # KV streams: rows moved to another position, another stream's bytes, a byte offset past the token.
    kvs = [n for n in names if n.startswith("kv/")]
    if kvs:
        k0 = kvs[0]

        @case("kv_position_moved")
        def _(p, k0=k0):
            rewrite(p, k0 + "/summary", lambda a: a["position"].__setitem__(-1, a["position"][-1] + 7))

        @case("kv_values_swapped", lossy=False)  # hashes still name the old bytes: --verify must see it
        def _(p, k0=k0):
            rewrite(p, k0 + "/values", lambda a: a.__setitem__(0, a[1].copy()))

        @case("kv_byte_offset_huge", lossy=False)
        def _(p, k0=k0):
            edit(p, lambda f: f[k0].attrs.__setitem__("byte_offset", np.int64(1 << 62)))

    # An incomplete trace whose chunk directory lies: records past the end of the file, torn
    # records, an index claiming 2^40 chunks (read only when HDF5's own index is torn).
    @case("chunk_directory_hostile", lossy=False)
    def _(p):
        import struct
        import xxhash

        with h5py.File(p, "r+") as f:
            f.attrs["complete"] = np.uint8(0)
        recs = b""
        for table, index, addr, size in (("sampling", 0, 1 << 40, 100), ("steps", 1 << 40, 0, 10),
                                         ("taps/embed/values", 0, 0, 1 << 62)):
            body = struct.pack("<QqQQI", xxhash.xxh3_64_intdigest(table.encode()), index, addr, size, 0)
            recs += body + struct.pack("<I", xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF)
        recs += b"\x01" * 17  # a torn last record
        with open(p + ".chunks", "wb") as c:
            c.write(b"lschunk1" + recs)

    # Packs (lockstep pack): a pack of the base, then damaged packs; replay must not call a
    # damaged one good (the manifest), nor any without the model it names.
    pack = os.path.join(WORK, "base.pack.h5")
    subprocess.run([LS, "pack", BASE, "--request", "1", "-o", pack, "--no-tokenizer"], check=True,
                   stdout=subprocess.DEVNULL)

    def pack_case(name, lossy=True):
        def wrap(fn):
            p = os.path.join(CASES, name + ".h5")
            shutil.copyfile(pack, p)
            fn(p)
            cases.append((name, p, lossy))
            return fn

        return wrap

    @pack_case("pack_intact", lossy=False)
    def _(p):
        pass

    @pack_case("pack_manifest_garbage")
    def _(p):
        def go(f):
            del f["pack/manifest"]
            f["pack/manifest"] = np.bytes_("not a manifest\n")

        edit(p, go)

    @pack_case("pack_manifest_deleted")
    def _(p):
        edit(p, lambda f: f.__delitem__("pack/manifest"))

    @pack_case("pack_config_edited")
    def _(p):
        def go(f):
            c = f["pack/config.json"][()]
            del f["pack/config.json"]
            f["pack/config.json"] = np.bytes_(c.replace(b"{", b'{"x": 1, ', 1))

        edit(p, go)

    @pack_case("pack_hash_edited")
    def _(p):
        rewrite(p, "taps/layers.1.resid_out/summary", lambda a: a["hash"].__setitem__(0, a["hash"][0] ^ np.uint64(1)))

    @case("steps_shrunk", lossy=False)  # timing records: nothing compared is lost
    def _(p):
        edit(p, lambda f: f["steps"].resize((1,)))

    @case("step_batch_ids_huge", lossy=False)
    def _(p):
        rewrite(p, "step_batch", lambda a: a.__setitem__((0, 0), 1 << 50))

    # --- hostile numbers in attributes and meta ---
    for key, val in (("max_new_tokens", 1e300), ("max_new_tokens", float("nan")), ("temperature", float("inf")),
                     ("temperature", float("nan")), ("top_k", -5.0), ("top_p", 7.0), ("seed", -1)):

        @case("request_attr_%s_%s" % (key, str(val).replace("-", "minus").replace("+", "")))
        def _(p, key=key, val=val):
            def go(f):
                a = f["requests/0"].attrs
                t = np.asarray(a[key]).dtype
                # Floats as float64 (1e300 and NaN where an integer was stored), ints in the attribute's type.
                a[key] = np.array(val, np.float64) if isinstance(val, float) else np.array(val, t)

            edit(p, go)

    for opt, val in (("kv_cache_tokens", 1 << 60), ("kv_cache_tokens", -1), ("max_batch", 1 << 40), ("page_size", 0),
                     ("page_size", 1 << 40), ("max_prefill_tokens", -7)):

        @case("engine_option_%s_%s" % (opt, str(val).replace("-", "minus")), lossy=False)
        def _(p, opt=opt, val=val):
            import json

            def go(f):
                eo = json.loads(f["meta"].attrs["engine_options"])
                eo[opt] = val
                f["meta"].attrs["engine_options"] = np.bytes_(json.dumps(eo))

            edit(p, go)

    @case("model_config_garbage", lossy=False)
    def _(p):
        edit(p, lambda f: f["meta"].attrs.__setitem__("model_config", np.bytes_("{not json")))

    # --- memory bombs: sizes the format's limits forbid ---
    @case("prompt_text_1gib")
    def _(p):
        def go(f):
            del f["requests/0/prompt_text"]
            f.create_dataset("requests/0/prompt_text", shape=(), dtype=h5py.string_dtype("utf-8", 1 << 30))

        edit(p, go)

    @case("generated_text_1gib")
    def _(p):
        def go(f):
            del f["requests/1/final/generated_text"]
            f.create_dataset("requests/1/final/generated_text", shape=(), dtype=h5py.string_dtype("utf-8", 1 << 30))

        edit(p, go)

    @case("prompt_2e26_tokens_unallocated")
    def _(p):
        def go(f):
            del f["requests/0/prompt"]
            f.create_dataset("requests/0/prompt", shape=(1 << 26,), dtype=np.int32, chunks=(1 << 20,))

        edit(p, go)

    @case("values_2e26_columns")
    def _(p):
        # One chunk of 4 rows x 2^26 f32 columns (1 GiB decoded) from a frame of a few KiB.
        t = "taps/layers.0.attn.out"

        def go(f):
            g = f[t]
            g.attrs["cols"] = np.int64(1 << 26)
            del g["values"]
            d = g.create_dataset("values", shape=(g["summary"].shape[0], 1 << 26), dtype=np.float32,
                                 chunks=(4, 1 << 26), compression=32015, compression_opts=(1,), shuffle=True)
            d.attrs["chunk_rows"] = np.int64(4)
            d.id.write_direct_chunk((0, 0), zstd_zero_frame(4 << 28))

        edit(p, go)

    @case("values_chunk_rows_huge")
    def _(p):
        t = "taps/layers.0.attn.out"

        def go(f):
            g = f[t]
            v = g["values"][...]
            del g["values"]
            d = g.create_dataset("values", shape=v.shape, maxshape=(None, v.shape[1]), dtype=np.float32,
                                 chunks=(1 << 20, v.shape[1]), compression=32015, compression_opts=(1,), shuffle=True)
            d.attrs["chunk_rows"] = np.int64(1 << 20)
            d.id.write_direct_chunk((0, 0), zstd_zero_frame((1 << 20) * v.shape[1] * 4))

        edit(p, go)

    @case("summary_2e24_rows_one_chunk")
    def _(p):
        t = "taps/layers.0.attn.out"

        def go(f):
            g = f[t]
            s = g["summary"]
            dt = s.dtype
            del g["summary"]
            d = g.create_dataset("summary", shape=(1 << 24,), maxshape=(None,), dtype=dt, chunks=(1 << 24,),
                                 compression=32015, compression_opts=(1,), shuffle=True)
            d.attrs["chunk_rows"] = np.int64(1 << 24)
            d.id.write_direct_chunk((0,), zstd_zero_frame((1 << 24) * dt.itemsize))

        edit(p, go)

    for t in ("taps/layers.0.attn.out/values", "taps/layers.1.resid_out/summary", "sampling", "steps"):
        s = t.replace("/", "_")

        @case("short_frame_" + s, lossy=t != "steps")
        def _(p, t=t):
            def go(f):
                d = f[t]
                esize = d.dtype.itemsize
                raw = bytes(64 * esize)
                d.id.write_direct_chunk((0,) * d.ndim, zstd_frame(shuffle(raw, esize)))

            edit(p, go)

        @case("long_frame_" + s, lossy=t != "steps")
        def _(p, t=t):
            def go(f):
                d = f[t]
                nbytes = int(np.prod(d.chunks)) * d.dtype.itemsize * 2
                d.id.write_direct_chunk((0,) * d.ndim, zstd_zero_frame(nbytes))

            edit(p, go)

        @case("not_a_frame_" + s, lossy=t != "steps")
        def _(p, t=t):
            edit(p, lambda f: f[t].id.write_direct_chunk((0,) * f[t].ndim, b"\x28\xb5\x2f\xfd" + bytes(40)))

        # Rows stored unfiltered (filter mask set): HDF5 reads them; their hashes say otherwise.
        @case("raw_unfiltered_chunk_" + s, lossy=t not in ("steps", "taps/layers.0.attn.out/values"))
        def _(p, t=t):
            def go(f):
                d = f[t]
                nbytes = int(np.prod(d.chunks)) * d.dtype.itemsize
                d.id.write_direct_chunk((0,) * d.ndim, bytes(nbytes), filter_mask=0b11)

            edit(p, go)

    @case("chunk_rows_attr_lies")
    def _(p):
        edit(p, lambda f: f["taps/embed/values"].attrs.__setitem__("chunk_rows", np.int64(1 << 40)))

    @case("cols_attr_lies")
    def _(p):
        edit(p, lambda f: f["taps/embed"].attrs.__setitem__("cols", np.int64(63)))

    @case("dtype_attr_lies")
    def _(p):
        edit(p, lambda f: f["taps/embed"].attrs.__setitem__("dtype", np.bytes_("bf16")))

    @case("format_version_huge", lossy=False)
    def _(p):
        edit(p, lambda f: f.attrs.__setitem__("format_version", np.array([1, 2**31 - 1], np.int32)))

    # An incomplete trace whose tail sidecar claims 2^25 sampled rows (and other tails).
    for target, count in (("sampling", 1 << 25), ("taps/embed/summary", 1 << 25), ("steps", 50)):
        s = target.replace("/", "_")

        @case("tail_claims_%s_%d" % (s, count), lossy=False)  # a bogus tail is ignored: nothing lost
        def _(p, target=target, count=count):
            with h5py.File(p, "r+") as f:
                f.attrs["complete"] = np.uint8(0)
                dt = f[target].dtype
                n = f[target].shape[0]
            with h5py.File(p[:-3] + ".h5.tails", "w") as t:
                d = t.create_dataset("tails/0", shape=(count,), dtype=dt)  # contiguous, never written
                d.attrs["target"] = np.bytes_(target)
                d.attrs["base"] = np.int64(n)
                d.attrs["count"] = np.int64(count)

    # Files whose damaged object headers crash libhdf5 1.10 itself (found by fuzz_trace_reader):
    # every command opens a trace in a child process first, so they are refused with one line.
    reg = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "regressions", "hdf5-1.10")
    for fn in sorted(os.listdir(reg)) if os.path.isdir(reg) else []:
        if fn.endswith(".h5"):
            name = "hdf5_crasher_" + fn[:-3]
            p = os.path.join(CASES, name + ".h5")
            shutil.copyfile(os.path.join(reg, fn), p)
            cases.append((name, p, False))

    # --- byte-level damage: truncations, bit flips, zeroed blocks (seeded) ---
    size = os.path.getsize(BASE)
    for frac in (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.9999):
        n = int(size * frac)

        @case("truncate_%d" % n)
        def _(p, n=n):
            os.truncate(p, n)

    with open(BASE, "rb") as f:
        base = f.read()
    for i in range(20):
        off = rng.randrange(size)
        bit = rng.randrange(8)

        @case("bitflip_%d_%d" % (off, bit), lossy=False)
        def _(p, off=off, bit=bit):
            b = bytearray(base)
            b[off] ^= 1 << bit
            with open(p, "wb") as f:
                f.write(b)

    # Flips in the first 4 KiB (superblock, root group, object headers) hit structure.
    for i in range(10):
        off = rng.randrange(min(size, 4096))

        @case("headflip_%d" % off, lossy=False)
        def _(p, off=off):
            b = bytearray(base)
            b[off] ^= 0xFF
            with open(p, "wb") as f:
                f.write(b)

    for i in range(5):
        off = rng.randrange(size - 4096)

        @case("zero_block_%d" % off, lossy=False)
        def _(p, off=off):
            b = bytearray(base)
            b[off : off + 4096] = bytes(4096)
            with open(p, "wb") as f:
                f.write(b)


def commands(p):
    out = os.path.join(os.path.dirname(p), "out_" + os.path.basename(p))
    return [
        ("inspect", [LS, "inspect", p], False),
        ("verify", [LS, "inspect", "--verify", p], False),
        ("replay", [LS, "replay", p, "-o", out + ".replay.h5"], True),
        ("forced", [LS, "replay", p, "--mode", "forced", "-o", out + ".forced.h5"], False),
        ("diff_original", [LS, "diff", BASE, p], True),
        ("diff_self", [LS, "diff", p, p], False),
        ("export", [LS, "export", p, "-r", "0", "--tap", "layers.0.attn.out", "-o", out + ".npy"], False),
        ("export_summary", [LS, "export", p, "-r", "1", "--tap", "layers.1.resid_out", "--summary", "-o", out + ".s.npy"], False),
    ] + ([("replay_pack", [LS, "replay", p, "-m", MODEL, "-o", out + ".pack.h5"], True)]
         if os.path.basename(p).startswith("pack_") else [])


def run_one(name, argv, must_differ):
    try:
        r = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB=%M"] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=TIMEOUT_S, env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        return "hang (over %d s)" % TIMEOUT_S
    err = r.stderr.decode(errors="replace").splitlines()
    rss = [int(x.split("=")[1]) for x in err if x.startswith("MAXRSS_KB=")]
    rss = rss[-1] if rss else 0
    err = [x for x in err if not x.startswith("MAXRSS_KB=") and not x.startswith("Command ")]
    rc = r.returncode
    msg = err[-1] if err else ""
    if any("terminate called" in x or "Assertion" in x or "Sanitizer" in x or "runtime error" in x for x in err):
        return "crash (rc %d): %s" % (rc, " | ".join(err[-3:]))
    if rc >= 128 or rc < 0:
        return "signal (rc %d): %s" % (rc, " | ".join(err[-3:]))
    if rc not in (0, 1, 2, 3):
        return "exit %d: %s" % (rc, msg)
    if rc in (1, 2) and not msg:
        return "exit %d with no error message" % rc
    if rss > MEM_BOUND_MB * 1024:
        return "peak memory %d MB > %d MB" % (rss // 1024, MEM_BOUND_MB)
    if must_differ and rc == 0:
        out = r.stdout.decode(errors="replace").strip().splitlines()
        return "exit 0 (%s) for a trace that lost, moved or changed rows" % (out[0][:100] if out else "")
    return None


def run_case(c):
    name, p, lossy = c
    fails = []
    for cmd, argv, differ in commands(p):
        verify_fails = (name.startswith("value_changed") or name.startswith("raw_unfiltered_chunk_taps") or
                        name == "kv_values_swapped")
        why = run_one(name, argv, differ and lossy or (cmd == "verify" and verify_fails))
        if why:
            fails.append("%s: %s" % (cmd, why))
    return name, fails


def main():
    record()
    make_cases()
    todo = [c for c in cases if ONLY is None or ONLY in c[0]]
    kinds = {}
    for n, _, _ in cases:
        k = n.split("_")[0]
        kinds[k] = kinds.get(k, 0) + 1
    print("%d cases (%s) x %d commands" % (len(cases), ", ".join("%s %d" % kv for kv in sorted(kinds.items())),
                                           len(commands(BASE))))
    unexpected = 0
    results = []
    with concurrent.futures.ThreadPoolExecutor(JOBS) as ex:
        for name, fails in ex.map(run_case, todo):
            results.append((name, fails))
            if fails and name in KNOWN:
                print("known %s (%s): %s" % (name, KNOWN[name], "; ".join(fails)))
            elif fails:
                unexpected += 1
                print("FAIL  %s: %s" % (name, "; ".join(fails)))
            elif name in KNOWN:
                unexpected += 1
                print("FIXED %s passes now: remove it from KNOWN" % name)
            else:
                print("ok    %s" % name)
    print("%d of %d cases failed unexpectedly" % (unexpected, len(todo)))
    if "--write-known" in sys.argv:
        with open(KNOWN_FILE, "w") as f:
            f.write("# hostile_traces.py: cases that still fail, with the first failing command (issue 31)\n")
            for name, fails in sorted(results):
                if fails:
                    f.write("%s %s\n" % (name, fails[0][:160]))
        return 0
    return 1 if unexpected else 0


sys.exit(main())
