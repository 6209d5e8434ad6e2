// kernels/fp4.h — the 4-bit routed-expert formats: MXFP4 (DeepSeek-V4 as published) and NVFP4
// (ModelOpt's export, nvidia/DeepSeek-V4-Flash-NVFP4): their scalar codes, their quantisers, the
// checkpoint tensors each stores for one expert projection, and the views the loader builds from
// those tensors (WeightDType::kMxfp4 / kNvfp4, dequantised on the fly by WeightView::DecodeRows).
//
// Scalar codes (OCP Microscaling spec v1.0 for E2M1 and E8M0; E4M3 is kernels/cpu/numerics.h's):
//   E2M1: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; codes 0..7 are 0, 0.5, 1, 1.5,
//         2, 3, 4, 6 and 8..15 their negatives (8 is −0); no infinity, no NaN.
//   E8M0: an unsigned exponent, 2^(e − 127); 0x00 is 2^−127 (not zero), 0xFF is NaN.
//
// Storage (docs/models.md, "4-bit routed experts"):
//   MXFP4 `<p>.weight` I8 (or U8) [out, in/2] — byte j of a row holds column 2j in its low
//         nibble, 2j+1 in its high nibble; `<p>.scale` F8_E8M0 (or U8) [out, in/32].
//   NVFP4 `<p>.weight` U8 (or I8) [out, in/2], same nibble order; `<p>.weight_scale` F8_E4M3
//         [out, in/16]; `<p>.weight_scale_2` F32 scalar ([] or [1]); `<p>.input_scale` F32
//         scalar (the activation scale of W4A4 kernels: read by nothing here).
// with <p> the projection's prefix (Fp4ExpertPrefix).
//
// Thread-safety: everything here is a pure function of its arguments.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/weight_view.h"

namespace lockstep::kernels {

// ---- Scalar codes ----------------------------------------------------------------------------

// Every E2M1 code's value (16 entries; index = the nibble).
const float* E2m1Table();
// Every E8M0 byte's value: 2^(e − 127) as fp32 (0x00 → 2^−127, an fp32 subnormal; 0xFF → NaN).
const float* E8m0Table();

// x on the E2M1 grid, rounded to nearest with ties to the even code (the one whose bit 0 is
// 0), saturating at ±6; the sign bit is x < 0, so negative values that round to zero are code 8
// (−0) and −0 itself is code 0 — ModelOpt's _cast_fp4 rule, whose rounding this equals too.
// NaN maps to code 0 — callers that see NaN mark the block instead (see the quantisers).
uint8_t F32ToE2m1(float x);

// ---- Quantisers ------------------------------------------------------------------------------
// What tools/fixtures/fp4_formats.py writes (the same rules, written there independently) and
// what a gemm=mxfp4_dot / nvfp4_dot run builds at load from fp32/bf16 experts.
//
// MXFP4, per block of 32 values of a row: amax = max |x|; the scale is the smallest power of two
//   s = 2^k with amax / s ≤ 6 (k = ⌈log2(amax / 6)⌉, exact: from the float's bits), so no value
//   saturates; k clamped to [−127, 127]; an all-zero block gets k = 0 (byte 127). A block holding
//   a NaN or an infinity gets scale byte 0xFF (NaN: every value of the block decodes to NaN) and
//   codes 0. Codes = F32ToE2m1(x / s) (x / s exact: s is a power of two inside fp32's range, but
//   for k < −126 where it is a subnormal divisor — still exact unless x/s overflows, which the
//   clamp's saturation covers).
// NVFP4 (ModelOpt's recipe), per tensor: scale_2 = amax_tensor / (6·448) in fp32 (1 for an
//   all-zero tensor); per block of 16: sb = e4m3(amax_block / (6·scale_2)) (round-to-nearest-even,
//   saturating at 448; a zero block gets 1.0), codes = F32ToE2m1(x / (E4M3(sb)·scale_2)) with the
//   divisor one fp32 product. A non-finite value anywhere makes scale_2 NaN (the whole tensor NaN).
struct Fp4Matrix {
  WeightDType dtype = WeightDType::kMxfp4;  // kMxfp4 or kNvfp4
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> packed;  // [rows, cols/2]
  std::vector<uint8_t> scales;  // [rows, cols/32] (E8M0) or [rows, cols/16] (E4M3)
  float scale_2 = 1.0f;         // kNvfp4
  // A view of these bytes: `*this` must outlive it.
  WeightView view() const;
};
// m [rows, cols] row-major; cols a multiple of 32 (MXFP4) / 16 (NVFP4).
Fp4Matrix QuantizeMxfp4(const float* m, int64_t rows, int64_t cols);
Fp4Matrix QuantizeNvfp4(const float* m, int64_t rows, int64_t cols);

// ---- Checkpoint tensors ----------------------------------------------------------------------

// Which expert projection: the SwiGLU's gate (w1), up (w3) or down (w2) matrix.
enum class ExpertProj : uint8_t { kGate, kUp, kDown };
// How a checkpoint names its tensors.
enum class Fp4Naming : uint8_t {
  kOfficial,  // DeepSeek's: layers.L.ffn.experts.E.w1 / w3 / w2 (V4-Flash as published)
  kHf,        // per-expert HF names: model.layers.L.mlp.experts.E.gate_proj / up_proj / down_proj
};
// The projection's tensor prefix <p> (without ".weight").
std::string Fp4ExpertPrefix(Fp4Naming naming, int64_t layer, int64_t expert, ExpertProj proj);
// The names of the tensors a format stores for prefix p, in the order the loader reads them:
// MXFP4 {p.weight, p.scale}; NVFP4 {p.weight, p.weight_scale, p.weight_scale_2}.
std::vector<std::string> Fp4TensorNames(WeightDType format, std::string_view prefix);

// One checkpoint tensor as the loader found it (engine::TensorView carries the same fields; this
// layer does not know safetensors). `data` must outlive every view built from it.
struct StoredTensor {
  std::string name;                    // "layers.3.ffn.experts.7.w1.weight"
  std::string dtype;                   // safetensors' spelling: "I8", "U8", "F8_E8M0", "F8_E4M3", "F32"
  std::vector<int64_t> shape;          // as stored
  const void* data = nullptr;          // nbytes bytes
  size_t nbytes = 0;
  std::string file;                    // for messages ("model-00003.safetensors")
};

// The [out, in] view of one projection from its tensors (Fp4TensorNames' order), checked:
// dtypes, shapes ([out, in/2], [out, in/B]; a scalar scale_2), byte counts, in % B == 0.
// A wrong tensor is one line naming it: "model.safetensors: tensor 'layers.0.ffn.experts.1.w1.scale':
// dtype U8, expected F8_E8M0 (MXFP4 block scales)". NVFP4's scale_2 is copied into the view;
// everything else is read in place.
Result<WeightView> Mxfp4View(const StoredTensor& weight, const StoredTensor& scale, int64_t out, int64_t in);
Result<WeightView> Nvfp4View(const StoredTensor& weight, const StoredTensor& weight_scale,
                             const StoredTensor& weight_scale_2, int64_t out, int64_t in);

}  // namespace lockstep::kernels
