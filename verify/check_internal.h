// verify/check_internal.h — what the checks of each model family share (verify/check.cc: the
// MLA families and the model-level ops; verify/check_v4.cc: DeepSeek-V4's blocks): the twin
// table, the trace's tensors read whole, per-op statistics and the comparison of a recorded row
// with its twin. Internal to verify/.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "engine/model.h"
#include "verify/check.h"
#include "verify/file_config.h"
#include "verify/golden.h"

namespace lockstep::verify::internal {
namespace g = golden;
using engine::Matrix;

// ---- The twin table: one entry per op, in the causal order of a block. A new block kind adds its
// ops here (with the family that has them) and the code that feeds them (check.cc, check_v4.cc).
// Which model family has the op: both, the MLA families (V2, V3, V3.2), or DeepSeek-V4.
enum Family { kAny, kMla, kV4 };
struct OpSpec {
  const char* op;
  const char* kernel_op;  // registry op of its variant ("" = none)
  int layer_order;        // its place among the layer's taps (engine/tap.h orders)
  const char* what;
  Family family = kAny;
};
inline constexpr OpSpec kOps[] = {
    {"embed", "", -1, "embedding row of the token, as stored"},
    {"attn_hc", "", 0, "V4: the attention hyper-connection's [pre | post | C] from the layer's input streams (sigmoids, softmax and Sinkhorn in fp64)", kV4},
    {"attn_norm", "norm", 0, "RMSNorm(layer input) in fp64 (V4: of Σ pre_j·stream_j, the recorded mix)"},
    {"q_proj", "gemm", 1, "q_b(RMSNorm(q_a(attn_norm))) (or q_proj), nope dims, from attn_norm (V4: each head RMS-rescaled)"},
    {"rope_q", "rope", 1, "q's rope dims: the q path then RoPE at the row's position (config's YaRN)"},
    {"kv_a", "gemm", 2, "latent = RMSNorm(kv_a(attn_norm)[:C]) from attn_norm", kMla},
    {"kv_proj", "gemm", 2, "V4: the K = V row RMSNorm(kv_proj(attn_norm)), RoPE on its trailing dims", kV4},
    {"rope_k", "rope", 3, "k_rope = RoPE(kv_a(attn_norm)[C:]) at the row's position", kMla},
    {"kv_cache", "kv_quant", 4, "stored latent row = the format's encoding of the recorded latent and k_rope (independent encoder, bit-exact; V4: the window and compressed rows of attn.kv and attn.compressor.entry)"},
    {"compressor", "compressor", 4, "V4: the compressed row, gated pooling of the window's recorded [kv | gate] rows with the position bias, RMSNorm, RoPE", kV4},
    {"indexer_key", "indexer", 4, "stored index key = RoPE(LayerNorm(wk·attn_norm)) (V3.2)"},
    {"indexer", "indexer", 5, "top-k set of Σ_h w_h·ReLU(q_h·k_t/√d) over the request's own earlier attn_norm rows (V3.2)"},
    {"attention", "attn_prefill", 6, "softmax(q·k/√d)·v over the request's OWN recorded latent/k_rope rows (encoded as the KV format stores them), sparse: the recorded selection (V4: the window's recorded rows and the compressed rows, with the sink)"},
    {"o_proj", "gemm", 7, "o_proj(attn.heads) (V4: the grouped o_a, then o_b)"},
    {"allreduce", "allreduce", 7, "emulated TP (--emulate-tp): attn.out and ffn.out = the recorded attn.partials / ffn.partials summed over the ranks in rank order, bit-exact (allreduce=ring: within the sum's fp32 bound)", kMla},
    {"resid_mid", "", 8, "layer input + attn.out", kMla},
    {"attn_hc_post", "", 8, "V4: the streams after attention, post_k·attn.out + Σ_j C_jk·stream_j (recorded mix)", kV4},
    {"ffn_hc", "", 9, "V4: the FFN hyper-connection's [pre | post | C] from hc.streams_mid", kV4},
    {"ffn_norm", "norm", 9, "RMSNorm(resid_mid) (V4: of Σ pre_j·streams_mid_j)"},
    {"router", "", 10, "gate scores, correction bias, group-limited top-k, normalisation and scaling from ffn_norm (V4: sqrt-softplus, hash layers' tid2eid)"},
    {"experts", "gemm", 12, "Σ_j w_j·expert_j(ffn_norm) + shared(ffn_norm) on the recorded choice, or the dense MLP (V4: clamped SwiGLU)"},
    {"resid_out", "", 13, "resid_mid + ffn.out", kMla},
    {"ffn_hc_post", "", 13, "V4: the layer's output streams, post_k·ffn.out + Σ_j C_jk·streams_mid_j", kV4},
    {"final_norm", "norm", 100, "RMSNorm(last resid_out) (V4: of hc_head(last hc.streams))"},
    {"lm_head", "gemm", 101, "lm_head(final_norm): every stored logit (full rows, or the stored top-k and that they are the top-k)"},
    {"sampler", "", 102, "the token redrawn from the recorded logits, sampling parameters and Philox counter"},
};
inline constexpr int kNumOps = sizeof(kOps) / sizeof(kOps[0]);
// Model-level ops after the last layer sort after every layer.
inline int64_t LayerRank(int op, int64_t layer) { return kOps[op].layer_order >= 100 ? int64_t{1} << 30 : layer; }
inline int OpIndex(std::string_view op) {
  for (int i = 0; i < kNumOps; ++i) {
    if (op == kOps[i].op) return i;
  }
  return -1;
}

// One tensor of the trace, read whole, rows found by (request, position).
struct Tensor {
  const traces::TensorInfo* info = nullptr;
  std::vector<uint8_t> raw;
  std::vector<traces::SummaryRow> rows;
  std::map<std::pair<int32_t, int64_t>, int64_t> at;
  int64_t row_bytes = 0;
  int64_t Row(int32_t req, int64_t pos) const {
    auto it = at.find({req, pos});
    return it == at.end() ? -1 : it->second;
  }
  const float* F(int64_t row) const { return reinterpret_cast<const float*>(raw.data() + row * row_bytes); }
  const int32_t* I(int64_t row) const { return reinterpret_cast<const int32_t*>(raw.data() + row * row_bytes); }
  const uint8_t* B(int64_t row) const { return raw.data() + row * row_bytes; }
};

// Per-op statistics as rows come in.
struct Stats {
  OpReport rep;
  std::tuple<int64_t, int64_t, int, int32_t, int64_t> first_key{INT64_MAX, 0, 0, 0, 0};
  double sa = 0, sa2 = 0, sb = 0, sb2 = 0;
  int64_t bias_rows = 0;
};

struct Ctx {
  const traces::TraceReader* trace = nullptr;
  FileConfig file;  // what config.json states, read by verify (file_config.h): the MLA twins use it
  std::shared_ptr<engine::Model> model;
  const engine::ModelConfig* c = nullptr;
  const engine::ModelWeights* W = nullptr;
  std::map<std::string, std::string> variants;
  std::string kv_format;
  g::Precision gemm, linear, fp32;
  std::vector<double> inv_freq;
  double af = 1;
  g::RopeLayout layout = g::RopeLayout::kPairsToHalves;
  std::map<std::string, std::unique_ptr<Tensor>> tensors;
  std::unordered_map<const void*, std::vector<float>> dense;
  std::vector<Stats> stats;
  std::map<int32_t, int64_t> prompt_len;
  int64_t tp = 1;  // the recording's emulated tensor-parallel degree (meta.engine_options.emulate_tp)

  const Tensor* T(const std::string& name) {
    auto it = tensors.find(name);
    if (it != tensors.end()) return it->second->info ? it->second.get() : nullptr;
    auto t = std::make_unique<Tensor>();
    const traces::TensorInfo* info = trace->FindTensor(name);
    if (info != nullptr && info->has_values && info->rows > 0) {
      auto s = trace->ReadSummary(*info);
      auto v = trace->ReadValues(*info, 0, info->rows);
      if (s.ok() && v.ok()) {
        t->info = info;
        t->rows = std::move(*s);
        t->raw = std::move(*v);
        t->row_bytes = static_cast<int64_t>(t->raw.size()) / info->rows;
        for (size_t i = 0; i < t->rows.size(); ++i) t->at[{t->rows[i].request, t->rows[i].position}] = static_cast<int64_t>(i);
      }
    }
    Tensor* p = t.get();
    tensors[name] = std::move(t);
    return p->info ? p : nullptr;
  }
  g::WeightRef Wt(const Matrix& m) {
    auto it = dense.find(&m);
    if (it == dense.end()) it = dense.emplace(&m, m.Dequantized()).first;
    return {it->second.data(), m.rows, m.cols};
  }
  std::string Variant(const std::string& op) const {
    auto it = variants.find(op);
    return it == variants.end() ? "" : it->second;
  }
};

inline std::string LayerTap(int64_t l, const char* name) { return "layers." + std::to_string(l) + "." + name; }

// One checked row of op `op` at `loc` into its statistics: `values` elements, the row's worst
// error/budget `ratio` (> 1: a defect) with the error and budget there. Returns ratio ≤ 1.
inline bool Tally(Ctx& cx, int op, Location loc, int64_t values, double ratio, double measured, double budget) {
  Stats& st = cx.stats[op];
  st.rep.rows += 1;
  st.rep.values += values;
  st.rep.prefill_rows += loc.prefill;
  loc.measured = measured;
  loc.budget = budget;
  if (ratio > st.rep.max_ratio || st.rep.rows == 1) {
    st.rep.max_ratio = ratio;
    st.rep.max_error = measured;
    st.rep.budget_at_max = budget;
    st.rep.worst = loc;
  }
  if (!(ratio > 1)) return true;
  ++st.rep.failing_rows;
  st.rep.failing_prefill_rows += loc.prefill;
  st.rep.failed = true;
  const auto key = std::make_tuple(loc.step, LayerRank(op, loc.layer), kOps[op].layer_order, loc.request, loc.position);
  if (key < st.first_key) {
    st.first_key = key;
    st.rep.first = loc;
  }
  return false;
}

// Compares a recorded row with its twin; returns whether it is within budget.
inline bool Compare(Ctx& cx, int op, const Location& where, const float* meas, const g::Vec& twin, int64_t off = 0,
             int64_t n = -1, bool bias = true) {
  Stats& st = cx.stats[op];
  if (n < 0) n = twin.size() - off;
  double worst = 0, wm = 0, wb = 0, sum_b = 0, sa = 0, sb = 0;
  int64_t wc = -1;
  for (int64_t i = off; i < off + n; ++i) {
    const double m = meas[i - off];
    const double v = twin.v[i];
    const double b = twin.e[i] + 1e-30;
    double err = std::fabs(m - v);
    if (std::isnan(m) != std::isnan(v) || (!std::isfinite(m) && m != v)) err = INFINITY;
    if (std::isnan(m) && std::isnan(v)) err = 0;
    const double r = err / b;
    if (r > worst || wc < 0) {
      worst = r;
      wm = err;
      wb = b;
      wc = i - off;
    }
    if (std::isfinite(err)) {
      sum_b += b;
      sa += (m - v) * (v < 0 ? -1 : 1);
      sb += m - v;
    }
  }
  if (bias && sum_b > 0) {
    const double a = sa / sum_b, b2 = sb / sum_b;
    st.sa += a;
    st.sa2 += a * a;
    st.sb += b2;
    st.sb2 += b2 * b2;
    ++st.bias_rows;
  }
  Location loc = where;
  loc.column = wc;
  return Tally(cx, op, loc, n, worst, wm, wb);
}

// A set-valued op's verdict on one row: `ratio` (> 1 defect) with what differs.
inline void CompareSet(Ctx& cx, int op, const Location& where, double ratio, double measured, double budget,
                       const std::string& detail) {
  Location loc = where;
  loc.detail = detail;
  Tally(cx, op, loc, 1, ratio, measured, budget);
}

inline g::Vec Row(const float* x, int64_t n) { return g::Exact(x, n); }

// Emulated TP's all-reduce on one row: `out` (H values) against the ranks' recorded partials
// ([tp][H]) summed in rank order, bit for bit — or, under allreduce=ring (whose order depends on
// the row's place in the batch), within the fp32 bound of a tp-term sum.
void CheckAllReduce(Ctx& cx, const Location& where, const float* out, const float* partials, int64_t H);
// What summing element i of the tp ranks' partials ([tp][H]) in fp32 may round by, in any order:
// tp·u·Σ_r |partial_r[i]|.
inline double AllReduceRounding(const float* partials, int64_t tp, int64_t H, int64_t i) {
  double mag = 0;
  for (int64_t r = 0; r < tp; ++r) mag += std::fabs(partials[r * H + i]);
  return static_cast<double>(tp) * golden::kFp32U * mag;
}

// Every tensor verify may read against the width and element type model `c` gives it (taps by
// the tap table at emulated TP `tp`, the cache's rows by its streams' parts, the top-k logits by
// the vocabulary): a mismatch is one error naming the file and the tensor (verify/check_shapes.cc).
Status CheckShapes(const traces::TraceReader& trace, const engine::ModelConfig& c, const std::string& kv_format,
                   bool fp8_index_keys, int64_t tp);

// A stored indexer key as the indexer reads it (V3.2's and V4's kv/….indexer_k): fp32 as stored,
// or FP8 (e4m3, .scales fp32 per 128 values) dequantised; `half_step` receives what the FP8
// rounding may move each value by (2^-4 relative, or 2^-10 of its scale; 0 for fp32). False
// when the row (or its scales) is not recorded.
bool StoredIndexKey(Ctx& cx, const std::string& base, int32_t req, int64_t pos, int64_t di, std::vector<double>* key,
                    std::vector<double>* half_step);

// The LM head's twin on one row (request `req` at `pos`, its final_norm row `rfin` of `t_fin`).
void CheckLmHead(Ctx& cx, int32_t req, int64_t pos, int64_t plen, const Tensor* t_fin, int64_t rfin);

// DeepSeek-V4's rows (verify/check_v4.cc): every op of every layer of every (request, position)
// embed holds, then hc_head, final_norm and the LM head, as CheckTrace does for the MLA families.
void CheckV4Rows(Ctx& cx, const CheckOptions& opt);

}  // namespace lockstep::verify::internal
