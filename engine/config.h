// engine/config.h — ModelConfig: the architecture of a DeepSeek-family checkpoint, read from
// its Hugging Face config.json, with transformers 5.17's defaults and semantics.
//
// One struct for all families: V2, V3 and V3.2 differ only in fields (gate kind, indexer).
// V4 will add per-layer attention kinds (`LayerSpec::attention`) and cache contents; the
// per-layer specs below are where they go, so a new family is an addition, not a rewrite.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "engine/v4_config.h"

namespace lockstep::engine {

enum class ModelFamily { kDeepseekV2, kDeepseekV3, kDeepseekV32, kDeepseekV4 };
std::string_view FamilyName(ModelFamily f);  // the config.json model_type

// How RoPE rotates q/k pairs, and in which order the rotated values come out. All three are
// transformers' own formulations; they differ only by a fixed permutation of the rotated
// dims, which q·k does not see, but taps and cache bytes do.
enum class RopeStyle {
  kPairsAdjacent,     // V2: (x0,x1),(x2,x3)… rotated as complex numbers, output in place
  kPairsToHalves,     // V3/V3.2 rope_interleave: pairs rotated, output [evens…, odds…]
  kHalves,            // rotate_half: (x_i, x_{i+d/2}) rotated, output in place
};

enum class GateKind { kSoftmaxGreedy, kSoftmaxGroupLimited, kSigmoidNoauxTc };

// V2/V3: MLA; V3.2: MLA with the lightning indexer. V4 (engine/v4_config.h): a sliding window
// of W keys, CSA (window + overlapping compressed rows chosen by an indexer) or HCA (window + all
// compressed rows), each with sinks.
enum class AttentionKind { kMla, kMlaSparse, kSliding, kCompressedSparse, kHeavilyCompressed };
// kMoe: the config's gate (V4: sqrt-softplus top-k); kHashMoe: V4's experts chosen by token id.
enum class FfnKind { kDense, kMoe, kHashMoe };
// kAdd: x + block(x); kHyperConnection: V4's hc_mult streams mixed around each block.
enum class ResidualKind { kAdd, kHyperConnection };

struct LayerSpec {
  AttentionKind attention = AttentionKind::kMla;
  FfnKind ffn = FfnKind::kDense;
  ResidualKind residual = ResidualKind::kAdd;
  int64_t compress_rate = 0;  // V4 CSA / HCA: tokens per compressed row (0 otherwise)
};

struct RopeConfig {
  double theta = 10000.0;
  bool yarn = false;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 0.0, mscale_all_dim = 0.0;  // 0 = absent
  double attention_factor = 1.0;  // multiplies cos/sin (YaRN's "attention_factor")
  double attention_factor_field = 0.0;  // the file's own `attention_factor` (0 = absent), as given
  bool truncate = true;
};

struct ModelConfig {
  ModelFamily family = ModelFamily::kDeepseekV3;
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  // MLA
  int64_t q_lora_rank = 0;  // 0: a plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // MoE
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  GateKind gate = GateKind::kSigmoidNoauxTc;
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0;
  // V3.2 lightning indexer
  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;
  // Misc
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;
  int64_t num_mtp_layers = 0;  // MTP layers live at layers.{num_hidden_layers…}; skipped on load
  RopeConfig rope;
  RopeStyle rope_style = RopeStyle::kPairsToHalves;
  // FP8 block-scaled weights (quantization_config.weight_block_size), 0 when absent.
  int64_t fp8_block_rows = 0, fp8_block_cols = 0;

  std::vector<LayerSpec> layers;
  V4Config v4;  // family kDeepseekV4 only

  bool is_v4() const { return family == ModelFamily::kDeepseekV4; }

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool has_indexer() const { return family == ModelFamily::kDeepseekV32; }
  // (qk_nope+qk_rope)^-0.5, times mscale² when YaRN carries mscale_all_dim.
  double softmax_scale() const;

  // Parses config.json text; `origin` names the file in errors.
  static Result<ModelConfig> FromJson(std::string_view text, const std::string& origin);
  static Result<ModelConfig> Load(const std::filesystem::path& model_dir);
};

}  // namespace lockstep::engine
