// engine/tap.cc — see tap.h.
#include "engine/tap.h"

#include <vector>

namespace lockstep::engine {

void TapHook::OnStepTaps(std::span<const TapEvent> events, std::span<const TapSegment> segments) {
  std::vector<TapEvent> summaries;  // consecutive summary-only events, handed over together
  auto flush = [&] {
    if (!summaries.empty()) OnTapSummaries(summaries);
    summaries.clear();
  };
  for (const TapEvent& e : events) {
    const int64_t row_bytes = e.cols * (e.dtype == TapDType::kBf16 ? 2 : e.dtype == TapDType::kFp8E4m3 ? 1 : 4);
    int64_t row0 = 0;
    for (const TapSegment& s : segments) {
      TapEvent one = e;
      one.request_id = s.request_id;
      one.position = s.position;
      one.rows = s.rows;
      if (e.data != nullptr) one.data = static_cast<const char*>(e.data) + row0 * row_bytes;
      if (e.summaries != nullptr) one.summaries = e.summaries + row0;
      row0 += s.rows;
      if (one.data == nullptr && one.summaries != nullptr) {
        summaries.push_back(std::move(one));
      } else {
        flush();
        OnTap(one);
      }
    }
  }
  flush();
}

}  // namespace lockstep::engine
