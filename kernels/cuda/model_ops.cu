// kernels/cuda/model_ops.cu — the forward pass's remaining kernels: embedding gather,
// residual add, scale, bf16 conversion, SwiGLU, LayerNorm, MoE routing, the grouped expert
// GEMM and the MoE combine. Contracts in ops.h; each mirrors engine/model.cc or
// kernels/cpu/ops.cc operation by operation (__f*_rn / __d*_rn spell every rounding).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/expert_tc.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla_combine.cuh"
#include "kernels/cuda/norm_row.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {
namespace {

constexpr int64_t kMaxGrid = 65535;  // grid.y / grid.z limit

constexpr int kElemThreads = 256;

__device__ __forceinline__ float QuietNan() { return __uint_as_float(0x7fc00000u); }

// Grid over [rows, n]: x covers columns in blocks of 256, y covers rows; both loop so any
// shape fits the grid limits.
dim3 ElementGrid(int64_t rows, int64_t n) {
  const int64_t bx = (n + kElemThreads - 1) / kElemThreads;
  return dim3(static_cast<unsigned>(bx < 4096 ? bx : 4096), static_cast<unsigned>(rows < kMaxGrid ? rows : kMaxGrid));
}
#define LS_FOR_EACH_ELEMENT(rows, n)                                                        \
  for (int64_t r = blockIdx.y; r < (rows); r += gridDim.y)                                  \
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; i < (n); \
         i += static_cast<int64_t>(gridDim.x) * kElemThreads)

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

// cpu::SwiGlu's element: (g / (1 + exp(−g))) · u (also ExpertGemm's swiglu epilogue).
__device__ __forceinline__ float SwiGluOf(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, dev::ExpF(-g))), u);
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
      ch[at] = sc[e];
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
    e = p.ids[slot];
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
        const int32_t id = p.ids[i];
        match = id == e;
        if (blockIdx.y == 0 && (id < 0 || id >= p.experts)) {
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
constexpr int kFwBlk = 256;  // weight elements per row per stage
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
    e = p.ids[slot];
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
          const int32_t id = p.ids[i];
          if (id == e) bits |= 1u << j;
          if (police && (id < 0 || id >= p.experts)) {
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
constexpr int kSwTileIn = 4096;   // x values staged at once

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
  const int e = p.ids[slot];
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
// SM, one wave (decode 383 → 394 tok/s, H200, docs/performance.md, eighth session). Speed only:
// the depth changes no arithmetic.
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
  const int e = p.ids[slot];
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

// The bulk path's ring for `p`: slots of 512 values (half the copies and barrier waits of 256)
// when the grid then fits on the GPU in one wave, else 256-value slots, whose shallower rings
// fit more CTAs on an SM (routed down at one token: 768 CTAs). `one_wave` tells whether either
// does. Speed only: the slot size changes no arithmetic.
struct BulkShape {
  int blk, stages;
  bool one_wave;
};
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
// order is fixed by `in` (ExpertGemmParams); gpu_model_ops_test runs every shape and compares bits.
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
