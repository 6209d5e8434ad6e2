// diff/metrics.h — the one comparison oracle: how two runs' tensors and logits differ.
//
// Used by the replayer's verifier, `lockstep diff`, `bisect` and the tests, so that "how far
// apart" means the same thing everywhere. Pure functions over spans: no traces, no models.
// Thresholds and their defaults are documented in docs/diff.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>

namespace lockstep::diff {

// Elementwise comparison of two equally long rows (one position of one tap).
struct TensorDiff {
  int64_t n = 0;
  bool bit_equal = true;       // every element has the same bits (NaN payloads included)
  double max_abs = 0;          // max |a − b| over elements where both are finite
  int64_t max_abs_index = -1;
  double rel_l2 = 0;           // ‖a − b‖₂ / ‖b‖₂ (b is the reference); 0 when both are zero
  double cosine = 1;           // a·b / (‖a‖‖b‖); 1 when both are zero
  double sqnr_db = INFINITY;   // 10·log10(‖b‖² / ‖a − b‖²); +inf when equal
  int64_t nonfinite_mismatch = 0;  // positions where exactly one side is NaN/Inf, or they differ in kind
};

// a: the candidate, b: the reference.
TensorDiff CompareRows(std::span<const float> a, std::span<const float> b);

// Comparison of two logit rows as distributions (softmax at temperature 1).
struct LogitDiff {
  double kl = 0;               // KL(p_ref ‖ p_cand) in nats
  bool top1_agree = true;      // same argmax (lowest id on ties)
  int32_t top1_ref = -1, top1_cand = -1;
  double chosen_prob_ref = 0;  // probability of `chosen` under each
  double chosen_prob_cand = 0;
  bool chosen_known = false;   // a chosen token was given (else the two above mean nothing)
};

// `chosen`: the token the reference run emitted at this step (−1: unknown).
LogitDiff CompareLogits(std::span<const float> cand, std::span<const float> ref, int32_t chosen);

// When a difference counts as a divergence (defaults: docs/diff.md).
struct Thresholds {
  double rel_l2 = 1e-3;    // activations: relative L2 error above this diverges
  double kl = 1e-3;        // logits: KL above this diverges
  bool exact = false;      // any bit difference diverges (exact replay)
};

bool Diverges(const TensorDiff& d, const Thresholds& t);
bool Diverges(const LogitDiff& d, const Thresholds& t);

}  // namespace lockstep::diff
