// kernels/plan.h — the kernel choices of a run, resolved once into typed values.
//
// The registry (registry.h) names variants by strings, because traces and flags do; the
// forward passes must not. At engine creation the resolved choice (Registry::Resolve: every op
// named, defaults filled) becomes a KernelPlan — one enum a op — and a forward pass switches
// on those. A fault-zoo variant is a value like any other (Rope::kFaultDecodeWrongInterleave):
// nothing downstream knows faults exist apart from dispatching to their code. Adding a
// variant = its registry entry, its enum value and its row in plan.cc's table; plan_test checks
// that every registry variant of every backend has a value.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"
#include "kernels/collective.h"
#include "kernels/hidden_fault.h"
#include "kernels/registry.h"

namespace lockstep::kernels {

// gemm: every product's precision and order (kernels list them: `lockstep kernels`).
enum class Gemm : uint8_t {
  kFp32,           // fp32 weights and activations (CPU: 16-lane FMA dots; CUDA: cuBLAS, pinned)
  kBf16,           // bf16-rounded weights and activations, fp32 accumulation (CUDA: cuBLAS / tensor cores)
  kFp32Dot,        // kFp32 in cpu::Dot's order (CUDA: the CPU's bits)
  kBf16Dot,        // kBf16 in cpu::Dot's order
  kFp8Dot,         // FP8 block-scaled weights as stored, cpu::Dot's order
  kW8a8Dot,        // kFp8Dot's weights and the linear layers' inputs through FP8
  kFp32Heuristic,  // kFp32 with cuBLAS's heuristic algorithm (not pinned)
  kBf16Heuristic,  // kBf16 likewise
  kMxfp4Dot,       // routed experts in MXFP4 (the checkpoint's, else quantised at load), cpu::Dot's order
  kNvfp4Dot,       // routed experts in NVFP4 likewise
};
enum class AttnPrefill : uint8_t { kExpanded, kAbsorbed };
enum class AttnDecode : uint8_t { kAbsorbed, kExpanded };
enum class AttnSparse : uint8_t { kReference, kFaultNeg1AsToken0, kFaultWindowOneShort };
enum class Indexer : uint8_t { kReference, kHadamard, kFp8Paged, kFaultSkipPartialPage, kFaultKeyLayout, kDense };
enum class Softmax : uint8_t { kReference, kFaultNoMaxFp16Sum, kFaultSinkOneSide };
enum class Norm : uint8_t { kFp64, kLanes256 };
enum class Rope : uint8_t { kReference, kFaultDecodeWrongInterleave };
enum class PageTable : uint8_t { kReference, kFaultCrossRequest };
enum class KvQuant : uint8_t { kReference, kFaultFp8NoClamp };
// DeepSeek-V4's compressors (CSA / HCA): when a window of m rows closes.
enum class Compressor : uint8_t { kReference, kFaultCloseLate };
// Emulated tensor parallelism (--emulate-tp N): how the ranks' partial outputs are summed.
enum class AllReduce : uint8_t { kOrdered, kRing, kFaultRotateByRow };

struct KernelPlan {
  Gemm gemm = Gemm::kFp32;
  AttnPrefill attn_prefill = AttnPrefill::kExpanded;
  AttnDecode attn_decode = AttnDecode::kAbsorbed;
  AttnSparse attn_sparse = AttnSparse::kReference;
  Indexer indexer = Indexer::kReference;
  Softmax softmax = Softmax::kReference;
  Norm norm = Norm::kFp64;
  Rope rope = Rope::kReference;
  PageTable page_table = PageTable::kReference;
  KvQuant kv_quant = KvQuant::kReference;
  Compressor compressor = Compressor::kReference;
  AllReduce allreduce = AllReduce::kOrdered;
  // Tensor parallelism emulated on one device (EngineOptions::emulate_tp): 1 = none.
  int emulate_tp = 1;
  // Set: this engine is rank ranks->rank() of emulate_tp real ranks (EngineOptions::tp_ranks):
  // it computes its shard only, and the collective gathers the partials the emulation sums.
  std::shared_ptr<Collective> ranks;
  bool tp_gather_taps = true;  // EngineOptions::tp_gather_taps
  // A hidden fault (kernels/hidden_fault.h) inside the defaults: not a variant, not in Describe().
  HiddenFault hidden = HiddenFault::kNone;

  // What a gemm variant means for the weights and the products.
  bool bf16() const { return gemm == Gemm::kBf16 || gemm == Gemm::kBf16Dot || gemm == Gemm::kBf16Heuristic; }
  bool w8a8() const { return gemm == Gemm::kW8a8Dot; }
  bool fp8_weights() const { return gemm == Gemm::kFp8Dot || gemm == Gemm::kW8a8Dot; }
  // The routed experts held in a 4-bit format (kernels/fp4.h): mxfp4_dot, nvfp4_dot.
  bool fp4_experts() const { return gemm == Gemm::kMxfp4Dot || gemm == Gemm::kNvfp4Dot; }
  // The products in cpu::Dot's order (the *_dot variants).
  bool dot() const {
    return gemm == Gemm::kFp32Dot || gemm == Gemm::kBf16Dot || gemm == Gemm::kFp8Dot || gemm == Gemm::kW8a8Dot ||
           fp4_experts();
  }
  // cuBLAS with a pinned algorithm (batch-invariant); the *_heuristic variants let it choose.
  bool pinned_algorithm() const { return gemm != Gemm::kFp32Heuristic && gemm != Gemm::kBf16Heuristic; }
  // The indexer's q and k Hadamard-rotated (hadamard, and fp8_paged which also stores them in FP8).
  bool indexer_hadamard() const { return indexer == Indexer::kHadamard || indexer == Indexer::kFp8Paged; }

  // From a choice Registry::Resolve returned (every op named); an op or variant this table does
  // not know is an Internal error naming it (a registry entry without its plan row).
  static Result<KernelPlan> From(const KernelChoice& resolved);
  // The variant name of each field, for messages ("gemm=bf16_dot").
  std::string Describe() const;
};

// The plan's enum value for (op, variant), as an integer, or −1: what plan_test checks every
// registry entry against.
int PlanValue(const std::string& op, const std::string& variant);

}  // namespace lockstep::kernels
