// cli/report_html.cc — DiffHtml (declared in diff_report.h): the diff as one self-contained
// page an engineer can send a colleague. No network, no external scripts or fonts: inline
// CSS, inline SVG charts and a few lines of JavaScript that switch between requests.
//
// Page, top to bottom: the verdict (first divergence, whether the tokens changed, top-1
// flips, mean/max KL); one tab per request, each with KL(a‖b) and top-1 agreement per
// position, next-token entropy per position, both traces' tokens aligned (fork and flips
// marked), resid_out error by layer × position (position axis, logarithmic colour bar,
// prompt/generation boundary, bit-identical cells white), and rel L2 per layer as curves;
// then every tensor in natural order (layers.2 before layers.10).
//
// Positions share one x scale in every chart of a request, so a column of the KL chart, the
// entropy chart and the heatmap is the same token. Logits at position p predict the token at
// p + 1: a flip at p is marked on the token at p + 1, the one the replay would change.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "cli/diff_report.h"

namespace lockstep::cli {
namespace {

// ---- text ----------------------------------------------------------------------------

std::string Esc(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&#39;"; break;
      case '\n': o += "↵"; break;
      case '\t': o += "⇥"; break;
      case '\r': o += "␍"; break;
      default: o += c < 0x20 ? std::string("·") : std::string(1, static_cast<char>(c));
    }
  }
  return o;
}

std::string Fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::string G3(double v) {
  if (std::isnan(v)) return "–";
  if (std::isinf(v)) return v > 0 ? "∞" : "−∞";
  return Fmt("%.3g", v);
}
std::string Px(double v) { return Fmt("%.1f", v); }  // SVG coordinates

// 10^e as text: "1", "10", "10⁻³".
std::string Decade(int e) {
  if (e == 0) return "1";
  if (e == 1) return "10";
  static const char* kSup[] = {"⁰", "¹", "²", "³", "⁴", "⁵", "⁶", "⁷", "⁸", "⁹"};
  std::string s = "10";
  if (e < 0) s += "⁻";
  for (char c : std::to_string(std::abs(e))) s += kSup[c - '0'];
  return s;
}

std::string Short(const std::string& tensor) { return tensor.substr(tensor.find('/') + 1); }

std::string Tok(const Detokenize& detok, int32_t id) {
  if (id < 0) return "?";
  if (!detok) return std::to_string(id);
  std::string t = detok({id});
  return t.empty() ? "∅" : t;
}

// ---- scales --------------------------------------------------------------------------

// Viridis (matplotlib's, 9 stops): perceptually uniform, readable in grey and by most
// colour-blind readers; low error dark, high error bright.
std::string Viridis(double t) {
  static const int kStops[9][3] = {{68, 1, 84},    {71, 44, 122},  {59, 81, 139},   {44, 113, 142}, {33, 144, 141},
                                   {39, 173, 129}, {92, 200, 99},  {170, 220, 50},  {253, 231, 37}};
  t = std::clamp(t, 0.0, 1.0) * 8;
  const int i = std::min(7, static_cast<int>(t));
  const double f = t - i;
  char b[8];
  std::snprintf(b, sizeof b, "#%02x%02x%02x", static_cast<int>(kStops[i][0] + f * (kStops[i + 1][0] - kStops[i][0])),
                static_cast<int>(kStops[i][1] + f * (kStops[i + 1][1] - kStops[i][1])),
                static_cast<int>(kStops[i][2] + f * (kStops[i + 1][2] - kStops[i][2])));
  return b;
}

// A logarithmic axis over whole decades [10^lo, 10^hi], from the positive finite values
// given (and `include`, e.g. the threshold), at least `min_decades` wide.
struct LogAxis {
  int lo = -8, hi = 0;
  double Frac(double v) const { return std::clamp((std::log10(v) - lo) / (hi - lo), 0.0, 1.0); }
};
LogAxis MakeLogAxis(const std::vector<double>& values, double include, int min_decades) {
  double mn = INFINITY, mx = 0;
  for (double v : values) {
    if (v > 0 && std::isfinite(v)) mn = std::min(mn, v), mx = std::max(mx, v);
  }
  if (include > 0) mn = std::min(mn, include), mx = std::max(mx, include);
  LogAxis a;
  if (!(mx > 0)) return a;
  a.lo = std::max(-12, static_cast<int>(std::floor(std::log10(mn))));
  a.hi = std::max(a.lo + 1, static_cast<int>(std::ceil(std::log10(mx) - 1e-9)));
  while (a.hi - a.lo < min_decades) (a.hi - a.lo) % 2 ? ++a.hi : --a.lo;
  return a;
}

// A tick step of 1, 2 or 5 × 10^k giving at most `max_ticks` ticks over [0, n).
int64_t TickStep(int64_t n, int max_ticks) {
  for (int64_t m = 1;; m *= 10) {
    for (int64_t s : {1, 2, 5}) {
      if (n / (s * m) < max_ticks) return s * m;
    }
  }
}

// ---- the geometry every chart of a request shares --------------------------------------

constexpr double kWidth = 1080, kLeft = 92, kRight = 20, kPlot = kWidth - kLeft - kRight;

struct Frame {
  int64_t positions = 1;  // columns: token positions 0 … positions − 1
  int64_t prompt = 0;     // prompt length: positions ≥ prompt are generated
  int64_t fork = -1;      // first position whose token differs between the traces (−1: none)
  double Col() const { return kPlot / static_cast<double>(positions); }
  double X(double p) const { return kLeft + (p + 0.5) * Col(); }  // centre of column p
  double Edge(double p) const { return kLeft + p * Col(); }       // left edge of column p
};

// Position ticks and the prompt/generation boundary below a plot whose bottom is `y`.
void PositionAxis(std::ostringstream& h, const Frame& f, double top, double y, bool labels) {
  h << "<g class=\"axis x-axis\">";
  h << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + kPlot << "\" y1=\"" << Px(y) << "\" y2=\"" << Px(y)
    << "\" stroke=\"#555\"/>";
  const int64_t step = TickStep(f.positions, 16);
  for (int64_t p = 0; p < f.positions; p += step) {
    h << "<line x1=\"" << Px(f.X(p)) << "\" x2=\"" << Px(f.X(p)) << "\" y1=\"" << Px(y) << "\" y2=\"" << Px(y + 4)
      << "\" stroke=\"#555\"/>";
    if (labels) {
      h << "<text class=\"tick\" x=\"" << Px(f.X(p)) << "\" y=\"" << Px(y + 16) << "\" text-anchor=\"middle\">" << p
        << "</text>";
    }
  }
  if (labels) {
    h << "<text class=\"axis-label\" x=\"" << kLeft + kPlot / 2 << "\" y=\"" << Px(y + 32)
      << "\" text-anchor=\"middle\">position (token index)</text>";
  }
  h << "</g>";
  const bool fork_at_prompt = f.fork >= 0 && f.fork == f.prompt;
  if (f.prompt > 0 && f.prompt < f.positions) {
    const double x = f.Edge(static_cast<double>(f.prompt));
    h << "<g class=\"boundary\"><line x1=\"" << Px(x) << "\" x2=\"" << Px(x) << "\" y1=\"" << Px(top - 4) << "\" y2=\""
      << Px(y) << "\" stroke=\"" << (fork_at_prompt ? "#7d3c98" : "#333") << "\" stroke-dasharray=\"4 3\"/><text class=\"tick\" x=\""
      << Px(x - 4) << "\" y=\"" << Px(top - 6) << "\" text-anchor=\"end\">prompt</text><text class=\"tick\" x=\"" << Px(x + 4)
      << "\" y=\"" << Px(top - 6) << "\">generated →" << (fork_at_prompt ? "</text><text class=\"tick fork-label\" x=\"" +
      Px(x + 4) + "\" y=\"" + Px(top - 18) + "\">texts fork here" : "") << "</text></g>";
  }
  if (f.fork >= 0 && !fork_at_prompt && f.fork < f.positions) {
    const double x = f.Edge(static_cast<double>(f.fork));
    h << "<g class=\"fork-line\"><line x1=\"" << Px(x) << "\" x2=\"" << Px(x) << "\" y1=\"" << Px(top - 16) << "\" y2=\""
      << Px(y) << "\" stroke=\"#7d3c98\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\"/><text class=\"tick fork-label\" x=\""
      << Px(x + 4) << "\" y=\"" << Px(top - 18) << "\">texts fork here →</text></g>";
  }
}

// Decade gridlines and labels of a log y axis spanning [top, bottom].
void LogYAxis(std::ostringstream& h, const LogAxis& a, double top, double bottom, const std::string& label) {
  h << "<g class=\"axis y-axis\">";
  const int step = (a.hi - a.lo) > 8 ? 2 : 1;
  for (int e = a.lo; e <= a.hi; e += step) {
    const double y = bottom - (e - a.lo) * (bottom - top) / (a.hi - a.lo);
    h << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + kPlot << "\" y1=\"" << Px(y) << "\" y2=\"" << Px(y)
      << "\" stroke=\"#e4e4e4\"/><text class=\"tick\" x=\"" << kLeft - 6 << "\" y=\"" << Px(y + 4)
      << "\" text-anchor=\"end\">" << Decade(e) << "</text>";
  }
  h << "<text class=\"axis-label\" transform=\"translate(16 " << Px((top + bottom) / 2)
    << ") rotate(-90)\" text-anchor=\"middle\">" << label << "</text></g>";
}

void Threshold(std::ostringstream& h, double y, const std::string& text) {
  h << "<g class=\"threshold\"><line x1=\"" << kLeft << "\" x2=\"" << kLeft + kPlot << "\" y1=\"" << Px(y) << "\" y2=\""
    << Px(y) << "\" stroke=\"#c0392b\" stroke-dasharray=\"6 4\" stroke-width=\"1\"/><text class=\"tick thr\" x=\""
    << kLeft + kPlot - 4 << "\" y=\"" << Px(y - 4) << "\" text-anchor=\"end\">" << text << "</text></g>";
}

// ---- per request ----------------------------------------------------------------------

struct View {
  const diff::RequestReport* q = nullptr;
  const diff::RequestDetail* d = nullptr;  // may be null (a report made without details)
  std::vector<int32_t> seq_a, seq_b;       // prompt + generated, per trace
  std::map<int64_t, const diff::RowDiff*> logits;  // by position (the first row of a position)
  int64_t flips = 0;
  int64_t flips_before_fork = 0;  // flips whose context is still a's (logits at p < the fork position)
  double mean_kl = -1, max_kl = 0;
  int64_t max_kl_pos = -1;
  bool cell_titles = true;  // hover text on heatmap cells (off when the page would grow too big)
  bool Flip(const diff::RowDiff& r) const { return !r.hash_equal && !r.logits.top1_agree; }
};

View MakeView(const diff::RequestReport& q, const diff::RequestDetail* d) {
  View v;
  v.q = &q;
  v.d = d;
  v.seq_a = v.seq_b = q.prompt;
  v.seq_a.insert(v.seq_a.end(), q.tokens_a.begin(), q.tokens_a.end());
  v.seq_b.insert(v.seq_b.end(), q.tokens_b.begin(), q.tokens_b.end());
  if (d) {
    for (const auto& r : d->logits) v.logits.emplace(r.position, &r);  // full rows come before top-k ones
  }
  double sum = 0;
  for (const auto& [p, r] : v.logits) {
    const double kl = r->hash_equal ? 0.0 : r->logits.kl;
    sum += std::isfinite(kl) ? kl : 1e3;
    if (kl > v.max_kl || v.max_kl_pos < 0) v.max_kl = kl, v.max_kl_pos = p;
    v.flips += v.Flip(*r);
    v.flips_before_fork +=
        v.Flip(*r) && (q.first_token_diff < 0 || p < static_cast<int64_t>(q.prompt.size()) + q.first_token_diff);
  }
  if (!v.logits.empty()) v.mean_kl = sum / static_cast<double>(v.logits.size());
  return v;
}

Frame MakeFrame(const View& v) {
  Frame f;
  f.prompt = static_cast<int64_t>(v.q->prompt.size());
  if (v.q->first_token_diff >= 0) f.fork = f.prompt + v.q->first_token_diff;
  f.positions = std::max<int64_t>(1, static_cast<int64_t>(std::max(v.seq_a.size(), v.seq_b.size())));
  if (v.d) {
    for (const auto& row : v.d->heatmap) f.positions = std::max<int64_t>(f.positions, static_cast<int64_t>(row.size()));
    if (!v.logits.empty()) f.positions = std::max(f.positions, v.logits.rbegin()->first + 1);
  }
  return f;
}

std::string PositionWord(const View& v, int64_t p) {
  const int64_t n = static_cast<int64_t>(v.q->prompt.size());
  return p < n ? "prompt" : "generated token " + std::to_string(p - n);
}

// KL(a‖b) per position on a log axis, with a top-1 agreement band above it.
void KlChart(std::ostringstream& h, const View& v, const Frame& f, double kl_threshold, const Detokenize& detok) {
  const int id = v.q->id;
  h << "<figure><figcaption>KL(a‖b) of the next-token distribution and top-1 agreement, per position "
    << "<span class=\"hint\">(logits at position p predict the token at p + 1"
    << (v.q->first_token_diff >= 0 ? "; from the fork on the two runs read different tokens, so KL compares different contexts" : "")
    << ")</span></figcaption>\n";
  if (v.logits.empty()) {
    h << "<p class=\"empty\">No logit values in both traces for this request (captured as summaries only, or not "
         "at all: record with <code>--logits full</code> or <code>topk</code> and <code>--capture full</code>).</p></figure>\n";
    return;
  }
  std::vector<double> kls;
  for (const auto& [p, r] : v.logits) kls.push_back(r->hash_equal ? 0.0 : r->logits.kl);
  const LogAxis ax = MakeLogAxis(kls, kl_threshold, 3);
  const double band = 26, top = 52, bottom = 232, height = 272;
  auto y_of = [&](double kl) { return bottom - ax.Frac(kl) * (bottom - top); };
  h << "<svg class=\"chart kl-chart\" id=\"kl-chart-" << id << "\" viewBox=\"0 0 " << kWidth << " " << height
    << "\" role=\"img\" aria-label=\"KL and top-1 agreement per position, request " << id << "\">";
  // Flip columns: a light red band through the plot, so the eye finds them.
  for (const auto& [p, r] : v.logits) {
    if (v.Flip(*r)) {
      h << "<rect class=\"flip-band\" x=\"" << Px(f.Edge(p)) << "\" y=\"" << Px(band) << "\" width=\"" << Px(f.Col())
        << "\" height=\"" << Px(bottom - band) << "\" fill=\"#fde2df\"/>";
    }
  }
  LogYAxis(h, ax, top, bottom, "KL (nats)");
  Threshold(h, y_of(kl_threshold), "threshold " + G3(kl_threshold));
  // Top-1 band: grey agrees, red differs, white not captured.
  h << "<text class=\"tick\" x=\"" << kLeft - 6 << "\" y=\"" << Px(band + 12) << "\" text-anchor=\"end\">top-1</text>";
  for (const auto& [p, r] : v.logits) {
    const bool flip = v.Flip(*r);
    h << "<rect class=\"top1" << (flip ? " flip" : " agree") << "\" data-position=\"" << p << "\" x=\""
      << Px(f.Edge(p) + 0.5) << "\" y=\"" << Px(band + 2) << "\" width=\"" << Px(std::max(0.5, f.Col() - 1))
      << "\" height=\"14\" fill=\"" << (flip ? "#d62728" : "#b7c4cc") << "\"><title>position " << p << ": top-1 "
      << (flip ? "differs" : "agrees") << " — a " << Esc(Tok(detok, r->logits.top1_ref)) << ", b "
      << Esc(Tok(detok, r->logits.top1_cand)) << "</title></rect>";
  }
  // The KL line, then its points (hollow on the floor where the rows are bit-identical).
  h << "<polyline fill=\"none\" stroke=\"#1f5f8b\" stroke-width=\"1.6\" points=\"";
  for (const auto& [p, r] : v.logits) {
    const double kl = r->hash_equal ? 0.0 : r->logits.kl;
    h << Px(f.X(p)) << "," << Px(kl > 0 ? y_of(kl) : bottom) << " ";  // KL 0 (or below the axis): on the floor
  }
  h << "\"/>";
  const double rad = std::clamp(f.Col() / 3, 1.2, 3.5);
  for (const auto& [p, r] : v.logits) {
    const double kl = r->hash_equal ? 0.0 : r->logits.kl;
    const bool flip = v.Flip(*r);
    // Hollow: bit-identical logits; filled: measured (on the floor when below the axis).
    const std::string colour = flip ? "#d62728" : "#1f5f8b";
    h << "<circle class=\"kl-point" << (flip ? " flip" : "") << (r->hash_equal ? " identical" : "")
      << "\" data-position=\"" << p << "\" data-kl=\"" << Fmt("%.6g", kl) << "\" cx=\"" << Px(f.X(p)) << "\" cy=\""
      << Px(kl > 0 ? y_of(kl) : bottom) << "\" r=\"" << Px(rad) << "\" fill=\"" << (r->hash_equal ? "#fff" : colour)
      << "\" stroke=\"" << colour << "\"><title>position " << p << " (" << PositionWord(v, p) << "): "
      << (r->hash_equal ? "bit-identical logits, KL 0" : "KL " + G3(kl)) << "; top-1 a "
      << Esc(Tok(detok, r->logits.top1_ref)) << ", b " << Esc(Tok(detok, r->logits.top1_cand));
    if (r->logits.chosen_prob_ref > 0) {
      h << "; p(emitted token) a " << G3(r->logits.chosen_prob_ref) << ", b " << G3(r->logits.chosen_prob_cand);
    }
    h << "</title></circle>";
  }
  const int64_t first_pos = v.logits.begin()->first;
  if (f.Edge(static_cast<double>(first_pos)) - kLeft > 230) {
    h << "<text class=\"tick note\" x=\"" << Px((kLeft + f.Edge(static_cast<double>(first_pos))) / 2) << "\" y=\""
      << Px(top + 16) << "\" text-anchor=\"middle\">no logits stored before position " << first_pos << "</text>";
  }
  PositionAxis(h, f, band, bottom, true);
  h << "</svg>\n<p class=\"legend\"><span class=\"sw\" style=\"background:#b7c4cc\"></span>top-1 agrees "
    << "<span class=\"sw\" style=\"background:#d62728\"></span>top-1 differs (flip) "
    << "<span class=\"sw ring\"></span>bit-identical logits (KL 0; filled points on the floor: KL below the axis) "
    << "<span class=\"sw dash\"></span>divergence threshold</p></figure>\n";
}

// Next-token entropy of each trace per position (linear axis, nats).
void EntropyChart(std::ostringstream& h, const View& v, const Frame& f) {
  double mx = 0;
  bool any = false;
  for (const auto& [p, r] : v.logits) {
    for (double e : {r->entropy_a, r->entropy_b}) {
      if (std::isfinite(e)) mx = std::max(mx, e), any = true;
    }
  }
  if (!any) return;
  const double top = 30, bottom = 140, height = 150;
  double step = 0.5;
  while (mx / step > 5) step *= 2;
  const double ymax = std::max(step, std::ceil(mx / step) * step);
  auto y_of = [&](double e) { return bottom - e / ymax * (bottom - top); };
  h << "<figure><figcaption>Next-token entropy per position (nats, softmax at temperature 1)</figcaption>\n"
    << "<svg class=\"chart entropy-chart\" id=\"entropy-chart-" << v.q->id << "\" viewBox=\"0 0 " << kWidth << " "
    << height << "\" role=\"img\" aria-label=\"entropy per position\"><g class=\"axis y-axis\">";
  for (double e = 0; e <= ymax + 1e-9; e += step) {
    h << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + kPlot << "\" y1=\"" << Px(y_of(e)) << "\" y2=\"" << Px(y_of(e))
      << "\" stroke=\"#e4e4e4\"/><text class=\"tick\" x=\"" << kLeft - 6 << "\" y=\"" << Px(y_of(e) + 4)
      << "\" text-anchor=\"end\">" << G3(e) << "</text>";
  }
  h << "<text class=\"axis-label\" transform=\"translate(16 " << Px((top + bottom) / 2)
    << ") rotate(-90)\" text-anchor=\"middle\">entropy</text></g>";
  for (int side = 0; side < 2; ++side) {
    h << "<polyline class=\"entropy-" << (side ? "b" : "a") << "\" fill=\"none\" stroke=\""
      << (side ? "#e67e22" : "#1f5f8b") << "\" stroke-width=\"" << (side ? "1.4" : "2") << "\""
      << (side ? " stroke-dasharray=\"5 3\"" : "") << " points=\"";
    for (const auto& [p, r] : v.logits) {
      const double e = side ? r->entropy_b : r->entropy_a;
      if (std::isfinite(e)) h << Px(f.X(p)) << "," << Px(y_of(e)) << " ";
    }
    h << "\"/>";
  }
  PositionAxis(h, f, top, bottom, false);
  h << "</svg>\n<p class=\"legend\"><span class=\"sw line\" style=\"border-color:#1f5f8b\"></span>a (reference) "
    << "<span class=\"sw line dashed\" style=\"border-color:#e67e22\"></span>b</p></figure>\n";
}

// Both traces' tokens, aligned by position; the fork (first differing generated token) and
// the top-1 flips marked.
void TokenStrip(std::ostringstream& h, const View& v, const Detokenize& detok) {
  const auto& q = *v.q;
  const int64_t n_prompt = static_cast<int64_t>(q.prompt.size());
  const int64_t fork = q.first_token_diff >= 0 ? n_prompt + q.first_token_diff : -1;
  const int64_t n = static_cast<int64_t>(std::max(v.seq_a.size(), v.seq_b.size()));
  // Flip at logits position p → the token at p + 1.
  std::map<int64_t, const diff::RowDiff*> flip_at;
  for (const auto& [p, r] : v.logits) {
    if (v.Flip(*r)) flip_at[p + 1] = r;
  }
  h << "<figure><figcaption>Tokens: a over b, aligned by position";
  if (fork >= 0) {
    h << " — <b class=\"fork-text\">the texts fork at position " << fork << " (generated token " << q.first_token_diff
      << ")</b>";
  } else {
    h << " — the tokens are identical in both traces";
  }
  h << "</figcaption>\n<p class=\"legend tok-legend\"><span><span class=\"sw\" style=\"background:#eef0f3\"></span>prompt</span>"
    << "<span><span class=\"sw\" style=\"background:#fff;border-color:#9ab\"></span>generated</span>"
    << "<span><span class=\"sw\" style=\"background:#fde2df;border-color:#d62728\"></span>top-1 flip: b's most likely "
       "token here differs (in red below)</span>"
    << "<span><span class=\"sw\" style=\"background:#efe3f7;border-color:#7d3c98\"></span>fork: first token that "
       "differs</span><span><b class=\"eqkey\">=</b> b has a's token</span>"
    << (detok ? "" : "<span>(token ids: the model folder has no tokenizer.json)</span>") << "</p>\n";
  h << "<div class=\"tokens\" id=\"tokens-" << q.id << "\">";
  const int64_t last = std::max(n, flip_at.empty() ? 0 : flip_at.rbegin()->first + 1);
  for (int64_t p = 0; p < last; ++p) {
    if (p == n_prompt && p > 0) h << "<span class=\"sep\" title=\"prompt ends, generation starts\">▸</span>";
    const bool have_a = p < static_cast<int64_t>(v.seq_a.size()), have_b = p < static_cast<int64_t>(v.seq_b.size());
    const int32_t ta = have_a ? v.seq_a[p] : -1, tb = have_b ? v.seq_b[p] : -1;
    std::string cls = p < n_prompt ? "tok prompt" : "tok gen";
    auto fl = flip_at.find(p);
    if (fl != flip_at.end()) cls += " flip";
    if (p == fork) cls += " fork";
    else if (fork >= 0 && p > fork) cls += " after-fork";
    if (q.has_divergence && p == q.first.position) cls += " first-div";
    std::string title = "position " + std::to_string(p) + " (" + PositionWord(v, p) + ")";
    if (have_a) title += "; a: " + Tok(detok, ta) + (detok ? " [" + std::to_string(ta) + "]" : "");
    if (have_b && tb != ta) title += "; b: " + Tok(detok, tb) + (detok ? " [" + std::to_string(tb) + "]" : "");
    if (fl != flip_at.end()) {
      title += "; logits at " + std::to_string(p - 1) + ": top-1 a " + Tok(detok, fl->second->logits.top1_ref) +
               ", b " + Tok(detok, fl->second->logits.top1_cand) + ", KL " + G3(fl->second->logits.kl);
    }
    h << "<span class=\"" << cls << "\" data-position=\"" << p << "\" title=\"" << Esc(title) << "\">";
    h << "<i>" << p << "</i><b class=\"ta\">" << (have_a ? Esc(Tok(detok, ta)) : "&nbsp;") << "</b>";
    if (have_b && tb != ta) {
      h << "<b class=\"tb differs\">" << Esc(Tok(detok, tb)) << "</b>";
    } else {
      h << "<b class=\"tb eq\">" << (have_b ? "=" : "&nbsp;") << "</b>";
    }
    // b's choice, unless b's token shows it already.
    if (fl != flip_at.end() && !(have_b && tb == fl->second->logits.top1_cand)) {
      h << "<b class=\"alt\">" << Esc(Tok(detok, fl->second->logits.top1_cand)) << "</b>";
    }
    h << "</span>";
  }
  h << "</div></figure>\n";
}

// rel L2 of layers.L.resid_out over layer × position, with its colour bar.
void Heatmap(std::ostringstream& h, const View& v, const Frame& f, double rel_threshold) {
  const int id = v.q->id;
  h << "<figure><figcaption>Relative L2 error of <code>layers.L.resid_out</code>, layer × position</figcaption>\n";
  if (!v.d || v.d->heatmap.empty()) {
    h << "<p class=\"empty\">No resid_out rows captured in both traces for this request.</p></figure>\n";
    return;
  }
  const auto& hm = v.d->heatmap;
  const int64_t layers = static_cast<int64_t>(hm.size());
  std::vector<double> vals;
  for (const auto& row : hm) vals.insert(vals.end(), row.begin(), row.end());
  const LogAxis ax = MakeLogAxis(vals, 0, 2);  // fitted to the data: contrast where the errors are
  const double rh = std::clamp(360.0 / layers, 5.0, 18.0), top = 30, bottom = top + rh * layers;
  const double bar_y = bottom + 58, height = bar_y + 52;
  h << "<svg class=\"chart heatmap\" id=\"heatmap-" << id << "\" viewBox=\"0 0 " << kWidth << " " << Px(height)
    << "\" role=\"img\" aria-label=\"resid_out error heatmap\"><defs><pattern id=\"hatch-" << id
    << "\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\"><rect width=\"6\" "
       "height=\"6\" fill=\"#f2f2f2\"/><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#c8c8c8\" stroke-width=\"2\"/>"
       "</pattern><pattern id=\"summ-"
    << id << "\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\"><rect width=\"6\" "
             "height=\"6\" fill=\"#9aa0a6\"/><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#6b7075\" stroke-width=\"2\"/>"
             "</pattern></defs>";
  const int label_every = rh >= 11 ? 1 : static_cast<int>(std::ceil(11 / rh));
  const bool titles = v.cell_titles;
  h << "<g class=\"cells\" shape-rendering=\"crispEdges\">";
  for (int64_t l = 0; l < layers; ++l) {
    const double y = top + l * rh;
    if (l % label_every == 0) {
      h << "<text class=\"tick layer-label\" x=\"" << kLeft - 6 << "\" y=\"" << Px(y + rh / 2 + 4)
        << "\" text-anchor=\"end\">layers." << l << "</text>";
    }
    for (int64_t p = 0; p < f.positions; ++p) {
      const double e = p < static_cast<int64_t>(hm[l].size()) ? hm[l][p] : -1.0;
      std::string fill, kind;
      if (e == 0) fill = "#ffffff", kind = "identical";
      else if (e > 0) fill = Viridis(ax.Frac(e)), kind = "err";
      else if (e == -2) fill = "url(#summ-" + std::to_string(id) + ")", kind = "summary";
      else if (e == -3) fill = "#e4e7f2", kind = "not-aligned";
      else fill = "url(#hatch-" + std::to_string(id) + ")", kind = "missing";
      h << "<rect class=\"cell " << kind << "\" x=\"" << Px(f.Edge(p)) << "\" y=\"" << Px(y) << "\" width=\""
        << Px(f.Col() + 0.05) << "\" height=\"" << Px(rh + 0.05) << "\" fill=\"" << fill << "\"";
      if (titles) {
        h << "><title>layers." << l << ".resid_out, position " << p << " (" << PositionWord(v, p) << "): "
          << (e == 0 ? "bit-identical" : e > 0 ? "rel L2 " + G3(e) : e == -2 ? "differs (summary only)"
                  : e == -3 ? "not aligned (the token streams forked before it)" : "not captured")
          << "</title></rect>";
      } else {
        h << "/>";
      }
    }
  }
  h << "</g><rect x=\"" << kLeft << "\" y=\"" << top << "\" width=\"" << kPlot << "\" height=\"" << Px(bottom - top)
    << "\" fill=\"none\" stroke=\"#888\"/>";
  // The first divergence of this request, when it is in a layer.
  if (v.q->has_divergence && v.q->first.layer >= 0 && v.q->first.layer < layers) {
    h << "<rect class=\"first-div-mark\" x=\"" << Px(f.Edge(v.q->first.position)) << "\" y=\""
      << Px(top + v.q->first.layer * rh) << "\" width=\"" << Px(f.Col()) << "\" height=\"" << Px(rh)
      << "\" fill=\"none\" stroke=\"#e74c3c\" stroke-width=\"2\"><title>first divergence: "
      << Esc(Short(v.q->first.tensor)) << ", position " << v.q->first.position << "</title></rect>";
  }
  h << "<text class=\"tick\" x=\"" << kLeft - 6 << "\" y=\"" << top - 8 << "\" text-anchor=\"end\">layer</text>";
  PositionAxis(h, f, top, bottom, true);
  // Colour bar: log scale, decade ticks, the threshold, and what white and grey mean.
  const double bx = kLeft, bw = 420, bh = 12;
  h << "<g class=\"colourbar\" id=\"colourbar-" << id << "\" data-scale=\"log10\" data-lo=\"" << ax.lo << "\" data-hi=\""
    << ax.hi << "\"><defs><linearGradient id=\"vir-" << id << "\">";
  for (int i = 0; i <= 8; ++i) h << "<stop offset=\"" << i * 12.5 << "%\" stop-color=\"" << Viridis(i / 8.0) << "\"/>";
  h << "</linearGradient></defs><text class=\"tick\" x=\"" << bx << "\" y=\"" << Px(bar_y - 6)
    << "\">rel L2 (log scale)</text><rect x=\"" << bx << "\" y=\"" << Px(bar_y) << "\" width=\"" << bw << "\" height=\""
    << bh << "\" fill=\"url(#vir-" << id << ")\" stroke=\"#888\"/>";
  for (int e = ax.lo; e <= ax.hi; ++e) {
    const double x = bx + bw * (e - ax.lo) / (ax.hi - ax.lo);
    h << "<line x1=\"" << Px(x) << "\" x2=\"" << Px(x) << "\" y1=\"" << Px(bar_y + bh) << "\" y2=\"" << Px(bar_y + bh + 4)
      << "\" stroke=\"#555\"/><text class=\"tick cb-tick\" x=\"" << Px(x) << "\" y=\"" << Px(bar_y + bh + 17)
      << "\" text-anchor=\"middle\">" << Decade(e) << "</text>";
  }
  // The threshold on the bar, or a note that it is off the scale.
  const double lt = std::log10(rel_threshold);
  std::string thr_text;
  double tx = bx + bw * ax.Frac(rel_threshold);
  if (lt < ax.lo) {
    thr_text = "every cell that differs is above the threshold " + G3(rel_threshold);
    tx = bx;
  } else if (lt > ax.hi) {
    thr_text = "every cell is below the threshold " + G3(rel_threshold);
    tx = bx + bw;
  } else {
    thr_text = "threshold " + G3(rel_threshold);
    h << "<line class=\"cb-threshold\" x1=\"" << Px(tx) << "\" x2=\"" << Px(tx) << "\" y1=\"" << Px(bar_y - 4)
      << "\" y2=\"" << Px(bar_y + bh + 4) << "\" stroke=\"#c0392b\" stroke-width=\"2\"/>";
  }
  const double sx = bx + bw + 40;
  auto swatch = [&](double x, const std::string& fill, const std::string& text) {
    h << "<rect x=\"" << Px(x) << "\" y=\"" << Px(bar_y) << "\" width=\"16\" height=\"" << bh << "\" fill=\"" << fill
      << "\" stroke=\"#888\"/><text class=\"tick\" x=\"" << Px(x + 22) << "\" y=\"" << Px(bar_y + 10) << "\">" << text
      << "</text>";
  };
  swatch(sx, "#ffffff", "bit-identical");
  swatch(sx + 120, "url(#hatch-" + std::to_string(id) + ")", "not captured");
  swatch(sx + 240, "url(#summ-" + std::to_string(id) + ")", "differs (summary only)");
  if (v.q->aligned_until >= 0) swatch(sx + 410, "#e4e7f2", "not aligned (forked)");
  h << "<text class=\"tick thr\" x=\"" << Px(tx) << "\" y=\"" << Px(bar_y + bh + 32) << "\" text-anchor=\""
    << (tx == bx ? "start" : tx == bx + bw ? "end" : "middle") << "\">" << thr_text << "</text></g></svg></figure>\n";
}

// rel L2 per layer as curves: resid_out's median (and max) and the attention and FFN outputs.
void LayerCurves(std::ostringstream& h, const View& v, bool grafted, double rel_threshold) {
  if (!v.d || v.d->tap_growth.empty()) return;
  struct Curve {
    const char* tap;
    bool max;
    const char* colour;
    const char* label;
  };
  const Curve kCurves[] = {{"resid_out", false, "#1f5f8b", "resid_out (median)"},
                           {"resid_out", true, "#1f5f8b", "resid_out (max)"},
                           {"attn.out", false, "#e67e22", "attn.out (median)"},
                           {"ffn.out", false, "#27ae60", "ffn.out (median)"}};
  std::vector<double> vals;
  int64_t layers = 0;
  for (const auto& c : kCurves) {
    auto it = v.d->tap_growth.find(c.tap);
    if (it == v.d->tap_growth.end()) continue;
    const auto& ys = c.max ? it->second.max : it->second.median;
    vals.insert(vals.end(), ys.begin(), ys.end());
    layers = std::max<int64_t>(layers, static_cast<int64_t>(ys.size()));
  }
  if (layers == 0) return;
  const LogAxis ax = MakeLogAxis(vals, rel_threshold, 3);
  const double top = 20, bottom = 210, height = 250;
  const double dx = kPlot / static_cast<double>(layers);
  auto x_of = [&](int64_t l) { return kLeft + (l + 0.5) * dx; };
  auto y_of = [&](double e) { return bottom - ax.Frac(e) * (bottom - top); };
  h << "<figure><figcaption>Error per layer: relative L2 of each layer's outputs, median over positions"
    << (v.q->has_divergence ? " from the first divergence (position " + std::to_string(v.q->first.position) + ") on" : "")
    << " — "
    << (grafted ? "<b>local error</b>: b is a grafted replay, every layer started from a's recorded input"
                : "<b>propagated error</b>: each layer inherits the error of the layers before it "
                  "(<code>replay --graft</code> measures each layer's own)")
    << "</figcaption>\n<svg class=\"chart layer-chart\" id=\"layer-chart-" << v.q->id << "\" viewBox=\"0 0 " << kWidth
    << " " << height << "\" role=\"img\" aria-label=\"error per layer\">";
  LogYAxis(h, ax, top, bottom, "rel L2");
  Threshold(h, y_of(rel_threshold), "threshold " + G3(rel_threshold));
  const int64_t step = TickStep(layers, 24);
  h << "<g class=\"axis x-axis\"><line x1=\"" << kLeft << "\" x2=\"" << kLeft + kPlot << "\" y1=\"" << bottom
    << "\" y2=\"" << bottom << "\" stroke=\"#555\"/>";
  for (int64_t l = 0; l < layers; l += step) {
    h << "<text class=\"tick layer-tick\" x=\"" << Px(x_of(l)) << "\" y=\"" << bottom + 16 << "\" text-anchor=\"middle\">"
      << l << "</text>";
  }
  h << "<text class=\"axis-label\" x=\"" << kLeft + kPlot / 2 << "\" y=\"" << bottom + 34
    << "\" text-anchor=\"middle\">layer</text></g>";
  std::ostringstream legend;
  for (const auto& c : kCurves) {
    auto it = v.d->tap_growth.find(c.tap);
    if (it == v.d->tap_growth.end()) continue;
    const auto& ys = c.max ? it->second.max : it->second.median;
    const char* dash = c.max ? " stroke-dasharray=\"2 3\"" : "";
    const char* width = std::string(c.tap) == "resid_out" && !c.max ? "2.4" : "1.5";
    h << "<polyline class=\"layer-curve\" data-tap=\"" << c.tap << (c.max ? "-max" : "") << "\" fill=\"none\" stroke=\""
      << c.colour << "\" stroke-width=\"" << width << "\"" << dash << " points=\"";
    for (size_t l = 0; l < ys.size(); ++l) {
      if (ys[l] > 0) h << Px(x_of(static_cast<int64_t>(l))) << "," << Px(y_of(ys[l])) << " ";
    }
    h << "\"/>";
    for (size_t l = 0; l < ys.size(); ++l) {
      if (ys[l] <= 0) continue;
      h << "<circle cx=\"" << Px(x_of(static_cast<int64_t>(l))) << "\" cy=\"" << Px(y_of(ys[l])) << "\" r=\"2.6\" fill=\""
        << c.colour << "\"><title>layers." << l << "." << c.tap << ": " << (c.max ? "max" : "median") << " rel L2 "
        << G3(ys[l]) << "</title></circle>";
    }
    legend << "<span class=\"sw line" << (c.max ? " dotted" : "") << "\" style=\"border-color:" << c.colour
           << "\"></span>" << c.label << " ";
  }
  h << "</svg>\n<p class=\"legend\">" << legend.str() << "</p></figure>\n";
}

void RequestSection(std::ostringstream& h, const diff::TraceDiffReport& r, const View& v, const Detokenize& detok) {
  const auto& q = *v.q;
  const Frame f = MakeFrame(v);
  h << "<section class=\"request\" id=\"request-" << q.id << "\" data-request=\"" << q.id << "\">\n<h2>Request "
    << q.id << (q.name.empty() || q.name == std::to_string(q.id) ? "" : " · " + Esc(q.name)) << "</h2>\n<p class=\"facts\">"
    << q.prompt.size() << " prompt tokens, " << q.tokens_a.size() << " generated in a, " << q.tokens_b.size()
    << " in b · ";
  if (q.first_token_diff >= 0) {
    h << "<b class=\"bad\">tokens fork at generated token " << q.first_token_diff << "</b>";
  } else {
    h << "tokens identical";
  }
  if (!v.logits.empty()) {
    h << " · top-1 flips <b>" << v.flips << "</b> of " << v.logits.size() << " · KL mean " << G3(v.mean_kl) << ", max "
      << G3(v.max_kl) << " (position " << v.max_kl_pos << ")";
  }
  if (q.has_divergence) {
    h << " · first divergence at position " << q.first.position << ", <code>" << Esc(Short(q.first.tensor))
      << "</code> (" << Esc(q.first.how) << ")";
  }
  h << "</p>\n";
  KlChart(h, v, f, r.thresholds.kl, detok);
  EntropyChart(h, v, f);
  TokenStrip(h, v, detok);
  Heatmap(h, v, f, r.thresholds.rel_l2);
  LayerCurves(h, v, r.grafted, r.thresholds.rel_l2);
  h << "</section>\n";
}

const char* kCss = R"css(
:root{--fg:#1d2329;--muted:#5f6b76;--line:#dde2e7;--bad:#c0392b;--ok:#1e8449}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);margin:0;background:#f5f7f9}
main{max-width:1140px;margin:0 auto;padding:20px 24px 40px}
header{background:#1d2329;color:#fff;padding:14px 24px}
header h1{font-size:18px;margin:0;font-weight:600;max-width:1092px;margin:0 auto;word-break:break-all}
header .paths{max-width:1092px;margin:4px auto 0;color:#aeb8c2;font-size:12px;font-family:ui-monospace,monospace}
h2{font-size:17px;margin:0 0 6px}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px}
.verdict{background:#fff;border:1px solid var(--line);border-left:6px solid var(--bad);border-radius:6px;padding:14px 18px;margin-bottom:16px}
.verdict.ok{border-left-color:var(--ok)}
.verdict .headline{font-size:16px;font-weight:600;margin:0 0 10px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{flex:1 1 190px;border:1px solid var(--line);border-radius:6px;padding:8px 12px;background:#fafbfc}
.card .k{font-size:11px;text-transform:uppercase;letter-spacing:.04em;color:var(--muted)}
.card .v{font-size:19px;font-weight:600}
.card .s{font-size:12px;color:var(--muted)}
.bad{color:var(--bad)}.good{color:var(--ok)}
.notes{margin:10px 0 0;padding-left:18px;color:var(--muted);font-size:12.5px}
nav.tabs{display:flex;flex-wrap:wrap;gap:6px;margin:0 0 -1px;position:relative}
nav.tabs .label{align-self:center;color:var(--muted);margin-right:6px}
.tab{font:inherit;border:1px solid var(--line);border-bottom:none;background:#e9edf1;border-radius:6px 6px 0 0;padding:6px 12px;cursor:pointer;color:var(--fg)}
.tab.active{background:#fff;font-weight:600}
.tab .badge{display:inline-block;margin-left:6px;padding:0 6px;border-radius:9px;background:#d5dbe1;font-size:11px;font-weight:600}
.tab .badge.bad{background:#f8d3cf;color:var(--bad)}
section.request{background:#fff;border:1px solid var(--line);border-radius:0 6px 6px 6px;padding:16px 18px}
.facts{color:var(--muted);margin:0 0 8px}
figure{margin:14px 0 6px}
figcaption{font-weight:600;margin-bottom:4px}
.hint{font-weight:normal;color:var(--muted)}
svg.chart{width:100%;height:auto;display:block}
svg text{font:11px system-ui,sans-serif;fill:#444}
svg .axis-label{font-size:12px;fill:#333}
svg .thr{fill:#c0392b}
svg .thr,svg .note,svg .fork-label{paint-order:stroke;stroke:#fff;stroke-width:3px;stroke-linejoin:round}
.legend{font-size:12px;color:var(--muted);margin:2px 0 0 92px}
.tok-legend{margin:0 0 6px;display:flex;flex-wrap:wrap;gap:4px 16px}.tok-legend .sw{margin-left:0}
.eqkey{color:#98a2ab;font-family:ui-monospace,monospace;margin-right:4px}
svg .note{fill:#98a2ab;font-style:italic}
svg .fork-label{fill:#7d3c98;font-weight:600}
.sw{display:inline-block;width:12px;height:12px;border:1px solid #999;vertical-align:-2px;margin:0 4px 0 12px}
.sw:first-child{margin-left:0}
.sw.ring{border-radius:50%;border:1.5px solid #1f5f8b;background:#fff}
.sw.dash{border:none;border-top:2px dashed #c0392b;height:0;width:18px;vertical-align:3px}
.sw.line{border:none;border-top:2.5px solid;height:0;width:20px;vertical-align:3px}
.sw.line.dashed{border-top-style:dashed}.sw.line.dotted{border-top-style:dotted}
.empty{color:var(--muted);font-style:italic}
.tokens{display:flex;flex-wrap:wrap;gap:3px;align-items:flex-start;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px}
.tok{display:inline-flex;flex-direction:column;min-width:22px;max-width:150px;border:1px solid #ccd3da;border-radius:4px;padding:1px 4px 2px;background:#fff}
.tok i{font-style:normal;font-size:9px;color:#98a2ab;line-height:1.1}
.tok b{font-weight:normal;white-space:pre;overflow:hidden;text-overflow:ellipsis}
.tok .tb{color:#7b8794}.tok .tb.eq{color:#b9c1c8}
.tok .tb.differs{color:#7d3c98;font-weight:600}
.tok .alt{color:#d62728;font-weight:600;border-top:1px dotted #d62728}
.tok.prompt{background:#eef0f3}
.tok.flip{background:#fde2df;border-color:#d62728}
.tok.fork{background:#efe3f7;border:2px solid #7d3c98}
.tok.after-fork .ta{color:#555}
.tok.first-div{box-shadow:inset 0 -3px 0 #e74c3c}
.sep{color:#7b8794;align-self:center;padding:0 2px}
.fork-text{color:#7d3c98}
details.tensors{background:#fff;border:1px solid var(--line);border-radius:6px;padding:10px 16px;margin-top:16px}
details.tensors summary{cursor:pointer;font-weight:600}
table.tensor-table{border-collapse:collapse;width:100%;margin-top:8px;font-size:12.5px}
table.tensor-table th{text-align:left;border-bottom:1px solid #bbb;padding:3px 8px;font-weight:600}
table.tensor-table td{border-bottom:1px solid #eee;padding:2px 8px}
table.tensor-table td.num{text-align:right;font-variant-numeric:tabular-nums}
table.tensor-table tr.same td{color:#9aa3ab}
.bar{display:inline-block;height:8px;background:#1f5f8b;border-radius:2px;vertical-align:0}
footer{color:var(--muted);font-size:12px;margin-top:18px}
)css";

// Shows one request's section; the hash (#request-ID) picks the first one shown.
const char* kScript = R"js(
(function(){
  var tabs=document.querySelectorAll('.tab'),secs=document.querySelectorAll('section.request');
  function show(id){
    var found=false;
    secs.forEach(function(s){var on=s.dataset.request===id;s.hidden=!on;found=found||on;});
    if(!found&&secs.length){id=secs[0].dataset.request;secs[0].hidden=false;}
    tabs.forEach(function(t){var on=t.dataset.request===id;t.classList.toggle('active',on);t.setAttribute('aria-selected',on?'true':'false');});
  }
  tabs.forEach(function(t){t.addEventListener('click',function(){show(t.dataset.request);history.replaceState(null,'','#request-'+t.dataset.request);});});
  var m=location.hash.match(/^#request-(.+)$/);
  show(m?decodeURIComponent(m[1]):document.body.dataset.focus);
})();
)js";

}  // namespace

std::string DiffHtml(const diff::TraceDiffReport& r, const Detokenize& detok, const std::string& title) {
  std::vector<View> views;
  for (size_t i = 0; i < r.requests.size(); ++i) {
    const diff::RequestDetail* d = nullptr;
    for (const auto& x : r.details) {
      if (x.request == r.requests[i].id) d = &x;
    }
    views.push_back(MakeView(r.requests[i], d));
  }
  // Hover text on heatmap cells costs ~100 bytes a cell: up to 60k cells over all requests.
  int64_t cells = 0;
  for (const auto& d : r.details) {
    for (const auto& row : d.heatmap) cells += static_cast<int64_t>(row.size());
  }
  for (auto& v : views) v.cell_titles = cells <= 60000;
  // Totals over requests.
  int64_t flips = 0, flips_before_fork = 0, logit_rows = 0, forks = 0;
  double sum_kl = 0, max_kl = -1;
  const View* max_view = nullptr;
  const View* first_flip = nullptr;
  const View* first_fork = nullptr;
  for (const auto& v : views) {
    flips += v.flips;
    flips_before_fork += v.flips_before_fork;
    logit_rows += static_cast<int64_t>(v.logits.size());
    if (v.mean_kl >= 0) sum_kl += v.mean_kl * static_cast<double>(v.logits.size());
    if (v.max_kl_pos >= 0 && v.max_kl > max_kl) max_kl = v.max_kl, max_view = &v;
    if (v.flips > 0 && !first_flip) first_flip = &v;
    if (v.q->first_token_diff >= 0) {
      ++forks;
      if (!first_fork) first_fork = &v;
    }
  }
  const bool ident = r.identical && !r.has_divergence;

  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<meta name=\"viewport\" "
       "content=\"width=device-width,initial-scale=1\"><title>"
    << Esc(title) << "</title>\n<style>" << kCss << "</style></head>\n<body data-focus=\"" << r.heatmap_request
    << "\">\n<header><h1>" << Esc(title) << "</h1><div class=\"paths\">a (reference): " << Esc(r.path_a)
    << "<br>b: " << Esc(r.path_b) << "</div></header>\n<main>\n";

  // Verdict.
  h << "<div class=\"verdict" << (ident ? " ok" : "") << "\" id=\"verdict\">\n<p class=\"headline\">";
  if (ident) {
    h << "Identical: every captured row is bit-identical and every token matches.";
  } else if (r.has_divergence) {
    const auto& f = r.first;
    std::string where;
    for (const auto& v : views) {
      if (v.q->id == f.request) where = PositionWord(v, f.position);
    }
    h << "First divergence: request " << f.request << ", position " << f.position
      << (where.empty() ? "" : " (" + where + ")") << (f.layer >= 0 ? ", layer " + std::to_string(f.layer) : "")
      << ", <code>" << Esc(Short(f.tensor)) << "</code> — " << Esc(f.how);
  } else {
    h << "Tokens differ, but no captured tensor diverges above the thresholds.";
  }
  h << "</p>\n<div class=\"cards\">";
  h << "<div class=\"card\" id=\"verdict-tokens\"><div class=\"k\">Tokens</div>";
  if (forks > 0) {
    h << "<div class=\"v bad\">changed in " << forks << " of " << views.size() << "</div><div class=\"s\">first fork: request "
      << first_fork->q->id << ", generated token " << first_fork->q->first_token_diff << "</div>";
  } else {
    h << "<div class=\"v" << (flips > 0 ? "" : " good") << "\">unchanged</div><div class=\"s\">" << views.size()
      << (views.size() == 1 ? " request" : " requests") << ", the same tokens in both traces"
      << (flips > 0 ? "; b's most likely token differs at the flips, so b's greedy text would differ" : "") << "</div>";
  }
  h << "</div><div class=\"card\" id=\"verdict-flips\"><div class=\"k\">Top-1 flips</div>";
  if (logit_rows > 0) {
    h << "<div class=\"v" << (flips ? " bad" : " good") << "\" data-flips=\"" << flips << "\">" << flips << " of "
      << logit_rows << "</div><div class=\"s\">";
    if (first_flip) {
      for (const auto& [p, row] : first_flip->logits) {
        if (first_flip->Flip(*row)) {
          h << "first at request " << first_flip->q->id << ", position " << p;
          break;
        }
      }
    } else {
      h << "the most likely token never changes";
    }
    if (forks > 0) h << "; " << flips_before_fork << " before the texts fork";
    h << "</div>";
  } else {
    h << "<div class=\"v\">–</div><div class=\"s\">no logits captured in both traces</div>";
  }
  h << "</div><div class=\"card\" id=\"verdict-kl\"><div class=\"k\">KL(a‖b), nats</div>";
  if (logit_rows > 0) {
    h << "<div class=\"v\">mean " << G3(sum_kl / static_cast<double>(logit_rows)) << "</div><div class=\"s\">max <span "
      << "data-max-kl=\"" << Fmt("%.6g", max_kl) << "\">" << G3(max_kl) << "</span>";
    if (max_view) h << " at request " << max_view->q->id << ", position " << max_view->max_kl_pos;
    h << "</div>";
  } else {
    h << "<div class=\"v\">–</div><div class=\"s\">no logits captured</div>";
  }
  h << "</div><div class=\"card\"><div class=\"k\">Thresholds</div><div class=\"v\" style=\"font-size:15px\">rel L2 "
    << G3(r.thresholds.rel_l2) << " · KL " << G3(r.thresholds.kl) << "</div><div class=\"s\">"
    << (r.thresholds.exact ? "exact: any bit difference diverges" : "above these a row diverges") << "</div></div>";
  h << "</div>\n";
  if (!r.notes.empty() || !r.only_in_a.empty() || !r.only_in_b.empty()) {
    h << "<ul class=\"notes\">";
    for (const auto& n : r.notes) h << "<li>" << Esc(n) << "</li>";
    if (!r.only_in_a.empty()) h << "<li>only in a: " << r.only_in_a.size() << " tensors (e.g. " << Esc(r.only_in_a[0]) << ")</li>";
    if (!r.only_in_b.empty()) h << "<li>only in b: " << r.only_in_b.size() << " tensors (e.g. " << Esc(r.only_in_b[0]) << ")</li>";
    h << "</ul>";
  }
  h << "</div>\n";

  // One tab and one section per request.
  h << "<nav class=\"tabs\" id=\"request-tabs\" role=\"tablist\"><span class=\"label\">Request:</span>";
  for (const auto& v : views) {
    h << "<button class=\"tab\" role=\"tab\" data-request=\"" << v.q->id << "\">" << v.q->id
      << (v.q->name.empty() || v.q->name == std::to_string(v.q->id) ? "" : " · " + Esc(v.q->name));
    if (v.q->first_token_diff >= 0) h << "<span class=\"badge bad\">fork</span>";
    else if (v.flips > 0) h << "<span class=\"badge bad\">" << v.flips << " flip" << (v.flips > 1 ? "s" : "") << "</span>";
    else if (!v.q->has_divergence) h << "<span class=\"badge\">same</span>";
    else if (!v.logits.empty()) h << "<span class=\"badge\">0 flips</span>";
    h << "</button>";
  }
  h << "</nav>\n";
  for (const auto& v : views) RequestSection(h, r, v, detok);

  // Every tensor, in natural order.
  int64_t diverging = 0;
  for (const auto& t : r.tensors) diverging += t.diverging_rows > 0;
  const LogAxis wax = MakeLogAxis([&] {
    std::vector<double> w;
    for (const auto& t : r.tensors) w.push_back(t.worst_rel_l2);
    return w;
  }(), 0, 3);
  h << "<details class=\"tensors\" id=\"tensors\"><summary>Tensors: " << r.tensors.size() << " compared, " << diverging
    << " with diverging rows (all requests)</summary>\n<table class=\"tensor-table\"><tr><th>tensor</th><th>rows</th>"
       "<th>equal</th><th>diverging</th><th>worst rel L2</th><th></th><th>at position</th><th>max KL</th></tr>\n";
  for (const auto* tp : NaturalTensors(r)) {
    const auto& t = *tp;
    const double bar = t.worst_rel_l2 > 0 ? 4 + 96 * wax.Frac(t.worst_rel_l2) : 0;
    h << "<tr class=\"" << (t.equal_rows == t.rows ? "same" : "differs") << "\"><td class=\"tensor-name\">"
      << Esc(Short(t.tensor)) << "</td><td class=\"num\">" << t.rows << "</td><td class=\"num\">" << t.equal_rows
      << "</td><td class=\"num\">" << t.diverging_rows << "</td><td class=\"num\">" << G3(t.worst_rel_l2)
      << "</td><td><span class=\"bar\" style=\"width:" << Px(bar) << "px\"></span></td><td class=\"num\">"
      << (t.worst_position >= 0 ? std::to_string(t.worst_position) : "–") << "</td><td class=\"num\">"
      << (t.tensor.find("logits") != std::string::npos ? G3(t.max_kl) : "") << "</td></tr>\n";
  }
  h << "</table></details>\n<footer>Written by lockstep. a is the reference: rel L2 = ‖b − a‖ / ‖a‖, KL = KL(p_a ‖ p_b) "
       "at temperature 1. Hover any cell, point or token for its numbers. Metrics and thresholds: docs/diff.md.</footer>\n"
       "</main>\n<script>"
    << kScript << "</script>\n</body></html>\n";
  return h.str();
}

}  // namespace lockstep::cli
