// kernels/cuda/expert_gemm.cu — the grouped expert GEMM (ExpertGemm, ops.h): its register
// path and cp.async shapes, the launch-shape choice and the argument checks. The streaming
// per-slot shapes are in expert_gemm_stream.cu, the tensor-core one in expert_tc.cu. Every
// shape gives each output cpu::Dot's order: the shape changes speed, never bits.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/expert_gemm.cuh"
#include "kernels/cuda/expert_tc.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla_combine.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

// --- ExpertGemm -----------------------------------------------------------------------------
//
// Thread layout: a warp owns 16 output rows, two lanes per row; lane half h holds cpu::Dot's
// chains 8h..8h+7 (element i feeds chain i mod 16) for every slot of the current chunk, so
// one 16-byte load of 8 bf16 weights feeds 8 chains × (slots in the chunk). x is staged in
// shared memory per in-tile; the chains carry over tiles, so tiling never changes the order.
// The fold is Dot's: chain l + chain l+8 (one shuffle), then 8 → 4 → 2 → 1 in registers.

constexpr int kEgTileIn = 1024;  // x elements per slot staged at a time (a multiple of 16)
constexpr int64_t kEgSlotModeMax = 16;  // slots up to which the grid runs over slots, not experts
constexpr int64_t kEgRegSlotMax = 96;   // … on the register path, for MoE (measured: README)
// By-slot grids of fewer 4-warp CTAs than this stream instead. 320 (was 256) puts a token's
// routed gate_up (6 slots × 44 CTAs = 264) on a streaming shape: alone it is 2 µs slower than
// the 4-warp shape (bench_expert_gemm --sweep), but in the decode step, beside the shared experts
// on the side stream, the step is 2 % faster (H200, 2026-11-30: V2-Lite bf16_dot batch 1,
// 343.8 / 344.0 / 343.6 → 351.6 / 351.1 / 351.0 tok/s, alternating runs in one session).
constexpr int64_t kEgStreamBelowCtas = 320;
constexpr int64_t kEgDenseSlotMax = 8;       // dense products per slot up to this many rows

// Weight element types of ExpertGemmParams: fp32, bf16, FP8 e4m3 with per-row 128-column scales.
enum WKind : int { kWF32 = 0, kWBf16 = 1, kWFp8 = 2 };

// Eight weights of a row from element `off` (a multiple of 8 from the row's start, so one
// FP8 scale covers them: `scale`, unused otherwise), as fp32.
template <int kW, bool kVec>
__device__ __forceinline__ void LoadW8(const void* w, int64_t off, float scale, float (&v)[8]) {
  if constexpr (kW == kWFp8) {
    const uint8_t* p = static_cast<const uint8_t*>(w) + off;
    uint32_t u[2];
    if constexpr (kVec) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
      u[0] = q.x, u[1] = q.y;
    } else {
      u[0] = p[0] | p[1] << 8 | p[2] << 16 | static_cast<uint32_t>(p[3]) << 24;
      u[1] = p[4] | p[5] << 8 | p[6] << 16 | static_cast<uint32_t>(p[7]) << 24;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = dev::Fp8x2ToF32(static_cast<uint16_t>(u[j / 2] >> (16 * (j % 2))));
      v[2 * j] = __fmul_rn(f.x, scale);
      v[2 * j + 1] = __fmul_rn(f.y, scale);
    }
  } else if constexpr (kW == kWBf16) {
    const uint16_t* p = static_cast<const uint16_t*>(w) + off;
    if constexpr (kVec) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
      const uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(u[j] << 16);
        v[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = dev::Bf16ToF32(p[j]);
    }
  } else {
    const float* p = static_cast<const float*>(w) + off;
    if constexpr (kVec) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = p[j];
    }
  }
}

// One weight, element `off` (column `col` of its row, whose scales start at `srow`), as fp32.
template <int kW>
__device__ __forceinline__ float LoadW1(const void* w, int64_t off, const float* srow, int64_t col) {
  if constexpr (kW == kWFp8) {
    return __fmul_rn(dev::Fp8E4m3ToF32(static_cast<const uint8_t*>(w)[off]), srow[col >> 7]);
  } else if constexpr (kW == kWBf16) {
    return dev::Bf16ToF32(static_cast<const uint16_t*>(w)[off]);
  } else {
    return static_cast<const float*>(w)[off];
  }
}

template <int kChunk>
__device__ __forceinline__ void Fma8(const float (&w)[8], const float (*xs)[kEgTileIn], int c, int ns,
                                     float (&acc)[kChunk][8]) {
#pragma unroll
  for (int s = 0; s < kChunk; ++s) {
    if (s < ns) {
      const float4 a = *reinterpret_cast<const float4*>(&xs[s][c]);
      const float4 b = *reinterpret_cast<const float4*>(&xs[s][c + 4]);
      const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[s][q] = __fmaf_rn(w[q], x[q], acc[s][q]);
    }
  }
}

// x[row of slots[s], t0 : t0 + tn) → xs[s][0 : tn) for s < ns, rounded to bf16 when asked.
// Staging is latency-bound (a few KB): every thread issues a batch of loads before storing
// any (16-byte loads when the rows allow), so a tile costs one or two memory round trips
// instead of one per element a thread copies.
template <int kThreads, int kTileIn>
__device__ __forceinline__ void StageX(float (*xs)[kTileIn], const int32_t* slots, int ns, const ExpertGemmParams& p,
                                       int64_t t0, int tn, int tid) {
  constexpr int kBatch = 8;
  auto row = [&](int s) {
    const int64_t slot = slots[s];
    return p.x + (p.x_per_slot ? slot : slot / p.k) * p.x_stride + t0;
  };
  auto round = [&](float v) { return p.round_x_bf16 ? dev::Bf16ToF32(dev::F32ToBf16(v)) : v; };
  const bool vec = (reinterpret_cast<uintptr_t>(p.x) & 15) == 0 && (p.x_stride & 3) == 0 && (t0 & 3) == 0 &&
                   (tn & 3) == 0;
  if (vec) {
    const int per = tn / 4, total = ns * per;
    for (int base = 0; base < total; base += kThreads * kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads + tid;
        if (i < total) v[j] = __ldg(reinterpret_cast<const float4*>(row(i / per)) + i % per);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads + tid;
        if (i < total) {
          const float4 a = v[j];
          *reinterpret_cast<float4*>(&xs[i / per][4 * (i % per)]) =
              make_float4(round(a.x), round(a.y), round(a.z), round(a.w));
        }
      }
    }
  } else {
    const int total = ns * tn;
    for (int base = 0; base < total; base += kThreads * kBatch) {
      float v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads + tid;
        if (i < total) v[j] = row(i / tn)[i % tn];
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads + tid;
        if (i < total) xs[i / tn][i % tn] = round(v[j]);
      }
    }
  }
}

// Grid (out tiles, experts): a CTA gathers the slots routed to its expert. kBySlot — for a
// handful of slots (decode) — grid (out tiles, slots) instead: a CTA takes one slot and reads
// that slot's expert, so no CTA is launched without work and the busy ones spread evenly.
template <int kWarps, int kChunk, int kUnroll, int kW, bool kVec, bool kBySlot>
__global__ void __launch_bounds__(kWarps * 32) ExpertGemmKernel(ExpertGemmParams p) {
  dev::GridDependencySync();
  constexpr int kThreads = kWarps * 32, kRows = kWarps * 16;
  static_assert(!kBySlot || kChunk == 1);
  __shared__ __align__(16) float xs[kChunk][kEgTileIn];
  __shared__ int32_t slots[kChunk + kThreads];
  __shared__ int32_t warp_counts[kWarps];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, h = lane & 1;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t o = o0 + warp * 16 + (lane >> 1);
  const bool row_ok = o < p.out;
  const int64_t total = p.rows * p.k;

  int64_t pos = 0;
  int count = 0;  // slots[0..count) routed to e, not yet computed; the same in every thread
  int e = blockIdx.y;
  if constexpr (kBySlot) {
    const int64_t slot = blockIdx.y;
    e = LocalExpert(p, p.ids[slot]);
    if (ForeignExpert(p, e)) return;  // another rank's slot
    if (e < 0 || e >= p.experts) {
      if (blockIdx.x == 0 && tid == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrExpert);
      if (tid < kRows && o0 + tid < p.out) p.y[slot * p.y_stride + o0 + tid] = QuietNan();
      return;
    }
    if (tid == 0) slots[0] = static_cast<int32_t>(slot);
    count = 1;
    pos = total;  // nothing to gather
    __syncthreads();
  }
  const int64_t w_row = e * p.w_expert_stride + (row_ok ? o : 0) * p.w_row_stride + 8 * h;
  const float* const srow =
      kW == kWFp8 ? p.w_scale + e * p.w_scale_expert_stride + (row_ok ? o : 0) * p.w_scale_row_stride : nullptr;
  // The FP8 scale of this lane's 8 weights from column `col` (a multiple of 16).
  auto scale8 = [&](int64_t col) { return kW == kWFp8 ? srow[(col + 8 * h) >> 7] : 0.0f; };
  for (;;) {
    // Top the list up to a chunk, in slot order; the expert-0 CTAs also police the ids.
    while (count < kChunk && pos < total) {
      const int64_t i = pos + tid;
      bool match = false;
      if (i < total) {
        const int32_t id = LocalExpert(p, p.ids[i]);
        match = id == e;
        if (blockIdx.y == 0 && (id < 0 || id >= p.experts) && !p.skip_foreign) {
          if (blockIdx.x == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrExpert);
          for (int c = 0; c < kRows && o0 + c < p.out; ++c) p.y[i * p.y_stride + o0 + c] = QuietNan();
        }
      }
      const unsigned ballot = __ballot_sync(0xffffffffu, match);
      if (lane == 0) warp_counts[warp] = __popc(ballot);
      __syncthreads();
      int before = count, added = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        before += w < warp ? warp_counts[w] : 0;
        added += warp_counts[w];
      }
      if (match) slots[before + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>(i);
      count += added;
      pos += kThreads;
      __syncthreads();
    }
    if (count == 0) break;
    const int ns = count < kChunk ? count : kChunk;

    float acc[kChunk][8];
#pragma unroll
    for (int s = 0; s < kChunk; ++s) {
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[s][q] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < p.in; t0 += kEgTileIn) {
      const int tn = static_cast<int>(p.in - t0 < kEgTileIn ? p.in - t0 : kEgTileIn);
      StageX<kThreads, kEgTileIn>(xs, slots, ns, p, t0, tn, tid);
      __syncthreads();
      if (row_ok) {
        const int full = tn / 16 * 16;
        int c = 0;
        for (; c + 16 * kUnroll <= full; c += 16 * kUnroll) {
          float w[kUnroll][8];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            LoadW8<kW, kVec>(p.w, w_row + t0 + c + 16 * u, scale8(t0 + c + 16 * u), w[u]);
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) Fma8<kChunk>(w[u], xs, c + 16 * u + 8 * h, ns, acc);
        }
        for (; c < full; c += 16) {
          float w[8];
          LoadW8<kW, kVec>(p.w, w_row + t0 + c, scale8(t0 + c), w);
          Fma8<kChunk>(w, xs, c + 8 * h, ns, acc);
        }
        if (c < tn) {  // the last partial block of `in`: element c + 8h + q is chain 8h + q
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            if (c + 8 * h + q < tn) {
              const float wv = LoadW1<kW>(p.w, w_row + t0 + c + q, srow, t0 + c + 8 * h + q);
#pragma unroll
              for (int s = 0; s < kChunk; ++s) {
                if (s < ns) acc[s][q] = __fmaf_rn(wv, xs[s][c + 8 * h + q], acc[s][q]);
              }
            }
          }
        }
      }
      __syncthreads();  // xs is restaged by the next tile or chunk
    }
    // Dot's fold, then lane half h stores the slots s ≡ h (mod 2).
#pragma unroll
    for (int s = 0; s < kChunk; ++s) {
      float v[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) v[q] = __fadd_rn(acc[s][q], __shfl_xor_sync(0xffffffffu, acc[s][q], 1));
#pragma unroll
      for (int q = 0; q < 4; ++q) v[q] = __fadd_rn(v[q], v[q + 4]);
#pragma unroll
      for (int q = 0; q < 2; ++q) v[q] = __fadd_rn(v[q], v[q + 2]);
      const float out = __fadd_rn(v[0], v[1]);
      if (row_ok && s < ns && (s & 1) == h) p.y[static_cast<int64_t>(slots[s]) * p.y_stride + o] = out;
    }
    // Drop the computed slots.
    const int rest = count - ns;
    const int32_t keep = tid < rest ? slots[ns + tid] : 0;
    __syncthreads();
    if (tid < rest) slots[tid] = keep;
    count = rest;
    __syncthreads();
  }
}

template <int kWarps, int kChunk, int kUnroll, bool kBySlot>
Status LaunchExpertGemm(const ExpertGemmParams& p, bool vec, Stream stream) {
  constexpr int64_t kRows = kWarps * 16;
  const dim3 grid(static_cast<unsigned>((p.out + kRows - 1) / kRows),
                  static_cast<unsigned>(kBySlot ? p.rows * p.k : p.experts));
  const dim3 block(kWarps * 32);
  auto launch = [&](auto kernel) {
    LS_CUDA_RETURN_IF_ERROR(LaunchKernel(kernel, grid, block, 0, stream, p));
    LS_CUDA_LAUNCH_CHECK();
    return Status::Ok();
  };
  if (p.w_fp8) {
    return vec ? launch(ExpertGemmKernel<kWarps, kChunk, kUnroll, kWFp8, true, kBySlot>)
               : launch(ExpertGemmKernel<kWarps, kChunk, kUnroll, kWFp8, false, kBySlot>);
  }
  if (p.w_bf16) {
    return vec ? launch(ExpertGemmKernel<kWarps, kChunk, kUnroll, kWBf16, true, kBySlot>)
               : launch(ExpertGemmKernel<kWarps, kChunk, kUnroll, kWBf16, false, kBySlot>);
  }
  return vec ? launch(ExpertGemmKernel<kWarps, kChunk, kUnroll, kWF32, true, kBySlot>)
             : launch(ExpertGemmKernel<kWarps, kChunk, kUnroll, kWF32, false, kBySlot>);
}

// --- ExpertGemm, fast path (bf16 W, 16-byte aligned rows, in % 16 == 0) -----------------------
//
// Same arithmetic per output element as ExpertGemmKernel (lane half h of the row's lane pair
// holds chains 8h..8h+7, element i → chain i mod 16, chains carry across blocks, Dot's fold);
// only the data movement differs. Each warp streams its 16 weight rows through shared memory
// with cp.async in kFwStages stages of 256 elements per row: load instruction j copies row j's
// 512 contiguous bytes (lane L: elements 8L..8L+7), so a warp instruction reads one row segment
// and the copies run kFwStages − 1 stages ahead of the arithmetic without holding registers.
// The 16-byte chunk q of row r sits at position q ^ 2·(r mod 4): the lane pairs then read
// their own row's chunk 2b + h in 4 shared-memory wavefronts (the minimum for 512 bytes).
// Grid (out tiles, experts, groups): CTA z of an expert takes the chunks of kChunk slots
// z, z + groups, …, of that expert's slot list (in slot order), so an expert with many slots
// (heads used as experts: every row is a slot of every head) spreads over many CTAs.
constexpr int kFwIdsPerThread = 8;  // ids read per thread per gather pass
constexpr int kEgFastChunk = 8;     // slots per chunk on the per-expert cp.async grid

using dev::CpAsync16;
using dev::CpAsyncCommit;
using dev::CpAsyncWait;
using dev::CpAsyncWaitAtMost;

template <int kWarps, int kChunk, int kStages, int kTileIn>
struct FwSmem {
  static constexpr size_t kWBytes = size_t{kStages} * kWarps * 16 * kFwBlk * 2;
  static constexpr size_t kXBytes = size_t{kChunk} * kTileIn * 4;
  static constexpr size_t kBytes = kWBytes + kXBytes;
};

// kFp8: FP8 weights — a stage's 256 values are 256 bytes a row (16 chunks, lanes 0–15 copy
// them; the same swizzle), lane half h reads its 8 bytes of chunk b, and each weight is value ×
// its row's scale for those 128 columns, one rounding, then the same FMAs.
template <int kWarps, int kChunk, int kStages, int kTileIn, bool kBySlot, bool kFp8 = false>
__global__ void __launch_bounds__(kWarps * 32) ExpertGemmFastKernel(ExpertGemmParams p, int groups) {
  dev::GridDependencySync();
  constexpr int kThreads = kWarps * 32, kRows = kWarps * 16;
  constexpr int kChunks16 = kFwBlk / 8;  // 16-byte chunk slots per row per stage (32; FP8 uses 16)
  static_assert(kTileIn % kFwBlk == 0 && (!kBySlot || kChunk == 1));
  using Smem = FwSmem<kWarps, kChunk, kStages, kTileIn>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* wbuf = reinterpret_cast<uint4*>(smem);  // [kStages][kWarps][16 rows][32 chunks], swizzled
  float(*xs)[kTileIn] = reinterpret_cast<float(*)[kTileIn]>(smem + Smem::kWBytes);
  __shared__ int32_t slots[kChunk + kThreads * kFwIdsPerThread];
  __shared__ int32_t warp_counts[kWarps];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, h = lane & 1, r = lane >> 1;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t o = o0 + warp * 16 + r;
  const bool row_ok = o < p.out;
  const int64_t total = p.rows * p.k;
  const uint16_t* w = static_cast<const uint16_t*>(p.w);

  int64_t pos = 0;
  int count = 0;  // slots[0..count) routed to e, not yet taken; the same in every thread
  int e = blockIdx.y;
  if constexpr (kBySlot) {
    const int64_t slot = blockIdx.y;
    e = LocalExpert(p, p.ids[slot]);
    if (ForeignExpert(p, e)) return;  // another rank's slot
    if (e < 0 || e >= p.experts) {
      if (blockIdx.x == 0 && tid == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrExpert);
      if (tid < kRows && o0 + tid < p.out) p.y[slot * p.y_stride + o0 + tid] = QuietNan();
      return;
    }
    if (tid == 0) slots[0] = static_cast<int32_t>(slot);
    count = 1;
    pos = total;
    __syncthreads();
  }
  const bool police = !kBySlot && blockIdx.y == 0 && blockIdx.z == 0;
  const int64_t nblk = (p.in + kFwBlk - 1) / kFwBlk;
  // This warp's 16 rows (rows past `out` are not copied; their results are never stored).
  const int64_t warp_row0 = o0 + warp * 16;
  const uint16_t* w_e = w + static_cast<int64_t>(e) * p.w_expert_stride;
  const uint8_t* w8_e = static_cast<const uint8_t*>(p.w) + static_cast<int64_t>(e) * p.w_expert_stride;
  auto issue = [&](int64_t blk) {
    uint4* dst = wbuf + ((blk % kStages) * kWarps + warp) * 16 * kChunks16;
    if constexpr (kFp8) {
      const int64_t col = blk * kFwBlk + 16 * lane;  // lane's 16 bytes
      if (lane < 16 && col < p.in) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          if (warp_row0 + j < p.out) {
            CpAsync16(dst + j * kChunks16 + (lane ^ ((j & 3) << 1)), w8_e + (warp_row0 + j) * p.w_row_stride + col);
          }
        }
      }
    } else {
      const int64_t col = blk * kFwBlk + 8 * lane;
      if (col < p.in) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          if (warp_row0 + j < p.out) {
            CpAsync16(dst + j * kChunks16 + (lane ^ ((j & 3) << 1)), w_e + (warp_row0 + j) * p.w_row_stride + col);
          }
        }
      }
    }
  };
  // FP8: this lane's row's scales (a row past `out` reads row 0's: computed, never stored).
  const float* const srow = kFp8 ? p.w_scale + static_cast<int64_t>(e) * p.w_scale_expert_stride +
                                       (row_ok ? o : 0) * p.w_scale_row_stride
                                 : nullptr;
  const int64_t nscales = (p.in + 127) / 128;

  int64_t chunk_index = 0;
  for (;;) {
    // Top the list up to a chunk, in slot order; the (expert 0, group 0) CTAs police the ids.
    while (count < kChunk && pos < total) {
      const int64_t base = pos + static_cast<int64_t>(tid) * kFwIdsPerThread;
      unsigned bits = 0;
#pragma unroll
      for (int j = 0; j < kFwIdsPerThread; ++j) {
        const int64_t i = base + j;
        if (i < total) {
          const int32_t id = LocalExpert(p, p.ids[i]);
          if (id == e) bits |= 1u << j;
          if (police && (id < 0 || id >= p.experts) && !p.skip_foreign) {
            if (blockIdx.x == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrExpert);
            for (int c = 0; c < kRows && o0 + c < p.out; ++c) p.y[i * p.y_stride + o0 + c] = QuietNan();
          }
        }
      }
      const int m = __popc(bits);
      int incl = m;  // inclusive scan over the warp
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += t;
      }
      if (lane == 31) warp_counts[warp] = incl;
      __syncthreads();
      int before = count + incl - m, added = 0;
#pragma unroll
      for (int wi = 0; wi < kWarps; ++wi) {
        before += wi < warp ? warp_counts[wi] : 0;
        added += warp_counts[wi];
      }
#pragma unroll
      for (int j = 0; j < kFwIdsPerThread; ++j) {
        if (bits & (1u << j)) slots[before++] = static_cast<int32_t>(base + j);
      }
      count += added;
      pos += static_cast<int64_t>(kThreads) * kFwIdsPerThread;
      __syncthreads();
    }
    if (count == 0) break;
    const int ns = count < kChunk ? count : kChunk;

    if (chunk_index++ % groups == blockIdx.z) {
      float acc[kChunk][8];
#pragma unroll
      for (int s = 0; s < kChunk; ++s) {
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[s][q] = 0.0f;
      }
#pragma unroll
      for (int st = 0; st < kStages - 1; ++st) {
        if (st < nblk) issue(st);
        CpAsyncCommit();
      }
      for (int64_t blk = 0; blk < nblk; ++blk) {
        if (blk + kStages - 1 < nblk) issue(blk + kStages - 1);
        CpAsyncCommit();
        const int64_t col0 = blk * kFwBlk;
        const int xc = static_cast<int>(col0 % kTileIn);
        if (xc == 0) {  // stage the next x tile (all warps reach this at the same blk)
          __syncthreads();
          const int64_t t0 = col0;
          const int tn = static_cast<int>(p.in - t0 < kTileIn ? p.in - t0 : kTileIn);
          StageX<kThreads, kTileIn>(xs, slots, ns, p, t0, tn, tid);
          __syncthreads();
        }
        CpAsyncWait<kStages - 1>();
        __syncwarp();
        const uint4* wb = wbuf + ((blk % kStages) * kWarps + warp) * 16 * kChunks16 + r * kChunks16;
        const int sw = (r & 3) << 1;
        const int nb = static_cast<int>((p.in - col0 < kFwBlk ? p.in - col0 : kFwBlk) / 16);
        float sc[2] = {0.0f, 0.0f};  // FP8: the scales of this stage's two 128-column chunks
        if constexpr (kFp8) {
          const int64_t c = col0 / 128;
          sc[0] = __ldg(srow + c);
          sc[1] = c + 1 < nscales ? __ldg(srow + c + 1) : 0.0f;
        }
#pragma unroll 4
        for (int b = 0; b < nb; ++b) {
          float wv[8];
          if constexpr (kFp8) {
            const uint2 q2 = reinterpret_cast<const uint2*>(wb)[((b ^ sw) << 1) + h];
            const float scale = sc[b >= 8 ? 1 : 0];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 f = dev::Fp8x2ToF32(static_cast<uint16_t>((j < 2 ? q2.x : q2.y) >> (16 * (j & 1))));
              wv[2 * j] = __fmul_rn(f.x, scale);
              wv[2 * j + 1] = __fmul_rn(f.y, scale);
            }
          } else {
            const uint4 q4 = wb[(2 * b + h) ^ sw];
            const uint32_t u[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              wv[2 * j] = __uint_as_float(u[j] << 16);
              wv[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
            }
          }
          const int c = xc + 16 * b + 8 * h;
#pragma unroll
          for (int s = 0; s < kChunk; ++s) {
            if (s < ns) {
              const float4 a = *reinterpret_cast<const float4*>(&xs[s][c]);
              const float4 bb = *reinterpret_cast<const float4*>(&xs[s][c + 4]);
              const float xv[8] = {a.x, a.y, a.z, a.w, bb.x, bb.y, bb.z, bb.w};
#pragma unroll
              for (int q = 0; q < 8; ++q) acc[s][q] = __fmaf_rn(wv[q], xv[q], acc[s][q]);
            }
          }
        }
        __syncwarp();  // this stage's buffer is refilled by the next iteration's copies
      }
      CpAsyncWait<0>();
      // Dot's fold, then lane half h stores the slots s ≡ h (mod 2).
#pragma unroll
      for (int s = 0; s < kChunk; ++s) {
        float v[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = __fadd_rn(acc[s][q], __shfl_xor_sync(0xffffffffu, acc[s][q], 1));
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = __fadd_rn(v[q], v[q + 4]);
#pragma unroll
        for (int q = 0; q < 2; ++q) v[q] = __fadd_rn(v[q], v[q + 2]);
        const float out = __fadd_rn(v[0], v[1]);
        if (row_ok && s < ns && (s & 1) == h) p.y[static_cast<int64_t>(slots[s]) * p.y_stride + o] = out;
      }
    }
    // Drop the taken slots (read all survivors into registers, then write them down).
    const int rest = count - ns;
    constexpr int kKeep = (kChunk + kThreads * kFwIdsPerThread + kThreads - 1) / kThreads;
    int32_t keep[kKeep];
#pragma unroll
    for (int j = 0; j < kKeep; ++j) {
      const int i = tid + j * kThreads;
      keep[j] = i < rest ? slots[ns + i] : 0;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kKeep; ++j) {
      const int i = tid + j * kThreads;
      if (i < rest) slots[i] = keep[j];
    }
    count = rest;
    __syncthreads();
  }
}

template <int kWarps, int kChunk, int kStages, int kTileIn, bool kBySlot, bool kFp8 = false>
Status LaunchExpertGemmFast(const ExpertGemmParams& p, Stream stream) {
  if constexpr (!kFp8) {
    if (p.w_fp8) return LaunchExpertGemmFast<kWarps, kChunk, kStages, kTileIn, kBySlot, true>(p, stream);
  }
  constexpr int64_t kRows = kWarps * 16;
  constexpr size_t smem = FwSmem<kWarps, kChunk, kStages, kTileIn>::kBytes;
  auto* kernel = ExpertGemmFastKernel<kWarps, kChunk, kStages, kTileIn, kBySlot, kFp8>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  LS_CUDA_RETURN_IF_ERROR(attr);
  int groups = 1;
  if constexpr (!kBySlot) {
    // Slots per expert on average, in chunks: an expert's chunks spread over that many CTAs.
    const int64_t per_expert = (p.rows * p.k + p.experts - 1) / p.experts;
    const int64_t g = (per_expert + kChunk - 1) / kChunk;
    groups = static_cast<int>(g < 1 ? 1 : (g > kMaxGrid ? kMaxGrid : g));
  }
  const dim3 grid(static_cast<unsigned>((p.out + kRows - 1) / kRows),
                  static_cast<unsigned>(kBySlot ? p.rows * p.k : p.experts), static_cast<unsigned>(groups));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(kernel, grid, kWarps * 32, smem, stream, p, groups));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace

// What ExpertGemm's shapes need of the weights: 16-byte weight loads need every row start
// 16-byte aligned (otherwise element loads: the same arithmetic, the same bits); the cp.async
// (kFast*) and bulk shapes bf16 or FP8 rows so aligned with in % 16 = 0; the streaming
// cp.async shape bf16.
struct GemmShapes {
  bool vec, bulk_ok, fast_ok, stream_ok;
};
GemmShapes ShapesOf(const ExpertGemmParams& p) {
  const int64_t es = p.w_fp8 ? 1 : p.w_bf16 ? 2 : 4;
  GemmShapes sh;
  sh.vec = reinterpret_cast<uintptr_t>(p.w) % 16 == 0 && (p.w_row_stride * es) % 16 == 0 &&
           (p.w_expert_stride * es) % 16 == 0;
  sh.bulk_ok = (p.w_bf16 || p.w_fp8) && sh.vec && p.in % 16 == 0;
  sh.fast_ok = sh.bulk_ok;
  sh.stream_ok = p.w_bf16 && sh.bulk_ok;
  return sh;
}

// The launch shape for p (p.launch unless kAuto). The shape changes speed only: each output's
// order is fixed by `in` (ExpertGemmParams); gpu_expert_gemm_test runs every shape and compares bits.
ExpertGemmParams::Launch ResolveLaunch(const ExpertGemmParams& p, const GemmShapes& sh) {
  using L = ExpertGemmParams::Launch;
  if (p.launch != L::kAuto) return p.launch;
  const int64_t slots = p.rows * p.k;
  const bool dense = p.experts == 1;
  if (p.w_fp8) {
    // FP8 weights: bulk copies per slot (any number of waves) for the few-row products, the
    // cp.async chunked shape for crowded ones (prefill, batches), the register path otherwise.
    const bool by_slot = slots <= (dense ? kEgDenseSlotMax : kEgSlotModeMax);
    const bool crowded = dense || slots >= kEgFastChunk * p.experts;
    return sh.bulk_ok && by_slot                                ? L::kBulkBySlot
           : sh.fast_ok && crowded                              ? L::kFastChunk4
           : by_slot || (!crowded && slots <= kEgRegSlotMax) ? L::kRegBySlot
                                                             : L::kRegChunk;
  }
  // Up to kEgSlotModeMax slots of distinct experts: one CTA column per slot (decode's
  // experts). Slots sharing experts (a dense layer: one "expert"; heads as experts; MoE
  // batches of ≥ 8 slots per expert) gather per-expert chunks so a weight row is read once
  // per chunk. bf16 rows with in % 16 = 0 (every DeepSeek shape) stream through cp.async.
  // Measured on the H200: kernels/cuda/README.md ("Speed").
  // (The 1-warp shapes measured slower everywhere on the H200: not chosen.)
  // A dense product at a few rows also goes per slot: each row re-reads the weights, from L2
  // after the first (H200: kv_a at 4 rows 10 µs per slot against 38 µs chunked).
  const bool by_slot = slots <= (dense ? kEgDenseSlotMax : kEgSlotModeMax);
  const bool crowded = dense || slots >= kEgFastChunk * p.experts;
  if (sh.fast_ok && by_slot) {
    // Fewer 4-warp CTAs than about two per SM leave the GPU idle: one warp per CTA, with
    // the whole row in flight, instead (decode's dense products, the heads' absorptions).
    // A dense product streams at any size (lm_head: 103 against 125 µs).
    // Of the two streaming shapes, bulk copies when the grid runs in one wave; cp.async when it
    // takes several (lm_head: 107 µs against 143; layer 0's down 32 against 39: the copy
    // engine's small requests are slower to stream than cp.async's once a wave waits).
    return dense || (p.out + 63) / 64 * slots < kEgStreamBelowCtas
               ? (PickBulkShape(p).one_wave ? L::kBulkBySlot : L::kStreamBySlot)
               : L::kFastBySlot4;
  }
  if (!dense && !crowded && slots <= kEgRegSlotMax) return L::kRegBySlot;  // a few tokens' experts
  if (sh.fast_ok && crowded) return L::kFastChunk4;
  return by_slot ? L::kRegBySlot : L::kRegChunk;
}

bool ExpertGemmSwiGluFits(const ExpertGemmParams& p) {
  if (p.swiglu_inter <= 0 || p.out != 2 * p.swiglu_inter || p.x_partials.o != nullptr || p.rows <= 0 || p.k <= 0 ||
      p.rows * p.k > kMaxGrid) {
    return false;
  }
  const GemmShapes sh = ShapesOf(p);
  return sh.bulk_ok && ResolveLaunch(p, sh) == ExpertGemmParams::Launch::kBulkBySlot;
}

Status ExpertGemm(const ExpertGemmParams& p, Stream stream) {
  constexpr const char* op = "ExpertGemm";
  LS_CHECK_ARG(p.w != nullptr, op, "w", p.w);
  const MlaPartials& xp = p.x_partials;
  const bool combine = xp.o != nullptr;
  LS_CHECK_ARG(combine || p.x != nullptr, op, "x", p.x);
  if (combine) {  // x from an MLA decode's splits (the bulk shape combines them)
    LS_CHECK_ARG(xp.m != nullptr && xp.l != nullptr, op, "x_partials (m, l)", xp.m);
    LS_CHECK_ARG(xp.kv_lora == p.in && p.in <= kSwTileIn, op, "x_partials.kv_lora (= in ≤ 4096)", xp.kv_lora);
    LS_CHECK_ARG(p.rows <= xp.batch, op, "rows (≤ x_partials.batch)", p.rows);
    LS_CHECK_ARG(p.experts <= xp.heads, op, "experts (≤ x_partials.heads)", p.experts);
    LS_CHECK_ARG(xp.seq_lens != nullptr || xp.topk >= 0, op, "x_partials.topk", xp.topk);
    // Every split a request's keys can make has its place (the merge reads S ≤ splits of them).
    const int64_t need = dev::MlaSplitsFor(xp.seq_lens != nullptr ? xp.max_seq_len : xp.topk);
    LS_CHECK_ARG(xp.splits >= need && xp.splits <= dev::kMlaMaxSplits, op,
                 "x_partials.splits (the workspace's splits for max_seq_len or topk)", xp.splits);
    LS_CHECK_ARG(p.launch == ExpertGemmParams::Launch::kAuto || p.launch == ExpertGemmParams::Launch::kBulkBySlot, op,
                 "launch (x_partials: the bulk shape)", static_cast<int>(p.launch));
  }
  LS_CHECK_ARG(p.swiglu_inter >= 0, op, "swiglu_inter", p.swiglu_inter);
  LS_CHECK_ARG(p.swiglu_inter == 0 || p.out == 2 * p.swiglu_inter, op, "swiglu_inter (out = 2 · swiglu_inter)",
               p.swiglu_inter);
  LS_CHECK_ARG(p.ids != nullptr, op, "ids", p.ids);
  LS_CHECK_ARG(p.y != nullptr, op, "y", p.y);
  LS_CHECK_ARG(p.rows >= 0, op, "rows", p.rows);
  LS_CHECK_ARG(p.k > 0, op, "k", p.k);
  LS_CHECK_ARG(p.rows * p.k < (int64_t{1} << 31), op, "rows·k", p.rows * p.k);
  LS_CHECK_ARG(p.experts > 0 && p.experts <= kMaxGrid, op, "experts", p.experts);
  LS_CHECK_ARG(p.out > 0 && p.out < (int64_t{1} << 31), op, "out", p.out);
  LS_CHECK_ARG(p.in > 0 && p.in < (int64_t{1} << 31), op, "in", p.in);
  LS_CHECK_ARG(p.w_row_stride >= p.in, op, "w_row_stride", p.w_row_stride);
  LS_CHECK_ARG(p.w_expert_stride >= (p.out - 1) * p.w_row_stride + p.in, op, "w_expert_stride", p.w_expert_stride);
  LS_CHECK_ARG(combine || p.x_stride >= p.in, op, "x_stride", p.x_stride);
  LS_CHECK_ARG(p.y_stride >= (p.swiglu_inter > 0 ? p.swiglu_inter : p.out), op, "y_stride", p.y_stride);
  LS_CHECK_ARG(!(p.w_bf16 && p.w_fp8), op, "w_fp8 (and w_bf16)", p.w_fp8);
  if (p.w_fp8) {
    const int64_t chunks = (p.in + 127) / 128;
    LS_CHECK_ARG(p.w_scale != nullptr, op, "w_scale", p.w_scale);
    LS_CHECK_ARG(p.w_scale_row_stride >= chunks, op, "w_scale_row_stride", p.w_scale_row_stride);
    LS_CHECK_ARG(p.w_scale_expert_stride >= (p.out - 1) * p.w_scale_row_stride + chunks, op, "w_scale_expert_stride",
                 p.w_scale_expert_stride);
  }
  if (p.tensor_cores) {
    LS_CHECK_ARG(ExpertGemmTcFits(p), op,
                 "tensor_cores (needs bf16 weights, round_x_bf16, plain x, in % 32 = 0, 16-byte aligned rows)",
                 p.in);
    return p.rows == 0 ? Status::Ok() : LaunchExpertGemmTc(p, stream);
  }
  if (p.rows == 0) return Status::Ok();
  using L = ExpertGemmParams::Launch;
  const GemmShapes sh = ShapesOf(p);
  L launch = combine ? L::kBulkBySlot : ResolveLaunch(p, sh);
  if (combine) {
    LS_CHECK_ARG(sh.bulk_ok, op, "x_partials (needs bf16 or FP8 weights, 16-byte rows, in % 16 = 0)", p.in);
  }
  if (p.swiglu_inter > 0) {
    LS_CHECK_ARG(!combine && launch == L::kBulkBySlot && sh.bulk_ok, op,
                 "swiglu_inter (the SwiGLU epilogue needs the bulk shape: ExpertGemmSwiGluFits)", p.swiglu_inter);
  }
  const int64_t slots = p.rows * p.k;
  const bool by_slot_launch = launch == L::kRegBySlot || launch == L::kFastBySlot4 || launch == L::kFastBySlot1 ||
                              launch == L::kStreamBySlot || launch == L::kBulkBySlot;
  LS_CHECK_ARG(!by_slot_launch || slots <= kMaxGrid, op, "launch (one CTA per slot needs rows·k ≤ 65535)", slots);
  switch (launch) {
    case L::kRegBySlot:
      return LaunchExpertGemm<4, 1, 8, true>(p, sh.vec, stream);
    case L::kRegChunk:
      return LaunchExpertGemm<4, 8, 4, false>(p, sh.vec, stream);
    default:
      break;
  }
  if (launch == L::kBulkBySlot) {
    LS_CHECK_ARG(sh.bulk_ok, op, "launch (bulk copies need bf16 or FP8 weights, 16-byte rows, in % 16 = 0)",
                 static_cast<int>(launch));
    return LaunchExpertGemmBulk(p, stream);
  }
  const char* need = launch == L::kStreamBySlot
                         ? "launch (the streaming shape needs bf16 weights, 16-byte rows, in % 16 = 0)"
                         : "launch (cp.async shapes need bf16 or FP8 weights, 16-byte rows, in % 16 = 0)";
  LS_CHECK_ARG(launch == L::kStreamBySlot ? sh.stream_ok : sh.fast_ok, op, need, static_cast<int>(launch));
  switch (launch) {
    case L::kFastBySlot4:
      return LaunchExpertGemmFast<4, 1, 3, 2048, true>(p, stream);
    case L::kFastChunk4:
      return LaunchExpertGemmFast<4, kEgFastChunk, 2, 1024, false>(p, stream);
    case L::kFastBySlot1:
      return LaunchExpertGemmFast<1, 1, 6, 2048, true>(p, stream);
    case L::kFastChunk1:
      return LaunchExpertGemmFast<1, kEgFastChunk, 4, 1024, false>(p, stream);
    case L::kStreamBySlot:
      return LaunchExpertGemmStream(p, stream);
    case L::kBulkBySlot:
      return LaunchExpertGemmBulk(p, stream);
    default:
      return Status::InvalidArgument("ExpertGemm: launch " + std::to_string(static_cast<int>(launch)) +
                                     " is not a launch shape");
  }
}

}  // namespace lockstep::kernels::cuda
