// engine/v4_config.cc — config.json → ModelConfig for model_type deepseek_v4, with
// transformers 5.17's DeepseekV4Config defaults (V4-Flash) and normalisation. save_pretrained
// omits fields equal to the class's defaults, so every default is spelled out here.
#include <cmath>

#include <nlohmann/json.hpp>

#include "engine/config.h"

namespace lockstep::engine {
namespace {

using json = nlohmann::json;

constexpr const char* kSliding = "sliding_attention";
constexpr const char* kCsa = "compressed_sparse_attention";
constexpr const char* kHca = "heavily_compressed_attention";

// Typed reads of one JSON object; errors name `prefix + key` in `origin`.
class Fields {
 public:
  Fields(const json& j, const std::string& origin, std::string prefix = "")
      : j_(j), origin_(origin), prefix_(std::move(prefix)) {}

  bool Has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }
  Status Int(const char* key, int64_t* out, int64_t dflt) const {
    *out = dflt;
    if (!Has(key)) return Status::Ok();
    if (!j_.at(key).is_number_integer()) return Bad(key, "must be an integer");
    *out = j_.at(key).get<int64_t>();
    return Status::Ok();
  }
  Status Float(const char* key, double* out, double dflt) const {
    *out = dflt;
    if (!Has(key)) return Status::Ok();
    if (!j_.at(key).is_number()) return Bad(key, "must be a number");
    *out = j_.at(key).get<double>();
    if (!std::isfinite(*out)) return Bad(key, "must be finite");
    return Status::Ok();
  }
  Status Bool(const char* key, bool* out, bool dflt) const {
    *out = dflt;
    if (!Has(key)) return Status::Ok();
    if (!j_.at(key).is_boolean()) return Bad(key, "must be true or false");
    *out = j_.at(key).get<bool>();
    return Status::Ok();
  }
  Status String(const char* key, std::string* out, const std::string& dflt) const {
    *out = dflt;
    if (!Has(key)) return Status::Ok();
    if (!j_.at(key).is_string()) return Bad(key, "must be a string");
    *out = j_.at(key).get<std::string>();
    return Status::Ok();
  }
  Status Bad(const std::string& key, const std::string& what) const {
    return Status::InvalidArgument(origin_ + ": field '" + prefix_ + key + "' " + what);
  }

 private:
  const json& j_;
  const std::string& origin_;
  std::string prefix_;
};

double YarnMscale(double factor, double mscale) { return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

// One normalised rope_parameters sub-dict (`main` or `compress`) → *r. `flat`: the dict came
// from flat keys (transformers then defaults a YaRN attention_factor to 1.0, not YaRN's mscale).
// `rope_dim`: the head's rotated dims from the top-level partial_rotary_factor, which the
// attention slices by; the table's own factor must give the same width.
Status ParseRopeDict(const json& d, const std::string& origin, const std::string& prefix, bool flat,
                     int64_t head_dim, int64_t rope_dim, int64_t max_pos, V4Rope* r) {
  Fields f(d, origin, prefix);
  std::string type;
  LS_RETURN_IF_ERROR(f.String("rope_type", &type, ""));
  if (type.empty()) LS_RETURN_IF_ERROR(f.String("type", &type, "default"));
  LS_RETURN_IF_ERROR(f.Float("rope_theta", &r->theta, 10000.0));
  if (!(r->theta > 1.0)) return f.Bad("rope_theta", "must be > 1");
  double prf = 1.0;  // transformers' rotary: .get("partial_rotary_factor", 1.0)
  LS_RETURN_IF_ERROR(f.Float("partial_rotary_factor", &prf, 1.0));
  if (static_cast<int64_t>(static_cast<double>(head_dim) * prf) != rope_dim) {
    return f.Bad("partial_rotary_factor", "rotates " + std::to_string(static_cast<int64_t>(head_dim * prf)) +
                                              " dims but the attention's partial_rotary_factor gives " +
                                              std::to_string(rope_dim) + " (put it in each sub-dict)");
  }
  if (type == "default") return Status::Ok();
  if (type != "yarn") return f.Bad("rope_type", "'" + type + "' is not supported (default, yarn)");
  r->yarn = true;
  LS_RETURN_IF_ERROR(f.Int("original_max_position_embeddings", &r->original_max_position_embeddings, max_pos));
  if (r->original_max_position_embeddings <= 0) return f.Bad("original_max_position_embeddings", "must be > 0");
  LS_RETURN_IF_ERROR(f.Float("factor", &r->factor, 0.0));
  if (r->factor == 0.0) {
    r->factor = static_cast<double>(max_pos) / static_cast<double>(r->original_max_position_embeddings);
  }
  if (!(r->factor > 0.0)) return f.Bad("factor", "must be > 0");
  LS_RETURN_IF_ERROR(f.Float("beta_fast", &r->beta_fast, 32.0));
  LS_RETURN_IF_ERROR(f.Float("beta_slow", &r->beta_slow, 1.0));
  if (r->beta_fast == 0) r->beta_fast = 32.0;  // transformers: `get("beta_fast") or 32`
  if (r->beta_slow == 0) r->beta_slow = 1.0;
  LS_RETURN_IF_ERROR(f.Bool("truncate", &r->truncate, true));
  double mscale = 0, mscale_all = 0, af = 0;
  LS_RETURN_IF_ERROR(f.Float("mscale", &mscale, 0.0));
  LS_RETURN_IF_ERROR(f.Float("mscale_all_dim", &mscale_all, 0.0));
  LS_RETURN_IF_ERROR(f.Float("attention_factor", &af, flat ? 1.0 : 0.0));
  r->mscale = mscale;
  r->mscale_all_dim = mscale_all;
  r->attention_factor_field = af;
  if (af != 0.0) {
    r->attention_factor = af;
  } else if (mscale != 0.0 && mscale_all != 0.0) {
    r->attention_factor = YarnMscale(r->factor, mscale) / YarnMscale(r->factor, mscale_all);
  } else {
    r->attention_factor = YarnMscale(r->factor, 1.0);
  }
  if (!(r->attention_factor > 0.0)) return f.Bad("attention_factor", "must be > 0");
  return Status::Ok();
}

// rope_parameters nested {main, compress} or flat keys (with rope_theta / compress_rope_theta).
Status ParseRopes(const json& j, const std::string& origin, ModelConfig* c) {
  V4Config& v = c->v4;
  Fields top(j, origin);
  double theta = 0, ctheta = 0;
  LS_RETURN_IF_ERROR(top.Float("rope_theta", &theta, 10000.0));
  LS_RETURN_IF_ERROR(top.Float("compress_rope_theta", &ctheta, 160000.0));
  const int64_t d = v.head_dim, rd = v.rope_dim, mp = c->max_position_embeddings;
  const json* rp = j.contains("rope_parameters") && !j.at("rope_parameters").is_null() ? &j.at("rope_parameters") : nullptr;
  if (rp != nullptr && !rp->is_object()) return top.Bad("rope_parameters", "must be an object");
  if (rp != nullptr && rp->contains("main")) {
    if (!rp->at("main").is_object()) return top.Bad("rope_parameters.main", "must be an object");
    if (!rp->contains("compress") || !rp->at("compress").is_object()) {
      return top.Bad("rope_parameters.compress", "must be an object when rope_parameters.main is given");
    }
    LS_RETURN_IF_ERROR(ParseRopeDict(rp->at("main"), origin, "rope_parameters.main.", false, d, rd, mp, &v.main_rope));
    LS_RETURN_IF_ERROR(
        ParseRopeDict(rp->at("compress"), origin, "rope_parameters.compress.", false, d, rd, mp, &v.compress_rope));
    return Status::Ok();
  }
  // Flat: main = {default, rope_theta, prf}; compress = {the flat (YaRN) keys, compress_rope_theta, prf}.
  json flat = rp != nullptr ? *rp : json::object();
  if (j.contains("rope_scaling") && j.at("rope_scaling").is_object()) {
    for (auto it = j.at("rope_scaling").begin(); it != j.at("rope_scaling").end(); ++it) {
      if (!flat.contains(it.key())) flat[it.key()] = it.value();
    }
  }
  json main = {{"rope_type", "default"}, {"rope_theta", theta}, {"partial_rotary_factor", v.partial_rotary_factor}};
  json comp = flat;
  comp["rope_theta"] = ctheta;
  comp["partial_rotary_factor"] = v.partial_rotary_factor;
  if (!comp.contains("rope_type") && !comp.contains("type")) comp["rope_type"] = "default";
  LS_RETURN_IF_ERROR(ParseRopeDict(main, origin, "", true, d, rd, mp, &v.main_rope));
  return ParseRopeDict(comp, origin, "rope_parameters.", true, d, rd, mp, &v.compress_rope);
}

// layer_types, or the legacy compress_ratios, or the V4-Pro default pattern.
Status ParseLayerTypes(const json& j, const std::string& origin, int64_t n, std::vector<std::string>* out) {
  Fields f(j, origin);
  if (f.Has("layer_types")) {
    const json& a = j.at("layer_types");
    if (!a.is_array()) return f.Bad("layer_types", "must be a list");
    for (const json& e : a) {
      if (!e.is_string() || (e != kSliding && e != kCsa && e != kHca)) {
        return f.Bad("layer_types", std::string("must list ") + kSliding + " | " + kCsa + " | " + kHca);
      }
      if (static_cast<int64_t>(out->size()) < n) out->push_back(e.get<std::string>());  // truncated to n
    }
  } else if (f.Has("compress_ratios")) {
    const json& a = j.at("compress_ratios");
    if (!a.is_array()) return f.Bad("compress_ratios", "must be a list");
    for (const json& e : a) {
      if (!e.is_number_integer()) return f.Bad("compress_ratios", "must list integers (0, 4 or 128)");
      const int64_t r = e.get<int64_t>();
      if (r != 0 && r != 4 && r != 128) return f.Bad("compress_ratios", "must list 0, 4 or 128, found " + std::to_string(r));
      if (static_cast<int64_t>(out->size()) < n) out->push_back(r == 0 ? kSliding : r == 4 ? kCsa : kHca);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) out->push_back(i < 2 || (i - 2) % 2 == 0 ? kHca : kCsa);
  }
  if (static_cast<int64_t>(out->size()) != n) {
    return f.Bad(f.Has("layer_types") ? "layer_types" : "compress_ratios",
                 "has " + std::to_string(out->size()) + " entries for " + std::to_string(n) + " layers");
  }
  return Status::Ok();
}

}  // namespace

Status V4ConfigFromJson(std::string_view text, const std::string& origin, ModelConfig* cp) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::InvalidArgument(origin + ": not a JSON object");
  ModelConfig& c = *cp;
  V4Config& v = c.v4;
  Fields f(j, origin);
  c.family = ModelFamily::kDeepseekV4;
  c.model_type = "deepseek_v4";
  LS_RETURN_IF_ERROR(f.Int("vocab_size", &c.vocab_size, 129280));
  LS_RETURN_IF_ERROR(f.Int("hidden_size", &c.hidden_size, 4096));
  if (f.Has("moe_intermediate_size")) {
    LS_RETURN_IF_ERROR(f.Int("moe_intermediate_size", &c.moe_intermediate_size, 2048));
  } else {  // attribute_map: intermediate_size → moe_intermediate_size
    LS_RETURN_IF_ERROR(f.Int("intermediate_size", &c.moe_intermediate_size, 2048));
  }
  LS_RETURN_IF_ERROR(f.Int("num_hidden_layers", &c.num_hidden_layers, 43));
  LS_RETURN_IF_ERROR(f.Int("num_attention_heads", &c.num_attention_heads, 64));
  c.num_key_value_heads = 1;  // transformers hard-wires one shared K = V head
  LS_RETURN_IF_ERROR(f.Int("head_dim", &v.head_dim, 512));
  LS_RETURN_IF_ERROR(f.Int("q_lora_rank", &c.q_lora_rank, 1024));
  if (f.Has("n_routed_experts")) {
    LS_RETURN_IF_ERROR(f.Int("n_routed_experts", &c.n_routed_experts, 256));
  } else {  // attribute_map: num_local_experts → n_routed_experts
    LS_RETURN_IF_ERROR(f.Int("num_local_experts", &c.n_routed_experts, 256));
  }
  LS_RETURN_IF_ERROR(f.Int("n_shared_experts", &c.n_shared_experts, 1));
  LS_RETURN_IF_ERROR(f.Int("num_experts_per_tok", &c.num_experts_per_tok, 6));
  LS_RETURN_IF_ERROR(f.Float("routed_scaling_factor", &c.routed_scaling_factor, 1.5));
  c.norm_topk_prob = true;  // V4 always renormalises the chosen weights
  LS_RETURN_IF_ERROR(f.Float("rms_norm_eps", &c.rms_norm_eps, 1e-6));
  LS_RETURN_IF_ERROR(f.Int("max_position_embeddings", &c.max_position_embeddings, 1048576));
  LS_RETURN_IF_ERROR(f.Bool("tie_word_embeddings", &c.tie_word_embeddings, false));
  LS_RETURN_IF_ERROR(f.Int("bos_token_id", &c.bos_token_id, 0));
  if (f.Has("eos_token_id") && j.at("eos_token_id").is_array()) {
    for (const json& e : j.at("eos_token_id")) {
      if (!e.is_number_integer()) return f.Bad("eos_token_id", "must hold integers");
      c.eos_token_ids.push_back(e.get<int64_t>());
    }
  } else {
    int64_t eos = 0;
    LS_RETURN_IF_ERROR(f.Int("eos_token_id", &eos, 1));
    c.eos_token_ids.push_back(eos);
  }
  LS_RETURN_IF_ERROR(f.Int("num_nextn_predict_layers", &c.num_mtp_layers, 1));
  LS_RETURN_IF_ERROR(f.Int("index_n_heads", &c.index_n_heads, 64));
  LS_RETURN_IF_ERROR(f.Int("index_head_dim", &c.index_head_dim, 128));
  LS_RETURN_IF_ERROR(f.Int("index_topk", &c.index_topk, 512));
  LS_RETURN_IF_ERROR(f.Int("o_groups", &v.o_groups, 8));
  LS_RETURN_IF_ERROR(f.Int("o_lora_rank", &v.o_lora_rank, 1024));
  LS_RETURN_IF_ERROR(f.Int("sliding_window", &v.sliding_window, 128));
  LS_RETURN_IF_ERROR(f.Int("hc_mult", &v.hc_mult, 4));
  LS_RETURN_IF_ERROR(f.Int("hc_sinkhorn_iters", &v.hc_sinkhorn_iters, 20));
  LS_RETURN_IF_ERROR(f.Float("hc_eps", &v.hc_eps, 1e-6));
  LS_RETURN_IF_ERROR(f.Float("swiglu_limit", &v.swiglu_limit, 10.0));
  LS_RETURN_IF_ERROR(f.Float("partial_rotary_factor", &v.partial_rotary_factor, 64.0 / 512.0));

  std::string s;
  LS_RETURN_IF_ERROR(f.String("hidden_act", &s, "silu"));
  if (s != "silu") return f.Bad("hidden_act", "'" + s + "' is not supported (silu)");
  LS_RETURN_IF_ERROR(f.String("scoring_func", &s, "sqrtsoftplus"));
  if (s != "sqrtsoftplus") return f.Bad("scoring_func", "'" + s + "' is not supported (sqrtsoftplus)");
  if (f.Has("quantization_config")) {
    const json& q = j.at("quantization_config");
    if (!q.is_object()) return f.Bad("quantization_config", "must be an object");
    const std::string method = q.value("quant_method", "");
    if (method != "fp8") {
      // MXFP4 / NVFP4 routed experts come with branch v4fmt's WeightView dtypes.
      return Status::Unsupported(origin + ": field 'quantization_config.quant_method': '" + method +
                                 "' (only fp8 block-scaled weights so far)");
    }
    const auto bs = q.find("weight_block_size");
    if (bs == q.end() || !bs->is_array() || bs->size() != 2 || !(*bs)[0].is_number_integer() ||
        !(*bs)[1].is_number_integer() || (*bs)[0].get<int64_t>() <= 0 || (*bs)[1].get<int64_t>() <= 0) {
      return f.Bad("quantization_config.weight_block_size", "must be two positive integers");
    }
    c.fp8_block_rows = (*bs)[0].get<int64_t>();
    c.fp8_block_cols = (*bs)[1].get<int64_t>();
  }

  // Dimensions: positive and small enough that products cannot overflow.
  struct Dim {
    const char* name;
    int64_t v;
  };
  for (const Dim& d : {Dim{"vocab_size", c.vocab_size}, Dim{"hidden_size", c.hidden_size},
                       Dim{"num_hidden_layers", c.num_hidden_layers}, Dim{"num_attention_heads", c.num_attention_heads},
                       Dim{"head_dim", v.head_dim}, Dim{"q_lora_rank", c.q_lora_rank},
                       Dim{"moe_intermediate_size", c.moe_intermediate_size},
                       Dim{"n_routed_experts", c.n_routed_experts}, Dim{"num_experts_per_tok", c.num_experts_per_tok},
                       Dim{"o_groups", v.o_groups}, Dim{"o_lora_rank", v.o_lora_rank},
                       Dim{"hc_mult", v.hc_mult}, Dim{"hc_sinkhorn_iters", v.hc_sinkhorn_iters},
                       Dim{"max_position_embeddings", c.max_position_embeddings}}) {
    if (d.v <= 0 || d.v > (int64_t{1} << 24)) return f.Bad(d.name, "has an impossible value " + std::to_string(d.v));
  }
  if (c.num_hidden_layers > 4096) return f.Bad("num_hidden_layers", "is too large");
  if (v.hc_mult > 64) return f.Bad("hc_mult", "is too large (at most 64 streams)");
  if (c.n_shared_experts < 0 || c.n_shared_experts > 1) {
    return f.Bad("n_shared_experts", "must be 0 or 1 (V4's shared expert is one MLP of moe_intermediate_size)");
  }
  if (c.num_experts_per_tok > c.n_routed_experts) return f.Bad("num_experts_per_tok", "must be ≤ n_routed_experts");
  if (c.num_mtp_layers < 0) return f.Bad("num_nextn_predict_layers", "must be ≥ 0");
  if (c.q_lora_rank <= 0) return f.Bad("q_lora_rank", "is required (> 0) by deepseek_v4");
  if ((c.num_attention_heads * v.head_dim) % v.o_groups != 0) {
    return f.Bad("o_groups", "must divide num_attention_heads × head_dim");
  }
  if (!(v.swiglu_limit > 0)) return f.Bad("swiglu_limit", "must be > 0 (0 zeroes every expert)");
  if (v.sliding_window < 2) return f.Bad("sliding_window", "must be ≥ 2");
  if (!(v.hc_eps >= 0)) return f.Bad("hc_eps", "must be ≥ 0");
  if (!(c.rms_norm_eps > 0)) return f.Bad("rms_norm_eps", "must be > 0");
  if (!(c.routed_scaling_factor > 0)) return f.Bad("routed_scaling_factor", "must be > 0");
  if (!(v.partial_rotary_factor > 0 && v.partial_rotary_factor <= 1)) {
    return f.Bad("partial_rotary_factor", "must be in (0, 1]");
  }
  v.rope_dim = static_cast<int64_t>(static_cast<double>(v.head_dim) * v.partial_rotary_factor);
  if (v.rope_dim <= 0 || v.rope_dim % 2 != 0) {
    return f.Bad("partial_rotary_factor", "gives " + std::to_string(v.rope_dim) + " rotated dims (must be even, > 0)");
  }
  c.qk_rope_head_dim = v.rope_dim;  // transformers sets config.qk_rope_head_dim so
  LS_RETURN_IF_ERROR(ParseRopes(j, origin, &c));

  // Attention kinds and compression rates.
  std::vector<std::string> types;
  LS_RETURN_IF_ERROR(ParseLayerTypes(j, origin, c.num_hidden_layers, &types));
  bool any_csa = false, any_hca = false;
  for (const auto& t : types) any_csa |= t == kCsa, any_hca |= t == kHca;
  int64_t legacy_csa = 4, legacy_hca = 128;
  LS_RETURN_IF_ERROR(f.Int("compress_rate_csa", &legacy_csa, 4));
  LS_RETURN_IF_ERROR(f.Int("compress_rate_hca", &legacy_hca, 128));
  v.csa_rate = legacy_csa;
  v.hca_rate = legacy_hca;
  if (f.Has("compress_rates")) {
    const json& r = j.at("compress_rates");
    if (!r.is_object()) return f.Bad("compress_rates", "must be an object");
    Fields fr(r, origin, "compress_rates.");
    // transformers' CSA cache builds the HCA one, which reads the HCA key: both are needed.
    if ((any_csa || any_hca) && !fr.Has(kHca)) return fr.Bad(kHca, "is missing");
    if (any_csa && !fr.Has(kCsa)) return fr.Bad(kCsa, "is missing");
    LS_RETURN_IF_ERROR(fr.Int(kCsa, &v.csa_rate, legacy_csa));
    LS_RETURN_IF_ERROR(fr.Int(kHca, &v.hca_rate, legacy_hca));
  }
  if (any_csa && (v.csa_rate < 1 || v.csa_rate > 65536)) {
    return f.Bad("compress_rates.compressed_sparse_attention", "must be in 1..65536");
  }
  if (any_hca && (v.hca_rate < 1 || v.hca_rate > 65536)) {
    return f.Bad("compress_rates.heavily_compressed_attention", "must be in 1..65536");
  }
  if (any_csa) {
    if (c.index_n_heads <= 0 || c.index_n_heads > 4096) return f.Bad("index_n_heads", "must be in 1..4096");
    if (c.index_head_dim <= 0 || c.index_head_dim > 65536) return f.Bad("index_head_dim", "must be in 1..65536");
    if (c.index_topk <= 0) return f.Bad("index_topk", "must be > 0");
    if (v.rope_dim > c.index_head_dim) return f.Bad("index_head_dim", "must be ≥ the rotated dims (head_dim × partial_rotary_factor)");
  }

  // FFN kinds: mlp_layer_types, or the first num_hash_layers (default 3) hash-routed.
  std::vector<std::string> mlp;
  if (f.Has("mlp_layer_types")) {
    const json& a = j.at("mlp_layer_types");
    if (!a.is_array() || static_cast<int64_t>(a.size()) != c.num_hidden_layers) {
      return f.Bad("mlp_layer_types", "must list hash_moe | moe for each of the " +
                                          std::to_string(c.num_hidden_layers) + " layers");
    }
    for (const json& e : a) {
      if (!e.is_string() || (e != "hash_moe" && e != "moe")) return f.Bad("mlp_layer_types", "must list hash_moe | moe");
      mlp.push_back(e.get<std::string>());
    }
  } else {
    int64_t nh = 3;
    LS_RETURN_IF_ERROR(f.Int("num_hash_layers", &nh, 3));
    if (nh < 0) return f.Bad("num_hash_layers", "must be ≥ 0");
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) mlp.push_back(i < nh ? "hash_moe" : "moe");
  }

  c.layers.clear();
  v.num_hash_layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerSpec sp;
    sp.residual = ResidualKind::kHyperConnection;
    if (types[l] == kSliding) {
      sp.attention = AttentionKind::kSliding;
    } else if (types[l] == kCsa) {
      sp.attention = AttentionKind::kCompressedSparse;
      sp.compress_rate = v.csa_rate;
    } else {
      sp.attention = AttentionKind::kHeavilyCompressed;
      sp.compress_rate = v.hca_rate;
    }
    sp.ffn = mlp[l] == "hash_moe" ? FfnKind::kHashMoe : FfnKind::kMoe;
    v.num_hash_layers += sp.ffn == FfnKind::kHashMoe;
    c.layers.push_back(sp);
  }
  return Status::Ok();
}

std::vector<V4StreamSpec> V4LayerStreams(const ModelConfig& c, int64_t l) {
  std::vector<V4StreamSpec> out;
  if (!c.is_v4()) return out;
  const V4Config& v = c.v4;
  const LayerSpec& s = c.layers[l];
  const int64_t d = v.head_dim, di = c.index_head_dim, m = s.compress_rate;
  // The window keeps W − 1 rows after a step (the query's own row joins them).
  out.push_back({V4Stream::kWindow, "window", d, 1, v.sliding_window - 1});
  if (s.attention == AttentionKind::kHeavilyCompressed) {
    out.push_back({V4Stream::kCompressorState, "compressor", 2 * d, 1, m});
    out.push_back({V4Stream::kCompressed, "compressed", d, m, 0});
  } else if (s.attention == AttentionKind::kCompressedSparse) {
    // CSA pools the current window's second half with the previous window's first half.
    out.push_back({V4Stream::kCompressorState, "compressor", 4 * d, 1, 2 * m});
    out.push_back({V4Stream::kCompressed, "compressed", d, m, 0});
    out.push_back({V4Stream::kIndexerState, "indexer_state", 4 * di, 1, 2 * m});
    out.push_back({V4Stream::kIndexerKey, "indexer_k", di, m, 0});
  }
  return out;
}

std::string_view V4AttentionName(const LayerSpec& s) {
  switch (s.attention) {
    case AttentionKind::kSliding: return kSliding;
    case AttentionKind::kCompressedSparse: return kCsa;
    case AttentionKind::kHeavilyCompressed: return kHca;
    default: return "mla";
  }
}

std::string_view V4FfnName(const LayerSpec& s) { return s.ffn == FfnKind::kHashMoe ? "hash_moe" : "moe"; }

}  // namespace lockstep::engine
