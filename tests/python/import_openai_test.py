#!/usr/bin/python3
"""tests/python/import_openai_test.py — `python3 -m lockstep import openai` end to end.

1. lockstep's own server: `lockstep serve` on models/lockstep-tiny-v32, /v1/completions with
   logprobs (greedy and sampled, return_tokens_as_token_ids, return_token_ids), imported and
   replayed teacher-forced on the same model: every position's most likely token agrees and the
   KL is zero up to the float rounding of the replay's logsumexp (the server takes it in double:
   |KL| ≤ 2 ulp of the float lse, 2^-22·|lse|). Replayed with --kv-cache fp8_e4m3, the per-position KLs equal
   those of a `lockstep record` of the same requests (top-k of the same size) replayed with
   --kv-cache fp8_e4m3 — the import measures what replay measures.
2. vLLM's and sglang's response shapes (prompt_token_ids/token_ids/"token_id:N" keys/
   prompt_logprobs; meta_info output_token_logprobs/output_top_logprobs/input_top_logprobs),
   made from transformers' own logits of a fixture model (reference.safetensors: every prompt
   and decode position): the imported rows hold exactly their log-softmax top-k, and the forced
   replay on lockstep's reference compares every generated and prompt position (prompt logits
   are replayed when the import has them) with 100 % top-1 agreement, KL below 1e-6 and the
   chosen token's probability known.
3. Bad input: one line naming the file and the field, exit 1, never a traceback.

Usage: import_openai_test.py LOCKSTEP PLUGIN_DIR WORK_DIR SOURCE_DIR
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np

LOCKSTEP, PLUGIN, WORK, SRC = sys.argv[1:5]
sys.path.insert(0, os.path.join(SRC, "python"))
os.environ["HDF5_PLUGIN_PATH"] = PLUGIN
os.environ["PYTHONPATH"] = os.path.join(SRC, "python")
import lockstep  # noqa: E402

TINY = os.path.join(SRC, "models", "lockstep-tiny-v32")
FIX = os.path.join(SRC, "tests", "fixtures", "models", "v3_basic")
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
failures = []


def check(cond, what):
    print(("ok: " if cond else "FAIL: ") + what)
    if not cond:
        failures.append(what)


def run(*args, ok=(0,)):
    p = subprocess.run([LOCKSTEP, *args], capture_output=True, text=True)
    if p.returncode not in ok:
        raise SystemExit(f"lockstep {' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-400:]}")
    return p


def imp(src, model, out, ok=(0,), via_python=False):
    """`lockstep import openai` (the binary runs the package of its checkout), or the package's own
    `python3 -m lockstep import openai`."""
    cmd = [sys.executable, "-m", "lockstep"] if via_python else [LOCKSTEP]
    p = subprocess.run([*cmd, "import", "openai", src, "-m", model, "-o", out, "--json"],
                       capture_output=True, text=True)
    if p.returncode not in ok:
        raise SystemExit(f"import {src} exited {p.returncode}: {p.stderr.strip()[-400:]}")
    return p


def replay_json(trace, *extra):
    out = trace.replace(".h5", ".rep%d.h5" % len(extra))
    p = run("replay", trace, "--mode", "forced", "-o", out, "--json", *extra, ok=(0, 3))
    return json.loads(p.stdout), out


def position_kls(rep):
    """{(request, position): (kl, top1_agree)} of a replay --json report's logits rows."""
    out = {}
    for row in rep.get("diff", rep)["logits_all"]:
        out[(row["request"], row["position"])] = (row["kl"], row["top1_agree"], row.get("chosen_prob_a"))
    return out


# -- 1. lockstep serve -------------------------------------------------------------------------
log = open(os.path.join(WORK, "serve.log"), "w")
srv = subprocess.Popen([LOCKSTEP, "serve", "-m", TINY, "--port", "0", "--admin-port", "0", "--no-record"],
                       stderr=log, stdout=subprocess.DEVNULL)
port = None
for _ in range(300):
    m = re.search(r"API on http://[0-9.]+:(\d+)", open(log.name).read())
    if m:
        port = int(m.group(1))
        break
    if srv.poll() is not None:
        break
    time.sleep(0.1)
if port is None:
    raise SystemExit("lockstep serve did not start: " + open(log.name).read()[-400:])
requests = [
    {"prompt": [1, 17, 200, 31, 9, 44], "max_tokens": 10, "temperature": 0, "logprobs": 5},
    {"prompt": [1, 90, 12, 5], "max_tokens": 12, "temperature": 0, "logprobs": 5},
    {"prompt": [1, 300, 301, 302, 8], "max_tokens": 10, "temperature": 0.9, "seed": 7, "logprobs": 5},
]
pairs = []
try:
    for r in requests:
        body = dict(r, model="m", return_tokens_as_token_ids=True, return_token_ids=True, ignore_eos=True)
        q = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"})
        resp = json.loads(urllib.request.urlopen(q, timeout=60).read())
        pairs.append({"request": body, "response": resp})
finally:
    srv.terminate()
    srv.wait(timeout=30)
c0 = pairs[0]["response"]["choices"][0]
check(all(re.fullmatch(r"token_id:\d+", t) for t in c0["logprobs"]["tokens"]), "serve: return_tokens_as_token_ids")
check(c0["token_ids"] == [int(t.split(":")[1]) for t in c0["logprobs"]["tokens"]] and
      c0["prompt_token_ids"] == requests[0]["prompt"], "serve: return_token_ids")
src = os.path.join(WORK, "serve.jsonl")
with open(src, "w") as fp:
    for p in pairs:
        fp.write(json.dumps(p) + "\n")
imported = os.path.join(WORK, "serve.h5")
info = json.loads(imp(src, TINY, imported).stdout)
check(info["requests"] == 3 and info["k"] == 5 and info["tokens"] == 32, f"import: {info}")
t = lockstep.open_trace(imported)
check(t.meta["source"].startswith("openai-compatible") or "lockstep" in t.meta["source"], f"meta.source {t.meta['source']}")
for rid, p in enumerate(pairs):
    ch = p["response"]["choices"][0]
    r = t.requests[rid]
    check(list(r.prompt) == p["request"]["prompt"] and list(r.generated) == ch["token_ids"], f"request {rid}: tokens")
    lg = t.logits(rid)
    P = len(r.prompt)
    check(list(lg["positions"]) == list(range(P - 1, P - 1 + len(r.generated))), f"request {rid}: logits positions")
    for i, top in enumerate(ch["logprobs"]["top_logprobs"]):
        want = sorted(((int(k.split(":")[1]), v) for k, v in top.items()), key=lambda x: (-x[1], x[0]))
        ok = list(lg["ids"][i]) == [a for a, _ in want] and np.array_equal(lg["values"][i], np.float32([b for _, b in want]))
        if not ok:
            check(False, f"request {rid} token {i}: imported top-k differs from the response")
            break
    s = t.sampling()
    s = s[s["request"] == rid]
    check(np.allclose(s["probability"], np.exp(ch["logprobs"]["token_logprobs"]), rtol=1e-12), f"request {rid}: chosen p")
t.close()

rep, rep_path = replay_json(imported)
diff = rep.get("diff", rep)
lg = diff["logit_summary"]
lse_max = max(abs(float(x)) for x in lockstep.open_trace(rep_path).values("logits.logsumexp")[:, 0])
bound = 2.0**-22 * lse_max  # two float ulps of the logsumexp (lockstep's is within 1.2 ulp)
print(f"serve import, forced replay on the same model: {lg['rows']} positions, mean KL {lg['mean_kl']:.3g}, "
      f"max {lg['max_kl']:.3g} (bound {bound:.3g}), same top p {lg['same_top_pct']}%")
check(lg["rows"] == 32 and lg["same_top_pct"] == 100.0 and lg["top1_flips"] == 0, "serve import: 100 % top-1")
check(abs(lg["max_kl"]) <= bound and abs(lg["mean_kl"]) <= bound, "serve import: KL 0 up to the lse rounding")
check(set(lg["kl_percentiles"]) == {"min", "1", "5", "10", "50", "90", "95", "99", "99.9"}, "llama.cpp percentiles")
check(not diff["missing"], f"serve import: nothing missing ({diff['missing'][:2]})")


def check_summary(rep, what):
    """logit_summary recomputed here from the per-position rows (logits_all): nearest-rank KL
    percentiles, same-top share, the chosen token's mean p and Δp."""
    d = rep.get("diff", rep)
    rows, ls = d["logits_all"], d["logit_summary"]
    kls = sorted(r["kl"] for r in rows)
    rank = lambda q: kls[min(len(kls) - 1, max(0, math.ceil(q * len(kls)) - 1))]
    want = {"min": kls[0], "1": rank(0.01), "5": rank(0.05), "10": rank(0.1), "50": rank(0.5), "90": rank(0.9),
            "95": rank(0.95), "99": rank(0.99), "99.9": rank(0.999)}
    ch = [(r["chosen_prob_a"], r["chosen_prob_b"]) for r in rows if r["chosen_prob_a"] is not None]
    ok = (ls["rows"] == len(rows) and all(math.isclose(ls["kl_percentiles"][k], v, rel_tol=1e-12, abs_tol=1e-300)
                                          for k, v in want.items())
          and math.isclose(ls["same_top_pct"], 100.0 * sum(r["top1_agree"] for r in rows) / len(rows))
          and math.isclose(ls["mean_kl"], sum(kls) / len(kls), rel_tol=1e-9, abs_tol=1e-15)
          and ls["chosen_rows"] == len(ch))
    if ch:
        ok = ok and math.isclose(ls["mean_dp"], sum(b - a for a, b in ch) / len(ch), rel_tol=1e-9, abs_tol=1e-15)
    check(ok, f"{what}: logit_summary = the figures recomputed from logits_all ({ls['kl_percentiles']} vs {want})")


check_summary(rep, "serve import")

# diff prints llama.cpp's figures, and does not call logprobs and logits "identical".
d = run("diff", imported, rep_path, ok=(0, 3))
check("identical: every row" not in d.stdout and "same top p 100.000%" in d.stdout and "KL percentiles" in d.stdout,
      f"diff text: {d.stdout[-400:]}")
v = subprocess.run([sys.executable, "-m", "lockstep", "verify", imported], capture_output=True, text=True)
check(v.returncode == 0 and "match their content hashes" in v.stdout, f"python3 -m lockstep verify: {v.stdout}{v.stderr}")

# The same KL as replay --kv-cache fp8_e4m3 of a recording of the same requests.
rep8, _ = replay_json(imported, "--kv-cache", "fp8_e4m3")
kl_imp = position_kls(rep8)
check_summary(rep8, "serve import, fp8 replay")
prompts = os.path.join(WORK, "same.jsonl")
with open(prompts, "w") as fp:
    for r in requests:
        fp.write(json.dumps({"prompt_ids": r["prompt"], "max_tokens": r["max_tokens"], "temperature": r["temperature"],
                             "seed": r.get("seed", 0)}) + "\n")
rec = os.path.join(WORK, "record.h5")
run("record", "-m", TINY, "--prompts", prompts, "--taps", "logits", "--no-kv", "--logits", "topk", "--logits-topk", "5",
    "--ignore-eos", "--no-special-tokens", "-q", "-o", rec)
rt = lockstep.open_trace(rec)
same_tokens = all(list(rt.requests[i].generated) == pairs[i]["response"]["choices"][0]["token_ids"] for i in range(2))
check(same_tokens, "record reproduces the server's greedy tokens")
rec8, _ = replay_json(rec, "--kv-cache", "fp8_e4m3")
kl_rec = position_kls(rec8)
worst = 0.0
for key in kl_rec:
    if key[0] >= 2:  # the sampled request: record draws its own tokens
        continue
    a, b = kl_imp.get(key), kl_rec[key]
    if a is None:
        check(False, f"fp8: position {key} missing from the import's replay")
        continue
    # The two replays' a-sides differ by the rounding of the reference's log-softmax (the server
    # takes logit − lse in double, the recording stores logits and a float lse): ~1e-7 per logprob.
    worst = max(worst, abs(a[0] - b[0]) - 1e-3 * b[0])
    if a[1] != b[1]:
        check(False, f"fp8: top-1 agreement differs at {key}")
print(f"fp8: import vs record replays, {len([k for k in kl_rec if k[0] < 2])} positions, worst KL difference "
      f"beyond 1e-3 relative {worst:.3g}; mean KL import {rep8.get('diff', rep8)['logit_summary']['mean_kl']:.4g}")
check(worst <= 1e-6 and rep8.get("diff", rep8)["logit_summary"]["mean_kl"] > 0, "fp8: the import reports the same KL as record")

# -- 2. vLLM and sglang shapes, with prompt logprobs --------------------------------------------
def safetensors(path):
    """{name: array} of a .safetensors file (little-endian; the dtypes this fixture uses)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    types = {"F32": "<f4", "I64": "<i8"}
    return {k: np.frombuffer(raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]],
                             dtype=types[v["dtype"]]).reshape(v["shape"]) for k, v in head.items() if k != "__metadata__"}


# transformers' own logits of the fixture (tests/fixtures/models/*/reference.safetensors, made by
# transformers 5.17 in fp32): prefill_logits[p] predicts prompt token p + 1 (and, last, the
# first decode token); decode_logits[i] is the row that chose decode_ids[i]. As a server's logprobs they are an
# engine other than lockstep, running the same weights.
ref = safetensors(os.path.join(FIX, "reference.safetensors"))
prompt_ids = [int(x) for x in ref["prompt_ids"]][:24]
dec = [int(x) for x in ref["decode_ids"]]
# Keep the first 24 prompt positions and the 32 decode tokens: prompt tokens 24.. become part of
# the "generation" (teacher forcing makes that the same computation).
gen_ids = [int(x) for x in ref["prompt_ids"]][24:] + dec
# decode_logits[i] chose decode_ids[i] (decode_logits[0] is the prefill's last row again).
all_rows = np.concatenate([ref["prefill_logits"], ref["decode_logits"][1:]])  # row p predicts token p + 1


class _R:
    pass


r = _R()
r.id, r.prompt, r.generated, r.finish_reason = 0, prompt_ids, gen_ids[:len(all_rows) - len(prompt_ids) + 1], "length"
ft_requests = [r]


def logsoftmax(v):
    v = v.astype(np.float64)
    m = v.max()
    return v - (m + math.log(np.exp(v - m).sum()))
vllm, sgl, expect = [], [], {}
for r in ft_requests:
    rows = {p: logsoftmax(all_rows[p]) for p in range(len(r.prompt) + len(r.generated) - 1)}
    P, n = len(r.prompt), 4
    top = lambda lp: [int(j) for j in np.argsort(-lp, kind="stable")[:n]]
    gen_tops = [rows[P - 1 + i] for i in range(len(r.generated))]
    ch = {"index": 0, "text": "", "finish_reason": r.finish_reason, "stop_reason": None,
          "prompt_token_ids": [int(x) for x in r.prompt], "token_ids": [int(x) for x in r.generated],
          "logprobs": {"tokens": [f"token_id:{int(g)}" for g in r.generated],
                       "token_logprobs": [float(lp[g]) for lp, g in zip(gen_tops, r.generated)],
                       "top_logprobs": [dict({f"token_id:{j}": float(lp[j]) for j in top(lp)},
                                             **{f"token_id:{int(g)}": float(lp[g])})
                                        for lp, g in zip(gen_tops, r.generated)],
                       "text_offset": list(range(len(r.generated)))}}
    have_prompt = all(j - 1 in rows for j in range(1, P))
    if have_prompt:
        ch["prompt_logprobs"] = [None] + [dict({str(k): {"logprob": float(rows[j - 1][k]), "rank": 1} for k in
                                                top(rows[j - 1])}, **{str(int(r.prompt[j])): {
                                                    "logprob": float(rows[j - 1][r.prompt[j]]), "rank": 9}})
                                          for j in range(1, P)]
    vllm.append({"id": f"cmpl-{r.id}", "object": "text_completion", "choices": [ch]})
    meta = {"output_token_logprobs": [[float(lp[g]), int(g), None] for lp, g in zip(gen_tops, r.generated)],
            "output_top_logprobs": [[[float(lp[j]), j, None] for j in top(lp)] for lp in gen_tops],
            "finish_reason": {"type": r.finish_reason}}
    if have_prompt:
        meta["input_top_logprobs"] = [None] + [[[float(rows[j - 1][k]), k, None] for k in top(rows[j - 1])]
                                               for j in range(1, P)]
    sgl.append({"request": {"input_ids": [int(x) for x in r.prompt]}, "response": {"text": "", "meta_info": meta}})
    expect[r.id] = (P, rows, have_prompt)
for name, recs in (("vllm", vllm), ("sglang", sgl)):
    src = os.path.join(WORK, name + ".json")
    json.dump(recs, open(src, "w"))  # a JSON array this time
    out = os.path.join(WORK, name + ".h5")
    info = json.loads(imp(src, FIX, out, via_python=name == "sglang").stdout)
    t = lockstep.open_trace(out)
    check(name in t.meta["source"], f"{name}: meta.source = {t.meta['source']}")
    n_rows = 0
    for rid, (P, rows, have_prompt) in expect.items():
        lg = t.logits(rid)
        for pos, ids, vals in zip(lg["positions"], lg["ids"], lg["values"]):
            want = [int(j) for j in np.argsort(-rows[int(pos)], kind="stable")[:4]]
            if list(ids) != want or not np.array_equal(vals, rows[int(pos)][want].astype(np.float32)):
                check(False, f"{name}: request {rid} position {pos}: imported row is not the recording's top-4")
            n_rows += 1
        want_rows = len(ft_requests[rid].generated) + (P - 1 if have_prompt else 0)
        check(len(lg["positions"]) == want_rows, f"{name}: request {rid}: {len(lg['positions'])} rows, want {want_rows}")
    rep, _ = replay_json(out)
    d = rep.get("diff", rep)
    kls = position_kls(rep)
    chosen = [v[2] for v in kls.values() if v[2] is not None]
    print(f"{name}: {n_rows} rows imported, prompt rows {info['prompt_rows']}; replay: {d['logit_summary']['rows']} "
          f"positions, mean KL {d['logit_summary']['mean_kl']:.3g}, same top p {d['logit_summary']['same_top_pct']}%, chosen p known "
          f"at {len(chosen)}")
    check(d["logit_summary"]["rows"] == n_rows and d["logit_summary"]["top1_flips"] == 0 and not d["missing"],
          f"{name}: every imported position compared, 100 % top-1")
    # fp32 parity of lockstep's reference with transformers (docs/parity: ~1e-6 relative on the
    # logits) bounds the KL far below the 1e-3 divergence threshold.
    check(d["logit_summary"]["max_kl"] < 1e-6, f"{name}: KL of transformers' logprobs vs lockstep ≈ 0 ({d['logit_summary']['max_kl']:.3g})")
    check(len(chosen) > 0 and d["logit_summary"]["chosen_rows"] == len(chosen), f"{name}: chosen-token probability")

# -- 3. bad input ----------------------------------------------------------------------------
good = pairs[0]
def variant(edit):
    g = json.loads(json.dumps(good))
    edit(g)
    return json.dumps(g)
cases = {
    "not_json": "{this is not json\n",
    "empty": "",
    "text_tokens": variant(lambda g: g["response"]["choices"][0]["logprobs"].__setitem__("tokens", ["a"] * 10)
                           or g["response"]["choices"][0].pop("token_ids")),
    "id_out_of_vocab": variant(lambda g: g["response"]["choices"][0].__setitem__("token_ids", [10**6] * 10)),
    "positive_logprob": variant(lambda g: g["response"]["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, 3.0)),
    "nan_logprob": variant(lambda g: g["response"]["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, "NaN")),
    "lengths": variant(lambda g: g["response"]["choices"][0]["logprobs"]["token_logprobs"].pop()),
    "no_prompt_ids": variant(lambda g: (g["request"].__setitem__("prompt", "text"),
                                        g["response"]["choices"][0].pop("prompt_token_ids"))),
    "no_logprobs": variant(lambda g: g["response"]["choices"][0].__setitem__("logprobs", None)),
    "error_response": json.dumps({"error": {"message": "boom"}}),
    "not_object": "[1, 2, 3]",
}
for name, textv in cases.items():
    path = os.path.join(WORK, f"bad-{name}.jsonl")
    open(path, "w").write(textv)
    p = imp(path, TINY, os.path.join(WORK, "bad.h5"), ok=(0, 1, 2), via_python=len(path) % 2 == 0)
    err = p.stderr.strip()
    check(p.returncode == 1 and path in err and "\n" not in err and "Traceback" not in err, f"bad {name}: {err}")
p = imp(src, os.path.join(WORK, "no-such-model"), os.path.join(WORK, "bad.h5"), ok=(0, 1))
check(p.returncode == 1 and "no-such-model" in p.stderr and "Traceback" not in p.stderr, f"bad model: {p.stderr.strip()}")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("import openai: all checks passed")
