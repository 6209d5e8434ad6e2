// tests/v4_blocks_test.cc — DeepSeek-V4's blocks (engine/v4_blocks.h) on hand-computed cases,
// and the loader's one-line errors on a damaged checkpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "engine/model.h"
#include "engine/v4_blocks.h"
#include "test_util.h"

namespace lockstep::engine {
namespace {

TEST(V4Blocks, RopeRotatesTheTrailingPairsAndItsInverseUndoesIt) {
  std::vector<float> x = {1, 2, 3, 4, 5, 6};  // width 6, rd 4: dims 2..5 rotate as (3,4), (5,6)
  const float cs[2] = {0.0f, std::cos(0.5f)}, sn[2] = {1.0f, std::sin(0.5f)};
  std::vector<float> y = x;
  v4::RopeTrailing(y.data(), 6, 4, cs, sn);
  EXPECT_EQ(y[0], 1);
  EXPECT_EQ(y[1], 2);
  EXPECT_FLOAT_EQ(y[2], -4);  // 3·cos 90° − 4·sin 90°
  EXPECT_FLOAT_EQ(y[3], 3);   // 4·cos 90° + 3·sin 90°
  EXPECT_FLOAT_EQ(y[4], 5 * std::cos(0.5f) - 6 * std::sin(0.5f));
  v4::RopeTrailing(y.data(), 6, 4, cs, sn, /*inverse=*/true);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(y[i], x[i], 1e-6) << i;
}

TEST(V4Blocks, RopeTableIsThetaToTheMinusTwoIOverRd) {
  V4Rope r;
  r.theta = 100.0;
  v4::RopeTable t(r, 4);
  float cs[2], sn[2];
  t.At(3, cs, sn);
  EXPECT_NEAR(cs[0], std::cos(3.0), 1e-6);
  EXPECT_NEAR(sn[1], std::sin(3.0 / 10.0), 1e-6);  // 100^(-2/4) = 0.1
}

TEST(V4Blocks, HyperConnectionMixesAsTheFormulaSays) {
  V4Config v;
  v.hc_mult = 2;
  v.hc_sinkhorn_iters = 30;
  v.hc_eps = 0;
  const int64_t hc = 2, D = 3;
  V4HcWeights w;
  w.fn = Matrix::Fp32(std::vector<float>((2 + hc) * hc * hc * D, 0.0f), (2 + hc) * hc, hc * D);  // mix = 0
  w.base = Matrix::Fp32({0.5f, -1.0f, 0.0f, 2.0f, 1.0f, 0.0f, 0.0f, -1.0f}, 1, 8);
  w.scale = Matrix::Fp32({1.0f, 1.0f, 1.0f}, 1, 3);
  const std::vector<float> X = {1, 2, 3, -1, 0, 4};  // streams [2, 3]
  v4::HcMix mix;
  std::vector<float> x_in(D);
  v4::HcPre(w, v, 1e-6, X.data(), D, &mix, x_in.data());
  auto sig = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
  EXPECT_NEAR(mix.pre[0], sig(0.5), 1e-6);
  EXPECT_NEAR(mix.pre[1], sig(-1.0), 1e-6);
  EXPECT_NEAR(mix.post[0], 2 * sig(0.0), 1e-6);
  EXPECT_NEAR(mix.post[1], 2 * sig(2.0), 1e-6);
  for (int i = 0; i < D; ++i) EXPECT_NEAR(x_in[i], sig(0.5) * X[i] + sig(-1.0) * X[D + i], 1e-6);
  // Sinkhorn: C = softmax rows of [[1, 0], [0, −1]], balanced until rows and columns sum to 1.
  const float* C = mix.comb.data();
  EXPECT_NEAR(C[0] + C[1], 1.0, 1e-5);
  EXPECT_NEAR(C[2] + C[3], 1.0, 1e-5);
  EXPECT_NEAR(C[0] + C[2], 1.0, 1e-5);
  EXPECT_NEAR(C[1] + C[3], 1.0, 1e-5);
  // A 2×2 doubly stochastic matrix is [[a, 1−a], [1−a, a]]. Row and column scalings keep the
  // cross ratio C00·C11 / (C01·C10), here e¹·e⁻¹ / (e⁰·e⁰) = 1, so a² / (1 − a)² = 1: a = ½.
  EXPECT_NEAR(C[0], 0.5, 1e-4);
  // hc_post: X'[k] = post[k]·y + Σ_j C[j, k]·X[j].
  const std::vector<float> y = {10, 20, 30};
  std::vector<float> Xo(hc * D);
  v4::HcPost(mix, X.data(), y.data(), hc, D, Xo.data());
  for (int k = 0; k < hc; ++k) {
    for (int i = 0; i < D; ++i) {
      EXPECT_NEAR(Xo[k * D + i], mix.post[k] * y[i] + C[k] * X[i] + C[2 + k] * X[D + i], 1e-5);
    }
  }
}

TEST(V4Blocks, PoolingWithOneOpenSlotIsThatSlotNormalised) {
  const int64_t slots = 3, width = 2;
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> kv = {0, 0, 3, 4, 100, 100};
  const std::vector<float> gate = {-inf, -inf, 0.0f, 5.0f, -inf, -inf};
  const std::vector<float> norm = {1.0f, 2.0f};
  std::vector<float> e(width);
  const float cs[1] = {1.0f}, sn[1] = {0.0f};
  v4::PoolEntry(kv.data(), gate.data(), slots, width, norm.data(), 0.0, 2, cs, sn, e.data());
  // RMS of (3, 4) is √12.5.
  EXPECT_NEAR(e[0], 3 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(e[1], 2 * 4 / std::sqrt(12.5), 1e-6);
}

TEST(V4Blocks, SinkTakesItsShareOfTheSoftmax) {
  const float q[2] = {1, 0}, k0[2] = {2, 1};
  const float* keys[1] = {k0};
  float out[2];
  // One key of logit 2·0.5 = 1 against a sink of 0: p = e / (e + 1).
  const float share = v4::AttendWithSink(q, keys, 1, 2, 0.5f, 0.0f, out);
  const double p = std::exp(1.0) / (std::exp(1.0) + 1.0);
  EXPECT_NEAR(share, 1 - p, 1e-6);
  EXPECT_NEAR(out[0], 2 * p, 1e-6);
  EXPECT_NEAR(out[1], p, 1e-6);
  // A sink of −∞ is no sink.
  EXPECT_EQ(v4::AttendWithSink(q, keys, 1, 2, 0.5f, -std::numeric_limits<float>::infinity(), out), 0.0f);
  EXPECT_NEAR(out[0], 2, 1e-6);
}

TEST(V4Blocks, SqrtSoftplusFollowsTorchsThreshold) {
  EXPECT_NEAR(v4::SqrtSoftplus(0.0f), std::sqrt(std::log(2.0)), 1e-7);
  EXPECT_FLOAT_EQ(v4::SqrtSoftplus(25.0f), 5.0f);  // past 20: softplus(x) = x
  EXPECT_NEAR(v4::SqrtSoftplus(-3.0f), std::sqrt(std::log1p(std::exp(-3.0))), 1e-7);
}

TEST(V4Blocks, ClampedSwiGluClampsGateAboveAndUpBothWays) {
  MlpWeights m;
  m.gate = Matrix::Fp32({1.0f}, 1, 1);
  m.up = Matrix::Fp32({-1.0f}, 1, 1);
  m.down = Matrix::Fp32({1.0f}, 1, 1);
  const float x = 50.0f;  // g = 50 → 7, u = −50 → −7
  float y = 0;
  v4::ClampedSwiGlu(m, 7.0, &x, 1, engine::Gemm{}, &y);
  EXPECT_NEAR(y, 7.0 / (1.0 + std::exp(-7.0)) * -7.0, 1e-4);
}

// A tid2eid entry past n_routed_experts is refused at load, naming the tensor and the token.
TEST(V4Weights, RefusesAHashRouteToAMissingExpert) {
  const auto src = testing::FixtureDir() / "models_v4" / "v4_mixed";
  const auto dir = std::filesystem::temp_directory_path() / "lockstep_v4_bad_tid2eid";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(src / "config.json", dir / "config.json", std::filesystem::copy_options::overwrite_existing);
  std::ifstream in(src / "model.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const nlohmann::json h = nlohmann::json::parse(bytes.substr(8, n));
  const std::string name = "model.layers.0.ffn.gate.tid2eid";
  ASSERT_TRUE(h.contains(name)) << "the fixture stores " << name;
  const int64_t off = 8 + static_cast<int64_t>(n) + h[name]["data_offsets"][0].get<int64_t>();
  const int64_t bad = 99;
  std::memcpy(&bytes[off + 8 * 7], &bad, 8);  // token 3, slot 1 (k = 2)
  std::ofstream(dir / "model.safetensors", std::ios::binary) << bytes;
  auto m = Model::Load(dir);
  ASSERT_FALSE(m.ok());
  const std::string msg = m.status().message();
  EXPECT_NE(msg.find("'" + name + "': token 3 routes to expert 99"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lockstep::engine
