"""lockstep/model.py — what a trace's /meta says about its model, computed from the checkpoint
folder exactly as lockstep's recorder does (recorder/fingerprint.cc), so that `lockstep replay`
accepts a trace written from Python: model_dir, model_config (config.json verbatim),
model_fingerprint (XXH3-64 of every *.safetensors, in file-name order, as one stream) and
tokenizer_hash (XXH3-64 of tokenizer.json, or "none")."""
import json
import os

import xxhash

from ._format import TraceError


def _hex(h):
    return f"xxh3-64:{h:016x}"


def fingerprint(model_dir):
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")
                   and os.path.isfile(os.path.join(model_dir, f)))
    if not files:
        raise TraceError(f"{model_dir}: no *.safetensors to fingerprint")
    h = xxhash.xxh3_64()
    for name in files:  # byte order of std::sort over paths of one folder = file-name order
        with open(os.path.join(model_dir, name), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return _hex(h.intdigest())


def model_meta(model_dir):
    """The /meta keys of a model folder (raises TraceError naming the folder when it is not one)."""
    model_dir = os.path.abspath(model_dir)
    cfg_path = os.path.join(model_dir, "config.json")
    try:
        cfg_text = open(cfg_path, encoding="utf-8").read()
        cfg = json.loads(cfg_text)
    except OSError as e:
        raise TraceError(f"{cfg_path}: cannot read ({e.strerror})")
    except ValueError as e:
        raise TraceError(f"{cfg_path}: not JSON ({e})")
    tok = os.path.join(model_dir, "tokenizer.json")
    tok_hash = _hex(xxhash.xxh3_64_intdigest(open(tok, "rb").read())) if os.path.exists(tok) else "none"
    return {"model_dir": model_dir, "model_config": cfg_text, "model_fingerprint": fingerprint(model_dir),
            "tokenizer_hash": tok_hash}, cfg


def capture_policy(taps, logits="topk", k=32, kv=False, mode="full"):
    """meta.capture_policy as lockstep record writes it; a replay captures the same."""
    big = 2**63 - 1
    return json.dumps({"full_logits_max_vocab": 4096, "kv": kv, "layers": [0, big], "logits": logits,
                       "logits_topk": int(k), "mode": mode, "position_stride": 1, "positions": [0, big],
                       "taps": list(taps)}, separators=(",", ":"))


def engine_options(kv_cache="fp32", max_batch=8):
    """meta.engine_options for a trace that no lockstep engine made: the reference configuration
    (fp32 cache, registry-default kernels, CPU) — what a replay of it runs unless overridden."""
    return json.dumps({"backend": "cpu", "cuda_graphs": True, "device_sampler": False, "fault": "", "kernels": {},
                       "kv_cache": kv_cache, "kv_cache_tokens": 65536, "max_batch": max_batch,
                       "max_prefill_tokens": 0, "overlapped_launch": True, "page_size": 64, "side_stream": True},
                      separators=(",", ":"))
