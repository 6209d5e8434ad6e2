// engine/v4_config.h — what a DeepSeek-V4 checkpoint adds to ModelConfig: hyper-connections,
// the three attention kinds with their compression rates, the two RoPE tables, the grouped
// output projection, hash / sqrt-softplus routing and the clamped SwiGLU.
//
// Parsed from config.json with transformers 5.17's DeepseekV4Config defaults (V4-Flash) and its
// normalisation rules (docs in ../shared/reference/deepseek-v4.md §1.1): `layer_types` or the
// legacy `compress_ratios`, `compress_rates` (+ legacy `compress_rate_csa/hca`),
// `mlp_layer_types` (+ legacy `num_hash_layers`), nested or flat `rope_parameters`.
// ModelConfig::FromJson hands a `model_type deepseek_v4` text to V4ConfigFromJson, which fills
// the shared fields (vocab, hidden, heads, experts, …) and ModelConfig::v4.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace lockstep::engine {

struct ModelConfig;
struct LayerSpec;

// The KV-cache streams a V4 layer owns (engine/kv_cache.h builds them from this list). Every
// stream is a sequence of fp32-valued rows indexed by `index`: a token position for the
// every-token streams, an entry number for the every-m-tokens ones.
enum class V4Stream {
  kWindow,            // the normed, RoPE'd kv row of every token; attention reads the last W
  kCompressorState,   // the raw [kv_proj | gate_proj] rows of every token (the pooling's input):
                      // a window's rows until it closes, and for CSA the previous window's (overlap)
  kCompressed,        // one normed, RoPE'd entry per closed window of m tokens
  kIndexerState,      // CSA: the indexer compressor's raw [kv | gate] rows, as kCompressorState
  kIndexerKey,        // CSA: the indexer's compressed key per closed window
};

struct V4StreamSpec {
  V4Stream kind;
  std::string name;     // "window", "compressor", "compressed", "indexer_state", "indexer_k"
  int64_t width = 0;    // fp32 values a row
  int64_t cadence = 1;  // a row every `cadence` tokens (1, or the compression rate)
  int64_t retention = 0;  // rows attention or pooling can still read: 0 = all, else the last N
};

// One RoPE table: θ, the rotated (trailing) dims and YaRN.
struct V4Rope {
  double theta = 10000.0;
  bool yarn = false;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
  double attention_factor = 1.0;  // multiplies cos and sin
  // The fields it is derived from, as read (0 = absent; attention_factor_field: the file's, or
  // the 1.0 transformers assumes for flat keys) — what verify derives it from itself.
  double mscale = 0.0, mscale_all_dim = 0.0, attention_factor_field = 0.0;
};

struct V4Config {
  int64_t head_dim = 512;           // d: one shared K = V head of this width, and each query head
  double partial_rotary_factor = 0.125;
  int64_t rope_dim = 64;            // rd = int(d · partial_rotary_factor), the trailing dims RoPE rotates
  int64_t o_groups = 8, o_lora_rank = 1024;
  int64_t sliding_window = 128;     // W: keys a query sees in its window, itself included
  int64_t hc_mult = 4, hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;
  double swiglu_limit = 10.0;
  int64_t csa_rate = 4, hca_rate = 128;  // compress_rates
  V4Rope main_rope;                 // sliding layers
  V4Rope compress_rope;             // CSA / HCA layers (q, window kv, compressors, indexer)
  int64_t num_hash_layers = 0;      // layers with FfnKind::kHashMoe (count, for `model info`)
};

// config.json text of a deepseek_v4 checkpoint → *c (family, shared fields, layers, v4).
Status V4ConfigFromJson(std::string_view text, const std::string& origin, ModelConfig* c);

// The cache streams of layer `l` (empty for a layer of another family).
std::vector<V4StreamSpec> V4LayerStreams(const ModelConfig& c, int64_t l);

// "sliding_attention" / "compressed_sparse_attention" / "heavily_compressed_attention" and
// "hash_moe" / "moe" — the names config.json uses, for `model info`.
std::string_view V4AttentionName(const LayerSpec& s);
std::string_view V4FfnName(const LayerSpec& s);

}  // namespace lockstep::engine
