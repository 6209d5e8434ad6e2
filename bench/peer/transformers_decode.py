#!/usr/bin/env python3
"""bench/peer/transformers_decode.py — the peer for bench_gpu_decode: transformers (eager
attention, bf16) decoding the same published shape with random weights on the same GPU.

Decode time = generate(prompt, 1 + N new tokens) − generate(prompt, 1 new token): the
difference is N decode steps with transformers' own KV cache, prefill excluded, greedy.

  python3 bench/peer/transformers_decode.py --model models/shapes/deepseek-v2-lite \
      --batch 1,64 --prompt-len 256 --tokens 64
"""
import argparse
import json
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/shapes/deepseek-v2-lite")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    cfg = AutoConfig.from_pretrained(a.model)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager")
    model.eval()
    load_s = time.time() - t0
    out = {"peer": "transformers " + transformers.__version__ + " eager bf16", "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0), "load_s": load_s, "runs": []}
    for b in [int(x) for x in a.batch.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (b, a.prompt_len), device="cuda")
        mask = torch.ones_like(ids)
        kw = dict(do_sample=False, attention_mask=mask, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
            torch.cuda.synchronize()
            t = time.time()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            torch.cuda.synchronize()
            t1 = time.time() - t
            t = time.time()
            model.generate(ids, max_new_tokens=1 + a.tokens, min_new_tokens=1 + a.tokens, **kw)
            torch.cuda.synchronize()
            tn = time.time() - t
        step = (tn - t1) / a.tokens
        run = {"batch": b, "prefill_plus_one_s": t1, "decode_ms_per_step": step * 1e3, "tokens_per_s": b / step}
        out["runs"].append(run)
        print(f"transformers batch {b}: decode {step*1e3:.2f} ms/step, {b/step:.1f} tok/s", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
