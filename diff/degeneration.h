// diff/degeneration.h — is a generation degenerate? The detector `lockstep degen`, the
// server's capture trigger and docs/models.md all use (docs/models.md defines it; the Python
// twin is tools/train-tiny-model/train.py's `degeneration`, and both must agree).
//
// On the last `window` generated token ids (all of them when fewer; N = how many):
//   loop     — for some period n ≤ max_period, the longest n-periodic suffix (ids[i] ==
//              ids[i+n] throughout), of length L, is either
//                long:     ≥ 2 repeats of the unit (L ≥ 2n) covering ≥ `cover` of N, or
//                repeated: ≥ `repeats` repeats (L ≥ repeats·n) covering ≥ `repeat_cover` of N.
//              The second rule is the one a reader's eye uses: a line seen four times in a
//              row at the end of the text is a loop even when the text before it is long
//              (issue 28: a 10-token `@import` line 5 times over the last 50 of 128 tokens
//              covers 39 %, which the first rule alone missed until ~200 tokens).
//   collapse — distinct n-grams / all n-grams (n = `ngram`) in the window < `distinct_min`.
// degenerate = loop or collapse. Both rules scale with N, so a completion shorter than the
// window needs proportionally less of a loop (a 64-token one: 16 tokens, 4 repeats).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace lockstep::diff {

struct DegenerationParams {
  int64_t window = 128;
  int64_t max_period = 32;
  double cover = 0.5;          // of N, with ≥ 2 repeats
  int64_t repeats = 4;         // full repeats of the unit for the second rule …
  double repeat_cover = 0.25;  // … and the part of N they must cover
  int64_t ngram = 4;
  double distinct_min = 0.3;
};

struct Degeneration {
  int64_t period = 0;        // n of the periodic suffix that fired the loop (none: the
                             // longest one; 0: no suffix repeats twice)
  int64_t periodic_len = 0;  // its length in tokens
  double repeats = 0;        // periodic_len / period: how many times the unit repeats
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
