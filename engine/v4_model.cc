// engine/v4_model.cc — the DeepSeek-V4 forward pass, top to bottom (see v4_model.h).
//
// Shapes: R = rows in this step (all segments' tokens), D = hidden, hc = streams, H = heads,
// d = head_dim, rd = rotated dims, r = q_lora_rank, G = o_groups, Ro = o_lora_rank, W = window,
// m = the layer's compression rate, Hi / di = index heads / dim, E = experts, k = experts a token.
#include "engine/v4_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "engine/ffn_blocks.h"
#include "engine/gemm.h"
#include "engine/tap_capture.h"
#include "engine/v4_blocks.h"
#include "engine/v4_weights.h"
#include "kernels/cpu/ops.h"

namespace lockstep::engine {
namespace {

namespace cpu = kernels::cpu;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One step's rows and where they come from; the taps it emits.
struct Step {
  const ModelConfig& c;
  const V4Weights& w;
  std::span<Segment> segs;
  PagedKvCache& cache;
  TapHook* hook;
  std::vector<int64_t> row0, pos;  // row0 per segment; pos per row
  std::vector<size_t> seg_of;      // per row
  std::vector<int32_t> token;      // per row
  int64_t R = 0;
  v4::RopeTable main_rope, compress_rope;
  // The products (engine/gemm.h): `linear` for the layers DeepSeek's inference quantises the
  // input of under gemm=w8a8_dot (q, kv, the output projections, the experts, the indexer's q);
  // `gemm` for the compressors, the indexer's weights and lm_head. The router and the
  // hyper-connections' mixing stay fp32 in every variant.
  Gemm gemm, linear;
  const kernels::KernelPlan& plan;  // the variants (the fault zoo's V4 entries among them)

  const SeqCache& seq(int64_t r) const { return *segs[seg_of[r]].cache; }
  const v4::RopeTable& rope_of(const LayerSpec& s) const {
    return s.attention == AttentionKind::kSliding ? main_rope : compress_rope;
  }
  HostTapCapture taps{hook, segs, row0};
  // Emits each segment's rows of a [R, cols] buffer as tap `name` (built only with a hook).
  void Tap(const std::string& name, const void* data, int64_t cols, TapDType dt = TapDType::kF32) const {
    taps.Emit(name, data, cols, dt);
  }
  // One row of request row r's segment, at row r's position (taps with rows only where an event happens).
  void TapRow(const std::string& name, int64_t r, const float* data, int64_t cols) const {
    taps.EmitRow(name, seg_of[r], pos[r], data, cols);
  }
  // The name of layer l's tap point `t` (engine/tap.h's table); built only with a hook.
  std::string Name(int64_t l, TapId t) const {
    return hook == nullptr ? std::string() : "layers." + std::to_string(l) + "." + std::string(kLayerTaps[t].name);
  }
};

// Index of the layer's stream of `kind` in PagedKvCache::streams(l) (V4LayerStreams' order).
size_t StreamIndex(const PagedKvCache& cache, int64_t l, StreamKind kind) {
  const auto& st = cache.streams(l);
  for (size_t i = 0; i < st.size(); ++i) {
    if (st[i].kind == kind) return i;
  }
  return 0;
}

// The compressor of a CSA / HCA layer (or the CSA indexer's): writes each row's raw
// [kv_proj | gate_proj] to its state stream, and at each position that closes a window of m,
// pools the window (CSA: with the previous window's first halves) into the entry stream.
//   width: the entry's width (d, or di); CSA's projections are 2·width wide.
void Compress(const Step& st, int64_t l, const V4CompressorWeights& cw, bool overlap, int64_t width, size_t state_stream,
              size_t entry_stream, const float* xn, TapId tap) {
  const std::string tap_name = st.Name(l, tap);
  const ModelConfig& c = st.c;
  const int64_t D = c.hidden_size, m = c.layers[l].compress_rate, rd = c.v4.rope_dim;
  const int64_t pw = overlap ? 2 * width : width;  // projection width
  std::vector<float> kv(st.R * pw), gate(st.R * pw), row(2 * pw);
  st.gemm(xn, st.R, cw.kv_proj, kv.data());    // [R, pw]
  st.gemm(xn, st.R, cw.gate_proj, gate.data());  // [R, pw]
  for (int64_t r = 0; r < st.R; ++r) {
    std::memcpy(row.data(), &kv[r * pw], pw * 4);
    std::memcpy(row.data() + pw, &gate[r * pw], pw * 4);
    st.cache.WriteRow(l, state_stream, st.seq(r), st.pos[r], row.data());
  }
  (void)D;
  const float* pb = cw.position_bias.ptr();  // [m, pw]
  const int64_t slots = overlap ? 2 * m : m;
  std::vector<float> skv(slots * width), sgate(slots * width), e(width), cs(rd / 2), sn(rd / 2);
  const bool late = st.plan.compressor == kernels::Compressor::kFaultCloseLate;  // fault zoo
  for (int64_t r = 0; r < st.R; ++r) {
    const int64_t p = st.pos[r];
    if (late ? (p % m != 0 || p == 0) : (p + 1) % m != 0) continue;  // no window closes here
    const int64_t w = late ? p / m - 1 : (p + 1) / m - 1;
    // Slots [0, m) (CSA): window w − 1's first halves, their gates with the bias; empty for w = 0.
    // Then window w's rows: CSA's second halves, HCA's whole rows.
    for (int64_t j = 0; j < m; ++j) {
      if (overlap) {
        float* k0 = &skv[j * width];
        float* g0 = &sgate[j * width];
        if (w == 0) {
          std::fill(k0, k0 + width, 0.0f);
          std::fill(g0, g0 + width, kNegInf);
        } else {
          st.cache.ReadRow(l, state_stream, st.seq(r), (w - 1) * m + j, row.data());
          const bool no_bias = st.plan.hidden == kernels::HiddenFault::kV4CompressorOverlapNoBias;  // hidden fault
          for (int64_t i = 0; i < width; ++i) {
            k0[i] = row[i];
            g0[i] = row[pw + i] + (no_bias ? 0.0f : pb[j * pw + i]);
          }
        }
      }
      st.cache.ReadRow(l, state_stream, st.seq(r), w * m + j, row.data());
      const int64_t off = overlap ? width : 0;  // CSA's second half
      float* k1 = &skv[((overlap ? m : 0) + j) * width];
      float* g1 = &sgate[((overlap ? m : 0) + j) * width];
      for (int64_t i = 0; i < width; ++i) {
        k1[i] = row[off + i];
        g1[i] = row[pw + off + i] + pb[j * pw + off + i];
      }
    }
    st.compress_rope.At(w * m, cs.data(), sn.data());  // at the window's first position
    v4::PoolEntry(skv.data(), sgate.data(), slots, width, cw.kv_norm.ptr(), c.rms_norm_eps, rd, cs.data(), sn.data(),
                  e.data());
    st.cache.WriteRow(l, entry_stream, st.seq(r), w, e.data());
    st.TapRow(tap_name, r, e.data(), width);
  }
}

// The CSA indexer's choice for query row r: up to index_topk entries among the T visible ones,
// by score_t = Σ_h (wts_h·Hi^−½)·ReLU(qi_h·K_t)·di^−½; ascending entry numbers.
std::vector<int64_t> IndexerPick(const Step& st, int64_t l, size_t key_stream, int64_t r, int64_t T, const float* qi,
                                 const float* wts) {
  const ModelConfig& c = st.c;
  const int64_t Hi = c.index_n_heads, di = c.index_head_dim, K = std::min<int64_t>(c.index_topk, T);
  std::vector<int64_t> picks(T);
  std::iota(picks.begin(), picks.end(), 0);
  if (T <= c.index_topk) return picks;  // every candidate: no score can change the choice
  if (st.plan.indexer == kernels::Indexer::kDense) return picks;  // indexer=dense: no selection
  std::vector<float> score(T), key(di);
  const float hs = 1.0f / std::sqrt(static_cast<float>(Hi)), ds = 1.0f / std::sqrt(static_cast<float>(di));
  const bool wrong_layout = st.plan.indexer == kernels::Indexer::kFaultKeyLayout;  // fault zoo
  const int64_t ps = st.cache.page_size();
  for (int64_t t = 0; t < T; ++t) {
    st.cache.ReadRow(l, key_stream, st.seq(r), t, key.data());
    if (wrong_layout) {  // the page's fp32 keys read dim-major: element i of slot j at i·page_size + j
      const float* page = reinterpret_cast<const float*>(st.cache.TokenBytes(l, key_stream, st.seq(r), t - t % ps));
      for (int64_t i = 0; i < di; ++i) key[i] = page[i * ps + t % ps];
    }
    float s = 0;
    for (int64_t h = 0; h < Hi; ++h) s += (wts[h] * hs) * (std::max(cpu::Dot(&qi[h * di], key.data(), di), 0.0f) * ds);
    score[t] = s;
  }
  std::stable_sort(picks.begin(), picks.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
  picks.resize(K);
  std::sort(picks.begin(), picks.end());
  return picks;
}

// Attention of every row (any kind): xn [R, D] normed input → y [R, D].
void Attention(Step& st, int64_t l, const float* xn, float* y) {
  const ModelConfig& c = st.c;
  const V4Config& v = c.v4;
  const LayerSpec& spec = c.layers[l];
  const V4LayerWeights& L = st.w.layers[l];
  const int64_t R = st.R, D = c.hidden_size, H = c.num_attention_heads, d = v.head_dim, rd = v.rope_dim;
  const int64_t r_q = c.q_lora_rank, W = v.sliding_window, G = v.o_groups, Ro = v.o_lora_rank, m = spec.compress_rate;
  const v4::RopeTable& rope = st.rope_of(spec);
  std::vector<float> cs(rd / 2), sn(rd / 2);

  // q_res = RMSNorm(q_a(x)); q = q_b(q_res), each head RMS-rescaled, RoPE'd    [R, r], [R, H, d]
  std::vector<float> qa(R * r_q), q_res(R * r_q), q(R * H * d);
  st.linear(xn, R, L.q_a_proj, qa.data());
  cpu::RmsNorm(qa.data(), L.q_a_norm.ptr(), R, r_q, c.rms_norm_eps, q_res.data());
  st.linear(q_res.data(), R, L.q_b_proj, q.data());
  // kv = RMSNorm(kv_proj(x)), RoPE'd: the one K = V head                        [R, d]
  std::vector<float> kv_raw(R * d), kv(R * d);
  st.linear(xn, R, L.kv_proj, kv_raw.data());
  cpu::RmsNorm(kv_raw.data(), L.kv_norm.ptr(), R, d, c.rms_norm_eps, kv.data());
  for (int64_t r = 0; r < R; ++r) {
    rope.At(st.pos[r], cs.data(), sn.data());
    for (int64_t h = 0; h < H; ++h) {
      float* qh = &q[(r * H + h) * d];
      v4::RmsScale(qh, d, c.rms_norm_eps, qh);
      v4::RopeTrailing(qh, d, rd, cs.data(), sn.data());
    }
    v4::RopeTrailing(&kv[r * d], d, rd, cs.data(), sn.data());
  }
  st.Tap(st.Name(l, kTapQ), q.data(), H * d);
  st.Tap(st.Name(l, kTapV4Kv), kv.data(), d);
  const size_t win = StreamIndex(st.cache, l, StreamKind::kV4Window);
  for (int64_t r = 0; r < R; ++r) st.cache.WriteRow(l, win, st.seq(r), st.pos[r], &kv[r * d]);

  // Compressors: new entries for the windows that close in this step.
  const bool csa = spec.attention == AttentionKind::kCompressedSparse;
  const bool compressed = csa || spec.attention == AttentionKind::kHeavilyCompressed;
  size_t entries = 0, ikeys = 0;
  if (compressed) {
    entries = StreamIndex(st.cache, l, StreamKind::kV4Compressed);
    Compress(st, l, L.compressor, csa, d, StreamIndex(st.cache, l, StreamKind::kV4CompressorState), entries, xn,
             kTapV4CompressorEntry);
  }
  std::vector<float> qi, iw;  // CSA: the indexer's queries [R, Hi, di] and head weights [R, Hi]
  const int64_t Hi = c.index_n_heads, di = c.index_head_dim;
  if (csa) {
    ikeys = StreamIndex(st.cache, l, StreamKind::kV4IndexerKey);
    Compress(st, l, L.indexer, true, di, StreamIndex(st.cache, l, StreamKind::kV4IndexerState), ikeys, xn,
             kTapV4IndexerKey);
    qi.resize(R * Hi * di);
    iw.resize(R * Hi);
    st.linear(q_res.data(), R, L.indexer_q_b, qi.data());
    st.gemm(xn, R, L.indexer_weights, iw.data());
    for (int64_t r = 0; r < R; ++r) {
      st.compress_rope.At(st.pos[r], cs.data(), sn.data());
      for (int64_t h = 0; h < Hi; ++h) v4::RopeTrailing(&qi[(r * Hi + h) * di], di, rd, cs.data(), sn.data());
    }
  }

  // Per row: keys = the window's W rows (itself included) + the compressed entries it may see;
  // sinks in the softmax; the output de-rotated.                                  [R, H, d]
  std::vector<float> o(R * H * d), sink_share(R * H);
  std::vector<int32_t> topk(csa ? R * c.index_topk : 0, -1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> keybuf;
  std::vector<const float*> keys;
  for (int64_t r = 0; r < R; ++r) {
    const bool short_window = st.plan.attn_sparse == kernels::AttnSparse::kFaultWindowOneShort;  // fault zoo
    const int64_t p = st.pos[r], first = std::max<int64_t>(0, p - W + (short_window ? 2 : 1));
    std::vector<int64_t> picked;
    if (compressed) {
      const int64_t T = (p + 1) / m;  // entries closed at or before p
      if (csa) {
        picked = IndexerPick(st, l, ikeys, r, T, &qi[r * Hi * di], &iw[r * Hi]);
        if (st.plan.indexer != kernels::Indexer::kDense) {  // dense: no selection to tap (−1)
          for (size_t i = 0; i < picked.size(); ++i) topk[r * c.index_topk + i] = static_cast<int32_t>(picked[i]);
        }
      } else {
        picked.resize(T);
        std::iota(picked.begin(), picked.end(), 0);
      }
    }
    const int64_t nwin = p - first + 1, n = nwin + static_cast<int64_t>(picked.size());
    keybuf.resize(n * d);
    keys.resize(n);
    for (int64_t j = 0; j < nwin; ++j) st.cache.ReadRow(l, win, st.seq(r), first + j, &keybuf[j * d]);
    for (size_t i = 0; i < picked.size(); ++i) st.cache.ReadRow(l, entries, st.seq(r), picked[i], &keybuf[(nwin + i) * d]);
    for (int64_t t = 0; t < n; ++t) keys[t] = &keybuf[t * d];
    rope.At(p, cs.data(), sn.data());
    for (int64_t h = 0; h < H; ++h) {
      float* oh = &o[(r * H + h) * d];
      sink_share[r * H + h] = v4::AttendWithSink(&q[(r * H + h) * d], keys.data(), n, d, scale, L.sinks.ptr()[h], oh,
                                                 st.plan.softmax == kernels::Softmax::kFaultSinkOneSide);
      v4::RopeTrailing(oh, d, rd, cs.data(), sn.data(), /*inverse=*/true);
    }
  }
  if (csa) st.Tap(st.Name(l, kTapV4IndexerTopk), topk.data(), c.index_topk, TapDType::kI32);
  st.Tap(st.Name(l, kTapV4SinkShare), sink_share.data(), H);
  st.Tap(st.Name(l, kTapHeads), o.data(), H * d);

  // Grouped low-rank output: z_g = o_g · W_gᵀ (group g = heads g·H/G…), out = o_b(z)   [R, G·Ro] → [R, D]
  const int64_t gw = H * d / G;
  std::vector<float> og(R * gw), z(R * G * Ro), zg(R * Ro);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < R; ++r) std::memcpy(&og[r * gw], &o[r * H * d + g * gw], gw * 4);
    st.linear(og.data(), R, L.o_a_proj.Rows(g * Ro, Ro), zg.data());
    for (int64_t r = 0; r < R; ++r) std::memcpy(&z[r * G * Ro + g * Ro], &zg[r * Ro], Ro * 4);
  }
  st.linear(z.data(), R, L.o_b_proj, y);
  (void)D;
}

// The MoE: sqrt-softplus scores; experts by top-k of score + correction bias (kMoe) or by
// tid2eid[token] (kHashMoe); weights = the chosen scores renormalised × routed_scaling_factor;
// clamped SwiGLU experts, weighted after down_proj, plus the shared expert.   xn [R, D] → y [R, D]
void Moe(Step& st, int64_t l, const float* xn, float* y) {
  const ModelConfig& c = st.c;
  const V4LayerWeights& L = st.w.layers[l];
  const int64_t R = st.R, D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok;
  const bool hash = c.layers[l].ffn == FfnKind::kHashMoe;
  std::vector<float> logits(R * E), wts(R * k);
  std::vector<int32_t> ids(R * k);
  cpu::MatMulNT(xn, R, L.router.data, kernels::WeightRounding::kAsStored, logits.data());
  std::vector<float> s(E), choice(E);
  std::vector<int32_t> order(E);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t e = 0; e < E; ++e) s[e] = v4::SqrtSoftplus(logits[r * E + e]);
    int32_t* id = &ids[r * k];
    if (hash) {
      int64_t t = st.token[r];
      if (st.plan.hidden == kernels::HiddenFault::kV4HashRouteNextToken) t = (t + 1) % c.vocab_size;  // hidden fault
      std::memcpy(id, &L.tid2eid[static_cast<size_t>(t) * k], k * 4);
      std::sort(id, id + k);  // ascending, as top-k's (a repeated expert keeps both slots)
    } else {
      for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + L.router_bias.ptr()[e];
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return choice[a] > choice[b]; });
      std::copy(order.begin(), order.begin() + k, id);
      std::sort(id, id + k);
    }
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += s[id[j]];
    for (int64_t j = 0; j < k; ++j) {
      wts[r * k + j] = s[id[j]] / (sum + 1e-20f) * static_cast<float>(c.routed_scaling_factor);
    }
  }
  st.Tap(st.Name(l, kTapTopkIds), ids.data(), k, TapDType::kI32);
  st.Tap(st.Name(l, kTapTopkWeights), wts.data(), k);
  // Each (row, slot) result in its own place, summed in slot order (engine/ffn_blocks.h).
  const float limit = static_cast<float>(c.v4.swiglu_limit);
  std::vector<float> slot(R * k * D);
  DispatchExperts(ids.data(), R, k, E, D, xn, [&](int64_t e, const float* xin, int64_t n, float* yout) {
    SwiGluMlp(st.linear, L.experts[e], xin, n, yout, limit);
  }, slot.data());
  std::vector<float> shared(R * D, 0.0f);
  if (c.n_shared_experts > 0) SwiGluMlp(st.linear, L.shared, xn, R, shared.data(), limit);
  CombineExperts(slot.data(), wts.data(), R, k, D, shared.data(), ExpertCombine::kFma, y);
}

// One hyper-connected sub-block around `block`: X [R, hc, D] ← post⊗block(norm(Σ pre·X)) + CᵀX.
template <typename Block>
void HyperConnected(Step& st, int64_t l, const V4HcWeights& hw, const Matrix& norm, TapId norm_tap, TapId mix_tap,
                    TapId streams_tap, std::vector<float>& X, Block block) {
  const ModelConfig& c = st.c;
  const int64_t R = st.R, D = c.hidden_size, hc = c.v4.hc_mult;
  std::vector<v4::HcMix> mix(R);
  std::vector<float> x_in(R * D), xn(R * D), y(R * D), Xn(X.size());
  for (int64_t r = 0; r < R; ++r) v4::HcPre(hw, c.v4, c.rms_norm_eps, &X[r * hc * D], D, &mix[r], &x_in[r * D]);
  if (st.hook != nullptr) {  // pre | post | comb per row
    std::vector<float> mw(R * (2 + hc) * hc);
    for (int64_t r = 0; r < R; ++r) {
      float* o = &mw[r * (2 + hc) * hc];
      std::copy(mix[r].pre.begin(), mix[r].pre.end(), o);
      std::copy(mix[r].post.begin(), mix[r].post.end(), o + hc);
      std::copy(mix[r].comb.begin(), mix[r].comb.end(), o + 2 * hc);
    }
    st.Tap(st.Name(l, mix_tap), mw.data(), (2 + hc) * hc);
  }
  cpu::RmsNorm(x_in.data(), norm.ptr(), R, D, c.rms_norm_eps, xn.data());
  st.Tap(st.Name(l, norm_tap), xn.data(), D);
  block(xn.data(), y.data());
  for (int64_t r = 0; r < R; ++r) v4::HcPost(mix[r], &X[r * hc * D], &y[r * D], hc, D, &Xn[r * hc * D]);
  X.swap(Xn);
  st.Tap(st.Name(l, streams_tap), X.data(), hc * D);
}

}  // namespace

Status V4Forward(const ModelConfig& c, const ModelWeights& w, std::span<Segment> segs, PagedKvCache& cache,
                 const kernels::KernelPlan& plan, TapHook* hook, ForwardOutput* out) {
  if (w.v4 == nullptr) return Status::Internal("V4Forward: the model has no V4 weights");
  LS_ASSIGN_OR_RETURN(SegmentLayout layout, LayOutSegments(segs, c));
  for (auto& g : segs) LS_RETURN_IF_ERROR(cache.Reserve(g.cache, g.start_pos + static_cast<int64_t>(g.tokens.size())));
  Step st{c, *w.v4, segs, cache, hook, layout.row0, {}, {}, {}, layout.rows,
          v4::RopeTable(c.v4.main_rope, c.v4.rope_dim), v4::RopeTable(c.v4.compress_rope, c.v4.rope_dim),
          Gemm::Of(plan, false), Gemm::Of(plan, true), plan};
  const int64_t R = st.R, D = c.hidden_size, hc = c.v4.hc_mult;
  st.pos.resize(R);
  st.seg_of.resize(R);
  st.token.resize(R);
  for (size_t s = 0; s < segs.size(); ++s) {
    for (size_t i = 0; i < segs[s].tokens.size(); ++i) {
      const int64_t r = st.row0[s] + static_cast<int64_t>(i);
      st.pos[r] = segs[s].start_pos + static_cast<int64_t>(i);
      st.seg_of[r] = s;
      st.token[r] = segs[s].tokens[i];
    }
  }

  // X = embed(tokens), copied into each of the hc streams                   [R, hc, D]
  std::vector<float> x(R * D), X(R * hc * D);
  for (int64_t r = 0; r < R; ++r) w.embed.data.DecodeRows(st.token[r], 1, &x[r * D]);
  st.Tap(std::string(kModelTaps[kTapEmbed].name), x.data(), D);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < hc; ++j) std::memcpy(&X[(r * hc + j) * D], &x[r * D], D * 4);
  }

  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const V4LayerWeights& L = st.w.layers[l];
    HyperConnected(st, l, L.attn_hc, L.input_norm, kTapAttnNorm, kTapV4AttnHcMix, kTapV4StreamsMid, X,
                   [&](const float* xn, float* y) {
      Attention(st, l, xn, y);
      st.Tap(st.Name(l, kTapAttnOut), y, D);
    });
    HyperConnected(st, l, L.ffn_hc, L.post_attn_norm, kTapFfnNorm, kTapV4FfnHcMix, kTapV4Streams, X,
                   [&](const float* xn, float* y) {
      Moe(st, l, xn, y);
      st.Tap(st.Name(l, kTapFfnOut), y, D);
    });
  }

  // h = RMSNorm(hc_head(X)); logits for the rows that need them.
  std::vector<float> h(R * D), hn(R * D);
  for (int64_t r = 0; r < R; ++r) v4::HcHead(st.w.head, c.v4, c.rms_norm_eps, &X[r * hc * D], D, &h[r * D]);
  cpu::RmsNorm(h.data(), w.final_norm.ptr(), R, D, c.rms_norm_eps, hn.data());
  st.Tap(std::string(kModelTaps[kTapFinalNorm].name), hn.data(), D);
  SegmentLogits(segs, st.row0, hn.data(), D, c.vocab_size, hook, [&](const float* x, int64_t rows, float* lg) {
    st.gemm(x, rows, w.lm_head, lg);
  }, out);
  for (auto& g : segs) g.cache->length = g.start_pos + static_cast<int64_t>(g.tokens.size());
  return Status::Ok();
}

}  // namespace lockstep::engine
