// kernels/weight_view.h — a weight matrix as the checkpoint stores it, read in place.
//
// A WeightView names a stored matrix's bytes (usually inside a memory-mapped safetensors file)
// and its format; it owns nothing. Kernels dequantise the rows they need, when they need them,
// into fp32 (DecodeRows) — the CPU reference's GEMM does it per block of rows into a small
// thread-local scratch (kernels/cpu/ops.h, MatMulNT over a WeightView) — so a model's weights
// cost the bytes of its file, not 4 bytes a parameter.
//
// Every dtype decodes to exactly the fp32 value the engine computed with when it converted
// whole checkpoints at load: bf16 and f16 widened, FP8 e4m3 × its block's scale as one fp32
// product (Fp8E4m3Table()[byte] × scale). WeightRounding::kBf16 then rounds each decoded value
// to bf16 (F32ToBf16, nearest-even) — what gemm=bf16 computes with.
//
// Lifetime: the bytes must outlive the view (engine::Matrix pairs a view with what keeps its
// bytes alive). Thread-safety: a view is immutable; any number of threads may decode from it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lockstep::kernels {

// How a stored matrix's elements are encoded. Each dtype fixes its element size and its scale
// format (kernels/fp4.h has the 4-bit formats' scalar codes, quantisers and loaders). The GEMM
// and the engine read any dtype through DecodeRows.
enum class WeightDType : uint8_t {
  kF32,
  kBf16,
  kF16,
  kFp8E4m3Blocks,  // e4m3 (fn) bytes; one fp32 scale per block_rows × block_cols block
  // E2M1 codes two a byte — column 2j in the LOW nibble (bits 3..0) of byte j, 2j+1 in the high —
  // and one E8M0 scale byte per 1 × 32 block (block_rows 1, block_cols 32): value = E2M1 × 2^(e−127),
  // one fp32 product (exact unless it overflows: e ≥ 253 with |E2M1| ≥ 4, e = 254 with ≥ 2; e = 255
  // is NaN). DeepSeek-V4's routed experts as published.
  kMxfp4,
  // E2M1 pairs as kMxfp4, one E4M3 scale byte per 1 × 16 block (block_cols 16) and the per-tensor
  // fp32 `scale_2`: value = (E2M1 × E4M3) × scale_2 — the first product exact (at most 6
  // significant bits), so the value is the exact triple product rounded once. ModelOpt's NVFP4.
  kNvfp4,
};

const char* WeightDTypeName(WeightDType d);  // "F32", "BF16", "F16", "F8_E4M3", "MXFP4", "NVFP4"
int ElementBits(WeightDType d);              // 32, 16, 16, 8, 4, 4

// What a kernel does to each decoded value before it multiplies.
enum class WeightRounding : uint8_t {
  kAsStored,  // the decoded fp32 value
  kBf16,      // rounded to bf16 (nearest-even; NaN stays NaN, made quiet): gemm=bf16's weights
};

// Rows [row0, row0 + rows) of a stored matrix [stored_rows, cols], row-major.
struct WeightView {
  WeightDType dtype = WeightDType::kF32;
  int64_t rows = 0, cols = 0;  // the view's shape: [rows, cols]
  int64_t row0 = 0;            // the view's first row in the stored matrix (Rows())
  // The stored matrix's elements from its row 0: element (row0 + r, c) of the view's (r, c)
  // at bit offset ((row0 + r)·cols + c)·ElementBits. Aligned to the element size (the loader
  // copies a tensor a file leaves unaligned).
  const void* values = nullptr;
  // kFp8E4m3Blocks: fp32 [⌈stored_rows / block_rows⌉, ⌈cols / block_cols⌉], the scale of
  // element (R, c) at [R / block_rows, c / block_cols] (DeepSeek-V3's `weight_scale_inv`:
  // dequantised = value × scale). kMxfp4 / kNvfp4: one byte a block (E8M0 / E4M3), the same
  // indexing with block_rows 1. Null for the unscaled dtypes.
  const void* scales = nullptr;
  int64_t block_rows = 0, block_cols = 0;
  float scale_2 = 1.0f;  // kNvfp4's per-tensor scale (`weight_scale_2`); unused otherwise

  size_t size() const { return static_cast<size_t>(rows * cols); }  // elements
  bool empty() const { return rows * cols == 0; }
  // Element i = r·cols + c of the view, dequantised (the slow path: tests, one-off reads).
  float operator[](int64_t i) const { return at(i / cols, i % cols); }
  float at(int64_t r, int64_t c) const;
  // Rows [r, r + n) of the view into dst [n, cols], dequantised and rounded as asked.
  void DecodeRows(int64_t r, int64_t n, float* dst, WeightRounding round = WeightRounding::kAsStored) const;
  // The view of rows [first, first + n) of this one.
  WeightView Rows(int64_t first, int64_t n) const;
  // The elements in place when stored as fp32 (row r at f32() + r·cols), else null.
  const float* f32() const {
    return dtype == WeightDType::kF32 ? static_cast<const float*>(values) + row0 * cols : nullptr;
  }
  // Bytes of the stored matrix this view reads: its elements and its rows' scales.
  size_t stored_bytes() const;
};

}  // namespace lockstep::kernels
