// engine/weights.h — ModelWeights: every parameter of a DeepSeek-family model, held as the
// checkpoint stores it, validated against the ModelConfig.
//
// A matrix is a view into the memory-mapped checkpoint (kernels::WeightView: F32, BF16, F16,
// or F8_E4M3 with 128×128 block scales — `<name>.weight_scale_inv`, the format DeepSeek-V3 is
// published in: dequantised = fp8 value × scale_inv), read in place; nothing is converted at
// load, so a checkpoint costs its file's bytes (resident as far as it is read) and the kernels
// dequantise the rows they multiply (cpu::MatMulNT over a WeightView). Vectors (norms, biases)
// are decoded to fp32 at load: they are small and read whole. Every tensor the model needs
// must be present with the shape the config implies; tensors of MTP layers (layers ≥
// num_hidden_layers) are skipped and listed in `skipped`.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/config.h"
#include "engine/safetensors.h"
#include "kernels/weight_view.h"

namespace lockstep::engine {

// A matrix in FP8 e4m3 with one fp32 scale per block_rows × block_cols block: element (r, c)
// is Fp8E4m3ToF32(values[r·cols + c]) × scales[(r / block_rows)·block_cols_n + c / block_cols],
// one fp32 product (DeepSeek-V3's `weight_scale_inv` layout). `values` and `scales` lie in an
// FP8 checkpoint's mapping or in memory Quantize made; `storage` keeps either alive, so a copy
// shares them.
struct Fp8Blocks {
  int64_t rows = 0, cols = 0, block_rows = 128, block_cols = 128;
  std::span<const uint8_t> values;  // [rows, cols]
  std::span<const float> scales;    // [⌈rows / block_rows⌉, ⌈cols / block_cols⌉]
  std::shared_ptr<const void> storage;
  int64_t scale_cols() const { return (cols + block_cols - 1) / block_cols; }
  float scale(int64_t r, int64_t c) const { return scales[(r / block_rows) * scale_cols() + c / block_cols]; }
  float value(int64_t r, int64_t c) const;  // the dequantised element
  void Dequantize(float* dst) const;         // every element, dst [rows, cols]
  kernels::WeightView view() const;          // the same bytes as a WeightView (kFp8E4m3Blocks)
  // Block-quantised `m` [rows, cols]: per block, scale = amax / 448 (1 for an all-zero block)
  // and value = e4m3(x / scale), rounded to nearest even, saturating (DeepSeek's quantiser).
  static Fp8Blocks Quantize(const float* m, int64_t rows, int64_t cols, int64_t block_rows = 128,
                            int64_t block_cols = 128);
};

// One weight as stored, [rows, cols] row-major (a Linear's weight: [out, in]; a vector has
// rows 1). `data` reads the elements where they lie — the checkpoint's mapping, or memory this
// Matrix shares (vectors, matrices quantised or sliced here) — and `storage` keeps them alive:
// copying a Matrix copies no weights. data[i] is element i dequantised to fp32, the value the
// forward pass computes with; data.size() = rows·cols.
// `fp8`, when set, is the FP8 form `data` reads (data.dtype == kFp8E4m3Blocks): an FP8
// checkpoint's own bytes and scales (gemm=fp8_dot), or a quantisation made for it
// (Model::Fp8Weights).
struct Matrix {
  int64_t rows = 0, cols = 0;
  kernels::WeightView data;
  std::shared_ptr<const void> storage;
  std::shared_ptr<const Fp8Blocks> fp8;
  // The elements in place when stored as fp32 (every vector is), else null.
  const float* ptr() const { return data.f32(); }
  const float* row(int64_t r) const { return data.f32() == nullptr ? nullptr : data.f32() + r * cols; }
  bool empty() const { return rows * cols == 0; }
  // Rows [first, first + n): a view of the same storage.
  Matrix Rows(int64_t first, int64_t n) const;
  // Every element dequantised, [rows, cols] (a copy: uploads, quantisation, tests).
  std::vector<float> Dequantized() const;
  // Bytes the view reads (elements and scales), for memory estimates.
  size_t stored_bytes() const { return data.stored_bytes(); }

  static Matrix Fp32(std::vector<float> values, int64_t rows, int64_t cols);  // owning fp32
  static Matrix FromFp8(std::shared_ptr<const Fp8Blocks> f);                  // shares f's bytes
};

// Checkpoint tensor `name` as a Matrix read in place: [rows, cols], or a stack [n, rows, cols]
// held as [n·rows, cols] (F32, BF16, F16); or F8_E4M3 [rows, cols] with its block scales —
// `<name>_scale_inv` (F32, transformers' name) or, for `<p>.weight`, `<p>.scale` (F8_E8M0 or
// F32, DeepSeek's official name), [⌈rows / block_rows⌉, ⌈cols / block_cols⌉]; or a 4-bit
// `<p>.weight` (I8 / U8 [rows, cols/2], two E2M1 codes a byte) with `<p>.scale` (MXFP4) or
// `<p>.weight_scale` + `<p>.weight_scale_2` (NVFP4), kernels/fp4.h. A vector (1-D) is decoded
// to fp32. The Matrix keeps the checkpoint's mapping alive. `companions`, when given, receives
// the names of the scale tensors read with the weight.
Result<Matrix> LoadMatrix(const Checkpoint& ck, const std::string& name, int64_t block_rows = 128,
                          int64_t block_cols = 128, std::vector<std::string>* companions = nullptr);

// The shape a stored tensor holds as a matrix: its shape, but a 4-bit one's last dimension ×2
// (I8 / U8 [rows, cols/2] with scale tensors beside it, as LoadMatrix reads it).
std::vector<int64_t> LogicalShape(const Checkpoint& ck, const TensorView& t);

struct ModelWeights;

// What every model family's loader does with one tensor the config implies: checkpoint tensor
// `name` (as stored) must exist with LogicalShape `shape` ({n}, {rows, cols} or {n, rows, cols});
// it is read by LoadMatrix with the config's FP8 block size, its dtype counted in
// w->dtype_counts ("MXFP4" / "NVFP4" for the 4-bit ones), FP8 matrices in w->fp8_tensors, and
// it and its scale tensors inserted into *used. A wrong shape is one line naming the file and
// the tensor.
Status LoadConfiguredMatrix(const Checkpoint& ck, const ModelConfig& c, const std::string& name,
                            const std::vector<int64_t>& shape, Matrix* out, ModelWeights* w,
                            std::set<std::string>* used);

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

struct V4Weights;  // engine/v4_weights.h

struct ModelWeights {
  Matrix embed;    // [vocab, hidden]
  Matrix final_norm;
  Matrix lm_head;  // [vocab, hidden] (embed's view when tied: the same bytes)
  std::vector<LayerWeights> layers;
  // DeepSeek-V4 (family kDeepseekV4): every other tensor; `layers` stays empty.
  std::shared_ptr<const V4Weights> v4;

  // --random-weights: no tensor is materialised on the host; a device backend generates every
  // weight from this seed (engine/cuda_backend.cc). The CPU backend refuses such a model.
  std::optional<uint64_t> random_seed;

  std::vector<std::string> skipped;   // tensors present but not used (MTP layers, extras)
  int64_t mtp_tensors = 0;            // of those, tensors of MTP layers (model.layers.{≥ num_hidden_layers}.*)
  std::map<std::string, int64_t> dtype_counts;  // "BF16" → number of tensors, for `model info`
  int64_t fp8_tensors = 0;
  uint64_t mapped_bytes = 0;  // the checkpoint files' sizes (the mapping the matrices read)

  // Shapes(): matrices without bytes (nothing can run on them) — what `model info` counts for a
  // folder that has a config.json and no checkpoint.
  bool shapes_only = false;

  static Result<ModelWeights> Load(const ModelConfig& config, const Checkpoint& ckpt);
  // The weights a checkpoint of `config` holds, shapes and dtypes only: every tensor `dtype`,
  // but FP8 blocks for the matrices DeepSeek publishes in FP8 when the config
  // declares FP8 (quantization_config); lm_head unless tied, V3's router bias.
  static ModelWeights Shapes(const ModelConfig& config, kernels::WeightDType dtype);
};

// Parameter counts of `w`: total, and active per token (routed experts counted
// num_experts_per_tok times).
int64_t ParameterCount(const ModelConfig& c, const ModelWeights& w);
int64_t ActiveParameterCount(const ModelConfig& c, const ModelWeights& w);

// f(m) for every matrix of a product (GEMM) — the ones a lower-precision GEMM variant computes
// in its precision: embeddings, norms and the router stay fp32, as inference stacks keep them.
// `W` is ModelWeights or const ModelWeights.
template <typename W, typename F>
void ForEachProductMatrix(W& w, F f) {
  f(w.lm_head);
  for (auto& L : w.layers) {
    for (auto* m : {&L.q_proj, &L.q_a_proj, &L.q_b_proj, &L.kv_a_proj, &L.kv_b_proj, &L.o_proj, &L.indexer.wq_b,
                    &L.indexer.wk, &L.indexer.weights_proj}) {
      f(*m);
    }
    for (auto* m : {&L.mlp, &L.shared}) {
      f(m->gate);
      f(m->up);
      f(m->down);
    }
    for (auto& e : L.experts) {
      f(e.gate);
      f(e.up);
      f(e.down);
    }
  }
}

// f(m) for every weight the checkpoint stores, each once (lm_head only when untied).
template <typename F>
void ForEachMatrix(const ModelConfig& c, const ModelWeights& w, F f) {
  f(w.embed);
  f(w.final_norm);
  if (!c.tie_word_embeddings) f(w.lm_head);
  for (const auto& L : w.layers) {
    for (const Matrix* m : {&L.input_norm, &L.post_attn_norm, &L.q_proj, &L.q_a_proj, &L.q_a_norm, &L.q_b_proj,
                            &L.kv_a_proj, &L.kv_a_norm, &L.kv_b_proj, &L.o_proj, &L.indexer.wq_b, &L.indexer.wk,
                            &L.indexer.k_norm_w, &L.indexer.k_norm_b, &L.indexer.weights_proj, &L.router,
                            &L.router_bias}) {
      f(*m);
    }
    for (const MlpWeights* m : {&L.mlp, &L.shared}) {
      f(m->gate);
      f(m->up);
      f(m->down);
    }
    for (const auto& e : L.experts) {
      f(e.gate);
      f(e.up);
      f(e.down);
    }
  }
}

}  // namespace lockstep::engine
