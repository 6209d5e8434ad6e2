// recorder/capture_policy.h — what a recording keeps: `--capture full|summary|none` and the
// filters (tap-name globs, layer range, position range and stride, KV cache on/off, logits).
//
// full     tensor bodies + per-row summaries (statistics and a 64-bit content hash)
// summary  summaries only: tiny, enough for a replay to prove bit-exactness or find the
//          first tensor that differs
// none     no tensors; tokens, sampler records, batches and meta only
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace lockstep::recorder {

struct CapturePolicy {
  enum class Mode { kNone, kSummary, kFull };
  enum class Logits { kAuto, kFull, kTopK };

  Mode mode = Mode::kFull;
  std::vector<std::string> taps;  // fnmatch globs on tap names; empty = every tap
  int64_t layer_first = 0, layer_last = std::numeric_limits<int64_t>::max();   // inclusive
  int64_t pos_first = 0, pos_last = std::numeric_limits<int64_t>::max();       // inclusive
  int64_t pos_stride = 1;        // keep positions p with (p - pos_first) % stride == 0
  bool kv = true;                // the KV cache as stored
  Logits logits = Logits::kAuto; // auto: every logit when vocab ≤ full_logits_max_vocab, else top-k
  int64_t logits_topk = 32;
  int64_t full_logits_max_vocab = 4096;

  // "full" | "summary" | "none".
  static Result<Mode> ParseMode(std::string_view s);
  static std::string_view ModeName(Mode m);
  // "A:B" (inclusive), "A:" or "A" → [first, last]; `what` names the flag in errors.
  static Status ParseRange(std::string_view s, const char* what, int64_t* first, int64_t* last);

  // The layer a tap or cache name belongs to ("layers.3.attn.out" → 3), or -1.
  static int64_t LayerOf(std::string_view name);
  // Whether a tap (by name) is captured at all; KV names pass only the layer filter.
  bool WantsTap(std::string_view name) const;
  bool WantsKvLayer(int64_t layer) const;
  bool WantsPosition(int64_t pos) const {
    // (Asked for every row of every tap: the division only when there is a stride.)
    return pos >= pos_first && pos <= pos_last && (pos_stride == 1 || (pos - pos_first) % pos_stride == 0);
  }
  bool StoreLogitsInFull(int64_t vocab) const {
    return logits == Logits::kFull || (logits == Logits::kAuto && vocab <= full_logits_max_vocab);
  }
  // A JSON object describing the policy (stored in the trace's meta).
  std::string ToJson() const;
};

}  // namespace lockstep::recorder
