// tests/numerics_test.cc — number formats against hand-computed cases (bit patterns from the
// OCP FP8 spec table and IEEE bf16), and kernels against naive double-precision loops.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>

#include <Eigen/Dense>

#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"
#include "kernels/mla_splits.h"

namespace lockstep::kernels {
namespace {

TEST(Bf16, RoundTripsAndRoundsToNearestEven) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToF32(0x3f80), 1.0f);
  EXPECT_EQ(F32ToBf16(-2.0f), 0xc000);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even → 1.0.
  EXPECT_EQ(F32ToBf16(1.00390625f), 0x3f80);
  // 1 + 3·2^-8 is halfway between 1.0078125 (odd mantissa) and 1.015625: → 1.015625.
  EXPECT_EQ(F32ToBf16(1.01171875f), 0x3f82);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::nanf("")))));
  EXPECT_EQ(Bf16ToF32(F32ToBf16(INFINITY)), INFINITY);
}

TEST(F16, DecodesNormalsSubnormalsAndSpecials) {
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0xc000), -2.0f);
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToF32(0x7c00), INFINITY);
}

// F32ToF16 is the fallback for compilers without _Float16 (engine/model.cc's fault-zoo fp16
// softmax): hand-computed cases, then the compiler's own cast on every 11th fp32 bit pattern
// (all exponents, signs and NaN payload classes; low mantissa bits in every residue) and on
// every tie between two fp16 neighbours.
TEST(F16, EncodesAsTheCompilersCast) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // the tie above the largest finite rounds to even: inf
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);   // tie between 0 and 2^-24: even (0)
  EXPECT_EQ(F32ToF16(std::ldexp(3.0f, -25)), 0x0002);   // tie between 2^-24 and 2^-23: even
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie: stays 1
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(-INFINITY), 0xfc00);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -14) * (1023.0f / 1024.0f) + std::ldexp(1.0f, -25)), 0x0400);  // carry to normal
#ifdef __FLT16_MAX__
  auto cast = [](float f) { return std::bit_cast<uint16_t>(static_cast<_Float16>(f)); };
  for (uint64_t u = 0; u <= 0xffffffffull; u += 11) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(u));
    ASSERT_EQ(F32ToF16(f), cast(f)) << std::hex << u;
  }
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // the midpoint above each finite fp16, both signs
    const float mid = (F16ToF32(static_cast<uint16_t>(h)) + F16ToF32(static_cast<uint16_t>(h + 1))) / 2;
    ASSERT_EQ(F32ToF16(mid), cast(mid)) << h;
    ASSERT_EQ(F32ToF16(-mid), cast(-mid)) << h;
  }
#else
  GTEST_SKIP() << "this compiler has no _Float16 to compare with";
#endif
}

TEST(Fp8E4m3, DecodesTheSpecTable) {
  EXPECT_EQ(Fp8E4m3ToF32(0x00), 0.0f);
  EXPECT_EQ(Fp8E4m3ToF32(0x38), 1.0f);                     // exp 7, man 0
  EXPECT_EQ(Fp8E4m3ToF32(0x7e), 448.0f);                   // largest finite
  EXPECT_EQ(Fp8E4m3ToF32(0x01), std::ldexp(1.0f, -9));     // smallest subnormal
  EXPECT_EQ(Fp8E4m3ToF32(0x08), std::ldexp(1.0f, -6));     // smallest normal
  EXPECT_EQ(Fp8E4m3ToF32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(Fp8E4m3ToF32(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4m3ToF32(0xff)));
}

// The lookup table the KV-cache and weight loops use: the decoder's bits for every byte, and
// the OCP definition computed independently in double precision.
TEST(Fp8E4m3, TableIsTheDecoderForEveryByte) {
  const float* table = Fp8E4m3Table();
  for (int b = 0; b < 256; ++b) {
    const float t = table[b], f = Fp8E4m3ToF32(static_cast<uint8_t>(b));
    EXPECT_EQ(std::bit_cast<uint32_t>(t), std::bit_cast<uint32_t>(f)) << "byte " << b;
    const int exp = (b >> 3) & 0xf, man = b & 7;
    if (exp == 0xf && man == 7) {
      EXPECT_TRUE(std::isnan(t)) << "byte " << b;
      continue;
    }
    const double mag = exp == 0 ? man / 8.0 * std::ldexp(1.0, -6) : (1.0 + man / 8.0) * std::ldexp(1.0, exp - 7);
    EXPECT_EQ(static_cast<double>(t), (b & 0x80) ? -mag : mag) << "byte " << b;
    EXPECT_EQ(std::signbit(t), (b & 0x80) != 0) << "byte " << b;  // −0 for 0x80
  }
}

TEST(Fp8E4m3, EncodesEveryValueBackToItself) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;  // NaN
    const float v = Fp8E4m3ToF32(static_cast<uint8_t>(b));
    const uint8_t e = F32ToFp8E4m3(v);
    if (v == 0.0f) {
      EXPECT_EQ(Fp8E4m3ToF32(e), 0.0f);
    } else {
      EXPECT_EQ(e, b) << "value " << v;
    }
  }
}

TEST(Fp8E4m3, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(F32ToFp8E4m3(1000.0f), 0x7e);   // saturates to 448, never NaN
  EXPECT_EQ(F32ToFp8E4m3(-1000.0f), 0xfe);
  EXPECT_EQ(F32ToFp8E4m3(INFINITY), 0x7e);
  // Between 1.0 (0x38) and 1.125 (0x39): 1.0625 is the tie → even mantissa (1.0).
  EXPECT_EQ(F32ToFp8E4m3(1.0625f), 0x38);
  // Between 1.125 (0x39) and 1.25 (0x3a): 1.1875 is the tie → even (1.25).
  EXPECT_EQ(F32ToFp8E4m3(1.1875f), 0x3a);
  EXPECT_EQ(F32ToFp8E4m3(1.07f), 0x39);
  // Subnormal grid (2^-9): 1.5·2^-9 ties to 2·2^-9.
  EXPECT_EQ(F32ToFp8E4m3(std::ldexp(1.5f, -9)), 0x02);
  // Against exhaustive nearest search on random values.
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-500.0f, 500.0f);
  for (int i = 0; i < 20000; ++i) {
    float x = u(rng) * std::pow(2.0f, static_cast<float>(i % 20) - 14.0f);
    float best = 0, bd = INFINITY;
    for (int b = 0; b < 256; ++b) {
      if ((b & 0x7f) == 0x7f) continue;
      float v = Fp8E4m3ToF32(static_cast<uint8_t>(b));
      if (std::fabs(v - x) < bd) bd = std::fabs(v - x), best = v;
    }
    const float got = Fp8E4m3ToF32(F32ToFp8E4m3(x));
    if (std::fabs(x) <= 448.0f) {
      EXPECT_EQ(std::fabs(got - x), bd) << x;
    } else {
      EXPECT_EQ(std::fabs(got), 448.0f);
    }
    (void)best;
  }
}

TEST(Ops, DotAndMatMulMatchDoublePrecisionAndAreRowIndependent) {
  std::mt19937 rng(2);
  std::normal_distribution<float> n(0, 1);
  const int64_t in = 77, out = 13;
  std::vector<float> x(5 * in), w(out * in);
  for (auto& v : x) v = n(rng);
  for (auto& v : w) v = n(rng);
  std::vector<float> y(5 * out), y1(out);
  cpu::MatMulNT(x.data(), 5, w.data(), out, in, y.data());
  for (int r = 0; r < 5; ++r) {
    cpu::MatMulNT(&x[r * in], 1, w.data(), out, in, y1.data());
    for (int j = 0; j < out; ++j) {
      double ref = 0;
      for (int k = 0; k < in; ++k) ref += static_cast<double>(x[r * in + k]) * w[j * in + k];
      EXPECT_NEAR(y[r * out + j], ref, 1e-4);
      EXPECT_EQ(y[r * out + j], y1[j]) << "a row's result must not depend on the other rows";
    }
  }
}

TEST(Ops, MatMulAgreesWithEigenInDoublePrecision) {
  // An independent implementation: Eigen's product in fp64 on the same operands.
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0, 1);
  const int64_t rows = 9, in = 300, out = 45;
  std::vector<float> x(rows * in), w(out * in), y(rows * out);
  for (auto& v : x) v = n(rng);
  for (auto& v : w) v = n(rng);
  cpu::MatMulNT(x.data(), rows, w.data(), out, in, y.data());
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::MatrixXd ref = Eigen::Map<RowMajor>(x.data(), rows, in).cast<double>() *
                        Eigen::Map<RowMajor>(w.data(), out, in).cast<double>().transpose();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < out; ++j) {
      // fp32 accumulation of 300 unit-variance products: error ≲ √300 · 2⁻²⁴ · |terms| ≈ 1e-5 · 17.
      EXPECT_NEAR(y[r * out + j], ref(r, j), 5e-4) << r << "," << j;
    }
  }
}

// norm=lanes256 (the CUDA kernels' order, fp32 lanes) against the fp64 RmsNorm: within the bound
// of its fp32 sums, (⌈n/256⌉/2 + 14)·u relative; a row alone as in a batch; NaN and ±Inf as the
// fp64 norm has them. By hand: 1 and 2⁻¹² in one lane (n = 512) lose the 2⁻²⁴ of their squares'
// sum to the fp32 tie, where fp64 keeps it — so the two norms are different functions.
TEST(Ops, RmsNormLanes256IsWithinFp32OfTheFp64Norm) {
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0, 2);
  for (const int64_t n : {1, 100, 256, 513, 2048, 7168}) {
    const int64_t rows = 3;
    std::vector<float> x(rows * n), w(n), a(rows * n), b(rows * n), one(n);
    for (auto& v : x) v = nd(rng);
    for (auto& v : w) v = nd(rng);
    cpu::RmsNormLanes256(x.data(), w.data(), rows, n, 1e-6, a.data());
    cpu::RmsNorm(x.data(), w.data(), rows, n, 1e-6, b.data());
    const double u = std::ldexp(1.0, -24), tol = (static_cast<double>((n + 255) / 256) / 2 + 14) * u;
    for (int64_t i = 0; i < rows * n; ++i) {
      ASSERT_NEAR(a[i], b[i], tol * std::fabs(b[i]) + 1e-30) << "n " << n << " at " << i;
    }
    cpu::RmsNormLanes256(&x[n], w.data(), 1, n, 1e-6, one.data());
    EXPECT_EQ(0, std::memcmp(one.data(), &a[n], n * sizeof(float))) << "n " << n << ": row 1 alone";
  }
  std::vector<float> x(3 * 4, 1.0f), w(4, 1.0f), a(12), b(12);
  x[1] = NAN;
  x[4 + 2] = INFINITY;
  cpu::RmsNormLanes256(x.data(), w.data(), 3, 4, 1e-6, a.data());
  cpu::RmsNorm(x.data(), w.data(), 3, 4, 1e-6, b.data());
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(std::isnan(a[i]), std::isnan(b[i])) << i;
    if (!std::isnan(b[i])) EXPECT_EQ(a[i], b[i]) << i;  // these rows' sums are exact either way
  }
  std::vector<float> h(512, 0.0f), hw(512, 1.0f), ha(512), hb(512);
  h[0] = 1.0f;
  h[256] = std::ldexp(1.0f, -12);
  cpu::RmsNormLanes256(h.data(), hw.data(), 1, 512, 0.0, ha.data());
  cpu::RmsNorm(h.data(), hw.data(), 1, 512, 0.0, hb.data());
  const float inv32 = 1.0f / std::sqrt(1.0f / 512.0f);  // lane 0: fma(2⁻¹², 2⁻¹², 1) = 1 in fp32
  EXPECT_EQ(ha[0], inv32);
  EXPECT_EQ(hb[0], static_cast<float>(1.0 / std::sqrt((1.0 + std::ldexp(1.0, -24)) / 512.0)));
}

// SwiGlu's element is (g / (1 + e)) · u with e = exp(−g) correctly rounded to fp32 (the CUDA
// kernels' value): bit for bit the same fp32 expression over long double expl rounded once, for
// 100k random gates and the edges (exp overflow → −0, NaN, ±0, ±inf up).
TEST(Ops, SwiGluRoundsExpOnce) {
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0, 6);
  std::vector<float> g(100000), u(g.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = nd(rng), u[i] = nd(rng);
  g[0] = -100.0f, g[1] = 100.0f, g[2] = -0.0f, g[3] = 0.0f, u[4] = INFINITY, g[5] = NAN, g[6] = 88.7f, g[7] = -88.8f;
  std::vector<float> got(g.size());
  cpu::SwiGlu(g.data(), u.data(), static_cast<int64_t>(g.size()), got.data());
  for (size_t i = 0; i < g.size(); ++i) {
    const float e = static_cast<float>(std::exp(-static_cast<long double>(g[i])));
    const float want = (g[i] / (1.0f + e)) * u[i];
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want)) << "g " << g[i] << " u " << u[i];
    }
  }
}

// n random keys of C values each and their scores (× score_scale); key j is masked (a null row)
// when j % mask_every == mask_at.
struct RandomKeys {
  std::vector<float> lat, scores;
  std::vector<const float*> rows;
};
RandomKeys MakeKeys(int64_t n, int64_t C, float score_scale, int64_t mask_every, int64_t mask_at, std::mt19937& rng) {
  std::normal_distribution<float> nd(0, 1);
  RandomKeys k;
  k.lat.resize(n * C);
  k.scores.resize(n);
  k.rows.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    k.scores[j] = score_scale * nd(rng);
    for (int64_t c = 0; c < C; ++c) k.lat[j * C + c] = nd(rng);
    k.rows[j] = j % mask_every == mask_at ? nullptr : &k.lat[j * C];
  }
  return k;
}

// cpu::MlaAttend: the split rule's values, hand cases exact to the bit, masks, and the
// softmax-weighted sum within the fp32 bound of an fp64 reference across split sizes.
TEST(Ops, MlaAttendSplitsTilesAndMerges) {
  EXPECT_EQ(kernels::MlaSplitKeysOf(1), 32);
  EXPECT_EQ(kernels::MlaSplitKeysOf(2048), 32);
  EXPECT_EQ(kernels::MlaNumSplits(2048), 64);
  EXPECT_EQ(kernels::MlaSplitKeysOf(2049), 64);  // ⌈2049 / 64⌉ = 33, whole tiles: 64
  EXPECT_EQ(kernels::MlaNumSplits(2049), 33);
  EXPECT_EQ(kernels::MlaSplitKeysOf(20000), 320);
  EXPECT_EQ(kernels::MlaNumSplits(20000), 63);
  EXPECT_EQ(kernels::MlaNumSplits(0), 0);

  // One key: its row, exactly (p = ExpF(0) = 1, l = 1, f = 1).
  const float r0[3] = {1.5f, -2.25f, 1e-30f};
  const float* one[1] = {r0};
  const float s0[1] = {-7.0f};
  float out[3];
  float M = 0;
  EXPECT_EQ(cpu::MlaAttend(s0, one, 1, 3, out, &M), 1.0f);
  EXPECT_EQ(M, -7.0f);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(out[c], r0[c]);
  // Two keys of one score in different splits (40 keys: splits 0–31 and 32–39), the rest
  // masked: each split's l = 1 and o = its row, M = 0, L = 2 → (2 + 4) / 2 = 3.
  const float two[1] = {2.0f}, four[1] = {4.0f};
  std::vector<const float*> rows(40, nullptr);
  std::vector<float> sc(40, 123.0f);  // masked keys' scores are never read
  rows[0] = two;
  rows[35] = four;
  sc[0] = sc[35] = 0.0f;
  EXPECT_EQ(cpu::MlaAttend(sc.data(), rows.data(), 40, 1, out), 2.0f);
  EXPECT_EQ(out[0], 3.0f);
  // No unmasked key: zeros, L = 0.
  std::fill(rows.begin(), rows.end(), nullptr);
  out[0] = NAN;
  EXPECT_EQ(cpu::MlaAttend(sc.data(), rows.data(), 40, 1, out), 0.0f);
  EXPECT_EQ(out[0], 0.0f);

  // Random keys against fp64: |out − ref| ≤ (depth + 4·exps)·u · Σ p|row| per column, over one
  // split, many splits of one tile, and wide splits; with a third of the keys masked.
  std::mt19937 rng(5);
  for (int64_t n : {5, 33, 700, 2049, 5000}) {
    const int64_t C = 24;
    const RandomKeys keys = MakeKeys(n, C, 2.5f, 3, 1, rng);
    const std::vector<float>& lat = keys.lat;
    const std::vector<float>& s = keys.scores;
    const std::vector<const float*>& r = keys.rows;
    std::vector<float> got(C);
    cpu::MlaAttend(s.data(), r.data(), n, C, got.data());
    double m = -INFINITY, z = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (r[j] != nullptr) m = std::max(m, static_cast<double>(s[j]));
    }
    for (int64_t j = 0; j < n; ++j) {
      if (r[j] != nullptr) z += std::exp(s[j] - m);
    }
    const int64_t split = kernels::MlaSplitKeysOf(n);
    const double u = std::ldexp(1.0, -24);
    const double bound = (split + split / 32 + kernels::MlaNumSplits(n) + 4 + 4.0 * (split / 32 + 2)) * 2 * u + u;
    for (int64_t c = 0; c < C; ++c) {
      double ref = 0, mass = 0;
      for (int64_t j = 0; j < n; ++j) {
        if (r[j] == nullptr) continue;
        const double p = std::exp(s[j] - m) / z;
        ref += p * lat[j * C + c];
        mass += p * std::fabs(lat[j * C + c]);
      }
      EXPECT_LE(std::fabs(got[c] - ref), bound * mass) << "n " << n << " c " << c;
    }
  }
}

// cpu::MlaAttend is the CUDA split kernel's arithmetic: a lane-by-lane emulation of
// kernels/cuda/mla_decode.cu (32 lanes each holding its key's score and its own running max and
// sum, the xor butterflies of dev::WarpMax / WarpSum on all 32 lanes, P·V per column in key
// order) and of mla_combine.cuh's merge gives the same bits.
TEST(Ops, MlaAttendIsTheKernelsLaneByLaneArithmetic) {
  auto emulate = [](const std::vector<float>& sc, const std::vector<const float*>& rows, int64_t C) {
    const int64_t n = static_cast<int64_t>(sc.size());
    const int64_t sk = kernels::MlaSplitKeysOf(n), S = kernels::MlaNumSplits(n);
    std::vector<std::vector<float>> o(S, std::vector<float>(C, 0.0f));
    std::vector<float> ms(S), ls(S);
    for (int64_t s = 0; s < S; ++s) {
      float m_run[32], l_run[32];
      std::fill(m_run, m_run + 32, -INFINITY);
      std::fill(l_run, l_run + 32, 0.0f);
      const int64_t end = std::min(n, (s + 1) * sk);
      for (int64_t t0 = s * sk; t0 < end; t0 += 32) {
        float v[32], p[32], alpha[32];
        for (int lane = 0; lane < 32; ++lane) {
          const int64_t key = t0 + lane;
          v[lane] = key < end && rows[key] != nullptr ? sc[key] : -INFINITY;
        }
        float mx[32], sm[32];
        std::copy(v, v + 32, mx);
        for (int w = 16; w >= 1; w /= 2) {
          float nx[32];
          for (int i = 0; i < 32; ++i) nx[i] = std::fmax(mx[i], mx[i ^ w]);
          std::copy(nx, nx + 32, mx);
        }
        for (int lane = 0; lane < 32; ++lane) {
          const float m_new = std::fmax(m_run[lane], mx[lane]);
          p[lane] = v[lane] == -INFINITY ? 0.0f : cpu::ExpF(v[lane] - m_new);
          alpha[lane] = m_run[lane] == -INFINITY ? 0.0f : cpu::ExpF(m_run[lane] - m_new);
          m_run[lane] = m_new;
        }
        std::copy(p, p + 32, sm);
        for (int w = 16; w >= 1; w /= 2) {
          float nx[32];
          for (int i = 0; i < 32; ++i) nx[i] = sm[i] + sm[i ^ w];
          std::copy(nx, nx + 32, sm);
        }
        for (int lane = 0; lane < 32; ++lane) l_run[lane] = l_run[lane] * alpha[lane] + sm[lane];
        for (int64_t c = 0; c < C; ++c) {
          float acc = o[s][c] * alpha[0];  // (lane 0's alpha is the one published)
          for (int t = 0; t < 32; ++t) {
            const int64_t key = t0 + t;
            const float kv = key < end && rows[key] != nullptr ? rows[key][c] : 0.0f;
            acc = std::fma(p[t], kv, acc);
          }
          o[s][c] = acc;
        }
      }
      ms[s] = m_run[0];
      ls[s] = l_run[0];
    }
    float M = -INFINITY;
    for (int64_t s = 0; s < S; ++s) M = std::fmax(M, ms[s]);
    std::vector<float> f(S);
    for (int64_t s = 0; s < S; ++s) f[s] = ms[s] == -INFINITY ? 0.0f : cpu::ExpF(ms[s] - M);
    float L = 0.0f;
    for (int64_t s = 0; s < S; ++s) L = L + ls[s] * f[s];
    std::vector<float> out(C);
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0.0f;
      for (int64_t s = 0; s < S; ++s) acc = std::fma(o[s][c], f[s], acc);
      out[c] = L == 0.0f ? 0.0f : acc / L;
    }
    return out;
  };
  std::mt19937 rng(17);
  for (int64_t n : {1, 31, 33, 64, 100, 2049, 3000}) {
    const int64_t C = 20;
    const RandomKeys keys = MakeKeys(n, C, 3.0f, 7, 3, rng);
    const std::vector<float> want = emulate(keys.scores, keys.rows, C);
    std::vector<float> got(C);
    cpu::MlaAttend(keys.scores.data(), keys.rows.data(), n, C, got.data());
    for (int64_t c = 0; c < C; ++c) {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[c]), std::bit_cast<uint32_t>(want[c])) << "n " << n << " c " << c;
    }
  }
}

TEST(Ops, RmsNormSoftmaxAndRope) {
  std::vector<float> x = {1, 2, 3, 4}, w = {1, 1, 2, 0.5f}, y(4);
  cpu::RmsNorm(x.data(), w.data(), 1, 4, 0.0, y.data());
  const double rms = std::sqrt((1 + 4 + 9 + 16) / 4.0);
  EXPECT_NEAR(y[2], 2 * 3 / rms, 1e-6);
  std::vector<float> s = {1000, 1000, -INFINITY};
  cpu::Softmax(s.data(), 3);
  EXPECT_FLOAT_EQ(s[0], 0.5f);
  EXPECT_EQ(s[2], 0.0f);
  // RoPE by 90°: (1, 0) → (0, 1) in every layout.
  float c[1] = {0}, sn[1] = {1};
  std::vector<float> a = {1, 0};
  cpu::RopePairsAdjacent(a.data(), c, sn, 2);
  EXPECT_FLOAT_EQ(a[1], 1);
  std::vector<float> b = {1, 0};
  cpu::RopeHalves(b.data(), c, sn, 2);
  EXPECT_FLOAT_EQ(b[1], 1);
  // Pairs-to-halves puts the rotated even elements first: (x0,x1,x2,x3) → (r0, r2 | r1, r3).
  float c2[2] = {1, 1}, s2[2] = {0, 0};
  std::vector<float> d = {10, 11, 12, 13};
  cpu::RopePairsToHalves(d.data(), c2, s2, 4);
  EXPECT_EQ(d, (std::vector<float>{10, 12, 11, 13}));
}

TEST(Ops, HadamardIsOrthogonalAndMatchesTheMatrix) {
  // H_4 (Sylvester) / 2 applied to e_1 gives its second column: (1, -1, 1, -1) / 2.
  std::vector<float> e = {0, 1, 0, 0};
  cpu::Hadamard(e.data(), 4);
  EXPECT_EQ(e, (std::vector<float>{0.5f, -0.5f, 0.5f, -0.5f}));
  std::mt19937 rng(4);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> a(64), b(64);
  for (auto& v : a) v = n(rng);
  for (auto& v : b) v = n(rng);
  const float dot = cpu::Dot(a.data(), b.data(), 64);
  cpu::Hadamard(a.data(), 64);
  cpu::Hadamard(b.data(), 64);
  EXPECT_NEAR(cpu::Dot(a.data(), b.data(), 64), dot, 1e-4);
}

}  // namespace
}  // namespace lockstep::kernels
