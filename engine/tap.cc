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
    int64_t row0 = 0;
    for (const TapSegment& s : segments) {
      TapEvent one = SegmentEvent(e, s, row0);
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
