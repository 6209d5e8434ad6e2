// kernels/registry.cc — the table of variants.
#include "kernels/registry.h"

#include <set>

namespace lockstep::kernels {

namespace {
// The variants only the MLA forward pass (DeepSeek V2, V3, V3.2) implements: DeepSeek-V4's
// forward has no absorbed/expanded forms, no V3.2 indexer, its own norms and cache.
const std::vector<std::string> kMlaFamilies = {"deepseek_v2", "deepseek_v3", "deepseek_v32"};
}  // namespace

Registry::Registry() {
  variants_ = {
      {.op = "attn_prefill", .name = "expanded", .backend = "cpu",
       .summary = "MLA prefill: expand each cached latent to per-head K/V with kv_b_proj (transformers' form)",
       .is_default = true, .bound = 0},
      {.op = "attn_prefill", .name = "absorbed", .backend = "cpu",
       .summary = "MLA prefill in the absorbed form, like decode (the CUDA kernels' bits)",
       .bound = 1e-5, .model_types = kMlaFamilies},
      {.op = "attn_decode", .name = "absorbed", .backend = "cpu",
       .summary = "MLA decode: W_UK folded into q, attention over the latent cache, W_UV after (FlashMLA's form; "
                 "the CUDA kernels' splits, tiles and online softmax: their bits)",
       .is_default = true, .bound = 0},
      {.op = "attn_decode", .name = "expanded", .backend = "cpu",
       .summary = "MLA decode with per-head K/V expanded from the latent (reference form)",
       .bound = 1e-5, .model_types = kMlaFamilies},
      {.op = "indexer", .name = "reference", .backend = "cpu",
       .summary = "V3.2 lightning indexer: Σ_h w_h·ReLU(q_h·k_t) over all causal keys, exact top-k (ties: lowest "
                 "position)",
       .is_default = true, .bound = 0},
      {.op = "indexer", .name = "hadamard", .backend = "cpu",
       .summary = "V3.2 indexer with the official Hadamard rotation of q and k (orthogonal: same scores up to "
                 "rounding)",
       .bound = 1e-5, .model_types = kMlaFamilies},
      {.op = "indexer", .name = "fp8_paged", .backend = "cpu",
       .summary = "V3.2 indexer as the official FP8 path: Hadamard-rotated q and k in FP8 e4m3 (power-of-two scale "
                 "per 128; keys stored so in the cache, 132 bytes); each q.k the rows' exact dot product, rounded "
                 "once; scored page by page up to the request's last page. DeepSeek-V4: the CSA indexer's compressed keys "
                 "stored so (vLLM's paged layout, 132 bytes), read back dequantised; queries fp32",
       .bound = 0.2},
      {.op = "indexer", .name = "dense", .backend = "cpu",
       .summary = "DeepSeek-V4 CSA: no selection — attention over every closed compressed row (the dense reference "
                 "the indexer's top-k approximates; the indexer_topk tap holds −1)",
       .bound = 0.2, .model_types = {"deepseek_v4"}},
      {.op = "gemm", .name = "fp32", .backend = "cpu",
       .summary = "fp32 GEMM, 16-lane FMA dot products in a fixed order",
       .is_default = true, .bound = 0},
      {.op = "gemm", .name = "bf16", .backend = "cpu",
       .summary = "bf16 weights and activations, fp32 accumulation (a bf16 GPU GEMM's precision)",
       .bound = 3e-2},
      {.op = "gemm", .name = "fp32_dot", .backend = "cpu",
       .summary = "= fp32 (the CPU's GEMM is always in cpu::Dot's order); named for replays of GPU traces",
       .bound = 0, .same_bits_as = "fp32"},
      {.op = "gemm", .name = "bf16_dot", .backend = "cpu",
       .summary = "= bf16 (the CPU's GEMM is always in cpu::Dot's order); named for replays of GPU traces",
       .bound = 3e-2, .same_bits_as = "bf16"},
      {.op = "gemm", .name = "fp32_heuristic", .backend = "cpu",
       .summary = "= fp32 (the CPU's GEMM has no heuristic); named for replays of GPU traces",
       .bound = 0, .same_bits_as = "fp32"},
      {.op = "gemm", .name = "bf16_heuristic", .backend = "cpu",
       .summary = "= bf16 (the CPU's GEMM has no heuristic); named for replays of GPU traces",
       .bound = 3e-2, .same_bits_as = "bf16"},
      {.op = "gemm", .name = "fp8_dot", .backend = "cpu",
       .summary = "FP8 e4m3 weights with 128x128 block scales (an FP8 checkpoint's own, else amax/448 at load), "
                 "dequantised exactly; fp32 activations, cpu::Dot's order",
       .bound = 0.3},
      {.op = "gemm", .name = "w8a8_dot", .backend = "cpu",
       .summary = "fp8_dot's weights, and each linear layer's input through FP8 e4m3 per 128 values (power-of-two "
                 "scale >= amax/448: DeepSeek V3.1/V3.2's act_quant, scale_fmt ue8m0); kv_b, the router and "
                 "lm_head keep fp32 inputs",
       .bound = 0.4},
      // 4-bit experts (E2M1: measured 0.1 relative L2 on the tiny V4 model's experts).
      {.op = "gemm", .name = "mxfp4_dot", .backend = "cpu",
       .summary = "DeepSeek-V4 routed experts in MXFP4 (E2M1, E8M0 scale per 32: the checkpoint's own, else "
                 "quantised at load by kernels/fp4.h), dequantised exactly in the GEMM; other weights as stored; "
                 "fp32 activations, cpu::Dot's order",
       .bound = 0.5, .model_types = {"deepseek_v4"}},
      {.op = "gemm", .name = "nvfp4_dot", .backend = "cpu",
       .summary = "DeepSeek-V4 routed experts in NVFP4 (E2M1, E4M3 scale per 16, fp32 scale_2: the checkpoint's "
                 "own, else quantised at load as ModelOpt does), dequantised in the GEMM; other weights as stored; "
                 "fp32 activations, cpu::Dot's order",
       .bound = 0.5, .model_types = {"deepseek_v4"}},
      {.op = "attn_sparse", .name = "reference", .backend = "cpu",
       .summary = "sparse attention reads exactly the indexer's selected keys",
       .is_default = true, .bound = 0},
      {.op = "softmax", .name = "reference", .backend = "cpu",
       .summary = "attention softmax: the expanded form's max-subtracted row, exp rounded once to fp32, fp64 sum; "
                 "the absorbed form's online softmax over 32-key tiles and splits (cpu::MlaAttend, the CUDA "
                 "kernels' bits)",
       .is_default = true, .bound = 0},
      {.op = "norm", .name = "fp64", .backend = "cpu",
       .summary = "RMSNorm: the sum of squares in fp64, in order",
       .is_default = true, .bound = 0},
      {.op = "norm", .name = "lanes256", .backend = "cpu",
       .summary = "RMSNorm in the CUDA kernels' order: fp32 FMA sums in 256 interleaved lanes, butterflies, a fixed "
                 "tree, fp32 rsqrt — a GPU trace's norms bit for bit",
       .bound = 1e-5, .model_types = kMlaFamilies},
      {.op = "rope", .name = "reference", .backend = "cpu",
       .summary = "RoPE in the model's own layout, prefill and decode alike",
       .is_default = true, .bound = 0},
      {.op = "page_table", .name = "reference", .backend = "cpu",
       .summary = "attention reads the request's own pages",
       .is_default = true, .bound = 0},
      {.op = "kv_quant", .name = "reference", .backend = "cpu",
       .summary = "FP8 cache writes: power-of-two scale ≥ amax/448, saturating e4m3",
       .is_default = true, .bound = 0},
      {.op = "compressor", .name = "reference", .backend = "cpu",
       .summary = "DeepSeek-V4 CSA / HCA: a window of m rows closes at its last position, (w + 1)·m − 1, and its "
                 "pooled entry is visible from there on (other models have no compressor)",
       .is_default = true, .bound = 0},
      // Emulated tensor parallelism (--emulate-tp N, engine/tensor_parallel.h): the all-reduce
      // that sums the ranks' partial outputs of o_proj and of the FFN. Nothing to do at TP 1.
      {.op = "allreduce", .name = "ordered", .backend = "cpu",
       .summary = "emulated TP: every element summed over the ranks in rank order 0, 1, …, N − 1 (fp32), whatever "
                 "the batch",
       .is_default = true, .bound = 0},
      {.op = "allreduce", .name = "ring", .backend = "cpu",
       .summary = "emulated TP: a ring all-reduce's order — the step's buffer cut into N chunks, chunk c summed "
                 "from rank c + 1 round to rank c — so a row's bits depend on its place in the batch",
       .batch_invariant = false, .bound = 1e-5, .model_types = kMlaFamilies},
      // The CUDA backend (engine/cuda_backend.cc, kernels/cuda/). Same op names as the CPU's so
      // a kernel choice carries across a --backend override where both have the variant. Where a
      // variant has the CPU's bits its bound is the CPU variant's (and the twin test checks the
      // bits); cuBLAS's own orders get the bound of their number format.
      {.op = "attn_prefill", .name = "absorbed", .backend = "cuda",
       .summary = "MLA prefill as one absorbed decode query per row over its causal prefix (MlaDecode)",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      {.op = "attn_decode", .name = "absorbed", .backend = "cuda",
       .summary = "MLA absorbed decode over the paged latent cache: fixed splits per key count, CPU-bitwise scores",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      {.op = "attn_sparse", .name = "reference", .backend = "cuda",
       .summary = "sparse MLA decode over the indexer's top-k slots, FP8 dequantised in the kernel "
                 "(MlaSparseDecode)",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      {.op = "indexer", .name = "reference", .backend = "cuda",
       .summary = "V3.2 indexer: one thread per key, CPU-bitwise scores, exact radix top-k (ties: lowest position)",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      {.op = "indexer", .name = "fp8_paged", .backend = "cuda",
       .summary = "V3.2 indexer, the official FP8 path: Hadamard, q and keys as FP8 rows (keys quantised on write, "
                 "132 bytes), exact dot products on fp64 tensor cores (bitwise the CPU's), 64-key tiles past a "
                 "request's end exit at once",
       .cpu_bits = true, .bound = 0.2},
      {.op = "indexer", .name = "hadamard", .backend = "cuda",
       .summary = "V3.2 indexer with the official Hadamard rotation of q and k after RoPE (Hadamard kernel: the "
                 "CPU's butterflies, bitwise)",
       .cpu_bits = true, .bound = 1e-5},
      {.op = "gemm", .name = "fp32", .backend = "cuda",
       .summary = "cuBLASLt fp32 (COMPUTE_32F_PEDANTIC, no TF32), algorithm pinned per shape without split-K",
       .is_default = true, .bound = 1e-5},
      {.op = "gemm", .name = "bf16", .backend = "cuda",
       .summary = "cuBLASLt bf16 inputs, fp32 accumulation, algorithm pinned per shape; the routed experts on "
                 "tensor cores (mma.m16n8k16, one fixed K order: batch-invariant)",
       .bound = 3e-2},
      {.op = "gemm", .name = "fp32_dot", .backend = "cuda",
       .summary = "fp32 on CUDA cores in cpu::Dot's order (ExpertGemm): bitwise the CPU's gemm=fp32 for any rows",
       .cpu_bits = true, .bound = 1e-5},
      {.op = "gemm", .name = "bf16_dot", .backend = "cuda",
       .summary = "bf16 weights and activations, fp32 in cpu::Dot's order (ExpertGemm): bitwise the CPU's gemm=bf16",
       .cpu_bits = true, .bound = 3e-2},
      {.op = "gemm", .name = "fp8_dot", .backend = "cuda",
       .summary = "FP8 e4m3 weights with 128x128 block scales, dequantised in the kernel (one fp32 rounding), fp32 "
                 "activations, cpu::Dot's order: bitwise the CPU's gemm=fp8_dot; half of bf16's weight bytes",
       .cpu_bits = true, .bound = 0.3},
      {.op = "gemm", .name = "w8a8_dot", .backend = "cuda",
       .summary = "fp8_dot with each linear layer's input through FP8 per 128 values first (Fp8RoundTrip kernel): "
                 "bitwise the CPU's gemm=w8a8_dot",
       .cpu_bits = true, .bound = 0.4},
      {.op = "gemm", .name = "fp32_heuristic", .backend = "cuda",
       .summary = "cuBLASLt fp32 with its per-shape heuristic: deterministic, NOT batch-invariant (split-K varies "
                 "with rows)",
       .batch_invariant = false, .bound = 1e-5},
      {.op = "gemm", .name = "bf16_heuristic", .backend = "cuda",
       .summary = "cuBLASLt bf16 with its per-shape heuristic: deterministic, NOT batch-invariant",
       .batch_invariant = false, .bound = 3e-2},
      {.op = "norm", .name = "lanes256", .backend = "cuda",
       .summary = "RMSNorm, a CTA of 256 threads a row: fp32 FMA lanes, butterflies, a fixed tree (cpu: "
                 "norm=lanes256)",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      {.op = "softmax", .name = "reference", .backend = "cuda",
       .summary = "online softmax over 32-key tiles in ascending order, splits merged in order",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      {.op = "rope", .name = "reference", .backend = "cuda",
       .summary = "RoPE in the model's own layout, CPU-bitwise",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      {.op = "page_table", .name = "reference", .backend = "cuda",
       .summary = "attention reads the request's own pages",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      // Under the CUDA defaults the FP8 cache rounds a latent whose last bits came from cuBLAS, not
      // the CPU's order: a value near an e4m3 rounding boundary steps by 2^-4 (measured p90 6.1e-4,
      // worst row 3.8e-3 on v2_qlora_group; ≤ 5.4e-6 elsewhere). With every op CPU-bitwise the
      // bits are the CPU's (the twin test checks that too).
      {.op = "kv_quant", .name = "reference", .backend = "cuda",
       .summary = "FP8 cache writes byte-identical to the CPU cache's",
       .is_default = true, .cpu_bits = true, .bound = 5e-3},
      {.op = "allreduce", .name = "ordered", .backend = "cuda",
       .summary = "emulated TP: every element summed over the ranks in rank order 0, 1, …, N − 1 (fp32), the CPU's "
                 "bits",
       .is_default = true, .cpu_bits = true, .bound = 1e-5},
      {.op = "allreduce", .name = "ring", .backend = "cuda",
       .summary = "emulated TP: the ring all-reduce's order (chunk c of the step's buffer from rank c + 1 round to "
                 "rank c), the CPU's bits — not batch-invariant",
       .batch_invariant = false, .cpu_bits = true, .bound = 1e-5, .model_types = kMlaFamilies},
      // The fault zoo (docs/fault-zoo.md): wrong on purpose, reachable only through --fault.
      {.op = "indexer", .name = "fault_skip_partial_page", .backend = "cpu",
       .summary = "FAULT: indexer early-exit never scores keys in the request's last, partial page",
       .fault = true, .model_types = kMlaFamilies},
      {.op = "attn_sparse", .name = "fault_neg1_as_token0", .backend = "cpu",
       .summary = "FAULT: selection padded to index_topk with -1, and -1 read as token 0",
       .fault = true, .model_types = kMlaFamilies},
      {.op = "kv_quant", .name = "fault_fp8_no_clamp", .backend = "cpu",
       .summary = "FAULT: FP8 scale rounded to the nearest power of two and no 448 clamp: overflow becomes NaN",
       .fault = true, .model_types = kMlaFamilies},
      {.op = "rope", .name = "fault_decode_wrong_interleave", .backend = "cpu",
       .summary = "FAULT: decode steps rotate q and k with the other RoPE layout (prefill is right)",
       .fault = true, .model_types = kMlaFamilies},
      {.op = "page_table", .name = "fault_cross_request", .backend = "cpu",
       .summary = "FAULT: reads of a request's second page go to the neighbouring physical page (another request's)",
       .fault = true, .model_types = kMlaFamilies},
      {.op = "softmax", .name = "fault_no_max_fp16_sum", .backend = "cpu",
       .summary = "FAULT: no max subtraction and an fp16 denominator: overflows to inf on long contexts",
       .fault = true, .model_types = kMlaFamilies},
      {.op = "allreduce", .name = "fault_rotate_by_row", .backend = "cpu",
       .summary = "FAULT: emulated TP's all-reduce claims rank order but starts row i's sum at rank i mod N (a "
                 "chunking bug): rows past the first of a step change bits, and with them the batch",
       .fault = true, .model_types = kMlaFamilies},
      {.op = "allreduce", .name = "fault_rotate_by_row", .backend = "cuda",
       .summary = "FAULT: the CPU's fault_rotate_by_row on the CUDA backend (row i's sum from rank i mod N), its bits",
       .fault = true, .model_types = kMlaFamilies},
      // DeepSeek-V4's fault zoo: each refused on other models (model_types).
      {.op = "compressor", .name = "fault_close_late", .backend = "cpu",
       .summary = "FAULT (V4): a compressor closes its window one token late — at (w + 1)·m, not (w + 1)·m − 1 — "
                 "so the query at the window's last position reads an entry not yet written (zeros)",
       .fault = true, .model_types = {"deepseek_v4"}},
      {.op = "indexer", .name = "fault_key_layout", .backend = "cpu",
       .summary = "FAULT (V4): the CSA indexer's compressed keys are written token-major and read dim-major within "
                 "a page, so every score past a page's first key reads other keys' values",
       .fault = true, .model_types = {"deepseek_v4"}},
      {.op = "softmax", .name = "fault_sink_one_side", .backend = "cpu",
       .summary = "FAULT (V4): the attention sink enters the softmax's max but not its denominator: the sink's share "
                 "is never taken, the weights sum to 1 without it",
       .fault = true, .model_types = {"deepseek_v4"}},
      {.op = "attn_sparse", .name = "fault_window_one_short", .backend = "cpu",
       .summary = "FAULT (V4): the sliding window keeps W − 1 rows (itself included), one too few, once a request "
                 "passes W tokens",
       .fault = true, .model_types = {"deepseek_v4"}},
  };
}

bool KernelVariant::RunsOn(std::string_view model_type) const {
  if (model_types.empty()) return true;
  for (const std::string& t : model_types) {
    if (t == model_type) return true;
  }
  return false;
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
    for (const auto& v : variants_) {
      if (v.fault && v.name == fault) {
        return Status::InvalidArgument("--fault " + std::string(fault) + ": runs on --backend " + v.backend +
                                       " only (the " + std::string(backend) + " backend's faults: " + known + ")");
      }
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
