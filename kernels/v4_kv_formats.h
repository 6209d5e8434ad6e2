// kernels/v4_kv_formats.h — DeepSeek-V4's KV-cache byte formats, as pure functions over one page.
//
// V4 caches one row of head_dim values a token per attention stream (the sliding-window rows and
// the compressed rows: the normed kv with RoPE on its trailing rope_dim values, K = V), and the
// indexer's compressed keys (index_head_dim values). The engine's paged cache owns the pages and
// the page tables; this file fixes what the bytes of a page are, so that a trace stores them and a
// replay reads them exactly as the serving engines lay them out (docs/kv-cache.md, "DeepSeek-V4").
//
// Row formats (V4KvFormat):
//   fp32        head_dim fp32 values a token, token-major                    (2048 B for V4-Flash)
//   bf16        head_dim bf16 values (nearest-even), token-major              (1024 B)
//   fp8_model1  FlashMLA's MODEL1_FP8Sparse (584 B): per token a data part of nope = head_dim −
//               rope_dim e4m3 values then rope_dim bf16 values (576 B), and a scale slot of one
//               ue8m0 byte per 64 nope values (7) plus one pad byte (8 B); a page holds every
//               token's data part first, then every token's scale slot, and its size is rounded
//               up to a multiple of 576 B.
// Indexer-key formats (V4IndexKeyFormat):
//   fp32        index_head_dim fp32 values a token                           (512 B for 128)
//   fp8         vLLM's / DeepGEMM's paged indexer cache (132 B for 128): a page holds every token's
//               index_head_dim e4m3 values first, then every token's fp32 scales (one per 128).
//
// FP8 rules (each tile: 64 nope values for MODEL1, 128 key values for the indexer):
//   MODEL1   s = 2^⌈log2(max(amax/448, 1e-4))⌉ (FlashMLA tests/quant.py: amax/448 in fp32, floored
//            at fp32(1e-4), then the smallest power of two ≥ it — so s ≥ 2^−13);
//   indexer  s = 2^⌈log2(max(amax, 1e-4)/448)⌉ (vLLM indexer_k_quant_and_cache, ue8m0: s ≥ 2^−22);
//   q = e4m3(x / s), nearest-even, saturating at ±448. The power of two is taken exactly (from the
//   float's bits): CUDA kernels that compute it as exp2f(ceilf(log2f(v))) can, for v within a few
//   ulps above a power of two, take the power below; the encoded value then rounds to ±448 instead
//   of a smaller code (docs/kv-cache.md lists it as a known difference).
//   A tile holding a NaN or an infinity is stored as NaN: its scale NaN (ue8m0 0xFF / fp32 NaN)
//   and every value byte 0x7F, so it decodes to NaN throughout (quant.py's torch arithmetic gives
//   NaN there too, up to the NaN's sign bit) — corruption stays visible instead of being clamped.
//   Decoding is exact: e4m3 × a power of two, in fp32 (and in bf16, FlashMLA's decode precision),
//   except that a value within an e4m3 rounding step of fp32's largest (|x| > ~3.2e38) can round up
//   to a code whose product passes it and decodes to ±inf.
//   Error bound of a finite value x: |x − decoded| ≤ max(2^−4·|x|, 2^−10·s) (half an e4m3 ulp;
//   the second term covers the subnormals and values that flush to zero); bf16 rope values
//   |x − decoded| ≤ 2^−8·|x|.
//
// Thread-safety: pure functions; a page may be written by one caller at a time per token slot.
#pragma once

#include <cstdint>
#include <string_view>

#include "base/status.h"

namespace lockstep::kernels {

enum class V4KvFormat : uint8_t { kFp32, kBf16, kFp8Model1 };
enum class V4IndexKeyFormat : uint8_t { kFp32, kFp8 };
std::string_view V4KvFormatName(V4KvFormat f);              // "fp32", "bf16", "fp8_model1"
std::string_view V4IndexKeyFormatName(V4IndexKeyFormat f);  // "fp32", "fp8"
// "fp32" | "bf16" | "fp8_model1" (also "fp8_e4m3": V4's one FP8 layout) → the format, else a one-line
// error naming `flag` and the choices.
Result<V4KvFormat> ParseV4KvFormat(std::string_view s, std::string_view flag = "--kv-cache");
Result<V4IndexKeyFormat> ParseV4IndexKeyFormat(std::string_view s, std::string_view flag = "--index-keys");

inline constexpr int64_t kModel1Tile = 64;          // nope values per ue8m0 scale
inline constexpr int64_t kModel1PageAlign = 576;    // a MODEL1 page's size is a multiple of this
inline constexpr int64_t kIndexKeyTile = 128;       // key values per fp32 scale

// A row's shape: head_dim values, the trailing rope_dim of them RoPE'd (V4-Flash: 512, 64).
struct V4RowShape {
  int64_t head_dim = 512, rope_dim = 64;
  int64_t nope() const { return head_dim - rope_dim; }
  int64_t tiles() const { return (nope() + kModel1Tile - 1) / kModel1Tile; }  // MODEL1 scales (7)
  int64_t model1_data_bytes() const { return nope() + 2 * rope_dim; }          // 576
  int64_t model1_scale_bytes() const { return tiles() + 1; }                   // 8: the scales, one pad byte
  int64_t token_bytes(V4KvFormat f) const;                                     // 2048 / 1024 / 584
  int64_t page_bytes(V4KvFormat f, int64_t page_size) const;                   // MODEL1: rounded up to 576
};
Status CheckV4RowShape(const V4RowShape& s);  // 0 ≤ rope_dim < head_dim

// Row `slot` of a page of `page_size` tokens: row [head_dim] fp32 (nope values, then the rope values)
// written into / read from `page` (page_bytes(f, page_size) bytes). Encode writes only that
// token's bytes (its data part and its scale slot, the pad byte 0); a fresh page should be zeroed.
void EncodeV4Row(V4KvFormat f, const V4RowShape& s, int64_t page_size, int64_t slot, const float* row, uint8_t* page);
void DecodeV4Row(V4KvFormat f, const V4RowShape& s, int64_t page_size, int64_t slot, const uint8_t* page, float* row);

// Indexer keys: dim values a token.
int64_t IndexKeyTokenBytes(V4IndexKeyFormat f, int64_t dim);  // fp32 4·dim; fp8 dim + 4·⌈dim/128⌉ (132)
int64_t IndexKeyPageBytes(V4IndexKeyFormat f, int64_t dim, int64_t page_size);
void EncodeIndexKey(V4IndexKeyFormat f, int64_t dim, int64_t page_size, int64_t slot, const float* key, uint8_t* page);
void DecodeIndexKey(V4IndexKeyFormat f, int64_t dim, int64_t page_size, int64_t slot, const uint8_t* page, float* key);

// The scale rules above, exposed for tests and the golden twins: the power-of-two exponent k
// (s = 2^k) of a tile, or nullopt-like INT32_MIN when the tile holds a non-finite value.
int Model1TileExponent(const float* x, int64_t n);
int IndexKeyTileExponent(const float* x, int64_t n);

}  // namespace lockstep::kernels
