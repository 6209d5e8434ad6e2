// engine/model.cc — a loaded model: its RoPE tables, the weight forms made on first use
// (fp8_dot's, the 4-bit experts'), MoE routing, and Model::Forward, which checks a step and
// hands it to its family's forward pass (engine/mla_model.cc for V2/V3/V3.2, engine/v4_model.cc).
#include "engine/model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <numeric>

#include "engine/mla_model.h"
#include "engine/v4_model.h"
#include "engine/v4_weights.h"
#include "kernels/fp4.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"

namespace lockstep::engine {

namespace cpu = kernels::cpu;

namespace {

double YarnCorrectionDim(double rot, double dim, double base, double max_pos) {
  return (dim * std::log(max_pos / (rot * 2.0 * M_PI))) / (2.0 * std::log(base));
}

}  // namespace

Model::Model(ModelConfig c, ModelWeights w) : config_(std::move(c)), weights_(std::move(w)) {
  // RoPE inverse frequencies in fp32, the way transformers computes them.
  const int64_t d = config_.qk_rope_head_dim;
  const double base = config_.rope.theta;
  std::vector<float> pos_freqs(d / 2);
  for (int64_t i = 0; i < d / 2; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(d);
    pos_freqs[i] = static_cast<float>(std::pow(base, static_cast<double>(e)));
  }
  inv_freq_.resize(d / 2);
  if (!config_.rope.yarn) {
    for (int64_t i = 0; i < d / 2; ++i) inv_freq_[i] = 1.0f / pos_freqs[i];
  } else {
    const RopeConfig& r = config_.rope;
    double low = YarnCorrectionDim(r.beta_fast, d, base, r.original_max_position_embeddings);
    double high = YarnCorrectionDim(r.beta_slow, d, base, r.original_max_position_embeddings);
    if (r.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(d - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < d / 2; ++i) {
      const float extra = 1.0f / pos_freqs[i];
      const float inter = 1.0f / (static_cast<float>(r.factor) * pos_freqs[i]);
      float ramp = static_cast<float>((static_cast<float>(i) - low) / (high - low));
      ramp = std::clamp(ramp, 0.0f, 1.0f);
      const float extra_factor = 1.0f - ramp;
      inv_freq_[i] = inter * (1.0f - extra_factor) + extra * extra_factor;
    }
  }
  tap_names_.resize(config_.num_hidden_layers);
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    for (int t = 0; t < kTapCount; ++t) {
      tap_names_[l].push_back("layers." + std::to_string(l) + "." + std::string(kLayerTaps[t].name));
    }
  }
}

const ModelWeights& Model::Fp8Weights() {
  if (weights_.fp8_tensors > 0) return weights_;
  std::lock_guard<std::mutex> lock(lazy_mu_);
  if (!fp8_weights_) {
    auto w = std::make_unique<ModelWeights>(weights_);  // views: no weight is copied
    auto quantize = [](Matrix& m) {
      if (m.empty()) return;
      const std::vector<float> v = m.Dequantized();
      m = Matrix::FromFp8(std::make_shared<const Fp8Blocks>(Fp8Blocks::Quantize(v.data(), m.rows, m.cols)));
    };
    ForEachProductMatrix(*w, quantize);
    if (w->v4 != nullptr) {
      auto v4 = std::make_shared<V4Weights>(*w->v4);
      ForEachV4ProductMatrix(*v4, /*experts_only=*/false, quantize);
      w->v4 = std::move(v4);
    }
    fp8_weights_ = std::move(w);
  }
  return *fp8_weights_;
}

const ModelWeights& Model::Fp4Weights(kernels::WeightDType format) {
  std::lock_guard<std::mutex> lock(lazy_mu_);
  std::unique_ptr<ModelWeights>& slot = format == kernels::WeightDType::kMxfp4 ? mxfp4_weights_ : nvfp4_weights_;
  if (!slot) {
    auto w = std::make_unique<ModelWeights>(weights_);
    if (w->v4 != nullptr) {
      auto v4 = std::make_shared<V4Weights>(*w->v4);
      ForEachV4ProductMatrix(*v4, /*experts_only=*/true, [&](Matrix& m) {
        if (m.empty() || m.data.dtype == format) return;  // the checkpoint's own 4-bit experts
        const std::vector<float> v = m.Dequantized();
        auto q = std::make_shared<const kernels::Fp4Matrix>(format == kernels::WeightDType::kMxfp4
                                                                ? kernels::QuantizeMxfp4(v.data(), m.rows, m.cols)
                                                                : kernels::QuantizeNvfp4(v.data(), m.rows, m.cols));
        Matrix f;
        f.rows = m.rows;
        f.cols = m.cols;
        f.data = q->view();
        f.storage = std::move(q);
        m = std::move(f);
      });
      w->v4 = std::move(v4);
    }
    slot = std::move(w);
  }
  return *slot;
}

void Model::RopeTable(int64_t positions, std::vector<float>* cos, std::vector<float>* sin) {
  const std::shared_ptr<const RopeTables> t = Rope(positions);
  const size_t n = static_cast<size_t>(positions * (config_.qk_rope_head_dim / 2));
  cos->assign(t->cos.begin(), t->cos.begin() + n);
  sin->assign(t->sin.begin(), t->sin.begin() + n);
}

std::shared_ptr<const Model::RopeTables> Model::Rope(int64_t positions) {
  std::lock_guard<std::mutex> lock(rope_mu_);
  const int64_t half = config_.qk_rope_head_dim / 2;
  const int64_t have = rope_ == nullptr || half == 0 ? 0 : static_cast<int64_t>(rope_->cos.size()) / half;
  if (rope_ != nullptr && positions <= have) return rope_;
  const int64_t target = std::max<int64_t>(positions, have * 2);
  auto t = std::make_shared<RopeTables>();
  if (rope_ != nullptr) *t = *rope_;  // the positions it has, as they are
  t->cos.resize(target * half);
  t->sin.resize(target * half);
  const float af = static_cast<float>(config_.rope.attention_factor);
  for (int64_t p = have; p < target; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const float f = inv_freq_[i] * static_cast<float>(p);
      t->cos[p * half + i] = std::cos(f) * af;
      t->sin[p * half + i] = std::sin(f) * af;
    }
  }
  rope_ = std::move(t);
  return rope_;
}

Result<std::shared_ptr<Model>> Model::Load(const std::filesystem::path& dir) {
  LS_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Load(dir));
  LS_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
  LS_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::Load(config, *ckpt));
  return FromParts(std::move(config), std::move(weights));
}

Result<std::shared_ptr<Model>> Model::RandomWeights(const std::filesystem::path& dir, uint64_t seed) {
  LS_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Load(dir));
  ModelWeights weights;
  weights.random_seed = seed;
  return FromParts(std::move(config), std::move(weights));
}

Result<std::shared_ptr<Model>> Model::FromParts(ModelConfig config, ModelWeights weights) {
  if (weights.shapes_only) return Status::InvalidArgument("Model::FromParts: weights without bytes (ModelWeights::Shapes)");
  return std::shared_ptr<Model>(new Model(std::move(config), std::move(weights)));
}

int64_t Model::ParameterCount() const { return engine::ParameterCount(config_, weights_); }

int64_t Model::ActiveParameterCount() const { return engine::ActiveParameterCount(config_, weights_); }

// ---------------------------------------------------------------------------------------------
// The forward pass.

Result<SegmentLayout> LayOutSegments(std::span<const Segment> segs, const ModelConfig& c) {
  SegmentLayout out;
  out.row0.resize(segs.size());
  for (size_t s = 0; s < segs.size(); ++s) {
    const Segment& g = segs[s];
    if (g.cache == nullptr || g.cache->length != g.start_pos) {
      return Status::Internal("Forward: segment of request " + std::to_string(g.request_id) +
                              " starts at position " + std::to_string(g.start_pos) + " but its cache holds " +
                              std::to_string(g.cache ? g.cache->length : -1) + " tokens");
    }
    if (g.tokens.empty()) return Status::Internal("Forward: empty segment");
    for (int32_t t : g.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return Status::InvalidArgument("token id " + std::to_string(t) + " outside the vocabulary (0.." +
                                       std::to_string(c.vocab_size - 1) + ")");
      }
    }
    out.row0[s] = out.rows;
    out.rows += static_cast<int64_t>(g.tokens.size());
    out.max_end = std::max<int64_t>(out.max_end, g.start_pos + static_cast<int64_t>(g.tokens.size()));
  }
  return out;
}

void RouteExperts(const ModelConfig& c, const float* bias, const float* logits_in, int32_t* ids, float* w) {
  const int64_t E = c.n_routed_experts, k = c.num_experts_per_tok;
  std::vector<float> logits(logits_in, logits_in + E), scores(E), choice(E);
  std::vector<bool> allowed(E, true);
  if (c.gate == GateKind::kSigmoidNoauxTc) {
    for (int64_t e = 0; e < E; ++e) {
      scores[e] = 1.0f / (1.0f + cpu::ExpF(-logits[e]));
      choice[e] = scores[e] + bias[e];
    }
  } else {
    scores = logits;
    cpu::Softmax(scores.data(), E);
    choice = scores;
  }
  // Group-limited selection (V3: group score = sum of its top-2; V2 group_limited: its max).
  if (c.gate != GateKind::kSoftmaxGreedy && c.n_group > 1) {
    const int64_t G = c.n_group, per = E / G;
    std::vector<std::pair<float, int64_t>> gs(G);
    for (int64_t g = 0; g < G; ++g) {
      float a = -INFINITY, b = -INFINITY;
      for (int64_t j = 0; j < per; ++j) {
        float v = choice[g * per + j];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      gs[g] = {c.gate == GateKind::kSigmoidNoauxTc ? a + b : a, g};
    }
    std::stable_sort(gs.begin(), gs.end(), [](auto& p, auto& q) { return p.first > q.first; });
    std::vector<bool> gkeep(G, false);
    for (int64_t i = 0; i < c.topk_group; ++i) gkeep[gs[i].second] = true;
    for (int64_t e = 0; e < E; ++e) allowed[e] = gkeep[e / per];
  }
  std::vector<int32_t> order;
  for (int64_t e = 0; e < E; ++e) {
    if (allowed[e]) order.push_back(static_cast<int32_t>(e));
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return choice[a] > choice[b]; });
  order.resize(k);
  std::sort(order.begin(), order.end());
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) {
    ids[i] = order[i];
    w[i] = scores[order[i]];
    // Hidden fault zoo: the selection score (score + correction bias) taken as the weight.
    if (kernels::HiddenFaultOrNone() == kernels::HiddenFault::kRouterBiasInWeights) w[i] = choice[order[i]];
    sum += w[i];
  }
  if (c.norm_topk_prob) {
    const float denom = static_cast<float>(sum) + 1e-20f;
    for (int64_t i = 0; i < k; ++i) w[i] /= denom;
  }
  for (int64_t i = 0; i < k; ++i) w[i] *= static_cast<float>(c.routed_scaling_factor);
}

Status Model::Forward(std::span<Segment> segs, PagedKvCache& cache, const kernels::KernelPlan& plan,
                      TapHook* hook, ForwardOutput* out) {
  if (config_.is_v4() && !random_weights()) {
    const ModelWeights& W = plan.fp8_weights() ? Fp8Weights()
                            : plan.gemm == kernels::Gemm::kMxfp4Dot ? Fp4Weights(kernels::WeightDType::kMxfp4)
                            : plan.gemm == kernels::Gemm::kNvfp4Dot ? Fp4Weights(kernels::WeightDType::kNvfp4)
                                                                    : weights_;
    return V4Forward(config_, W, segs, cache, plan, hook, out);
  }
  const ModelConfig& c = config_;
  if (random_weights()) {
    return Status::Unsupported("--random-weights: the weights exist only on the GPU; run with --backend cuda");
  }
  if (plan.indexer_hadamard() && c.has_indexer() && (c.index_head_dim & (c.index_head_dim - 1)) != 0) {
    return Status::InvalidArgument(std::string("--kernel indexer=") +
                                   (plan.indexer == kernels::Indexer::kFp8Paged ? "fp8_paged" : "hadamard") +
                                   ": index_head_dim " + std::to_string(c.index_head_dim) +
                                   " is not a power of two (the Hadamard rotation)");
  }
  // The weights as stored (gemm=bf16 rounds them in its products); fp8_dot's FP8 forms.
  const ModelWeights& W = plan.fp8_weights() ? Fp8Weights() : weights_;

  // Rows, positions, and validation.
  LS_ASSIGN_OR_RETURN(SegmentLayout layout, LayOutSegments(segs, c));
  for (auto& g : segs) LS_RETURN_IF_ERROR(cache.Reserve(g.cache, g.start_pos + static_cast<int64_t>(g.tokens.size())));
  // The pass's own snapshot of the tables (another thread's pass may make longer ones meanwhile).
  const std::shared_ptr<const RopeTables> rope = Rope(layout.max_end);
  return MlaForward(c, W, segs, layout, cache, plan, MlaTables{rope->cos, rope->sin, tap_names_}, hook, out);
}

}  // namespace lockstep::engine
