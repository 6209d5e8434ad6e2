"""lockstep/import_sglang.py — a trace from the tensors that sglang's debug dumper wrote
(sglang/srt/debug_utils/dumper.py), so that `lockstep replay imported.h5 --mode forced` runs
lockstep's reference teacher-forced on the same tokens and `diff` names, tap by tap, where sglang
and the reference first part.

    python3 -m lockstep import sglang DUMP_DIR -m MODEL_DIR -o imported.h5 [--map NAME=TAP …]

What the dumper writes (read from its source; docs/python.md has the details): one torch.save
file per dump call, named by its tags joined with "___", in one folder per run:

  DUMPER_DIR/<exp_name>/step=S___rank=R___dump_index=I___name=N[___layer_id=L …].pt
      holding {"value": tensor, "meta": {step, rank, dump_index, name, …, world_size, …}}
  SGLANG_DUMPER_DIR/sglang_dump_<time>/forward_pass_id=F___rank=R___name=N___dump_index=I[…].pt
      (earlier dumpers: the tensor itself; `curr_step=` in between)

S / F is the forward pass (the dumper's step counter). sglang's ModelRunner registers the
dumper's forward hooks on the whole model; in the default "core" mode they dump, each pass, the
ForwardBatch's `input_ids` [T] and `positions` [T] (T tokens: every request's new tokens, one
after another), `seq_lens` [B], `req_pool_indices` [B] and `rids` (B request ids); in "all"
mode also every module's inputs and outputs as `non_intrusive__<module path>.inputs.<i>` /
`.output[.<i>]`, tensors [T, …] whose rows are those T tokens (logits: [B, V], one row a
request). A prefill pass is a request whose positions run p0 … p0+n−1 (n > 1); a decode pass
gives each request one token at seq_len − 1.

Mapping (NAME_TABLE below, docs/python.md prints it): sglang's DeepSeek module paths to tap
names, lockstep's own tap names (a `dumper.dump("attn.out", x, layer_id=3)` or
"layers.3.attn.out"), and `--map NAME=TAP` (NAME may hold {L}, the layer; TAP "-" ignores it).
Requests: by `rids` when dumped, else by `req_pool_indices` (a segment at position 0 starts a new
request in that slot), else one request at a time (a pass at position 0 starts the next; with no
positions dumped, every pass continues the one request).
Tokens: from `input_ids`; `--tokens FILE` ({"prompt": [...], "generated": [...]}, a list of
them, or what `import openai` reads) supplies them when not dumped and fixes the prompt /
generation split. The prompt is a request's first segment and the multi-token segments right
after it (chunked prefill); the token sampled after the last pass is fed nowhere, so no row
depends on it: it is --tokens', else the argmax of the dumped logits, else 0 (meta says which).

Refused (one TraceError line naming the file and the field): dumps of more than one rank or
of a tensor-parallel run (sharded activations), a tensor whose rows are not the pass's tokens
(CUDA-graph padding: run sglang with --disable-cuda-graph), the wrong number of columns for its
tap, a name dumped twice in one pass, positions that skip or repeat, and everything
_torchzip refuses.
"""
import json
import math
import os
import re
import stat

import numpy as np

from . import _torchzip
from ._format import TraceError
from .model import capture_policy, engine_options, model_meta
from .writer import TraceWriter

PASS_KEYS = ("forward_pass_id", "curr_step", "step")   # the pass counter, oldest name first
TOKEN_FIELDS = ("input_ids", "positions", "seq_lens", "req_pool_indices", "rids")
NI = "non_intrusive__"

# Taps an import can fill (docs/tap-points.md): name → dtype. V4's compressor.entry and
# indexer.key have rows only where a window closes, not one a token, so they are not here.
GLOBAL_TAPS = {"embed": "f32", "final_norm": "f32", "logits": "f32"}
LAYER_TAPS = {
    "attn_norm": "f32", "attn.q": "f32", "attn.latent": "f32", "attn.k_rope": "f32", "indexer.topk": "i32",
    "attn.heads": "f32", "attn.out": "f32", "resid_mid": "f32", "ffn_norm": "f32",
    "ffn.router.topk_ids": "i32", "ffn.router.topk_weights": "f32", "ffn.out": "f32", "resid_out": "f32",
    "attn_hc.mix": "f32", "attn.kv": "f32", "attn.indexer_topk": "i32", "attn.sink_share": "f32",
    "hc.streams_mid": "f32", "ffn_hc.mix": "f32", "hc.streams": "f32",
}

# sglang's DeepseekV2/V3/V32ForCausalLM module paths (after "non_intrusive__") → tap. {L} is the
# layer of the path, {L-1} the one before it, {last} the model's last layer; [.0] an optional
# ".0" (a module that returned one tensor, or the first of a tuple). sglang's RMSNorm
# called with a residual adds it first and returns (normed, x + residual): so .output.0 is the
# norm, .output.1 the residual stream it was given plus the block's output.
NAME_TABLE = [
    ("model.embed_tokens.output", "embed"),
    ("model.layers.{L}.input_layernorm.output[.0]", "layers.{L}.attn_norm"),
    ("model.layers.{L}.input_layernorm.output.1", "layers.{L-1}.resid_out"),
    ("model.layers.{L}.self_attn.kv_a_layernorm.output", "layers.{L}.attn.latent"),
    ("model.layers.{L}.self_attn.o_proj.inputs.0", "layers.{L}.attn.heads"),
    ("model.layers.{L}.self_attn.o_proj.output", "layers.{L}.attn.out"),
    ("model.layers.{L}.post_attention_layernorm.output.0", "layers.{L}.ffn_norm"),
    ("model.layers.{L}.post_attention_layernorm.output.1", "layers.{L}.resid_mid"),
    ("model.layers.{L}.mlp.output", "layers.{L}.ffn.out"),
    ("model.norm.output[.0]", "final_norm"),
    ("model.norm.output.1", "layers.{last}.resid_out"),
    ("logits_processor.output.next_token_logits", "logits"),
]


def _compile(readable):
    """A NAME_TABLE name → its regex: {L} a layer number, [.0] an optional ".0"."""
    rx = re.escape(readable).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\[\.0\]", r"(?:\.0)?")
    return re.compile(rx)


_TABLE = [(_compile(p), t) for p, t in NAME_TABLE]
MAX_FILES = 1 << 20


class _Bad(Exception):
    pass


def is_tap(name):
    if name in GLOBAL_TAPS:
        return True
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return bool(m) and m.group(2) in LAYER_TAPS and len(m.group(1)) < 6


def tap_dtype(tap):
    return GLOBAL_TAPS.get(tap) or LAYER_TAPS[tap.split(".", 2)[2]]


def parse_map(arg):
    """--map NAME=TAP → (compiled NAME pattern, TAP template or None to ignore)."""
    name, eq, tap = arg.partition("=")
    if not eq or not name:
        raise TraceError(f"--map {arg!r}: expected NAME=TAP (TAP a tap name, or - to ignore NAME)")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name.replace("{L}", "x")) or name.count("{L}") > 1:
        raise TraceError(f"--map {arg!r}: NAME may hold letters, digits, '_', '.', '-' and one {{L}} (a layer number)")
    pat = re.compile("".join("(?P<L>\\d+)" if p == "{L}" else re.escape(p) for p in re.split(r"(\{L\})", name)))
    if tap == "-":
        return pat, None
    probe = tap.replace("{L}", "0")
    if not (is_tap(probe) or probe in LAYER_TAPS):
        raise TraceError(f"--map {arg!r}: {tap!r} is not a tap name (docs/tap-points.md: embed, "
                         "layers.{L}.attn.out, attn.out with the dump's layer, final_norm, logits, …)")
    return pat, tap


def parse_file_name(fname):
    """The tags of a dumper file name: {key: value} (strings). Raises _Bad."""
    if not fname.endswith(".pt"):
        raise _Bad("not a .pt file")
    tags = {}
    for part in fname[:-3].split("___"):
        k, eq, v = part.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise _Bad(f"not a dumper file name (key=value tags joined by ___; {part[:40]!r} is not one)")
        if k in tags:
            raise _Bad(f"tag {k!r} twice")
        tags[k] = v
    for k in ("name", "rank", "dump_index"):
        if k not in tags:
            raise _Bad(f"no {k}= tag (the dumper always writes it)")
    key = next((k for k in PASS_KEYS if k in tags), None)
    if key is None:
        raise _Bad("no forward pass tag (forward_pass_id=, curr_step= or step=)")
    for k in (key, "rank", "dump_index") + (("layer_id",) if "layer_id" in tags else ()):
        if not re.fullmatch(r"[0-9]{1,9}", tags[k]):
            raise _Bad(f"tag {k}={tags[k][:20]!r} is not a number")
    return tags, key


def _scan(path):
    """(folder, [file names]) of the dumps under `path` (the run's folder or the one above it)."""
    if not os.path.isdir(path):
        raise TraceError(f"{path}: not a folder (give the dumper's run folder: DUMPER_DIR/<exp_name> or "
                         "SGLANG_DUMPER_DIR/sglang_dump_<time>)")
    names = sorted(os.listdir(path))
    pts = [n for n in names if n.endswith(".pt")]
    if pts:
        if len(pts) > MAX_FILES:
            raise TraceError(f"{path}: {len(pts)} dump files, more than an import reads ({MAX_FILES})")
        return path, pts
    subs = [n for n in names if os.path.isdir(os.path.join(path, n)) and not os.path.islink(os.path.join(path, n))
            and any(f.endswith(".pt") for f in os.listdir(os.path.join(path, n)))]
    if len(subs) == 1:
        return _scan(os.path.join(path, subs[0]))
    if subs:
        raise TraceError(f"{path}: {len(subs)} dump folders ({', '.join(subs[:4])}{', …' if len(subs) > 4 else ''}): "
                         "name one")
    raise TraceError(f"{path}: no .pt dump files here or in a folder below")


class _Resolver:
    """Dump name (+ its layer_id tag) → tap name, or None."""

    def __init__(self, maps, n_layers):
        self.maps = maps
        self.n_layers = n_layers

    def __call__(self, name, layer):
        for pat, tap in self.maps:
            m = pat.fullmatch(name)
            if m:
                if tap is None:
                    return None
                L = int(m.group("L")) if pat.groups else layer
                if "{L}" in tap or tap in LAYER_TAPS:
                    if L is None:
                        raise _Bad(f"--map maps it to {tap!r}, but neither the name nor a layer_id= tag gives "
                                   "the layer")
                    return tap.replace("{L}", str(L)) if "{L}" in tap else f"layers.{L}.{tap}"
                return tap
        if name.startswith(NI):
            for pat, tap in _TABLE:
                m = pat.fullmatch(name[len(NI):])
                if m:
                    L = int(m.group("L")) if "L" in pat.groupindex else None
                    if "{L-1}" in tap and L == 0:
                        return None
                    return (tap.replace("{L-1}", str((L or 0) - 1)).replace("{L}", str(L))
                            .replace("{last}", str(self.n_layers - 1)))
            return None
        if is_tap(name):
            return name
        if name in LAYER_TAPS and layer is not None:
            return f"layers.{layer}.{name}"
        return None


def _cols(tap, cfg):
    """The columns tap `tap` has for this model, or None where this importer does not know them."""
    H, V = cfg.get("hidden_size"), cfg.get("vocab_size")
    if tap == "logits":
        return V
    if tap in ("embed", "final_norm"):
        return H
    suffix = tap.split(".", 2)[2]
    if suffix in ("attn_norm", "attn.out", "ffn_norm", "ffn.out"):
        return H
    if cfg.get("model_type") == "deepseek_v4":
        return None
    nh, dn, dr, dv = (cfg.get(k) for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    known = {"resid_mid": H, "resid_out": H, "attn.latent": cfg.get("kv_lora_rank"), "attn.k_rope": dr,
             "attn.q": nh * (dn + dr) if None not in (nh, dn, dr) else None,
             "attn.heads": nh * dv if None not in (nh, dv) else None,
             "ffn.router.topk_ids": cfg.get("num_experts_per_tok"),
             "ffn.router.topk_weights": cfg.get("num_experts_per_tok"), "indexer.topk": cfg.get("index_topk")}
    return known.get(suffix)


def _ints(v, field, length=None):
    if isinstance(v, _torchzip.SavedTensor):
        if v.is_floating_point:
            raise _Bad(f"{field}: a {v.dtype} tensor, not integers")
        a = v.array
        if a.ndim == 2 and a.shape[0] == 1:
            a = a[0]
        if a.ndim != 1:
            raise _Bad(f"{field}: shape {list(v.shape)}, expected one dimension")
        a = a.astype(np.int64)
    elif isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        a = np.asarray(v, dtype=np.int64)
    else:
        raise _Bad(f"{field}: {type(v).__name__}, not a tensor of integers")
    if length is not None and len(a) != length:
        raise _Bad(f"{field}: {len(a)} entries, expected {length}")
    return a


def _rids(v, field, B):
    if isinstance(v, (list, tuple)) and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v):
        if len(v) != B:
            raise _Bad(f"{field}: {len(v)} request ids for {B} requests (seq_lens)")
        return [str(x) for x in v]
    if isinstance(v, _torchzip.SavedTensor):
        return [str(x) for x in _ints(v, field, B)]
    raise _Bad(f"{field}: {type(v).__name__}, not a list of request ids")


def _segments(pos, seq_lens, where):
    """[(start, end)) of each request's tokens in a pass: request b's positions run on by one and
    end at seq_lens[b] − 1."""
    T, segs, s = len(pos), [], 0
    for b, n in enumerate(seq_lens):
        last = int(n) - 1
        if s >= T:
            raise _Bad(f"{where}: seq_lens has {len(seq_lens)} requests, the {T} positions end at request {b}")
        j = s
        while int(pos[j]) != last:
            if j + 1 >= T or int(pos[j + 1]) != int(pos[j]) + 1:
                raise _Bad(f"{where}: request {b}'s positions (from {int(pos[s])}) do not run on to seq_lens[{b}] − 1 "
                           f"= {last}")
            j += 1
        segs.append((s, j + 1))
        s = j + 1
    if s != T:
        raise _Bad(f"{where}: {T - s} positions left after the last of seq_lens' {len(seq_lens)} requests")
    return segs


def _rows(v, field, tap, T, B, cols, want):
    """A dumped tensor → [rows, cols] float32 or int32: T rows (a token tap), B (logits)."""
    if not isinstance(v, _torchzip.SavedTensor):
        raise _Bad(f"{field}: a {type(v).__name__}, not a tensor")
    n = B if tap == "logits" else T
    s = v.shape
    if len(s) >= 1 and s[0] == n:
        shape = (n, -1)
    elif len(s) >= 2 and s[0] == 1 and s[1] == n:
        shape = (n, -1)
    elif n == 1 and len(s) == 1:
        shape = (1, -1)
    else:
        extra = " (CUDA-graph padding? run sglang with --disable-cuda-graph)" if len(s) and s[0] > n else ""
        raise _Bad(f"{field}: shape {list(s)}, but the pass has {n} {'requests' if tap == 'logits' else 'tokens'}"
                   f"{extra}")
    if v.array.size == 0:
        raise _Bad(f"{field}: an empty tensor (shape {list(s)})")
    if want == "i32":
        if v.is_floating_point:
            raise _Bad(f"{field}: a {v.dtype} tensor for {tap}, which holds integer ids")
        a = v.array.astype(np.int64).reshape(shape)
        if a.size and (a.min() < -(1 << 31) or a.max() >= 1 << 31):
            raise _Bad(f"{field}: ids beyond int32")
        a = a.astype(np.int32)
    else:
        if not v.is_floating_point:
            raise _Bad(f"{field}: a {v.dtype} tensor for {tap}, which holds floating-point values (a name mapped to "
                       "the wrong tap?)")
        a = v.to_f32().reshape(shape)
    if cols is not None and a.shape[1] != cols:
        raise _Bad(f"{field}: {a.shape[1]} values a row (shape {list(s)}), but {tap} has {cols} for this model "
                   "(a sharded tensor-parallel dump, or a name mapped to the wrong tap?)")
    return np.ascontiguousarray(a)


def _load_tokens(path, vocab):
    """--tokens: [(prompt, generated)] in request order."""
    from . import import_openai as oa
    out = []
    for where, obj in oa.read_records(path):
        if isinstance(obj, dict) and "prompt" in obj and "generated" in obj and "choices" not in obj:
            try:
                p = oa._ids(obj["prompt"], vocab, "prompt")
                g = oa._ids(obj["generated"], vocab, "generated")
            except oa._Bad as e:
                raise TraceError(f"{where}: {e}")
            out.append((p, g))
            continue
        try:
            req, choices, _ = oa._choices(obj)
            for ci, ch in enumerate(choices):
                try:
                    p = oa.parse_choice(ch, req, vocab, where)
                except oa._Bad as e:
                    raise oa._Bad(f"choices[{ci}]: {e}")
                out.append((p["prompt"], p["generated"]))
        except oa._Bad as e:
            raise TraceError(f"{where}: {e} (expected {{\"prompt\": [ids], \"generated\": [ids]}} or a completions "
                             "response with token ids)")
    return out


def _check_meta(meta, rec, where):
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise _Bad(f"{where}: meta is a {type(meta).__name__}, not a dict")
    if "name" in meta and meta["name"] != rec["name"]:
        raise _Bad(f"{where}: meta.name {str(meta['name'])[:60]!r} differs from the file name's {rec['name'][:60]!r}")
    k = rec["pass_key"]
    if k in meta and meta[k] != rec["pass_"]:
        raise _Bad(f"{where}: meta.{k} {str(meta[k])[:20]!r} differs from the file name's {rec['pass_']}")
    ws = meta.get("world_size")
    if isinstance(ws, int) and not isinstance(ws, bool) and ws > 1:
        raise _Bad(f"{where}: meta.world_size {ws}: dumps of a multi-rank run hold sharded tensors; lockstep imports "
                   "single-rank dumps (tp = pp = ep = dp = 1)")
    for k, v in meta.items():
        if isinstance(k, str) and k.endswith("_parallel_info") and isinstance(v, dict):
            for sk in ("tp_size", "pp_size", "attn_tp_size", "moe_ep_size", "attn_dp_size"):
                n = v.get(sk)
                if isinstance(n, int) and not isinstance(n, bool) and n > 1:
                    raise _Bad(f"{where}: meta.{k}.{sk} {n}: a parallel run's activations are sharded; lockstep "
                               "imports single-rank dumps")


def import_sglang(dump_dir, model_dir, out, maps=(), tokens=None, logits_topk=32, source=None, plugin_path=None):
    """Writes the trace `out` from the dumps under `dump_dir`; returns a summary dict."""
    if not 1 <= int(logits_topk) <= 65536:
        raise TraceError(f"--logits-topk {logits_topk}: must be in [1, 65536]")
    meta_keys, cfg = model_meta(model_dir)
    vocab = int(cfg.get("vocab_size", 0) or 0)
    n_layers = int(cfg.get("num_hidden_layers", 0) or 0)
    if vocab <= 0 or n_layers <= 0:
        raise TraceError(f"{model_dir}/config.json: vocab_size or num_hidden_layers missing")
    resolve = _Resolver([parse_map(m) for m in maps], n_layers)
    folder, files = _scan(dump_dir)
    user_tokens = _load_tokens(tokens, vocab) if tokens else None

    # -- which files: parse every name, load the token fields and the mapped taps ----------------
    recs, skipped, ranks, keys = [], {}, set(), set()
    for fname in files:
        path = os.path.join(folder, fname)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise _Bad("not a regular file (a link, device or pipe); dumps are plain files")
            tags, key = parse_file_name(fname)
            L = int(tags["layer_id"]) if "layer_id" in tags else None
            name = tags["name"]
            tap = None if name in TOKEN_FIELDS else resolve(name, L)
            if tap is not None:
                m = re.fullmatch(r"layers\.(\d+)\..+", tap)
                if m and int(m.group(1)) >= n_layers:
                    raise _Bad(f"maps to {tap}, but the model has {n_layers} layers")
        except _Bad as e:
            raise TraceError(f"{path}: {e}")
        ranks.add(int(tags["rank"]))
        keys.add(key)
        if name not in TOKEN_FIELDS and tap is None:
            skipped[name] = skipped.get(name, 0) + 1
            continue
        recs.append(dict(path=path, file=fname, name=name, tap=tap, layer=L, pass_=int(tags[key]), pass_key=key,
                         index=int(tags["dump_index"])))
    if len(ranks) > 1:
        raise TraceError(f"{folder}: dumps of ranks {sorted(ranks)[:8]}: a multi-rank run holds sharded tensors; "
                         "lockstep imports single-rank dumps (tp = pp = ep = dp = 1)")
    if len(keys) > 1:
        raise TraceError(f"{folder}: file names count passes as {' and '.join(sorted(keys))}: two dumper versions in "
                         "one folder")
    if not any(r["tap"] for r in recs):
        raise TraceError(f"{folder}: none of the {len(files)} dumps maps to a tap (names: "
                         f"{', '.join(sorted(skipped)[:6])}{', …' if len(skipped) > 6 else ''}); see --map")
    passes = {}
    for r in recs:
        p = passes.setdefault(r["pass_"], {"tokens": {}, "taps": {}})
        slot, k = (p["tokens"], r["name"]) if r["tap"] is None else (p["taps"], r["tap"])
        if k in slot:
            raise TraceError(f"{r['path']}: {k} dumped twice in pass {r['pass_']} (also {slot[k]['file']}): which one "
                             "is the forward's is ambiguous")
        slot[k] = r
    for r in recs:
        obj = _torchzip.load(r["path"])
        meta = None
        if isinstance(obj, dict) and "value" in obj:
            meta, obj = obj.get("meta"), obj["value"]
        try:
            _check_meta(meta, r, "the dump")
        except _Bad as e:
            raise TraceError(f"{r['path']}: {e}")
        if r["tap"] is not None and not isinstance(obj, _torchzip.SavedTensor):
            raise TraceError(f"{r['path']}: the dump's value is a {type(obj).__name__}, not a tensor")
        r["value"] = obj

    # -- each pass: its requests, their tokens and positions, the rows of each tap ---------------
    # Each request: id, name, first and next position, tokens {position: id}, rows {tap: [(positions,
    # rows, step)]}, segs [(start, end, step)] (its runs of positions, pass by pass), step_of {position: step}.
    requests = []
    by_rid, slot_req, last_req = {}, {}, None
    steps = []
    max_batch = 1
    for step, pid in enumerate(sorted(passes)):
        p = passes[pid]
        tok = p["tokens"]
        where = f"{folder}: pass {pid}"
        try:
            ids = _ints(tok["input_ids"]["value"], f"{tok['input_ids']['file']}") if "input_ids" in tok else None
            pos = _ints(tok["positions"]["value"], f"{tok['positions']['file']}") if "positions" in tok else None
            token_taps = [t for t in p["taps"] if t != "logits"]
            if ids is not None:
                T = len(ids)
            elif pos is not None:
                T = len(pos)
            elif token_taps:
                t0 = p["taps"][token_taps[0]]["value"]
                T = t0.shape[0] if len(t0.shape) else 1
            else:
                raise _Bad("only logits dumped, and no input_ids or positions: the pass's tokens are unknown")
            if T == 0:
                raise _Bad("a forward pass of no tokens")
            if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab):
                raise _Bad(f"{tok['input_ids']['file']}: token id {int(ids.min() if ids.min() < 0 else ids.max())} is "
                           f"not in [0, {vocab}) (another model's dumps?)")
            if pos is not None and len(pos) and (pos.min() < 0 or pos.max() >= 1 << 31):
                raise _Bad(f"{tok['positions']['file']}: position {int(pos.min() if pos.min() < 0 else pos.max())} "
                           "out of range")
            if ids is not None and pos is not None and len(pos) != T:
                raise _Bad(f"{tok['positions']['file']}: {len(pos)} positions for {T} input_ids")
            if "seq_lens" in tok:
                seq_lens = _ints(tok["seq_lens"]["value"], tok["seq_lens"]["file"])
                if pos is None:
                    raise _Bad("seq_lens dumped without positions: the requests' tokens cannot be told apart")
                segs = _segments(pos, seq_lens, tok["seq_lens"]["file"])
            else:
                if pos is not None and np.any(np.diff(pos) != 1):
                    raise _Bad(f"{tok['positions']['file']}: positions do not run on by one, and no seq_lens tells the "
                               "requests apart")
                segs = [(0, T)]
            B = len(segs)
            rids = _rids(tok["rids"]["value"], tok["rids"]["file"], B) if "rids" in tok else None
            pools = _ints(tok["req_pool_indices"]["value"], tok["req_pool_indices"]["file"], B) \
                if "req_pool_indices" in tok else None
            if B > 1 and rids is None and pools is None:
                raise _Bad(f"{B} requests in one forward, but neither rids nor req_pool_indices was dumped to tell "
                           "them apart across passes")
            rows = {}
            for tap, r in p["taps"].items():
                rows[tap] = _rows(r["value"], r["file"], tap, T, B, _cols(tap, cfg), tap_dtype(tap))
        except _Bad as e:
            raise TraceError(f"{where}: {e}")
        # Router ids ascending (lockstep's order), their weights in the same order.
        for tap in [t for t in rows if t.endswith("ffn.router.topk_ids")]:
            order = np.argsort(rows[tap], axis=1, kind="stable")
            rows[tap] = np.take_along_axis(rows[tap], order, 1)
            wt = tap[:-len("ids")] + "weights"
            if wt in rows and rows[wt].shape == rows[tap].shape:
                rows[wt] = np.take_along_axis(rows[wt], order, 1)
        batch = []
        max_batch = max(max_batch, B)
        for b, (s, e) in enumerate(segs):
            # Which request: by rid, by pool slot (a segment at position 0 starts a new one), or
            # the last one (a pass at position 0 starts the next; without positions: one request).
            start = int(pos[s]) if pos is not None else (last_req["next"] if last_req is not None else 0)
            if rids is not None:
                req = by_rid.get(rids[b])
                if req is None:
                    req = by_rid[rids[b]] = _new_request(requests, rids[b], start)
            elif pools is not None:
                req = slot_req.get(int(pools[b]))
                if req is None or start == 0:
                    name = f"slot{int(pools[b])}.{len(requests)}"
                    req = slot_req[int(pools[b])] = _new_request(requests, name, start)
            else:
                req = last_req if last_req is not None and (pos is None or start != 0) else None
                if req is None:
                    req = _new_request(requests, str(len(requests)), start)
                last_req = req
            if req["next"] is not None and start != req["next"]:
                raise TraceError(f"{where}: request {req['name']} continues at position {start}, but its last pass "
                                 f"ended at {req['next'] - 1}")
            if any(x == req["id"] for x in batch):
                raise TraceError(f"{where}: request {req['name']} twice in one forward")
            positions = np.arange(start, start + (e - s), dtype=np.int64)
            for j, q in enumerate(positions):
                if ids is not None:
                    req["tokens"][int(q)] = int(ids[s + j])
                req["step_of"][int(q)] = step
            req["segs"].append((start, start + (e - s), step))
            req["next"] = start + (e - s)
            for tap, a in rows.items():
                if tap == "logits":
                    req["rows"].setdefault(tap, []).append((positions[-1:], a[b:b + 1], step))
                else:
                    req["rows"].setdefault(tap, []).append((positions, a[s:e], step))
            batch.append(req["id"])
        steps.append((step, batch, T))
    return _write(requests, steps, user_tokens, meta_keys, folder, files, skipped, recs, passes, out,
                  max_batch, logits_topk, source, plugin_path, vocab, keys)


def _new_request(requests, name, start):
    r = dict(id=len(requests), name=name, first=start, next=None, tokens={}, rows={}, segs=[], step_of={})
    requests.append(r)
    return r


def _write(requests, steps, user_tokens, meta_keys, folder, files, skipped, recs, passes, out, max_batch,
           logits_topk, source, plugin_path, vocab, keys):
    if user_tokens is not None and len(user_tokens) != len(requests):
        raise TraceError(f"--tokens: {len(user_tokens)} requests, the dumps hold {len(requests)}")
    notes, plan = [], []
    full_logits = vocab <= 4096
    for i, r in enumerate(requests):
        last = r["next"] - 1
        known = r["tokens"]
        if user_tokens is not None:
            prompt, gen = list(user_tokens[i][0]), list(user_tokens[i][1])
            seq = prompt + gen
            if len(seq) - 2 < last:
                raise TraceError(f"--tokens: request {i} has {len(seq)} tokens, but the dumps reach position {last} "
                                 f"(a trace of P prompt and G generated tokens has rows up to P + G − 2)")
            for q, t in known.items():
                if seq[q] != t:
                    raise TraceError(f"--tokens: request {i} has token {seq[q]} at position {q}, the dumped input_ids "
                                     f"{t}")
            final_from = "--tokens"
        else:
            if r["first"] != 0:
                raise TraceError(f"{folder}: request {r['name']} starts at position {r['first']} (its prefix came from "
                                 "sglang's radix cache or passes not dumped): give its tokens with --tokens")
            if len(known) != r["next"]:
                raise TraceError(f"{folder}: request {r['name']}: no input_ids dumped; give its tokens with --tokens")
            # The prompt: the first segment and the multi-token segments that follow it (chunked prefill).
            segs = r["segs"]
            P = segs[0][1]
            for s, e, _ in segs[1:]:
                if e - s > 1 and s == P:
                    P = e
                else:
                    break
            seq = [known[q] for q in range(r["next"])]
            prompt, gen = seq[:P], seq[P:]
            lg = r["rows"].get("logits")
            if lg and int(lg[-1][0][-1]) == last:
                final, final_from = int(np.argmax(lg[-1][1][-1])), "argmax of the dumped logits"
            else:
                final, final_from = 0, "unknown: 0 written"
            gen.append(final)
        plan.append((r, prompt, gen, final_from))
        if final_from != "--tokens":
            notes.append(f"request {r['name']}: the last generated token ({gen[-1]}) is fed nowhere, so no row depends "
                         f"on it: {final_from}")
    taps = sorted({t for r in requests for t in r["rows"]})
    k = min(int(logits_topk), vocab)
    w = TraceWriter(out, plugin_path=plugin_path, writer="lockstep-python 0.1.0 import sglang",
                    batch_width=max(1, max_batch))
    for key, v in meta_keys.items():
        w.set_meta(key, v)
    fmt = {"step": "step=… files of {value, meta}", "curr_step": "curr_step=… files",
           "forward_pass_id": "forward_pass_id=… files"}[next(iter(keys))]
    w.set_meta("source", source or f"sglang dumper ({fmt}): {os.path.basename(folder)}, {len(passes)} forward passes")
    w.set_meta("import_dir", os.path.abspath(folder))
    w.set_meta("import_names", json.dumps({r["name"]: r["tap"] for r in recs if r["tap"]}, sort_keys=True))
    w.set_meta("import_notes", json.dumps(notes))
    w.set_meta("capture_policy", capture_policy(taps, "full" if full_logits else "topk", k))
    w.set_meta("engine_options", engine_options(max_batch=max(1, min(max_batch, 64))))
    w.set_meta("kv_cache_format", "unknown (imported)")
    w.set_meta("backend", "sglang (imported)")
    prompt_rows = False
    for t in taps:
        if t == "logits":
            if full_logits:
                w.define_tensor("taps/logits", "f32", vocab)
            else:
                w.define_tensor("taps/logits.topk_ids", "i32", k, attrs={"of": "logits"})
                w.define_tensor("taps/logits.topk_values", "f32", k, attrs={"of": "logits"})
                w.define_tensor("taps/logits.logsumexp", "f32", 1, attrs={"of": "logits"})
            continue
        cols = {a.shape[1] for r in requests for (_, a, _) in r["rows"].get(t, [])}
        if len(cols) != 1:
            raise TraceError(f"{folder}: {t}: rows of {sorted(cols)} values in different passes")
        w.define_tensor("taps/" + t, tap_dtype(t), cols.pop())
    rows_total = 0
    for r, prompt, gen, _ in plan:
        rid = r["id"]
        P = len(prompt)
        w.add_request(rid, prompt, name=r["name"], max_new_tokens=len(gen), temperature=0.0)
        for t in taps:
            for positions, a, step in r["rows"].get(t, []):
                rows_total += len(a)
                if t != "logits":
                    w.append("taps/" + t, a, rid, positions, step)
                    continue
                if int(positions[0]) < P - 1:
                    prompt_rows = True
                if full_logits:
                    w.append("taps/logits", a, rid, positions, step)
                    continue
                v = a[0]
                order = np.lexsort((np.arange(len(v)), -v))[:k]  # descending, ties to the lower id
                m = float(np.max(v))
                lse = np.float32(m + math.log(float(np.exp(v.astype(np.float64) - m).sum())))
                w.append("taps/logits.topk_ids", order.astype(np.int32)[None], rid, positions, step)
                w.append("taps/logits.topk_values", v[order][None], rid, positions, step)
                w.append("taps/logits.logsumexp", np.array([[lse]], np.float32), rid, positions, step)
        logit_at = {int(q[0]): a[0] for q, a, _ in r["rows"].get("logits", [])}
        for i, t in enumerate(gen):
            q = P - 1 + i
            prob = 0.0
            if q in logit_at:
                x = logit_at[q].astype(np.float64)
                prob = float(np.exp(x[t] - x.max()) / np.exp(x - x.max()).sum())
            w.append_sampling(rid, t, i, r["step_of"].get(q, steps[-1][0]), probability=prob, temperature=0.0,
                              finished=1 if i == len(gen) - 1 else 0)
        w.finish_request(rid, gen, "", "length")
    for step, batch, T in steps:
        w.append_step(step, batch, tokens=T)
    w.set_meta("import_prompt_logprobs", "1" if prompt_rows else "0")
    w.close()
    return {"output": out, "folder": folder, "requests": len(requests), "passes": len(passes),
            "files": len(files), "files_read": len(recs), "taps": len(taps), "rows": rows_total,
            "tokens": sum(len(g) for _, _, g, _ in plan), "names": {r["name"]: r["tap"] for r in recs if r["tap"]},
            "skipped_names": skipped, "notes": notes}
