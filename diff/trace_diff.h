// diff/trace_diff.h — compare two traces layer by layer and token by token, and name where
// they part: the first divergence in causal order (engine step, then layer, then the tap's
// place in the layer), how the error grows layer by layer, and the tokens around it.
//
// Rows are aligned by (request id, position) per tensor path. Where both traces hold a
// row's values the metrics of diff/metrics.h apply (logits: KL, top-1, chosen-token
// probability); where one holds only summaries, rows are compared by content hash (exact)
// or by their statistics (relative rms change, NaN/Inf counts). The thresholds decide what
// counts as divergence (docs/diff.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "diff/metrics.h"
#include "traces/trace_reader.h"

namespace lockstep::diff {

struct DiffOptions {
  Thresholds thresholds;
  bool allow_model_mismatch = false;  // compare traces of different models anyway
};

// One (tensor, request, position) row compared.
struct RowDiff {
  std::string tensor;    // "taps/layers.3.attn.out"
  int32_t request = 0;
  int64_t position = 0;
  int64_t step = 0;      // the engine step that produced the row (in trace a)
  int64_t layer = -1;    // -1: not a layer tensor (embed, final_norm, logits)
  bool hash_equal = true;
  bool compared_values = false;
  TensorDiff values;     // when compared_values
  LogitDiff logits;      // for taps/logits rows
  bool is_logits = false;
  // Logits rows: the next-token entropy (nats, softmax at temperature 1) of each side; over
  // the top-k tokens only (a lower bound) where only the top-k were stored; NaN when unknown
  // (summary-only rows, NaN logits). Hash-equal rows with values carry both sides' top-1
  // (equal) and entropy too, so a report can show them at every position.
  double entropy_a = NAN, entropy_b = NAN;
  // Integer taps (selected positions, chosen experts) are sets: what one side holds and the
  // other lacks (entries of a only, of b only; −1 padding is not an entry). is_set: compared so.
  bool is_set = false;
  std::vector<int32_t> only_a, only_b;
  bool diverges = false;
  std::string how;       // one phrase: "rel L2 3.1e-2", "hash differs (summary only)", "NaN appears", …
};

struct TensorReport {
  std::string tensor;
  int64_t rows = 0, equal_rows = 0, diverging_rows = 0;
  // Rows whose hashes differ and whose values both traces hold (their error is measured);
  // the other differing rows were compared by summary statistics only (not measured).
  int64_t measured_rows = 0;
  // Rows left out because they come after the request's token streams fork (not aligned).
  int64_t not_aligned_rows = 0;
  bool integer = false;      // an integer tap: rows are compared as sets, rel L2 means nothing
  int64_t max_set_diff = 0;  // integer taps: the most entries one row's sets differ by
  double worst_rel_l2 = 0;   // over measured float rows; meaningful when measured_rows > 0
  int64_t worst_position = -1;
  double max_kl = 0;  // logits only
  double sum_kl = 0;  // logits only: Σ KL over compared rows (hash-equal rows count 0)
};

struct RequestReport {
  int32_t id = 0;
  std::string name;
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens_a, tokens_b;
  int64_t first_token_diff = -1;  // index into the generated tokens, −1 when equal
  // Rows at positions ≥ aligned_until were computed from different tokens (the prompts
  // differ there, or the generated streams forked at first_token_diff): they are not
  // compared. −1: every position is aligned.
  int64_t aligned_until = -1;
  bool prompts_differ = false;    // the fork is in the prompts (else in the generated tokens)
  int64_t not_aligned_rows = 0;
  bool has_divergence = false;
  RowDiff first;                  // first divergent row of this request, in causal order
};

// The logits over every request and position both traces hold (full or top-k rows): how far
// the distributions moved and where the argmax changed. rows == 0: no logits were compared.
struct LogitSummary {
  int64_t rows = 0;                 // rows compared
  int64_t top1_flips = 0;           // rows whose argmax differs
  double mean_kl = 0, max_kl = 0;   // over the compared rows (hash-equal rows count 0)
  int32_t max_kl_request = -1;
  int64_t max_kl_position = -1;
  // The first flips in (request, position) order, at most kMaxFlipsListed of them.
  static constexpr size_t kMaxFlipsListed = 16;
  std::vector<std::pair<int32_t, int64_t>> flips;
  // llama.cpp's KL-divergence figures (its perplexity tool, --kl-divergence) over the same rows:
  // KL percentiles (nearest rank over the sorted KLs; an infinite KL sorts last), the share of
  // positions whose most likely token agrees ("same top p"), and the chosen token's probability
  // under each side where both know it (mean p_a, mean p_b, mean and RMS of p_b − p_a).
  double kl_min = 0, kl_p01 = 0, kl_p05 = 0, kl_p10 = 0, kl_median = 0, kl_p90 = 0, kl_p95 = 0, kl_p99 = 0,
         kl_p999 = 0;
  double same_top_pct = 0;       // 100 · (rows − top1_flips) / rows
  int64_t chosen_rows = 0;       // rows where both sides give the chosen token's probability
  double chosen_prob_a = 0, chosen_prob_b = 0, mean_dp = 0, rms_dp = 0;
};

// One request's data for reports: what `heatmap`, `logits` and `layer_growth` hold for the
// first divergent request, for every request.
struct RequestDetail {
  int32_t request = 0;
  // rel L2 of layers.L.resid_out, [layer][position]: 0 bit-identical (hash equal), > 0 the
  // rel L2 (a row whose bits differ but whose rel L2 is 0, e.g. −0 vs +0, is stored as the
  // smallest positive double), −1 not captured in both, −2 differs but only summaries stored.
  std::vector<std::vector<double>> heatmap;
  // This request's logits, one row a position, by position: the full-logits comparison where
  // both stored values, else the top-k one; positions where only differing summaries were
  // stored (nothing to say about KL) are left out.
  std::vector<RowDiff> logits;
  // Per layer tap ("attn.out", "ffn.out", "resid_out", …: the part of the name after
  // "layers.L."), per layer: the median and the max rel L2 over this request's rows at or
  // after its first divergent position (every row when it has none); −1: no data.
  struct TapGrowth {
    std::vector<double> median, max;
  };
  std::map<std::string, TapGrowth> tap_growth;
};

struct TraceDiffReport {
  std::string path_a, path_b;
  bool identical = true;                   // every common row hash-equal and tokens equal
  std::vector<std::string> only_in_a, only_in_b;
  std::vector<std::string> notes;          // e.g. capture policies differ
  // What one side holds and the other lacks (requests, prompts, tensors, rows), one line
  // each; any entry makes the traces different (`identical` false): a comparison that walks
  // only common rows would call a trace that lost or moved rows identical (issue 31).
  std::vector<std::string> missing;
  std::vector<TensorReport> tensors;
  std::vector<RequestReport> requests;
  bool has_divergence = false;
  RowDiff first;                           // the earliest divergent row over all requests
  // Error growth: per layer, the median rel L2 of layers.L.resid_out (V4: hc.streams) over the
  // rows of the first divergent request at or after the first divergent position (−1: no data).
  std::vector<double> layer_growth;
  // Heatmap for reports: rel L2 of layers.L.resid_out (V4: hc.streams), [layer][position],
  // request = first's.
  std::vector<std::vector<double>> heatmap;
  int64_t heatmap_request = -1;
  std::vector<RowDiff> logits;             // every compared logits row of heatmap_request
  // Mean KL(a ‖ b) of the logits over every row both traces hold (full or top-k); 0 when
  // identical, −1 when no logits were captured.
  double mean_logit_kl = -1;
  LogitSummary logit_summary;
  // For reports; none of the fields above changes meaning.
  std::vector<RequestDetail> details;      // one per entry of `requests`, in the same order
  Thresholds thresholds;                   // the thresholds this report was made with
  bool grafted = false;                    // b is a `replay --graft`: per-layer errors are local
  int64_t num_layers = 0;                  // layers seen in layer taps (max index + 1)
};

// Fails (with the mismatch named) when the traces are of different models or tokenizers,
// unless allowed; or when a trace cannot be read.
Result<TraceDiffReport> CompareTraces(const traces::TraceReader& a, const traces::TraceReader& b,
                                      const DiffOptions& options = {});

// The position of a tap within a layer in the engine's causal order (lower = earlier), and the
// layer of a tensor path ("taps/layers.3.attn.out" → 3, "kv/layers.2.latent" → 2), or −1.
int TapRank(const std::string& tensor_path);
int64_t LayerOfTensor(const std::string& tensor_path);

}  // namespace lockstep::diff
