// tests/timeline_write_test.cc — bench_gpu_decode --timeline's CSV and digest (bench/
// timeline_write.cc) on hand-made kernel spans: each kernel's share of the critical path (how far
// it moved the latest end), names shortened, the busy union and the idle gaps.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/gpu_timeline.h"

namespace lockstep::bench {
namespace {

KernelSpan Span(const char* name, uint64_t start_us, uint64_t end_us, uint32_t stream) {
  KernelSpan s;
  s.name = name;
  s.start_ns = start_us * 1000;
  s.end_ns = end_us * 1000;
  s.stream = stream;
  return s;
}

std::vector<std::string> Lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// A chain launched ahead (each kernel scheduled before its predecessor ends) beside a side
// stream kernel: A [0, 10); B [5, 14) waits for A; C [2, 8) on the side, inside A; D [20, 30)
// after 6 µs idle. In the order they end: C moves the end from 0 to 8 (8), A to 10 (2), B to 14
// (4, though its span is 9), D to 30 (16, the idle 6 included) — 30 µs, the wall span.
TEST(TimelineWrite, CriticalSharesAddUpToTheWallSpan) {
  const std::vector<KernelSpan> spans = {
      Span("_ZN8lockstep7kernels4cuda12_GLOBAL__N_17KernelAILi4EEEvi", 0, 10, 7),  // KernelA<4>(int)
      Span("C", 2, 8, 9),
      Span("B", 5, 14, 7),
      Span("D", 20, 30, 7),
  };
  const std::string csv = (std::filesystem::temp_directory_path() / "lockstep_timeline_test.csv").string();
  std::string digest;
  ASSERT_TRUE(WriteTimeline(spans, csv, 2, &digest).ok());
  const std::vector<std::string> lines = Lines(csv);
  std::filesystem::remove(csv);
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[0], "kernel,stream,start_us,duration_us,gap_us,grid,block,critical_us");
  EXPECT_EQ(lines[1], "\"KernelA<4>\",7,0.000,10.000,0.000,0x0x0,0x0x0,2.000");
  EXPECT_EQ(lines[2], "\"C\",9,2.000,6.000,0.000,0x0x0,0x0x0,8.000");
  EXPECT_EQ(lines[3], "\"B\",7,5.000,9.000,0.000,0x0x0,0x0x0,4.000");
  EXPECT_EQ(lines[4], "\"D\",7,20.000,10.000,6.000,0x0x0,0x0x0,16.000");
  // Per step (2 steps): wall 15, busy (the union, 24 µs) 12, idle 3; rows by critical share.
  EXPECT_NE(digest.find("per step 15.0 µs from the first kernel's start to the last's end, GPU busy 12.0 µs (80%), "
                        "idle between kernels 3.0 µs"),
            std::string::npos)
      << digest;
  const size_t d = digest.find("  D\n"), c = digest.find("  C\n"), b = digest.find("  B\n"),
               a = digest.find("  KernelA<4>\n");
  ASSERT_TRUE(d != std::string::npos && c != std::string::npos && b != std::string::npos && a != std::string::npos)
      << digest;
  EXPECT_LT(d, c);
  EXPECT_LT(c, b);
  EXPECT_LT(b, a);
  EXPECT_NE(digest.find("               8.0           5.0         0.5    10.00  D\n"), std::string::npos) << digest;
}

TEST(TimelineWrite, NamesTheFileItCannotWriteAndRefusesNoSpans) {
  std::string digest;
  const Status none = WriteTimeline({}, "/tmp/x.csv", 1, &digest);
  EXPECT_FALSE(none.ok());
  const Status bad = WriteTimeline({Span("A", 0, 1, 1)}, "/nonexistent-dir/t.csv", 1, &digest);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("/nonexistent-dir/t.csv"), std::string::npos) << bad.message();
}

}  // namespace
}  // namespace lockstep::bench
