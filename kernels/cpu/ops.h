// kernels/cpu/ops.h — the CPU reference kernels (fp32).
//
// Determinism contract: every output element is computed by a fixed sequence of fp32
// operations that depends only on the operand lengths — never on how many rows are in the
// batch, which thread computes it, or where the row sits in memory. That is what makes a
// request's bits independent of what it is batched with (docs/determinism.md). Threads split
// work by output element, never inside a reduction.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/weight_view.h"

namespace lockstep::kernels::cpu {

// exp(v) correctly rounded to fp32 (in practice): the double exp rounded once. glibc's expf is 1
// ulp off in ~0.06 % of inputs; this is the CUDA kernels' value (kernels/cuda/device_math.cuh ExpF), so
// SwiGLU, the routers' softmax and sigmoid and MLA's softmax give the same bits on either backend.
inline float ExpF(float v) { return static_cast<float>(std::exp(static_cast<double>(v))); }

// Work (multiply-adds) below which a kernel stays on one thread (see MatMulNT).
inline constexpr int64_t kParallelMacs = int64_t{1} << 22;

// Σ a[i]·b[i] with 16 interleaved fp32 FMA accumulators (lane = i mod 16), folded by a fixed
// pairwise tree. The order depends on n alone.
float Dot(const float* a, const float* b, int64_t n);

// y[r, j] = Σ_k x[r, k] · w[j, k]   x: [rows, in], w: [out, in] row-major, y: [rows, out].
// Each y element is Dot(x_r, w_j, in), bit for bit, however the loops are blocked.
void MatMulNT(const float* x, int64_t rows, const float* w, int64_t out, int64_t in, float* y);
// The same over a weight as stored: w [out = w.rows, in = w.cols] dequantised block by block of
// rows into a thread-local scratch (WeightView::DecodeRows, rounded as `round` says) and
// multiplied there — each y element is Dot(x_r, the decoded row j), so it equals MatMulNT over
// an fp32 copy of the decoded (and rounded) matrix bit for bit. An fp32 view without rounding
// is read in place.
void MatMulNT(const float* x, int64_t rows, const WeightView& w, WeightRounding round, float* y);
// One rank's share of a row-parallel product (emulated tensor parallelism): y[r, j] =
// Dot(x_r[k0:k1], w_j[k0:k1], k1 − k0) — what that rank's own MatMulNT over its slice of the
// input dim gives, bit for bit (the lanes start at k0 as they start at 0 on the rank).
// x: [rows, w.cols]; y: rows `ldy` elements apart, w.rows values each.
void MatMulNTCols(const float* x, int64_t rows, const WeightView& w, WeightRounding round, int64_t k0, int64_t k1,
                  float* y, int64_t ldy);
// The same with explicit row strides (elements): x rows `ldx` apart, w rows `ldw` apart, y
// rows `ldy` apart.
void MatMulNTStrided(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int64_t out,
                     int64_t in, float* y, int64_t ldy);

// y = x · rsqrt(mean(x²) + eps) · weight, per row of length n (sum of squares in fp64).
void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t n, double eps, float* y);

// RmsNorm in the CUDA kernels' order (norm=lanes256): the sum of squares in fp32, lane t of 256
// accumulating x[i]² by FMA for i ≡ t (mod 256) in ascending i; each 32 lanes folded by a
// butterfly (offsets 16, 8, 4, 2, 1); the 8 sums as ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); then
// inv = 1 / sqrt(s / n + eps) in fp32 (eps rounded to fp32) and y = weight · (x · inv) — the bits of
// kernels/cuda's RmsNorm and of every kernel that normalises a row with it.
void RmsNormLanes256(const float* x, const float* weight, int64_t rows, int64_t n, double eps, float* y);

// LayerNorm with weight and bias (biased variance, fp64 statistics), per row of length n.
void LayerNorm(const float* x, const float* weight, const float* bias, int64_t rows, int64_t n, double eps, float* y);

// In-place softmax over n values; max-subtracted, exp by ExpF, fp64 sum.
void Softmax(float* x, int64_t n);


// out[i] = silu(gate[i]) · up[i], silu(g) = g / (1 + exp(−g)) with exp correctly rounded to fp32
void SwiGlu(const float* gate, const float* up, int64_t n, float* out);

// RoPE over one vector of `dim` values at one position. cos/sin hold dim/2 entries (one per
// frequency, attention factor already applied). Layouts as in engine/config.h RopeStyle.
void RopePairsAdjacent(float* x, const float* cos, const float* sin, int64_t dim);
void RopePairsToHalves(float* x, const float* cos, const float* sin, int64_t dim);
void RopeHalves(float* x, const float* cos, const float* sin, int64_t dim);

// In-place Walsh–Hadamard transform (Sylvester order) scaled by n^-1/2, n a power of two:
// the orthogonal rotation DeepSeek-V3.2's indexer applies to q and k before FP8 quantisation.
void Hadamard(float* x, int64_t n);

// y += a · x over n values (fixed order).
void Axpy(float a, const float* x, int64_t n, float* y);

// One head's MLA attention over n keys in the CUDA kernels' order (kernels/mla_splits.h;
// kernels/cuda/mla_decode.cu and mla_combine.cuh compute the same bits): out[C] = Σ_j
// softmax(scores)_j · rows[j], where key j is masked when rows[j] is null (its score unread).
// The keys are cut into MlaNumSplits(n) splits of MlaSplitKeysOf(n); each split walks its
// keys in tiles of 32 with an online softmax —
//   m' = max(m, the tile's max), p_t = ExpF(s_t − m'), α = ExpF(m − m') (0 from m = −∞),
//   l = l·α + Σ_t p_t (a 32-lane butterfly: lanes i and i ⊕ 16, then ⊕ 8, … ⊕ 1),
//   o = o·α, then o = fma(p_t, row_t, o) for t ascending
// (a masked key, or one past the split's end in its last tile, is p = 0 against a row of
// zeros; each operation rounded once) — and the splits are merged in ascending order:
// M = max m_s, f_s = ExpF(m_s − M), L = Σ_s l_s·f_s, out = (Σ_s fma o_s·f_s) / L, 0 where
// L = 0 (no unmasked key). The online form's o is the softmax's numerator; its one division
// comes last. Returns L (and *max_out = M when set).
float MlaAttend(const float* scores, const float* const* rows, int64_t n, int64_t C, float* out,
                float* max_out = nullptr);

}  // namespace lockstep::kernels::cpu
