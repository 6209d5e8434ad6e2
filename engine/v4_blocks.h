// engine/v4_blocks.h — DeepSeek-V4's blocks on the CPU reference (fp32), each written like the
// math of transformers 5.17's DeepseekV4 modules (../shared/reference/deepseek-v4.md §1.3).
//
// Symbols: D = hidden, hc = hc_mult streams, H = heads, d = head_dim, rd = rotated dims (the
// trailing rd of a vector), G = o_groups, R = o_lora_rank, m = a compression rate, di = the
// indexer's head dim, E = experts, I = moe_intermediate. Every function works on one token's row
// (or one compressed window), so a request's numbers never depend on its batch. Thread-safety:
// pure functions over their arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/gemm.h"
#include "engine/v4_config.h"
#include "engine/v4_weights.h"
#include "kernels/weight_view.h"

namespace lockstep::engine::v4 {

// One RoPE table (main or compress): inv_freq[i] = θ^(−2i/rd) in fp32, YaRN-blended when
// configured; cos/sin of pos·inv_freq times the attention factor.
class RopeTable {
 public:
  RopeTable(const V4Rope& r, int64_t rd);
  // cos, sin: [rd/2] at `pos`.
  void At(int64_t pos, float* cos, float* sin) const;
  int64_t half() const { return static_cast<int64_t>(inv_freq_.size()); }

 private:
  std::vector<float> inv_freq_;
  float attention_factor_ = 1.0f;
};

// Rotates the trailing rd of x [width] as interleaved pairs (x[2i], x[2i+1]) by θ_i; `inverse`
// rotates by −θ_i (the attention output's de-rotation).
void RopeTrailing(float* x, int64_t width, int64_t rd, const float* cos, const float* sin, bool inverse = false);

// x · rsqrt(mean(x²) + eps), no weight (the hyper-connections' normalisation, q's per-head rescale).
void RmsScale(const float* x, int64_t n, double eps, float* y);

// The mixing weights of one hyper-connection at one token.
struct HcMix {
  std::vector<float> pre;   // [hc]      stream weights of the block's input
  std::vector<float> post;  // [hc]      how much of the block's output each stream takes
  std::vector<float> comb;  // [hc, hc]  C[j, k]: stream j's share of the new stream k (Sinkhorn-balanced)
};

// hc_pre: from the streams X [hc, D] → the mix and the block input x_in [D] = Σ_j pre[j]·X[j].
void HcPre(const V4HcWeights& w, const V4Config& v, double rms_eps, const float* X, int64_t D, HcMix* mix,
           float* x_in);
// hc_post: X'[k] = post[k]·y + Σ_j C[j, k]·X[j]   (X, X' [hc, D]; may not alias).
void HcPost(const HcMix& mix, const float* X, const float* y, int64_t hc, int64_t D, float* X_out);
// hc_head: h [D] = Σ_k pre[k]·X[k], pre = sigmoid(RMS(flatten X)·hc_fnᵀ·scale + base) + hc_eps.
void HcHead(const V4HcWeights& w, const V4Config& v, double rms_eps, const float* X, int64_t D, float* h,
            float* pre_out = nullptr);

// One compressed entry from the gated pooling of its slots (CSA: 2m, HCA: m):
// kv, gate [slots, width] (gate with the position bias added; −inf = an empty slot),
// e[c] = Σ_j softmax_j(gate[:, c])·kv[j, c], then RMSNorm_w(e; norm) and RoPE at `pos`.
void PoolEntry(const float* kv, const float* gate, int64_t slots, int64_t width, const float* norm_w, double eps,
               int64_t rd, const float* cos, const float* sin, float* e);

// Attention of one head over its keys with a sink: l_t = q·K_t·scale, p = softmax([l, sink])
// without the sink's column, out[d] = Σ_t p_t·K_t (V = K). keys: pointers to rows [d]. Returns the
// sink's share of the softmax (1 − Σ_t p_t). fault_sink_one_side (the fault zoo's
// softmax=fault_sink_one_side): the sink enters the max but not the denominator.
float AttendWithSink(const float* q, const float* const* keys, int64_t n, int64_t d, float scale, float sink,
                    float* out, bool fault_sink_one_side = false);

// sqrt(softplus(x)) with torch's softplus (β 1, threshold 20).
float SqrtSoftplus(float x);

// The clamped SwiGLU of V4's experts on `rows` rows: down(silu(min(g, L)) · clamp(u, ±L)), each
// product by `gemm` (engine/gemm.h: the run's gemm variant) — engine/ffn_blocks.h's SwiGluMlp
// with the clamp.
void ClampedSwiGlu(const MlpWeights& m, double limit, const float* x, int64_t rows, const Gemm& gemm, float* y);

}  // namespace lockstep::engine::v4
