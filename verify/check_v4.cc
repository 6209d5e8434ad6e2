// verify/check_v4.cc — DeepSeek-V4's golden twins on a trace's own rows (see check.h).
//
// Each op is written here once more from the math, in fp64, sharing nothing with the engine's
// V4 code (engine/v4_*.cc) or kernels/cpu: the hyper-connections (sigmoids, a softmax and
// Sinkhorn), the q and kv paths with the per-head rescale and RoPE on the trailing dims, the KV
// cache's encodings of the recorded rows (fp32, bf16, FlashMLA's MODEL1), the compressor's gated
// pooling, attention with the sink over the request's OWN recorded window and compressed rows
// (decoded from the trace's kv/ bytes), the grouped output projection, sqrt-softplus and hash
// routing, the clamped SwiGLU experts, hc_head and the final norm. Each feeds on the recorded
// inputs of its op, so a defect is placed at its op, layer and position. The compressors' and
// the indexer's products from the layer input (their state rows) are taken as recorded.
//
// Budgets follow golden.h's first-order rules. Where the production computes a short chain in
// fp32 (a sigmoid, Sinkhorn's normalisations), the budget is a few unit roundoffs per step
// times the magnitudes involved, plus the input's budget times the chain's sensitivity (written
// at each place).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "engine/v4_weights.h"
#include "verify/check_internal.h"

namespace lockstep::verify::internal {
namespace {

constexpr double kU = g::kFp32U;

double Sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

// The norms' eps as config.json states it (verify/file_config.h), else the engine's default.
double Eps(const Ctx& cx) { return cx.file.rms_norm_eps.value_or(cx.c->rms_norm_eps); }

// The RoPE frequencies of one of V4's two tables.
std::vector<double> InvFreq(const engine::V4Rope& r, int64_t rd) {
  g::RopeSpec s;
  s.theta = r.theta;
  s.yarn = r.yarn;
  s.factor = r.factor;
  s.beta_fast = r.beta_fast;
  s.beta_slow = r.beta_slow;
  s.original_max_pos = static_cast<double>(r.original_max_position_embeddings);
  s.truncate = r.truncate;
  return g::RopeInvFreq(s, rd);
}

g::Vec Slice(const g::Vec& x, int64_t off, int64_t n) {
  g::Vec y;
  y.v.assign(x.v.begin() + off, x.v.begin() + off + n);
  y.e.assign(x.e.begin() + off, x.e.begin() + off + n);
  return y;
}
void Put(g::Vec* y, int64_t off, const g::Vec& x) {
  std::copy(x.v.begin(), x.v.end(), y->v.begin() + off);
  std::copy(x.e.begin(), x.e.end(), y->e.begin() + off);
}
// x / sqrt(mean(x²) + eps), no weight.
g::Vec RmsScale(const g::Vec& x, double eps) {
  const std::vector<float> ones(x.size(), 1.0f);
  return g::RmsNorm(x, ones.data(), eps);
}

// A hyper-connection's mixing weights from the streams X [hc·D] (recorded): [pre | post | C].
g::Vec HcMix(Ctx& cx, const engine::V4HcWeights& w, const float* X) {
  const engine::V4Config& v = cx.c->v4;
  const int64_t hc = v.hc_mult, D = cx.c->hidden_size;
  const g::Vec f = RmsScale(Row(X, hc * D), Eps(cx));
  const g::Vec m = g::Linear(cx.Wt(w.fn), f, cx.fp32);  // the mixing product stays fp32 in every variant
  const float* base = w.base.ptr();
  const float* scale = w.scale.ptr();
  g::Vec out;
  out.v.assign((2 + hc) * hc, 0);
  out.e.assign((2 + hc) * hc, 0);
  for (int64_t j = 0; j < hc; ++j) {
    // σ(m·s + b): σ' ≤ 1/4; an fp32 exp, a product, a sum and a division (8u).
    const double p = Sigmoid(m.v[j] * scale[0] + base[j]);
    out.v[j] = p + v.hc_eps;
    out.e[j] = 0.25 * std::fabs(scale[0]) * m.e[j] + 8 * kU * out.v[j];
    const double q = 2 * Sigmoid(m.v[hc + j] * scale[1] + base[hc + j]);
    out.v[hc + j] = q;
    out.e[hc + j] = 0.5 * std::fabs(scale[1]) * m.e[hc + j] + 8 * kU * q;
  }
  // C: per row j softmax over k of (m·s + b), + eps; then Sinkhorn — columns, then (rows,
  // columns) × (iters − 1), each dividing by the sum + eps.
  std::vector<double> C(hc * hc);
  double dz = 0;  // the largest input perturbation of a softmax row
  for (int64_t j = 0; j < hc; ++j) {
    double mx = -INFINITY;
    for (int64_t k = 0; k < hc; ++k) {
      const int64_t i = 2 * hc + j * hc + k;
      C[j * hc + k] = m.v[i] * scale[2] + base[i];
      mx = std::max(mx, C[j * hc + k]);
      dz = std::max(dz, std::fabs(scale[2]) * m.e[i]);
    }
    double s = 0;
    for (int64_t k = 0; k < hc; ++k) s += (C[j * hc + k] = std::exp(C[j * hc + k] - mx));
    for (int64_t k = 0; k < hc; ++k) C[j * hc + k] = C[j * hc + k] / s + v.hc_eps;
  }
  auto normalise = [&](bool columns) {
    for (int64_t a = 0; a < hc; ++a) {
      double s = 0;
      for (int64_t b = 0; b < hc; ++b) s += columns ? C[b * hc + a] : C[a * hc + b];
      for (int64_t b = 0; b < hc; ++b) (columns ? C[b * hc + a] : C[a * hc + b]) /= s + v.hc_eps;
    }
  };
  normalise(true);
  for (int64_t it = 1; it < v.hc_sinkhorn_iters; ++it) {
    normalise(false);
    normalise(true);
  }
  // The softmax moves each entry by at most 2·dz relative (and 8u + γ_hc for its own fp32
  // rounding); a normalisation keeps a relative perturbation of its inputs (the sums move with
  // them) and adds γ_(hc+1); 2·iters of them. The absolute term is a floor for entries near 0,
  // chosen (not derived) at 10⁻³ of one row's total rounding: rows sum to about 1.
  const double rel = 2 * dz + 8 * kU + g::Gamma(hc + 1) * (1 + 2 * v.hc_sinkhorn_iters);
  for (int64_t i = 0; i < hc * hc; ++i) {
    out.v[2 * hc + i] = C[i];
    out.e[2 * hc + i] = 2 * rel * C[i] + 2 * v.hc_sinkhorn_iters * g::Gamma(hc + 1) * 1e-3;
  }
  return out;
}

// Σ_j pre_j·X_j over the recorded mix and streams: an fp32 sum of hc products.
g::Vec HcPreSum(const float* pre, const float* X, int64_t hc, int64_t D) {
  g::Vec x;
  x.v.assign(D, 0);
  x.e.assign(D, 0);
  for (int64_t i = 0; i < D; ++i) {
    double s = 0, a = 0;
    for (int64_t j = 0; j < hc; ++j) {
      s += static_cast<double>(pre[j]) * X[j * D + i];
      a += std::fabs(static_cast<double>(pre[j]) * X[j * D + i]);
    }
    x.v[i] = s;
    x.e[i] = g::Gamma(hc + 1) * a;
  }
  return x;
}

// The streams after a block: post_k·y + Σ_j C_jk·X_j (recorded mix, streams and block output).
g::Vec HcPost(const float* mix, const float* X, const float* y, int64_t hc, int64_t D) {
  const float* post = mix + hc;
  const float* C = mix + 2 * hc;
  g::Vec out;
  out.v.assign(hc * D, 0);
  out.e.assign(hc * D, 0);
  for (int64_t k = 0; k < hc; ++k) {
    for (int64_t i = 0; i < D; ++i) {
      double s = 0, a = 0;
      for (int64_t j = 0; j < hc; ++j) {
        s += static_cast<double>(C[j * hc + k]) * X[j * D + i];
        a += std::fabs(static_cast<double>(C[j * hc + k]) * X[j * D + i]);
      }
      const double py = static_cast<double>(post[k]) * y[i];
      out.v[k * D + i] = py + s;
      out.e[k * D + i] = g::Gamma(hc + 2) * (a + std::fabs(py));
    }
  }
  return out;
}

// One cached row, decoded from its recorded parts as the format stores them (independently of
// kernels/v4_kv_formats): fp32, bf16, or MODEL1 (nope e4m3 × 2^(e − 127) per 64, rope bf16).
bool DecodeCacheRow(Ctx& cx, const std::string& base, int32_t req, int64_t pos, int64_t d, int64_t rd,
                    std::vector<double>* row) {
  const Tensor* t = cx.T(base);
  const int64_t r = t ? t->Row(req, pos) : -1;
  if (r < 0) return false;
  row->assign(d, 0);
  const traces::DType dt = t->info->dtype;
  if (dt == traces::DType::kF32) {
    for (int64_t i = 0; i < d; ++i) (*row)[i] = t->F(r)[i];
  } else if (dt == traces::DType::kBf16) {
    for (int64_t i = 0; i < d; ++i) {
      uint16_t b;
      std::memcpy(&b, t->B(r) + 2 * i, 2);
      (*row)[i] = g::Bf16Value(b);
    }
  } else {
    const Tensor* tr = cx.T(base + ".rope");
    const Tensor* ts = cx.T(base + ".scales");
    const int64_t rr = tr ? tr->Row(req, pos) : -1, rs = ts ? ts->Row(req, pos) : -1;
    if (rr < 0 || rs < 0) return false;
    const int64_t nope = d - rd;
    for (int64_t i = 0; i < nope; ++i) {
      const uint8_t e = ts->B(rs)[i / 64];
      (*row)[i] = e == 0xFF ? NAN : g::E4m3Value(t->B(r)[i]) * std::ldexp(1.0, static_cast<int>(e) - 127);
    }
    for (int64_t i = 0; i < rd; ++i) {
      uint16_t b;
      std::memcpy(&b, tr->B(rr) + 2 * i, 2);
      (*row)[nope + i] = g::Bf16Value(b);
    }
  }
  return true;
}

// Whether the recorded cache bytes of a row are the format's encoding of the recorded fp32 row
// `x` (written from FlashMLA's MODEL1: per 64 nope values s = 2^⌈log2(max(amax/448, 1e-4))⌉,
// e4m3(x/s) nearest-even saturating, scale byte log2(s) + 127; rope values bf16). "" if equal.
std::string CacheBytesDiffer(Ctx& cx, const std::string& base, int32_t req, int64_t pos, const float* x, int64_t d,
                             int64_t rd) {
  const Tensor* t = cx.T(base);
  const int64_t r = t ? t->Row(req, pos) : -1;
  if (r < 0) return "not recorded";
  const traces::DType dt = t->info->dtype;
  if (dt == traces::DType::kF32) {
    return std::memcmp(t->B(r), x, d * 4) == 0 ? "" : "fp32 bytes differ from the recorded row";
  }
  if (dt == traces::DType::kBf16) {
    for (int64_t i = 0; i < d; ++i) {
      uint16_t b;
      std::memcpy(&b, t->B(r) + 2 * i, 2);
      if (b != g::Bf16Bits(x[i])) return "bf16 value " + std::to_string(i) + " is not the recorded row's rounding";
    }
    return "";
  }
  const Tensor* tr = cx.T(base + ".rope");
  const Tensor* ts = cx.T(base + ".scales");
  const int64_t rr = tr ? tr->Row(req, pos) : -1, rs = ts ? ts->Row(req, pos) : -1;
  if (rr < 0 || rs < 0) return "the rope or scale part is not recorded";
  const int64_t nope = d - rd;
  for (int64_t tile = 0; tile * 64 < nope; ++tile) {
    const int64_t lo = tile * 64, n = std::min<int64_t>(64, nope - lo);
    double amax = 0;
    bool finite = true;
    for (int64_t i = lo; i < lo + n; ++i) {
      finite &= std::isfinite(x[i]);
      amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
    }
    uint8_t want_scale = 0xFF;
    double s = NAN;
    if (finite) {
      const float q = std::max(static_cast<float>(amax) / 448.0f, 1e-4f);  // fp32, as quant.py computes it
      int k = static_cast<int>(std::ceil(std::log2(static_cast<double>(q))));
      if (std::ldexp(1.0, k - 1) >= q) --k;  // the least power of two ≥ q, exactly
      if (std::ldexp(1.0, k) < q) ++k;
      want_scale = static_cast<uint8_t>(k + 127);
      s = std::ldexp(1.0, k);
    }
    if (ts->B(rs)[tile] != want_scale) {
      return "MODEL1 scale of values " + std::to_string(lo) + "… is byte " + std::to_string(ts->B(rs)[tile]) +
             ", the recorded row's is " + std::to_string(want_scale);
    }
    for (int64_t i = lo; i < lo + n; ++i) {
      const uint8_t want = finite ? g::E4m3Bits(static_cast<double>(x[i]) / s) : 0x7F;
      if (t->B(r)[i] != want) return "MODEL1 e4m3 value " + std::to_string(i) + " is not the recorded row's encoding";
    }
  }
  for (int64_t i = 0; i < rd; ++i) {
    uint16_t b;
    std::memcpy(&b, tr->B(rr) + 2 * i, 2);
    if (b != g::Bf16Bits(x[nope + i])) return "MODEL1 rope value " + std::to_string(i) + " is not the recorded row's bf16";
  }
  return "";
}

// The clamped SwiGLU expert down(silu(min(g, L))·clamp(u, ±L)) of x.
g::Vec Expert(Ctx& cx, const engine::MlpWeights& m, const g::Vec& x, double limit) {
  g::Vec gt = g::Linear(cx.Wt(m.gate), x, cx.linear), up = g::Linear(cx.Wt(m.up), x, cx.linear);
  for (int64_t i = 0; i < gt.size(); ++i) {
    if (gt.v[i] > limit) gt.v[i] = limit, gt.e[i] = 0;
    if (std::fabs(up.v[i]) > limit) up.v[i] = std::copysign(limit, up.v[i]), up.e[i] = 0;
  }
  return g::Linear(cx.Wt(m.down), g::SwiGlu(gt, up), cx.linear);
}

// The entry a compressor emits for window w (closing at (w + 1)·m − 1) from the recorded state
// rows of `state` (kv/layers.L.compressor or .indexer_state: [kv | gate], 2·width each for the
// overlapping CSA kind, width for HCA): per column a softmax over the slots of gate + position
// bias — CSA's previous window's first halves (none for w = 0), then this window's rows (CSA: the
// second halves) — the kv values pooled by it, RMSNorm, RoPE on the trailing dims at w·m.
// False when a state row is not in the trace.
bool PoolTwin(Ctx& cx, const engine::V4CompressorWeights& cw, const Tensor* state, int32_t req, int64_t w, int64_t m,
              int64_t width, bool overlap, const std::vector<double>& freq, double af, g::Vec* out) {
  if (state == nullptr) return false;
  const int64_t pw = overlap ? 2 * width : width, slots = overlap ? 2 * m : m, rd = cx.c->v4.rope_dim;
  const float* pb = cw.position_bias.ptr();
  std::vector<const float*> row(slots, nullptr);
  std::vector<int64_t> off(slots, 0), bias_row(slots, 0);
  for (int64_t j = 0; j < m; ++j) {
    if (overlap && w > 0) {
      const int64_t r0 = state->Row(req, (w - 1) * m + j);
      if (r0 < 0) return false;
      row[j] = state->F(r0);
      bias_row[j] = j;
    }
    const int64_t r1 = state->Row(req, w * m + j);
    if (r1 < 0) return false;
    const int64_t s = (overlap ? m : 0) + j;
    row[s] = state->F(r1);
    off[s] = overlap ? width : 0;
    bias_row[s] = j;
  }
  g::Vec pooled;
  pooled.v.assign(width, 0);
  pooled.e.assign(width, 0);
  for (int64_t col = 0; col < width; ++col) {
    g::Vec gs;
    std::vector<int64_t> used;
    for (int64_t s = 0; s < slots; ++s) {
      if (row[s] == nullptr) continue;  // CSA window 0: no previous window
      const double gv = static_cast<double>(row[s][pw + off[s] + col]) + pb[bias_row[s] * pw + off[s] + col];
      gs.v.push_back(gv);
      gs.e.push_back(kU * std::fabs(gv));
      used.push_back(s);
    }
    const g::Vec a = g::Softmax(gs);
    double sum = 0, mag = 0, eb = 0;
    for (size_t i = 0; i < used.size(); ++i) {
      const double kvv = row[used[i]][off[used[i]] + col];
      sum += a.v[i] * kvv;
      mag += std::fabs(a.v[i] * kvv);
      eb += a.e[i] * std::fabs(kvv);
    }
    pooled.v[col] = sum;
    pooled.e[col] = eb + g::Gamma(static_cast<int64_t>(used.size()) + 1) * mag;
  }
  *out = g::RmsNorm(pooled, cw.kv_norm.ptr(), Eps(cx));
  g::Rope(out, width - rd, rd, w * m, freq, af, g::RopeLayout::kPairsAdjacent);
  return true;
}

// `twin` with the rounding the stored format adds (bf16: half an ulp, at most 2^-8 relative;
// MODEL1's e4m3: 2^-4 relative or 2^-10 of its tile's scale, its rope values bf16), to compare
// with a stored row decoded.
g::Vec WithStorageRounding(Ctx& cx, const std::string& base, int32_t req, int64_t pos, g::Vec twin, int64_t rd) {
  const Tensor* t = cx.T(base);
  const int64_t r = t ? t->Row(req, pos) : -1;
  if (r < 0 || t->info->dtype == traces::DType::kF32) return twin;
  const int64_t d = twin.size(), nope = d - rd;
  const Tensor* ts = t->info->dtype == traces::DType::kFp8E4m3 ? cx.T(base + ".scales") : nullptr;
  const int64_t rs = ts ? ts->Row(req, pos) : -1;
  for (int64_t i = 0; i < d; ++i) {
    const double v = std::fabs(twin.v[i]) + twin.e[i];
    if (ts == nullptr || i >= nope) {
      twin.e[i] += g::kBf16U * v;
    } else {
      const double s = rs >= 0 ? std::ldexp(1.0, static_cast<int>(ts->B(rs)[i / 64]) - 127) : INFINITY;
      twin.e[i] += std::max(g::kFp8U * v, 0x1p-10 * s);
    }
  }
  return twin;
}

}  // namespace

void CheckV4Rows(Ctx& cx, const CheckOptions& opt) {
  const traces::TraceReader& trace = *cx.trace;
  const engine::ModelConfig& c = *cx.c;
  const engine::V4Config& v = c.v4;
  const engine::V4Weights& W4 = *cx.W->v4;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, d = v.head_dim, rd = v.rope_dim, hc = v.hc_mult;
  const int64_t G = v.o_groups, Ro = v.o_lora_rank, E = c.n_routed_experts, k = c.num_experts_per_tok;
  const int64_t NL = c.num_hidden_layers, Wn = v.sliding_window;
  const std::vector<double> main_freq = InvFreq(v.main_rope, rd), comp_freq = InvFreq(v.compress_rope, rd);
  // YaRN's factor on cos and sin of each table, from its fields (golden::RopeAttentionFactor).
  auto factor_of = [](const engine::V4Rope& r) {
    return g::RopeAttentionFactor(r.yarn, r.factor, r.mscale, r.mscale_all_dim, r.attention_factor_field);
  };
  const double main_af = factor_of(v.main_rope), comp_af = factor_of(v.compress_rope);
  const bool dense = cx.Variant("indexer") == "dense";  // CSA attends every closed entry
  const Tensor* embed = cx.T("embed");
  const int64_t total = static_cast<int64_t>(embed->rows.size());
  int64_t done = 0;
  std::map<int32_t, std::vector<int32_t>> tokens;  // per request: prompt then generated
  for (const auto& q : trace.requests()) {
    tokens[q.id] = q.prompt;
    tokens[q.id].insert(tokens[q.id].end(), q.generated.begin(), q.generated.end());
  }
  {  // V4's attention: its softmax (with the sink) over the keys the window and the selection give
    OpReport& a = cx.stats[OpIndex("attention")].rep;
    a.kernel_op = "softmax+attn_sparse";
    a.variant = cx.Variant("softmax") + "+" + cx.Variant("attn_sparse");
  }
  auto not_checked = [&](const char* op, const char* why) {
    Stats& st = cx.stats[OpIndex(op)];
    ++st.rep.not_checked;
    st.rep.not_checked_why = why;
  };
  for (int64_t ri = 0; ri < total; ++ri) {
    const traces::SummaryRow& sr = embed->rows[ri];
    const int32_t req = sr.request;
    const int64_t pos = sr.position;
    const int64_t plen = cx.prompt_len.count(req) ? cx.prompt_len[req] : 0;
    const std::vector<int32_t>& toks = tokens[req];
    const int32_t token = pos < static_cast<int64_t>(toks.size()) ? toks[pos] : -1;
    Location base{req, -1, pos, sr.step, "embed"};
    base.prefill = pos < plen;
    if (token >= 0 && token < c.vocab_size) {
      std::vector<float> e(D);
      cx.W->embed.data.DecodeRows(token, 1, e.data());
      Compare(cx, OpIndex("embed"), base, embed->F(ri), Row(e.data(), D), 0, -1, false);
    } else {
      not_checked("embed", "the row's token is not in the trace");
    }
    // The streams entering layer 0: the embedding in each of the hc streams (recorded).
    std::vector<float> X0(hc * D);
    for (int64_t j = 0; j < hc; ++j) std::memcpy(&X0[j * D], embed->F(ri), D * 4);
    const float* X = X0.data();
    for (int64_t l = 0; l < NL; ++l) {
      const engine::V4LayerWeights& L = W4.layers[l];
      const engine::LayerSpec& spec = c.layers[l];
      const bool sliding = spec.attention == engine::AttentionKind::kSliding;
      const std::vector<double>& freq = sliding ? main_freq : comp_freq;
      const double af = sliding ? main_af : comp_af;
      auto tap = [&](const char* n) { return cx.T(LayerTap(l, n)); };
      auto row_of = [&](const Tensor* t) { return t ? t->Row(req, pos) : -1; };
      auto loc = [&](const char* n, const Tensor* t, int64_t row) {
        Location w{req, l, pos, t ? t->rows[row].step : sr.step, LayerTap(l, n)};
        w.prefill = pos < plen;
        return w;
      };
      // ---- attention sub-block ----
      const Tensor* t_mix = tap("attn_hc.mix");
      const Tensor* t_norm = tap("attn_norm");
      const int64_t rmix = row_of(t_mix), rn = row_of(t_norm);
      if (rmix < 0 || rn < 0) {
        X = nullptr;
        break;  // the trace holds no more of this row's layers
      }
      if (X != nullptr) {
        Compare(cx, OpIndex("attn_hc"), loc("attn_hc.mix", t_mix, rmix), t_mix->F(rmix), HcMix(cx, L.attn_hc, X), 0, -1,
                false);
        Compare(cx, OpIndex("attn_norm"), loc("attn_norm", t_norm, rn), t_norm->F(rn),
                g::RmsNorm(HcPreSum(t_mix->F(rmix), X, hc, D), L.input_norm.ptr(), Eps(cx)));
      }
      const g::Vec hv = Row(t_norm->F(rn), D);
      // q: q_b(RMSNorm(q_a(h))), each head RMS-rescaled, RoPE on its trailing rd dims.
      const Tensor* t_q = tap("attn.q");
      const int64_t rq = row_of(t_q);
      const g::Vec q_res = g::RmsNorm(g::Linear(cx.Wt(L.q_a_proj), hv, cx.linear), L.q_a_norm.ptr(), Eps(cx));
      if (rq >= 0) {
        g::Vec q = g::Linear(cx.Wt(L.q_b_proj), q_res, cx.linear);
        for (int64_t h = 0; h < H; ++h) {
          g::Vec qh = RmsScale(Slice(q, h * d, d), Eps(cx));
          g::Rope(&qh, d - rd, rd, pos, freq, af, g::RopeLayout::kPairsAdjacent);
          Put(&q, h * d, qh);
        }
        for (int64_t h = 0; h < H; ++h) {
          Compare(cx, OpIndex("q_proj"), loc("attn.q", t_q, rq), t_q->F(rq) + h * d, q, h * d, d - rd);
          Compare(cx, OpIndex("rope_q"), loc("attn.q", t_q, rq), t_q->F(rq) + h * d + d - rd, q, h * d + d - rd, rd);
        }
      }
      // kv: RMSNorm(kv_proj(h)), RoPE'd; then its cache row's bytes.
      const Tensor* t_kv = tap("attn.kv");
      const int64_t rkv = row_of(t_kv);
      if (rkv >= 0) {
        g::Vec kv = g::RmsNorm(g::Linear(cx.Wt(L.kv_proj), hv, cx.linear), L.kv_norm.ptr(), Eps(cx));
        g::Rope(&kv, d - rd, rd, pos, freq, af, g::RopeLayout::kPairsAdjacent);
        Compare(cx, OpIndex("kv_proj"), loc("attn.kv", t_kv, rkv), t_kv->F(rkv), kv);
        const std::string why = CacheBytesDiffer(cx, "kv/" + LayerTap(l, "window"), req, pos, t_kv->F(rkv), d, rd);
        if (why != "not recorded") {
          Location w = loc("attn.kv", t_kv, rkv);
          w.tensor = "kv/" + LayerTap(l, "window");
          CompareSet(cx, OpIndex("kv_cache"), w, why.empty() ? 0 : INFINITY, why.empty() ? 0 : 1, 0, why);
        }
      }
      // The compressed row a window closing here emits, and its cache bytes.
      const bool csa = spec.attention == engine::AttentionKind::kCompressedSparse;
      const bool compressed = csa || spec.attention == engine::AttentionKind::kHeavilyCompressed;
      const int64_t m = spec.compress_rate;
      if (compressed && (pos + 1) % m == 0) {
        // The entry of the window closing here, from the recorded state rows: against the entry
        // emitted here (tap) and against the row the cache stores for it (decoded, with the
        // format's rounding) — a compressor that emits late or writes elsewhere fails the second.
        const int64_t w = (pos + 1) / m - 1;
        const Tensor* t_ce = tap("attn.compressor.entry");
        const int64_t rce = row_of(t_ce);
        const std::string stored = "kv/" + LayerTap(l, "compressed");
        g::Vec e;
        if (PoolTwin(cx, L.compressor, cx.T("kv/" + LayerTap(l, "compressor")), req, w, m, d, csa, comp_freq,
                     comp_af, &e)) {
          if (rce >= 0) Compare(cx, OpIndex("compressor"), loc("attn.compressor.entry", t_ce, rce), t_ce->F(rce), e);
          std::vector<double> kr;
          if (DecodeCacheRow(cx, stored, req, pos, d, rd, &kr)) {
            std::vector<float> kf(kr.begin(), kr.end());
            Location wl = loc("attn.compressor.entry", t_ce, rce >= 0 ? rce : 0);
            wl.tensor = stored;
            if (rce < 0) wl.step = sr.step;
            Compare(cx, OpIndex("compressor"), wl, kf.data(), WithStorageRounding(cx, stored, req, pos, e, rd), 0, -1, false);
          }
        } else {
          not_checked("compressor", "the window's kv/…compressor rows are not in the trace");
        }
        if (rce >= 0) {
          const std::string why = CacheBytesDiffer(cx, stored, req, pos, t_ce->F(rce), d, rd);
          if (why != "not recorded") {
            Location wl = loc("attn.compressor.entry", t_ce, rce);
            wl.tensor = stored;
            CompareSet(cx, OpIndex("kv_cache"), wl, why.empty() ? 0 : INFINITY, why.empty() ? 0 : 1, 0, why);
          }
        }
      }
      if (csa) {
        const int64_t Hi = c.index_n_heads, di = c.index_head_dim, K = c.index_topk;
        // The indexer's compressed key of the window closing here: against its tap and the stored row.
        if ((pos + 1) % m == 0) {
          const Tensor* t_ik = tap("attn.indexer.key");
          const int64_t rik = row_of(t_ik);
          const std::string stored = "kv/" + LayerTap(l, "indexer_k");
          g::Vec key;
          if (PoolTwin(cx, L.indexer, cx.T("kv/" + LayerTap(l, "indexer_state")), req, (pos + 1) / m - 1, m, di, true,
                       comp_freq, comp_af, &key)) {
            if (rik >= 0) Compare(cx, OpIndex("indexer_key"), loc("attn.indexer.key", t_ik, rik), t_ik->F(rik), key);
            std::vector<double> sk, step;
            if (StoredIndexKey(cx, stored, req, pos, di, &sk, &step)) {
              Location wl = loc("attn.indexer.key", t_ik, rik >= 0 ? rik : 0);
              wl.tensor = stored;
              if (rik < 0) wl.step = sr.step;
              g::Vec kr = key;
              for (int64_t i = 0; i < di; ++i) kr.e[i] += step[i];
              const std::vector<float> skf(sk.begin(), sk.end());
              Compare(cx, OpIndex("indexer_key"), wl, skf.data(), kr, 0, -1, false);
            }
          } else {
            not_checked("indexer_key", "the window's kv/…indexer_state rows are not in the trace");
          }
        }
        // The selection: the top-k of Σ_h (w_h·Hi^−½)·ReLU(q_h·K_t)·di^−½ over the stored keys.
        const Tensor* t_sel = tap("attn.indexer_topk");
        const int64_t rsel = dense ? -1 : row_of(t_sel);
        if (dense) not_checked("indexer", "indexer=dense selects nothing: attention is checked over every closed entry");
        if (rsel >= 0) {
          const int64_t T = (pos + 1) / m;
          std::vector<int32_t> rec;
          for (int64_t i = 0; i < t_sel->info->cols; ++i) {
            if (t_sel->I(rsel)[i] >= 0) rec.push_back(t_sel->I(rsel)[i]);
          }
          double ratio = 0, meas = 0, bud = 0;
          std::string detail;
          bool checked = true;
          if (T <= K) {
            bool all = static_cast<int64_t>(rec.size()) == T;
            for (int64_t t = 0; all && t < T; ++t) all = rec[t] == t;
            if (!all) ratio = INFINITY, detail = std::to_string(T) + " entries visible, all must be picked; " +
                                                 std::to_string(rec.size()) + " were";
          } else {
            g::Vec qi = g::Linear(cx.Wt(L.indexer_q_b), q_res, cx.linear);
            for (int64_t h = 0; h < Hi; ++h) g::Rope(&qi, h * di + di - rd, rd, pos, comp_freq, comp_af, g::RopeLayout::kPairsAdjacent);
            const g::Vec iw = g::Linear(cx.Wt(L.indexer_weights), hv, cx.gemm);
            const std::string keys_at = "kv/" + LayerTap(l, "indexer_k");
            std::vector<double> score(T), se(T), kt, unused;
            const double hs = 1 / std::sqrt(static_cast<double>(Hi)), ds = 1 / std::sqrt(static_cast<double>(di));
            for (int64_t t = 0; t < T && checked; ++t) {
              if (!StoredIndexKey(cx, keys_at, req, (t + 1) * m - 1, di, &kt, &unused)) {
                checked = false;
                break;
              }
              double sum = 0, mag = 0, eb = 0;
              for (int64_t h = 0; h < Hi; ++h) {
                double dot = 0, dm = 0, de = 0;
                for (int64_t i = 0; i < di; ++i) {
                  dot += qi.v[h * di + i] * kt[i];
                  dm += std::fabs(qi.v[h * di + i] * kt[i]);
                  de += qi.e[h * di + i] * std::fabs(kt[i]);
                }
                const double edot = de + g::Gamma(di) * dm;
                const double relu = std::max(dot, 0.0);
                const double term = iw.v[h] * hs * relu * ds;
                sum += term;
                mag += std::fabs(term);
                eb += hs * ds * (std::fabs(iw.v[h]) * edot + iw.e[h] * relu) + 4 * kU * std::fabs(term);
              }
              score[t] = sum;
              se[t] = eb + g::Gamma(Hi) * mag;
            }
            if (checked) {
              std::vector<int32_t> order(T);
              std::iota(order.begin(), order.end(), 0);
              std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
              const int32_t kth = order[K - 1];
              if (static_cast<int64_t>(rec.size()) != K) ratio = INFINITY, detail = std::to_string(rec.size()) + " entries picked of " + std::to_string(K);
              for (int32_t e : rec) {
                if (!std::isfinite(ratio)) break;
                if (e >= T) {
                  ratio = INFINITY, detail = "entry " + std::to_string(e) + " is not closed yet";
                  break;
                }
                if (std::find(order.begin(), order.begin() + K, e) != order.begin() + K) continue;
                const double gap = score[kth] - score[e], b = se[kth] + se[e] + 1e-30;
                if (gap / b > ratio) ratio = gap / b, meas = gap, bud = b, detail = "entry " + std::to_string(e) + " is not among the top-k by its score";
              }
            }
          }
          if (checked) {
            CompareSet(cx, OpIndex("indexer"), loc("attn.indexer_topk", t_sel, rsel), ratio, meas, bud, ratio > 1 ? detail : "");
          } else {
            not_checked("indexer", "a visible entry's kv/…indexer_k row is not in the trace");
          }
        }
      }
      // Attention over the window's recorded rows and the compressed rows it sees, with the sink.
      const Tensor* t_heads = tap("attn.heads");
      const Tensor* t_sink = tap("attn.sink_share");
      const int64_t rh = row_of(t_heads), rsk = row_of(t_sink);
      if (rh >= 0 && rq >= 0) {
        const int64_t first = std::max<int64_t>(0, pos - Wn + 1);
        std::vector<std::vector<double>> keys;
        bool have = true;
        std::vector<double> kr;
        for (int64_t t = first; t <= pos && have; ++t) {
          have &= DecodeCacheRow(cx, "kv/" + LayerTap(l, "window"), req, t, d, rd, &kr);
          keys.push_back(kr);
        }
        if (compressed && have) {
          std::vector<int64_t> picked;
          const int64_t T = (pos + 1) / m;
          if (csa && dense) {
            for (int64_t e = 0; e < T; ++e) picked.push_back(e);
          } else if (csa) {
            const Tensor* t_sel = tap("attn.indexer_topk");
            const int64_t rs = row_of(t_sel);
            have &= rs >= 0;
            for (int64_t i = 0; have && i < t_sel->info->cols; ++i) {
              const int32_t e = t_sel->I(rs)[i];
              if (e >= 0 && e < T) picked.push_back(e);
            }
          } else {
            for (int64_t e = 0; e < T; ++e) picked.push_back(e);
          }
          for (int64_t e : picked) {
            if (!have) break;
            have &= DecodeCacheRow(cx, "kv/" + LayerTap(l, "compressed"), req, (e + 1) * m - 1, d, rd, &kr);
            keys.push_back(kr);
          }
        }
        if (have) {
          const int64_t n = static_cast<int64_t>(keys.size());
          const float scale = 1.0f / std::sqrt(static_cast<float>(d));
          g::Vec heads;
          heads.v.assign(H * d, 0);
          heads.e.assign(H * d, 0);
          std::vector<double> shares(H), share_e(H);
          for (int64_t h = 0; h < H; ++h) {
            const float* q = t_q->F(rq) + h * d;
            g::Vec s;  // the n scores, then the sink
            for (const auto& key : keys) {
              double dot = 0, mag = 0;
              for (int64_t i = 0; i < d; ++i) {
                dot += q[i] * key[i];
                mag += std::fabs(q[i] * key[i]);
              }
              s.v.push_back(dot * scale);
              s.e.push_back((g::Gamma(d) * mag + kU * std::fabs(dot)) * scale);
            }
            s.v.push_back(L.sinks.ptr()[h]);
            s.e.push_back(0);
            const g::Vec p = g::Softmax(s);
            g::Vec o;
            o.v.assign(d, 0);
            o.e.assign(d, 0);
            for (int64_t i = 0; i < d; ++i) {
              double acc = 0, mag = 0, eb = 0;
              for (int64_t t = 0; t < n; ++t) {
                acc += p.v[t] * keys[t][i];
                mag += std::fabs(p.v[t] * keys[t][i]);
                eb += p.e[t] * std::fabs(keys[t][i]);
              }
              o.v[i] = acc;
              o.e[i] = eb + g::Gamma(n + 1) * mag;
            }
            g::Rope(&o, d - rd, rd, -pos, freq, af, g::RopeLayout::kPairsAdjacent);  // the inverse rotation
            Put(&heads, h * d, o);
            shares[h] = p.v[n];
            share_e[h] = p.e[n];
          }
          Compare(cx, OpIndex("attention"), loc("attn.heads", t_heads, rh), t_heads->F(rh), heads);
          if (rsk >= 0) {
            g::Vec sv;
            sv.v = shares;
            sv.e = share_e;
            Compare(cx, OpIndex("attention"), loc("attn.sink_share", t_sink, rsk), t_sink->F(rsk), sv, 0, -1, false);
          }
        } else {
          not_checked("attention", "a key's kv/ rows (or the indexer's selection) are not in the trace");
        }
      }
      // Grouped output: z_g = o_a_g(heads_g), out = o_b(z).
      const Tensor* t_out = tap("attn.out");
      const int64_t ro = row_of(t_out);
      if (ro >= 0 && rh >= 0) {
        const g::Vec hv2 = Row(t_heads->F(rh), H * d);
        const int64_t gw = H * d / G;
        g::Vec z;
        z.v.assign(G * Ro, 0);
        z.e.assign(G * Ro, 0);
        for (int64_t gi = 0; gi < G; ++gi) Put(&z, gi * Ro, g::Linear(cx.Wt(L.o_a_proj), Slice(hv2, gi * gw, gw), cx.linear, gi * Ro, Ro));
        Compare(cx, OpIndex("o_proj"), loc("attn.out", t_out, ro), t_out->F(ro), g::Linear(cx.Wt(L.o_b_proj), z, cx.linear));
      }
      const Tensor* t_mid = tap("hc.streams_mid");
      const int64_t rm = row_of(t_mid);
      if (rm >= 0 && ro >= 0 && X != nullptr) {
        Compare(cx, OpIndex("attn_hc_post"), loc("hc.streams_mid", t_mid, rm), t_mid->F(rm),
                HcPost(t_mix->F(rmix), X, t_out->F(ro), hc, D), 0, -1, false);
      }
      if (rm < 0) {
        X = nullptr;
        continue;
      }
      const float* Xm = t_mid->F(rm);
      // ---- FFN sub-block ----
      const Tensor* t_fmix = tap("ffn_hc.mix");
      const Tensor* t_fn = tap("ffn_norm");
      const int64_t rfm = row_of(t_fmix), rfn = row_of(t_fn);
      if (rfm < 0 || rfn < 0) {
        X = nullptr;
        continue;
      }
      Compare(cx, OpIndex("ffn_hc"), loc("ffn_hc.mix", t_fmix, rfm), t_fmix->F(rfm), HcMix(cx, L.ffn_hc, Xm), 0, -1, false);
      Compare(cx, OpIndex("ffn_norm"), loc("ffn_norm", t_fn, rfn), t_fn->F(rfn),
              g::RmsNorm(HcPreSum(t_fmix->F(rfm), Xm, hc, D), L.post_attn_norm.ptr(), Eps(cx)));
      const g::Vec fv = Row(t_fn->F(rfn), D);
      // Router: s_e = sqrt(softplus(router·x)); top-k of s + bias (or tid2eid's ids); weights
      // s_id / Σ s · scaling.
      const Tensor* t_ids = tap("ffn.router.topk_ids");
      const Tensor* t_w = tap("ffn.router.topk_weights");
      const int64_t rid = row_of(t_ids), rw = row_of(t_w);
      if (rid >= 0 && rw >= 0) {
        const g::Vec lg = g::Linear(cx.Wt(L.router), fv, cx.fp32);
        std::vector<double> s(E), es(E);
        for (int64_t e = 0; e < E; ++e) {
          const double x = lg.v[e];
          const double sp = x > 20 ? x : std::log1p(std::exp(x));
          s[e] = std::sqrt(sp);
          // d sqrt(softplus)/dx = σ(x) / (2·sqrt(softplus)) ≤ 1/(2 s) … bounded by 1 for s ≥ 1/2.
          es[e] = lg.e[e] * Sigmoid(x) / (2 * std::max(s[e], 1e-6)) + 8 * kU * s[e];
        }
        std::vector<int32_t> want(k);
        const bool hash = spec.ffn == engine::FfnKind::kHashMoe;
        double ratio = 0, meas = 0, bud = 0;
        std::string detail;
        if (hash) {
          if (token >= 0) {
            for (int64_t j = 0; j < k; ++j) want[j] = L.tid2eid[static_cast<size_t>(token) * k + j];
            std::sort(want.begin(), want.end());
          }
        } else {
          std::vector<double> choice(E);
          for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + L.router_bias.ptr()[e];
          std::vector<int32_t> order(E);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return choice[a] > choice[b]; });
          // A recorded id outside the twin's top-k is a defect unless within budget of the k-th.
          const int32_t* got = t_ids->I(rid);
          const double kth = choice[order[k - 1]];
          for (int64_t j = 0; j < k; ++j) {
            const int32_t e = got[j];
            if (e < 0 || e >= E) {
              ratio = INFINITY, detail = "expert id " + std::to_string(e) + " out of range";
              break;
            }
            const bool in = std::find(order.begin(), order.begin() + k, e) != order.begin() + k;
            if (!in) {
              const double gap = kth - choice[e], b = es[e] + es[order[k - 1]] + 1e-30;
              if (gap / b > ratio) ratio = gap / b, meas = gap, bud = b, detail = "expert " + std::to_string(e) + " is not among the top-k";
            }
          }
          std::copy(order.begin(), order.begin() + k, want.begin());
          std::sort(want.begin(), want.end());
        }
        if (hash && token >= 0 && !std::equal(want.begin(), want.end(), t_ids->I(rid))) {
          ratio = INFINITY, meas = 1, detail = "the hash layer's ids are not tid2eid's for token " + std::to_string(token);
        }
        CompareSet(cx, OpIndex("router"), loc("ffn.router.topk_ids", t_ids, rid), ratio, meas, bud, ratio > 1 ? detail : "");
        // Weights of the recorded ids.
        const int32_t* got = t_ids->I(rid);
        double sum = 0, sum_e = 0;
        for (int64_t j = 0; j < k; ++j) {
          if (got[j] >= 0 && got[j] < E) sum += s[got[j]], sum_e += es[got[j]];
        }
        g::Vec wv;
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = got[j] >= 0 && got[j] < E ? got[j] : 0;
          const double w = s[e] / (sum + 1e-20) * cx.file.routed_scaling_factor.value_or(c.routed_scaling_factor);
          wv.v.push_back(w);
          wv.e.push_back(std::fabs(w) * (es[e] / std::max(s[e], 1e-30) + sum_e / std::max(sum, 1e-30) + g::Gamma(k + 3)));
        }
        Compare(cx, OpIndex("router"), loc("ffn.router.topk_weights", t_w, rw), t_w->F(rw), wv, 0, -1, false);
      }
      // Experts on the recorded choice, plus the shared expert.
      const Tensor* t_fo = tap("ffn.out");
      const int64_t rfo = row_of(t_fo);
      if (rfo >= 0 && rid >= 0 && rw >= 0) {
        g::Vec y;
        y.v.assign(D, 0);
        y.e.assign(D, 0);
        std::vector<double> mag(D, 0);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = t_ids->I(rid)[j];
          if (e < 0 || e >= E) continue;
          const double w = t_w->F(rw)[j];
          const g::Vec o = Expert(cx, L.experts[e], fv, v.swiglu_limit);
          for (int64_t i = 0; i < D; ++i) {
            y.v[i] += w * o.v[i];
            y.e[i] += std::fabs(w) * o.e[i];
            mag[i] += std::fabs(w * o.v[i]);
          }
        }
        if (c.n_shared_experts > 0) {
          const g::Vec o = Expert(cx, L.shared, fv, v.swiglu_limit);
          for (int64_t i = 0; i < D; ++i) {
            y.v[i] += o.v[i];
            y.e[i] += o.e[i];
            mag[i] += std::fabs(o.v[i]);
          }
        }
        for (int64_t i = 0; i < D; ++i) y.e[i] += g::Gamma(k + 2) * mag[i];
        Compare(cx, OpIndex("experts"), loc("ffn.out", t_fo, rfo), t_fo->F(rfo), y);
      }
      const Tensor* t_st = tap("hc.streams");
      const int64_t rst = row_of(t_st);
      if (rst >= 0 && rfo >= 0) {
        Compare(cx, OpIndex("ffn_hc_post"), loc("hc.streams", t_st, rst), t_st->F(rst),
                HcPost(t_fmix->F(rfm), Xm, t_fo->F(rfo), hc, D), 0, -1, false);
      }
      X = rst >= 0 ? t_st->F(rst) : nullptr;
    }
    // hc_head, the final norm, the LM head.
    const Tensor* t_fin = cx.T("final_norm");
    const int64_t rfin = t_fin ? t_fin->Row(req, pos) : -1;
    if (rfin >= 0 && X != nullptr) {
      const g::Vec f = RmsScale(Row(X, hc * D), Eps(cx));
      const g::Vec m = g::Linear(cx.Wt(W4.head.fn), f, cx.fp32);
      std::vector<float> pre(hc);
      std::vector<double> pre_e(hc);
      for (int64_t j = 0; j < hc; ++j) {
        const double p = Sigmoid(m.v[j] * W4.head.scale.ptr()[0] + W4.head.base.ptr()[j]) + v.hc_eps;
        pre[j] = static_cast<float>(p);
        pre_e[j] = 0.25 * std::fabs(W4.head.scale.ptr()[0]) * m.e[j] + 8 * kU * p;
      }
      g::Vec h = HcPreSum(pre.data(), X, hc, D);
      for (int64_t i = 0; i < D; ++i) {
        for (int64_t j = 0; j < hc; ++j) h.e[i] += pre_e[j] * std::fabs(X[j * D + i]) + kU * std::fabs(pre[j] * X[j * D + i]);
      }
      Location w{req, -1, pos, t_fin->rows[rfin].step, "final_norm"};
      w.prefill = pos < plen;
      Compare(cx, OpIndex("final_norm"), w, t_fin->F(rfin), g::RmsNorm(h, cx.W->final_norm.ptr(), Eps(cx)));
    }
    if (rfin >= 0) CheckLmHead(cx, req, pos, plen, t_fin, rfin);
    ++done;
    if (opt.progress) opt.progress(done, total);
  }
}

}  // namespace lockstep::verify::internal
