// tests/sampler_test.cc — Philox against the published known-answer vectors (Random123's
// kat_vectors), and the sampler's filters on hand-computed distributions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "engine/sampler.h"
#include "kernels/philox.h"

namespace lockstep {
namespace {

using kernels::Philox4x32;

TEST(Philox, KnownAnswerVectors) {
  struct Kat {
    Philox4x32 ctr;
    uint32_t k0, k1;
    Philox4x32 want;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
       0xffffffffu,
       0xffffffffu,
       {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       0xa4093822u,
       0x299f31d0u,
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const auto& k : kats) {
    Philox4x32 got = kernels::Philox4x32_10(k.ctr, k.k0, k.k1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], k.want.v[i]) << "word " << i;
  }
}

TEST(Philox, UniformIsAPureFunctionOfSeedAndStep) {
  const double a = kernels::PhiloxUniform(42, 7, 0);
  EXPECT_EQ(a, kernels::PhiloxUniform(42, 7, 0));
  EXPECT_NE(a, kernels::PhiloxUniform(42, 8, 0));
  EXPECT_NE(a, kernels::PhiloxUniform(43, 7, 0));
  EXPECT_GE(a, 0.0);
  EXPECT_LT(a, 1.0);
}

std::vector<float> Logits(std::vector<double> probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

std::map<int, double> Frequencies(const std::vector<float>& logits, engine::SamplingParams p, int n) {
  std::map<int, double> f;
  for (int i = 0; i < n; ++i) f[engine::Sampler::Sample(logits, p, i).token] += 1.0 / n;
  return f;
}

TEST(Sampler, GreedyTakesTheArgmaxAndTheLowestIdOnTies) {
  engine::SamplingParams p;
  EXPECT_EQ(engine::Sampler::Sample(std::vector<float>{0, 3, 1, 3}, p, 0).token, 1);
  EXPECT_EQ(engine::Sampler::Sample(std::vector<float>{NAN, -1, -2}, p, 0).token, 1);
}

TEST(Sampler, TemperatureOneSamplesTheSoftmax) {
  engine::SamplingParams p;
  p.temperature = 1.0;
  p.seed = 123;
  auto f = Frequencies(Logits({0.5, 0.3, 0.2}), p, 40000);
  EXPECT_NEAR(f[0], 0.5, 0.01);
  EXPECT_NEAR(f[1], 0.3, 0.01);
  EXPECT_NEAR(f[2], 0.2, 0.01);
}

TEST(Sampler, TemperatureSharpens) {
  engine::SamplingParams p;
  p.temperature = 0.5;  // p_i ∝ p_i² → 0.25, 0.09, 0.04 over 0.38
  p.seed = 5;
  auto f = Frequencies(Logits({0.5, 0.3, 0.2}), p, 40000);
  EXPECT_NEAR(f[0], 0.25 / 0.38, 0.01);
  EXPECT_NEAR(f[2], 0.04 / 0.38, 0.01);
}

TEST(Sampler, TopKTopPMinPFilter) {
  engine::SamplingParams p;
  p.temperature = 1.0;
  p.seed = 9;
  auto l = Logits({0.5, 0.3, 0.15, 0.05});
  p.top_k = 2;
  auto f = Frequencies(l, p, 20000);
  EXPECT_EQ(f.count(2) + f.count(3), 0u);
  EXPECT_NEAR(f[0], 0.5 / 0.8, 0.015);
  p.top_k = 0;
  p.top_p = 0.5;  // the first token alone reaches 0.5
  EXPECT_EQ(Frequencies(l, p, 2000).size(), 1u);
  p.top_p = 0.81;  // needs three tokens
  f = Frequencies(l, p, 20000);
  EXPECT_EQ(f.count(3), 0u);
  EXPECT_NEAR(f[2], 0.15 / 0.95, 0.01);
  p.top_p = 1.0;
  p.min_p = 0.5;  // keep p ≥ 0.25
  f = Frequencies(l, p, 20000);
  EXPECT_EQ(f.size(), 2u);
  auto r = engine::Sampler::Sample(l, p, 3);
  EXPECT_EQ(r.candidates, 2);
  EXPECT_NEAR(r.probability, r.token == 0 ? 0.5 / 0.8 : 0.3 / 0.8, 1e-6);
}

TEST(Sampler, ReplayingOneStepNeedsNoHistory) {
  engine::SamplingParams p;
  p.temperature = 0.8;
  p.seed = 77;
  std::vector<float> l(1000);
  for (int i = 0; i < 1000; ++i) l[i] = std::sin(i * 0.37f) * 3;
  std::vector<int32_t> run;
  for (int s = 0; s < 50; ++s) run.push_back(engine::Sampler::Sample(l, p, s).token);
  EXPECT_EQ(engine::Sampler::Sample(l, p, 37).token, run[37]);
  EXPECT_GT(std::set<int32_t>(run.begin(), run.end()).size(), 5u);
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

// The sampler's candidate order, spelled out as the docs define it (logit descending, id
// ascending on ties, NaN as −∞, −0 == +0) with a comparison sort: the reference the sampler's
// key-based sorts (comparison below 32k tokens, radix above) must reproduce exactly.
engine::SampleResult ReferenceSample(const std::vector<float>& logits, const engine::SamplingParams& p, uint64_t step) {
  const int64_t n = static_cast<int64_t>(logits.size());
  auto val = [&](int64_t i) { return std::isnan(logits[i]) ? -INFINITY : logits[i]; };
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return val(a) > val(b); });
  const int64_t k = p.top_k > 0 && p.top_k < n ? p.top_k : n;
  const double lmax = val(ids[0]);
  std::vector<double> w(k);
  double total = 0;
  for (int64_t i = 0; i < k; ++i) total += (w[i] = std::exp((static_cast<double>(val(ids[i])) - lmax) / p.temperature));
  int64_t keep = k;
  if (p.top_p < 1.0) {
    double cum = 0;
    for (int64_t i = 0; i < k; ++i) {
      cum += w[i];
      if (cum >= p.top_p * total) {
        keep = i + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.0) {
    int64_t m = 1;
    while (m < keep && w[m] >= p.min_p) ++m;
    keep = m;
  }
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += w[i];
  const double u = kernels::PhiloxUniform(p.seed, step, 0);
  double cum = 0;
  int64_t chosen = keep - 1;
  for (int64_t i = 0; i < keep; ++i) {
    cum += w[i];
    if (cum > u * kept) {
      chosen = i;
      break;
    }
  }
  engine::SampleResult r;
  r.token = ids[chosen];
  r.probability = w[chosen] / kept;
  r.candidates = keep;
  return r;
}

TEST(Sampler, KeySortsGiveTheDocumentedOrderAtEveryVocabularySize) {
  std::mt19937 rng(5);
  for (int64_t n : {7, 6144, 40000, 129280}) {
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<float> l(n);
      std::normal_distribution<float> nd(0.0f, 3.0f);
      for (auto& v : l) v = nd(rng);
      // Ties, signed zeros, infinities and NaN.
      for (int64_t i = 0; i < n; i += 5) l[i] = std::round(l[i]);
      l[n / 2] = -0.0f;
      l[n / 3] = 0.0f;
      l[n - 1] = -INFINITY;
      if (n > 7) l[n / 4] = std::nanf("");
      l[0] = trial % 2 ? INFINITY : l[0];
      engine::SamplingParams p;
      p.temperature = trial % 3 == 0 ? 0.6 : 1.0;
      p.top_p = trial % 2 ? 0.9 : 1.0;
      p.top_k = trial == 4 ? 50 : 0;
      p.min_p = trial == 5 ? 0.05 : 0.0;
      p.seed = 100 + trial;
      for (uint64_t step = 0; step < 4; ++step) {
        const auto got = engine::Sampler::Sample(l, p, step);
        const auto want = ReferenceSample(l, p, step);
        ASSERT_EQ(got.token, want.token) << "n " << n << " trial " << trial << " step " << step;
        ASSERT_EQ(got.candidates, want.candidates) << "n " << n << " trial " << trial;
        ASSERT_EQ(std::memcmp(&got.probability, &want.probability, 8), 0)  // bits: NaN (a +inf logit) too
            << "n " << n << " trial " << trial << ": " << got.probability << " vs " << want.probability;
      }
    }
  }
}

}  // namespace
}  // namespace lockstep
