// engine/weights.cc — see weights.h.
#include "engine/weights.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>

#include "engine/v4_weights.h"
#include "kernels/cpu/numerics.h"
#include "kernels/fp4.h"

namespace lockstep::engine {
namespace {

// Bytes of a tensor where a view may read them: in place when aligned to `align` (safetensors
// writers align every tensor to its element size), else an aligned copy (`*owner` keeps it).
const uint8_t* InPlaceOrCopy(const TensorView& t, size_t align, std::shared_ptr<const void>* owner) {
  if (reinterpret_cast<uintptr_t>(t.data) % align == 0) {
    *owner = t.mapping;
    return t.data;
  }
  auto copy = std::make_shared<std::vector<uint64_t>>((t.nbytes + 7) / 8);
  std::memcpy(copy->data(), t.data, t.nbytes);
  *owner = copy;
  return reinterpret_cast<const uint8_t*>(copy->data());
}

// The name of an F8_E4M3 weight's block scales: "<name>_scale_inv" for "….weight".
std::string ScaleName(const std::string& name) {
  std::string sname = name;
  if (sname.size() > 7 && sname.compare(sname.size() - 7, 7, ".weight") == 0) sname += "_scale_inv";
  return sname;
}

// Whether DeepSeek publishes tensor `name` [rows, cols] of an FP8 checkpoint in FP8: the
// layers' linear weights but the router (`mlp.gate`) and the indexer's weights_proj; never the
// embeddings, lm_head or a vector.
bool PublishedInFp8(const std::string& name, size_t dims) {
  return dims == 2 && name.rfind("model.layers.", 0) == 0 && name.ends_with("_proj.weight") &&
         name.find("weights_proj") == std::string::npos;
}

// Reads the tensors Build asks for from a checkpoint, or — `ck` null (ModelWeights::Shapes) —
// makes matrices of those shapes without bytes.
class Loader {
 public:
  Loader(const ModelConfig& c, const Checkpoint* ck, ModelWeights* w, kernels::WeightDType shapes_dtype)
      : c_(c), ck_(ck), w_(w), shapes_dtype_(shapes_dtype) {}

  // Optional tensors a config-only folder is taken to have: an untied lm_head, V3's bias.
  bool Has(const std::string& name) const {
    if (ck_ == nullptr) return name == "lm_head.weight" ? !c_.tie_word_embeddings : name.ends_with("_bias");
    return ck_->Find(name) != nullptr;
  }

  // `name` with the expected shape ({n} for vectors, {rows, cols} for matrices, {n, rows, cols}
  // for stacked matrices): LoadMatrix's Matrix.
  Status Get(const std::string& name, std::vector<int64_t> shape, Matrix* out) {
    if (ck_ == nullptr) return Shape(name, shape, out);
    return LoadConfiguredMatrix(*ck_, c_, name, shape, out, w_, &used_);
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
  // A matrix of `shape` stored as shapes_dtype_ — or FP8 blocks where PublishedInFp8 and the
  // config declares FP8 — with no bytes (values and scales null).
  Status Shape(const std::string& name, const std::vector<int64_t>& shape, Matrix* out) {
    const int64_t cols = shape.back(), rows = cols == 0 ? 0 : [&] {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      return n / cols;
    }();
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    if (c_.fp8_block_rows > 0 && PublishedInFp8(name, shape.size())) {
      auto f = std::make_shared<Fp8Blocks>();
      f->rows = rows;
      f->cols = cols;
      f->block_rows = c_.fp8_block_rows;
      f->block_cols = c_.fp8_block_cols;
      m = Matrix::FromFp8(std::move(f));
      w_->fp8_tensors++;
    } else {
      m.data.dtype = shapes_dtype_;
      m.data.rows = rows;
      m.data.cols = cols;
    }
    w_->dtype_counts[kernels::WeightDTypeName(m.data.dtype)]++;
    *out = std::move(m);
    return Status::Ok();
  }

  const ModelConfig& c_;
  const Checkpoint* ck_;
  ModelWeights* w_;
  kernels::WeightDType shapes_dtype_;
  std::set<std::string> used_;
};

// `<p>` of a `<p>.weight` name, else "" (a name with no companion tensors).
std::string WeightStem(const std::string& name) {
  return name.size() > 7 && name.ends_with(".weight") ? name.substr(0, name.size() - 7) : std::string();
}

// fp8 value × scale[row / block_rows, col / block_cols], both read in place: the scales are
// `<name>_scale_inv` F32 (transformers) or `<p>.scale` F8_E8M0 / F32 (DeepSeek's official
// files; E8M0 decoded to fp32 once: 2^(e − 127), exact).
Result<Matrix> Fp8Matrix(const Checkpoint& ck, const TensorView& t, const std::string& name, int64_t br, int64_t bc,
                         std::vector<std::string>* companions) {
  if (t.shape.size() != 2) return Status::Unsupported(t.file + ": tensor '" + name + "': F8_E4M3 must be 2-D");
  std::string sname = ScaleName(name);
  const TensorView* s = ck.Find(sname);
  if (s == nullptr && !WeightStem(name).empty() && ck.Find(WeightStem(name) + ".scale") != nullptr) {
    sname = WeightStem(name) + ".scale";
    s = ck.Find(sname);
  }
  if (s == nullptr) {
    return Status::NotFound(t.file + ": tensor '" + name + "' is F8_E4M3 but '" + ScaleName(name) + "' is missing");
  }
  const int64_t rows = t.shape[0], cols = t.shape[1];
  const std::vector<int64_t> want = {(rows + br - 1) / br, (cols + bc - 1) / bc};
  const bool e8m0 = s->dtype == DType::kF8E8M0;
  if (s->shape != want || (s->dtype != DType::kF32 && !e8m0)) {
    TensorView w;
    w.shape = want;
    return Status::Corruption(s->file + ": tensor '" + sname + "': must be F32 (or F8_E8M0) " + w.ShapeString() +
                              ", found " + std::string(DTypeName(s->dtype)) + " " + s->ShapeString());
  }
  if (companions != nullptr) companions->push_back(sname);
  auto f = std::make_shared<Fp8Blocks>();
  f->rows = rows;
  f->cols = cols;
  f->block_rows = br;
  f->block_cols = bc;
  std::shared_ptr<const void> scales_owner;
  const size_t nscales = static_cast<size_t>(want[0] * want[1]);
  const uint8_t* scales = nullptr;
  if (e8m0) {
    auto decoded = std::make_shared<std::vector<float>>(nscales);
    const float* table = kernels::E8m0Table();
    for (size_t i = 0; i < nscales; ++i) (*decoded)[i] = table[s->data[i]];
    scales = reinterpret_cast<const uint8_t*>(decoded->data());
    scales_owner = std::move(decoded);
  } else {
    scales = InPlaceOrCopy(*s, 4, &scales_owner);
  }
  f->values = {t.data, static_cast<size_t>(rows * cols)};
  f->scales = {reinterpret_cast<const float*>(scales), nscales};
  // The mapping holds both, unless the scales had to be copied.
  using Pins = std::pair<std::shared_ptr<const void>, std::shared_ptr<const void>>;
  f->storage = scales_owner == t.mapping ? t.mapping : std::make_shared<const Pins>(t.mapping, scales_owner);
  return Matrix::FromFp8(std::move(f));
}

kernels::StoredTensor Stored(const TensorView& t) {
  kernels::StoredTensor s;
  s.name = t.name;
  s.dtype = std::string(DTypeName(t.dtype));
  s.shape = t.shape;
  s.data = t.data;
  s.nbytes = t.nbytes;
  s.file = t.file;
  return s;
}

// The 4-bit format a `<p>.weight` of I8 / U8 is stored in, from the tensors beside it: MXFP4
// (`<p>.scale`), NVFP4 (`<p>.weight_scale` and `<p>.weight_scale_2`), or none.
std::optional<kernels::WeightDType> Fp4Format(const Checkpoint& ck, const TensorView& t) {
  const std::string stem = WeightStem(t.name);
  if ((t.dtype != DType::kI8 && t.dtype != DType::kU8) || t.shape.size() != 2 || stem.empty()) return std::nullopt;
  if (ck.Find(stem + ".scale") != nullptr) return kernels::WeightDType::kMxfp4;
  if (ck.Find(stem + ".weight_scale") != nullptr && ck.Find(stem + ".weight_scale_2") != nullptr) {
    return kernels::WeightDType::kNvfp4;
  }
  return std::nullopt;
}

// A 4-bit weight [rows, cols] from its codes [rows, cols/2] and scales, read in place.
Result<Matrix> Fp4Matrix(const Checkpoint& ck, const TensorView& t, kernels::WeightDType format,
                         std::vector<std::string>* companions) {
  const std::vector<std::string> names = kernels::Fp4TensorNames(format, WeightStem(t.name));
  std::vector<kernels::StoredTensor> parts;
  for (const std::string& n : names) parts.push_back(Stored(*ck.Find(n)));  // Fp4Format saw each one
  const int64_t rows = t.shape[0], cols = t.shape[1] * 2;
  Result<kernels::WeightView> v = format == kernels::WeightDType::kMxfp4
                                      ? kernels::Mxfp4View(parts[0], parts[1], rows, cols)
                                      : kernels::Nvfp4View(parts[0], parts[1], parts[2], rows, cols);
  if (!v.ok()) return v.status();
  if (companions != nullptr) {
    companions->insert(companions->end(), names.begin() + 1, names.end());
    // NVFP4's activation scale (W4A4 kernels'): stored with the weight, read by nothing here.
    const std::string input_scale = WeightStem(t.name) + ".input_scale";
    if (format == kernels::WeightDType::kNvfp4 && ck.Find(input_scale) != nullptr) companions->push_back(input_scale);
  }
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.data = *v;
  m.storage = t.mapping;  // one mapping holds a shard's tensors; a format's tensors share a shard
  for (size_t i = 1; i < names.size(); ++i) {
    if (ck.Find(names[i])->mapping != t.mapping) {
      using Pins = std::pair<std::shared_ptr<const void>, std::shared_ptr<const void>>;
      m.storage = std::make_shared<const Pins>(m.storage, ck.Find(names[i])->mapping);
    }
  }
  return m;
}

}  // namespace

Result<Matrix> LoadMatrix(const Checkpoint& ck, const std::string& name, int64_t block_rows, int64_t block_cols,
                          std::vector<std::string>* companions) {
  const TensorView* t = ck.Find(name);
  if (t == nullptr) return Status::NotFound("checkpoint: tensor '" + name + "' is missing");
  if (t->dtype == DType::kF8E4M3) return Fp8Matrix(ck, *t, name, block_rows, block_cols, companions);
  if (auto f = Fp4Format(ck, *t)) return Fp4Matrix(ck, *t, *f, companions);
  kernels::WeightDType dtype;
  switch (t->dtype) {
    case DType::kF32: dtype = kernels::WeightDType::kF32; break;
    case DType::kBF16: dtype = kernels::WeightDType::kBf16; break;
    case DType::kF16: dtype = kernels::WeightDType::kF16; break;
    default:
      return Status::Unsupported(t->file + ": tensor '" + name + "': dtype " + std::string(DTypeName(t->dtype)) +
                                 " is not a weight dtype (F32, BF16, F16, F8_E4M3)");
  }
  const int64_t cols = t->shape.empty() ? 1 : t->shape.back();
  const int64_t rows = cols == 0 ? 0 : t->numel() / cols;
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.data.dtype = dtype;
  m.data.rows = rows;
  m.data.cols = cols;
  m.data.values = InPlaceOrCopy(*t, DTypeSize(t->dtype), &m.storage);
  // Vectors are read whole by the norms and the router: fp32 once, here.
  if (t->shape.size() <= 1) return Matrix::Fp32(m.Dequantized(), rows, cols);
  return m;
}

std::vector<int64_t> LogicalShape(const Checkpoint& ck, const TensorView& t) {
  std::vector<int64_t> shape = t.shape;
  if (Fp4Format(ck, t)) shape.back() *= 2;
  return shape;
}

Status LoadConfiguredMatrix(const Checkpoint& ck, const ModelConfig& c, const std::string& name,
                            const std::vector<int64_t>& shape, Matrix* out, ModelWeights* w,
                            std::set<std::string>* used) {
  const TensorView* t = ck.Find(name);
  if (t == nullptr) return Status::NotFound("checkpoint: tensor '" + name + "' is missing");
  used->insert(name);
  const std::optional<kernels::WeightDType> fp4 = Fp4Format(ck, *t);
  const std::vector<int64_t> logical = LogicalShape(ck, *t);
  if (logical != shape) {
    TensorView want, held;
    want.shape = shape;
    held.shape = logical;
    return Status::Corruption(t->file + ": tensor '" + name + "': shape " + t->ShapeString() +
                              (fp4 ? std::string(" (") + kernels::WeightDTypeName(*fp4) + ": " + held.ShapeString() +
                                         " values, two a byte)"
                                   : "") +
                              " but config.json implies " + want.ShapeString());
  }
  w->dtype_counts[fp4 ? std::string(kernels::WeightDTypeName(*fp4)) : std::string(DTypeName(t->dtype))]++;
  const int64_t br = c.fp8_block_rows > 0 ? c.fp8_block_rows : 128;
  const int64_t bc = c.fp8_block_cols > 0 ? c.fp8_block_cols : 128;
  std::vector<std::string> companions;
  LS_ASSIGN_OR_RETURN(*out, LoadMatrix(ck, name, br, bc, &companions));
  if (out->fp8 != nullptr) w->fp8_tensors++;
  used->insert(companions.begin(), companions.end());
  return Status::Ok();
}

Matrix Matrix::Rows(int64_t first, int64_t n) const {
  Matrix m = *this;
  m.rows = n;
  m.data = data.Rows(first, n);
  m.fp8 = nullptr;
  if (fp8 != nullptr && first % fp8->block_rows == 0) {  // a slice on block rows is FP8 blocks itself
    auto f = std::make_shared<Fp8Blocks>(*fp8);
    f->rows = n;
    f->values = fp8->values.subspan(static_cast<size_t>(first * cols), static_cast<size_t>(n * cols));
    f->scales = fp8->scales.subspan(static_cast<size_t>(first / fp8->block_rows * fp8->scale_cols()),
                                    static_cast<size_t>((n + fp8->block_rows - 1) / fp8->block_rows * fp8->scale_cols()));
    m.fp8 = std::move(f);
  }
  return m;
}

std::vector<float> Matrix::Dequantized() const {
  std::vector<float> v(static_cast<size_t>(rows * cols));
  if (!v.empty()) data.DecodeRows(0, rows, v.data());
  return v;
}

Matrix Matrix::Fp32(std::vector<float> values, int64_t rows, int64_t cols) {
  auto owned = std::make_shared<const std::vector<float>>(std::move(values));
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.data.dtype = kernels::WeightDType::kF32;
  m.data.rows = rows;
  m.data.cols = cols;
  m.data.values = owned->data();
  m.storage = std::move(owned);
  return m;
}

Matrix Matrix::FromFp8(std::shared_ptr<const Fp8Blocks> f) {
  Matrix m;
  m.rows = f->rows;
  m.cols = f->cols;
  m.data = f->view();
  m.storage = f;
  m.fp8 = std::move(f);
  return m;
}

kernels::WeightView Fp8Blocks::view() const {
  kernels::WeightView v;
  v.dtype = kernels::WeightDType::kFp8E4m3Blocks;
  v.rows = rows;
  v.cols = cols;
  v.values = values.data();
  v.scales = scales.data();
  v.block_rows = block_rows;
  v.block_cols = block_cols;
  return v;
}

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
  struct Owned {
    std::vector<uint8_t> values;
    std::vector<float> scales;
  };
  auto owned = std::make_shared<Owned>();
  std::vector<uint8_t>& values = owned->values;
  std::vector<float>& scales = owned->scales;
  values.resize(static_cast<size_t>(rows * cols));
  const int64_t brs = (rows + block_rows - 1) / block_rows, bcs = f.scale_cols();
  scales.resize(static_cast<size_t>(brs * bcs));
  for (int64_t bi = 0; bi < brs; ++bi) {
    for (int64_t bj = 0; bj < bcs; ++bj) {
      const int64_t r0 = bi * block_rows, r1 = std::min(rows, r0 + block_rows);
      const int64_t c0 = bj * block_cols, c1 = std::min(cols, c0 + block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(m[r * cols + c]));
      }
      const float scale = amax > 0.0f ? amax / kernels::kFp8E4m3Max : 1.0f;
      scales[bi * bcs + bj] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) values[r * cols + c] = kernels::F32ToFp8E4m3(m[r * cols + c] / scale);
      }
    }
  }
  f.values = values;
  f.scales = scales;
  f.storage = std::move(owned);
  return f;
}

namespace {

// Every tensor of the model, through `ld`, into `w`.
Status Build(const ModelConfig& c, Loader& ld, ModelWeights& w) {
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
        L.router_bias = Matrix::Fp32(std::vector<float>(E, 0.0f), 1, E);
      }
    }
    L.experts.resize(E);
    if (ld.Has(m + ".experts.gate_up_proj")) {
      // transformers 5's fused layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I],
      // held as [E·2I, H] and [E·H, I]; each expert's matrices are views of their rows.
      Matrix gu, dn;
      LS_RETURN_IF_ERROR(ld.Get(m + ".experts.gate_up_proj", {E, 2 * I, H}, &gu));
      LS_RETURN_IF_ERROR(ld.Get(m + ".experts.down_proj", {E, H, I}, &dn));
      for (int64_t e = 0; e < E; ++e) {
        MlpWeights& X = L.experts[e];
        X.gate = gu.Rows(e * 2 * I, I);
        X.up = gu.Rows(e * 2 * I + I, I);
        X.down = dn.Rows(e * H, H);
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
  return Status::Ok();
}

}  // namespace

Result<ModelWeights> ModelWeights::Load(const ModelConfig& c, const Checkpoint& ck) {
  ModelWeights w;
  if (c.is_v4()) {
    LS_RETURN_IF_ERROR(LoadV4Weights(c, ck, &w));
    return w;
  }
  w.mapped_bytes = ck.file_bytes();
  Loader ld(c, &ck, &w, kernels::WeightDType::kF32);
  LS_RETURN_IF_ERROR(Build(c, ld, w));
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

int64_t ParameterCount(const ModelConfig& c, const ModelWeights& w) {
  auto n = [](const Matrix& m) { return static_cast<int64_t>(m.data.size()); };
  auto mlp = [&](const MlpWeights& m) { return n(m.gate) + n(m.up) + n(m.down); };
  int64_t total = n(w.embed) + n(w.final_norm) + (c.tie_word_embeddings ? 0 : n(w.lm_head));
  for (const auto& L : w.layers) {
    total += n(L.input_norm) + n(L.post_attn_norm) + n(L.q_proj) + n(L.q_a_proj) + n(L.q_a_norm) + n(L.q_b_proj) +
             n(L.kv_a_proj) + n(L.kv_a_norm) + n(L.kv_b_proj) + n(L.o_proj) + n(L.indexer.wq_b) + n(L.indexer.wk) +
             n(L.indexer.k_norm_w) + n(L.indexer.k_norm_b) + n(L.indexer.weights_proj) + mlp(L.mlp) + n(L.router) +
             mlp(L.shared);
    for (const auto& e : L.experts) total += mlp(e);
  }
  if (w.v4 != nullptr) total += w.v4->parameters;
  return total;
}

int64_t ActiveParameterCount(const ModelConfig& c, const ModelWeights& w) {
  int64_t total = ParameterCount(c, w);
  if (w.v4 != nullptr) total -= w.v4->inactive_experts;
  for (const auto& L : w.layers) {
    if (L.experts.empty()) continue;
    const auto& e = L.experts[0];
    const int64_t per = static_cast<int64_t>(e.gate.data.size() + e.up.data.size() + e.down.data.size());
    total -= per * (static_cast<int64_t>(L.experts.size()) - c.num_experts_per_tok);
  }
  return total;
}

ModelWeights ModelWeights::Shapes(const ModelConfig& c, kernels::WeightDType dtype) {
  ModelWeights w;
  w.shapes_only = true;
  if (c.is_v4()) return w;  // not yet: `model info` prints V4's layer pattern and cache instead
  Loader ld(c, nullptr, &w, dtype);
  const Status s = Build(c, ld, w);
  assert(s.ok());  // no tensor to be missing or of the wrong shape
  (void)s;
  return w;
}

}  // namespace lockstep::engine
