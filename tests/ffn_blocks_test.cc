// tests/ffn_blocks_test.cc — the FFN blocks the model families share (engine/ffn_blocks.h):
// the SwiGLU MLP against fp64 code written from its formula, and the routed experts' dispatch
// and combine on hand-made routings — each row's output the same bits alone as in any batch.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "engine/ffn_blocks.h"

namespace lockstep::engine {
namespace {

Matrix RandomMatrix(int64_t rows, int64_t cols, std::mt19937* rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = u(*rng);
  return Matrix::Fp32(std::move(v), rows, cols);
}

double Silu(double g) { return g / (1.0 + std::exp(-g)); }

// down(silu(gate x) · up x) in fp64, with V4's clamp when `limit` > 0.
std::vector<double> MlpGolden(const MlpWeights& m, const float* x, double limit) {
  const int64_t I = m.gate.rows, H = m.gate.cols, out = m.down.rows;
  std::vector<double> a(I), y(out, 0.0);
  for (int64_t i = 0; i < I; ++i) {
    double g = 0, u = 0;
    for (int64_t c = 0; c < H; ++c) {
      g += static_cast<double>(m.gate.ptr()[i * H + c]) * x[c];
      u += static_cast<double>(m.up.ptr()[i * H + c]) * x[c];
    }
    if (limit > 0) {
      g = std::min(g, limit);
      u = std::clamp(u, -limit, limit);
    }
    a[i] = Silu(g) * u;
  }
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < I; ++i) y[o] += static_cast<double>(m.down.ptr()[o * I + i]) * a[i];
  }
  return y;
}

TEST(FfnBlocks, SwiGluMlpMatchesTheFormulaWithAndWithoutTheClamp) {
  std::mt19937 rng(7);
  const int64_t H = 24, I = 40, R = 3;
  MlpWeights m{RandomMatrix(I, H, &rng), RandomMatrix(I, H, &rng), RandomMatrix(H, I, &rng)};
  std::vector<float> x(R * H);
  for (float& v : x) v = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
  for (const double limit : {0.0, 0.5}) {
    std::vector<float> y(R * H);
    if (limit > 0) {
      SwiGluMlp(Gemm{}, m, x.data(), R, y.data(), static_cast<float>(limit));
    } else {
      SwiGluMlp(Gemm{}, m, x.data(), R, y.data());
    }
    for (int64_t r = 0; r < R; ++r) {
      const std::vector<double> want = MlpGolden(m, &x[r * H], limit);
      // fp32 products and sums of a few dozen terms: a few ulps of the result's size.
      for (int64_t c = 0; c < H; ++c) {
        EXPECT_NEAR(y[r * H + c], want[c], 4e-6 * (1 + std::fabs(want[c]))) << "limit " << limit << " row " << r;
      }
    }
  }
  // The clamp bites: with inputs this large some gate and up values pass 0.5.
  std::vector<float> a(R * H), b(R * H);
  SwiGluMlp(Gemm{}, m, x.data(), R, a.data());
  SwiGluMlp(Gemm{}, m, x.data(), R, b.data(), 0.5f);
  EXPECT_NE(a, b);
}

// A toy expert: y = (e + 1)·x + row sum of x, so every slot says which expert made it.
void Toy(int64_t e, const float* xin, int64_t n, int64_t H, float* yout) {
  for (int64_t r = 0; r < n; ++r) {
    float s = 0;
    for (int64_t c = 0; c < H; ++c) s += xin[r * H + c];
    for (int64_t c = 0; c < H; ++c) yout[r * H + c] = static_cast<float>(e + 1) * xin[r * H + c] + s;
  }
}

TEST(FfnBlocks, DispatchRunsEachChosenExpertOnceAndFillsEverySlot) {
  const int64_t R = 3, k = 2, E = 5, H = 4;
  const std::vector<int32_t> ids = {1, 3, 3, 3, 0, 1};  // row 1 picks expert 3 twice; 2 and 4 unchosen
  std::vector<float> x(R * H);
  for (int64_t i = 0; i < R * H; ++i) x[i] = 0.25f * static_cast<float>(i) - 1.0f;
  std::vector<float> slot(R * k * H, -7.0f);
  std::multiset<int64_t> ran;
  DispatchExperts(ids.data(), R, k, E, H, x.data(), [&](int64_t e, const float* xin, int64_t n, float* yout) {
    ran.insert(e);
    Toy(e, xin, n, H, yout);
  }, slot.data());
  EXPECT_EQ(ran, (std::multiset<int64_t>{0, 1, 3}));
  for (int64_t i = 0; i < R * k; ++i) {
    std::vector<float> want(H);
    Toy(ids[i], &x[(i / k) * H], 1, H, want.data());
    for (int64_t c = 0; c < H; ++c) EXPECT_EQ(slot[i * H + c], want[c]) << "slot " << i;
  }
}

TEST(FfnBlocks, CombineSumsSlotsInOrderThenTheSharedExperts) {
  const int64_t R = 2, k = 3, H = 2;
  const std::vector<float> slot = {1, 2, 3, 4, 5, 6, -1, 0.5f, 2, 2, 0, 1};
  const std::vector<float> wts = {0.5f, 0.25f, 2.0f, 1.0f, 1.0f, 0.125f};
  const std::vector<float> shared = {10, 20, 0, 0};
  for (const ExpertCombine how : {ExpertCombine::kMulAdd, ExpertCombine::kFma}) {
    std::vector<float> y(R * H, 99.0f);
    CombineExperts(slot.data(), wts.data(), R, k, H, shared.data(), how, y.data());
    EXPECT_EQ(y[0], 0.5f * 1 + 0.25f * 3 + 2.0f * 5 + 10);  // exact in binary: hand-computed 21.25
    EXPECT_EQ(y[1], 0.5f * 2 + 0.25f * 4 + 2.0f * 6 + 20);  // 34
    EXPECT_EQ(y[2], -1.0f + 2.0f + 0.0f);                    // 1
    EXPECT_EQ(y[3], 0.5f + 2.0f + 0.125f);                   // 2.625
  }
  // Where it matters the two differ: with -1 already summed, w·v (w = v = 1 + 2⁻¹²: exactly
  // 1 + 2⁻¹¹ + 2⁻²⁴, a tie that rounds to 1 + 2⁻¹¹) is rounded before the add, or not (fma).
  const float w = 1.0f + 0x1p-12f;
  const std::vector<float> s1 = {-1.0f, w};
  const std::vector<float> w1 = {1.0f, w};
  const std::vector<float> z = {0.0f};
  float mul_add = 0, fma = 0;
  CombineExperts(s1.data(), w1.data(), 1, 2, 1, z.data(), ExpertCombine::kMulAdd, &mul_add);
  CombineExperts(s1.data(), w1.data(), 1, 2, 1, z.data(), ExpertCombine::kFma, &fma);
  EXPECT_EQ(mul_add, 0x1p-11f);
  EXPECT_EQ(fma, 0x1p-11f + 0x1p-24f);
}

TEST(FfnBlocks, ARowsOutputIsTheSameBitsAloneAndInAnyBatch) {
  std::mt19937 rng(11);
  const int64_t H = 16, I = 24, E = 6, k = 2, R = 7;
  std::vector<MlpWeights> experts;
  for (int64_t e = 0; e < E; ++e) experts.push_back({RandomMatrix(I, H, &rng), RandomMatrix(I, H, &rng), RandomMatrix(H, I, &rng)});
  std::vector<float> x(R * H), wts(R * k);
  std::vector<int32_t> ids(R * k);
  for (float& v : x) v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
  for (float& v : wts) v = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
  for (int32_t& v : ids) v = static_cast<int32_t>(rng() % E);
  const std::vector<float> zeros(R * H, 0.0f);
  auto run = [&](int64_t r0, int64_t n) {
    std::vector<float> slot(n * k * H), y(n * H);
    DispatchExperts(&ids[r0 * k], n, k, E, H, &x[r0 * H], [&](int64_t e, const float* xin, int64_t m, float* yout) {
      SwiGluMlp(Gemm{}, experts[e], xin, m, yout);
    }, slot.data());
    CombineExperts(slot.data(), &wts[r0 * k], n, k, H, zeros.data(), ExpertCombine::kMulAdd, y.data());
    return y;
  };
  const std::vector<float> all = run(0, R);
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<float> alone = run(r, 1);
    for (int64_t c = 0; c < H; ++c) EXPECT_EQ(alone[c], all[r * H + c]) << "row " << r;
  }
}

}  // namespace
}  // namespace lockstep::engine
