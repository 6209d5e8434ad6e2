// engine/cuda_backend_impl.h — the CUDA backend's class, private to engine/cuda_backend.cc
// (set-up: weights, cache, GEMMs, taps), engine/cuda_forward.cc (a step) and
// engine/cuda_blocks.cc (the forward pass's blocks).
// Use it through engine/backend.h.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/cuda_scratch.h"
#include "engine/cuda_tap_capture.h"
#include "engine/tensor_parallel.h"
#include "kernels/collective.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

namespace lockstep::engine::cuda_impl {

namespace cu = kernels::cuda;
struct CudaStep;  // engine/cuda_step.h

// A weight on the device: fp32, bf16 bits for the bf16 GEMM variants, or FP8 e4m3 bytes for
// gemm=fp8_dot with `scale` [rows, scale_cols]: each row's fp32 scale per 128 columns (a
// 128 × 128 block's scale repeated over its rows, so stacked and sliced matrices keep theirs).
struct DevTensor {
  cu::DeviceBuffer buf;
  int64_t rows = 0, cols = 0;
  bool bf16 = false;
  bool fp8 = false;
  cu::DeviceBuffer scale;
  int64_t scale_cols = 0;
  const void* ptr() const { return buf.data(); }
  const float* f32() const { return buf.as<const float>(); }
  bool empty() const { return rows == 0; }
  size_t element_bytes() const { return fp8 ? 1 : bf16 ? 2 : 4; }
  // Points g's weight at rows [row0, …) of this tensor, expert e at e·expert_rows rows further.
  void Bind(cu::ExpertGemmParams* g, int64_t row0, int64_t expert_rows) const {
    g->w = static_cast<const char*>(ptr()) + row0 * cols * static_cast<int64_t>(element_bytes());
    g->w_bf16 = bf16;
    g->w_fp8 = fp8;
    g->w_row_stride = cols;
    g->w_expert_stride = expert_rows * cols;
    g->w_scale = fp8 ? scale.as<const float>() + row0 * scale_cols : nullptr;
    g->w_scale_row_stride = scale_cols;
    g->w_scale_expert_stride = expert_rows * scale_cols;
  }
};

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
  // The routed experts held: [expert0, expert0 + experts) (every one but in rank mode, EP).
  int32_t expert0 = 0;
  int64_t experts = 0;
};

// Every weight of a model on the device. Immutable once made, so engines over the same Model
// and GEMM precision share one copy (a server's live engine and its capture re-runs). In rank
// mode (KernelPlan::ranks) the rank's shard only: the heads', the intermediate slices' and the
// expert block's rows and columns (CudaBackend::ShardLayer; the rest replicated).
struct DeviceWeights {
  DevTensor embed, final_norm, lm_head;
  std::vector<DevLayer> layers;
};

// kernels/cuda mirrors the engine's enumerations in the same order (ops.h says so).
static_assert(static_cast<int>(cu::LatentFormat::kFp8E4m3) == static_cast<int>(KvFormat::kFp8E4m3) &&
              static_cast<int>(cu::LatentFormat::kBf16) == static_cast<int>(KvFormat::kBf16));
static_assert(static_cast<int>(cu::RopeStyle::kHalves) == static_cast<int>(RopeStyle::kHalves) &&
              static_cast<int>(cu::RopeStyle::kPairsToHalves) == static_cast<int>(RopeStyle::kPairsToHalves));
static_assert(static_cast<int>(cu::GateKind::kSigmoidNoauxTc) == static_cast<int>(GateKind::kSigmoidNoauxTc) &&
              static_cast<int>(cu::GateKind::kSoftmaxGroupLimited) == static_cast<int>(GateKind::kSoftmaxGroupLimited));
inline cu::LatentFormat ToLatentFormat(KvFormat f) { return static_cast<cu::LatentFormat>(f); }
inline cu::RopeStyle ToRopeStyle(RopeStyle s) { return static_cast<cu::RopeStyle>(s); }
inline cu::GateKind ToGateKind(GateKind g) { return static_cast<cu::GateKind>(g); }
static_assert(static_cast<int>(cu::ReduceOrder::kRing) == static_cast<int>(kernels::AllReduce::kRing) &&
              static_cast<int>(cu::ReduceOrder::kRotateByRow) == static_cast<int>(kernels::AllReduce::kFaultRotateByRow));
inline cu::ReduceOrder ToReduceOrder(kernels::AllReduce v) { return static_cast<cu::ReduceOrder>(v); }

class CudaBackend final : public Backend {
 public:
  std::string_view name() const override { return "cuda"; }
  ~CudaBackend() override {
    if (!prof_) return;
    std::fprintf(stderr, "lockstep: cuda backend: %lld steps replayed from CUDA graphs\n",
                 static_cast<long long>(graph_launches_));
    for (int kind = 0; kind < 2; ++kind) {
      if (prof_steps_[kind] == 0) continue;
      double total = 0;
      for (const auto& [k, v] : prof_ms_[kind]) total += v;
      std::fprintf(stderr, "lockstep: cuda backend GPU time over %lld %s (ms/step, share):\n",
                   static_cast<long long>(prof_steps_[kind]), kind == 0 ? "decode steps" : "steps with prompt rows");
      for (const auto& [k, v] : prof_ms_[kind]) {
        std::fprintf(stderr, "  %-16s %8.3f  %5.1f%%\n", k.c_str(), v / static_cast<double>(prof_steps_[kind]),
                     100 * v / std::max(total, 1e-9));
      }
    }
  }
  std::string device() const override { return device_; }
  void SetMirrorCache(bool on) override { mirror_ = on; }
  int64_t tap_wait_ns() const override { return taps_.wait_ns(); }

  static Result<std::unique_ptr<Backend>> Create(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                 const kernels::KernelPlan& plan, const BackendOptions& options);

  Status Forward(std::span<Segment> segs, PagedKvCache& cache, const kernels::KernelPlan& plan, TapHook* hook,
                 ForwardOutput* out) override;

 private:
  CudaBackend() {
    for (Scratch* sc : {&dev_in_, &act_, &xb_, &xb_side_, &zero_ids_, &mla_ws_, &scores_, &iq8_, &logits_dev_, &gather_,
                        &mirror_dev_, &tp_w_, &tp_gather_}) {
      sc->generation = &alloc_generation_;
    }
  }
  int64_t alloc_generation_ = 0;  // see Scratch
  Status UploadWeights(DeviceWeights* w);
  Status RandomWeights(uint64_t seed, DeviceWeights* w);
  // The shared device weights of (model_, weight precision): made now, or taken from a live engine.
  Status AcquireWeights();
  Status AllocateCache(const PagedKvCache& cache);
  // Rank mode: layer l's whole tensors → rank_'s shard of them (docs/parallelism.md).
  Status ShardLayer(DevLayer& D, int64_t l, cu::Stream s) const;

  // The dot GEMM's (gemm=*_dot) parameters of Linear: w as one expert, fixed ids.
  Result<kernels::cuda::ExpertGemmParams> DotParams(const float* x, int64_t x_stride, int64_t rows, const DevTensor& w,
                                                    float* y, int64_t y_stride);
  // y[rows, out] = x[rows, w.cols] · wᵀ through the chosen GEMM; bf16 weights take x rounded to
  // bf16 (LinearCols over every column).
  Status Linear(const float* x, int64_t x_stride, int64_t rows, const DevTensor& w, float* y, int64_t y_stride);
  Status SwiGluMlp(const DevTensor& gate_up, const DevTensor& down, int64_t inter, const float* x, int64_t rows,
                   float* y);
  // SwiGluMlp's activations [rows, inter] (in gather_), the down projection's input.
  // (ranks > 1: the emulated row-parallel down's input, each rank's slice of inter rounded on its own.)
  Result<float*> SwiGluAct(const DevTensor& gate_up, int64_t inter, const float* x, int64_t rows, int ranks = 1);

  // Emulated tensor parallelism (--emulate-tp N > 1; engine/tensor_parallel.h). LinearCols: a
  // rank's product over input columns [k0, k1) of w (Linear's arithmetic over the slice: under
  // gemm=*_dot cpu::MatMulNTCols' bits). RowParallel: the row-parallel product's partials
  // [rows][ranks][out], rank r over ShardOf(in / unit, ranks, r)·unit. TpAllReduce: y = the
  // partials summed in the plan's all-reduce order.
  Status LinearCols(const float* x, int64_t x_stride, int64_t rows, const DevTensor& w, int64_t k0, int64_t k1,
                    float* y, int64_t y_stride);
  Status RowParallel(const float* x, int64_t x_stride, int64_t rows, const DevTensor& w, int ranks, int64_t unit,
                     float* partials);
  Status TpAllReduce(const CudaStep& st, const float* partials, float* y);
  Status MlpPartials(const DevTensor& gate_up, const DevTensor& down, int64_t inter, const float* x, int64_t rows,
                     int ranks, float* partials);

  // The forward pass's blocks (engine/cuda_blocks.cc), in step order: StepBody loops over the
  // layers calling them; each launches on st.s and leaves its outputs in the step's buffers.
  Status StepBody(CudaStep& st);
  Status EmbedBlock(CudaStep& st);              // x = embed(tokens)
  Status QueryAndKeyBlock(CudaStep& st, int64_t l);  // input norm; q; latent and k_rope into the cache
  Status IndexerBlock(CudaStep& st, int64_t l);      // V3.2: the top-k keys sparse attention reads
  Status AttendBlock(CudaStep& st, int64_t l);       // absorbed MLA attention → heads
  Status OutProjBlock(CudaStep& st, int64_t l);      // o_proj, x += o, the FFN's norm (and routing)
  Status FfnBlock(CudaStep& st, int64_t l);          // dense MLP or MoE, x += o, the next norm
  Status HeadBlock(CudaStep& st);                    // final norm, lm_head, the step's tap tail
  // A head-sharded tensor [R, nh·w] as tap t of layer l (rank mode: every rank's, whole rows).
  Status TapHeads(CudaStep& st, int64_t l, TapId t, const float* mine, int64_t w);
  // Runs fn's launches on the side stream after what st.main_stream has queued; join_ marks their end.
  Status OnSide(CudaStep& st, const std::function<Status()>& fn);

  // The step's taps (engine/cuda_tap_capture.h): the blocks call taps_.Tap at each tap point.
  CudaTapCapture taps_{&alloc_generation_};
  // BackendOptions::profile: GPU time per phase, printed when the backend is destroyed.
  Status Mark(const char* name) { return prof_ ? prof_->Mark(name, stream_->get()) : Status::Ok(); }
  std::unique_ptr<cu::EventTimer> prof_;
  std::map<std::string, double> prof_ms_[2];  // [0] decode-only steps, [1] steps with prompt rows
  int64_t prof_steps_[2] = {0, 0};
  int64_t graph_launches_ = 0;

  std::shared_ptr<Model> model_;
  std::string device_;
  // Rank mode (KernelPlan::ranks: real tensor parallelism, this backend one rank): rank_ of
  // ranks_ (−1 of 1 otherwise), its collective, and the host staging of a collective whose ranks
  // are threads (kernels::LocalCollectives: the step waits for its stream, and the gather runs
  // over host memory — no CUDA graphs then).
  int rank_ = -1, ranks_ = 1;
  std::shared_ptr<kernels::Collective> coll_;
  cu::PinnedBuffer gather_host_;
  // recv [ranks_ × n] (rank q's n floats at q·n, device) = every rank's send [n] (device), on st.s.
  Status DeviceAllGather(const CudaStep& st, const float* send, int64_t n, float* recv);
  // Rank mode: every rank's rows of `mine` [R, cols] → out [R][ranks][cols] (the emulation's
  // partials layout, and for a head-sharded tensor its whole rows), through tp_gather_.
  Status GatherRows(const CudaStep& st, const float* mine, int64_t cols, float* out);
  Scratch tp_gather_;
  kernels::Gemm gemm_ = kernels::Gemm::kFp32;  // the variant the weights were uploaded for
  bool bf16_ = false;
  bool fp8_ = false;  // gemm=fp8_dot / w8a8_dot: product weights in FP8 where the model has them (Model::Fp8Weights)
  bool w8a8_ = false;  // gemm=w8a8_dot: the linear layers' inputs through FP8 first (cu::Fp8RoundTrip)
  bool mirror_ = false;
  // gemm=*_dot: dense products through ExpertGemm (one "expert", ids all zero: zero_ids_), in
  // cpu::Dot's order — bitwise the CPU engine's GEMM of the same precision.
  bool dot_ = false;
  // A second stream for independent branches of a decode step (the shared experts beside the
  // routed ones, the latent-cache path beside q's): forked from and joined back into stream_
  // with events, so a CUDA graph captures both branches. Linear and SwiGluMlp launch on
  // launch_ (stream_ outside a branch).
  std::unique_ptr<cu::CudaStream> side_;
  std::unique_ptr<cu::CudaEvent> fork_, join_;
  cu::Stream launch_ = nullptr;
  Status EnsureZeroIds(int64_t rows);  // zero_ids_ for `rows` rows (dot_ GEMMs' expert ids)
  int64_t zero_rows_ = 0;  // rows of zero_ids_ known to be zero
  std::unique_ptr<cu::CudaStream> stream_;
  std::unique_ptr<cu::Gemm> gemm_f32_, gemm_bf16_;
  std::unique_ptr<cu::Gemm> gemm_f32_side_, gemm_bf16_side_;  // the side stream's (cuBLAS variants)

  std::shared_ptr<const DeviceWeights> weights_;
  DevTensor rope_cos_, rope_sin_;
  int64_t rope_positions_ = 0;

  // The device cache: per layer, the latent pool and (V3.2) the index-key pool, slot-major.
  std::vector<cu::DeviceBuffer> latent_pool_, index_pool_;
  bool fp8_index_keys_ = false;  // index_pool_ rows are FP8 (indexer=fp8_paged), else fp32
  int64_t num_pages_ = 0, page_size_ = 0, latent_bytes_ = 0;
  cu::LatentFormat format_ = cu::LatentFormat::kFp32;

  // Step inputs (pinned host → device) and scratch.
  cu::PinnedBuffer host_in_;
  Scratch dev_in_, act_, xb_, xb_side_, zero_ids_, mla_ws_, scores_, logits_dev_, gather_, mirror_dev_;
  Scratch iq8_;  // indexer=fp8_paged: the indexer's queries as FP8 rows
  Scratch tp_w_;  // LinearCols: an FP8 weight slice off its 128-column scale blocks, as fp32
  cu::PinnedBuffer mirror_host_;
  cu::DeviceBuffer error_flag_;

  // CUDA graphs of decode steps, by batch size: captured on the second step of a size (the
  // first grows every buffer to its final size), replayed while no buffer moved since.
  struct StepGraph {
    std::unique_ptr<cu::CudaGraph> graph;
    size_t marks = 0;  // profiling events recorded inside the graph
    // Taps copied into the arena by the graph: what the capture hands to the hook after a launch.
    CudaTapCapture::Captured taps;
    int64_t generation = -1;
    bool failed = false;
  };
  std::map<int64_t, StepGraph> graphs_;
  std::map<int64_t, int64_t> warmed_;  // batch size → generation after its uncaptured run
  bool use_graphs_ = true;
  bool use_side_ = true;  // BackendOptions::side_stream
  bool overlap_launch_ = true;  // BackendOptions::overlapped_launch
  bool device_sampler_ = true;  // BackendOptions::device_sampler
  // Device sampling (outside the graph: the requests change every step). sample_dev_:
  // requests, outputs, row ids, the sampler's workspace, gathered rows; sample_host_: the first three.
  Status SampleOnDevice(std::span<const Segment> segs, int64_t V, cu::Stream s);
  Status CollectSamples(std::span<const Segment> segs, ForwardOutput* out) const;
  int64_t sample_generation_ = 0;  // sample_dev_ is never captured: its moves matter to no graph
  Scratch sample_dev_{cu::DeviceBuffer(), &sample_generation_};
  cu::PinnedBuffer sample_host_;
  cu::PinnedBuffer flag_host_;  // the kernels' error flag, read back each step (pinned: an async copy)
  std::vector<size_t> sampled_;  // the step's sampled segments

  // The step's rows: segment s from row0_[s].
  std::vector<int64_t> row0_;
};

}  // namespace lockstep::engine::cuda_impl
