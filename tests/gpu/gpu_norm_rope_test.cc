// tests/gpu/gpu_norm_rope_test.cc — CUDA RMSNorm, RoPE and Hadamard against their CPU twins
// (kernels/cpu/ops.h) on fresh seeded inputs, NaN/Inf positions, determinism, batch
// invariance, argument validation and the device-side error flag.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/kv_cache.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

using namespace gpu_testing;  // NOLINT

std::vector<float> RandomRows(int64_t rows, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(-6.0f, 6.0f);
  std::vector<float> x(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    const float s = std::exp2(scale(rng));  // rows from 2^-6 to 2^6 in magnitude
    for (int64_t i = 0; i < n; ++i) x[r * n + i] = g(rng) * s;
  }
  return x;
}

struct NormRun {
  std::vector<float> y;
  Status status;
};

// y = RMSNorm(x) · w over `rows` contiguous rows of n.
cu::RmsNormParams Params(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  cu::RmsNormParams p;
  p.x = x;
  p.x_stride = n;
  p.weight = w;
  p.y = y;
  p.y_stride = n;
  p.rows = rows;
  p.n = n;
  p.eps = eps;
  return p;
}

NormRun GpuRmsNorm(const std::vector<float>& x, const std::vector<float>& w, int64_t rows, int64_t n, float eps) {
  auto dx = Upload(x), dw = Upload(w);
  auto dy = Zeros<float>(rows * n);
  const cu::RmsNormParams p = Params(dx.as<float>(), dw.as<float>(), dy.as<float>(), rows, n, eps);
  NormRun r;
  r.status = cu::RmsNorm(p);
  if (r.status.ok()) r.status = cu::Synchronize();
  r.y = Download<float>(dy, rows * n);
  return r;
}

// Error bound of the GPU RMSNorm against cpu::RmsNorm (fp64 sum), relative to |y|:
// the fp32 sum of squares runs a chain of ceil(n/256) FMAs per thread then 8 butterfly
// levels, d = ceil(n/256) + 8 additions deep: relative error ≤ d·u. Then /n, +eps, sqrt, 1/
// add 4 roundings, the sqrt halves the sum's error: inv ≤ (d/2 + 4)·u; the eps conversion
// to fp32 adds ≤ u; the CPU's inv has ≤ u; each side's two products w·(x·inv) ≤ 2u.
double RmsNormRelTol(int64_t n) {
  const double d = std::ceil(n / 256.0) + 8;
  return (d / 2 + 4 + 1 + 1 + 4) * kU32;
}

TEST(CudaRmsNorm, MatchesCpuWithinDerivedBound) {
  LS_REQUIRE_GPU();
  const float eps = 1e-6f;
  for (auto [rows, n] : std::vector<std::pair<int64_t, int64_t>>{{37, 7168}, {5, 1}, {3, 513}, {64, 512}, {2, 1536}}) {
    std::vector<float> x = RandomRows(rows, n, 100 + n), w = RandomRows(1, n, 200 + n);
    std::vector<float> want(rows * n);
    kernels::cpu::RmsNorm(x.data(), w.data(), rows, n, eps, want.data());
    NormRun got = GpuRmsNorm(x, w, rows, n, eps);
    LS_ASSERT_OK(got.status);
    const double rel = RmsNormRelTol(n);
    EXPECT_TRUE(AllClose(
        got.y, want, [&](size_t i) { return rel * std::fabs(want[i]); },
        "rmsnorm rows=" + std::to_string(rows) + " n=" + std::to_string(n)));
  }
}

// The kernel is cpu::RmsNormLanes256 (norm=lanes256) bit for bit: rows held in registers
// (n ≤ 4096) and not, a single value, partial lanes.
TEST(CudaRmsNorm, IsCpuLanes256Bitwise) {
  LS_REQUIRE_GPU();
  for (auto [rows, n] : std::vector<std::pair<int64_t, int64_t>>{{37, 7168}, {5, 1}, {3, 513}, {64, 512}, {2, 2048}}) {
    std::vector<float> x = RandomRows(rows, n, 300 + n), w = RandomRows(1, n, 400 + n);
    std::vector<float> want(rows * n);
    kernels::cpu::RmsNormLanes256(x.data(), w.data(), rows, n, 1e-6, want.data());
    NormRun got = GpuRmsNorm(x, w, rows, n, 1e-6f);
    LS_ASSERT_OK(got.status);
    EXPECT_TRUE(BitwiseEqual(got.y, want, "rmsnorm vs cpu lanes256 rows=" + std::to_string(rows) + " n=" +
                                              std::to_string(n)));
  }
}

TEST(CudaRmsNorm, NanAndInfPositionsMatchCpu) {
  LS_REQUIRE_GPU();
  const int64_t rows = 6, n = 700;
  std::vector<float> x = RandomRows(rows, n, 7), w = RandomRows(1, n, 8);
  x[1 * n + 10] = NAN;        // a NaN poisons its whole row (the sum)
  x[2 * n + 3] = INFINITY;    // inv = 0: the row is 0 except inf·0 = NaN at the inf
  x[3 * n + 5] = -INFINITY;
  w[17] = NAN;                // column 17 NaN in every row
  x[4 * n + 0] = -0.0f;
  std::vector<float> want(rows * n);
  kernels::cpu::RmsNorm(x.data(), w.data(), rows, n, 1e-6, want.data());
  NormRun got = GpuRmsNorm(x, w, rows, n, 1e-6f);
  LS_ASSERT_OK(got.status);
  const double rel = RmsNormRelTol(n);
  EXPECT_TRUE(AllClose(got.y, want, [&](size_t i) { return rel * std::fabs(want[i]); }, "rmsnorm special values"));
}

TEST(CudaRmsNorm, DeterministicAndBatchInvariant) {
  LS_REQUIRE_GPU();
  const int64_t rows = 16, n = 7168;
  std::vector<float> x = RandomRows(rows, n, 11), w = RandomRows(1, n, 12);
  NormRun a = GpuRmsNorm(x, w, rows, n, 1e-6f), b = GpuRmsNorm(x, w, rows, n, 1e-6f);
  LS_ASSERT_OK(a.status);
  EXPECT_TRUE(BitwiseEqual(a.y, b.y, "rmsnorm run twice"));
  for (int64_t r : {0, 7, 15}) {
    std::vector<float> one(x.begin() + r * n, x.begin() + (r + 1) * n);
    NormRun s = GpuRmsNorm(one, w, 1, n, 1e-6f);
    LS_ASSERT_OK(s.status);
    EXPECT_TRUE(BitwiseEqual(s.y, std::vector<float>(a.y.begin() + r * n, a.y.begin() + (r + 1) * n),
                             "rmsnorm row " + std::to_string(r) + " alone vs in a batch of 16"));
  }
}

// The residual add fused into the norm (the decode step's x + o → RMSNorm) gives the bits of
// Add then RmsNorm: the sum (fp32 a + b, checked on the host) and the normalised row, with
// the sum written over x or to its own buffer, for rows held in registers (n ≤ 4096) and not.
TEST(CudaRmsNorm, FusedResidualAddIsAddThenNorm) {
  LS_REQUIRE_GPU();
  for (int64_t n : {int64_t{2048}, int64_t{7168}, int64_t{100}}) {
    for (bool in_place : {true, false}) {
      const int64_t rows = 3;
      std::vector<float> x = RandomRows(rows, n, 21 + n), o = RandomRows(rows, n, 22 + n), w = RandomRows(1, n, 23);
      std::vector<float> want_sum(x.size());
      for (size_t i = 0; i < x.size(); ++i) want_sum[i] = x[i] + o[i];
      NormRun want = GpuRmsNorm(want_sum, w, rows, n, 1e-6f);
      LS_ASSERT_OK(want.status);
      auto dx = Upload(x), doo = Upload(o), dw = Upload(w);
      auto dy = Zeros<float>(rows * n), ds = Zeros<float>(rows * n);
      cu::RmsNormParams p = Params(dx.as<float>(), dw.as<float>(), dy.as<float>(), rows, n, 1e-6f);
      p.add = doo.as<float>();
      p.add_stride = n;
      p.sum = in_place ? dx.as<float>() : ds.as<float>();
      p.sum_stride = n;
      LS_ASSERT_OK(cu::RmsNorm(p));
      LS_ASSERT_OK(cu::Synchronize());
      const std::string what = "n=" + std::to_string(n) + (in_place ? " in place" : " own sum buffer");
      EXPECT_TRUE(BitwiseEqual(Download<float>(in_place ? dx : ds, rows * n), want_sum, "fused sum, " + what));
      EXPECT_TRUE(BitwiseEqual(Download<float>(dy, rows * n), want.y, "fused norm, " + what));
    }
  }
}

TEST(CudaRmsNorm, ValidationNamesTheField) {  // runs without a GPU: nothing is launched
  cu::RmsNormParams p;
  float dummy = 0;
  p.x = p.y = &dummy;
  p.weight = &dummy;
  p.rows = 1;
  p.n = 8;
  p.x_stride = 8;
  p.y_stride = 4;
  Status s = cu::RmsNorm(p);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("y_stride"), std::string::npos) << s.message();
}

// --- RoPE -----------------------------------------------------------------------------

struct RopeCase {
  cu::RopeStyle style;
  int64_t rows, heads, nope, dim, max_pos;
};

void RunRopeCase(const RopeCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 2.0f);
  std::uniform_real_distribution<double> angle(-40.0, 40.0);
  const int64_t half = c.dim / 2, head_stride = c.nope + c.dim, row_stride = c.heads * head_stride;
  std::vector<float> q(c.rows * row_stride);
  for (auto& v : q) v = g(rng);
  q[0 * row_stride + c.nope + 1] = NAN;  // NaN rides through: positions must match
  std::vector<float> cs(c.max_pos * half), sn(c.max_pos * half);
  for (int64_t i = 0; i < c.max_pos * half; ++i) {
    const double a = angle(rng);
    cs[i] = static_cast<float>(std::cos(a) * 1.1);  // a YaRN-like attention factor
    sn[i] = static_cast<float>(std::sin(a) * 1.1);
  }
  std::vector<int32_t> pos(c.rows);
  for (auto& p : pos) p = static_cast<int32_t>(rng() % c.max_pos);

  std::vector<float> want = q;
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t h = 0; h < c.heads; ++h) {
      float* v = &want[r * row_stride + h * head_stride + c.nope];
      const float* cp = &cs[pos[r] * half];
      const float* sp = &sn[pos[r] * half];
      switch (c.style) {
        case cu::RopeStyle::kPairsAdjacent: kernels::cpu::RopePairsAdjacent(v, cp, sp, c.dim); break;
        case cu::RopeStyle::kPairsToHalves: kernels::cpu::RopePairsToHalves(v, cp, sp, c.dim); break;
        case cu::RopeStyle::kHalves: kernels::cpu::RopeHalves(v, cp, sp, c.dim); break;
      }
    }
  }
  auto dq = Upload(q), dc = Upload(cs), ds = Upload(sn), dp = Upload(pos);
  auto flag = Zeros<int32_t>(1);
  cu::RopeParams p;
  p.x = dq.as<float>() + c.nope;
  p.row_stride = row_stride;
  p.head_stride = head_stride;
  p.rows = c.rows;
  p.heads = c.heads;
  p.dim = c.dim;
  p.positions = dp.as<int32_t>();
  p.cos = dc.as<float>();
  p.sin = ds.as<float>();
  p.max_position = c.max_pos;
  p.style = c.style;
  p.error_flag = flag.as<int32_t>();
  LS_ASSERT_OK(cu::Rope(p));
  LS_ASSERT_OK(cu::Synchronize());
  const std::vector<float> got = Download<float>(dq, q.size());
  // Bitwise: the kernel performs the CPU's operations with the same roundings; the nope
  // part must be untouched; the planted NaN must come out at the same positions.
  EXPECT_TRUE(SameBitsOrBothNan(got, want,
                           "rope style " + std::to_string(static_cast<int>(c.style)) + " dim " + std::to_string(c.dim)));
  EXPECT_EQ(Download<int32_t>(flag, 1)[0], 0);
}

TEST(CudaRope, AllStylesBitwiseEqualToCpu) {
  LS_REQUIRE_GPU();
  for (cu::RopeStyle s : {cu::RopeStyle::kPairsAdjacent, cu::RopeStyle::kPairsToHalves, cu::RopeStyle::kHalves}) {
    RunRopeCase({s, 9, 5, 128, 64, 300}, 1 + static_cast<int>(s));  // DeepSeek q: nope 128 then rope 64
    RunRopeCase({s, 3, 2, 16, 8, 20}, 10 + static_cast<int>(s));    // the tiny test models
    RunRopeCase({s, 2, 1, 0, 2048, 4}, 20 + static_cast<int>(s));   // 1024 threads
  }
}

TEST(CudaRope, OutOfRangePositionIsFlaggedAndLeftAlone) {
  LS_REQUIRE_GPU();
  const int64_t dim = 8, half = 4;
  std::vector<float> x(2 * dim, 1.5f), cs(3 * half, 0.5f), sn(3 * half, 0.25f);
  std::vector<int32_t> pos = {1, 3};  // 3 == max_position
  auto dx = Upload(x), dc = Upload(cs), ds = Upload(sn), dp = Upload(pos);
  auto flag = Zeros<int32_t>(1);
  cu::RopeParams p;
  p.x = dx.as<float>();
  p.row_stride = dim;
  p.head_stride = dim;
  p.rows = 2;
  p.heads = 1;
  p.dim = dim;
  p.positions = dp.as<int32_t>();
  p.cos = dc.as<float>();
  p.sin = ds.as<float>();
  p.max_position = 3;
  p.style = cu::RopeStyle::kHalves;
  p.error_flag = flag.as<int32_t>();
  LS_ASSERT_OK(cu::Rope(p));
  LS_ASSERT_OK(cu::Synchronize());
  EXPECT_EQ(Download<int32_t>(flag, 1)[0], cu::kErrPosition);
  const auto got = Download<float>(dx, x.size());
  for (int64_t i = dim; i < 2 * dim; ++i) EXPECT_EQ(got[i], 1.5f) << i;
  EXPECT_EQ(got[0], 1.5f * 0.5f - 1.5f * 0.25f);
}

TEST(CudaRope, ValidationNamesTheField) {
  cu::RopeParams p;
  float f = 0;
  int32_t i = 0;
  p.x = &f;
  p.positions = &i;
  p.cos = p.sin = &f;
  p.rows = 1;
  p.heads = 1;
  p.dim = 7;
  p.head_stride = p.row_stride = 8;
  p.max_position = 1;
  Status s = cu::Rope(p);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("dim"), std::string::npos) << s.message();
}

// The indexer's Hadamard rotation: cpu::Hadamard's bits for every power of two up to 4096, rows
// at a stride, and values spread over many binades (so the butterflies' roundings matter).
TEST(CudaHadamard, BitwiseEqualToCpu) {
  LS_REQUIRE_GPU();
  std::mt19937_64 rng(77);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int64_t n : {1, 2, 4, 8, 64, 128, 256, 4096}) {
    const int64_t rows = 5, stride = n + 3;
    std::vector<float> x(rows * stride);
    for (float& v : x) v = g(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 24) - 12);
    std::vector<float> want = x;
    for (int64_t r = 0; r < rows; ++r) kernels::cpu::Hadamard(&want[r * stride], n);
    cu::DeviceBuffer dx = Upload(x);
    LS_ASSERT_OK(cu::Hadamard(dx.as<float>(), stride, rows, n));
    LS_ASSERT_OK(cu::Synchronize());
    const auto got = Download<float>(dx, x.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), x.size() * 4)) << "n=" << n;
  }
}

TEST(CudaHadamard, ValidationNamesTheField) {  // nothing is launched
  float f = 0;
  Status s = cu::Hadamard(&f, 96, 1, 96);
  EXPECT_EQ(s.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.message().find("power of two"), std::string::npos) << s.message();
  s = cu::Hadamard(&f, 32, 1, 64);
  EXPECT_NE(s.message().find("stride"), std::string::npos) << s.message();
}

// gemm=w8a8_dot's activations: engine::Fp8RoundTrip's bits, row by row, for lengths around the
// 128-value tile (1, 100, 128, 129, 2048, 7168), values over many binades (subnormal e4m3 results
// and saturation-free rounding), an all-zero tile, a tile holding NaN (ignored by its amax, NaN
// out) and one holding +Inf (scale 1: saturates to 448); out of place at a stride and in place.
TEST(CudaFp8RoundTrip, BitwiseEqualToCpu) {
  LS_REQUIRE_GPU();
  std::mt19937_64 rng(91);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int64_t n : {1, 100, 128, 129, 2048, 7168}) {
    const int64_t rows = 4, xs = n + 5, ys = n + 1;
    std::vector<float> x(rows * xs);
    for (float& v : x) v = g(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
    for (int64_t i = 0; i < std::min<int64_t>(n, 128); ++i) x[1 * xs + i] = 0.0f;  // row 1's first tile: zeros
    x[2 * xs + n / 2] = NAN;
    x[3 * xs + n - 1] = INFINITY;
    std::vector<float> want(rows * ys, 0.0f);
    for (int64_t r = 0; r < rows; ++r) engine::Fp8RoundTrip(&x[r * xs], n, &want[r * ys]);
    cu::DeviceBuffer dx = Upload(x), dy = Upload(std::vector<float>(rows * ys, 0.0f));
    LS_ASSERT_OK(cu::Fp8RoundTrip(dx.as<float>(), xs, dy.as<float>(), ys, rows, n));
    LS_ASSERT_OK(cu::Synchronize());
    const auto got = Download<float>(dy, rows * ys);
    // Bit for bit, NaN for NaN (the GPU's NaN is the canonical one, the CPU's keeps a payload).
    EXPECT_TRUE(SameBitsOrBothNan(got, want, "n=" + std::to_string(n)));
    EXPECT_TRUE(std::isnan(got[2 * ys + n / 2])) << "n=" << n;
    EXPECT_EQ(got[3 * ys + n - 1], 448.0f) << "n=" << n;
    // In place (x's stride for both).
    LS_ASSERT_OK(cu::Fp8RoundTrip(dx.as<float>(), xs, dx.as<float>(), xs, rows, n));
    LS_ASSERT_OK(cu::Synchronize());
    const auto inplace = Download<float>(dx, rows * xs);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_TRUE(SameBitsOrBothNan(std::vector<float>(&inplace[r * xs], &inplace[r * xs] + n),
                                    std::vector<float>(&want[r * ys], &want[r * ys] + n),
                                    "in place, n=" + std::to_string(n) + " row " + std::to_string(r)));
    }
  }
  float f = 0;
  const Status st = cu::Fp8RoundTrip(&f, 8, &f, 16, 1, 8);
  EXPECT_NE(st.message().find("y_stride"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace lockstep
