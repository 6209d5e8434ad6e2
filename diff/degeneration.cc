// diff/degeneration.cc — see degeneration.h.
#include "diff/degeneration.h"

#include <algorithm>
#include <set>
#include <vector>

namespace lockstep::diff {

Degeneration DetectDegeneration(std::span<const int32_t> all, const DegenerationParams& p) {
  Degeneration d;
  const size_t w = static_cast<size_t>(std::max<int64_t>(p.window, 0));
  std::span<const int32_t> tail = all.size() > w ? all.subspan(all.size() - w) : all;
  const int64_t N = static_cast<int64_t>(tail.size());
  // Longest n-periodic suffix, n ≤ max_period, of length ≥ 2n (ties: the smaller n).
  for (int64_t n = 1; n <= p.max_period && 2 * n <= N; ++n) {
    int64_t L = n;
    while (L < N && tail[N - 1 - L] == tail[N - 1 - L + n]) ++L;
    if (L >= 2 * n && L > d.periodic_len) {
      d.period = n;
      d.periodic_len = L;
    }
  }
  d.loop = N > 0 && static_cast<double>(d.periodic_len) >= p.cover * static_cast<double>(N);
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

}  // namespace lockstep::diff
