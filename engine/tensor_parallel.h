// engine/tensor_parallel.h — tensor parallelism emulated on one device (--emulate-tp N).
//
// A TP=N deployment of an MLA model splits the attention heads and the MLPs' intermediate dims
// across N ranks and the routed experts in contiguous blocks (EP); each rank's o_proj and
// down projections then reduce over its own slice only, and an all-reduce sums the N partial
// outputs after the attention block and after the FFN. Everything else — the column-parallel
// projections, the replicated latent cache, the router — gives the same bits as one device.
// The emulation computes exactly those partials, each with the product a rank would run on its
// slice (cpu::MatMulNTCols: the rank's own lane order), and sums them by the plan's all-reduce
// variant. docs/parallelism.md says what is modelled and what is not.
//
// Thread-safety: free functions over caller-owned buffers.
#pragma once

#include <cstdint>
#include <string_view>

#include "base/status.h"
#include "engine/config.h"
#include "engine/gemm.h"
#include "kernels/plan.h"

namespace lockstep::engine {

// The largest emulated degree (a flag past it is refused).
inline constexpr int kMaxEmulatedTp = 64;

// Whether tap `name` (a layer tap: "layers.L.attn.q") holds columns rank by rank under TP:
// the heads' queries and outputs (column-parallel: rank r's heads' block) and the ranks'
// partial outputs (attn.partials, ffn.partials: rank r's H values). Rank shards keep these.
bool IsRankSplitTap(std::string_view name);

// Rank r's share [begin, end) of n items split `ranks` ways.
struct Shard {
  int64_t begin = 0, end = 0;
};
inline Shard ShardOf(int64_t n, int ranks, int r) { return {n * r / ranks, n * (r + 1) / ranks}; }

// Whether `c` splits `ranks` ways: heads, every MLP's intermediate size and the routed experts
// divisible by it; V2–V3.2 only. The message names the field.
Status CheckTensorParallel(const ModelConfig& c, int64_t ranks, const char* flag = "--emulate-tp");

// The partial outputs of the row-parallel y = x·wᵀ (x: [rows, w.cols], w: [out, in]), laid out
// [rows][ranks][out] (a row's partials side by side: the attn.partials / ffn.partials taps):
// rank r's over input dims ShardOf(in / unit, ranks, r) × unit (unit: a head's width for
// o_proj, 1 for an intermediate dim). Each rank's slice of x is rounded as that rank holds it
// (gemm=w8a8_dot's FP8 tiles of 128 from the slice's start), so a slice that does not end on a
// tile of the whole row rounds as on the real rank, not as at TP 1.
void RowParallelPartials(const Gemm& gemm, const float* x, int64_t rows, const Matrix& w, int ranks, int64_t unit,
                         float* partials);

// Rank mode (a real rank, not the emulation): rank `rank`'s partial alone, y [rows][out], from
// x_local [rows, its slice] — RowParallelPartials' rank `rank` bit for bit (activations rounded
// element by element, or FP8 in 128-value blocks from the slice's start).
void RowParallelRank(const Gemm& gemm, const float* x_local, int64_t rows, const Matrix& w, int ranks, int64_t unit,
                     int rank, float* y);

// y[i, j] = the sum over ranks of partials[i][r][j] ([rows][ranks][cols]) in `v`'s order:
// kOrdered rank 0, 1, …; kRing the buffer cut into `ranks` chunks, chunk c from rank c + 1 round
// to rank c; kFaultRotateByRow row i from rank i mod N. Left to right in fp32.
void AllReduce(kernels::AllReduce v, const float* partials, int ranks, int64_t rows, int64_t cols, float* y);

}  // namespace lockstep::engine
