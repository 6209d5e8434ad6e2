// tests/tap_capture_test.cc — HostTapCapture (engine/tap_capture.h), the CPU forward passes' tap
// capture, against hand-made steps: each segment's rows reach the hook as one event with its
// request, position and bytes; strided rows arrive as the contiguous ones would; grafting writes
// back only where the hook asks for it; nothing happens without a hook.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "engine/tap_capture.h"

namespace lockstep::engine {
namespace {

struct Seen {
  std::string name;
  int64_t request, position, rows, cols;
  std::vector<float> values;
};

class RecordingHook : public TapHook {
 public:
  void OnTap(const TapEvent& e) override {
    const auto* f = static_cast<const float*>(e.data);
    events.push_back({std::string(e.name), e.request_id, e.position, e.rows, e.cols,
                      std::vector<float>(f, f + e.rows * e.cols)});
  }
  bool WantsOverride() const override { return graft; }
  bool Override(const TapEvent& e, void* data) override {
    ++overrides;
    if (e.request_id != 8) return false;  // grafts request 8 only
    auto* f = static_cast<float*>(data);
    for (int64_t i = 0; i < e.rows * e.cols; ++i) f[i] = -1.0f;
    return true;
  }
  std::vector<Seen> events;
  bool graft = false;
  int overrides = 0;
};

// Two segments: request 7 with 3 rows from position 4, request 8 with 1 row at position 10.
struct TwoSegments {
  std::vector<int32_t> t7{1, 2, 3}, t8{4};
  std::vector<Segment> segs;
  std::vector<int64_t> row0{0, 3};
  TwoSegments() {
    segs.resize(2);
    segs[0].request_id = 7;
    segs[0].tokens = t7;
    segs[0].start_pos = 4;
    segs[1].request_id = 8;
    segs[1].tokens = t8;
    segs[1].start_pos = 10;
  }
};

TEST(HostTapCapture, EachSegmentsRowsAreOneEvent) {
  TwoSegments s;
  RecordingHook hook;
  HostTapCapture taps(&hook, s.segs, s.row0);
  const std::vector<float> x = {0, 1, 2, 3, 4, 5, 6, 7};  // [4 rows, 2 cols]
  ASSERT_TRUE(taps.Tap("layers.0.attn_norm", x.data(), 2, 2, TapDType::kF32).ok());
  ASSERT_EQ(hook.events.size(), 2u);
  EXPECT_EQ(hook.events[0].name, "layers.0.attn_norm");
  EXPECT_EQ(hook.events[0].request, 7);
  EXPECT_EQ(hook.events[0].position, 4);
  EXPECT_EQ(hook.events[0].rows, 3);
  EXPECT_EQ(hook.events[0].values, (std::vector<float>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(hook.events[1].request, 8);
  EXPECT_EQ(hook.events[1].position, 10);
  EXPECT_EQ(hook.events[1].values, (std::vector<float>{6, 7}));
  taps.EmitRow("layers.1.attn.compressor.entry", 1, 11, x.data() + 2, 2);
  ASSERT_EQ(hook.events.size(), 3u);
  EXPECT_EQ(hook.events[2].request, 8);
  EXPECT_EQ(hook.events[2].position, 11);
  EXPECT_EQ(hook.events[2].values, (std::vector<float>{2, 3}));
  EXPECT_TRUE(taps.Flush().ok());
}

TEST(HostTapCapture, StridedRowsArriveAsTheContiguousOnes) {
  TwoSegments s;
  RecordingHook a, b;
  HostTapCapture ta(&a, s.segs, s.row0), tb(&b, s.segs, s.row0);
  // k_rope inside kv: columns 3..4 of rows 5 wide.
  std::vector<float> kv(4 * 5), krope(4 * 2);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 5; ++c) kv[r * 5 + c] = static_cast<float>(10 * r + c);
    krope[r * 2] = kv[r * 5 + 3];
    krope[r * 2 + 1] = kv[r * 5 + 4];
  }
  ASSERT_TRUE(ta.Tap("layers.0.attn.k_rope", kv.data() + 3, 2, 5, TapDType::kF32).ok());
  ASSERT_TRUE(tb.Tap("layers.0.attn.k_rope", krope.data(), 2, 2, TapDType::kF32).ok());
  ASSERT_EQ(a.events.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(a.events[i].values, b.events[i].values) << i;
  EXPECT_FALSE(ta.Tap("bad", kv.data(), 5, 2, TapDType::kF32).ok());  // a stride below the width
}

TEST(HostTapCapture, OverrideWritesBackOnlyWhereTheHookGrafts) {
  TwoSegments s;
  RecordingHook hook;
  HostTapCapture taps(&hook, s.segs, s.row0);
  std::vector<float> x = {0, 1, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE(taps.Override("layers.0.resid_out", x.data(), 2).ok());
  EXPECT_EQ(hook.overrides, 0);  // the hook does not graft: not even asked
  hook.graft = true;
  ASSERT_TRUE(taps.Override("layers.0.resid_out", x.data(), 2).ok());
  EXPECT_EQ(hook.overrides, 2);
  EXPECT_EQ(x, (std::vector<float>{0, 1, 2, 3, 4, 5, -1, -1}));  // request 8's row only
}

TEST(HostTapCapture, WithoutAHookNothingHappens) {
  TwoSegments s;
  HostTapCapture taps(nullptr, s.segs, s.row0);
  EXPECT_FALSE(taps.active());
  std::vector<float> x(8, 1.0f);
  EXPECT_TRUE(taps.Tap("embed", x.data(), 2, 2, TapDType::kF32).ok());
  EXPECT_TRUE(taps.Override("embed", x.data(), 2).ok());
  EXPECT_EQ(x, std::vector<float>(8, 1.0f));
}

}  // namespace
}  // namespace lockstep::engine
