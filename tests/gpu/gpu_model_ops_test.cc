// tests/gpu/gpu_model_ops_test.cc — kernels/cuda/model_ops.cu and expert_gemm*.cu against their
// CPU twins on fresh seeded inputs: embedding, residual add, scale, bf16 conversion, SwiGLU,
// LayerNorm, MoE routing, the grouped expert GEMM and the MoE combine. Bitwise where the CPU's operation
// sequence is reproduced; a derived bound where expf's rounding may differ; NaN positions
// always equal; batch invariance and the device error flags.
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
// Bit for bit the CPU's (both round exp once from a double; until 2026-11-30 the CPU used
// glibc's expf and 43 of 180k elements differed, all within 8u), NaN where it has NaN.
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

// --- ExpertGemm -------------------------------------------------------------------------------

struct GemmCase {
  int64_t rows, k, experts, out, in;
  bool w_bf16, x_per_slot, round_x;
  int64_t pad;  // extra elements per weight row (pad 1 breaks 16-byte alignment)
  bool w_fp8 = false;  // FP8 e4m3 weights with a scale per row and 128 columns (w_bf16 false)
};

std::string Name(const GemmCase& g) {
  return "rows=" + std::to_string(g.rows) + " k=" + std::to_string(g.k) + " E=" + std::to_string(g.experts) +
         " out=" + std::to_string(g.out) + " in=" + std::to_string(g.in) +
         (g.w_fp8 ? " fp8" : g.w_bf16 ? " bf16" : " fp32") +
         (g.x_per_slot ? " per-slot" : "") + (g.round_x ? " round-x" : "") + " pad=" + std::to_string(g.pad);
}

struct GemmData {
  GemmCase g;
  int64_t rs, es, xs, ys, xrows;
  std::vector<float> w;        // fp32 values (bf16-exact when w_bf16; FP8's dequantised values when w_fp8)
  std::vector<uint16_t> w16;   // bf16 bits when w_bf16
  std::vector<uint8_t> w8;     // e4m3 bytes when w_fp8
  std::vector<float> scales;   // w_fp8: [experts][out][srs] (row stride srs, expert stride ses)
  int64_t srs = 0, ses = 0;
  std::vector<float> x;
  std::vector<int32_t> ids;
};

GemmData MakeGemm(const GemmCase& g, uint64_t seed) {
  GemmData d;
  d.g = g;
  d.rs = g.in + g.pad;
  d.es = g.out * d.rs + 16;
  d.xrows = g.x_per_slot ? g.rows * g.k : g.rows;
  d.xs = g.in + 2;
  d.ys = g.out + 1;
  d.w = Randn(g.experts * d.es, seed, 0.05f);
  if (g.w_bf16) {
    d.w16.resize(d.w.size());
    for (size_t i = 0; i < d.w.size(); ++i) {
      d.w16[i] = kernels::F32ToBf16(d.w[i]);
      d.w[i] = kernels::Bf16ToF32(d.w16[i]);
    }
  }
  if (g.w_fp8) {
    // Each row's 128-column chunks quantised on their own amax (DeepSeek's amax / 448), scales
    // padded apart (srs > chunks, ses > out·srs) to exercise the strides; `w` becomes the exact
    // dequantisation, value × scale in fp32 — the CPU's definition (engine/weights.h).
    const int64_t chunks = (g.in + 127) / 128;
    d.srs = chunks + 1;
    d.ses = g.out * d.srs + 3;
    d.scales.assign(g.experts * d.ses, 0.0f);
    d.w8.assign(d.w.size(), 0);
    for (int64_t e = 0; e < g.experts; ++e) {
      for (int64_t o = 0; o < g.out; ++o) {
        for (int64_t j = 0; j < chunks; ++j) {
          const int64_t base = e * d.es + o * d.rs, c0 = 128 * j, c1 = std::min(g.in, c0 + 128);
          float amax = 0.0f;
          for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(d.w[base + c]));
          const float sc = amax > 0 ? amax / 448.0f : 1.0f;
          d.scales[e * d.ses + o * d.srs + j] = sc;
          for (int64_t c = c0; c < c1; ++c) {
            d.w8[base + c] = kernels::F32ToFp8E4m3(d.w[base + c] / sc);
            d.w[base + c] = kernels::Fp8E4m3ToF32(d.w8[base + c]) * sc;
          }
        }
      }
    }
  }
  d.x = Randn(d.xrows * d.xs, seed + 1, 1.0f);
  std::mt19937_64 rng(seed + 2);
  d.ids.resize(g.rows * g.k);
  for (int64_t r = 0; r < g.rows; ++r) {  // k distinct experts per row, ascending, like Route
    std::vector<int32_t> all(g.experts);
    for (int64_t e = 0; e < g.experts; ++e) all[e] = static_cast<int32_t>(e);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + g.k);
    std::copy(all.begin(), all.begin() + g.k, d.ids.begin() + r * g.k);
  }
  return d;
}

struct GemmRun {
  std::vector<float> y;
  int32_t flag = 0;
};

GemmRun GpuExpertGemm(const GemmData& d, const std::vector<int32_t>& ids, int64_t rows, const float* x_host,
                      cu::ExpertGemmParams::Launch launch = cu::ExpertGemmParams::Launch::kAuto,
                      int64_t swiglu_inter = 0, bool tensor_cores = false) {
  const GemmCase& g = d.g;
  cu::DeviceBuffer dw = g.w_fp8 ? Upload(d.w8) : g.w_bf16 ? Upload(d.w16) : Upload(d.w);
  cu::DeviceBuffer dscale = Upload(g.w_fp8 ? d.scales : std::vector<float>(1, 0.0f));
  const int64_t xrows = g.x_per_slot ? rows * g.k : rows;
  auto dx = Upload(std::vector<float>(x_host, x_host + xrows * d.xs));
  auto di = Upload(ids);
  auto dy = Zeros<float>(rows * g.k * d.ys);
  auto flag = Zeros<int32_t>(1);
  cu::ExpertGemmParams p;
  p.rows = rows;
  p.k = g.k;
  p.experts = g.experts;
  p.out = g.out;
  p.in = g.in;
  p.w = dw.data();
  p.w_bf16 = g.w_bf16;
  p.w_fp8 = g.w_fp8;
  p.w_expert_stride = d.es;
  p.w_row_stride = d.rs;
  if (g.w_fp8) {
    p.w_scale = dscale.as<float>();
    p.w_scale_row_stride = d.srs;
    p.w_scale_expert_stride = d.ses;
  }
  p.x = dx.as<float>();
  p.x_stride = d.xs;
  p.x_per_slot = g.x_per_slot;
  p.round_x_bf16 = g.round_x;
  p.ids = di.as<int32_t>();
  p.y = dy.as<float>();
  p.y_stride = d.ys;
  p.error_flag = flag.as<int32_t>();
  p.launch = launch;
  p.swiglu_inter = swiglu_inter;
  p.tensor_cores = tensor_cores;
  GemmRun run;
  const Status s = cu::ExpertGemm(p);
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(cu::Synchronize().ok());
  run.y = Download<float>(dy, rows * g.k * d.ys);
  run.flag = ReadFlag(flag);
  return run;
}

// Each y element is cpu::Dot (16 FMA chains, pairwise fold) of the (rounded) x row and the
// weight row: bitwise cpu::MatMulNT. Independently, against an fp64 product, the standard
// bound for a sum of `in` products: |Δ| ≤ (in + 1)·u·Σ|w·x| (a chain of in/16 FMAs plus a
// 4-level fold is far shorter; the bound is the conservative textbook one).
TEST(CudaExpertGemm, BitwiseCpuMatMulAndWithinFp64Bound) {
  LS_REQUIRE_GPU();
  const GemmCase cases[] = {
      {1, 6, 64, 2816, 2048, true, false, true, 0},    // V2-Lite gate+up decode (per-slot grid)
      {3, 6, 64, 2816, 2048, true, false, true, 0},    // 18 slots: the per-expert grid
      {64, 6, 64, 300, 1408, true, true, true, 0},     // down projection, per-slot x
      {5, 2, 4, 70, 37, false, false, false, 1},       // odd `in`, unaligned rows: element loads
      {33, 3, 5, 129, 1040, false, true, false, 0},    // fp32 vector loads, in = 1024 + 16
      {9, 4, 8, 65, 2100, true, false, false, 3},      // bf16 unaligned, tail over two tiles
      {200, 8, 16, 64, 256, true, false, true, 0},     // many slots per expert: > 8 per chunk
      // Heads as experts (k = experts = 16: every row's ids are 0..15): the absorbed W_UK
      // (out 512, in 128) and W_UV (out 128, in 512) products, batched and decode.
      {64, 16, 16, 512, 128, true, true, true, 0},
      {64, 16, 16, 128, 512, true, true, false, 0},
      {1, 16, 16, 512, 128, true, true, true, 0},
      {1, 16, 16, 128, 512, true, true, true, 0},
      {40, 1, 1, 64, 2048, true, false, true, 0},      // the router: one "expert", one slot per row
      {7, 6, 64, 96, 1416, true, false, true, 0},      // aligned bf16, in % 16 = 8: the register path
  };
  uint64_t seed = 1000;
  for (const GemmCase& g : cases) {
    GemmData d = MakeGemm(g, seed += 10);
    GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data());
    EXPECT_EQ(got.flag, 0) << Name(g);
    std::vector<float> want(got.y.size(), 0.0f), bound(got.y.size(), 0.0);
    std::vector<double> exact(got.y.size(), 0.0);
    std::vector<float> xr(g.in);
    for (int64_t r = 0; r < g.rows; ++r) {
      for (int64_t j = 0; j < g.k; ++j) {
        const int64_t slot = r * g.k + j, e = d.ids[slot];
        const float* xrow = &d.x[(g.x_per_slot ? slot : r) * d.xs];
        for (int64_t i = 0; i < g.in; ++i) {
          xr[i] = g.round_x ? kernels::Bf16ToF32(kernels::F32ToBf16(xrow[i])) : xrow[i];
        }
        kernels::cpu::MatMulNTStrided(xr.data(), g.in, 1, &d.w[e * d.es], d.rs, g.out, g.in, &want[slot * d.ys], 1);
        for (int64_t o = 0; o < g.out; ++o) {
          double s = 0, a = 0;
          const float* wr = &d.w[e * d.es + o * d.rs];
          for (int64_t i = 0; i < g.in; ++i) {
            s += static_cast<double>(wr[i]) * xr[i];
            a += std::fabs(static_cast<double>(wr[i]) * xr[i]);
          }
          exact[slot * d.ys + o] = s;
          bound[slot * d.ys + o] = static_cast<float>((g.in + 1) * kU32 * a);
        }
      }
    }
    EXPECT_TRUE(SameBitsOrBothNan(got.y, want, "expert gemm vs cpu::MatMulNT " + Name(g)));
    double worst = 0;
    for (size_t i = 0; i < got.y.size(); ++i) {
      if (bound[i] > 0) worst = std::max(worst, std::fabs(got.y[i] - exact[i]) / bound[i]);
    }
    EXPECT_LE(worst, 1.0) << Name(g);
    std::printf("  [expert gemm %s] bitwise cpu; worst |y − fp64| / ((in+1)·u·Σ|w·x|) = %.3g\n", Name(g).c_str(),
                worst);

    // Batch invariance: a row computed alone gives the bits it had in the batch.
    for (int64_t r : {int64_t{0}, g.rows - 1}) {
      const std::vector<int32_t> one(d.ids.begin() + r * g.k, d.ids.begin() + (r + 1) * g.k);
      const float* x_one = &d.x[(g.x_per_slot ? r * g.k : r) * d.xs];
      GemmRun alone = GpuExpertGemm(d, one, 1, x_one);
      EXPECT_TRUE(BitwiseEqual(alone.y,
                               std::vector<float>(got.y.begin() + r * g.k * d.ys, got.y.begin() + (r + 1) * g.k * d.ys),
                               "expert gemm row " + std::to_string(r) + " alone vs batch " + Name(g)));
    }
  }
}

// cpu::MatMulNT of every slot: the bits every launch shape must give.
std::vector<float> CpuExpertGemm(const GemmData& d) {
  const GemmCase& g = d.g;
  std::vector<float> want(g.rows * g.k * d.ys, 0.0f), xr(g.in);
  for (int64_t slot = 0; slot < g.rows * g.k; ++slot) {
    const float* xrow = &d.x[(g.x_per_slot ? slot : slot / g.k) * d.xs];
    for (int64_t i = 0; i < g.in; ++i) xr[i] = g.round_x ? kernels::Bf16ToF32(kernels::F32ToBf16(xrow[i])) : xrow[i];
    kernels::cpu::MatMulNTStrided(xr.data(), g.in, 1, &d.w[d.ids[slot] * d.es], d.rs, g.out, g.in,
                                  &want[slot * d.ys], 1);
  }
  return want;
}

// The launch shape is speed only: every shape ExpertGemm can take — forced — gives
// cpu::MatMulNT's bits, for dense layers (one "expert": gemm=*_dot) at decode and prefill row
// counts and for MoE. The cp.async shapes refuse operands they cannot stream.
TEST(CudaExpertGemm, EveryLaunchShapeGivesTheSameBits) {
  LS_REQUIRE_GPU();
  using L = cu::ExpertGemmParams::Launch;
  const GemmCase cases[] = {
      {1, 1, 1, 3072, 2048, true, false, true, 0},   // V2-Lite q_proj at batch 1
      {5, 1, 1, 576, 2048, true, false, true, 0},    // kv_a_proj, a few rows
      {70, 1, 1, 200, 1408, true, false, true, 0},   // more rows than a chunk, tail tile
      {4, 6, 64, 352, 512, true, false, true, 0},    // MoE decode
      {50, 6, 8, 96, 1024, true, true, false, 0},    // MoE crowded, per-slot x
      {3, 1, 1, 40, 72, false, false, false, 1},     // fp32, unaligned: register shapes only
      {1, 1, 1, 200, 4352, true, false, true, 0},    // streaming: 17 blocks > the ring, two x tiles
      {2, 3, 5, 40, 1408, true, true, true, 0},      // streaming: per-slot x, half a last block
      {1, 6, 8, 2048, 1408, true, true, true, 0},    // routed down at one token: 768 CTAs, a 3-deep ring refilled
      {1, 1, 1, 42, 10944, true, false, true, 0},    // a warp with 2 rows; 22 blocks over 3 x tiles (layer 0's down)
      // FP8 weights (gemm=fp8_dot): every shape but the streaming one (bf16 only), which refuses them.
      {1, 1, 1, 3072, 2048, false, false, false, 0, true},   // q_proj at batch 1
      {5, 1, 1, 576, 2048, false, false, false, 0, true},    // kv_a_proj, a few rows
      {4, 6, 64, 352, 512, false, false, false, 0, true},    // MoE decode
      {50, 6, 8, 96, 1024, false, true, false, 0, true},     // MoE crowded, per-slot x
      {1, 1, 1, 42, 10944, false, false, false, 0, true},    // 22 blocks over 3 x tiles, 86 scale chunks
      {2, 3, 5, 40, 1408, false, true, false, 0, true},      // half a last block, 11 chunks
      {1, 6, 8, 2048, 1408, false, true, false, 0, true},    // routed down at one token
      {3, 1, 1, 40, 200, false, false, false, 1, true},      // unaligned rows, a partial chunk: register only
  };
  const L all[] = {L::kAuto,        L::kRegBySlot,  L::kRegChunk,   L::kFastBySlot4,
                   L::kFastChunk4,  L::kFastBySlot1, L::kFastChunk1, L::kStreamBySlot, L::kBulkBySlot};
  uint64_t seed = 5000;
  for (const GemmCase& g : cases) {
    GemmData d = MakeGemm(g, seed += 10);
    const std::vector<float> want = CpuExpertGemm(d);
    const bool aligned = g.pad == 0 && g.in % 16 == 0;
    for (L launch : all) {
      const bool fast = launch >= L::kFastBySlot4;
      const bool fast_ok = aligned && (g.w_bf16 || (g.w_fp8 && launch != L::kStreamBySlot));
      const std::string what = Name(g) + " launch " + std::to_string(static_cast<int>(launch));
      if (fast && !fast_ok) {
        // Refused with a named field, before any launch.
        cu::ExpertGemmParams p;
        p.rows = g.rows, p.k = g.k, p.experts = g.experts, p.out = g.out, p.in = g.in;
        p.w = reinterpret_cast<const void*>(uintptr_t{16});  // never dereferenced: the check comes first
        p.w_bf16 = g.w_bf16, p.w_expert_stride = d.es, p.w_row_stride = d.rs;
        p.w_fp8 = g.w_fp8, p.w_scale = reinterpret_cast<const float*>(uintptr_t{16});
        p.w_scale_row_stride = d.srs, p.w_scale_expert_stride = d.ses;
        p.x = reinterpret_cast<const float*>(uintptr_t{16}), p.x_stride = d.xs;
        p.ids = reinterpret_cast<const int32_t*>(uintptr_t{16});
        p.y = reinterpret_cast<float*>(uintptr_t{16}), p.y_stride = d.ys;
        p.launch = launch;
        const Status st = cu::ExpertGemm(p);
        EXPECT_FALSE(st.ok()) << what;
        EXPECT_NE(st.message().find("launch"), std::string::npos) << st.message();
        continue;
      }
      GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), launch);
      EXPECT_EQ(got.flag, 0) << what;
      EXPECT_TRUE(SameBitsOrBothNan(got.y, want, "expert gemm vs cpu::MatMulNT, " + what));
    }
  }
}

// With fixed ids the streaming GEMV requests its weights before the kernel launched just before
// it has finished (kernels/cuda/launch.cuh); its x must still be that kernel's output. Here that
// kernel is a long Scale (× 2, exact) over 256 MB whose last row is x: a GEMV that read x before
// its wait would see x / 2 (or a mix) and miss cpu::MatMulNT's bits.
TEST(CudaExpertGemm, StreamingGemvReadsXOnlyAfterTheKernelBefore) {
  LS_REQUIRE_GPU();
  std::printf("  overlapped launch: %s\n", cu::OverlappedLaunch() ? "on" : "off (device before sm_90)");
  auto stream = cu::CudaStream::Create();
  ASSERT_TRUE(stream.ok()) << stream.status().message();
  const cu::Stream s = (*stream)->get();
  const GemmCase g{1, 1, 1, 2048, 2048, true, false, true, 0};
  const GemmData d = MakeGemm(g, 9100);
  const std::vector<float> want = CpuExpertGemm(d);
  const int64_t n = d.xs, filler = (int64_t{64} << 20) / n;  // rows before x's
  std::vector<float> halves((filler + 1) * n, 1.0f);
  for (int64_t i = 0; i < n; ++i) halves[filler * n + i] = d.x[i] * 0.5f;
  cu::DeviceBuffer big = Upload(halves);
  cu::DeviceBuffer dw = Upload(d.w16);
  cu::DeviceBuffer ids = Zeros<int32_t>(1);
  cu::DeviceBuffer dy = Zeros<float>(d.ys);
  cu::ExpertGemmParams p;
  p.rows = 1, p.k = 1, p.experts = 1, p.out = g.out, p.in = g.in;
  p.w = dw.data(), p.w_bf16 = true, p.w_expert_stride = d.es, p.w_row_stride = d.rs;
  p.x = big.as<float>() + filler * n, p.x_stride = n, p.round_x_bf16 = true;
  p.ids = ids.as<int32_t>(), p.ids_fixed = true;
  p.y = dy.as<float>(), p.y_stride = d.ys;
  using L = cu::ExpertGemmParams::Launch;
  for (L launch : {L::kStreamBySlot, L::kBulkBySlot, L::kAuto}) {
    p.launch = launch;
    for (int rep = 0; rep < 4; ++rep) {
      ASSERT_TRUE(cu::CopyAsync(big.data(), halves.data(), halves.size() * sizeof(float), s).ok());
      ASSERT_TRUE(cu::MemsetAsync(dy.data(), 0xff, d.ys * sizeof(float), s).ok());  // NaNs until written
      ASSERT_TRUE(cu::Scale(big.as<float>(), n, filler + 1, n, 2.0f, s).ok());
      ASSERT_TRUE(cu::ExpertGemm(p, s).ok());
      ASSERT_TRUE((*stream)->Synchronize().ok());
      const std::vector<float> y = Download<float>(dy, d.ys);
      EXPECT_TRUE(SameBitsOrBothNan(std::vector<float>(y.begin(), y.begin() + g.out),
                                    std::vector<float>(want.begin(), want.begin() + g.out),
                                    "launch " + std::to_string(static_cast<int>(launch)) + " rep " +
                                        std::to_string(rep)));
    }
  }
}

// The SwiGLU epilogue (swiglu_inter = I; the product's 2·I rows are [gate | up]): each slot's
// I activations are the SwiGlu kernel's over the product's gate and up rows, bit for bit (the
// product is cpu::MatMulNT's bits: the tests above; SwiGlu is within an exp ulp of the CPU's:
// CudaSwiGlu), and nothing past them is written — V2-Lite's shared experts at batch 1 and 8
// (I = 2816), a token's routed experts (I = 1408, six slots by id), FP8 weights, and I not a
// multiple of 8 (the last CTA's gate and up halves both partial); a bad id gives NaN
// activations and the flag. Refused by name where the bulk shape does not run;
// ExpertGemmSwiGluFits says so beforehand.
TEST(CudaExpertGemm, SwiGluEpilogueIsTheProductThenSwiGlu) {
  LS_REQUIRE_GPU();
  using L = cu::ExpertGemmParams::Launch;
  const GemmCase cases[] = {
      {1, 1, 1, 5632, 2048, true, false, true, 0},           // shared gate_up, batch 1
      {8, 1, 1, 5632, 2048, true, false, true, 0},           // batch 8
      {1, 6, 64, 2816, 2048, true, false, true, 0},          // routed gate_up of a token
      {2, 2, 4, 26, 64, true, false, true, 0},               // I = 13
      {1, 1, 1, 5632, 2048, false, false, false, 0, true},   // FP8
      {3, 2, 4, 42, 256, false, false, false, 0, true},      // FP8, I = 21
  };
  uint64_t seed = 7100;
  for (const GemmCase& g : cases) {
    const int64_t I = g.out / 2, slots = g.rows * g.k;
    GemmData d = MakeGemm(g, seed += 10);
    const GemmRun prod = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), L::kBulkBySlot);
    ASSERT_TRUE(SameBitsOrBothNan(prod.y, CpuExpertGemm(d), "the product, " + Name(g)));
    cu::DeviceBuffer dprod = Upload(prod.y), dwant = Zeros<float>(slots * d.ys);
    cu::SwiGluParams sp;
    sp.g = dprod.as<float>(), sp.g_stride = d.ys;
    sp.u = dprod.as<float>() + I, sp.u_stride = d.ys;
    sp.out = dwant.as<float>(), sp.out_stride = d.ys;
    sp.rows = slots, sp.n = I;
    LS_ASSERT_OK(cu::SwiGlu(sp));
    LS_ASSERT_OK(cu::Synchronize());
    const std::vector<float> want = Download<float>(dwant, slots * d.ys);
    GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), L::kBulkBySlot, I);
    EXPECT_EQ(got.flag, 0) << Name(g);
    EXPECT_TRUE(SameBitsOrBothNan(got.y, want, "swiglu epilogue vs the product then SwiGlu, " + Name(g)));

    // A bad id: that slot's activations NaN, the flag set, the other slots unchanged.
    if (g.k > 1) {
      std::vector<int32_t> ids = d.ids;
      ids[1] = static_cast<int32_t>(g.experts);
      GemmRun bad = GpuExpertGemm(d, ids, g.rows, d.x.data(), L::kBulkBySlot, I);
      EXPECT_EQ(bad.flag, cu::kErrExpert) << Name(g);
      for (int64_t slot = 0; slot < slots; ++slot) {
        for (int64_t c = 0; c < d.ys; ++c) {
          const float v = bad.y[slot * d.ys + c];
          if (c >= I) {
            ASSERT_EQ(v, 0.0f) << Name(g) << " slot " << slot << " col " << c << ": past the activations";
          } else if (slot == 1) {
            ASSERT_TRUE(std::isnan(v)) << Name(g) << " col " << c;
          } else {
            ASSERT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(want[slot * d.ys + c]))
                << Name(g) << " slot " << slot << " col " << c;
          }
        }
      }
    }
  }

  // Where it applies: the auto shape at decode's few rows (the engine's shared experts) fits;
  // a crowded product and a forced non-bulk shape do not, and ExpertGemm refuses them by name.
  const GemmData d = MakeGemm({1, 1, 1, 5632, 2048, true, false, true, 0}, 7300);
  cu::DeviceBuffer dw = Upload(d.w16), dx = Upload(std::vector<float>(64 * 2048, 0.5f)), ids = Zeros<int32_t>(64),
                   dy = Zeros<float>(64 * d.ys);
  cu::ExpertGemmParams p;
  p.rows = 1, p.k = 1, p.experts = 1, p.out = 5632, p.in = 2048;
  p.w = dw.data(), p.w_bf16 = true, p.w_expert_stride = d.es, p.w_row_stride = d.rs;
  p.x = dx.as<float>(), p.x_stride = 2048, p.round_x_bf16 = true;
  p.ids = ids.as<int32_t>(), p.ids_fixed = true;
  p.y = dy.as<float>(), p.y_stride = d.ys;
  p.swiglu_inter = 2816;
  EXPECT_TRUE(cu::ExpertGemmSwiGluFits(p)) << "decode's shared gate_up at one row";
  p.launch = L::kStreamBySlot;
  EXPECT_FALSE(cu::ExpertGemmSwiGluFits(p));
  Status st = cu::ExpertGemm(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("swiglu_inter"), std::string::npos) << st.message();
  p.launch = L::kAuto;
  p.rows = 64;  // crowded: the chunked cp.async shape
  EXPECT_FALSE(cu::ExpertGemmSwiGluFits(p));
  st = cu::ExpertGemm(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("swiglu_inter"), std::string::npos) << st.message();
  p.rows = 1;
  p.swiglu_inter = 2815;  // out ≠ 2·I
  EXPECT_FALSE(cu::ExpertGemmSwiGluFits(p));
  st = cu::ExpertGemm(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("swiglu_inter"), std::string::npos) << st.message();
}

TEST(CudaExpertGemm, BadExpertIdGivesNanRowAndFlag) {
  LS_REQUIRE_GPU();
  // 6 slots (the per-slot grid) and 40 slots (the per-expert grid), each on the cp.async path
  // (in = 64) and the register path (in = 60).
  for (int64_t rows : {3, 20, -3, -20}) {
    const GemmCase g{rows < 0 ? -rows : rows, 2, 4, 100, rows < 0 ? 60 : 64, true, false, false, 0};
    GemmData d = MakeGemm(g, 77 + rows);
    std::vector<int32_t> ids = d.ids;
    ids[1] = 4;   // row 0 slot 1: out of range
    ids[4] = -1;  // row 2 slot 0
    GemmRun got = GpuExpertGemm(d, ids, g.rows, d.x.data());
    EXPECT_EQ(got.flag, cu::kErrExpert) << Name(g);
    for (int64_t slot = 0; slot < g.rows * g.k; ++slot) {
      const bool bad = slot == 1 || slot == 4;
      for (int64_t o = 0; o < g.out; ++o) {
        ASSERT_EQ(std::isnan(got.y[slot * d.ys + o]), bad) << Name(g) << " slot " << slot << " col " << o;
      }
    }
  }
}

// The tensor-core shape (gemm=bf16's routed experts): not cpu::Dot's order, so checked against
// the fp64 product of the same bf16 operands — within 2·(in + 1)·u·Σ|w·x| (the MMA's internal
// fp32 additions need not round to nearest: twice the textbook bound) — and for what the
// variant promises: the same bits run to run and for a row alone as in its batch. Shapes: V2-
// Lite's gate_up and down at 1 and 64 tokens, experts with more than 32 slots (several
// passes), a partial row tile and a partial K chunk.
TEST(CudaExpertGemm, TensorCoresAreDeterministicBatchInvariantAndWithinBound) {
  LS_REQUIRE_GPU();
  const GemmCase cases[] = {
      // (8 experts, not V2-Lite's 64: the shapes that matter are out and in, and the host's
      // random weights for 64 took seconds; 64 rows then put ~48 slots on each expert.)
      {1, 6, 8, 2816, 2048, true, false, true, 0},    // decode gate_up
      {64, 6, 8, 2816, 2048, true, false, true, 0},   // batch 64 gate_up: passes of 32 slots
      {64, 6, 8, 2048, 1408, true, true, true, 0},    // batch 64 down, per-slot x, in = 5.5 chunks
      {50, 2, 4, 200, 320, true, false, true, 8},     // partial row tile and K chunk, padded rows
      {7, 1, 1, 64, 32, true, true, true, 0},         // one 32-column block
  };
  uint64_t seed = 4000;
  for (const GemmCase& g : cases) {
    GemmData d = MakeGemm(g, seed += 10);
    d.xs = g.in + 4;  // 16-byte x rows
    d.x = Randn(d.xrows * d.xs, seed + 1, 1.0f);
    if (g.experts == 4) {  // expert 0 in every row: 50 slots, two passes of ≤ 32
      for (int64_t r = 0; r < g.rows; ++r) {
        d.ids[r * g.k] = 0;
        d.ids[r * g.k + 1] = 1 + static_cast<int32_t>(r % 3);
      }
    }
    cu::ExpertGemmParams probe;
    probe.w_bf16 = true;
    probe.round_x_bf16 = true;
    probe.x = reinterpret_cast<const float*>(uintptr_t{256});
    probe.w = reinterpret_cast<const void*>(uintptr_t{256});
    probe.in = g.in;
    probe.w_row_stride = d.rs;
    probe.w_expert_stride = d.es;
    probe.x_stride = d.xs;
    ASSERT_TRUE(cu::ExpertGemmTcFits(probe)) << Name(g);
    const auto kAuto = cu::ExpertGemmParams::Launch::kAuto;
    GemmRun got = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), kAuto, 0, true);
    EXPECT_EQ(got.flag, 0) << Name(g);
    double worst = 0;
    int64_t bad = 0;
    std::vector<float> xr(g.in);
    // (The fp64 reference over every 7th output row and the last: the batch-64 cases' full
    // products take the host minutes; the bitwise checks below cover every element.)
    for (int64_t slot = 0; slot < g.rows * g.k; ++slot) {
      const int64_t e = d.ids[slot];
      const float* xrow = &d.x[(g.x_per_slot ? slot : slot / g.k) * d.xs];
      for (int64_t i = 0; i < g.in; ++i) xr[i] = kernels::Bf16ToF32(kernels::F32ToBf16(xrow[i]));
      for (int64_t o = 0; o < g.out; o = o == g.out - 1 ? g.out : std::min(o + 7, g.out - 1)) {
        double s = 0, a = 0;
        const float* wr = &d.w[e * d.es + o * d.rs];
        for (int64_t i = 0; i < g.in; ++i) {
          s += static_cast<double>(wr[i]) * xr[i];
          a += std::fabs(static_cast<double>(wr[i]) * xr[i]);
        }
        const double y = got.y[slot * d.ys + o], bound = 2.0 * (g.in + 1) * kU32 * a;
        if (!(std::fabs(y - s) <= bound)) {  // NaN fails
          if (bad++ < 3) ADD_FAILURE() << Name(g) << " slot " << slot << " row " << o << ": " << y << " vs " << s;
        } else if (bound > 0) {
          worst = std::max(worst, std::fabs(y - s) / bound);
        }
      }
    }
    EXPECT_EQ(bad, 0) << Name(g);
    GemmRun again = GpuExpertGemm(d, d.ids, g.rows, d.x.data(), kAuto, 0, true);
    EXPECT_TRUE(BitwiseEqual(again.y, got.y, "tensor cores run to run " + Name(g)));
    for (int64_t r : {int64_t{0}, g.rows - 1}) {
      const std::vector<int32_t> one(d.ids.begin() + r * g.k, d.ids.begin() + (r + 1) * g.k);
      const float* x_one = &d.x[(g.x_per_slot ? r * g.k : r) * d.xs];
      GemmRun alone = GpuExpertGemm(d, one, 1, x_one, kAuto, 0, true);
      EXPECT_TRUE(BitwiseEqual(alone.y,
                               std::vector<float>(got.y.begin() + r * g.k * d.ys, got.y.begin() + (r + 1) * g.k * d.ys),
                               "tensor cores: row " + std::to_string(r) + " alone vs batch " + Name(g)));
    }
    std::printf("  [expert gemm tensor cores %s] worst |y − fp64| / (2·(in+1)·u·Σ|w·x|) = %.3g\n", Name(g).c_str(),
                worst);
  }
  // A bad id: its row NaN and the flag, as the other shapes.
  const GemmCase g{20, 2, 4, 100, 64, true, false, true, 0};
  GemmData d = MakeGemm(g, 91);
  d.xs = g.in + 4;
  d.x = Randn(d.xrows * d.xs, 92, 1.0f);
  std::vector<int32_t> ids = d.ids;
  ids[1] = 4;
  ids[4] = -1;
  GemmRun got = GpuExpertGemm(d, ids, g.rows, d.x.data(), cu::ExpertGemmParams::Launch::kAuto, 0, true);
  EXPECT_EQ(got.flag, cu::kErrExpert);
  for (int64_t slot = 0; slot < g.rows * g.k; ++slot) {
    for (int64_t o = 0; o < g.out; ++o) {
      ASSERT_EQ(std::isnan(got.y[slot * d.ys + o]), slot == 1 || slot == 4) << "slot " << slot << " col " << o;
    }
  }
  // A shape the MMA blocks do not tile: refused, naming the field (nothing is launched).
  cu::ExpertGemmParams p;
  p.rows = 1;
  p.k = 1;
  p.experts = 1;
  p.out = 64;
  p.in = 48;  // not a multiple of 32
  p.w = reinterpret_cast<const void*>(uintptr_t{256});
  p.w_bf16 = true;
  p.w_row_stride = 48;
  p.w_expert_stride = 64 * 48;
  p.x = reinterpret_cast<const float*>(uintptr_t{256});
  p.x_stride = 48;
  p.round_x_bf16 = true;
  p.ids = reinterpret_cast<const int32_t*>(uintptr_t{256});
  p.y = reinterpret_cast<float*>(uintptr_t{256});
  p.y_stride = 64;
  p.tensor_cores = true;
  EXPECT_FALSE(cu::ExpertGemmTcFits(p));
  const Status st = cu::ExpertGemm(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("tensor_cores"), std::string::npos) << st.message();
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
