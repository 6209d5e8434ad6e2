// kernels/registry.cc — the table of variants.
#include "kernels/registry.h"

#include <set>

namespace lockstep::kernels {

Registry::Registry() {
  variants_ = {
      {"attn_prefill", "expanded", "cpu",
       "MLA prefill: expand each cached latent to per-head K/V with kv_b_proj (transformers' form)", true, true,
       true},
      {"attn_prefill", "absorbed", "cpu", "MLA prefill in the absorbed form, like decode (the CUDA kernels' bits)",
       true, true, false},
      {"attn_decode", "absorbed", "cpu",
       "MLA decode: W_UK folded into q, attention over the latent cache, W_UV after (FlashMLA's form; the CUDA "
       "kernels' splits, tiles and online softmax: their bits)",
       true, true, true},
      {"attn_decode", "expanded", "cpu", "MLA decode with per-head K/V expanded from the latent (reference form)",
       true, true, false},
      {"indexer", "reference", "cpu",
       "V3.2 lightning indexer: Σ_h w_h·ReLU(q_h·k_t) over all causal keys, exact top-k (ties: lowest position)",
       true, true, true},
      {"indexer", "hadamard", "cpu",
       "V3.2 indexer with the official Hadamard rotation of q and k (orthogonal: same scores up to rounding)", true,
       true, false},
      {"indexer", "fp8_paged", "cpu",
       "V3.2 indexer as the official FP8 path: Hadamard-rotated q and k in FP8 e4m3 (power-of-two scale per 128; "
       "keys stored so in the cache, 132 bytes); each q.k the rows' exact dot product, rounded once; scored page by "
       "page up to the request's last page",
       true, true, false},
      {"gemm", "fp32", "cpu", "fp32 GEMM, 16-lane FMA dot products in a fixed order", true, true, true},
      {"gemm", "bf16", "cpu", "bf16 weights and activations, fp32 accumulation (a bf16 GPU GEMM's precision)", true,
       true, false},
      {"gemm", "fp32_dot", "cpu",
       "= fp32 (the CPU's GEMM is always in cpu::Dot's order); named for replays of GPU traces", true, true, false},
      {"gemm", "bf16_dot", "cpu",
       "= bf16 (the CPU's GEMM is always in cpu::Dot's order); named for replays of GPU traces", true, true, false},
      {"gemm", "fp32_heuristic", "cpu",
       "= fp32 (the CPU's GEMM has no heuristic); named for replays of GPU traces", true, true, false},
      {"gemm", "bf16_heuristic", "cpu",
       "= bf16 (the CPU's GEMM has no heuristic); named for replays of GPU traces", true, true, false},
      {"gemm", "fp8_dot", "cpu",
       "FP8 e4m3 weights with 128x128 block scales (an FP8 checkpoint's own, else amax/448 at load), "
       "dequantised exactly; fp32 activations, cpu::Dot's order",
       true, true, false},
      {"gemm", "w8a8_dot", "cpu",
       "fp8_dot's weights, and each linear layer's input through FP8 e4m3 per 128 values (power-of-two scale >= "
       "amax/448: DeepSeek V3.1/V3.2's act_quant, scale_fmt ue8m0); kv_b, the router and lm_head keep fp32 inputs",
       true, true, false},
      {"gemm", "mxfp4_dot", "cpu",
       "DeepSeek-V4 routed experts in MXFP4 (E2M1, E8M0 scale per 32: the checkpoint's own, else quantised at "
       "load by kernels/fp4.h), dequantised exactly in the GEMM; other weights as stored; fp32 activations, "
       "cpu::Dot's order",
       true, true, false},
      {"gemm", "nvfp4_dot", "cpu",
       "DeepSeek-V4 routed experts in NVFP4 (E2M1, E4M3 scale per 16, fp32 scale_2: the checkpoint's own, else "
       "quantised at load as ModelOpt does), dequantised in the GEMM; other weights as stored; fp32 "
       "activations, cpu::Dot's order",
       true, true, false},
      {"attn_sparse", "reference", "cpu", "sparse attention reads exactly the indexer's selected keys", true, true,
       true},
      {"softmax", "reference", "cpu",
       "attention softmax: the expanded form's max-subtracted row, exp rounded once to fp32, fp64 sum; the "
       "absorbed form's online softmax over 32-key tiles and splits (cpu::MlaAttend, the CUDA kernels' bits)",
       true, true, true},
      {"norm", "fp64", "cpu", "RMSNorm: the sum of squares in fp64, in order", true, true, true},
      {"norm", "lanes256", "cpu",
       "RMSNorm in the CUDA kernels' order: fp32 FMA sums in 256 interleaved lanes, butterflies, a fixed tree, "
       "fp32 rsqrt — a GPU trace's norms bit for bit",
       true, true, false},
      {"rope", "reference", "cpu", "RoPE in the model's own layout, prefill and decode alike", true, true, true},
      {"page_table", "reference", "cpu", "attention reads the request's own pages", true, true, true},
      {"kv_quant", "reference", "cpu", "FP8 cache writes: power-of-two scale ≥ amax/448, saturating e4m3", true, true,
       true},
      // The CUDA backend (engine/cuda_backend.cc, kernels/cuda/). Same op names as the CPU's so
      // a kernel choice carries across a --backend override where both have the variant.
      {"attn_prefill", "absorbed", "cuda",
       "MLA prefill as one absorbed decode query per row over its causal prefix (MlaDecode)", true, true, true, false,
       true},
      {"attn_decode", "absorbed", "cuda",
       "MLA absorbed decode over the paged latent cache: fixed splits per key count, CPU-bitwise scores", true, true,
       true, false, true},
      {"attn_sparse", "reference", "cuda",
       "sparse MLA decode over the indexer's top-k slots, FP8 dequantised in the kernel (MlaSparseDecode)", true,
       true, true, false, true},
      {"indexer", "reference", "cuda",
       "V3.2 indexer: one thread per key, CPU-bitwise scores, exact radix top-k (ties: lowest position)", true, true,
       true, false, true},
      {"indexer", "fp8_paged", "cuda",
       "V3.2 indexer, the official FP8 path: Hadamard, q and keys as FP8 rows (keys quantised on write, 132 bytes), "
       "exact dot products on fp64 tensor cores (bitwise the CPU's), 64-key tiles past a request's end exit at once",
       true, true, false, false, true},
      {"indexer", "hadamard", "cuda",
       "V3.2 indexer with the official Hadamard rotation of q and k after RoPE (Hadamard kernel: the CPU's "
       "butterflies, bitwise)",
       true, true, false, false, true},
      {"gemm", "fp32", "cuda",
       "cuBLASLt fp32 (COMPUTE_32F_PEDANTIC, no TF32), algorithm pinned per shape without split-K", true, true,
       true, false, false},
      {"gemm", "bf16", "cuda",
       "cuBLASLt bf16 inputs, fp32 accumulation, algorithm pinned per shape; the routed experts on tensor cores "
       "(mma.m16n8k16, one fixed K order: batch-invariant)",
       true, true, false, false, false},
      {"gemm", "fp32_dot", "cuda",
       "fp32 on CUDA cores in cpu::Dot's order (ExpertGemm): bitwise the CPU's gemm=fp32 for any rows", true, true,
       false, false, true},
      {"gemm", "bf16_dot", "cuda",
       "bf16 weights and activations, fp32 in cpu::Dot's order (ExpertGemm): bitwise the CPU's gemm=bf16",
       true, true, false, false, true},
      {"gemm", "fp8_dot", "cuda",
       "FP8 e4m3 weights with 128x128 block scales, dequantised in the kernel (one fp32 rounding), fp32 "
       "activations, cpu::Dot's order: bitwise the CPU's gemm=fp8_dot; half of bf16's weight bytes",
       true, true, false, false, true},
      {"gemm", "w8a8_dot", "cuda",
       "fp8_dot with each linear layer's input through FP8 per 128 values first (Fp8RoundTrip kernel): bitwise "
       "the CPU's gemm=w8a8_dot",
       true, true, false, false, true},
      {"gemm", "fp32_heuristic", "cuda",
       "cuBLASLt fp32 with its per-shape heuristic: deterministic, NOT batch-invariant (split-K varies with rows)",
       true, false, false, false, false},
      {"gemm", "bf16_heuristic", "cuda",
       "cuBLASLt bf16 with its per-shape heuristic: deterministic, NOT batch-invariant", true, false, false, false,
       false},
      {"norm", "lanes256", "cuda",
       "RMSNorm, a CTA of 256 threads a row: fp32 FMA lanes, butterflies, a fixed tree (cpu: norm=lanes256)", true,
       true, true, false, true},
      {"softmax", "reference", "cuda", "online softmax over 32-key tiles in ascending order, splits merged in order",
       true, true, true, false, true},
      {"rope", "reference", "cuda", "RoPE in the model's own layout, CPU-bitwise", true, true, true, false, true},
      {"page_table", "reference", "cuda", "attention reads the request's own pages", true, true, true, false, true},
      {"kv_quant", "reference", "cuda", "FP8 cache writes byte-identical to the CPU cache's", true, true, true, false,
       true},
      // The fault zoo (docs/fault-zoo.md): wrong on purpose, reachable only through --fault.
      {"indexer", "fault_skip_partial_page", "cpu",
       "FAULT: indexer early-exit never scores keys in the request's last, partial page", true, true, false, true},
      {"attn_sparse", "fault_neg1_as_token0", "cpu",
       "FAULT: selection padded to index_topk with -1, and -1 read as token 0", true, true, false, true},
      {"kv_quant", "fault_fp8_no_clamp", "cpu",
       "FAULT: FP8 scale rounded to the nearest power of two and no 448 clamp: overflow becomes NaN", true, true,
       false, true},
      {"rope", "fault_decode_wrong_interleave", "cpu",
       "FAULT: decode steps rotate q and k with the other RoPE layout (prefill is right)", true, true, false, true},
      {"page_table", "fault_cross_request", "cpu",
       "FAULT: reads of a request's second page go to the neighbouring physical page (another request's)", true,
       true, false, true},
      {"softmax", "fault_no_max_fp16_sum", "cpu",
       "FAULT: no max subtraction and an fp16 denominator: overflows to inf on long contexts", true, true, false,
       true},
  };
  DeclareBounds();
}

// What each variant promises against the CPU reference (the defaults, which model_reference_test
// holds to transformers' fp32 logits), and which variants are aliases. A bound is on a layer's
// own error: each layer started from the reference's input (grafted), what it adds to the
// residual stream against the reference's addition, max|Δ| / max|ref| a row — its 90th
// percentile over every layer and row of the fixture models (a low-precision path flips a few
// discrete choices, an expert or a selected key, which moves single rows by O(1)), and the
// logits from the reference's last hidden state, every row. tests/variant_twin_test.cc checks
// each; docs/determinism.md lists them with the measured worst case.
//   fp32 in another order: 1e-5 (measured ≤ 1.3e-6); bf16 inputs (unit roundoff 2^-9): 3e-2
//   (measured ≤ 1.1e-2); FP8 e4m3 weights (2^-4): 0.3 (≤ 0.13), and FP8 activations too: 0.4
//   (≤ 0.17); the FP8 indexer's selection: 0.2 (≤ 0.07). A default is the reference: 0.
void Registry::DeclareBounds() {
  struct Declared {
    const char* op;
    const char* name;
    const char* backend;
    double bound;
    const char* same_bits_as;
  };
  static const Declared kDeclared[] = {
      {"attn_prefill", "expanded", "cpu", 0, ""},
      {"attn_prefill", "absorbed", "cpu", 1e-5, ""},
      {"attn_decode", "absorbed", "cpu", 0, ""},
      {"attn_decode", "expanded", "cpu", 1e-5, ""},
      {"indexer", "reference", "cpu", 0, ""},
      {"indexer", "hadamard", "cpu", 1e-5, ""},
      {"indexer", "fp8_paged", "cpu", 0.2, ""},
      {"gemm", "fp32", "cpu", 0, ""},
      {"gemm", "bf16", "cpu", 3e-2, ""},
      {"gemm", "fp32_dot", "cpu", 0, "fp32"},
      {"gemm", "bf16_dot", "cpu", 3e-2, "bf16"},
      {"gemm", "fp32_heuristic", "cpu", 0, "fp32"},
      {"gemm", "bf16_heuristic", "cpu", 3e-2, "bf16"},
      {"gemm", "fp8_dot", "cpu", 0.3, ""},
      {"gemm", "w8a8_dot", "cpu", 0.4, ""},
      {"attn_sparse", "reference", "cpu", 0, ""},
      {"softmax", "reference", "cpu", 0, ""},
      {"norm", "fp64", "cpu", 0, ""},
      {"norm", "lanes256", "cpu", 1e-5, ""},
      {"rope", "reference", "cpu", 0, ""},
      {"page_table", "reference", "cpu", 0, ""},
      {"kv_quant", "reference", "cpu", 0, ""},
      // 4-bit experts (E2M1, measured 0.1 relative L2 on the tiny V4 model's experts): no forward
      // pass holds its experts so yet (issue 32), so no fixture runs them; the twin test skips.
      {"gemm", "mxfp4_dot", "cpu", 0.5, ""},
      {"gemm", "nvfp4_dot", "cpu", 0.5, ""},
      // CUDA: where a variant has the CPU's bits its bound is the CPU variant's (and the test
      // checks the bits); cuBLAS's own orders get the bound of their number format.
      {"attn_prefill", "absorbed", "cuda", 1e-5, ""},
      {"attn_decode", "absorbed", "cuda", 1e-5, ""},
      {"attn_sparse", "reference", "cuda", 1e-5, ""},
      {"indexer", "reference", "cuda", 1e-5, ""},
      {"indexer", "fp8_paged", "cuda", 0.2, ""},
      {"indexer", "hadamard", "cuda", 1e-5, ""},
      {"gemm", "fp32", "cuda", 1e-5, ""},
      {"gemm", "bf16", "cuda", 3e-2, ""},
      {"gemm", "fp32_dot", "cuda", 1e-5, ""},
      {"gemm", "bf16_dot", "cuda", 3e-2, ""},
      {"gemm", "fp8_dot", "cuda", 0.3, ""},
      {"gemm", "w8a8_dot", "cuda", 0.4, ""},
      {"gemm", "fp32_heuristic", "cuda", 1e-5, ""},
      {"gemm", "bf16_heuristic", "cuda", 3e-2, ""},
      {"norm", "lanes256", "cuda", 1e-5, ""},
      {"softmax", "reference", "cuda", 1e-5, ""},
      {"rope", "reference", "cuda", 1e-5, ""},
      {"page_table", "reference", "cuda", 1e-5, ""},
      // Under the CUDA defaults the FP8 cache rounds a latent whose last bits came from cuBLAS, not
      // the CPU's order: a value near an e4m3 rounding boundary steps by 2^-4 (measured p90 6.1e-4,
      // worst row 3.8e-3 on v2_qlora_group; ≤ 5.4e-6 elsewhere). With every op CPU-bitwise the
      // bits are the CPU's (the twin test checks that too).
      {"kv_quant", "reference", "cuda", 5e-3, ""},
  };
  for (const Declared& d : kDeclared) {
    for (auto& v : variants_) {
      if (v.op == d.op && v.name == d.name && v.backend == d.backend) {
        v.bound = d.bound;
        v.same_bits_as = d.same_bits_as;
      }
    }
  }
}

const Registry& Registry::Get() {
  static const Registry r;
  return r;
}

const KernelVariant* Registry::Find(std::string_view op, std::string_view name, std::string_view backend) const {
  for (const auto& v : variants_) {
    if (v.op == op && v.name == name && v.backend == backend) return &v;
  }
  return nullptr;
}

std::vector<std::string> BitsApartAcross(const KernelChoice& ran, std::string_view from, std::string_view to) {
  std::vector<std::string> apart;
  if (from == to) return apart;
  const Registry& reg = Registry::Get();
  for (const auto& [op, name] : ran) {
    const KernelVariant* a = reg.Find(op, name, from);
    const KernelVariant* b = reg.Find(op, name, to);
    const KernelVariant* gpu = from == "cuda" ? a : to == "cuda" ? b : nullptr;
    if (a == nullptr || b == nullptr || a->fault || b->fault || (gpu != nullptr && !gpu->cpu_bits)) {
      apart.push_back(op + "=" + name);
    }
  }
  return apart;
}

std::string Registry::Default(std::string_view op, std::string_view backend) const {
  for (const auto& v : variants_) {
    if (v.op == op && v.backend == backend && v.is_default) return v.name;
  }
  return "";
}

Result<KernelChoice> Registry::Resolve(const KernelChoice& requested, std::string_view backend,
                                      std::string_view fault) const {
  KernelChoice out;
  std::set<std::string> ops;
  for (const auto& v : variants_) {
    if (v.backend == backend) ops.insert(v.op);
  }
  if (ops.empty()) {
    return Status::InvalidArgument("--backend " + std::string(backend) + ": unknown backend (backends: cpu, cuda)");
  }
  for (const auto& [op, name] : requested) {
    if (!ops.count(op)) {
      std::string known;
      for (const auto& o : ops) known += (known.empty() ? "" : ", ") + o;
      return Status::InvalidArgument("--kernel " + op + "=" + name + ": unknown op '" + op + "' (ops: " + known + ")");
    }
    const KernelVariant* v = Find(op, name, backend);
    if (v == nullptr || v->fault) {
      std::string known;
      for (const auto& x : variants_) {
        if (x.op == op && x.backend == backend && !x.fault) known += (known.empty() ? "" : ", ") + x.name;
      }
      return Status::InvalidArgument("--kernel " + op + "=" + name + ": unknown variant (" + op + ": " + known + ")");
    }
  }
  for (const auto& op : ops) {
    auto it = requested.find(op);
    out[op] = it != requested.end() ? it->second : Default(op, backend);
  }
  if (!fault.empty()) {
    std::string known;
    for (const auto& v : variants_) {
      if (!v.fault || v.backend != backend) continue;
      if (v.name == fault) {
        out[v.op] = v.name;
        return out;
      }
      known += (known.empty() ? "" : ", ") + v.name;
    }
    if (known.empty()) {
      return Status::InvalidArgument("--fault " + std::string(fault) + ": the " + std::string(backend) +
                                     " backend has no fault variants (the fault zoo runs on --backend cpu)");
    }
    return Status::InvalidArgument("--fault " + std::string(fault) + ": unknown fault (faults: " + known + ")");
  }
  return out;
}

Status ParseKernelOverride(std::string_view spec, KernelChoice* into) {
  auto eq = spec.find('=');
  if (eq == std::string_view::npos || eq == 0 || eq + 1 == spec.size()) {
    return Status::InvalidArgument("--kernel '" + std::string(spec) + "': expected op=variant, e.g. attn_decode=expanded");
  }
  (*into)[std::string(spec.substr(0, eq))] = std::string(spec.substr(eq + 1));
  return Status::Ok();
}

}  // namespace lockstep::kernels
