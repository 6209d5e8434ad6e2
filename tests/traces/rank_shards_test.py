#!/usr/bin/env python3
"""tests/traces/rank_shards_test.py — CTest traces_rank_shards: traces whose rank-split taps lie
in per-rank shard files stitched by HDF5 virtual datasets (`record --emulate-tp N --rank-shards`,
docs/trace-format.md "Rank shards"), against the same run recorded in one file.

  * the sharded trace reads as one: `lockstep diff` with the one-file trace says identical; h5py
    reads every sharded tap's `values` (a virtual dataset) bit for bit the one-file trace's, each
    row's XXH3-64 the trace's summary hash; each shard opens in h5py alone (its columns); the
    Python package reads the same values; `export` writes the same rows; `verify` is clean;
  * a pack of it holds the values itself (no shard named) and diffs identical;
  * hostile or mixed-up files: a missing shard (the trace opens, with a note; values of a
    sharded tap fail naming the shard; others export), a shard of another run, shards swapped,
    a shard value changed (`inspect --verify`: the trace's whole-row hash), a shard row at
    another position,
    a /meta name with a folder part, the trace named as its own shard, a virtual mapping that
    reads another file than /meta names — each a one-line error naming the file and field,
    exit ≠ 0, never a crash or wrong rows; and the flag's refusals;
  * a recorder killed (SIGKILL) mid-run leaves a trace and shards that open and export.

usage: rank_shards_test.py LOCKSTEP PLUGIN_DIR WORK_DIR MODEL_DIR
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

L, PLUGIN, WORK, MODEL = sys.argv[1:5]
os.environ["HDF5_PLUGIN_PATH"] = PLUGIN
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import h5py  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402

import lockstep  # noqa: E402

shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(*args, ok=True):
    p = subprocess.run([L, *args], capture_output=True, text=True, timeout=300)
    if ok and p.returncode != 0:
        raise SystemExit(f"FAIL: lockstep {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


prompts = os.path.join(WORK, "prompts.jsonl")
with open(prompts, "w") as f:
    for r in range(3):
        f.write(json.dumps({"prompt_ids": [(7 * i + 13 * r + 3) % 6000 for i in range(10 + 3 * r)], "max_tokens": 6}) + "\n")
rec = ["record", "-m", MODEL, "--prompts", prompts, "-t", "0", "--ignore-eos", "--emulate-tp", "4", "-q"]
sharded, plain = os.path.join(WORK, "run.h5"), os.path.join(WORK, "plain.h5")
run(*rec, "--rank-shards", "-o", sharded)
run(*rec, "-o", plain)

# --- the sharded trace reads as one ------------------------------------------------------------
d = run("diff", plain, sharded)
check("identical" in d.stdout, f"diff plain vs sharded: {d.stdout.strip()[-200:]}")
fs, fp = h5py.File(sharded, "r"), h5py.File(plain, "r")
sharded_taps = [n for n in fs["taps"] if "shards" in fs["taps"][n].attrs]
want = {f"layers.{l}.{t}" for l in range(5) for t in ("attn.q", "attn.heads", "attn.partials", "ffn.partials")}
check(set(sharded_taps) == want, f"sharded taps {sorted(set(sharded_taps) ^ want)} differ from the rank-split ones")
for n in sharded_taps:
    g = fs["taps"][n]
    v = g["values"]
    a, b = v[...], fp["taps"][n]["values"][...]
    check(v.is_virtual and g.attrs["shards"] == 4 and g.attrs["has_values"] == 0, f"{n}: not a 4-shard virtual dataset")
    check(a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{n}: stitched values differ")
    hashes = g["summary"]["hash"]
    check(all(xxhash.xxh3_64_intdigest(r.tobytes()) == h for r, h in zip(a, hashes)), f"{n}: a row's hash is not the summary's")
for r in range(4):
    with h5py.File(sharded + f".rank{r}", "r") as sf:
        x = sf["taps/layers.1.attn.partials/values"][...]
        check(x.shape[1] == 256 and sf["meta"].attrs["shard_rank"].decode() == str(r), f"shard {r}: not rank {r}'s 256 columns")
        whole = fp["taps/layers.1.attn.partials/values"][...]
        check(np.array_equal(x, whole[:, r * 256:(r + 1) * 256]), f"shard {r}: not columns {r * 256}.. of the partials")
tp, tq = lockstep.open_trace(sharded), lockstep.open_trace(plain)
for n in ("layers.0.attn.q", "layers.4.ffn.partials"):
    for req in range(3):
        check(np.array_equal(tp.values(n, request=req), tq.values(n, request=req)), f"python package: {n} request {req}")
for n in ("layers.2.attn.heads", "layers.2.attn.out"):
    ea, eb = os.path.join(WORK, "a.npy"), os.path.join(WORK, "b.npy")
    run("export", sharded, "--request", "1", "--tap", n, "-o", ea)
    run("export", plain, "--request", "1", "--tap", n, "-o", eb)
    check(np.array_equal(np.load(ea), np.load(eb)), f"export {n}: rows differ")
v = run("verify", sharded, "-q", ok=False)
check(v.returncode == 0 and "clean" in v.stdout, f"verify on the sharded trace: exit {v.returncode}: {v.stdout[-300:]}")
pack = os.path.join(WORK, "pack.h5")
run("pack", sharded, "--request", "2", "-o", pack)
with h5py.File(pack, "r") as pf:
    check(not any(k.startswith("shard_") for k in pf["meta"].attrs), "the pack names shards")
    check(not pf["taps/layers.0.attn.q/values"].is_virtual, "the pack's values are virtual")
check(not os.path.exists(pack + ".rank0"), "the pack wrote shards")

# --- hostile and mixed-up files ----------------------------------------------------------------
def copy_set(name):
    d = os.path.join(WORK, name)
    os.makedirs(d)
    for f in os.listdir(WORK):
        if f.startswith("run.h5"):
            shutil.copy(os.path.join(WORK, f), d)
    return os.path.join(d, "run.h5")


def expect_error(trace, must, what, cmd=("inspect",)):
    p = run(*cmd, trace, ok=False)
    line = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    check(p.returncode not in (0, -11, -6) and all(m in line for m in must) and len(p.stderr.strip().splitlines()) <= 2,
          f"{what}: exit {p.returncode}, stderr {p.stderr.strip()[-300:]!r} (wanted {must})")


t = copy_set("missing")
os.remove(t + ".rank2")
p = run("inspect", t, ok=False)
check(p.returncode == 0 and "run.h5.rank2" in p.stdout + p.stderr, f"missing shard: inspect exit {p.returncode}, no note")
expect_error(t, ["run.h5.rank2", "missing"], "missing shard: export of a sharded tap",
             ("export", "--request", "0", "--tap", "layers.1.attn.q", "-o", os.path.join(WORK, "m.npy")))
check(run("export", t, "--request", "0", "--tap", "layers.1.attn.out", "-o", os.path.join(WORK, "m2.npy"),
          ok=False).returncode == 0, "missing shard: an unsharded tap no longer exports")
try:
    lockstep.open_trace(t).values("layers.1.attn.q", request=0)
    check(False, "missing shard: the Python package read values")
except lockstep.TraceError as e:
    check("shards" in str(e), f"missing shard: the Python package says {e}")

other_dir = os.path.join(WORK, "other")
os.makedirs(other_dir)
run(*rec, "--rank-shards", "-o", os.path.join(other_dir, "run.h5"))
t = copy_set("foreign")
shutil.copy(os.path.join(other_dir, "run.h5.rank1"), t + ".rank1")
expect_error(t, ["run.h5.rank1", "shard_run_id"], "a shard of another run")

t = copy_set("swapped")
os.rename(t + ".rank0", t + ".tmp")
os.rename(t + ".rank1", t + ".rank0")
os.rename(t + ".tmp", t + ".rank1")
expect_error(t, ["run.h5.rank0", "shard_rank"], "shards swapped")

for name, value, must in (("traversal", "../run.h5.rank0", ["shard_file_0", "not a file name"]),
                          ("itself", "run.h5", ["not a rank shard"]),
                          ("renamed", "copy.rank0", ["virtual mapping 0", "copy.rank0"])):
    t = copy_set(name)
    if name == "renamed":
        shutil.copy(t + ".rank0", os.path.join(os.path.dirname(t), "copy.rank0"))
    with h5py.File(t, "r+") as f:
        f["meta"].attrs["shard_file_0"] = np.bytes_(value)
    expect_error(t, must, f"/meta shard_file_0 = {value!r}")

# A shard's values changed after the fact: `inspect --verify` finds the row by the trace's own
# whole-row hash; a shard whose rows are not the trace's (request, position) is refused on read.
t = copy_set("tampered")
with h5py.File(t + ".rank1", "r+") as f:
    d = f["taps/layers.2.attn.q/values"]
    a = d[...]
    a[1, 3] += 1.0
    d[...] = a
p = run("inspect", t, "--verify", ok=False)
check(p.returncode != 0 and "layers.2.attn.q" in p.stderr and "content hash" in p.stderr,
      f"a shard's changed value: inspect --verify exit {p.returncode}: {p.stderr.strip()[-300:]}")
# … and every read of the stitched rows refuses it, not only --verify (export would hand it out).
expect_error(t, ["layers.2.attn.q", "content hash"], "a shard's changed value: export",
             ("export", "--request", "0", "--tap", "layers.2.attn.q", "-o", os.path.join(WORK, "t.npy")))
t = copy_set("misplaced")
with h5py.File(t + ".rank1", "r+") as f:
    s = f["taps/layers.3.ffn.partials/summary"]
    b = s[...]
    b["position"][0] += 1
    s[...] = b
expect_error(t, ["run.h5.rank1", "layers.3.ffn.partials", "position"], "a shard row at another position",
             ("export", "--request", "0", "--tap", "layers.3.ffn.partials", "-o", os.path.join(WORK, "p.npy")))

p = run("record", "-m", MODEL, "--prompt-ids", "1,2,3", "-n", "2", "--rank-shards", "-o", os.path.join(WORK, "x.h5"), "-q", ok=False)
check(p.returncode != 0 and "--rank-shards" in p.stderr and "--emulate-tp" in p.stderr, f"--rank-shards at TP 1: {p.stderr}")
p = run("record", "-m", MODEL, "--prompt-ids", "1,2,3", "-n", "2", "--emulate-tp", "2", "--capture", "summary",
        "--rank-shards", "-o", os.path.join(WORK, "x.h5"), "-q", ok=False)
check(p.returncode != 0 and "--capture full" in p.stderr, f"--rank-shards in summary capture: {p.stderr}")

# --- killed mid-run --------------------------------------------------------------------------
killed = os.path.join(WORK, "killed", "run.h5")
os.makedirs(os.path.dirname(killed))
proc = subprocess.Popen([L, "record", "-m", MODEL, "--prompt-ids", ",".join(str(i % 5000 + 7) for i in range(40)), "-n",
                         "2000", "--ignore-eos", "--emulate-tp", "4", "--rank-shards", "--flush-interval", "0", "-q",
                         "-o", killed], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.time() + 60
while time.time() < deadline and not os.path.exists(killed):
    time.sleep(0.1)
time.sleep(1.0)
proc.send_signal(signal.SIGKILL)
proc.wait()
p = run("inspect", killed, ok=False)
# (On a machine fast enough to finish before the kill the trace is complete: it must open all the same.)
check(p.returncode == 0 and ("incomplete" in p.stdout.lower() or "complete" in p.stdout),
      f"killed: inspect exit {p.returncode}: {p.stderr.strip()[-300:]}")
e = run("export", killed, "--request", "0", "--tap", "layers.3.attn.partials", "-o", os.path.join(WORK, "k.npy"), ok=False)
if e.returncode == 0:
    rows = np.load(os.path.join(WORK, "k.npy"))
    with h5py.File(killed, "r") as f:
        pass  # the trace opens in h5py too
    check(rows.shape[1] == 1024 and np.isfinite(rows).all(), f"killed: exported partials {rows.shape}")
else:
    check("shard" in e.stderr or "rows" in e.stderr, f"killed: export failed without naming why: {e.stderr.strip()}")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print(f"ok: {len(sharded_taps)} sharded taps read as one (diff, h5py, Python, export, verify, pack); "
      "missing, foreign, swapped, misnamed and self-referring shards refused by name; a killed run opens")
