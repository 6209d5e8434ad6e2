// engine/kv_cache.h — the paged latent KV cache.
//
// Storage is a pool of fixed-size pages (page_size tokens each); a request owns a page table
// mapping its logical pages to physical ones, allocated lowest-free-first so placement is
// deterministic. Each layer has one or more *streams* — what a token leaves behind in that
// layer. DeepSeek V2/V3 layers have one, the MLA latent (normalised c_kv, then the RoPE'd
// shared key); V3.2 layers add the indexer's key. V4 adds its own stream kinds (compressed
// rows, sliding-window keys) as new StreamKinds, without touching the page logic.
//
// The latent is stored in the selected format (docs/kv-cache.md has the byte layouts):
//   fp32      — (kv_lora + rope) little-endian fp32
//   bf16      — (kv_lora + rope) bf16, round-to-nearest-even
//   fp8_e4m3  — FlashMLA's V3.2 layout: kv_lora e4m3 values, one fp32 power-of-two scale per
//               128 latent values (amax/448 rounded up to a power of two), then rope as bf16.
//               For DeepSeek-V3 shapes (512 + 64) that is 656 bytes per token.
// Indexer keys (V3.2) are fp32 in every format, or — for --kernel indexer=fp8_paged, whatever the
// latent's format — FP8 rows (QuantizeFp8Row below: the latent's FP8 layout without a rope
// part; 132 bytes for DeepSeek-V3.2's 128, DeepGEMM's paged indexer layout).
//
// Not thread-safe: the engine thread owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "engine/config.h"
#include "engine/tap.h"
#include "kernels/hidden_fault.h"
#include "kernels/v4_kv_formats.h"

namespace lockstep::engine {

enum class KvFormat { kFp32, kBf16, kFp8E4m3 };
std::string_view KvFormatName(KvFormat f);  // "fp32", "bf16", "fp8_e4m3"
Result<KvFormat> ParseKvFormat(std::string_view s);

// V2/V3's latent and V3.2's index key; DeepSeek-V4's streams (engine/v4_config.h V4Stream):
// window rows, compressor state, compressed rows, the indexer's state and compressed keys.
enum class StreamKind {
  kMlaLatent, kIndexerKey,
  kV4Window, kV4CompressorState, kV4Compressed, kV4IndexerState, kV4IndexerKey
};

// A stream is a sequence of rows at slots 0, 1, …: one a token (cadence 1, slot = position) or
// one per `cadence` tokens (slot = entry number, < position, so a request's pages hold it).
// `retention`: how many of the latest rows a reader may still use (0 = all) — the window's W − 1,
// a compressor's open and overlapped windows; older rows stay in the pages (the reference keeps
// them; reading one is a bug that a test catches).
struct StreamSpec {
  StreamKind kind;
  std::string name;       // "latent", "indexer_k"; V4: "window", "compressor", "compressed", …
  int64_t bytes_per_token;  // bytes a row (a slot)
  int64_t cols = 0;       // V4 rows: fp32 values a row (WriteRow / ReadRow)
  int64_t cadence = 1;
  int64_t retention = 0;
  // V4 rows (cols > 0): how WriteRow stores them — fp32, bf16, or FlashMLA's MODEL1 (window and
  // compressed rows under --kv-cache fp8_e4m3: kernels/v4_kv_formats.h).
  kernels::V4KvFormat row_format = kernels::V4KvFormat::kFp32;
  // The CSA indexer's compressed keys (kV4IndexerKey): fp32, or vLLM's FP8 paged layout (132 B
  // for 128 dims) under --kernel indexer=fp8_paged.
  kernels::V4IndexKeyFormat key_format = kernels::V4IndexKeyFormat::kFp32;
  // A page's layout: split 0 — each slot's bytes_per_token bytes contiguous, slot after slot;
  // split > 0 — every slot's first `split` bytes, then every slot's remaining bytes (MODEL1:
  // the 576-byte data parts, then the 8-byte scale slots). page_bytes: a page's size (MODEL1
  // rounds it up to a multiple of 576 B).
  int64_t split = 0;
  int64_t page_bytes = 0;
};

// How a trace stores a stream's token bytes (kv/layers.L.<stream><suffix>): fp32 and bf16
// latents and fp32 index keys whole; the FP8 latent as its E4M3 values, fp32 scales and bf16
// rope values; FP8 index keys as E4M3 values and fp32 scales. A device backend hands these
// same parts to a tap hook as kv/ taps (TapHook::WantsKvTaps).
// V4's MODEL1 rows: the nope values' e4m3 bytes, the bf16 rope values and the ue8m0 scales.
struct KvPart {
  std::string suffix;  // "", ".scales", ".rope"
  // The trace's `part` attribute: "latent", "latent_e4m3", "scales", "rope", "key", "key_e4m3";
  // V4: the stream's name (fp32 / bf16 rows), "nope_e4m3", "scales_ue8m0".
  std::string what;
  TapDType type;
  int64_t offset;      // bytes into the token's bytes_per_token (a split layout's second part from `split`)
  int64_t cols;        // values
};

// A request's view of the cache: its page table and how many tokens are stored.
struct SeqCache {
  std::vector<int32_t> pages;
  int64_t length = 0;
};

class PagedKvCache {
 public:
  PagedKvCache(const ModelConfig& config, KvFormat format, int64_t page_size, int64_t max_pages,
               bool fp8_index_keys = false);

  KvFormat format() const { return format_; }
  int64_t page_size() const { return page_size_; }
  int64_t max_pages() const { return max_pages_; }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  const std::vector<StreamSpec>& streams(int64_t layer) const { return layer_streams_[layer]; }

  // Grows `seq` so that it can hold `new_length` tokens; fails (leaving `seq` unchanged) when
  // the pool is exhausted.
  Status Reserve(SeqCache* seq, int64_t new_length);
  // Returns every page of `seq` to the pool.
  void Release(SeqCache* seq);

  // MLA latent of one token: latent [kv_lora], rope [qk_rope], quantised per the format.
  void WriteLatent(int64_t layer, const SeqCache& seq, int64_t pos, const float* latent, const float* rope);
  // Reads back what attention sees: the stored values dequantised to fp32.
  void ReadLatent(int64_t layer, const SeqCache& seq, int64_t pos, float* latent, float* rope) const;

  // The indexer key of one token: stored (fp32, or quantised to FP8), and read back as what the
  // indexer sees (the stored values, dequantised).
  void WriteIndexKey(int64_t layer, const SeqCache& seq, int64_t pos, const float* key);
  void ReadIndexKey(int64_t layer, const SeqCache& seq, int64_t pos, float* key) const;
  bool fp8_index_keys() const { return fp8_index_keys_; }

  // A V4 stream's row at `slot` (streams(layer)[stream]: cols values): stored in the cache's
  // format for the window and compressed rows (fp32, bf16 or MODEL1: StreamSpec::row_format),
  // fp32 for the compressor and indexer state and keys; read back as what attention sees.
  void WriteRow(int64_t layer, size_t stream, const SeqCache& seq, int64_t slot, const float* row);
  void ReadRow(int64_t layer, size_t stream, const SeqCache& seq, int64_t slot, float* row) const;

  // The bytes of one token of one stream exactly as stored (for the recorder); a split
  // stream's (StreamSpec::split) first part only — read split streams through PartBytes.
  const uint8_t* TokenBytes(int64_t layer, size_t stream, const SeqCache& seq, int64_t pos) const;
  uint8_t* MutableTokenBytes(int64_t layer, size_t stream, const SeqCache& seq, int64_t pos);
  // Where part `part` (parts(layer, stream)) of slot `pos` lies, in either layout.
  const uint8_t* PartBytes(int64_t layer, size_t stream, const SeqCache& seq, int64_t pos, const KvPart& part) const;

  int64_t latent_bytes_per_token() const { return latent_bytes_; }
  // The parts of one token's bytes of `layer`'s stream `stream` (KvPart).
  std::vector<KvPart> parts(int64_t layer, size_t stream) const;

  // Fault zoo (kv_quant=fault_fp8_no_clamp): FP8 writes round the scale to the nearest power of
  // two instead of up, and do not saturate, so values past 448 become NaN.
  void SetFaultFp8NoClamp(bool on) { fault_fp8_no_clamp_ = on; }
  // Hidden fault zoo (kernels/hidden_fault.h): page_double_handout, kv_bf16_truncate, kv_fp8_scale_floor.
  void SetHiddenFault(kernels::HiddenFault f) { hidden_ = f; }

 private:
  StreamSpec V4Stream(const V4StreamSpec& v) const;
  uint8_t* PageOf(int64_t layer, size_t stream, const SeqCache& seq, int64_t pos);
  int64_t kv_lora_, rope_, index_dim_;
  int64_t v4_rope_;  // DeepSeek-V4: the trailing RoPE dims of a window / compressed row (MODEL1's bf16 part)
  bool fp8_index_keys_ = false;
  KvFormat format_;
  int64_t page_size_, max_pages_;
  int64_t latent_bytes_;
  std::vector<std::vector<StreamSpec>> layer_streams_;
  // storage_[layer][stream][physical page] → page_size × bytes_per_token bytes, allocated on first use.
  std::vector<std::vector<std::vector<std::unique_ptr<uint8_t[]>>>> storage_;
  std::vector<int32_t> free_;  // a min-heap of free physical page ids
  std::vector<uint8_t> zero_page_;  // what a never-allocated page reads as (only a faulty page table reads one)
  bool fault_fp8_no_clamp_ = false;
  kernels::HiddenFault hidden_ = kernels::HiddenFault::kNone;
};

// FP8 quantisation of one tile as the cache does it: scale = 2^ceil(log2(amax / 448)) (1 when
// amax is 0), q = e4m3(x / scale) with round-to-nearest-even and saturation.
float Fp8TileScale(const float* x, int64_t n);

// An FP8 row (indexer=fp8_paged's keys and queries): n e4m3 values, then per tile of 128 values
// Fp8TileScale's power-of-two scale s as fp32 (value = e4m3(x / s)). Fp8RowBytes(128) = 132.
int64_t Fp8RowBytes(int64_t n);
void QuantizeFp8Row(const float* x, int64_t n, uint8_t* row);
// x's FP8 row as fp32 values: per tile of 128, e4m3(x / s)·s with Fp8TileScale's s (a power of
// two, so both steps are exact but for e4m3's rounding). gemm=w8a8_dot's activations: DeepSeek
// V3.1/V3.2's act_quant with scale_fmt "ue8m0" (whose amax is floored at 1e-4 first; here a tile
// of amax 0 keeps its zeros).
void Fp8RoundTrip(const float* x, int64_t n, float* y);
// The dot product of two FP8 rows of n values: per tile, Σ e4m3(a_i)·e4m3(b_i) in fp64 — exact
// in any order (every e4m3 value is N·2^E with N ≤ 15 and −9 ≤ E ≤ 5, so 128 products are
// integers in units of 2^-18 below 2^43, inside fp64's 53 bits) — times s_a·s_b, and the tiles'
// terms added in ascending order (one tile for head sizes ≤ 128: then the result is exact
// before the caller rounds it once to fp32).
double Fp8RowDot(const uint8_t* a, const uint8_t* b, int64_t n);

}  // namespace lockstep::engine
