// recorder/capture_policy.cc — see capture_policy.h.
#include "recorder/capture_policy.h"

#include <fnmatch.h>

#include <charconv>

#include <nlohmann/json.hpp>

namespace lockstep::recorder {

Result<CapturePolicy::Mode> CapturePolicy::ParseMode(std::string_view s) {
  if (s == "full") return Mode::kFull;
  if (s == "summary") return Mode::kSummary;
  if (s == "none") return Mode::kNone;
  return Status::InvalidArgument("--capture: '" + std::string(s) + "' is not one of full, summary, none");
}

std::string_view CapturePolicy::ModeName(Mode m) {
  switch (m) {
    case Mode::kFull: return "full";
    case Mode::kSummary: return "summary";
    case Mode::kNone: return "none";
  }
  return "?";
}

Status CapturePolicy::ParseRange(std::string_view s, const char* what, int64_t* first, int64_t* last) {
  auto num = [&](std::string_view t, int64_t* out) {
    auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), *out);
    return ec == std::errc() && p == t.data() + t.size() && *out >= 0;
  };
  const size_t colon = s.find(':');
  int64_t a = 0, b = std::numeric_limits<int64_t>::max();
  bool ok = true;
  if (colon == std::string_view::npos) {
    ok = num(s, &a);
    b = a;
  } else {
    if (colon > 0) ok = num(s.substr(0, colon), &a);
    if (ok && colon + 1 < s.size()) ok = num(s.substr(colon + 1), &b);
  }
  if (!ok || a > b) {
    return Status::InvalidArgument(std::string(what) + ": '" + std::string(s) +
                                   "' is not a range like 2:5, 3: or 7 (inclusive, non-negative)");
  }
  *first = a;
  *last = b;
  return Status::Ok();
}

int64_t CapturePolicy::LayerOf(std::string_view name) {
  constexpr std::string_view kPrefix = "layers.";
  if (name.substr(0, kPrefix.size()) != kPrefix) return -1;
  int64_t layer = -1;
  const char* b = name.data() + kPrefix.size();
  auto [p, ec] = std::from_chars(b, name.data() + name.size(), layer);
  return ec == std::errc() && p != b ? layer : -1;
}

bool CapturePolicy::WantsTap(std::string_view name) const {
  if (mode == Mode::kNone) return false;
  const int64_t layer = LayerOf(name);
  if (layer >= 0 && (layer < layer_first || layer > layer_last)) return false;
  if (taps.empty()) return true;
  const std::string n(name);
  for (const auto& g : taps) {
    if (fnmatch(g.c_str(), n.c_str(), 0) == 0) return true;
  }
  return false;
}

bool CapturePolicy::WantsKvLayer(int64_t layer) const {
  return mode != Mode::kNone && kv && layer >= layer_first && layer <= layer_last;
}

std::string CapturePolicy::ToJson() const {
  nlohmann::json j;
  j["mode"] = ModeName(mode);
  j["taps"] = taps;
  j["layers"] = {layer_first, layer_last};
  j["positions"] = {pos_first, pos_last};
  j["position_stride"] = pos_stride;
  j["kv"] = kv;
  j["logits"] = logits == Logits::kAuto ? "auto" : logits == Logits::kFull ? "full" : "topk";
  j["logits_topk"] = logits_topk;
  j["full_logits_max_vocab"] = full_logits_max_vocab;
  return j.dump();
}

}  // namespace lockstep::recorder
