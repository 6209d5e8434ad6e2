// engine/ffn_blocks.h — the FFN blocks every DeepSeek generation's CPU forward pass shares
// (engine-internal): the SwiGLU MLP (dense layers, each routed expert, the shared experts; V4's
// clamped form) and the routed experts' dispatch and combine. A family brings its router (V2's
// group-limited softmax, V3's sigmoid noaux_tc — RouteExperts —, V4's sqrt-softplus and hash
// routing) and calls these with the ids and weights it chose.
//
// Batch invariance: each (row, slot) result of the experts lands in its own place and a row's
// output sums its slots in slot order (ascending expert id), so no sum depends on which rows
// share the step or how many went to an expert.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "engine/gemm.h"
#include "engine/weights.h"

namespace lockstep::engine {

// y = down(SwiGLU(gate(x), up(x)))                            x [rows, in] → y [rows, out]
// `clamp` (DeepSeek-V4's swiglu_limit L): gate ≤ L and up in [−L, L] before the SwiGLU.
void SwiGluMlp(const Gemm& gemm, const MlpWeights& m, const float* x, int64_t rows, float* y,
               std::optional<float> clamp = std::nullopt);

// expert(e, xin, n, yout): expert e on n rows xin [n, H] → yout [n, H].
using ExpertFn = std::function<void(int64_t e, const float* xin, int64_t n, float* yout)>;

// The routed experts of a step: ids [R, k] (each row's experts, any order, repeats allowed) and
// x [R, H] → slot [R·k, H], slot r·k + j = expert ids[r·k + j] on row r. Each expert runs once,
// on its rows in (row, slot) order; experts nobody chose do not run.
void DispatchExperts(const int32_t* ids, int64_t R, int64_t k, int64_t E, int64_t H, const float* x,
                     const ExpertFn& expert, float* slot);

// How a row's weighted slots accumulate: w·y then a rounded add (V2/V3's reference), or one fused
// multiply-add (V4's, cpu::Axpy).
enum class ExpertCombine { kMulAdd, kFma };
// y[r] = Σ_j wts[r·k + j] · slot[r·k + j] in slot order, then + shared[r] (shared [R, H]: the
// shared experts' output, zeros when the model has none).
void CombineExperts(const float* slot, const float* wts, int64_t R, int64_t k, int64_t H, const float* shared,
                    ExpertCombine how, float* y);

}  // namespace lockstep::engine
