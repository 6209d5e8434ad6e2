// engine/kv_cache.cc — see kv_cache.h and docs/kv-cache.md.
#include "engine/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "kernels/cpu/numerics.h"

namespace lockstep::engine {
namespace {
constexpr int64_t kFp8Tile = 128;  // latent values per fp32 scale (FlashMLA's V3.2 layout)
}

std::string_view KvFormatName(KvFormat f) {
  switch (f) {
    case KvFormat::kFp32: return "fp32";
    case KvFormat::kBf16: return "bf16";
    case KvFormat::kFp8E4m3: return "fp8_e4m3";
  }
  return "?";
}

Result<KvFormat> ParseKvFormat(std::string_view s) {
  if (s == "fp32") return KvFormat::kFp32;
  if (s == "bf16") return KvFormat::kBf16;
  if (s == "fp8_e4m3" || s == "fp8") return KvFormat::kFp8E4m3;
  return Status::InvalidArgument("--kv-cache: '" + std::string(s) + "' is not one of fp32, bf16, fp8_e4m3");
}

float Fp8TileScale(const float* x, int64_t n) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  if (!(amax > 0) || !std::isfinite(amax)) return 1.0f;
  // Power of two ≥ amax/448, so that x/scale never exceeds the e4m3 range.
  int e = static_cast<int>(std::ceil(std::log2(static_cast<double>(amax) / kernels::kFp8E4m3Max)));
  return std::ldexp(1.0f, e);
}

// The faulty scale: nearest power of two to amax/448 (may be below it, so x/scale can pass 448).
static float FaultyFp8Scale(const float* x, int64_t n) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  if (!(amax > 0) || !std::isfinite(amax)) return 1.0f;
  return std::ldexp(1.0f, static_cast<int>(std::lround(std::log2(static_cast<double>(amax) / kernels::kFp8E4m3Max))));
}

PagedKvCache::PagedKvCache(const ModelConfig& c, KvFormat format, int64_t page_size, int64_t max_pages,
                           bool fp8_index_keys)
    : kv_lora_(c.kv_lora_rank),
      rope_(c.qk_rope_head_dim),
      v4_rope_(c.is_v4() ? c.v4.rope_dim : 0),
      index_dim_(c.index_head_dim),
      fp8_index_keys_(fp8_index_keys),
      format_(format),
      page_size_(page_size),
      max_pages_(max_pages) {
  switch (format) {
    case KvFormat::kFp32: latent_bytes_ = (kv_lora_ + rope_) * 4; break;
    case KvFormat::kBf16: latent_bytes_ = (kv_lora_ + rope_) * 2; break;
    case KvFormat::kFp8E4m3:
      latent_bytes_ = kv_lora_ + 4 * ((kv_lora_ + kFp8Tile - 1) / kFp8Tile) + 2 * rope_;
      break;
  }
  layer_streams_.resize(c.num_hidden_layers);
  storage_.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_v4()) {
      for (const V4StreamSpec& v : V4LayerStreams(c, l)) layer_streams_[l].push_back(V4Stream(v));
      storage_[l].resize(layer_streams_[l].size());
      for (auto& s : storage_[l]) s.resize(max_pages);
      continue;
    }
    layer_streams_[l].push_back({StreamKind::kMlaLatent, "latent", latent_bytes_});
    if (c.layers[l].attention == AttentionKind::kMlaSparse) {
      layer_streams_[l].push_back({StreamKind::kIndexerKey, "indexer_k",
                                   fp8_index_keys_ ? index_dim_ + 4 * ((index_dim_ + kFp8Tile - 1) / kFp8Tile)
                                                   : index_dim_ * 4});
    }
    storage_[l].resize(layer_streams_[l].size());
    for (auto& s : storage_[l]) s.resize(max_pages);
  }
  for (auto& streams : layer_streams_) {
    for (StreamSpec& st : streams) {
      if (st.page_bytes == 0) st.page_bytes = page_size_ * st.bytes_per_token;
    }
  }
  free_.reserve(max_pages);
  for (int64_t p = max_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
  std::make_heap(free_.begin(), free_.end(), std::greater<>());
}

Status PagedKvCache::Reserve(SeqCache* seq, int64_t new_length) {
  const int64_t need = (new_length + page_size_ - 1) / page_size_;
  const int64_t have = static_cast<int64_t>(seq->pages.size());
  if (need - have > free_pages()) {
    return Status::InvalidArgument("KV cache full: need " + std::to_string(need - have) + " more pages of " +
                                   std::to_string(page_size_) + " tokens, " + std::to_string(free_pages()) +
                                   " free (raise --kv-cache-tokens)");
  }
  for (int64_t i = have; i < need; ++i) {
    std::pop_heap(free_.begin(), free_.end(), std::greater<>());
    int32_t page = free_.back();
    free_.pop_back();
    if (hidden_ == kernels::HiddenFault::kPageDoubleHandout && i > 0) {
      // Hidden fault: the page is handed out but stays free — the next request gets it too.
      free_.push_back(page);
      std::push_heap(free_.begin(), free_.end(), std::greater<>());
    }
    seq->pages.push_back(page);
    for (size_t l = 0; l < storage_.size(); ++l) {
      for (size_t s = 0; s < storage_[l].size(); ++s) {
        auto& slot = storage_[l][s][page];
        const size_t bytes = layer_streams_[l][s].page_bytes;
        if (!slot) slot.reset(new uint8_t[bytes]);
        std::memset(slot.get(), 0, bytes);  // a reused page must not leak its last owner's bytes
      }
    }
  }
  return Status::Ok();
}

void PagedKvCache::Release(SeqCache* seq) {
  for (int32_t p : seq->pages) {
    free_.push_back(p);
    std::push_heap(free_.begin(), free_.end(), std::greater<>());
  }
  seq->pages.clear();
  seq->length = 0;
}

// The page holding slot `pos`; a page never handed out reads as zeros. Only a page table that
// points at one gets there (the fault zoo's cross-request fault): it reads zeros rather than
// unallocated memory.
uint8_t* PagedKvCache::PageOf(int64_t layer, size_t stream, const SeqCache& seq, int64_t pos) {
  const int32_t page = seq.pages[pos / page_size_];
  auto& slot = storage_[layer][stream][page];
  if (!slot) {
    const size_t bytes = static_cast<size_t>(layer_streams_[layer][stream].page_bytes);
    if (zero_page_.size() < bytes) zero_page_.assign(bytes, 0);
    return zero_page_.data();
  }
  return slot.get();
}

uint8_t* PagedKvCache::MutableTokenBytes(int64_t layer, size_t stream, const SeqCache& seq, int64_t pos) {
  const StreamSpec& st = layer_streams_[layer][stream];
  return PageOf(layer, stream, seq, pos) + (pos % page_size_) * (st.split > 0 ? st.split : st.bytes_per_token);
}

const uint8_t* PagedKvCache::PartBytes(int64_t layer, size_t stream, const SeqCache& seq, int64_t pos,
                                       const KvPart& part) const {
  const StreamSpec& st = layer_streams_[layer][stream];
  if (st.split == 0 || part.offset < st.split) return TokenBytes(layer, stream, seq, pos) + part.offset;
  const uint8_t* page = const_cast<PagedKvCache*>(this)->PageOf(layer, stream, seq, pos);
  return page + page_size_ * st.split + (pos % page_size_) * (st.bytes_per_token - st.split) + (part.offset - st.split);
}

// A V4 stream: window and compressed rows in the cache's format (fp32, bf16, or fp8_e4m3 as
// FlashMLA's MODEL1), the compressors' and indexer's state and keys fp32.
StreamSpec PagedKvCache::V4Stream(const V4StreamSpec& v) const {
  StreamKind kind = StreamKind::kV4Window;
  switch (v.kind) {
    case engine::V4Stream::kWindow: kind = StreamKind::kV4Window; break;
    case engine::V4Stream::kCompressorState: kind = StreamKind::kV4CompressorState; break;
    case engine::V4Stream::kCompressed: kind = StreamKind::kV4Compressed; break;
    case engine::V4Stream::kIndexerState: kind = StreamKind::kV4IndexerState; break;
    case engine::V4Stream::kIndexerKey: kind = StreamKind::kV4IndexerKey; break;
  }
  using F = kernels::V4KvFormat;
  const bool rows = kind == StreamKind::kV4Window || kind == StreamKind::kV4Compressed;
  const F f = !rows ? F::kFp32 : format_ == KvFormat::kBf16 ? F::kBf16 : format_ == KvFormat::kFp8E4m3 ? F::kFp8Model1 : F::kFp32;
  const kernels::V4RowShape shape{v.width, v4_rope_};
  StreamSpec st{kind, v.name, shape.token_bytes(f), v.width, v.cadence, v.retention, f};
  if (f == F::kFp8Model1) {
    st.split = shape.model1_data_bytes();
    st.page_bytes = shape.page_bytes(f, page_size_);
  }
  if (kind == StreamKind::kV4IndexerKey && fp8_index_keys_) {  // a page's e4m3 keys, then its fp32 scales
    st.key_format = kernels::V4IndexKeyFormat::kFp8;
    st.bytes_per_token = kernels::IndexKeyTokenBytes(st.key_format, v.width);
    st.split = v.width;
    st.page_bytes = kernels::IndexKeyPageBytes(st.key_format, v.width, page_size_);
  }
  return st;
}

void PagedKvCache::WriteRow(int64_t layer, size_t stream, const SeqCache& seq, int64_t slot, const float* row) {
  const StreamSpec& st = layer_streams_[layer][stream];
  if (st.key_format == kernels::V4IndexKeyFormat::kFp8) {
    kernels::EncodeIndexKey(st.key_format, st.cols, page_size_, slot % page_size_, row, PageOf(layer, stream, seq, slot));
    return;
  }
  kernels::EncodeV4Row(st.row_format, {st.cols, v4_rope_}, page_size_, slot % page_size_, row,
                       PageOf(layer, stream, seq, slot));
}

void PagedKvCache::ReadRow(int64_t layer, size_t stream, const SeqCache& seq, int64_t slot, float* row) const {
  const StreamSpec& st = layer_streams_[layer][stream];
  if (st.key_format == kernels::V4IndexKeyFormat::kFp8) {
    kernels::DecodeIndexKey(st.key_format, st.cols, page_size_, slot % page_size_,
                            const_cast<PagedKvCache*>(this)->PageOf(layer, stream, seq, slot), row);
    return;
  }
  kernels::DecodeV4Row(st.row_format, {st.cols, v4_rope_}, page_size_, slot % page_size_,
                       const_cast<PagedKvCache*>(this)->PageOf(layer, stream, seq, slot), row);
}

std::vector<KvPart> PagedKvCache::parts(int64_t layer, size_t stream) const {
  const StreamSpec& st = layer_streams_[layer][stream];
  const int64_t tb = st.bytes_per_token;
  if (st.cols > 0) {  // a V4 stream: one part, or MODEL1's three
    if (st.row_format == kernels::V4KvFormat::kFp8Model1) {
      const kernels::V4RowShape shape{st.cols, v4_rope_};
      return {{"", "nope_e4m3", TapDType::kFp8E4m3, 0, shape.nope()},
              {".rope", "rope", TapDType::kBf16, shape.nope(), shape.rope_dim},
              {".scales", "scales_ue8m0", TapDType::kU8, shape.model1_data_bytes(), shape.tiles()}};
    }
    if (st.key_format == kernels::V4IndexKeyFormat::kFp8) {
      const int64_t tiles = (st.cols + kernels::kIndexKeyTile - 1) / kernels::kIndexKeyTile;
      return {{"", "key_e4m3", TapDType::kFp8E4m3, 0, st.cols}, {".scales", "scales", TapDType::kF32, st.cols, tiles}};
    }
    const bool bf16 = st.row_format == kernels::V4KvFormat::kBf16;
    return {{"", st.name, bf16 ? TapDType::kBf16 : TapDType::kF32, 0, st.cols}};
  }
  if (st.kind == StreamKind::kMlaLatent && format_ == KvFormat::kFp8E4m3) {
    const int64_t tiles = (kv_lora_ + 127) / 128;
    return {{"", "latent_e4m3", TapDType::kFp8E4m3, 0, kv_lora_},
            {".scales", "scales", TapDType::kF32, kv_lora_, tiles},
            {".rope", "rope", TapDType::kBf16, kv_lora_ + 4 * tiles, rope_}};
  }
  if (st.kind == StreamKind::kIndexerKey && fp8_index_keys_) {
    const int64_t tiles = (index_dim_ + 127) / 128;
    return {{"", "key_e4m3", TapDType::kFp8E4m3, 0, index_dim_}, {".scales", "scales", TapDType::kF32, index_dim_, tiles}};
  }
  if (st.kind == StreamKind::kMlaLatent && format_ == KvFormat::kBf16) return {{"", "latent", TapDType::kBf16, 0, tb / 2}};
  return {{"", st.kind == StreamKind::kMlaLatent ? "latent" : "key", TapDType::kF32, 0, tb / 4}};
}

const uint8_t* PagedKvCache::TokenBytes(int64_t layer, size_t stream, const SeqCache& seq, int64_t pos) const {
  return const_cast<PagedKvCache*>(this)->MutableTokenBytes(layer, stream, seq, pos);
}

void PagedKvCache::WriteLatent(int64_t layer, const SeqCache& seq, int64_t pos, const float* latent,
                               const float* rope) {
  uint8_t* b = MutableTokenBytes(layer, 0, seq, pos);
  switch (format_) {
    case KvFormat::kFp32:
      std::memcpy(b, latent, kv_lora_ * 4);
      std::memcpy(b + kv_lora_ * 4, rope, rope_ * 4);
      break;
    case KvFormat::kBf16:
      for (int64_t i = 0; i < kv_lora_; ++i) {
        uint16_t h = kernels::F32ToBf16(latent[i]);
        if (hidden_ == kernels::HiddenFault::kKvBf16Truncate) {
          uint32_t u;
          std::memcpy(&u, &latent[i], 4);
          h = static_cast<uint16_t>(u >> 16);  // hidden fault: toward zero
        }
        std::memcpy(b + 2 * i, &h, 2);
      }
      for (int64_t i = 0; i < rope_; ++i) {
        uint16_t h = kernels::F32ToBf16(rope[i]);
        std::memcpy(b + 2 * (kv_lora_ + i), &h, 2);
      }
      break;
    case KvFormat::kFp8E4m3: {
      const int64_t tiles = (kv_lora_ + kFp8Tile - 1) / kFp8Tile;
      uint8_t* scales = b + kv_lora_;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t lo = t * kFp8Tile, n = std::min(kFp8Tile, kv_lora_ - lo);
        float s = Fp8TileScale(latent + lo, n);
        if (fault_fp8_no_clamp_) s = FaultyFp8Scale(latent + lo, n);
        // Hidden fault: the power of two at or below amax/448 (the largest values then saturate).
        if (hidden_ == kernels::HiddenFault::kKvFp8ScaleFloor && s > 0) {
          float amax = 0;
          for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(latent[lo + i]));
          if (amax > 0 && s * 448.0f > amax) s = s * 0.5f;
        }
        std::memcpy(scales + 4 * t, &s, 4);
        for (int64_t i = 0; i < n; ++i) {
          const float v = latent[lo + i] / s;
          // e4m3fn has no infinity: without saturation, |v| ≥ 464 (past 448's rounding range) is NaN.
          b[lo + i] = fault_fp8_no_clamp_ && std::fabs(v) >= 464.0f ? (std::signbit(v) ? 0xff : 0x7f)
                                                                     : kernels::F32ToFp8E4m3(v);
        }
      }
      uint8_t* r = scales + 4 * tiles;
      for (int64_t i = 0; i < rope_; ++i) {
        uint16_t h = kernels::F32ToBf16(rope[i]);
        std::memcpy(r + 2 * i, &h, 2);
      }
      break;
    }
  }
}

void PagedKvCache::ReadLatent(int64_t layer, const SeqCache& seq, int64_t pos, float* latent, float* rope) const {
  const uint8_t* b = TokenBytes(layer, 0, seq, pos);
  switch (format_) {
    case KvFormat::kFp32:
      std::memcpy(latent, b, kv_lora_ * 4);
      std::memcpy(rope, b + kv_lora_ * 4, rope_ * 4);
      break;
    case KvFormat::kBf16:
      for (int64_t i = 0; i < kv_lora_ + rope_; ++i) {
        uint16_t h;
        std::memcpy(&h, b + 2 * i, 2);
        (i < kv_lora_ ? latent[i] : rope[i - kv_lora_]) = kernels::Bf16ToF32(h);
      }
      break;
    case KvFormat::kFp8E4m3: {
      const int64_t tiles = (kv_lora_ + kFp8Tile - 1) / kFp8Tile;
      const uint8_t* scales = b + kv_lora_;
      const float* fp8 = kernels::Fp8E4m3Table();
      for (int64_t t = 0; t < tiles; ++t) {
        float s;
        std::memcpy(&s, scales + 4 * t, 4);
        const int64_t lo = t * kFp8Tile, n = std::min(kFp8Tile, kv_lora_ - lo);
        for (int64_t i = 0; i < n; ++i) latent[lo + i] = fp8[b[lo + i]] * s;
      }
      const uint8_t* r = scales + 4 * tiles;
      for (int64_t i = 0; i < rope_; ++i) {
        uint16_t h;
        std::memcpy(&h, r + 2 * i, 2);
        rope[i] = kernels::Bf16ToF32(h);
      }
      break;
    }
  }
}

void PagedKvCache::WriteIndexKey(int64_t layer, const SeqCache& seq, int64_t pos, const float* key) {
  uint8_t* b = MutableTokenBytes(layer, 1, seq, pos);
  if (fp8_index_keys_) {
    QuantizeFp8Row(key, index_dim_, b);
    if (hidden_ == kernels::HiddenFault::kIndexKeyFp8Truncate) {  // the hidden fault zoo: toward zero
      const float* fp8 = kernels::Fp8E4m3Table();
      for (int64_t i = 0; i < index_dim_; ++i) {
        float s;
        std::memcpy(&s, b + index_dim_ + 4 * (i / kFp8Tile), 4);
        if ((b[i] & 0x7F) != 0 && std::fabs(fp8[b[i]]) * s > std::fabs(key[i])) --b[i];  // one code nearer zero
      }
    }
  } else {
    std::memcpy(b, key, index_dim_ * 4);
  }
}

void PagedKvCache::ReadIndexKey(int64_t layer, const SeqCache& seq, int64_t pos, float* key) const {
  const uint8_t* b = TokenBytes(layer, 1, seq, pos);
  if (!fp8_index_keys_) {
    std::memcpy(key, b, index_dim_ * 4);
    return;
  }
  const float* fp8 = kernels::Fp8E4m3Table();
  for (int64_t i = 0; i < index_dim_; ++i) {
    float s;
    std::memcpy(&s, b + index_dim_ + 4 * (i / kFp8Tile), 4);
    key[i] = fp8[b[i]] * s;
  }
}

int64_t Fp8RowBytes(int64_t n) { return n + 4 * ((n + kFp8Tile - 1) / kFp8Tile); }

void QuantizeFp8Row(const float* x, int64_t n, uint8_t* row) {
  for (int64_t t = 0; t * kFp8Tile < n; ++t) {
    const int64_t lo = t * kFp8Tile, m = std::min(kFp8Tile, n - lo);
    const float s = Fp8TileScale(x + lo, m);
    std::memcpy(row + n + 4 * t, &s, 4);
    for (int64_t i = 0; i < m; ++i) row[lo + i] = kernels::F32ToFp8E4m3(x[lo + i] / s);
  }
}

void Fp8RoundTrip(const float* x, int64_t n, float* y) {
  for (int64_t t = 0; t * kFp8Tile < n; ++t) {
    const int64_t lo = t * kFp8Tile, m = std::min(kFp8Tile, n - lo);
    const float s = Fp8TileScale(x + lo, m);
    for (int64_t i = lo; i < lo + m; ++i) y[i] = kernels::Fp8E4m3ToF32(kernels::F32ToFp8E4m3(x[i] / s)) * s;
  }
}

double Fp8RowDot(const uint8_t* a, const uint8_t* b, int64_t n) {
  const float* fp8 = kernels::Fp8E4m3Table();
  double total = 0;
  for (int64_t t = 0; t * kFp8Tile < n; ++t) {
    const int64_t lo = t * kFp8Tile, m = std::min(kFp8Tile, n - lo);
    double sum = 0;  // exact: see kv_cache.h
    for (int64_t i = lo; i < lo + m; ++i) {
      sum += static_cast<double>(fp8[a[i]]) * static_cast<double>(fp8[b[i]]);
    }
    float sa, sb;
    std::memcpy(&sa, a + n + 4 * t, 4);
    std::memcpy(&sb, b + n + 4 * t, 4);
    total += sum * (static_cast<double>(sa) * static_cast<double>(sb));
  }
  return total;
}

}  // namespace lockstep::engine
