// kernels/cuda/device_math.cuh — device twins of the CPU's scalar numerics.
//
// Each function here is a line-by-line port of its CPU counterpart (kernels/cpu/numerics.h,
// kernels/cpu/ops.cc's Dot, engine/kv_cache.cc's Fp8TileScale) using correctly rounded
// intrinsics, so the GPU produces the CPU's bits. The library is compiled with --fmad=false;
// the __f*_rn intrinsics make the intent explicit and survive a change of that flag.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lockstep::kernels::cuda::dev {

// --- exp (kernels/cpu/ops.h ExpF) --------------------------------------------------------
// expf as the correctly rounded value: CUDA's double exp (≤ 1 double ulp) rounded once to
// fp32 — cpu::ExpF's bits (the double exps of glibc and CUDA round to one float unless they
// straddle a rounding boundary, about once in 2^29). glibc's expf is 1 ulp off in ≈0.06 % of
// inputs and CUDA's own expf (≤ 2 ulp) more often: neither is shared by the two backends.
__device__ __forceinline__ float ExpF(float v) { return __double2float_rn(exp(static_cast<double>(v))); }

// --- bf16 (kernels/cpu/numerics.h Bf16ToF32 / F32ToBf16) ---------------------------------
__device__ __forceinline__ float Bf16ToF32(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

__device__ __forceinline__ uint16_t F32ToBf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

// --- FP8 E4M3 "fn" (kernels/cpu/numerics.h) ---------------------------------------------
__device__ __forceinline__ float Fp8E4m3ToF32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t man = b & 0x7u;
  if (exp == 0xf && man == 0x7) return __uint_as_float(0x7fc00000u);  // NaN (the CPU's nanf(""))
  if (exp == 0) {
    // m/8 · 2^-6 = m · 2^-9, exact in fp32.
    return __uint_as_float(sign | __float_as_uint(static_cast<float>(man) * 0.001953125f));
  }
  return __uint_as_float(sign | ((exp - 7u + 127u) << 23) | (man << 20));
}

// Two e4m3 values (the low byte first) as fp32, exactly: the hardware's conversion to f16,
// which holds every e4m3 value, then to fp32. Finite values equal Fp8E4m3ToF32's.
__device__ __forceinline__ float2 Fp8x2ToF32(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return __half22float2(__half2(h));
}

// Round to nearest even with saturation to ±448; NaN → 0x7f. The CPU's algorithm, step by step.
__device__ __forceinline__ uint8_t F32ToFp8E4m3(float f) {
  if (isnan(f)) return 0x7f;
  const uint8_t sign = signbit(f) ? 0x80 : 0x00;
  const float a = fabsf(f);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0.015625f) {
    const float q = rintf(__fmul_rn(a, 512.0f));
    return sign | static_cast<uint8_t>(q);
  }
  int e;
  const float m = frexpf(a, &e);
  float scaled = rintf(__fmul_rn(__fsub_rn(__fmul_rn(m, 2.0f), 1.0f), 8.0f));
  int exp = e - 1 + 7;
  if (scaled >= 8.0f) {
    scaled = 0.0f;
    exp += 1;
  }
  if (exp > 15 || (exp == 15 && scaled > 6.0f)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((exp << 3) | static_cast<int>(scaled));
}

// engine/kv_cache.cc Fp8TileScale from a tile's amax (max of |x| ignoring NaN, as fmax does):
// 2^ceil(log2(amax/448)), 1 when amax is 0 or not finite. ceil(log2(r)) is computed exactly
// from frexp (r = m·2^e, m ∈ [0.5, 1): e − 1 when m = 0.5, else e); it equals the CPU's
// ceil(std::log2(r)) because r = amax/448 (fp32 amax, so r is within 2^-24 relative of a
// power of two only when it is one) is never close enough to an integer exponent for log2's
// rounding to matter.
__device__ __forceinline__ float Fp8ScaleFromAmax(float amax) {
  if (!(amax > 0.0f) || !isfinite(amax)) return 1.0f;
  const double r = static_cast<double>(amax) / 448.0;
  int e;
  const double m = frexp(r, &e);
  if (m == 0.5) e -= 1;
  return ldexpf(1.0f, e);
}

// cpu::Dot's fold of its 16 lanes: 16 → 8 → 4 → 2 → 1, pairwise. Spelled out: nvcc does not
// fully unroll a `w /= 2` loop, which would put acc in local memory.
__device__ __forceinline__ float Fold16(float (&acc)[16]) {
#pragma unroll
  for (int l = 0; l < 8; ++l) acc[l] = __fadd_rn(acc[l], acc[l + 8]);
#pragma unroll
  for (int l = 0; l < 4; ++l) acc[l] = __fadd_rn(acc[l], acc[l + 4]);
#pragma unroll
  for (int l = 0; l < 2; ++l) acc[l] = __fadd_rn(acc[l], acc[l + 2]);
  return __fadd_rn(acc[0], acc[1]);
}

// Fold16 over 8 consecutive lanes of a warp, lane g holding chains 2g and 2g + 1 (element i
// feeds chain i mod 16): chain l + chain l + 8 (lanes g, g + 4), then 8 → 4 (g, g + 2), 4 → 2
// (g, g + 1), 2 → 1. Lane g = 0 of each 8 holds the sum — Fold16's bits (each add pairs the
// same two partial sums).
__device__ __forceinline__ float FoldPairs8(float acc0, float acc1) {
  acc0 = __fadd_rn(acc0, __shfl_xor_sync(0xffffffffu, acc0, 4));
  acc1 = __fadd_rn(acc1, __shfl_xor_sync(0xffffffffu, acc1, 4));
  acc0 = __fadd_rn(acc0, __shfl_xor_sync(0xffffffffu, acc0, 2));
  acc1 = __fadd_rn(acc1, __shfl_xor_sync(0xffffffffu, acc1, 2));
  acc0 = __fadd_rn(acc0, __shfl_xor_sync(0xffffffffu, acc0, 1));
  acc1 = __fadd_rn(acc1, __shfl_xor_sync(0xffffffffu, acc1, 1));
  return __fadd_rn(acc0, acc1);
}

// Fold16 over a half-warp, lane l (of 16) holding chain l: l + 8, then 4, 2, 1, by shuffles.
// Lane 0 of each half-warp holds the sum (every lane of the warp calls it).
__device__ __forceinline__ float FoldHalfWarp16(float acc) {
  acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, 8, 16));
  acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, 4, 16));
  acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, 2, 16));
  return __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, 1, 16));
}

// --- cpu::Dot: 16 interleaved FMA lanes (lane = i mod 16), pairwise fold 16→8→4→2→1 ------
// NH dot products sharing `b` (one key against NH query heads). a[h] and b may live in any
// memory space. Register arrays are indexed by compile-time constants only.
template <int NH>
__device__ __forceinline__ void Dot16(const float* const (&a)[NH], const float* b, int n, float (&out)[NH]) {
  float acc[NH][16];
#pragma unroll
  for (int h = 0; h < NH; ++h) {
#pragma unroll
    for (int l = 0; l < 16; ++l) acc[h][l] = 0.0f;
  }
  int i = 0;
  for (; i + 16 <= n; i += 16) {
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const float bv = b[i + l];
#pragma unroll
      for (int h = 0; h < NH; ++h) acc[h][l] = __fmaf_rn(a[h][i + l], bv, acc[h][l]);
    }
  }
  // Tail: element i + l goes to lane l (the CPU's `for (l = 0; i < n; ++i, ++l)`).
#pragma unroll
  for (int l = 0; l < 16; ++l) {
    if (i + l < n) {
      const float bv = b[i + l];
#pragma unroll
      for (int h = 0; h < NH; ++h) acc[h][l] = __fmaf_rn(a[h][i + l], bv, acc[h][l]);
    }
  }
#pragma unroll
  for (int h = 0; h < NH; ++h) out[h] = Fold16(acc[h]);
}

// Dot16 with the a[h] read as float4 (a[h] 16-byte aligned, e.g. query rows in shared
// memory, read by every lane at once: one broadcast per 4 elements). The same FMAs in the
// same order per lane as Dot16: only the loads differ.
template <int NH>
__device__ __forceinline__ void Dot16A4(const float* const (&a)[NH], const float* b, int n, float (&out)[NH]) {
  float acc[NH][16];
#pragma unroll
  for (int h = 0; h < NH; ++h) {
#pragma unroll
    for (int l = 0; l < 16; ++l) acc[h][l] = 0.0f;
  }
  int i = 0;
  for (; i + 16 <= n; i += 16) {
#pragma unroll
    for (int l4 = 0; l4 < 4; ++l4) {
      float4 av[NH];
#pragma unroll
      for (int h = 0; h < NH; ++h) av[h] = *reinterpret_cast<const float4*>(a[h] + i + 4 * l4);
      const float b0 = b[i + 4 * l4], b1 = b[i + 4 * l4 + 1], b2 = b[i + 4 * l4 + 2], b3 = b[i + 4 * l4 + 3];
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        acc[h][4 * l4] = __fmaf_rn(av[h].x, b0, acc[h][4 * l4]);
        acc[h][4 * l4 + 1] = __fmaf_rn(av[h].y, b1, acc[h][4 * l4 + 1]);
        acc[h][4 * l4 + 2] = __fmaf_rn(av[h].z, b2, acc[h][4 * l4 + 2]);
        acc[h][4 * l4 + 3] = __fmaf_rn(av[h].w, b3, acc[h][4 * l4 + 3]);
      }
    }
  }
#pragma unroll
  for (int l = 0; l < 16; ++l) {
    if (i + l < n) {
      const float bv = b[i + l];
#pragma unroll
      for (int h = 0; h < NH; ++h) acc[h][l] = __fmaf_rn(a[h][i + l], bv, acc[h][l]);
    }
  }
#pragma unroll
  for (int h = 0; h < NH; ++h) out[h] = Fold16(acc[h]);
}

// --- order-preserving float bits ---------------------------------------------------------
// Larger float ⇔ larger key for non-NaN values; −0 and +0 share a key (the CPU compares
// them equal); NaN maps to 0, below −∞ (0x007fffff).
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  if (isnan(f)) return 0u;
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// --- warp reductions with a fixed butterfly (every lane ends with the same bits) ---------
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace lockstep::kernels::cuda::dev
