// engine/memory.h — what a model needs in memory on each backend (`lockstep model info`).
//
// Computed from the config and the weights as stored (ModelWeights::Load's views, or
// ModelWeights::Shapes' for a folder with a config.json and no checkpoint), without running
// anything: the CPU reference maps the checkpoint and reads it in place, so its weights cost
// the files' bytes (resident as far as a run reads them: all of a dense model, the experts it
// routes to of an MoE one); the CUDA backend uploads a copy in the gemm variant's precision
// (engine/cuda_backend.cc UploadWeights, whose rules DeviceWeightBytes follows).
#pragma once

#include <cstdint>

#include "engine/config.h"
#include "engine/kv_cache.h"
#include "engine/weights.h"

namespace lockstep::engine {

// The weight precisions the CUDA backend uploads, one per family of gemm variants.
enum class DeviceWeights {
  kFp32,  // gemm=fp32, fp32_dot, fp32_heuristic: every matrix fp32
  kBf16,  // gemm=bf16, bf16_dot, bf16_heuristic: the product matrices bf16, the rest fp32
  kFp8,   // gemm=fp8_dot, w8a8_dot: the product matrices FP8 (bytes + a scale per row per 128
          // columns) where they have an FP8 form, fp32 where not; the rest fp32
};

// Bytes of the weights the CUDA backend allocates for `w` in `precision` (W_UKᵀ, the absorbed
// attention's transposed copy of kv_b_proj's W_UK rows, included).
uint64_t DeviceWeightBytes(const ModelConfig& c, const ModelWeights& w, DeviceWeights precision);

// Bytes of the FP8 forms the CPU makes for gemm=fp8_dot / w8a8_dot when the checkpoint has no
// FP8 tensors (Model::Fp8Weights: each product matrix quantised, values and scales); 0 for an
// FP8 checkpoint, which runs on its own bytes.
uint64_t CpuFp8CopyBytes(const ModelWeights& w);

// Bytes a KV cache of `format` holds per token, every layer's streams (the latent; V3.2's
// index keys, fp32 or FP8 rows with `fp8_index_keys`).
uint64_t KvBytesPerToken(const ModelConfig& c, KvFormat format, bool fp8_index_keys = false);

// Bytes of the stored weights one decode step reads: every weight as stored, each MoE layer's
// routed experts counted num_experts_per_tok times (the embedding table whole, as
// ActiveParameterCount counts it).
uint64_t ActiveWeightBytes(const ModelConfig& c, const ModelWeights& w);

// ≈ bytes of the CPU forward's buffers for one step that prefills `tokens` tokens of one
// request (fp32 activations, the expanded attention's K/V rows, the last logits row): what a
// step adds on top of the weights and the KV cache. An estimate, not an accounting.
uint64_t CpuActivationBytes(const ModelConfig& c, int64_t tokens);

}  // namespace lockstep::engine
