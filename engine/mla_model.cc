// engine/mla_model.cc — the DeepSeek V2/V3/V3.2 forward pass, top to bottom (see mla_model.h).
//
// Shapes: R = rows in this step (all segments' tokens concatenated), H = hidden, nh = heads,
// dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, C = kv_lora_rank,
// nhi / di = index heads / dim, E = routed experts, k = experts a token, tp = emulated ranks.
// Semantics follow transformers 5.17 (the oracle of tests/model_reference_test.cc); where the
// engine differs in form (absorbed decode) it is equal in exact arithmetic; the absorbed form
// adds in the CUDA kernels' order (cpu::MlaAttend), so the two backends share its bits.
#include "engine/mla_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "engine/ffn_blocks.h"
#include "engine/gemm.h"
#include "engine/tap_capture.h"
#include "engine/tensor_parallel.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"

namespace lockstep::engine {
namespace {

namespace cpu = kernels::cpu;
using HF = kernels::HiddenFault;
using RmsNormFn = void (*)(const float* x, const float* w, int64_t rows, int64_t n, double eps, float* y);
using SoftmaxFn = void (*)(float* x, int64_t n);

// Fault zoo (softmax=fault_no_max_fp16_sum): exp without max subtraction, denominator
// accumulated in fp16. Once Σ exp passes 65504 the sum is inf and every weight 0 (or NaN).
// Where the compiler has no _Float16 (clang 14 on x86: the fuzz build), the sum is kept as
// fp16 bits through kernels::F32ToF16, which rounds as the cast does (tests/numerics_test.cc).
void SoftmaxNoMaxFp16Sum(float* x, int64_t n) {
#ifdef __FLT16_MAX__
  _Float16 sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i]);
    sum = static_cast<_Float16>(static_cast<float>(sum) + x[i]);
  }
  const float inv = 1.0f / static_cast<float>(sum);
#else
  uint16_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i]);
    sum = kernels::F32ToF16(kernels::F16ToF32(sum) + x[i]);
  }
  const float inv = 1.0f / kernels::F16ToF32(sum);
#endif
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Hidden fault zoo (kernels/hidden_fault.h): RMSNorm with the mean over n − 1, or its sum of
// squares in fp32 (used only when a step batches several requests).
void RmsNormMeanNm1(const float* x, const float* w, int64_t rows, int64_t n, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[r * n + i]) * x[r * n + i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n > 1 ? n - 1 : 1) + eps));
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * inv * w[i];
  }
}
void RmsNormFp32Sum(const float* x, const float* w, int64_t rows, int64_t n, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    float ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += x[r * n + i] * x[r * n + i];
    const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ss) / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * inv * w[i];
  }
}

RopeStyle OtherRopeStyle(RopeStyle s) {
  return s == RopeStyle::kHalves ? RopeStyle::kPairsToHalves : RopeStyle::kHalves;
}

// Head hd's W_UKᵀ [C, dn] (row c is W_UK's column c) from kv_b_proj [nh·(dn + dv), C]: the
// head's first dn rows dequantised (rounded as the products round them) into `uk` [dn, C], then
// transposed into `wt` — so q_lat's elements are cpu::Dot over wt's rows, as the CUDA
// backend's absorption forms them.
void HeadWukT(const kernels::WeightView& kv_b, int64_t hd, int64_t dn, int64_t dv, kernels::WeightRounding round,
              float* uk, float* wt) {
  const int64_t C = kv_b.cols;
  kv_b.DecodeRows(hd * (dn + dv), dn, uk, round);
  for (int64_t a = 0; a < dn; ++a) {
    for (int64_t cc = 0; cc < C; ++cc) wt[cc * dn + a] = uk[a * C + cc];
  }
}

// Emulated TP: the MLP's gate and up (column-parallel: the same values on every rank), then
// each rank's slice of the down projection — partials [rows, ranks, hidden].
void MlpPartials(const Gemm& gemm, const MlpWeights& m, const float* x, int64_t rows, int64_t hidden, int ranks,
                 float* partials) {
  const int64_t inter = m.gate.rows;
  std::vector<float> g(rows * inter), u(rows * inter);
  gemm(x, rows, m.gate, inter, hidden, g.data());
  gemm(x, rows, m.up, inter, hidden, u.data());
  cpu::SwiGlu(g.data(), u.data(), rows * inter, g.data());
  RowParallelPartials(gemm, g.data(), rows, m.down, ranks, 1, partials);
}
// Rank mode: rank `rank`'s partial of the MLP alone [rows, hidden] — its intermediate slice's
// gate and up rows (each output the same bits as the whole product's), SwiGLU, and its columns
// of down: MlpPartials' rank `rank`.
void MlpRank(const Gemm& gemm, const MlpWeights& m, const float* x, int64_t rows, int64_t hidden, int ranks, int rank,
             float* y) {
  const Shard s = ShardOf(m.gate.rows, ranks, rank);
  const int64_t n = s.end - s.begin;
  std::vector<float> g(rows * n), u(rows * n);
  gemm(x, rows, m.gate.Rows(s.begin, n), n, hidden, g.data());
  gemm(x, rows, m.up.Rows(s.begin, n), n, hidden, u.data());
  cpu::SwiGlu(g.data(), u.data(), rows * n, g.data());
  RowParallelRank(gemm, g.data(), rows, m.down, ranks, 1, rank, y);
}
// Hidden fault zoo: the down projection's K loop stops at the last full 64-wide tile.
void MlpDownKTail(const Gemm& gemm, const MlpWeights& m, const float* x, int64_t rows, int64_t hidden, float* y) {
  const int64_t inter = m.gate.rows, full = (inter / 64) * 64;
  std::vector<float> g(rows * inter), u(rows * inter);
  gemm(x, rows, m.gate, inter, hidden, g.data());
  gemm(x, rows, m.up, inter, hidden, u.data());
  cpu::SwiGlu(g.data(), u.data(), rows * inter, g.data());
  for (int64_t r = 0; r < rows; ++r) std::fill(g.begin() + r * inter + full, g.begin() + (r + 1) * inter, 0.0f);
  gemm(g.data(), rows, m.down, hidden, inter, y);
}

// One step: its rows and where they come from, the variants it runs, the taps it emits.
struct Step {
  const ModelConfig& c;
  const ModelWeights& W;
  std::span<Segment> segs;
  PagedKvCache& cache;
  const kernels::KernelPlan& plan;
  const MlaTables& tables;
  TapHook* hook;
  const std::vector<int64_t>& row0;  // first row of each segment
  HostTapCapture taps{hook, segs, row0};
  int64_t R = 0, max_pos = 0;
  std::vector<int64_t> pos{};    // per row
  std::vector<size_t> seg_of{};  // per row
  // *_dot and *_heuristic name GPU GEMMs; on the CPU they are its GEMM of that precision (the
  // CPU's is in cpu::Dot's order already), so a GPU trace replays here at its own precision.
  // gemm=w8a8_dot: fp8_dot's weights, and the linear layers' inputs through FP8 as DeepSeek's
  // inference quantises them (act_quant before fp8_gemm): q, kv_a, o_proj, the MLPs and experts,
  // the indexer's wq_b and wk. Not kv_b (the absorbed path dequantises it and multiplies in
  // bf16), the indexer's weights_proj, the router or lm_head (bf16 layers there).
  Gemm gemm{}, linear{};
  // norm=lanes256: every RMSNorm in the CUDA kernels' order and precision (fp32 lanes), so a GPU
  // trace's CPU replay gives its norms' bits; the default sums in fp64.
  RmsNormFn rmsnorm = cpu::RmsNorm;
  SoftmaxFn softmax = cpu::Softmax;
  HF hidden = HF::kNone;
  int tp = 1;
  // Rank mode (plan.ranks: real TP, this engine one rank): its rank and its heads
  // [h0, h0 + nhl); otherwise rank −1 and every head. A failed collective is kept in `error`
  // (the blocks return nothing) and ends the step after the layer.
  int rank = -1;
  int64_t h0 = 0, nhl = 0;
  mutable Status error;
  bool ranked() const { return rank >= 0; }
  // Rank mode: every rank's rows of `mine` [R, cols] → out [R][ranks][cols] (a row's blocks in
  // rank order: the emulation's partials layout, and for a head-sharded tensor its whole row).
  bool Gather(const float* mine, int64_t cols, float* out) const {
    std::vector<float> all(static_cast<size_t>(tp) * R * cols);
    const Status s = plan.ranks->AllGather(mine, R * cols, all.data());
    if (!s.ok()) {
      if (error.ok()) error = s;
      return false;
    }
    for (int q = 0; q < tp; ++q) {
      for (int64_t r = 0; r < R; ++r) {
        std::memcpy(out + (r * tp + q) * cols, &all[(q * R + r) * cols], static_cast<size_t>(cols) * sizeof(float));
      }
    }
    return true;
  }
  // A head-sharded tensor [R, nhl·w] as its tap: the whole rows. In rank mode every rank gathers
  // them whether its hook taps or not (plan.tp_gather_taps: the ranks' collectives must match).
  void TapHeads(std::string_view name, const std::vector<float>& mine, int64_t w) const {
    if (!ranked()) {
      if (tapping()) Tap(name, mine.data(), nhl * w);
      return;
    }
    if (!plan.tp_gather_taps) {
      if (tapping() && error.ok()) {
        error = Status::InvalidArgument(std::string(name) + ": a rank's tap of a head-sharded tensor needs "
                                        "tp_gather_taps on every rank");
      }
      return;
    }
    std::vector<float> whole(static_cast<size_t>(R) * tp * nhl * w);
    if (Gather(mine.data(), nhl * w, whole.data()) && tapping()) Tap(name, whole.data(), tp * nhl * w);
  }

  bool tapping() const { return hook != nullptr; }
  const SeqCache& seq(int64_t r) const { return *segs[seg_of[r]].cache; }
  const std::string& Name(int64_t l, TapId t) const { return tables.tap_names[l][t]; }
  const float* Cos(int64_t p) const { return tables.rope_cos.data() + p * (c.qk_rope_head_dim / 2); }
  const float* Sin(int64_t p) const { return tables.rope_sin.data() + p * (c.qk_rope_head_dim / 2); }
  // A decode row: one token of a request past its prompt.
  bool DecodeRow(int64_t r) const {
    const Segment& sg = segs[seg_of[r]];
    return !sg.prefill && sg.tokens.size() == 1 && sg.start_pos > 0;
  }
  // Each segment's rows of a [R, cols] buffer as tap `name`.
  void Tap(std::string_view name, const void* data, int64_t cols, TapDType dt = TapDType::kF32) const {
    taps.Emit(name, data, cols, dt);
  }
  // Offers each segment's rows of a [R, cols] f32 buffer for overwriting (grafting).
  void Override(std::string_view name, float* data, int64_t cols) const {
    taps.EmitOverride(name, data, cols);
  }
};

// q = q_b(RMSNorm(q_a(h))) or q_proj(h)                     h [R, H] → q [R, nh, dn + dr]
// [c_kv | k_rope] = kv_a(h); latent = RMSNorm(c_kv)          → latent [R, C], krope [R, dr]
// RoPE on q's rope part (every head) and on the shared key; then the cache append (attention
// reads what the cache stored). q_resid [R, q_lora]: RMSNorm(q_a(h)), which the V3.2 indexer reads.
void QueryAndKey(const Step& st, int64_t l, const std::vector<float>& h, std::vector<float>& q,
                 std::vector<float>& q_resid, std::vector<float>& kv, std::vector<float>& latent,
                 std::vector<float>& krope) {
  const ModelConfig& c = st.c;
  const LayerWeights& L = st.W.layers[l];
  const int64_t R = st.R, H = c.hidden_size, nh = st.nhl, dn = c.qk_nope_head_dim,
                dr = c.qk_rope_head_dim, C = c.kv_lora_rank, dqk = dn + dr;
  // (nh: the heads this engine computes — every head, or its rank's: their rows of q_b / q_proj.)
  if (c.q_lora_rank > 0) {
    q_resid.resize(R * c.q_lora_rank);
    std::vector<float> qa(R * c.q_lora_rank);
    st.linear(h.data(), R, L.q_a_proj, c.q_lora_rank, H, qa.data());
    st.rmsnorm(qa.data(), L.q_a_norm.ptr(), R, c.q_lora_rank, 1e-6, q_resid.data());  // default eps, as HF
    st.linear(q_resid.data(), R, L.q_b_proj.Rows(st.h0 * dqk, nh * dqk), nh * dqk, c.q_lora_rank, q.data());
  } else {
    st.linear(h.data(), R, L.q_proj.Rows(st.h0 * dqk, nh * dqk), nh * dqk, H, q.data());
  }

  st.linear(h.data(), R, L.kv_a_proj, C + dr, H, kv.data());
  for (int64_t r = 0; r < R; ++r) {
    st.rmsnorm(&kv[r * (C + dr)], L.kv_a_norm.ptr(), 1, C, 1e-6, &latent[r * C]);
    std::memcpy(&krope[r * dr], &kv[r * (C + dr) + C], dr * sizeof(float));
  }

  const bool fault_rope = st.plan.rope == kernels::Rope::kFaultDecodeWrongInterleave;
  for (int64_t r = 0; r < R; ++r) {
    const float* cs = st.Cos(st.pos[r]);
    const float* sn = st.Sin(st.pos[r]);  // (cs, sn: reassigned only by a hidden fault)
    const bool decode_row = st.DecodeRow(r);
    const RopeStyle style = fault_rope && decode_row ? OtherRopeStyle(c.rope_style) : c.rope_style;
    auto apply = [&](float* v) {
      switch (style) {
        case RopeStyle::kPairsAdjacent: cpu::RopePairsAdjacent(v, cs, sn, dr); break;
        case RopeStyle::kPairsToHalves: cpu::RopePairsToHalves(v, cs, sn, dr); break;
        case RopeStyle::kHalves: cpu::RopeHalves(v, cs, sn, dr); break;
      }
    };
    for (int64_t hd = 0; hd < nh; ++hd) apply(&q[(r * nh + hd) * dqk + dn]);
    if (st.hidden == HF::kRopeDecodeKeyPosMinus1 && decode_row) {
      // Hidden fault zoo: the new key rotated at the cache length before the append.
      cs = st.Cos(st.pos[r] - 1);
      sn = st.Sin(st.pos[r] - 1);
    }
    apply(&krope[r * dr]);
  }
  st.TapHeads(st.Name(l, kTapQ), q, dqk);
  if (st.tapping()) {
    st.Tap(st.Name(l, kTapLatent), latent.data(), C);
    st.Tap(st.Name(l, kTapKRope), krope.data(), dr);
  }
  for (int64_t r = 0; r < R; ++r) {
    st.cache.WriteLatent(l, st.seq(r), st.pos[r], &latent[r * C], &krope[r * dr]);
  }
}

// V3.2 lightning indexer: selected[r] = the top-k causal keys of row r by
// s_t = Σ_h w_h·ReLU(q_h·k_t/√di), ascending; appends the index keys to the cache first.
//   iq = wq_b(q_resid) [R, nhi, di], ik = LayerNorm(wk(h)) [R, di], iw = weights_proj(h) [R, nhi]
std::vector<std::vector<int32_t>> LightningIndexer(const Step& st, int64_t l, const std::vector<float>& h,
                                                   const std::vector<float>& q_resid) {
  const ModelConfig& c = st.c;
  const LayerWeights& L = st.W.layers[l];
  const kernels::KernelPlan& plan = st.plan;
  PagedKvCache& cache = st.cache;
  const int64_t R = st.R, H = c.hidden_size, dr = c.qk_rope_head_dim;
  // indexer=fp8_paged: the official indexer's FP8 path — Hadamard-rotated q and k in FP8 (keys so
  // in the cache), scored page by page up to each request's last page.
  const bool indexer_fp8 = plan.indexer == kernels::Indexer::kFp8Paged;
  const bool indexer_hadamard = plan.indexer_hadamard();
  const bool fault_skip_partial = plan.indexer == kernels::Indexer::kFaultSkipPartialPage;
  const int64_t nhi = c.index_n_heads, di = c.index_head_dim;
  std::vector<float> iq(R * nhi * di), ik(R * di), ikn(R * di), iw(R * nhi);
  const int64_t row8 = Fp8RowBytes(di);
  std::vector<uint8_t> iq8(indexer_fp8 ? R * nhi * row8 : 0);  // fp8_paged: each head's query, an FP8 row
  st.linear(q_resid.data(), R, L.indexer.wq_b, nhi * di, c.q_lora_rank, iq.data());
  st.linear(h.data(), R, L.indexer.wk, di, H, ik.data());
  cpu::LayerNorm(ik.data(), L.indexer.k_norm_w.ptr(), L.indexer.k_norm_b.ptr(), R, di, 1e-6, ikn.data());
  st.gemm(h.data(), R, L.indexer.weights_proj, nhi, H, iw.data());
  const float wscale = 1.0f / std::sqrt(static_cast<float>(nhi));
  for (int64_t r = 0; r < R; ++r) {
    const float* cs = st.Cos(st.pos[r]);
    const float* sn = st.Sin(st.pos[r]);
    for (int64_t hd = 0; hd < nhi; ++hd) cpu::RopeHalves(&iq[(r * nhi + hd) * di], cs, sn, dr);
    cpu::RopeHalves(&ikn[r * di], cs, sn, dr);
    if (indexer_hadamard) {
      for (int64_t hd = 0; hd < nhi; ++hd) cpu::Hadamard(&iq[(r * nhi + hd) * di], di);
      cpu::Hadamard(&ikn[r * di], di);
    }
    if (indexer_fp8) {
      for (int64_t hd = 0; hd < nhi; ++hd) {
        QuantizeFp8Row(&iq[(r * nhi + hd) * di], di, &iq8[(r * nhi + hd) * row8]);
      }
    }
    for (int64_t hd = 0; hd < nhi; ++hd) iw[r * nhi + hd] *= wscale;
    cache.WriteIndexKey(l, st.seq(r), st.pos[r], &ikn[r * di]);
  }
  const float kscale = 1.0f / std::sqrt(static_cast<float>(di));
  std::vector<std::vector<int32_t>> selected(R);
  const int64_t topk = c.index_topk;
  std::vector<int32_t> topk_tap(st.tapping() ? R * topk : 0, -1);
  // Each request's index keys as the indexer sees them, gathered once per layer into [T, di]
  // (the reference variant; fp8_paged reads them page by page below).
  std::vector<std::vector<float>> keys(st.segs.size());
  for (size_t sgi = 0; sgi < st.segs.size() && !indexer_fp8; ++sgi) {
    const int64_t Tn = st.segs[sgi].start_pos + static_cast<int64_t>(st.segs[sgi].tokens.size());
    keys[sgi].resize(Tn * di);
    for (int64_t t = 0; t < Tn; ++t) cache.ReadIndexKey(l, *st.segs[sgi].cache, t, &keys[sgi][t * di]);
  }
#pragma omp parallel for schedule(dynamic) if (R * (st.max_pos + 1) * nhi * di > cpu::kParallelMacs)
  for (int64_t r = 0; r < R; ++r) {
    int64_t T = st.pos[r] + 1;
    if (st.hidden == HF::kIndexerSkipsSelf) T = std::max<int64_t>(st.pos[r], 1);
    // The faulty early exit stops at the last full page.
    if (fault_skip_partial) T = (T / cache.page_size()) * cache.page_size();
    // d[h, t] = q_h · k_t for every head and key; then s_t = Σ_h w_h · ReLU(d[h, t] / √d), h ascending.
    std::vector<float> d(nhi * T);
    if (indexer_fp8) {
      // Page by page through the request's page table, stopping after the page that holds
      // key T − 1 (a partial page scores only its first T mod page_size keys): d[h, t] is
      // the FP8 rows' dot product (Fp8RowDot: exact for head sizes ≤ 128), rounded once.
      const int64_t ps = cache.page_size();
      for (int64_t t0 = 0; t0 < T; t0 += ps) {
        for (int64_t t = t0; t < std::min(T, t0 + ps); ++t) {
          const uint8_t* k8 = cache.TokenBytes(l, 1, st.seq(r), t);
          for (int64_t hd = 0; hd < nhi; ++hd) {
            d[hd * T + t] = static_cast<float>(Fp8RowDot(&iq8[(r * nhi + hd) * row8], k8, di));
          }
        }
      }
    } else {
      cpu::MatMulNT(&iq[r * nhi * di], nhi, keys[st.seg_of[r]].data(), T, di, d.data());
    }
    std::vector<std::pair<float, int32_t>> sc_t(T);
    for (int64_t t = 0; t < T; ++t) {
      float s = 0;
      for (int64_t hd = 0; hd < nhi; ++hd) s += iw[r * nhi + hd] * std::max(d[hd * T + t] * kscale, 0.0f);
      sc_t[t] = {s, static_cast<int32_t>(t)};
    }
    const int64_t k = std::min(topk, T);
    // Higher score first; on equal scores the lower position wins (docs/tap-points.md).
    std::partial_sort(sc_t.begin(), sc_t.begin() + k, sc_t.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    std::vector<int32_t>& sel = selected[r];
    for (int64_t i = 0; i < k; ++i) sel.push_back(sc_t[i].second);
    std::sort(sel.begin(), sel.end());
    if (st.tapping()) std::copy(sel.begin(), sel.end(), &topk_tap[r * topk]);
  }
  if (st.tapping()) st.Tap(st.Name(l, kTapIndexerTopk), topk_tap.data(), topk, TapDType::kI32);
  return selected;
}

// heads[r, h] = softmax(q_h · K / √dqk) · V over the keys row r may see (all causal keys, or
// the indexer's selection), per segment from its own request's cache.   → heads [R, nh, dv]
// Expanded: K, V = kv_b(latent) per key. Absorbed: the scores and the sum over the latent.
void Attend(const Step& st, int64_t l, const std::vector<float>& q, const std::vector<std::vector<int32_t>>& selected,
            std::vector<float>& heads) {
  const ModelConfig& c = st.c;
  const LayerWeights& L = st.W.layers[l];
  const kernels::KernelPlan& plan = st.plan;
  PagedKvCache& cache = st.cache;
  const Gemm& gemm = st.gemm;
  // nh: the heads this engine computes, from head h0 (every head, or its rank's); head hd of
  // the model is local head hd − h0 of q, kvx and heads.
  const int64_t nh = st.nhl, h0 = st.h0, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, C = c.kv_lora_rank, dqk = dn + dr;
  const float scale = static_cast<float>(c.softmax_scale());
  const bool sparse = c.layers[l].attention == AttentionKind::kMlaSparse;
  const bool prefill_absorbed = plan.attn_prefill == kernels::AttnPrefill::kAbsorbed;
  const bool decode_expanded = plan.attn_decode == kernels::AttnDecode::kExpanded;
  const bool fault_neg1 = plan.attn_sparse == kernels::AttnSparse::kFaultNeg1AsToken0;
  const bool fault_page = plan.page_table == kernels::PageTable::kFaultCrossRequest;
  const SoftmaxFn softmax = st.softmax;
  for (size_t s = 0; s < st.segs.size(); ++s) {
    const Segment& g = st.segs[s];
    const int64_t n = static_cast<int64_t>(g.tokens.size());
    const int64_t T = g.start_pos + n;
    std::vector<float> lat(T * C), kr(T * dr);
    SeqCache view = *g.cache;
    if (fault_page && view.pages.size() > 1) {
      // The faulty page table maps logical page 1 to the next physical page this request
      // does not own — another request's, or one never handed out.
      int32_t p = view.pages[1];
      do {
        p = static_cast<int32_t>((p + 1) % cache.max_pages());
      } while (std::find(view.pages.begin(), view.pages.end(), p) != view.pages.end() && p != view.pages[1]);
      view.pages[1] = p;
    }
    for (int64_t t = 0; t < T; ++t) cache.ReadLatent(l, view, t, &lat[t * C], &kr[t * dr]);
    const bool decode = !g.prefill && n == 1 && g.start_pos > 0;
    const bool expanded = decode ? decode_expanded : !prefill_absorbed;
    std::vector<float> kvx;  // [T, nh, dn + dv] when expanded
    if (expanded) {
      kvx.resize(T * nh * (dn + dv));
      gemm(lat.data(), T, L.kv_b_proj.Rows(h0 * (dn + dv), nh * (dn + dv)), nh * (dn + dv), C, kvx.data());
    }
#pragma omp parallel for collapse(2) schedule(static) if (n * nh * T * (C + dr) > cpu::kParallelMacs)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t lh = 0; lh < nh; ++lh) {
        const int64_t hd = h0 + lh;  // the model's head
        const int64_t r = st.row0[s] + i;
        const int64_t p = st.pos[r];
        const float* qn = &q[(r * nh + lh) * dqk];
        const float* qr = qn + dn;
        // Keys this query may see, ascending.
        std::vector<int32_t> keys;
        if (sparse) {
          keys = selected[r];
          // The faulty kernel pads the selection with -1 up to index_topk and reads -1 as token 0.
          if (fault_neg1) keys.resize(std::max<size_t>(keys.size(), static_cast<size_t>(c.index_topk)), 0);
        } else {
          keys.resize(p + 1);
          std::iota(keys.begin(), keys.end(), 0);
        }
        // Hidden fault: a prefill query also sees the next prompt token.
        if (st.hidden == HF::kAttnPrefillCausalLeak && !decode && expanded && p + 1 < T) {
          keys.push_back(static_cast<int32_t>(p + 1));
        }
        // Keys 0..K-1 in order (dense, or a selection that kept every causal key).
        bool contiguous = true;
        for (size_t j = 0; j < keys.size() && contiguous; ++j) contiguous = keys[j] == static_cast<int32_t>(j);
        std::vector<float> sc(keys.size());
        float* oh = &heads[(r * nh + lh) * dv];
        if (expanded) {
          const int64_t K = static_cast<int64_t>(keys.size());
          std::vector<float> s_nope(K), s_rope(K);
          if (contiguous) {
            cpu::MatMulNTStrided(qn, dn, 1, &kvx[lh * (dn + dv)], nh * (dn + dv), K, dn, s_nope.data(), K);
            cpu::MatMulNT(qr, 1, kr.data(), K, dr, s_rope.data());
          } else {
            for (int64_t j = 0; j < K; ++j) {
              s_nope[j] = cpu::Dot(qn, &kvx[(keys[j] * nh + lh) * (dn + dv)], dn);
              s_rope[j] = cpu::Dot(qr, &kr[keys[j] * dr], dr);
            }
          }
          for (int64_t j = 0; j < K; ++j) sc[j] = (s_nope[j] + s_rope[j]) * scale;
          softmax(sc.data(), static_cast<int64_t>(sc.size()));
          std::fill(oh, oh + dv, 0.0f);
          for (size_t j = 0; j < keys.size(); ++j) {
            cpu::Axpy(sc[j], &kvx[(keys[j] * nh + lh) * (dn + dv) + dn], dv, oh);
          }
        } else {
          // Absorbed, in the CUDA kernels' order — each step their bits: q_lat = W_UKᵀ q_nope
          // (cpu::Dot over W_UKᵀ's rows); the scores over the latent; cpu::MlaAttend's splits,
          // tiles and online softmax over the keys — for sparse attention the top-k list as the
          // GPU holds it, index_topk entries with the missing ones masked; o = W_UV ol.
          // gemm=bf16: both absorption products read bf16 activations (q_nope, then the
          // attention's output), as every other product of the variant does — and as the
          // CUDA backend's absorptions do.
          std::vector<float> ql(C), ol(C), qnr;
          const float* qa = qn;
          if (gemm.bf16) {
            qnr.resize(dn);
            for (int64_t a = 0; a < dn; ++a) qnr[a] = kernels::Bf16ToF32(kernels::F32ToBf16(qn[a]));
            qa = qnr.data();
          }
          // q_lat[c] = W_UKᵀ row c · q_nope (HeadWukT, into this thread's scratch).
          thread_local std::vector<float> uk_scratch;
          uk_scratch.resize(static_cast<size_t>(2 * dn * C));
          float* const wt = uk_scratch.data() + dn * C;
          HeadWukT(L.kv_b_proj.data, hd, dn, dv, gemm.weights(), uk_scratch.data(), wt);
          for (int64_t cc = 0; cc < C; ++cc) ql[cc] = cpu::Dot(wt + cc * dn, qa, dn);
          // Scores over the keys: blocked products, each element exactly Dot's.
          const int64_t K = static_cast<int64_t>(keys.size());
          const int64_t n_keys = sparse ? std::max<int64_t>(K, c.index_topk) : K;
          std::vector<float> s_lat(K), s_rope(K);
          if (contiguous) {
            cpu::MatMulNT(ql.data(), 1, lat.data(), K, C, s_lat.data());
            cpu::MatMulNT(qr, 1, kr.data(), K, dr, s_rope.data());
          } else {
            for (int64_t j = 0; j < K; ++j) {
              s_lat[j] = cpu::Dot(ql.data(), &lat[keys[j] * C], C);
              s_rope[j] = cpu::Dot(qr, &kr[keys[j] * dr], dr);
            }
          }
          sc.assign(n_keys, -INFINITY);
          std::vector<const float*> rows(n_keys, nullptr);
          for (int64_t j = 0; j < K; ++j) {
            sc[j] = (s_lat[j] + s_rope[j]) * scale;
            rows[j] = &lat[keys[j] * C];
          }
          cpu::MlaAttend(sc.data(), rows.data(), n_keys, C, ol.data());
          // o_h = W_UV ol: dv rows of kv_b_proj after the head's W_UK rows.
          if (gemm.bf16) {
            for (float& v : ol) v = kernels::Bf16ToF32(kernels::F32ToBf16(v));
          }
          cpu::MatMulNT(ol.data(), 1, L.kv_b_proj.data.Rows(hd * (dn + dv) + dn, dv), gemm.weights(), oh);
        }
      }
    }
  }
  st.TapHeads(st.Name(l, kTapHeads), heads, dv);
}

// o = o_proj(heads)                                          heads [R, nh·dv] → o [R, H]
// Emulated TP: each rank's heads through its slice of o_proj ([R, tp, H]), then the all-reduce.
void OutProj(const Step& st, int64_t l, const std::vector<float>& heads, std::vector<float>& o) {
  const ModelConfig& c = st.c;
  const LayerWeights& L = st.W.layers[l];
  const int64_t R = st.R, H = c.hidden_size, tp = st.tp;
  if (tp > 1) {
    std::vector<float> parts(R * tp * H);
    if (st.ranked()) {  // this rank's heads through its columns of o_proj; every rank's gathered
      std::vector<float> mine(R * H);
      RowParallelRank(st.linear, heads.data(), R, L.o_proj, st.tp, c.v_head_dim, st.rank, mine.data());
      if (!st.Gather(mine.data(), H, parts.data())) return;
    } else {
      RowParallelPartials(st.linear, heads.data(), R, L.o_proj, st.tp, c.v_head_dim, parts.data());
    }
    if (st.tapping()) st.Tap(st.Name(l, kTapAttnPartials), parts.data(), tp * H);
    AllReduce(st.plan.allreduce, parts.data(), st.tp, R, H, o.data());
  } else {
    st.linear(heads.data(), R, L.o_proj, H, c.num_attention_heads * c.v_head_dim, o.data());
  }
  if (st.tapping()) st.Tap(st.Name(l, kTapAttnOut), o.data(), H);
}

// o = MLP(h), or Σ_j w_j·expert_{id_j}(h) + shared(h) over the k routed experts   h [R, H] → o [R, H]
// Emulated TP: each rank's partial ([R, tp, H]: its slice of the dense MLP's or the shared
// experts' intermediate dims, plus its block of routed experts), then the all-reduce.
void Ffn(const Step& st, int64_t l, const std::vector<float>& h, std::vector<float>& o) {
  const ModelConfig& c = st.c;
  const LayerWeights& L = st.W.layers[l];
  const Gemm& linear = st.linear;
  const int64_t R = st.R, H = c.hidden_size;
  const int tp = st.tp;
  std::vector<float> fparts(tp > 1 ? R * tp * H : 0);
  // Rank mode: this rank's partial alone (`mine`), every rank's gathered into fparts below.
  std::vector<float> mine(st.ranked() ? R * H : 0);
  if (c.layers[l].ffn == FfnKind::kDense && st.ranked()) {
    MlpRank(linear, L.mlp, h.data(), R, H, tp, st.rank, mine.data());
  } else if (c.layers[l].ffn == FfnKind::kDense && tp > 1) {
    MlpPartials(linear, L.mlp, h.data(), R, H, tp, fparts.data());
  } else if (c.layers[l].ffn == FfnKind::kDense) {
    SwiGluMlp(linear, L.mlp, h.data(), R, o.data());
  } else {
    const int64_t k = c.num_experts_per_tok, E = c.n_routed_experts;
    std::vector<int32_t> ids(R * k);
    std::vector<float> wts(R * k);
    {
      // logits[e] = cpu::Dot(x, router row e): one row through MatMulNT, each element Dot's.
      std::vector<float> logits(E);
      for (int64_t r = 0; r < R; ++r) {
        cpu::MatMulNT(&h[r * H], 1, L.router.data, kernels::WeightRounding::kAsStored, logits.data());
        RouteExperts(c, L.router_bias.empty() ? nullptr : L.router_bias.ptr(), logits.data(), &ids[r * k], &wts[r * k]);
      }
    }
    if (st.tapping()) {
      st.Tap(st.Name(l, kTapTopkIds), ids.data(), k, TapDType::kI32);
      st.Tap(st.Name(l, kTapTopkWeights), wts.data(), k);
    }
    // Each (row, slot) result in its own place (engine/ffn_blocks.h), combined below.
    std::vector<float> slot(R * k * H);
    const Shard own = st.ranked() ? ShardOf(E, tp, st.rank) : Shard{0, E};  // the experts this engine holds
    DispatchExperts(ids.data(), R, k, E, H, h.data(), [&](int64_t e, const float* xin, int64_t n, float* yout) {
      if (e < own.begin || e >= own.end) return;  // another rank's (its slots are not read here)
      if (st.hidden == HF::kExpertDownKTail) {
        MlpDownKTail(linear, L.experts[e], xin, n, H, yout);
      } else {
        SwiGluMlp(linear, L.experts[e], xin, n, yout);
      }
    }, slot.data());
    if (tp > 1) {
      // Rank q holds experts ShardOf(E, tp, q) and its slice of the shared experts (in rank mode
      // this engine is one q: its partial rows in `mine`).
      if (c.n_shared_experts > 0 && st.ranked()) MlpRank(linear, L.shared, h.data(), R, H, tp, st.rank, mine.data());
      if (c.n_shared_experts > 0 && !st.ranked()) MlpPartials(linear, L.shared, h.data(), R, H, tp, fparts.data());
      std::vector<float> acc(H);
      for (int64_t r = 0; r < R; ++r) {
        for (int q = st.ranked() ? st.rank : 0; q < (st.ranked() ? st.rank + 1 : tp); ++q) {
          const Shard mine_e = ShardOf(E, tp, q);
          float* prow = st.ranked() ? &mine[r * H] : &fparts[(r * tp + q) * H];
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t j = 0; j < k; ++j) {
            if (ids[r * k + j] < mine_e.begin || ids[r * k + j] >= mine_e.end) continue;
            const float w = wts[r * k + j];
            const float* y = &slot[(r * k + j) * H];
            for (int64_t i = 0; i < H; ++i) acc[i] += y[i] * w;
          }
          if (c.n_shared_experts > 0) {
            for (int64_t i = 0; i < H; ++i) acc[i] += prow[i];
          }
          std::copy(acc.begin(), acc.end(), prow);
        }
      }
    } else {
      std::vector<float> shared(R * H, 0.0f);
      if (c.n_shared_experts > 0) SwiGluMlp(linear, L.shared, h.data(), R, shared.data());
      CombineExperts(slot.data(), wts.data(), R, k, H, shared.data(), ExpertCombine::kMulAdd, o.data());
    }
  }
  if (tp > 1) {
    if (st.ranked() && !st.Gather(mine.data(), H, fparts.data())) return;
    if (st.tapping()) st.Tap(st.Name(l, kTapFfnPartials), fparts.data(), tp * H);
    AllReduce(st.plan.allreduce, fparts.data(), tp, R, H, o.data());
  }
  if (st.tapping()) st.Tap(st.Name(l, kTapFfnOut), o.data(), H);
}

}  // namespace

Status MlaForward(const ModelConfig& c, const ModelWeights& W, std::span<Segment> segs, const SegmentLayout& layout,
                  PagedKvCache& cache, const kernels::KernelPlan& plan, const MlaTables& tables, TapHook* hook,
                  ForwardOutput* out) {
  Step st{c, W, segs, cache, plan, tables, hook, layout.row0};
  st.R = layout.rows;
  st.max_pos = layout.max_end;
  st.pos.resize(st.R);
  st.seg_of.resize(st.R);
  for (size_t s = 0; s < segs.size(); ++s) {
    for (size_t i = 0; i < segs[s].tokens.size(); ++i) {
      st.pos[st.row0[s] + i] = segs[s].start_pos + static_cast<int64_t>(i);
      st.seg_of[st.row0[s] + i] = s;
    }
  }
  st.gemm = Gemm{plan.bf16()};
  st.linear = Gemm{plan.bf16(), plan.w8a8()};
  st.hidden = plan.hidden;
  st.tp = plan.emulate_tp;
  st.nhl = c.num_attention_heads;
  if (plan.ranks) {
    st.rank = plan.ranks->rank();
    const Shard mine = ShardOf(c.num_attention_heads, st.tp, st.rank);
    st.h0 = mine.begin;
    st.nhl = mine.end - mine.begin;
  }
  st.rmsnorm = plan.norm == kernels::Norm::kLanes256 ? cpu::RmsNormLanes256 : cpu::RmsNorm;
  if (plan.norm == kernels::Norm::kFp64 && st.hidden == HF::kNormMeanOverNMinus1) st.rmsnorm = RmsNormMeanNm1;
  if (plan.norm == kernels::Norm::kFp64 && st.hidden == HF::kNormBatchFp32Sum && segs.size() > 1) {
    st.rmsnorm = RmsNormFp32Sum;
  }
  // Fault zoo (docs/fault-zoo.md): variants of their ops like any other.
  if (plan.softmax == kernels::Softmax::kFaultNoMaxFp16Sum) st.softmax = SoftmaxNoMaxFp16Sum;

  const int64_t R = st.R, H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim,
                dr = c.qk_rope_head_dim, dv = c.v_head_dim, C = c.kv_lora_rank;
  // x = embed(tokens)                                          [R, H]
  std::vector<float> x(R * H);
  for (size_t s = 0; s < segs.size(); ++s) {
    for (size_t i = 0; i < segs[s].tokens.size(); ++i) {
      W.embed.data.DecodeRows(segs[s].tokens[i], 1, &x[(st.row0[s] + i) * H]);
    }
  }
  if (st.tapping()) {
    st.Tap(kModelTaps[kTapEmbed].name, x.data(), H);
    st.Override(kModelTaps[kTapEmbed].name, x.data(), H);
  }

  const int64_t nhl = st.nhl;  // the heads this engine computes (nh but in rank mode)
  std::vector<float> h(R * H), q(R * nhl * (dn + dr)), kv(R * (C + dr)), latent(R * C), krope(R * dr);
  std::vector<float> heads(R * nhl * dv), o(R * H), q_resid;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = W.layers[l];
    // x = x + Attention(RMSNorm(x))
    st.rmsnorm(x.data(), L.input_norm.ptr(), R, H, c.rms_norm_eps, h.data());
    if (st.tapping()) st.Tap(st.Name(l, kTapAttnNorm), h.data(), H);
    QueryAndKey(st, l, h, q, q_resid, kv, latent, krope);
    std::vector<std::vector<int32_t>> selected;
    if (c.layers[l].attention == AttentionKind::kMlaSparse) selected = LightningIndexer(st, l, h, q_resid);
    Attend(st, l, q, selected, heads);
    OutProj(st, l, heads, o);
    if (!st.error.ok()) return st.error;
    for (int64_t i = 0; i < R * H; ++i) x[i] += o[i];
    if (st.tapping()) st.Tap(st.Name(l, kTapResidMid), x.data(), H);

    // x = x + FFN(RMSNorm(x))
    st.rmsnorm(x.data(), L.post_attn_norm.ptr(), R, H, c.rms_norm_eps, h.data());
    if (st.tapping()) st.Tap(st.Name(l, kTapFfnNorm), h.data(), H);
    Ffn(st, l, h, o);
    if (!st.error.ok()) return st.error;  // rank mode: a collective failed (the group is aborted)
    for (int64_t i = 0; i < R * H; ++i) x[i] += o[i];
    if (st.tapping()) {
      st.Tap(st.Name(l, kTapResidOut), x.data(), H);
      st.Override(st.Name(l, kTapResidOut), x.data(), H);
    }
  }

  // Final norm, then logits for the rows that need them.
  st.rmsnorm(x.data(), W.final_norm.ptr(), R, H, c.rms_norm_eps, h.data());
  if (st.tapping()) st.Tap(kModelTaps[kTapFinalNorm].name, h.data(), H);
  SegmentLogits(segs, st.row0, h.data(), H, c.vocab_size, hook, [&](const float* xs, int64_t rows, float* lg) {
    if (st.hidden == HF::kLmHeadDropsLastHidden) {
      std::vector<float> hx(xs, xs + rows * H);
      for (int64_t r = 0; r < rows; ++r) hx[r * H + H - 1] = 0.0f;  // the loop's last element never read
      st.gemm(hx.data(), rows, W.lm_head, c.vocab_size, H, lg);
    } else {
      st.gemm(xs, rows, W.lm_head, c.vocab_size, H, lg);
    }
  }, out);
  for (auto& g : segs) g.cache->length = g.start_pos + static_cast<int64_t>(g.tokens.size());
  return Status::Ok();
}

}  // namespace lockstep::engine
