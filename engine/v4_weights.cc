// engine/v4_weights.cc — see v4_weights.h.
#include "engine/v4_weights.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <utility>

namespace lockstep::engine {
namespace {

// transformers 5.17's conversion_mapping for DeepSeek-V4, applied in this order to the part
// after "layers.L." (or to the whole name of a model-level tensor).
constexpr std::pair<const char*, const char*> kLayerRenames[] = {
    {"attn_norm.", "input_layernorm."},
    {"ffn_norm.", "post_attention_layernorm."},
    {"hc_attn_fn", "attn_hc.fn"},
    {"hc_attn_base", "attn_hc.base"},
    {"hc_attn_scale", "attn_hc.scale"},
    {"hc_ffn_fn", "ffn_hc.fn"},
    {"hc_ffn_base", "ffn_hc.base"},
    {"hc_ffn_scale", "ffn_hc.scale"},
    {"attn.indexer.compressor.", "self_attn.compressor.indexer."},
    {"attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."},
    {"attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."},
    {"attn.", "self_attn."},
    {"ffn.", "mlp."},
};
// Then, on the leaf names (a component between dots).
constexpr std::pair<const char*, const char*> kLeafRenames[] = {
    {"attn_sink", "sinks"}, {"wq_a", "q_a_proj"}, {"wq_b", "q_b_proj"}, {"wkv", "kv_proj"},
    {"wgate", "gate_proj"}, {"wo_a", "o_a_proj"}, {"wo_b", "o_b_proj"}, {"q_norm", "q_a_norm"},
    {"ape", "position_bias"}, {"w1", "gate_proj"}, {"w2", "down_proj"}, {"w3", "up_proj"},
};

std::string ReplaceComponent(std::string s, const std::string& from, const std::string& to) {
  size_t pos = 0;
  while ((pos = s.find(from, pos)) != std::string::npos) {
    const bool left = pos == 0 || s[pos - 1] == '.';
    const size_t end = pos + from.size();
    const bool right = end == s.size() || s[end] == '.';
    if (left && right) {
      s.replace(pos, from.size(), to);
      pos += to.size();
    } else {
      pos = end;
    }
  }
  return s;
}

// Reads V4 tensors by their transformers names (through the official-name aliases).
class V4Loader {
 public:
  V4Loader(const ModelConfig& c, const Checkpoint& ck, ModelWeights* w) : c_(c), ck_(ck), w_(w) {
    for (const auto& [name, t] : ck.tensors()) {
      const std::string hf = V4OfficialToHf(name);
      if (hf != name) alias_[hf] = name;
    }
  }

  const TensorView* Find(const std::string& hf) const {
    if (const TensorView* t = ck_.Find(hf)) return t;
    auto it = alias_.find(hf);
    return it == alias_.end() ? nullptr : ck_.Find(it->second);
  }
  std::string Stored(const std::string& hf) const {
    auto it = alias_.find(hf);
    return ck_.Find(hf) == nullptr && it != alias_.end() ? it->second : hf;
  }
  bool Has(const std::string& hf) const { return Find(hf) != nullptr; }

  Status Get(const std::string& hf, const std::vector<int64_t>& shape, Matrix* out, int64_t* count) {
    const TensorView* t = Find(hf);
    if (t == nullptr) return Status::NotFound("checkpoint: tensor '" + hf + "' is missing");
    LS_RETURN_IF_ERROR(LoadConfiguredMatrix(ck_, c_, Stored(hf), shape, out, w_, &used_));
    if (count != nullptr) *count += out->rows * out->cols;
    return Status::Ok();
  }

  // tid2eid [V, k] (I64 or I32): every id must name an expert.
  Status Ids(const std::string& hf, int64_t rows, int64_t cols, int64_t experts, std::vector<int32_t>* out) {
    const TensorView* t = Find(hf);
    if (t == nullptr) return Status::NotFound("checkpoint: tensor '" + hf + "' is missing");
    const std::string name = Stored(hf);
    used_.insert(name);
    if (t->shape != std::vector<int64_t>{rows, cols} || (t->dtype != DType::kI64 && t->dtype != DType::kI32)) {
      return Status::Corruption(t->file + ": tensor '" + name + "': must be I64 [" + std::to_string(rows) + ", " +
                                std::to_string(cols) + "], found " + std::string(DTypeName(t->dtype)) + " " +
                                t->ShapeString());
    }
    w_->dtype_counts[std::string(DTypeName(t->dtype))]++;
    out->resize(static_cast<size_t>(rows * cols));
    for (int64_t i = 0; i < rows * cols; ++i) {
      int64_t v = 0;
      if (t->dtype == DType::kI64) {
        std::memcpy(&v, t->data + i * 8, 8);
      } else {
        int32_t v32 = 0;
        std::memcpy(&v32, t->data + i * 4, 4);
        v = v32;
      }
      if (v < 0 || v >= experts) {
        return Status::Corruption(t->file + ": tensor '" + name + "': token " + std::to_string(i / cols) +
                                  " routes to expert " + std::to_string(v) + " (n_routed_experts " +
                                  std::to_string(experts) + ")");
      }
      (*out)[i] = static_cast<int32_t>(v);
    }
    return Status::Ok();
  }

  const std::set<std::string>& used() const { return used_; }

 private:
  const ModelConfig& c_;
  const Checkpoint& ck_;
  ModelWeights* w_;
  std::map<std::string, std::string> alias_;  // transformers name → stored (official) name
  std::set<std::string> used_;
};

}  // namespace

std::string V4OfficialToHf(const std::string& stored) {
  // transformers' save_pretrained writes the official leaf names under "model." (model.layers.L.attn.wq_a…),
  // DeepSeek's files without it: both map.
  const bool prefixed = stored.rfind("model.", 0) == 0;
  const std::string name = prefixed ? stored.substr(6) : stored;
  if (name.rfind("lm_head.", 0) == 0 || name.rfind("mtp.", 0) == 0) return stored;
  if (name == "embed.weight") return "model.embed_tokens.weight";
  if (name == "head.weight") return "lm_head.weight";
  if (name.rfind("hc_head_", 0) == 0) return "model.hc_head.hc_" + name.substr(8);  // hc_head_fn → hc_head.hc_fn
  if (name.rfind("layers.", 0) != 0) return prefixed || name.rfind("norm.", 0) == 0 ? "model." + name : stored;
  const size_t dot = name.find('.', 7);
  if (dot == std::string::npos) return stored;
  std::string rest = name.substr(dot + 1);
  for (const auto& [from, to] : kLayerRenames) {
    if (rest.rfind(from, 0) == 0) {
      rest = to + rest.substr(std::strlen(from));
      break;
    }
  }
  for (const auto& [from, to] : kLeafRenames) rest = ReplaceComponent(rest, from, to);
  rest = ReplaceComponent(rest, "self_attn.norm", "self_attn.kv_norm");  // the attention's kv norm
  rest = ReplaceComponent(rest, "compressor.norm", "compressor.kv_norm");
  rest = ReplaceComponent(rest, "indexer.norm", "indexer.kv_norm");
  rest = ReplaceComponent(rest, "gate.bias", "gate.e_score_correction_bias");
  return "model." + name.substr(0, dot + 1) + rest;
}

Status LoadV4Weights(const ModelConfig& c, const Checkpoint& ck, ModelWeights* w) {
  const V4Config& v = c.v4;
  const int64_t D = c.hidden_size, H = c.num_attention_heads, d = v.head_dim, r = c.q_lora_rank;
  const int64_t hc = v.hc_mult, G = v.o_groups, R = v.o_lora_rank, E = c.n_routed_experts;
  const int64_t I = c.moe_intermediate_size, k = c.num_experts_per_tok, Hi = c.index_n_heads, di = c.index_head_dim;
  V4Loader ld(c, ck, w);
  auto v4 = std::make_shared<V4Weights>();
  int64_t* params = &v4->parameters;
  w->mapped_bytes = ck.file_bytes();
  LS_RETURN_IF_ERROR(ld.Get("model.embed_tokens.weight", {c.vocab_size, D}, &w->embed, nullptr));
  LS_RETURN_IF_ERROR(ld.Get("model.norm.weight", {D}, &w->final_norm, nullptr));
  if (ld.Has("lm_head.weight")) {
    LS_RETURN_IF_ERROR(ld.Get("lm_head.weight", {c.vocab_size, D}, &w->lm_head, nullptr));
  } else if (c.tie_word_embeddings) {
    w->lm_head = w->embed;
  } else {
    return Status::NotFound("checkpoint: tensor 'lm_head.weight' is missing (and tie_word_embeddings is false)");
  }
  LS_RETURN_IF_ERROR(ld.Get("model.hc_head.hc_fn", {hc, hc * D}, &v4->head.fn, params));
  LS_RETURN_IF_ERROR(ld.Get("model.hc_head.hc_base", {hc}, &v4->head.base, params));
  LS_RETURN_IF_ERROR(ld.Get("model.hc_head.hc_scale", {1}, &v4->head.scale, params));

  auto hc_weights = [&](const std::string& p, V4HcWeights* x) -> Status {
    const int64_t mix = (2 + hc) * hc;
    LS_RETURN_IF_ERROR(ld.Get(p + ".fn", {mix, hc * D}, &x->fn, params));
    LS_RETURN_IF_ERROR(ld.Get(p + ".base", {mix}, &x->base, params));
    return ld.Get(p + ".scale", {3}, &x->scale, params);
  };
  auto compressor = [&](const std::string& p, int64_t width, int64_t m, int64_t norm, V4CompressorWeights* x) -> Status {
    LS_RETURN_IF_ERROR(ld.Get(p + ".kv_proj.weight", {width, D}, &x->kv_proj, params));
    LS_RETURN_IF_ERROR(ld.Get(p + ".gate_proj.weight", {width, D}, &x->gate_proj, params));
    LS_RETURN_IF_ERROR(ld.Get(p + ".position_bias", {m, width}, &x->position_bias, params));
    return ld.Get(p + ".kv_norm.weight", {norm}, &x->kv_norm, params);
  };
  auto mlp = [&](const std::string& p, MlpWeights* x, int64_t* count) -> Status {
    LS_RETURN_IF_ERROR(ld.Get(p + ".gate_proj.weight", {I, D}, &x->gate, count));
    LS_RETURN_IF_ERROR(ld.Get(p + ".up_proj.weight", {I, D}, &x->up, count));
    return ld.Get(p + ".down_proj.weight", {D, I}, &x->down, count);
  };

  v4->layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerSpec& s = c.layers[l];
    V4LayerWeights& L = v4->layers[l];
    const std::string p = "model.layers." + std::to_string(l);
    LS_RETURN_IF_ERROR(hc_weights(p + ".attn_hc", &L.attn_hc));
    LS_RETURN_IF_ERROR(hc_weights(p + ".ffn_hc", &L.ffn_hc));
    LS_RETURN_IF_ERROR(ld.Get(p + ".input_layernorm.weight", {D}, &L.input_norm, params));
    LS_RETURN_IF_ERROR(ld.Get(p + ".post_attention_layernorm.weight", {D}, &L.post_attn_norm, params));
    const std::string a = p + ".self_attn";
    LS_RETURN_IF_ERROR(ld.Get(a + ".q_a_proj.weight", {r, D}, &L.q_a_proj, params));
    LS_RETURN_IF_ERROR(ld.Get(a + ".q_a_norm.weight", {r}, &L.q_a_norm, params));
    LS_RETURN_IF_ERROR(ld.Get(a + ".q_b_proj.weight", {H * d, r}, &L.q_b_proj, params));
    LS_RETURN_IF_ERROR(ld.Get(a + ".kv_proj.weight", {d, D}, &L.kv_proj, params));
    LS_RETURN_IF_ERROR(ld.Get(a + ".kv_norm.weight", {d}, &L.kv_norm, params));
    LS_RETURN_IF_ERROR(ld.Get(a + ".sinks", {H}, &L.sinks, params));
    LS_RETURN_IF_ERROR(ld.Get(a + ".o_a_proj.weight", {G * R, H * d / G}, &L.o_a_proj, params));
    LS_RETURN_IF_ERROR(ld.Get(a + ".o_b_proj.weight", {D, G * R}, &L.o_b_proj, params));
    const int64_t m = s.compress_rate;
    if (s.attention == AttentionKind::kHeavilyCompressed) {
      LS_RETURN_IF_ERROR(compressor(a + ".compressor", d, m, d, &L.compressor));
    } else if (s.attention == AttentionKind::kCompressedSparse) {
      LS_RETURN_IF_ERROR(compressor(a + ".compressor", 2 * d, m, d, &L.compressor));
      const std::string ix = a + ".compressor.indexer";
      LS_RETURN_IF_ERROR(compressor(ix, 2 * di, m, di, &L.indexer));
      LS_RETURN_IF_ERROR(ld.Get(ix + ".q_b_proj.weight", {Hi * di, r}, &L.indexer_q_b, params));
      LS_RETURN_IF_ERROR(ld.Get(ix + ".scorer.weights_proj.weight", {Hi, D}, &L.indexer_weights, params));
    }
    const std::string f = p + ".mlp";
    LS_RETURN_IF_ERROR(ld.Get(f + ".gate.weight", {E, D}, &L.router, params));
    if (s.ffn == FfnKind::kHashMoe) {
      LS_RETURN_IF_ERROR(ld.Ids(f + ".gate.tid2eid", c.vocab_size, k, E, &L.tid2eid));
    } else if (ld.Has(f + ".gate.e_score_correction_bias")) {
      LS_RETURN_IF_ERROR(ld.Get(f + ".gate.e_score_correction_bias", {E}, &L.router_bias, params));
    } else {
      L.router_bias = Matrix::Fp32(std::vector<float>(E, 0.0f), 1, E);
    }
    L.experts.resize(E);
    int64_t expert_params = 0;
    if (ld.Has(f + ".experts.gate_up_proj")) {
      // transformers' fused layout: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I].
      Matrix gu, dn;
      LS_RETURN_IF_ERROR(ld.Get(f + ".experts.gate_up_proj", {E, 2 * I, D}, &gu, &expert_params));
      LS_RETURN_IF_ERROR(ld.Get(f + ".experts.down_proj", {E, D, I}, &dn, &expert_params));
      for (int64_t e = 0; e < E; ++e) {
        L.experts[e].gate = gu.Rows(e * 2 * I, I);
        L.experts[e].up = gu.Rows(e * 2 * I + I, I);
        L.experts[e].down = dn.Rows(e * D, D);
      }
    } else {  // one tensor a matrix (the official w1 / w3 / w2)
      for (int64_t e = 0; e < E; ++e) {
        LS_RETURN_IF_ERROR(mlp(f + ".experts." + std::to_string(e), &L.experts[e], &expert_params));
      }
    }
    *params += expert_params;
    v4->inactive_experts += expert_params / E * (E - k);
    if (c.n_shared_experts > 0) LS_RETURN_IF_ERROR(mlp(f + ".shared_experts", &L.shared, params));
  }

  for (const auto& [name, t] : ck.tensors()) {
    if (ld.used().count(name)) continue;
    w->skipped.push_back(name);
    const std::string hf = V4OfficialToHf(name);
    const std::string prefix = "model.layers.";
    if (hf.rfind("mtp.", 0) == 0 ||
        (hf.rfind(prefix, 0) == 0 && std::atoll(hf.c_str() + prefix.size()) >= c.num_hidden_layers)) {
      w->mtp_tensors++;
    }
  }
  w->v4 = std::move(v4);
  return Status::Ok();
}

}  // namespace lockstep::engine
