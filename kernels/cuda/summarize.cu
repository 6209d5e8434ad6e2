// kernels/cuda/summarize.cu — SummarizeRows (runtime.h): trace summaries of rows on the device.
#include <cuda_runtime.h>

#include <mutex>

#define XXH_INLINE_ALL  // the default XXH3 secret, copied once to the device
#include <xxhash.h>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/row_stats.h"
#include "kernels/xxh3.h"

namespace lockstep::kernels::cuda {

namespace {

__constant__ __align__(16) uint8_t kSecret[xxh3::kSecretSize];
// Lane i's 64-bit secret words of the long path, derived from the secret on the host: the 16
// stripe keys of a block, the scramble key, the last stripe's key. Global memory, not
// constant: the eight lanes read different words (constant memory would serialise them).
constexpr int kLaneKeys = 18;
__device__ uint64_t kLaneKey[8][kLaneKeys];

constexpr int kSumWarps = 2;                 // warps (rows) per CTA
constexpr int kStageValues = 8192;           // values a warp stages in shared memory
constexpr unsigned kFull = 0xffffffffu;

// 4-byte aligned little-endian 64-bit read (rows are 4-byte aligned; a stripe may not be 8-).
__device__ __forceinline__ uint64_t Read64Al4(const uint8_t* p) {
  const uint32_t lo = *reinterpret_cast<const uint32_t*>(p), hi = *reinterpret_cast<const uint32_t*>(p + 4);
  return static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32;
}

// Lane i < 8 of XXH3's long path: accumulator i after every stripe, block scramble and the last
// stripe (xxh3::HashLong, whose Accumulate512 adds word i^1 and word i's keyed product to acc[i]:
// 64-bit additions, so their order within a stripe does not matter). Lanes 0–3 also add the
// squares of the stripe's values i ≡ lane (mod 4) in row order: row_stats.h's four lanes.
__device__ __forceinline__ void HashAndSquares(const uint8_t* in, size_t len, int lane, bool squares,
                                               uint64_t* acc_out, double* sq_out, int64_t* next_sq) {
  const uint64_t init[8] = {xxh3::kP32_3, xxh3::kP64_1, xxh3::kP64_2, xxh3::kP64_3,
                            xxh3::kP64_4, xxh3::kP32_2, xxh3::kP64_5, xxh3::kP32_1};
  constexpr int kPerBlock = static_cast<int>((xxh3::kSecretSize - 64) / 8);  // 16 stripes
  constexpr size_t kBlockLen = 64 * kPerBlock;                               // 1024 bytes
  const int i = lane & 7, j = lane & 3;
  uint64_t acc = init[i];
  double sq = 0.0;
  // This lane's secret words, once (the secret's offsets are not all 4-aligned: byte reads).
  static_assert(kPerBlock + 2 == kLaneKeys);
  uint64_t key[kPerBlock];
#pragma unroll
  for (int s = 0; s < kPerBlock; ++s) key[s] = kLaneKey[i][s];
  const uint64_t scramble_key = kLaneKey[i][kPerBlock], last_key = kLaneKey[i][kPerBlock + 1];
  auto stripe = [&](const uint8_t* st, uint64_t k_i, bool add_squares) {
    const uint64_t v = Read64Al4(st + 8 * i), vx = Read64Al4(st + 8 * (i ^ 1));
    const uint64_t k = v ^ k_i;
    acc += vx;
    acc += static_cast<uint64_t>(static_cast<uint32_t>(k)) * (k >> 32);
    if (add_squares) {
      const float* f = reinterpret_cast<const float*>(st);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const double x = f[j + 4 * m];
        sq = __dadd_rn(sq, __dmul_rn(x, x));
      }
    }
  };
  const size_t blocks = (len - 1) / kBlockLen;
  for (size_t b = 0; b < blocks; ++b) {
#pragma unroll
    for (int s = 0; s < kPerBlock; ++s) stripe(in + b * kBlockLen + s * 64, key[s], squares);
    uint64_t a = acc;
    a ^= a >> 47;
    a ^= scramble_key;
    acc = a * xxh3::kP32_1;
  }
  const int stripes = static_cast<int>(((len - 1) - kBlockLen * blocks) / 64);
#pragma unroll
  for (int s = 0; s < kPerBlock; ++s) {
    if (s < stripes) stripe(in + blocks * kBlockLen + s * 64, key[s], squares);
  }
  stripe(in + len - 64, last_key, false);  // the last stripe (overlaps the ones before)
  *acc_out = acc;
  *sq_out = sq;
  *next_sq = static_cast<int64_t>((blocks * kBlockLen + static_cast<size_t>(stripes) * 64) / 4);
}

// One warp per row of `t` (row r), `stage` = this warp's kStageValues floats of shared memory.
// dst[0, n) = src[0, n) by a warp, 16 loads a lane issued before their stores.
template <typename T>
__device__ __forceinline__ void StageWarp(const T* src, T* dst, int64_t n, int lane) {
  for (int64_t base = 0; base < n; base += 32 * 16) {
    T v[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      const int64_t idx = base + u * 32 + lane;
      if (idx < n) v[u] = src[idx];
    }
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      const int64_t idx = base + u * 32 + lane;
      if (idx < n) dst[idx] = v[u];
    }
  }
}

__device__ __forceinline__ int RowTypeSize(RowType t) {
  return t == RowType::kBf16 ? 2 : t == RowType::kFp8E4m3 ? 1 : 4;
}

__device__ void SummarizeRowWarp(const SummarizeBatchParams::Tensor& t, int64_t r, float* stage, int lane) {
  const int64_t cols = t.cols;
  const bool f32 = t.type == RowType::kF32;
  const size_t esize = static_cast<size_t>(RowTypeSize(t.type));
  const uint8_t* src = static_cast<const uint8_t*>(t.x) + static_cast<size_t>(r * t.x_stride) * esize;
  const size_t len = static_cast<size_t>(cols) * esize;
  // Stage the row (every lane's loads issued before its stores), or read it in place; as
  // 4-byte words (rows are whole words: SummarizeBatch checks, SummarizeTable's callers vouch).
  const uint8_t* row = src;
  if (len <= size_t{kStageValues} * 4) {
    const int64_t words = static_cast<int64_t>(len / 4);
    const bool vec = (reinterpret_cast<uintptr_t>(src) & 15) == 0 && (words & 3) == 0;
    if (vec) {
      StageWarp(reinterpret_cast<const float4*>(src), reinterpret_cast<float4*>(stage), words / 4, lane);
    } else {
      StageWarp(reinterpret_cast<const float*>(src), stage, words, lane);
    }
    __syncwarp();
    row = reinterpret_cast<const uint8_t*>(stage);
  }
  const float* f = reinterpret_cast<const float*>(row);

  RowSummaryOut o;
  bool sequential = !f32 || cols == 0;  // lane 0 runs the host's loops
  if (len > 240) {
    uint64_t acc = 0;
    double sq = 0.0;
    int64_t next = 0;
    if (lane < 8) HashAndSquares(row, len, lane, f32 && lane < 4, &acc, &sq, &next);
    if (f32 && lane < 4) {
      for (int64_t e = next + lane; e < cols; e += 4) {  // values after the last whole stripe
        const double x = f[e];
        sq = __dadd_rn(sq, __dmul_rn(x, x));
      }
    }
    uint64_t a[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] = __shfl_sync(kFull, acc, k);
    uint64_t h = static_cast<uint64_t>(len) * xxh3::kP64_1;
    const uint8_t* ms = kSecret + 11;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      h += xxh3::MulFold64(a[2 * k] ^ xxh3::Read64(ms + 16 * k), a[2 * k + 1] ^ xxh3::Read64(ms + 16 * k + 8));
    }
    o.hash = xxh3::Avalanche(h);
    if (f32) {
      const double s0 = __shfl_sync(kFull, sq, 0), s1 = __shfl_sync(kFull, sq, 1), s2 = __shfl_sync(kFull, sq, 2),
                   s3 = __shfl_sync(kFull, sq, 3);
      const double sumsq = __dadd_rn(__dadd_rn(s0, s1), __dadd_rn(s2, s3));
      if (!isfinite(sumsq)) {
        sequential = true;  // NaN or ±Inf in the row: the careful loop
      } else {
        // min / max: the smallest / largest value, first index among equals (row_stats.h's
        // strict comparisons in row order, with FirstZero for a zero extreme).
        float lo = INFINITY, hi = -INFINITY;
        int64_t lo_i = cols, hi_i = cols;
        for (int64_t e = lane; e < cols; e += 32) {
          const float v = f[e];
          if (v < lo) lo = v, lo_i = e;
          if (v > hi) hi = v, hi_i = e;
        }
#pragma unroll
        for (int d = 16; d >= 1; d /= 2) {
          const float olo = __shfl_xor_sync(kFull, lo, d), ohi = __shfl_xor_sync(kFull, hi, d);
          const int64_t oli = __shfl_xor_sync(kFull, lo_i, d), ohi_i = __shfl_xor_sync(kFull, hi_i, d);
          if (olo < lo || (olo == lo && oli < lo_i)) lo = olo, lo_i = oli;
          if (ohi > hi || (ohi == hi && ohi_i < hi_i)) hi = ohi, hi_i = ohi_i;
        }
        lo = f[lo_i];  // the element itself: its sign of zero
        hi = f[hi_i];
        o.rms = static_cast<float>(sqrt(__ddiv_rn(sumsq, static_cast<double>(cols))));
        o.absmax = static_cast<float>(fmax(fabs(static_cast<double>(lo)), fabs(static_cast<double>(hi))));
        o.min = lo;
        o.max = hi;
      }
    }
  } else {
    sequential = true;
    if (lane == 0) o.hash = xxh3::Hash64(row, len, kSecret);
  }
  if (sequential && lane == 0) {
    const RowStats st = t.type == RowType::kI32    ? RowStatsI32(reinterpret_cast<const int32_t*>(row), cols)
                        : t.type == RowType::kBf16   ? RowStatsBf16(row, cols)
                        : t.type == RowType::kFp8E4m3 ? RowStatsFp8E4m3(row, cols)
                                                      : RowStatsF32(f, cols);
    o.nan_count = st.nan_count;
    o.inf_count = st.inf_count;
    o.rms = st.rms;
    o.absmax = st.absmax;
    o.min = st.min;
    o.max = st.max;
  }
  if (lane == 0) t.out[r] = o;
  __syncwarp();  // the stage is reused by this warp's next row
}

// Grid (ceil(rows / kSumWarps), tensors): warp w of CTA x takes row x·kSumWarps + w.
__global__ void __launch_bounds__(kSumWarps * 32) SummarizeBatchKernel(SummarizeBatchParams p) {
  dev::GridDependencySync();
  extern __shared__ __align__(16) float sum_stage[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kSumWarps + warp;
  if (r >= p.rows) return;
  SummarizeRowWarp(p.t[blockIdx.y], r, sum_stage + warp * kStageValues, lane);
}

__global__ void __launch_bounds__(kSumWarps * 32) SummarizeTableKernel(SummarizeTableParams p) {
  dev::GridDependencySync();
  extern __shared__ __align__(16) float sum_stage[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kSumWarps + warp;
  if (r >= p.rows) return;
  const SummarizeBatchParams::Tensor t = p.tensors[blockIdx.y];
  SummarizeRowWarp(t, r, sum_stage + warp * kStageValues, lane);
}

Status UploadSecretOnce() {
  static std::once_flag once;
  static cudaError_t err = cudaSuccess;
  std::call_once(once, [] {
    err = cudaMemcpyToSymbol(kSecret, XXH3_kSecret, xxh3::kSecretSize);
    uint64_t keys[8][kLaneKeys];
    for (int i = 0; i < 8; ++i) {
      for (int s = 0; s < kLaneKeys - 2; ++s) keys[i][s] = xxh3::Read64(XXH3_kSecret + s * 8 + 8 * i);
      keys[i][kLaneKeys - 2] = xxh3::Read64(XXH3_kSecret + xxh3::kSecretSize - 64 + 8 * i);
      keys[i][kLaneKeys - 1] = xxh3::Read64(XXH3_kSecret + xxh3::kSecretSize - 64 - 7 + 8 * i);
    }
    if (err == cudaSuccess) err = cudaMemcpyToSymbol(kLaneKey, keys, sizeof(keys));
  });
  LS_CUDA_RETURN_IF_ERROR(err);
  return Status::Ok();
}

// Grid (ceil(rows / kSumWarps), tensors), kSumWarps staging areas of shared memory.
template <typename Params>
Status Launch(void (*kernel)(Params), const Params& p, int64_t rows, int64_t tensors, Stream stream) {
  LS_RETURN_IF_ERROR(UploadSecretOnce());
  constexpr size_t smem = size_t{kSumWarps} * kStageValues * 4;
  // Once per kernel (one kernel per Params type), before any graph capture can need it.
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  LS_CUDA_RETURN_IF_ERROR(attr);
  const dim3 grid(static_cast<unsigned>((rows + kSumWarps - 1) / kSumWarps), static_cast<unsigned>(tensors));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(kernel, grid, kSumWarps * 32, smem, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace

Status SummarizeBatch(const SummarizeBatchParams& p, Stream stream) {
  const char* op = "SummarizeBatch";
  LS_CHECK_ARG(p.count >= 0 && p.count <= kSummarizeBatchMax, op, "count", p.count);
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  if (p.rows == 0 || p.count == 0) return Status::Ok();
  for (int i = 0; i < p.count; ++i) {
    const SummarizeBatchParams::Tensor& t = p.t[i];
    LS_CHECK_ARG(t.cols >= 0, op, "t[].cols", t.cols);
    LS_CHECK_ARG(t.x != nullptr, op, "t[].x", t.x);
    LS_CHECK_ARG(reinterpret_cast<uintptr_t>(t.x) % 4 == 0, op, "t[].x (4-byte aligned)", t.x);
    LS_CHECK_ARG(t.type <= RowType::kFp8E4m3, op, "t[].type", static_cast<int>(t.type));
    LS_CHECK_ARG(t.type == RowType::kF32 || t.type == RowType::kI32 || t.x_stride % 4 == 0 ||
                     (t.type == RowType::kBf16 && t.x_stride % 2 == 0),
                 op, "t[].x_stride (rows 4-byte aligned)", t.x_stride);
    LS_CHECK_ARG(t.type != RowType::kFp8E4m3 || t.cols % 4 == 0, op, "t[].cols (E4M3 rows a multiple of 4 bytes)", t.cols);
    LS_CHECK_ARG(t.type != RowType::kBf16 || t.cols % 2 == 0, op, "t[].cols (bf16 rows a multiple of 4 bytes)", t.cols);
    LS_CHECK_ARG(t.out != nullptr, op, "t[].out", static_cast<const void*>(t.out));
    LS_CHECK_ARG(t.x_stride >= t.cols, op, "t[].x_stride", t.x_stride);
  }
  return Launch(SummarizeBatchKernel, p, p.rows, p.count, stream);
}

Status SummarizeTable(const SummarizeTableParams& p, Stream stream) {
  const char* op = "SummarizeTable";
  LS_CHECK_ARG(p.count >= 0 && p.count <= 65535, op, "count", p.count);
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  if (p.rows == 0 || p.count == 0) return Status::Ok();
  LS_CHECK_ARG(p.tensors != nullptr, op, "tensors", static_cast<const void*>(p.tensors));
  return Launch(SummarizeTableKernel, p, p.rows, p.count, stream);
}

Status SummarizeRows(const SummarizeRowsParams& p, Stream stream) {
  const char* op = "SummarizeRows";
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  LS_CHECK_ARG(p.cols >= 0, op, "cols", p.cols);
  if (p.rows == 0) return Status::Ok();
  LS_CHECK_ARG(p.x != nullptr, op, "x", p.x);
  LS_CHECK_ARG(p.out != nullptr, op, "out", static_cast<const void*>(p.out));
  LS_CHECK_ARG(p.x_stride >= p.cols, op, "x_stride", p.x_stride);
  SummarizeBatchParams b;
  b.t[0].x = p.x;
  b.t[0].x_stride = p.x_stride;
  b.t[0].cols = p.cols;
  b.t[0].type = p.type;
  b.t[0].out = p.out;
  b.count = 1;
  b.rows = p.rows;
  return SummarizeBatch(b, stream);
}

}  // namespace lockstep::kernels::cuda
