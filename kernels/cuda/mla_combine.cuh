// kernels/cuda/mla_combine.cuh — how MLA decode's splits are cut and merged, shared by the
// combine kernel (mla_decode.cu) and by the W_UV absorption that merges them where it reads
// its x (expert_gemm_stream.cu, ExpertGemmParams::x_partials): one code path, so both give one set of
// bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/mla_splits.h"

namespace lockstep::kernels::cuda::dev {

// The split rule (kernels/mla_splits.h, shared with the CPU reference's cpu::MlaAttend).
using kernels::kMlaBaseSplitKeys;
using kernels::kMlaMaxSplits;
using kernels::kMlaTileKeys;
using kernels::MlaNumSplits;
using kernels::MlaSplitKeysOf;

// Splits a grid (and a workspace) must cover for any n ≤ max_keys (MlaNumSplits is not monotone
// above 2048 keys).
__host__ __device__ inline int64_t MlaSplitsFor(int64_t max_keys) {
  return max_keys > int64_t{kMlaBaseSplitKeys} * kMlaMaxSplits ? kMlaMaxSplits : MlaNumSplits(max_keys);
}

// Request b's key count as the split kernels read it: the top-k (sparse), else seq_lens[b], or
// 0 when that lies outside the table (the split kernels flag it; nothing is flagged here).
__device__ __forceinline__ int64_t MlaPartialsKeys(const MlaPartials& q, int64_t b) {
  if (q.seq_lens == nullptr) return q.topk;
  const int64_t n = q.seq_lens[b];
  return n < 0 || n > q.max_seq_len || n > q.key_capacity ? 0 : n;
}

// Request b, head h: its splits merged in ascending order — M = max m_s, f_s = exp(m_s − M)
// (ExpF: the CPU's cpu::ExpF bits),
// L = Σ l_s f_s, o_c = (Σ_s o_s,c f_s) / L (0 where L = 0) — and put(c, o_c) for every column
// c < kv_lora. Every thread of the CTA calls it (block barriers); `threads` = blockDim.x;
// `scratch`: kMlaCombineScratch floats of shared memory. Each column's sums run over s in one
// order whatever the thread count: the same bits in any CTA. Returns L; *M_out = M (when set).
constexpr int kMlaCombineScratch = 3 * kMlaMaxSplits;
template <typename Put>
__device__ float MlaCombineSplits(const MlaPartials& q, int64_t b, int64_t h, int tid, int threads, float* scratch,
                                  Put put, float* M_out) {
  float* const f_s = scratch;
  float* const m_s = scratch + kMlaMaxSplits;
  float* const l_s = scratch + 2 * kMlaMaxSplits;
  const int C = static_cast<int>(q.kv_lora);
  const int S = static_cast<int>(MlaNumSplits(MlaPartialsKeys(q, b)));
  const int64_t base = (b * q.heads + h) * q.splits;
  // The splits' m and l into shared memory in one round trip (S ≤ 64).
  for (int s = tid; s < S; s += threads) {
    m_s[s] = q.m[base + s];
    l_s[s] = q.l[base + s];
  }
  __syncthreads();
  // Every thread computes M and L itself, in the same order: identical bits, no broadcast.
  float M = -INFINITY;
  for (int s = 0; s < S; ++s) M = fmaxf(M, m_s[s]);
  for (int s = tid; s < S; s += threads) {
    const float m = m_s[s];
    f_s[s] = m == -INFINITY ? 0.0f : ExpF(__fsub_rn(m, M));
  }
  __syncthreads();
  float L = 0.0f;
  for (int s = 0; s < S; ++s) L = __fadd_rn(L, __fmul_rn(l_s[s], f_s[s]));
  // A thread's kCols columns (c, c + threads, …) at once: their partials' loads go out
  // together, 16 splits at a time, ahead of the FMAs, which keep ascending s per column.
  constexpr int kCols = 4;
  for (int c0 = tid; c0 < C; c0 += threads * kCols) {
    float acc[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) acc[j] = 0.0f;
    for (int s0 = 0; s0 < S; s0 += 16) {
      float o[kCols][16];
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int c = c0 + j * threads;
#pragma unroll
        for (int u = 0; u < 16; ++u) o[j][u] = s0 + u < S && c < C ? q.o[(base + s0 + u) * C + c] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        if (s0 + u < S) {
#pragma unroll
          for (int j = 0; j < kCols; ++j) acc[j] = __fmaf_rn(o[j][u], f_s[s0 + u], acc[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int c = c0 + j * threads;
      if (c < C) put(c, L == 0.0f ? 0.0f : __fdiv_rn(acc[j], L));
    }
  }
  if (M_out != nullptr) *M_out = M;
  return L;
}

}  // namespace lockstep::kernels::cuda::dev
