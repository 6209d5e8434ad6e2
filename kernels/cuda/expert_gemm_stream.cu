// kernels/cuda/expert_gemm_stream.cu — ExpertGemm's streaming shapes for few-row products
// (decode): a CTA of 4 warps owns 16 rows of one slot and keeps the rows' weights in flight
// through a ring in shared memory, filled by 16-byte cp.async (kStreamBySlot) or by bulk copies
// (kBulkBySlot, with the MLA combine and the SwiGLU epilogue). expert_gemm.cu chooses the shape;
// the arithmetic of every output is cpu::Dot's, as on every other shape.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/expert_gemm.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla_combine.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

using dev::CpAsync16;
using dev::CpAsyncCommit;
using dev::CpAsyncWait;
using dev::CpAsyncWaitAtMost;

// --- ExpertGemm, streaming per-slot path (decode's products) -----------------------------------
//
// Same arithmetic per output element once more (element i → chain i mod 16, chains carry
// across blocks, Dot's fold); the work is cut differently. At one row the 4-warp CTAs above
// are few (kv_a: 9) and a warp's instruction stream is long (16 rows, 8 chains a lane:
// ~6k instructions), so every product took 11–20 µs whatever its size (ncu, 2026-11-30).
// Here a CTA of 4 warps owns 16 rows of one slot; 8 lanes share a row, lane g holding chains
// 2g and 2g + 1 (one 4-byte read of two bf16 weights and an 8-byte read of x feed both), so
// a warp runs 4 rows and its instruction stream is a quarter as long. Every 256-value block
// of the CTA's rows up to the ring's size is requested at once, each block its own cp.async
// group taken in order as it lands (its ring slot refilled when done): a row of ≤
// kSwMaxStages·256 values costs one round trip; with fixed ids the requests go out before the
// previous kernel has finished (launch.cuh). x is loaded (and rounded) into shared memory
// while they land. A warp copies and reads only its own rows (warp barriers, no CTA barrier
// per block), and row j's 16-byte chunk q sits at q ^ 2·(j mod 4), so a warp's four rows read
// 128 distinct bytes per instruction at offsets fixed per thread plus immediates: the inner
// loop is two shared loads, two conversions and two FMAs per weight pair (it also spent
// instructions on 64-bit index arithmetic and two CTA barriers per block: 11–13 µs for any
// product of ≤ 64 KB per CTA, in-graph on the H200, 2026-11-30).
constexpr int kSwMaxStages = 12;  // ring of 256-value blocks (16 rows · 512 B each)

// 4 warps a CTA, 4 rows a warp, 8 lanes a row. (CTAs of 1 or 2 warps — more of them, more
// evenly spread over the SMs — measured slower at every dense decode shape on the H200: each
// stages x for fewer rows.)
constexpr int kSwThreads = 128;
constexpr int kSwRows = 16;
static_assert(kSwTileIn % kFwBlk == 0 && kSwRows == 4 * (kSwThreads / 32));

size_t StreamSmemBytes(int stages, int64_t in) {
  return static_cast<size_t>(stages) * kSwRows * kFwBlk * 2 + static_cast<size_t>(in < kSwTileIn ? in : kSwTileIn) * 4;
}

// x[0, n) into shared memory, rounded to bf16 when `round`, by `threads` threads. A tile of
// ≤ kXv·4·threads values that is 16-byte aligned with n % 4 = 0 goes in 16-byte loads, all of a
// thread's issued before its first store; split in two (XTileLoad, then XTileStore) so that
// other requests can go out between the loads and their use.
constexpr int kXv = 8;  // float4s a thread holds
struct XTile {
  float4 v[kXv];
  bool vec;
};
__device__ __forceinline__ void XTileLoad(const float* x, int n, int tid, int threads, XTile& t) {
  t.vec = (reinterpret_cast<uintptr_t>(x) & 15) == 0 && n % 4 == 0 && n <= kXv * 4 * threads;
  if (!t.vec) return;
#pragma unroll
  for (int u = 0; u < kXv; ++u) {
    const int i = tid + u * threads;
    if (i < n / 4) t.v[u] = reinterpret_cast<const float4*>(x)[i];
  }
}
__device__ __forceinline__ void XTileStore(const float* x, int n, bool round, float* xs, int tid, int threads,
                                           const XTile& t) {
  auto rd = [&](float v) { return round ? dev::Bf16ToF32(dev::F32ToBf16(v)) : v; };
  if (t.vec) {
#pragma unroll
    for (int u = 0; u < kXv; ++u) {
      const int i = tid + u * threads;
      if (i < n / 4) reinterpret_cast<float4*>(xs)[i] = make_float4(rd(t.v[u].x), rd(t.v[u].y), rd(t.v[u].z), rd(t.v[u].w));
    }
  } else {
    for (int i = tid; i < n; i += threads) xs[i] = rd(x[i]);
  }
}
__device__ __forceinline__ void StageX(const float* x, int n, bool round, float* xs, int tid, int threads) {
  XTile t;
  XTileLoad(x, n, tid, threads, t);
  XTileStore(x, n, round, xs, tid, threads, t);
}

// The streaming shapes' shared pieces. An id outside [0, experts): kErrExpert, and the CTA's
// `rows` outputs from row0 (those below `limit`: out, or swiglu_inter) are NaN; true when so
// (the CTA then returns).
__device__ __forceinline__ bool BadExpert(const ExpertGemmParams& p, int e, int64_t slot, int64_t row0, int rows,
                                          int tid, int64_t limit) {
  if (e >= 0 && e < p.experts) return false;
  dev::GridDependencySync();
  if (p.skip_foreign) return true;  // another rank's slot: not computed here
  if (blockIdx.x == 0 && tid == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrExpert);
  if (tid < rows && row0 + tid < limit) p.y[slot * p.y_stride + row0 + tid] = QuietNan();
  return true;
}
__global__ void __launch_bounds__(kSwThreads) ExpertGemmStreamKernel(ExpertGemmParams p, int stages) {
  constexpr int kRows = kSwRows;
  constexpr int kChunks16 = kFwBlk / 8;  // 16-byte chunks per row per block (32)
  constexpr int kWords = kFwBlk / 2;     // 4-byte words per row per block (128)
  extern __shared__ __align__(16) unsigned char smem[];
  uint32_t* wbuf = reinterpret_cast<uint32_t*>(smem);  // [stages][kRows][128 words], chunks swizzled
  float* xs = reinterpret_cast<float*>(smem + static_cast<size_t>(stages) * kRows * kFwBlk * 2);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = tid & 7, row = tid >> 3;
  const int r3 = row & 3;  // = i for the warp's row 4·warp + i
  const int64_t slot = blockIdx.y, row0 = static_cast<int64_t>(blockIdx.x) * kRows, o = row0 + row;
  // Fixed ids (a dense product's): the weight blocks are requested before the wait for the
  // previous kernel (launch.cuh), so they stream in while it finishes.
  if (!p.ids_fixed) dev::WaitForPrior();
  const int e = LocalExpert(p, p.ids[slot]);
  if (BadExpert(p, e, slot, row0, kRows, tid, p.out)) return;
  const int nblk = static_cast<int>((p.in + kFwBlk - 1) / kFwBlk);
  // A warp copies its own four rows (lane = chunk), so a warp barrier, not the CTA's, makes a
  // block visible to the lanes that read it. Row 4·warp + i's chunk q sits at q ^ 2i: a warp's
  // four rows then read 128 distinct bytes per instruction.
  const uint16_t* src[4];
  bool row_ok[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + 4 * warp + i;
    row_ok[i] = r < p.out;
    src[i] = static_cast<const uint16_t*>(p.w) + static_cast<int64_t>(e) * p.w_expert_stride +
             (row_ok[i] ? r : 0) * p.w_row_stride + 8 * lane;
  }
  uint4* const wdst = reinterpret_cast<uint4*>(wbuf) + warp * 4 * kChunks16;
  auto issue = [&](int blk, int ring_slot) {
    uint4* dst = wdst + ring_slot * kRows * kChunks16;
    const bool col_ok = static_cast<int64_t>(blk) * kFwBlk + 8 * lane < p.in;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (row_ok[i] && col_ok) CpAsync16(dst + i * kChunks16 + (lane ^ (2 * i)), src[i] + blk * kFwBlk);
    }
  };

  // Every weight block the ring holds, each its own group: all in flight together.
  const int ring = nblk < stages ? nblk : stages;  // blocks in flight from the start
  for (int blk = 0; blk < ring; ++blk) {
    issue(blk, blk);
    CpAsyncCommit();
  }
  dev::GridDependencySync();  // (a no-op wait when it was waited for above)
  const float* xrow = p.x + (p.x_per_slot ? slot : slot / p.k) * p.x_stride;
  auto tile_len = [&](int64_t t0) { return static_cast<int>(p.in - t0 < kSwTileIn ? p.in - t0 : kSwTileIn); };
  // x's first tile, rounded, while the weights land.
  StageX(xrow, tile_len(0), p.round_x_bf16, xs, tid, kSwThreads);
  __syncthreads();  // x visible to every warp

  // Lane g of a row holds chains 2g, 2g + 1: elements 16b + 2g, 16b + 2g + 1 of each block,
  // word 8(b ^ r3) + g of the row's swizzled block (chunk 2b + g/4 at (2b + g/4) ^ 2·r3). For
  // b = 4m + u that is word 8(u ^ r3) + g + 32m: four per-thread offsets and immediates.
  int woff[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) woff[u] = row * kWords + 8 * (u ^ r3) + g;
  const float2* x2 = reinterpret_cast<const float2*>(xs) + g;
  float acc0 = 0.0f, acc1 = 0.0f;  // chains 2g, 2g + 1
  int ring_slot = 0, xc = 0;
  for (int blk = 0; blk < nblk; ++blk) {
    const int64_t col0 = static_cast<int64_t>(blk) * kFwBlk;
    if (xc == kSwTileIn) {  // the next x tile (in > kSwTileIn): plain loads, once all are done with the last
      __syncthreads();
      StageX(xrow + col0, tile_len(col0), p.round_x_bf16, xs, tid, kSwThreads);
      __syncthreads();
      xc = 0;
    }
    // Block b's group is number b (every iteration commits one group, empty when nothing is
    // left to refill), so ring − 1 groups are younger than block blk's.
    CpAsyncWaitAtMost(ring - 1);
    __syncwarp();  // the warp's copies visible to all its lanes
    const uint32_t* wb = wbuf + ring_slot * kRows * kWords;
    const float2* xb = x2 + xc / 2;
    if (col0 + kFwBlk <= p.in) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint32_t w2 = wb[woff[u] + 32 * m];
          const float2 xv = xb[8 * (4 * m + u)];
          acc0 = __fmaf_rn(__uint_as_float(w2 << 16), xv.x, acc0);
          acc1 = __fmaf_rn(__uint_as_float(w2 & 0xffff0000u), xv.y, acc1);
        }
      }
    } else {  // the last, partial block (in % 16 = 0)
      const int nb = static_cast<int>((p.in - col0) / 16);
      for (int b = 0; b < nb; ++b) {
        const uint32_t w2 = wb[woff[b & 3] + 32 * (b >> 2)];
        const float2 xv = xb[8 * b];
        acc0 = __fmaf_rn(__uint_as_float(w2 << 16), xv.x, acc0);
        acc1 = __fmaf_rn(__uint_as_float(w2 & 0xffff0000u), xv.y, acc1);
      }
    }
    xc += kFwBlk;
    if (blk + ring < nblk) {
      __syncwarp();  // every lane is done with this ring slot before it is refilled
      issue(blk + ring, ring_slot);
    }
    CpAsyncCommit();
    ring_slot = ring_slot + 1 == ring ? 0 : ring_slot + 1;
  }
  CpAsyncWait<0>();
  const float sum = dev::FoldPairs8(acc0, acc1);
  if (g == 0 && o < p.out) p.y[slot * p.y_stride + o] = sum;
}

// The ring's depth: every block of a row in flight (up to kSwMaxStages) when the grid fits on
// the GPU at once; when it would take two waves but fits in one with a shallower ring, the
// shallower ring (never below kSwMinStages). Routed down at one token: 768 CTAs, 6 stages →
// 4 CTAs an SM and a second wave 45 % full; 3 stages → 7 an SM, one wave, and as many bytes in
// flight per SM. Routed gate_up at one token: 1056 CTAs, 3 stages → 7 an SM and a second wave
// of one CTA an SM, whose 64 KB then stream at one CTA's pace while the SM idles; 2 stages → 8 an
// SM, one wave (decode 383 → 394 tok/s, H200, 2026-11-30). Speed only: the depth changes no
// arithmetic.
constexpr int kSwMinStages = 2;
constexpr int kSwMaxCtasPerSm = 8;  // 64 registers × 128 threads: 8 CTAs fill the register file

// Shared memory an SM offers CTAs when it runs kSwMaxCtasPerSm of them (0: unknown).
int64_t SmemPerSm() {
  static const int64_t v = [] {
    int total = 0, reserved = 0;
    if (cudaDeviceGetAttribute(&total, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0) != cudaSuccess ||
        cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, 0) != cudaSuccess) {
      cudaGetLastError();
      return int64_t{0};
    }
    return static_cast<int64_t>(total) - reserved * kSwMaxCtasPerSm;
  }();
  return v;
}

// Whether `ctas` CTAs of `bytes` shared memory each run on the GPU at once.
bool OneWave(int64_t ctas, size_t bytes) {
  const int64_t per_sm = (ctas + SmCount() - 1) / SmCount();
  return SmemPerSm() > 0 && per_sm <= kSwMaxCtasPerSm && per_sm * static_cast<int64_t>(bytes) <= SmemPerSm();
}

// A ring's depth for a grid of `ctas` CTAs that each need bytes(stages) of shared memory:
// every block of a row in flight (up to max_stages) unless the grid would then take two waves
// where a shallower ring (never below min_stages) fits it in one.
template <typename Bytes>
int RingStages(int64_t nblk, int64_t ctas, int max_stages, int min_stages, Bytes bytes) {
  const int stages = static_cast<int>(nblk < max_stages ? nblk : max_stages);
  int s = stages;
  while (s > min_stages && !OneWave(ctas, bytes(s))) --s;
  return OneWave(ctas, bytes(s)) ? s : stages;
}

}  // namespace

Status LaunchExpertGemmStream(const ExpertGemmParams& p, Stream stream) {
  const int64_t nblk = (p.in + kFwBlk - 1) / kFwBlk;
  const int64_t ctas = (p.out + kSwRows - 1) / kSwRows * p.rows * p.k;
  const int stages =
      RingStages(nblk, ctas, kSwMaxStages, kSwMinStages, [&](int st) { return StreamSmemBytes(st, p.in); });
  static const cudaError_t attr =
      cudaFuncSetAttribute(ExpertGemmStreamKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(StreamSmemBytes(kSwMaxStages, kSwTileIn)));
  LS_CUDA_RETURN_IF_ERROR(attr);
  const dim3 grid(static_cast<unsigned>((p.out + kSwRows - 1) / kSwRows), static_cast<unsigned>(p.rows * p.k));
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(ExpertGemmStreamKernel, grid, kSwThreads, StreamSmemBytes(stages, p.in), stream, p, stages));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

namespace {

// --- ExpertGemm, bulk-copy per-slot path (decode's products, sm_90) ----------------------------
//
// The streaming path's work split and arithmetic (a CTA of 4 warps owns 16 rows of one slot;
// 8 lanes a row, lane g holding chains 2g and 2g + 1; Dot's fold), with the weights moved by
// bulk copies (async_copy.cuh) instead of 16-byte cp.async: lanes 0–3 of a warp request the
// warp's four rows, a ring slot (512 or 256 values) a row at a time, each slot on the warp's
// own mbarrier; x is staged while they land and a slot is consumed as soon as its barrier's
// phase ends. Why (H200, 2026-11-30, kernels/cuda/README.md): x's loads, issued after a
// CTA's 64 KB of cp.async weight requests (32 instructions a thread), came back only with the
// last weight byte — an L2-resident x in 611 cycles alone, 2360 behind cp.async, 1633 behind
// the same bytes in bulk copies (lab/bench_smem_fill, 36 CTAs). Row r of a slot sits at
// r·kBkRowBytes: the 32-byte pad puts a warp's four rows 8 banks apart, so the 32 lanes'
// 4-byte reads hit 32 banks (what the streaming path's XOR swizzle did; bulk copies cannot
// swizzle).
constexpr int kBkMaxValues = 2560;  // a row's values in flight at most
constexpr int kBkThreads = 128, kBkRows = 16;
// A row's bytes in a ring slot of kBlk values (bf16, or FP8 when kFp8), padded.
template <int kBlk, bool kFp8>
constexpr int kBkRowBytes = kBlk * (kFp8 ? 1 : 2) + 32;
static_assert(kSwTileIn % 512 == 0 && kBkRows == 4 * (kBkThreads / 32));

// (With x_partials, the MLA combine's scratch after x.)
template <int kBlk, bool kFp8>
size_t BulkSmemBytes(int stages, int64_t in, bool combine = false) {
  return static_cast<size_t>(stages) * (4 * sizeof(uint64_t) + kBkRows * kBkRowBytes<kBlk, kFp8>) +
         static_cast<size_t>(in < kSwTileIn ? in : kSwTileIn) * 4 + (combine ? dev::kMlaCombineScratch * 4 : 0);
}

// FP8 weights (kFp8): the same split and chains; lane g reads the byte pair of elements
// 16b + 2g, 16b + 2g + 1, and each weight is value × its row's scale for those 128 columns
// (loaded for a whole ring slot before the wait for its bytes), one rounding, then the FMA.
template <int kBlk, bool kFp8>
__global__ void __launch_bounds__(kBkThreads) ExpertGemmBulkKernel(ExpertGemmParams p, int stages) {
  constexpr int kRowBytes = kBkRowBytes<kBlk, kFp8>;
  constexpr int kEsz = kFp8 ? 1 : 2;
  constexpr int kScales = kBlk / 128;  // FP8 scales a row has per ring slot
  static_assert(kRowBytes % 16 == 0 && (kRowBytes / 4) % 32 == 8);  // rows 8 banks apart
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem);  // [stages][4 warps]
  unsigned char* wbuf = smem + static_cast<size_t>(stages) * 4 * sizeof(uint64_t);  // [stages][16][kRowBytes]
  float* xs = reinterpret_cast<float*>(wbuf + static_cast<size_t>(stages) * kBkRows * kRowBytes);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane & 7, row = tid >> 3;
  // The CTA's 16 weight rows: row0 … row0 + 15; with the SwiGLU epilogue (swiglu_inter = I) the
  // gate rows 8b … 8b + 7 (warps 0, 1) and the up rows I + 8b … (warps 2, 3), b = blockIdx.x —
  // a warp's four rows stay adjacent. o is this thread's weight row; o_ok whether it exists.
  const int64_t I = p.swiglu_inter;
  const bool swiglu = I > 0;
  const int64_t slot = blockIdx.y, row0 = static_cast<int64_t>(blockIdx.x) * (swiglu ? kBkRows / 2 : kBkRows);
  auto weight_row = [&](int r) { return swiglu ? (r < 8 ? row0 + r : I + row0 + (r - 8)) : row0 + r; };
  const int64_t o = weight_row(row);
  const bool o_ok = swiglu ? row0 + (row & 7) < I : o < p.out;
  const bool combine = p.x_partials.o != nullptr;  // x: an MLA decode's splits, merged here
  const float* const xrow = combine ? nullptr : p.x + (p.x_per_slot ? slot : slot / p.k) * p.x_stride;
  const int tn0 = p.in < kSwTileIn ? static_cast<int>(p.in) : kSwTileIn;
  XTile xt;
  if (!p.ids_fixed) {
    // Ids a kernel of this step wrote (a routing): nothing can be requested before it is done,
    // so x's loads go out first, ahead of the weights they would otherwise queue behind.
    dev::WaitForPrior();
    if (!combine) XTileLoad(xrow, tn0, tid, kBkThreads, xt);
  }
  const int e = LocalExpert(p, p.ids[slot]);
  if (swiglu ? BadExpert(p, e, slot, row0, kBkRows / 2, tid, I) : BadExpert(p, e, slot, row0, kBkRows, tid, p.out)) {
    return;
  }
  const int nblk = static_cast<int>((p.in + kBlk - 1) / kBlk);
  const int ring = nblk < stages ? nblk : stages;
  uint64_t* const wbar = bars + warp;  // this warp's barrier of ring slot s: wbar[4 s]
  if (lane < ring) dev::MbarInit(wbar + 4 * lane, 1);
  __syncwarp();
  // The warp's rows that exist; lane i below that count copies row 4·warp + i.
  const int64_t wrow0 = weight_row(4 * warp);
  const int64_t wleft = swiglu ? I - (row0 + 4 * (warp & 1)) : p.out - wrow0;
  const int nrows = static_cast<int>(wleft < 0 ? 0 : (wleft > 4 ? 4 : wleft));
  const unsigned char* wsrc =
      static_cast<const unsigned char*>(p.w) +
      (static_cast<int64_t>(e) * p.w_expert_stride + (lane < nrows ? wrow0 + lane : 0) * p.w_row_stride) * kEsz;
  unsigned char* const wdst = wbuf + static_cast<size_t>(4 * warp + lane) * kRowBytes;
  auto issue = [&](int blk, int s) {
    const int64_t c0 = static_cast<int64_t>(blk) * kBlk;
    const unsigned bytes = static_cast<unsigned>((p.in - c0 < kBlk ? p.in - c0 : kBlk) * kEsz);
    if (lane == 0) dev::MbarArriveExpectTx(wbar + 4 * s, bytes * nrows);
    if (lane < nrows) {
      dev::BulkCopyToShared(wdst + static_cast<size_t>(s) * kBkRows * kRowBytes, wsrc + c0 * kEsz, bytes,
                            wbar + 4 * s);
    }
  };
  // This thread's row's FP8 scales (a row past `out` reads row 0's: computed, not stored).
  const float* const srow = kFp8 ? p.w_scale + static_cast<int64_t>(e) * p.w_scale_expert_stride +
                                       (o_ok ? o : 0) * p.w_scale_row_stride
                                 : nullptr;
  const int nscales = static_cast<int>((p.in + 127) / 128);
  // With fixed ids the requests go out before the previous kernel has finished (launch.cuh).
  for (int blk = 0; blk < ring; ++blk) issue(blk, blk);
  dev::GridDependencySync();  // (a no-op wait when it was waited for above)
  if (combine) {  // request slot / k, head e: MlaDecode's combine into xs (rounded as XTileStore rounds)
    const bool round = p.round_x_bf16;
    dev::MlaCombineSplits(
        p.x_partials, slot / p.k, e, tid, kBkThreads, xs + tn0,  // (BulkSmemBytes' combine scratch)
        [&](int c, float v) { xs[c] = round ? dev::Bf16ToF32(dev::F32ToBf16(v)) : v; }, nullptr);
  } else {
    if (p.ids_fixed) XTileLoad(xrow, tn0, tid, kBkThreads, xt);
    XTileStore(xrow, tn0, p.round_x_bf16, xs, tid, kBkThreads, xt);
  }
  __syncthreads();  // x visible to every warp

  // Lane g of a row reads word 8b + g of the row's block for elements 16b + 2g, 16b + 2g + 1
  // (FP8: half-word 8b + g).
  const uint32_t* const wrow = reinterpret_cast<const uint32_t*>(wbuf + static_cast<size_t>(row) * kRowBytes) + g;
  const uint16_t* const wrow8 = reinterpret_cast<const uint16_t*>(wbuf + static_cast<size_t>(row) * kRowBytes) + g;
  const float2* const x2 = reinterpret_cast<const float2*>(xs) + g;
  float acc0 = 0.0f, acc1 = 0.0f;  // chains 2g, 2g + 1
  int s = 0, xc = 0;
  unsigned parity = 0;
  for (int blk = 0; blk < nblk; ++blk) {
    const int64_t col0 = static_cast<int64_t>(blk) * kBlk;
    if (xc == kSwTileIn) {  // the next x tile (in > kSwTileIn), once every warp is done with the last
      __syncthreads();
      const int64_t left = p.in - col0;
      StageX(xrow + col0, left < kSwTileIn ? static_cast<int>(left) : kSwTileIn, p.round_x_bf16, xs, tid, kBkThreads);
      __syncthreads();
      xc = 0;
    }
    float sc[kScales];
    if constexpr (kFp8) {
#pragma unroll
      for (int j = 0; j < kScales; ++j) {
        const int c = static_cast<int>(col0 / 128) + j;
        sc[j] = c < nscales ? __ldg(srow + c) : 0.0f;
      }
    }
    dev::MbarWait(wbar + 4 * s, parity);
    const float2* xb = x2 + xc / 2;
    if constexpr (kFp8) {
      const uint16_t* wb = wrow8 + static_cast<size_t>(s) * (kBkRows * kRowBytes / 2);
      auto step = [&](int b, float scale) {
        const float2 f = dev::Fp8x2ToF32(wb[8 * b]);
        const float2 xv = xb[8 * b];
        acc0 = __fmaf_rn(__fmul_rn(f.x, scale), xv.x, acc0);
        acc1 = __fmaf_rn(__fmul_rn(f.y, scale), xv.y, acc1);
      };
      if (col0 + kBlk <= p.in) {
#pragma unroll
        for (int b = 0; b < kBlk / 16; ++b) step(b, sc[b / 8]);
      } else {  // the last, partial block (in % 16 = 0)
        const int nb = static_cast<int>((p.in - col0) / 16);
        for (int b = 0; b < nb; ++b) step(b, __ldg(srow + (col0 + 16 * b) / 128));
      }
    } else if (col0 + kBlk <= p.in) {
      const uint32_t* wb = wrow + static_cast<size_t>(s) * (kBkRows * kRowBytes / 4);
#pragma unroll
      for (int b = 0; b < kBlk / 16; ++b) {
        const uint32_t w2 = wb[8 * b];
        const float2 xv = xb[8 * b];
        acc0 = __fmaf_rn(__uint_as_float(w2 << 16), xv.x, acc0);
        acc1 = __fmaf_rn(__uint_as_float(w2 & 0xffff0000u), xv.y, acc1);
      }
    } else {  // the last, partial block (in % 16 = 0)
      const uint32_t* wb = wrow + static_cast<size_t>(s) * (kBkRows * kRowBytes / 4);
      const int nb = static_cast<int>((p.in - col0) / 16);
#pragma unroll 4
      for (int b = 0; b < nb; ++b) {
        const uint32_t w2 = wb[8 * b];
        const float2 xv = xb[8 * b];
        acc0 = __fmaf_rn(__uint_as_float(w2 << 16), xv.x, acc0);
        acc1 = __fmaf_rn(__uint_as_float(w2 & 0xffff0000u), xv.y, acc1);
      }
    }
    xc += kBlk;
    if (blk + ring < nblk) {
      __syncwarp();  // every lane is done with this slot before it is refilled
      dev::FenceProxyAsyncShared();
      issue(blk + ring, s);
    }
    if (++s == ring) {
      s = 0;
      parity ^= 1u;
    }
  }
  const float sum = dev::FoldPairs8(acc0, acc1);
  if (swiglu) {  // act[8b + i] = SwiGlu(gate row i, up row i): SwiGluKernel's bits
    __shared__ float pair_s[kBkRows];
    if (g == 0) pair_s[row] = sum;
    __syncthreads();
    if (tid < kBkRows / 2 && row0 + tid < I) {
      p.y[slot * p.y_stride + row0 + tid] = SwiGluOf(pair_s[tid], pair_s[tid + 8]);
    }
  } else if (g == 0 && o_ok) {
    p.y[slot * p.y_stride + o] = sum;
  }
}

template <int kBlk, bool kFp8>
Status LaunchBulk(const ExpertGemmParams& p, int stages, Stream stream) {
  static const cudaError_t attr =
      cudaFuncSetAttribute(ExpertGemmBulkKernel<kBlk, kFp8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(BulkSmemBytes<kBlk, kFp8>(kBkMaxValues / kBlk, kSwTileIn, true)));
  LS_CUDA_RETURN_IF_ERROR(attr);
  const int64_t row_blocks =
      p.swiglu_inter > 0 ? (p.swiglu_inter + kBkRows / 2 - 1) / (kBkRows / 2) : (p.out + kBkRows - 1) / kBkRows;
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(p.rows * p.k));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(ExpertGemmBulkKernel<kBlk, kFp8>, grid, kBkThreads,
                                       BulkSmemBytes<kBlk, kFp8>(stages, p.in, p.x_partials.o != nullptr), stream,
                                       p, stages));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace

BulkShape PickBulkShape(const ExpertGemmParams& p) {
  const int64_t ctas = (p.out + kBkRows - 1) / kBkRows * p.rows * p.k;
  auto bytes = [&](int blk, int st) {
    return p.w_fp8 ? (blk == 512 ? BulkSmemBytes<512, true>(st, p.in) : BulkSmemBytes<256, true>(st, p.in))
                   : (blk == 512 ? BulkSmemBytes<512, false>(st, p.in) : BulkSmemBytes<256, false>(st, p.in));
  };
  const int s512 = RingStages((p.in + 511) / 512, ctas, kBkMaxValues / 512, 2, [&](int st) { return bytes(512, st); });
  if (OneWave(ctas, bytes(512, s512))) return {512, s512, true};
  const int s256 = RingStages((p.in + 255) / 256, ctas, kBkMaxValues / 256, 3, [&](int st) { return bytes(256, st); });
  return {256, s256, OneWave(ctas, bytes(256, s256))};
}

Status LaunchExpertGemmBulk(const ExpertGemmParams& p, Stream stream) {
  const BulkShape b = PickBulkShape(p);
  if (p.w_fp8) {
    return b.blk == 512 ? LaunchBulk<512, true>(p, b.stages, stream) : LaunchBulk<256, true>(p, b.stages, stream);
  }
  return b.blk == 512 ? LaunchBulk<512, false>(p, b.stages, stream) : LaunchBulk<256, false>(p, b.stages, stream);
}

}  // namespace lockstep::kernels::cuda
