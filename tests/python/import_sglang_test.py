#!/usr/bin/python3
"""tests/python/import_sglang_test.py — `python3 -m lockstep import sglang` end to end.

The dump files are written by this test's own minimal torch.save writer (a zip archive built
byte by byte and a protocol-2 pickle built opcode by opcode, from the format as
torch/serialization.py defines it; nothing shared with python/lockstep/_torchzip.py), named and
laid out as sglang's dumper (sglang/srt/debug_utils/dumper.py) names and lays them out.

0. The reader alone: every dtype it reads (f32, f64, f16, bf16, fp8 e4m3fn / e5m2, int8/16/32/64,
   uint8, bool), a strided view at a storage offset, a big-endian archive, sglang's
   {"value", "meta"} dict and a list of request ids give exactly the values written.
1. Real recordings as sglang dumps: `lockstep record` runs (A: lockstep-tiny-v32, one request,
   the old dumper's forward_pass_id= files holding bare tensors, lockstep's own tap names, full
   logits of a 6144-token vocabulary imported as top-k; B: v3_basic, two requests batched in one
   engine, the current dumper's step= files of {"value", "meta"}, the non-intrusive dumper's
   module names, rids/seq_lens/req_pool_indices, router ids in selection order, --map for two
   names), every recorded tap's rows written out as the passes of those steps. Imported and
   replayed teacher-forced on lockstep's reference: every imported tap compared, every row
   aligned, nothing missing, every float tap within fp32 parity (the values are the reference's
   own: relative L2 ≤ 1e-6, in fact 0), router ids equal as sets, the logits' KL ≤ 1e-6 with
   100 % top-1. Then one row of one dumped tensor is changed (layer 1's o_proj output, one
   decode position of the second request, × 1.05) and the replay's first divergence must be
   that request, position, layer and tap.
2. Hostile dumps: a global not on the allow-list (os.system — refused, never run), offsets,
   sizes and strides out of range, a truncated zip, a 2^40-element shape, dtypes not read, a
   non-tensor value, path traversal in a storage key, a zip member and the dumped name, the
   legacy format, object-building opcodes, CUDA-graph-padded rows, … — each one line on stderr,
   exit 1, no traceback, no output file.
3. Only where `import torch` works (the GPU machine): real torch.save files read back equal.

Usage: import_sglang_test.py LOCKSTEP PLUGIN_DIR WORK_DIR SOURCE_DIR
       import_sglang_test.py --torch-only WORK_DIR SOURCE_DIR   (part 3 alone)
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np

TORCH_ONLY = sys.argv[1] == "--torch-only"
if TORCH_ONLY:
    WORK, SRC = sys.argv[2:4]
    LOCKSTEP = PLUGIN = None
else:
    LOCKSTEP, PLUGIN, WORK, SRC = sys.argv[1:5]
    os.environ["HDF5_PLUGIN_PATH"] = PLUGIN
sys.path.insert(0, os.path.join(SRC, "python"))
os.environ["PYTHONPATH"] = os.path.join(SRC, "python")
import lockstep  # noqa: E402
from lockstep import _torchzip  # noqa: E402  (part 0 reads through it directly)

TINY = os.path.join(SRC, "models", "lockstep-tiny-v32")
FIX = os.path.join(SRC, "tests", "fixtures", "models", "v3_basic")
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
failures = []


def check(cond, what):
    print(("ok: " if cond else "FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


# -- a minimal torch.save writer, written from the format ---------------------------------------
# Pickle protocol 2, as torch.save emits it: PROTO 2, GLOBAL "module\nname\n", MARK … TUPLE,
# BINPERSID for storages, REDUCE, EMPTY_DICT + MARK … SETITEMS, BINUNICODE strings.
def p_int(n):
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -2**31 <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def p_str(s):
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def p_global(mod, name):
    return b"c" + mod.encode() + b"\n" + name.encode() + b"\n"


def p_tuple(parts):
    return b")" if not parts else b"(" + b"".join(parts) + b"t"


def p_obj(v, storages):
    """Pickle bytes of v: dict/list/tuple/str/int/float/bool/None and Tensor specs."""
    if isinstance(v, Spec):
        return v.pickle(storages)
    if v is None:
        return b"N"
    if v is True:
        return b"\x88"
    if v is False:
        return b"\x89"
    if isinstance(v, int):
        return p_int(v)
    if isinstance(v, float):
        return b"G" + struct.pack(">d", v)
    if isinstance(v, str):
        return p_str(v)
    if isinstance(v, tuple):
        return p_tuple([p_obj(x, storages) for x in v])
    if isinstance(v, list):
        return b"]" + (b"(" + b"".join(p_obj(x, storages) for x in v) + b"e" if v else b"")
    if isinstance(v, dict):
        return b"}" + (b"(" + b"".join(p_obj(k, storages) + p_obj(x, storages) for k, x in v.items()) + b"u"
                       if v else b"")
    raise TypeError(type(v))


class Spec:
    """A tensor to write: its storage's bytes and torch storage type, the view's offset,
    size and stride (in elements)."""

    def __init__(self, storage_type, data, numel, size, stride=None, offset=0, key=None, dtype=None):
        self.storage_type, self.data, self.numel = storage_type, data, numel
        self.size = tuple(size)
        if stride is None:
            stride, acc = [], 1
            for s in reversed(self.size):
                stride.insert(0, acc)
                acc *= s
        self.stride, self.offset, self.key, self.dtype = tuple(stride), offset, key, dtype

    def pickle(self, storages):
        """torch ≥ 2.1 for dtypes without a typed storage (float8): _rebuild_tensor_v3 on a
        torch.storage.UntypedStorage (numel in bytes) and the dtype as a torch.<dtype> global."""
        key = self.key if self.key is not None else str(len(storages))
        storages.append((key, self.data))
        st = p_global("torch.storage", "UntypedStorage") if self.dtype else p_global("torch", self.storage_type)
        pid = p_tuple([p_str("storage"), st, p_str(key), p_str("cpu"), p_int(self.numel)]) + b"Q"
        hooks = p_global("collections", "OrderedDict") + b")R"
        args = [pid, p_int(self.offset), p_tuple([p_int(s) for s in self.size]),
                p_tuple([p_int(s) for s in self.stride]), b"\x89", hooks]
        if self.dtype:
            args.append(p_global("torch", self.dtype))
        return (p_global("torch._utils", "_rebuild_tensor_v3" if self.dtype else "_rebuild_tensor_v2") +
                p_tuple(args) + b"R")


TYPES = {np.dtype("<f4"): "FloatStorage", np.dtype("<f8"): "DoubleStorage", np.dtype("<f2"): "HalfStorage",
         np.dtype("<i8"): "LongStorage", np.dtype("<i4"): "IntStorage", np.dtype("<i2"): "ShortStorage",
         np.dtype("i1"): "CharStorage", np.dtype("u1"): "ByteStorage", np.dtype("bool"): "BoolStorage"}


def spec(a, storage_type=None):
    """A contiguous tensor holding numpy array a (little-endian as torch writes it)."""
    a = np.ascontiguousarray(a)
    st = storage_type or TYPES[a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype]
    return Spec(st, a.astype(a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype).tobytes(), a.size,
                a.shape)


def zip_bytes(members):
    """A zip archive of (name, bytes) members, stored, each data record 64-byte aligned as torch's
    writer aligns them (padding in a local extra field), with a central directory."""
    out, central = bytearray(), bytearray()
    for name, data in members:
        nb = name.encode()
        pad = (-(len(out) + 30 + len(nb) + 4)) % 64
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        crc = zlib.crc32(data) & 0xFFFFFFFF
        off = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(nb),
                           len(extra)) + nb + extra + data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                               len(nb), 0, 0, 0, 0, 0, off) + nb
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(out), 0)
    return bytes(out + central + eocd)


def torch_save_bytes(obj, archive="archive", byteorder=b"little", pkl=None, extra_members=()):
    storages = []
    body = pkl if pkl is not None else b"\x80\x02" + p_obj(obj, storages) + b"."
    members = [(f"{archive}/data.pkl", body), (f"{archive}/byteorder", byteorder)]
    members += [(f"{archive}/data/{k}", d) for k, d in storages]
    members += [(f"{archive}/version", b"3\n")] + list(extra_members)
    return zip_bytes(members)


def write_pt(path, obj, **kw):
    with open(path, "wb") as f:
        f.write(torch_save_bytes(obj, **kw))


# -- 0. the reader alone ------------------------------------------------------------------------
def part0():
    rng = np.random.default_rng(7)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    cases = {"f32": (spec(f32), "float32", f32)}
    cases["f64"] = (spec(f32.astype(np.float64)), "float64", f32.astype(np.float64))
    h = rng.standard_normal(6).astype(np.float16)
    cases["f16"] = (spec(h), "float16", h)
    bf = (rng.standard_normal((2, 4)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    cases["bf16"] = (Spec("BFloat16Storage", (bf.view(np.uint32) >> 16).astype("<u2").tobytes(), bf.size, bf.shape),
                     "bfloat16", bf)
    # OCP E4M3FN bytes and their values by hand (bias 7): 0x38 1.0, 0x40 2.0, 0xB8 −1.0, 0x7E 448
    # (the largest), 0x01 2^-9 (the smallest subnormal), 0x34 = 1.5 × 2^-1 = 0.75.
    e4 = np.array([0x38, 0x40, 0xB8, 0x7E, 0x01, 0x34], np.uint8)
    cases["e4m3"] = (Spec("Float8_e4m3fnStorage", e4.tobytes(), 6, (6,)), "float8_e4m3fn",
                     np.array([1.0, 2.0, -1.0, 448.0, 2.0**-9, 0.75], np.float32))
    cases["e4m3 (v3)"] = (Spec(None, e4.tobytes(), 6, (6,), dtype="float8_e4m3fn"), "float8_e4m3fn", cases["e4m3"][2])
    f2 = rng.standard_normal(4).astype(np.float32)
    cases["f32 (v3)"] = (Spec(None, f2.tobytes(), 16, (2, 2), dtype="float32"), "float32", f2.reshape(2, 2))
    e5 = np.array([0x3C, 0x40, 0x7C, 0xBC], np.uint8)  # 1.0, 2.0, +inf, −1.0 (fp16's top byte)
    cases["e5m2"] = (Spec("Float8_e5m2Storage", e5.tobytes(), 4, (4,)), "float8_e5m2",
                     np.array([1.0, 2.0, np.inf, -1.0], np.float32))
    for dt in ("<i8", "<i4", "<i2", "i1", "u1"):
        a = rng.integers(-100 if dt != "u1" else 0, 100, size=(4, 2)).astype(dt)
        cases[dt] = (spec(a), None, a)
    bo = np.array([True, False, True])
    cases["bool"] = (spec(bo), "bool", bo)
    # A transposed view 2 elements into its storage: storage [2 + 12], size (4, 3), stride (1, 4).
    base = rng.standard_normal(14).astype(np.float32)
    view = np.lib.stride_tricks.as_strided(base[2:], shape=(4, 3), strides=(4, 16))
    cases["view"] = (Spec("FloatStorage", base.tobytes(), 14, (4, 3), (1, 4), offset=2), "float32", np.array(view))
    cases["0-d"] = (Spec("FloatStorage", base.tobytes(), 14, (), (), offset=5), "float32", np.array(base[5]))
    for name, (sp, want_dtype, want) in cases.items():
        got = _torchzip.loads(torch_save_bytes(sp), name)
        ok = isinstance(got, _torchzip.SavedTensor) and got.shape == want.shape
        if ok and want.dtype.kind == "f":
            ok = np.array_equal(got.to_f32(), want.astype(np.float32), equal_nan=True)
        elif ok:
            ok = np.array_equal(got.array, want)
        if want_dtype:
            ok = ok and got.dtype == want_dtype
        check(ok, f"reader: {name} tensor read back exactly ({got!r})")
    # Big-endian archive: the storage bytes swapped, byteorder "big".
    be = Spec("FloatStorage", f32.astype(">f4").tobytes(), f32.size, f32.shape)
    got = _torchzip.loads(torch_save_bytes(be, byteorder=b"big"), "big-endian")
    check(np.array_equal(got.to_f32(), f32), "reader: a big-endian archive (byteorder 'big') reads the same values")
    # sglang's current file: {"value": tensor, "meta": {…}}; the core dumper's rids: a list of str.
    obj = {"value": spec(f32), "meta": {"step": 3, "rank": 0, "name": "x", "world_size": 1,
                                        "sglang_parallel_info": {"tp_size": 1, "enable_dp_attention": False},
                                        "tokenizer_path": "/m", "scale": 0.5}}
    got = _torchzip.loads(torch_save_bytes(obj), "dict")
    check(isinstance(got, dict) and np.array_equal(got["value"].to_f32(), f32) and got["meta"]["step"] == 3 and
          got["meta"]["sglang_parallel_info"] == {"tp_size": 1, "enable_dp_attention": False} and
          got["meta"]["scale"] == 0.5, "reader: sglang's {'value', 'meta'} dict")
    got = _torchzip.loads(torch_save_bytes(["r-1", "r-2"]), "rids")
    check(got == ["r-1", "r-2"], "reader: a list of request ids")
    # Two tensors sharing one storage (a view of a view), as torch.save writes them: one data member.
    st = rng.standard_normal(8).astype(np.float32)
    a = Spec("FloatStorage", st.tobytes(), 8, (2, 2), key="0")
    b = Spec("FloatStorage", st.tobytes(), 8, (4,), offset=4, key="0")
    storages = []
    pkl = b"\x80\x02" + p_tuple([a.pickle(storages), b.pickle(storages)]) + b"."
    raw = zip_bytes([("a/data.pkl", pkl), ("a/data/0", st.tobytes()), ("a/byteorder", b"little")])
    got = _torchzip.loads(raw, "shared")
    check(np.array_equal(got[0].to_f32(), st[:4].reshape(2, 2)) and np.array_equal(got[1].to_f32(), st[4:]),
          "reader: two tensors on one storage")


# -- 1. recordings written as sglang dumps ------------------------------------------------------
def run(*args, ok=(0,)):
    p = subprocess.run([LOCKSTEP, *args], capture_output=True, text=True)
    if p.returncode not in ok:
        raise SystemExit(f"lockstep {' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-600:]}")
    return p


def imp(folder, model, out, *extra):
    return subprocess.run([sys.executable, "-m", "lockstep", "import", "sglang", folder, "-m", model, "-o", out,
                           "--json", *extra], capture_output=True, text=True)


def passes_of(trace):
    """The recording's engine steps as sglang forward passes: per step, its requests in batch
    order, each with its positions and every tap's rows there, and the tokens at them."""
    t = lockstep.open_trace(trace)
    tokens = {r.id: [int(x) for x in r.prompt] + [int(x) for x in r.generated] for r in t.requests}
    taps = sorted(n for n in t.tensors if n.startswith("taps/") and t.tensors[n].has_values)
    data = {}
    for n in taps:
        tap = n[len("taps/"):]
        for r in t.requests:
            s = t.summary(tap, r.id)
            data[(tap, r.id)] = (s["position"], s["step"], t.values(tap, r.id))
    out = []
    for st in t.steps():
        step = int(st["step"])
        reqs = []
        for r in t.requests:
            pos, stp, _ = data[("embed", r.id)]
            sel = pos[stp == step]
            if len(sel):
                reqs.append((r.id, sel))
        rows = {}
        for (tap, rid), (pos, stp, vals) in data.items():
            rows[(tap, rid)] = vals[stp == step]
        out.append(dict(step=step, reqs=reqs, rows=rows))
    t.close()
    return out, tokens, [n[len("taps/"):] for n in taps]


def write_dumps(folder, passes, tokens, names, fmt, rids=None, extra_fields=True, input_ids=True):
    """Writes one file a (pass, name): names = {tap: (dump name, layer_id or None)}; fmt "old"
    (forward_pass_id=, bare tensors, pass ids from 1) or "new" (step=, {value, meta}, from 0)."""
    os.makedirs(folder)
    index = 0
    written = {}
    for k, p in enumerate(passes):
        pid = k + 1 if fmt == "old" else k
        ids = np.concatenate([np.asarray([tokens[rid][q] for q in pos], np.int64) for rid, pos in p["reqs"]])
        pos = np.concatenate([pos for _, pos in p["reqs"]]).astype(np.int64)
        fields = ([("input_ids", None, spec(ids))] if input_ids else []) + [("positions", None, spec(pos))]
        if extra_fields:
            fields += [("seq_lens", None, spec(np.asarray([int(q[-1]) + 1 for _, q in p["reqs"]], np.int64))),
                       ("req_pool_indices", None, spec(np.asarray([rid for rid, _ in p["reqs"]], np.int64)))]
        if rids:
            fields.append(("rids", None, [rids[rid] for rid, _ in p["reqs"]]))
        for tap, (name, layer) in names.items():
            parts = [p["rows"][(tap, rid)] for rid, _ in p["reqs"]]
            if tap == "logits":
                parts = [x[-1:] for x in parts]  # sglang's next_token_logits: one row a request
            a = np.concatenate(parts).astype(np.float32 if parts[0].dtype.kind == "f" else np.int32)
            if tap.endswith("router.topk_ids") or tap.endswith("router.topk_weights"):
                a = a[:, ::-1].copy()  # selection order, not lockstep's ascending ids
            written[(pid, tap)] = a
            fields.append((name, layer, spec(a)))
        for name, layer, value in fields:
            index += 1
            tags = ([("forward_pass_id", pid), ("rank", 0), ("name", name), ("dump_index", index)] if fmt == "old" else
                    [("step", pid), ("rank", 0), ("dump_index", index), ("name", name), ("recompute_status", "disabled")])
            if layer is not None:
                tags.append(("layer_id", layer))
            fname = "___".join(f"{a}={b}" for a, b in tags) + ".pt"
            obj = value if fmt == "old" else {"value": value, "meta": dict(tags, world_rank=0, world_size=1,
                                                                          sglang_parallel_info={"tp_size": 1})}
            write_pt(os.path.join(folder, fname), obj)
    return written


def replay_json(trace):
    out = trace.replace(".h5", ".replay.h5")
    p = run("replay", trace, "--mode", "forced", "-o", out, "--json", ok=(0, 3))
    return json.loads(p.stdout)


def check_parity(label, rep, imported_taps, rows_by_tap):
    d = rep.get("diff", rep)
    tensors = {t["tensor"][len("taps/"):]: t for t in d["tensors"] if t["tensor"].startswith("taps/")}
    for tap in imported_taps:
        key = "logits (top-k)" if tap == "logits" and "logits" not in tensors else tap
        t = tensors.get(key)
        if t is None:
            check(False, f"{label}: {tap} compared by the replay")
            continue
        ok = t["rows"] == rows_by_tap[tap] and t["not_aligned_rows"] == 0 and t["diverging_rows"] == 0
        if not t["integer"] and not tap.startswith("logits"):
            ok = ok and t["worst_rel_l2"] is not None and t["worst_rel_l2"] <= 1e-6
        if not ok:
            check(False, f"{label}: {tap}: {t}")
    check(True, f"{label}: {len(imported_taps)} imported taps compared, rows aligned, within fp32 parity "
          f"(worst rel L2 {max((t['worst_rel_l2'] or 0) for t in tensors.values() if not t['integer']):.3g})")
    check(not d["missing"] and not d.get("only_in_a"), f"{label}: nothing missing ({d['missing']}, {d.get('only_in_a')})")
    lg = d["logit_summary"]
    check(lg["rows"] > 0 and lg["max_kl"] <= 1e-6 and lg["same_top_pct"] == 100,
          f"{label}: logits: {lg['rows']} positions, max KL {lg['max_kl']:.3g}, same top p {lg['same_top_pct']}%")
    check(d["first_divergence"] is None, f"{label}: no first divergence ({d['first_divergence']})")


def part1():
    # A: lockstep-tiny-v32, one request, the old dumper's files, lockstep's own names.
    rec_a = os.path.join(WORK, "a.rec.h5")
    run("record", "-m", TINY, "--prompt-ids", "1,300,301,302,8,17,200", "-n", "6", "-t", "0", "--logits", "full",
        "-o", rec_a, "-q")
    passes, tokens, taps = passes_of(rec_a)
    names = {}
    for tap in taps:
        if tap.startswith("layers.") and tap.endswith(("attn.out", "indexer.topk")):
            names[tap] = (tap.split(".", 2)[2], int(tap.split(".")[1]))  # the name, the layer as layer_id=
        else:
            names[tap] = (tap, None)
    dir_a = os.path.join(WORK, "dumps_a", "sglang_dump_1767225600.123")
    write_dumps(dir_a, passes, tokens, names, "old", extra_fields=False)
    out_a = os.path.join(WORK, "a.imported.h5")
    p = imp(os.path.dirname(dir_a), TINY, out_a)
    check(p.returncode == 0, f"import A: exit {p.returncode} {p.stderr.strip()[-300:]}")
    if p.returncode:
        return
    info = json.loads(p.stdout)
    print(f"import A: {info['requests']} request, {info['passes']} passes, {info['rows']} rows in {info['taps']} taps")
    t = lockstep.open_trace(out_a)
    r0 = t.requests[0]
    check(list(r0.prompt) + list(r0.generated)[:-1] == tokens[0][:-1] and t.meta["source"].startswith("sglang dumper"),
          f"import A: tokens from input_ids, meta.source {t.meta['source']!r}")
    check(len(passes) == info["passes"] and "logits.topk_ids" in {n[5:] for n in t.tensors},
          "import A: one pass a step; a 6144-token vocabulary's logits kept as top-k")
    t.close()
    rows = {tap: sum(len(p["rows"][(tap, 0)]) for p in passes) for tap in taps}
    rows["logits"] = len(passes)
    check_parity("replay A", replay_json(out_a), taps, rows)

    # A without input_ids: refused until --tokens gives the tokens; then the same trace.
    dir_a2 = os.path.join(WORK, "dumps_a2", "sglang_dump_1")
    write_dumps(dir_a2, passes, tokens, names, "old", extra_fields=False, input_ids=False)
    p = imp(dir_a2, TINY, os.path.join(WORK, "a2.imported.h5"))
    check(p.returncode == 1 and "--tokens" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
          f"import A without input_ids: refused, asks for --tokens ({p.stderr.strip()[:160]})")
    tok = os.path.join(WORK, "a2.tokens.json")
    with open(tok, "w") as f:
        json.dump({"prompt": tokens[0][:7], "generated": tokens[0][7:]}, f)
    out_a2 = os.path.join(WORK, "a2.imported.h5")
    p = imp(dir_a2, TINY, out_a2, "--tokens", tok)
    ok = p.returncode == 0
    if ok:
        t = lockstep.open_trace(out_a2)
        ok = list(t.requests[0].prompt) + list(t.requests[0].generated) == tokens[0] and not json.loads(p.stdout)["notes"]
        t.close()
        d = replay_json(out_a2)
        ok = ok and d.get("diff", d)["first_divergence"] is None
    check(ok, f"import A without input_ids, --tokens: every token (the last one too) and no divergence "
          f"({p.stderr.strip()[-200:]})")

    # B: v3_basic, two requests in one engine (batched steps), the current dumper's files.
    prompts = os.path.join(WORK, "b.prompts.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"id": "first", "prompt_ids": [1, 17, 200, 31, 9, 44]}) + "\n")
        f.write(json.dumps({"id": "second", "prompt_ids": [1, 90, 12, 5]}) + "\n")
    rec_b = os.path.join(WORK, "b.rec.h5")
    run("record", "-m", FIX, "--prompts", prompts, "-n", "5", "-t", "0", "--max-batch", "2", "-o", rec_b, "-q")
    passes, tokens, taps = passes_of(rec_b)
    n_layers = 3
    check(any(len(p["reqs"]) == 2 for p in passes), f"recording B batches the two requests "
          f"({[len(p['reqs']) for p in passes]} requests a step)")
    ni = "non_intrusive__model."
    names = {}
    for tap in taps:
        if tap == "embed":
            names[tap] = (ni + "embed_tokens.output", None)
        elif tap == "final_norm":
            names[tap] = (ni + "norm.output.0", None)
        elif tap == "logits":
            names[tap] = ("non_intrusive__logits_processor.output.next_token_logits", None)
        else:
            L, what = int(tap.split(".")[1]), tap.split(".", 2)[2]
            m = f"{ni}layers.{L}."
            names[tap] = {
                "attn_norm": (m + "input_layernorm.output" + ("" if L == 0 else ".0"), L),
                "resid_out": ((f"{ni}layers.{L + 1}.input_layernorm.output.1", L + 1) if L + 1 < n_layers
                              else (ni + "norm.output.1", None)),
                "attn.latent": (m + "self_attn.kv_a_layernorm.output", L),
                "attn.heads": (m + "self_attn.o_proj.inputs.0", L),
                "attn.out": (m + "self_attn.o_proj.output", L),
                "ffn_norm": (m + "post_attention_layernorm.output.0", L),
                "resid_mid": (m + "post_attention_layernorm.output.1", L),
                "ffn.out": (m + "mlp.output", L),
                "attn.q": ("q_after_rope", L),                   # --map q_after_rope=attn.q (layer from layer_id)
                "attn.k_rope": (f"k_rope_of_layer{L}", None),    # --map 'k_rope_of_layer{L}=layers.{L}.attn.k_rope'
                "ffn.router.topk_ids": ("ffn.router.topk_ids", L),          # lockstep's names, layer_id=
                "ffn.router.topk_weights": ("ffn.router.topk_weights", L),
            }[what]
    dir_b = os.path.join(WORK, "dumps_b", "dump_20260101_000000_123456")
    rids = {0: "9f1c0a", 1: "77ab02"}
    written = write_dumps(dir_b, passes, tokens, names, "new", rids=rids)
    # Names sglang dumps that have no tap: counted, not read.
    write_pt(os.path.join(dir_b, "step=0___rank=0___dump_index=9999___name=non_intrusive__model.layers.0.self_attn."
                                 "q_a_proj.output___layer_id=0.pt"), {"value": spec(np.zeros((1, 3), np.float32))})
    maps = ["--map", "q_after_rope=attn.q", "--map", "k_rope_of_layer{L}=layers.{L}.attn.k_rope"]
    out_b = os.path.join(WORK, "b.imported.h5")
    p = imp(os.path.dirname(dir_b), FIX, out_b, *maps)
    check(p.returncode == 0, f"import B: exit {p.returncode} {p.stderr.strip()[-300:]}")
    if p.returncode:
        return
    info = json.loads(p.stdout)
    print(f"import B: {info['requests']} requests, {info['passes']} passes, {info['rows']} rows in {info['taps']} taps; "
          f"skipped {info['skipped_names']}")
    check(info["requests"] == 2 and info["skipped_names"] == {"non_intrusive__model.layers.0.self_attn.q_a_proj.output": 1},
          "import B: two requests by rid; the name without a tap skipped and counted")
    t = lockstep.open_trace(out_b)
    check([r.name for r in t.requests] == ["9f1c0a", "77ab02"] and
          all(list(r.prompt) + list(r.generated) == tokens[i] for i, r in enumerate(t.requests)),
          "import B: each request's prompt and generated tokens (the last one the argmax of its dumped logits)")
    t.close()
    rows = {tap: sum(len(p["rows"][(tap, rid)]) for p in passes for rid, _ in p["reqs"]) for tap in taps}
    rows["logits"] = sum(len(p["reqs"]) for p in passes)
    check_parity("replay B", replay_json(out_b), taps, rows)

    # B without rids: the requests told apart by req_pool_indices.
    dir_b2 = os.path.join(WORK, "dumps_b2", "dump_y")
    write_dumps(dir_b2, passes, tokens, names, "new")
    out_b2 = os.path.join(WORK, "b2.imported.h5")
    p = imp(dir_b2, FIX, out_b2, *maps)
    ok = p.returncode == 0
    if ok:
        t = lockstep.open_trace(out_b2)
        ok = len(t.requests) == 2 and all(list(r.prompt) + list(r.generated) == tokens[i] for i, r in enumerate(t.requests))
        t.close()
    check(ok, f"import B without rids: two requests by req_pool_indices, their tokens ({p.stderr.strip()[-200:]})")

    # The planted change: layer 1's o_proj output × 1.05 at one decode position of "second".
    k = next(i for i, p in enumerate(passes) if len(p["reqs"]) == 2 and all(len(q) == 1 for _, q in p["reqs"]))
    pos = int(passes[k]["reqs"][1][1][0])
    planted = os.path.join(WORK, "dumps_planted", "dump_x")
    shutil.copytree(dir_b, planted)
    tap = "layers.1.attn.out"
    f = next(n for n in os.listdir(planted) if n.startswith(f"step={k}___") and f"name={names[tap][0]}___" in n)
    a = written[(k, tap)].copy()
    a[1] *= np.float32(1.05)
    write_pt(os.path.join(planted, f), {"value": spec(a), "meta": {"step": k, "name": names[tap][0]}})
    out_p = os.path.join(WORK, "planted.imported.h5")
    p = imp(os.path.dirname(planted), FIX, out_p, *maps)
    check(p.returncode == 0, f"import planted: exit {p.returncode} {p.stderr.strip()[-300:]}")
    if p.returncode:
        return
    d = replay_json(out_p)
    d = d.get("diff", d)
    fd = d["first_divergence"] or {}
    print(f"planted: first divergence {json.dumps(fd)[:400]}")
    # rel L2 against the import (the diff's a): ‖1.05x − x‖ / ‖1.05x‖ = 0.05 / 1.05.
    check(fd.get("request") == 1 and fd.get("position") == pos and fd.get("tensor") == "taps/" + tap and
          fd.get("layer") == 1 and abs((fd.get("rel_l2") or 0) - 0.05 / 1.05) < 1e-4,
          f"planted: the first divergence is request 1, position {pos}, {tap}, rel L2 0.05/1.05 "
          f"(got {fd.get('request')}, {fd.get('position')}, {fd.get('tensor')}, {fd.get('rel_l2')})")


# -- 2. hostile dumps ---------------------------------------------------------------------------
def zip_raw(members):
    """(name, data, method) members; method 8 deflates (torch never does)."""
    out, central = bytearray(), bytearray()
    for name, data, method in members:
        nb = name.encode()
        body = data
        if method == 8:
            c = zlib.compressobj(9, zlib.DEFLATED, -15)
            body = c.compress(data) + c.flush()
        crc = zlib.crc32(data) & 0xFFFFFFFF
        off = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(body), len(data), len(nb),
                           0) + nb + body
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(body), len(data),
                               len(nb), 0, 0, 0, 0, 0, off) + nb
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(out), 0)
    return bytes(out + central + eocd)


def part2():
    H = 64  # v3_basic's hidden size
    rng = np.random.default_rng(3)
    good = rng.standard_normal((2, H)).astype(np.float32)
    marker = os.path.join(WORK, "os_system_ran")
    EMBED = "step=0___rank=0___dump_index=3___name=non_intrusive__model.embed_tokens.output.pt"

    def tensor_pkl(storage_type="FloatStorage", key="0", numel=2 * H, offset=0, size=(2, H), stride=(H, 1)):
        pid = p_tuple([p_str("storage"), p_global("torch", storage_type), p_str(key), p_str("cpu"), p_int(numel)]) + b"Q"
        return (b"\x80\x02" + p_global("torch._utils", "_rebuild_tensor_v2") +
                p_tuple([pid, p_int(offset), p_tuple([p_int(x) for x in size]), p_tuple([p_int(x) for x in stride]),
                         b"\x89", p_global("collections", "OrderedDict") + b")R"]) + b"R.")

    def archive(pkl, data=good.tobytes(), key="0"):
        return zip_bytes([("archive/data.pkl", pkl), ("archive/byteorder", b"little"), (f"archive/data/{key}", data)])

    valid = torch_save_bytes({"value": spec(good), "meta": {"name": "non_intrusive__model.embed_tokens.output"}})
    cases = [
        ("os.system", archive(b"\x80\x02" + p_global("os", "system") + p_str("touch " + marker) + b"\x85R.")),
        ("builtins.eval", archive(b"\x80\x02" + p_global("builtins", "eval") + p_str("1+1") + b"\x85R.")),
        ("a class global", archive(b"\x80\x02" + p_global("sglang.srt.layers.logits_processor", "LogitsProcessorOutput")
                                   + b")R.")),
        ("STACK_GLOBAL of posix.system", archive(b"\x80\x04" + b"\x8c\x05posix\x8c\x06system\x93" + p_str("id") + b"\x85R.")),
        ("offset out of range", archive(tensor_pkl(offset=10))),
        ("storage shorter than its numel", archive(tensor_pkl(numel=2 * H), data=good.tobytes()[:100])),
        ("negative stride", archive(tensor_pkl(stride=(-H, 1), offset=H))),
        ("stride past the storage", archive(tensor_pkl(stride=(H, 2)))),
        ("size and stride of different lengths", archive(tensor_pkl(size=(2, H), stride=(H,)))),
        ("a 2^40-element shape", archive(tensor_pkl(size=(1 << 20, 1 << 20), stride=(1 << 20, 1)))),
        ("a 2^30-element broadcast of one element", archive(tensor_pkl(size=(1 << 30,), stride=(0,)))),
        ("complex dtype", archive(tensor_pkl(storage_type="ComplexFloatStorage", numel=H))),
        ("complex dtype, torch 2's form", torch_save_bytes({"value": Spec(None, good.tobytes(), good.nbytes, (2, H // 2),
                                                                           dtype="complex64")})),
        ("an untyped storage without a dtype", archive(
            tensor_pkl(numel=good.nbytes).replace(p_global("torch", "FloatStorage"),
                                                  p_global("torch.storage", "UntypedStorage")))),
        ("quantised dtype", archive(tensor_pkl(storage_type="QInt8Storage", numel=2 * H * 4))),
        ("storage key with ../", archive(tensor_pkl(key="../../../../etc/passwd"), key="0")),
        ("zip member with ../", zip_bytes([("archive/data.pkl", tensor_pkl()), ("archive/../../evil", b"x"),
                                           ("archive/data/0", good.tobytes())])),
        ("duplicate zip member", zip_bytes([("archive/data.pkl", tensor_pkl()), ("archive/data/0", good.tobytes()),
                                            ("archive/data/0", good.tobytes())])),
        ("deflated member", zip_raw([("archive/data.pkl", tensor_pkl(), 0), ("archive/data/0", good.tobytes(), 8)])),
        ("no data.pkl", zip_bytes([("archive/byteorder", b"little"), ("archive/data/0", good.tobytes())])),
        ("TorchScript archive", zip_bytes([("m/data.pkl", tensor_pkl()), ("m/constants.pkl", b"\x80\x02)."),
                                           ("m/data/0", good.tobytes())])),
        ("truncated zip", valid[:len(valid) // 2]),
        ("not a zip", bytes(rng.integers(0, 256, 300, dtype=np.uint8))),
        ("empty file", b""),
        ("legacy format", b"\x80\x02\x8a\x0a" + (0x1950a86a20f9469cfc6c).to_bytes(10, "little") + b".rest"),
        ("BUILD opcode", archive(b"\x80\x02}" + p_str("x") + b"b.")),
        ("NEWOBJ opcode", archive(b"\x80\x02" + p_global("collections", "OrderedDict") + b")\x81.")),
        ("truncated pickle", archive(tensor_pkl()[:40])),
        ("integer of 2^31 bytes", archive(b"\x80\x02\x8b" + struct.pack("<i", 2**31 - 1) + b"xx.")),
        ("non-tensor value", torch_save_bytes({"value": {"a": 1}, "meta": {}})),
        ("dumped name differs from meta.name (path traversal)",
         torch_save_bytes({"value": spec(good), "meta": {"name": "../../../../etc/passwd"}})),
        ("rows padded past the tokens (CUDA graph)", torch_save_bytes({"value": spec(np.zeros((4, H), np.float32))})),
        ("wrong columns", torch_save_bytes({"value": spec(np.zeros((2, H - 1), np.float32))})),
        ("integer tensor for a float tap", torch_save_bytes({"value": spec(np.zeros((2, H), np.int64))})),
        ("a multi-rank run (meta.world_size 2)",
         torch_save_bytes({"value": spec(good), "meta": {"world_size": 2}})),
    ]
    ran = 0
    for label, raw in cases:
        d = os.path.join(WORK, "hostile", label.replace(" ", "_").replace("/", "_").replace(".", "_"), "dump_x")
        os.makedirs(d)
        write_pt(os.path.join(d, "step=0___rank=0___dump_index=1___name=input_ids.pt"),
                 {"value": spec(np.array([1, 17], np.int64))})
        write_pt(os.path.join(d, "step=0___rank=0___dump_index=2___name=positions.pt"),
                 {"value": spec(np.array([0, 1], np.int64))})
        with open(os.path.join(d, EMBED), "wb") as f:
            f.write(raw)
        ran += _refused(label, os.path.dirname(d), EMBED)
    # Cases about the folder rather than one file.
    def folder(label, files, extra=()):
        d = os.path.join(WORK, "hostile", label.replace(" ", "_").replace("/", "_"), "dump_x")
        os.makedirs(d)
        for name, obj in files:
            if isinstance(obj, bytes):
                with open(os.path.join(d, name), "wb") as f:
                    f.write(obj)
            elif obj == "link":
                os.symlink("/dev/zero", os.path.join(d, name))
            else:
                write_pt(os.path.join(d, name), obj)
        return _refused(label, os.path.dirname(d), files[-1][0], extra)
    ids = ("step=0___rank=0___dump_index=1___name=input_ids.pt", {"value": spec(np.array([1, 17], np.int64))})
    ran += folder("a dump that is a link to /dev/zero", [ids, (EMBED, "link")])
    ran += folder("dumps of two ranks", [ids, ("step=0___rank=1___dump_index=1___name=non_intrusive__model.embed_tokens"
                                               ".output.pt", {"value": spec(good)})])
    ran += folder("a name dumped twice in a pass", [ids, (EMBED, {"value": spec(good)}),
                                                   (EMBED.replace("dump_index=3", "dump_index=4"), {"value": spec(good)})])
    ran += folder("a file name that is not the dumper's", [ids, ("embed.pt", {"value": spec(good)})])
    ran += folder("--map to a name that is no tap", [ids, (EMBED, {"value": spec(good)})],
                  extra=("--map", "foo=../../meta"))
    check(not os.path.exists(marker), "hostile: os.system was never called (its marker file does not exist)")
    check(ran >= 12, f"hostile: {ran} damaged or crafted dumps, each refused with one line, exit 1, no traceback")


def _refused(label, folder, fname, extra=()):
    out = os.path.join(WORK, "hostile.out.h5")
    if os.path.exists(out):
        os.remove(out)
    p = imp(folder, FIX, out, *extra)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    named = fname in p.stderr or folder in p.stderr or (extra and extra[-1] in p.stderr)
    ok = (p.returncode == 1 and len(lines) == 1 and lines[0].startswith("lockstep: ") and "Traceback" not in p.stderr
          and named and not os.path.exists(out))
    check(ok, f"hostile: {label}: exit {p.returncode}, {lines[0][:220] if lines else 'no message'}"
          + ("" if ok else f" [{len(lines)} lines, names the file: {bool(named)}]"))
    return 1 if ok else 0


# -- 3. real torch.save files (where torch is installed) ----------------------------------------
def part3():
    try:
        import torch
    except Exception as e:  # ImportError, or a torch that fails to load
        print(f"skip: real torch.save files: `import torch` fails here ({type(e).__name__}); part 3 runs where torch "
              "is installed (the GPU machine: import_sglang_test.py --torch-only WORK SRC)")
        return
    d = os.path.join(WORK, "torch_save")
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 7, generator=g)
    cases = {
        "float32": x, "float64": x.double(), "float16": x.half(), "bfloat16": x.bfloat16(),
        "int64": torch.arange(-6, 6).reshape(3, 4), "int32": torch.arange(12, dtype=torch.int32),
        "int16": torch.arange(-3, 3, dtype=torch.int16), "int8": torch.arange(-5, 5, dtype=torch.int8),
        "uint8": torch.arange(0, 250, 25, dtype=torch.uint8), "bool": x > 0,
        "a transposed view at an offset": x[1:, 2:].t(), "a 0-d tensor": x[0, 0].clone(),
        "an empty tensor": torch.zeros(0, 3),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            cases[name] = x.clamp(-8, 8).to(getattr(torch, name))
    for label, t in cases.items():
        path = os.path.join(d, label.replace(" ", "_") + ".pt")
        torch.save(t, path)
        got = _torchzip.load(path)
        want = t.float().numpy() if t.is_floating_point() else t.numpy()
        have = got.to_f32() if t.is_floating_point() else got.array
        check(isinstance(got, _torchzip.SavedTensor) and got.shape == tuple(t.shape) and
              np.array_equal(have, want, equal_nan=True) and got.dtype == str(t.dtype).replace("torch.", ""),
              f"torch.save {label} ({t.dtype}, {list(t.shape)}): read back identical")
    path = os.path.join(d, "sglang_style.pt")
    torch.save({"value": x.bfloat16(), "meta": {"step": 2, "rank": 0, "name": "n", "world_size": 1,
                                                "sglang_parallel_info": {"tp_size": 1}}}, path)
    got = _torchzip.load(path)
    check(np.array_equal(got["value"].to_f32(), x.bfloat16().float().numpy()) and got["meta"]["step"] == 2,
          "torch.save of sglang's {'value', 'meta'}: read back identical")
    path = os.path.join(d, "rids.pt")
    torch.save(["a1", "b2"], path)
    check(_torchzip.load(path) == ["a1", "b2"], "torch.save of a list of request ids")
    path = os.path.join(d, "param.pt")
    torch.save(torch.nn.Parameter(x.clone()), path)
    check(np.array_equal(_torchzip.load(path).to_f32(), x.numpy()), "torch.save of an nn.Parameter")
    path = os.path.join(d, "legacy.pt")
    torch.save(x, path, _use_new_zipfile_serialization=False)
    try:
        _torchzip.load(path)
        check(False, "torch.save(_use_new_zipfile_serialization=False): refused")
    except lockstep.TraceError as e:
        check("legacy" in str(e), f"torch.save(_use_new_zipfile_serialization=False): refused ({e})")


if __name__ == "__main__":
    part0()
    if not TORCH_ONLY:
        part1()
        part2()
    part3()
    if failures:
        print(f"{len(failures)} FAILED")
        sys.exit(1)
    print("all ok")
