#!/usr/bin/env python3
"""tests/python/torch_recorder_test.py — lockstep.torch against lockstep's CPU reference (run by
torch_recorder_test.sh on a machine with torch and transformers: the GPU machine).

For each fixture model (V3, V3.2, V4): load it with transformers in fp32, eager attention and
eager experts, record a greedy generate through lockstep.torch, replay the trace teacher-forced
with the lockstep binary on the CPU, and require
  * every recorded tap compared (nothing missing on either side, every row aligned) and within
    the fp32 parity bound of the parity tests: relative L2 ≤ 1e-4 per row (--rel-l2 1e-4);
  * the logits: no top-1 flip, KL ≤ 1e-6;
  * the replay's integer taps (router experts) equal as sets.
Then plant bugs into transformers' modules at run time, record again, and require `diff`
(through the forced replay) to name the layer and the first recorded tap the bug reaches:
  * V3/V3.2: RoPE with the sine's sign flipped in layer 1's attention (the rotary function of
    the modeling module wrapped) → layer 1, attn.heads, at a position > 0 (RoPE at 0 is the
    identity);
  * V4: layer 1's attention sinks dropped (set to −∞: the softmax without its sink) → layer 1,
    attn.heads;
  * every model: one expert's down projection scaled by 1.05 in the first MoE layer (the expert
    the clean run routed to most) → that layer, ffn.out, at a position that routed to it.
Then the same models in bf16 (V3 with bf16 weights; V4 under autocast, see test_bf16): every row
aligned, nothing missing, every float tap off the fp32 reference by a bf16-sized amount (worst
rel L2 above 2^-12: it did run in bf16; at most 2^-4 unless a routing decision flipped), the
logits within KL 0.01, and no first divergence at --rel-l2 2^-4 but a logits row or a routing
flip (bf16's discrete effects), never an activation tap (what a misaligned tap would give).

Usage: torch_recorder_test.py LOCKSTEP PLUGIN_DIR WORK_DIR SOURCE_DIR [MODEL ...]
"""
import json
import os
import subprocess
import sys

LOCKSTEP, PLUGIN, WORK, SRC = sys.argv[1:5]
MODELS = sys.argv[5:] or ["v3_basic", "v32_sparse", "v4_mixed", "v4_topk_select"]
BF16_MODELS = ["v3_basic", "v4_mixed"]
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


def fixture_dir(name):
    for sub in ("models", "models_v4"):
        d = os.path.join(SRC, "tests", "fixtures", sub, name)
        if os.path.isdir(d):
            return d
    raise SystemExit(f"no fixture model {name}")


def load(model_dir, dtype=torch.float32):
    kw = dict(dtype=dtype, attn_implementation="eager")
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


def replay(trace, rel_l2="1e-4", kl="1e-6"):
    out = trace.replace(".h5", ".replay.h5")
    p = subprocess.run([LOCKSTEP, "replay", trace, "--mode", "forced", "--rel-l2", rel_l2, "--kl", kl, "-o", out,
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


class DroppedSink:
    """Layer L's attention sinks set to −∞ (each head's softmax without its sink), restored by remove()."""

    def __init__(self, model, layer):
        self.p = model.model.layers[layer].self_attn.sinks
        self.saved = self.p.detach().clone()
        with torch.no_grad():
            self.p.fill_(float("-inf"))

    def remove(self):
        with torch.no_grad():
            self.p.copy_(self.saved)


class WrongExpert:
    """One routed expert's down projection scaled by 1.05 in one layer (fused [E, D, I] experts or
    a ModuleList of MLPs), restored by remove()."""

    def __init__(self, model, layer, expert):
        ex = model.model.layers[layer].mlp.experts
        w = ex.down_proj if isinstance(getattr(ex, "down_proj", None), torch.nn.Parameter) else None
        self.p = w if w is not None else ex[expert].down_proj.weight
        self.sl = (expert,) if w is not None else (slice(None),)
        self.saved = self.p.detach()[self.sl].clone()
        with torch.no_grad():
            self.p[self.sl] *= 1.05

    def remove(self):
        with torch.no_grad():
            self.p[self.sl] = self.saved


def first_moe_layer(model):
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            return i
    return None


def named(rep, layer, tap):
    f = rep["first_divergence"]
    return f is not None and f["layer"] == layer and f["tensor"].endswith(f"layers.{layer}.{tap}"), f


def test_model(name):
    model_dir = fixture_dir(name)
    model = load(model_dir)
    v4 = hasattr(model.model.layers[0], "attn_hc")
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
    # The planted bugs.
    if v4:
        bug = DroppedSink(model, layer=1)
        btrace = os.path.join(WORK, f"{name}.sink-bug.h5")
        record(model, model_dir, btrace, prompts[:1], 6)
        bug.remove()
        brep, _ = replay(btrace)
        ok, f = named(brep, 1, "attn.heads")
        print(f"{name} with layer 1's sinks dropped: first divergence "
              f"{f and (f['tensor'], f['layer'], f['position'], f['how'])}", flush=True)
        check(ok, f"{name}: diff names layer 1, attn.heads (sinks dropped)")
    else:
        bug = PlantedRope(model, layer=1)
        btrace = os.path.join(WORK, f"{name}.rope-bug.h5")
        record(model, model_dir, btrace, prompts[:1], 6)
        bug.remove()
        brep, brc = replay(btrace)
        f = brep["first_divergence"]
        print(f"{name} with RoPE broken in layer 1: first divergence "
              f"{f and (f['tensor'], f['layer'], f['position'], f['how'])}", flush=True)
        check(bug.calls > 0, f"{name}: the planted RoPE ran ({bug.calls} calls of {sorted(bug.saved)} in layer 1)")
        check(f is not None and f["layer"] == 1 and f["tensor"].endswith("layers.1.attn.heads")
              and f["position"] > 0, f"{name}: diff names layer 1, attn.heads")
    L = first_moe_layer(model)
    if L is not None:
        ids = t.values(f"layers.{L}.ffn.router.topk_ids", request=0)
        pos = t.positions(f"layers.{L}.ffn.router.topk_ids", 0)
        e = int(np.bincount(ids.reshape(-1)).argmax())
        bug = WrongExpert(model, L, e)
        btrace = os.path.join(WORK, f"{name}.expert-bug.h5")
        record(model, model_dir, btrace, prompts[:1], 6)
        bug.remove()
        brep, _ = replay(btrace)
        ok, f = named(brep, L, "ffn.out")
        routed = {int(p) for p, row in zip(pos, ids) if e in row}
        print(f"{name} with expert {e}'s down_proj ×1.05 in layer {L} (routed at {len(routed)} positions): first "
              f"divergence {f and (f['tensor'], f['layer'], f['position'], f['how'])}", flush=True)
        check(ok and f["position"] in routed, f"{name}: diff names layer {L}, ffn.out, at a position routed to "
              f"expert {e}")
    if name in BF16_MODELS:
        test_bf16(name, model_dir, prompts)


def test_bf16(name, model_dir, prompts):
    # V4: transformers 5.17's DeepseekV4 loaded in bf16 stops in its first forward (a Linear
    # given a float32 input: "expected mat1 and mat2 to have the same dtype"), so it runs as its
    # fp32 weights under torch.autocast(bfloat16) — the products in bf16 as a bf16 deployment's.
    v4 = name.startswith("v4_")
    model = load(model_dir, torch.float32 if v4 else torch.bfloat16)
    trace = os.path.join(WORK, f"{name}.bf16.h5")
    how = "fp32 weights under autocast(bfloat16)" if v4 else "bf16 weights"
    if v4:
        with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
            record(model, model_dir, trace, prompts, 8)
    else:
        record(model, model_dir, trace, prompts, 8)
    bound = 2.0 ** -4
    rep, _ = replay(trace, rel_l2=repr(bound), kl="1e-2")
    floats = [x for x in rep["tensors"] if not x["integer"] and "logits" not in x["tensor"]]
    lo = min(floats, key=lambda x: x["worst_rel_l2"] or 0.0)
    hi = max(floats, key=lambda x: x["worst_rel_l2"] or 0.0)
    flips = [x["tensor"] for x in rep["tensors"] if x["integer"] and x.get("max_set_diff", 0) > 0]
    ls = rep.get("logit_summary") or {}
    print(f"{name} bf16 ({how}): {len(floats)} float taps, worst rel L2 from {lo['worst_rel_l2']:.3g} ({lo['tensor']}) "
          f"to {hi['worst_rel_l2']:.3g} ({hi['tensor']}); routing flips in {flips}; logits max KL {ls.get('max_kl')}, "
          f"top-1 flips {ls.get('top1_flips')} of {ls.get('rows')}", flush=True)
    for x in rep["tensors"]:
        print(f"  {x['tensor']}: rows {x['rows']}, worst rel L2 {x['worst_rel_l2']}", flush=True)
    check(not rep["missing"] and not rep["only_in_a"] and not rep["only_in_b"], f"{name} bf16: every tap on both sides")
    check(all(x["not_aligned_rows"] == 0 for x in rep["tensors"]), f"{name} bf16: every row aligned")
    # bf16 weights round every tap from the embedding on; autocast rounds only the products, so
    # there the taps computed by a product (attention's, the FFN's and all after them) moved.
    moved = floats if not v4 else [x for x in floats if x["tensor"].endswith(("attn.heads", "attn.out", "ffn.out",
                                                                               "final_norm", "hc.streams"))]
    lo = min(moved, key=lambda x: x["worst_rel_l2"] or 0.0)
    check((lo["worst_rel_l2"] or 0.0) > 2.0 ** -12, f"{name} bf16: every {'product ' if v4 else ''}tap moved by "
          f"bf16 (least {lo['worst_rel_l2']:.3g} in {lo['tensor']} > 2^-12, of {len(moved)})")
    # A flipped discrete choice (an expert, the most likely token) is bf16's real effect and moves
    # what follows it by O(1); a misaligned tap would move an activation tap with no flip before it.
    if not flips:
        check((hi["worst_rel_l2"] or 0.0) <= bound, f"{name} bf16: every activation tap within 2^-4 "
              f"(worst {hi['worst_rel_l2']:.3g} in {hi['tensor']})")
    check((ls.get("max_kl") or 0.0) <= 1e-2, f"{name} bf16: logits within a bf16-sized KL ({ls.get('max_kl')} ≤ 0.01)")
    f = rep["first_divergence"]
    check(f is None or "logits" in f["tensor"] or "router.topk_ids" in f["tensor"],
          f"{name} bf16: the first divergence above 2^-4 is none, a logits row or a routing flip "
          f"({f and (f['tensor'], f['position'], f['how'])})")


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
