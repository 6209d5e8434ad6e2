// kernels/cuda/indexer.cu — DeepSeek-V3.2 lightning-indexer scores (the reference variant, and
// indexer=fp8_paged's over FP8 rows) and the deterministic top-k that turns them into the
// sparse attention's key set (ops.h).
#include <cuda_runtime.h>

#include <algorithm>

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
constexpr int kTopKPer = 8;  // positions a thread takes per chunk of the final pass

// Global slot (page · page_size + offset) of key t of request b through the page table, or −1 on
// a page id outside the pool (flagged kErrPageId). P: IndexerScoreParams or TopKParams.
template <typename P>
__device__ __forceinline__ int64_t PagedSlot(const P& p, int b, int64_t t) {
  const int32_t page = p.page_table[b * p.page_table_stride + t / p.page_size];
  if (page < 0 || page >= p.num_pages) {
    if (p.error_flag != nullptr) atomicOr(p.error_flag, kErrPageId);
    return -1;
  }
  return static_cast<int64_t>(page) * p.page_size + t % p.page_size;
}

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
  slot_s[tid] = t < n ? PagedSlot(p, b, t) : -1;
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
      // Lanes of a warp with the same digit add once, all of them (scores cluster in a few
      // digits: per-lane atomics on one counter serialise). Counts: order-independent.
      // A thread's kTopKPer loads go out together (one CTA walks the row: latency-bound).
      for (int64_t base = 0; base < n; base += static_cast<int64_t>(kTopKThreads) * kTopKPer) {
        float v[kTopKPer];
#pragma unroll
        for (int j = 0; j < kTopKPer; ++j) {
          const int64_t t = base + j * kTopKThreads + tid;
          v[j] = t < n ? sc[t] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kTopKPer; ++j) {
          uint32_t digit = 256;  // none
          if (base + j * kTopKThreads + tid < n) {
            const uint32_t key = dev::OrderedKey(v[j]);
            if ((key & mask) == prefix) digit = (key >> shift) & 255u;
          }
          const unsigned peers = __match_any_sync(0xffffffffu, digit);
          if (digit < 256 && (tid & 31) == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
        }
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
    // output comes out in ascending position order: chunks of kTopKPer positions a thread
    // (contiguous, so a scan over threads orders them), until all k are written.
    const uint32_t tau = prefix;
    int eq_taken = 0, written = 0;
    for (int64_t base = 0; base < n && written < k; base += static_cast<int64_t>(kTopKThreads) * kTopKPer) {
      const int64_t t0 = base + static_cast<int64_t>(tid) * kTopKPer;
      uint32_t keys[kTopKPer];
      int gt = 0, eq = 0;
#pragma unroll
      for (int j = 0; j < kTopKPer; ++j) {
        keys[j] = t0 + j < n ? dev::OrderedKey(sc[t0 + j]) : 0u;
        gt += (t0 + j < n && keys[j] > tau) ? 1 : 0;
        eq += (t0 + j < n && keys[j] == tau) ? 1 : 0;
      }
      int eq_rank, eq_total;
      Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
      __syncthreads();
      // This thread's keys == τ that are still wanted, in position order.
      const int eq_want = max(0, min(eq, remaining - eq_taken - eq_rank));
      int sel_rank, sel_total;
      Scan(scan_tmp).ExclusiveSum(gt + eq_want, sel_rank, sel_total);
      __syncthreads();
      int at = written + sel_rank, eq_seen = 0;
#pragma unroll
      for (int j = 0; j < kTopKPer; ++j) {
        const int64_t t = t0 + j;
        if (t >= n) break;
        bool sel = keys[j] > tau;
        if (keys[j] == tau) sel = eq_seen++ < eq_want;
        if (!sel) continue;
        pos_out[at] = static_cast<int32_t>(t);
        if (slot_out != nullptr) slot_out[at] = static_cast<int32_t>(PagedSlot(p, b, t));
        ++at;
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

// --- indexer=fp8_paged: FP8 rows, exact dot products ---------------------------------------
//
// A CTA scores one request's kF8Keys keys (a DeepSeek page) for every head. Keys past the
// request's end: the CTA exits after the −inf fill, before reading anything (per-page early
// exit). Every e4m3 value of q and of the keys goes into shared memory as fp64, and fp64
// tensor-core MMAs accumulate Σ q_i·k_i per 128-value tile, which is exact (engine::Fp8RowDot),
// so the tiling and the order of the i are free; then × s_q·s_k per tile, tiles ascending, one
// rounding to fp32 — Fp8RowDot's value. The head sum per key is the reference's (fp32, h
// ascending).
constexpr int kF8Keys = 64;
constexpr int kF8Threads = 256;
static_assert(kF8Keys == 64 && kF8Threads == 256, "8 warps: 4 × 16 heads by 2 × 32 keys");

struct F8Layout {
  int64_t dp, tiles, row_bytes;  // fp64 row stride, 128-value tiles, bytes of an FP8 row
  size_t q_off, k_off, d_off, qs_off, ks_off, w_off, slot_off, bytes;
};
__host__ __device__ inline F8Layout MakeF8Layout(int64_t heads, int64_t hd) {
  F8Layout L;
  // Rows 8 banks apart (dp ≡ 4 mod 16 doubles): a fragment load of 8 rows × 4 values is the
  // minimum two wavefronts.
  L.dp = (hd + 15) / 16 * 16 + 4;
  heads = (heads + 15) / 16 * 16;  // q rows up to a whole warp tile (the extra ones zero)
  L.tiles = (hd + kFp8TileValues - 1) / kFp8TileValues;
  L.row_bytes = hd + 4 * L.tiles;
  L.q_off = 0;                                            // fp64 [heads][dp]
  L.k_off = L.q_off + 8 * heads * L.dp;                   // fp64 [kF8Keys][dp]
  L.d_off = L.k_off + 8 * kF8Keys * L.dp;                 // fp32 [kF8Keys][heads + 1]
  L.qs_off = L.d_off + 4 * kF8Keys * (heads + 1);         // fp32 [heads][tiles]
  L.ks_off = L.qs_off + 4 * heads * L.tiles;              // fp32 [kF8Keys][tiles]
  L.w_off = L.ks_off + 4 * kF8Keys * L.tiles;             // fp32 [heads]
  L.slot_off = (L.w_off + 4 * heads + 7) / 8 * 8;         // int64 [kF8Keys]
  L.bytes = L.slot_off + 8 * kF8Keys;
  return L;
}

__device__ __forceinline__ float LoadF32(const uint8_t* p) { return *reinterpret_cast<const float*>(p); }

__global__ void __launch_bounds__(kF8Threads) IndexerFp8ScoreKernel(IndexerScoreParams p, int tiles_per_cta) {
  dev::GridDependencySync();
  extern __shared__ __align__(16) unsigned char f8smem[];
  const int b = blockIdx.y, tid = threadIdx.x;
  const int H = static_cast<int>(p.heads), hd = static_cast<int>(p.head_dim);
  const F8Layout L = MakeF8Layout(H, hd);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * tiles_per_cta * kF8Keys;  // the CTA's first key
  int64_t n = p.seq_lens[b];
  if (n < 0 || n > p.max_seq_len || n > p.page_table_stride * p.page_size) {
    if (blockIdx.x == 0 && tid == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrSeqLen);
    n = 0;
  }
  float* out = p.scores + b * p.scores_stride;
  const int64_t end = min(first + static_cast<int64_t>(tiles_per_cta) * kF8Keys, p.max_seq_len);
  if (first >= n) {  // every tile past the request's keys: only the −inf fill
    for (int64_t t = first + tid; t < end; t += kF8Threads) out[t] = -INFINITY;
    return;
  }
  double* qd = reinterpret_cast<double*>(f8smem + L.q_off);
  double* kd = reinterpret_cast<double*>(f8smem + L.k_off);
  float* ds = reinterpret_cast<float*>(f8smem + L.d_off);
  float* qs = reinterpret_cast<float*>(f8smem + L.qs_off);
  float* ks = reinterpret_cast<float*>(f8smem + L.ks_off);
  float* w_s = reinterpret_cast<float*>(f8smem + L.w_off);
  int64_t* slot_s = reinterpret_cast<int64_t*>(f8smem + L.slot_off);
  const int tiles = static_cast<int>(L.tiles);
  const int64_t rb = L.row_bytes, dp = L.dp;
  const int words = hd / 4;
  // rows × hd e4m3 values (row r at row_at(r), 4-byte aligned; null: zeros) into dst [rows][dp]
  // as fp64, and each row's scales: every thread issues a batch of 4-byte loads before it
  // converts any (a round trip per batch, not per value); two values per hardware conversion.
  auto stage = [&](auto row_at, int rows, double* dst, float* scales) {
    constexpr int kBatch = 8;
    for (int base = 0; base < rows * words; base += kF8Threads * kBatch) {
      uint32_t v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kF8Threads + tid;
        const uint8_t* r = i < rows * words ? row_at(i / words) : nullptr;
        v[u] = r != nullptr ? *reinterpret_cast<const uint32_t*>(r + 4 * (i % words)) : 0u;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kF8Threads + tid;
        if (i < rows * words) {
          const float2 lo = dev::Fp8x2ToF32(static_cast<uint16_t>(v[u]));
          const float2 hi = dev::Fp8x2ToF32(static_cast<uint16_t>(v[u] >> 16));
          double2* d = reinterpret_cast<double2*>(dst + (i / words) * dp + 4 * (i % words));
          d[0] = make_double2(lo.x, lo.y);
          d[1] = make_double2(hi.x, hi.y);
        }
      }
    }
    for (int i = tid; i < rows * tiles; i += kF8Threads) {
      const uint8_t* r = row_at(i / tiles);
      scales[i] = r != nullptr ? LoadF32(r + hd + 4 * (i % tiles)) : 0.0f;
    }
  };
  // The request's queries, once for all the CTA's tiles (rows past H up to the warp tiles: 0).
  const uint8_t* qrows = p.q_fp8 + static_cast<int64_t>(b) * H * rb;
  stage([&](int r) { return qrows + r * rb; }, H, qd, qs);
  const int q_end = (H + 15) / 16 * 16 * static_cast<int>(dp);
  for (int i = H * static_cast<int>(dp) + tid; i < q_end; i += kF8Threads) qd[i] = 0.0;
  for (int h = tid; h < H; h += kF8Threads) w_s[h] = p.weights[b * p.weights_stride + h];

  const int lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int wh = (warp & 3) * 16, wk = (warp >> 2) * 32;  // the warp's first head (in a pass) and key
  const int Hp = (H + 15) / 16 * 16;
  for (int64_t t0 = first; t0 < end; t0 += kF8Keys) {
    if (t0 >= n) {  // past the request's last page: the rest is −inf (per-page early exit)
      for (int64_t t = t0 + tid; t < end; t += kF8Threads) out[t] = -INFINITY;
      return;
    }
    if (tid < kF8Keys) slot_s[tid] = t0 + tid < n ? PagedSlot(p, b, t0 + tid) : -1;
    __syncthreads();  // slot_s (and, on the first tile, q and w)
    stage([&](int r) { return slot_s[r] >= 0 ? p.keys_fp8 + slot_s[r] * rb : static_cast<const uint8_t*>(nullptr); },
          kF8Keys, kd, ks);
    __syncthreads();

    // d[t, h] with fp64 tensor-core MMAs (m8n8k4): a warp owns 16 heads × 32 keys (2 × 4 tiles
    // of 8 × 8); passes of 64 heads. Lane l holds A[l/4][l%4] = q[h][i], B[l%4][l/4] = k[t][i]
    // and C[l/4][2(l%4) + c]. Exact sums, so the MMA's internal order does not matter.
    for (int h0 = 0; h0 < Hp; h0 += 64) {
      if (h0 + wh >= Hp) break;  // no rows of this warp's tile in this pass (a whole-warp condition)
      double total[2][4][2], acc[2][4][2];
#pragma unroll
      for (int a = 0; a < 2; ++a) {
#pragma unroll
        for (int c = 0; c < 4; ++c) total[a][c][0] = total[a][c][1] = 0.0;
      }
      for (int tl = 0; tl < tiles; ++tl) {
#pragma unroll
        for (int a = 0; a < 2; ++a) {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[a][c][0] = acc[a][c][1] = 0.0;
        }
        const int lo = tl * static_cast<int>(kFp8TileValues);
        const int hi = min(lo + static_cast<int>(kFp8TileValues), hd);
#pragma unroll 4
        for (int i = lo; i < hi; i += 4) {  // hd % 4 = 0
          double av[2], bv[4];
#pragma unroll
          for (int a = 0; a < 2; ++a) av[a] = qd[(h0 + wh + 8 * a + gid) * dp + i + tig];
#pragma unroll
          for (int c = 0; c < 4; ++c) bv[c] = kd[(wk + 8 * c + gid) * dp + i + tig];
#pragma unroll
          for (int a = 0; a < 2; ++a) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
                           : "+d"(acc[a][c][0]), "+d"(acc[a][c][1])
                           : "d"(av[a]), "d"(bv[c]));
            }
          }
        }
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          const double sq = qs[min(h0 + wh + 8 * a + gid, H - 1) * tiles + tl];
#pragma unroll
          for (int c = 0; c < 4; ++c) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const double sk = ks[(wk + 8 * c + 2 * tig + e) * tiles + tl];
              total[a][c][e] = __dadd_rn(total[a][c][e], __dmul_rn(acc[a][c][e], __dmul_rn(sq, sk)));
            }
          }
        }
      }
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        const int h = h0 + wh + 8 * a + gid;
        if (h >= H) continue;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
          for (int e = 0; e < 2; ++e) ds[(wk + 8 * c + 2 * tig + e) * (H + 1) + h] = __double2float_rn(total[a][c][e]);
        }
      }
    }
    __syncthreads();
    // s = Σ_h w_h · ReLU(d · key_scale), h ascending: the reference's loop.
    if (tid < kF8Keys) {
      const int64_t t = t0 + tid;
      if (t < p.max_seq_len) {
        if (t >= n || slot_s[tid] < 0) {
          out[t] = t >= n ? -INFINITY : __uint_as_float(0x7fc00000u);
        } else {
          float s = 0.0f;
          for (int h = 0; h < H; ++h) {
            const float x = __fmul_rn(ds[tid * (H + 1) + h], p.key_scale);
            s = __fadd_rn(s, __fmul_rn(w_s[h], x < 0.0f ? 0.0f : x));
          }
          out[t] = s;
        }
      }
    }
    __syncthreads();  // kd, ds and slot_s are the next tile's
  }
}

}  // namespace

Status IndexerScores(const IndexerScoreParams& p, Stream stream) {
  constexpr const char* op = "IndexerScores";
  LS_CHECK_ARG(p.batch >= 0 && p.batch <= 65535, op, "batch", p.batch);
  LS_CHECK_ARG(p.heads > 0, op, "heads", p.heads);
  LS_CHECK_ARG(p.head_dim > 0 && p.head_dim <= 256, op, "head_dim", p.head_dim);
  const bool fp8 = p.keys_fp8 != nullptr;
  if (fp8) {
    LS_CHECK_ARG(MakeF8Layout(p.heads, p.head_dim).bytes <= kMaxScoreSmem, op,
                 "heads (heads·head_dim too large for shared memory)", p.heads);
    LS_CHECK_ARG(p.q_fp8 != nullptr, op, "q_fp8 (needed with keys_fp8)", p.q_fp8);
    LS_CHECK_ARG(p.head_dim % 4 == 0, op, "head_dim (FP8 rows need a multiple of 4)", p.head_dim);
  } else {
    LS_CHECK_ARG(ScoreSmem(p.heads, p.head_dim) <= kMaxScoreSmem, op,
                 "heads (heads·head_dim too large for shared memory)", p.heads);
    LS_CHECK_ARG(p.q != nullptr, op, "q", p.q);
    LS_CHECK_ARG(p.q_head_stride >= p.head_dim, op, "q_head_stride", p.q_head_stride);
    LS_CHECK_ARG(p.q_batch_stride >= (p.heads - 1) * p.q_head_stride + p.head_dim, op, "q_batch_stride",
                 p.q_batch_stride);
    LS_CHECK_ARG(p.keys != nullptr, op, "keys", p.keys);
  }
  LS_CHECK_ARG(p.weights != nullptr, op, "weights", p.weights);
  LS_CHECK_ARG(p.weights_stride >= p.heads, op, "weights_stride", p.weights_stride);
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
  if (fp8) {
    const size_t smem = MakeF8Layout(p.heads, p.head_dim).bytes;
    LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(IndexerFp8ScoreKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)));
    // A CTA stages a request's queries once for several 64-key tiles, as many as keep about two
    // CTAs per SM busy. Speed only: every score is computed the same way.
    const int64_t key_tiles = (p.max_seq_len + kF8Keys - 1) / kF8Keys;
    const int per_cta = static_cast<int>(std::clamp<int64_t>(key_tiles * p.batch / (2 * SmCount()), 1, 8));
    const dim3 grid(static_cast<unsigned>((key_tiles + per_cta - 1) / per_cta), static_cast<unsigned>(p.batch));
    LS_CUDA_RETURN_IF_ERROR(LaunchKernel(IndexerFp8ScoreKernel, grid, kF8Threads, smem, stream, p, per_cta));
    LS_CUDA_LAUNCH_CHECK();
    return Status::Ok();
  }
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
