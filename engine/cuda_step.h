// engine/cuda_step.h — one engine step of the CUDA backend as its blocks see it: the shapes, the
// step's device inputs, its activation buffers, where its cache rows and taps go, and the
// small launch helpers the blocks share. Private to engine/cuda_forward.cc (which makes it) and
// engine/cuda_blocks.cc (the blocks: CudaBackend::EmbedBlock … HeadBlock).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/cuda_backend_impl.h"

namespace lockstep::engine::cuda_impl {

struct CudaStep {
  CudaStep(const ModelConfig& config, const kernels::KernelPlan& p, PagedKvCache& kv_cache)
      : c(config), plan(p), cache(kv_cache) {
    H = c.hidden_size;
    nh = c.num_attention_heads;
    dn = c.qk_nope_head_dim;
    dr = c.qk_rope_head_dim;
    dv = c.v_head_dim;
    C = c.kv_lora_rank;
    dqk = dn + dr;
    V = c.vocab_size;
    nhi = c.has_indexer() ? c.index_n_heads : 0;
    di = c.has_indexer() ? c.index_head_dim : 0;
    topk = c.has_indexer() ? c.index_topk : 0;
    k = c.num_experts_per_tok;
    E = c.n_routed_experts;
    scale = static_cast<float>(c.softmax_scale());
    rms_eps = static_cast<float>(c.rms_norm_eps);
    indexer_fp8 = p.indexer == kernels::Indexer::kFp8Paged;
    indexer_hadamard = p.indexer_hadamard();
    if (p.ranks) {  // rank mode: this rank's heads [h0, h0 + nh) only
      rank = p.ranks->rank();
      const Shard mine = ShardOf(nh, p.ranks->size(), rank);
      h0 = mine.begin;
      nh = mine.end - mine.begin;
    }
  }
  const ModelConfig& c;
  const kernels::KernelPlan& plan;
  PagedKvCache& cache;

  // Rank mode (KernelPlan::ranks): this backend's rank, and its first head (nh: its heads);
  // rank −1 otherwise (every head).
  int rank = -1;
  int64_t h0 = 0;
  bool ranked() const { return rank >= 0; }
  // Shapes (the config's; nh the rank's heads in rank mode): H hidden, nh heads, dn/dr/dv head parts, C latent, V vocabulary; the
  // V3.2 indexer's nhi heads of di, topk; k experts a row of E. The step's: R rows, RL with logits.
  int64_t H = 0, nh = 0, dn = 0, dr = 0, dv = 0, C = 0, dqk = 0, V = 0;
  int64_t nhi = 0, di = 0, topk = 0, k = 0, E = 0;
  int64_t R = 0, RL = 0;
  float scale = 0, rms_eps = 0;
  // Page-table width and the key bound the kernels run over (graph steps: the cache's capacity).
  int64_t P = 1, max_len = 0;
  bool indexer_fp8 = false, indexer_hadamard = false, w8a8 = false;

  // The stream the blocks launch on (the side stream inside CudaBackend::OnSide) and the main one.
  cu::Stream s = nullptr, main_stream = nullptr;
  // The RoPE tables [rope_positions, dr/2].
  const float *rope_cos = nullptr, *rope_sin = nullptr;
  int64_t rope_positions = 0;

  // Device inputs: tokens, positions, cache slots, sequence lengths [R]; logit rows [RL]; page
  // table [R, P]; head ids [R, nh].
  const int32_t *d_tok = nullptr, *d_pos = nullptr, *d_slot = nullptr, *d_len = nullptr, *d_lrow = nullptr,
                *d_table = nullptr, *d_heads = nullptr;
  int32_t* err = nullptr;  // the kernels' error flag

  // Activations (floats unless noted); in a slab step the tapped ones point into the slab, per layer.
  float *x = nullptr, *h = nullptr, *o = nullptr, *qa = nullptr, *qr = nullptr, *q = nullptr, *kv = nullptr,
        *latent = nullptr, *qlat = nullptr, *olat = nullptr, *heads = nullptr, *iq = nullptr, *ik = nullptr,
        *ikn = nullptr, *iw = nullptr, *rlog = nullptr, *wts = nullptr, *gu = nullptr, *act = nullptr, *ey = nullptr,
        *sh = nullptr, *hq = nullptr, *qrq = nullptr, *headsq = nullptr;
  int32_t *topk_pos = nullptr, *topk_slot = nullptr, *ids = nullptr;
  float* o_shared = nullptr;  // o's own buffer (the gathered logit rows' place)
  // Emulated tensor parallelism (KernelPlan::emulate_tp): the ranks, and the partial outputs
  // [R, tp, H] of o_proj and of the FFN before their all-reduces (empty at TP 1).
  int tp = 1;
  float *attn_parts = nullptr, *ffn_parts = nullptr;
  // Rank mode: the whole rows of the head-sharded taps (attn.q, attn.heads) outside the slab.
  float *q_whole = nullptr, *heads_whole = nullptr;
  // This layer's: what the linear layers read of h and of qr (LinearIn), and whether the
  // attention's output block routed the FFN's rows already (NormRoute).
  const float *h_lin = nullptr, *qr_lin = nullptr;
  bool routed = false;

  // Where each layer's new cache rows are copied as they are written (null: nowhere).
  std::vector<size_t> mirror_off;
  std::vector<std::array<uint8_t*, 2>> mirror_at;  // [layer][latent, index keys]
  uint8_t* mirror_base = nullptr;

  // The tap slab's layout: per layer one place per tapped tensor, then embed and final_norm.
  enum SlabPart { kSAttnNorm, kSQ, kSLatent, kSKv, kSTopk, kSHeads, kSAttnOut, kSResidMid, kSFfnNorm, kSIds, kSWts,
                  kSFfnOut, kSResidOut, kSAttnParts, kSFfnParts, kSParts };
  int64_t part_off[kSParts] = {};
  int64_t layer_floats = 0, ends_floats = 0;
  const Scratch* slab_buf = nullptr;
  // l = −1: embed, num_hidden_layers: final_norm.
  float* SlabAt(int64_t l, int part) const {
    float* base = slab_buf->as<float>();
    if (l < 0) return base;
    if (l >= c.num_hidden_layers) return base + ends_floats + c.num_hidden_layers * layer_floats;
    return base + ends_floats + l * layer_floats + part_off[part];
  }

  // The residual adds carry the next RMSNorm (one kernel, Add's and RmsNorm's bits) unless
  // taps outside the slab need each buffer summarised or copied before the next write.
  bool fuse_norms = true;
  bool h_ready = false;  // h already holds this layer's input norm (from the last residual add)
  // Independent branches on two streams (CudaBackend::OnSide).
  bool overlap = false;

  cu::RmsNormParams NormParams(const float* in, int64_t in_stride, const DevTensor& w, int64_t n, float eps, float* y,
                               int64_t y_stride) const {
    cu::RmsNormParams p;
    p.x = in;
    p.x_stride = in_stride;
    p.weight = w.f32();
    p.y = y;
    p.y_stride = y_stride;
    p.rows = R;
    p.n = n;
    p.eps = eps;
    p.fault_mean_n_minus_1 = plan.hidden == kernels::HiddenFault::kCudaNormMeanOverNMinus1;
    return p;
  }
  Status RmsNorm(const float* in, int64_t in_stride, const DevTensor& w, int64_t n, float eps, float* y,
                 int64_t y_stride) const {
    return cu::RmsNorm(NormParams(in, in_stride, w, n, eps, y, y_stride), s);
  }
  // sum = a + b; y = RMSNorm(sum) with w.
  Status AddNorm(float* sum, const float* a, const float* b, const DevTensor& w, float* y) const {
    cu::RmsNormParams p = NormParams(a, H, w, H, rms_eps, y, H);
    p.add = b;
    p.add_stride = H;
    p.sum = sum;
    p.sum_stride = H;
    return cu::RmsNorm(p, s);
  }
  cu::RopeParams RopeParams(float* v, int64_t row_stride, int64_t heads_n, int64_t head_stride,
                            cu::RopeStyle style) const {
    cu::RopeParams p;
    p.x = v;
    p.row_stride = row_stride;
    p.head_stride = head_stride;
    p.rows = R;
    p.heads = heads_n;
    p.dim = dr;
    p.positions = d_pos;
    p.cos = rope_cos;
    p.sin = rope_sin;
    p.max_position = rope_positions;
    p.style = style;
    p.error_flag = err;
    return p;
  }
  Status Rope(float* v, int64_t row_stride, int64_t heads_n, int64_t head_stride, cu::RopeStyle style) const {
    return cu::Rope(RopeParams(v, row_stride, heads_n, head_stride, style), s);
  }
  // What gemm=w8a8_dot's linear layers read of x [R, n]: x through FP8 per 128 values, in
  // `buf` (the tapped tensor stays as it is); x itself under every other variant. A row-parallel
  // product emulating `ranks` ranks rounds each rank's slice (ShardOf(n / unit)·unit) from its
  // own start, as that rank holds it (engine::RowParallelPartials).
  Result<const float*> LinearIn(const float* x_in, int64_t n, float* buf, int ranks = 1, int64_t unit = 1) const {
    if (!w8a8) return x_in;
    for (int q = 0; q < ranks; ++q) {
      const Shard sh = ShardOf(n / unit, ranks, q);
      const int64_t k0 = sh.begin * unit;
      LS_RETURN_IF_ERROR(cu::Fp8RoundTrip(x_in + k0, n, buf + k0, n, R, (sh.end - sh.begin) * unit, s));
    }
    return static_cast<const float*>(buf);
  }
  // Route's parameters for layer D's routing of the R rows' logits (rlog) into ids / weights.
  cu::RouteParams RouteParams(const DevLayer& D, int32_t* ids_out, float* wts_out) const {
    cu::RouteParams rp;
    rp.logits = rlog;
    rp.logits_stride = E;
    rp.bias = D.router_bias.empty() ? nullptr : D.router_bias.f32();
    rp.rows = R;
    rp.experts = E;
    rp.k = k;
    // Groups matter only with more than one (the CPU ignores n_group ≤ 1, e.g. V2's null).
    const bool grouped = c.gate != GateKind::kSoftmaxGreedy && c.n_group > 1;
    rp.n_group = grouped ? c.n_group : 1;
    rp.topk_group = grouped ? c.topk_group : 1;
    rp.gate = ToGateKind(c.gate);
    rp.norm_topk_prob = c.norm_topk_prob;
    rp.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
    rp.ids = ids_out;
    rp.weights = wts_out;
    rp.fault_bias_in_weights = plan.hidden == kernels::HiddenFault::kCudaRouteBiasInWeights;
    return rp;
  }
};

}  // namespace lockstep::engine::cuda_impl
