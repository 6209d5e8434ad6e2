// kernels/cuda/model_ops.cu — the forward pass's remaining kernels: embedding gather,
// residual add, scale, bf16 conversion, SwiGLU, LayerNorm, MoE routing and the MoE combine (the
// grouped expert GEMM: expert_gemm.cu). Contracts in ops.h; each mirrors engine/model.cc or
// kernels/cpu/ops.cc operation by operation (__f*_rn / __d*_rn spell every rounding).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/expert_gemm.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/norm_row.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

// --- embedding, elementwise ----------------------------------------------------------------

__global__ void EmbedKernel(EmbedParams p) {
  dev::GridDependencySync();
  const int64_t r = blockIdx.x;
  const int32_t id = p.ids[r];
  float* y = p.y + r * p.y_stride;
  if (id < 0 || id >= p.vocab) {
    if (threadIdx.x == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrToken);
    for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x) y[i] = QuietNan();
    return;
  }
  const float* t = p.table + static_cast<int64_t>(id) * p.n;
  for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x) y[i] = t[i];
}

__global__ void AddInPlaceKernel(float* y, int64_t ys, const float* x, int64_t xs, int64_t rows, int64_t n) {
  dev::GridDependencySync();
  LS_FOR_EACH_ELEMENT(rows, n) y[r * ys + i] = __fadd_rn(y[r * ys + i], x[r * xs + i]);
}

__global__ void AddKernel(float* y, int64_t ys, const float* a, int64_t as, const float* b, int64_t bs, int64_t rows,
                          int64_t n) {
  dev::GridDependencySync();
  LS_FOR_EACH_ELEMENT(rows, n) y[r * ys + i] = __fadd_rn(a[r * as + i], b[r * bs + i]);
}

__global__ void ScaleKernel(float* x, int64_t xs, int64_t rows, int64_t n, float s) {
  dev::GridDependencySync();
  LS_FOR_EACH_ELEMENT(rows, n) x[r * xs + i] = __fmul_rn(x[r * xs + i], s);
}

__global__ void ToBf16Kernel(const float* x, int64_t xs, uint16_t* y, int64_t ys, int64_t rows, int64_t n) {
  dev::GridDependencySync();
  LS_FOR_EACH_ELEMENT(rows, n) y[r * ys + i] = dev::F32ToBf16(x[r * xs + i]);
}

__global__ void SwiGluKernel(SwiGluParams p) {
  dev::GridDependencySync();
  LS_FOR_EACH_ELEMENT(p.rows, p.n) {
    p.out[r * p.out_stride + i] = SwiGluOf(p.g[r * p.g_stride + i], p.u[r * p.u_stride + i]);
  }
}

// engine/model.cc's combine loop for element (r, i): stored, and returned.
__device__ __forceinline__ float MoeCombineAt(const MoeCombineParams& p, int64_t r, int64_t i) {
  float acc = 0.0f;
  for (int64_t j = 0; j < p.k; ++j) {
    const int64_t slot = r * p.k + j;
    acc = __fadd_rn(acc, __fmul_rn(p.y[slot * p.y_stride + i], p.weights[slot]));
  }
  if (p.shared != nullptr) acc = __fadd_rn(acc, p.shared[r * p.shared_stride + i]);
  p.out[r * p.out_stride + i] = acc;
  return acc;
}
__global__ void MoeCombineKernel(MoeCombineParams p) {
  dev::GridDependencySync();
  LS_FOR_EACH_ELEMENT(p.rows, p.n) MoeCombineAt(p, r, i);
}

// MoeCombineNorm: CTA c of a row's cluster takes columns [c·per, c·per + per), MoeCombine's
// loop then Add's x + out for each, and writes the sums into the first CTA's row buffer; that
// CTA then runs RmsNormRowTo over the buffer.
__global__ void __cluster_dims__(kNormRouteCluster, 1, 1) __launch_bounds__(kNormThreads)
    MoeCombineNormKernel(MoeCombineNormParams p) {
  namespace cg = cooperative_groups;
  // A CTA may write another's shared memory only once that CTA has started: every CTA arrives
  // on the cluster barrier first thing and waits on it just before its first remote store (by
  // then the wait costs nothing).
  __cluster_barrier_arrive_relaxed();
  dev::GridDependencySync();
  extern __shared__ __align__(16) float row_s[];  // [n] (the first CTA's is used)
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const MoeCombineParams& c = p.combine;
  const int64_t r = blockIdx.y, n = c.n;
  const int64_t per = (n + kNormRouteCluster - 1) / kNormRouteCluster;
  const int64_t i1 = (rank + 1) * per < n ? (rank + 1) * per : n;
  float* row0 = cluster.map_shared_rank(row_s, 0);
  __cluster_barrier_wait();  // every CTA of the cluster has started
  for (int64_t i = rank * per + threadIdx.x; i < i1; i += kNormThreads) {
    const float s = __fadd_rn(p.x[r * p.x_stride + i], MoeCombineAt(c, r, i));  // Add's x + o
    p.sum[r * p.sum_stride + i] = s;
    row0[i] = s;
  }
  cluster.sync();  // the whole row of sums in the first CTA
  if (rank != 0) return;
  RmsNormParams np;
  np.x = row_s;
  np.weight = p.weight;
  np.rows = 1;
  np.n = n;
  np.eps = p.eps;
  np.fault_mean_n_minus_1 = p.fault_mean_n_minus_1;
  RmsNormRowTo(np, 0, p.y + r * p.y_stride, nullptr);
}

// --- LayerNorm --------------------------------------------------------------------------------

constexpr int kLnWarps = 4;

// One warp per row; lane 0 runs cpu::LayerNorm's two fp64 loops in the CPU's order.
__global__ void __launch_bounds__(kLnWarps * 32) LayerNormKernel(LayerNormParams p) {
  dev::GridDependencySync();
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kLnWarps + (threadIdx.x >> 5);
  if (r >= p.rows) return;
  const float* x = p.x + r * p.x_stride;
  double mean = 0.0, inv = 0.0;
  if (lane == 0) {
    for (int64_t i = 0; i < p.n; ++i) mean = __dadd_rn(mean, static_cast<double>(x[i]));
    mean = __ddiv_rn(mean, static_cast<double>(p.n));
    double var = 0.0;
    for (int64_t i = 0; i < p.n; ++i) {
      const double d = __dsub_rn(static_cast<double>(x[i]), mean);
      var = __dadd_rn(var, __dmul_rn(d, d));
    }
    var = __ddiv_rn(var, static_cast<double>(p.n));
    inv = __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var, p.eps)));
  }
  mean = __shfl_sync(0xffffffffu, mean, 0);
  inv = __shfl_sync(0xffffffffu, inv, 0);
  float* y = p.y + r * p.y_stride;
  for (int64_t i = lane; i < p.n; i += 32) {
    const float t = __double2float_rn(__dmul_rn(__dsub_rn(static_cast<double>(x[i]), mean), inv));
    y[i] = __fadd_rn(__fmul_rn(t, p.weight[i]), p.bias[i]);
  }
}

// --- Route ----------------------------------------------------------------------------------

constexpr int kRouteWarps = 4;
constexpr int kRouteMaxGroups = 64;

// Per-warp scratch: scores[E], choice[E] (fp32), state[E] (0 excluded, 1 allowed, 2 chosen).
__host__ __device__ constexpr int64_t RouteWarpBytes(int64_t experts) { return (9 * experts + 15) / 16 * 16; }

// (value descending, id ascending) as one unsigned key; NaN ranks below −∞; every
// candidate's key is > 0.
__device__ __forceinline__ uint64_t RankKey(float v, int e) {
  return (static_cast<uint64_t>(dev::OrderedKey(v)) << 32) | (0xffffffffu - static_cast<uint32_t>(e));
}

// One row's routing by one warp (every lane calls it; only __syncwarp inside): lg is the row's
// logits (global or shared memory), `scratch` RouteWarpBytes(experts) bytes of shared memory
// (16-byte aligned), group_score / group_keep kRouteMaxGroups each; the row's k ids
// (ascending) and weights go to ids / w.
__device__ void RouteWarp(const RouteParams& p, const float* lg, unsigned char* scratch, float* group_score,
                          uint8_t* group_keep, int32_t* ids, float* w, int lane) {
  const int E = static_cast<int>(p.experts);
  float* sc = reinterpret_cast<float*>(scratch);
  float* ch = sc + E;
  uint8_t* state = reinterpret_cast<uint8_t*>(ch + E);

  if (p.gate == GateKind::kSigmoidNoauxTc) {
    for (int e = lane; e < E; e += 32) {
      const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, dev::ExpF(-lg[e])));
      sc[e] = s;
      ch[e] = p.bias != nullptr ? __fadd_rn(s, p.bias[e]) : s;
    }
  } else {
    // cpu::Softmax: m = fmax fold (exact; NaN is fmax's identity, as in the CPU's fold).
    float m = QuietNan();
    for (int e = lane; e < E; e += 32) m = fmaxf(m, lg[e]);
    m = dev::WarpMax(m);
    if (isinf(m) && m < 0.0f) {
      for (int e = lane; e < E; e += 32) sc[e] = 0.0f;
    } else {
      for (int e = lane; e < E; e += 32) sc[e] = dev::ExpF(__fsub_rn(lg[e], m));
      __syncwarp();
      float inv = 0.0f;
      if (lane == 0) {
        double s = 0.0;  // left to right, as the CPU (four values a load: the loads go out ahead)
        int e = 0;
        if (E % 4 == 0) {
          const float4* sc4 = reinterpret_cast<const float4*>(sc);  // scratch is 16-byte aligned
#pragma unroll 4
          for (; e < E; e += 4) {
            const float4 v = sc4[e / 4];
            s = __dadd_rn(__dadd_rn(__dadd_rn(__dadd_rn(s, static_cast<double>(v.x)), static_cast<double>(v.y)),
                                    static_cast<double>(v.z)),
                          static_cast<double>(v.w));
          }
        }
        for (; e < E; ++e) s = __dadd_rn(s, static_cast<double>(sc[e]));
        inv = __double2float_rn(__ddiv_rn(1.0, s));
      }
      inv = __shfl_sync(0xffffffffu, inv, 0);
      __syncwarp();
      for (int e = lane; e < E; e += 32) sc[e] = __fmul_rn(sc[e], inv);
    }
    __syncwarp();
    for (int e = lane; e < E; e += 32) ch[e] = sc[e];
  }
  __syncwarp();

  // Group-limited selection: group score = its max (softmax) or the sum of its top two
  // (sigmoid), from the CPU's sequential scan; keep the topk_group best groups.
  const bool grouped = p.gate != GateKind::kSoftmaxGreedy && p.n_group > 1;
  if (grouped) {
    const int G = static_cast<int>(p.n_group), per = E / G;
    for (int g = lane; g < G; g += 32) {
      float a = -INFINITY, b = -INFINITY;
      for (int j = 0; j < per; ++j) {
        const float v = ch[g * per + j];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      group_score[g] = p.gate == GateKind::kSigmoidNoauxTc ? __fadd_rn(a, b) : a;
      group_keep[g] = 0;
    }
    __syncwarp();
    if (lane == 0) {
      for (int64_t round = 0; round < p.topk_group; ++round) {
        int best = -1;
        uint64_t best_key = 0;
        for (int g = 0; g < G; ++g) {
          const uint64_t key = RankKey(group_score[g], g);
          if (!group_keep[g] && key > best_key) {
            best_key = key;
            best = g;
          }
        }
        group_keep[best] = 1;
      }
    }
    __syncwarp();
    for (int e = lane; e < E; e += 32) state[e] = group_keep[e / per];
  } else {
    for (int e = lane; e < E; e += 32) state[e] = 1;
  }
  __syncwarp();

  // k rounds of a warp argmax by (choice desc, id asc): the prefix of the CPU's stable sort.
  for (int64_t round = 0; round < p.k; ++round) {
    uint64_t best = 0;
    for (int e = lane; e < E; e += 32) {
      if (state[e] == 1) {
        const uint64_t key = RankKey(ch[e], e);
        best = key > best ? key : best;
      }
    }
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, best, o);
      best = other > best ? other : best;
    }
    if (lane == 0) state[0xffffffffu - static_cast<uint32_t>(best & 0xffffffffu)] = 2;
    __syncwarp();
  }

  // ids ascending (each chosen expert's place from a ballot of the chosen); weights = scores,
  // fp64 sum in id order, normalise, scale. The chosen scores go to ch[0, n) in id order (ch
  // is not read after the rounds).
  int n = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const bool chosen = e < E && state[e] == 2;
    const unsigned mask = __ballot_sync(0xffffffffu, chosen);
    if (chosen) {
      const int at = n + __popc(mask & ((1u << lane) - 1u));
      ids[at] = e;
      ch[at] = p.fault_bias_in_weights && p.bias != nullptr ? __fadd_rn(sc[e], p.bias[e]) : sc[e];  // (hidden fault zoo)
    }
    n += __popc(mask);
  }
  __syncwarp();
  float denom = 0.0f;
  if (lane == 0 && p.norm_topk_prob) {
    double sum = 0.0;
    for (int i = 0; i < n; ++i) sum = __dadd_rn(sum, static_cast<double>(ch[i]));
    denom = __fadd_rn(__double2float_rn(sum), 1e-20f);
  }
  denom = __shfl_sync(0xffffffffu, denom, 0);
  for (int i = lane; i < n; i += 32) {
    const float v = p.norm_topk_prob ? __fdiv_rn(ch[i], denom) : ch[i];
    w[i] = __fmul_rn(v, p.routed_scaling_factor);
  }
}

__global__ void __launch_bounds__(kRouteWarps * 32) RouteKernel(RouteParams p, int64_t warp_bytes) {
  dev::GridDependencySync();
  extern __shared__ __align__(16) unsigned char route_smem[];
  __shared__ float group_score[kRouteWarps][kRouteMaxGroups];
  __shared__ uint8_t group_keep[kRouteWarps][kRouteMaxGroups];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (r >= p.rows) return;
  RouteWarp(p, p.logits + r * p.logits_stride, route_smem + warp * warp_bytes, group_score[warp], group_keep[warp],
            p.ids + r * p.k, p.weights + r * p.k, lane);
}

// --- NormRoute ------------------------------------------------------------------------------
//
// A cluster of kNormRouteCluster CTAs a row (RmsNormRowTo's kNormThreads threads each), CTA c
// owning experts [c·per, c·per + per). Shared memory: its router rows [per][n], the row's h [n],
// the row's logits [E] (filled in the first CTA by all of them), Route's scratch.
struct NormRouteLayout {
  size_t h, lg, scratch, total;
};
__host__ __device__ inline NormRouteLayout NormRouteSmem(int64_t experts, int64_t n) {
  const int64_t per = (experts + kNormRouteCluster - 1) / kNormRouteCluster;
  NormRouteLayout L;
  L.h = static_cast<size_t>(per * n) * 4;
  L.lg = L.h + static_cast<size_t>(n) * 4;
  L.scratch = L.lg + static_cast<size_t>((experts + 3) / 4 * 4) * 4;
  L.total = L.scratch + static_cast<size_t>(RouteWarpBytes(experts)) + kRouteMaxGroups * (sizeof(float) + 1);
  return L;
}
constexpr size_t kNormRouteMaxSmem = 200 * 1024;

__global__ void __cluster_dims__(kNormRouteCluster, 1, 1) __launch_bounds__(kNormThreads)
    NormRouteKernel(NormRouteParams p) {
  namespace cg = cooperative_groups;
  extern __shared__ __align__(16) unsigned char smem[];
  const int n = static_cast<int>(p.norm.n), E = static_cast<int>(p.route.experts);
  const NormRouteLayout L = NormRouteSmem(E, n);
  const int per = (E + kNormRouteCluster - 1) / kNormRouteCluster;
  float* w_s = reinterpret_cast<float*>(smem);
  float* h_s = reinterpret_cast<float*>(smem + L.h);
  float* lg_s = reinterpret_cast<float*>(smem + L.lg);
  unsigned char* scratch = smem + L.scratch;
  float* group_score = reinterpret_cast<float*>(scratch + RouteWarpBytes(E));
  uint8_t* group_keep = reinterpret_cast<uint8_t*>(group_score + kRouteMaxGroups);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t r = blockIdx.y;
  const int tid = threadIdx.x;
  const int e0 = rank * per, ne = E - e0 < per ? (E - e0 > 0 ? E - e0 : 0) : per;
  __cluster_barrier_arrive_relaxed();  // (the remote store below: see MoeCombineNormKernel)
  // This CTA's router rows: fixed weights, requested before the wait (launch.cuh).
  const int c4 = n / 4;
  for (int i = tid; i < ne * c4; i += kNormThreads) {
    const int e = i / c4, c = i - e * c4;
    dev::CpAsync16(w_s + static_cast<size_t>(e) * n + 4 * c, p.router + (e0 + e) * p.router_stride + 4 * c);
  }
  dev::CpAsyncCommit();
  dev::GridDependencySync();
  // Every CTA normalises the row itself (RmsNorm's bits, into shared memory; the sum is
  // stored by the first CTA below, once no CTA of the cluster reads x any more).
  RmsNormRowTo(p.norm, r, h_s, nullptr);
  dev::CpAsyncWait<0>();
  __syncthreads();
  // RowDots' products: half-warp j takes expert e0 + j, lane l cpu::Dot's chain l (elements
  // ≡ l mod 16, ascending), then the fold l + 8, 4, 2, 1.
  const int half = tid / 16, l = tid % 16;
  float acc = 0.0f;
  if (half < ne) {
    const float* wr = w_s + static_cast<size_t>(half) * n;
    for (int i = l; i < n; i += 16) acc = __fmaf_rn(h_s[i], wr[i], acc);
  }
  acc = dev::FoldHalfWarp16(acc);
  __cluster_barrier_wait();  // every CTA of the cluster has started
  if (half < ne && l == 0) {
    p.logits[r * p.logits_stride + e0 + half] = acc;
    *cluster.map_shared_rank(lg_s + e0 + half, 0) = acc;
  }
  cluster.sync();  // the row's logits in the first CTA's lg_s; every CTA done with x
  if (rank != 0) return;
  const RouteParams& rp = p.route;
  if (tid < 32) {
    RouteWarp(rp, lg_s, scratch, group_score, group_keep, rp.ids + r * rp.k, rp.weights + r * rp.k, tid);
  }
  const float* a = p.norm.x + r * p.norm.x_stride;
  const float* b = p.norm.add + r * p.norm.add_stride;
  float* y = p.norm.y + r * p.norm.y_stride;
  float* sum = p.norm.sum + r * p.norm.sum_stride;
  for (int i = tid; i < n; i += kNormThreads) {
    y[i] = h_s[i];
    sum[i] = __fadd_rn(a[i], b[i]);  // Add's a + b, as RmsNormRowTo formed it (sum may alias a)
  }
}

Status CheckRows(const char* op, int64_t rows, int64_t n) {
  LS_CHECK_ARG(rows >= 0 && rows < (int64_t{1} << 31), op, "rows", rows);
  LS_CHECK_ARG(n >= 0 && n < (int64_t{1} << 31), op, "n", n);
  return Status::Ok();
}

}  // namespace

Status Embed(const EmbedParams& p, Stream stream) {
  constexpr const char* op = "Embed";
  LS_CHECK_ARG(p.table != nullptr, op, "table", p.table);
  LS_CHECK_ARG(p.ids != nullptr, op, "ids", p.ids);
  LS_CHECK_ARG(p.y != nullptr, op, "y", p.y);
  LS_CHECK_ARG(p.vocab > 0 && p.vocab < (int64_t{1} << 31), op, "vocab", p.vocab);
  LS_CHECK_ARG(p.n > 0, op, "n", p.n);
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  LS_CHECK_ARG(p.y_stride >= p.n, op, "y_stride", p.y_stride);
  if (p.rows == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(EmbedKernel, static_cast<unsigned>(p.rows), 256, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status AddInPlace(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t rows, int64_t n,
                  Stream stream) {
  constexpr const char* op = "AddInPlace";
  LS_CHECK_ARG(y != nullptr, op, "y", static_cast<const void*>(y));
  LS_CHECK_ARG(x != nullptr, op, "x", static_cast<const void*>(x));
  LS_RETURN_IF_ERROR(CheckRows(op, rows, n));
  LS_CHECK_ARG(y_stride >= n, op, "y_stride", y_stride);
  LS_CHECK_ARG(x_stride >= n, op, "x_stride", x_stride);
  if (rows == 0 || n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(AddInPlaceKernel, ElementGrid(rows, n), kElemThreads, 0, stream, y, y_stride, x, x_stride, rows, n));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status Add(float* out, int64_t out_stride, const float* a, int64_t a_stride, const float* b, int64_t b_stride,
           int64_t rows, int64_t n, Stream stream) {
  constexpr const char* op = "Add";
  LS_CHECK_ARG(out != nullptr, op, "out", static_cast<const void*>(out));
  LS_CHECK_ARG(a != nullptr, op, "a", static_cast<const void*>(a));
  LS_CHECK_ARG(b != nullptr, op, "b", static_cast<const void*>(b));
  LS_RETURN_IF_ERROR(CheckRows(op, rows, n));
  LS_CHECK_ARG(out_stride >= n, op, "out_stride", out_stride);
  LS_CHECK_ARG(a_stride >= n, op, "a_stride", a_stride);
  LS_CHECK_ARG(b_stride >= n, op, "b_stride", b_stride);
  if (rows == 0 || n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(AddKernel, ElementGrid(rows, n), kElemThreads, 0, stream, out, out_stride, a,
                                       a_stride, b, b_stride, rows, n));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status Scale(float* x, int64_t stride, int64_t rows, int64_t n, float s, Stream stream) {
  constexpr const char* op = "Scale";
  LS_CHECK_ARG(x != nullptr, op, "x", static_cast<const void*>(x));
  LS_RETURN_IF_ERROR(CheckRows(op, rows, n));
  LS_CHECK_ARG(stride >= n, op, "stride", stride);
  if (rows == 0 || n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(ScaleKernel, ElementGrid(rows, n), kElemThreads, 0, stream, x, stride, rows, n, s));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status ToBf16(const float* x, int64_t x_stride, uint16_t* y, int64_t y_stride, int64_t rows, int64_t n,
              Stream stream) {
  constexpr const char* op = "ToBf16";
  LS_CHECK_ARG(x != nullptr, op, "x", static_cast<const void*>(x));
  LS_CHECK_ARG(y != nullptr, op, "y", static_cast<const void*>(y));
  LS_RETURN_IF_ERROR(CheckRows(op, rows, n));
  LS_CHECK_ARG(x_stride >= n, op, "x_stride", x_stride);
  LS_CHECK_ARG(y_stride >= n, op, "y_stride", y_stride);
  if (rows == 0 || n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(ToBf16Kernel, ElementGrid(rows, n), kElemThreads, 0, stream, x, x_stride, y, y_stride, rows, n));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status SwiGlu(const SwiGluParams& p, Stream stream) {
  constexpr const char* op = "SwiGlu";
  LS_CHECK_ARG(p.g != nullptr, op, "g", p.g);
  LS_CHECK_ARG(p.u != nullptr, op, "u", p.u);
  LS_CHECK_ARG(p.out != nullptr, op, "out", p.out);
  LS_RETURN_IF_ERROR(CheckRows(op, p.rows, p.n));
  LS_CHECK_ARG(p.g_stride >= p.n, op, "g_stride", p.g_stride);
  LS_CHECK_ARG(p.u_stride >= p.n, op, "u_stride", p.u_stride);
  LS_CHECK_ARG(p.out_stride >= p.n, op, "out_stride", p.out_stride);
  if (p.rows == 0 || p.n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(SwiGluKernel, ElementGrid(p.rows, p.n), kElemThreads, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status LayerNorm(const LayerNormParams& p, Stream stream) {
  constexpr const char* op = "LayerNorm";
  LS_CHECK_ARG(p.x != nullptr, op, "x", p.x);
  LS_CHECK_ARG(p.weight != nullptr, op, "weight", p.weight);
  LS_CHECK_ARG(p.bias != nullptr, op, "bias", p.bias);
  LS_CHECK_ARG(p.y != nullptr, op, "y", p.y);
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  LS_CHECK_ARG(p.n > 0 && p.n < (int64_t{1} << 31), op, "n", p.n);
  LS_CHECK_ARG(p.x_stride >= p.n, op, "x_stride", p.x_stride);
  LS_CHECK_ARG(p.y_stride >= p.n, op, "y_stride", p.y_stride);
  LS_CHECK_ARG(p.x != p.y || p.x_stride == p.y_stride, op, "y_stride (in place needs x_stride)", p.y_stride);
  LS_CHECK_ARG(p.eps >= 0.0, op, "eps", p.eps);
  if (p.rows == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(LayerNormKernel, static_cast<unsigned>((p.rows + kLnWarps - 1) / kLnWarps),
                                       kLnWarps * 32, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

static Status CheckRoute(const RouteParams& p) {
  constexpr const char* op = "Route";
  LS_CHECK_ARG(p.logits != nullptr, op, "logits", p.logits);
  LS_CHECK_ARG(p.ids != nullptr, op, "ids", static_cast<const void*>(p.ids));
  LS_CHECK_ARG(p.weights != nullptr, op, "weights", static_cast<const void*>(p.weights));
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  LS_CHECK_ARG(p.experts > 0 && p.experts <= kRouteMaxExperts, op, "experts", p.experts);
  LS_CHECK_ARG(p.k > 0 && p.k <= p.experts, op, "k", p.k);
  LS_CHECK_ARG(p.logits_stride >= p.experts, op, "logits_stride", p.logits_stride);
  LS_CHECK_ARG(p.gate == GateKind::kSoftmaxGreedy || p.gate == GateKind::kSoftmaxGroupLimited ||
                   p.gate == GateKind::kSigmoidNoauxTc,
               op, "gate", static_cast<int>(p.gate));
  if (p.gate != GateKind::kSoftmaxGreedy && p.n_group > 1) {
    LS_CHECK_ARG(p.n_group <= kRouteMaxGroups && p.experts % p.n_group == 0, op, "n_group", p.n_group);
    LS_CHECK_ARG(p.topk_group >= 1 && p.topk_group <= p.n_group, op, "topk_group", p.topk_group);
    // Fewer allowed experts than k would make the CPU pad with expert 0.
    LS_CHECK_ARG(p.k <= p.topk_group * (p.experts / p.n_group), op, "k (> topk_group · experts/n_group)", p.k);
  } else {
    LS_CHECK_ARG(p.n_group >= 1, op, "n_group", p.n_group);
  }
  return Status::Ok();
}

Status Route(const RouteParams& p, Stream stream) {
  LS_RETURN_IF_ERROR(CheckRoute(p));
  if (p.rows == 0) return Status::Ok();
  const int64_t warp_bytes = RouteWarpBytes(p.experts);
  const size_t smem = static_cast<size_t>(warp_bytes * kRouteWarps);  // ≤ 36 KiB at 1024 experts
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(RouteKernel, static_cast<unsigned>((p.rows + kRouteWarps - 1) / kRouteWarps),
                                       kRouteWarps * 32, smem, stream, p, warp_bytes));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

bool NormRouteFits(int64_t experts, int64_t n, int64_t rows) {
  return rows >= 0 && rows <= kMaxGrid && experts > 0 && experts <= int64_t{kNormRouteCluster} * (kNormThreads / 16) && n > 0 &&
         n <= int64_t{kNormCached} * kNormThreads && n % 4 == 0 && NormRouteSmem(experts, n).total <= kNormRouteMaxSmem;
}

Status NormRoute(const NormRouteParams& p, Stream stream) {
  constexpr const char* op = "NormRoute";
  const RmsNormParams& nm = p.norm;
  LS_CHECK_ARG(NormRouteFits(p.route.experts, nm.n, nm.rows), op, "route.experts and norm.n (NormRouteFits)",
               p.route.experts);
  LS_RETURN_IF_ERROR(CheckRmsNorm(nm, op));
  LS_CHECK_ARG(nm.add != nullptr, op, "norm.add (the residual add is part of it)", nm.add);
  LS_CHECK_ARG(p.route.rows == nm.rows, op, "route.rows (≠ norm.rows)", p.route.rows);
  LS_CHECK_ARG(p.router != nullptr && reinterpret_cast<uintptr_t>(p.router) % 16 == 0, op,
               "router (16-byte aligned)", p.router);
  LS_CHECK_ARG(p.router_stride >= nm.n && p.router_stride % 4 == 0, op, "router_stride", p.router_stride);
  LS_CHECK_ARG(p.logits != nullptr, op, "logits", static_cast<const void*>(p.logits));
  LS_CHECK_ARG(p.logits_stride >= p.route.experts, op, "logits_stride", p.logits_stride);
  RouteParams rp = p.route;
  rp.logits = p.logits;
  rp.logits_stride = p.logits_stride;
  LS_RETURN_IF_ERROR(CheckRoute(rp));
  if (nm.rows == 0) return Status::Ok();
  static const cudaError_t attr = cudaFuncSetAttribute(NormRouteKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(kNormRouteMaxSmem));
  LS_CUDA_RETURN_IF_ERROR(attr);
  const dim3 grid(kNormRouteCluster, static_cast<unsigned>(nm.rows));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(NormRouteKernel, grid, kNormThreads,
                                       NormRouteSmem(p.route.experts, nm.n).total, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

static Status CheckMoeCombine(const MoeCombineParams& p, const char* op) {
  LS_CHECK_ARG(p.y != nullptr, op, "y", p.y);
  LS_CHECK_ARG(p.weights != nullptr, op, "weights", p.weights);
  LS_CHECK_ARG(p.out != nullptr, op, "out", p.out);
  LS_RETURN_IF_ERROR(CheckRows(op, p.rows, p.n));
  LS_CHECK_ARG(p.k > 0, op, "k", p.k);
  LS_CHECK_ARG(p.y_stride >= p.n, op, "y_stride", p.y_stride);
  LS_CHECK_ARG(p.shared == nullptr || p.shared_stride >= p.n, op, "shared_stride", p.shared_stride);
  LS_CHECK_ARG(p.out_stride >= p.n, op, "out_stride", p.out_stride);
  return Status::Ok();
}

Status MoeCombine(const MoeCombineParams& p, Stream stream) {
  LS_RETURN_IF_ERROR(CheckMoeCombine(p, "MoeCombine"));
  if (p.rows == 0 || p.n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(MoeCombineKernel, ElementGrid(p.rows, p.n), kElemThreads, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

bool MoeCombineNormFits(int64_t n, int64_t rows) {
  return rows >= 0 && rows <= kMaxGrid && n > 0 && n <= int64_t{kNormCached} * kNormThreads;
}

Status MoeCombineNorm(const MoeCombineNormParams& p, Stream stream) {
  constexpr const char* op = "MoeCombineNorm";
  const MoeCombineParams& c = p.combine;
  LS_CHECK_ARG(MoeCombineNormFits(c.n, c.rows), op, "combine.n (MoeCombineNormFits: ≤ 4096)", c.n);
  LS_RETURN_IF_ERROR(CheckMoeCombine(c, op));
  // The norm part is RmsNorm of x with out added.
  RmsNormParams nm;
  nm.x = p.x;
  nm.x_stride = p.x_stride;
  nm.add = c.out;
  nm.add_stride = c.out_stride;
  nm.sum = p.sum;
  nm.sum_stride = p.sum_stride;
  nm.weight = p.weight;
  nm.eps = p.eps;
  nm.y = p.y;
  nm.y_stride = p.y_stride;
  nm.rows = c.rows;
  nm.n = c.n;
  LS_RETURN_IF_ERROR(CheckRmsNorm(nm, op));
  if (c.rows == 0) return Status::Ok();
  const dim3 grid(kNormRouteCluster, static_cast<unsigned>(c.rows));
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(MoeCombineNormKernel, grid, kNormThreads,
                                       static_cast<size_t>(c.n) * sizeof(float), stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
