// kernels/cuda/indexer.cu — DeepSeek-V3.2 lightning-indexer scores (reference variant) and
// the deterministic top-k that turns them into the sparse attention's key set (ops.h).
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

constexpr int kScoreThreads = 128;  // one key per thread, a tile of 128 keys per CTA
constexpr int kHeadBlock = 4;       // heads sharing one pass over a key row
constexpr size_t kMaxScoreSmem = 220 * 1024;
constexpr int kTopKThreads = 512;

size_t ScoreSmem(int64_t heads, int64_t head_dim) {
  return sizeof(int64_t) * kScoreThreads + sizeof(float) * (heads * head_dim + heads + kScoreThreads * (head_dim + 1));
}

__global__ void __launch_bounds__(kScoreThreads) IndexerScoreKernel(IndexerScoreParams p) {
  dev::GridDependencySync();
  extern __shared__ int64_t smem64[];
  const int b = blockIdx.y, tid = threadIdx.x;
  const int H = static_cast<int>(p.heads), hd = static_cast<int>(p.head_dim);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kScoreThreads;
  int64_t n = p.seq_lens[b];
  if (n < 0 || n > p.max_seq_len || n > p.page_table_stride * p.page_size) {
    if (blockIdx.x == 0 && tid == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrSeqLen);
    n = 0;
  }
  float* out = p.scores + b * p.scores_stride;
  const int64_t t = t0 + tid;
  if (t0 >= n) {  // a tile past the request's keys: only the −inf fill
    if (t < p.max_seq_len) out[t] = -INFINITY;
    return;
  }
  int64_t* slot_s = smem64;                                        // [128] (first: 8-byte aligned)
  float* q_s = reinterpret_cast<float*>(slot_s + kScoreThreads);   // [H][hd]
  float* w_s = q_s + H * hd;                                       // [H]
  float* k_s = w_s + H;                                            // [128][hd + 1]
  for (int i = tid; i < H * hd; i += kScoreThreads) {
    const int h = i / hd, j = i - h * hd;
    q_s[i] = p.q[b * p.q_batch_stride + h * p.q_head_stride + j];
  }
  for (int h = tid; h < H; h += kScoreThreads) w_s[h] = p.weights[b * p.weights_stride + h];
  {
    int64_t slot = -1;
    if (t < n) {
      const int32_t page = p.page_table[b * p.page_table_stride + t / p.page_size];
      if (page < 0 || page >= p.num_pages) {
        if (p.error_flag != nullptr) atomicOr(p.error_flag, kErrPageId);
      } else {
        slot = static_cast<int64_t>(page) * p.page_size + t % p.page_size;
      }
    }
    slot_s[tid] = slot;
  }
  __syncthreads();
  for (int i = tid; i < kScoreThreads * hd; i += kScoreThreads) {
    const int row = i / hd, j = i - row * hd;
    const int64_t slot = slot_s[row];
    k_s[row * (hd + 1) + j] = slot >= 0 ? p.keys[slot * hd + j] : 0.0f;
  }
  __syncthreads();
  if (t >= p.max_seq_len) return;
  if (t >= n || slot_s[tid] < 0) {
    out[t] = t >= n ? -INFINITY : __uint_as_float(0x7fc00000u);  // a bad page gives NaN, flagged above
    return;
  }
  // s = Σ_h w_h · ReLU(Dot(q_h, k_t) · key_scale), h ascending — engine/model.cc's loop, where
  // std::max(d, 0.0f) is (d < 0 ? 0 : d).
  const float* krow = k_s + tid * (hd + 1);
  float s = 0.0f;
  for (int h0 = 0; h0 < H; h0 += kHeadBlock) {
    const float* qa[kHeadBlock];
#pragma unroll
    for (int i = 0; i < kHeadBlock; ++i) qa[i] = q_s + min(h0 + i, H - 1) * hd;  // tail heads: computed, unused
    float d[kHeadBlock];
    dev::Dot16<kHeadBlock>(qa, krow, hd, d);
#pragma unroll
    for (int i = 0; i < kHeadBlock; ++i) {
      if (h0 + i < H) {
        const float x = __fmul_rn(d[i], p.key_scale);
        s = __fadd_rn(s, __fmul_rn(w_s[h0 + i], x < 0.0f ? 0.0f : x));
      }
    }
  }
  out[t] = s;
}

__global__ void __launch_bounds__(kTopKThreads) TopKKernel(TopKParams p) {
  dev::GridDependencySync();
  using Scan = cub::BlockScan<int, kTopKThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ int remaining_s;
  const int b = blockIdx.x, tid = threadIdx.x;
  int64_t n = p.seq_lens[b];
  if (n < 0 || n > p.max_seq_len) {
    if (tid == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrSeqLen);
    n = 0;
  }
  const float* sc = p.scores + b * p.scores_stride;
  const int64_t k = min(p.topk, n);
  int32_t* pos_out = p.positions + b * p.topk;
  int32_t* slot_out = p.slots != nullptr ? p.slots + b * p.topk : nullptr;

  if (k > 0) {
    // Radix select, 8 bits at a time from the top: τ = the k-th largest key, and `remaining`
    // = how many keys equal to τ belong to the top k. Counts are order-independent.
    uint32_t prefix = 0, mask = 0;
    int remaining = static_cast<int>(k);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kTopKThreads) hist[i] = 0;
      __syncthreads();
      for (int64_t t = tid; t < n; t += kTopKThreads) {
        const uint32_t key = dev::OrderedKey(sc[t]);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int above = 0;
        for (int d = 255; d >= 0; --d) {
          if (above + hist[d] >= remaining) {
            prefix_s = prefix | (static_cast<uint32_t>(d) << shift);
            remaining_s = remaining - above;
            break;
          }
          above += hist[d];
        }
      }
      __syncthreads();
      prefix = prefix_s;
      remaining = remaining_s;
      mask |= 0xffu << shift;
      __syncthreads();
    }
    // Keep every key > τ and the first `remaining` keys == τ, scanning positions upwards so the
    // output comes out in ascending position order.
    const uint32_t tau = prefix;
    int eq_taken = 0, written = 0;
    for (int64_t base = 0; base < n; base += kTopKThreads) {
      const int64_t t = base + tid;
      const uint32_t key = t < n ? dev::OrderedKey(sc[t]) : 0u;
      const int gt = (t < n && key > tau) ? 1 : 0;
      const int eq = (t < n && key == tau) ? 1 : 0;
      int eq_rank, eq_total;
      Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
      __syncthreads();
      const int sel = (gt || (eq && eq_taken + eq_rank < remaining)) ? 1 : 0;
      int sel_rank, sel_total;
      Scan(scan_tmp).ExclusiveSum(sel, sel_rank, sel_total);
      __syncthreads();
      if (sel) {
        const int at = written + sel_rank;
        pos_out[at] = static_cast<int32_t>(t);
        if (slot_out != nullptr) {
          const int32_t page = p.page_table[b * p.page_table_stride + t / p.page_size];
          if (page < 0 || page >= p.num_pages) {
            if (p.error_flag != nullptr) atomicOr(p.error_flag, kErrPageId);
            slot_out[at] = -1;
          } else {
            slot_out[at] = static_cast<int32_t>(static_cast<int64_t>(page) * p.page_size + t % p.page_size);
          }
        }
      }
      eq_taken += eq_total;
      written += sel_total;
    }
  }
  for (int64_t i = k + tid; i < p.topk; i += kTopKThreads) {
    pos_out[i] = -1;
    if (slot_out != nullptr) slot_out[i] = -1;
  }
}

}  // namespace

Status IndexerScores(const IndexerScoreParams& p, Stream stream) {
  constexpr const char* op = "IndexerScores";
  LS_CHECK_ARG(p.batch >= 0 && p.batch <= 65535, op, "batch", p.batch);
  LS_CHECK_ARG(p.heads > 0, op, "heads", p.heads);
  LS_CHECK_ARG(p.head_dim > 0 && p.head_dim <= 256, op, "head_dim", p.head_dim);
  LS_CHECK_ARG(ScoreSmem(p.heads, p.head_dim) <= kMaxScoreSmem, op, "heads (heads·head_dim too large for shared memory)",
               p.heads);
  LS_CHECK_ARG(p.q != nullptr, op, "q", p.q);
  LS_CHECK_ARG(p.q_head_stride >= p.head_dim, op, "q_head_stride", p.q_head_stride);
  LS_CHECK_ARG(p.q_batch_stride >= (p.heads - 1) * p.q_head_stride + p.head_dim, op, "q_batch_stride",
               p.q_batch_stride);
  LS_CHECK_ARG(p.weights != nullptr, op, "weights", p.weights);
  LS_CHECK_ARG(p.weights_stride >= p.heads, op, "weights_stride", p.weights_stride);
  LS_CHECK_ARG(p.keys != nullptr, op, "keys", p.keys);
  LS_CHECK_ARG(p.page_size > 0, op, "page_size", p.page_size);
  LS_CHECK_ARG(p.num_pages > 0 && p.num_pages * p.page_size <= (int64_t{1} << 31), op, "num_pages", p.num_pages);
  LS_CHECK_ARG(p.page_table != nullptr, op, "page_table", p.page_table);
  LS_CHECK_ARG(p.page_table_stride > 0, op, "page_table_stride", p.page_table_stride);
  LS_CHECK_ARG(p.seq_lens != nullptr, op, "seq_lens", p.seq_lens);
  LS_CHECK_ARG(p.max_seq_len >= 0 && p.max_seq_len <= p.page_table_stride * p.page_size, op, "max_seq_len",
               p.max_seq_len);
  LS_CHECK_ARG(p.scores != nullptr, op, "scores", p.scores);
  LS_CHECK_ARG(p.scores_stride >= p.max_seq_len, op, "scores_stride", p.scores_stride);
  if (p.batch == 0 || p.max_seq_len == 0) return Status::Ok();
  const size_t smem = ScoreSmem(p.heads, p.head_dim);
  LS_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(IndexerScoreKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((p.max_seq_len + kScoreThreads - 1) / kScoreThreads),
                  static_cast<unsigned>(p.batch));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(IndexerScoreKernel, grid, kScoreThreads, smem, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status TopK(const TopKParams& p, Stream stream) {
  constexpr const char* op = "TopK";
  LS_CHECK_ARG(p.batch >= 0 && p.batch < (int64_t{1} << 31), op, "batch", p.batch);
  LS_CHECK_ARG(p.topk > 0 && p.topk < (int64_t{1} << 31), op, "topk", p.topk);
  LS_CHECK_ARG(p.scores != nullptr, op, "scores", p.scores);
  LS_CHECK_ARG(p.max_seq_len >= 0 && p.max_seq_len < (int64_t{1} << 31), op, "max_seq_len", p.max_seq_len);
  LS_CHECK_ARG(p.scores_stride >= p.max_seq_len, op, "scores_stride", p.scores_stride);
  LS_CHECK_ARG(p.seq_lens != nullptr, op, "seq_lens", p.seq_lens);
  LS_CHECK_ARG(p.positions != nullptr, op, "positions", p.positions);
  if (p.slots != nullptr) {
    LS_CHECK_ARG(p.page_table != nullptr, op, "page_table (needed for slots)", p.page_table);
    LS_CHECK_ARG(p.page_size > 0, op, "page_size", p.page_size);
    LS_CHECK_ARG(p.page_table_stride * p.page_size >= p.max_seq_len, op, "page_table_stride", p.page_table_stride);
    LS_CHECK_ARG(p.num_pages > 0 && p.num_pages * p.page_size <= (int64_t{1} << 31), op, "num_pages", p.num_pages);
  }
  if (p.batch == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(TopKKernel, static_cast<unsigned>(p.batch), kTopKThreads, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
