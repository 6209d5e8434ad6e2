// engine/sampler.cc — see docs/sampling.md for the normative description.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/hidden_fault.h"
#include "kernels/philox.h"

namespace lockstep::engine {

namespace {

// Larger float ⇔ larger value; −0 and +0 map alike (the order compares them equal). NaN never
// reaches here (it reads as −∞).
uint32_t OrderedBits(float f) {
  if (f == 0.0f) f = 0.0f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Ascending sort of unique keys: LSD radix for large vocabularies (129k: a few times faster
// than a comparison sort), std::sort below that. The keys arrive in id order (their low half),
// so the radix passes over the low half would leave them as they are: two stable passes over
// the logit half give the whole keys' order.
void SortKeys(std::vector<uint64_t>* keys) {
  const size_t n = keys->size();
  if (n < (size_t{1} << 15)) {
    std::sort(keys->begin(), keys->end());
    return;
  }
  std::vector<uint64_t> tmp(n);
  std::vector<uint32_t> count(size_t{1} << 16);
  uint64_t* src = keys->data();
  uint64_t* dst = tmp.data();
  for (int pass = 2; pass < 4; ++pass) {
    const int shift = 16 * pass;
    std::fill(count.begin(), count.end(), 0u);
    for (size_t i = 0; i < n; ++i) ++count[(src[i] >> shift) & 0xffffu];
    uint32_t sum = 0;
    for (uint32_t& c : count) {
      const uint32_t v = c;
      c = sum;
      sum += v;
    }
    for (size_t i = 0; i < n; ++i) dst[count[(src[i] >> shift) & 0xffffu]++] = src[i];
    std::swap(src, dst);
  }
  // Two passes: the sorted keys are back in *keys.
}

}  // namespace

std::vector<int32_t> Sampler::Candidates(std::span<const float> logits, int64_t top_k) {
  // Unique 64-bit keys (order-preserving logit bits, inverted, then the id): any sort of them
  // gives the one documented order; radix for large vocabularies.
  const int64_t n = static_cast<int64_t>(logits.size());
  auto val = [&](int64_t i) { return std::isnan(logits[i]) ? -INFINITY : logits[i]; };
  std::vector<uint64_t> keys(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = (static_cast<uint64_t>(~OrderedBits(val(i))) << 32) | static_cast<uint32_t>(i);
  int64_t k = n;
  if (top_k > 0 && top_k < n) {
    k = top_k;
    std::partial_sort(keys.begin(), keys.begin() + k, keys.end());
  } else {
    SortKeys(&keys);
  }
  std::vector<int32_t> ids(k);
  for (int64_t i = 0; i < k; ++i) ids[i] = static_cast<int32_t>(keys[i] & 0xffffffffu);
  return ids;
}

SampleResult Sampler::Sample(std::span<const float> logits, const SamplingParams& p, uint64_t step) {
  SampleResult r;
  r.counter = step;
  const int64_t n = static_cast<int64_t>(logits.size());
  if (n == 0) return r;
  // NaN logits never win: they are treated as −∞.
  auto val = [&](int64_t i) { return std::isnan(logits[i]) ? -INFINITY : logits[i]; };
  if (p.temperature <= 0.0) {
    int64_t best = 0;
    float best_v = val(0);
    for (int64_t i = 1; i < n; ++i) {
      const float v = logits[i];
      if (v > best_v) {  // NaN compares false: never chosen
        best_v = v;
        best = i;
      }
    }
    r.token = static_cast<int32_t>(best);
    r.candidates = 1;
    return r;
  }
  // 1. Candidates sorted by logit descending, id ascending on ties.
  const std::vector<int32_t> ids = Candidates(logits, p.top_k);
  const int64_t k = static_cast<int64_t>(ids.size());
  // 2. Unnormalised probabilities in fp64: w_i = exp((l_i − l_max) / T), and their total.
  // The weights descend, so once adding the next one leaves the running sum unchanged no later
  // one changes it either (rounding is monotone: s ≤ s + w_j ≤ s + w_i = s for 0 ≤ w_j ≤ w_i):
  // from index `settled` on every prefix sum is `total`, and weights past it are computed only
  // when a later step asks for one. Exact, not an approximation.
  const double lmax = val(ids[0]);
  std::vector<double> w;
  w.reserve(static_cast<size_t>(std::min<int64_t>(k, 4096)));
  auto w_at = [&](int64_t i) {
    while (static_cast<int64_t>(w.size()) <= i) {
      w.push_back(std::exp((static_cast<double>(val(ids[w.size()])) - lmax) / p.temperature));
    }
    return w[static_cast<size_t>(i)];
  };
  double total = 0;
  int64_t settled = k;
  for (int64_t i = 0; i < k; ++i) {
    const double wi = w_at(i);
    if (total + wi == total) {
      settled = i;
      break;
    }
    total += wi;
  }
  // 3. top-p: the shortest prefix whose mass reaches top_p (at least one token).
  int64_t keep = k;
  if (p.top_p < 1.0) {
    double cum = 0;
    for (int64_t i = 0; i < k; ++i) {
      cum += w_at(i);
      if (cum >= p.top_p * total) {
        keep = i + 1;
        break;
      }
    }
  }
  // 4. min-p: drop tokens whose probability is below min_p × the top probability (w[0] = 1).
  if (p.min_p > 0.0) {
    int64_t m = 1;
    while (m < keep && w_at(m) >= p.min_p) ++m;
    keep = m;
  }
  double kept = 0;  // the prefix sum of `keep` weights: `total` once past `settled`
  if (keep > settled) {
    kept = total;
  } else {
    for (int64_t i = 0; i < keep; ++i) kept += w[i];
  }
  // 5. Inverse CDF with one Philox draw: first i whose running sum exceeds u × kept.
  const double u = kernels::PhiloxUniform(p.seed, step, /*stream=*/0);
  // Hidden fault zoo (kernels/hidden_fault.h): the draw scaled by the total mass, not the kept one.
  const double target = u * (kernels::HiddenFaultOrNone() == kernels::HiddenFault::kSamplerCdfTotalMass ? total : kept);
  double cum = 0;
  int64_t chosen = keep - 1;
  for (int64_t i = 0; i < keep && i <= settled; ++i) {  // past `settled` the running sum stays put
    cum += w_at(i);
    if (cum > target) {
      chosen = i;
      break;
    }
  }
  r.token = ids[chosen];
  r.probability = w_at(chosen) / kept;
  r.uniform = u;
  r.candidates = keep;
  return r;
}

}  // namespace lockstep::engine
