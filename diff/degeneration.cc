// diff/degeneration.cc — see degeneration.h.
#include "diff/degeneration.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <set>
#include <vector>

#include <zstd.h>

namespace lockstep::diff {

Degeneration DetectDegeneration(std::span<const int32_t> all, const DegenerationParams& p) {
  Degeneration d;
  const size_t w = static_cast<size_t>(std::max<int64_t>(p.window, 0));
  std::span<const int32_t> tail = all.size() > w ? all.subspan(all.size() - w) : all;
  const int64_t N = static_cast<int64_t>(tail.size());
  // Per period n ≤ max_period, the longest n-periodic suffix L_n (≥ 2n to count). Reported:
  // the longest suffix among those that fire a rule, else the longest of all (ties: the
  // smaller n).
  const double dN = static_cast<double>(N);
  int64_t best_len = 0, best_n = 0;
  for (int64_t n = 1; n <= p.max_period && 2 * n <= N; ++n) {
    int64_t L = n;
    while (L < N && tail[N - 1 - L] == tail[N - 1 - L + n]) ++L;
    if (L < 2 * n) continue;
    const double dL = static_cast<double>(L);
    const bool fires = dL >= p.cover * dN || (p.repeats > 0 && L >= p.repeats * n && dL >= p.repeat_cover * dN);
    if (fires && (!d.loop || L > d.periodic_len)) {
      d.loop = true;
      d.period = n;
      d.periodic_len = L;
    }
    if (L > best_len) {
      best_len = L;
      best_n = n;
    }
  }
  if (!d.loop) {
    d.period = best_n;
    d.periodic_len = best_len;
  }
  d.repeats = d.period > 0 ? static_cast<double>(d.periodic_len) / static_cast<double>(d.period) : 0.0;
  const int64_t g = N - p.ngram + 1;
  if (g > 0 && p.ngram > 0) {
    std::set<std::vector<int32_t>> grams;
    for (int64_t i = 0; i < g; ++i) grams.emplace(tail.begin() + i, tail.begin() + i + p.ngram);
    d.distinct = static_cast<double>(grams.size()) / static_cast<double>(g);
  } else {
    d.distinct = 0.0;  // like the Python twin: len(set([])) / max(1, 0) = 0
  }
  d.collapse = d.distinct < p.distinct_min;
  d.degenerate = d.loop || d.collapse;
  return d;
}

double ZstdRatio(std::string_view text) {
  if (text.empty()) return 1.0;
  std::string buf(ZSTD_compressBound(text.size()), '\0');
  const size_t n = ZSTD_compress(buf.data(), buf.size(), text.data(), text.size(), 3);
  if (ZSTD_isError(n)) return 1.0;
  return static_cast<double>(n) / static_cast<double>(text.size());
}

double Entropy(std::span<const float> logits) {
  double m = -INFINITY;
  for (float x : logits) m = std::max(m, static_cast<double>(x));
  if (!std::isfinite(m)) return 0.0;
  double z = 0;
  for (float x : logits) z += std::exp(x - m);
  double h = 0;
  for (float x : logits) {
    const double p = std::exp(x - m) / z;
    if (p > 0) h -= p * std::log(p);
  }
  return h;
}

TextSignals JudgeText(std::string_view text, std::span<const double> ent, int64_t tail) {
  TextSignals s;
  s.zstd_ratio = ZstdRatio(text);
  s.compressible = text.size() >= 256 && s.zstd_ratio < 0.15;
  const size_t n = std::min<size_t>(ent.size(), static_cast<size_t>(std::max<int64_t>(tail, 1)));
  double sum = 0;
  for (size_t i = ent.size() - n; i < ent.size(); ++i) sum += ent[i];
  s.tail_entropy = n ? sum / static_cast<double>(n) : 0.0;
  s.entropy_collapse = n >= static_cast<size_t>(tail) && s.tail_entropy < 0.1;
  return s;
}

}  // namespace lockstep::diff
