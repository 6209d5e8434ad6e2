// cli/diff_report.cc — see diff_report.h.
#include "cli/diff_report.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "engine/tokenizer.h"

namespace lockstep::cli {
namespace {

using json = nlohmann::json;

std::string Short(const std::string& tensor) { return tensor.substr(tensor.find('/') + 1); }

std::string TokenText(const Detokenize& detok, int32_t id) {
  if (!detok) return std::to_string(id);
  return detok({id});
}

std::string HtmlEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      case '\n': o += "↵"; break;
      case '\t': o += "⇥"; break;
      default: o += c;
    }
  }
  return o;
}

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
  if (r.identical && !r.has_divergence) {
    std::printf("identical: every common row has the same content hash, and every token matches\n");
    return;
  }
  std::printf("\n%-40s %8s %8s %10s %12s %10s\n", "tensor", "rows", "equal", "diverging", "worst relL2", "max KL");
  for (const auto& t : r.tensors) {
    if (!verbose && t.equal_rows == t.rows) continue;
    std::printf("%-40s %8lld %8lld %10lld %12.3g %10.3g\n", Short(t.tensor).c_str(), static_cast<long long>(t.rows),
                static_cast<long long>(t.equal_rows), static_cast<long long>(t.diverging_rows), t.worst_rel_l2, t.max_kl);
  }
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
    std::printf("error growth (median rel L2 of layers.L.resid_out from that position on):");
    for (size_t l = 0; l < r.layer_growth.size(); ++l) {
      if (r.layer_growth[l] >= 0) std::printf(" L%zu %.2g", l, r.layer_growth[l]);
    }
    std::printf("\n");
  }
}

json DiffJson(const diff::TraceDiffReport& r, const Detokenize& detok) {
  auto row = [](const diff::RowDiff& d) {
    json j = {{"tensor", d.tensor}, {"request", d.request}, {"position", d.position}, {"layer", d.layer},
              {"step", d.step}, {"hash_equal", d.hash_equal}, {"how", d.how}};
    if (d.compared_values) {
      j["max_abs"] = d.values.max_abs;
      j["max_abs_index"] = d.values.max_abs_index;
      j["rel_l2"] = std::isfinite(d.values.rel_l2) ? json(d.values.rel_l2) : json("inf");
      j["cosine"] = d.values.cosine;
      j["sqnr_db"] = std::isfinite(d.values.sqnr_db) ? json(d.values.sqnr_db) : json(nullptr);
      j["nonfinite_mismatch"] = d.values.nonfinite_mismatch;
    }
    if (d.is_logits) {
      j["kl"] = std::isfinite(d.logits.kl) ? json(d.logits.kl) : json("inf");
      j["top1_agree"] = d.logits.top1_agree;
      j["chosen_prob_a"] = d.logits.chosen_prob_ref;
      j["chosen_prob_b"] = d.logits.chosen_prob_cand;
    }
    return j;
  };
  json j;
  j["a"] = r.path_a;
  j["b"] = r.path_b;
  j["identical"] = r.identical && !r.has_divergence;
  j["notes"] = r.notes;
  j["only_in_a"] = r.only_in_a;
  j["only_in_b"] = r.only_in_b;
  j["first_divergence"] = r.has_divergence ? row(r.first) : json(nullptr);
  j["layer_growth"] = r.layer_growth;
  json tensors = json::array();
  for (const auto& t : r.tensors) {
    tensors.push_back({{"tensor", t.tensor}, {"rows", t.rows}, {"equal_rows", t.equal_rows},
                       {"diverging_rows", t.diverging_rows}, {"worst_rel_l2", t.worst_rel_l2},
                       {"worst_position", t.worst_position}, {"max_kl", t.max_kl}});
  }
  j["tensors"] = tensors;
  json reqs = json::array();
  for (const auto& q : r.requests) {
    json x = {{"id", q.id}, {"name", q.name}, {"first_token_diff", q.first_token_diff},
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
  return j;
}

std::string DiffHtml(const diff::TraceDiffReport& r, const Detokenize& detok, const std::string& title) {
  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" << HtmlEscape(title) << "</title>\n<style>"
    << "body{font:14px system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}"
    << "table.hm{border-collapse:collapse}table.hm td{width:9px;height:16px;padding:0}"
    << "table.hm th{font-weight:normal;font-size:11px;padding-right:6px;text-align:right}"
    << ".tok{display:inline-block;padding:2px 3px;margin:1px;border:1px solid #ddd;border-radius:3px;font-family:monospace;white-space:pre}"
    << ".gen{background:#eef6ff}.div{background:#ffd6d6;border-color:#d00;font-weight:bold}"
    << ".after{background:#fff0e0}.verdict{padding:12px;background:#f6f6f6;border-left:4px solid #d00}"
    << ".ok{border-left-color:#090}td.num{text-align:right;padding:2px 8px}"
    << "</style></head><body>\n<h1>" << HtmlEscape(title) << "</h1>\n";
  h << "<p>a: <code>" << HtmlEscape(r.path_a) << "</code><br>b: <code>" << HtmlEscape(r.path_b) << "</code></p>\n";
  const bool ident = r.identical && !r.has_divergence;
  h << "<div class=\"verdict" << (ident ? " ok" : "") << "\" id=\"verdict\">";
  if (ident) {
    h << "Identical: every common row has the same content hash and every token matches.";
  } else if (r.has_divergence) {
    h << "First divergence: request " << r.first.request << ", position " << r.first.position << ", layer "
      << r.first.layer << ", <b>" << HtmlEscape(Short(r.first.tensor)) << "</b> — " << HtmlEscape(r.first.how);
  } else {
    h << "Tokens differ, but no captured tensor diverges above the thresholds.";
  }
  h << "</div>\n";
  for (const auto& n : r.notes) h << "<p>note: " << HtmlEscape(n) << "</p>\n";

  // Heatmap: rel L2 of layers.L.resid_out, layer × position (log colour scale).
  h << "<h2>Error by layer × position (rel L2 of resid_out, request " << r.heatmap_request << ")</h2>\n";
  if (r.heatmap.empty()) {
    h << "<p>No resid_out values captured in both traces.</p>\n";
  } else {
    h << "<table class=\"hm\" id=\"heatmap\">\n";
    for (size_t l = 0; l < r.heatmap.size(); ++l) {
      h << "<tr><th>layer " << l << "</th>";
      for (size_t p = 0; p < r.heatmap[l].size(); ++p) {
        const double e = r.heatmap[l][p];
        std::string colour = "#eeeeee";  // not captured
        if (e == 0) {
          colour = "#ffffff";
        } else if (e > 0) {
          // 1e-7 → pale yellow … 1 → dark red.
          const double t = std::clamp((std::log10(e) + 7.0) / 7.0, 0.0, 1.0);
          char buf[16];
          std::snprintf(buf, sizeof buf, "#%02x%02x%02x", 255, static_cast<int>(240 * (1 - t)), static_cast<int>(200 * (1 - t)));
          colour = buf;
        }
        char title_buf[96];
        std::snprintf(title_buf, sizeof title_buf, "layer %zu, position %zu: %.3g", l, p, e);
        h << "<td style=\"background:" << colour << "\" title=\"" << title_buf << "\"></td>";
      }
      h << "</tr>\n";
    }
    h << "</table>\n<p>white: bit-identical; yellow→red: rel L2 from 1e-7 to 1; grey: not captured.</p>\n";
  }

  // Token strip with the divergence marked.
  if (const auto* q = FocusRequest(r)) {
    h << "<h2>Tokens (request " << q->id << ")</h2>\n<div id=\"tokens\">";
    std::vector<int32_t> seq = q->prompt;
    seq.insert(seq.end(), q->tokens_a.begin(), q->tokens_a.end());
    for (size_t p = 0; p < seq.size(); ++p) {
      std::string cls = "tok";
      if (p >= q->prompt.size()) cls += " gen";
      if (r.has_divergence && static_cast<int64_t>(p) == r.first.position && r.first.request == q->id) cls += " div";
      else if (r.has_divergence && static_cast<int64_t>(p) > r.first.position && r.first.request == q->id) cls += " after";
      h << "<span class=\"" << cls << "\" title=\"position " << p << "\">" << HtmlEscape(TokenText(detok, seq[p]))
        << "</span>";
    }
    h << "</div>\n";
    if (q->first_token_diff >= 0) {
      h << "<p>The generated tokens first differ at generated token " << q->first_token_diff << ".</p>\n";
    }
  }
  h << "<h2>Error growth by layer</h2>\n<table>";
  for (size_t l = 0; l < r.layer_growth.size(); ++l) {
    h << "<tr><td>layer " << l << "</td><td class=\"num\">" << (r.layer_growth[l] < 0 ? std::string("–") : [&] {
      char b[32];
      std::snprintf(b, sizeof b, "%.3g", r.layer_growth[l]);
      return std::string(b);
    }()) << "</td></tr>";
  }
  h << "</table>\n<h2>Tensors</h2>\n<table><tr><th>tensor</th><th>rows</th><th>equal</th><th>diverging</th><th>worst rel L2</th></tr>\n";
  for (const auto& t : r.tensors) {
    char b[32];
    std::snprintf(b, sizeof b, "%.3g", t.worst_rel_l2);
    h << "<tr><td>" << HtmlEscape(Short(t.tensor)) << "</td><td class=\"num\">" << t.rows << "</td><td class=\"num\">"
      << t.equal_rows << "</td><td class=\"num\">" << t.diverging_rows << "</td><td class=\"num\">" << b << "</td></tr>\n";
  }
  h << "</table>\n</body></html>\n";
  return h.str();
}

}  // namespace lockstep::cli
