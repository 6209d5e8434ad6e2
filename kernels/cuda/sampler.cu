// kernels/cuda/sampler.cu — engine/sampler.cc on the GPU (docs/sampling.md), token for token.
//
// Steps per request (after one sort for the whole batch):
//   sort     64-bit keys (~ordered(logit) << 32 | id) sorted ascending per row by their upper
//            half (a stable radix sort of rows written in id order): logit descending, id
//            ascending;
//   weights  W[i] = exp((l_i − l_0) / T) in fp64, by many CTAs a row (WeightsKernel);
//   prefix   P[i] = (…(W[0] + W[1]) + …) + W[i], the CPU's left-to-right sums bit for bit,
//            formed in parallel passes (SequentialPrefix: within a binade of the running sum
//            every addition adds whole ulps, so a pass is an integer scan). Every sum the CPU
//            forms (total, top-p's running cum, kept, the inverse CDF's cum) is one of these
//            prefixes, so all of them are bitwise the CPU's;
//   cuts     top-p, min-p and the draw are "first index satisfying …": the exact answer of the
//            CPU's loops, by a k-ary search over the (non-decreasing) sums for top-p and the
//            draw, a block-wide minimum over the candidates for min-p.
// One CTA a row from the prefix on. Greedy batches (all_greedy) skip all of it: an argmax in
// 4096-logit parts, then their maximum. A top-k select before the sort is future work.
#include <cuda_runtime.h>

#include <climits>
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/philox.h"

namespace lockstep::kernels::cuda {
namespace {

constexpr int kPrepThreads = 256;
constexpr int kSampleThreads = 512;
constexpr int kPrefixItems = 8;  // weights a thread takes per pass of SequentialPrefix

inline size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

struct Layout {
  size_t keys_in, keys_out, weights, prefix, offsets, temp, total;
};

// NaN logits are −∞ (they never win); −0 equals +0 (OrderedKey).
__device__ __forceinline__ float Val(float l) { return isnan(l) ? -INFINITY : l; }

Result<Layout> MakeLayout(int64_t batch, int64_t vocab) {
  Layout l{};
  const size_t n = static_cast<size_t>(batch) * vocab;
  size_t at = 0;
  l.keys_in = at;
  at += Align256(n * sizeof(uint64_t));
  l.keys_out = at;
  at += Align256(n * sizeof(uint64_t));
  l.weights = at;
  at += Align256(n * sizeof(double));
  l.prefix = at;
  at += Align256(n * sizeof(double));
  l.offsets = at;
  at += Align256((batch + 1) * sizeof(int));
  size_t temp_bytes = 0;
  LS_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortKeys(
      nullptr, temp_bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<int>(n), static_cast<int>(batch), static_cast<const int*>(nullptr), static_cast<const int*>(nullptr)));
  if (batch == 1) {  // one row: the device-wide sort (many CTAs), not the segmented one (one CTA a row)
    size_t one = 0;
    LS_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortKeys(nullptr, one, static_cast<const uint64_t*>(nullptr),
                                                           static_cast<uint64_t*>(nullptr), static_cast<int>(n)));
    temp_bytes = std::max(temp_bytes, one);
  }
  l.temp = at;
  at += Align256(temp_bytes);
  l.total = at;
  return l;
}

__global__ void __launch_bounds__(kPrepThreads) PrepKernel(SamplerParams p, uint64_t* keys, int* offsets) {
  dev::GridDependencySync();
  const int64_t b = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kPrepThreads + threadIdx.x;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    offsets[b] = static_cast<int>(b * p.vocab);
    if (b == p.batch - 1) offsets[p.batch] = static_cast<int>(p.batch * p.vocab);
  }
  if (i >= p.vocab) return;
  const uint32_t ord = dev::OrderedKey(Val(p.logits[b * p.logits_stride + i]));
  keys[b * p.vocab + i] = (static_cast<uint64_t>(~ord) << 32) | static_cast<uint32_t>(i);
}

// A row's part for the kernels that spread one row over many CTAs (the greedy argmax, the
// weights): kRowPart = 4096 logits.
constexpr int kRowPartPerThread = 16;
constexpr int kRowPart = kRowPartPerThread * kPrepThreads;

// Greedy rows (SamplerParams::all_greedy): the argmax in two launches, many CTAs a row. CTA
// (part, b) reduces logits [part·kRowPart, +kRowPart) of row b to one key,
// (OrderedKey(value) << 32) | ~index, whose maximum is the first index of the largest value
// (NaN = −∞; −0 = +0) — the CPU's `if (val(i) > val(best))` scan, in any reduction order;
// every key is > 0. The sample kernel then takes the maximum over the row's parts. (One CTA
// scanning a 102400-logit row took ~20 µs of a batch-1 step, H200.)

__device__ __forceinline__ uint64_t ArgmaxKey(float v, int i) {
  return (static_cast<uint64_t>(dev::OrderedKey(Val(v))) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}
__device__ __forceinline__ uint64_t WarpMaxU64(uint64_t v) {
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__global__ void __launch_bounds__(kPrepThreads) ArgmaxPartKernel(SamplerParams p, uint64_t* parts) {
  dev::GridDependencySync();
  __shared__ uint64_t warp_best[kPrepThreads / 32];
  const int64_t b = blockIdx.y;
  const float* lg = p.logits + b * p.logits_stride;
  const int V = static_cast<int>(p.vocab), i0 = static_cast<int>(blockIdx.x) * kRowPart;
  float v[kRowPartPerThread];
#pragma unroll
  for (int u = 0; u < kRowPartPerThread; ++u) {  // every load issued before any compare
    const int i = i0 + u * kPrepThreads + static_cast<int>(threadIdx.x);
    v[u] = i < V ? lg[i] : 0.0f;
  }
  uint64_t best = 0;
#pragma unroll
  for (int u = 0; u < kRowPartPerThread; ++u) {
    const int i = i0 + u * kPrepThreads + static_cast<int>(threadIdx.x);
    const uint64_t key = i < V ? ArgmaxKey(v[u], i) : 0;
    best = key > best ? key : best;
  }
  best = WarpMaxU64(best);
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x / 32] = best;
  __syncthreads();
  if (threadIdx.x < 32) {
    best = threadIdx.x < kPrepThreads / 32 ? warp_best[threadIdx.x] : 0;
    best = WarpMaxU64(best);
    if (threadIdx.x == 0) parts[b * gridDim.x + blockIdx.x] = best;
  }
}

// --- The CPU's running sums, in parallel ------------------------------------------------------
//
// pre[i] = (…(w[0] ⊕ w[1]) ⊕ …) ⊕ w[i], ⊕ fp64 addition (round to nearest even), left to
// right as engine/sampler.cc forms it, up to `settled`, the first i whose addition leaves the
// sum unchanged; pre[i] = pre[settled − 1] from there on (and the result is settled, or n).
// Needs w[0] > 0, every w finite and ≥ 0, and every running sum finite (the sampler's
// weights with a finite top logit: w[0] = 1, the others in [0, 1]).
// Bitwise the serial chain without being one: while the running sum s stays in one binade
// (one ulp u: [2^e, 2^(e+1)), or below 2^−1021 for the subnormal ulp), s ⊕ w = s + u·round(w/u),
// and for a positive double adding j ulps inside a binade adds j to its bit pattern. w/u is w's
// integer significand shifted right by the exponents' difference, so round(w/u) is integer
// arithmetic too. A pass takes the next kSampleThreads · kPrefixItems weights, scans their
// k_j = round(w_j/u) (uint64, saturating) and has every sum as bits(s) + K_j — up to the first j
// where that stops being the rule: w_j/u ends in exactly .5 (a tie: rounding to even depends on
// the sum's last bit), the sum leaves the binade (the next ulp), or k_j = 0 (the sum does not
// move: settled). That j's sum is __dadd_rn of the one before, and the next pass starts after
// it. Passes: n / 4096 plus one per binade the sum crosses (≤ log2 n + 1 from w[0]) and per tie;
// one barrier a pass that crosses nothing. The serial chain it replaces took ~24 ns a weight:
// 2.4 ms for a flat 102400-token distribution (H200, 2026-12-01).
struct SatAdd {  // saturating at 2^62: associative, and never wraps
  __device__ __forceinline__ unsigned long long operator()(unsigned long long a, unsigned long long b) const {
    const unsigned long long c = a + b;
    return c < (1ull << 62) ? c : (1ull << 62);
  }
};
constexpr int kPrefixWarps = kSampleThreads / 32;
struct PrefixShared {
  unsigned long long warp_total[2][kPrefixWarps];  // by pass parity: a pass's writes never meet
  int warp_stop[2][kPrefixWarps], warp_cross[2][kPrefixWarps];  // the last pass's reads
  unsigned long long next_bits;  // a break's sum (its owner's __dadd_rn)
  int settled;
};

// round(w / u) for the ulp u of sums with biased exponent max(Es, 1), as an integer, and
// whether w/u ends in exactly .5.
__device__ __forceinline__ unsigned long long UlpsOf(unsigned long long wb, int es1, bool* tie) {
  const int ew = static_cast<int>(wb >> 52) & 0x7ff;
  const unsigned long long m = (wb & ((1ull << 52) - 1)) | (ew != 0 ? 1ull << 52 : 0ull);
  const int sh = es1 - (ew > 1 ? ew : 1);
  *tie = false;
  if (sh < 0) return 1ull << 62;  // w above the sum's binade: a crossing, left to __dadd_rn
  if (sh == 0) return m;
  if (sh > 60) return 0;  // m < 2^53 < half an ulp's 2^(sh−1)
  const unsigned long long q = m >> sh, rem = m & ((1ull << sh) - 1), half = 1ull << (sh - 1);
  *tie = rem == half;
  return q + (rem > half ? 1 : 0);
}

__device__ int SequentialPrefix(const double* w, int n, double* pre, PrefixShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kChunk = kSampleThreads * kPrefixItems, kWarpSpan = 32 * kPrefixItems;
  unsigned long long s_bits = static_cast<unsigned long long>(__double_as_longlong(w[0]));  // 0 ⊕ w[0]
  if (tid == 0) pre[0] = w[0];
  int i = 1, settled = n, parity = 0;
  while (i < n) {
    const int es = static_cast<int>(s_bits >> 52) & 0x7ff, es1 = es > 1 ? es : 1;
    const unsigned long long limit = static_cast<unsigned long long>(es1 + 1) << 52;  // the next ulp's first sum
    // Warp w takes [i + w·kWarpSpan, +kWarpSpan) in kPrefixItems rounds of 32 consecutive weights
    // (lane l the round's l-th: loads and stores coalesce); loc[m] = K within the warp's span.
    // Every load first (one memory round trip a pass, not one a round), then the rounds' scans
    // side by side (independent shuffle chains), then their carries in registers.
    const int base = i + warp * kWarpSpan + lane;
    unsigned long long wb[kPrefixItems], loc[kPrefixItems];
#pragma unroll
    for (int m = 0; m < kPrefixItems; ++m) {
      const int j = base + 32 * m;
      wb[m] = j < n ? static_cast<unsigned long long>(__double_as_longlong(w[j])) : 0ull;
    }
    int my_stop = INT_MAX;
#pragma unroll
    for (int m = kPrefixItems - 1; m >= 0; --m) {
      bool tie;
      loc[m] = UlpsOf(wb[m], es1, &tie);
      if (base + 32 * m < n && (tie || loc[m] == 0)) my_stop = base + 32 * m;
    }
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
#pragma unroll
      for (int m = 0; m < kPrefixItems; ++m) {
        const unsigned long long v = __shfl_up_sync(0xffffffffu, loc[m], o);
        if (lane >= o) loc[m] = SatAdd()(loc[m], v);
      }
    }
    unsigned long long carry = 0;
#pragma unroll
    for (int m = 0; m < kPrefixItems; ++m) {
      const unsigned long long round_total = __shfl_sync(0xffffffffu, loc[m], 31);
      loc[m] = SatAdd()(carry, loc[m]);
      carry = SatAdd()(carry, round_total);
    }
    const int warp_stop = __reduce_min_sync(0xffffffffu, my_stop);
    if (lane == 0) {
      sh.warp_total[parity][warp] = carry;
      sh.warp_stop[parity][warp] = warp_stop;
    }
    __syncthreads();
    unsigned long long before = 0, total = 0;
    int stop = INT_MAX;
#pragma unroll
    for (int v = 0; v < kPrefixWarps; ++v) {
      const unsigned long long t = sh.warp_total[parity][v];
      if (v < warp) before = SatAdd()(before, t);
      total = SatAdd()(total, t);
      stop = sh.warp_stop[parity][v] < stop ? sh.warp_stop[parity][v] : stop;
    }
    // The first sum past the binade (K never decreases: it flips once), when the pass reaches it
    // at all (every thread knows the total: a uniform branch).
    int cross = INT_MAX;
    if (s_bits + total >= limit) {
      int my_cross = INT_MAX;
#pragma unroll
      for (int m = kPrefixItems - 1; m >= 0; --m) {
        if (base + 32 * m < n && s_bits + SatAdd()(before, loc[m]) >= limit) my_cross = base + 32 * m;
      }
      const int wc = __reduce_min_sync(0xffffffffu, my_cross);
      if (lane == 0) sh.warp_cross[parity][warp] = wc;
      __syncthreads();
#pragma unroll
      for (int v = 0; v < kPrefixWarps; ++v) cross = sh.warp_cross[parity][v] < cross ? sh.warp_cross[parity][v] : cross;
    }
    const int b = stop < cross ? stop : cross;
    const int end = b != INT_MAX ? b : (n < i + kChunk ? n : i + kChunk);
#pragma unroll
    for (int m = 0; m < kPrefixItems; ++m) {
      const int j = base + 32 * m;
      if (j < end) pre[j] = __longlong_as_double(static_cast<long long>(s_bits + SatAdd()(before, loc[m])));
    }
    parity ^= 1;
    if (b == INT_MAX) {
      s_bits += total;  // < limit: no saturation
      i = end;
      continue;
    }
    // The break's own addition, from the sum before it (stored above by whichever thread).
    __syncthreads();
    if (tid == 0) {
      const double prev = b == i ? __longlong_as_double(static_cast<long long>(s_bits)) : pre[b - 1];
      const double next = __dadd_rn(prev, w[b]);
      sh.next_bits = static_cast<unsigned long long>(__double_as_longlong(next));
      sh.settled = next == prev ? b : INT_MAX;
      if (next != prev) pre[b] = next;
    }
    __syncthreads();
    s_bits = sh.next_bits;  // settled: = the sum before b
    if (sh.settled != INT_MAX) {
      settled = sh.settled;
      break;
    }
    i = b + 1;
  }
  // From `settled` on, the last sum (no addition after it moved it).
  const double last = __longlong_as_double(static_cast<long long>(s_bits));
  for (int j = settled + tid; j < n; j += kSampleThreads) pre[j] = last;
  __syncthreads();
  return settled;
}

__global__ void __launch_bounds__(kSampleThreads) SequentialPrefixKernel(const double* w, int n, double* pre,
                                                                         int* settled) {
  dev::GridDependencySync();
  __shared__ PrefixShared sh;
  const int s = SequentialPrefix(w, n, pre, sh);
  if (threadIdx.x == 0) *settled = s;
}

// Block-wide minimum of per-thread candidates (INT_MAX = none), by all kSampleThreads threads:
// each warp's minimum, then the warps' (`slot` holds a value a warp); order-independent.
__device__ __forceinline__ int BlockMin(int v, int* slot) {
  const int m = __reduce_min_sync(0xffffffffu, v);
  if ((threadIdx.x & 31) == 0) slot[threadIdx.x / 32] = m;
  __syncthreads();
  int r = slot[0];
#pragma unroll
  for (int w = 1; w < kSampleThreads / 32; ++w) r = slot[w] < r ? slot[w] : r;
  __syncthreads();  // slot free for the next call
  return r;
}

// The first index in [0, n) where `pred` holds, n if none, for a predicate that is false and
// then true along the index (a threshold on the running sums, which never decrease): rounds of
// kSampleThreads probes, each narrowing the interval kSampleThreads-fold — two or three rounds
// of parallel loads where a thread's strided scan made ~n / kSampleThreads dependent ones.
template <typename Pred>
__device__ int FirstTrue(int n, Pred pred, int* slot) {
  int lo = 0, hi = n;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int stride = (hi - lo + kSampleThreads - 1) / kSampleThreads;
    const int probes = (hi - lo) / stride;
    const int t = static_cast<int>(threadIdx.x);
    const int hit = BlockMin(t < probes && pred(lo + (t + 1) * stride - 1) ? t : INT_MAX, slot);
    if (hit == INT_MAX) {
      lo += probes * stride;
    } else {
      hi = lo + (hit + 1) * stride - 1;
      lo += hit * stride;
    }
  }
  return lo;
}

// Step 2's weights, w_i = exp((l_i − l_max) / T) in fp64 for the row's sorted candidates i < k,
// by many CTAs a row: CTA (c, b) takes candidates [c·kRowPart, +kRowPart) of row b.
// (One CTA a row took ~30 µs for 102400 of them: the fp64 division and exp.)
__global__ void __launch_bounds__(kPrepThreads) WeightsKernel(SamplerParams p, const uint64_t* sorted, double* W) {
  dev::GridDependencySync();
  const int64_t b = blockIdx.y;
  const SampleRequest& req = p.requests[b];
  if (req.temperature <= 0.0) return;
  const int V = static_cast<int>(p.vocab);
  const int k = (req.top_k > 0 && req.top_k < p.vocab) ? static_cast<int>(req.top_k) : V;
  const uint64_t* keys = sorted + b * p.vocab;
  const float* lg = p.logits + b * p.logits_stride;
  double* w = W + b * p.vocab;
  auto id_at = [&](int i) { return static_cast<int>(static_cast<uint32_t>(keys[i])); };
  const double lmax = static_cast<double>(Val(lg[id_at(0)]));
  const int i0 = static_cast<int>(blockIdx.x) * kRowPart;
  const int i1 = k < i0 + kRowPart ? k : i0 + kRowPart;
  for (int i = i0 + static_cast<int>(threadIdx.x); i < i1; i += kPrepThreads) {
    w[i] = exp(__ddiv_rn(__dsub_rn(static_cast<double>(Val(lg[id_at(i)])), lmax), req.temperature));
  }
}

__global__ void __launch_bounds__(kSampleThreads) SampleKernel(SamplerParams p, const uint64_t* sorted, double* W,
                                                               double* P) {
  dev::GridDependencySync();
  __shared__ int min_slot[kSampleThreads / 32];
  __shared__ PrefixShared prefix_sh;
  __shared__ float best_v[kSampleThreads];
  __shared__ int best_i[kSampleThreads];
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x;
  const SampleRequest req = p.requests[b];
  const float* lg = p.logits + b * p.logits_stride;
  const int V = static_cast<int>(p.vocab);
  SampleOutput out;
  out.counter = req.step;

  if (req.temperature <= 0.0 && p.all_greedy) {  // ArgmaxPartKernel's parts of the row, in `sorted`
    if (tid < 32) {
      const int nparts = (V + kRowPart - 1) / kRowPart;
      uint64_t best = 0;
      for (int i = tid; i < nparts; i += 32) best = sorted[b * nparts + i] > best ? sorted[b * nparts + i] : best;
      best = WarpMaxU64(best);
      if (tid == 0) {
        out.token = static_cast<int>(0xffffffffu - static_cast<uint32_t>(best & 0xffffffffu));
        out.probability = 1.0;
        out.uniform = -1.0;
        out.candidates = 1;
        p.out[b] = out;
      }
    }
    return;
  }
  if (req.temperature <= 0.0) {
    // Greedy: the first index of the maximum (NaN = −∞), as the CPU's `if (val(i) > val(best))`.
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = tid; i < V; i += kSampleThreads) {
      const float v = Val(lg[i]);
      if (bi == INT_MAX || v > bv) {  // strided ascending: the first strict improvement wins
        bv = v;
        bi = i;
      }
    }
    best_v[tid] = bv;
    best_i[tid] = bi;
    __syncthreads();
    for (int w = kSampleThreads / 2; w >= 1; w /= 2) {
      if (tid < w) {
        const float ov = best_v[tid + w];
        const int oi = best_i[tid + w];
        if (oi != INT_MAX && (best_i[tid] == INT_MAX || ov > best_v[tid] || (ov == best_v[tid] && oi < best_i[tid]))) {
          best_v[tid] = ov;
          best_i[tid] = oi;
        }
      }
      __syncthreads();
    }
    if (tid == 0) {
      out.token = best_i[0];
      out.probability = 1.0;
      out.uniform = -1.0;
      out.candidates = 1;
      p.out[b] = out;
    }
    return;
  }
  if (p.all_greedy) {  // a broken promise: nothing was sorted
    if (tid == 0) {
      out.token = -1;
      p.out[b] = out;
    }
    return;
  }

  const uint64_t* keys = sorted + b * p.vocab;
  double* w = W + b * p.vocab;
  double* pre = P + b * p.vocab;
  const int k = (req.top_k > 0 && req.top_k < p.vocab) ? static_cast<int>(req.top_k) : V;
  auto id_at = [&](int i) { return static_cast<int>(static_cast<uint32_t>(keys[i])); };
  // 2. w_i = exp((l_i − l_max) / T) in fp64: WeightsKernel's.
  const double lmax = static_cast<double>(Val(lg[id_at(0)]));
  const bool finite = isfinite(lmax);
  // Prefix sums, left to right. With a finite top logit (w[0] = 1, every weight in [0, 1]),
  // SequentialPrefix's passes; otherwise (no finite logit: NaN weights) warp 0 runs the chain
  // itself — every lane adds the same broadcast values; a chunk's 32 values are broadcast before
  // its additions, so only the fp64 adds are a chain. The weights descend: once adding the
  // largest one left changes nothing, rounding's monotonicity means no later one does
  // (0 ≤ w ≤ w_max: c ≤ c ⊕ w ≤ c ⊕ w_max = c), and every later prefix is c.
  if (finite) {
    SequentialPrefix(w, k, pre, prefix_sh);
  } else {
    if (tid < 32) {
      double c = 0.0;
      for (int base = 0; base < k; base += 32) {
        if (__dadd_rn(c, w[base]) == c) {
          for (int i = base + tid; i < k; i += 32) pre[i] = c;
          break;
        }
        const double mine = base + tid < k ? w[base + tid] : 0.0;  // zeros past k add nothing
        double v[32];
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = __shfl_sync(0xffffffffu, mine, j);
        double keep_c = 0.0;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          c = __dadd_rn(c, v[j]);
          if (j == tid) keep_c = c;
        }
        if (base + tid < k) pre[base + tid] = keep_c;
      }
    }
    __syncthreads();
  }
  const double total = pre[k - 1];
  // 3. top-p: the shortest prefix with cum ≥ top_p · total.
  int keep = k;
  // (With NaN sums — no finite logit — the sums are not ordered: a scan, as the CPU's loop.)
  if (req.top_p < 1.0) {
    const double thr = req.top_p * total;
    if (finite) {
      const int f = FirstTrue(k, [&](int i) { return pre[i] >= thr; }, min_slot);
      if (f < k) keep = f + 1;
    } else {
      int first = INT_MAX;
      for (int i = tid; i < k; i += kSampleThreads) {
        if (pre[i] >= thr) {
          first = i;
          break;
        }
      }
      const int f = BlockMin(first, min_slot);
      if (f != INT_MAX) keep = f + 1;
    }
  }
  // 4. min-p: the leading tokens with w ≥ min_p (m ≥ 1).
  if (req.min_p > 0.0) {
    int first = INT_MAX;
    for (int i = 1 + tid; i < keep; i += kSampleThreads) {
      if (!(w[i] >= req.min_p)) {
        first = i;
        break;
      }
    }
    const int f = BlockMin(first, min_slot);
    if (f != INT_MAX) keep = f;
  }
  const double kept = pre[keep - 1];
  // 5. Inverse CDF with one Philox draw.
  const double u = PhiloxUniform(req.seed, req.step, /*stream=*/0);
  const double target = u * kept;
  int chosen = keep - 1;
  if (finite) {
    const int f = FirstTrue(keep, [&](int i) { return pre[i] > target; }, min_slot);
    if (f < keep) chosen = f;
  } else {
    int first = INT_MAX;
    for (int i = tid; i < keep; i += kSampleThreads) {
      if (pre[i] > target) {
        first = i;
        break;
      }
    }
    const int f = BlockMin(first, min_slot);
    if (f != INT_MAX) chosen = f;
  }
  if (tid == 0) {
    out.token = id_at(chosen);
    out.probability = w[chosen] / kept;
    out.uniform = u;
    out.candidates = keep;
    p.out[b] = out;
  }
}

}  // namespace

size_t SamplerWorkspaceBytes(int64_t batch, int64_t vocab) {
  if (batch <= 0 || vocab <= 0 || batch * vocab >= (int64_t{1} << 31)) return 0;
  auto l = MakeLayout(batch, vocab);
  return l.ok() ? l->total : 0;
}

Status Sample(const SamplerParams& p, Stream stream) {
  constexpr const char* op = "Sample";
  LS_CHECK_ARG(p.batch >= 0 && p.batch <= 65535, op, "batch", p.batch);  // grid.y of the prep kernel
  LS_CHECK_ARG(p.vocab > 0 && p.vocab < (int64_t{1} << 31), op, "vocab", p.vocab);
  LS_CHECK_ARG(p.batch * p.vocab < (int64_t{1} << 31), op, "batch·vocab", p.batch * p.vocab);
  LS_CHECK_ARG(p.logits != nullptr, op, "logits", p.logits);
  LS_CHECK_ARG(p.logits_stride >= p.vocab, op, "logits_stride", p.logits_stride);
  LS_CHECK_ARG(p.requests != nullptr, op, "requests", p.requests);
  LS_CHECK_ARG(p.out != nullptr, op, "out", p.out);
  if (p.batch == 0) return Status::Ok();
  Result<Layout> layout = MakeLayout(p.batch, p.vocab);
  if (!layout.ok()) return layout.status().WithContext("Sample: sizing the workspace: ");
  LS_CHECK_ARG(p.workspace_bytes >= layout->total, op, "workspace_bytes (need SamplerWorkspaceBytes)",
               p.workspace_bytes);
  LS_CHECK_ARG(p.workspace != nullptr, op, "workspace", p.workspace);
  LS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.workspace) % 256 == 0, op, "workspace (256-byte aligned)", p.workspace);
  char* ws = static_cast<char*>(p.workspace);
  auto* keys_in = reinterpret_cast<uint64_t*>(ws + layout->keys_in);
  auto* keys_out = reinterpret_cast<uint64_t*>(ws + layout->keys_out);
  auto* W = reinterpret_cast<double*>(ws + layout->weights);
  auto* P = reinterpret_cast<double*>(ws + layout->prefix);
  auto* offsets = reinterpret_cast<int*>(ws + layout->offsets);
  const dim3 prep_grid(static_cast<unsigned>((p.vocab + kPrepThreads - 1) / kPrepThreads),
                       static_cast<unsigned>(p.batch));
  if (p.all_greedy) {  // greedy rows need no order: the argmax's parts go where the keys would
    const dim3 grid(static_cast<unsigned>((p.vocab + kRowPart - 1) / kRowPart), static_cast<unsigned>(p.batch));
    LS_CUDA_RETURN_IF_ERROR(LaunchKernel(ArgmaxPartKernel, grid, kPrepThreads, 0, stream, p, keys_out));
    LS_CUDA_LAUNCH_CHECK();
  } else {
    LS_CUDA_RETURN_IF_ERROR(LaunchKernel(PrepKernel, prep_grid, kPrepThreads, 0, stream, p, keys_in, offsets));
    LS_CUDA_LAUNCH_CHECK();
    size_t temp_bytes = layout->total - layout->temp;
    // By the logit bits alone (the keys' upper half: four radix passes, not eight): the sort is
    // stable and PrepKernel writes each row in id order, so equal logits stay id-ascending — the
    // order of the whole keys.
    if (p.batch == 1) {
      LS_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortKeys(ws + layout->temp, temp_bytes, keys_in, keys_out,
                                                             static_cast<int>(p.vocab), 32, 64, stream));
    } else {
      LS_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortKeys(
          ws + layout->temp, temp_bytes, keys_in, keys_out, static_cast<int>(p.batch * p.vocab),
          static_cast<int>(p.batch), offsets, offsets + 1, 32, 64, stream));
    }
  }
  if (!p.all_greedy) {
    const dim3 grid(static_cast<unsigned>((p.vocab + kRowPart - 1) / kRowPart), static_cast<unsigned>(p.batch));
    LS_CUDA_RETURN_IF_ERROR(LaunchKernel(WeightsKernel, grid, kPrepThreads, 0, stream, p, keys_out, W));
    LS_CUDA_LAUNCH_CHECK();
  }
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(SampleKernel, static_cast<unsigned>(p.batch), kSampleThreads, 0, stream, p, keys_out, W, P));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status SequentialPrefixSums(const double* w, int64_t n, double* pre, int32_t* settled, Stream stream) {
  constexpr const char* op = "SequentialPrefixSums";
  LS_CHECK_ARG(n > 0 && n < (int64_t{1} << 31), op, "n", n);
  LS_CHECK_ARG(w != nullptr, op, "w", w);
  LS_CHECK_ARG(pre != nullptr, op, "pre", pre);
  LS_CHECK_ARG(settled != nullptr, op, "settled", settled);
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(SequentialPrefixKernel, 1, kSampleThreads, 0, stream, w, static_cast<int>(n), pre, settled));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
