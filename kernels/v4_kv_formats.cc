// kernels/v4_kv_formats.cc — see v4_kv_formats.h.
#include "kernels/v4_kv_formats.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "kernels/cpu/numerics.h"

namespace lockstep::kernels {

std::string_view V4KvFormatName(V4KvFormat f) {
  switch (f) {
    case V4KvFormat::kFp32: return "fp32";
    case V4KvFormat::kBf16: return "bf16";
    case V4KvFormat::kFp8Model1: return "fp8_model1";
  }
  return "?";
}

std::string_view V4IndexKeyFormatName(V4IndexKeyFormat f) { return f == V4IndexKeyFormat::kFp32 ? "fp32" : "fp8"; }

Result<V4KvFormat> ParseV4KvFormat(std::string_view s, std::string_view flag) {
  if (s == "fp32") return V4KvFormat::kFp32;
  if (s == "bf16") return V4KvFormat::kBf16;
  if (s == "fp8_model1" || s == "fp8_e4m3") return V4KvFormat::kFp8Model1;
  return Status::InvalidArgument(std::string(flag) + " " + std::string(s) +
                                 ": unknown DeepSeek-V4 KV-cache format (fp32, bf16, fp8_model1 — alias fp8_e4m3)");
}

Result<V4IndexKeyFormat> ParseV4IndexKeyFormat(std::string_view s, std::string_view flag) {
  if (s == "fp32") return V4IndexKeyFormat::kFp32;
  if (s == "fp8") return V4IndexKeyFormat::kFp8;
  return Status::InvalidArgument(std::string(flag) + " " + std::string(s) +
                                 ": unknown DeepSeek-V4 indexer-key format (fp32, fp8)");
}

int64_t V4RowShape::token_bytes(V4KvFormat f) const {
  switch (f) {
    case V4KvFormat::kFp32: return 4 * head_dim;
    case V4KvFormat::kBf16: return 2 * head_dim;
    case V4KvFormat::kFp8Model1: return model1_data_bytes() + model1_scale_bytes();
  }
  return 0;
}

int64_t V4RowShape::page_bytes(V4KvFormat f, int64_t page_size) const {
  const int64_t raw = page_size * token_bytes(f);
  if (f != V4KvFormat::kFp8Model1) return raw;
  return (raw + kModel1PageAlign - 1) / kModel1PageAlign * kModel1PageAlign;
}

Status CheckV4RowShape(const V4RowShape& s) {
  if (s.head_dim <= 0 || s.rope_dim < 0 || s.rope_dim >= s.head_dim) {
    return Status::InvalidArgument("V4 KV row: head_dim " + std::to_string(s.head_dim) + ", rope_dim " +
                                   std::to_string(s.rope_dim) + " (need 0 ≤ rope_dim < head_dim)");
  }
  return Status::Ok();
}

namespace {

// The smallest k with 2^k ≥ v, for finite v > 0 (exact: from frexp, v = m·2^e, m ∈ [0.5, 1)).
int CeilLog2(float v) {
  int e;
  const float m = std::frexp(v, &e);
  return m == 0.5f ? e - 1 : e;
}

// amax of n values, or a negative value when one is not finite.
float TileAmax(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return -1.0f;
    amax = std::max(amax, std::fabs(x[i]));
  }
  return amax;
}

void PutBf16(float v, uint8_t* dst) {
  const uint16_t h = F32ToBf16(v);
  std::memcpy(dst, &h, 2);
}

float GetBf16(const uint8_t* src) {
  uint16_t h;
  std::memcpy(&h, src, 2);
  return Bf16ToF32(h);
}

// e4m3(x / 2^k) for n values; a NaN tile (k == INT_MIN) is 0x7F throughout.
void QuantizeTile(const float* x, int64_t n, int k, uint8_t* q) {
  if (k == INT_MIN) {
    std::memset(q, 0x7f, static_cast<size_t>(n));
    return;
  }
  const float inv = std::ldexp(1.0f, -k);  // exact: 2^−k is normal for k in [−22, 126]
  for (int64_t i = 0; i < n; ++i) q[i] = F32ToFp8E4m3(x[i] * inv);
}

}  // namespace

int Model1TileExponent(const float* x, int64_t n) {
  const float amax = TileAmax(x, n);
  if (amax < 0) return INT_MIN;
  return CeilLog2(std::max(amax / kFp8E4m3Max, 1e-4f));
}

int IndexKeyTileExponent(const float* x, int64_t n) {
  const float amax = TileAmax(x, n);
  if (amax < 0) return INT_MIN;
  return CeilLog2(std::max(amax, 1e-4f) / kFp8E4m3Max);
}

void EncodeV4Row(V4KvFormat f, const V4RowShape& s, int64_t page_size, int64_t slot, const float* row, uint8_t* page) {
  const int64_t d = s.head_dim;
  switch (f) {
    case V4KvFormat::kFp32:
      std::memcpy(page + slot * 4 * d, row, static_cast<size_t>(4 * d));
      return;
    case V4KvFormat::kBf16:
      for (int64_t i = 0; i < d; ++i) PutBf16(row[i], page + slot * 2 * d + 2 * i);
      return;
    case V4KvFormat::kFp8Model1: {
      const int64_t nope = s.nope();
      uint8_t* data = page + slot * s.model1_data_bytes();                                  // [nope e4m3 | rope bf16]
      uint8_t* scales = page + page_size * s.model1_data_bytes() + slot * s.model1_scale_bytes();  // [tiles ue8m0 | pad]
      for (int64_t t = 0; t < s.tiles(); ++t) {
        const int64_t lo = t * kModel1Tile, n = std::min(kModel1Tile, nope - lo);
        const int k = Model1TileExponent(row + lo, n);
        scales[t] = k == INT_MIN ? 0xff : static_cast<uint8_t>(k + 127);
        QuantizeTile(row + lo, n, k, data + lo);
      }
      scales[s.tiles()] = 0;  // the pad byte
      for (int64_t i = 0; i < s.rope_dim; ++i) PutBf16(row[nope + i], data + nope + 2 * i);
      return;
    }
  }
}

void DecodeV4Row(V4KvFormat f, const V4RowShape& s, int64_t page_size, int64_t slot, const uint8_t* page, float* row) {
  const int64_t d = s.head_dim;
  switch (f) {
    case V4KvFormat::kFp32:
      std::memcpy(row, page + slot * 4 * d, static_cast<size_t>(4 * d));
      return;
    case V4KvFormat::kBf16:
      for (int64_t i = 0; i < d; ++i) row[i] = GetBf16(page + slot * 2 * d + 2 * i);
      return;
    case V4KvFormat::kFp8Model1: {
      const int64_t nope = s.nope();
      const uint8_t* data = page + slot * s.model1_data_bytes();
      const uint8_t* scales = page + page_size * s.model1_data_bytes() + slot * s.model1_scale_bytes();
      const float* e4m3 = Fp8E4m3Table();
      for (int64_t t = 0; t < s.tiles(); ++t) {
        const float sc = scales[t] == 0xff ? std::numeric_limits<float>::quiet_NaN()
                                           : std::ldexp(1.0f, static_cast<int>(scales[t]) - 127);
        const int64_t lo = t * kModel1Tile, hi = std::min(nope, lo + kModel1Tile);
        for (int64_t i = lo; i < hi; ++i) row[i] = e4m3[data[i]] * sc;
      }
      for (int64_t i = 0; i < s.rope_dim; ++i) row[nope + i] = GetBf16(data + nope + 2 * i);
      return;
    }
  }
}

int64_t IndexKeyTokenBytes(V4IndexKeyFormat f, int64_t dim) {
  return f == V4IndexKeyFormat::kFp32 ? 4 * dim : dim + 4 * ((dim + kIndexKeyTile - 1) / kIndexKeyTile);
}

int64_t IndexKeyPageBytes(V4IndexKeyFormat f, int64_t dim, int64_t page_size) {
  return page_size * IndexKeyTokenBytes(f, dim);
}

void EncodeIndexKey(V4IndexKeyFormat f, int64_t dim, int64_t page_size, int64_t slot, const float* key, uint8_t* page) {
  if (f == V4IndexKeyFormat::kFp32) {
    std::memcpy(page + slot * 4 * dim, key, static_cast<size_t>(4 * dim));
    return;
  }
  const int64_t tiles = (dim + kIndexKeyTile - 1) / kIndexKeyTile;
  uint8_t* values = page + slot * dim;
  uint8_t* scales = page + page_size * dim + slot * 4 * tiles;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t lo = t * kIndexKeyTile, n = std::min(kIndexKeyTile, dim - lo);
    const int k = IndexKeyTileExponent(key + lo, n);
    const float sc = k == INT_MIN ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, k);
    std::memcpy(scales + 4 * t, &sc, 4);
    QuantizeTile(key + lo, n, k, values + lo);
  }
}

void DecodeIndexKey(V4IndexKeyFormat f, int64_t dim, int64_t page_size, int64_t slot, const uint8_t* page, float* key) {
  if (f == V4IndexKeyFormat::kFp32) {
    std::memcpy(key, page + slot * 4 * dim, static_cast<size_t>(4 * dim));
    return;
  }
  const int64_t tiles = (dim + kIndexKeyTile - 1) / kIndexKeyTile;
  const uint8_t* values = page + slot * dim;
  const uint8_t* scales = page + page_size * dim + slot * 4 * tiles;
  const float* e4m3 = Fp8E4m3Table();
  for (int64_t t = 0; t < tiles; ++t) {
    float sc;
    std::memcpy(&sc, scales + 4 * t, 4);
    const int64_t lo = t * kIndexKeyTile, hi = std::min(dim, lo + kIndexKeyTile);
    for (int64_t i = lo; i < hi; ++i) key[i] = e4m3[values[i]] * sc;
  }
}

}  // namespace lockstep::kernels
