// engine/weights.cc — see weights.h.
#include "engine/weights.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>

#include "kernels/cpu/numerics.h"

namespace lockstep::engine {
namespace {

class Loader {
 public:
  Loader(const ModelConfig& c, const Checkpoint& ck, ModelWeights* w) : c_(c), ck_(ck), w_(w) {}

  bool Has(const std::string& name) const { return ck_.Find(name) != nullptr; }

  // Loads `name` as fp32 with the expected shape ({n} for vectors, {rows, cols} for matrices).
  Status Get(const std::string& name, std::vector<int64_t> shape, Matrix* out) {
    const TensorView* t = ck_.Find(name);
    if (t == nullptr) return Status::NotFound("checkpoint: tensor '" + name + "' is missing");
    used_.insert(name);
    if (t->shape != shape) {
      TensorView want;
      want.shape = shape;
      return Status::Corruption(t->file + ": tensor '" + name + "': shape " + t->ShapeString() +
                                " but config.json implies " + want.ShapeString());
    }
    out->rows = shape.size() == 2 ? shape[0] : 1;
    out->cols = shape.size() == 2 ? shape[1] : shape[0];
    const int64_t n = t->numel();
    out->data.resize(n);
    float* dst = out->data.data();
    const uint8_t* src = t->data;
    w_->dtype_counts[std::string(DTypeName(t->dtype))]++;
    switch (t->dtype) {
      case DType::kF32:
        std::memcpy(dst, src, n * sizeof(float));
        break;
      case DType::kBF16:
        for (int64_t i = 0; i < n; ++i) {
          uint16_t h;
          std::memcpy(&h, src + 2 * i, 2);
          dst[i] = kernels::Bf16ToF32(h);
        }
        break;
      case DType::kF16:
        for (int64_t i = 0; i < n; ++i) {
          uint16_t h;
          std::memcpy(&h, src + 2 * i, 2);
          dst[i] = kernels::F16ToF32(h);
        }
        break;
      case DType::kF8E4M3:
        LS_RETURN_IF_ERROR(DequantFp8(*t, name, dst, &out->fp8));
        break;
      default:
        return Status::Unsupported(t->file + ": tensor '" + name + "': dtype " + std::string(DTypeName(t->dtype)) +
                                   " is not a weight dtype (F32, BF16, F16, F8_E4M3)");
    }
    return Status::Ok();
  }

  Status Linear(const std::string& prefix, int64_t out, int64_t in, Matrix* m) {
    return Get(prefix + ".weight", {out, in}, m);
  }
  Status Vector(const std::string& name, int64_t n, Matrix* m) { return Get(name, {n}, m); }

  Status Mlp(const std::string& prefix, int64_t hidden, int64_t inter, MlpWeights* m) {
    LS_RETURN_IF_ERROR(Linear(prefix + ".gate_proj", inter, hidden, &m->gate));
    LS_RETURN_IF_ERROR(Linear(prefix + ".up_proj", inter, hidden, &m->up));
    return Linear(prefix + ".down_proj", hidden, inter, &m->down);
  }

  const std::set<std::string>& used() const { return used_; }

 private:
  // fp8 value × weight_scale_inv[row / block_rows, col / block_cols]
  Status DequantFp8(const TensorView& t, const std::string& name, float* dst,
                    std::shared_ptr<const Fp8Blocks>* fp8) {
    if (t.shape.size() != 2) return Status::Unsupported(t.file + ": tensor '" + name + "': F8_E4M3 must be 2-D");
    std::string sname = name;
    if (sname.size() > 7 && sname.compare(sname.size() - 7, 7, ".weight") == 0) sname += "_scale_inv";
    const TensorView* s = ck_.Find(sname);
    if (s == nullptr) {
      return Status::NotFound(t.file + ": tensor '" + name + "' is F8_E4M3 but '" + sname + "' is missing");
    }
    used_.insert(sname);
    const int64_t br = c_.fp8_block_rows > 0 ? c_.fp8_block_rows : 128;
    const int64_t bc = c_.fp8_block_cols > 0 ? c_.fp8_block_cols : 128;
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const std::vector<int64_t> want = {(rows + br - 1) / br, (cols + bc - 1) / bc};
    if (s->shape != want || s->dtype != DType::kF32) {
      TensorView w;
      w.shape = want;
      return Status::Corruption(s->file + ": tensor '" + sname + "': must be F32 " + w.ShapeString() + ", found " +
                                std::string(DTypeName(s->dtype)) + " " + s->ShapeString());
    }
    w_->fp8_tensors++;
    auto f = std::make_shared<Fp8Blocks>();
    f->rows = rows;
    f->cols = cols;
    f->block_rows = br;
    f->block_cols = bc;
    f->values.assign(t.data, t.data + rows * cols);
    f->scales.resize(want[0] * want[1]);
    std::memcpy(f->scales.data(), s->data, f->scales.size() * 4);
    f->Dequantize(dst);
    *fp8 = std::move(f);
    return Status::Ok();
  }

  const ModelConfig& c_;
  const Checkpoint& ck_;
  ModelWeights* w_;
  std::set<std::string> used_;
};

}  // namespace

float Fp8Blocks::value(int64_t r, int64_t c) const { return kernels::Fp8E4m3Table()[values[r * cols + c]] * scale(r, c); }

void Fp8Blocks::Dequantize(float* dst) const {
  const float* fp8 = kernels::Fp8E4m3Table();  // value()'s product, the table looked up once
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = fp8[values[r * cols + c]] * scale(r, c);
  }
}

Fp8Blocks Fp8Blocks::Quantize(const float* m, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols) {
  Fp8Blocks f;
  f.rows = rows;
  f.cols = cols;
  f.block_rows = block_rows;
  f.block_cols = block_cols;
  f.values.resize(static_cast<size_t>(rows * cols));
  const int64_t brs = (rows + block_rows - 1) / block_rows, bcs = f.scale_cols();
  f.scales.resize(static_cast<size_t>(brs * bcs));
  for (int64_t bi = 0; bi < brs; ++bi) {
    for (int64_t bj = 0; bj < bcs; ++bj) {
      const int64_t r0 = bi * block_rows, r1 = std::min(rows, r0 + block_rows);
      const int64_t c0 = bj * block_cols, c1 = std::min(cols, c0 + block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(m[r * cols + c]));
      }
      const float scale = amax > 0.0f ? amax / kernels::kFp8E4m3Max : 1.0f;
      f.scales[bi * bcs + bj] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) f.values[r * cols + c] = kernels::F32ToFp8E4m3(m[r * cols + c] / scale);
      }
    }
  }
  return f;
}

Result<ModelWeights> ModelWeights::Load(const ModelConfig& c, const Checkpoint& ck) {
  ModelWeights w;
  Loader ld(c, ck, &w);
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  LS_RETURN_IF_ERROR(ld.Linear("model.embed_tokens", c.vocab_size, H, &w.embed));
  LS_RETURN_IF_ERROR(ld.Vector("model.norm.weight", H, &w.final_norm));
  if (ld.Has("lm_head.weight")) {
    LS_RETURN_IF_ERROR(ld.Linear("lm_head", c.vocab_size, H, &w.lm_head));
  } else if (c.tie_word_embeddings) {
    w.lm_head = w.embed;
  } else {
    return Status::NotFound("checkpoint: tensor 'lm_head.weight' is missing (and tie_word_embeddings is false)");
  }

  w.layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& L = w.layers[l];
    const std::string p = "model.layers." + std::to_string(l);
    LS_RETURN_IF_ERROR(ld.Vector(p + ".input_layernorm.weight", H, &L.input_norm));
    LS_RETURN_IF_ERROR(ld.Vector(p + ".post_attention_layernorm.weight", H, &L.post_attn_norm));
    const std::string a = p + ".self_attn";
    const int64_t qdim = nh * c.qk_head_dim();
    if (c.q_lora_rank > 0) {
      LS_RETURN_IF_ERROR(ld.Linear(a + ".q_a_proj", c.q_lora_rank, H, &L.q_a_proj));
      LS_RETURN_IF_ERROR(ld.Vector(a + ".q_a_layernorm.weight", c.q_lora_rank, &L.q_a_norm));
      LS_RETURN_IF_ERROR(ld.Linear(a + ".q_b_proj", qdim, c.q_lora_rank, &L.q_b_proj));
    } else {
      LS_RETURN_IF_ERROR(ld.Linear(a + ".q_proj", qdim, H, &L.q_proj));
    }
    LS_RETURN_IF_ERROR(ld.Linear(a + ".kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H, &L.kv_a_proj));
    LS_RETURN_IF_ERROR(ld.Vector(a + ".kv_a_layernorm.weight", c.kv_lora_rank, &L.kv_a_norm));
    LS_RETURN_IF_ERROR(
        ld.Linear(a + ".kv_b_proj", nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, &L.kv_b_proj));
    LS_RETURN_IF_ERROR(ld.Linear(a + ".o_proj", H, nh * c.v_head_dim, &L.o_proj));
    if (c.layers[l].attention == AttentionKind::kMlaSparse) {
      const std::string ix = a + ".indexer";
      IndexerWeights& I = L.indexer;
      LS_RETURN_IF_ERROR(ld.Linear(ix + ".wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, &I.wq_b));
      LS_RETURN_IF_ERROR(ld.Linear(ix + ".wk", c.index_head_dim, H, &I.wk));
      LS_RETURN_IF_ERROR(ld.Vector(ix + ".k_norm.weight", c.index_head_dim, &I.k_norm_w));
      LS_RETURN_IF_ERROR(ld.Vector(ix + ".k_norm.bias", c.index_head_dim, &I.k_norm_b));
      LS_RETURN_IF_ERROR(ld.Linear(ix + ".weights_proj", c.index_n_heads, H, &I.weights_proj));
    }
    const std::string m = p + ".mlp";
    if (c.layers[l].ffn == FfnKind::kDense) {
      LS_RETURN_IF_ERROR(ld.Mlp(m, H, c.intermediate_size, &L.mlp));
      continue;
    }
    const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
    LS_RETURN_IF_ERROR(ld.Linear(m + ".gate", E, H, &L.router));
    if (c.gate == GateKind::kSigmoidNoauxTc) {
      if (ld.Has(m + ".gate.e_score_correction_bias")) {
        LS_RETURN_IF_ERROR(ld.Vector(m + ".gate.e_score_correction_bias", E, &L.router_bias));
      } else {
        L.router_bias.rows = 1;
        L.router_bias.cols = E;
        L.router_bias.data.assign(E, 0.0f);
      }
    }
    L.experts.resize(E);
    if (ld.Has(m + ".experts.gate_up_proj")) {
      // transformers 5's fused layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
      Matrix gu, dn;
      LS_RETURN_IF_ERROR(ld.Get(m + ".experts.gate_up_proj", {E, 2 * I, H}, &gu));
      LS_RETURN_IF_ERROR(ld.Get(m + ".experts.down_proj", {E, H, I}, &dn));
      for (int64_t e = 0; e < E; ++e) {
        MlpWeights& X = L.experts[e];
        const float* g = gu.data.data() + e * 2 * I * H;
        X.gate = {I, H, std::vector<float>(g, g + I * H)};
        X.up = {I, H, std::vector<float>(g + I * H, g + 2 * I * H)};
        const float* d = dn.data.data() + e * H * I;
        X.down = {H, I, std::vector<float>(d, d + H * I)};
      }
    } else {
      for (int64_t e = 0; e < E; ++e) {
        LS_RETURN_IF_ERROR(ld.Mlp(m + ".experts." + std::to_string(e), H, I, &L.experts[e]));
      }
    }
    if (c.n_shared_experts > 0) {
      LS_RETURN_IF_ERROR(ld.Mlp(m + ".shared_experts", H, I * c.n_shared_experts, &L.shared));
    }
  }
  for (const auto& [name, t] : ck.tensors()) {
    if (ld.used().count(name)) continue;
    w.skipped.push_back(name);
    const std::string prefix = "model.layers.";
    if (name.rfind(prefix, 0) == 0) {
      const int64_t layer = std::atoll(name.c_str() + prefix.size());
      if (layer >= c.num_hidden_layers) w.mtp_tensors++;
    }
  }
  return w;
}

}  // namespace lockstep::engine
