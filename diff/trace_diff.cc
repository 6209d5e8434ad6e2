// diff/trace_diff.cc — see trace_diff.h.
#include "diff/trace_diff.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <set>
#include <tuple>

#include "base/natural_order.h"
#include "engine/tap.h"  // the tap table: each tap's place in causal order
#include "traces/row_summary.h"

namespace lockstep::diff {
namespace {

// What the per-layer views (error growth, heatmaps) hold at most: a hostile trace's tap names
// and positions must not size an allocation. DeepSeek models have at most a few hundred layers;
// a heatmap past 2^24 cells (layers × positions, 128 MB) is left out, with a note.
constexpr int64_t kMaxPlotLayers = int64_t{1} << 12;
constexpr int64_t kMaxPlotCells = int64_t{1} << 24;
bool Plottable(int64_t layer, int64_t position) {
  return layer >= 0 && layer < kMaxPlotLayers && position >= 0 && position < kMaxPlotCells;
}

using traces::DType;

constexpr int64_t kAfterLayers = int64_t{1} << 40;  // final_norm and logits come after every layer

std::string NameOf(const std::string& path) {
  const size_t slash = path.find('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::vector<float> RowAsFloat(DType d, const uint8_t* p, int64_t cols) {
  std::vector<float> out(cols);
  for (int64_t i = 0; i < cols; ++i) {
    switch (d) {
      case DType::kF32: std::memcpy(&out[i], p + 4 * i, 4); break;
      case DType::kI32: {
        int32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = static_cast<float>(v);
        break;
      }
      case DType::kBf16: {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        out[i] = traces::Bf16ToFloat(v);
        break;
      }
      case DType::kFp8E4m3: out[i] = traces::Fp8E4m3ToFloat(p[i]); break;
      case DType::kU8: out[i] = p[i]; break;
    }
  }
  return out;
}

// Rows of an integer tap hold sets of ids (ascending, −1 padded). Fills d->only_a / only_b
// (at most kSetListed each) and returns how many entries the sets differ by in all.
constexpr size_t kSetListed = 8;
int64_t CompareSets(const uint8_t* pa, const uint8_t* pb, int64_t cols, RowDiff* d) {
  auto read = [cols](const uint8_t* p) {
    std::vector<int32_t> v;
    v.reserve(cols);
    for (int64_t c = 0; c < cols; ++c) {
      int32_t x;
      std::memcpy(&x, p + 4 * c, 4);
      if (x != -1) v.push_back(x);
    }
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  };
  const std::vector<int32_t> a = read(pa), b = read(pb);
  std::vector<int32_t> oa, ob;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(oa));
  std::set_difference(b.begin(), b.end(), a.begin(), a.end(), std::back_inserter(ob));
  const int64_t n = static_cast<int64_t>(oa.size() + ob.size());
  if (oa.size() > kSetListed) oa.resize(kSetListed);
  if (ob.size() > kSetListed) ob.resize(kSetListed);
  d->only_a = std::move(oa);
  d->only_b = std::move(ob);
  return n;
}

// "set differs by 3: a alone {4, 17}, b alone {5}" (lists cut at kSetListed).
std::string SetPhrase(const RowDiff& d, int64_t cols) {
  auto list = [](const std::vector<int32_t>& v) {
    std::string s = "{";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + (v.size() == kSetListed ? ", …}" : "}");
  };
  return "set of " + std::to_string(cols) + " differs: a alone " + list(d.only_a) + ", b alone " + list(d.only_b);
}

bool StatsDiverge(const traces::SummaryRow& a, const traces::SummaryRow& b, double tol, std::string* how) {
  if (a.nan_count != b.nan_count || a.inf_count != b.inf_count) {
    *how = "NaN/Inf count " + std::to_string(a.nan_count + a.inf_count) + " → " + std::to_string(b.nan_count + b.inf_count);
    return true;
  }
  const double den = std::max<double>(std::fabs(a.rms), 1e-30);
  const double rel = std::fabs(static_cast<double>(b.rms) - a.rms) / den;
  char buf[96];
  std::snprintf(buf, sizeof buf, "hash differs; rms changes by %.3g (summary only)", rel);
  *how = buf;
  return rel > tol;
}

struct Key {
  int32_t request;
  int64_t position;
  bool operator<(const Key& o) const { return std::tie(request, position) < std::tie(o.request, o.position); }
};

// Causal order within a request: position, then layer, then place in the layer.
bool CausallyBefore(const RowDiff& x, const RowDiff& y) {
  const int64_t lx = x.layer < 0 && x.tensor.find("layers.") == std::string::npos ? (x.tensor == "taps/embed" ? -1 : kAfterLayers) : x.layer;
  const int64_t ly = y.layer < 0 && y.tensor.find("layers.") == std::string::npos ? (y.tensor == "taps/embed" ? -1 : kAfterLayers) : y.layer;
  return std::make_tuple(x.position, lx, TapRank(x.tensor), x.tensor) <
         std::make_tuple(y.position, ly, TapRank(y.tensor), y.tensor);
}

char* Fmt(char* buf, size_t n, const char* f, double v) {
  std::snprintf(buf, n, f, v);
  return buf;
}

// One logit row on its own: its argmax (lowest id on ties, as CompareLogits) and the entropy
// of its softmax at temperature 1, in nats (NaN when a logit is NaN).
struct LogitRowStats {
  int32_t top1 = -1;
  double entropy = NAN;
};
LogitRowStats RowStats(const std::vector<float>& l) {
  LogitRowStats s;
  if (l.empty()) return s;
  double mx = -INFINITY;
  int32_t best = 0;
  for (size_t i = 0; i < l.size(); ++i) {
    if (std::isnan(l[i])) return s;
    if (l[i] > l[best]) best = static_cast<int32_t>(i);
    mx = std::max<double>(mx, l[i]);
  }
  s.top1 = best;
  if (!std::isfinite(mx)) return s;
  double z = 0, ez = 0;  // Σ e^(x−mx), Σ (x−mx)·e^(x−mx)
  for (float x : l) {
    const double d = x - mx, e = std::exp(d);
    z += e;
    if (e > 0) ez += d * e;
  }
  s.entropy = std::max(0.0, std::log(z) - ez / z);  // H = log Z − E[x − mx]
  return s;
}

// A layer tap's row, compact, for the per-request details (curves per tap, heatmaps).
struct LayerCell {
  int32_t request;
  int64_t position;
  int64_t layer;
  size_t tap;  // index into the tap-suffix list
  double e;    // as RequestDetail::heatmap: 0 identical, > 0 rel L2, −2 summary only
};

}  // namespace

int64_t LayerOfTensor(const std::string& path) {
  const std::string name = NameOf(path);
  if (name.rfind("layers.", 0) != 0) return -1;
  return std::atoll(name.c_str() + 7);
}

int TapRank(const std::string& path) {
  const std::string name = NameOf(path);
  if (path.rfind("kv/", 0) == 0) return engine::kKvCacheOrder;  // the cache is written right after k_rope
  // logits.topk_ids / .topk_values / .logsumexp are the logits' own rows.
  if (name.rfind("logits", 0) == 0) return engine::kModelTaps[engine::kTapLogits].order;
  const engine::TapPoint* t = engine::FindTapPoint(name);
  return t != nullptr ? t->order : 99;
}

Result<TraceDiffReport> CompareTraces(const traces::TraceReader& a, const traces::TraceReader& b,
                                      const DiffOptions& opt) {
  TraceDiffReport rep;
  rep.path_a = a.path().string();
  rep.path_b = b.path().string();
  auto meta = [](const traces::TraceReader& t, const char* k) {
    auto it = t.meta().find(k);
    return it == t.meta().end() ? std::string() : it->second;
  };
  for (const char* k : {"model_fingerprint", "tokenizer_hash"}) {
    if (meta(a, k) != meta(b, k)) {
      const std::string msg = std::string("the traces are of different ") +
                              (std::string(k) == "model_fingerprint" ? "models" : "tokenizers") + ": meta." + k + " " +
                              meta(a, k) + " in " + rep.path_a + " vs " + meta(b, k) + " in " + rep.path_b;
      if (!opt.allow_model_mismatch) return Status::InvalidArgument(msg);
      rep.notes.push_back(msg);
    }
  }
  // A recording that ended on an error holds the run up to it, no more (trace_format.h kMetaStopped).
  for (const traces::TraceReader* t : {&a, &b}) {
    const std::string why = meta(*t, traces::kMetaStopped);
    if (!why.empty()) rep.notes.push_back(t->path().string() + ": the recording stopped on an error: " + why);
  }
  const bool policies_differ = meta(a, "capture_policy") != meta(b, "capture_policy");
  if (policies_differ) {
    rep.notes.push_back("capture policies differ; only rows captured in both are compared");
  }

  // Requests and their tokens.
  std::map<int32_t, const traces::RequestInfo*> rb;
  for (const auto& r : b.requests()) rb[r.id] = &r;
  for (const auto& ra : a.requests()) {
    RequestReport rr;
    rr.id = ra.id;
    rr.name = ra.name;
    rr.prompt = ra.prompt;
    rr.tokens_a = ra.generated;
    auto it = rb.find(ra.id);
    if (it == rb.end()) {
      rep.missing.push_back("request " + std::to_string(ra.id) + " is only in " + rep.path_a);
      continue;
    }
    if (it->second->prompt != ra.prompt) {
      rep.missing.push_back("request " + std::to_string(ra.id) + ": the prompts differ");
    }
    {
      const traces::RequestInfo& q = *it->second;
      if (q.seed != ra.seed || q.temperature != ra.temperature || q.top_k != ra.top_k || q.top_p != ra.top_p ||
          q.min_p != ra.min_p || q.max_new_tokens != ra.max_new_tokens) {
        rep.missing.push_back("request " + std::to_string(ra.id) + ": the sampling parameters differ");
      }
    }
    rr.tokens_b = it->second->generated;
    const size_t n = std::min(rr.tokens_a.size(), rr.tokens_b.size());
    for (size_t i = 0; i < n && rr.first_token_diff < 0; ++i) {
      if (rr.tokens_a[i] != rr.tokens_b[i]) rr.first_token_diff = static_cast<int64_t>(i);
    }
    if (rr.first_token_diff < 0 && rr.tokens_a.size() != rr.tokens_b.size()) rr.first_token_diff = static_cast<int64_t>(n);
    if (rr.first_token_diff >= 0) rep.identical = false;
    {
      // From the first token that differs (in the prompts, else in the generated streams) the
      // two runs compute different things at the same position: those rows are not aligned.
      const auto& pa = ra.prompt;
      const auto& pb = it->second->prompt;
      size_t i = 0;
      while (i < pa.size() && i < pb.size() && pa[i] == pb[i]) ++i;
      if (i < pa.size() || i < pb.size()) {
        rr.prompts_differ = true;
        rr.aligned_until = static_cast<int64_t>(i);
      } else if (rr.first_token_diff >= 0) {
        rr.aligned_until = static_cast<int64_t>(pa.size()) + rr.first_token_diff;
      }
    }
    rep.requests.push_back(std::move(rr));
  }
  {
    std::set<int32_t> ids_a;
    for (const auto& r : a.requests()) ids_a.insert(r.id);
    for (const auto& r : b.requests()) {
      if (!ids_a.count(r.id)) rep.missing.push_back("request " + std::to_string(r.id) + " is only in " + rep.path_b);
    }
  }
  std::map<int32_t, RequestReport*> req_by_id;
  for (auto& r : rep.requests) req_by_id[r.id] = &r;
  // The request of a row when the row is past the request's fork, else null.
  auto past_fork = [&req_by_id](int32_t request, int64_t position) -> RequestReport* {
    auto it = req_by_id.find(request);
    if (it == req_by_id.end()) return nullptr;
    RequestReport* q = it->second;
    return q->aligned_until >= 0 && position >= q->aligned_until ? q : nullptr;
  };

  // Tensors.
  std::map<std::string, const traces::TensorInfo*> tb;
  for (const auto& t : b.tensors()) tb[t.path] = &t;
  std::set<std::string> in_a;
  for (const auto& t : a.tensors()) in_a.insert(t.path);
  // An import of a server's logprobs (python/lockstep/import_openai.py) holds only the top-k
  // rows of the logits: the full rows' summaries a recording always keeps (taps/logits, no
  // values) have nothing to pair with there, and the logits compare through the top-k rows.
  auto topk_only = [](const traces::TraceReader& t) {
    return t.FindTensor("taps/logits.topk_ids") != nullptr && t.FindTensor("taps/logits") == nullptr;
  };
  auto summary_logits = [](const traces::TensorInfo& t) { return t.path == "taps/logits" && !t.has_values; };
  // logits.logsumexp_t is derived from the logits rows and the request's temperature (verify's
  // aid for redrawing a top-p token): traces before it, greedy ones and imports have none.
  // Derived, it is compared through the logits; on one side only, it is a note, not a gap.
  auto lse_t_note = [&](const std::string& path, const std::string& holder) {
    if (path != "taps/logits.logsumexp_t") return false;
    rep.notes.push_back("taps/logits.logsumexp_t (the logits' logsumexp at the sampling temperature) is only in " +
                        holder + ": derived from the logits rows, which are compared");
    return true;
  };
  for (const auto& t : b.tensors()) {
    if (in_a.count(t.path)) continue;
    if (lse_t_note(t.path, rep.path_b)) continue;
    if (summary_logits(t) && topk_only(a)) {
      rep.notes.push_back(rep.path_a + " holds only top-k logits rows (an import?): taps/logits of " + rep.path_b +
                          " (summaries only) is compared through its top-k rows");
      continue;
    }
    rep.only_in_b.push_back(t.path);
  }
  const Thresholds& th = opt.thresholds;
  std::map<int32_t, std::vector<RowDiff>> resid_rows;  // per request: layers.*.resid_out (V4: hc.streams) rows
  std::map<int32_t, std::vector<RowDiff>> logit_rows;
  std::vector<LayerCell> layer_cells;      // float layer taps of every request
  std::vector<std::string> tap_suffixes;   // LayerCell::tap → "attn.out", …
  bool kv_format_noted = false;

  for (const auto& ta : a.tensors()) {
    auto it = tb.find(ta.path);
    if (it == tb.end()) {
      if (lse_t_note(ta.path, rep.path_a)) {
      } else if (summary_logits(ta) && topk_only(b)) {
        rep.notes.push_back(rep.path_b + " holds only top-k logits rows (an import?): taps/logits of " + rep.path_a +
                            " (summaries only) is compared through its top-k rows");
      } else {
        rep.only_in_a.push_back(ta.path);
      }
      continue;
    }
    const traces::TensorInfo& tbi = *it->second;
    if (ta.path.rfind("taps/logits.", 0) == 0) continue;  // used through taps/logits below
    if (ta.dtype != tbi.dtype || ta.cols != tbi.cols) {
      // Different cache formats store different bytes by design; the taps that read the cache
      // (attn.heads, …) show what the format changed.
      if (ta.path.rfind("kv/", 0) == 0) {
        if (!kv_format_noted) {
          rep.notes.push_back("the KV-cache formats differ (" + std::string(traces::DTypeName(ta.dtype)) + " vs " +
                              traces::DTypeName(tbi.dtype) + "): cache bytes are not compared, the taps reading them are");
          kv_format_noted = true;
        }
      } else {
        rep.missing.push_back(ta.path + ": stored as " + traces::DTypeName(ta.dtype) + " × " + std::to_string(ta.cols) +
                            " in a but " + traces::DTypeName(tbi.dtype) + " × " + std::to_string(tbi.cols) + " in b; not compared");
      }
      continue;
    }
    LS_ASSIGN_OR_RETURN(auto sa, a.ReadSummary(ta));
    LS_ASSIGN_OR_RETURN(auto sb, b.ReadSummary(tbi));
    std::map<Key, size_t> index_b;
    for (size_t i = 0; i < sb.size(); ++i) index_b[{sb[i].request, sb[i].position}] = i;
    {
      // Count what has no partner first (and rows a trace holds twice): with the same capture
      // policy, every row of one side must be in the other.
      std::set<Key> keys_a;
      int64_t dup_a = 0, only_a = 0;
      for (const auto& r : sa) {
        if (!keys_a.insert({r.request, r.position}).second) ++dup_a;
        if (!index_b.count({r.request, r.position}) && !past_fork(r.request, r.position)) ++only_a;
      }
      const int64_t dup_b = static_cast<int64_t>(sb.size() - index_b.size());
      int64_t only_b = 0;
      for (const auto& [k, j] : index_b) only_b += keys_a.count(k) || past_fork(k.request, k.position) ? 0 : 1;
      if (dup_a || dup_b) {
        rep.missing.push_back(ta.path + ": " + std::to_string(dup_a) + " rows of a and " + std::to_string(dup_b) +
                              " of b repeat a (request, position) another row has");
      }
      if ((only_a || only_b) && !policies_differ) {
        rep.missing.push_back(ta.path + ": " + std::to_string(only_a) + " rows only in " + rep.path_a + ", " +
                              std::to_string(only_b) + " only in " + rep.path_b);
      }
    }
    const bool values = ta.has_values && tbi.has_values && ta.dtype == tbi.dtype && ta.cols == tbi.cols;
    std::vector<uint8_t> va, vb;
    if (values) {
      LS_ASSIGN_OR_RETURN(va, a.ReadValues(ta, 0, static_cast<int64_t>(sa.size())));
      LS_ASSIGN_OR_RETURN(vb, b.ReadValues(tbi, 0, static_cast<int64_t>(sb.size())));
    }
    const bool is_logits = ta.path == "taps/logits";
    const size_t esize = traces::DTypeSize(ta.dtype);
    const size_t row_bytes = esize * ta.cols;
    TensorReport tr;
    tr.tensor = ta.path;
    tr.integer = ta.dtype == DType::kI32;
    const int64_t tensor_layer = LayerOfTensor(ta.path);
    size_t tap_index = 0;
    const bool layer_tap = tensor_layer >= 0 && ta.path.rfind("taps/", 0) == 0 && ta.dtype != DType::kI32;
    if (layer_tap) {
      const std::string name = NameOf(ta.path);
      const std::string suffix = name.substr(std::min(name.size(), name.find('.', 7) + 1));
      tap_index = std::find(tap_suffixes.begin(), tap_suffixes.end(), suffix) - tap_suffixes.begin();
      if (tap_index == tap_suffixes.size()) tap_suffixes.push_back(suffix);
    }
    for (size_t i = 0; i < sa.size(); ++i) {
      if (RequestReport* q = past_fork(sa[i].request, sa[i].position)) {
        ++tr.not_aligned_rows;
        ++q->not_aligned_rows;
        if (layer_tap && Plottable(tensor_layer, sa[i].position)) {
          layer_cells.push_back({sa[i].request, sa[i].position, tensor_layer, tap_index, -3});
        }
        continue;
      }
      auto jt = index_b.find({sa[i].request, sa[i].position});
      if (jt == index_b.end()) continue;
      const size_t j = jt->second;
      RowDiff d;
      d.tensor = ta.path;
      d.request = sa[i].request;
      d.position = sa[i].position;
      d.step = sa[i].step;
      d.layer = LayerOfTensor(ta.path);
      d.hash_equal = sa[i].hash == sb[j].hash;
      d.is_logits = is_logits;
      tr.rows++;
      if (d.hash_equal) {
        tr.equal_rows++;
      } else {
        rep.identical = false;
      }
      char buf[128];
      if (values && !d.hash_equal && tr.integer) {
        // A set of ids (ascending, −1 padded): which entries each side holds alone.
        d.compared_values = true;
        d.is_set = true;
        const int64_t differ = CompareSets(va.data() + i * row_bytes, vb.data() + j * row_bytes, ta.cols, &d);
        tr.max_set_diff = std::max(tr.max_set_diff, differ);
        d.diverges = differ > 0 || th.exact;
        d.how = differ > 0 ? SetPhrase(d, ta.cols) : "the same set in another order or padding";
      } else if (values && !d.hash_equal) {
        d.compared_values = true;
        auto fa = RowAsFloat(ta.dtype, va.data() + i * row_bytes, ta.cols);
        auto fb = RowAsFloat(ta.dtype, vb.data() + j * row_bytes, ta.cols);
        d.values = CompareRows(fb, fa);  // b is the candidate, a the reference
        ++tr.measured_rows;
        if (is_logits) {
          int32_t chosen = -1;
          auto rq = req_by_id.find(d.request);
          if (rq != req_by_id.end()) {
            const int64_t gi = d.position + 1 - static_cast<int64_t>(rq->second->prompt.size());
            if (gi >= 0 && gi < static_cast<int64_t>(rq->second->tokens_a.size())) chosen = rq->second->tokens_a[gi];
          }
          d.logits = CompareLogits(fb, fa, chosen);
          d.entropy_a = RowStats(fa).entropy;
          d.entropy_b = RowStats(fb).entropy;
          d.diverges = Diverges(d.logits, th);
          std::snprintf(buf, sizeof buf, "KL %.3g, top-1 %s", d.logits.kl, d.logits.top1_agree ? "agrees" : "differs");
          d.how = buf;
          tr.max_kl = std::max(tr.max_kl, d.logits.kl);
          tr.sum_kl += std::isfinite(d.logits.kl) ? d.logits.kl : 1e3;
        } else {
          d.diverges = Diverges(d.values, th);
          if (d.values.nonfinite_mismatch > 0) {
            d.how = std::to_string(d.values.nonfinite_mismatch) + " NaN/Inf where the other trace is finite";
          } else {
            d.how = std::string("rel L2 ") + Fmt(buf, sizeof buf, "%.3g", d.values.rel_l2);
          }
        }
        tr.worst_rel_l2 = std::max(tr.worst_rel_l2, d.values.rel_l2);
        if (d.values.rel_l2 >= tr.worst_rel_l2) tr.worst_position = d.position;
      } else if (!d.hash_equal && tr.integer) {
        // Statistics say nothing about a set: a different hash is a different set.
        d.diverges = true;
        d.how = "content hash differs (summary only: the set itself was not stored)";
      } else if (!d.hash_equal) {
        d.diverges = th.exact ? true : StatsDiverge(sa[i], sb[j], th.rel_l2, &d.how);
        if (th.exact) d.how = "content hash differs";
      } else if (values && is_logits) {
        // Bit-identical logits: KL 0 and the same top-1; the report still wants both.
        const LogitRowStats st = RowStats(RowAsFloat(ta.dtype, va.data() + i * row_bytes, ta.cols));
        d.logits.top1_ref = d.logits.top1_cand = st.top1;
        d.entropy_a = d.entropy_b = st.entropy;
      }
      if (layer_tap && Plottable(d.layer, d.position)) {
        double e = -2;
        if (d.hash_equal) e = 0;
        else if (d.compared_values) e = d.values.rel_l2 > 0 ? d.values.rel_l2 : std::numeric_limits<double>::denorm_min();
        layer_cells.push_back({d.request, d.position, d.layer, tap_index, e});
      }
      if (d.diverges) {
        tr.diverging_rows++;
        auto rq = req_by_id.find(d.request);
        if (rq != req_by_id.end()) {
          RequestReport& R = *rq->second;
          if (!R.has_divergence || CausallyBefore(d, R.first)) {
            R.first = d;
            R.has_divergence = true;
          }
        }
      }
      // A layer's output: resid_out, or DeepSeek-V4's hc.streams (its residual is hc streams).
      if (Plottable(d.layer, d.position) &&
          (ta.path.ends_with("." + std::string(engine::kLayerTaps[engine::kTapResidOut].name)) ||
                           ta.path.ends_with("." + std::string(engine::kLayerTaps[engine::kTapV4Streams].name)))) {
        resid_rows[d.request].push_back(d);
      }
      if (is_logits) logit_rows[d.request].push_back(d);
    }
    rep.tensors.push_back(tr);
  }

  // Large vocabularies keep only the top-k logits (+ logsumexp): compare those as
  // distributions restricted to the reference's top-k (tokens missing from the candidate's
  // top-k get at most its k-th value), when the full rows were not compared above.
  auto find = [](const traces::TraceReader& t, const char* n) { return t.FindTensor(std::string("taps/") + n); };
  const traces::TensorInfo *ia = find(a, "logits.topk_ids"), *va_ = find(a, "logits.topk_values"),
                           *la = find(a, "logits.logsumexp");
  const traces::TensorInfo *ib = find(b, "logits.topk_ids"), *vb_ = find(b, "logits.topk_values"),
                           *lb = find(b, "logits.logsumexp");
  if (ia && va_ && la && ib && vb_ && lb && ia->cols == ib->cols) {
    const int64_t k = ia->cols;
    LS_ASSIGN_OR_RETURN(auto sa, a.ReadSummary(*ia));
    LS_ASSIGN_OR_RETURN(auto sb, b.ReadSummary(*ib));
    // A row is bit-identical only when its ids, values and logsumexp all are (equal ids alone
    // say nothing about the distribution: an import's logprobs, another cache format).
    LS_ASSIGN_OR_RETURN(auto sva, a.ReadSummary(*va_));
    LS_ASSIGN_OR_RETURN(auto svb, b.ReadSummary(*vb_));
    LS_ASSIGN_OR_RETURN(auto sla, a.ReadSummary(*la));
    LS_ASSIGN_OR_RETURN(auto slb, b.ReadSummary(*lb));
    if (sva.size() < sa.size() || sla.size() < sa.size() || svb.size() < sb.size() || slb.size() < sb.size()) {
      return Status::Corruption("taps/logits.topk_*: the top-k tensors hold different row counts");
    }
    LS_ASSIGN_OR_RETURN(auto ida, a.ReadValues(*ia, 0, static_cast<int64_t>(sa.size())));
    LS_ASSIGN_OR_RETURN(auto vda, a.ReadValues(*va_, 0, static_cast<int64_t>(sa.size())));
    LS_ASSIGN_OR_RETURN(auto lda, a.ReadValues(*la, 0, static_cast<int64_t>(sa.size())));
    LS_ASSIGN_OR_RETURN(auto idb, b.ReadValues(*ib, 0, static_cast<int64_t>(sb.size())));
    LS_ASSIGN_OR_RETURN(auto vdb, b.ReadValues(*vb_, 0, static_cast<int64_t>(sb.size())));
    LS_ASSIGN_OR_RETURN(auto ldb, b.ReadValues(*lb, 0, static_cast<int64_t>(sb.size())));
    std::map<Key, size_t> index_b;
    for (size_t i = 0; i < sb.size(); ++i) index_b[{sb[i].request, sb[i].position}] = i;
    auto i32 = [](const std::vector<uint8_t>& v, size_t i) {
      int32_t x;
      std::memcpy(&x, v.data() + 4 * i, 4);
      return x;
    };
    auto f32 = [](const std::vector<uint8_t>& v, size_t i) {
      float x;
      std::memcpy(&x, v.data() + 4 * i, 4);
      return x;
    };
    TensorReport tr;
    tr.tensor = "taps/logits (top-k)";
    for (size_t i = 0; i < sa.size(); ++i) {
      if (past_fork(sa[i].request, sa[i].position) != nullptr) {
        ++tr.not_aligned_rows;
        continue;  // counted once per request already, through taps/logits
      }
      auto jt = index_b.find({sa[i].request, sa[i].position});
      if (jt == index_b.end()) continue;
      const size_t j = jt->second;
      // Skip rows whose full logits were already compared (hash-equal rows included).
      bool done = false;
      for (const auto& r : logit_rows[sa[i].request]) done |= r.position == sa[i].position && r.compared_values;
      if (done) continue;
      RowDiff d;
      d.tensor = "taps/logits";
      d.request = sa[i].request;
      d.position = sa[i].position;
      d.step = sa[i].step;
      d.is_logits = true;
      const double lse_a = f32(lda, i), lse_b = f32(ldb, j);
      std::map<int32_t, double> qb;
      double kth_b = INFINITY;
      for (int64_t c = 0; c < k; ++c) {
        qb[i32(idb, j * k + c)] = f32(vdb, j * k + c) - lse_b;
        kth_b = std::min<double>(kth_b, f32(vdb, j * k + c) - lse_b);
      }
      double kl = 0, ent_a = 0, ent_b = 0;
      for (int64_t c = 0; c < k; ++c) {
        const double lp = f32(vda, i * k + c) - lse_a;
        auto q = qb.find(i32(ida, i * k + c));
        const double lq = q != qb.end() ? q->second : kth_b;
        kl += std::exp(lp) * (lp - lq);
        ent_a -= std::exp(lp) * lp;  // −Σ p log p over the top-k: a lower bound on the entropy
        const double lb_ = f32(vdb, j * k + c) - lse_b;
        ent_b -= std::exp(lb_) * lb_;
      }
      d.entropy_a = std::isfinite(ent_a) ? ent_a : NAN;
      d.entropy_b = std::isfinite(ent_b) ? ent_b : NAN;
      d.logits.kl = std::isfinite(kl) ? std::max(0.0, kl) : INFINITY;  // NaN logits: infinitely far
      d.logits.top1_ref = i32(ida, i * k);
      d.logits.top1_cand = i32(idb, j * k);
      // The chosen token (a's token at position + 1), where it is in both top-k lists.
      if (auto rq = req_by_id.find(d.request); rq != req_by_id.end()) {
        const auto& pr = rq->second->prompt;
        const int64_t next = d.position + 1, gi = next - static_cast<int64_t>(pr.size());
        const int32_t chosen = next < static_cast<int64_t>(pr.size()) ? pr[next]
                               : gi < static_cast<int64_t>(rq->second->tokens_a.size()) ? rq->second->tokens_a[gi]
                                                                                         : -1;
        double la_chosen = NAN;
        for (int64_t c = 0; c < k && chosen >= 0; ++c) {
          if (i32(ida, i * k + c) == chosen) la_chosen = f32(vda, i * k + c) - lse_a;
        }
        auto q = qb.find(chosen);
        if (chosen >= 0 && std::isfinite(la_chosen) && q != qb.end()) {
          d.logits.chosen_known = true;
          d.logits.chosen_prob_ref = std::exp(la_chosen);
          d.logits.chosen_prob_cand = std::exp(q->second);
        }
      }
      d.logits.top1_agree = d.logits.top1_ref == d.logits.top1_cand;
      d.hash_equal = sa[i].hash == sb[j].hash && sva[i].hash == svb[j].hash && sla[i].hash == slb[j].hash;
      if (!d.hash_equal) rep.identical = false;
      d.diverges = !d.hash_equal && Diverges(d.logits, th);
      char buf[96];
      std::snprintf(buf, sizeof buf, "KL %.3g (top-%lld), top-1 %s", d.logits.kl, static_cast<long long>(k),
                    d.logits.top1_agree ? "agrees" : "differs");
      d.how = buf;
      tr.rows++;
      tr.equal_rows += d.hash_equal;
      tr.measured_rows += !d.hash_equal;
      tr.max_kl = std::max(tr.max_kl, d.logits.kl);
      tr.sum_kl += d.hash_equal ? 0.0 : (std::isfinite(d.logits.kl) ? d.logits.kl : 1e3);
      if (d.diverges) {
        tr.diverging_rows++;
        auto rq = req_by_id.find(d.request);
        if (rq != req_by_id.end() && (!rq->second->has_divergence || CausallyBefore(d, rq->second->first))) {
          rq->second->first = d;
          rq->second->has_divergence = true;
        }
      }
      logit_rows[d.request].push_back(d);
    }
    rep.tensors.push_back(tr);
  }

  // Mean logit KL: full-logit rows where stored, else the top-k estimate.
  for (const auto& t : rep.tensors) {
    if (t.tensor == "taps/logits (top-k)" && t.rows > 0) rep.mean_logit_kl = t.sum_kl / t.rows;
  }
  for (const auto& t : rep.tensors) {
    if (t.tensor == "taps/logits" && t.rows > 0 && rep.mean_logit_kl < 0) {
      const traces::TensorInfo* ta = a.FindTensor("taps/logits");
      const traces::TensorInfo* tb2 = b.FindTensor("taps/logits");
      if (ta && tb2 && ta->has_values && tb2->has_values) rep.mean_logit_kl = t.sum_kl / t.rows;
    }
  }

  // The earliest divergence over requests: the lowest engine step, then causal order.
  for (const auto& r : rep.requests) {
    if (!r.has_divergence) continue;
    if (!rep.has_divergence || r.first.step < rep.first.step ||
        (r.first.step == rep.first.step && CausallyBefore(r.first, rep.first))) {
      rep.first = r.first;
      rep.has_divergence = true;
    }
  }
  for (const auto& r : rep.requests) {
    if (r.aligned_until < 0) continue;
    rep.notes.push_back("request " + std::to_string(r.id) + ": " +
                        (r.prompts_differ ? "the prompts differ from position " + std::to_string(r.aligned_until)
                                 : "the token streams fork at position " + std::to_string(r.aligned_until) +
                                       " (generated token " + std::to_string(r.first_token_diff) + ")") +
                        "; rows from there on compute different things and are not compared (" +
                        std::to_string(r.not_aligned_rows) + " rows)");
  }
  // Tokens that differ without any captured tensor diverging (capture none) still count.
  if (!rep.has_divergence) {
    for (const auto& r : rep.requests) {
      if (r.first_token_diff >= 0) {
        rep.notes.push_back("request " + std::to_string(r.id) + ": generated tokens differ from index " +
                            std::to_string(r.first_token_diff) + " but no captured tensor diverges");
      }
    }
  }

  // Every compared logits row, all requests: KL and argmax flips, in (request, position) order.
  {
    LogitSummary& ls = rep.logit_summary;
    double sum = 0;
    std::vector<double> kls;  // for llama.cpp's figures: the same rows' KLs
    double dp2 = 0;
    for (auto& [req, rows] : logit_rows) {
      // One row a position: the full logits' row when its values were compared (or its hash
      // matched), else the top-k row of the same position; a summary-only row whose hash
      // differs measured nothing and is not counted.
      auto measured = [](const RowDiff& d) { return d.logits.top1_ref >= 0; };  // full or top-k compared
      std::map<int64_t, const RowDiff*> at;
      for (const auto& d : rows) {
        if (!d.hash_equal && !measured(d)) continue;
        auto [it, fresh] = at.emplace(d.position, &d);
        if (!fresh && !measured(*it->second) && measured(d)) it->second = &d;
      }
      for (const auto& [pos, d] : at) {
        ++ls.rows;
        const double kl = d->hash_equal ? 0.0 : d->logits.kl;
        sum += std::isfinite(kl) ? kl : 1e3;
        if (kl > ls.max_kl || ls.max_kl_request < 0) {
          ls.max_kl = kl;
          ls.max_kl_request = d->request;
          ls.max_kl_position = d->position;
        }
        kls.push_back(std::isnan(kl) ? INFINITY : kl);
        if (d->logits.chosen_known && std::isfinite(d->logits.chosen_prob_ref) &&
            std::isfinite(d->logits.chosen_prob_cand)) {
          const double dp = d->logits.chosen_prob_cand - d->logits.chosen_prob_ref;
          ++ls.chosen_rows;
          ls.chosen_prob_a += d->logits.chosen_prob_ref;
          ls.chosen_prob_b += d->logits.chosen_prob_cand;
          ls.mean_dp += dp;
          dp2 += dp * dp;
        }
        if (!d->hash_equal && !d->logits.top1_agree) {
          ++ls.top1_flips;
          if (ls.flips.size() < LogitSummary::kMaxFlipsListed) ls.flips.emplace_back(d->request, d->position);
        }
      }
    }
    if (ls.rows > 0) ls.mean_kl = sum / static_cast<double>(ls.rows);
    if (!kls.empty()) {
      std::sort(kls.begin(), kls.end());
      auto rank = [&](double q) {  // nearest rank: the smallest value with at least q of the rows at or below it
        const size_t n = kls.size();
        size_t r = static_cast<size_t>(std::ceil(q * static_cast<double>(n)));
        return kls[std::min(n - 1, r == 0 ? 0 : r - 1)];
      };
      ls.kl_min = kls.front();
      ls.kl_p01 = rank(0.01), ls.kl_p05 = rank(0.05), ls.kl_p10 = rank(0.10), ls.kl_median = rank(0.5);
      ls.kl_p90 = rank(0.90), ls.kl_p95 = rank(0.95), ls.kl_p99 = rank(0.99), ls.kl_p999 = rank(0.999);
      ls.same_top_pct = 100.0 * static_cast<double>(ls.rows - ls.top1_flips) / static_cast<double>(ls.rows);
    }
    if (ls.chosen_rows > 0) {
      const double n = static_cast<double>(ls.chosen_rows);
      ls.chosen_prob_a /= n, ls.chosen_prob_b /= n, ls.mean_dp /= n;
      ls.rms_dp = std::sqrt(dp2 / n);
    }
  }

  // Error growth and heatmap for the request of the first divergence (else request 0).
  const int32_t hr = rep.has_divergence ? rep.first.request : (rep.requests.empty() ? 0 : rep.requests[0].id);
  rep.heatmap_request = hr;
  int64_t layers = 0, positions = 0;
  for (const auto& d : resid_rows[hr]) {
    layers = std::max(layers, d.layer + 1);
    positions = std::max(positions, d.position + 1);
  }
  const bool heatmap = layers * positions <= kMaxPlotCells;
  if (!heatmap) {
    rep.notes.push_back("the heatmap is left out: " + std::to_string(layers) + " layers × " + std::to_string(positions) +
                        " positions is past " + std::to_string(kMaxPlotCells) + " cells");
  }
  rep.heatmap.assign(heatmap ? layers : 0, std::vector<double>(heatmap ? positions : 0, -1.0));
  std::vector<std::vector<double>> per_layer(layers);
  for (const auto& d : resid_rows[hr]) {
    const double e = d.hash_equal ? 0.0 : (d.compared_values ? d.values.rel_l2 : -1.0);
    if (heatmap) rep.heatmap[d.layer][d.position] = e;
    if (e >= 0 && (!rep.has_divergence || d.position >= rep.first.position)) per_layer[d.layer].push_back(e);
  }
  rep.layer_growth.assign(layers, -1.0);
  for (int64_t l = 0; l < layers; ++l) {
    auto& v = per_layer[l];
    if (v.empty()) continue;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    rep.layer_growth[l] = v[v.size() / 2];
  }
  rep.logits = logit_rows[hr];
  std::sort(rep.logits.begin(), rep.logits.end(), [](const RowDiff& x, const RowDiff& y) { return x.position < y.position; });

  // Every request's details, for reports.
  rep.thresholds = th;
  {
    auto it = b.meta().find("replay_graft");
    rep.grafted = it != b.meta().end() && it->second == "1";
  }
  for (const auto& c : layer_cells) rep.num_layers = std::max(rep.num_layers, c.layer + 1);
  std::map<int32_t, size_t> detail_of;
  for (const auto& q : rep.requests) {
    detail_of[q.id] = rep.details.size();
    RequestDetail det;
    det.request = q.id;
    // One row per position, the most informative: full logits compared, else bit-identical
    // with values, else the top-k comparison, else bit-identical summaries (KL 0, top-1
    // unknown). A summary-only row whose hash differs says nothing about KL: left out.
    auto rank = [](const RowDiff& d) {
      if (d.compared_values) return 0;
      if (d.hash_equal && d.logits.top1_ref >= 0) return 1;
      if (d.logits.top1_ref >= 0) return 2;
      return d.hash_equal ? 3 : 4;
    };
    std::vector<RowDiff> rows = logit_rows[q.id];
    std::stable_sort(rows.begin(), rows.end(), [&](const RowDiff& x, const RowDiff& y) {
      return std::make_pair(x.position, rank(x)) < std::make_pair(y.position, rank(y));
    });
    for (auto& d : rows) {
      if (rank(d) == 4 || (!det.logits.empty() && det.logits.back().position == d.position)) continue;
      det.logits.push_back(std::move(d));
    }
    rep.details.push_back(std::move(det));
  }
  // The layer's output as the heatmap shows it: resid_out, or DeepSeek-V4's hc.streams.
  auto suffix_index = [&](int id) {
    return static_cast<size_t>(std::find(tap_suffixes.begin(), tap_suffixes.end(), engine::kLayerTaps[id].name) -
                               tap_suffixes.begin());
  };
  size_t resid_tap = suffix_index(engine::kTapResidOut);
  if (resid_tap == tap_suffixes.size()) resid_tap = suffix_index(engine::kTapV4Streams);
  std::vector<int64_t> positions_of(rep.details.size(), 0);
  for (const auto& c : layer_cells) {
    auto it = detail_of.find(c.request);
    if (it != detail_of.end() && c.tap == resid_tap) positions_of[it->second] = std::max(positions_of[it->second], c.position + 1);
  }
  // [detail][tap][layer] → the rel L2 values at or after the request's first divergence.
  std::vector<std::vector<std::vector<std::vector<double>>>> growth(
      rep.details.size(), std::vector<std::vector<std::vector<double>>>(tap_suffixes.size(),
                                                                          std::vector<std::vector<double>>(rep.num_layers)));
  std::vector<bool> detail_heatmap(rep.details.size());
  for (size_t k = 0; k < rep.details.size(); ++k) {
    detail_heatmap[k] = rep.num_layers * positions_of[k] <= kMaxPlotCells;
    const bool keep = detail_heatmap[k] && positions_of[k] > 0;
    rep.details[k].heatmap.assign(keep ? rep.num_layers : 0, std::vector<double>(keep ? positions_of[k] : 0, -1.0));
  }
  for (const auto& c : layer_cells) {
    auto it = detail_of.find(c.request);
    if (it == detail_of.end()) continue;
    const size_t k = it->second;
    const RequestReport& q = rep.requests[k];
    if (c.tap == resid_tap && detail_heatmap[k]) rep.details[k].heatmap[c.layer][c.position] = c.e;
    if (c.e >= 0 && (!q.has_divergence || c.position >= q.first.position)) growth[k][c.tap][c.layer].push_back(c.e);
  }
  for (size_t k = 0; k < rep.details.size(); ++k) {
    for (size_t t = 0; t < tap_suffixes.size(); ++t) {
      RequestDetail::TapGrowth g;
      g.median.assign(rep.num_layers, -1.0);
      g.max.assign(rep.num_layers, -1.0);
      bool any = false;
      for (int64_t l = 0; l < rep.num_layers; ++l) {
        auto& v = growth[k][t][l];
        if (v.empty()) continue;
        any = true;
        g.max[l] = *std::max_element(v.begin(), v.end());
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        g.median[l] = v[v.size() / 2];
      }
      if (any) rep.details[k].tap_growth[tap_suffixes[t]] = std::move(g);
    }
  }

  // Listings in natural order: layers.2 before layers.10.
  std::stable_sort(rep.tensors.begin(), rep.tensors.end(),
                   [](const TensorReport& x, const TensorReport& y) { return NaturalLess{}(x.tensor, y.tensor); });
  std::sort(rep.only_in_a.begin(), rep.only_in_a.end(), NaturalLess{});
  std::sort(rep.only_in_b.begin(), rep.only_in_b.end(), NaturalLess{});
  if (!policies_differ) {
    for (const auto& t : rep.only_in_a) rep.missing.push_back("tensor " + t + " is only in " + rep.path_a);
    for (const auto& t : rep.only_in_b) rep.missing.push_back("tensor " + t + " is only in " + rep.path_b);
  }
  if (!rep.missing.empty()) rep.identical = false;
  return rep;
}

}  // namespace lockstep::diff
