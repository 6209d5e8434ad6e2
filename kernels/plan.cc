// kernels/plan.cc — the one table from variant names to plan values.
#include "kernels/plan.h"

#include <array>
#include <string_view>

namespace lockstep::kernels {
namespace {

struct Row {
  std::string_view op, variant;
  int value;
};

template <typename E>
constexpr int V(E e) {
  return static_cast<int>(e);
}

// Every variant of every backend, by (op, name): the same name means the same math on both.
constexpr std::array kRows = {
    Row{"gemm", "fp32", V(Gemm::kFp32)},
    Row{"gemm", "bf16", V(Gemm::kBf16)},
    Row{"gemm", "fp32_dot", V(Gemm::kFp32Dot)},
    Row{"gemm", "bf16_dot", V(Gemm::kBf16Dot)},
    Row{"gemm", "fp8_dot", V(Gemm::kFp8Dot)},
    Row{"gemm", "w8a8_dot", V(Gemm::kW8a8Dot)},
    Row{"gemm", "fp32_heuristic", V(Gemm::kFp32Heuristic)},
    Row{"gemm", "bf16_heuristic", V(Gemm::kBf16Heuristic)},
    Row{"gemm", "mxfp4_dot", V(Gemm::kMxfp4Dot)},
    Row{"gemm", "nvfp4_dot", V(Gemm::kNvfp4Dot)},
    Row{"attn_prefill", "expanded", V(AttnPrefill::kExpanded)},
    Row{"attn_prefill", "absorbed", V(AttnPrefill::kAbsorbed)},
    Row{"attn_decode", "absorbed", V(AttnDecode::kAbsorbed)},
    Row{"attn_decode", "expanded", V(AttnDecode::kExpanded)},
    Row{"attn_sparse", "reference", V(AttnSparse::kReference)},
    Row{"attn_sparse", "fault_neg1_as_token0", V(AttnSparse::kFaultNeg1AsToken0)},
    Row{"attn_sparse", "fault_window_one_short", V(AttnSparse::kFaultWindowOneShort)},
    Row{"indexer", "reference", V(Indexer::kReference)},
    Row{"indexer", "hadamard", V(Indexer::kHadamard)},
    Row{"indexer", "fp8_paged", V(Indexer::kFp8Paged)},
    Row{"indexer", "fault_skip_partial_page", V(Indexer::kFaultSkipPartialPage)},
    Row{"indexer", "fault_key_layout", V(Indexer::kFaultKeyLayout)},
    Row{"indexer", "dense", V(Indexer::kDense)},
    Row{"softmax", "reference", V(Softmax::kReference)},
    Row{"softmax", "fault_no_max_fp16_sum", V(Softmax::kFaultNoMaxFp16Sum)},
    Row{"softmax", "fault_sink_one_side", V(Softmax::kFaultSinkOneSide)},
    Row{"norm", "fp64", V(Norm::kFp64)},
    Row{"norm", "lanes256", V(Norm::kLanes256)},
    Row{"rope", "reference", V(Rope::kReference)},
    Row{"rope", "fault_decode_wrong_interleave", V(Rope::kFaultDecodeWrongInterleave)},
    Row{"page_table", "reference", V(PageTable::kReference)},
    Row{"page_table", "fault_cross_request", V(PageTable::kFaultCrossRequest)},
    Row{"kv_quant", "reference", V(KvQuant::kReference)},
    Row{"kv_quant", "fault_fp8_no_clamp", V(KvQuant::kFaultFp8NoClamp)},
    Row{"compressor", "reference", V(Compressor::kReference)},
    Row{"compressor", "fault_close_late", V(Compressor::kFaultCloseLate)},
    Row{"allreduce", "ordered", V(AllReduce::kOrdered)},
    Row{"allreduce", "ring", V(AllReduce::kRing)},
    Row{"allreduce", "fault_rotate_by_row", V(AllReduce::kFaultRotateByRow)},
};

std::string_view NameOf(std::string_view op, int value) {
  for (const Row& r : kRows) {
    if (r.op == op && r.value == value) return r.variant;
  }
  return "?";
}

}  // namespace

int PlanValue(const std::string& op, const std::string& variant) {
  for (const Row& r : kRows) {
    if (r.op == op && r.variant == variant) return r.value;
  }
  return -1;
}

Result<KernelPlan> KernelPlan::From(const KernelChoice& resolved) {
  KernelPlan p;
  for (const auto& [op, variant] : resolved) {
    const int v = PlanValue(op, variant);
    if (v < 0) return Status::Internal("kernel plan: no plan value for " + op + "=" + variant + " (kernels/plan.cc)");
    if (op == "gemm") p.gemm = static_cast<Gemm>(v);
    else if (op == "attn_prefill") p.attn_prefill = static_cast<AttnPrefill>(v);
    else if (op == "attn_decode") p.attn_decode = static_cast<AttnDecode>(v);
    else if (op == "attn_sparse") p.attn_sparse = static_cast<AttnSparse>(v);
    else if (op == "indexer") p.indexer = static_cast<Indexer>(v);
    else if (op == "softmax") p.softmax = static_cast<Softmax>(v);
    else if (op == "norm") p.norm = static_cast<Norm>(v);
    else if (op == "rope") p.rope = static_cast<Rope>(v);
    else if (op == "page_table") p.page_table = static_cast<PageTable>(v);
    else if (op == "kv_quant") p.kv_quant = static_cast<KvQuant>(v);
    else if (op == "compressor") p.compressor = static_cast<Compressor>(v);
    else if (op == "allreduce") p.allreduce = static_cast<AllReduce>(v);
    else return Status::Internal("kernel plan: op '" + op + "' has no plan field (kernels/plan.h)");
  }
  return p;
}

std::string KernelPlan::Describe() const {
  std::string s;
  auto add = [&](std::string_view op, int v) {
    s += (s.empty() ? "" : " ") + std::string(op) + "=" + std::string(NameOf(op, v));
  };
  add("allreduce", V(allreduce));
  add("attn_decode", V(attn_decode));
  add("attn_prefill", V(attn_prefill));
  add("attn_sparse", V(attn_sparse));
  add("compressor", V(compressor));
  add("gemm", V(gemm));
  add("indexer", V(indexer));
  add("kv_quant", V(kv_quant));
  add("norm", V(norm));
  add("page_table", V(page_table));
  add("rope", V(rope));
  add("softmax", V(softmax));
  return s;
}

}  // namespace lockstep::kernels
