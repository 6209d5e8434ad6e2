// engine/tensor_parallel.cc — see tensor_parallel.h.
#include "engine/tensor_parallel.h"

#include <algorithm>
#include <string>
#include <vector>

#include "engine/tap.h"
#include "kernels/cpu/ops.h"

namespace lockstep::engine {

bool IsRankSplitTap(std::string_view name) {
  if (name.rfind("layers.", 0) != 0) return false;
  const size_t dot = name.find('.', 7);  // after the layer index
  if (dot == std::string_view::npos) return false;
  const std::string_view tap = name.substr(dot + 1);
  for (TapId t : {kTapQ, kTapHeads, kTapAttnPartials, kTapFfnPartials}) {
    if (tap == kLayerTaps[t].name) return true;
  }
  return false;
}

Status CheckTensorParallel(const ModelConfig& c, int64_t ranks, const char* flag) {
  if (ranks < 1 || ranks > kMaxEmulatedTp) {
    return Status::InvalidArgument(std::string(flag) + " " + std::to_string(ranks) + ": not in 1.." + std::to_string(kMaxEmulatedTp));
  }
  if (ranks == 1) return Status::Ok();
  if (c.is_v4()) {
    return Status::Unsupported(std::string(flag) + " " + std::to_string(ranks) +
                               ": DeepSeek-V4's blocks are not sharded yet (V2, V3 and V3.2 are)");
  }
  auto need = [&](const char* field, int64_t v) -> Status {
    if (v % ranks != 0) {
      return Status::InvalidArgument(std::string(flag) + " " + std::to_string(ranks) + ": config.json's " + field + " " +
                                     std::to_string(v) + " does not split " + std::to_string(ranks) + " ways");
    }
    return Status::Ok();
  };
  LS_RETURN_IF_ERROR(need("num_attention_heads", c.num_attention_heads));
  bool dense = false, moe = false;
  for (const auto& l : c.layers) (l.ffn == FfnKind::kDense ? dense : moe) = true;
  if (dense) LS_RETURN_IF_ERROR(need("intermediate_size", c.intermediate_size));
  if (moe) {
    LS_RETURN_IF_ERROR(need("n_routed_experts", c.n_routed_experts));
    if (c.n_shared_experts > 0) LS_RETURN_IF_ERROR(need("moe_intermediate_size × n_shared_experts", c.moe_intermediate_size * c.n_shared_experts));
  }
  return Status::Ok();
}

namespace {
// x [rows, in] as the product sees it: bf16 / FP8 rounding is element- or block-wise on the row,
// as Gemm does (into buf), or x itself.
const float* Rounded(const Gemm& gemm, const float* x, int64_t rows, int64_t in, std::vector<float>* buf) {
  if (!gemm.bf16 && !gemm.act_fp8) return x;
  buf->resize(rows * in);
  for (int64_t r = 0; r < rows; ++r) {
    if (gemm.act_fp8) {
      Fp8RoundTrip(x + r * in, in, &(*buf)[r * in]);
    } else {
      for (int64_t i = 0; i < in; ++i) (*buf)[r * in + i] = kernels::Bf16ToF32(kernels::F32ToBf16(x[r * in + i]));
    }
  }
  return buf->data();
}
}  // namespace

void RowParallelRank(const Gemm& gemm, const float* x_local, int64_t rows, const Matrix& w, int ranks, int64_t unit,
                     int rank, float* y) {
  const int64_t out = w.rows, in = w.cols;
  const Shard s = ShardOf(in / unit, ranks, rank);
  const int64_t k0 = s.begin * unit, n = (s.end - s.begin) * unit;
  std::vector<float> xr;
  const float* xs = Rounded(gemm, x_local, rows, n, &xr);
  // MatMulNTCols reads columns [k0, k0 + n) of rows `in` apart: the slice where it lies in a
  // whole row (the rest is never read).
  std::vector<float> whole(static_cast<size_t>(rows) * in);
  for (int64_t r = 0; r < rows; ++r) std::copy(xs + r * n, xs + (r + 1) * n, &whole[r * in + k0]);
  kernels::cpu::MatMulNTCols(whole.data(), rows, w.data, gemm.weights(), k0, k0 + n, y, out);
}

void RowParallelPartials(const Gemm& gemm, const float* x, int64_t rows, const Matrix& w, int ranks, int64_t unit,
                         float* partials) {
  const int64_t out = w.rows, in = w.cols, units = in / unit;
  // Each rank's slice of the activations as its product sees them: rounded as a rank holds it
  // (FP8's tiles of 128 start at the slice, RowParallelRank's bits), then its columns.
  std::vector<float> xr;
  if (gemm.bf16 || gemm.act_fp8) xr.resize(static_cast<size_t>(rows) * in);
  std::vector<float> slice;
  for (int r = 0; r < ranks; ++r) {
    const Shard s = ShardOf(units, ranks, r);
    const int64_t k0 = s.begin * unit, n = (s.end - s.begin) * unit;
    if (xr.empty()) continue;
    slice.resize(static_cast<size_t>(rows) * n);
    for (int64_t i = 0; i < rows; ++i) std::copy(x + i * in + k0, x + i * in + k0 + n, &slice[i * n]);
    std::vector<float> rounded;
    const float* sr = Rounded(gemm, slice.data(), rows, n, &rounded);
    for (int64_t i = 0; i < rows; ++i) std::copy(sr + i * n, sr + (i + 1) * n, &xr[i * in + k0]);
  }
  const float* xs = xr.empty() ? x : xr.data();
  for (int r = 0; r < ranks; ++r) {
    const Shard s = ShardOf(units, ranks, r);
    kernels::cpu::MatMulNTCols(xs, rows, w.data, gemm.weights(), s.begin * unit, s.end * unit, partials + r * out,
                               ranks * out);
  }
}

void AllReduce(kernels::AllReduce v, const float* partials, int ranks, int64_t rows, int64_t cols, float* y) {
  const int64_t n = rows * cols, chunk = (n + ranks - 1) / ranks;
  for (int64_t e = 0; e < n; ++e) {
    const int64_t i = e / cols, j = e % cols;
    int first = 0;  // the rank whose partial the sum starts from
    if (v == kernels::AllReduce::kRing) first = static_cast<int>((e / chunk + 1) % ranks);
    if (v == kernels::AllReduce::kFaultRotateByRow) first = static_cast<int>(i % ranks);
    const float* p = partials + i * ranks * cols + j;
    float s = p[first * cols];
    for (int k = 1; k < ranks; ++k) s += p[((first + k) % ranks) * cols];
    y[e] = s;
  }
}

}  // namespace lockstep::engine
