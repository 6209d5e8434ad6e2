#!/usr/bin/env python3
"""tests/python/torch_recorder_test.py — lockstep.torch against lockstep's CPU reference (run by
torch_recorder_test.sh on a machine with torch and transformers: the GPU machine).

For each fixture model (V3, V3.2): load it with transformers in fp32, eager attention and eager
experts, record a greedy generate through lockstep.torch, replay the trace teacher-forced with
the lockstep binary on the CPU, and require
  * every recorded tap compared (nothing missing on either side, every row aligned) and within
    the fp32 parity bound of the parity tests: relative L2 ≤ 1e-4 per row (--rel-l2 1e-4);
  * the logits: no top-1 flip, KL ≤ 1e-6;
  * the replay's integer taps (router experts) equal as sets.
Then plant a bug — RoPE with the sine's sign flipped, in layer 1's attention only, by
monkeypatching transformers' rotary function at run time — record again, and require `diff`
(through the forced replay) to name layer 1 and the first tap after RoPE that a module
produces, attn.heads, as the first divergence, at a position > 0 (RoPE at position 0 is the
identity).

Usage: torch_recorder_test.py LOCKSTEP PLUGIN_DIR WORK_DIR SOURCE_DIR [MODEL ...]
"""
import json
import os
import subprocess
import sys

LOCKSTEP, PLUGIN, WORK, SRC = sys.argv[1:5]
MODELS = sys.argv[5:] or ["v3_basic", "v32_sparse"]
sys.path.insert(0, os.path.join(SRC, "python"))
os.environ["HDF5_PLUGIN_PATH"] = PLUGIN
os.makedirs(WORK, exist_ok=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import lockstep  # noqa: E402
import lockstep.torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (parity bound below)
torch.backends.cudnn.allow_tf32 = False
# The zstd plugin is built against the build machine's HDF5; h5py here may carry its own. Try it in
# a child first (a crash there costs nothing); without it the traces are written uncompressed.
probe = subprocess.run([sys.executable, "-c", "import sys, numpy as np; sys.path.insert(0, sys.argv[1]); import lockstep; "
                        "w = lockstep.TraceWriter(sys.argv[2]); w.add_request(0, [1]); w.finish_request(0, [2]); "
                        "w.append_sampling(0, 2, 0, 0); w.append_step(0, [0], 1); w.close(); "
                        "print(len(lockstep.open_trace(sys.argv[2]).tensors))", os.path.join(SRC, "python"),
                        os.path.join(WORK, "probe.h5")], capture_output=True, text=True)
COMPRESS = probe.returncode == 0
print(f"zstd plugin through h5py: {'works' if COMPRESS else 'unavailable, traces uncompressed: ' + probe.stderr[-300:]}",
      flush=True)
DEVICE = os.environ.get("LOCKSTEP_TORCH_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
failures = []


def check(cond, what):
    print(("ok: " if cond else "FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


def load(model_dir):
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", **kw)
    except (TypeError, ValueError) as e:
        print(f"from_pretrained(experts_implementation='eager') refused ({e}); loading with the default", flush=True)
        m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    return m.to(DEVICE).eval()


def prompt_of(model_dir, n=12):
    raw = open(os.path.join(model_dir, "reference.safetensors"), "rb").read()
    h = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + h])
    a, b = head["prompt_ids"]["data_offsets"]
    return [int(x) for x in np.frombuffer(raw[8 + h + a:8 + h + b], dtype="<i8")[:n]]


def record(model, model_dir, out, prompts, n):
    rec = lockstep.torch.Recorder(model, model_dir, out, compress=COMPRESS)
    gens = [rec.generate(p, max_new_tokens=n) for p in prompts]
    rec.close()
    return gens, rec


def replay(trace):
    out = trace.replace(".h5", ".replay.h5")
    p = subprocess.run([LOCKSTEP, "replay", trace, "--mode", "forced", "--rel-l2", "1e-4", "--kl", "1e-6", "-o", out,
                        "--json"], capture_output=True, text=True)
    if p.returncode not in (0, 3):
        raise SystemExit(f"replay {trace}: exit {p.returncode}: {p.stderr[-600:]}")
    return json.loads(p.stdout), p.returncode  # a forced replay exits 0 whatever it finds


class PlantedRope:
    """Flips the sign of RoPE's sine in one layer's attention: the rotary functions of the model's
    modeling module are wrapped, and a pre-hook / hook on that layer's self_attn turn it on and off."""

    def __init__(self, model, layer):
        self.mod = sys.modules[type(model).__module__]
        self.on = False
        self.saved = {}
        for name in dir(self.mod):
            if name.startswith("apply_rotary_pos_emb"):
                fn = getattr(self.mod, name)
                self.saved[name] = fn
                setattr(self.mod, name, self._wrap(fn))
        attn = model.model.layers[layer].self_attn
        self.h = [attn.register_forward_pre_hook(lambda *_: setattr(self, "on", True)),
                  attn.register_forward_hook(lambda *_: setattr(self, "on", False))]
        # The V3.2 indexer may call the same functions from inside the attention: it is wrong there too.

    calls = 0

    def _wrap(self, fn):
        def wrapped(q, k, cos, sin, *a, **kw):
            if self.on:
                self.calls += 1
                sin = -sin
            return fn(q, k, cos, sin, *a, **kw)
        return wrapped

    def remove(self):
        for name, fn in self.saved.items():
            setattr(self.mod, name, fn)
        for h in self.h:
            h.remove()


def test_model(name):
    model_dir = os.path.join(SRC, "tests", "fixtures", "models", name)
    model = load(model_dir)
    p0 = prompt_of(model_dir)
    prompts = [p0, p0[3:9]]
    trace = os.path.join(WORK, f"{name}.h5")
    gens, rec = record(model, model_dir, trace, prompts, 8)
    t = lockstep.open_trace(trace)
    check(t.verify() > 0 and len(t.requests) == 2, f"{name}: trace written and verified ({len(t.tensors)} tensors)")
    rep, rc = replay(trace)
    taps = sorted(x["tensor"] for x in rep["tensors"])
    worst = max((x["worst_rel_l2"] or 0.0) for x in rep["tensors"] if not x["integer"] and "logits" not in x["tensor"])
    worst_t = max((x for x in rep["tensors"] if not x["integer"] and "logits" not in x["tensor"]),
                  key=lambda x: x["worst_rel_l2"] or 0.0)
    print(f"{name}: {len(taps)} tensors compared; worst rel L2 {worst:.3g} in {worst_t['tensor']}; "
          f"logits {rep.get('logit_summary')}", flush=True)
    check(not rep["missing"] and not rep["only_in_a"] and not rep["only_in_b"],
          f"{name}: every tap on both sides ({rep['missing'][:3]})")
    check(all(x["not_aligned_rows"] == 0 for x in rep["tensors"]), f"{name}: every row aligned")
    check(rep["first_divergence"] is None, f"{name}: no tap above 1e-4 rel L2 "
          f"(first: {rep['first_divergence'] and rep['first_divergence']['tensor']})")
    check(worst <= 1e-4, f"{name}: worst rel L2 {worst:.3g} ≤ 1e-4")
    rows = sum(x["rows"] for x in rep["tensors"])
    want = sum(tt.rows for tt in t.tensors.values())
    check(rows == want, f"{name}: {rows} rows compared, the recording holds {want}")
    ls = rep.get("logit_summary") or {}
    check(ls.get("top1_flips") == 0 and (ls.get("max_kl") or 0) <= 1e-6, f"{name}: logits agree ({ls.get('max_kl')})")
    # The planted bug.
    bug = PlantedRope(model, layer=1)
    btrace = os.path.join(WORK, f"{name}.rope-bug.h5")
    record(model, model_dir, btrace, prompts[:1], 6)
    bug.remove()
    brep, brc = replay(btrace)
    f = brep["first_divergence"]
    print(f"{name} with RoPE broken in layer 1: first divergence {f and (f['tensor'], f['layer'], f['position'], f['how'])}",
          flush=True)
    check(bug.calls > 0, f"{name}: the planted RoPE ran ({bug.calls} calls of {sorted(bug.saved)} in layer 1)")
    check(f is not None and f["layer"] == 1 and f["tensor"].endswith("layers.1.attn.heads")
          and f["position"] > 0, f"{name}: diff names layer 1, attn.heads")


for name in MODELS:
    try:
        test_model(name)
    except Exception:  # one model's crash must not hide the other's results
        import traceback
        traceback.print_exc()
        failures.append(f"{name}: raised")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("lockstep.torch: all checks passed")
