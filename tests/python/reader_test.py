#!/usr/bin/python3
"""tests/python/reader_test.py — the Python package (python/lockstep) against lockstep itself.

Traces recorded by `lockstep record` (fp32, bf16 and fp8 KV caches, a V3.2 model's integer
taps) are read with lockstep.open_trace and compared with what the C++ side says about the
same files: `lockstep export` (.npy of a request's rows, values and summaries, FP8 dequantised
by the C++ code) and `lockstep inspect --json` (requests, tokens, tensors and row counts).
verify() must accept every row and refuse a row whose bytes were changed. The Python writer's
copy of each trace must open in `lockstep inspect --verify`, `lockstep diff` of the copy against
the original must say identical (exit 0), and a copy with one changed value must not (exit 3).
Hostile input: each damaged file is one TraceError naming the file, never another exception.

Usage: reader_test.py LOCKSTEP PLUGIN_DIR WORK_DIR SOURCE_DIR
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np

LOCKSTEP, PLUGIN, WORK, SRC = sys.argv[1:5]
sys.path.insert(0, os.path.join(SRC, "python"))
os.environ["HDF5_PLUGIN_PATH"] = PLUGIN
import lockstep  # noqa: E402
from lockstep import TraceError  # noqa: E402

FIX = os.path.join(SRC, "tests", "fixtures", "models")
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(*args, ok=(0,)):
    p = subprocess.run([LOCKSTEP, *args], capture_output=True, text=True)
    if p.returncode not in ok:
        raise SystemExit(f"lockstep {' '.join(args)} exited {p.returncode}: {p.stderr.strip()}")
    return p


def record(name, model, *extra):
    out = os.path.join(WORK, name + ".h5")
    with open(os.path.join(WORK, name + ".jsonl"), "w") as fp:
        fp.write(json.dumps({"id": "a", "prompt_ids": [5, 6, 7, 8, 9]}) + "\n")
        fp.write(json.dumps({"id": "b", "prompt_ids": [11, 12, 13]}) + "\n")
    run("record", "-m", os.path.join(FIX, model), "--prompts", os.path.join(WORK, name + ".jsonl"), "-n", "5",
        "-t", "0.8", "--seed", "3", "-q", "-o", out, *extra)
    return out


def export(trace, tap, *flags, request="0"):
    out = os.path.join(WORK, "x.npy")
    run("export", trace, "-r", request, "--tap", tap, "-o", out, *flags)
    return np.load(out)


def test_read(trace, kv_format):
    t = lockstep.open_trace(trace)
    info = json.loads(run("inspect", "--json", trace).stdout)
    check(t.format_version == tuple(info["format_version"]), f"{trace}: format_version")
    check(t.complete is True and info["complete"] is True, f"{trace}: complete")
    # Requests and tokens as inspect sees them.
    check(len(t.requests) == len(info["requests"]), f"{trace}: request count")
    for r, j in zip(t.requests, info["requests"]):
        check(r.id == j["id"] and r.name == j["name"], f"{trace}: request {r.id} id/name")
        check(len(r.prompt) == j["prompt_tokens"] and list(r.generated) == j["generated"], f"{trace}: request {r.id} tokens")
        check(r.seed == j["seed"] and r.top_p == j["top_p"], f"{trace}: request {r.id} seed/top_p")
        check(r.finish_reason == j["finish_reason"], f"{trace}: request {r.id} finish_reason")
        check(r.temperature == j["temperature"], f"{trace}: request {r.id} temperature")
    # Tensors and their rows.
    want = {x["path"]: x for x in info["tensors"]}
    check(set(want) == set(t.tensors), f"{trace}: tensor list {sorted(set(want) ^ set(t.tensors))[:4]}")
    for p, x in want.items():
        ten = t.tensors.get(p)
        check(ten is not None and ten.rows == x["rows"] and ten.cols == x["cols"] and ten.dtype == x["dtype"],
              f"{trace}: {p} rows/cols/dtype")
    # Values and summaries per request against `lockstep export` (the C++ reader's decoding).
    n_cmp = 0
    for p, ten in t.tensors.items():
        if not ten.has_values or ".scales" in p or ".rope" in p:
            continue
        for r in t.requests[1:]:  # the second request: rows of another request come first in the file
            mine = t.values(p, request=r.id)
            theirs = export(trace, p, request=str(r.id))
            check(mine.shape == theirs.shape, f"{trace}: {p} request {r.id}: shape {mine.shape} vs export {theirs.shape}")
            if ten.dtype == "fp8_e4m3":
                # export dequantises with the .scales rows; kv() does the same from docs/kv-cache.md.
                layer, stream = p.split("/")[1].split(".")[1], p.split(".")[-1]
                deq = t.kv(int(layer), stream, request=r.id)[:, :theirs.shape[1]]
                check(np.array_equal(deq, theirs), f"{trace}: {p} request {r.id}: fp8 dequantised differs from export")
            else:
                check(np.array_equal(mine.view(np.uint8), theirs.astype(mine.dtype).view(np.uint8)),
                      f"{trace}: {p} request {r.id}: values differ from export")
            if n_cmp % 3:
                n_cmp += 1
                continue
            s = export(trace, p, "--summary", request=str(r.id))
            mine_s = t.summary(p, request=r.id)
            check(all(np.array_equal(mine_s[f], s[f]) for f in ("position", "hash", "request", "step")),
                  f"{trace}: {p} request {r.id}: summary differs from export")
            n_cmp += 1
    check(list(t.request("a").prompt) == [5, 6, 7, 8, 9] and list(t.request("b").prompt) == [11, 12, 13],
          f"{trace}: prompts")
    check(n_cmp > 10, f"{trace}: only {n_cmp} tensors compared")
    # Every row verifies; the KV cache dequantises to what attention read.
    check(t.verify() == sum(x.rows for x in t.tensors.values() if x.has_values), f"{trace}: verify count")
    cfg = json.loads(t.meta["model_config"])
    C = cfg["kv_lora_rank"]
    for layer in range(cfg["num_hidden_layers"]):
        kv = t.kv(layer, request=0)
        lat = t.values(f"layers.{layer}.attn.latent", request=0)
        rope = t.values(f"layers.{layer}.attn.k_rope", request=0)
        check(kv.shape == (lat.shape[0], C + rope.shape[1]), f"{trace}: kv layer {layer} shape {kv.shape}")
        if kv_format == "fp32":
            check(np.array_equal(kv[:, :C], lat) and np.array_equal(kv[:, C:], rope), f"{trace}: fp32 kv != taps")
        elif kv_format == "bf16":
            check(np.array_equal(kv, lockstep.bf16_to_f32(lockstep.f32_to_bf16(np.concatenate([lat, rope], 1)))),
                  f"{trace}: bf16 kv layer {layer} is not the taps rounded to nearest even")
        else:
            # e4m3 keeps 3 mantissa bits: |error| ≤ half an ulp = 2^-4 relative above the
            # normal range, and ≤ scale·2^-10 below it (subnormal steps of 2^-9 × scale).
            s = t.stored(f"kv/layers.{layer}.latent.scales", request=0)
            scale = np.repeat(s, 128, axis=1)[:, :C]
            err = np.abs(kv[:, :C] - lat)
            check(np.all(err <= np.maximum(np.abs(lat) * 2.0**-4, scale * 2.0**-10)), f"{trace}: fp8 kv layer {layer} error")
            check(np.array_equal(kv[:, C:], lockstep.bf16_to_f32(lockstep.f32_to_bf16(rope))), f"{trace}: fp8 rope")
    t.close()
    return t


def copy_trace(src, dst, mutate=None, narrow=None):
    """The Python writer's copy of a trace: same meta, requests, tables and rows (tensor `mutate`
    with one bit flipped; tensor `narrow` stored 8 columns short, a shape no model of the trace has)."""
    t = lockstep.open_trace(src)
    w = lockstep.TraceWriter(dst)
    for k, v in t.meta.items():
        w.set_meta(k, v)
    for r in t.requests:
        w.add_request(r.id, r.prompt, r.name, r.prompt_text, r.max_new_tokens, r.seed, r.temperature, r.top_p,
                      r.min_p, r.top_k)
        w.finish_request(r.id, r.generated, r.generated_text, r.finish_reason)
    for s in t.sampling():
        w.append_sampling(**{k: s[k] for k in s.dtype.names})
    bw = t._f["step_batch"].shape[1]
    w.batch_width = bw
    for s, b in zip(t.steps(), t._read_table("step_batch")):
        w.append_step(int(s["step"]), [int(x) for x in b if x >= 0], int(s["tokens"]), int(s["wall_ns"]), int(s["stall_ns"]))
    for p, ten in t.tensors.items():
        cut = 8 if p == narrow else 0
        w.define_tensor(p, ten.dtype, ten.cols - cut, ten.has_values, ten.attrs)
        s = t.summary(p)
        if not ten.has_values:
            w.append_summaries(p, s)
            continue
        v = t.stored(p).copy()
        if cut:
            v = np.ascontiguousarray(v[:, :ten.cols - cut])
        if mutate and p == mutate:
            v.view(np.uint8)[0, 0] ^= 1
        for i in range(len(s)):  # one row at a time, each with its own request, position, step
            w.append(p, v[i:i + 1], int(s["request"][i]), int(s["position"][i]), int(s["step"][i]))
    w.close()
    t.close()


def test_write(trace):
    dst = trace.replace(".h5", ".py.h5")
    copy_trace(trace, dst)
    p = run("inspect", "--verify", dst)
    check("match their content hashes" in p.stdout, f"{dst}: inspect --verify: {p.stdout[-200:]}")
    d = run("diff", trace, dst, ok=(0, 3))
    check(d.returncode == 0 and "identical" in d.stdout, f"{dst}: diff with the original: {d.stdout[-300:]}")
    d = run("diff", dst, dst, ok=(0, 3))
    check(d.returncode == 0, f"{dst}: diff against itself")
    # The copy's summaries are the C++ writer's, bit for bit (statistics too).
    a, b = lockstep.open_trace(trace), lockstep.open_trace(dst)
    for name in a.tensors:
        check(a.summary(name).tobytes() == b.summary(name).tobytes(), f"{dst}: {name} summaries differ")
    bad = trace.replace(".h5", ".mut.h5")
    copy_trace(trace, bad, mutate="taps/layers.1.attn.out")
    d = run("diff", trace, bad, ok=(0, 3))
    check(d.returncode == 3 and "layers.1.attn.out" in d.stdout, f"{bad}: a changed value is not found by diff")
    # A tensor narrower than the model makes it (a stranger's file, or another model's trace):
    # verify refuses it with one line naming it before any row is read.
    narrow = trace.replace(".h5", ".narrow.h5")
    copy_trace(trace, narrow, narrow="taps/layers.0.attn_norm")
    v = run("verify", narrow, "-q", ok=(0, 1, 2, 3))
    err = v.stderr.strip()
    check(v.returncode in (1, 2) and "taps/layers.0.attn_norm" in err and "columns" in err and "\n" not in err,
          f"{narrow}: verify of a narrowed tap: exit {v.returncode}: {err[-300:]}")


def hostile(good):
    cases = {}
    def damaged(name, edit):
        path = os.path.join(WORK, "hostile-" + name + ".h5")
        shutil.copy(good, path)
        edit(path)
        cases[name] = path

    def h5edit(fn):
        def e(path):
            import h5py
            with h5py.File(path, "r+") as f:
                fn(f)
        return e

    damaged("not_hdf5", lambda p: open(p, "wb").write(b"hello, not a trace" * 100))
    damaged("truncated", lambda p: os.truncate(p, os.path.getsize(p) // 3))
    damaged("empty", lambda p: os.truncate(p, 0))
    damaged("newer", h5edit(lambda f: f.attrs.__setitem__("format_version", np.array([2, 0], np.int32))))
    damaged("no_magic", h5edit(lambda f: f.attrs.__delitem__("lockstep_trace")))
    damaged("no_meta", h5edit(lambda f: f.__delitem__("meta")))
    damaged("bad_dtype", h5edit(lambda f: f["taps/embed"].attrs.__setitem__("dtype", np.bytes_(b"f64"))))
    damaged("bad_cols", h5edit(lambda f: f["taps/embed"].attrs.__setitem__("cols", np.int64(-3))))
    damaged("no_summary", h5edit(lambda f: f.__delitem__("taps/embed/summary")))
    damaged("bad_temperature", h5edit(lambda f: f["requests/0"].attrs.__setitem__("temperature", np.float64(np.nan))))
    damaged("prompt_2d", h5edit(lambda f: (f["requests/0"].__delitem__("prompt"),
                                            f["requests/0"].create_dataset("prompt", data=np.zeros((2, 2), np.int32)))))
    damaged("sampling_type", h5edit(lambda f: (f.__delitem__("sampling"), f.create_dataset("sampling", data=np.zeros(3)))))
    for name, path in cases.items():
        try:
            lockstep.open_trace(path).verify()
            failures.append(f"hostile {name}: opened without an error")
            print("FAIL: hostile", name, "opened")
        except TraceError as e:
            msg = str(e)
            check(path in msg and "\n" not in msg, f"hostile {name}: message does not name the file: {msg}")
            print(f"hostile {name}: {msg}")
        except Exception as e:  # anything else is a defect
            failures.append(f"hostile {name}: {type(e).__name__}: {e}")
            print("FAIL: hostile", name, type(e).__name__, e)
    # A changed row is found by verify(), by name and row.
    bad = os.path.join(WORK, "hostile-flipped.h5")
    shutil.copy(good, bad)
    import h5py
    with h5py.File(bad, "r+") as f:
        v = f["taps/layers.0.resid_out/values"]
        row = v[2]
        row[5] = row[5] + 1
        v[2] = row
    try:
        lockstep.open_trace(bad).verify()
        failures.append("verify accepted a changed row")
    except TraceError as e:
        check("layers.0.resid_out row 2" in str(e), f"verify names the row: {e}")
    # Without the plugin: one clear error saying what to do (a copy of the package, so that
    # the source checkout's build/hdf5-plugins is not found either).
    pkg = os.path.join(WORK, "pkg")
    shutil.copytree(os.path.join(SRC, "python", "lockstep"), os.path.join(pkg, "lockstep"))
    env = {k: v for k, v in os.environ.items() if k not in ("HDF5_PLUGIN_PATH", "LOCKSTEP_HDF5_PLUGIN_DIR")}
    p = subprocess.run([sys.executable, "-c", f"import lockstep; lockstep.open_trace({good!r})"], cwd=pkg, env=env,
                       capture_output=True, text=True)
    check(p.returncode != 0 and "TraceError" in p.stderr and "HDF5_PLUGIN_PATH" in p.stderr,
          f"without the plugin: {p.stderr[-300:]}")
    # … and found through plugin_path= alone.
    p = subprocess.run([sys.executable, "-c", f"import lockstep; print(len(lockstep.open_trace({good!r}, plugin_path={PLUGIN!r}).tensors))"],
                       cwd=pkg, env=env, capture_output=True, text=True)
    check(p.returncode == 0 and int(p.stdout) > 10, f"plugin_path=: {p.stderr[-300:]}")


def incomplete():
    """A recorder SIGKILLed mid-run: rows per tensor and tokens as lockstep's reader sees them
    (leading chunks, then the sidecar's tails), and every row still verifies."""
    out = os.path.join(WORK, "killed.h5")
    with open(out + ".jsonl", "w") as fp:
        for i in range(12):
            fp.write(json.dumps({"prompt_ids": [5, 6, i + 1]}) + "\n")
    p = subprocess.Popen([LOCKSTEP, "record", "-m", os.path.join(SRC, "models", "lockstep-tiny-v32"), "--prompts",
                          out + ".jsonl", "-n", "1000", "--ignore-eos", "--max-batch", "1", "--flush-interval", "0",
                          "-q", "-o", out])
    try:
        p.wait(timeout=1.5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    info = json.loads(run("inspect", "--json", out).stdout)
    t = lockstep.open_trace(out)
    check(t.complete == info["complete"], "killed: complete flag")
    if t.complete:
        print("killed: the recorder finished before the kill; the tail rule was not exercised")
    check(os.path.exists(out + ".tails") or t.complete, "killed: no sidecar")
    for x in info["tensors"]:
        check(t.tensors[x["path"]].rows == x["rows"], f"killed: {x['path']}: {t.tensors[x['path']].rows} rows, inspect {x['rows']}")
    for r, j in zip(t.requests, info["requests"]):
        check(list(r.generated) == j["generated"], f"killed: request {r.id} tokens")
    n = t.verify()
    check(n > 0, "killed: no rows")
    print(f"killed trace (complete={t.complete}): {n} rows verified, {sum(len(r.generated) for r in t.requests)} tokens")


incomplete()
fp32 = record("v3_fp32", "v3_basic")
bf16 = record("v2_bf16", "v2_lite_like", "--kv-cache", "bf16")
fp8 = record("v32_fp8", "v32_sparse", "--kv-cache", "fp8_e4m3")
for trace, fmt in ((fp32, "fp32"), (bf16, "bf16"), (fp8, "fp8_e4m3")):
    test_read(trace, fmt)
    test_write(trace)
    print(f"{trace}: read, verified and rewritten")
hostile(fp32)
if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("python reader/writer: all checks passed")
