// engine/tap.h — the tap hook: how the recorder (and tests) see intermediate tensors.
//
// The engine calls TapHook::OnTap at every stable tap point (docs/tap-points.md lists them)
// with the rows one request contributed to a forward pass. With no hook attached the engine
// builds no names and copies nothing: the cost is one pointer test per tap point.
// The data pointer is valid only during the call — copy what you keep — unless the event
// carries an owner (TapEvent::owner).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

namespace lockstep::engine {

// kBf16, kFp8E4m3 and kU8 (MODEL1's ue8m0 scale bytes) only for the KV cache's parts
// (engine/kv_cache.h KvPart), which come as kv/ events (TapHook::WantsKvTaps); every tap point
// is fp32 or int32.
enum class TapDType { kF32, kI32, kBf16, kFp8E4m3, kU8 };

// ---- The tap table: the one list of tap points ----------------------------------------
// Every tap's name, dtype, width, place in causal order and meaning. The CPU forward and the
// CUDA backend emit these names (Model::tap_name), the recorder stores them as trace paths,
// diff orders rows by `order` (diff::TapRank), `lockstep taps` prints the table, and
// docs/tap-points.md's table is `lockstep taps --markdown` (tests/cli/taps_doc_test.sh fails
// when they disagree). Widths use the doc's symbols: H = hidden_size, nh = heads, dn/dr/dv =
// qk_nope/qk_rope/v head dims, C = kv_lora_rank, k = experts per token, K = index_topk,
// V = vocab_size; DeepSeek-V4: d = head_dim, hc = hc_mult, di = index_head_dim; tp = the emulated
// tensor-parallel degree.

// The per-layer tap points, in the order a layer computes them; a tap's name is
// "layers.<L>.<name>". Every backend emits the same names with the same shapes.
enum TapId {
  kTapAttnNorm, kTapQ, kTapLatent, kTapKRope, kTapIndexerTopk, kTapHeads, kTapAttnOut, kTapResidMid,
  kTapFfnNorm, kTapTopkIds, kTapTopkWeights, kTapFfnOut, kTapResidOut,
  // DeepSeek-V4 (engine/v4_model.cc), which also emits attn_norm, attn.q, attn.heads, attn.out,
  // ffn_norm, ffn.router.* and ffn.out above.
  kTapV4AttnHcMix, kTapV4Kv, kTapV4CompressorEntry, kTapV4IndexerKey, kTapV4IndexerTopk, kTapV4SinkShare,
  kTapV4StreamsMid, kTapV4FfnHcMix, kTapV4Streams,
  // Tensor parallelism (engine/tensor_parallel.h), emulated or over ranks: the ranks' partials before each all-reduce.
  kTapAttnPartials, kTapFfnPartials,
  kTapCount
};

struct TapPoint {
  std::string_view name;     // per layer: the part after "layers.<L>."; else the whole name
  bool per_layer;
  TapDType dtype;
  int order;                 // causal place within its layer (per-layer taps), or among the model's
  std::string_view cols;     // width, in the symbols above
  std::string_view meaning;  // one line, as docs/tap-points.md says it
};

// Where the KV cache's rows (kv/layers.L.*, written by the cache, not a tap) fall among a
// layer's taps: right after attn.k_rope, before anything reads them.
inline constexpr int kKvCacheOrder = 8;

inline constexpr TapPoint kLayerTaps[kTapCount] = {
    {"attn_norm", true, TapDType::kF32, 0, "H", "RMSNorm(x): the attention input"},
    {"attn.q", true, TapDType::kF32, 2, "nh·(dn+dr); V4 nh·d",
     "queries per head `[nope | rope]`, RoPE applied (V4: each head RMS-rescaled, RoPE on its last dr)"},
    {"attn.latent", true, TapDType::kF32, 4, "C",
     "`kv_a_layernorm(c_kv)` as computed (before the cache's quantisation)"},
    {"attn.k_rope", true, TapDType::kF32, 6, "dr", "the shared RoPE key, RoPE applied"},
    {"indexer.topk", true, TapDType::kI32, 10, "K",
     "V3.2: positions the indexer selected for each query, ascending, padded with −1"},
    {"attn.heads", true, TapDType::kF32, 12, "nh·dv; V4 nh·d",
     "per-head attention outputs, before `o_proj` (V4: after the inverse RoPE, before the grouped `o_a_proj`)"},
    {"attn.out", true, TapDType::kF32, 14, "H", "`o_proj(heads)`: the attention block's output"},
    {"resid_mid", true, TapDType::kF32, 16, "H", "x + attention: the residual stream between the blocks"},
    {"ffn_norm", true, TapDType::kF32, 18, "H", "RMSNorm(resid_mid): the FFN input"},
    {"ffn.router.topk_ids", true, TapDType::kI32, 20, "k", "MoE layers: the chosen experts, ascending id"},
    {"ffn.router.topk_weights", true, TapDType::kF32, 22, "k",
     "MoE layers: their weights (after normalisation and scaling)"},
    {"ffn.out", true, TapDType::kF32, 24, "H",
     "the FFN block's output (routed + shared experts, or the dense MLP)"},
    {"resid_out", true, TapDType::kF32, 26, "H", "the layer's output, the next layer's input"},
    {"attn_hc.mix", true, TapDType::kF32, 0, "(2+hc)·hc",
     "V4: the attention hyper-connection's weights `[pre | post | C]` (C row-major after Sinkhorn)"},
    {"attn.kv", true, TapDType::kF32, 4, "d", "V4: the shared K = V row, normed and RoPE'd (the window stream's row)"},
    {"attn.compressor.entry", true, TapDType::kF32, 8, "d",
     "V4 CSA/HCA: the compressed row a window emits, at the position that closes it (no row elsewhere)"},
    {"attn.indexer.key", true, TapDType::kF32, 8, "di",
     "V4 CSA: the indexer's compressed key a window emits, at the position that closes it"},
    {"attn.indexer_topk", true, TapDType::kI32, 10, "K",
     "V4 CSA: the compressed rows the indexer picked for each query, ascending, padded with −1"},
    {"attn.sink_share", true, TapDType::kF32, 12, "nh", "V4: per head, the softmax weight the sink took"},
    {"hc.streams_mid", true, TapDType::kF32, 16, "hc·H", "V4: the hc residual streams between the blocks"},
    {"ffn_hc.mix", true, TapDType::kF32, 18, "(2+hc)·hc", "V4: the FFN hyper-connection's weights `[pre | post | C]`"},
    {"hc.streams", true, TapDType::kF32, 26, "hc·H",
     "V4: the layer's output streams (routing: ffn.router.topk_ids carries hash layers' tid2eid picks)"},
    {"attn.partials", true, TapDType::kF32, 13, "tp·H",
     "TP (--emulate-tp, --tp-ranks): each rank's o_proj output over its heads, `[rank 0 | rank 1 | …]`, before the all-reduce"},
    {"ffn.partials", true, TapDType::kF32, 23, "tp·H",
     "TP: each rank's FFN output (its slice of the MLP or shared experts, its block of routed experts), before the all-reduce"},
};

// The model-level taps: before the first layer (order 0) and after the last (1, 2).
enum ModelTapId { kTapEmbed, kTapFinalNorm, kTapLogits, kModelTapCount };
inline constexpr TapPoint kModelTaps[kModelTapCount] = {
    {"embed", false, TapDType::kF32, 0, "H", "token embeddings, the input of layer 0"},
    {"final_norm", false, TapDType::kF32, 1, "H", "the final RMSNorm"},
    {"logits", false, TapDType::kF32, 2, "V",
     "logits of the rows that need them: the last position of each step (all prompt positions when a "
     "request asks for them)"},
};

// The tap point a name denotes ("layers.3.attn.q", "embed", "logits"), or null; *layer is set to
// its layer (−1 for model taps).
inline const TapPoint* FindTapPoint(std::string_view name, int64_t* layer = nullptr) {
  if (layer) *layer = -1;
  for (const TapPoint& t : kModelTaps) {
    if (name == t.name) return &t;
  }
  constexpr std::string_view kPrefix = "layers.";
  if (name.substr(0, kPrefix.size()) != kPrefix) return nullptr;
  const size_t dot = name.find('.', kPrefix.size());
  if (dot == std::string_view::npos || dot == kPrefix.size()) return nullptr;
  int64_t l = 0;
  for (size_t i = kPrefix.size(); i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9' || l > (int64_t{1} << 40)) return nullptr;
    l = l * 10 + (name[i] - '0');
  }
  const std::string_view suffix = name.substr(dot + 1);
  for (const TapPoint& t : kLayerTaps) {
    if (suffix == t.name) {
      if (layer) *layer = l;
      return &t;
    }
  }
  return nullptr;
}

// A row's trace summary computed by the backend where the tensor lives: traces::SummaryRow's
// hash and statistics, the same bits (kernels/row_stats.h and kernels/xxh3.h define them).
struct TapRowSummary {
  uint64_t hash = 0;  // XXH3-64 (seed 0) of the row's bytes
  uint32_t nan_count = 0, inf_count = 0;
  float rms = 0, absmax = 0, min = 0, max = 0;
};

struct TapEvent {
  std::string_view name;    // "layers.3.attn.out"
  int64_t request_id = 0;   // the engine's request id
  int64_t position = 0;     // sequence position of the first row
  int64_t rows = 0;         // consecutive positions
  int64_t cols = 0;         // values per row
  TapDType dtype = TapDType::kF32;
  const void* data = nullptr;  // rows × cols, row-major, contiguous; null when only summaries came
  // [rows] when the backend summarised the rows itself: alone (summary capture), or beside
  // `data` (the CUDA backend's full capture: the hook need not summarise the values again).
  const TapRowSummary* summaries = nullptr;
  // When set, `data` stays valid and unchanged for as long as any copy of `owner` is held: a
  // hook may keep both past the call instead of copying the rows (the CUDA backend's logits,
  // which the recorder's writer thread then summarises where they are, and its full capture's
  // taps, which the writer compresses where they are). The backend lends a bounded number of
  // such buffers and waits for one to come back when all are held: drop owners soon.
  std::shared_ptr<const void> owner;
};

inline int64_t TapDTypeSize(TapDType t) {
  return t == TapDType::kBf16 ? 2 : t == TapDType::kFp8E4m3 || t == TapDType::kU8 ? 1 : 4;
}

// One request's rows of a forward pass, for TapHook::OnStepTaps: its events' rows are the
// segments' rows back to back, in this order.
struct TapSegment {
  int64_t request_id = 0;
  int64_t position = 0;  // of its first row
  int64_t rows = 0;
};

// A step event's rows of one segment (rows row0 … of `e`), as an event of its own.
inline TapEvent SegmentEvent(const TapEvent& e, const TapSegment& s, int64_t row0) {
  TapEvent one = e;
  one.request_id = s.request_id;
  one.position = s.position;
  one.rows = s.rows;
  if (e.data != nullptr) one.data = static_cast<const char*>(e.data) + row0 * e.cols * TapDTypeSize(e.dtype);
  if (e.summaries != nullptr) one.summaries = e.summaries + row0;
  return one;
}

class TapHook {
 public:
  virtual ~TapHook() = default;
  // Called on the engine thread, in causal order per request (layer by layer within a step).
  virtual void OnTap(const TapEvent& event) = 0;
  // Backend-summarised taps at once (each event with `summaries` and no data), in the order
  // OnTap would have seen them: what OnStepTaps' default makes of a run of summary-only step
  // events. The same as OnTap for each event — the default does exactly that — so a hook
  // overrides it only to take them faster (the recorder: one append).
  // These events' names lie in storage that lives as long as the engine: a hook may
  // recognise a name by its address and length (OnTap's may be built on the fly).
  virtual void OnTapSummaries(std::span<const TapEvent> events) {
    for (const TapEvent& e : events) OnTap(e);
  }

  // A step's taps at once, each event covering every segment's rows back to back (`rows` =
  // the segments' sum; its request_id and position are unused): the CUDA backend's hand-over,
  // one event a tapped tensor rather than one a tensor and request. The default passes each
  // event on as one per segment, in order — the summary-only ones gathered into
  // OnTapSummaries calls, the rest through OnTap — so a hook overrides it only to take a
  // step's rows together (the recorder: one append a tensor). Names as OnTapSummaries'.
  virtual void OnStepTaps(std::span<const TapEvent> events, std::span<const TapSegment> segments);

  // Grafting (replay --graft): called right after OnTap at the points whose values feed the
  // next layer (`embed`, `layers.L.resid_out`). A hook that returns true has overwritten
  // `data` (rows × cols, the event's layout) and the engine continues from those values, so
  // each layer's own error can be measured apart from the error it inherits.
  virtual bool Override(const TapEvent& event, void* data) { return false; }
  // Whether Override may be called at all (lets the engine skip the calls when not grafting).
  virtual bool WantsOverride() const { return false; }
  // False: the hook reads only each row's summary. A backend that can summarise where a
  // tensor lives (the CUDA backend) then passes `summaries` and data = nullptr instead of
  // copying the values out; others pass the values as always. Asked once per step.
  virtual bool WantsTapValues() const { return true; }
  // True: the hook also takes the KV cache rows each forward pass stores as tap events named
  // "kv/layers.<L>.<stream><part suffix>" (PagedKvCache::parts: one event per part, its dtype
  // the part's), after the step's taps — summaries only when WantsTapValues is false, else the
  // stored bytes with their summaries. A backend that can do so where it stores them (the CUDA
  // backend: summaries in every step, values in its decode steps) sends them and then need not
  // copy the rows back for Engine::SetForwardCallback: the host cache does not hold that
  // step's rows. Other backends, and other steps, send none; the hook reads the cache then. A
  // hook tells the two apart by whether such events came in the step. Asked once per step.
  virtual bool WantsKvTaps() const { return false; }
};

}  // namespace lockstep::engine
