// engine/model.h — a loaded DeepSeek-family model and its forward pass on the CPU (fp32).
//
// Model = ModelConfig + ModelWeights + RoPE tables. Forward() runs one step of the engine:
// a list of segments, each a run of consecutive tokens of one request (a whole prompt in
// prefill, one token in decode, or a chunk), over that request's paged latent cache. Every
// per-token computation reads only that token's row and its own request's cache, so a
// request's numbers are the same whatever it is batched with.
//
// The weights are held as the checkpoint stores them (engine/weights.h: views of the mapped
// file), and every product dequantises the rows it multiplies (cpu::MatMulNT over a
// WeightView) — gemm=bf16 rounding them there — so a model costs its checkpoint's bytes.
//
// Thread-safety: a Model is immutable after Load except for the RoPE table, which Forward
// extends, and the FP8 quantisation of a non-FP8 checkpoint (gemm=fp8_dot), which Forward
// makes on first use. Both are guarded (lazy_mu_; rope_mu_ guards the pointer to immutable RoPE
// snapshots, so no pass waits for another), so Forward may run on several
// threads at once, each with its own PagedKvCache (a server's scheduler and its capture worker
// share one Model).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/config.h"
#include "engine/kv_cache.h"
#include "engine/safetensors.h"
#include "engine/sampler.h"
#include "engine/tap.h"
#include "engine/weights.h"
#include "kernels/plan.h"
#include "kernels/registry.h"

namespace lockstep::engine {

struct Segment {
  int64_t request_id = 0;
  SeqCache* cache = nullptr;      // must hold exactly start_pos tokens on entry
  std::span<const int32_t> tokens;
  int64_t start_pos = 0;
  bool all_logits = false;        // logits for every row, not only the last
  // Prompt tokens (a whole prompt or a chunk of one): attention takes the prefill variant even
  // for a one-token chunk, so a token's numbers do not depend on where chunks were cut.
  bool prefill = false;
  // Sample the segment's last logits row with these parameters (`sample_step`: the index of the
  // token being generated, Sampler::Sample's `step`). A backend that samples on the device puts
  // the result in ForwardOutput::samples; otherwise the engine samples on the host.
  const SamplingParams* sampling = nullptr;
  uint64_t sample_step = 0;
  // Whether the caller reads the segment's logits rows (ForwardOutput::logits). A device
  // backend that sampled the segment on the device copies nothing back for it when false (its
  // ForwardOutput::logits entry is then empty); with a tap hook every row is copied anyway.
  bool want_logits = true;
};

// A step's segments checked (each continues its request's cache, none empty, every token in
// the vocabulary) and laid out as rows: segment s owns rows [row0[s], row0[s] + tokens).
struct SegmentLayout {
  std::vector<int64_t> row0;
  int64_t rows = 0;
  int64_t max_end = 0;  // the largest start_pos + tokens
};
Result<SegmentLayout> LayOutSegments(std::span<const Segment> segs, const ModelConfig& c);

struct ForwardOutput {
  // Per segment: its logits rows ([rows, vocab], rows = tokens or 1); empty for a segment
  // whose logits nobody asked for (Segment::want_logits) and the device sampled.
  std::vector<std::vector<float>> logits;
  // Per segment, when the backend sampled it on the device (Segment::sampling): the result
  // Sampler::Sample gives for the same row and parameters. Empty when it samples nothing.
  std::vector<std::optional<SampleResult>> samples;
};

// MoE routing of one token from its router logits [n_routed_experts] (fp32, cpu::Dot of the
// normalised hidden state with each router row): the config's gate (softmax greedy, V2's
// group-limited greedy, V3's sigmoid noaux_tc with `bias` = e_score_correction_bias, null
// otherwise), ties to the lower expert id; writes num_experts_per_tok ids ascending and their
// weights (normalised when norm_topk_prob, × routed_scaling_factor). The CUDA Route kernel's twin.
void RouteExperts(const ModelConfig& c, const float* bias, const float* logits, int32_t* ids, float* weights);

// The step's logits, the CPU forward passes' last step: per segment its last row (every row
// with all_logits) of the final hidden states h [rows, hidden] through head(x, n, dst) (x
// [n, hidden] → dst [n, vocab]) into out->logits, each segment's emitted as tap "logits".
template <typename Head>
void SegmentLogits(std::span<const Segment> segs, std::span<const int64_t> row0, const float* h, int64_t hidden,
                   int64_t vocab, TapHook* hook, Head&& head, ForwardOutput* out) {
  out->logits.assign(segs.size(), {});
  for (size_t s = 0; s < segs.size(); ++s) {
    const int64_t n = static_cast<int64_t>(segs[s].tokens.size());
    const int64_t first = segs[s].all_logits ? 0 : n - 1, rows = n - first;
    auto& lg = out->logits[s];
    lg.resize(rows * vocab);
    head(h + (row0[s] + first) * hidden, rows, lg.data());
    if (hook != nullptr) {
      TapEvent e;
      e.name = kModelTaps[kTapLogits].name;
      e.request_id = segs[s].request_id;
      e.position = segs[s].start_pos + first;
      e.rows = rows;
      e.cols = vocab;
      e.data = lg.data();
      hook->OnTap(e);
    }
  }
}

class Model {
 public:
  static Result<std::shared_ptr<Model>> Load(const std::filesystem::path& dir);
  static Result<std::shared_ptr<Model>> FromParts(ModelConfig config, ModelWeights weights);
  // The config of `dir` with weights the device backend generates from `seed` (benchmarks of
  // published shapes without their checkpoints: `--random-weights`). Only `--backend cuda` runs it.
  static Result<std::shared_ptr<Model>> RandomWeights(const std::filesystem::path& dir, uint64_t seed);
  bool random_weights() const { return weights_.random_seed.has_value(); }

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }

  // Runs the segments through the model, appending their tokens to their caches. `kernels`
  // must come from kernels::Registry::Resolve. `hook` may be null.
  Status Forward(std::span<Segment> segments, PagedKvCache& cache, const kernels::KernelPlan& plan,
                 TapHook* hook, ForwardOutput* out);

  // Tap name of a per-layer tap point: "layers.<layer>.<suffix>".
  const std::string& tap_name(int64_t layer, TapId tap) const { return tap_names_[layer][tap]; }
  // Copies of the RoPE tables for positions [0, positions): cos and sin, [positions, qk_rope/2]
  // each, the attention factor applied (what every backend rotates with). Thread-safe.
  void RopeTable(int64_t positions, std::vector<float>* cos, std::vector<float>* sin);

  // gemm=fp8_dot's weights (made on first use, kept; thread-safe): every product matrix as
  // FP8 e4m3 with 128 × 128 block scales (Matrix::fp8, which `data` reads). An FP8
  // checkpoint's matrices keep their own bytes and scales, and its other matrices stay as they
  // are (these are then the loaded weights themselves); any other checkpoint's product
  // matrices — the ones gemm=bf16 rounds — are quantised here (Fp8Blocks::Quantize: 1 byte a
  // parameter held in memory, the other matrices shared with weights()).
  const ModelWeights& Fp8Weights();
  // gemm=mxfp4_dot / nvfp4_dot's weights (DeepSeek-V4; made on first use, kept; thread-safe):
  // the routed experts in `format` (kMxfp4 / kNvfp4) — the checkpoint's own where it stores
  // them so, else quantised here (kernels/fp4.h QuantizeMxfp4 / QuantizeNvfp4: the bytes
  // tools/fixtures/fp4_formats.py writes) — every other matrix shared with weights().
  const ModelWeights& Fp4Weights(kernels::WeightDType format);

  // Parameter counts: total, and active per token (routed experts counted num_experts_per_tok times).
  int64_t ParameterCount() const;
  int64_t ActiveParameterCount() const;

 private:
  Model(ModelConfig c, ModelWeights w);
  // The RoPE tables for at least `positions` positions: the current snapshot, or a longer one
  // made now (the tables double). A snapshot never changes: a pass holds its own, so no pass
  // waits for another's — ranks of one model in one process meet in collectives mid-pass.
  struct RopeTables {
    std::vector<float> cos, sin;  // [positions, qk_rope/2]
  };
  std::shared_ptr<const RopeTables> Rope(int64_t positions);
  std::unique_ptr<ModelWeights> fp8_weights_;  // made once under lazy_mu_, then read-only (unset for an FP8 checkpoint)
  std::unique_ptr<ModelWeights> mxfp4_weights_, nvfp4_weights_;  // the same, for Fp4Weights
  std::mutex lazy_mu_;
  std::mutex rope_mu_;  // guards rope_ (the pointer; the tables it points to are immutable)
  ModelConfig config_;
  ModelWeights weights_;
  std::shared_ptr<const RopeTables> rope_;
  std::vector<float> inv_freq_;
  std::vector<std::vector<std::string>> tap_names_;  // [layer][TapId]
};

}  // namespace lockstep::engine
