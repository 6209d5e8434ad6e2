// kernels/cuda/sampler.cu — engine/sampler.cc on the GPU (docs/sampling.md), token for token.
//
// Steps per request (one CTA each, after one segmented sort for the whole batch):
//   sort     64-bit keys (~ordered(logit) << 32 | id) sorted ascending per row: logit
//            descending, id ascending — unique keys, so the order needs no sort stability;
//   weights  W[i] = exp((l_i − l_0) / T) in fp64, in parallel (independent of each other);
//   prefix   P[i] = (…(W[0] + W[1]) + …) + W[i], left to right by one warp (each lane
//            redundantly adds the broadcast values; lane j keeps P[base + j]). Every sum the
//            CPU forms (total, top-p's running cum, kept, the inverse CDF's cum) is one of
//            these prefixes, so all of them are bitwise the CPU's;
//   cuts     top-p, min-p and the draw are "first index satisfying …", found by a block-wide
//            minimum over the candidates: the exact answer of the CPU's loops.
// Cost: the prefix is a serial chain of fp64 additions over the sorted weights (k = top_k, or
// the vocabulary when top_k is off), stopped where adding the next weight no longer changes
// the sum; the chain was ~43 cycles an element (a shuffle waited for per add) and is now the
// adds alone. One row is sorted device-wide; a batch by a segmented sort (one CTA a row). A
// top-k select before the sort is future work.
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
constexpr int kSampleThreads = 256;

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

// Block-wide minimum of per-thread candidates (INT_MAX = none): order-independent.
__device__ __forceinline__ int BlockMin(int v, int* slot) {
  if (threadIdx.x == 0) *slot = INT_MAX;
  __syncthreads();
  if (v != INT_MAX) atomicMin(slot, v);
  __syncthreads();
  const int r = *slot;
  __syncthreads();
  return r;
}

__global__ void __launch_bounds__(kSampleThreads) SampleKernel(SamplerParams p, const uint64_t* sorted, double* W,
                                                               double* P) {
  dev::GridDependencySync();
  __shared__ int min_slot;
  __shared__ float best_v[kSampleThreads];
  __shared__ int best_i[kSampleThreads];
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x;
  const SampleRequest req = p.requests[b];
  const float* lg = p.logits + b * p.logits_stride;
  const int V = static_cast<int>(p.vocab);
  SampleOutput out;
  out.counter = req.step;

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
  // 2. w_i = exp((l_i − l_max) / T) in fp64.
  const double lmax = static_cast<double>(Val(lg[id_at(0)]));
  for (int i = tid; i < k; i += kSampleThreads) {
    w[i] = exp(__ddiv_rn(__dsub_rn(static_cast<double>(Val(lg[id_at(i)])), lmax), req.temperature));
  }
  __syncthreads();
  // Prefix sums, left to right (warp 0; every lane adds the same broadcast values). A chunk's 32
  // values are broadcast before its additions, so only the fp64 adds are a chain. The weights
  // descend: once adding the largest one left changes nothing, rounding's monotonicity means no
  // later one does (0 ≤ w ≤ w_max: c ≤ c ⊕ w ≤ c ⊕ w_max = c), and every later prefix is c.
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
  const double total = pre[k - 1];
  // 3. top-p: the shortest prefix with cum ≥ top_p · total.
  int keep = k;
  if (req.top_p < 1.0) {
    const double thr = req.top_p * total;
    int first = INT_MAX;
    for (int i = tid; i < k; i += kSampleThreads) {
      if (pre[i] >= thr) {
        first = i;
        break;
      }
    }
    const int f = BlockMin(first, &min_slot);
    if (f != INT_MAX) keep = f + 1;
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
    const int f = BlockMin(first, &min_slot);
    if (f != INT_MAX) keep = f;
  }
  const double kept = pre[keep - 1];
  // 5. Inverse CDF with one Philox draw.
  const double u = PhiloxUniform(req.seed, req.step, /*stream=*/0);
  const double target = u * kept;
  int first = INT_MAX;
  for (int i = tid; i < keep; i += kSampleThreads) {
    if (pre[i] > target) {
      first = i;
      break;
    }
  }
  const int f = BlockMin(first, &min_slot);
  const int chosen = f != INT_MAX ? f : keep - 1;
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
  if (!p.all_greedy) {  // greedy rows need no order (an argmax: decode's usual case, ~1 ms saved)
    LS_CUDA_RETURN_IF_ERROR(LaunchKernel(PrepKernel, prep_grid, kPrepThreads, 0, stream, p, keys_in, offsets));
    LS_CUDA_LAUNCH_CHECK();
    size_t temp_bytes = layout->total - layout->temp;
    if (p.batch == 1) {  // the keys are unique: any correct sort gives the same order
      LS_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortKeys(ws + layout->temp, temp_bytes, keys_in, keys_out,
                                                             static_cast<int>(p.vocab), 0, 64, stream));
    } else {
      LS_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortKeys(
          ws + layout->temp, temp_bytes, keys_in, keys_out, static_cast<int>(p.batch * p.vocab),
          static_cast<int>(p.batch), offsets, offsets + 1, 0, 64, stream));
    }
  }
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(SampleKernel, static_cast<unsigned>(p.batch), kSampleThreads, 0, stream, p, keys_out, W, P));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
