// kernels/cpu/numerics.h — scalar number formats used by checkpoints and the KV cache.
//
// bf16, fp16 and FP8 E4M3 (the OCP "e4m3fn" variant: no infinities, 0x7f/0xff are NaN,
// largest finite 448) to and from fp32. Encoders round to nearest, ties to even, the rule
// torch, CUDA's __float2bfloat16_rn and __nv_cvt_float_to_fp8(…, __NV_SATFINITE, …) use, so
// the GPU path can reproduce the CPU's cache bytes bit for bit. docs/kv-cache.md states it.
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace lockstep::kernels {

inline float Bf16ToF32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays a quiet NaN (sign kept).
inline uint16_t F32ToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return std::bit_cast<float>(sign);
    // Subnormal: value = man × 2^-24.
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

// fp32 to fp16 (IEEE binary16), round to nearest, ties to even; past 65504 (after rounding)
// ±inf; NaN stays a quiet NaN (sign kept). The same bits as a C++ cast to _Float16, which some
// compilers lack on x86 (clang 14): tests/numerics_test.cc compares the two where it exists.
inline uint16_t F32ToF16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65520: rounds past 65504
  const int32_t exp = static_cast<int32_t>(a >> 23) - 127;
  if (exp < -14) {
    // Subnormal (or zero) in fp16: the value in units of 2^-24, rounded to nearest even.
    if (exp < -25) return sign;  // below 2^-25: rounds to ±0
    const uint32_t man = (a & 0x7fffffu) | 0x800000u;  // value = man × 2^(exp - 23)
    const int shift = -exp - 1;                        // to units of 2^-24: man >> (exp·(-1) - 1)
    const uint32_t q = man >> shift, rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
    const uint32_t r = q + (rem > half || (rem == half && (q & 1u)));
    return static_cast<uint16_t>(sign | r);
  }
  // Normal: drop 13 mantissa bits with round to nearest even (a carry may bump the exponent).
  const uint32_t base = a - (112u << 23);  // exponent rebased from 127 to 15
  const uint32_t r = (base + 0xfffu + ((base >> 13) & 1u)) >> 13;
  return static_cast<uint16_t>(sign | r);
}

// E4M3 (fn): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals 2^-6 × m/8.
inline float Fp8E4m3ToF32(uint8_t b) {
  uint32_t sign = b & 0x80u;
  uint32_t exp = (b >> 3) & 0xfu;
  uint32_t man = b & 0x7u;
  float v;
  if (exp == 0xf && man == 0x7) return std::nanf("");
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -9);  // m/8 × 2^-6
  } else {
    v = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, static_cast<int>(exp) - 7);
  }
  return sign ? -v : v;
}

// Every e4m3 byte's value: Fp8E4m3ToF32 of it, bit for bit (NaN included), for the loops that
// dequantise a KV cache or weights element by element (a lookup instead of ldexp). Take the
// pointer once outside the loop.
inline const float* Fp8E4m3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = Fp8E4m3ToF32(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

inline constexpr float kFp8E4m3Max = 448.0f;

// Round to nearest even with saturation to ±448 (finite inputs never become NaN);
// NaN maps to 0x7f. This is the "satfinite" conversion.
inline uint8_t F32ToFp8E4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= kFp8E4m3Max) return sign | 0x7e;  // 448 = 1.75 × 2^8
  // Smallest normal is 2^-6; below it the grid is uniform with step 2^-9.
  if (a < 0.015625f) {
    float q = std::nearbyint(a * 512.0f);  // default rounding mode is nearest-even
    return sign | static_cast<uint8_t>(q);  // q ≤ 8; q == 8 encodes 2^-6 (exp 1, man 0)
  }
  int e;
  float m = std::frexp(a, &e);  // a = m × 2^e, m in [0.5, 1)
  // a = (1 + man/8) × 2^(e-1); scaled mantissa on a grid of 1/8.
  float scaled = std::nearbyint((m * 2.0f - 1.0f) * 8.0f);  // 0..8
  int exp = e - 1 + 7;
  if (scaled >= 8.0f) {
    scaled = 0.0f;
    exp += 1;
  }
  if (exp > 15 || (exp == 15 && scaled > 6.0f)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((exp << 3) | static_cast<int>(scaled));
}

}  // namespace lockstep::kernels
