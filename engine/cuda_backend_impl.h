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
#include "engine/lending_pool.h"
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
};

// Every weight of a model on the device. Immutable once made, so engines over the same Model
// and GEMM precision share one copy (a server's live engine and its capture re-runs).
struct DeviceWeights {
  DevTensor embed, final_norm, lm_head;
  std::vector<DevLayer> layers;
};

// A grow-only device scratch buffer. Every move bumps its backend's generation counter:
// captured CUDA graphs hold the old address and must be captured again.
struct Scratch {
  cu::DeviceBuffer buf;
  int64_t* generation = nullptr;  // the owning backend's
  Status Ensure(size_t bytes) {
    if (buf.size() >= bytes) return Status::Ok();
    const size_t grown = std::max(bytes, buf.size() * 3 / 2);
    buf = cu::DeviceBuffer();  // free first: the pool may be nearly full
    LS_ASSIGN_OR_RETURN(buf, cu::DeviceBuffer::Allocate(grown));
    ++*generation;
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
inline cu::LatentFormat ToLatentFormat(KvFormat f) { return static_cast<cu::LatentFormat>(f); }
inline cu::RopeStyle ToRopeStyle(RopeStyle s) { return static_cast<cu::RopeStyle>(s); }
inline cu::GateKind ToGateKind(GateKind g) { return static_cast<cu::GateKind>(g); }

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
  int64_t tap_wait_ns() const override { return tap_wait_retired_ns_ + (tap_lend_ ? tap_lend_->waited_ns() : 0); }

  static Result<std::unique_ptr<Backend>> Create(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                 const kernels::KernelPlan& plan, const BackendOptions& options);

  Status Forward(std::span<Segment> segs, PagedKvCache& cache, const kernels::KernelPlan& plan, TapHook* hook,
                 ForwardOutput* out) override;

 private:
  CudaBackend() {
    for (Scratch* sc : {&dev_in_, &act_, &xb_, &xb_side_, &zero_ids_, &mla_ws_, &scores_, &iq8_, &logits_dev_, &gather_,
                        &tap_arena_, &mirror_dev_, &slab_buf_}) {
      sc->generation = &alloc_generation_;
    }
  }
  int64_t alloc_generation_ = 0;  // see Scratch
  Status UploadWeights(DeviceWeights* w);
  Status RandomWeights(uint64_t seed, DeviceWeights* w);
  // The shared device weights of (model_, weight precision): made now, or taken from a live engine.
  Status AcquireWeights();
  Status AllocateCache(const PagedKvCache& cache);

  // The dot GEMM's (gemm=*_dot) parameters of Linear: w as one expert, fixed ids.
  Result<kernels::cuda::ExpertGemmParams> DotParams(const float* x, int64_t x_stride, int64_t rows, const DevTensor& w,
                                                    float* y, int64_t y_stride);
  // y[rows, out] = x[rows, w.rows] · wᵀ through the chosen GEMM; bf16 weights take x rounded to bf16.
  Status Linear(const float* x, int64_t x_stride, int64_t rows, const DevTensor& w, float* y, int64_t y_stride);
  Status SwiGluMlp(const DevTensor& gate_up, const DevTensor& down, int64_t inter, const float* x, int64_t rows,
                   float* y);

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
  // Runs fn's launches on the side stream after what st.main_stream has queued; join_ marks their end.
  Status OnSide(CudaStep& st, const std::function<Status()>& fn);

  // Taps: tensors are copied on the device into an arena and handed to the hook together
  // (one device→host copy, one synchronisation) at the end of the step, or earlier when the
  // arena fills or an Override needs the values now.
  static constexpr size_t kNoSummaries = ~size_t{0};
  struct PendingTap {
    // The model's tap name (or a literal): stable for the model's life, so the hook can key
    // on its address (the recorder does) and a replayed step's list costs no allocations.
    std::string_view name;
    size_t offset = 0;
    bool summary = false;  // the arena holds rows_ TapRowSummary at offset, not the values
    int64_t cols = 0;
    int64_t stride = 0;    // values: row stride in elements (the slab keeps a tensor's layout)
    TapDType dtype = TapDType::kF32;
    // Values with summaries (full capture from the slab): the rows' TapRowSummary in the
    // arena at sum_offset; kNoSummaries when none were made.
    size_t sum_offset = kNoSummaries;
    // A summary-only tensor outside the slab in a slab step (the KV rows in mirror_dev_):
    // where SummarizeSlab reads it, `stride` elements of `dtype` apart.
    const void* dev = nullptr;
  };
  Status Tap(std::string_view name, const void* dev, int64_t cols, int64_t stride, TapDType dtype);
  Status FlushTaps();
  // TapHook::WantsKvTaps: the step's new cache rows in the mirror at `mirror` (mirror_off:
  // where each layer's streams lie, in PagedKvCache order) as taps named kv/layers.L.…, one per
  // part (PagedKvCache::parts), after the step's own taps: summaries (summary capture), or
  // values with summaries from the slab (full capture, the mirror inside the slab).
  Status TapKvRows(const PagedKvCache& cache, const uint8_t* mirror, std::span<const size_t> mirror_off);
  bool kv_events_ = false;  // this step's KV rows go to the hook as kv/ taps, not to the host cache
  struct KvTap {
    size_t mirror;        // the layer's stream's index in mirror_off
    int64_t token_bytes;  // the stream's
    KvPart part;
    std::string name;  // stable: made once (the hook keys on the address)
  };
  std::vector<KvTap> kv_taps_;
  // Points logits_host_ at a buffer of ≥ bytes nobody else holds (see logits_shared_); a shared
  // one (with its owner) when `share`.
  Status TakeLogitsBuffer(size_t bytes, bool share);
  // Summary-only taps (the hook does not want values): Tap queues the tensor and SummaryFence
  // summarises the queue in one launch. The step calls it before a tapped buffer is written
  // again (after embed, resid_mid, resid_out and final_norm); FlushTaps calls it too.
  Status SummaryFence();
  bool summary_taps_ = false;
  cu::SummarizeBatchParams summary_batch_;
  // The tap slab (cuda_forward.cc): decode steps of up to kSlabMaxRows rows with a tap hook.
  // SummarizeSlab summarises every pending tap in one launch; its descriptor table is uploaded
  // per batch size when a step runs uncaptured and must be unchanged when it is captured.
  // (V2-Lite: 2 MB per row; a step whose slab would pass 1 GiB — large models at large batches —
  // takes the per-tap path instead.)
  static constexpr int64_t kSlabMaxRows = 256;
  static constexpr size_t kSlabMaxBytes = size_t{1} << 30;
  bool slab_ = false;
  size_t slab_bytes_ = 0;
  Status SummarizeSlab();
  struct SlabTable {
    std::vector<cu::SummarizeBatchParams::Tensor> host;
    cu::DeviceBuffer dev;
  };
  std::map<int64_t, SlabTable> slab_tables_;  // by rows
  std::vector<std::vector<uint32_t>> tap_rows_;  // FlushTaps: each strided tap's rows, contiguous
  std::vector<TapEvent> step_events_;            // FlushTaps: the step's, for TapHook::OnStepTaps
  std::vector<TapSegment> step_segments_;
  // Full capture from the slab: each step's values and summaries go to the host in a pinned
  // buffer lent to the hook (TapEvent::owner), so the recorder's writer compresses the rows
  // where they landed instead of the engine thread copying them. TapLendBuffers(step) of them
  // (engine/lending_pool.h), allocated as steps find all others lent; then a step waits for
  // one to come back (tap_wait_ns), and after kTapLendPatience hands its rows over unlent from
  // tap_host_. The pool is remade when a step needs far less than its buffers would hold.
  static constexpr std::chrono::seconds kTapLendPatience{5};
  std::unique_ptr<LendingPool> tap_lend_;
  size_t tap_lend_max_ = 0;
  int64_t tap_wait_retired_ns_ = 0;  // waits of pools replaced since
  // BackendOptions::profile: GPU time per phase, printed when the backend is destroyed.
  Status Mark(const char* name) { return prof_ ? prof_->Mark(name, stream_->get()) : Status::Ok(); }
  std::unique_ptr<cu::EventTimer> prof_;
  std::map<std::string, double> prof_ms_[2];  // [0] decode-only steps, [1] steps with prompt rows
  int64_t prof_steps_[2] = {0, 0};
  int64_t graph_launches_ = 0;
  // Offers x (the values feeding the next layer) to the hook for overwriting (replay --graft).
  Status OverrideRows(std::string_view name, float* dev_x, int64_t cols);

  std::shared_ptr<Model> model_;
  std::string device_;
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
  Scratch slab_buf_;
  Scratch dev_in_, act_, xb_, xb_side_, zero_ids_, mla_ws_, scores_, logits_dev_, gather_, tap_arena_, mirror_dev_;
  Scratch iq8_;  // indexer=fp8_paged: the indexer's queries as FP8 rows
  cu::PinnedBuffer tap_host_, mirror_host_;
  // The step's logits on the host. A tap hook may keep a buffer past the step
  // (TapEvent::owner: the recorder's writer thread summarises it in place), so the step takes
  // one nobody else holds: up to kLogitsShared shared ones, then a private one handed out
  // without an owner (the hook then copies).
  static constexpr size_t kLogitsShared = 4;
  std::vector<std::shared_ptr<cu::PinnedBuffer>> logits_shared_;
  cu::PinnedBuffer logits_private_;
  cu::PinnedBuffer* logits_host_ = nullptr;
  std::shared_ptr<const void> logits_owner_;  // logits_host_'s, when shared
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
  bool capturing_ = false;

  // Per-step state used by the tap helpers.
  TapHook* hook_ = nullptr;
  std::span<Segment> segs_;
  std::vector<int64_t> row0_;
  int64_t rows_ = 0;
  std::vector<PendingTap> pending_;
  size_t tap_used_ = 0;
};

}  // namespace lockstep::engine::cuda_impl
