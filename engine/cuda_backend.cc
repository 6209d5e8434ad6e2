// engine/cuda_backend.cc — the DeepSeek V2/V3/V3.2 forward pass on the GPU.
//
// The same computation as engine/model.cc, step for step, with kernels/cuda's launchers:
// the projections through cuBLASLt (pinned algorithms: batch-invariant), RMSNorm, RoPE, the
// latent written into a device copy of the paged cache in its own format, attention in the
// absorbed form for every row (a prefill row is a decode query over its causal prefix, so a
// token's numbers do not depend on how its prompt was chunked or batched), the V3.2 indexer
// + exact top-k + sparse decode, MoE routing and grouped expert products on the device (no
// host round trip inside a step), logits copied back for the host sampler.
//
// Shapes as in model.cc: R rows, H hidden, nh heads, dn/dr/dv head dims, C kv_lora.
// Every device buffer lives as long as the backend (grown, never shrunk), so a step's
// launches see the same pointers from step to step.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cuda_backend.h"
#include "kernels/cpu/numerics.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

namespace lockstep::engine {

namespace cu = kernels::cuda;

bool HaveCudaBackend() { return true; }

namespace {

// A weight on the device: fp32, or bf16 bits for the bf16 GEMM variants.
struct DevTensor {
  cu::DeviceBuffer buf;
  int64_t rows = 0, cols = 0;
  bool bf16 = false;
  const void* ptr() const { return buf.data(); }
  const float* f32() const { return buf.as<const float>(); }
  bool empty() const { return rows == 0; }
};

// Device copy of `n` fp32 values, rounded to bf16 when asked.
Result<DevTensor> Upload(const float* data, int64_t rows, int64_t cols, bool bf16) {
  DevTensor t;
  t.rows = rows;
  t.cols = cols;
  t.bf16 = bf16;
  const int64_t n = rows * cols;
  if (n == 0) return t;
  LS_ASSIGN_OR_RETURN(t.buf, cu::DeviceBuffer::Allocate(static_cast<size_t>(n) * (bf16 ? 2 : 4)));
  if (!bf16) {
    LS_RETURN_IF_ERROR(t.buf.CopyFromHost(data, static_cast<size_t>(n) * 4));
  } else {
    std::vector<uint16_t> b(n);
    for (int64_t i = 0; i < n; ++i) b[i] = kernels::F32ToBf16(data[i]);
    LS_RETURN_IF_ERROR(t.buf.CopyFromHost(b.data(), static_cast<size_t>(n) * 2));
  }
  return t;
}

Result<DevTensor> Upload(const Matrix& m, bool bf16) { return Upload(m.ptr(), m.rows, m.cols, bf16); }

// Rows of several matrices stacked into one device tensor (gate ; up → [2I, in]).
Result<DevTensor> UploadStacked(const std::vector<const Matrix*>& parts, bool bf16) {
  int64_t rows = 0;
  const int64_t cols = parts.empty() ? 0 : parts[0]->cols;
  for (const Matrix* m : parts) {
    if (m->cols != cols) return Status::Internal("UploadStacked: column counts differ");
    rows += m->rows;
  }
  std::vector<float> host;
  host.reserve(static_cast<size_t>(rows * cols));
  for (const Matrix* m : parts) host.insert(host.end(), m->data.begin(), m->data.end());
  return Upload(host.data(), rows, cols, bf16);
}

// Random weights made on the device (--random-weights): U(−bound, bound) with Philox seeded
// by (seed, tensor number), so a run is reproducible without a checkpoint on disk.
Result<DevTensor> Random(int64_t rows, int64_t cols, bool bf16, float bound, uint64_t seed, cu::Stream s) {
  DevTensor t;
  t.rows = rows;
  t.cols = cols;
  t.bf16 = bf16;
  LS_ASSIGN_OR_RETURN(t.buf, cu::DeviceBuffer::Allocate(static_cast<size_t>(rows * cols) * (bf16 ? 2 : 4)));
  LS_RETURN_IF_ERROR(cu::FillUniform(t.buf.data(), rows * cols, bf16, -bound, bound, seed, s));
  return t;
}

Result<DevTensor> Constant(int64_t rows, int64_t cols, float value, cu::Stream s) {
  DevTensor t;
  t.rows = rows;
  t.cols = cols;
  LS_ASSIGN_OR_RETURN(t.buf, cu::DeviceBuffer::Allocate(static_cast<size_t>(rows * cols) * 4));
  LS_RETURN_IF_ERROR(cu::FillConstant(t.buf.data(), rows * cols, false, value, s));
  return t;
}

struct DevLayer {
  DevTensor input_norm, post_attn_norm, q_a_norm, kv_a_norm;  // fp32 vectors
  DevTensor q_proj, q_a_proj, q_b_proj, kv_a_proj, o_proj;
  DevTensor w_ukt;  // [nh·C, dn]: per head W_UKᵀ (q absorption)
  DevTensor kv_b;   // [nh·(dn + dv), C]: W_UV rows are read in place
  DevTensor iq_b, ik, ik_norm_w, ik_norm_b, iw_proj;  // V3.2 indexer (k_norm fp32)
  DevTensor mlp_gate_up, mlp_down;                     // dense FFN: [2I, H], [H, I]
  DevTensor router, router_bias;                       // fp32, as inference stacks keep them
  DevTensor experts_gate_up, experts_down;             // [E·2I, H], [E·H, I]
  DevTensor shared_gate_up, shared_down;
  int64_t mlp_inter = 0, moe_inter = 0, shared_inter = 0;
};

// Bumped whenever a scratch buffer moves: captured CUDA graphs hold its old address.
int64_t g_alloc_generation = 0;

// A grow-only device scratch buffer.
struct Scratch {
  cu::DeviceBuffer buf;
  Status Ensure(size_t bytes) {
    if (buf.size() >= bytes) return Status::Ok();
    buf = cu::DeviceBuffer();  // free first: the pool may be nearly full
    LS_ASSIGN_OR_RETURN(buf, cu::DeviceBuffer::Allocate(std::max(bytes, buf.size() * 3 / 2)));
    ++g_alloc_generation;
    return Status::Ok();
  }
  template <typename T>
  T* as() const {
    return buf.as<T>();
  }
};

// kernels/cuda mirrors the engine's enumerations in the same order (ops.h says so).
static_assert(static_cast<int>(cu::LatentFormat::kFp8E4m3) == static_cast<int>(KvFormat::kFp8E4m3) &&
              static_cast<int>(cu::LatentFormat::kBf16) == static_cast<int>(KvFormat::kBf16));
static_assert(static_cast<int>(cu::RopeStyle::kHalves) == static_cast<int>(RopeStyle::kHalves) &&
              static_cast<int>(cu::RopeStyle::kPairsToHalves) == static_cast<int>(RopeStyle::kPairsToHalves));
static_assert(static_cast<int>(cu::GateKind::kSigmoidNoauxTc) == static_cast<int>(GateKind::kSigmoidNoauxTc) &&
              static_cast<int>(cu::GateKind::kSoftmaxGroupLimited) == static_cast<int>(GateKind::kSoftmaxGroupLimited));
cu::LatentFormat ToLatentFormat(KvFormat f) { return static_cast<cu::LatentFormat>(f); }
cu::RopeStyle ToRopeStyle(RopeStyle s) { return static_cast<cu::RopeStyle>(s); }
cu::GateKind ToGateKind(GateKind g) { return static_cast<cu::GateKind>(g); }

class CudaBackend final : public Backend {
 public:
  std::string_view name() const override { return "cuda"; }
  ~CudaBackend() override {
    if (!prof_) return;
    double total = 0;
    for (const auto& [k, v] : prof_ms_) total += v;
    std::fprintf(stderr, "lockstep: cuda backend GPU time over %lld steps (ms/step, share):\n",
                 static_cast<long long>(prof_steps_));
    for (const auto& [k, v] : prof_ms_) {
      std::fprintf(stderr, "  %-16s %8.3f  %5.1f%%\n", k.c_str(), v / std::max<int64_t>(prof_steps_, 1),
                   100 * v / std::max(total, 1e-9));
    }
  }
  std::string device() const override { return device_; }
  void SetMirrorCache(bool on) override { mirror_ = on; }

  static Result<std::unique_ptr<Backend>> Create(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                 const kernels::KernelChoice& kernels);

  Status Forward(std::span<Segment> segs, PagedKvCache& cache, const kernels::KernelChoice& kernels, TapHook* hook,
                 ForwardOutput* out) override;

 private:
  CudaBackend() = default;
  Status UploadWeights();
  Status RandomWeights(uint64_t seed);
  Status AllocateCache(const PagedKvCache& cache);

  // y[rows, out] = x[rows, in] · wᵀ through the chosen GEMM; bf16 weights take x rounded to bf16.
  Status Linear(const float* x, int64_t x_stride, int64_t rows, const void* w, int64_t w_stride, bool w_bf16,
                int64_t out, int64_t in, float* y, int64_t y_stride);
  Status Linear(const float* x, int64_t x_stride, int64_t rows, const DevTensor& w, float* y, int64_t y_stride) {
    return Linear(x, x_stride, rows, w.ptr(), w.cols, w.bf16, w.rows, w.cols, y, y_stride);
  }
  Status SwiGluMlp(const DevTensor& gate_up, const DevTensor& down, int64_t inter, const float* x, int64_t rows,
                   float* y);

  // Taps: tensors are copied on the device into an arena and handed to the hook together
  // (one device→host copy, one synchronisation) at the end of the step, or earlier when the
  // arena fills or an Override needs the values now.
  struct PendingTap {
    std::string name;
    size_t offset = 0;
    int64_t cols = 0;
    TapDType dtype = TapDType::kF32;
  };
  Status Tap(std::string_view name, const void* dev, int64_t cols, int64_t stride, TapDType dtype);
  Status FlushTaps();
  // LOCKSTEP_CUDA_PROFILE=1: GPU time per phase, printed when the backend is destroyed.
  Status Mark(const char* name) { return prof_ ? prof_->Mark(name, stream_->get()) : Status::Ok(); }
  std::unique_ptr<cu::EventTimer> prof_;
  std::map<std::string, double> prof_ms_;
  int64_t prof_steps_ = 0;
  // Offers x (the values feeding the next layer) to the hook for overwriting (replay --graft).
  Status OverrideRows(std::string_view name, float* dev_x, int64_t cols);

  std::shared_ptr<Model> model_;
  std::string device_;
  std::string gemm_variant_;
  bool bf16_ = false;
  bool mirror_ = false;
  std::unique_ptr<cu::CudaStream> stream_;
  std::unique_ptr<cu::Gemm> gemm_f32_, gemm_bf16_;

  DevTensor embed_, final_norm_, lm_head_;
  std::vector<DevLayer> layers_;
  DevTensor rope_cos_, rope_sin_;
  int64_t rope_positions_ = 0;

  // The device cache: per layer, the latent pool and (V3.2) the index-key pool, slot-major.
  std::vector<cu::DeviceBuffer> latent_pool_, index_pool_;
  int64_t num_pages_ = 0, page_size_ = 0, latent_bytes_ = 0;
  cu::LatentFormat format_ = cu::LatentFormat::kFp32;

  // Step inputs (pinned host → device) and scratch.
  cu::PinnedBuffer host_in_;
  Scratch dev_in_, act_, xb_, mla_ws_, scores_, logits_dev_, gather_, tap_arena_, mirror_dev_;
  cu::PinnedBuffer logits_host_, tap_host_, mirror_host_;
  cu::DeviceBuffer error_flag_;

  // CUDA graphs of decode steps, by batch size: captured on the second step of a size (the
  // first grows every buffer to its final size), replayed while no buffer moved since.
  struct StepGraph {
    std::unique_ptr<cu::CudaGraph> graph;
    size_t marks = 0;  // profiling events recorded inside the graph
    // Taps copied into the arena by the graph: what FlushTaps hands to the hook after a launch.
    std::vector<PendingTap> pending;
    size_t tap_used = 0;
    int64_t generation = -1;
    bool failed = false;
  };
  std::map<int64_t, StepGraph> graphs_;
  std::map<int64_t, int64_t> warmed_;  // batch size → generation after its uncaptured run
  bool use_graphs_ = true;
  bool capturing_ = false;

  // Per-step state used by the tap helpers.
  TapHook* hook_ = nullptr;
  std::span<Segment> segs_;
  std::vector<int64_t> row0_;
  int64_t rows_ = 0;
  std::vector<PendingTap> pending_;
  size_t tap_used_ = 0;
};

Result<std::unique_ptr<Backend>> CudaBackend::Create(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                     const kernels::KernelChoice& kernels) {
  if (cu::DeviceCount() == 0) {
    return Status::Unsupported("--backend cuda: " + cu::DeviceDescription());
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->model_ = std::move(model);
  b->device_ = cu::DeviceDescription();
  if (const char* g = std::getenv("LOCKSTEP_CUDA_GRAPHS")) b->use_graphs_ = std::string(g) != "0";
  if (const char* p = std::getenv("LOCKSTEP_CUDA_PROFILE"); p != nullptr && std::string(p) == "1") {
    LS_ASSIGN_OR_RETURN(b->prof_, cu::EventTimer::Create());
  }
  auto it = kernels.find("gemm");
  b->gemm_variant_ = it == kernels.end() ? "fp32" : it->second;
  b->bf16_ = b->gemm_variant_.rfind("bf16", 0) == 0;
  const bool pinned = b->gemm_variant_.find("heuristic") == std::string::npos;
  LS_ASSIGN_OR_RETURN(b->stream_, cu::CudaStream::Create());
  cu::GemmOptions go;
  go.variant = cu::GemmVariant::kFp32Pedantic;
  go.pin_algorithm = pinned;
  LS_ASSIGN_OR_RETURN(b->gemm_f32_, cu::Gemm::Create(go));
  if (b->bf16_) {
    go.variant = cu::GemmVariant::kBf16;
    LS_ASSIGN_OR_RETURN(b->gemm_bf16_, cu::Gemm::Create(go));
  }
  const ModelWeights& w = b->model_->weights();
  if (w.random_seed.has_value()) {
    LS_RETURN_IF_ERROR(b->RandomWeights(*w.random_seed));
  } else {
    LS_RETURN_IF_ERROR(b->UploadWeights());
  }
  LS_RETURN_IF_ERROR(b->AllocateCache(cache));
  LS_ASSIGN_OR_RETURN(b->error_flag_, cu::DeviceBuffer::Allocate(4));
  LS_RETURN_IF_ERROR(b->error_flag_.Fill(0));
  LS_RETURN_IF_ERROR(b->stream_->Synchronize());
  return std::unique_ptr<Backend>(std::move(b));
}

Status CudaBackend::UploadWeights() {
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  const int64_t nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dv = c.v_head_dim, C = c.kv_lora_rank;
  LS_ASSIGN_OR_RETURN(embed_, Upload(W.embed, false));
  LS_ASSIGN_OR_RETURN(final_norm_, Upload(W.final_norm, false));
  LS_ASSIGN_OR_RETURN(lm_head_, Upload(W.lm_head, bf16_));
  layers_.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = W.layers[l];
    DevLayer& D = layers_[l];
    LS_ASSIGN_OR_RETURN(D.input_norm, Upload(L.input_norm, false));
    LS_ASSIGN_OR_RETURN(D.post_attn_norm, Upload(L.post_attn_norm, false));
    if (c.q_lora_rank > 0) {
      LS_ASSIGN_OR_RETURN(D.q_a_proj, Upload(L.q_a_proj, bf16_));
      LS_ASSIGN_OR_RETURN(D.q_a_norm, Upload(L.q_a_norm, false));
      LS_ASSIGN_OR_RETURN(D.q_b_proj, Upload(L.q_b_proj, bf16_));
    } else {
      LS_ASSIGN_OR_RETURN(D.q_proj, Upload(L.q_proj, bf16_));
    }
    LS_ASSIGN_OR_RETURN(D.kv_a_proj, Upload(L.kv_a_proj, bf16_));
    LS_ASSIGN_OR_RETURN(D.kv_a_norm, Upload(L.kv_a_norm, false));
    LS_ASSIGN_OR_RETURN(D.kv_b, Upload(L.kv_b_proj, bf16_));
    std::vector<float> ukt(static_cast<size_t>(nh * C * dn));
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t a = 0; a < dn; ++a) {
        const float* row = L.kv_b_proj.row(h * (dn + dv) + a);
        for (int64_t k = 0; k < C; ++k) ukt[(h * C + k) * dn + a] = row[k];
      }
    }
    LS_ASSIGN_OR_RETURN(D.w_ukt, Upload(ukt.data(), nh * C, dn, bf16_));
    LS_ASSIGN_OR_RETURN(D.o_proj, Upload(L.o_proj, bf16_));
    if (c.has_indexer()) {
      LS_ASSIGN_OR_RETURN(D.iq_b, Upload(L.indexer.wq_b, bf16_));
      LS_ASSIGN_OR_RETURN(D.ik, Upload(L.indexer.wk, bf16_));
      LS_ASSIGN_OR_RETURN(D.ik_norm_w, Upload(L.indexer.k_norm_w, false));
      LS_ASSIGN_OR_RETURN(D.ik_norm_b, Upload(L.indexer.k_norm_b, false));
      LS_ASSIGN_OR_RETURN(D.iw_proj, Upload(L.indexer.weights_proj, bf16_));
    }
    if (c.layers[l].ffn == FfnKind::kDense) {
      D.mlp_inter = L.mlp.gate.rows;
      LS_ASSIGN_OR_RETURN(D.mlp_gate_up, UploadStacked({&L.mlp.gate, &L.mlp.up}, bf16_));
      LS_ASSIGN_OR_RETURN(D.mlp_down, Upload(L.mlp.down, bf16_));
    } else {
      LS_ASSIGN_OR_RETURN(D.router, Upload(L.router, false));
      if (!L.router_bias.empty()) {
        LS_ASSIGN_OR_RETURN(D.router_bias, Upload(L.router_bias, false));
      }
      D.moe_inter = L.experts.at(0).gate.rows;
      std::vector<const Matrix*> gu, dn_;
      for (const auto& e : L.experts) {
        gu.push_back(&e.gate);
        gu.push_back(&e.up);
        dn_.push_back(&e.down);
      }
      LS_ASSIGN_OR_RETURN(D.experts_gate_up, UploadStacked(gu, bf16_));
      LS_ASSIGN_OR_RETURN(D.experts_down, UploadStacked(dn_, bf16_));
      if (c.n_shared_experts > 0) {
        D.shared_inter = L.shared.gate.rows;
        LS_ASSIGN_OR_RETURN(D.shared_gate_up, UploadStacked({&L.shared.gate, &L.shared.up}, bf16_));
        LS_ASSIGN_OR_RETURN(D.shared_down, Upload(L.shared.down, bf16_));
      }
    }
  }
  return Status::Ok();
}

Status CudaBackend::RandomWeights(uint64_t seed) {
  const ModelConfig& c = model_->config();
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, C = c.kv_lora_rank, dqk = dn + dr, V = c.vocab_size;
  cu::Stream s = stream_->get();
  uint64_t tensor = 0;
  // Kaiming-uniform-like bounds keep activations of order one through the layers.
  auto rnd = [&](int64_t rows, int64_t cols, bool bf16) {
    return Random(rows, cols, bf16, 1.0f / std::sqrt(static_cast<float>(cols)), seed * 1000003u + tensor++, s);
  };
  LS_ASSIGN_OR_RETURN(embed_, Random(V, H, false, 1.0f, seed * 1000003u + tensor++, s));
  LS_ASSIGN_OR_RETURN(final_norm_, Constant(1, H, 1.0f, s));
  LS_ASSIGN_OR_RETURN(lm_head_, rnd(V, H, bf16_));
  layers_.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    DevLayer& D = layers_[l];
    LS_ASSIGN_OR_RETURN(D.input_norm, Constant(1, H, 1.0f, s));
    LS_ASSIGN_OR_RETURN(D.post_attn_norm, Constant(1, H, 1.0f, s));
    if (c.q_lora_rank > 0) {
      LS_ASSIGN_OR_RETURN(D.q_a_proj, rnd(c.q_lora_rank, H, bf16_));
      LS_ASSIGN_OR_RETURN(D.q_a_norm, Constant(1, c.q_lora_rank, 1.0f, s));
      LS_ASSIGN_OR_RETURN(D.q_b_proj, rnd(nh * dqk, c.q_lora_rank, bf16_));
    } else {
      LS_ASSIGN_OR_RETURN(D.q_proj, rnd(nh * dqk, H, bf16_));
    }
    LS_ASSIGN_OR_RETURN(D.kv_a_proj, rnd(C + dr, H, bf16_));
    LS_ASSIGN_OR_RETURN(D.kv_a_norm, Constant(1, C, 1.0f, s));
    LS_ASSIGN_OR_RETURN(D.kv_b, rnd(nh * (dn + dv), C, bf16_));
    LS_ASSIGN_OR_RETURN(D.w_ukt, rnd(nh * C, dn, bf16_));  // independent of kv_b: random either way
    LS_ASSIGN_OR_RETURN(D.o_proj, rnd(H, nh * dv, bf16_));
    if (c.has_indexer()) {
      LS_ASSIGN_OR_RETURN(D.iq_b, rnd(c.index_n_heads * c.index_head_dim, c.q_lora_rank, bf16_));
      LS_ASSIGN_OR_RETURN(D.ik, rnd(c.index_head_dim, H, bf16_));
      LS_ASSIGN_OR_RETURN(D.ik_norm_w, Constant(1, c.index_head_dim, 1.0f, s));
      LS_ASSIGN_OR_RETURN(D.ik_norm_b, Constant(1, c.index_head_dim, 0.0f, s));
      LS_ASSIGN_OR_RETURN(D.iw_proj, rnd(c.index_n_heads, H, bf16_));
    }
    if (c.layers[l].ffn == FfnKind::kDense) {
      D.mlp_inter = c.intermediate_size;
      LS_ASSIGN_OR_RETURN(D.mlp_gate_up, rnd(2 * D.mlp_inter, H, bf16_));
      LS_ASSIGN_OR_RETURN(D.mlp_down, rnd(H, D.mlp_inter, bf16_));
    } else {
      const int64_t E = c.n_routed_experts;
      LS_ASSIGN_OR_RETURN(D.router, rnd(E, H, false));
      if (c.gate == GateKind::kSigmoidNoauxTc) {
        LS_ASSIGN_OR_RETURN(D.router_bias, Constant(1, E, 0.0f, s));
      }
      D.moe_inter = c.moe_intermediate_size;
      LS_ASSIGN_OR_RETURN(D.experts_gate_up, rnd(E * 2 * D.moe_inter, H, bf16_));
      LS_ASSIGN_OR_RETURN(D.experts_down, rnd(E * H, D.moe_inter, bf16_));
      if (c.n_shared_experts > 0) {
        D.shared_inter = c.moe_intermediate_size * c.n_shared_experts;
        LS_ASSIGN_OR_RETURN(D.shared_gate_up, rnd(2 * D.shared_inter, H, bf16_));
        LS_ASSIGN_OR_RETURN(D.shared_down, rnd(H, D.shared_inter, bf16_));
      }
    }
  }
  return Status::Ok();
}

Status CudaBackend::AllocateCache(const PagedKvCache& cache) {
  const ModelConfig& c = model_->config();
  num_pages_ = cache.max_pages();
  page_size_ = cache.page_size();
  format_ = ToLatentFormat(cache.format());
  latent_bytes_ = cu::LatentBytesPerToken(format_, c.kv_lora_rank, c.qk_rope_head_dim);
  if (latent_bytes_ != cache.latent_bytes_per_token()) {
    return Status::Internal("cuda backend: latent bytes per token " + std::to_string(latent_bytes_) +
                            " differ from the host cache's " + std::to_string(cache.latent_bytes_per_token()));
  }
  const int64_t slots = num_pages_ * page_size_;
  latent_pool_.resize(c.num_hidden_layers);
  index_pool_.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LS_ASSIGN_OR_RETURN(latent_pool_[l], cu::DeviceBuffer::Allocate(static_cast<size_t>(slots * latent_bytes_)));
    LS_RETURN_IF_ERROR(latent_pool_[l].Fill(0));
    if (c.layers[l].attention == AttentionKind::kMlaSparse) {
      LS_ASSIGN_OR_RETURN(index_pool_[l],
                          cu::DeviceBuffer::Allocate(static_cast<size_t>(slots * c.index_head_dim) * 4));
      LS_RETURN_IF_ERROR(index_pool_[l].Fill(0));
    }
  }
  // RoPE tables for every position the cache can hold.
  rope_positions_ = std::min<int64_t>(slots, c.max_position_embeddings);
  std::vector<float> cs, sn;
  model_->RopeTable(rope_positions_, &cs, &sn);
  LS_ASSIGN_OR_RETURN(rope_cos_, Upload(cs.data(), rope_positions_, c.qk_rope_head_dim / 2, false));
  LS_ASSIGN_OR_RETURN(rope_sin_, Upload(sn.data(), rope_positions_, c.qk_rope_head_dim / 2, false));
  return Status::Ok();
}

Status CudaBackend::Linear(const float* x, int64_t x_stride, int64_t rows, const void* w, int64_t w_stride,
                           bool w_bf16, int64_t out, int64_t in, float* y, int64_t y_stride) {
  if (rows == 0) return Status::Ok();
  cu::GemmParams p;
  p.rows = rows;
  p.out = out;
  p.in = in;
  p.w = w;
  p.w_stride = w_stride;
  p.y = y;
  p.y_stride = y_stride;
  if (!w_bf16) {
    p.x = x;
    p.x_stride = x_stride;
    return gemm_f32_->Run(p, stream_->get());
  }
  LS_RETURN_IF_ERROR(xb_.Ensure(static_cast<size_t>(rows * in) * 2));
  LS_RETURN_IF_ERROR(cu::ToBf16(x, x_stride, xb_.as<uint16_t>(), in, rows, in, stream_->get()));
  p.x = xb_.as<uint16_t>();
  p.x_stride = in;
  return gemm_bf16_->Run(p, stream_->get());
}

Status CudaBackend::Tap(std::string_view name, const void* dev, int64_t cols, int64_t stride, TapDType dtype) {
  if (hook_ == nullptr) return Status::Ok();
  const size_t bytes = static_cast<size_t>(rows_ * cols) * 4;
  if (tap_used_ + bytes > tap_arena_.buf.size()) {
    // A graph cannot hand taps over in the middle of a step: such a step runs plainly.
    if (capturing_) return Status::Unsupported("tap arena full during graph capture");
    LS_RETURN_IF_ERROR(FlushTaps());
    if (bytes > tap_arena_.buf.size()) {
      LS_RETURN_IF_ERROR(tap_arena_.Ensure(std::max<size_t>(bytes, size_t{64} << 20)));
      LS_ASSIGN_OR_RETURN(tap_host_, cu::PinnedBuffer::Allocate(tap_arena_.buf.size()));
    }
  }
  LS_RETURN_IF_ERROR(cu::Copy2DAsync(tap_arena_.as<char>() + tap_used_, static_cast<size_t>(cols) * 4, dev,
                                     static_cast<size_t>(stride) * 4, static_cast<size_t>(cols) * 4,
                                     static_cast<size_t>(rows_), stream_->get()));
  pending_.push_back({std::string(name), tap_used_, cols, dtype});
  tap_used_ += (bytes + 255) / 256 * 256;
  return Status::Ok();
}

Status CudaBackend::FlushTaps() {
  if (pending_.empty()) return Status::Ok();
  LS_RETURN_IF_ERROR(cu::CopyAsync(tap_host_.data(), tap_arena_.buf.data(), tap_used_, stream_->get()));
  LS_RETURN_IF_ERROR(stream_->Synchronize());
  for (const PendingTap& t : pending_) {
    const char* base = tap_host_.as<char>() + t.offset;
    for (size_t s = 0; s < segs_.size(); ++s) {
      TapEvent e;
      e.name = t.name;
      e.request_id = segs_[s].request_id;
      e.position = segs_[s].start_pos;
      e.rows = static_cast<int64_t>(segs_[s].tokens.size());
      e.cols = t.cols;
      e.dtype = t.dtype;
      e.data = base + row0_[s] * t.cols * 4;
      hook_->OnTap(e);
    }
  }
  pending_.clear();
  tap_used_ = 0;
  return Status::Ok();
}

Status CudaBackend::OverrideRows(std::string_view name, float* dev_x, int64_t cols) {
  if (hook_ == nullptr || !hook_->WantsOverride()) return Status::Ok();
  LS_RETURN_IF_ERROR(FlushTaps());
  std::vector<float> host(static_cast<size_t>(rows_ * cols));
  LS_RETURN_IF_ERROR(cu::CopyAsync(host.data(), dev_x, host.size() * 4, stream_->get()));
  LS_RETURN_IF_ERROR(stream_->Synchronize());
  bool changed = false;
  for (size_t s = 0; s < segs_.size(); ++s) {
    TapEvent e;
    e.name = name;
    e.request_id = segs_[s].request_id;
    e.position = segs_[s].start_pos;
    e.rows = static_cast<int64_t>(segs_[s].tokens.size());
    e.cols = cols;
    e.data = host.data() + row0_[s] * cols;
    changed |= hook_->Override(e, host.data() + row0_[s] * cols);
  }
  if (changed) {
    LS_RETURN_IF_ERROR(cu::CopyAsync(dev_x, host.data(), host.size() * 4, stream_->get()));
    LS_RETURN_IF_ERROR(stream_->Synchronize());
  }
  return Status::Ok();
}

Status CudaBackend::SwiGluMlp(const DevTensor& gate_up, const DevTensor& down, int64_t inter, const float* x,
                              int64_t rows, float* y) {
  // gate_up: [R, 2I] (gate then up), act: [R, I]; both in the `gather_` scratch.
  const ModelConfig& c = model_->config();
  const int64_t H = c.hidden_size;
  LS_RETURN_IF_ERROR(gather_.Ensure(static_cast<size_t>(rows * 3 * inter) * 4));
  float* gu = gather_.as<float>();
  float* act = gu + rows * 2 * inter;
  LS_RETURN_IF_ERROR(Linear(x, H, rows, gate_up, gu, 2 * inter));
  cu::SwiGluParams sp;
  sp.g = gu;
  sp.g_stride = 2 * inter;
  sp.u = gu + inter;
  sp.u_stride = 2 * inter;
  sp.out = act;
  sp.out_stride = inter;
  sp.rows = rows;
  sp.n = inter;
  LS_RETURN_IF_ERROR(cu::SwiGlu(sp, stream_->get()));
  return Linear(act, inter, rows, down, y, H);
}

Status CudaBackend::Forward(std::span<Segment> segs, PagedKvCache& cache, const kernels::KernelChoice& kernels,
                            TapHook* hook, ForwardOutput* out) {
  const ModelConfig& c = model_->config();
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, C = c.kv_lora_rank, dqk = dn + dr, V = c.vocab_size;
  const float scale = static_cast<float>(c.softmax_scale());
  auto it = kernels.find("gemm");
  const std::string gemm = it == kernels.end() ? "fp32" : it->second;
  if (gemm != gemm_variant_) {
    return Status::Internal("cuda backend: weights were loaded for gemm=" + gemm_variant_ + ", step asks gemm=" + gemm);
  }
  cu::Stream s = stream_->get();

  // Rows, positions, validation, cache pages (the host cache allocates; the device mirrors ids).
  LS_ASSIGN_OR_RETURN(SegmentLayout layout, LayOutSegments(segs, c));
  row0_ = std::move(layout.row0);
  const int64_t R = layout.rows;
  int64_t max_len = layout.max_end, max_pages = 1;
  if (max_len > rope_positions_) {
    return Status::InvalidArgument("position " + std::to_string(max_len - 1) + " beyond the cuda backend's RoPE table (" +
                                   std::to_string(rope_positions_) + " positions)");
  }
  for (auto& g : segs) {
    LS_RETURN_IF_ERROR(cache.Reserve(g.cache, g.start_pos + static_cast<int64_t>(g.tokens.size())));
    max_pages = std::max<int64_t>(max_pages, static_cast<int64_t>(g.cache->pages.size()));
  }
  segs_ = segs;
  rows_ = R;
  hook_ = hook;

  // Decode-only steps run as a CUDA graph (taps too: their device copies are graph nodes and
  // the arena is handed over after the launch; not when grafting, which needs the host inside
  // the step). Their launches
  // must not depend on the step: keys up to the cache's capacity (kernels skip what a
  // request does not have; results do not depend on this bound) and a full-width page table.
  bool all_decode = true;
  for (const auto& g : segs) all_decode = all_decode && g.tokens.size() == 1;
  const bool graph = use_graphs_ && all_decode && (hook == nullptr || !hook->WantsOverride());
  if (graph) {
    max_len = std::min<int64_t>(rope_positions_, num_pages_ * page_size_);
    max_pages = num_pages_;
  }

  // Logit rows: every row of an all_logits segment, else its last.
  std::vector<int32_t> logit_rows;
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(segs[i].tokens.size());
    for (int64_t j = segs[i].all_logits ? 0 : n - 1; j < n; ++j) logit_rows.push_back(static_cast<int32_t>(row0_[i] + j));
  }
  const int64_t RL = static_cast<int64_t>(logit_rows.size());

  // Host inputs, packed: tokens | positions | slots | seq_lens | logit rows | page table [R, P]
  // | head ids [R, nh] (0..nh−1 per row: the per-head absorption products run as grouped GEMVs)
  const int64_t P = max_pages;
  const size_t in_ints = static_cast<size_t>(4 * R + RL + R * P + R * nh);
  if (host_in_.size() < in_ints * 4) {
    LS_ASSIGN_OR_RETURN(host_in_, cu::PinnedBuffer::Allocate(in_ints * 4 * 2));
  }
  int32_t* hin = host_in_.as<int32_t>();
  int32_t *h_tok = hin, *h_pos = hin + R, *h_slot = hin + 2 * R, *h_len = hin + 3 * R, *h_lrow = hin + 4 * R,
          *h_table = hin + 4 * R + RL;
  for (size_t i = 0; i < segs.size(); ++i) {
    const Segment& g = segs[i];
    for (size_t j = 0; j < g.tokens.size(); ++j) {
      const int64_t r = row0_[i] + static_cast<int64_t>(j);
      const int64_t p = g.start_pos + static_cast<int64_t>(j);
      h_tok[r] = g.tokens[j];
      h_pos[r] = static_cast<int32_t>(p);
      h_slot[r] = static_cast<int32_t>(g.cache->pages[p / page_size_] * page_size_ + p % page_size_);
      h_len[r] = static_cast<int32_t>(p + 1);
      int32_t* row = h_table + r * P;
      std::fill(row, row + P, 0);
      std::copy(g.cache->pages.begin(), g.cache->pages.end(), row);
    }
  }
  std::copy(logit_rows.begin(), logit_rows.end(), h_lrow);
  int32_t* h_heads = h_table + R * P;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t hd = 0; hd < nh; ++hd) h_heads[r * nh + hd] = static_cast<int32_t>(hd);
  }

  LS_RETURN_IF_ERROR(dev_in_.Ensure(in_ints * 4));
  LS_RETURN_IF_ERROR(cu::CopyAsync(dev_in_.buf.data(), hin, in_ints * 4, s));
  const int32_t* d_in = dev_in_.as<int32_t>();
  const int32_t *d_tok = d_in, *d_pos = d_in + R, *d_slot = d_in + 2 * R, *d_len = d_in + 3 * R,
                *d_lrow = d_in + 4 * R, *d_table = d_in + 4 * R + RL, *d_heads = d_table + R * P;

  // Activations, one allocation carved up (floats unless noted).
  const int64_t qlora = std::max<int64_t>(c.q_lora_rank, 1);
  const int64_t nhi = c.has_indexer() ? c.index_n_heads : 0, di = c.has_indexer() ? c.index_head_dim : 0;
  const int64_t topk = c.has_indexer() ? c.index_topk : 0;
  const int64_t k = c.num_experts_per_tok, E = c.n_routed_experts;
  const int64_t E_ = E > 0 ? E : 1, k_ = k > 0 ? k : 1;
  int64_t moe_inter = 1;
  for (const DevLayer& D : layers_) moe_inter = std::max(moe_inter, D.moe_inter);
  struct Part {
    float** ptr;
    int64_t n;
  };
  float *x, *h, *o, *qa, *qr, *q, *kv, *latent, *qlat, *olat, *heads, *iq, *ik, *ikn, *iw, *rlog, *wts, *gu, *act,
      *ey, *sh;
  float *topk_pos_f, *topk_slot_f, *ids_f;
  std::vector<Part> parts = {{&x, R * H},          {&h, R * H},
                             {&o, R * H},          {&qa, R * qlora},
                             {&qr, R * qlora},     {&q, R * nh * dqk},
                             {&kv, R * (C + dr)},  {&latent, R * C},
                             {&qlat, R * nh * C},  {&olat, R * nh * C},
                             {&heads, R * nh * dv}, {&iq, R * std::max<int64_t>(nhi * di, 1)},
                             {&ik, R * std::max<int64_t>(di, 1)}, {&ikn, R * std::max<int64_t>(di, 1)},
                             {&iw, R * std::max<int64_t>(nhi, 1)}, {&topk_pos_f, R * std::max<int64_t>(topk, 1)},
                             {&topk_slot_f, R * std::max<int64_t>(topk, 1)}, {&rlog, R * E_},
                             {&ids_f, R * k_},     {&wts, R * k_},
                             {&gu, R * k_ * 2 * moe_inter}, {&act, R * k_ * moe_inter},
                             {&ey, R * k_ * H},    {&sh, R * H}};
  size_t total = 0;
  for (const Part& p : parts) total += static_cast<size_t>((p.n + 63) / 64 * 64);
  LS_RETURN_IF_ERROR(act_.Ensure(total * 4));
  {
    float* base = act_.as<float>();
    for (const Part& p : parts) {
      *p.ptr = base;
      base += (p.n + 63) / 64 * 64;
    }
  }
  int32_t* topk_pos = reinterpret_cast<int32_t*>(topk_pos_f);
  int32_t* topk_slot = reinterpret_cast<int32_t*>(topk_slot_f);
  int32_t* ids = reinterpret_cast<int32_t*>(ids_f);
  int32_t* err = error_flag_.as<int32_t>();
  if (hook != nullptr && tap_arena_.buf.size() == 0) {
    LS_RETURN_IF_ERROR(tap_arena_.Ensure(size_t{64} << 20));
    LS_ASSIGN_OR_RETURN(tap_host_, cu::PinnedBuffer::Allocate(tap_arena_.buf.size()));
  }

  if (logits_host_.size() < static_cast<size_t>(RL * V) * 4) {
    LS_ASSIGN_OR_RETURN(logits_host_, cu::PinnedBuffer::Allocate(static_cast<size_t>(RL * V) * 4 * 3 / 2));
  }
  LS_RETURN_IF_ERROR(logits_dev_.Ensure(static_cast<size_t>(RL * V) * 4));
  // The new cache rows go back into the host cache when a reader wants them: gathered by
  // slot on the device (inside the step, so a graph includes it), then one copy.
  std::vector<size_t> mirror_off;
  size_t mirror_bytes = 0;
  if (mirror_) {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      for (const StreamSpec& st : cache.streams(l)) {
        if (st.bytes_per_token % 4 != 0) {
          return Status::Internal("cuda backend: cache stream '" + st.name + "' has " +
                                  std::to_string(st.bytes_per_token) + " bytes per token, not a multiple of 4");
        }
        mirror_off.push_back(mirror_bytes);
        mirror_bytes += static_cast<size_t>(R * st.bytes_per_token + 255) / 256 * 256;
      }
    }
    LS_RETURN_IF_ERROR(mirror_dev_.Ensure(mirror_bytes));
    if (mirror_host_.size() < mirror_bytes) {
      LS_ASSIGN_OR_RETURN(mirror_host_, cu::PinnedBuffer::Allocate(mirror_bytes * 3 / 2));
    }
  }
  auto body = [&]() -> Status {
LS_RETURN_IF_ERROR(Mark("start"));
    // x = embed(tokens)
    {
      cu::EmbedParams ep;
      ep.table = embed_.f32();
      ep.vocab = V;
      ep.n = H;
      ep.ids = d_tok;
      ep.rows = R;
      ep.y = x;
      ep.y_stride = H;
      ep.error_flag = err;
      LS_RETURN_IF_ERROR(cu::Embed(ep, s));
    }
    LS_RETURN_IF_ERROR(Tap("embed", x, H, H, TapDType::kF32));
    LS_RETURN_IF_ERROR(OverrideRows("embed", x, H));
    LS_RETURN_IF_ERROR(Mark("embed"));
  
    auto rmsnorm = [&](const float* in, int64_t in_stride, const DevTensor& w, int64_t n, float eps, float* y,
                       int64_t y_stride) {
      cu::RmsNormParams p;
      p.x = in;
      p.x_stride = in_stride;
      p.weight = w.f32();
      p.y = y;
      p.y_stride = y_stride;
      p.rows = R;
      p.n = n;
      p.eps = eps;
      return cu::RmsNorm(p, s);
    };
    auto rope = [&](float* v, int64_t row_stride, int64_t heads_n, int64_t head_stride, cu::RopeStyle style) {
      cu::RopeParams p;
      p.x = v;
      p.row_stride = row_stride;
      p.head_stride = head_stride;
      p.rows = R;
      p.heads = heads_n;
      p.dim = dr;
      p.positions = d_pos;
      p.cos = rope_cos_.f32();
      p.sin = rope_sin_.f32();
      p.max_position = rope_positions_;
      p.style = style;
      p.error_flag = err;
      return cu::Rope(p, s);
    };
    const float rms_eps = static_cast<float>(c.rms_norm_eps);
    LS_RETURN_IF_ERROR(mla_ws_.Ensure(256));
  
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const DevLayer& D = layers_[l];
      auto tn = [&](TapId t) -> const std::string& { return model_->tap_name(l, t); };
  
      LS_RETURN_IF_ERROR(rmsnorm(x, H, D.input_norm, H, rms_eps, h, H));
      LS_RETURN_IF_ERROR(Tap(tn(kTapAttnNorm), h, H, H, TapDType::kF32));
      LS_RETURN_IF_ERROR(Mark("rmsnorm"));
  
      // q = q_b(RMSNorm(q_a(h))) or q_proj(h)
      if (c.q_lora_rank > 0) {
        LS_RETURN_IF_ERROR(Linear(h, H, R, D.q_a_proj, qa, c.q_lora_rank));
        LS_RETURN_IF_ERROR(rmsnorm(qa, c.q_lora_rank, D.q_a_norm, c.q_lora_rank, 1e-6f, qr, c.q_lora_rank));
        LS_RETURN_IF_ERROR(Linear(qr, c.q_lora_rank, R, D.q_b_proj, q, nh * dqk));
        LS_RETURN_IF_ERROR(Mark("q_proj"));
      } else {
        LS_RETURN_IF_ERROR(Linear(h, H, R, D.q_proj, q, nh * dqk));
        LS_RETURN_IF_ERROR(Mark("q_proj"));
      }
      // [c_kv | k_rope] = kv_a(h); latent = RMSNorm(c_kv); RoPE on q's rope part and k_rope in place.
      LS_RETURN_IF_ERROR(Linear(h, H, R, D.kv_a_proj, kv, C + dr));
      LS_RETURN_IF_ERROR(Mark("kv_a_proj"));
      LS_RETURN_IF_ERROR(rmsnorm(kv, C + dr, D.kv_a_norm, C, 1e-6f, latent, C));
      const cu::RopeStyle style = ToRopeStyle(c.rope_style);
      LS_RETURN_IF_ERROR(rope(q + dn, nh * dqk, nh, dqk, style));
      LS_RETURN_IF_ERROR(rope(kv + C, C + dr, 1, dr, style));
      LS_RETURN_IF_ERROR(Tap(tn(kTapQ), q, nh * dqk, nh * dqk, TapDType::kF32));
      LS_RETURN_IF_ERROR(Tap(tn(kTapLatent), latent, C, C, TapDType::kF32));
      LS_RETURN_IF_ERROR(Tap(tn(kTapKRope), kv + C, dr, C + dr, TapDType::kF32));
  
      // Append to the device cache in its format; attention reads what was stored.
      {
        cu::LatentWriteParams wp;
        wp.latent = latent;
        wp.latent_stride = C;
        wp.rope = kv + C;
        wp.rope_stride = C + dr;
        wp.slots = d_slot;
        wp.cache = latent_pool_[l].as<uint8_t>();
        wp.num_slots = num_pages_ * page_size_;
        wp.rows = R;
        wp.kv_lora = C;
        wp.rope_dim = dr;
        wp.format = format_;
        wp.error_flag = err;
        LS_RETURN_IF_ERROR(cu::WriteLatent(wp, s));
        LS_RETURN_IF_ERROR(Mark("norm_rope_write"));
      }
  
      // V3.2 indexer: scores over every causal key, exact top-k → the keys sparse attention reads.
      const bool sparse = c.layers[l].attention == AttentionKind::kMlaSparse;
      if (sparse) {
        LS_RETURN_IF_ERROR(Linear(qr, c.q_lora_rank, R, D.iq_b, iq, nhi * di));
        LS_RETURN_IF_ERROR(Linear(h, H, R, D.ik, ik, di));
        cu::LayerNormParams lp;
        lp.x = ik;
        lp.x_stride = di;
        lp.weight = D.ik_norm_w.f32();
        lp.bias = D.ik_norm_b.f32();
        lp.y = ikn;
        lp.y_stride = di;
        lp.rows = R;
        lp.n = di;
        lp.eps = 1e-6;
        LS_RETURN_IF_ERROR(cu::LayerNorm(lp, s));
        LS_RETURN_IF_ERROR(Linear(h, H, R, D.iw_proj, iw, nhi));
        LS_RETURN_IF_ERROR(rope(iq, nhi * di, nhi, di, cu::RopeStyle::kHalves));
        LS_RETURN_IF_ERROR(rope(ikn, di, 1, di, cu::RopeStyle::kHalves));
        LS_RETURN_IF_ERROR(cu::Scale(iw, nhi, R, nhi, 1.0f / std::sqrt(static_cast<float>(nhi)), s));
        cu::ScatterRowsParams sp;
        sp.src = ikn;
        sp.src_stride = di * 4;
        sp.slots = d_slot;
        sp.n = R;
        sp.dst = index_pool_[l].data();
        sp.dst_rows = num_pages_ * page_size_;
        sp.dst_stride = di * 4;
        sp.row_bytes = di * 4;
        sp.error_flag = err;
        LS_RETURN_IF_ERROR(cu::ScatterRows(sp, s));
  
        LS_RETURN_IF_ERROR(scores_.Ensure(static_cast<size_t>(R * max_len) * 4));
        cu::IndexerScoreParams ip;
        ip.batch = R;
        ip.heads = nhi;
        ip.head_dim = di;
        ip.q = iq;
        ip.q_batch_stride = nhi * di;
        ip.q_head_stride = di;
        ip.weights = iw;
        ip.weights_stride = nhi;
        ip.key_scale = 1.0f / std::sqrt(static_cast<float>(di));
        ip.keys = index_pool_[l].as<float>();
        ip.num_pages = num_pages_;
        ip.page_size = page_size_;
        ip.page_table = d_table;
        ip.page_table_stride = P;
        ip.seq_lens = d_len;
        ip.max_seq_len = max_len;
        ip.scores = scores_.as<float>();
        ip.scores_stride = max_len;
        ip.error_flag = err;
        LS_RETURN_IF_ERROR(cu::IndexerScores(ip, s));
        cu::TopKParams tp;
        tp.batch = R;
        tp.topk = topk;
        tp.scores = scores_.as<float>();
        tp.scores_stride = max_len;
        tp.seq_lens = d_len;
        tp.max_seq_len = max_len;
        tp.positions = topk_pos;
        tp.slots = topk_slot;
        tp.page_table = d_table;
        tp.page_table_stride = P;
        tp.page_size = page_size_;
        tp.num_pages = num_pages_;
        tp.error_flag = err;
        LS_RETURN_IF_ERROR(cu::TopK(tp, s));
        LS_RETURN_IF_ERROR(Tap(tn(kTapIndexerTopk), topk_pos, topk, topk, TapDType::kI32));
        LS_RETURN_IF_ERROR(Mark("indexer"));
      }
  
      // Absorbed attention for every row: q_lat_h = W_UK_hᵀ q_nope_h; attend over the latent;
      // heads_h = W_UV_h o_lat_h.
      // Per head as a grouped GEMV (heads = "experts", one slot per head): a fixed reduction
      // order per output element whatever the number of rows (ExpertGemm is cpu::MatMulNT's).
      cu::ExpertGemmParams ab;
      ab.rows = R;
      ab.k = nh;
      ab.experts = nh;
      ab.out = C;
      ab.in = dn;
      ab.w = D.w_ukt.ptr();
      ab.w_bf16 = D.w_ukt.bf16;
      ab.w_expert_stride = C * dn;
      ab.w_row_stride = dn;
      ab.x = q;  // slot (r, h) reads q[r, h, 0:dn]: row (r·nh + h) at stride dqk
      ab.x_stride = dqk;
      ab.x_per_slot = true;
      ab.round_x_bf16 = bf16_;
      ab.ids = d_heads;
      ab.y = qlat;
      ab.y_stride = C;
      ab.error_flag = err;
      LS_RETURN_IF_ERROR(cu::ExpertGemm(ab, s));
      LS_RETURN_IF_ERROR(Mark("absorb_q"));
      {
        cu::MlaDecodeParams mp;
        mp.batch = R;
        mp.heads = nh;
        mp.kv_lora = C;
        mp.rope_dim = dr;
        mp.format = format_;
        mp.softmax_scale = scale;
        mp.q_latent = qlat;
        mp.q_latent_batch_stride = nh * C;
        mp.q_latent_head_stride = C;
        mp.q_rope = q + dn;
        mp.q_rope_batch_stride = nh * dqk;
        mp.q_rope_head_stride = dqk;
        mp.cache = latent_pool_[l].as<uint8_t>();
        mp.num_pages = num_pages_;
        mp.page_size = page_size_;
        mp.o_latent = olat;
        mp.o_batch_stride = nh * C;
        mp.o_head_stride = C;
        mp.error_flag = err;
        if (sparse) {
          mp.indices = topk_slot;
          mp.indices_stride = topk;
          mp.topk = topk;
        } else {
          mp.page_table = d_table;
          mp.page_table_stride = P;
          mp.seq_lens = d_len;
          mp.max_seq_len = max_len;
        }
        const size_t need = cu::MlaDecodeWorkspaceBytes(mp);
        LS_RETURN_IF_ERROR(mla_ws_.Ensure(std::max<size_t>(need, 256)));
        mp.workspace = mla_ws_.buf.data();
        mp.workspace_bytes = mla_ws_.buf.size();
        LS_RETURN_IF_ERROR(sparse ? cu::MlaSparseDecode(mp, s) : cu::MlaDecode(mp, s));
        LS_RETURN_IF_ERROR(Mark("mla_decode"));
      }
      // heads_h = W_UV_h o_lat_h: W_UV_h is rows [h·(dn+dv) + dn, +dv) of kv_b_proj.
      ab.out = dv;
      ab.in = C;
      ab.w = static_cast<const char*>(D.kv_b.ptr()) + dn * C * (D.kv_b.bf16 ? 2 : 4);
      ab.w_bf16 = D.kv_b.bf16;
      ab.w_expert_stride = (dn + dv) * C;
      ab.w_row_stride = C;
      ab.x = olat;
      ab.x_stride = C;
      ab.y = heads;
      ab.y_stride = dv;
      LS_RETURN_IF_ERROR(cu::ExpertGemm(ab, s));
      LS_RETURN_IF_ERROR(Mark("absorb_v"));
      LS_RETURN_IF_ERROR(Tap(tn(kTapHeads), heads, nh * dv, nh * dv, TapDType::kF32));
  
      // x = x + o_proj(heads)
      LS_RETURN_IF_ERROR(Linear(heads, nh * dv, R, D.o_proj, o, H));
      LS_RETURN_IF_ERROR(Mark("o_proj"));
      LS_RETURN_IF_ERROR(Tap(tn(kTapAttnOut), o, H, H, TapDType::kF32));
      LS_RETURN_IF_ERROR(cu::AddInPlace(x, H, o, H, R, H, s));
      LS_RETURN_IF_ERROR(Tap(tn(kTapResidMid), x, H, H, TapDType::kF32));
  
      // FFN on RMSNorm(x).
      LS_RETURN_IF_ERROR(rmsnorm(x, H, D.post_attn_norm, H, rms_eps, h, H));
      LS_RETURN_IF_ERROR(Tap(tn(kTapFfnNorm), h, H, H, TapDType::kF32));
      if (c.layers[l].ffn == FfnKind::kDense) {
        LS_RETURN_IF_ERROR(SwiGluMlp(D.mlp_gate_up, D.mlp_down, D.mlp_inter, h, R, o));
        LS_RETURN_IF_ERROR(Mark("dense_mlp"));
      } else {
        // Router logits in fp32 (the router is never rounded), routing on the device.
        // Router logits: fp32 weights, cpu::Dot's order (RowDots) — the CPU's exact bits,
        // so the experts chosen are the CPU's whenever the inputs are.
        cu::RowDotsParams rg;
        rg.x = h;
        rg.x_stride = H;
        rg.w = D.router.f32();
        rg.w_stride = H;
        rg.y = rlog;
        rg.y_stride = E;
        rg.rows = R;
        rg.outs = E;
        rg.n = H;
        LS_RETURN_IF_ERROR(cu::RowDots(rg, s));
        cu::RouteParams rp;
        rp.logits = rlog;
        rp.logits_stride = E;
        rp.bias = D.router_bias.empty() ? nullptr : D.router_bias.f32();
        rp.rows = R;
        rp.experts = E;
        rp.k = k;
        // Groups matter only with more than one (the CPU ignores n_group ≤ 1, e.g. V2's null).
        const bool grouped = c.gate != GateKind::kSoftmaxGreedy && c.n_group > 1;
        rp.n_group = grouped ? c.n_group : 1;
        rp.topk_group = grouped ? c.topk_group : 1;
        rp.gate = ToGateKind(c.gate);
        rp.norm_topk_prob = c.norm_topk_prob;
        rp.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
        rp.ids = ids;
        rp.weights = wts;
        LS_RETURN_IF_ERROR(cu::Route(rp, s));
        LS_RETURN_IF_ERROR(Mark("router"));
        LS_RETURN_IF_ERROR(Tap(tn(kTapTopkIds), ids, k, k, TapDType::kI32));
        LS_RETURN_IF_ERROR(Tap(tn(kTapTopkWeights), wts, k, k, TapDType::kF32));
        // Each (row, slot) through its expert: gate_up, SwiGLU, down; combined in slot order.
        const int64_t I = D.moe_inter;
        cu::ExpertGemmParams ge;
        ge.rows = R;
        ge.k = k;
        ge.experts = E;
        ge.out = 2 * I;
        ge.in = H;
        ge.w = D.experts_gate_up.ptr();
        ge.w_bf16 = D.experts_gate_up.bf16;
        ge.w_expert_stride = 2 * I * H;
        ge.w_row_stride = H;
        ge.x = h;
        ge.x_stride = H;
        ge.x_per_slot = false;
        ge.round_x_bf16 = bf16_;
        ge.ids = ids;
        ge.y = gu;
        ge.y_stride = 2 * I;
        ge.error_flag = err;
        LS_RETURN_IF_ERROR(cu::ExpertGemm(ge, s));
        LS_RETURN_IF_ERROR(Mark("experts_gate_up"));
        cu::SwiGluParams sp;
        sp.g = gu;
        sp.g_stride = 2 * I;
        sp.u = gu + I;
        sp.u_stride = 2 * I;
        sp.out = act;
        sp.out_stride = I;
        sp.rows = R * k;
        sp.n = I;
        LS_RETURN_IF_ERROR(cu::SwiGlu(sp, s));
        ge.out = H;
        ge.in = I;
        ge.w = D.experts_down.ptr();
        ge.w_bf16 = D.experts_down.bf16;
        ge.w_expert_stride = H * I;
        ge.w_row_stride = I;
        ge.x = act;
        ge.x_stride = I;
        ge.x_per_slot = true;
        ge.y = ey;
        ge.y_stride = H;
        LS_RETURN_IF_ERROR(cu::ExpertGemm(ge, s));
        LS_RETURN_IF_ERROR(Mark("experts_down"));
        if (c.n_shared_experts > 0) {
          LS_RETURN_IF_ERROR(SwiGluMlp(D.shared_gate_up, D.shared_down, D.shared_inter, h, R, sh));
          LS_RETURN_IF_ERROR(Mark("shared_experts"));
        }
        cu::MoeCombineParams mc;
        mc.y = ey;
        mc.y_stride = H;
        mc.weights = wts;
        mc.shared = c.n_shared_experts > 0 ? sh : nullptr;
        mc.shared_stride = H;
        mc.out = o;
        mc.out_stride = H;
        mc.rows = R;
        mc.k = k;
        mc.n = H;
        LS_RETURN_IF_ERROR(cu::MoeCombine(mc, s));
        LS_RETURN_IF_ERROR(Mark("combine"));
      }
      LS_RETURN_IF_ERROR(Tap(tn(kTapFfnOut), o, H, H, TapDType::kF32));
      LS_RETURN_IF_ERROR(cu::AddInPlace(x, H, o, H, R, H, s));
      LS_RETURN_IF_ERROR(Tap(tn(kTapResidOut), x, H, H, TapDType::kF32));
      LS_RETURN_IF_ERROR(OverrideRows(tn(kTapResidOut), x, H));
    }
  
    // Final norm; logits for the rows that need them, gathered first so lm_head is read once.
    LS_RETURN_IF_ERROR(rmsnorm(x, H, final_norm_, H, rms_eps, h, H));
    LS_RETURN_IF_ERROR(Tap("final_norm", h, H, H, TapDType::kF32));
    {
      cu::GatherRowsParams gp;
      gp.src = h;
      gp.src_rows = R;
      gp.src_stride = H * 4;
      gp.rows = d_lrow;
      gp.n = RL;
      gp.dst = o;  // o has R ≥ RL rows
      gp.dst_stride = H * 4;
      gp.row_bytes = H * 4;
      gp.error_flag = err;
      LS_RETURN_IF_ERROR(cu::GatherRows(gp, s));
    }
    LS_RETURN_IF_ERROR(Linear(o, H, RL, lm_head_, logits_dev_.as<float>(), V));
    LS_RETURN_IF_ERROR(Mark("lm_head"));
    if (mirror_) {
      size_t idx = 0;
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        for (const StreamSpec& st : cache.streams(l)) {
          cu::GatherRowsParams gp;
          gp.src = st.kind == StreamKind::kMlaLatent ? latent_pool_[l].data() : index_pool_[l].data();
          gp.src_rows = num_pages_ * page_size_;
          gp.src_stride = st.bytes_per_token;
          gp.rows = d_slot;
          gp.n = R;
          gp.dst = mirror_dev_.as<char>() + mirror_off[idx++];
          gp.dst_stride = st.bytes_per_token;
          gp.row_bytes = st.bytes_per_token;
          gp.error_flag = err;
          LS_RETURN_IF_ERROR(cu::GatherRows(gp, s));
        }
      }
      LS_RETURN_IF_ERROR(Mark("cache_mirror"));
    }
    return Status::Ok();
  };
  if (!graph) {
    LS_RETURN_IF_ERROR(body());
  } else {
    const int64_t key = 2 * R + (hook != nullptr ? 1 : 0);  // with taps the graph has the arena copies
    StepGraph& sg = graphs_[key];
    auto warm = warmed_.find(key);
    if (sg.graph && sg.generation == g_alloc_generation) {
      LS_RETURN_IF_ERROR(sg.graph->Launch(s));
      if (prof_) prof_->SetUsed(sg.marks);
      pending_ = sg.pending;
      tap_used_ = sg.tap_used;
    } else if (!sg.failed && warm != warmed_.end() && warm->second == g_alloc_generation) {
      LS_RETURN_IF_ERROR(cu::CudaGraph::BeginCapture(s));
      capturing_ = true;
      const Status st = body();
      capturing_ = false;
      auto captured = cu::CudaGraph::EndCapture(s);
      if (st.ok() && captured.ok() && g_alloc_generation == warm->second) {
        sg.graph = std::move(*captured);
        sg.generation = g_alloc_generation;
        if (prof_) sg.marks = prof_->used();
        sg.pending = pending_;
        sg.tap_used = tap_used_;
        LS_RETURN_IF_ERROR(sg.graph->Launch(s));
      } else {
        // Something in the step cannot be captured: run it plainly from now on.
        sg.failed = true;
        sg.graph.reset();
        cu::ClearLastError();
        pending_.clear();
        tap_used_ = 0;
        if (prof_) prof_->SetUsed(0);
        LS_RETURN_IF_ERROR(body());
      }
    } else {
      LS_RETURN_IF_ERROR(body());
      warmed_[key] = g_alloc_generation;
    }
  }
  LS_RETURN_IF_ERROR(cu::CopyAsync(logits_host_.data(), logits_dev_.buf.data(), static_cast<size_t>(RL * V) * 4, s));

  if (mirror_) {
    LS_RETURN_IF_ERROR(cu::CopyAsync(mirror_host_.data(), mirror_dev_.buf.data(), mirror_bytes, s));
  }

  // One synchronisation: taps, logits, cache rows and the kernels' error flag.
  int32_t flag = 0;
  LS_RETURN_IF_ERROR(cu::CopyAsync(&flag, err, 4, s));
  LS_RETURN_IF_ERROR(FlushTaps());
  LS_RETURN_IF_ERROR(stream_->Synchronize());
  if (flag != 0) {
    LS_RETURN_IF_ERROR(error_flag_.Fill(0));
    return Status::Internal("cuda backend: a kernel reported bad device arguments (KernelError bits " +
                            std::to_string(flag) + ")");
  }
  if (prof_) {
    LS_RETURN_IF_ERROR(prof_->Collect(&prof_ms_));
    ++prof_steps_;
  }
  if (mirror_) {
    size_t idx = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const auto& streams = cache.streams(l);
      for (size_t si = 0; si < streams.size(); ++si) {
        const char* base = mirror_host_.as<char>() + mirror_off[idx++];
        for (size_t i = 0; i < segs.size(); ++i) {
          for (size_t j = 0; j < segs[i].tokens.size(); ++j) {
            const int64_t r = row0_[i] + static_cast<int64_t>(j);
            std::memcpy(cache.MutableTokenBytes(l, si, *segs[i].cache, segs[i].start_pos + static_cast<int64_t>(j)),
                        base + r * streams[si].bytes_per_token, static_cast<size_t>(streams[si].bytes_per_token));
          }
        }
      }
    }
  }

  out->logits.assign(segs.size(), {});
  const float* lg = logits_host_.as<float>();
  int64_t lr = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(segs[i].tokens.size());
    const int64_t first = segs[i].all_logits ? 0 : n - 1;
    const int64_t rows = n - first;
    out->logits[i].assign(lg + lr * V, lg + (lr + rows) * V);
    lr += rows;
    if (hook != nullptr) {
      TapEvent e;
      e.name = "logits";
      e.request_id = segs[i].request_id;
      e.position = segs[i].start_pos + first;
      e.rows = rows;
      e.cols = V;
      e.data = out->logits[i].data();
      hook->OnTap(e);
    }
  }
  for (auto& g : segs) g.cache->length = g.start_pos + static_cast<int64_t>(g.tokens.size());
  hook_ = nullptr;
  segs_ = {};
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                   const kernels::KernelChoice& kernels) {
  return CudaBackend::Create(std::move(model), cache, kernels);
}

}  // namespace lockstep::engine
