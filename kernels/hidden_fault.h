// kernels/hidden_fault.h — the hidden fault zoo: bugs planted INTO THE DEFAULT implementation
// of an op, for testing the debugger the way a real bug meets it (docs/fault-zoo.md).
//
// Unlike --fault (a variant with its own name, written into the trace), a hidden fault is
// switched on only by the environment variable LOCKSTEP_TEST_HIDDEN_FAULT=<name>, read once
// per process, and recorded nowhere: the trace names the default variant, exactly as a build
// with that bug would. Tests only; unset (or empty) = none.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace lockstep::kernels {

enum class HiddenFault {
  kNone,
  kNormMeanOverNMinus1,    // norm: RMSNorm's mean of squares divides by n − 1
  kNormBatchFp32Sum,       // norm: with > 1 request in the step, the sum of squares in fp32 (ULP-level, batch-dependent)
  kRopeDecodeKeyPosMinus1, // rope: decode rows rotate the new key at position p − 1
  kAttnPrefillCausalLeak,  // attention: each prefill query also sees the next prompt token
  kIndexerSkipsSelf,       // indexer: scores keys t < p only (position 0 keeps itself)
  kRouterBiasInWeights,    // router: the correction bias leaks into the expert weights
  kExpertDownKTail,        // expert GEMM: routed experts' down projection skips the K tail past the last 64-tile
  kLmHeadDropsLastHidden,  // LM head: the last hidden element is not multiplied (K loop bound off by one)
  kPageDoubleHandout,      // page state: a request's second and later pages stay on the free list (shared with the next request)
  kSamplerCdfTotalMass,    // sampler: inverse CDF against u × the total mass, not the top-p kept mass
  kKvBf16Truncate,         // kv_quant: the bf16 cache truncates instead of rounding to nearest even
  kKvFp8ScaleFloor,        // kv_quant: the FP8 scale rounds amax/448 DOWN to a power of two and saturates
  kIndexKeyFp8Truncate,    // kv_quant: V3.2's FP8 index keys (indexer=fp8_paged) round toward zero
  // DeepSeek-V4's defaults (engine/v4_*.cc):
  kV4SinkhornOneRoundShort,  // hyper-connections: Sinkhorn runs one (rows, columns) round fewer
  kV4CompressorOverlapNoBias,  // compressor: CSA's previous-window slots pool without their position bias
  kV4HashRouteNextToken,     // router: hash layers route token t by tid2eid of t + 1
  kSoftmaxScaleNopeDim,      // config: MLA's softmax scale from qk_nope_head_dim alone (every backend)
  kConfigScalingFactorDropped,  // config: the parser leaves routed_scaling_factor at 1 (every backend)
  // The CUDA backend's defaults (kernels/cuda/, engine/cuda_blocks.cc): the GPU's bits wrong, the
  // CPU's right — a GPU trace's verify (golden twins on the CPU) must find them.
  kCudaNormMeanOverNMinus1,   // norm: the CUDA RMSNorm row (every kernel that normalises) divides by n − 1
  kCudaLatentRopePosMinus1,   // rope: the latent-cache path kernel rotates the shared key at p − 1
  kCudaRouteBiasInWeights,    // router: the CUDA routing warp takes the weights from score + bias
  kCudaExpertDownKTail,       // gemm: the CUDA backend's routed-expert down GEMM runs K to the last full 64-tile
};

struct HiddenFaultInfo {
  HiddenFault id;
  std::string_view name;   // LOCKSTEP_TEST_HIDDEN_FAULT value
  std::string_view op;     // the registry op whose default it breaks ("router", "sampler": ops without variants)
  std::string_view what;
  std::string_view backend = "cpu";  // where it lives: "cpu" (the CPU engine), "cuda", or both
};

const std::vector<HiddenFaultInfo>& HiddenFaults();
// The active one (LOCKSTEP_TEST_HIDDEN_FAULT, read on first call); an unknown name is an error.
Result<HiddenFault> ActiveHiddenFault();
// ActiveHiddenFault() where an error cannot be returned (kNone then; Engine::Create reports it).
HiddenFault HiddenFaultOrNone();

}  // namespace lockstep::kernels
