// tests/gpu/gpu_model_ops_test.cc — kernels/cuda/model_ops.cu against its CPU twins on fresh
// seeded inputs: embedding, residual add, scale, bf16 conversion, SwiGLU, LayerNorm, MoE
// routing and the MoE combine (the grouped expert GEMM: gpu_expert_gemm_test.cc), and the
// launchers' argument checks. Bitwise where the CPU's operation sequence is reproduced; a
// derived bound where expf's rounding may differ; NaN positions always equal; batch
// invariance and the device error flags.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/model.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

using namespace gpu_testing;  // NOLINT

std::vector<float> Randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = g(rng);
  return v;
}

int32_t ReadFlag(const cu::DeviceBuffer& flag) { return Download<int32_t>(flag, 1)[0]; }

std::string Shape(int64_t rows, int64_t n) { return "rows=" + std::to_string(rows) + " n=" + std::to_string(n); }

// --- Embed --------------------------------------------------------------------------------

TEST(CudaEmbed, GathersRowsBitwiseAndFlagsBadIds) {
  LS_REQUIRE_GPU();
  const int64_t vocab = 1000, n = 333, stride = 340;
  std::vector<float> table = Randn(vocab * n, 1);
  table[7 * n + 3] = NAN;  // payloads travel as bits
  std::vector<int32_t> ids = {7, 0, 999, 7, 1000, -1, 512};
  const int64_t rows = static_cast<int64_t>(ids.size());
  auto dt = Upload(table), di = Upload(ids);
  auto dy = Zeros<float>(rows * stride);
  auto flag = Zeros<int32_t>(1);
  cu::EmbedParams p;
  p.table = dt.as<float>();
  p.vocab = vocab;
  p.n = n;
  p.ids = di.as<int32_t>();
  p.rows = rows;
  p.y = dy.as<float>();
  p.y_stride = stride;
  p.error_flag = flag.as<int32_t>();
  LS_ASSERT_OK(cu::Embed(p));
  LS_ASSERT_OK(cu::Synchronize());
  std::vector<float> y = Download<float>(dy, rows * stride);
  for (int64_t r = 0; r < rows; ++r) {
    const bool bad = ids[r] < 0 || ids[r] >= vocab;
    for (int64_t i = 0; i < n; ++i) {
      const float got = y[r * stride + i];
      if (bad) {
        ASSERT_TRUE(std::isnan(got)) << "row " << r << " col " << i;
      } else {
        const float want = table[ids[r] * n + i];
        ASSERT_EQ(0, std::memcmp(&got, &want, 4)) << "row " << r << " col " << i;
      }
    }
  }
  EXPECT_EQ(ReadFlag(flag), cu::kErrToken);
}

// --- elementwise ----------------------------------------------------------------------------

TEST(CudaElementwise, AddScaleToBf16Bitwise) {
  LS_REQUIRE_GPU();
  for (auto [rows, n] : std::vector<std::pair<int64_t, int64_t>>{{1, 2048}, {37, 7168}, {70000, 3}, {5, 1}}) {
    const int64_t xs = n + 3, ys = n + 5;
    std::vector<float> x = Randn(rows * xs, 10 + n, 3.0f), y = Randn(rows * ys, 20 + n, 3.0f);
    // Specials: NaN, ±inf, ±0, subnormals, bf16 halfway and overflow-on-rounding values.
    const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-40f, -3e-39f, 3.3895314e38f,
                              std::bit_cast<float>(0x3f808000u), std::bit_cast<float>(0x3f818000u),
                              std::bit_cast<float>(0x7f7fffffu)};
    for (size_t s = 0; s < std::size(specials) && s < x.size(); ++s) x[(s * 7919) % x.size()] = specials[s];
    auto dx = Upload(x), dy = Upload(y);
    auto dh = Zeros<uint16_t>(rows * ys);
    LS_ASSERT_OK(cu::AddInPlace(dy.as<float>(), ys, dx.as<float>(), xs, rows, n));
    LS_ASSERT_OK(cu::Scale(dy.as<float>(), ys, rows, n, 0.3f));
    LS_ASSERT_OK(cu::ToBf16(dx.as<float>(), xs, dh.as<uint16_t>(), ys, rows, n));
    LS_ASSERT_OK(cu::Synchronize());
    std::vector<float> want_y = y;
    std::vector<uint16_t> want_h(rows * ys, 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        want_y[r * ys + i] += x[r * xs + i];
        want_y[r * ys + i] *= 0.3f;
        want_h[r * ys + i] = kernels::F32ToBf16(x[r * xs + i]);
      }
    }
    EXPECT_TRUE(SameBitsOrBothNan(Download<float>(dy, rows * ys), want_y, "add+scale " + Shape(rows, n)));
    EXPECT_TRUE(BitwiseEqual(Download<uint16_t>(dh, rows * ys), want_h, "to_bf16 " + Shape(rows, n)));
  }
}

// SwiGLU. The two sides run the same operations on exp(−g) values that differ by at most
// one ulp (glibc's expf vs the correctly rounded one, ops.h). e' = e(1 + δ), |δ| ≤ 2u: then
// 1 + e differs by ≤ 2u relative before each side's rounding (u each), the quotient and the
// product add u each per side: |Δ| ≤ (2 + 2 + 2 + 2)u = 8u relative, plus an absolute
// 2^-149 for results in the subnormal range.
// Bit for bit the CPU's (both round exp once from a double; with glibc's expf on the CPU, 43
// of 180k elements differed, all within 8u), NaN where it has NaN.
TEST(CudaSwiGlu, BitwiseCpu) {
  LS_REQUIRE_GPU();
  for (auto [rows, n] : std::vector<std::pair<int64_t, int64_t>>{{1, 1408}, {64, 2816}, {3, 17}}) {
    std::vector<float> g = Randn(rows * n, 30 + n, 4.0f), u = Randn(rows * n, 40 + n);
    g[0] = NAN;
    if (g.size() > 5) {
      g[1] = -100.0f;  // exp(100) = inf: silu = −0
      g[2] = 100.0f;
      u[3] = INFINITY;
      g[4] = -0.0f;
    }
    auto dg = Upload(g), du = Upload(u);
    auto dout = Zeros<float>(rows * n);
    cu::SwiGluParams p;
    p.g = dg.as<float>();
    p.g_stride = n;
    p.u = du.as<float>();
    p.u_stride = n;
    p.out = dout.as<float>();
    p.out_stride = n;
    p.rows = rows;
    p.n = n;
    LS_ASSERT_OK(cu::SwiGlu(p));
    LS_ASSERT_OK(cu::Synchronize());
    std::vector<float> want(rows * n);
    kernels::cpu::SwiGlu(g.data(), u.data(), rows * n, want.data());
    std::vector<float> got = Download<float>(dout, rows * n);
    int64_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += !std::isnan(want[i]) && std::memcmp(&got[i], &want[i], 4) != 0;
    std::printf("  [swiglu %s] %lld of %zu elements differ in bits\n", Shape(rows, n).c_str(),
                static_cast<long long>(differ), got.size());
    EXPECT_EQ(differ, 0) << "swiglu " << Shape(rows, n);
    EXPECT_TRUE(SameBitsOrBothNan(got, want, "swiglu " + Shape(rows, n)));
  }
}

// --- LayerNorm --------------------------------------------------------------------------------

TEST(CudaLayerNorm, BitwiseCpu) {
  LS_REQUIRE_GPU();
  for (auto [rows, n] : std::vector<std::pair<int64_t, int64_t>>{{1, 128}, {300, 128}, {7, 1}, {9, 1000}}) {
    std::vector<float> x = Randn(rows * n, 50 + n, 5.0f), w = Randn(n, 60 + n), b = Randn(n, 70 + n);
    for (int64_t r = 0; r < rows; ++r) x[r * n] += 100.0f * r;  // large means: the fp64 path matters
    auto dx = Upload(x), dw = Upload(w), db = Upload(b);
    auto dy = Zeros<float>(rows * n);
    cu::LayerNormParams p;
    p.x = dx.as<float>();
    p.x_stride = n;
    p.weight = dw.as<float>();
    p.bias = db.as<float>();
    p.y = dy.as<float>();
    p.y_stride = n;
    p.rows = rows;
    p.n = n;
    p.eps = 1e-6;
    LS_ASSERT_OK(cu::LayerNorm(p));
    // In place as well.
    p.y = dx.as<float>();
    LS_ASSERT_OK(cu::LayerNorm(p));
    LS_ASSERT_OK(cu::Synchronize());
    std::vector<float> want(rows * n);
    kernels::cpu::LayerNorm(x.data(), w.data(), b.data(), rows, n, 1e-6, want.data());
    EXPECT_TRUE(SameBitsOrBothNan(Download<float>(dy, rows * n), want, "layernorm " + Shape(rows, n)));
    EXPECT_TRUE(SameBitsOrBothNan(Download<float>(dx, rows * n), want, "layernorm in place " + Shape(rows, n)));
  }
}

// --- Route --------------------------------------------------------------------------------------

struct RouteConfig {
  const char* name;
  int64_t experts, k, n_group, topk_group;
  cu::GateKind gate;
  bool norm;
  float scale;
};

// The CPU's routing from the same logits (engine::RouteExperts, which the engine's forward
// pass calls after its router products).
void CpuRoute(const RouteConfig& c, const float* logits, const float* bias, int32_t* ids, float* w) {
  engine::ModelConfig mc;
  mc.n_routed_experts = c.experts;
  mc.num_experts_per_tok = c.k;
  mc.n_group = c.n_group;
  mc.topk_group = c.topk_group;
  mc.gate = static_cast<engine::GateKind>(c.gate);  // same enumerators (ops.h)
  mc.norm_topk_prob = c.norm;
  mc.routed_scaling_factor = c.scale;
  engine::RouteExperts(mc, c.gate == cu::GateKind::kSigmoidNoauxTc ? bias : nullptr, logits, ids, w);
}

struct RouteOut {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

RouteOut GpuRoute(const RouteConfig& c, const std::vector<float>& logits, int64_t stride, const std::vector<float>& bias,
                  int64_t rows) {
  auto dl = Upload(logits), db = Upload(bias);
  auto di = Zeros<int32_t>(rows * c.k);
  auto dw = Zeros<float>(rows * c.k);
  cu::RouteParams p;
  p.logits = dl.as<float>();
  p.logits_stride = stride;
  p.bias = c.gate == cu::GateKind::kSigmoidNoauxTc ? db.as<float>() : nullptr;
  p.rows = rows;
  p.experts = c.experts;
  p.k = c.k;
  p.n_group = c.n_group;
  p.topk_group = c.topk_group;
  p.gate = c.gate;
  p.norm_topk_prob = c.norm;
  p.routed_scaling_factor = c.scale;
  p.ids = di.as<int32_t>();
  p.weights = dw.as<float>();
  RouteOut o;
  const Status s = cu::Route(p);
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(cu::Synchronize().ok());
  o.ids = Download<int32_t>(di, rows * c.k);
  o.w = Download<float>(dw, rows * c.k);
  return o;
}

// Weights: each score is a few roundings from exp(·) (which may differ by one ulp, 2u); the
// softmax adds its fp64 sum and fp32 reciprocal and product (≤ 4u), the normalisation's fp64
// sum, conversion and quotient (≤ 3u each side), the scale u each side. 24u covers it.
TEST(CudaRoute, SameExpertsAsCpuAllGateKinds) {
  LS_REQUIRE_GPU();
  const RouteConfig configs[] = {
      {"v2-lite softmax greedy", 64, 6, 1, 1, cu::GateKind::kSoftmaxGreedy, false, 1.0f},
      {"v2 softmax group-limited", 160, 6, 8, 3, cu::GateKind::kSoftmaxGroupLimited, false, 16.0f},
      {"v3 sigmoid noaux_tc", 256, 8, 8, 4, cu::GateKind::kSigmoidNoauxTc, true, 2.5f},
      {"sigmoid, 1 group, norm", 64, 6, 1, 1, cu::GateKind::kSigmoidNoauxTc, true, 1.0f},
      {"softmax greedy k=E", 16, 16, 1, 1, cu::GateKind::kSoftmaxGreedy, true, 1.0f},
      // Past 256 experts the rounds run over shared memory instead of registers.
      {"softmax greedy, 384 experts", 384, 8, 1, 1, cu::GateKind::kSoftmaxGreedy, false, 1.0f},
      {"sigmoid noaux_tc, 512 experts", 512, 8, 8, 4, cu::GateKind::kSigmoidNoauxTc, true, 2.5f},
  };
  for (const RouteConfig& c : configs) {
    for (int ties = 0; ties < 2; ++ties) {
      const int64_t rows = 517, stride = c.experts + 3;
      std::vector<float> logits = Randn(rows * stride, 80 + c.experts + ties, 2.0f);
      std::vector<float> bias = Randn(c.experts, 90 + c.experts, 0.05f);
      if (ties) {  // coarse values: many exact ties, in logits, choices and group scores
        for (float& v : logits) v = std::round(v * 2.0f) / 2.0f;
        for (float& v : bias) v = std::round(v * 64.0f) / 64.0f;
      }
      for (int64_t i = 0; i < c.experts; ++i) logits[5 * stride + i] = -INFINITY;  // a fully masked row
      logits[7 * stride + 3] = std::nanf("");  // NaN logits: every score of the row NaN (softmax)
      logits[9 * stride + c.experts - 1] = std::nanf("");
      RouteOut got = GpuRoute(c, logits, stride, bias, rows);
      std::vector<int32_t> want_ids(rows * c.k);
      std::vector<float> want_w(rows * c.k);
      for (int64_t r = 0; r < rows; ++r) {
        CpuRoute(c, &logits[r * stride], bias.data(), &want_ids[r * c.k], &want_w[r * c.k]);
      }
      const std::string what = std::string(c.name) + (ties ? " (ties)" : "");
      EXPECT_TRUE(BitwiseEqual(got.ids, want_ids, what + " ids"));
      int64_t differ = 0;
      for (size_t i = 0; i < got.w.size(); ++i) {
        differ += !(std::isnan(got.w[i]) && std::isnan(want_w[i])) && std::memcmp(&got.w[i], &want_w[i], 4) != 0;
      }
      std::printf("  [%s] %lld of %zu weights differ in bits (NaN for NaN counts as equal)\n", what.c_str(),
                  static_cast<long long>(differ), got.w.size());
      EXPECT_TRUE(AllClose(got.w, want_w, [&](size_t i) { return 24 * kU32 * std::fabs(want_w[i]); }, what + " weights"));
      // Both round a double exp once (cpu::ExpF): the weights are the CPU's bits.
      EXPECT_TRUE(SameBitsOrBothNan(got.w, want_w, what + " weights, bitwise"));
      // Batch invariance: rows 0, 5, 300 routed alone.
      for (int64_t r : {0, 5, 300}) {
        std::vector<float> one(logits.begin() + r * stride, logits.begin() + (r + 1) * stride);
        RouteOut alone = GpuRoute(c, one, stride, bias, 1);
        EXPECT_TRUE(BitwiseEqual(alone.ids, std::vector<int32_t>(got.ids.begin() + r * c.k, got.ids.begin() + (r + 1) * c.k),
                                 what + " ids alone, row " + std::to_string(r)));
        EXPECT_TRUE(BitwiseEqual(alone.w, std::vector<float>(got.w.begin() + r * c.k, got.w.begin() + (r + 1) * c.k),
                                 what + " weights alone, row " + std::to_string(r)));
      }
    }
  }
}

// NormRoute is RmsNorm (with the residual add), RowDots and Route in one launch: each of its
// outputs — the sum, h, the router logits, the ids and weights — bit for bit the three
// kernels', for every gate kind, one and several rows, ties, and the sum written over x (the
// engine's buffers alias when there is no tap slab). The outputs start as garbage.
TEST(CudaNormRoute, IsRmsNormRowDotsThenRoute) {
  LS_REQUIRE_GPU();
  struct Case {
    RouteConfig c;
    int64_t n;
  };
  const Case cases[] = {
      {{"v2-lite softmax greedy", 64, 6, 1, 1, cu::GateKind::kSoftmaxGreedy, false, 1.0f}, 2048},
      {{"group-limited, 128 experts", 128, 6, 8, 3, cu::GateKind::kSoftmaxGroupLimited, false, 16.0f}, 1024},
      {{"sigmoid noaux_tc, groups, norm", 48, 8, 4, 2, cu::GateKind::kSigmoidNoauxTc, true, 2.5f}, 512},
      {{"7 experts, k 2", 7, 2, 1, 1, cu::GateKind::kSoftmaxGreedy, true, 1.0f}, 4096},
  };
  uint64_t seed = 8800;
  for (const Case& tc : cases) {
    const RouteConfig& c = tc.c;
    const int64_t n = tc.n, E = c.experts;
    ASSERT_TRUE(cu::NormRouteFits(E, n, 5)) << c.name;
    for (const int64_t rows : {1, 5}) {
      for (const bool alias : {false, true}) {
        for (int ties = 0; ties < 2; ++ties) {
          seed += 10;
          std::vector<float> x = Randn(rows * n, seed, 1.0f), b = Randn(rows * n, seed + 1, 1.0f);
          std::vector<float> w = Randn(n, seed + 2, 0.3f), router = Randn(E * n, seed + 3, 0.05f);
          std::vector<float> bias = Randn(E, seed + 4, 0.05f);
          if (ties) {  // coarse inputs and router: exact ties among the logits
            for (float& v : x) v = std::round(v * 2.0f) / 2.0f;
            for (float& v : b) v = std::round(v * 2.0f) / 2.0f;
            for (float& v : router) v = std::round(v * 8.0f) / 64.0f;
          }
          const std::string what = std::string(c.name) + " rows " + std::to_string(rows) +
                                   (alias ? " sum over x" : "") + (ties ? " ties" : "");
          auto route = [&](float* logits, int32_t* ids, float* wts) {
            cu::RouteParams rp;
            rp.logits = logits, rp.logits_stride = E;
            rp.rows = rows, rp.experts = E, rp.k = c.k, rp.n_group = c.n_group, rp.topk_group = c.topk_group;
            rp.gate = c.gate, rp.norm_topk_prob = c.norm, rp.routed_scaling_factor = c.scale;
            rp.ids = ids, rp.weights = wts;
            return rp;
          };
          cu::DeviceBuffer dbias = Upload(bias), dw = Upload(w), drouter = Upload(router), db = Upload(b);
          // The three kernels.
          cu::DeviceBuffer x1 = Upload(x), sum1 = Zeros<float>(rows * n), h1 = Zeros<float>(rows * n);
          cu::DeviceBuffer lg1 = Zeros<float>(rows * E), ids1 = Zeros<int32_t>(rows * c.k);
          cu::DeviceBuffer w1 = Zeros<float>(rows * c.k);
          cu::RmsNormParams nm;
          nm.x = x1.as<float>(), nm.x_stride = n, nm.weight = dw.as<float>(), nm.y = h1.as<float>(), nm.y_stride = n;
          nm.rows = rows, nm.n = n, nm.eps = 1e-6f;
          nm.add = db.as<float>(), nm.add_stride = n, nm.sum = sum1.as<float>(), nm.sum_stride = n;
          ASSERT_TRUE(cu::RmsNorm(nm).ok());
          cu::RowDotsParams rd;
          rd.x = h1.as<float>(), rd.x_stride = n, rd.w = drouter.as<float>(), rd.w_stride = n;
          rd.y = lg1.as<float>(), rd.y_stride = E, rd.rows = rows, rd.outs = E, rd.n = n;
          ASSERT_TRUE(cu::RowDots(rd).ok());
          cu::RouteParams rp1 = route(lg1.as<float>(), ids1.as<int32_t>(), w1.as<float>());
          if (c.gate == cu::GateKind::kSigmoidNoauxTc) rp1.bias = dbias.as<float>();
          ASSERT_TRUE(cu::Route(rp1).ok());
          // NormRoute, into garbage.
          cu::DeviceBuffer x2 = Upload(x);
          cu::DeviceBuffer sum2 = Upload(std::vector<float>(rows * n, std::nanf("")));
          cu::DeviceBuffer h2 = Upload(std::vector<float>(rows * n, std::nanf("")));
          cu::DeviceBuffer lg2 = Upload(std::vector<float>(rows * E, std::nanf("")));
          cu::DeviceBuffer ids2 = Upload(std::vector<int32_t>(rows * c.k, -5));
          cu::DeviceBuffer w2 = Upload(std::vector<float>(rows * c.k, std::nanf("")));
          cu::NormRouteParams nr;
          nr.norm = nm;
          nr.norm.x = x2.as<float>();
          nr.norm.y = h2.as<float>();
          nr.norm.sum = alias ? x2.as<float>() : sum2.as<float>();
          nr.router = drouter.as<float>(), nr.router_stride = n;
          nr.logits = lg2.as<float>(), nr.logits_stride = E;
          nr.route = route(nullptr, ids2.as<int32_t>(), w2.as<float>());
          if (c.gate == cu::GateKind::kSigmoidNoauxTc) nr.route.bias = dbias.as<float>();
          const Status st = cu::NormRoute(nr);
          ASSERT_TRUE(st.ok()) << what << ": " << st.message();
          ASSERT_TRUE(cu::Synchronize().ok());
          EXPECT_TRUE(BitwiseEqual(Download<float>(alias ? x2 : sum2, rows * n), Download<float>(sum1, rows * n),
                                   what + " sum"));
          EXPECT_TRUE(BitwiseEqual(Download<float>(h2, rows * n), Download<float>(h1, rows * n), what + " h"));
          EXPECT_TRUE(BitwiseEqual(Download<float>(lg2, rows * E), Download<float>(lg1, rows * E), what + " logits"));
          EXPECT_TRUE(BitwiseEqual(Download<int32_t>(ids2, rows * c.k), Download<int32_t>(ids1, rows * c.k),
                                   what + " ids"));
          EXPECT_TRUE(
              BitwiseEqual(Download<float>(w2, rows * c.k), Download<float>(w1, rows * c.k), what + " weights"));
        }
      }
    }
  }
}

// --- MoeCombine -----------------------------------------------------------------------------

TEST(CudaMoeCombine, BitwiseCpuLoop) {
  LS_REQUIRE_GPU();
  for (int with_shared = 0; with_shared < 2; ++with_shared) {
    const int64_t rows = 19, k = 6, n = 2048, ys = n + 4, ss = n + 2, os = n + 1;
    std::vector<float> y = Randn(rows * k * ys, 300), w = Randn(rows * k, 301), shared = Randn(rows * ss, 302);
    y[5] = NAN;
    auto dy = Upload(y), dw = Upload(w), dsh = Upload(shared);
    auto dout = Zeros<float>(rows * os);
    cu::MoeCombineParams p;
    p.y = dy.as<float>();
    p.y_stride = ys;
    p.weights = dw.as<float>();
    p.shared = with_shared ? dsh.as<float>() : nullptr;
    p.shared_stride = ss;
    p.out = dout.as<float>();
    p.out_stride = os;
    p.rows = rows;
    p.k = k;
    p.n = n;
    LS_ASSERT_OK(cu::MoeCombine(p));
    LS_ASSERT_OK(cu::Synchronize());
    std::vector<float> want(rows * os, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      float* orow = &want[r * os];
      std::fill(orow, orow + n, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float wj = w[r * k + j];
        const float* yr = &y[(r * k + j) * ys];
        for (int64_t i = 0; i < n; ++i) orow[i] += yr[i] * wj;
      }
      if (with_shared) {
        for (int64_t i = 0; i < n; ++i) orow[i] += shared[r * ss + i];
      }
    }
    EXPECT_TRUE(SameBitsOrBothNan(Download<float>(dout, rows * os), want,
                                  with_shared ? "combine + shared" : "combine"));
  }
}

// MoeCombineNorm is MoeCombine, the residual add and RmsNorm in one launch: its out, sum and y
// bit for bit those kernels' (RmsNorm with add over x and out), with and without shared
// experts, rows not a multiple of the cluster's slices, the sum written over x, and NaN in.
TEST(CudaMoeCombineNorm, IsMoeCombineThenAddNorm) {
  LS_REQUIRE_GPU();
  uint64_t seed = 9300;
  for (const int64_t n : {2048, 1000, 7, 4096}) {
    ASSERT_TRUE(cu::MoeCombineNormFits(n, 3));
    for (const int64_t rows : {1, 3}) {
      for (int with_shared = 0; with_shared < 2; ++with_shared) {
        for (const bool alias : {false, true}) {
          seed += 10;
          const int64_t k = 6, ys = n + 4, ss = n + 2, os = n + 1;
          std::vector<float> y = Randn(rows * k * ys, seed), w = Randn(rows * k, seed + 1);
          std::vector<float> shared = Randn(rows * ss, seed + 2), x = Randn(rows * n, seed + 3, 4.0f);
          std::vector<float> nw = Randn(n, seed + 4, 0.5f);
          if (n == 1000 && rows == 3) y[ys + 17] = NAN;  // row 0 slot 1: NaN through all three outputs of row 0
          const std::string what = "n " + std::to_string(n) + " rows " + std::to_string(rows) +
                                   (with_shared ? " shared" : "") + (alias ? " sum over x" : "");
          cu::DeviceBuffer dy = Upload(y), dw = Upload(w), dsh = Upload(shared), dnw = Upload(nw);
          cu::MoeCombineParams mc;
          mc.y = dy.as<float>(), mc.y_stride = ys, mc.weights = dw.as<float>();
          mc.shared = with_shared ? dsh.as<float>() : nullptr, mc.shared_stride = ss;
          mc.out_stride = os, mc.rows = rows, mc.k = k, mc.n = n;
          // The two kernels.
          cu::DeviceBuffer out1 = Zeros<float>(rows * os), x1 = Upload(x), sum1 = Zeros<float>(rows * n);
          cu::DeviceBuffer y1 = Zeros<float>(rows * n);
          mc.out = out1.as<float>();
          LS_ASSERT_OK(cu::MoeCombine(mc));
          cu::RmsNormParams nm;
          nm.x = x1.as<float>(), nm.x_stride = n, nm.add = out1.as<float>(), nm.add_stride = os;
          nm.sum = sum1.as<float>(), nm.sum_stride = n, nm.weight = dnw.as<float>();
          nm.y = y1.as<float>(), nm.y_stride = n, nm.rows = rows, nm.n = n, nm.eps = 1e-6f;
          LS_ASSERT_OK(cu::RmsNorm(nm));
          // The one launch, into garbage.
          cu::DeviceBuffer out2 = Upload(std::vector<float>(rows * os, 7.0f)), x2 = Upload(x);
          cu::DeviceBuffer sum2 = Upload(std::vector<float>(rows * n, 7.0f));
          cu::DeviceBuffer y2 = Upload(std::vector<float>(rows * n, 7.0f));
          cu::MoeCombineNormParams cn;
          cn.combine = mc;
          cn.combine.out = out2.as<float>();
          cn.x = x2.as<float>(), cn.x_stride = n;
          cn.sum = alias ? x2.as<float>() : sum2.as<float>(), cn.sum_stride = n;
          cn.weight = dnw.as<float>(), cn.eps = 1e-6f;
          cn.y = y2.as<float>(), cn.y_stride = n;
          const Status st = cu::MoeCombineNorm(cn);
          ASSERT_TRUE(st.ok()) << what << ": " << st.message();
          LS_ASSERT_OK(cu::Synchronize());
          // out's rows: n values, then a stride's padding neither kernel writes.
          auto rows_of = [&](const std::vector<float>& v) {
            std::vector<float> o;
            for (int64_t r = 0; r < rows; ++r) o.insert(o.end(), v.begin() + r * os, v.begin() + r * os + n);
            return o;
          };
          EXPECT_TRUE(SameBitsOrBothNan(rows_of(Download<float>(out2, rows * os)),
                                        rows_of(Download<float>(out1, rows * os)), what + " out"));
          EXPECT_TRUE(SameBitsOrBothNan(Download<float>(alias ? x2 : sum2, rows * n), Download<float>(sum1, rows * n),
                                        what + " sum"));
          EXPECT_TRUE(SameBitsOrBothNan(Download<float>(y2, rows * n), Download<float>(y1, rows * n), what + " y"));
        }
      }
    }
  }
}

// --- validation ---------------------------------------------------------------------------------

TEST(CudaModelOps, ValidationNamesTheField) {
  // Host-side checks: no device needed.
  cu::ExpertGemmParams p;
  p.rows = 1;
  p.k = 6;
  p.experts = 64;
  p.out = 16;
  p.in = 32;
  int32_t dummy = 0;
  float f = 0;
  p.w = &dummy;
  p.x = &f;
  p.ids = &dummy;
  p.y = &f;
  p.w_row_stride = 31;
  Status s = cu::ExpertGemm(p);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("w_row_stride"), std::string::npos) << s.message();
  // FP8 weights need their scales, a row's worth per 128 columns.
  p.w_row_stride = 32;
  p.w_expert_stride = 16 * 32;
  p.x_stride = 32;
  p.y_stride = 16;
  p.w_fp8 = true;
  s = cu::ExpertGemm(p);
  EXPECT_NE(s.message().find("w_scale"), std::string::npos) << s.message();
  p.w_scale = &f;
  s = cu::ExpertGemm(p);
  EXPECT_NE(s.message().find("w_scale_row_stride"), std::string::npos) << s.message();
  p.w_bf16 = true;
  s = cu::ExpertGemm(p);
  EXPECT_NE(s.message().find("w_fp8"), std::string::npos) << s.message();

  cu::RouteParams r;
  r.logits = &f;
  r.ids = &dummy;
  r.weights = &f;
  r.rows = 1;
  r.experts = 64;
  r.logits_stride = 64;
  r.k = 6;
  r.gate = cu::GateKind::kSigmoidNoauxTc;
  r.n_group = 8;
  r.topk_group = 0;
  s = cu::Route(r);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("topk_group"), std::string::npos) << s.message();
  // NormRoute takes only routers that fit its cluster's shared memory, and names what does not.
  EXPECT_TRUE(cu::NormRouteFits(64, 2048, 1));
  EXPECT_FALSE(cu::NormRouteFits(256, 7168, 1));    // V3's router: RowDots and Route instead
  EXPECT_FALSE(cu::NormRouteFits(64, 2050, 1));     // rows of whole 16-byte chunks only
  EXPECT_FALSE(cu::NormRouteFits(64, 2048, 70000));  // a prefill chunk past the grid's 65535 rows
  cu::NormRouteParams nr;
  nr.norm.x = &f, nr.norm.add = &f, nr.norm.sum = &f, nr.norm.y = &f, nr.norm.weight = &f;
  nr.norm.rows = 1, nr.norm.n = 7168;
  nr.norm.x_stride = nr.norm.add_stride = nr.norm.sum_stride = nr.norm.y_stride = 7168;
  nr.route = r;
  nr.route.experts = 256;
  s = cu::NormRoute(nr);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("NormRouteFits"), std::string::npos) << s.message();
  EXPECT_FALSE(cu::MoeCombineNormFits(7168, 1));  // V3's rows: MoeCombine and RmsNorm instead
  EXPECT_FALSE(cu::MoeCombineNormFits(2048, 70000));
  cu::MoeCombineNormParams cn;
  cn.combine.y = &f, cn.combine.weights = &f, cn.combine.out = &f, cn.combine.rows = 1, cn.combine.k = 8;
  cn.combine.n = 7168;
  s = cu::MoeCombineNorm(cn);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("combine.n"), std::string::npos) << s.message();

  cu::LayerNormParams l;
  l.x = &f;
  l.weight = &f;
  l.y = &f;
  l.rows = 1;
  l.n = 4;
  l.x_stride = l.y_stride = 4;
  s = cu::LayerNorm(l);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("bias"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace lockstep
