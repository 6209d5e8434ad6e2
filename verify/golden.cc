// verify/golden.cc — see golden.h. Written from the math (the DeepSeek papers, transformers'
// modelling code as the definition of each op, docs/sampling.md, docs/kv-cache.md); shares no
// code with kernels/.
#include "verify/golden.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

namespace lockstep::verify::golden {

double Gamma(int64_t n, double u) {
  const double nu = static_cast<double>(std::max<int64_t>(n, 1)) * u;
  return nu < 0.5 ? nu / (1 - nu) : 1.0;
}

Vec Exact(const float* x, int64_t n) {
  Vec r;
  r.v.assign(x, x + n);
  r.e.assign(n, 0.0);
  return r;
}

Vec Linear(WeightRef w, const Vec& x, const Precision& p, int64_t r0, int64_t n) {
  if (n < 0) n = w.rows - r0;
  const int64_t k = w.cols;
  // fp32 sum of k products of inputs each rounded by in_x / in_w: |err| ≤ (γ_k + in_x + in_w +
  // in_x·in_w)·(1 + …)·Σ|x||w|; the second-order terms are folded into a factor 1.01.
  const double rel = 1.01 * (Gamma(k + 1, p.acc) + p.in_x + p.in_w + p.in_x * p.in_w);
  Vec y;
  y.v.resize(n);
  y.e.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = w.w + (r0 + i) * k;
    double s = 0, m = 0, prop = 0;
    for (int64_t j = 0; j < k; ++j) {
      const double wj = row[j];
      s += wj * x.v[j];
      m += std::fabs(wj * x.v[j]);
      prop += std::fabs(wj) * x.e[j];
    }
    y.v[i] = s;
    y.e[i] = prop * (1 + p.in_w) + rel * m + kFp32U * std::fabs(s);
  }
  return y;
}

Vec RmsNorm(const Vec& x, const float* w, double eps) {
  const int64_t n = x.size();
  double ss = 0, se = 0;
  for (int64_t i = 0; i < n; ++i) {
    ss += x.v[i] * x.v[i];
    se += 2 * std::fabs(x.v[i]) * x.e[i] + x.e[i] * x.e[i];
  }
  const double ms = ss / n + eps;
  const double r = 1 / std::sqrt(ms);
  // Relative error of r: half that of mean(x²) + eps (its inputs' errors, an fp32 sum of n
  // squares), plus an fp32 rsqrt / division and the eps add (4u).
  const double rel_r = 0.5 * (se / n + Gamma(n + 1) * ss / n) / ms + 4 * kFp32U;
  Vec y;
  y.v.resize(n);
  y.e.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    y.v[i] = x.v[i] * r * w[i];
    y.e[i] = std::fabs(w[i]) * r * (x.e[i] + std::fabs(x.v[i]) * rel_r) + 3 * kFp32U * std::fabs(y.v[i]);
  }
  return y;
}

Vec LayerNorm(const Vec& x, const float* w, const float* b, double eps) {
  const int64_t n = x.size();
  double mean = 0, me = 0, mabs = 0;
  for (int64_t i = 0; i < n; ++i) {
    mean += x.v[i];
    me += x.e[i];
    mabs += std::fabs(x.v[i]);
  }
  mean /= n;
  me = me / n + Gamma(n + 1) * mabs / n;
  double var = 0, ve = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = x.v[i] - mean;
    var += d * d;
    ve += 2 * std::fabs(d) * (x.e[i] + me) + (x.e[i] + me) * (x.e[i] + me);
  }
  var /= n;
  const double vv = var + eps;
  const double r = 1 / std::sqrt(vv);
  const double rel_r = 0.5 * (ve / n + Gamma(2 * n + 2) * var) / vv + 4 * kFp32U;
  Vec y;
  y.v.resize(n);
  y.e.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const double d = x.v[i] - mean;
    const double t = d * r * w[i];
    y.v[i] = t + b[i];
    y.e[i] = std::fabs(w[i]) * r * (x.e[i] + me + std::fabs(d) * rel_r) + 3 * kFp32U * (std::fabs(t) + std::fabs(y.v[i]));
  }
  return y;
}

Vec SwiGlu(const Vec& g, const Vec& u) {
  Vec y;
  const int64_t n = g.size();
  y.v.resize(n);
  y.e.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const double x = g.v[i];
    const double sig = 1 / (1 + std::exp(-x));
    const double silu = x * sig;
    // d silu / dx = σ(x)(1 + x(1 − σ(x))), |·| ≤ 1.1; an fp32 exp (a few ulps: 8u) and three roundings.
    const double ds = std::fabs(sig * (1 + x * (1 - sig)));
    const double e_silu = ds * g.e[i] + 12 * kFp32U * std::fabs(silu) + std::fabs(x) * 8 * kFp32U * sig * (1 - sig);
    y.v[i] = silu * u.v[i];
    y.e[i] = e_silu * std::fabs(u.v[i]) + std::fabs(silu) * u.e[i] + e_silu * u.e[i] + kFp32U * std::fabs(y.v[i]);
  }
  return y;
}

Vec Add(const Vec& a, const Vec& b) {
  Vec y;
  const int64_t n = a.size();
  y.v.resize(n);
  y.e.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    y.v[i] = a.v[i] + b.v[i];
    y.e[i] = a.e[i] + b.e[i] + 1.01 * kFp32U * std::fabs(y.v[i]);
  }
  return y;
}

double YarnMscale(double factor, double mscale) { return factor > 1 ? 0.1 * mscale * std::log(factor) + 1 : 1.0; }

double MlaSoftmaxScale(int64_t qk_nope, int64_t qk_rope, bool yarn, double factor, double mscale_all_dim) {
  const double base = 1 / std::sqrt(static_cast<double>(qk_nope + qk_rope));
  if (!yarn || mscale_all_dim == 0) return base;
  const double m = YarnMscale(factor, mscale_all_dim);
  return base * m * m;
}

double RopeAttentionFactor(bool yarn, double factor, double mscale, double mscale_all_dim, double file_factor) {
  if (!yarn) return 1.0;
  if (file_factor != 0) return file_factor;
  if (mscale != 0 && mscale_all_dim != 0) return YarnMscale(factor, mscale) / YarnMscale(factor, mscale_all_dim);
  return YarnMscale(factor, 1.0);
}

std::vector<double> RopeInvFreq(const RopeSpec& s, int64_t dim) {
  const int64_t half = dim / 2;
  std::vector<double> f(half);
  for (int64_t i = 0; i < half; ++i) f[i] = std::pow(s.theta, -2.0 * i / dim);
  if (!s.yarn) return f;
  // YaRN (Peng et al. 2023): the dims that rotate fewer than beta_slow times over the original
  // context are interpolated (f / factor), those rotating more than beta_fast times are kept,
  // and a linear ramp over the dim index blends the two in between.
  auto dim_of = [&](double rotations) {
    return dim * std::log(s.original_max_pos / (rotations * 2 * M_PI)) / (2 * std::log(s.theta));
  };
  double lo = dim_of(s.beta_fast), hi = dim_of(s.beta_slow);
  if (s.truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  lo = std::max(lo, 0.0);
  hi = std::min(hi, static_cast<double>(dim - 1));
  if (lo == hi) hi += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
    const double keep = 1 - ramp;  // weight of the extrapolated (original) frequency
    f[i] = f[i] / s.factor * ramp + f[i] * keep;
  }
  return f;
}

void Rope(Vec* x, int64_t off, int64_t dim, int64_t pos, std::span<const double> inv_freq, double af,
          RopeLayout layout) {
  const int64_t half = dim / 2;
  std::vector<double> v(x->v.begin() + off, x->v.begin() + off + dim), e(x->e.begin() + off, x->e.begin() + off + dim);
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = layout == RopeLayout::kHalves ? i : 2 * i;
    const int64_t ib = layout == RopeLayout::kHalves ? i + half : 2 * i + 1;
    const int64_t oa = layout == RopeLayout::kPairsAdjacent ? 2 * i : i;
    const int64_t ob = layout == RopeLayout::kPairsAdjacent ? 2 * i + 1 : i + half;
    const double ang = inv_freq[i] * static_cast<double>(pos);
    const double c = std::cos(ang) * af, s = std::sin(ang) * af;
    const double a = v[ia], b = v[ib];
    // The angle in fp32 (its frequency computed in fp32, times pos, rounded: 5u relative), fp32
    // cos/sin (2u absolute) and the attention factor's product: each of |a|, |b| moves by at most
    // that much; the rotation itself adds two fp32 products and a sum.
    const double de = (std::fabs(ang) * 5 * kFp32U + 2 * kFp32U) * std::fabs(af) + 2 * kFp32U * std::fabs(af);
    const double mag = std::fabs(a) + std::fabs(b);
    const double ea = std::fabs(af) * (e[ia] + e[ib]) + de * mag;
    x->v[off + oa] = a * c - b * s;
    x->v[off + ob] = b * c + a * s;
    x->e[off + oa] = ea + 2 * kFp32U * (std::fabs(a * c) + std::fabs(b * s));
    x->e[off + ob] = ea + 2 * kFp32U * (std::fabs(b * c) + std::fabs(a * s));
  }
}

Vec Softmax(const Vec& s) {
  const int64_t n = s.size();
  Vec p;
  p.v.resize(n);
  p.e.resize(n);
  double mx = -INFINITY;
  for (double v : s.v) mx = std::max(mx, v);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    p.v[i] = std::exp(s.v[i] - mx);
    sum += p.v[i];
  }
  double mean_e = 0;
  for (int64_t i = 0; i < n; ++i) {
    p.v[i] /= sum;
    mean_e += p.v[i] * s.e[i];
  }
  // p_i = exp(s_i)/Σ exp(s_j): δp_i ≈ p_i(δs_i − Σ p_j δs_j); an fp32 exp (8u), an fp32 or
  // online sum of n terms (γ_n) and the division.
  const double r = 8 * kFp32U + Gamma(n + 2);
  for (int64_t i = 0; i < n; ++i) p.e[i] = p.v[i] * (s.e[i] + mean_e + r);
  return p;
}

namespace {

struct Scores {
  std::vector<double> s, es;  // per expert
};

Scores GateScores(const RouteSpec& sp, const Vec& lg) {
  Scores r;
  const int64_t E = sp.experts;
  r.s.resize(E);
  r.es.resize(E);
  if (sp.gate == Gate::kSigmoidNoauxTc) {
    for (int64_t e = 0; e < E; ++e) {
      const double s = 1 / (1 + std::exp(-lg.v[e]));
      r.s[e] = s;
      r.es[e] = s * (1 - s) * lg.e[e] + 8 * kFp32U * s;
    }
  } else {
    const Vec p = Softmax(lg);
    r.s = p.v;
    r.es = p.e;
  }
  return r;
}

}  // namespace

Route RouteToken(const RouteSpec& sp, const Vec& lg, const float* bias) {
  const int64_t E = sp.experts;
  const Scores sc = GateScores(sp, lg);
  Route r;
  r.choice.resize(E);
  r.choice_budget.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    const bool biased = sp.gate == Gate::kSigmoidNoauxTc && bias != nullptr;
    r.choice[e] = sc.s[e] + (biased ? bias[e] : 0.0);
    r.choice_budget[e] = sc.es[e] + kFp32U * std::fabs(r.choice[e]);
  }
  r.allowed.assign(E, true);
  if (sp.gate != Gate::kSoftmaxGreedy && sp.groups > 1) {
    // A group's score: the sum of its two best choices (noaux_tc) or its best (V2's group-limited).
    const int64_t G = sp.groups, per = E / G;
    std::vector<std::pair<double, int64_t>> gs(G);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> m(r.choice.begin() + g * per, r.choice.begin() + (g + 1) * per);
      std::sort(m.begin(), m.end(), std::greater<>());
      gs[g] = {sp.gate == Gate::kSigmoidNoauxTc ? m[0] + (per > 1 ? m[1] : 0.0) : m[0], g};
    }
    std::stable_sort(gs.begin(), gs.end(), [](auto& a, auto& b) { return a.first > b.first; });
    std::vector<bool> keep(G, false);
    for (int64_t i = 0; i < sp.top_groups && i < G; ++i) keep[gs[i].second] = true;
    for (int64_t e = 0; e < E; ++e) r.allowed[e] = keep[e / per];
  }
  std::vector<int32_t> order;
  for (int64_t e = 0; e < E; ++e) {
    if (r.allowed[e]) order.push_back(static_cast<int32_t>(e));
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return r.choice[a] > r.choice[b]; });
  order.resize(std::min<size_t>(order.size(), static_cast<size_t>(sp.top_k)));
  std::sort(order.begin(), order.end());
  r.ids = order;
  RouteWeights(sp, lg, r.ids, &r.weights, &r.weight_budget);
  return r;
}

void RouteWeights(const RouteSpec& sp, const Vec& lg, std::span<const int32_t> ids, std::vector<double>* w,
                  std::vector<double>* budget) {
  const Scores sc = GateScores(sp, lg);
  const int64_t k = static_cast<int64_t>(ids.size());
  w->assign(k, 0);
  budget->assign(k, 0);
  double sum = 0, esum = 0;
  for (int32_t id : ids) {
    sum += sc.s[id];
    esum += sc.es[id];
  }
  for (int64_t i = 0; i < k; ++i) {
    const double s = sc.s[ids[i]], es = sc.es[ids[i]];
    if (sp.normalise) {
      const double d = sum + 1e-20;
      (*w)[i] = s / d * sp.scaling;
      (*budget)[i] = (es / d + s * esum / (d * d) + 4 * kFp32U * s / d) * std::fabs(sp.scaling);
    } else {
      (*w)[i] = s * sp.scaling;
      (*budget)[i] = (es + 2 * kFp32U * s) * std::fabs(sp.scaling);
    }
  }
}

uint16_t Bf16Bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN, sign kept
  // Round to nearest, ties to even, on the upper 16 bits.
  const uint32_t lsb = (u >> 16) & 1;
  return static_cast<uint16_t>((u + 0x7fff + lsb) >> 16);
}

float Bf16Value(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

double E4m3Value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 0xf, m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

uint8_t E4m3Bits(double x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  if (a >= 448) return sign | 0x7e;  // saturate at the largest finite value
  // The nearest of the 127 non-negative finite codes, ties to the even code (its last bit 0).
  uint8_t best = 0;
  double bd = INFINITY;
  for (int c = 0; c < 0x7f; ++c) {
    const double d = std::fabs(E4m3Value(static_cast<uint8_t>(c)) - a);
    if (d < bd || (d == bd && (c & 1) == 0)) {
      bd = d;
      best = static_cast<uint8_t>(c);
    }
  }
  return sign | best;
}

float Fp8Scale(const float* x, int64_t n) {
  double amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
  if (amax == 0) return 1.0f;
  int ex = 0;
  const double m = std::frexp(amax / 448.0, &ex);  // amax/448 = m·2^ex, m in [0.5, 1)
  return static_cast<float>(std::ldexp(1.0, m == 0.5 ? ex - 1 : ex));
}

double PhiloxUniform(uint64_t seed, uint64_t counter, uint32_t stream) {
  uint32_t c[4] = {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), stream, 0};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53u} * c[0];
    const uint64_t p1 = uint64_t{0xCD9E8D57u} * c[2];
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = static_cast<uint32_t>(p1);
    c[2] = n2;
    c[3] = static_cast<uint32_t>(p0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  const uint64_t bits = ((static_cast<uint64_t>(c[0]) << 21) | (c[1] >> 11)) & ((uint64_t{1} << 53) - 1);
  return std::ldexp(static_cast<double>(bits), -53);
}

Draw Sample(std::span<const float> logits, double T, int64_t top_k, double top_p, double min_p, uint64_t seed,
            uint64_t counter) {
  Draw d;
  const int64_t n = static_cast<int64_t>(logits.size());
  if (n == 0) return d;
  auto val = [&](int64_t i) { return std::isnan(logits[i]) ? -INFINITY : static_cast<double>(logits[i]); };
  if (T <= 0) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i) {
      if (val(i) > val(best)) best = i;
    }
    d.token = static_cast<int32_t>(best);
    d.candidates = 1;
    return d;
  }
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return val(a) > val(b); });
  const int64_t k = top_k > 0 && top_k < n ? top_k : n;
  std::vector<double> w(k);
  const double lmax = val(ids[0]);
  double total = 0;
  for (int64_t i = 0; i < k; ++i) {
    w[i] = std::exp((val(ids[i]) - lmax) / T);
    total += w[i];
  }
  int64_t keep = k;
  if (top_p < 1) {
    double cum = 0;
    for (int64_t i = 0; i < k; ++i) {
      cum += w[i];
      if (cum >= top_p * total) {
        keep = i + 1;
        break;
      }
    }
  }
  if (min_p > 0) {
    int64_t m = 1;
    while (m < keep && w[m] >= min_p) ++m;
    keep = m;
  }
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += w[i];
  d.uniform = PhiloxUniform(seed, counter, 0);
  const double target = d.uniform * kept;
  double cum = 0;
  int64_t chosen = keep - 1;
  for (int64_t i = 0; i < keep; ++i) {
    cum += w[i];
    if (cum > target) {
      chosen = i;
      break;
    }
  }
  d.token = ids[chosen];
  d.candidates = keep;
  return d;
}

double LseRelMargin(double lse) { return 1e-7 + std::fabs(lse) * 0x1p-21; }

TopKDraw SampleFromTopK(std::span<const int32_t> ids, std::span<const float> values, int64_t vocab, double lse,
                        double T, int64_t top_k, double top_p, double min_p, uint64_t seed, uint64_t counter,
                        double lse_t) {
  TopKDraw d;
  const int64_t K = static_cast<int64_t>(std::min(ids.size(), values.size()));
  if (K == 0 || vocab <= 0) {
    d.why = "no recorded logits";
    return d;
  }
  auto val = [&](int64_t j) { return std::isnan(values[j]) ? -INFINITY : static_cast<double>(values[j]); };
  std::vector<int64_t> ord(K);
  std::iota(ord.begin(), ord.end(), 0);
  std::stable_sort(ord.begin(), ord.end(), [&](int64_t a, int64_t b) {
    return val(a) != val(b) ? val(a) > val(b) : ids[a] < ids[b];
  });
  if (T <= 0) {  // greedy: the highest recorded logit, lowest id on ties; all NaN: id 0
    d.outcome = TopKDraw::kToken;
    d.token = val(ord[0]) == -INFINITY ? 0 : ids[ord[0]];  // every logit −∞ or NaN: the full draw's id 0
    return d;
  }
  const double lmax = val(ord[0]);
  if (!std::isfinite(lmax)) {
    d.why = "no finite recorded logit";
    return d;
  }
  // Step 3's kept set has n tokens; `known` of them are recorded, in the sampler's order.
  const int64_t n = top_k > 0 && top_k < vocab ? top_k : vocab, known = std::min(K, n);
  std::vector<double> w(known), c(known);
  for (int64_t i = 0; i < known; ++i) {
    w[i] = std::exp((val(ord[i]) - lmax) / T);
    c[i] = (i > 0 ? c[i - 1] : 0.0) + w[i];
  }
  // The unrecorded m = n − known weights: each in [0, w_K], so their sum in [0, m·w_K]. With
  // the row's logsumexp, their sum at temperature 1 is R = e^(lse − lmax) − Σ_known e^(l − lmax)
  // (all of it when n = V, else a bound), and with x_K = e^(l_K − lmax), p = 1/T, a sum of
  // x_i^p over terms in [0, x_K] adding up to R lies between R^p·m^(1−p) (spread evenly) and
  // R·x_K^(p−1) (packed at x_K): the lower of the two for p > 1, the upper for p < 1.
  const double last = c[known - 1];
  const double m = static_cast<double>(n - known);
  double tail_lo = 0, tail_hi = m * w[known - 1];
  if (m > 0 && std::isfinite(lse)) {
    double c1 = 0;
    for (int64_t i = 0; i < known; ++i) c1 += std::exp(val(ord[i]) - lmax);
    const double t = std::exp(lse - lmax), rel = LseRelMargin(lse);
    const double r_lo = n == vocab ? std::max(0.0, t * (1 - rel) - c1) : 0.0, r_hi = std::max(0.0, t * (1 + rel) - c1);
    const double p = 1 / T, xk = std::exp(val(ord[known - 1]) - lmax);
    double lo = r_lo, hi = r_hi;
    if (p > 1) {
      lo = std::pow(r_lo, p) * std::pow(m, 1 - p), hi = r_hi * std::pow(xk, p - 1);
    } else if (p < 1) {
      lo = r_lo * std::pow(xk, p - 1), hi = std::pow(r_hi, p) * std::pow(m, 1 - p);
    }
    // Slack for the bounds' own rounding; an inconsistent logsumexp (outside [0, m·w_K], or
    // less than the recorded logits' own mass: a damaged row) is not used.
    lo *= 1 - 1e-9, hi *= 1 + 1e-9;
    const bool consistent = t * (1 + rel) * (1 + 1e-9) >= c1;
    if (consistent && lo <= tail_hi && std::isfinite(hi)) tail_lo = std::max(tail_lo, lo), tail_hi = std::min(tail_hi, hi);
  }
  // At the sampling temperature itself: Σ_all e^((l − lmax)/T) = e^(lse_t − lmax/T), so the
  // unrecorded weights add up to that less the recorded ones (exactly when the kept set is the
  // whole vocabulary, at most that otherwise), to within lse_t's float rounding.
  if (m > 0 && std::isfinite(lse_t)) {
    const double t = std::exp(lse_t - lmax / T), rel = LseRelMargin(lse_t);
    double lo = n == vocab ? std::max(0.0, t * (1 - rel) - last) : 0.0, hi = std::max(0.0, t * (1 + rel) - last);
    lo *= 1 - 1e-9, hi *= 1 + 1e-9;
    // Used only where consistent: at least the recorded weights' own mass, a finite total, and
    // overlapping what the top-k and the other logsumexp allow.
    const bool consistent = t * (1 + rel) * (1 + 1e-9) >= last && std::isfinite(hi);
    if (consistent && lo <= tail_hi && hi >= tail_lo) tail_lo = std::max(tail_lo, lo), tail_hi = std::min(tail_hi, hi);
  }
  const double tot_lo = last + tail_lo, tot_hi = last + tail_hi;
  auto first_at_least = [&](double x) -> int64_t {  // first i with c_i ≥ x; known when none
    for (int64_t i = 0; i < known; ++i) {
      if (c[i] >= x) return i;
    }
    return known;
  };
  // keep: the kept count when decided (≤ known), or -1 when it lies past the recorded tokens.
  int64_t keep = n <= known ? n : -1;
  if (top_p < 1) {
    const int64_t a = first_at_least(top_p * tot_lo), b = first_at_least(top_p * tot_hi);
    if (a == b && b < known) {
      keep = b + 1;
    } else if (a == known) {
      keep = -1;
    } else {
      d.why = "top-p's cut falls where the unrecorded logits decide it";
      return d;
    }
  }
  if (min_p > 0) {
    const int64_t lim = keep > 0 ? keep : known;
    int64_t m = 1;
    while (m < lim && w[m] >= min_p) ++m;
    if (m < lim || keep > 0) keep = m;  // a cut among the recorded tokens (or the decided one)
  }
  d.uniform = PhiloxUniform(seed, counter, 0);
  if (keep > 0) {
    const double target = d.uniform * c[keep - 1];
    int64_t chosen = keep - 1;
    for (int64_t i = 0; i < keep; ++i) {
      if (c[i] > target) {
        chosen = i;
        break;
      }
    }
    d.outcome = TopKDraw::kToken;
    d.token = ids[ord[chosen]];
    return d;
  }
  // The kept mass lies in [s_lo, s_hi]: at least the recorded prefix (and top-p's share of the
  // total), at most the total.
  double s_lo = last, s_hi = tot_hi;
  if (min_p <= 0) s_lo = std::max(last, top_p < 1 ? top_p * tot_lo : tot_lo);
  // Top-p's cut past the recorded tokens stops at the first prefix reaching top_p of the total,
  // so the kept mass is below that share plus the last kept weight (an unrecorded one: ≤ w_K).
  if (min_p <= 0 && top_p < 1) s_hi = std::min(s_hi, top_p * tot_hi + w[known - 1]);
  const double t_lo = d.uniform * s_lo, t_hi = d.uniform * s_hi;
  auto first_above = [&](double x) -> int64_t {
    for (int64_t i = 0; i < known; ++i) {
      if (c[i] > x) return i;
    }
    return known;
  };
  const int64_t i_lo = first_above(t_lo), i_hi = first_above(t_hi);
  if (i_lo == known) {
    d.outcome = TopKDraw::kOutsideTopK;
  } else if (i_lo == i_hi) {
    d.outcome = TopKDraw::kToken;
    d.token = ids[ord[i_lo]];
  } else {
    d.why = "the draw falls where the unrecorded logits decide it";
  }
  return d;
}

}  // namespace lockstep::verify::golden
