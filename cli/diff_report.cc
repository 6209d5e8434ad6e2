// cli/diff_report.cc — see diff_report.h.
#include "cli/diff_report.h"
#include "cli/table.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "base/natural_order.h"
#include "engine/tokenizer.h"

namespace lockstep::cli {
namespace {

using json = nlohmann::json;

std::string Short(const std::string& tensor) { return tensor.substr(tensor.find('/') + 1); }

std::string TokenText(const Detokenize& detok, int32_t id) {
  if (!detok) return std::to_string(id);
  return detok({id});
}

}  // namespace

// The tensors in natural order of their names without the group (layers.2 before layers.10;
// kv/layers.1.latent beside taps/layers.1.*), whatever order the report has.
std::vector<const diff::TensorReport*> NaturalTensors(const diff::TraceDiffReport& r) {
  std::vector<const diff::TensorReport*> v;
  for (const auto& t : r.tensors) v.push_back(&t);
  std::stable_sort(v.begin(), v.end(), [](const auto* x, const auto* y) {
    const int c = NaturalCompare(Short(x->tensor), Short(y->tensor));
    return c != 0 ? c < 0 : NaturalLess{}(x->tensor, y->tensor);
  });
  return v;
}

namespace {

// The request of the first divergence (or the heatmap's).
const diff::RequestReport* FocusRequest(const diff::TraceDiffReport& r) {
  for (const auto& q : r.requests) {
    if (q.id == r.heatmap_request) return &q;
  }
  return r.requests.empty() ? nullptr : &r.requests[0];
}

}  // namespace

Detokenize TokenizerFromTrace(const std::map<std::string, std::string>& meta) {
  auto it = meta.find("model_dir");
  if (it == meta.end()) return {};
  const auto path = std::filesystem::path(it->second) / "tokenizer.json";
  if (!std::filesystem::exists(path)) return {};
  auto tok = engine::Tokenizer::Load(path);
  if (!tok.ok()) return {};
  std::shared_ptr<const engine::Tokenizer> t = *tok;
  return [t](const std::vector<int32_t>& ids) { return t->Decode(ids); };
}

void PrintDiffText(const diff::TraceDiffReport& r, const Detokenize& detok, bool verbose) {
  std::printf("a: %s\nb: %s\n", r.path_a.c_str(), r.path_b.c_str());
  for (const auto& n : r.notes) std::printf("note: %s\n", n.c_str());
  if (!r.only_in_a.empty()) std::printf("only in a: %zu tensors (e.g. %s)\n", r.only_in_a.size(), r.only_in_a[0].c_str());
  if (!r.only_in_b.empty()) std::printf("only in b: %zu tensors (e.g. %s)\n", r.only_in_b.size(), r.only_in_b[0].c_str());
  for (const auto& m : r.missing) std::printf("different: %s\n", m.c_str());
  if (r.identical && !r.has_divergence) {
    std::printf("identical: every row, tensor and request is in both, with the same content hash, and every token matches\n");
    return;
  }
  std::printf("\n");
  Table table({"tensor", "rows", "equal", "diverging", "worst relL2", "max KL"}, {false, true, true, true, true, true});
  for (const auto* tp : NaturalTensors(r)) {
    const auto& t = *tp;
    if (!verbose && t.equal_rows == t.rows) continue;
    const bool logits = t.tensor.rfind("taps/logits", 0) == 0;
    const bool measured = t.measured_rows > 0 || t.equal_rows == t.rows;
    std::string worst = t.integer ? "set Δ " + std::to_string(t.max_set_diff)
                        : !measured || t.tensor.ends_with("(top-k)") ? "—"
                                                                     : Format("%.3g", t.worst_rel_l2);
    table.Add({Short(t.tensor), std::to_string(t.rows), std::to_string(t.equal_rows), std::to_string(t.diverging_rows),
               worst, logits && measured ? Format("%.3g", t.max_kl) : "—"});
  }
  table.Print();
  std::printf("\nrequests:\n");
  for (const auto& q : r.requests) {
    std::printf("  %d %s: tokens %s", q.id, q.name.empty() ? "" : ("'" + q.name + "'").c_str(),
                q.first_token_diff < 0 ? "identical" : ("first differ at generated token " + std::to_string(q.first_token_diff)).c_str());
    if (q.has_divergence) {
      std::printf("; first divergence: position %lld, %s (%s)", static_cast<long long>(q.first.position),
                  Short(q.first.tensor).c_str(), q.first.how.c_str());
    }
    std::printf("\n");
  }
  if (const auto& ls = r.logit_summary; ls.rows > 0) {
    // llama.cpp's --kl-divergence figures, over every position with logits on both sides.
    std::printf("\nlogits: %lld positions; mean KL %.6g nats, max %.6g; KL percentiles 99.9%% %.3g, 99%% %.3g, "
                "95%% %.3g, 90%% %.3g, median %.3g, 10%% %.3g, 5%% %.3g, 1%% %.3g, min %.3g; same top p %.3f%%\n",
                static_cast<long long>(ls.rows), ls.mean_kl, ls.max_kl, ls.kl_p999, ls.kl_p99, ls.kl_p95, ls.kl_p90,
                ls.kl_median, ls.kl_p10, ls.kl_p05, ls.kl_p01, ls.kl_min, ls.same_top_pct);
    if (ls.chosen_rows > 0) {
      std::printf("chosen token (%lld positions where both give it): mean p %.6g (a) vs %.6g (b), mean Δp %.3g, "
                  "RMS Δp %.3g\n",
                  static_cast<long long>(ls.chosen_rows), ls.chosen_prob_a, ls.chosen_prob_b, ls.mean_dp, ls.rms_dp);
    }
  }
  if (r.has_divergence) {
    const auto& f = r.first;
    std::printf("\nFIRST DIVERGENCE: request %d, position %lld, layer %lld, %s — %s\n", f.request,
                static_cast<long long>(f.position), static_cast<long long>(f.layer), Short(f.tensor).c_str(), f.how.c_str());
    if (const auto* q = FocusRequest(r)) {
      // Tokens around it: the sequence is prompt + generated (a's).
      std::vector<int32_t> seq = q->prompt;
      seq.insert(seq.end(), q->tokens_a.begin(), q->tokens_a.end());
      std::printf("tokens around it: ");
      for (int64_t p = std::max<int64_t>(0, f.position - 6); p <= f.position + 4 && p < static_cast<int64_t>(seq.size()); ++p) {
        std::string t = TokenText(detok, seq[p]);
        for (auto& c : t) c = (c == '\n' ? ' ' : c);
        std::printf(p == f.position ? "[[%s]]" : "%s", t.c_str());
        std::printf("|");
      }
      std::printf("\n");
    }
    std::printf("error growth (median rel L2 of layers.L.resid_out, V4 hc.streams, from that position on):");
    for (size_t l = 0; l < r.layer_growth.size(); ++l) {
      if (r.layer_growth[l] >= 0) std::printf(" L%zu %.2g", l, r.layer_growth[l]);
    }
    std::printf("\n");
  }
}

namespace {

// What was not measured is null, never 0 or a string; an infinite measurement is null with
// its `_infinite` flag set beside it (JSON has no infinity).
json Num(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }
json Index(int64_t v) { return v >= 0 ? json(v) : json(nullptr); }

}  // namespace

json DiffJson(const diff::TraceDiffReport& r, const Detokenize& detok) {
  auto row = [](const diff::RowDiff& d) {
    json j = {{"tensor", d.tensor}, {"request", d.request}, {"position", d.position}, {"layer", Index(d.layer)},
              {"step", d.step}, {"hash_equal", d.hash_equal}, {"how", d.how}};
    if (d.is_set) {
      j["only_a"] = d.only_a;  // entries one side's set holds alone (lists cut at 8)
      j["only_b"] = d.only_b;
    } else if (d.compared_values) {
      j["max_abs"] = d.values.max_abs;
      j["max_abs_index"] = Index(d.values.max_abs_index);
      j["rel_l2"] = Num(d.values.rel_l2);
      if (!std::isfinite(d.values.rel_l2)) j["rel_l2_infinite"] = true;
      j["cosine"] = Num(d.values.cosine);
      j["sqnr_db"] = Num(d.values.sqnr_db);  // null when equal (+inf) or undefined
      j["nonfinite_mismatch"] = d.values.nonfinite_mismatch;
    }
    if (d.is_logits) {
      const bool measured = d.logits.top1_ref >= 0 || d.hash_equal;
      j["kl"] = measured ? Num(d.hash_equal ? 0.0 : d.logits.kl) : json(nullptr);
      if (measured && !d.hash_equal && !std::isfinite(d.logits.kl)) j["kl_infinite"] = true;
      j["top1_agree"] = d.logits.top1_ref >= 0 ? json(d.logits.top1_agree) : json(nullptr);
      j["chosen_prob_a"] = d.logits.chosen_known ? json(d.logits.chosen_prob_ref) : json(nullptr);
      j["chosen_prob_b"] = d.logits.chosen_known ? json(d.logits.chosen_prob_cand) : json(nullptr);
      j["top1_a"] = Index(d.logits.top1_ref);
      j["top1_b"] = Index(d.logits.top1_cand);
      j["entropy_a"] = Num(d.entropy_a);
      j["entropy_b"] = Num(d.entropy_b);
    }
    return j;
  };
  json j;
  j["a"] = r.path_a;
  j["b"] = r.path_b;
  j["identical"] = r.identical && !r.has_divergence;
  j["notes"] = r.notes;
  j["missing"] = r.missing;
  j["only_in_a"] = r.only_in_a;
  j["only_in_b"] = r.only_in_b;
  j["first_divergence"] = r.has_divergence ? row(r.first) : json(nullptr);
  json growth = json::array();
  for (double g : r.layer_growth) growth.push_back(g >= 0 ? json(g) : json(nullptr));
  j["layer_growth"] = growth;
  j["mean_logit_kl"] = r.mean_logit_kl >= 0 ? Num(r.mean_logit_kl) : json(nullptr);
  if (const auto& ls = r.logit_summary; ls.rows > 0) {
    const bool chosen = ls.chosen_rows > 0;
    j["logit_summary"] = {{"rows", ls.rows}, {"top1_flips", ls.top1_flips}, {"same_top_pct", ls.same_top_pct},
                   {"mean_kl", Num(ls.mean_kl)}, {"max_kl", Num(ls.max_kl)},
                   {"kl_percentiles", {{"min", Num(ls.kl_min)}, {"1", Num(ls.kl_p01)}, {"5", Num(ls.kl_p05)},
                                       {"10", Num(ls.kl_p10)}, {"50", Num(ls.kl_median)}, {"90", Num(ls.kl_p90)},
                                       {"95", Num(ls.kl_p95)}, {"99", Num(ls.kl_p99)}, {"99.9", Num(ls.kl_p999)}}},
                   {"chosen_rows", ls.chosen_rows},
                   {"chosen_prob_a", chosen ? Num(ls.chosen_prob_a) : json(nullptr)},
                   {"chosen_prob_b", chosen ? Num(ls.chosen_prob_b) : json(nullptr)},
                   {"mean_dp", chosen ? Num(ls.mean_dp) : json(nullptr)},
                   {"rms_dp", chosen ? Num(ls.rms_dp) : json(nullptr)}};
  } else {
    j["logit_summary"] = nullptr;
  }
  json tensors = json::array();
  for (const auto* tp : NaturalTensors(r)) {
    const auto& t = *tp;
    const bool logits = t.tensor.rfind("taps/logits", 0) == 0;
    // rel L2 is measured on float rows: 0 when every row is bit-identical, the worst over the
    // rows whose values were compared, null when differing rows were compared by summary only.
    const int64_t differing = t.rows - t.equal_rows;
    json worst = nullptr;
    if (!t.integer && (differing == 0 || t.measured_rows > 0) && !t.tensor.ends_with("(top-k)")) worst = Num(t.worst_rel_l2);
    json x = {{"tensor", t.tensor}, {"rows", t.rows}, {"equal_rows", t.equal_rows},
              {"diverging_rows", t.diverging_rows}, {"measured_rows", t.measured_rows},
              {"not_aligned_rows", t.not_aligned_rows}, {"integer", t.integer},
              {"worst_rel_l2", worst}, {"worst_position", t.measured_rows > 0 ? Index(t.worst_position) : json(nullptr)},
              {"max_kl", logits && (differing == 0 || t.measured_rows > 0) ? Num(t.max_kl) : json(nullptr)}};
    if (t.integer) x["max_set_diff"] = t.max_set_diff;
    tensors.push_back(x);
  }
  j["tensors"] = tensors;
  json reqs = json::array();
  for (const auto& q : r.requests) {
    json x = {{"id", q.id}, {"name", q.name}, {"first_token_diff", Index(q.first_token_diff)},
              {"aligned_until", Index(q.aligned_until)}, {"not_aligned_rows", q.not_aligned_rows},
              {"tokens_a", q.tokens_a}, {"tokens_b", q.tokens_b}};
    if (detok) {
      x["text_a"] = detok(q.tokens_a);
      x["text_b"] = detok(q.tokens_b);
    }
    x["first_divergence"] = q.has_divergence ? row(q.first) : json(nullptr);
    reqs.push_back(x);
  }
  j["requests"] = reqs;
  json lg = json::array();
  for (const auto& d : r.logits) lg.push_back(row(d));
  j["logits"] = lg;
  // Every request's logits rows, one a position (per position KL, top-1, chosen-token p).
  json all = json::array();
  for (const auto& det : r.details) {
    for (const auto& d : det.logits) all.push_back(row(d));
  }
  j["logits_all"] = all;
  return j;
}

}  // namespace lockstep::cli
