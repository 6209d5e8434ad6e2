// kernels/weight_view.cc — see weight_view.h.
#include "kernels/weight_view.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/numerics.h"
#include "kernels/fp4.h"

namespace lockstep::kernels {

const char* WeightDTypeName(WeightDType d) {
  switch (d) {
    case WeightDType::kF32: return "F32";
    case WeightDType::kBf16: return "BF16";
    case WeightDType::kF16: return "F16";
    case WeightDType::kFp8E4m3Blocks: return "F8_E4M3";
    case WeightDType::kMxfp4: return "MXFP4";
    case WeightDType::kNvfp4: return "NVFP4";
  }
  return "?";
}

int ElementBits(WeightDType d) {
  switch (d) {
    case WeightDType::kF32: return 32;
    case WeightDType::kBf16: case WeightDType::kF16: return 16;
    case WeightDType::kFp8E4m3Blocks: return 8;
    case WeightDType::kMxfp4: case WeightDType::kNvfp4: return 4;
  }
  return 0;
}

float WeightView::at(int64_t r, int64_t c) const {
  const int64_t i = (row0 + r) * cols + c;
  switch (dtype) {
    case WeightDType::kF32: return static_cast<const float*>(values)[i];
    case WeightDType::kBf16: return Bf16ToF32(static_cast<const uint16_t*>(values)[i]);
    case WeightDType::kF16: return F16ToF32(static_cast<const uint16_t*>(values)[i]);
    case WeightDType::kFp8E4m3Blocks: {
      const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
      const float scale = static_cast<const float*>(scales)[((row0 + r) / block_rows) * scale_cols + c / block_cols];
      return Fp8E4m3Table()[static_cast<const uint8_t*>(values)[i]] * scale;
    }
    case WeightDType::kMxfp4: case WeightDType::kNvfp4: {
      const uint8_t byte = static_cast<const uint8_t*>(values)[i / 2];
      const float v = E2m1Table()[(i & 1) ? byte >> 4 : byte & 0x0f];
      const uint8_t s = static_cast<const uint8_t*>(scales)[(row0 + r) * ((cols + block_cols - 1) / block_cols) + c / block_cols];
      return dtype == WeightDType::kMxfp4 ? v * E8m0Table()[s] : (v * Fp8E4m3Table()[s]) * scale_2;
    }
  }
  return 0.0f;
}

void WeightView::DecodeRows(int64_t r, int64_t n, float* dst, WeightRounding round) const {
  const int64_t first = row0 + r, count = n * cols;
  switch (dtype) {
    case WeightDType::kF32:
      std::memcpy(dst, static_cast<const float*>(values) + first * cols, static_cast<size_t>(count) * 4);
      break;
    case WeightDType::kBf16: {
      const uint16_t* src = static_cast<const uint16_t*>(values) + first * cols;
      for (int64_t i = 0; i < count; ++i) dst[i] = Bf16ToF32(src[i]);
      break;
    }
    case WeightDType::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(values) + first * cols;
      for (int64_t i = 0; i < count; ++i) dst[i] = F16ToF32(src[i]);
      break;
    }
    case WeightDType::kFp8E4m3Blocks: {
      // value × its block's scale, one fp32 product (Fp8Blocks::Dequantize's).
      const float* table = Fp8E4m3Table();
      const float* sc = static_cast<const float*>(scales);
      const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t* v = static_cast<const uint8_t*>(values) + (first + i) * cols;
        const float* srow = sc + ((first + i) / block_rows) * scale_cols;
        float* d = dst + i * cols;
        for (int64_t c0 = 0, b = 0; c0 < cols; c0 += block_cols, ++b) {
          const float s = srow[b];
          const int64_t c1 = std::min(cols, c0 + block_cols);
          for (int64_t c = c0; c < c1; ++c) d[c] = table[v[c]] * s;
        }
      }
      break;
    }
    case WeightDType::kMxfp4: case WeightDType::kNvfp4: {
      // Per block: the scale looked up once, each nibble's E2M1 value times it (MXFP4: one
      // fp32 product, exact; NVFP4: the exact E2M1 × E4M3 product, then × scale_2 rounded once).
      const float* e2m1 = E2m1Table();
      const float* scale_table = dtype == WeightDType::kMxfp4 ? E8m0Table() : Fp8E4m3Table();
      const bool nv = dtype == WeightDType::kNvfp4;
      const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t* v = static_cast<const uint8_t*>(values) + (first + i) * cols / 2;
        const uint8_t* srow = static_cast<const uint8_t*>(scales) + (first + i) * scale_cols;
        float* d = dst + i * cols;
        for (int64_t c0 = 0, b = 0; c0 < cols; c0 += block_cols, ++b) {
          const float s = scale_table[srow[b]];
          const int64_t c1 = std::min(cols, c0 + block_cols);
          if (nv) {
            for (int64_t c = c0; c < c1; c += 2) {
              d[c] = (e2m1[v[c / 2] & 0x0f] * s) * scale_2;
              d[c + 1] = (e2m1[v[c / 2] >> 4] * s) * scale_2;
            }
          } else {
            for (int64_t c = c0; c < c1; c += 2) {
              d[c] = e2m1[v[c / 2] & 0x0f] * s;
              d[c + 1] = e2m1[v[c / 2] >> 4] * s;
            }
          }
        }
      }
      break;
    }
  }
  if (round == WeightRounding::kBf16) {
    for (int64_t i = 0; i < count; ++i) dst[i] = Bf16ToF32(F32ToBf16(dst[i]));
  }
}

WeightView WeightView::Rows(int64_t first, int64_t n) const {
  WeightView v = *this;
  v.row0 = row0 + first;
  v.rows = n;
  return v;
}

size_t WeightView::stored_bytes() const {
  size_t bytes = static_cast<size_t>(rows * cols) * ElementBits(dtype) / 8;
  if (dtype == WeightDType::kFp8E4m3Blocks && rows > 0) {
    const int64_t block_rows_read = (row0 + rows - 1) / block_rows - row0 / block_rows + 1;
    bytes += static_cast<size_t>(block_rows_read * ((cols + block_cols - 1) / block_cols)) * 4;
  }
  if (dtype == WeightDType::kMxfp4 || dtype == WeightDType::kNvfp4) {
    bytes += static_cast<size_t>(rows * ((cols + block_cols - 1) / block_cols));  // one scale byte a block
  }
  return bytes;
}

}  // namespace lockstep::kernels
