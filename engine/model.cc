// engine/model.cc — the DeepSeek V2/V3/V3.2 forward pass, top to bottom.
//
// Shapes: R = rows in this step (all segments' tokens concatenated), H = hidden, nh = heads,
// dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, C = kv_lora_rank.
// Semantics follow transformers 5.17 (the oracle of tests/model_reference_test.cc); where the
// engine differs in form (absorbed decode) it is equal in exact arithmetic; the absorbed form
// adds in the CUDA kernels' order (cpu::MlaAttend), so the two backends share its bits.
#include "engine/model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <numeric>

#include "engine/gemm.h"
#include "engine/tensor_parallel.h"
#include "engine/v4_weights.h"
#include "kernels/fp4.h"
#include "engine/v4_model.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cpu/ops.h"

namespace lockstep::engine {

namespace cpu = kernels::cpu;

namespace {

// Segment g's rows of a step buffer [R, cols] of `dtype`, its first row at row0, as a tap event.
TapEvent SegmentRowsEvent(const Segment& g, int64_t row0, std::string_view name, const void* data, int64_t cols,
                          TapDType dtype) {
  TapEvent e;
  e.name = name;
  e.request_id = g.request_id;
  e.position = g.start_pos;
  e.rows = static_cast<int64_t>(g.tokens.size());
  e.cols = cols;
  e.dtype = dtype;
  e.data = static_cast<const uint8_t*>(data) + row0 * cols * TapDTypeSize(dtype);
  return e;
}

// Emits one tap per segment: the segment's rows of a [R, cols] buffer.
struct Tapper {
  TapHook* hook;
  std::span<Segment> segs;
  const std::vector<int64_t>& row0;  // first row of each segment
  void Emit(std::string_view name, const float* data, int64_t cols) const { EmitAny(name, data, cols, TapDType::kF32); }
  void EmitI32(std::string_view name, const int32_t* data, int64_t cols) const {
    EmitAny(name, data, cols, TapDType::kI32);
  }
  // Offers each segment's rows of a [R, cols] f32 buffer for overwriting (grafting).
  void Override(std::string_view name, float* data, int64_t cols) const {
    if (hook == nullptr || !hook->WantsOverride()) return;
    for (size_t s = 0; s < segs.size(); ++s) {
      hook->Override(SegmentRowsEvent(segs[s], row0[s], name, data, cols, TapDType::kF32), data + row0[s] * cols);
    }
  }
  void EmitAny(std::string_view name, const void* data, int64_t cols, TapDType dt) const {
    EmitSegmentRows(hook, segs, row0, name, data, cols, dt);
  }
};

// Fault zoo (softmax=fault_no_max_fp16_sum): exp without max subtraction, denominator
// accumulated in fp16. Once Σ exp passes 65504 the sum is inf and every weight 0 (or NaN).
// Where the compiler has no _Float16 (clang 14 on x86: the fuzz build), the sum is kept as
// fp16 bits through kernels::F32ToF16, which rounds as the cast does (tests/numerics_test.cc).
void SoftmaxNoMaxFp16Sum(float* x, int64_t n) {
#ifdef __FLT16_MAX__
  _Float16 sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i]);
    sum = static_cast<_Float16>(static_cast<float>(sum) + x[i]);
  }
  const float inv = 1.0f / static_cast<float>(sum);
#else
  uint16_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i]);
    sum = kernels::F32ToF16(kernels::F16ToF32(sum) + x[i]);
  }
  const float inv = 1.0f / kernels::F16ToF32(sum);
#endif
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Head hd's W_UKᵀ [C, dn] (row c is W_UK's column c) from kv_b_proj [nh·(dn + dv), C]: the
// head's first dn rows dequantised (rounded as the products round them) into `uk` [dn, C], then
// transposed into `wt` — so q_lat's elements are cpu::Dot over wt's rows, as the CUDA
// backend's absorption forms them.
void HeadWukT(const kernels::WeightView& kv_b, int64_t hd, int64_t dn, int64_t dv, kernels::WeightRounding round,
              float* uk, float* wt) {
  const int64_t C = kv_b.cols;
  kv_b.DecodeRows(hd * (dn + dv), dn, uk, round);
  for (int64_t a = 0; a < dn; ++a) {
    for (int64_t cc = 0; cc < C; ++cc) wt[cc * dn + a] = uk[a * C + cc];
  }
}

// Hidden fault zoo (kernels/hidden_fault.h): RMSNorm with the mean over n − 1, or its sum of
// squares in fp32 (used only when a step batches several requests).
void RmsNormMeanNm1(const float* x, const float* w, int64_t rows, int64_t n, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[r * n + i]) * x[r * n + i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n > 1 ? n - 1 : 1) + eps));
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * inv * w[i];
  }
}
void RmsNormFp32Sum(const float* x, const float* w, int64_t rows, int64_t n, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    float ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += x[r * n + i] * x[r * n + i];
    const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ss) / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * inv * w[i];
  }
}

RopeStyle OtherRopeStyle(RopeStyle s) {
  return s == RopeStyle::kHalves ? RopeStyle::kPairsToHalves : RopeStyle::kHalves;
}

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
  std::unique_lock<std::shared_mutex> lock(rope_mu_);
  EnsureRope(positions);
  const size_t n = static_cast<size_t>(positions * (config_.qk_rope_head_dim / 2));
  cos->assign(rope_cos_.begin(), rope_cos_.begin() + n);
  sin->assign(rope_sin_.begin(), rope_sin_.begin() + n);
}

void Model::EnsureRope(int64_t positions) {
  const int64_t half = config_.qk_rope_head_dim / 2;
  const int64_t have = half == 0 ? 0 : static_cast<int64_t>(rope_cos_.size()) / half;
  if (positions <= have) return;
  const int64_t target = std::max<int64_t>(positions, have * 2);
  rope_cos_.resize(target * half);
  rope_sin_.resize(target * half);
  const float af = static_cast<float>(config_.rope.attention_factor);
  for (int64_t p = have; p < target; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const float f = inv_freq_[i] * static_cast<float>(p);
      rope_cos_[p * half + i] = std::cos(f) * af;
      rope_sin_[p * half + i] = std::sin(f) * af;
    }
  }
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

void EmitSegmentRows(TapHook* hook, std::span<const Segment> segs, std::span<const int64_t> row0,
                     std::string_view name, const void* data, int64_t cols, TapDType dtype) {
  if (hook == nullptr) return;
  for (size_t s = 0; s < segs.size(); ++s) hook->OnTap(SegmentRowsEvent(segs[s], row0[s], name, data, cols, dtype));
}

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

struct Model::Impl {
  // Chooses the experts of one token. Returns ids (ascending) and their weights.
  static void Route(const ModelConfig& c, const LayerWeights& L, const float* x, int32_t* ids, float* w) {
    // logits[e] = cpu::Dot(x, router row e): one row through MatMulNT, each element Dot's.
    std::vector<float> logits(c.n_routed_experts);
    cpu::MatMulNT(x, 1, L.router.data, kernels::WeightRounding::kAsStored, logits.data());
    RouteExperts(c, L.router_bias.empty() ? nullptr : L.router_bias.ptr(), logits.data(), ids, w);
  }

  static void Mlp(const Gemm& gemm, const MlpWeights& m, const float* x, int64_t rows, int64_t hidden, float* y) {
    const int64_t inter = m.gate.rows;
    std::vector<float> g(rows * inter), u(rows * inter);
    gemm(x, rows, m.gate, inter, hidden, g.data());
    gemm(x, rows, m.up, inter, hidden, u.data());
    cpu::SwiGlu(g.data(), u.data(), rows * inter, g.data());
    gemm(g.data(), rows, m.down, hidden, inter, y);
  }
  // Emulated TP: the MLP's gate and up (column-parallel: the same values on every rank), then
  // each rank's slice of the down projection — partials [rows, ranks, hidden].
  static void MlpPartials(const Gemm& gemm, const MlpWeights& m, const float* x, int64_t rows, int64_t hidden, int ranks,
                          float* partials) {
    const int64_t inter = m.gate.rows;
    std::vector<float> g(rows * inter), u(rows * inter);
    gemm(x, rows, m.gate, inter, hidden, g.data());
    gemm(x, rows, m.up, inter, hidden, u.data());
    cpu::SwiGlu(g.data(), u.data(), rows * inter, g.data());
    RowParallelPartials(gemm, g.data(), rows, m.down, ranks, 1, partials);
  }
  // Hidden fault zoo: the down projection's K loop stops at the last full 64-wide tile.
  static void MlpDownKTail(const Gemm& gemm, const MlpWeights& m, const float* x, int64_t rows, int64_t hidden, float* y) {
    const int64_t inter = m.gate.rows, full = (inter / 64) * 64;
    std::vector<float> g(rows * inter), u(rows * inter);
    gemm(x, rows, m.gate, inter, hidden, g.data());
    gemm(x, rows, m.up, inter, hidden, u.data());
    cpu::SwiGlu(g.data(), u.data(), rows * inter, g.data());
    for (int64_t r = 0; r < rows; ++r) std::fill(g.begin() + r * inter + full, g.begin() + (r + 1) * inter, 0.0f);
    gemm(g.data(), rows, m.down, hidden, inter, y);
  }
};

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
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, C = c.kv_lora_rank, dqk = dn + dr, half = dr / 2;
  const float scale = static_cast<float>(c.softmax_scale());
  if (random_weights()) {
    return Status::Unsupported("--random-weights: the weights exist only on the GPU; run with --backend cuda");
  }
  const bool prefill_absorbed = plan.attn_prefill == kernels::AttnPrefill::kAbsorbed;
  const bool decode_expanded = plan.attn_decode == kernels::AttnDecode::kExpanded;
  // indexer=fp8_paged: the official indexer's FP8 path — Hadamard-rotated q and k in FP8 (keys so
  // in the cache), scored page by page up to each request's last page.
  const bool indexer_fp8 = plan.indexer == kernels::Indexer::kFp8Paged;
  const bool indexer_hadamard = plan.indexer_hadamard();
  // *_dot and *_heuristic name GPU GEMMs; on the CPU they are its GEMM of that precision (the
  // CPU's is in cpu::Dot's order already), so a GPU trace replays here at its own precision.
  const Gemm gemm{plan.bf16()};
  // gemm=w8a8_dot: fp8_dot's weights, and the linear layers' inputs through FP8 as DeepSeek's
  // inference quantises them (act_quant before fp8_gemm): q, kv_a, o_proj, the MLPs and experts,
  // the indexer's wq_b and wk. Not kv_b (the absorbed path dequantises it and multiplies in
  // bf16), the indexer's weights_proj, the router or lm_head (bf16 layers there).
  const bool w8a8 = plan.w8a8();
  const Gemm linear{gemm.bf16, w8a8};
  // The weights as stored (gemm=bf16 rounds them in its products); fp8_dot's FP8 forms.
  const ModelWeights& W = plan.fp8_weights() ? Fp8Weights() : weights_;
  // norm=lanes256: every RMSNorm in the CUDA kernels' order and precision (fp32 lanes), so a GPU
  // trace's CPU replay gives its norms' bits; the default sums in fp64.
  auto rmsnorm = plan.norm == kernels::Norm::kLanes256 ? cpu::RmsNormLanes256 : cpu::RmsNorm;
  using HF = kernels::HiddenFault;
  const HF hidden = plan.hidden;
  if (plan.norm == kernels::Norm::kFp64 && hidden == HF::kNormMeanOverNMinus1) rmsnorm = RmsNormMeanNm1;
  if (plan.norm == kernels::Norm::kFp64 && hidden == HF::kNormBatchFp32Sum && segs.size() > 1) rmsnorm = RmsNormFp32Sum;
  // Fault zoo (docs/fault-zoo.md): variants of their ops like any other.
  const bool fault_skip_partial = plan.indexer == kernels::Indexer::kFaultSkipPartialPage;
  const bool fault_neg1 = plan.attn_sparse == kernels::AttnSparse::kFaultNeg1AsToken0;
  const bool fault_rope = plan.rope == kernels::Rope::kFaultDecodeWrongInterleave;
  const bool fault_page = plan.page_table == kernels::PageTable::kFaultCrossRequest;
  auto softmax = plan.softmax == kernels::Softmax::kFaultNoMaxFp16Sum ? SoftmaxNoMaxFp16Sum : cpu::Softmax;
  if (indexer_hadamard && c.has_indexer() && (c.index_head_dim & (c.index_head_dim - 1)) != 0) {
    return Status::InvalidArgument(std::string("--kernel indexer=") + (indexer_fp8 ? "fp8_paged" : "hadamard") +
                                   ": index_head_dim " +
                                   std::to_string(c.index_head_dim) + " is not a power of two (the Hadamard rotation)");
  }

  // Rows, positions, and validation.
  LS_ASSIGN_OR_RETURN(SegmentLayout layout, LayOutSegments(segs, c));
  const std::vector<int64_t>& row0 = layout.row0;
  const int64_t R = layout.rows, max_pos = layout.max_end;
  for (auto& g : segs) LS_RETURN_IF_ERROR(cache.Reserve(g.cache, g.start_pos + static_cast<int64_t>(g.tokens.size())));
  // Held for the rest of the pass: another thread's Forward may need longer tables.
  std::shared_lock<std::shared_mutex> rope_lock(rope_mu_);
  if (static_cast<int64_t>(rope_cos_.size()) < max_pos * half) {
    rope_lock.unlock();
    {
      std::unique_lock<std::shared_mutex> grow(rope_mu_);
      EnsureRope(max_pos);
    }
    rope_lock.lock();  // tables never shrink: still long enough
  }
  std::vector<int64_t> pos(R);
  std::vector<size_t> seg_of(R);
  for (size_t s = 0; s < segs.size(); ++s) {
    for (size_t i = 0; i < segs[s].tokens.size(); ++i) {
      pos[row0[s] + i] = segs[s].start_pos + static_cast<int64_t>(i);
      seg_of[row0[s] + i] = s;
    }
  }
  const Tapper tap{hook, segs, row0};
  const bool tapping = hook != nullptr;
  const int tp = plan.emulate_tp;

  // x = embed(tokens)                                     [R, H]
  std::vector<float> x(R * H);
  for (size_t s = 0; s < segs.size(); ++s) {
    for (size_t i = 0; i < segs[s].tokens.size(); ++i) {
      W.embed.data.DecodeRows(segs[s].tokens[i], 1, &x[(row0[s] + i) * H]);
    }
  }
  if (tapping) {
    tap.Emit(kModelTaps[kTapEmbed].name, x.data(), H);
    tap.Override(kModelTaps[kTapEmbed].name, x.data(), H);
  }

  std::vector<float> h(R * H), q(R * nh * dqk), kv(R * (C + dr)), latent(R * C), krope(R * dr);
  std::vector<float> heads(R * nh * dv), o(R * H);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = W.layers[l];
    const auto& names = tap_names_[l];

    // h = RMSNorm(x)                                       [R, H]
    rmsnorm(x.data(), L.input_norm.ptr(), R, H, c.rms_norm_eps, h.data());
    if (tapping) tap.Emit(names[kTapAttnNorm], h.data(), H);

    // q = q_b(RMSNorm(q_a(h))) or q_proj(h)                 [R, nh, dn + dr]
    std::vector<float> q_resid;  // [R, q_lora] — the V3.2 indexer reads it too
    if (c.q_lora_rank > 0) {
      q_resid.resize(R * c.q_lora_rank);
      std::vector<float> qa(R * c.q_lora_rank);
      linear(h.data(), R, L.q_a_proj, c.q_lora_rank, H, qa.data());
      rmsnorm(qa.data(), L.q_a_norm.ptr(), R, c.q_lora_rank, 1e-6, q_resid.data());  // default eps, as HF
      linear(q_resid.data(), R, L.q_b_proj, nh * dqk, c.q_lora_rank, q.data());
    } else {
      linear(h.data(), R, L.q_proj, nh * dqk, H, q.data());
    }

    // [c_kv | k_rope] = kv_a(h); latent = RMSNorm(c_kv)      [R, C], [R, dr]
    linear(h.data(), R, L.kv_a_proj, C + dr, H, kv.data());
    for (int64_t r = 0; r < R; ++r) {
      rmsnorm(&kv[r * (C + dr)], L.kv_a_norm.ptr(), 1, C, 1e-6, &latent[r * C]);
      std::memcpy(&krope[r * dr], &kv[r * (C + dr) + C], dr * sizeof(float));
    }

    // RoPE on q's rope part (every head) and on the shared key.
    for (int64_t r = 0; r < R; ++r) {
      const float* cs = &rope_cos_[pos[r] * half];
      const float* sn = &rope_sin_[pos[r] * half];
      const Segment& sg = segs[seg_of[r]];  // (cs, sn: reassigned only by a hidden fault)
      const bool decode_row = !sg.prefill && sg.tokens.size() == 1 && sg.start_pos > 0;
      const RopeStyle style = fault_rope && decode_row ? OtherRopeStyle(c.rope_style) : c.rope_style;
      auto apply = [&](float* v) {
        switch (style) {
          case RopeStyle::kPairsAdjacent: cpu::RopePairsAdjacent(v, cs, sn, dr); break;
          case RopeStyle::kPairsToHalves: cpu::RopePairsToHalves(v, cs, sn, dr); break;
          case RopeStyle::kHalves: cpu::RopeHalves(v, cs, sn, dr); break;
        }
      };
      for (int64_t hd = 0; hd < nh; ++hd) apply(&q[(r * nh + hd) * dqk + dn]);
      if (hidden == HF::kRopeDecodeKeyPosMinus1 && decode_row) {
        // Hidden fault zoo: the new key rotated at the cache length before the append.
        cs = &rope_cos_[(pos[r] - 1) * half];
        sn = &rope_sin_[(pos[r] - 1) * half];
      }
      apply(&krope[r * dr]);
    }
    if (tapping) {
      tap.Emit(names[kTapQ], q.data(), nh * dqk);
      tap.Emit(names[kTapLatent], latent.data(), C);
      tap.Emit(names[kTapKRope], krope.data(), dr);
    }

    // Append to the cache; attention then reads what the cache stored.
    for (int64_t r = 0; r < R; ++r) {
      cache.WriteLatent(l, *segs[seg_of[r]].cache, pos[r], &latent[r * C], &krope[r * dr]);
    }

    // V3.2 lightning indexer: selected[r] = top-k causal keys by Σ_h w_h·ReLU(q_h·k_t/√d).
    const bool sparse = c.layers[l].attention == AttentionKind::kMlaSparse;
    std::vector<std::vector<int32_t>> selected;
    if (sparse) {
      const int64_t nhi = c.index_n_heads, di = c.index_head_dim;
      std::vector<float> iq(R * nhi * di), ik(R * di), ikn(R * di), iw(R * nhi);
      const int64_t row8 = Fp8RowBytes(di);
      std::vector<uint8_t> iq8(indexer_fp8 ? R * nhi * row8 : 0);  // fp8_paged: each head's query, an FP8 row
      linear(q_resid.data(), R, L.indexer.wq_b, nhi * di, c.q_lora_rank, iq.data());
      linear(h.data(), R, L.indexer.wk, di, H, ik.data());
      cpu::LayerNorm(ik.data(), L.indexer.k_norm_w.ptr(), L.indexer.k_norm_b.ptr(), R, di, 1e-6, ikn.data());
      gemm(h.data(), R, L.indexer.weights_proj, nhi, H, iw.data());
      const float wscale = 1.0f / std::sqrt(static_cast<float>(nhi));
      for (int64_t r = 0; r < R; ++r) {
        const float* cs = &rope_cos_[pos[r] * half];
        const float* sn = &rope_sin_[pos[r] * half];
        for (int64_t hd = 0; hd < nhi; ++hd) cpu::RopeHalves(&iq[(r * nhi + hd) * di], cs, sn, dr);
        cpu::RopeHalves(&ikn[r * di], cs, sn, dr);
        if (indexer_hadamard) {
          for (int64_t hd = 0; hd < nhi; ++hd) cpu::Hadamard(&iq[(r * nhi + hd) * di], di);
          cpu::Hadamard(&ikn[r * di], di);
        }
        if (indexer_fp8) {
          for (int64_t hd = 0; hd < nhi; ++hd) {
            QuantizeFp8Row(&iq[(r * nhi + hd) * di], di, &iq8[(r * nhi + hd) * row8]);
          }
        }
        for (int64_t hd = 0; hd < nhi; ++hd) iw[r * nhi + hd] *= wscale;
        cache.WriteIndexKey(l, *segs[seg_of[r]].cache, pos[r], &ikn[r * di]);
      }
      const float kscale = 1.0f / std::sqrt(static_cast<float>(di));
      selected.resize(R);
      const int64_t topk = c.index_topk;
      std::vector<int32_t> topk_tap(tapping ? R * topk : 0, -1);
      // Each request's index keys as the indexer sees them, gathered once per layer into [T, di]
      // (the reference variant; fp8_paged reads them page by page below).
      std::vector<std::vector<float>> keys(segs.size());
      for (size_t sgi = 0; sgi < segs.size() && !indexer_fp8; ++sgi) {
        const int64_t Tn = segs[sgi].start_pos + static_cast<int64_t>(segs[sgi].tokens.size());
        keys[sgi].resize(Tn * di);
        for (int64_t t = 0; t < Tn; ++t) cache.ReadIndexKey(l, *segs[sgi].cache, t, &keys[sgi][t * di]);
      }
#pragma omp parallel for schedule(dynamic) if (R * (max_pos + 1) * nhi * di > cpu::kParallelMacs)
      for (int64_t r = 0; r < R; ++r) {
        int64_t T = pos[r] + 1;
        if (hidden == HF::kIndexerSkipsSelf) T = std::max<int64_t>(pos[r], 1);
        // The faulty early exit stops at the last full page.
        if (fault_skip_partial) T = (T / cache.page_size()) * cache.page_size();
        // d[h, t] = q_h · k_t for every head and key; then s_t = Σ_h w_h · ReLU(d[h, t] / √d), h ascending.
        std::vector<float> d(nhi * T);
        if (indexer_fp8) {
          // Page by page through the request's page table, stopping after the page that holds
          // key T − 1 (a partial page scores only its first T mod page_size keys): d[h, t] is
          // the FP8 rows' dot product (Fp8RowDot: exact for head sizes ≤ 128), rounded once.
          const int64_t ps = cache.page_size();
          for (int64_t t0 = 0; t0 < T; t0 += ps) {
            for (int64_t t = t0; t < std::min(T, t0 + ps); ++t) {
              const uint8_t* k8 = cache.TokenBytes(l, 1, *segs[seg_of[r]].cache, t);
              for (int64_t hd = 0; hd < nhi; ++hd) {
                d[hd * T + t] = static_cast<float>(Fp8RowDot(&iq8[(r * nhi + hd) * row8], k8, di));
              }
            }
          }
        } else {
          cpu::MatMulNT(&iq[r * nhi * di], nhi, keys[seg_of[r]].data(), T, di, d.data());
        }
        std::vector<std::pair<float, int32_t>> sc_t(T);
        for (int64_t t = 0; t < T; ++t) {
          float s = 0;
          for (int64_t hd = 0; hd < nhi; ++hd) s += iw[r * nhi + hd] * std::max(d[hd * T + t] * kscale, 0.0f);
          sc_t[t] = {s, static_cast<int32_t>(t)};
        }
        const int64_t k = std::min(topk, T);
        // Higher score first; on equal scores the lower position wins (docs/tap-points.md).
        std::partial_sort(sc_t.begin(), sc_t.begin() + k, sc_t.end(), [](const auto& a, const auto& b) {
          return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        std::vector<int32_t>& sel = selected[r];
        for (int64_t i = 0; i < k; ++i) sel.push_back(sc_t[i].second);
        std::sort(sel.begin(), sel.end());
        if (tapping) std::copy(sel.begin(), sel.end(), &topk_tap[r * topk]);
      }
      if (tapping) tap.EmitI32(names[kTapIndexerTopk], topk_tap.data(), topk);
    }

    // Attention, per segment (each reads only its own request's cache).
    for (size_t s = 0; s < segs.size(); ++s) {
      const Segment& g = segs[s];
      const int64_t n = static_cast<int64_t>(g.tokens.size());
      const int64_t T = g.start_pos + n;
      std::vector<float> lat(T * C), kr(T * dr);
      SeqCache view = *g.cache;
      if (fault_page && view.pages.size() > 1) {
        // The faulty page table maps logical page 1 to the next physical page this request
        // does not own — another request's, or one never handed out.
        int32_t p = view.pages[1];
        do {
          p = static_cast<int32_t>((p + 1) % cache.max_pages());
        } while (std::find(view.pages.begin(), view.pages.end(), p) != view.pages.end() && p != view.pages[1]);
        view.pages[1] = p;
      }
      for (int64_t t = 0; t < T; ++t) cache.ReadLatent(l, view, t, &lat[t * C], &kr[t * dr]);
      const bool decode = !g.prefill && n == 1 && g.start_pos > 0;
      const bool expanded = decode ? decode_expanded : !prefill_absorbed;
      std::vector<float> kvx;  // [T, nh, dn + dv] when expanded
      if (expanded) {
        kvx.resize(T * nh * (dn + dv));
        gemm(lat.data(), T, L.kv_b_proj, nh * (dn + dv), C, kvx.data());
      }
#pragma omp parallel for collapse(2) schedule(static) if (n * nh * T * (C + dr) > cpu::kParallelMacs)
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t hd = 0; hd < nh; ++hd) {
          const int64_t r = row0[s] + i;
          const int64_t p = pos[r];
          const float* qn = &q[(r * nh + hd) * dqk];
          const float* qr = qn + dn;
          // Keys this query may see, ascending.
          std::vector<int32_t> keys;
          if (sparse) {
            keys = selected[r];
            // The faulty kernel pads the selection with -1 up to index_topk and reads -1 as token 0.
            if (fault_neg1) keys.resize(std::max<size_t>(keys.size(), static_cast<size_t>(c.index_topk)), 0);
          } else {
            keys.resize(p + 1);
            std::iota(keys.begin(), keys.end(), 0);
          }
          // Hidden fault: a prefill query also sees the next prompt token.
          if (hidden == HF::kAttnPrefillCausalLeak && !decode && expanded && p + 1 < T) keys.push_back(static_cast<int32_t>(p + 1));
          // Keys 0..K-1 in order (dense, or a selection that kept every causal key).
          bool contiguous = true;
          for (size_t j = 0; j < keys.size() && contiguous; ++j) contiguous = keys[j] == static_cast<int32_t>(j);
          std::vector<float> sc(keys.size());
          float* oh = &heads[(r * nh + hd) * dv];
          if (expanded) {
            const int64_t K = static_cast<int64_t>(keys.size());
            std::vector<float> s_nope(K), s_rope(K);
            if (contiguous) {
              cpu::MatMulNTStrided(qn, dn, 1, &kvx[hd * (dn + dv)], nh * (dn + dv), K, dn, s_nope.data(), K);
              cpu::MatMulNT(qr, 1, kr.data(), K, dr, s_rope.data());
            } else {
              for (int64_t j = 0; j < K; ++j) {
                s_nope[j] = cpu::Dot(qn, &kvx[(keys[j] * nh + hd) * (dn + dv)], dn);
                s_rope[j] = cpu::Dot(qr, &kr[keys[j] * dr], dr);
              }
            }
            for (int64_t j = 0; j < K; ++j) sc[j] = (s_nope[j] + s_rope[j]) * scale;
            softmax(sc.data(), static_cast<int64_t>(sc.size()));
            std::fill(oh, oh + dv, 0.0f);
            for (size_t j = 0; j < keys.size(); ++j) {
              cpu::Axpy(sc[j], &kvx[(keys[j] * nh + hd) * (dn + dv) + dn], dv, oh);
            }
          } else {
            // Absorbed, in the CUDA kernels' order — each step their bits: q_lat = W_UKᵀ q_nope
            // (cpu::Dot over W_UKᵀ's rows); the scores over the latent; cpu::MlaAttend's splits,
            // tiles and online softmax over the keys — for sparse attention the top-k list as the
            // GPU holds it, index_topk entries with the missing ones masked; o = W_UV ol.
            // gemm=bf16: both absorption products read bf16 activations (q_nope, then the
            // attention's output), as every other product of the variant does — and as the
            // CUDA backend's absorptions do.
            std::vector<float> ql(C), ol(C), qnr;
            const float* qa = qn;
            if (gemm.bf16) {
              qnr.resize(dn);
              for (int64_t a = 0; a < dn; ++a) qnr[a] = kernels::Bf16ToF32(kernels::F32ToBf16(qn[a]));
              qa = qnr.data();
            }
            // q_lat[c] = W_UKᵀ row c · q_nope (HeadWukT, into this thread's scratch).
            thread_local std::vector<float> uk_scratch;
            uk_scratch.resize(static_cast<size_t>(2 * dn * C));
            float* const wt = uk_scratch.data() + dn * C;
            HeadWukT(L.kv_b_proj.data, hd, dn, dv, gemm.weights(), uk_scratch.data(), wt);
            for (int64_t cc = 0; cc < C; ++cc) ql[cc] = cpu::Dot(wt + cc * dn, qa, dn);
            // Scores over the keys: blocked products, each element exactly Dot's.
            const int64_t K = static_cast<int64_t>(keys.size());
            const int64_t n_keys = sparse ? std::max<int64_t>(K, c.index_topk) : K;
            std::vector<float> s_lat(K), s_rope(K);
            if (contiguous) {
              cpu::MatMulNT(ql.data(), 1, lat.data(), K, C, s_lat.data());
              cpu::MatMulNT(qr, 1, kr.data(), K, dr, s_rope.data());
            } else {
              for (int64_t j = 0; j < K; ++j) {
                s_lat[j] = cpu::Dot(ql.data(), &lat[keys[j] * C], C);
                s_rope[j] = cpu::Dot(qr, &kr[keys[j] * dr], dr);
              }
            }
            sc.assign(n_keys, -INFINITY);
            std::vector<const float*> rows(n_keys, nullptr);
            for (int64_t j = 0; j < K; ++j) {
              sc[j] = (s_lat[j] + s_rope[j]) * scale;
              rows[j] = &lat[keys[j] * C];
            }
            cpu::MlaAttend(sc.data(), rows.data(), n_keys, C, ol.data());
            // o_h = W_UV ol: dv rows of kv_b_proj after the head's W_UK rows.
            if (gemm.bf16) {
              for (float& v : ol) v = kernels::Bf16ToF32(kernels::F32ToBf16(v));
            }
            cpu::MatMulNT(ol.data(), 1, L.kv_b_proj.data.Rows(hd * (dn + dv) + dn, dv), gemm.weights(), oh);
          }
        }
      }
    }
    if (tapping) tap.Emit(names[kTapHeads], heads.data(), nh * dv);

    // x = x + o_proj(heads); emulated TP: each rank's heads through its slice of o_proj
    // ([R, tp, H]), then the all-reduce.
    if (tp > 1) {
      std::vector<float> parts(R * tp * H);
      RowParallelPartials(linear, heads.data(), R, L.o_proj, tp, dv, parts.data());
      if (tapping) tap.Emit(names[kTapAttnPartials], parts.data(), tp * H);
      AllReduce(plan.allreduce, parts.data(), tp, R, H, o.data());
    } else {
      linear(heads.data(), R, L.o_proj, H, nh * dv, o.data());
    }
    if (tapping) tap.Emit(names[kTapAttnOut], o.data(), H);
    for (int64_t i = 0; i < R * H; ++i) x[i] += o[i];
    if (tapping) tap.Emit(names[kTapResidMid], x.data(), H);

    // FFN on RMSNorm(x).
    rmsnorm(x.data(), L.post_attn_norm.ptr(), R, H, c.rms_norm_eps, h.data());
    if (tapping) tap.Emit(names[kTapFfnNorm], h.data(), H);
    // Emulated TP: each rank's partial FFN output ([R, tp, H]: its slice of the dense MLP or
    // shared experts' intermediate dims, plus its block of routed experts), then the all-reduce.
    std::vector<float> fparts(tp > 1 ? R * tp * H : 0);
    if (c.layers[l].ffn == FfnKind::kDense && tp > 1) {
      Impl::MlpPartials(linear, L.mlp, h.data(), R, H, tp, fparts.data());
    } else if (c.layers[l].ffn == FfnKind::kDense) {
      Impl::Mlp(linear, L.mlp, h.data(), R, H, o.data());
    } else {
      const int64_t k = c.num_experts_per_tok, E = c.n_routed_experts;
      std::vector<int32_t> ids(R * k);
      std::vector<float> wts(R * k);
      for (int64_t r = 0; r < R; ++r) Impl::Route(c, L, &h[r * H], &ids[r * k], &wts[r * k]);
      if (tapping) {
        tap.EmitI32(names[kTapTopkIds], ids.data(), k);
        tap.Emit(names[kTapTopkWeights], wts.data(), k);
      }
      // Rows grouped per expert; each row's result lands in its own slot, combined below in
      // ascending expert order so the sum never depends on the batch.
      std::vector<float> slot(R * k * H);
      for (int64_t e = 0; e < E; ++e) {
        std::vector<int64_t> rows;
        for (int64_t r = 0; r < R; ++r) {
          for (int64_t j = 0; j < k; ++j) {
            if (ids[r * k + j] == e) rows.push_back(r * k + j);
          }
        }
        if (rows.empty()) continue;
        std::vector<float> xin(rows.size() * H), yout(rows.size() * H);
        for (size_t i = 0; i < rows.size(); ++i) std::memcpy(&xin[i * H], &h[(rows[i] / k) * H], H * sizeof(float));
        if (hidden == HF::kExpertDownKTail) {
          Impl::MlpDownKTail(linear, L.experts[e], xin.data(), static_cast<int64_t>(rows.size()), H, yout.data());
        } else {
          Impl::Mlp(linear, L.experts[e], xin.data(), static_cast<int64_t>(rows.size()), H, yout.data());
        }
        for (size_t i = 0; i < rows.size(); ++i) std::memcpy(&slot[rows[i] * H], &yout[i * H], H * sizeof(float));
      }
      if (tp > 1) {
        // Rank q holds experts ShardOf(E, tp, q) and its slice of the shared experts.
        if (c.n_shared_experts > 0) Impl::MlpPartials(linear, L.shared, h.data(), R, H, tp, fparts.data());
        std::vector<float> acc(H);
        for (int64_t r = 0; r < R; ++r) {
          for (int q = 0; q < tp; ++q) {
            const Shard mine = ShardOf(E, tp, q);
            float* prow = &fparts[(r * tp + q) * H];
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t j = 0; j < k; ++j) {
              if (ids[r * k + j] < mine.begin || ids[r * k + j] >= mine.end) continue;
              const float w = wts[r * k + j];
              const float* y = &slot[(r * k + j) * H];
              for (int64_t i = 0; i < H; ++i) acc[i] += y[i] * w;
            }
            if (c.n_shared_experts > 0) {
              for (int64_t i = 0; i < H; ++i) acc[i] += prow[i];
            }
            std::copy(acc.begin(), acc.end(), prow);
          }
        }
      } else {
        std::vector<float> shared(R * H, 0.0f);
        if (c.n_shared_experts > 0) Impl::Mlp(linear, L.shared, h.data(), R, H, shared.data());
        for (int64_t r = 0; r < R; ++r) {
          float* orow = &o[r * H];
          std::fill(orow, orow + H, 0.0f);
          for (int64_t j = 0; j < k; ++j) {
            const float w = wts[r * k + j];
            const float* y = &slot[(r * k + j) * H];
            for (int64_t i = 0; i < H; ++i) orow[i] += y[i] * w;
          }
          for (int64_t i = 0; i < H; ++i) orow[i] += shared[r * H + i];
        }
      }
    }
    if (tp > 1) {
      if (tapping) tap.Emit(names[kTapFfnPartials], fparts.data(), tp * H);
      AllReduce(plan.allreduce, fparts.data(), tp, R, H, o.data());
    }
    if (tapping) tap.Emit(names[kTapFfnOut], o.data(), H);
    for (int64_t i = 0; i < R * H; ++i) x[i] += o[i];
    if (tapping) {
      tap.Emit(names[kTapResidOut], x.data(), H);
      tap.Override(names[kTapResidOut], x.data(), H);
    }
  }

  // Final norm, then logits for the rows that need them.
  rmsnorm(x.data(), W.final_norm.ptr(), R, H, c.rms_norm_eps, h.data());
  if (tapping) tap.Emit(kModelTaps[kTapFinalNorm].name, h.data(), H);
  SegmentLogits(segs, row0, h.data(), H, c.vocab_size, hook, [&](const float* x, int64_t rows, float* lg) {
    if (hidden == HF::kLmHeadDropsLastHidden) {
      std::vector<float> hx(x, x + rows * H);
      for (int64_t r = 0; r < rows; ++r) hx[r * H + H - 1] = 0.0f;  // the loop's last element never read
      gemm(hx.data(), rows, W.lm_head, c.vocab_size, H, lg);
    } else {
      gemm(x, rows, W.lm_head, c.vocab_size, H, lg);
    }
  }, out);
  for (auto& g : segs) g.cache->length = g.start_pos + static_cast<int64_t>(g.tokens.size());
  return Status::Ok();
}

}  // namespace lockstep::engine
