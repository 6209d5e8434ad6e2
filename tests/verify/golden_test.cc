// Golden twins (verify/golden.h) against hand-computed cases, published known answers (Philox's
// Random123 vector), and — for the sampler — against the engine's sampler on seeded inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <limits>
#include <numeric>
#include <cmath>
#include <random>

#include "engine/config.h"
#include "engine/sampler.h"
#include "../test_util.h"
#include "verify/file_config.h"
#include "verify/golden.h"

namespace lockstep::verify::golden {
namespace {

TEST(GoldenTest, RmsNormByHand) {
  const float x[2] = {3, 4}, w[2] = {1, 2};
  const Vec y = RmsNorm(Exact(x, 2), w, 0.0);
  // mean(x²) = 12.5, 1/√12.5 = 0.28284271…
  EXPECT_NEAR(y.v[0], 3 * 0.282842712474619, 1e-15);
  EXPECT_NEAR(y.v[1], 8 * 0.282842712474619, 1e-15);
  // The budget: a few fp32 roundings of the output, not more than 1e-6 relative here.
  EXPECT_GT(y.e[0], 0);
  EXPECT_LT(y.e[1], 1e-6 * y.v[1]);
}

TEST(GoldenTest, LinearValueAndBudget) {
  const float W[4] = {1, 2, 3, -4};
  const float x[2] = {1, 1};
  const Vec y = Linear({W, 2, 2}, Exact(x, 2), {});
  EXPECT_EQ(y.v[0], 3);
  EXPECT_EQ(y.v[1], -1);
  // Row 1: Σ|x w| = 7, so the fp32 bound is ≈ γ_3·7 + u·1.
  EXPECT_NEAR(y.e[1], 1.01 * Gamma(3) * 7 + kFp32U, 1e-12);
  // bf16 inputs add their rounding: 2^-8 each for x and w.
  const Vec yb = Linear({W, 2, 2}, Exact(x, 2), {kFp32U, kBf16U, kBf16U});
  EXPECT_GT(yb.e[1], 2 * kBf16U * 7);
}

TEST(GoldenTest, RopeLayoutsByHand) {
  const std::vector<double> f = {1.0, 0.5};
  // Halves: (x0, x2) and (x1, x3) rotate by pos·f.
  Vec h = Exact(std::vector<float>{1, 0, 0, 1}.data(), 4);
  Rope(&h, 0, 4, 2, f, 1.0, RopeLayout::kHalves);
  EXPECT_NEAR(h.v[0], std::cos(2.0), 1e-15);
  EXPECT_NEAR(h.v[2], std::sin(2.0), 1e-15);
  EXPECT_NEAR(h.v[1], -std::sin(1.0), 1e-15);
  EXPECT_NEAR(h.v[3], std::cos(1.0), 1e-15);
  // Pairs to halves: pairs (x0, x1), (x2, x3) rotate, output [a0', a1', b0', b1'].
  Vec p = Exact(std::vector<float>{1, 0, 0, 1}.data(), 4);
  Rope(&p, 0, 4, 2, f, 1.0, RopeLayout::kPairsToHalves);
  EXPECT_NEAR(p.v[0], std::cos(2.0), 1e-15);
  EXPECT_NEAR(p.v[2], std::sin(2.0), 1e-15);
  EXPECT_NEAR(p.v[1], -std::sin(1.0), 1e-15);
  EXPECT_NEAR(p.v[3], std::cos(1.0), 1e-15);
  // Adjacent pairs in place.
  Vec a = Exact(std::vector<float>{1, 0, 0, 1}.data(), 4);
  Rope(&a, 0, 4, 2, f, 1.0, RopeLayout::kPairsAdjacent);
  EXPECT_NEAR(a.v[1], std::sin(2.0), 1e-15);
  EXPECT_NEAR(a.v[2], -std::sin(1.0), 1e-15);
  // The angle's fp32 rounding grows with the position.
  EXPECT_GT(a.e[0], 0);
}

TEST(GoldenTest, RopeFrequenciesWithYarnByHand) {
  RopeSpec s;
  s.theta = 10000;
  const auto plain = RopeInvFreq(s, 4);
  EXPECT_DOUBLE_EQ(plain[0], 1.0);
  EXPECT_NEAR(plain[1], 0.01, 1e-15);
  // dim 4, original context 4096, β 32/1: the correction dims are 4·ln(4096/(β·2π))/(2 ln 10⁴)
  // = 0.654 → floor 0 and 1.407 → ceil 2; dim pair 1 sits halfway up the ramp: f/4·½ + f·½.
  s.yarn = true;
  s.factor = 4;
  s.original_max_pos = 4096;
  const auto y = RopeInvFreq(s, 4);
  EXPECT_DOUBLE_EQ(y[0], 1.0);
  EXPECT_NEAR(y[1], 0.01 / 4 * 0.5 + 0.01 * 0.5, 1e-15);
}

TEST(GoldenTest, SoftmaxByHand) {
  Vec s;
  s.v = {0, std::log(3.0)};
  s.e = {0, 0};
  const Vec p = Softmax(s);
  EXPECT_NEAR(p.v[0], 0.25, 1e-15);
  EXPECT_NEAR(p.v[1], 0.75, 1e-15);
}

TEST(GoldenTest, NoauxTcRoutingByHand) {
  RouteSpec sp;
  sp.experts = 4;
  sp.top_k = 2;
  sp.groups = 2;
  sp.top_groups = 1;
  sp.scaling = 2.5;
  Vec lg;
  lg.v = {0, 2, 1, -1};
  lg.e = {0, 0, 0, 0};
  const double s0 = 0.5, s1 = 1 / (1 + std::exp(-2.0)), s2 = 1 / (1 + std::exp(-1.0)), s3 = 1 / (1 + std::exp(1.0));
  // Groups {0, 1} (top-2 sum 1.38) and {2, 3} (1.0): group 0 wins.
  Route r = RouteToken(sp, lg, nullptr);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights[0], s0 / (s0 + s1) * 2.5, 1e-12);
  EXPECT_NEAR(r.weights[1], s1 / (s0 + s1) * 2.5, 1e-12);
  // A correction bias of 1 on group 1 moves the choice there; the weights stay the scores.
  const float bias[4] = {0, 0, 1, 1};
  r = RouteToken(sp, lg, bias);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(r.weights[0], s2 / (s2 + s3) * 2.5, 1e-12);
}

TEST(GoldenTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(Bf16Bits(1.0f), 0x3f80);
  EXPECT_EQ(Bf16Bits(1.0f + 0x1p-8f), 0x3f80);       // tie → even
  EXPECT_EQ(Bf16Bits(1.0f + 3 * 0x1p-8f), 0x3f82);   // tie → even (up)
  EXPECT_EQ(Bf16Bits(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_EQ(Bf16Bits(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(Bf16Value(Bf16Bits(NAN))));
}

TEST(GoldenTest, E4m3ByHand) {
  EXPECT_EQ(E4m3Bits(1.0), 0x38);
  EXPECT_EQ(E4m3Bits(448.0), 0x7e);
  EXPECT_EQ(E4m3Bits(500.0), 0x7e);  // saturates
  EXPECT_EQ(E4m3Bits(-448.0), 0xfe);
  EXPECT_EQ(E4m3Bits(0x1p-9), 0x01);  // the least subnormal
  EXPECT_EQ(E4m3Bits(1.0625), 0x38);  // tie between 1 and 1.125 → even
  EXPECT_EQ(E4m3Bits(1.1875), 0x3a);  // tie between 1.125 and 1.25 → even
  EXPECT_DOUBLE_EQ(E4m3Value(0x7e), 448.0);
  EXPECT_TRUE(std::isnan(E4m3Value(0x7f)));
  const float a[2] = {448, 1}, b[2] = {449, 0}, c[2] = {0, 0}, d[1] = {224};
  EXPECT_EQ(Fp8Scale(a, 2), 1.0f);
  EXPECT_EQ(Fp8Scale(b, 2), 2.0f);
  EXPECT_EQ(Fp8Scale(c, 2), 1.0f);
  EXPECT_EQ(Fp8Scale(d, 1), 0.5f);
}

TEST(GoldenTest, PhiloxKnownAnswer) {
  // Random123's kat_vectors: philox4x32-10, counter 0, key 0 → 6627e8d5 e169c58d bc57ac4c 9b00dbd8;
  // the uniform takes 32 bits of the first word and 21 of the second.
  const uint64_t bits = ((uint64_t{0x6627e8d5} << 21) | (0xe169c58du >> 11)) & ((uint64_t{1} << 53) - 1);
  EXPECT_EQ(PhiloxUniform(0, 0, 0), std::ldexp(static_cast<double>(bits), -53));
}

TEST(GoldenTest, SamplerGreedyByHand) {
  const float l[3] = {1, 3, 3};
  EXPECT_EQ(Sample(l, 0, 0, 1, 0, 0, 0).token, 1);  // ties: the lowest id
  const float n[2] = {NAN, 0};
  EXPECT_EQ(Sample(n, 0, 0, 1, 0, 0, 0).token, 1);  // NaN never wins
  // Two tokens with probabilities 1/4, 3/4: the draw u picks id 1 when u·(4/3) < 1.
  const float two[2] = {0, static_cast<float>(std::log(3.0))};
  const double u = PhiloxUniform(7, 3, 0);
  EXPECT_EQ(Sample(two, 1, 0, 1, 0, 7, 3).token, u * (1 + 1.0 / 3) < 1 ? 1 : 0);
}

// The twin and the engine's sampler agree on seeded random logits under every filter.
TEST(GoldenTest, SamplerAgreesWithTheEngine) {
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0, 3);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> l(300);
    for (auto& v : l) v = nd(rng);
    engine::SamplingParams p;
    p.temperature = 0.3 + (trial % 5) * 0.3;
    p.top_k = trial % 3 == 0 ? 20 : 0;
    p.top_p = trial % 2 == 0 ? 0.9 : 1.0;
    p.min_p = trial % 7 == 0 ? 0.05 : 0.0;
    p.seed = 1000 + trial;
    const auto e = engine::Sampler::Sample(l, p, trial);
    const Draw d = Sample(l, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, trial);
    EXPECT_EQ(d.token, e.token) << trial;
    EXPECT_EQ(d.uniform, e.uniform) << trial;
  }
}


// The draw from the recorded top-K (`--logits topk`) against the draw from the whole row: where
// it decides, it must agree (a token, or "one outside the top-K" exactly when the full draw's
// token is not among them) — on seeded rows from peaked to flat, under every filter. It decides
// every greedy row, every row whose top-k fits in K, and nearly every row at temperature 1 with
// no top-p (the row's logsumexp fixes the total there); the counts below are what it decides.
TEST(GoldenTest, TopKDrawAgreesWithTheFullDrawWhereItDecides) {
  constexpr int64_t kV = 2000, kK = 32;
  std::mt19937 rng(7);
  int decided = 0, outside = 0, total = 0;
  int t1_rows = 0, t1_decided = 0, topp_rows = 0, topp_decided = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const float sigma = std::array<float, 3>{1.0f, 3.0f, 6.0f}[trial % 3];
    std::normal_distribution<float> nd(0, sigma);
    std::vector<float> l(kV);
    for (auto& v : l) v = nd(rng);
    const double T = std::array<double, 4>{0.0, 0.6, 1.0, 1.3}[(trial / 3) % 4];
    const int64_t top_k = std::array<int64_t, 3>{0, 20, 50}[(trial / 12) % 3];
    const double top_p = std::array<double, 3>{1.0, 0.95, 0.7}[(trial / 36) % 3];
    const double min_p = (trial / 108) % 2 == 0 ? 0.0 : 0.05;
    const uint64_t seed = 500 + trial;
    // The trace's view of the row: the K largest (logit descending, id ascending) and the
    // logsumexp at temperature 1, computed here in long double and rounded to float.
    std::vector<int32_t> order(kV);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
    std::vector<int32_t> ids(order.begin(), order.begin() + kK);
    std::vector<float> vals(kK);
    for (int64_t j = 0; j < kK; ++j) vals[j] = l[ids[j]];
    long double se = 0;
    for (float v : l) se += std::exp(static_cast<long double>(v) - l[order[0]]);
    const float lse = static_cast<float>(l[order[0]] + std::log(se));
    const Draw full = Sample(l, T, top_k, top_p, min_p, seed, trial);
    const TopKDraw tk = SampleFromTopK(ids, vals, kV, lse, T, top_k, top_p, min_p, seed, trial);
    ++total;
    const bool easy_t1 = T == 1 && top_k == 0 && top_p == 1 && min_p == 0;
    t1_rows += easy_t1;
    topp_rows += T > 0 && top_k == 0 && top_p < 1;
    if (tk.outcome == TopKDraw::kUndecided) {
      EXPECT_FALSE(T <= 0 || (top_k > 0 && top_k <= kK)) << trial << ": " << tk.why;
      continue;
    }
    ++decided;
    t1_decided += easy_t1;
    topp_decided += T > 0 && top_k == 0 && top_p < 1;
    if (T > 0) EXPECT_EQ(tk.uniform, full.uniform) << trial;
    if (tk.outcome == TopKDraw::kToken) {
      EXPECT_EQ(tk.token, full.token) << trial << " T " << T << " top_k " << top_k << " top_p " << top_p;
    } else {
      ++outside;
      EXPECT_EQ(std::find(ids.begin(), ids.end(), full.token), ids.end()) << trial;
    }
  }
  EXPECT_GE(t1_decided, t1_rows * 99 / 100) << t1_decided << " of " << t1_rows;
  std::printf("decided %d of %d rows (%d outside the top-%lld); temperature 1, no filter: %d of %d; "
              "top-p without top-k: %d of %d\n",
              decided, total, outside, static_cast<long long>(kK), t1_decided, t1_rows, topp_decided, topp_rows);
  EXPECT_GT(outside, 0);  // flat rows at temperature ≥ 1 draw from the tail: that case is exercised
}

// A row as a top-k trace keeps it: the K largest logits (descending, id ascending) and their ids.
struct TopKRow {
  std::vector<int32_t> ids;
  std::vector<float> vals;
};
TopKRow RecordedTopK(const std::vector<float>& l, int64_t K) {
  std::vector<int32_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  TopKRow t{std::vector<int32_t>(order.begin(), order.begin() + K), std::vector<float>(K)};
  for (int64_t j = 0; j < K; ++j) t.vals[j] = l[t.ids[j]];
  return t;
}

// With the row's logsumexp at the sampling temperature too (logits.logsumexp_t), the same
// rows: wherever it decides, the full draw's token; and every row whose kept set lies within
// the recorded K, or is the whole vocabulary, is decided — top-p's cut included — but for cuts
// within lse_t's rounding.
TEST(GoldenTest, TopKDrawWithTheTemperaturesLogsumexpDecidesEveryRowWhoseKeptSetIsKnown) {
  constexpr int64_t kV = 2000, kK = 32;
  std::mt19937 rng(7);
  int rows = 0, decided = 0, decided_without = 0, outside = 0, rows_inside = 0, decided_inside = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const float sigma = std::array<float, 3>{1.0f, 3.0f, 6.0f}[trial % 3];
    std::normal_distribution<float> nd(0, sigma);
    std::vector<float> l(kV);
    for (auto& v : l) v = nd(rng);
    const double T = std::array<double, 3>{0.6, 1.0, 1.3}[(trial / 3) % 3];
    const double top_p = std::array<double, 3>{1.0, 0.95, 0.7}[(trial / 9) % 3];
    const double min_p = (trial / 27) % 2 == 0 ? 0.0 : 0.05;
    const uint64_t seed = 900 + trial;
    const auto [ids, vals] = RecordedTopK(l, kK);
    // Both logsumexps in long double from the row, rounded to float as the trace keeps them.
    const long double mx = vals[0];
    long double s1 = 0, st = 0;
    for (float v : l) {
      s1 += std::exp(static_cast<long double>(v) - mx);
      st += std::exp((static_cast<long double>(v) - mx) / T);
    }
    const float lse = static_cast<float>(mx + std::log(s1)), lse_t = static_cast<float>(mx / T + std::log(st));
    const Draw full = Sample(l, T, 0, top_p, min_p, seed, trial);
    const TopKDraw with = SampleFromTopK(ids, vals, kV, lse, T, 0, top_p, min_p, seed, trial, lse_t);
    const TopKDraw without = SampleFromTopK(ids, vals, kV, lse, T, 0, top_p, min_p, seed, trial);
    // The kept set within the recorded K: the whole draw is known (but for a cut within
    // lse_t's float rounding). Past it (a flat row's nucleus, min-p's cut among the others),
    // which unrecorded tokens are kept stays open.
    const bool inside = full.candidates < kK || (top_p >= 1 && min_p <= 0);
    ++rows;
    rows_inside += inside;
    decided_without += without.outcome != TopKDraw::kUndecided;
    if (with.outcome == TopKDraw::kUndecided) {
      if (inside) std::printf("undecided: trial %d T %g top_p %g min_p %g: %s\n", trial, T, top_p, min_p, with.why.c_str());
      continue;
    }
    decided_inside += inside;
    ++decided;
    EXPECT_EQ(with.uniform, full.uniform) << trial;
    if (with.outcome == TopKDraw::kToken) {
      EXPECT_EQ(with.token, full.token) << trial << " T " << T << " top_p " << top_p;
    } else {
      ++outside;
      EXPECT_EQ(std::find(ids.begin(), ids.end(), full.token), ids.end()) << trial;
    }
  }
  std::printf("with logsumexp_t: decided %d of %d rows (%d outside the top-%lld; %d of the %d whose kept set is "
              "recorded or the whole vocabulary); without: %d\n",
              decided, rows, outside, static_cast<long long>(kK), decided_inside, rows_inside, decided_without);
  EXPECT_GE(decided_inside, rows_inside - rows_inside / 200) << decided_inside << " of " << rows_inside;
  EXPECT_GT(decided, decided_without);
  EXPECT_LT(decided_without, rows);  // the case the new field exists for is exercised
  EXPECT_GT(outside, 0);
}

// A damaged trace's logsumexp cannot make a draw look decided: one below the recorded logits'
// own mass, or not finite, is ignored (the row is decided as without it, or not at all), and a
// consistent one never changes a decided token.
TEST(GoldenTest, TopKDrawIgnoresAnInconsistentLogsumexp) {
  constexpr int64_t kV = 500, kK = 16;
  std::mt19937 rng(3);
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::normal_distribution<float> nd(0, 2.0f);
    std::vector<float> l(kV);
    for (auto& v : l) v = nd(rng);
    const auto [ids, vals] = RecordedTopK(l, kK);
    const double T = 0.7, top_p = 0.9;
    const TopKDraw base = SampleFromTopK(ids, vals, kV, std::numeric_limits<double>::quiet_NaN(), T, 0, top_p, 0, 77, trial);
    // Below the top logit's own weight at T (lse_t < lmax / T), infinite, or NaN.
    const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
    for (const double bad : {static_cast<double>(vals[0]) / T - 1.0, -1e30, inf, -inf, nan}) {
      for (const double bad1 : {nan, static_cast<double>(vals[0]) - 1.0}) {
        const TopKDraw d = SampleFromTopK(ids, vals, kV, bad1, T, 0, top_p, 0, 77, trial, bad);
        EXPECT_EQ(d.outcome, base.outcome) << trial << " lse_t " << bad << " lse " << bad1;
        if (d.outcome == base.outcome && d.outcome == TopKDraw::kToken) EXPECT_EQ(d.token, base.token) << trial;
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 3000);
}

// The constants a config implies, from DeepSeek's formulas by hand: V3's YaRN (factor 40,
// mscale = mscale_all_dim = 1) scales the softmax by (0.1·ln 40 + 1)² and leaves cos/sin as they
// are; V2-Lite's 0.707s the same way; without YaRN 1/sqrt(qk_nope + qk_rope). Then every shipped
// MLA config gives the engine's values (computed by its own code) to the last bits.
TEST(GoldenTest, ConfigConstantsFollowTheFormulas) {
  const double m40 = 0.1 * std::log(40.0) + 1;  // 1.3688879454113936
  EXPECT_NEAR(YarnMscale(40, 1), 1.3688879454113936, 1e-15);
  EXPECT_EQ(YarnMscale(1, 1), 1.0);
  EXPECT_EQ(YarnMscale(0.5, 3), 1.0);
  EXPECT_NEAR(MlaSoftmaxScale(128, 64, true, 40, 1.0), m40 * m40 / std::sqrt(192.0), 1e-15);
  EXPECT_NEAR(MlaSoftmaxScale(128, 64, true, 40, 0.707), std::pow(0.1 * 0.707 * std::log(40.0) + 1, 2) / std::sqrt(192.0),
              1e-15);
  EXPECT_EQ(MlaSoftmaxScale(128, 64, false, 40, 1.0), 1 / std::sqrt(192.0));
  EXPECT_EQ(MlaSoftmaxScale(128, 64, true, 40, 0.0), 1 / std::sqrt(192.0));
  EXPECT_EQ(RopeAttentionFactor(true, 40, 1.0, 1.0, 0), 1.0);
  EXPECT_NEAR(RopeAttentionFactor(true, 40, 0.5, 1.0, 0), (0.05 * std::log(40.0) + 1) / m40, 1e-15);
  EXPECT_NEAR(RopeAttentionFactor(true, 40, 0, 0, 0), m40, 1e-15);
  EXPECT_EQ(RopeAttentionFactor(true, 40, 1.0, 1.0, 0.9), 0.9);
  EXPECT_EQ(RopeAttentionFactor(false, 40, 1.0, 0.5, 0), 1.0);
  int checked = 0, yarn = 0, stated = 0;
  for (const auto& dir : {testing::SourceDir() / "models", testing::SourceDir() / "models" / "shapes",
                          testing::FixtureDir() / "models"}) {
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (!std::filesystem::exists(e.path() / "config.json")) continue;
      auto c = engine::ModelConfig::Load(e.path());
      ASSERT_TRUE(c.ok()) << e.path() << ": " << c.status().message();
      if (c->is_v4()) {  // its two RoPE tables' factors
        for (const engine::V4Rope* r : {&c->v4.main_rope, &c->v4.compress_rope}) {
          EXPECT_NEAR(RopeAttentionFactor(r->yarn, r->factor, r->mscale, r->mscale_all_dim, r->attention_factor_field),
                      r->attention_factor, 1e-15)
              << e.path();
          yarn += r->yarn;
        }
        const FileConfig f = ReadFileConfig(e.path(), false);
        if (f.rms_norm_eps) EXPECT_EQ(*f.rms_norm_eps, c->rms_norm_eps) << e.path();
        if (f.routed_scaling_factor) EXPECT_EQ(*f.routed_scaling_factor, c->routed_scaling_factor) << e.path();
        continue;
      }
      ++checked;
      yarn += c->rope.yarn;
      // What verify reads from config.json itself agrees with the engine's parse on every shipped
      // config (no false defects from a difference in how a stated field is read).
      const FileConfig f = ReadFileConfig(e.path(), c->family == engine::ModelFamily::kDeepseekV2);
      if (f.rms_norm_eps) EXPECT_EQ(*f.rms_norm_eps, c->rms_norm_eps) << e.path();
      if (f.routed_scaling_factor) EXPECT_EQ(*f.routed_scaling_factor, c->routed_scaling_factor) << e.path();
      if (f.norm_topk_prob) EXPECT_EQ(*f.norm_topk_prob, c->norm_topk_prob) << e.path();
      if (f.rope_theta) EXPECT_EQ(*f.rope_theta, c->rope.theta) << e.path();
      stated += f.rms_norm_eps.has_value() + f.routed_scaling_factor.has_value() + f.rope_theta.has_value();
      EXPECT_NEAR(MlaSoftmaxScale(c->qk_nope_head_dim, c->qk_rope_head_dim, c->rope.yarn, c->rope.factor,
                                  c->rope.mscale_all_dim),
                  c->softmax_scale(), 1e-15 * c->softmax_scale())
          << e.path();
      EXPECT_NEAR(RopeAttentionFactor(c->rope.yarn, c->rope.factor, c->rope.mscale, c->rope.mscale_all_dim,
                                      c->rope.attention_factor_field),
                  c->rope.attention_factor, 1e-15)
          << e.path();
    }
  }
  EXPECT_GE(checked, 8);
  EXPECT_GE(yarn, 2);
  EXPECT_GE(stated, 3 * 8);
}

}  // namespace
}  // namespace lockstep::verify::golden
