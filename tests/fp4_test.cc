// tests/fp4_test.cc — the 4-bit routed-expert formats (kernels/fp4.h): every E2M1 code, the E8M0
// and E4M3 scale edges, the nibble order, NVFP4's one rounding, the quantisers' rules and error
// bounds, MatMulNT over a quantised matrix against an fp64 reference, and the loader's checks.
//
// The references here are written from the format definitions (OCP MX v1.0; ModelOpt's NVFP4),
// not with the kernels' tables: E2M1 from a hand-typed list of the eight magnitudes, E8M0 as
// 2^(e−127) in fp64, E4M3 from its bit fields.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>

#include "kernels/cpu/ops.h"
#include "kernels/fp4.h"

namespace lockstep::kernels {
namespace {

constexpr double kMagnitudes[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};  // E2M1 codes 0..7

double RefE2m1(int code) { return (code & 8) ? -kMagnitudes[code & 7] : kMagnitudes[code & 7]; }
double RefE8m0(int e) { return e == 255 ? NAN : std::pow(2.0, e - 127); }
double RefE4m3(int b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const double v = e == 0 ? m * std::pow(2.0, -9) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -v : v;
}

// The decoded value of element (r, c) of a stored 4-bit matrix, in fp64 then rounded once to fp32
// (NVFP4's triple product is exact in fp64: ≤ 6 × 24 significant bits).
float RefDecode(const WeightView& w, int64_t r, int64_t c) {
  const uint8_t byte = static_cast<const uint8_t*>(w.values)[((w.row0 + r) * w.cols + c) / 2];
  const int code = (c % 2 == 0) ? (byte & 15) : (byte >> 4);
  const uint8_t s = static_cast<const uint8_t*>(w.scales)[(w.row0 + r) * (w.cols / w.block_cols) + c / w.block_cols];
  if (w.dtype == WeightDType::kMxfp4) return static_cast<float>(RefE2m1(code) * RefE8m0(s));
  return static_cast<float>(RefE2m1(code) * RefE4m3(s) * static_cast<double>(w.scale_2));
}

bool SameBits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) || (std::isnan(a) && std::isnan(b)); }

TEST(Fp4Codes, EveryE2m1Code) {
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(E2m1Table()[c], static_cast<float>(RefE2m1(c))) << "code " << c;
    EXPECT_EQ(std::signbit(E2m1Table()[c]), c >= 8) << "code " << c << " (8 is −0)";
  }
}

TEST(Fp4Codes, E8m0Edges) {
  EXPECT_EQ(std::bit_cast<uint32_t>(E8m0Table()[0]), 0x00400000u);  // 2^−127: an fp32 subnormal, not 0
  EXPECT_EQ(E8m0Table()[1], std::ldexp(1.0f, -126));
  EXPECT_EQ(E8m0Table()[127], 1.0f);
  EXPECT_EQ(E8m0Table()[128], 2.0f);
  EXPECT_EQ(E8m0Table()[254], std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(E8m0Table()[255]));
  for (int e = 0; e < 255; ++e) EXPECT_EQ(E8m0Table()[e], static_cast<float>(RefE8m0(e))) << e;
}

TEST(Fp4Codes, E2m1RoundsToNearestTiesToEvenAndSaturates) {
  struct Case { float x; uint8_t code; };
  const Case cases[] = {{0.0f, 0},  {-0.0f, 0},  {0.25f, 0},  {0.2500001f, 1}, {0.75f, 2}, {0.7499999f, 1},
                        {1.25f, 2}, {1.75f, 4},  {2.5f, 4},   {2.5000002f, 5}, {3.5f, 6},  {5.0f, 6},
                        {5.0000005f, 7}, {6.0f, 7}, {1e30f, 7}, {INFINITY, 7}, {-INFINITY, 15}, {-0.1f, 8},
                        {-3.0f, 13}, {NAN, 0}};
  for (const Case& k : cases) EXPECT_EQ(F32ToE2m1(k.x), k.code) << k.x;
  for (int c = 0; c < 16; ++c) {
    if (c == 8) continue;  // −0 encodes as code 0
    EXPECT_EQ(F32ToE2m1(E2m1Table()[c]), c) << "code " << c << " round-trips";
  }
}

// A 2 × 64 MXFP4 matrix by hand: nibble order, the exponent edges 0, 127, 254 and 255 (NaN),
// overflow of the fp32 product at the top.
TEST(Fp4View, Mxfp4HandCases) {
  std::vector<uint8_t> packed(2 * 32), scales(2 * 2);
  for (int j = 0; j < 32; ++j) packed[j] = static_cast<uint8_t>((j % 16) | ((15 - j % 16) << 4));
  for (int j = 32; j < 64; ++j) packed[j] = 0x71;  // col 2j: code 1 (0.5), col 2j+1: code 7 (6)
  scales = {127, 0, 254, 255};
  WeightView w;
  w.dtype = WeightDType::kMxfp4;
  w.rows = 2;
  w.cols = 64;
  w.values = packed.data();
  w.scales = scales.data();
  w.block_rows = 1;
  w.block_cols = 32;
  std::vector<float> d(128);
  w.DecodeRows(0, 2, d.data());
  // Row 0, block 0 (scale 1): byte j holds code j%16 low, 15 − j%16 high.
  for (int c = 0; c < 32; ++c) {
    const int code = c % 2 == 0 ? (c / 2) % 16 : 15 - (c / 2) % 16;
    EXPECT_EQ(d[c], static_cast<float>(RefE2m1(code))) << c;
  }
  // Row 0, block 1 (scale 2^−127): subnormal products, exact.
  for (int c = 32; c < 64; ++c) EXPECT_EQ(d[c], static_cast<float>(RefE2m1(c % 2 == 0 ? (c / 2) % 16 : 15 - (c / 2) % 16) * std::pow(2.0, -127))) << c;
  EXPECT_EQ(d[36], std::ldexp(1.0f, -127));  // byte 18's low nibble: code 2 (1.0) × 2^−127
  // Row 1, block 0 (2^127): 0.5·2^127 finite, 6·2^127 overflows to inf.
  EXPECT_EQ(d[64], std::ldexp(1.0f, 126));
  EXPECT_TRUE(std::isinf(d[65]) && d[65] > 0);
  // Row 1, block 1: scale NaN → every value NaN.
  for (int c = 96; c < 128; ++c) EXPECT_TRUE(std::isnan(d[c])) << c;
  // The slow path and a row slice agree bit for bit.
  for (int64_t i = 0; i < 128; ++i) EXPECT_TRUE(SameBits(w[i], d[i])) << i;
  std::vector<float> d1(64);
  w.Rows(1, 1).DecodeRows(0, 1, d1.data());
  for (int c = 0; c < 64; ++c) EXPECT_TRUE(SameBits(d1[c], d[64 + c])) << c;
  EXPECT_EQ(w.stored_bytes(), 64u + 4u);
  EXPECT_EQ(ElementBits(WeightDType::kMxfp4), 4);
  EXPECT_STREQ(WeightDTypeName(WeightDType::kNvfp4), "NVFP4");
}

// NVFP4: E4M3 scales across the subnormal range, NaN scales, and the triple product rounded
// once (not (E2M1 × (E4M3 × scale_2)) rounded twice).
TEST(Fp4View, Nvfp4ScalesAndOneRounding) {
  const uint8_t scale_bytes[] = {0x01, 0x07, 0x08, 0x3f, 0x7e, 0x7f, 0x80 | 0x30, 0x00};
  const int nb = sizeof(scale_bytes);
  std::vector<uint8_t> packed(nb * 8);
  for (int b = 0; b < nb; ++b) {
    for (int j = 0; j < 8; ++j) packed[b * 8 + j] = static_cast<uint8_t>((2 * j) | ((2 * j + 1) << 4));  // codes 0..15
  }
  // scale_2 values with full mantissas: (e2m1·e4m3)·s2 needs rounding.
  WeightView w;
  w.dtype = WeightDType::kNvfp4;
  w.rows = 1;
  w.cols = nb * 16;
  w.values = packed.data();
  w.scales = scale_bytes;
  w.block_rows = 1;
  w.block_cols = 16;
  std::vector<float> d(w.cols);
  std::mt19937 rng(1);
  int double_rounding_differs = 0;
  float s2 = 0;
  for (int trial = 0; trial < 64; ++trial) {
    s2 = std::bit_cast<float>(static_cast<uint32_t>(0x3b000000u | (rng() & 0x7fffffu)));  // [2^−9, 2^−8)
    w.scale_2 = s2;
    w.DecodeRows(0, 1, d.data());
    for (int c = 0; c < w.cols; ++c) {
      const float want = static_cast<float>(RefE2m1(c % 16) * RefE4m3(scale_bytes[c / 16]) * static_cast<double>(s2));
      EXPECT_TRUE(SameBits(d[c], want)) << c << ": " << d[c] << " vs " << want;
      if (!std::isnan(want)) {
        const float twice = static_cast<float>(RefE2m1(c % 16)) * (static_cast<float>(RefE4m3(scale_bytes[c / 16])) * s2);
        double_rounding_differs += !SameBits(twice, want);
      }
    }
  }
  EXPECT_GT(double_rounding_differs, 0) << "the case set should tell one rounding from two";
  EXPECT_EQ(d[0 * 16 + 2], static_cast<float>(std::pow(2.0, -9) * s2));  // smallest subnormal scale × 1.0
  for (int c = 5 * 16; c < 6 * 16; ++c) EXPECT_TRUE(std::isnan(d[c])) << "scale 0x7f is NaN";
  for (int c = 7 * 16; c < 8 * 16; ++c) EXPECT_EQ(d[c], 0.0f) << "scale 0 zeroes its block";
  EXPECT_LT(d[6 * 16 + 2], 0.0f);  // a negative scale flips the sign (value = product as stored)
}

std::vector<float> RandomMatrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> m(static_cast<size_t>(rows * cols));
  for (auto& v : m) v = n(rng) * 0.05f;
  // Row-dependent magnitudes, an all-zero block, a tiny one, a large one.
  for (int64_t c = 0; c < 32; ++c) m[static_cast<size_t>(c)] = 0.0f;
  for (int64_t c = 32; c < 64; ++c) m[static_cast<size_t>(c)] *= 1e-38f;
  for (int64_t c = 64; c < 96; ++c) m[static_cast<size_t>(c)] *= 1e30f;
  return m;
}

// Half the E2M1 grid step at |x| / s (the rounding bound of an unsaturated value).
double HalfStep(double a) { return a < 2 ? 0.25 : a < 4 ? 0.5 : 1.0; }

TEST(Fp4Quantize, Mxfp4RuleAndBound) {
  const int64_t rows = 5, cols = 160;
  const std::vector<float> m = RandomMatrix(rows, cols, 7);
  const Fp4Matrix q = QuantizeMxfp4(m.data(), rows, cols);
  const WeightView w = q.view();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / 32; ++b) {
      double amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(static_cast<double>(m[r * cols + b * 32 + i])));
      const int e = q.scales[r * (cols / 32) + b];
      const double s = RefE8m0(e);
      if (amax == 0) {
        EXPECT_EQ(e, 127);
      } else if (e > 0) {  // the smallest power of two with amax ≤ 6·s
        EXPECT_LE(amax, 6 * s);
        EXPECT_GT(amax, 3 * s);
      }
      for (int i = 0; i < 32; ++i) {
        const int64_t c = b * 32 + i;
        const double x = m[r * cols + c], got = RefDecode(w, r, c);
        EXPECT_LE(std::fabs(got - x), HalfStep(std::fabs(x) / s) * s * (1 + 1e-12)) << r << "," << c;
      }
    }
  }
}

TEST(Fp4Quantize, Nvfp4RuleAndBound) {
  const int64_t rows = 4, cols = 96;
  std::vector<float> m = RandomMatrix(rows, cols, 11);
  for (int64_t c = 64; c < 96; ++c) m[static_cast<size_t>(c)] *= 1e-30f;  // undo the huge block: one tensor scale
  const Fp4Matrix q = QuantizeNvfp4(m.data(), rows, cols);
  double amax = 0;
  for (float v : m) amax = std::max(amax, std::fabs(static_cast<double>(v)));
  EXPECT_EQ(q.scale_2, static_cast<float>(amax) / 2688.0f);
  const WeightView w = q.view();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double s = RefE4m3(q.scales[r * (cols / 16) + c / 16]) * q.scale_2;
      const double x = m[r * cols + c], got = RefDecode(w, r, c);
      if (s == 0) {
        EXPECT_EQ(got, 0.0);
        continue;
      }
      // The block scale is rounded to E4M3, so x / s may pass 6 by that rounding (≤ 2^−4 relative): saturation.
      const double a = std::fabs(x) / s;
      const double bound = a > 6 ? (a - 6) * s + 1e-30 : HalfStep(a) * s;
      EXPECT_LE(std::fabs(got - x), bound * (1 + 1e-5)) << r << "," << c;
    }
  }
}

TEST(Fp4Quantize, NonFiniteValuesMarkTheirBlockOrTensor) {
  std::vector<float> m(64, 0.5f);
  m[40] = NAN;
  const Fp4Matrix mx = QuantizeMxfp4(m.data(), 1, 64);
  EXPECT_EQ(mx.scales[0], 127 - 3);  // the smallest 2^k with 0.5 ≤ 6·2^k: 6·2^−3 = 0.75, 6·2^−4 = 0.375
  EXPECT_EQ(mx.scales[1], 0xff);
  const Fp4Matrix nv = QuantizeNvfp4(m.data(), 1, 64);
  EXPECT_TRUE(std::isnan(nv.scale_2));
  std::vector<float> d(64);
  nv.view().DecodeRows(0, 1, d.data());
  for (float v : d) EXPECT_TRUE(std::isnan(v));
}

// MatMulNT over a quantised view equals the product over the decoded fp32 copy bit for bit, and
// the fp64 reference (from RefDecode) within fp32 accumulation's bound n·u·Σ|x·w|.
TEST(Fp4View, MatMulOverQuantisedMatrix) {
  const int64_t out = 37, in = 256, rows = 5;
  std::vector<float> m = RandomMatrix(out, in, 3);
  for (int64_t c = 0; c < 96; ++c) m[static_cast<size_t>(c)] = 0.01f * static_cast<float>(c % 7);  // finite products
  std::vector<float> x(static_cast<size_t>(rows * in));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& v : x) v = u(rng);
  for (const Fp4Matrix& q : {QuantizeMxfp4(m.data(), out, in), QuantizeNvfp4(m.data(), out, in)}) {
    const WeightView w = q.view();
    std::vector<float> y(static_cast<size_t>(rows * out)), y_copy(y.size()), dec(static_cast<size_t>(out * in));
    cpu::MatMulNT(x.data(), rows, w, WeightRounding::kAsStored, y.data());
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t c = 0; c < in; ++c) dec[r * in + c] = RefDecode(w, r, c);
    }
    cpu::MatMulNT(x.data(), rows, dec.data(), out, in, y_copy.data());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < out; ++j) {
        EXPECT_TRUE(SameBits(y[i * out + j], y_copy[i * out + j])) << WeightDTypeName(q.dtype) << " " << i << "," << j;
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < in; ++k) {
          ref += static_cast<double>(x[i * in + k]) * dec[j * in + k];
          mag += std::fabs(static_cast<double>(x[i * in + k]) * dec[j * in + k]);
        }
        EXPECT_LE(std::fabs(y[i * out + j] - ref), in * std::ldexp(1.0, -24) * mag + 1e-30) << i << "," << j;
      }
    }
    // A slice of rows multiplies as the same rows of the whole.
    std::vector<float> ys(static_cast<size_t>(rows * 3));
    cpu::MatMulNT(x.data(), rows, w.Rows(10, 3), WeightRounding::kAsStored, ys.data());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(SameBits(ys[i * 3 + j], y[i * out + 10 + j]));
    }
  }
}

StoredTensor Tensor(std::string name, std::string dtype, std::vector<int64_t> shape, const std::vector<uint8_t>& bytes) {
  return {std::move(name), std::move(dtype), std::move(shape), bytes.data(), bytes.size(), "model.safetensors"};
}

TEST(Fp4Loader, NamesAndViews) {
  EXPECT_EQ(Fp4ExpertPrefix(Fp4Naming::kOfficial, 3, 7, ExpertProj::kGate), "layers.3.ffn.experts.7.w1");
  EXPECT_EQ(Fp4ExpertPrefix(Fp4Naming::kOfficial, 3, 7, ExpertProj::kUp), "layers.3.ffn.experts.7.w3");
  EXPECT_EQ(Fp4ExpertPrefix(Fp4Naming::kOfficial, 3, 7, ExpertProj::kDown), "layers.3.ffn.experts.7.w2");
  EXPECT_EQ(Fp4ExpertPrefix(Fp4Naming::kHf, 0, 1, ExpertProj::kDown), "model.layers.0.mlp.experts.1.down_proj");
  EXPECT_EQ(Fp4TensorNames(WeightDType::kMxfp4, "p"), (std::vector<std::string>{"p.weight", "p.scale"}));
  EXPECT_EQ(Fp4TensorNames(WeightDType::kNvfp4, "p"),
            (std::vector<std::string>{"p.weight", "p.weight_scale", "p.weight_scale_2"}));

  const std::vector<uint8_t> w(8 * 32), s32(8 * 2), s16(8 * 4), f(4, 0);
  auto ok = Mxfp4View(Tensor("a.weight", "I8", {8, 32}, w), Tensor("a.scale", "F8_E8M0", {8, 2}, s32), 8, 64);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->dtype, WeightDType::kMxfp4);
  EXPECT_EQ(ok->block_cols, 32);
  std::vector<uint8_t> two(4);
  const float half = 0.5f;
  std::memcpy(two.data(), &half, 4);
  auto nv = Nvfp4View(Tensor("b.weight", "U8", {8, 32}, w), Tensor("b.weight_scale", "F8_E4M3", {8, 4}, s16),
                      Tensor("b.weight_scale_2", "F32", {}, two), 8, 64);
  ASSERT_TRUE(nv.ok()) << nv.status().message();
  EXPECT_EQ(nv->scale_2, 0.5f);

  struct Bad { Result<WeightView> r; const char* want; };
  const Bad bad[] = {
      {Mxfp4View(Tensor("a.weight", "F32", {8, 32}, w), Tensor("a.scale", "F8_E8M0", {8, 2}, s32), 8, 64),
       "model.safetensors: tensor 'a.weight': dtype F32, expected I8 or U8 (MXFP4 E2M1 pairs)"},
      {Mxfp4View(Tensor("a.weight", "I8", {8, 32}, w), Tensor("a.scale", "F8_E8M0", {8, 4}, s16), 8, 64),
       "model.safetensors: tensor 'a.scale': shape [8, 4], expected [8, 2] (MXFP4 block scales)"},
      {Mxfp4View(Tensor("a.weight", "I8", {16, 16}, w), Tensor("a.scale", "F8_E8M0", {8, 2}, s32), 8, 64),
       "model.safetensors: tensor 'a.weight': shape [16, 16], expected [8, 32] (MXFP4 E2M1 pairs)"},
      {Mxfp4View(Tensor("a.weight", "I8", {8, 24}, w), Tensor("a.scale", "F8_E8M0", {8, 2}, s32), 8, 48),
       "model.safetensors: tensor 'a.weight': MXFP4 needs an input dimension (48) that is a positive multiple "
       "of 32"},
      {Mxfp4View(Tensor("a.weight", "I8", {8, 32}, s32), Tensor("a.scale", "F8_E8M0", {8, 2}, s32), 8, 64),
       "model.safetensors: tensor 'a.weight': 16 bytes, expected 256 (MXFP4 E2M1 pairs)"},
      {Nvfp4View(Tensor("b.weight", "U8", {8, 32}, w), Tensor("b.weight_scale", "F8_E8M0", {8, 4}, s16),
                 Tensor("b.weight_scale_2", "F32", {}, f), 8, 64),
       "model.safetensors: tensor 'b.weight_scale': dtype F8_E8M0, expected F8_E4M3 (NVFP4 block scales)"},
      {Nvfp4View(Tensor("b.weight", "U8", {8, 32}, w), Tensor("b.weight_scale", "F8_E4M3", {8, 4}, s16),
                 Tensor("b.weight_scale_2", "BF16", {}, f), 8, 64),
       "model.safetensors: tensor 'b.weight_scale_2': dtype BF16, expected F32 (NVFP4 per-tensor scale)"},
      {Nvfp4View(Tensor("b.weight", "U8", {8, 32}, w), Tensor("b.weight_scale", "F8_E4M3", {8, 4}, s16),
                 Tensor("b.weight_scale_2", "F32", {2}, f), 8, 64),
       "model.safetensors: tensor 'b.weight_scale_2': shape [2], expected [1] (NVFP4 per-tensor scale)"},
  };
  for (const Bad& b : bad) {
    ASSERT_FALSE(b.r.ok()) << b.want;
    EXPECT_EQ(b.r.status().message(), b.want);
  }
}

}  // namespace
}  // namespace lockstep::kernels
