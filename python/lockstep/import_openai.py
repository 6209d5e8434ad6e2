"""lockstep/import_openai.py — a trace from the token ids and logprobs that an OpenAI-compatible
server returned (vLLM, sglang, lockstep serve), so that `lockstep replay imported.h5 --mode
forced` runs lockstep's reference teacher-forced on exactly those tokens and compares its
distributions with the server's.

    python3 -m lockstep import openai responses.jsonl -m MODEL_DIR -o imported.h5

Input: one JSON object, a JSON array of them, or JSONL (one a line). Each object is a
/v1/completions response (its "choices"), or {"request": {...}, "response": {...}} (the request
supplies the prompt as token ids and the sampling parameters), or sglang's native /generate
answer ({"text", "meta_info"}) with its request beside it. Each choice becomes one request.

What is read, per choice (docs/python.md has the table):
  prompt ids      choice.prompt_token_ids (vLLM, return_token_ids), else request.prompt as ids
                  (or request.input_ids, sglang)
  generated ids   choice.token_ids (vLLM), else logprobs.tokens as "token_id:N"
                  (return_tokens_as_token_ids: vLLM, lockstep serve), else sglang's
                  meta_info.output_token_logprobs [logprob, id, text]
  per token       token_logprobs[i] and top_logprobs[i] {"token_id:N": logprob} (or sglang's
                  output_top_logprobs), k = the smallest number of alternatives any token has
  prompt          vLLM prompt_logprobs [None, {id: {logprob, rank}}, …], sglang
                  input_token_logprobs / input_top_logprobs: the rows at prompt positions

Logprobs become the trace's top-k logits rows: taps/logits.topk_ids / .topk_values (the
logprobs, descending, ties to the lower id) / .logsumexp (0: logprobs are already
normalised), at position P − 1 + i for generated token i (the row that predicted it), and
at j − 1 for prompt token j. The chosen token's probability goes to its SamplingRow.
meta.source says where the trace came from; meta.capture_policy asks a replay for the same
top-k of the logits (logits at every prompt position when prompt logprobs were imported).
Text without ids is refused: the same piece can be several tokens.
"""
import json
import math
import os
import re

import numpy as np

from ._format import TraceError
from .model import capture_policy, engine_options, model_meta
from .writer import TraceWriter

_ID = re.compile(r"^token_id:(-?\d+)$")


class _Bad(Exception):
    pass


def read_records(path):
    """The JSON objects of FILE: one object, an array, or JSONL. Yields (where, object)."""
    try:
        raw = open(path, "rb").read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})")
    if len(raw) > 1 << 31:
        raise TraceError(f"{path}: {len(raw)} bytes, more than an import reads (2 GiB)")
    try:
        txt = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text (byte {e.start})")
    try:
        whole = json.loads(txt)
        items = whole if isinstance(whole, list) else [whole]
        return [(f"{path}: record {i}" if isinstance(whole, list) else path, o) for i, o in enumerate(items)]
    except ValueError:
        pass
    out = []
    for n, line in enumerate(txt.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}: line {n}", json.loads(line)))
        except ValueError as e:
            raise TraceError(f"{path}: line {n}: not JSON ({e.msg} at column {e.colno})")
    if not out:
        raise TraceError(f"{path}: no JSON records")
    return out


def _token_id(s, vocab, field):
    if isinstance(s, bool):
        raise _Bad(f"{field}: {s!r} is not a token id")
    if isinstance(s, int):
        t = s
    elif isinstance(s, str) and _ID.match(s):
        t = int(_ID.match(s).group(1))
    elif isinstance(s, str) and s.lstrip("-").isdigit():
        t = int(s)  # JSON object keys of vLLM's prompt_logprobs: ids as strings
    else:
        raise _Bad(f"{field}: {s!r} is text, not a token id (ask the server for ids: return_tokens_as_token_ids, "
                   "return_token_ids)")
    if not 0 <= t < vocab:
        raise _Bad(f"{field}: token id {t} is not in [0, {vocab})")
    return t


def _logprob(v, field):
    if isinstance(v, dict):  # vLLM's Logprob object
        v = v.get("logprob")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(f"{field}: {v!r} is not a logprob")
    v = float(v)
    if math.isnan(v) or v > 1e-3:
        raise _Bad(f"{field}: {v} is not a log-probability (≤ 0)")
    return v


def _top(entries, vocab, field):
    """[(id, logprob)] of one position, descending, ties to the lower id."""
    out = {}
    if isinstance(entries, dict):
        items = list(entries.items())
    elif isinstance(entries, list):  # sglang: [[logprob, id, text], …]
        items = []
        for j, e in enumerate(entries):
            if not isinstance(e, (list, tuple)) or len(e) < 2:
                raise _Bad(f"{field}[{j}]: expected [logprob, token_id, text]")
            items.append((e[1], e[0]))
    else:
        raise _Bad(f"{field}: expected an object or a list, got {type(entries).__name__}")
    for key, lp in items:
        out[_token_id(key, vocab, field)] = _logprob(lp, f"{field}[{key!r}]")
    return sorted(out.items(), key=lambda x: (-x[1], x[0]))


def _ids(v, vocab, field):
    if not isinstance(v, list) or not v:
        raise _Bad(f"{field}: expected a non-empty list of token ids")
    return [_token_id(t, vocab, f"{field}[{i}]") for i, t in enumerate(v)]


def parse_choice(choice, request, vocab, where):
    """One choice → dict(prompt, generated, chosen logprobs, top lists, prompt tops, text, reason)."""
    if not isinstance(choice, dict):
        raise _Bad("is not an object")
    meta = choice.get("meta_info") if isinstance(choice.get("meta_info"), dict) else None
    lp = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else None
    req = request if isinstance(request, dict) else {}
    # Prompt ids.
    if choice.get("prompt_token_ids") is not None:
        prompt = _ids(choice["prompt_token_ids"], vocab, "prompt_token_ids")
    elif isinstance(req.get("prompt"), list) and req["prompt"] and isinstance(req["prompt"][0], int):
        prompt = _ids(req["prompt"], vocab, "request.prompt")
    elif isinstance(req.get("input_ids"), list):
        prompt = _ids(req["input_ids"], vocab, "request.input_ids")
    else:
        raise _Bad("no prompt token ids (vLLM: send return_token_ids for prompt_token_ids; or pair the response "
                   "with its request, {\"request\": …, \"response\": …}, whose prompt is a list of token ids)")
    # Generated ids, their logprobs and alternatives.
    tops, chosen = None, None
    if lp is not None:
        toks, tlp, tops_raw = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
        if not isinstance(toks, list) or not isinstance(tlp, list) or not isinstance(tops_raw, list):
            raise _Bad("logprobs: expected tokens, token_logprobs and top_logprobs lists (ask with logprobs: N ≥ 1)")
        if not (len(toks) == len(tlp) == len(tops_raw)):
            raise _Bad(f"logprobs: {len(toks)} tokens, {len(tlp)} token_logprobs, {len(tops_raw)} top_logprobs")
        if req.get("echo"):  # echoed prompt first (its first logprob is null)
            toks, tlp, tops_raw = toks[len(prompt):], tlp[len(prompt):], tops_raw[len(prompt):]
        if choice.get("token_ids") is not None:
            gen = _ids(choice["token_ids"], vocab, "token_ids")
        else:
            gen = _ids(toks, vocab, "logprobs.tokens")
        if len(gen) != len(toks):
            raise _Bad(f"token_ids has {len(gen)} tokens, logprobs {len(toks)}")
        chosen = [_logprob(v, f"logprobs.token_logprobs[{i}]") for i, v in enumerate(tlp)]
        tops = []
        for i, t in enumerate(tops_raw):
            if t is None:
                raise _Bad(f"logprobs.top_logprobs[{i}] is null (ask with logprobs: N ≥ 1)")
            tops.append(_top(t, vocab, f"logprobs.top_logprobs[{i}]"))
    elif meta is not None and isinstance(meta.get("output_token_logprobs"), list):
        out_lp = meta["output_token_logprobs"]
        gen = [_token_id(e[1] if isinstance(e, list) and len(e) >= 2 else None, vocab,
                         f"meta_info.output_token_logprobs[{i}]") for i, e in enumerate(out_lp)]
        chosen = [_logprob(e[0], f"meta_info.output_token_logprobs[{i}]") for i, e in enumerate(out_lp)]
        top_raw = meta.get("output_top_logprobs")
        if not isinstance(top_raw, list) or len(top_raw) != len(gen):
            raise _Bad("meta_info.output_top_logprobs: expected one list per token (ask with top_logprobs_num ≥ 1)")
        tops = [_top(t, vocab, f"meta_info.output_top_logprobs[{i}]") for i, t in enumerate(top_raw)]
    else:
        raise _Bad("no logprobs (ask with logprobs: N ≥ 1, and token ids: return_tokens_as_token_ids)")
    if not gen:
        raise _Bad("no generated tokens")
    for i, (t, top) in enumerate(zip(gen, tops)):
        if not top:
            raise _Bad(f"token {i}: no alternatives in top_logprobs (ask with logprobs: N ≥ 1)")
    # Prompt logprobs: the row at position j − 1 predicted prompt token j.
    prompt_tops = {}
    plp = choice.get("prompt_logprobs")
    if isinstance(plp, list):
        if len(plp) != len(prompt):
            raise _Bad(f"prompt_logprobs has {len(plp)} entries for a prompt of {len(prompt)} tokens")
        for j in range(1, len(plp)):
            if plp[j] is not None:
                prompt_tops[j - 1] = _top(plp[j], vocab, f"prompt_logprobs[{j}]")
    elif meta is not None and isinstance(meta.get("input_top_logprobs"), list):
        itop = meta["input_top_logprobs"]
        if len(itop) != len(prompt):
            raise _Bad(f"meta_info.input_top_logprobs has {len(itop)} entries for a prompt of {len(prompt)} tokens")
        for j in range(1, len(itop)):
            if itop[j]:
                prompt_tops[j - 1] = _top(itop[j], vocab, f"meta_info.input_top_logprobs[{j}]")
    reason = choice.get("finish_reason") or (meta.get("finish_reason", {}).get("type") if meta and
                                             isinstance(meta.get("finish_reason"), dict) else None) or "other"
    text = choice.get("text") if isinstance(choice.get("text"), str) else ""
    return dict(prompt=prompt, generated=gen, chosen=chosen, tops=tops, prompt_tops=prompt_tops, text=text,
                reason=str(reason))


def _choices(obj):
    """(request, [choices], server) of one record."""
    if not isinstance(obj, dict):
        raise _Bad("is not a JSON object")
    req, resp = None, obj
    if "response" in obj:
        req, resp = obj.get("request"), obj["response"]
        if not isinstance(resp, dict):
            raise _Bad("response: not an object")
    if "error" in resp and "choices" not in resp:
        raise _Bad(f"is an error response ({str(resp['error'])[:80]})")
    if isinstance(resp.get("choices"), list):
        if not resp["choices"]:
            raise _Bad("choices: empty")
        return req, resp["choices"], resp
    if "meta_info" in resp:  # sglang /generate: the answer is itself the choice
        return req, [resp], resp
    raise _Bad("neither a completions response (choices) nor sglang's /generate answer (meta_info)")


def _guess_source(resp):
    if "meta_info" in resp:
        return "sglang /generate"
    if isinstance(resp.get("choices"), list) and resp["choices"]:
        c = resp["choices"][0]
        if isinstance(c, dict) and "stop_reason" in c:  # vLLM's choices always carry it (null or the stop)
            return "vllm /v1/completions"
        if isinstance(c, dict) and "matched_stop" in c:  # sglang's
            return "sglang /v1/completions"
    fp = str(resp.get("system_fingerprint") or "")
    return "lockstep serve /v1/completions" if fp.startswith("lockstep") else "openai-compatible /v1/completions"


def import_openai(path, model_dir, out, source=None, plugin_path=None):
    """Writes the trace `out`; returns a summary dict (requests, tokens, k, prompt rows)."""
    meta, cfg = model_meta(model_dir)
    vocab = int(cfg.get("vocab_size", 0))
    if vocab <= 0:
        raise TraceError(f"{model_dir}/config.json: vocab_size missing")
    parsed, srcs = [], set()
    for where, obj in read_records(path):
        try:
            req, choices, resp = _choices(obj)
            srcs.add(_guess_source(resp))
            for ci, ch in enumerate(choices):
                try:
                    p = parse_choice(ch, req, vocab, where)
                except _Bad as e:
                    raise _Bad(f"choices[{ci}]: {e}")
                p["request"] = req if isinstance(req, dict) else {}
                p["name"] = f"{resp.get('id', 'r%d' % len(parsed))}.{ci}" if isinstance(resp.get("id"), str) else str(len(parsed))
                parsed.append(p)
        except _Bad as e:
            raise TraceError(f"{where}: {e}")
    k = min(len(t) for p in parsed for t in p["tops"] + list(p["prompt_tops"].values()))
    any_prompt = any(p["prompt_tops"] for p in parsed)
    w = TraceWriter(out, plugin_path=plugin_path, writer="lockstep-python 0.1.0 import openai",
                    batch_width=max(1, len(parsed)))
    for key, v in meta.items():
        w.set_meta(key, v)
    w.set_meta("source", source or " + ".join(sorted(srcs)))
    w.set_meta("import_file", os.path.abspath(path))
    w.set_meta("capture_policy", capture_policy(["logits"], "topk", k))
    w.set_meta("engine_options", engine_options(max_batch=max(1, min(len(parsed), 8))))
    w.set_meta("kv_cache_format", "unknown (imported)")
    w.set_meta("backend", "unknown (imported)")
    w.set_meta("import_prompt_logprobs", "1" if any_prompt else "0")
    w.define_tensor("taps/logits.topk_ids", "i32", k, attrs={"of": "logits"})
    w.define_tensor("taps/logits.topk_values", "f32", k, attrs={"of": "logits"})
    w.define_tensor("taps/logits.logsumexp", "f32", 1, attrs={"of": "logits"})
    tokens = 0
    for rid, p in enumerate(parsed):
        r = p["request"]
        num = lambda key, d, lo, hi: float(r[key]) if isinstance(r.get(key), (int, float)) and not isinstance(
            r.get(key), bool) and lo <= float(r[key]) <= hi else d
        temp = num("temperature", 1.0, 0, 1e6)
        seed = int(r["seed"]) if isinstance(r.get("seed"), int) and r["seed"] >= 0 else 0
        top_k = int(num("top_k", 0, 0, 1 << 26)) if num("top_k", 0, -1, 1 << 26) >= 0 else 0
        w.add_request(rid, p["prompt"], name=p["name"], max_new_tokens=len(p["generated"]), seed=seed,
                      temperature=temp, top_p=num("top_p", 1.0, 0, 1), min_p=num("min_p", 0.0, 0, 1), top_k=top_k)
        P = len(p["prompt"])
        rows = sorted(p["prompt_tops"].items()) + [(P - 1 + i, t) for i, t in enumerate(p["tops"])]
        for pos, top in rows:
            step = 0 if pos < P - 1 else pos - (P - 1)
            top = top[:k]
            w.append("taps/logits.topk_ids", np.array([[t for t, _ in top]], np.int32), rid, [pos], step)
            w.append("taps/logits.topk_values", np.array([[v for _, v in top]], np.float32), rid, [pos], step)
            w.append("taps/logits.logsumexp", np.zeros((1, 1), np.float32), rid, [pos], step)
        for i, (t, lp) in enumerate(zip(p["generated"], p["chosen"])):
            w.append_sampling(rid, t, i, i, seed=seed, probability=math.exp(lp), temperature=temp,
                              finished=(2 if p["reason"] == "stop" else 1 if p["reason"] == "length" else 3)
                              if i == len(p["generated"]) - 1 else 0)
        w.finish_request(rid, p["generated"], p["text"], p["reason"])
        tokens += len(p["generated"])
    for s in range(max(len(p["generated"]) for p in parsed)):
        batch = [rid for rid, p in enumerate(parsed) if s < len(p["generated"])]
        w.append_step(s, batch, tokens=len(batch))
    w.close()
    return {"requests": len(parsed), "tokens": tokens, "k": k, "prompt_rows": sum(len(p["prompt_tops"]) for p in parsed),
            "source": source or " + ".join(sorted(srcs)), "output": out}
