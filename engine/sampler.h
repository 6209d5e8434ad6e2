// engine/sampler.h — turns one row of logits into a token, reproducibly.
//
// The algorithm is specified in docs/sampling.md, step by step, because the CUDA sampler
// must reproduce it bit for bit: same logits in, same token out. Its randomness is one
// Philox4x32-10 draw keyed by the request's seed and counted by the decode step, so there is
// no hidden state: step n can be replayed alone.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace lockstep::engine {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (argmax, lowest id on ties)
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // 1: off
  double min_p = 0.0;        // 0: off
  uint64_t seed = 0;
};

struct SampleResult {
  int32_t token = -1;
  double probability = 1.0;  // of the chosen token under the final (filtered) distribution
  double uniform = -1.0;     // the Philox draw used; −1 when greedy
  uint64_t counter = 0;      // the step counter the draw was keyed with
  int64_t candidates = 0;    // tokens left after top-k / top-p / min-p
};

class Sampler {
 public:
  // `step` is the index of the generated token within its request (0 for the first).
  static SampleResult Sample(std::span<const float> logits, const SamplingParams& p, uint64_t step);
  // Step 1 of docs/sampling.md: the first min(top_k, n) token ids (all when top_k is 0) by logit
  // descending, id ascending on ties, NaN as −∞ and −0 equal to +0.
  static std::vector<int32_t> Candidates(std::span<const float> logits, int64_t top_k);
};

}  // namespace lockstep::engine
