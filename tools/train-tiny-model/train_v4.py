#!/usr/bin/env python3
"""Train lockstep-tiny-v4: a tiny DeepSeek-V4-architecture model (hyper-connections, sliding /
CSA / HCA attention with sinks, lightning indexer over compressed rows, grouped output
projection, hash-routed and sqrt-softplus top-k MoE with clamped SwiGLU) on the corpus that
build_corpus.py writes, with the 6,144-token tokenizer of lockstep-tiny-v32.

Runs on a machine with one CUDA GPU, torch and transformers 5.17 (DeepseekV4ForCausalLM):

    python3 tools/train-tiny-model/train_v4.py --out OUTDIR [--smoke] [--deadline 560]

Phases (each prints what it produced):
  1. corpus: encodes it as <bos> doc <eos> ... with models/lockstep-tiny-v32/tokenizer.json
     (reused, not retrained; train.py's loader and encoder);
  2. model: a transformers DeepseekV4ForCausalLM built from MODEL_CONFIG; hash layers get a
     frequency-balanced tid2eid table;
  3. training with a forward of its own that calls the transformers modules (hyper-connections,
     norms, rotary, the CSA/HCA compressors, shared experts) and does the same math for the
     rest (attention with sinks, MoE dispatch evaluated densely); checked against transformers'
     own forward in phase 5:
       stage 1 (dense):  CSA layers attend to every causally visible compressed row;
       stage 2 (sparse): CSA layers attend to the indexer's top-k rows (as transformers does);
     in both stages the indexer learns by KL distillation from the main attention's
     distribution over the compressed rows (heads summed, L1-normalised, detached), its
     inputs detached from the LM graph; the routers' e_score_correction_bias gets the
     aux-loss-free balancing update; training stops by wall clock;
  4. writes config.json (transformers' serialisation, default dtype float32 because transformers
     5.17 does not run this model in bf16), model.safetensors (bf16; the modules
     transformers keeps in fp32 are stored fp32; tid2eid int64), tokenizer files,
     generation_config.json (DeepSeek-V4's recommended sampling: temperature 1.0, top_p 1.0);
  5. reloads with DeepseekV4ForCausalLM.from_pretrained (missing/unexpected keys must be
     empty) and compares its logits with the training forward (fp32, TF32 off);
  6. reference for the C++ engine: fp32 CPU greedy decode of 128 tokens from two prompts
     -> tiny_v4_reference.json (ids, margins, top logits of the first 16 steps);
  7. held-out loss per kind on 1024-token windows, for this model (as shipped, and with
     dense attention over the compressed rows) and for lockstep-tiny-v32 on the same
     windows; the share of the dense compressed-row attention that the indexer's top-k keeps;
     samples at temperature 0, 0.6 and 1.0; the degeneration study (48 prompts x 256 tokens
     at temperature 0, 0.6, 1.0, and the HTML Counter prompt);
  8. results.json with all numbers and the training curve.
--smoke runs every phase on a few documents and steps and exits non-zero when the reload,
the forward check or any later phase fails.  All seeds are fixed.
"""
import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tarfile
import time

T0 = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np
import torch
import torch.nn.functional as F

import train as v32  # corpus loading and encoding, prompts, special tokens, degeneration detector

BOS, EOS = v32.BOS, v32.EOS
HTML_PROMPT, EN_PROMPT = v32.HTML_PROMPT, v32.EN_PROMPT
MODEL_NAME = "lockstep-tiny-v4"
V32_DIR = os.path.join(REPO, "models", "lockstep-tiny-v32")

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
MODEL_CONFIG = {
    "vocab_size": 6144,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "layer_types": [SLIDING, CSA, HCA, SLIDING, CSA, HCA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 16},
    "sliding_window": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "partial_rotary_factor": 0.125,  # 64 rope dims of 512, as V4-Flash
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 32,
    "moe_intermediate_size": 96,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
# transformers 5.17's DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict: stored fp32 in the file
FP32_MODULES = {"attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias",
                "q_a_norm", "kv_norm", "input_layernorm", "post_attention_layernorm", "norm"}


def keep_fp32(name):
    return bool(FP32_MODULES & set(name.split(".")))


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def left():
    return ARGS.deadline - (time.time() - T0)


class SmokeFailure(Exception):
    pass


# ----------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------
def build_config():
    from transformers import DeepseekV4Config
    c = DeepseekV4Config(**MODEL_CONFIG, bos_token_id=BOS, eos_token_id=EOS)
    c._attn_implementation = "eager"
    return c


def build_tid2eid(freq, n_experts, k, seed):
    """Hash routing table [V, k]: tokens in order of falling train frequency each go to the k
    least-loaded experts (distinct), so the static routes are balanced by token count."""
    rng = np.random.default_rng(seed)
    V = len(freq)
    load = np.zeros(n_experts)
    table = np.zeros((V, k), dtype=np.int64)
    for t in np.argsort(-freq, kind="stable"):
        pick = np.argsort(load + rng.random(n_experts) * 1e-3, kind="stable")[:k]
        table[t] = pick
        load[pick] += freq[t] + 1.0
    return torch.from_numpy(table), load


def build_model(freq):
    from transformers import DeepseekV4ForCausalLM
    config = build_config()
    torch.manual_seed(ARGS.seed)
    model = DeepseekV4ForCausalLM(config)
    g = torch.Generator().manual_seed(ARGS.seed + 1)
    hash_loads = []
    with torch.no_grad():
        # transformers' init leaves the hc biases at 0; small noise breaks the symmetry of the
        # 4 identical streams a little earlier (sinks and position biases start at 0 and learn)
        for li, layer in enumerate(model.model.layers):
            for hc in (layer.attn_hc, layer.ffn_hc):
                hc.base.copy_(torch.randn(hc.base.shape, generator=g) * 0.1)
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                t, ld = build_tid2eid(freq, config.n_routed_experts, config.num_experts_per_tok, ARGS.seed + 100 + li)
                gate.tid2eid.copy_(t)
                hash_loads.append((ld / ld.mean()).round(3).tolist())
        model.model.hc_head.hc_base.copy_(torch.randn(model.model.hc_head.hc_base.shape, generator=g) * 0.1)
    return model, hash_loads


def randomize_for_check_(model, seed):
    """Smoke only: move the parameters transformers initialises to constants away from them,
    so that the forward check exercises sinks, position biases, hc biases, norms and routing bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in n:
                continue
            last = n.split(".")[-1]
            if last in ("sinks",):
                p.copy_(torch.randn(p.shape, generator=g))
            elif last in ("position_bias", "base", "hc_base"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif last in ("scale", "hc_scale"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
            elif last == "e_score_correction_bias":
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)


# ----------------------------------------------------------------------------------------
# training forward: transformers' modules where they can be called as they are, the same
# math as transformers 5.17's DeepseekV4 forward for the rest (checked in phase 5)
# ----------------------------------------------------------------------------------------
class Capture:
    on = False
    out = None


CAP = Capture()


def _scorer_hook(mod, inp, out):
    if CAP.on:
        CAP.out = out


def install_hooks(model):
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            comp.indexer.scorer.register_forward_hook(_scorer_hook)


_WMASK = {}


def window_mask(S, W, device):
    key = (S, W, str(device))
    if key not in _WMASK:
        i = torch.arange(S, device=device)
        ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
        _WMASK[key] = torch.zeros(S, S, device=device).masked_fill(~ok, float("-inf"))[None, None]
    return _WMASK[key]


def amp_ctx(amp):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp)


def no_amp():
    return torch.autocast("cuda", enabled=False)


def attention_block(attn, li, x, pe, pos, mode, want_kl, stats):
    """DeepseekV4Attention of layer li without a cache.  mode 'sparse': CSA rows picked by the
    indexer (transformers' block bias); 'dense': every causally visible compressed row.
    Returns (output [B,S,D], indexer KL or None)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
    B, S, _ = x.shape
    c = attn.config
    H, d = c.num_attention_heads, c.head_dim
    lt = c.layer_types[li]
    cos, sin = pe["main" if lt == SLIDING else "compress"]
    q_res = attn.q_a_norm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_res).view(B, S, H, d).transpose(1, 2)
    if getattr(attn, "q_b_norm", None) is not None:
        q = attn.q_b_norm(q)
    else:  # per-head unweighted RMS rescale
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + c.rms_norm_eps).to(q.dtype)
    q = apply_rotary_pos_emb(q, cos, sin)
    kv = attn.kv_norm(attn.kv_proj(x)).view(B, S, 1, d).transpose(1, 2)
    kv = apply_rotary_pos_emb(kv, cos, sin)
    mask = window_mask(S, c.sliding_window, x.device)
    K, T, kl = kv, 0, None
    comp = attn.compressor
    if comp is not None:
        kc, bias = comp(x, q_res, pos, None, li)  # [B,1,T,d], [B,1,S,T] or None
        T = kc.shape[2]
        if T:
            rate = c.compress_rates[lt]
            causal_c = torch.arange(T, device=x.device)[None, None, :] < ((pos + 1) // rate)[:, :, None]  # [1,S,T]
            hf_bias = bias
            if bias is None or (lt == CSA and mode == "dense"):
                bias = torch.zeros(1, 1, S, T, device=x.device).masked_fill(~causal_c[:, None], float("-inf"))
            nb = max(bias.shape[0], B)
            K = torch.cat([kv, kc.to(kv.dtype)], dim=2)
            mask = torch.cat([mask.expand(nb, 1, S, S), bias.to(mask.dtype).expand(nb, 1, S, T)], dim=-1)
    raw = torch.matmul(q, K.transpose(-1, -2)).float() * (d ** -0.5)  # [B,H,S,S+T]
    logits = raw + mask
    lse = torch.logaddexp(torch.logsumexp(logits, dim=-1, keepdim=True), attn.sinks.float().view(1, H, 1, 1))
    p = torch.exp(logits - lse)
    o = torch.matmul(p, K)  # [B,H,S,d]; the sink's share is dropped, as transformers does
    o = apply_rotary_pos_emb(o, cos, -sin).transpose(1, 2)  # inverse rope on the output, -> [B,S,H,d]
    grouped = o.reshape(B, S, c.o_groups, -1)
    out = attn.o_b_proj(attn.o_a_proj(grouped).flatten(2))

    if lt == CSA and T and (want_kl or stats is not None):
        r0 = rate - 1  # rows before this position see no compressed row
        with torch.no_grad():  # target: main attention over the visible compressed rows
            lc = raw[:, :, r0:, S:].masked_fill(~causal_c[:, None, r0:], float("-inf"))
            pt = torch.softmax(lc, dim=-1).sum(1) / H  # [B,S-r0,T]
        if stats is not None:
            with torch.no_grad():
                sel = (hf_bias[:, 0, r0:] == 0) if hf_bias is not None else None
                ncand = ((pos[0, r0:] + 1) // rate)
                rows = ncand > c.index_topk
                if sel is not None and rows.any():
                    kept = (pt * sel).sum(-1)[:, rows]
                    stats.setdefault(li, []).append(
                        (kept.sum().item(), kept.numel(), (kept >= 0.9).sum().item()))
        if want_kl:
            CAP.on = True
            try:
                comp.indexer(x.detach(), q_res.detach(), pos, None, li)
            finally:
                CAP.on = False
            sc = CAP.out[:, r0:].float()  # [B,S-r0,T] differentiable in the indexer's weights
            CAP.out = None
            vis = causal_c[:, r0:]
            logq = torch.log_softmax(sc.masked_fill(~vis, float("-inf")), dim=-1).masked_fill(~vis, 0.0)
            kl = (torch.xlogy(pt, pt) - pt * logq).sum(-1).mean()
    return out, kl


def moe_block(mlp, h, ids, c):
    """DeepseekV4SparseMoeBlock, every expert evaluated densely and weighted by the sparse
    routing weights (same result as transformers' dispatch; no host sync)."""
    B, S, D = h.shape
    flat = h.reshape(-1, D)
    gate = mlp.gate
    logits = F.linear(flat, gate.weight)
    scores = torch.sqrt(F.softplus(logits))  # scoring_func sqrtsoftplus
    is_hash = hasattr(gate, "tid2eid")
    if is_hash:
        idx = gate.tid2eid[ids.reshape(-1)].long()
    else:
        idx = torch.topk(scores + gate.e_score_correction_bias, c.num_experts_per_tok, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
    E = c.n_routed_experts
    dense_w = torch.zeros(flat.shape[0], E, device=h.device, dtype=w.dtype).scatter_add(1, idx, w)
    ex = mlp.experts
    gu = torch.einsum("nd,eid->eni", flat, ex.gate_up_proj)
    g, u = gu.chunk(2, dim=-1)
    lim = c.swiglu_limit
    act = F.silu(g.clamp(max=lim)) * u.clamp(min=-lim, max=lim)
    o = torch.bmm(act, ex.down_proj.transpose(1, 2))  # [E,N,D]
    y = torch.einsum("end,ne->nd", o, dense_w.to(o.dtype))
    y = y + mlp.shared_experts(h).reshape(-1, D)
    load = None if is_hash else torch.bincount(idx.flatten(), minlength=E)
    return y.view(B, S, D), load


def hc_mix(post, comb, y, X):
    with no_amp():
        return post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), X)


def forward(model, ids, mode, amp=True, want_kl=False, stats=None):
    """Returns logits [B,S,V] (fp32 residual streams), mean indexer KL (or None), router loads."""
    m = model.model
    B, S = ids.shape
    hc = model.config.hc_mult
    pos = torch.arange(S, device=ids.device)[None]
    emb = m.embed_tokens(ids).float()
    X = emb.unsqueeze(2).expand(-1, -1, hc, -1).contiguous()
    pe = {"main": m.rotary_emb(emb, position_ids=pos, layer_type="main"),
          "compress": m.rotary_emb(emb, position_ids=pos, layer_type="compress")}
    kls, loads = [], []
    for li, layer in enumerate(m.layers):
        with no_amp():
            post, comb, col = layer.attn_hc(X)
        with amp_ctx(amp):
            a, kl = attention_block(layer.self_attn, li, layer.input_layernorm(col), pe, pos, mode, want_kl, stats)
        X = hc_mix(post, comb, a, X)
        with no_amp():
            post, comb, col = layer.ffn_hc(X)
        with amp_ctx(amp):
            y, load = moe_block(layer.mlp, layer.post_attention_layernorm(col), ids, model.config)
        X = hc_mix(post, comb, y, X)
        if kl is not None:
            kls.append(kl)
        if load is not None:
            loads.append(load)
    with no_amp():
        hfin = m.norm(m.hc_head(X))
    with amp_ctx(amp):
        logits = model.lm_head(hfin)
    return logits, (torch.stack(kls).mean() if kls else None), loads


# ----------------------------------------------------------------------------------------
# checkpoint
# ----------------------------------------------------------------------------------------
def file_state_dict(model):
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().cpu()
        if not v.is_floating_point():
            out[k] = v.contiguous()
        elif keep_fp32(k):
            out[k] = v.float().contiguous()
        else:
            out[k] = v.to(torch.bfloat16).contiguous()
    return out


def round_to_file_precision_(model):
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.is_floating_point() and not keep_fp32(n) and "inv_freq" not in n:
                p.copy_(p.to(torch.bfloat16).float())


def save_model_dir(model, outdir):
    from safetensors.torch import save_file
    import transformers
    os.makedirs(outdir, exist_ok=True)
    sd = file_state_dict(model)
    save_file(dict(sorted(sd.items())), os.path.join(outdir, "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = ["DeepseekV4ForCausalLM"]
    model.config.save_pretrained(outdir)
    cpath = os.path.join(outdir, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    # the weights are bf16 (fp32 where transformers keeps modules in fp32), but transformers 5.17
    # cannot run DeepseekV4ForCausalLM in bf16 (a kept-fp32 norm feeds a bf16 linear: "expected
    # mat1 and mat2 to have the same dtype"), so the default load dtype is float32
    c["dtype"] = "float32"
    with open(cpath, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")
    # DeepSeek-V4's recommended sampling (temperature 1.0, top_p 1.0), written by hand because
    # GenerationConfig.save_pretrained leaves out values equal to its defaults
    gen = {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": True, "temperature": 1.0, "top_p": 1.0,
           "transformers_version": transformers.__version__}
    with open(os.path.join(outdir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    for fn in ("tokenizer.json", "tokenizer_config.json"):  # byte for byte the V3.2 model's
        shutil.copy(os.path.join(V32_DIR, fn), os.path.join(outdir, fn))
    return sd


def load_hf(path, dtype, device, experts=None):
    from transformers import DeepseekV4ForCausalLM
    m, info = DeepseekV4ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                    output_loading_info=True)
    if experts:
        m.config._experts_implementation = experts
    return m.to(device).eval(), info


# ----------------------------------------------------------------------------------------
def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=os.path.join(REPO, ".corpus"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train-seconds", type=float, default=420)
    ap.add_argument("--deadline", type=float, default=560, help="seconds after start by which all must end")
    ap.add_argument("--deadline-epoch", type=float, default=0, help="unix time by which all must end")
    ap.add_argument("--post-reserve", type=float, default=190, help="seconds kept for phases 4-8")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--sparse-batch", type=int, default=32)
    ap.add_argument("--sparse-seq", type=int, default=1024)
    ap.add_argument("--sparse-frac", type=float, default=0.25)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bias-gamma", type=float, default=1e-3)
    ap.add_argument("--degen-prompts", type=int, default=48)
    ARGS = ap.parse_args()
    if ARGS.deadline_epoch:
        ARGS.deadline = min(ARGS.deadline, ARGS.deadline_epoch - T0)
    if ARGS.smoke:
        ARGS.batch, ARGS.seq, ARGS.sparse_batch, ARGS.sparse_seq, ARGS.sparse_frac = 8, 512, 4, 1024, 0.5
        ARGS.degen_prompts = 6
    random.seed(ARGS.seed)
    np.random.seed(ARGS.seed)
    torch.manual_seed(ARGS.seed)
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    out = ARGS.out
    stage = os.path.join(out, "stage")
    mdir = os.path.join(stage, MODEL_NAME)
    os.makedirs(mdir, exist_ok=True)
    import transformers, tokenizers, safetensors
    log(f"torch {torch.__version__} transformers {transformers.__version__} tokenizers {tokenizers.__version__}"
        f" safetensors {safetensors.__version__} gpu {torch.cuda.get_device_name()}"
        f" deadline {ARGS.deadline:.0f}s{' SMOKE' if ARGS.smoke else ''}")
    results = {"model": MODEL_NAME, "smoke": ARGS.smoke, "args": vars(ARGS), "config": MODEL_CONFIG,
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "tokenizers": tokenizers.__version__}}

    def dump():
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, ensure_ascii=False)

    # ---- 1. corpus ---------------------------------------------------------------------
    train_docs = v32.load_docs(os.path.join(ARGS.corpus, "train.jsonl.xz"))
    held_docs = v32.load_docs(os.path.join(ARGS.corpus, "heldout.jsonl.xz"))
    log(f"corpus: {len(train_docs)} train docs, {len(held_docs)} held-out docs")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(V32_DIR, "tokenizer.json"))
    assert tok.get_vocab_size() == MODEL_CONFIG["vocab_size"], tok.get_vocab_size()
    if ARGS.smoke:
        train_docs = train_docs[:300]
    t = time.time()
    train_ids, _ = v32.encode_stream(tok, train_docs)
    held_by_kind = {}
    for d in held_docs:
        held_by_kind.setdefault(d["kind"], []).append(d)
    held_ids = {k: v32.encode_stream(tok, v)[0] for k, v in held_by_kind.items()}
    log(f"encoded: {len(train_ids)} train tokens in {time.time() - t:.1f}s; held-out tokens "
        f"{ {k: len(v) for k, v in held_ids.items()} }")
    results["tokens"] = {"train": int(len(train_ids)), "heldout": {k: int(len(v)) for k, v in held_ids.items()}}
    freq = np.bincount(train_ids, minlength=MODEL_CONFIG["vocab_size"]).astype(np.float64)

    # ---- 2. model ----------------------------------------------------------------------
    model, hash_loads = build_model(freq)
    model = model.to(dev)
    install_hooks(model)
    cfg = model.config
    n_total = sum(p.numel() for p in model.parameters())
    D, I, E, k = cfg.hidden_size, MODEL_CONFIG["moe_intermediate_size"], cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = 3 * D * I
    L = cfg.num_hidden_layers
    n_embed = cfg.vocab_size * D

    def count(pred):
        return sum(p.numel() for n, p in model.named_parameters() if pred(n))
    results["params"] = {
        "total": n_total, "embedding": n_embed, "lm_head": n_embed,
        "routed_experts": L * E * per_expert, "shared_experts": L * per_expert,
        "active_per_token": n_total - L * (E - k) * per_expert,
        "active_per_token_excl_embedding": n_total - L * (E - k) * per_expert - n_embed,
        "attention_excl_compressors": count(lambda n: ".self_attn." in n and ".compressor." not in n),
        "csa_compressors_excl_indexer": count(lambda n: ".compressor." in n and ".indexer." not in n
                                              and cfg.layer_types[int(n.split(".")[2])] == CSA),
        "indexers": count(lambda n: ".indexer." in n),
        "hca_compressors": count(lambda n: ".compressor." in n and cfg.layer_types[int(n.split(".")[2])] == HCA),
        "hyper_connections": count(lambda n: "_hc." in n or "hc_head" in n),
        "routers": count(lambda n: ".mlp.gate." in n),
        "tid2eid_entries": sum(b.numel() for n, b in model.named_buffers() if n.endswith("tid2eid")),
    }
    results["hash_routing_static_load_max_over_mean"] = [max(h) for h in hash_loads]
    log(f"params: {results['params']}")
    log(f"hash layers: static expert load max/mean {results['hash_routing_static_load_max_over_mean']}")
    bias_bufs = [l.mlp.gate.e_score_correction_bias for l in model.model.layers
                 if hasattr(l.mlp.gate, "e_score_correction_bias")]

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=ARGS.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    gen = np.random.default_rng(ARGS.seed)
    train_t = torch.from_numpy(train_ids.astype(np.int64))

    def batch(B, S):
        offs = gen.integers(0, len(train_t) - S - 1, size=B)
        x = torch.stack([train_t[o:o + S + 1] for o in offs]).to(dev, non_blocking=True)
        return x[:, :-1], x[:, 1:]

    held_all = np.concatenate([held_ids[k] for k in sorted(held_ids)])

    def held_windows(S, n):
        hs = torch.from_numpy(held_all.astype(np.int64))
        nw = min(n, (len(hs) - 1) // S)
        step = (len(hs) - 1 - S) // max(1, nw)
        return torch.stack([hs[i * step:i * step + S + 1] for i in range(nw)]).to(dev)
    curve_windows = held_windows(512, 32 if not ARGS.smoke else 4)

    @torch.no_grad()
    def eval_loss(windows, mode, amp=True, bs=16):
        model.eval()
        tot, n = 0.0, 0
        for i in range(0, len(windows), bs):
            w = windows[i:i + bs]
            lg, _, _ = forward(model, w[:, :-1], mode, amp=amp)
            tot += F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
            n += w[:, 1:].numel()
        model.train()
        return tot / n

    # ---- 3. training -------------------------------------------------------------------
    t_start = time.time()
    budget = ARGS.train_seconds if not ARGS.smoke else 12
    if not ARGS.smoke:
        budget = min(budget, ARGS.deadline - ARGS.post_reserve - (t_start - T0))
    log(f"training budget {budget:.0f}s")
    results["train_budget_s"] = round(budget, 1)
    step, curve, last_eval, tokens_so_far = 0, [], t_start, 0
    ema = None
    warm = 150 if not ARGS.smoke else 5
    stage_times = {}
    model.train()
    while True:
        el = time.time() - t_start
        if el >= budget:
            break
        frac = el / budget
        sparse = frac >= 1.0 - ARGS.sparse_frac
        B, S = (ARGS.sparse_batch, ARGS.sparse_seq) if sparse else (ARGS.batch, ARGS.seq)
        lr = ARGS.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(B, S)
        logits, kl, loads = forward(model, x, "sparse" if sparse else "dense", amp=True, want_kl=True)
        lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        if kl is None:
            kl = torch.zeros((), device=dev)
        loss = lm + kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free load balancing (DeepSeek-V3): push bias toward balance
            for b, ld in zip(bias_bufs, loads):
                ld = ld.float()
                b.add_(ARGS.bias_gamma * torch.sign(ld.mean() - ld))
        step += 1
        tokens_so_far += B * S
        stage_times.setdefault("sparse" if sparse else "dense", [step, time.time()])
        if step % 25 == 0 or step <= 3:
            lmv, klv = lm.item(), kl.item()
            if not (math.isfinite(lmv) and math.isfinite(klv)):
                log(f"non-finite loss at step {step}: lm {lmv} kl {klv}")
                if ARGS.smoke:
                    raise SmokeFailure("non-finite loss")
            ema = lmv if ema is None else 0.9 * ema + 0.1 * lmv
            rec = {"step": step, "t": round(time.time() - t_start, 1), "stage": "sparse" if sparse else "dense",
                   "lr": lr, "loss": round(lmv, 4), "loss_ema": round(ema, 4), "kl": round(klv, 4),
                   "grad_norm": round(gn.item(), 3), "tokens": tokens_so_far}
            if time.time() - last_eval > (30 if not ARGS.smoke else 5):
                rec["heldout_dense512"] = round(eval_loss(curve_windows, "dense"), 4)
                rec["heldout_sparse512"] = round(eval_loss(curve_windows, "sparse"), 4)
                last_eval = time.time()
            curve.append(rec)
            if step % 100 == 0 or step <= 3 or "heldout_dense512" in rec:
                imb = [round((l.max() / l.float().mean()).item(), 2) for l in loads]
                log(f"step {step} {rec['stage']} lr {lr:.2e} loss {lmv:.3f} (ema {ema:.3f}) kl {klv:.3f} "
                    f"gn {gn.item():.2f} max/mean load {imb}"
                    + (f" heldout d/s {rec['heldout_dense512']}/{rec['heldout_sparse512']}"
                       if "heldout_dense512" in rec else ""))
    torch.cuda.synchronize()
    train_time = time.time() - t_start
    st = dict(stage_times)
    n_dense = (st["sparse"][0] - 1) if "sparse" in st else step
    tokens_seen = n_dense * ARGS.batch * ARGS.seq + (step - n_dense) * ARGS.sparse_batch * ARGS.sparse_seq
    step_ms = {}
    if "sparse" in st and "dense" in st:
        ts = st["sparse"][1]
        step_ms = {"dense": round((ts - st["dense"][1]) / max(1, n_dense - 1) * 1e3, 1),
                   "sparse": round((time.time() - ts) / max(1, step - n_dense) * 1e3, 1)}
        log(f"step time: dense {step_ms['dense']} ms (B={ARGS.batch}, S={ARGS.seq}), sparse {step_ms['sparse']} ms "
            f"(B={ARGS.sparse_batch}, S={ARGS.sparse_seq}); peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    log(f"trained {step} steps ({n_dense} dense, {step - n_dense} sparse) in {train_time:.0f}s, "
        f"{tokens_seen / 1e6:.1f}M tokens ({tokens_seen / len(train_ids):.2f} epochs)")
    results["training"] = {"steps": step, "dense_steps": n_dense, "sparse_steps": step - n_dense,
                           "seconds": round(train_time, 1), "tokens_seen": tokens_seen,
                           "epochs": tokens_seen / len(train_ids), "final_train_loss_ema": ema,
                           "step_ms": step_ms, "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                           "e_score_correction_bias": [[round(x, 4) for x in b.tolist()] for b in bias_bufs]}
    results["curve"] = curve
    dump()

    # ---- 4. save ------------------------------------------------------------------------
    model.eval()
    if ARGS.smoke:
        randomize_for_check_(model, ARGS.seed + 7)
    round_to_file_precision_(model)
    sd = save_model_dir(model, mdir)
    size = os.path.getsize(os.path.join(mdir, "model.safetensors"))
    with open(os.path.join(mdir, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    dtypes = {}
    for v in sd.values():
        dtypes[str(v.dtype)] = dtypes.get(str(v.dtype), 0) + 1
    log(f"saved {mdir}: model.safetensors {size / 1e6:.2f} MB, {len(sd)} tensors {dtypes}, sha256 {sha[:16]}")
    results["files"] = {f: os.path.getsize(os.path.join(mdir, f)) for f in sorted(os.listdir(mdir))}
    results["safetensors"] = {"tensors": len(sd), "dtypes": dtypes, "sha256": sha}
    dump()

    def finish():
        tar = os.path.join(out, "bundle.tar")
        with tarfile.open(tar, "w") as t:
            for fn in sorted(os.listdir(mdir)):
                if fn != "model.safetensors":
                    t.add(os.path.join(mdir, fn), arcname=f"{MODEL_NAME}/{fn}")
            rp = os.path.join(stage, "tiny_v4_reference.json")
            if os.path.exists(rp):
                t.add(rp, arcname="tiny_v4_reference.json")
        shutil.move(os.path.join(mdir, "model.safetensors"), os.path.join(out, "model.safetensors"))
        shutil.rmtree(stage)
        dump()
        log(f"done; bundle {os.path.getsize(tar)} bytes")

    def post():
        from transformers import AutoConfig, AutoTokenizer, DynamicCache
        # ---- 5. reload with transformers and compare -------------------------------------
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        hf, info = load_hf(mdir, torch.float32, dev, experts="eager")
        log(f"from_pretrained: missing {info['missing_keys']} unexpected {info['unexpected_keys']} "
            f"mismatched {info.get('mismatched_keys')} experts {hf.config._experts_implementation}")
        results["load_info"] = {k: [str(x) for x in v] for k, v in info.items() if isinstance(v, (list, set))}
        ok_load = not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys")
        results["loads_cleanly"] = ok_load
        ac = AutoConfig.from_pretrained(mdir)
        results["config_roundtrip"] = {"layer_types": ac.layer_types == cfg.layer_types,
                                       "mlp_layer_types": ac.mlp_layer_types == cfg.mlp_layer_types,
                                       "compress_rates": ac.compress_rates == cfg.compress_rates,
                                       "rope_parameters": ac.rope_parameters}
        with torch.no_grad():
            w = held_windows(300, 4)[:, :-1]
            ref = hf(w).logits.float()  # eager expert loop: the reference semantics
            mine, _, _ = forward(model.float(), w, "sparse", amp=False)
            scale = ref.abs().max().item()
            pos_diff = (mine - ref).abs().amax(-1)  # [B,S]
            d = pos_diff.max().item()
            rel = d / scale
            frac_off = (pos_diff > 1e-4 * scale).float().mean().item()  # e.g. a routing near-tie flipped
            agree = (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()
            dense_l, _, _ = forward(model, w, "dense", amp=False)
            dd = (dense_l - ref).abs().max().item()
            try:  # transformers' default expert path (grouped_mm) on the same input, for the record
                hf.config._experts_implementation = "grouped_mm"
                gmm = (hf(w).logits.float() - ref).abs().max().item()
            except Exception as e:
                gmm = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                hf.config._experts_implementation = "eager"
        log(f"training forward vs transformers (fp32, TF32 off, sparse, 4x300 tokens): max |dlogit| {d:.2e} "
            f"(rel {rel:.1e}, positions over 1e-4 rel: {frac_off:.4f}), argmax agree {agree:.4f}; "
            f"dense-over-compressed variant differs by {dd:.2e}; transformers grouped_mm vs eager experts: {gmm}")
        results["forward_check"] = {"max_abs_logit_diff": d, "rel": rel, "positions_over_1e-4_rel": frac_off,
                                    "argmax_agreement": agree, "dense_variant_max_abs_diff": dd,
                                    "transformers_grouped_mm_vs_eager_max_abs_diff": gmm,
                                    "experts_implementation": "eager"}
        dump()
        if ARGS.smoke and not (ok_load and frac_off <= 0.01 and agree > 0.995):
            raise SmokeFailure(f"reload/forward check failed: load ok {ok_load}, rel {rel:.2e}, "
                               f"off {frac_off:.4f}, agree {agree:.4f}")

        htok = AutoTokenizer.from_pretrained(mdir)
        enc = htok(HTML_PROMPT).input_ids
        rt = htok.decode(enc, skip_special_tokens=True)
        same = enc == [BOS] + tok.encode(HTML_PROMPT, add_special_tokens=False).ids
        log(f"AutoTokenizer: {type(htok).__name__}, HTML prompt -> {enc}, round trip {'ok' if rt == HTML_PROMPT else repr(rt)}, "
            f"same as tokenizers: {same}")
        results["tokenizer_check"] = {"ids": enc, "roundtrip": rt == HTML_PROMPT, "same_as_tokenizers": same}
        if ARGS.smoke and not (rt == HTML_PROMPT and same):
            raise SmokeFailure("tokenizer check failed")

        # ---- 6. fp32 CPU reference for the C++ engine ---------------------------------------
        cpu, _ = load_hf(mdir, torch.float32, "cpu", experts="eager")
        torch.set_num_threads(min(8, os.cpu_count()))
        nsteps = 128 if not ARGS.smoke else 8
        ref_meta = {"model": MODEL_NAME, "model_safetensors_sha256": sha, "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "note": "transformers DeepseekV4ForCausalLM, fp32 on CPU, eager attention, eager experts, "
                            "greedy argmax over the raw logits, one token a step through DynamicCache; bos "
                            "prepended by the tokenizer; eos not treated specially. top_logits: the 8 largest "
                            "logits (id, value) of each of the first 16 steps, with the step's logsumexp.",
                    "steps": nsteps, "prompts": []}
        t = time.time()
        for text in (HTML_PROMPT, EN_PROMPT):
            pids = htok(text).input_ids
            cache = DynamicCache(config=cpu.config)
            inp = torch.tensor([pids])
            toks, margins, tops = [], [], []
            with torch.no_grad():
                for s in range(nsteps):
                    o = cpu(inp, past_key_values=cache, use_cache=True)
                    lg = o.logits[0, -1].float()
                    top = lg.topk(8)
                    nxt = int(top.indices[0])
                    margins.append(round(float(top.values[0] - top.values[1]), 6))
                    if s < 16:
                        tops.append({"ids": top.indices.tolist(), "logits": [round(float(v), 6) for v in top.values],
                                     "logsumexp": round(float(torch.logsumexp(lg, 0)), 6)})
                    toks.append(nxt)
                    inp = torch.tensor([[nxt]])
                full = cpu(torch.tensor([pids + toks[:-1]])).logits[0, len(pids) - 1:].argmax(-1).tolist()
            nc = sum(int(a == b) for a, b in zip(full, toks))
            ref_meta["prompts"].append({"text": text, "prompt_ids": pids, "decode_ids": toks,
                                        "decode_text": htok.decode(toks), "top1_top2_margin": margins,
                                        "min_margin": min(margins), "min_margin_step": int(np.argmin(margins)),
                                        "no_cache_recompute_agrees": f"{nc}/{len(toks)}", "top_logits": tops})
            log(f"reference {text[:24]!r}: {len(pids)} prompt ids, {len(toks)} greedy ids, min margin "
                f"{min(margins):.4f} at step {int(np.argmin(margins))}, no-cache recompute agrees {nc}/{len(toks)}")
        log(f"cpu reference took {time.time() - t:.1f}s")
        results["reference"] = {p["text"][:20]: {"min_margin": p["min_margin"], "recompute": p["no_cache_recompute_agrees"],
                                                 "text": p["decode_text"]} for p in ref_meta["prompts"]}
        del cpu
        t = time.time()
        with torch.no_grad():
            for p in ref_meta["prompts"]:
                g = hf.generate(torch.tensor([p["prompt_ids"]], device=dev), do_sample=False, max_new_tokens=nsteps,
                                min_new_tokens=nsteps, eos_token_id=None, pad_token_id=2)
                gt = g[0, len(p["prompt_ids"]):].tolist()
                same = next((i for i, (a, b) in enumerate(zip(gt, p["decode_ids"])) if a != b), len(gt))
                p["gpu_fp32_generate_agrees_for"] = same
                results["reference"][p["text"][:20]]["gpu_fp32_generate_agrees_for"] = same
                log(f"gpu fp32 generate() agrees with the cpu reference for {same}/{nsteps} tokens")
        gen_step = (time.time() - t) / (2 * nsteps)
        log(f"gpu generate: {gen_step * 1e3:.1f} ms a step (batch 1)")
        with open(os.path.join(stage, "tiny_v4_reference.json"), "w") as f:
            json.dump(ref_meta, f, indent=1, ensure_ascii=False)
        dump()

        # ---- 7. held-out loss --------------------------------------------------------------
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

        def hf_loss(mm, wins, bs=8):
            tot, n = 0.0, 0
            with torch.no_grad():
                for i in range(0, len(wins), bs):
                    w = wins[i:i + bs]
                    lg = mm(w[:, :-1]).logits.float()
                    tot += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
                    n += w[:, 1:].numel()
            return tot, n

        if left() > 60:
            t = time.time()
            from transformers import DeepseekV32ForCausalLM
            v3 = DeepseekV32ForCausalLM.from_pretrained(V32_DIR, dtype=torch.float32, attn_implementation="eager").to(dev).eval()
            ho, sums = {}, {}
            for kname in sorted(held_ids):
                hs = torch.from_numpy(held_ids[kname].astype(np.int64))
                nw = (len(hs) - 1) // 1024
                if ARGS.smoke:
                    nw = min(nw, 2)
                if not nw:
                    continue
                wins = torch.stack([hs[i * 1024:i * 1024 + 1025] for i in range(nw)]).to(dev)
                a = hf_loss(hf, wins)
                b = hf_loss(v3, wins)
                with torch.no_grad():
                    dn = eval_loss(wins, "dense", amp=False, bs=8)
                ho[kname] = {"windows": nw, "v4_sparse_as_shipped": round(a[0] / a[1], 4),
                             "v4_dense_over_compressed": round(dn, 4), "v32": round(b[0] / b[1], 4)}
                for key, val in (("a", a[0]), ("b", b[0]), ("d", dn * a[1]), ("n", a[1]), ("w", nw)):
                    sums[key] = sums.get(key, 0) + val
            ho["all"] = {"windows": sums["w"], "v4_sparse_as_shipped": round(sums["a"] / sums["n"], 4),
                         "v4_dense_over_compressed": round(sums["d"] / sums["n"], 4), "v32": round(sums["b"] / sums["n"], 4)}
            ho["note"] = ("nats per token over consecutive 1024-token windows of each kind's held-out stream; both "
                          "models through transformers in fp32 (TF32 on) on the same windows; the dense variant is "
                          "this script's forward with CSA attending to every visible compressed row")
            results["heldout_loss"] = ho
            log(f"held-out loss ({time.time() - t:.1f}s): {ho}")
            del v3
            # share of the dense compressed-row attention that the indexer's top-k keeps (1k windows)
            stats = {}
            wins = held_windows(1024, 16 if not ARGS.smoke else 2)
            with torch.no_grad():
                for i in range(0, len(wins), 4):
                    forward(model, wins[i:i + 4, :-1], "sparse", amp=False, stats=stats)
            results["indexer_recall_1024"] = {
                f"layer{li}": {"mean_mass_kept": round(sum(a for a, _, _ in v) / sum(n for _, n, _ in v), 4),
                               "rows_keeping_90pct": round(sum(c for _, _, c in v) / sum(n for _, n, _ in v), 4),
                               "rows": sum(n for _, n, _ in v)} for li, v in sorted(stats.items())}
            results["indexer_recall_1024"]["note"] = (
                f"rows with more than index_topk={cfg.index_topk} visible compressed rows; mass = the main attention's "
                "distribution over the visible compressed rows (heads summed, normalised) that falls on the "
                "indexer's picks")
            log(f"indexer top-{cfg.index_topk} keeps of the dense compressed-row attention: {results['indexer_recall_1024']}")
            dump()
        # does transformers run this model in bf16? (probe only; the numbers above are fp32)
        try:
            hb, _ = load_hf(mdir, torch.bfloat16, dev)
            w = held_windows(1024, 4)
            with torch.no_grad():
                lb = hb(w[:, :-1]).logits.float()
                lf = hf(w[:, :-1]).logits.float()
            cb = F.cross_entropy(lb.reshape(-1, lb.shape[-1]), w[:, 1:].reshape(-1)).item()
            cf = F.cross_entropy(lf.reshape(-1, lf.shape[-1]), w[:, 1:].reshape(-1)).item()
            results["bf16_probe"] = {"runs": True, "loss_bf16": round(cb, 4), "loss_fp32": round(cf, 4),
                                     "argmax_agree": round((lb.argmax(-1) == lf.argmax(-1)).float().mean().item(), 4)}
            del hb
        except Exception as e:
            results["bf16_probe"] = {"runs": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"bf16 probe: {results['bf16_probe']}")
        dump()

        # ---- 8. samples and degeneration (fp32 model, TF32 on) ---------------------------------
        def gen_batch(prompts_ids, temp, n_new):
            ids = torch.tensor(prompts_ids, device=dev)
            kw = dict(do_sample=temp > 0, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=2)
            if temp > 0:
                kw.update(temperature=temp, top_p=1.0, top_k=0)
            with torch.no_grad():
                o = hf.generate(ids, **kw)
            return o[:, ids.shape[1]:].tolist()

        torch.manual_seed(ARGS.seed)
        n_new = 256 if not ARGS.smoke else 16
        samples = {}
        for name, text in [("html", HTML_PROMPT), ("english", EN_PROMPT)]:
            pids = htok(text).input_ids
            for temp in (0.0, 0.6, 1.0):
                if left() < 45:
                    log(f"out of time: skipping sample {name}@{temp}")
                    continue
                n = 1 if temp == 0 else 3
                outs = gen_batch([pids] * n, temp, n_new)
                samples[f"{name}@{temp}"] = [{"text": htok.decode(o), "degeneration": v32.degeneration(o)} for o in outs]
                log(f"sample {name}@{temp}: {samples[f'{name}@{temp}'][0]['text'][:300]!r}")
        results["samples"] = samples
        dump()

        order = sorted(held_docs, key=lambda d: d["id"])
        per_kind = max(1, ARGS.degen_prompts // 3)
        prompts, pkinds = [], []
        for kk in ("html", "js", "en"):
            c = 0
            for d in order:
                if d["kind"] != kk or c >= per_kind:
                    continue
                ids = tok.encode(d["text"], add_special_tokens=False).ids
                if len(ids) >= 64:
                    prompts.append([BOS] + ids[:32])
                    pkinds.append(kk)
                    c += 1
        n_new = 256 if not ARGS.smoke else 32
        study = {"n_prompts": len(prompts), "prompt_tokens": 33, "new_tokens": n_new, "kinds": pkinds,
                 "detector": "train.py degeneration() (window 128, max period 32, cover 0.5 or 4 repeats over "
                             "0.25, distinct-4 < 0.3)",
                 "eos": "suppressed (min_new_tokens) so every sample has exactly new_tokens tokens",
                 "sampling": "transformers generate, fp32, pure temperature (top_p 1, top_k off)", "rates": {}}
        for temp in (0.0, 0.6, 1.0):
            if left() < 25:
                log(f"out of time: skipping degeneration at T={temp}")
                break
            t = time.time()
            outs = gen_batch(prompts, temp, n_new)
            dets = [v32.degeneration(o) for o in outs]
            r = {"degenerate": sum(d["degenerate"] for d in dets) / len(dets),
                 "loop": sum(d["loop"] for d in dets) / len(dets),
                 "collapse": sum(d["collapse"] for d in dets) / len(dets),
                 "mean_distinct4": float(np.mean([d["distinct4"] for d in dets])),
                 "by_kind": {kk: sum(d["degenerate"] for d, k2 in zip(dets, pkinds) if k2 == kk) /
                             max(1, pkinds.count(kk)) for kk in ("html", "js", "en")},
                 "periods": [d["period"] for d in dets if d["loop"]],
                 "seconds": round(time.time() - t, 1),
                 "examples": [htok.decode(o)[-240:] for o, d in zip(outs, dets) if d["degenerate"]][:3]}
            study["rates"][str(temp)] = r
            log(f"degeneration T={temp}: {r['degenerate']:.3f} (loop {r['loop']:.3f}, collapse {r['collapse']:.3f}, "
                f"by kind {r['by_kind']}) in {r['seconds']}s")
        hp = htok(HTML_PROMPT).input_ids
        study["html_counter_prompt"] = {}
        for temp in (0.6, 1.0):
            if left() < 20:
                log(f"out of time: skipping Counter prompt at T={temp}")
                break
            outs = gen_batch([hp] * (32 if not ARGS.smoke else 4), temp, n_new)
            dets = [v32.degeneration(o) for o in outs]
            texts = [htok.decode(o) for o in outs]
            study["html_counter_prompt"][str(temp)] = {
                "n": len(outs), "degenerate": sum(d["degenerate"] for d in dets) / len(dets),
                "loop": sum(d["loop"] for d in dets) / len(dets),
                "collapse": sum(d["collapse"] for d in dets) / len(dets),
                "ends_in_div_loop": sum(tx.rstrip().endswith("</div>") and d["loop"] for tx, d in zip(texts, dets)),
                "examples": texts[:2]}
            log(f"HTML Counter prompt T={temp}: degenerate {study['html_counter_prompt'][str(temp)]['degenerate']:.3f}")
        results["degeneration"] = study

    failed = None
    try:
        post()
    except Exception as e:
        import traceback
        traceback.print_exc()
        results["error"] = traceback.format_exc()
        failed = e
    finally:
        finish()
    if ARGS.smoke and failed is not None:
        log(f"SMOKE FAILED: {failed}")
        sys.exit(3)
    if ARGS.smoke:
        log("SMOKE OK")


if __name__ == "__main__":
    main()
