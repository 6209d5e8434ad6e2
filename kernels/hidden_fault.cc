// kernels/hidden_fault.cc — see hidden_fault.h.
#include "kernels/hidden_fault.h"

#include <cstdlib>

namespace lockstep::kernels {

const std::vector<HiddenFaultInfo>& HiddenFaults() {
  static const std::vector<HiddenFaultInfo> kAll = {
      {HiddenFault::kNormMeanOverNMinus1, "norm_mean_n_minus_1", "norm", "RMSNorm divides the sum of squares by n − 1"},
      {HiddenFault::kNormBatchFp32Sum, "norm_batch_fp32_sum", "norm",
       "with more than one request in a step, RMSNorm sums squares in fp32 (last-bit, batch-dependent)"},
      {HiddenFault::kRopeDecodeKeyPosMinus1, "rope_decode_key_pos_minus_1", "rope",
       "decode rows rotate the new shared key at position p − 1 (q is right)"},
      {HiddenFault::kAttnPrefillCausalLeak, "attn_prefill_causal_leak", "attn_prefill",
       "each prefill query also attends to the next prompt token"},
      {HiddenFault::kIndexerSkipsSelf, "indexer_skips_self", "indexer",
       "the indexer scores keys t < p only (off by one; position 0 keeps itself)"},
      {HiddenFault::kRouterBiasInWeights, "router_bias_in_weights", "router",
       "the expert weights are taken from score + correction bias instead of the score"},
      {HiddenFault::kExpertDownKTail, "expert_down_k_tail", "gemm",
       "routed experts' down projection stops at the last full 64-wide K tile"},
      {HiddenFault::kLmHeadDropsLastHidden, "lm_head_drops_last_hidden", "gemm",
       "the LM head's dot products stop one element short of the hidden size"},
      {HiddenFault::kPageDoubleHandout, "page_double_handout", "page_table",
       "a request's pages after its first stay on the free list, so the next request is handed the same page"},
      {HiddenFault::kSamplerCdfTotalMass, "sampler_cdf_total_mass", "sampler",
       "inverse CDF at u × the total mass instead of the top-p kept mass (the last kept token wins too often)"},
      {HiddenFault::kKvBf16Truncate, "kv_bf16_truncate", "kv_quant",
       "the bf16 cache truncates (rounds toward zero) instead of rounding to nearest even"},
      {HiddenFault::kKvFp8ScaleFloor, "kv_fp8_scale_floor", "kv_quant",
       "the FP8 cache's tile scale is rounded down to a power of two and the largest values saturate at 448"},
      {HiddenFault::kIndexKeyFp8Truncate, "index_key_fp8_truncate", "kv_quant",
       "V3.2's FP8 index keys (indexer=fp8_paged) round each value toward zero, not to nearest: looks like rounding"},
      {HiddenFault::kV4SinkhornOneRoundShort, "v4_sinkhorn_one_round_short", "hyper_connection",
       "DeepSeek-V4: the hyper-connections' Sinkhorn runs one (rows, columns) round fewer than hc_sinkhorn_iters"},
      {HiddenFault::kV4CompressorOverlapNoBias, "v4_compressor_overlap_no_bias", "compressor",
       "DeepSeek-V4: CSA's compressor pools the previous window's slots without their position bias"},
      {HiddenFault::kV4HashRouteNextToken, "v4_hash_route_next_token", "router",
       "DeepSeek-V4: hash-routed layers look token t up as t + 1 in tid2eid"},
      {HiddenFault::kSoftmaxScaleNopeDim, "softmax_scale_nope_dim", "attention",
       "the config's attention scale is qk_nope_head_dim^−½, the RoPE dims left out (ModelConfig::softmax_scale: every backend)",
       "cpu, cuda"},
      {HiddenFault::kConfigScalingFactorDropped, "config_scaling_factor_dropped", "router",
       "the config parser leaves routed_scaling_factor at 1 whatever config.json says (every backend)", "cpu, cuda"},
      {HiddenFault::kCudaNormMeanOverNMinus1, "cuda_norm_mean_n_minus_1", "norm",
       "CUDA: the RMSNorm row every normalising kernel shares divides the sum of squares by n − 1", "cuda"},
      {HiddenFault::kCudaLatentRopePosMinus1, "cuda_latent_rope_pos_minus_1", "rope",
       "CUDA: the latent-cache path kernel rotates the shared RoPE key at position p − 1 (p > 0; q is right)", "cuda"},
      {HiddenFault::kCudaRouteBiasInWeights, "cuda_route_bias_in_weights", "router",
       "CUDA: the routing warp takes the expert weights from score + correction bias", "cuda"},
      {HiddenFault::kCudaExpertDownKTail, "cuda_expert_down_k_tail", "gemm",
       "CUDA: the routed experts' down GEMM is launched with K cut to the last full 64-wide tile", "cuda"},
  };
  return kAll;
}

Result<HiddenFault> ActiveHiddenFault() {
  static const Result<HiddenFault> active = []() -> Result<HiddenFault> {
    const char* v = std::getenv("LOCKSTEP_TEST_HIDDEN_FAULT");
    if (v == nullptr || *v == 0) return HiddenFault::kNone;
    std::string known;
    for (const auto& f : HiddenFaults()) {
      if (f.name == v) return f.id;
      known += (known.empty() ? "" : ", ") + std::string(f.name);
    }
    return Status::InvalidArgument("LOCKSTEP_TEST_HIDDEN_FAULT=" + std::string(v) + ": unknown hidden fault (" + known + ")");
  }();
  return active;
}

HiddenFault HiddenFaultOrNone() {
  auto r = ActiveHiddenFault();
  return r.ok() ? *r : HiddenFault::kNone;
}

}  // namespace lockstep::kernels
