"""lockstep/torch.py — records a transformers DeepSeek model (DeepseekV2/V3/V32/V4ForCausalLM)
into a lockstep trace, so that

    lockstep replay recorded.h5 --mode forced

runs lockstep's reference teacher-forced on the same tokens and `diff` names the first layer
and tap where transformers and the reference part.

    import lockstep.torch
    rec = lockstep.torch.Recorder(model, "tests/fixtures/models/v3_basic", "hf.h5")
    out = rec.generate(prompt_ids, max_new_tokens=16)      # model.generate, greedy, batch 1
    rec.close()

Each tap is the output (or input) of one module, by forward hooks (docs/tap-points.md has the
table and defines the taps):

  embed                         model.embed_tokens output
  layers.L.attn_norm            layers[L].input_layernorm output
  layers.L.attn.latent          layers[L].self_attn.kv_a_layernorm output (V2–V3.2: c_kv normalised)
  layers.L.attn.heads           layers[L].self_attn.o_proj input (V4: o_a_proj's, the groups flattened)
  layers.L.attn.out             layers[L].self_attn.o_proj output (V4: o_b_proj's)
  layers.L.resid_mid            layers[L].post_attention_layernorm input (V2–V3.2)
  layers.L.hc.streams_mid       layers[L].ffn_hc input (V4: the hc streams between the blocks)
  layers.L.ffn_norm             layers[L].post_attention_layernorm output
  layers.L.ffn.router.topk_ids  layers[L].mlp.gate output's indices, ascending (V4 hash layers:
                                the tid2eid picks)
  layers.L.ffn.router.topk_weights  … and their weights, in that order
  layers.L.ffn.out              layers[L].mlp output
  layers.L.resid_out            layers[L] output (V2–V3.2)
  layers.L.hc.streams           layers[L] output (V4: hc·H, stream-major)
  final_norm                    model.norm output
  logits                        lm_head output, the last position of each forward (full, or
                                top-k + logsumexp for vocabularies > 4096)

attn.q, attn.k_rope, indexer.topk and V4's attn.kv, attn_hc.mix/ffn_hc.mix (the HC module
consumes `pre` itself) and attn.sink_share are computed inside a module's forward, not by a
module of their own, so they are not recorded (a bug in RoPE or the sink shows first in
attn.heads). Values are stored as float32 whatever the model's dtype. Positions: the prompt's
at the prefill forward, then one a decode step. One request a generate call (batch 1); several
calls make requests 0, 1, …. The trace's meta carries the checkpoint folder's fingerprint, so
`lockstep replay -m` accepts it, and meta.source = "transformers <version>".
"""
import json
import math
import re

import numpy as np
import torch

from .model import capture_policy, engine_options, model_meta
from .writer import TraceWriter

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return getattr(x, "last_hidden_state", None)


class Recorder:
    def __init__(self, model, model_dir, output, logits="auto", topk=32, zstd_level=3, plugin_path=None,
                 compress=True):
        self.model = model
        self.meta, self.cfg = model_meta(model_dir)
        V = int(self.cfg["vocab_size"])
        self.full_logits = logits == "full" or (logits == "auto" and V <= 4096)
        self.topk = int(topk)
        self.w = TraceWriter(output, zstd_level=zstd_level, writer="lockstep-python 0.1.0 lockstep.torch",
                             batch_width=1, plugin_path=plugin_path, compress=compress)
        self.request = -1
        self.step = -1        # this forward's step (one a forward of the base model, across requests)
        self.pos = 0          # position of this forward's first token
        self.rows = 0         # this forward's token count
        self.next_pos = 0     # where the next forward starts
        self.active = False   # inside generate(): forwards outside it are not recorded
        self.handles = []
        self.defined = set()
        self.taps = []
        self._attach()

    # -- hooks ------------------------------------------------------------------------------
    def _attach(self):
        m = self.model
        base = m.model if hasattr(m, "model") else m
        # The base model's pre-hook opens a forward; the lm_head hook runs after the base model
        # returned, so a forward's position and step stay set until the next one begins.
        self.handles.append(base.register_forward_pre_hook(self._begin, with_kwargs=True))
        self._out(base.embed_tokens, "embed")
        self._out(base.norm, "final_norm")
        for name, mod in base.named_modules():
            mm = _LAYER.search(name)
            if not mm:
                continue
            L = int(mm.group(1))
            p = f"layers.{L}."
            attn = mod.self_attn
            self._out(mod.input_layernorm, p + "attn_norm")
            self._out(mod.post_attention_layernorm, p + "ffn_norm")
            self._out(mod.mlp, p + "ffn.out")
            if hasattr(mod, "attn_hc"):  # DeepSeek-V4: hyper-connection streams, grouped output projection
                self._out(mod, p + "hc.streams")
                self._in(mod.ffn_hc, p + "hc.streams_mid")
                self._in(attn.o_a_proj, p + "attn.heads")
                self._out(attn.o_b_proj, p + "attn.out")
            else:
                self._out(mod, p + "resid_out")
                if hasattr(attn, "kv_a_layernorm"):
                    self._out(attn.kv_a_layernorm, p + "attn.latent")
                self._in(attn.o_proj, p + "attn.heads")
                self._out(attn.o_proj, p + "attn.out")
                self._in(mod.post_attention_layernorm, p + "resid_mid")
            gate = getattr(mod.mlp, "gate", None)
            if gate is not None and not isinstance(gate, torch.nn.Linear):
                self.handles.append(gate.register_forward_hook(self._router(p)))
                self.taps += [p + "ffn.router.topk_ids", p + "ffn.router.topk_weights"]
        lm = m.lm_head
        self.handles.append(lm.register_forward_hook(self._logits))
        self.taps.append("logits")

    def _out(self, mod, tap):
        self.taps.append(tap)
        self.handles.append(mod.register_forward_hook(lambda _m, _i, out: self._emit(tap, _first_tensor(out))))

    def _in(self, mod, tap):
        self.taps.append(tap)
        self.handles.append(mod.register_forward_pre_hook(lambda _m, inp: self._emit(tap, _first_tensor(inp))))

    def _begin(self, _mod, args, kwargs):
        if not self.active:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        x = ids if ids is not None else emb
        if x is None or x.shape[0] != 1:
            raise ValueError("lockstep.torch records batch 1 (one request a generate call)")
        self.rows = int(x.shape[1])
        self.pos = self.next_pos
        self.next_pos += self.rows
        self.step += 1
        self.w.append_step(self.step, [self.request], tokens=self.rows)

    def _positions(self, n):
        return np.arange(self.pos + self.rows - n, self.pos + self.rows, dtype=np.int64)  # the last n of this forward

    def _define(self, tap, dtype, cols):
        path = "taps/" + tap
        if path not in self.defined:
            attrs = {"of": "logits"} if tap.startswith("logits.") else {}
            self.w.define_tensor(path, dtype, cols, attrs=attrs)
            self.defined.add(path)
        return path

    def _emit(self, tap, t):
        if t is None or not self.active:
            return
        # [B, S, ...] → one row a token ([B, S, hc, H] streams and [B, S, G, nh·d/G] groups flatten
        # in order); a tensor already flat ([N, C]) stays as it is.
        t = t.detach()
        x = (t.reshape(t.shape[0] * t.shape[1], -1) if t.dim() >= 3 else t.reshape(-1, t.shape[-1]))
        x = x.to(torch.float32).cpu().numpy()
        x = x[-self.rows:]  # the current forward's tokens (batch 1)
        path = self._define(tap, "f32", x.shape[1])
        self.w.append(path, x, self.request, self._positions(len(x)), self.step)

    def _router(self, p):
        def hook(_m, _i, out):
            if not self.active:
                return
            outs = out if isinstance(out, (tuple, list)) else (out,)
            ids = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()]
            k = ids[0].shape[-1] if ids else 0
            wts = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point() and o.shape[-1] == k]
            if not ids or not wts:
                return
            i = ids[0].detach().reshape(-1, k).cpu().numpy().astype(np.int32)
            w = wts[-1].detach().reshape(-1, k).to(torch.float32).cpu().numpy()
            order = np.argsort(i, axis=1, kind="stable")  # lockstep keeps the experts in ascending id
            i, w = np.take_along_axis(i, order, 1)[-self.rows:], np.take_along_axis(w, order, 1)[-self.rows:]
            pos = self._positions(len(i))
            self.w.append(self._define(p + "ffn.router.topk_ids", "i32", k), i, self.request, pos, self.step)
            self.w.append(self._define(p + "ffn.router.topk_weights", "f32", k), w, self.request, pos, self.step)
        return hook

    def _logits(self, _m, _i, out):
        if not self.active:
            return
        row = out.detach()[0, -1].to(torch.float32).cpu().numpy()[None, :]  # the last position's
        self.last_logits = row[0].astype(np.float64)
        pos = np.array([self.pos + self.rows - 1])
        if self.full_logits:
            self.w.append(self._define("logits", "f32", row.shape[1]), row, self.request, pos, self.step)
            return
        v = row[0]
        order = np.lexsort((np.arange(len(v)), -v))[:self.topk]  # descending, ties to the lower id
        m = float(np.max(v))
        lse = np.float32(m + math.log(float(np.exp(v.astype(np.float64) - m).sum())))
        self.w.append(self._define("logits.topk_ids", "i32", self.topk), order.astype(np.int32)[None], self.request,
                      pos, self.step)
        self.w.append(self._define("logits.topk_values", "f32", self.topk), v[order][None], self.request, pos,
                      self.step)
        self.w.append(self._define("logits.logsumexp", "f32", 1), np.array([[lse]], np.float32), self.request, pos,
                      self.step)

    # -- a request --------------------------------------------------------------------------
    def generate(self, prompt_ids, max_new_tokens=16, **kwargs):
        """model.generate on one prompt, greedy unless told otherwise; records it as the next
        request and returns the generated ids."""
        self.request += 1
        rid = self.request
        self.next_pos = 0
        first_step = self.step + 1  # steps count on across requests, one a forward
        ids = torch.as_tensor([list(prompt_ids)], dtype=torch.long, device=self.model.device)
        kwargs.setdefault("do_sample", False)
        self.active = True
        try:
            with torch.no_grad():
                out = self.model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, **kwargs)
        finally:
            self.active = False
        gen = [int(t) for t in out[0, ids.shape[1]:]]
        temp = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
        self.w.add_request(rid, list(prompt_ids), max_new_tokens=max_new_tokens, temperature=temp,
                           top_p=float(kwargs.get("top_p", 1.0)) if kwargs.get("do_sample") else 1.0,
                           top_k=int(kwargs.get("top_k", 0) or 0) if kwargs.get("do_sample") else 0)
        for i, t in enumerate(gen):  # token i was chosen from the logits of forward first_step + i
            self.w.append_sampling(rid, t, i, first_step + i, temperature=temp,
                                   finished=1 if i == len(gen) - 1 else 0)
        self.w.finish_request(rid, gen, "", "length")
        return gen

    def close(self):
        import transformers
        for h in self.handles:
            h.remove()
        self.handles = []
        for k, v in self.meta.items():
            self.w.set_meta(k, v)
        self.w.set_meta("source", f"transformers {transformers.__version__} (lockstep.torch), "
                        f"{type(self.model).__name__}, {next(self.model.parameters()).dtype}")
        self.w.set_meta("capture_policy", capture_policy(sorted(set(self.taps)), "full" if self.full_logits else "topk",
                                                         self.topk, kv=False))
        self.w.set_meta("engine_options", engine_options(max_batch=1))
        self.w.set_meta("backend", "transformers")
        self.w.set_meta("kv_cache_format", "transformers")
        self.w.close()
