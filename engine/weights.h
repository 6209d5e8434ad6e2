// engine/weights.h — ModelWeights: every parameter of a DeepSeek-family model as fp32,
// loaded from a Checkpoint and validated against the ModelConfig.
//
// BF16, F16 and F8_E4M3-with-128×128-block-scales (`<name>.weight_scale_inv`, the format
// DeepSeek-V3 is published in: dequantized = fp8 value × scale_inv) are converted to fp32
// once, at load; F32 tensors are copied. Every tensor the model needs must be present with
// the shape the config implies; tensors of MTP layers (layers ≥ num_hidden_layers) are
// skipped and listed in `skipped`.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/config.h"
#include "engine/safetensors.h"

namespace lockstep::engine {

// A matrix in FP8 e4m3 with one fp32 scale per block_rows × block_cols block: element (r, c)
// is Fp8E4m3ToF32(values[r·cols + c]) × scales[(r / block_rows)·block_cols_n + c / block_cols],
// one fp32 product (DeepSeek-V3's `weight_scale_inv` layout).
struct Fp8Blocks {
  int64_t rows = 0, cols = 0, block_rows = 128, block_cols = 128;
  std::vector<uint8_t> values;  // [rows, cols]
  std::vector<float> scales;    // [⌈rows / block_rows⌉, ⌈cols / block_cols⌉]
  int64_t scale_cols() const { return (cols + block_cols - 1) / block_cols; }
  float scale(int64_t r, int64_t c) const { return scales[(r / block_rows) * scale_cols() + c / block_cols]; }
  float value(int64_t r, int64_t c) const;  // the dequantised element
  void Dequantize(float* dst) const;         // every element, dst [rows, cols]
  // Block-quantised `m` [rows, cols]: per block, scale = amax / 448 (1 for an all-zero block)
  // and value = e4m3(x / scale), rounded to nearest even, saturating (DeepSeek's quantiser).
  static Fp8Blocks Quantize(const float* m, int64_t rows, int64_t cols, int64_t block_rows = 128,
                            int64_t block_cols = 128);
};

// A dense fp32 matrix [rows, cols] row-major (a Linear's weight: [out, in]); a vector has rows 1.
// `fp8`, when set, holds the FP8 form `data` was dequantised from: an FP8 checkpoint's own
// bytes and scales (kept for gemm=fp8_dot), or a quantisation made for it (Model::Fp8Weights).
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<float> data;
  std::shared_ptr<const Fp8Blocks> fp8;
  const float* ptr() const { return data.data(); }
  const float* row(int64_t r) const { return data.data() + r * cols; }
  bool empty() const { return data.empty(); }
};

struct MlpWeights {  // SwiGLU: down(silu(gate(x)) · up(x))
  Matrix gate, up, down;
};

struct IndexerWeights {  // V3.2 lightning indexer
  Matrix wq_b;          // [index_n_heads·index_head_dim, q_lora_rank]
  Matrix wk;            // [index_head_dim, hidden]
  Matrix k_norm_w, k_norm_b;  // LayerNorm [index_head_dim]
  Matrix weights_proj;  // [index_n_heads, hidden]
};

struct LayerWeights {
  Matrix input_norm, post_attn_norm;  // [hidden]
  // MLA
  Matrix q_proj;                   // [H·qk_head_dim, hidden] when q_lora_rank == 0
  Matrix q_a_proj, q_a_norm, q_b_proj;  // [q_lora, hidden], [q_lora], [H·qk_head_dim, q_lora]
  Matrix kv_a_proj;                // [kv_lora + rope, hidden]
  Matrix kv_a_norm;                // [kv_lora]
  Matrix kv_b_proj;                // [H·(nope + v), kv_lora]: per head W_UK rows then W_UV rows
  Matrix o_proj;                   // [hidden, H·v]
  IndexerWeights indexer;          // V3.2 only
  // FFN
  MlpWeights mlp;                  // dense layers
  Matrix router;                   // [E, hidden]
  Matrix router_bias;              // [E] e_score_correction_bias (V3/V3.2), empty for V2
  std::vector<MlpWeights> experts; // E routed experts
  MlpWeights shared;               // n_shared_experts merged into one MLP (inter = moe_inter × n_shared)
};

struct ModelWeights {
  Matrix embed;    // [vocab, hidden]
  Matrix final_norm;
  Matrix lm_head;  // [vocab, hidden] (a copy of embed when tied)
  std::vector<LayerWeights> layers;

  // --random-weights: no tensor is materialised on the host; a device backend generates every
  // weight from this seed (engine/cuda_backend.cc). The CPU backend refuses such a model.
  std::optional<uint64_t> random_seed;

  std::vector<std::string> skipped;   // tensors present but not used (MTP layers, extras)
  int64_t mtp_tensors = 0;            // of those, tensors of MTP layers (model.layers.{≥ num_hidden_layers}.*)
  std::map<std::string, int64_t> dtype_counts;  // "BF16" → number of tensors, for `model info`
  int64_t fp8_tensors = 0;

  static Result<ModelWeights> Load(const ModelConfig& config, const Checkpoint& ckpt);
};

}  // namespace lockstep::engine
