// kernels/cuda/mla_decode.cu — MLA absorbed decode over the paged latent cache, dense and
// sparse (top-k slots), fp32 accumulation, one fixed reduction order (ops.h).
//
// Work decomposition (all of it a function of a request's own key count n):
//   splits   n keys cut into ceil(n / MlaSplitKeys(n)) splits (≤ 64), ascending;
//   split CTA  (split, 16-head group, request): q for its 16 heads in shared memory, keys in
//            tiles of 32 dequantised into shared memory, online softmax per head over the
//            tiles in ascending order; writes its unnormalised o, running max m, and sum l
//            (8-head groups, or one head a CTA — MlaSplitHeadKernel — when the grid would
//            leave SMs idle; the same arithmetic, the same bits);
//   combine  one CTA per (request, head) merges the splits in ascending order:
//            M = max m_s, f_s = exp(m_s − M), L = Σ l_s f_s, o = (Σ o_s f_s) / L,
//            lse = M + log L (mla_combine.cuh; MlaDecodeSplits leaves the merge to the
//            reader: the W_UV absorption, ExpertGemmParams::x_partials, the same code).
// Thread roles inside a split CTA (256 threads = 8 warps):
//   scores   warp w owns heads w and w + 8 of the group, lane = key of the tile; each score
//            is cpu::Dot over the latent plus cpu::Dot over the rope part, then × scale —
//            bitwise the CPU's score; the tile max and Σp are warp butterflies;
//   P·V      thread owns heads 4·(tid/64)…+3 and latent columns c ≡ tid (mod 64) (8 of
//            them for kv_lora 512); o[h][c] = fma(p[h][t], c_t[c], o[h][c]) for t ascending.
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla_combine.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeadsPerCta = 16;  // the score phase takes kHpc / 8 heads per warp (kHpc = 16 or 8)
constexpr int kTileKeys = dev::kMlaTileKeys;  // = warp width: lane ↔ key in the score phase
constexpr int kMaxLora = 512;
constexpr int kMaxRope = 64;
constexpr int kColGroups = 64;                                       // P·V column groups
constexpr int kColsPerThread = kMaxLora / kColGroups;                // 8
constexpr int kMaxSplits = dev::kMlaMaxSplits;
constexpr int kBaseSplitKeys = dev::kMlaBaseSplitKeys;
constexpr int kCombineThreads = 128;
constexpr int kQPerThread = (kMaxLora + kMaxRope + kThreads - 1) / kThreads;  // q values a thread loads
// The one-head kernel's key rows: 16-byte aligned (float4 dequantisation) and 8 floats past a
// multiple of 32, so the float2 score reads of a half-warp's two keys (tile keys j and j + 2:
// HeadScoreKey) hit 32 banks. (16 past would do it for keys j, j + 1, but its 2 KB more cost
// the bf16 CTA its second slot on an SM.)
__host__ __device__ inline int HeadKeyStride(int64_t d) { return static_cast<int>((d + 31) / 32 * 32 + 8); }
// The tile key whose score thread `tid` helps with (8 threads a key): warp w takes keys 4w … 4w + 3,
// its lanes 0–7, 8–15, 16–23, 24–31 keys 4w, 4w + 2, 4w + 1, 4w + 3.
__device__ __forceinline__ int HeadScoreKey(int tid) {
  const int q = (tid >> 3) & 3;
  return (tid >> 5) * 4 + (((q & 1) << 1) | (q >> 1));
}
static_assert(kBaseSplitKeys % kTileKeys == 0);

__host__ __device__ inline int64_t SplitKeys(int64_t n) { return dev::MlaSplitKeysOf(n); }
inline int64_t SplitsToAllocate(int64_t max_keys) { return dev::MlaSplitsFor(max_keys); }

inline size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

struct Workspace {
  float* o_part;  // [batch, heads, splits, kv_lora]
  float* m_part;  // [batch, heads, splits]
  float* l_part;  // [batch, heads, splits]
  int64_t splits;
};

struct WorkspaceLayout {
  size_t o_bytes, ml_bytes, total;
};
WorkspaceLayout Layout(const MlaDecodeParams& p, int64_t splits) {
  WorkspaceLayout w;
  const size_t bhs = static_cast<size_t>(p.batch) * p.heads * splits;
  w.o_bytes = Align256(bhs * p.kv_lora * sizeof(float));
  w.ml_bytes = Align256(bhs * sizeof(float));
  w.total = w.o_bytes + 2 * w.ml_bytes;
  return w;
}

template <bool kSparse>
__device__ __forceinline__ int64_t KeyCount(const MlaDecodeParams& p, int b, bool report) {
  if constexpr (kSparse) {
    return p.topk;
  } else {
    const int64_t n = p.seq_lens[b];
    if (n < 0 || n > p.max_seq_len || n > p.page_table_stride * p.page_size) {  // (MlaPartialsKeys' rule)
      if (report && p.error_flag != nullptr) atomicOr(p.error_flag, kErrSeqLen);
      return 0;
    }
    return n;
  }
}

// What locates key `key` of request b: its page-table entry (dense) or its top-k index
// (sparse), read raw — −1 past the table's row (max_seq_len) or the top-k — so a CTA can read
// it before it knows its key count.
template <bool kSparse>
__device__ __forceinline__ int32_t KeyEntry(const MlaDecodeParams& p, int b, int64_t key) {
  if constexpr (kSparse) {
    return key < p.topk ? p.indices[b * p.indices_stride + key] : -1;
  } else {
    return key < p.max_seq_len ? p.page_table[b * p.page_table_stride + key / p.page_size] : -1;
  }
}
// Global slot of key `key` from its entry, or −1 when masked or invalid (invalid is flagged).
template <bool kSparse>
__device__ __forceinline__ int64_t SlotFromEntry(const MlaDecodeParams& p, int64_t key, int32_t entry) {
  if constexpr (kSparse) {
    if (entry == -1) return -1;
    if (entry < -1 || entry >= p.num_pages * p.page_size) {
      if (p.error_flag != nullptr) atomicOr(p.error_flag, kErrSlot);
      return -1;
    }
    return entry;
  } else {
    if (entry < 0 || entry >= p.num_pages) {
      if (p.error_flag != nullptr) atomicOr(p.error_flag, kErrPageId);
      return -1;
    }
    return static_cast<int64_t>(entry) * p.page_size + key % p.page_size;
  }
}
// Global slot of key `key` (< the request's key count) of request b, or −1 when masked or
// invalid (invalid is flagged).
template <bool kSparse>
__device__ __forceinline__ int64_t KeySlot(const MlaDecodeParams& p, int b, int64_t key) {
  return SlotFromEntry<kSparse>(p, key, KeyEntry<kSparse>(p, b, key));
}

// One token's bytes → fp32 [kv_lora + rope_dim] in shared memory, by the 32 lanes of a warp.
// The dequantisation is engine::PagedKvCache::ReadLatent's (fp8 value × tile scale in fp32).
__device__ __forceinline__ void DequantRow(LatentFormat format, const uint8_t* src, int C, int R, float* dst,
                                           int lane) {
  switch (format) {
    case LatentFormat::kFp32: {
      const float* f = reinterpret_cast<const float*>(src);
      for (int j = lane; j < C + R; j += 32) dst[j] = f[j];
      break;
    }
    case LatentFormat::kBf16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
      for (int j = lane; j < C + R; j += 32) dst[j] = dev::Bf16ToF32(h[j]);
      break;
    }
    case LatentFormat::kFp8E4m3: {
      const uint8_t* scales = src + C;
      const bool aligned = (reinterpret_cast<uintptr_t>(scales) & 3u) == 0;
      for (int j = lane; j < C; j += 32) {
        const uint8_t* sp = scales + 4 * (j / kFp8TileValues);
        float s;
        if (aligned) {
          s = *reinterpret_cast<const float*>(sp);
        } else {
          s = __uint_as_float(static_cast<uint32_t>(sp[0]) | (static_cast<uint32_t>(sp[1]) << 8) |
                              (static_cast<uint32_t>(sp[2]) << 16) | (static_cast<uint32_t>(sp[3]) << 24));
        }
        dst[j] = __fmul_rn(dev::Fp8E4m3ToF32(src[j]), s);
      }
      const uint8_t* rope = scales + 4 * ((C + kFp8TileValues - 1) / kFp8TileValues);
      for (int j = lane; j < R; j += 32) {
        const uint16_t h = static_cast<uint16_t>(rope[2 * j] | (rope[2 * j + 1] << 8));
        dst[C + j] = dev::Bf16ToF32(h);
      }
      break;
    }
  }
}

// Whether DequantRow16 can take a token's bytes: every piece (bf16 row; fp8 values, scales and
// the bf16 rope part) in whole 16- or 8-byte chunks at 16-byte offsets. DeepSeek's 512 + 64
// (bf16 1152 and fp8 656 bytes) qualify.
__device__ __forceinline__ bool Dequant16Ok(LatentFormat format, int C, int R) {
  if (C % 16 != 0 || R % 8 != 0) return false;
  if (format == LatentFormat::kBf16) return true;
  const int rope_at = C + 4 * ((C + static_cast<int>(kFp8TileValues) - 1) / static_cast<int>(kFp8TileValues));
  return format == LatentFormat::kFp8E4m3 && rope_at % 16 == 0;
}
// DequantRow from a 16-byte aligned `src` into a 16-byte aligned `dst`, 8 values a lane at a
// time (16- or 8-byte loads, two float4 stores); the same values (Dequant16Ok must hold).
__device__ __forceinline__ void DequantRow16(LatentFormat format, const uint8_t* src, int C, int R, float* dst,
                                             int lane) {
  float4* d4 = reinterpret_cast<float4*>(dst);
  auto bf16x8 = [&](const uint4 v, int at) {  // 8 bf16 (low half first) → dst[at … at + 7]
    d4[at / 4] = make_float4(dev::Bf16ToF32(v.x & 0xffffu), dev::Bf16ToF32(v.x >> 16), dev::Bf16ToF32(v.y & 0xffffu),
                             dev::Bf16ToF32(v.y >> 16));
    d4[at / 4 + 1] = make_float4(dev::Bf16ToF32(v.z & 0xffffu), dev::Bf16ToF32(v.z >> 16),
                                 dev::Bf16ToF32(v.w & 0xffffu), dev::Bf16ToF32(v.w >> 16));
  };
  if (format == LatentFormat::kBf16) {
    const uint4* s16 = reinterpret_cast<const uint4*>(src);
    for (int c = lane; c < (C + R) / 8; c += 32) bf16x8(s16[c], 8 * c);
    return;
  }
  const uint2* v8 = reinterpret_cast<const uint2*>(src);
  const float* scales = reinterpret_cast<const float*>(src + C);
  for (int c = lane; c < C / 8; c += 32) {
    const uint2 v = v8[c];
    const float sc = scales[8 * c / static_cast<int>(kFp8TileValues)];
    // Two e4m3 values a conversion instruction (Fp8x2ToF32: Fp8E4m3ToF32's values, NaN as a
    // NaN), then the scale: the product is Fp8E4m3ToF32's path's bits, NaN included (a product
    // with a NaN factor is the canonical NaN either way).
    auto f2 = [&](uint32_t word, int half) {
      const float2 v2 = dev::Fp8x2ToF32(static_cast<uint16_t>(word >> (16 * half)));
      return make_float2(__fmul_rn(v2.x, sc), __fmul_rn(v2.y, sc));
    };
    const float2 a = f2(v.x, 0), b = f2(v.x, 1), cc = f2(v.y, 0), d = f2(v.y, 1);
    d4[2 * c] = make_float4(a.x, a.y, b.x, b.y);
    d4[2 * c + 1] = make_float4(cc.x, cc.y, d.x, d.y);
  }
  const uint4* rope = reinterpret_cast<const uint4*>(
      src + C + 4 * ((C + static_cast<int>(kFp8TileValues) - 1) / static_cast<int>(kFp8TileValues)));
  for (int c = lane; c < R / 8; c += 32) bf16x8(rope[c], C + 8 * c);
}

// Keys t0 … t0 + 31 of request b (those before key_end) dequantised into k_s rows (stride
// k_stride), warp w taking rows w, w + 8, …; a masked or invalid key is a row of zeros (p = 0
// must meet finite values) and valid_s[row] = 0. Each row read straight from global memory:
// the path for tokens whose bytes are not whole 16-byte chunks (the test models' odd sizes)
// and for fp32 caches (KeyTiles below).
template <bool kSparse>
__device__ __forceinline__ void StageKeyTile(const MlaDecodeParams& p, int b, int64_t t0, int64_t key_end,
                                             int64_t bytes_per_token, float* k_s, int k_stride, int* valid_s,
                                             int warp, int lane) {
  const int C = static_cast<int>(p.kv_lora), R = static_cast<int>(p.rope_dim);
  for (int row = warp; row < kTileKeys; row += kWarps) {
    const int64_t key = t0 + row;
    const int64_t slot = key < key_end ? KeySlot<kSparse>(p, b, key) : -1;
    float* krow = k_s + row * k_stride;
    if (slot < 0) {
      for (int j = lane; j < C + R; j += 32) krow[j] = 0.0f;
    } else {
      DequantRow(p.format, p.cache + slot * bytes_per_token, C, R, krow, lane);
    }
    if (lane == 0) valid_s[row] = slot >= 0;
  }
}

// Whether a split CTA of `hpc` heads stages its key tiles' bytes (KeyTiles). It can for tokens
// of whole 16-byte chunks (fp8 656 and bf16 1152 bytes at DeepSeek's 512 + 64) in a bf16 or fp8
// cache; by default it does with one head a CTA only. With 8 or 16 heads the tile's bytes cost
// the CTA its second slot on an SM, and row-by-row reads of one CTA overlap the other's
// arithmetic: staged was slower there (H200, 2026-11-30, 128 heads: bf16 1 × 4k 0.105 → 0.137
// ms, fp8 8 × 4k 1.11 → 1.34 ms), while one head a CTA gained (16 heads × 256 keys: fp8 28 → 17
// µs, bf16 14 → 13 µs). An fp32 tile (72 KB) is always read row by row.
inline bool StagesKeys(const MlaDecodeParams& p, int64_t bytes_per_token, int hpc) {
  const bool can = bytes_per_token % 16 == 0 && p.format != LatentFormat::kFp32;
  return can && (p.key_staging == 2 || (p.key_staging == 0 && hpc == 1));
}
// Shared memory KeyTiles takes (at the start of a split CTA's, 16-byte aligned): two tiles'
// slots and one tile's bytes.
__host__ __device__ inline size_t KeyTilesSmem(bool staged, int64_t bytes_per_token) {
  return staged ? 2 * kTileKeys * sizeof(int64_t) + kTileKeys * static_cast<size_t>(bytes_per_token) : 0;
}

// How a split CTA brings in its key tiles. Staged (StagesKeys): tile i + 1's slot lookups and
// then its bytes (16-byte cp.async into `raw`, every chunk of the tile in flight at once) are
// requested as soon as tile i is dequantised into k_s, so they land while tile i's scores and
// P·V run; at batch 1 (one tile a split) the CTA makes two round trips to memory, slots then
// bytes, where reading each row's values one 32-lane load at a time made ~75 (H200, 2026-11-30:
// V2-Lite's 16 heads × 256 keys, bf16, 14.6 µs a layer). The dequantisation is DequantRow's,
// from shared memory instead of global: the same values (DequantRow16 into 16-byte rows, 8
// values a lane). Otherwise StageKeyTile, per tile.
//   KeyTiles::At(...)    the loader at the start of the CTA's shared memory; Floats() after it
//   Begin(key_begin)     before the loop (after q's loads are issued)
//   BeginFrom(t0, e)     the same with the first tile's KeyEntry already read (the one-head
//                        kernel reads it with q and the key count: one round trip, not two)
//   Load(it, t0, …)      at the top of tile `it`: its keys in k_s, the next tile's requested
template <bool kSparse>
struct KeyTiles {
  const MlaDecodeParams& p;
  int b;
  int64_t key_end, bpt;
  bool staged;
  int64_t* slots;      // [2][32] (staged)
  unsigned char* raw;  // [32][bpt] (staged)
  int tid;

  // The loader over the first KeyTilesSmem(staged, bpt) bytes of `smem` (16-byte aligned).
  __device__ static KeyTiles At(const MlaDecodeParams& p, int b, int64_t key_end, int64_t bpt, bool staged,
                                void* smem, int tid) {
    unsigned char* base = static_cast<unsigned char*>(smem);
    return KeyTiles{p, b, key_end, bpt, staged, reinterpret_cast<int64_t*>(base),
                    base + 2 * kTileKeys * sizeof(int64_t), tid};
  }
  // The CTA's shared memory after the loader's.
  __device__ float* Floats() const {
    return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(slots) + KeyTilesSmem(staged, bpt));
  }
  __device__ int64_t SlotOf(int64_t key) const { return key < key_end ? KeySlot<kSparse>(p, b, key) : -1; }
  // Tile `t0`'s byte requests (the tile's slots must be visible to every thread).
  __device__ void Request(const int64_t* s) const {
    const int n16 = static_cast<int>(bpt / 16);
    for (int c = tid; c < kTileKeys * n16; c += kThreads) {
      const int r = c / n16, q = c - r * n16;
      const int64_t slot = s[r];
      if (slot >= 0) dev::CpAsync16(raw + r * bpt + 16 * q, p.cache + slot * bpt + 16 * q);
    }
    dev::CpAsyncCommit();
  }
  __device__ const int64_t* Tile(int it) const { return slots + kTileKeys * (it & 1); }
  // Before the loop: the first tile's slots, a barrier, its bytes requested.
  __device__ void Begin(int64_t t0) const {
    if (!staged) return;
    if (tid < kTileKeys) slots[tid] = SlotOf(t0 + tid);
    __syncthreads();
    Request(slots);
  }
  // Begin with the first tile's entries already read (KeyEntry of key t0 + tid, tid < 32).
  __device__ void BeginFrom(int64_t t0, int32_t entry) const {
    if (tid < kTileKeys) slots[tid] = t0 + tid < key_end ? SlotFromEntry<kSparse>(p, t0 + tid, entry) : -1;
    __syncthreads();
    Request(slots);
  }
  // Top of tile `it` (keys t0…), before the loop's first barrier: the next tile's slots; this
  // tile's bytes are this thread's only outstanding copies.
  __device__ void Next(int it, int64_t t0) const {
    if (!staged) return;
    if (tid < kTileKeys && t0 + kTileKeys < key_end) {
      slots[kTileKeys * ((it + 1) & 1) + tid] = SlotOf(t0 + kTileKeys + tid);
    }
    dev::CpAsyncWait<0>();
  }
  // After that barrier: tile `it` into k_s (valid_s per row), as StageKeyTile would.
  __device__ void Dequant(int it, int64_t t0, float* k_s, int k_stride, int* valid_s, int warp, int lane) const {
    if (!staged) {
      StageKeyTile<kSparse>(p, b, t0, key_end, bpt, k_s, k_stride, valid_s, warp, lane);
      return;
    }
    const int C = static_cast<int>(p.kv_lora), R = static_cast<int>(p.rope_dim);
    const int64_t* s = Tile(it);
    // 16-byte rows (the one-head kernel's stride) take the vector loop.
    const bool vec = k_stride % 4 == 0 && Dequant16Ok(p.format, C, R);
    for (int row = warp; row < kTileKeys; row += kWarps) {
      float* krow = k_s + row * k_stride;
      if (s[row] < 0) {
        for (int j = lane; j < C + R; j += 32) krow[j] = 0.0f;
      } else if (vec) {
        DequantRow16(p.format, raw + row * bpt, C, R, krow, lane);
      } else {
        DequantRow(p.format, raw + row * bpt, C, R, krow, lane);
      }
      if (lane == 0) valid_s[row] = s[row] >= 0;
    }
  }
  // After the barrier that follows Dequant (raw is free): the next tile's bytes.
  __device__ void Prefetch(int it, int64_t t0) const {
    if (staged && t0 + kTileKeys < key_end) Request(Tile(it + 1));
  }
  // Tile `it` (keys t0…) into k_s and valid_s, between two CTA barriers (the first also orders
  // the last tile's readers of k_s before this write), and the next tile requested.
  __device__ void Load(int it, int64_t t0, float* k_s, int k_stride, int* valid_s, int warp, int lane) const {
    Next(it, t0);
    __syncthreads();
    Dequant(it, t0, k_s, k_stride, valid_s, warp, lane);
    __syncthreads();
    Prefetch(it, t0);
  }
};

// kHpc heads per CTA: 16 (two per warp) normally; 8 (one per warp: half the per-warp work, twice
// the CTAs reading each key) when the grid would be too small to fill the GPU (batch-1 decode).
// The sparse kernels are held to two CTAs an SM (≤ 128 registers: 16 heads took 168 once the
// FP8 dequantisation converted pairs, and ran 1.5× slower at one CTA an SM; H200, 2026-12-01);
// the dense ones keep the compiler's choice (min blocks 0: unspecified; 1 would let the 8-head
// kernel grow from 79 registers to 154).
template <bool kSparse, int kHpc>
__global__ void __launch_bounds__(kThreads, kSparse ? 2 : 0)
    MlaSplitKernel(MlaDecodeParams p, int64_t bytes_per_token, bool staged, Workspace ws) {
  dev::GridDependencySync();
  constexpr int kHeadsPerCta = kHpc;
  constexpr int kHeadsPerWarp = kHpc / kWarps;
  constexpr int kPvHeads = kHpc / (kThreads / kColGroups);  // heads per thread in P·V
  static_assert(kHpc == kHeadsPerWarp * kWarps && kHeadsPerWarp >= 1 && kPvHeads >= 1);
  extern __shared__ __align__(16) float smem[];
  const int b = blockIdx.z, group = blockIdx.y, split = blockIdx.x;
  const int C = static_cast<int>(p.kv_lora), R = static_cast<int>(p.rope_dim), D = C + R;
  const int H = static_cast<int>(p.heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int head0 = group * kHeadsPerCta;

  const int64_t n_keys = KeyCount<kSparse>(p, b, group == 0 && split == 0 && tid == 0);
  const int64_t split_keys = SplitKeys(n_keys);
  const int64_t key_begin = split * split_keys;
  if (key_begin >= n_keys) return;
  const int64_t key_end = min(n_keys, key_begin + split_keys);

  const auto tiles = KeyTiles<kSparse>::At(p, b, key_end, bytes_per_token, staged, smem, tid);
  float* q_s = tiles.Floats();                         // [16][D]
  float* k_s = q_s + kHeadsPerCta * D;                 // [32][D + 1] (+1: lane ↔ key reads hit 32 banks)
  float* p_s = k_s + kTileKeys * (D + 1);              // [16][32]
  float* alpha_s = p_s + kHeadsPerCta * kTileKeys;     // [16]
  int* valid_s = reinterpret_cast<int*>(alpha_s + kHeadsPerCta);  // [32]
  const int k_stride = D + 1;

  // q for the 16 heads: 12 loads per thread in flight before their stores (latency, not
  // bandwidth, sets the cost of these 36 KB).
  constexpr int kQBatch = 12;
  for (int base = 0; base < kHeadsPerCta * D; base += kThreads * kQBatch) {
    float v[kQBatch];
#pragma unroll
    for (int u = 0; u < kQBatch; ++u) {
      const int idx = base + u * kThreads + tid;
      const int h = idx / D, j = idx - h * D, head = head0 + h;
      v[u] = 0.0f;
      if (idx < kHeadsPerCta * D && head < H) {
        v[u] = j < C ? p.q_latent[b * p.q_latent_batch_stride + head * p.q_latent_head_stride + j]
                     : p.q_rope[b * p.q_rope_batch_stride + head * p.q_rope_head_stride + (j - C)];
      }
    }
#pragma unroll
    for (int u = 0; u < kQBatch; ++u) {
      const int idx = base + u * kThreads + tid;
      if (idx < kHeadsPerCta * D) q_s[idx] = v[u];
    }
  }

  // Score role: heads sh[i] = warp + i·8; state replicated across the warp's lanes.
  int sh[kHeadsPerWarp];
  float m_run[kHeadsPerWarp], l_run[kHeadsPerWarp];
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    sh[i] = warp + i * kWarps;
    m_run[i] = -INFINITY;
    l_run[i] = 0.0f;
  }
  // P·V role.
  const int cg = tid % kColGroups, hq = (tid / kColGroups) * kPvHeads;
  float o[kPvHeads][kColsPerThread];
#pragma unroll
  for (int hh = 0; hh < kPvHeads; ++hh) {
#pragma unroll
    for (int m = 0; m < kColsPerThread; ++m) o[hh][m] = 0.0f;
  }

  tiles.Begin(key_begin);
  int it = 0;
  for (int64_t t0 = key_begin; t0 < key_end; t0 += kTileKeys, ++it) {
    // (Its first barrier: q_s written, first tile / the last tile's P·V done with k_s, p_s.)
    tiles.Load(it, t0, k_s, k_stride, valid_s, warp, lane);

    // Scores and the online softmax update, per head of this warp.
    const float* krow = k_s + lane * k_stride;
    const float* ql[kHeadsPerWarp];
    const float* qr[kHeadsPerWarp];
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; ++i) {
      ql[i] = q_s + sh[i] * D;
      qr[i] = ql[i] + C;
    }
    float dot_l[kHeadsPerWarp], dot_r[kHeadsPerWarp];
    if (C % 4 == 0 && R % 4 == 0) {  // q rows 16-byte aligned: broadcast float4 reads of q
      dev::Dot16A4<kHeadsPerWarp>(ql, krow, C, dot_l);
      dev::Dot16A4<kHeadsPerWarp>(qr, krow + C, R, dot_r);
    } else {
      dev::Dot16<kHeadsPerWarp>(ql, krow, C, dot_l);
      dev::Dot16<kHeadsPerWarp>(qr, krow + C, R, dot_r);
    }
    const bool valid = valid_s[lane] != 0;
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; ++i) {
      // (Dot(q_lat, c) + Dot(q_rope, k_rope)) · scale — engine/model.cc's expression.
      const float s = valid ? __fmul_rn(__fadd_rn(dot_l[i], dot_r[i]), p.softmax_scale) : -INFINITY;
      const float m_new = fmaxf(m_run[i], dev::WarpMax(s));
      const float pr = s == -INFINITY ? 0.0f : dev::ExpF(__fsub_rn(s, m_new));
      const float alpha = m_run[i] == -INFINITY ? 0.0f : dev::ExpF(__fsub_rn(m_run[i], m_new));
      l_run[i] = __fadd_rn(__fmul_rn(l_run[i], alpha), dev::WarpSum(pr));
      m_run[i] = m_new;
      p_s[sh[i] * kTileKeys + lane] = pr;
      if (lane == 0) alpha_s[sh[i]] = alpha;
    }
    __syncthreads();

    // o = o · alpha + Σ_t p_t · c_t, t ascending.
#pragma unroll
    for (int hh = 0; hh < kPvHeads; ++hh) {
      const float a = alpha_s[hq + hh];
#pragma unroll
      for (int m = 0; m < kColsPerThread; ++m) o[hh][m] = __fmul_rn(o[hh][m], a);
    }
    for (int t = 0; t < kTileKeys; ++t) {
      float kv[kColsPerThread];
#pragma unroll
      for (int m = 0; m < kColsPerThread; ++m) {
        const int c = cg + m * kColGroups;
        kv[m] = c < C ? k_s[t * k_stride + c] : 0.0f;
      }
#pragma unroll
      for (int hh = 0; hh < kPvHeads; ++hh) {
        const float pv = p_s[(hq + hh) * kTileKeys + t];
#pragma unroll
        for (int m = 0; m < kColsPerThread; ++m) o[hh][m] = __fmaf_rn(pv, kv[m], o[hh][m]);
      }
    }
  }

  // Partials of this split.
#pragma unroll
  for (int hh = 0; hh < kPvHeads; ++hh) {
    const int head = head0 + hq + hh;
    if (head >= H) continue;
    float* dst = ws.o_part + ((static_cast<int64_t>(b) * H + head) * ws.splits + split) * C;
#pragma unroll
    for (int m = 0; m < kColsPerThread; ++m) {
      const int c = cg + m * kColGroups;
      if (c < C) dst[c] = o[hh][m];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; ++i) {
      const int head = head0 + sh[i];
      if (head >= H) continue;
      const int64_t at = (static_cast<int64_t>(b) * H + head) * ws.splits + split;
      ws.m_part[at] = m_run[i];
      ws.l_part[at] = l_run[i];
    }
  }
}

// One head a CTA (batch-1 decode: a split has 32 keys, and 16 heads a CTA would leave nearly
// every SM idle while each lane walked 576 values serially). The same bits as MlaSplitKernel:
// the dequantised keys, each score's cpu::Dot chains (a key's 16 chains held by 8 threads, two
// each — chains g and g + 8, whose sum is Fold16's first step — then Fold16's other steps
// across those threads), and the online softmax done by one warp with a lane per key exactly
// as there (WarpMax, WarpSum); P·V per column in ascending key order.
template <bool kSparse>
__global__ void __launch_bounds__(kThreads) MlaSplitHeadKernel(MlaDecodeParams p, int64_t bytes_per_token,
                                                               bool staged, Workspace ws) {
  dev::GridDependencySync();
  extern __shared__ __align__(16) float smem[];
  const int b = blockIdx.z, head = blockIdx.y, split = blockIdx.x;
  const int C = static_cast<int>(p.kv_lora), R = static_cast<int>(p.rope_dim), D = C + R;
  const int H = static_cast<int>(p.heads);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // The CTA's first reads go out together, one round trip instead of three in series: q's row
  // (into registers), the key count and — when a split's keys do not depend on that count (up
  // to 2048 keys, 32 a split; sparse: the top-k) — the page-table entries or indices of the
  // split's keys.
  const bool ahead = staged && (kSparse ? p.topk : p.max_seq_len) <= int64_t{kBaseSplitKeys} * kMaxSplits;
  int32_t entry = -1;
  if (ahead && tid < kTileKeys) entry = KeyEntry<kSparse>(p, b, int64_t{split} * kBaseSplitKeys + tid);
  float qv[kQPerThread];
#pragma unroll
  for (int u = 0; u < kQPerThread; ++u) {
    const int j = tid + u * kThreads;
    qv[u] = j >= D   ? 0.0f
            : j < C ? p.q_latent[b * p.q_latent_batch_stride + head * p.q_latent_head_stride + j]
                    : p.q_rope[b * p.q_rope_batch_stride + head * p.q_rope_head_stride + (j - C)];
  }
  const int64_t n_keys = KeyCount<kSparse>(p, b, head == 0 && split == 0 && tid == 0);
  const int64_t split_keys = SplitKeys(n_keys);
  const int64_t key_begin = split * split_keys;
  if (key_begin >= n_keys) return;
  const int64_t key_end = min(n_keys, key_begin + split_keys);

  const auto tiles = KeyTiles<kSparse>::At(p, b, key_end, bytes_per_token, staged, smem, tid);
  const int k_stride = HeadKeyStride(D);
  float* q_s = tiles.Floats();                         // [D]
  float* k_s = q_s + D;                                // [32][k_stride]
  float* s_s = k_s + kTileKeys * k_stride;             // [32] scores
  float* p_s = s_s + kTileKeys;                        // [32]
  float* alpha_s = p_s + kTileKeys;                    // [1]
  int* valid_s = reinterpret_cast<int*>(alpha_s + 1);  // [32]
#pragma unroll
  for (int u = 0; u < kQPerThread; ++u) {
    if (tid + u * kThreads < D) q_s[tid + u * kThreads] = qv[u];
  }
  // Score role: key t_key of the tile, chains g and g + 8 (g = tid % 8), or 2g and 2g + 1 (pairs).
  const int t_key = HeadScoreKey(tid), g = tid % 8;
  // Softmax role (warp 0, lane = key): the running max and sum, replicated across its lanes.
  float m_run = -INFINITY, l_run = 0.0f;
  // P·V role: columns tid, tid + 256 (kv_lora ≤ 512).
  float o[2] = {0.0f, 0.0f};

  // Σ over i ≡ lane (mod 16) of a[i]·b[i], ascending: cpu::Dot's chain `lane`.
  auto chain = [](const float* a, const float* bb, int n, int l) {
    float acc = 0.0f;
    for (int i = l; i < n; i += 16) acc = __fmaf_rn(a[i], bb[i], acc);
    return acc;
  };
  // Fold16 of the chains held two a thread by 8 consecutive lanes (g: chains g and g + 8).
  auto fold = [](float lo, float hi) {
    float v = __fadd_rn(lo, hi);                               // l + (l + 8)
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 4));     // l + (l + 4), l < 4
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));     // l + (l + 2), l < 2
    return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));  // 0 + 1
  };

  // Part lengths in whole 16-value rounds: thread g holds chains 2g and 2g + 1 instead, read as
  // float2 (FoldPairs8 — the same sums in the same order).
  const bool pairs = C % 16 == 0 && R % 16 == 0;
  auto pair_chains = [](const float* a, const float* bb, int n, int g8) {
    const float2* a2 = reinterpret_cast<const float2*>(a) + g8;
    const float2* b2 = reinterpret_cast<const float2*>(bb) + g8;
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 8
    for (int m = 0; m < n / 16; ++m) {
      const float2 x = a2[8 * m], y = b2[8 * m];
      acc0 = __fmaf_rn(x.x, y.x, acc0);
      acc1 = __fmaf_rn(x.y, y.y, acc1);
    }
    return dev::FoldPairs8(acc0, acc1);
  };

  if (ahead) {
    tiles.BeginFrom(key_begin, entry);
  } else {
    tiles.Begin(key_begin);
  }
  int it = 0;
  for (int64_t t0 = key_begin; t0 < key_end; t0 += kTileKeys, ++it) {
    // (Its first barrier: q_s written, first tile / the last tile's P·V done with k_s, p_s.)
    tiles.Load(it, t0, k_s, k_stride, valid_s, warp, lane);
    {
      const float* krow = k_s + t_key * k_stride;
      float dl, dr;
      if (pairs) {
        dl = pair_chains(q_s, krow, C, g);
        dr = pair_chains(q_s + C, krow + C, R, g);
      } else {
        // Fold16's lanes l and l + 8 are chains g and g + 8 (l = g); a chain past n is 0.
        dl = fold(chain(q_s, krow, C, g), chain(q_s, krow, C, g + 8));
        dr = fold(chain(q_s + C, krow + C, R, g), chain(q_s + C, krow + C, R, g + 8));
      }
      if (g == 0) {
        s_s[t_key] = valid_s[t_key] != 0 ? __fmul_rn(__fadd_rn(dl, dr), p.softmax_scale) : -INFINITY;
      }
    }
    __syncthreads();
    if (warp == 0) {  // MlaSplitKernel's per-head update, lane = key
      const float sc = s_s[lane];
      const float m_new = fmaxf(m_run, dev::WarpMax(sc));
      const float pr = sc == -INFINITY ? 0.0f : dev::ExpF(__fsub_rn(sc, m_new));
      const float alpha = m_run == -INFINITY ? 0.0f : dev::ExpF(__fsub_rn(m_run, m_new));
      l_run = __fadd_rn(__fmul_rn(l_run, alpha), dev::WarpSum(pr));
      m_run = m_new;
      p_s[lane] = pr;
      if (lane == 0) alpha_s[0] = alpha;
    }
    __syncthreads();
    const float a = alpha_s[0];
#pragma unroll
    for (int m = 0; m < 2; ++m) o[m] = __fmul_rn(o[m], a);
    for (int t = 0; t < kTileKeys; ++t) {
      const float pv = p_s[t];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int c = tid + m * kThreads;
        if (c < C) o[m] = __fmaf_rn(pv, k_s[t * k_stride + c], o[m]);
      }
    }
  }
  float* dst = ws.o_part + ((static_cast<int64_t>(b) * H + head) * ws.splits + split) * C;
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const int c = tid + m * kThreads;
    if (c < C) dst[c] = o[m];
  }
  if (tid == 0) {
    const int64_t at = (static_cast<int64_t>(b) * H + head) * ws.splits + split;
    ws.m_part[at] = m_run;
    ws.l_part[at] = l_run;
  }
}
static_assert(2 * kThreads >= kMaxLora, "MlaSplitHeadKernel: two columns a thread");
static_assert(kThreads == 8 * kTileKeys, "MlaSplitHeadKernel: eight threads a key");

// One CTA per (request, head): dev::MlaCombineSplits into o_latent, and lse = M + log L.
__global__ void __launch_bounds__(kCombineThreads) MlaCombineKernel(MlaDecodeParams p, MlaPartials q) {
  dev::GridDependencySync();
  const int64_t H = p.heads, b = blockIdx.x / H, h = blockIdx.x % H;
  float* out = p.o_latent + b * p.o_batch_stride + h * p.o_head_stride;
  __shared__ float scratch[dev::kMlaCombineScratch];
  float M = 0.0f;
  const float L =
      dev::MlaCombineSplits(q, b, h, threadIdx.x, kCombineThreads, scratch, [&](int c, float v) { out[c] = v; }, &M);
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[b * H + h] = L == 0.0f ? -INFINITY : __fadd_rn(M, logf(L));
}

Status Validate(const MlaDecodeParams& p, bool sparse, const char* op) {
  LS_CHECK_ARG(p.batch >= 0 && p.batch <= 65535, op, "batch", p.batch);
  LS_CHECK_ARG(p.heads > 0 && p.heads <= 65535 * int64_t{kMaxHeadsPerCta} / 2, op, "heads", p.heads);
  LS_CHECK_ARG(p.batch * p.heads < (int64_t{1} << 31), op, "batch·heads", p.batch * p.heads);
  LS_CHECK_ARG(p.kv_lora > 0 && p.kv_lora <= kMaxLora, op, "kv_lora", p.kv_lora);
  LS_CHECK_ARG(p.rope_dim >= 0 && p.rope_dim <= kMaxRope, op, "rope_dim", p.rope_dim);
  LS_CHECK_ARG(p.format == LatentFormat::kFp32 || p.format == LatentFormat::kBf16 ||
                   p.format == LatentFormat::kFp8E4m3,
               op, "format", static_cast<int>(p.format));
  LS_CHECK_ARG(std::isfinite(p.softmax_scale), op, "softmax_scale", p.softmax_scale);
  LS_CHECK_ARG(p.q_latent != nullptr, op, "q_latent", p.q_latent);
  LS_CHECK_ARG(p.q_latent_head_stride >= p.kv_lora, op, "q_latent_head_stride", p.q_latent_head_stride);
  LS_CHECK_ARG(p.q_latent_batch_stride >= (p.heads - 1) * p.q_latent_head_stride + p.kv_lora, op,
               "q_latent_batch_stride", p.q_latent_batch_stride);
  if (p.rope_dim > 0) {
    LS_CHECK_ARG(p.q_rope != nullptr, op, "q_rope", p.q_rope);
    LS_CHECK_ARG(p.q_rope_head_stride >= p.rope_dim, op, "q_rope_head_stride", p.q_rope_head_stride);
    LS_CHECK_ARG(p.q_rope_batch_stride >= (p.heads - 1) * p.q_rope_head_stride + p.rope_dim, op,
                 "q_rope_batch_stride", p.q_rope_batch_stride);
  }
  LS_CHECK_ARG(p.cache != nullptr, op, "cache", p.cache);
  LS_CHECK_ARG(p.page_size > 0, op, "page_size", p.page_size);
  LS_CHECK_ARG(p.num_pages > 0 && p.num_pages * p.page_size <= (int64_t{1} << 31), op, "num_pages", p.num_pages);
  if (sparse) {
    LS_CHECK_ARG(p.indices != nullptr, op, "indices", p.indices);
    LS_CHECK_ARG(p.topk > 0 && p.topk < (int64_t{1} << 31), op, "topk", p.topk);
    LS_CHECK_ARG(p.indices_stride >= p.topk, op, "indices_stride", p.indices_stride);
  } else {
    LS_CHECK_ARG(p.indices == nullptr, op, "indices (set: call MlaSparseDecode)", p.indices);
    LS_CHECK_ARG(p.page_table != nullptr, op, "page_table", p.page_table);
    LS_CHECK_ARG(p.seq_lens != nullptr, op, "seq_lens", p.seq_lens);
    LS_CHECK_ARG(p.page_table_stride > 0, op, "page_table_stride", p.page_table_stride);
    LS_CHECK_ARG(p.max_seq_len >= 0 && p.max_seq_len <= p.page_table_stride * p.page_size, op, "max_seq_len",
                 p.max_seq_len);
  }
  LS_CHECK_ARG(p.o_latent != nullptr, op, "o_latent", p.o_latent);
  LS_CHECK_ARG(p.o_head_stride >= p.kv_lora, op, "o_head_stride", p.o_head_stride);
  LS_CHECK_ARG(p.o_batch_stride >= (p.heads - 1) * p.o_head_stride + p.kv_lora, op, "o_batch_stride",
               p.o_batch_stride);
  LS_CHECK_ARG(p.heads_per_cta == 0 || p.heads_per_cta == 1 || p.heads_per_cta == 8 || p.heads_per_cta == 16, op,
               "heads_per_cta (0, 1, 8 or 16)", p.heads_per_cta);
  LS_CHECK_ARG(p.key_staging >= 0 && p.key_staging <= 2, op, "key_staging (0, 1 or 2)", p.key_staging);
  LS_CHECK_ARG(p.heads <= 65535, op, "heads", p.heads);
  const size_t need = MlaDecodeWorkspaceBytes(p);
  LS_CHECK_ARG(p.workspace_bytes >= need, op, "workspace_bytes (need MlaDecodeWorkspaceBytes)", p.workspace_bytes);
  LS_CHECK_ARG(p.workspace != nullptr || need == 0, op, "workspace", p.workspace);
  LS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.workspace) % 256 == 0, op, "workspace (256-byte aligned)",
               p.workspace);
  return Status::Ok();
}

// The split kernel's results in p's workspace, as the combine reads them.
template <bool kSparse>
MlaPartials PartialsOf(const MlaDecodeParams& p, const Workspace& ws) {
  MlaPartials q;
  q.o = ws.o_part;
  q.m = ws.m_part;
  q.l = ws.l_part;
  q.batch = p.batch;
  q.heads = p.heads;
  q.kv_lora = p.kv_lora;
  q.splits = ws.splits;
  if constexpr (kSparse) {
    q.topk = p.topk;
  } else {
    q.seq_lens = p.seq_lens;
    q.max_seq_len = p.max_seq_len;
    q.key_capacity = p.page_table_stride * p.page_size;
  }
  return q;
}

// The split kernel; *partials (when not null) describes what it writes.
template <bool kSparse>
Status LaunchSplits(const MlaDecodeParams& p, Stream stream, MlaPartials* partials) {
  const int64_t splits = SplitsToAllocate(kSparse ? p.topk : p.max_seq_len);
  const WorkspaceLayout layout = Layout(p, splits);
  char* w = static_cast<char*>(p.workspace);
  Workspace ws{reinterpret_cast<float*>(w), reinterpret_cast<float*>(w + layout.o_bytes),
               reinterpret_cast<float*>(w + layout.o_bytes + layout.ml_bytes), splits};
  if (partials != nullptr) *partials = PartialsOf<kSparse>(p, ws);
  const int64_t D = p.kv_lora + p.rope_dim;
  const int64_t bpt = LatentBytesPerToken(p.format, p.kv_lora, p.rope_dim);
  if (splits > 0) {
    // 8 heads a CTA when 16 would leave SMs idle; one when 8 still would at one or two requests
    // (batch-1 decode at short context: H200, 16 heads, bf16 cache, 1 × 256 keys 20 → 13 µs; at
    // 8 × 256 one head a CTA is slower, 21 → 39 µs: every CTA dequantises its keys again). The
    // grid counts splits for max_seq_len (a graph's: the cache's capacity), not the keys the
    // requests have. Every shape gives the same bits (gpu_mla_decode_test).
    const int64_t ctas16 = splits * ((p.heads + 15) / 16) * p.batch, ctas8 = splits * ((p.heads + 7) / 8) * p.batch;
    const int hpc = p.heads_per_cta != 0                       ? p.heads_per_cta
                    : ctas16 >= SmCount()                      ? 16
                    : ctas8 >= SmCount() || p.batch > 2        ? 8
                                                               : 1;
    const bool staged = StagesKeys(p, bpt, hpc);
    auto launch = [&](auto kernel, int hpc) -> Status {
      const size_t smem = sizeof(float) * (hpc * D + kTileKeys * (D + 1) + hpc * kTileKeys + hpc) +
                          sizeof(int) * kTileKeys + KeyTilesSmem(staged, bpt);
      LS_CUDA_RETURN_IF_ERROR(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>((p.heads + hpc - 1) / hpc),
                      static_cast<unsigned>(p.batch));
      LS_CUDA_RETURN_IF_ERROR(LaunchKernel(kernel, grid, kThreads, smem, stream, p, bpt, staged, ws));
      LS_CUDA_LAUNCH_CHECK();
      return Status::Ok();
    };
    if (hpc == 1) {
      const size_t smem = sizeof(float) * (D + kTileKeys * HeadKeyStride(D) + 2 * kTileKeys + 1) +
                          sizeof(int) * kTileKeys + KeyTilesSmem(staged, bpt);
      LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          MlaSplitHeadKernel<kSparse>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
      LS_CUDA_RETURN_IF_ERROR(LaunchKernel(MlaSplitHeadKernel<kSparse>, grid, kThreads, smem, stream, p, bpt, staged,
                                           ws));
      LS_CUDA_LAUNCH_CHECK();
    } else {
      LS_RETURN_IF_ERROR(hpc == 8 ? launch(MlaSplitKernel<kSparse, 8>, 8) : launch(MlaSplitKernel<kSparse, 16>, 16));
    }
  }
  return Status::Ok();
}

template <bool kSparse>
Status Launch(const MlaDecodeParams& p, Stream stream) {
  LS_RETURN_IF_ERROR(Validate(p, kSparse, kSparse ? "MlaSparseDecode" : "MlaDecode"));
  if (p.batch == 0) return Status::Ok();
  MlaPartials q;
  LS_RETURN_IF_ERROR(LaunchSplits<kSparse>(p, stream, &q));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(MlaCombineKernel, static_cast<unsigned>(p.batch * p.heads), kCombineThreads,
                                       0, stream, p, q));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

template <bool kSparse>
Status LaunchSplitsOnly(const MlaDecodeParams& p, MlaPartials* partials, Stream stream) {
  const char* op = kSparse ? "MlaSparseDecodeSplits" : "MlaDecodeSplits";
  LS_CHECK_ARG(partials != nullptr, op, "partials", partials);
  LS_RETURN_IF_ERROR(Validate(p, kSparse, op));
  *partials = MlaPartials();
  if (p.batch == 0) return Status::Ok();
  return LaunchSplits<kSparse>(p, stream, partials);
}

}  // namespace

int64_t MlaSplitKeys(int64_t n_keys) { return SplitKeys(n_keys); }

size_t MlaDecodeWorkspaceBytes(const MlaDecodeParams& p) {
  if (p.batch <= 0 || p.heads <= 0 || p.kv_lora <= 0) return 0;
  const int64_t max_keys = p.indices != nullptr ? p.topk : p.max_seq_len;
  return Layout(p, SplitsToAllocate(max_keys)).total;
}

Status MlaDecode(const MlaDecodeParams& p, Stream stream) { return Launch<false>(p, stream); }
Status MlaSparseDecode(const MlaDecodeParams& p, Stream stream) { return Launch<true>(p, stream); }
Status MlaDecodeSplits(const MlaDecodeParams& p, MlaPartials* partials, Stream stream) {
  return LaunchSplitsOnly<false>(p, partials, stream);
}
Status MlaSparseDecodeSplits(const MlaDecodeParams& p, MlaPartials* partials, Stream stream) {
  return LaunchSplitsOnly<true>(p, partials, stream);
}

}  // namespace lockstep::kernels::cuda
