#!/usr/bin/env python3
"""bench/fp8_rss.py — peak resident memory of `lockstep generate` on an FP8 checkpoint, against
the checkpoint's size (docs/performance.md, "Weights held as stored").

  python3 bench/fp8_rss.py make DIR [--layers 4 --experts 32 --hidden 2048 --vocab 16384 --seed 1]
      writes DIR/config.json and DIR/model.safetensors: a DeepSeek-V3-shaped checkpoint (MLA with
      q-LoRA, kv_lora 512, nope/rope/v 128/64/128, noaux_tc routing over grouped experts, one
      dense layer first) with random weights, published the way DeepSeek-V3 is: every linear
      weight of the layers F8_E4M3 with fp32 128×128 block scales (weight_scale_inv), the
      embeddings, lm_head, norms and router bf16, the router bias fp32. The defaults make ~0.55 GB.
  python3 bench/fp8_rss.py measure DIR --lockstep build/lockstep [-n 16] [--prompt-len 32] [--kernel gemm=fp8_dot]
                                   [--backend cuda]
      runs `lockstep generate -m DIR` (greedy, a --prompt-len-token prompt) and prints one JSON line: the
      checkpoint's bytes, the run's peak RSS (the kernel's ru_maxrss of the finished child) and
      their ratio.

Only the standard library: weights are seeded random bytes (random.Random(seed).randbytes)
mapped onto finite codes, so a few hundred MB are written in seconds. The weights are nonsense; the shapes and formats are
DeepSeek-V3's, which is what the memory figure depends on.
"""
import argparse
import json
import os
import random
import resource
import struct
import subprocess
import sys
import time

FP8_NO_NAN = bytes(0x7E if b == 0x7F else 0xFE if b == 0xFF else b for b in range(256))
# bf16 high bytes: keep the sign, exponent 2^-8 … 2^-5 (biased 119 … 122 → high bits 59 … 61).
BF16_SMALL_HIGH = bytes((b & 0x80) | (59 + b % 3) for b in range(256))


RNG = random.Random(1)


def bf16_random(n):
    out = bytearray(2 * n)
    out[0::2] = RNG.randbytes(n)
    out[1::2] = RNG.randbytes(n).translate(BF16_SMALL_HIGH)
    return bytes(out)


def tensors(cfg):
    """(name, dtype, shape, maker) for every tensor, in the order they are written."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    ql, C = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    E, I, V = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    out = []

    def vec_ones(name, n):
        out.append((name, "BF16", [n], lambda: b"\x80\x3f" * n))

    def bf16_mat(name, rows, cols):
        out.append((name, "BF16", [rows, cols], lambda: bf16_random(rows * cols)))

    def fp8_linear(name, rows, cols):
        out.append((name + ".weight", "F8_E4M3", [rows, cols], lambda: RNG.randbytes(rows * cols).translate(FP8_NO_NAN)))
        sr, sc = (rows + 127) // 128, (cols + 127) // 128
        bound = 1.0 / cols ** 0.5
        out.append((name + ".weight_scale_inv", "F32", [sr, sc], lambda: struct.pack("<%df" % (sr * sc),
                                                                                    *([bound / 448.0] * (sr * sc)))))

    bf16_mat("model.embed_tokens.weight", V, H)
    vec_ones("model.norm.weight", H)
    bf16_mat("lm_head.weight", V, H)
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d" % l
        vec_ones(p + ".input_layernorm.weight", H)
        vec_ones(p + ".post_attention_layernorm.weight", H)
        a = p + ".self_attn"
        fp8_linear(a + ".q_a_proj", ql, H)
        vec_ones(a + ".q_a_layernorm.weight", ql)
        fp8_linear(a + ".q_b_proj", nh * (dn + dr), ql)
        fp8_linear(a + ".kv_a_proj_with_mqa", C + dr, H)
        vec_ones(a + ".kv_a_layernorm.weight", C)
        fp8_linear(a + ".kv_b_proj", nh * (dn + dv), C)
        fp8_linear(a + ".o_proj", H, nh * dv)
        m = p + ".mlp"
        if l < cfg["first_k_dense_replace"]:
            for proj, r, c in (("gate_proj", cfg["intermediate_size"], H), ("up_proj", cfg["intermediate_size"], H),
                               ("down_proj", H, cfg["intermediate_size"])):
                fp8_linear(m + "." + proj, r, c)
            continue
        bf16_mat(m + ".gate.weight", E, H)
        out.append((m + ".gate.e_score_correction_bias", "F32", [E], lambda: bytes(4 * E)))
        for e in list(range(E)) + ["shared"]:
            x = m + (".shared_experts" if e == "shared" else ".experts.%d" % e)
            inter = I * cfg["n_shared_experts"] if e == "shared" else I
            fp8_linear(x + ".gate_proj", inter, H)
            fp8_linear(x + ".up_proj", inter, H)
            fp8_linear(x + ".down_proj", H, inter)
    return out


def make(args):
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "dtype": "bfloat16",
        "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden + args.hidden // 2,
        "moe_intermediate_size": 512, "num_hidden_layers": args.layers, "first_k_dense_replace": 1,
        "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
        "n_routed_experts": args.experts, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_interleave": True, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": 4096, "vocab_size": args.vocab, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 0, "attention_bias": False,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    }
    RNG.seed(args.seed)
    os.makedirs(args.dir, exist_ok=True)
    with open(os.path.join(args.dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    ts = tensors(cfg)
    # F32 first, then BF16, then FP8: every tensor aligned to its element size.
    order = {"F32": 0, "BF16": 1, "F8_E4M3": 2}
    ts.sort(key=lambda t: order[t[1]])
    size = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
    header, off = {}, 0
    for name, dt, shape, _ in ts:
        n = size[dt]
        for d in shape:
            n *= d
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    t0 = time.time()
    with open(os.path.join(args.dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for name, dt, shape, maker in ts:
            b = maker()
            assert len(b) == header[name]["data_offsets"][1] - header[name]["data_offsets"][0], name
            f.write(b)
    total = 8 + len(h) + off
    print(json.dumps({"dir": args.dir, "tensors": len(ts), "bytes": total, "seconds": round(time.time() - t0, 1)}))


def measure(args):
    files = [os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.endswith(".safetensors")]
    file_bytes = sum(os.path.getsize(f) for f in files)
    cmd = [args.lockstep, "generate", "-m", args.dir, "--prompt-ids", ",".join(str(5 + i) for i in range(args.prompt_len)),
           "-n", str(args.n), "-t", "0", "-q"] + sum((["--kernel", k] for k in args.kernel), []) + \
        (["--backend", args.backend] if args.backend else [])
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.time() - t0
    if r.returncode != 0:
        sys.exit("fp8_rss: %s failed (%d): %s" % (" ".join(cmd), r.returncode, r.stderr.strip()))
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"command": " ".join(cmd), "checkpoint_bytes": file_bytes, "peak_rss_bytes": peak,
                      "rss_over_file": round(peak / file_bytes, 4), "wall_s": round(wall, 2)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write a V3-shaped FP8 checkpoint")
    mk.add_argument("dir")
    mk.add_argument("--layers", type=int, default=4)
    mk.add_argument("--experts", type=int, default=32)
    mk.add_argument("--hidden", type=int, default=2048)
    mk.add_argument("--vocab", type=int, default=16384)
    mk.add_argument("--seed", type=int, default=1)
    ms = sub.add_parser("measure", help="peak RSS of lockstep generate on it")
    ms.add_argument("dir")
    ms.add_argument("--lockstep", default="build/lockstep")
    ms.add_argument("-n", type=int, default=16)
    ms.add_argument("--prompt-len", type=int, default=32)
    ms.add_argument("--kernel", action="append", default=[])
    ms.add_argument("--backend", default=None, help="passed to generate (cuda: the host memory the device upload takes)")
    args = ap.parse_args()
    make(args) if args.cmd == "make" else measure(args)


if __name__ == "__main__":
    main()
