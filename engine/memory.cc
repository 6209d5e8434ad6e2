// engine/memory.cc — see memory.h.
#include "engine/memory.h"

#include <algorithm>

namespace lockstep::engine {
namespace {

constexpr int64_t kRowScaleCols = 128;  // the device FP8 format: one scale per row per 128 columns

// Whether every row's 128-column chunks each lie in one scale block (cuda_backend.cc
// AppendRowScales): the device keeps one scale per row and chunk.
bool RowScalesFit(const Fp8Blocks& f) {
  if (f.block_cols < kRowScaleCols) return false;
  for (int64_t c0 = 0; c0 < f.cols; c0 += kRowScaleCols) {
    if (c0 / f.block_cols != (std::min(f.cols, c0 + kRowScaleCols) - 1) / f.block_cols) return false;
  }
  return true;
}

uint64_t Fp8DeviceBytes(int64_t rows, int64_t cols) {
  return static_cast<uint64_t>(rows * cols + rows * ((cols + kRowScaleCols - 1) / kRowScaleCols) * 4);
}

// A product matrix on the device: bf16, fp32, or FP8 when it has (or — a checkpoint without FP8
// tensors — is given) an FP8 form whose blocks fit the device's row scales.
uint64_t ProductBytes(const Matrix& m, DeviceWeights p, bool quantize) {
  const uint64_t n = static_cast<uint64_t>(m.rows * m.cols);
  switch (p) {
    case DeviceWeights::kFp32: return 4 * n;
    case DeviceWeights::kBf16: return 2 * n;
    case DeviceWeights::kFp8:
      if (m.fp8 != nullptr ? RowScalesFit(*m.fp8) : quantize) return Fp8DeviceBytes(m.rows, m.cols);
      return 4 * n;
  }
  return 4 * n;
}

// W_UKᵀ [nh·C, dn] (cuda_backend.cc UploadUkT): FP8 when kv_b_proj's FP8 form puts each
// transposed row's 128-value chunk in one block row, else fp32 (fp8) or the precision's.
uint64_t UkTBytes(const ModelConfig& c, const Matrix& kv_b, DeviceWeights p, bool quantize) {
  const int64_t nh = c.num_attention_heads, C = c.kv_lora_rank, dn = c.qk_nope_head_dim, dv = c.v_head_dim;
  const uint64_t n = static_cast<uint64_t>(nh * C * dn);
  if (p == DeviceWeights::kBf16) return 2 * n;
  if (p == DeviceWeights::kFp32) return 4 * n;
  const int64_t br = kv_b.fp8 != nullptr ? kv_b.fp8->block_rows : 128;
  if (kv_b.fp8 == nullptr && !quantize) return 4 * n;
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t a0 = 0; a0 < dn; a0 += kRowScaleCols) {
      const int64_t first = h * (dn + dv) + a0, last = h * (dn + dv) + std::min(dn, a0 + kRowScaleCols) - 1;
      if (first / br != last / br) return 4 * n;
    }
  }
  return Fp8DeviceBytes(nh * C, dn);
}

}  // namespace

uint64_t DeviceWeightBytes(const ModelConfig& c, const ModelWeights& w, DeviceWeights p) {
  const bool quantize = w.fp8_tensors == 0;  // fp8: a checkpoint without FP8 tensors is quantised
  auto f32 = [](const Matrix& m) { return static_cast<uint64_t>(m.rows * m.cols) * 4; };
  uint64_t bytes = f32(w.embed) + f32(w.final_norm);
  ForEachProductMatrix(w, [&](const Matrix& m) { bytes += ProductBytes(m, p, quantize); });
  for (const LayerWeights& L : w.layers) {
    for (const Matrix* m : {&L.input_norm, &L.post_attn_norm, &L.q_a_norm, &L.kv_a_norm, &L.indexer.k_norm_w,
                            &L.indexer.k_norm_b, &L.router, &L.router_bias}) {
      bytes += f32(*m);
    }
    bytes += UkTBytes(c, L.kv_b_proj, p, quantize);
  }
  return bytes;
}

uint64_t CpuFp8CopyBytes(const ModelWeights& w) {
  if (w.fp8_tensors > 0) return 0;
  uint64_t bytes = 0;
  ForEachProductMatrix(w, [&](const Matrix& m) {
    if (m.empty()) return;
    bytes += static_cast<uint64_t>(m.rows * m.cols + ((m.rows + 127) / 128) * ((m.cols + 127) / 128) * 4);
  });
  return bytes;
}

uint64_t ActiveWeightBytes(const ModelConfig& c, const ModelWeights& w) {
  uint64_t bytes = 0;
  ForEachMatrix(c, w, [&](const Matrix& m) { bytes += m.stored_bytes(); });
  for (const LayerWeights& L : w.layers) {
    if (L.experts.empty()) continue;
    const MlpWeights& e = L.experts[0];
    const uint64_t per = e.gate.stored_bytes() + e.up.stored_bytes() + e.down.stored_bytes();
    bytes -= per * (L.experts.size() - static_cast<size_t>(c.num_experts_per_tok));
  }
  return bytes;
}

uint64_t KvBytesPerToken(const ModelConfig& c, KvFormat format, bool fp8_index_keys) {
  const PagedKvCache layout(c, format, /*page_size=*/1, /*max_pages=*/0, fp8_index_keys);  // no page allocated
  uint64_t bytes = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (const StreamSpec& s : layout.streams(l)) bytes += static_cast<uint64_t>(s.bytes_per_token);
  }
  return bytes;
}

uint64_t CpuActivationBytes(const ModelConfig& c, int64_t P) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, C = c.kv_lora_rank, k = c.num_experts_per_tok;
  // Per row: x, h, o; q; [c_kv | k_rope], latent, k_rope; the heads' outputs; q_a and its norm.
  int64_t per_row = 3 * H + nh * (dn + dr) + 2 * (C + dr) + nh * dv + 2 * c.q_lora_rank;
  // The FFN's widest step: a dense SwiGLU's gate and up, or an MoE layer's k slots, the shared
  // expert's output and gate/up, and one expert's rows in and out.
  const int64_t shared_inter = c.moe_intermediate_size * c.n_shared_experts;
  int64_t ffn = 0;
  for (const LayerSpec& l : c.layers) {
    ffn = std::max(ffn, l.ffn == FfnKind::kDense ? 2 * c.intermediate_size
                                                 : k * H + H + 2 * shared_inter + 2 * H + 2 * c.moe_intermediate_size);
  }
  per_row += ffn;
  // Attention reads the request's cache back as fp32 rows, and the expanded form (prefill's
  // default) its keys and values [P, nh, dn + dv].
  per_row += C + dr + nh * (dn + dv);
  // V3.2's indexer: its queries, keys and head weights, the gathered keys.
  if (c.has_indexer()) per_row += c.index_n_heads * c.index_head_dim + 3 * c.index_head_dim + c.index_n_heads;
  // A product's rounded activations (gemm=bf16, w8a8_dot's FP8 round trip): its widest input.
  per_row += std::max({H, c.intermediate_size, nh * dv, c.q_lora_rank, C});
  return static_cast<uint64_t>(P * per_row + c.vocab_size) * 4;
}

}  // namespace lockstep::engine
