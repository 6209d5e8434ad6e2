// engine/sampler.cc — see docs/sampling.md for the normative description.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/philox.h"

namespace lockstep::engine {

SampleResult Sampler::Sample(std::span<const float> logits, const SamplingParams& p, uint64_t step) {
  SampleResult r;
  r.counter = step;
  const int64_t n = static_cast<int64_t>(logits.size());
  if (n == 0) return r;
  // NaN logits never win: they are treated as −∞.
  auto val = [&](int64_t i) { return std::isnan(logits[i]) ? -INFINITY : logits[i]; };
  if (p.temperature <= 0.0) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i) {
      if (val(i) > val(best)) best = i;
    }
    r.token = static_cast<int32_t>(best);
    r.candidates = 1;
    return r;
  }
  // 1. Candidates sorted by logit descending, id ascending on ties.
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  auto cmp = [&](int32_t a, int32_t b) { return val(a) > val(b) || (val(a) == val(b) && a < b); };
  int64_t k = n;
  if (p.top_k > 0 && p.top_k < n) {
    k = p.top_k;
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), cmp);
  } else {
    std::sort(ids.begin(), ids.end(), cmp);
  }
  // 2. Unnormalised probabilities in fp64: w_i = exp((l_i − l_max) / T).
  const double lmax = val(ids[0]);
  std::vector<double> w(k);
  for (int64_t i = 0; i < k; ++i) w[i] = std::exp((static_cast<double>(val(ids[i])) - lmax) / p.temperature);
  double total = 0;
  for (int64_t i = 0; i < k; ++i) total += w[i];
  // 3. top-p: the shortest prefix whose mass reaches top_p (at least one token).
  int64_t keep = k;
  if (p.top_p < 1.0) {
    double cum = 0;
    for (int64_t i = 0; i < k; ++i) {
      cum += w[i];
      if (cum >= p.top_p * total) {
        keep = i + 1;
        break;
      }
    }
  }
  // 4. min-p: drop tokens whose probability is below min_p × the top probability (w[0] = 1).
  if (p.min_p > 0.0) {
    int64_t m = 1;
    while (m < keep && w[m] >= p.min_p) ++m;
    keep = m;
  }
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += w[i];
  // 5. Inverse CDF with one Philox draw: first i whose running sum exceeds u × kept.
  const double u = kernels::PhiloxUniform(p.seed, step, /*stream=*/0);
  const double target = u * kept;
  double cum = 0;
  int64_t chosen = keep - 1;
  for (int64_t i = 0; i < keep; ++i) {
    cum += w[i];
    if (cum > target) {
      chosen = i;
      break;
    }
  }
  r.token = ids[chosen];
  r.probability = w[chosen] / kept;
  r.uniform = u;
  r.candidates = keep;
  return r;
}

}  // namespace lockstep::engine
