// diff/degeneration.h — is a generation degenerate? The detector `lockstep degen`, the
// server's capture trigger and docs/models.md all use (docs/models.md defines it; the Python
// twin is tools/train-tiny-model/train.py's `degeneration`, and both must agree).
//
// On the last `window` generated token ids:
//   loop     — the longest suffix that is n-periodic for some n ≤ max_period (ids[i] ==
//              ids[i+n]), spanning at least 2n tokens, covers ≥ `cover` of the window;
//   collapse — distinct n-grams / all n-grams (n = `ngram`) in the window < `distinct_min`.
// degenerate = loop or collapse.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace lockstep::diff {

struct DegenerationParams {
  int64_t window = 128;
  int64_t max_period = 32;
  double cover = 0.5;
  int64_t ngram = 4;
  double distinct_min = 0.3;
};

struct Degeneration {
  int64_t period = 0;        // n of the longest periodic suffix (0: none)
  int64_t periodic_len = 0;  // its length in tokens
  bool loop = false;
  double distinct = 1.0;     // distinct-n-gram ratio of the window
  bool collapse = false;
  bool degenerate = false;
};

Degeneration DetectDegeneration(std::span<const int32_t> ids, const DegenerationParams& p = {});

// Two more signals `lockstep degen` reports beside the detector above:
// zstd compressibility — compressed / raw size of the generated text at level 3 (looping text
// compresses far better than prose or code: < 0.15 on ≥ 256 bytes counts as degenerate), and
// entropy collapse — the mean entropy (nats) of the model's next-token distribution (at
// temperature 1) over the last `tail` steps (< 0.1: the model has become certain of its loop).
double ZstdRatio(std::string_view text);
double Entropy(std::span<const float> logits);  // of softmax(logits), in nats

struct TextSignals {
  double zstd_ratio = 1.0;
  bool compressible = false;
  double tail_entropy = 0.0;
  bool entropy_collapse = false;
};
TextSignals JudgeText(std::string_view text, std::span<const double> step_entropies, int64_t tail = 64);

}  // namespace lockstep::diff
