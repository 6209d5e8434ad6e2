// diff/metrics.cc — see metrics.h. Sums are in fp64 in index order.
#include "diff/metrics.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace lockstep::diff {

TensorDiff CompareRows(std::span<const float> a, std::span<const float> b) {
  TensorDiff d;
  d.n = static_cast<int64_t>(std::min(a.size(), b.size()));
  if (a.size() != b.size()) d.bit_equal = false;
  double diff2 = 0, aa = 0, bb = 0, ab = 0;
  for (int64_t i = 0; i < d.n; ++i) {
    const float x = a[i], y = b[i];
    if (std::memcmp(&x, &y, sizeof(float)) != 0) d.bit_equal = false;
    const bool fx = std::isfinite(x), fy = std::isfinite(y);
    if (!fx || !fy) {
      const bool same_kind = (std::isnan(x) && std::isnan(y)) || (!fx && !fy && x == y);
      if (!same_kind) d.nonfinite_mismatch++;
      continue;
    }
    const double e = static_cast<double>(x) - y;
    if (d.max_abs_index < 0 || std::fabs(e) > d.max_abs) {
      d.max_abs = std::fabs(e);
      d.max_abs_index = i;
    }
    diff2 += e * e;
    aa += static_cast<double>(x) * x;
    bb += static_cast<double>(y) * y;
    ab += static_cast<double>(x) * y;
  }
  d.rel_l2 = bb > 0 ? std::sqrt(diff2 / bb) : (diff2 > 0 ? INFINITY : 0.0);
  d.cosine = (aa > 0 && bb > 0) ? ab / std::sqrt(aa * bb) : (aa == bb ? 1.0 : 0.0);
  d.sqnr_db = diff2 > 0 ? 10.0 * std::log10(bb / diff2) : INFINITY;
  if (d.nonfinite_mismatch > 0) {
    d.rel_l2 = INFINITY;
    d.sqnr_db = -INFINITY;
  }
  return d;
}

namespace {
// log-softmax in fp64; NaN logits count as −∞.
std::vector<double> LogSoftmax(std::span<const float> l) {
  double m = -INFINITY;
  for (float x : l) {
    if (!std::isnan(x)) m = std::max(m, static_cast<double>(x));
  }
  double s = 0;
  for (float x : l) {
    if (!std::isnan(x)) s += std::exp(x - m);
  }
  const double lse = m + std::log(s);
  std::vector<double> out(l.size());
  for (size_t i = 0; i < l.size(); ++i) out[i] = std::isnan(l[i]) ? -INFINITY : l[i] - lse;
  return out;
}
int32_t Argmax(std::span<const float> l) {
  int32_t best = 0;
  for (size_t i = 1; i < l.size(); ++i) {
    if (!(l[i] <= l[best]) && !std::isnan(l[i])) best = static_cast<int32_t>(i);
  }
  return best;
}
}  // namespace

LogitDiff CompareLogits(std::span<const float> cand, std::span<const float> ref, int32_t chosen) {
  LogitDiff d;
  if (cand.size() != ref.size() || ref.empty()) {
    d.kl = INFINITY;
    d.top1_agree = false;
    return d;
  }
  // NaN on either side: the distributions cannot be compared, and that is as far apart as
  // two runs get (a NaN row is never "close").
  bool nan_ref = false, nan_cand = false;
  for (float x : ref) nan_ref |= std::isnan(x);
  for (float x : cand) nan_cand |= std::isnan(x);
  if (nan_ref || nan_cand) {
    d.kl = INFINITY;
    d.top1_ref = Argmax(ref);
    d.top1_cand = Argmax(cand);
    d.top1_agree = false;
    return d;
  }
  auto lp = LogSoftmax(ref), lq = LogSoftmax(cand);
  double kl = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (lp[i] == -INFINITY) continue;
    const double p = std::exp(lp[i]);
    kl += p * (lp[i] - lq[i]);  // lq = −∞ where p > 0 → +∞, as it should
  }
  d.kl = std::isnan(kl) ? INFINITY : std::max(0.0, kl);
  d.top1_ref = Argmax(ref);
  d.top1_cand = Argmax(cand);
  d.top1_agree = d.top1_ref == d.top1_cand;
  if (chosen >= 0 && static_cast<size_t>(chosen) < ref.size()) {
    d.chosen_known = true;
    d.chosen_prob_ref = std::exp(lp[chosen]);
    d.chosen_prob_cand = std::exp(lq[chosen]);
  }
  return d;
}

bool Diverges(const TensorDiff& d, const Thresholds& t) {
  if (t.exact) return !d.bit_equal;
  return d.nonfinite_mismatch > 0 || d.rel_l2 > t.rel_l2;
}

bool Diverges(const LogitDiff& d, const Thresholds& t) {
  if (t.exact) return d.kl != 0 || !d.top1_agree;
  return d.kl > t.kl || !d.top1_agree;
}

}  // namespace lockstep::diff
