// tests/traces/row_stats_test.cc — kernels/row_stats.h + kernels/xxh3.h (the host/device code a
// GPU backend will summarise tap rows with) give exactly traces::Summarize's SummaryRow fields:
// fp32 rows (finite; with signed zeros at the extremes; with NaN and ±Inf; all non-finite;
// empty) and int32 rows, at tap-like widths. Bitwise: rms is compared bit for bit in traces.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kernels/row_stats.h"
#include "kernels/xxh3.h"
#include "traces/row_summary.h"

namespace lockstep {
namespace {

bool Same(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

void ExpectSame(const traces::SummaryRow& want, const kernels::RowStats& got, uint64_t hash, const std::string& what) {
  EXPECT_EQ(want.hash, hash) << what;
  EXPECT_EQ(want.nan_count, got.nan_count) << what;
  EXPECT_EQ(want.inf_count, got.inf_count) << what;
  EXPECT_TRUE(Same(want.rms, got.rms)) << what << ": rms " << want.rms << " vs " << got.rms;
  EXPECT_TRUE(Same(want.absmax, got.absmax)) << what << ": absmax";
  EXPECT_TRUE(Same(want.min, got.min)) << what << ": min " << want.min << " vs " << got.min;
  EXPECT_TRUE(Same(want.max, got.max)) << what << ": max " << want.max << " vs " << got.max;
}

TEST(RowStats, EqualsSummarizeOnFp32Rows) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int64_t cols : {0, 1, 3, 7, 64, 513, 2048, 7168}) {
    for (int kind = 0; kind < 6; ++kind) {
      std::vector<float> row(cols);
      for (auto& v : row) v = nd(rng);
      if (kind == 1 && cols > 0) {  // non-negative with a −0 then +0 minimum: the first zero wins
        for (auto& v : row) v = std::fabs(v) + 1.0f;
        row[cols / 2] = -0.0f;
        row[cols - 1] = 0.0f;
      }
      if (kind == 2 && cols > 2) {
        row[1] = std::nanf("");
        row[cols - 1] = -INFINITY;
      }
      if (kind == 3) {
        for (auto& v : row) v = INFINITY;
      }
      if (kind == 4 && cols > 0) row[0] = 3.0e38f;  // squares overflow fp32, not fp64
      if (kind == 5) {
        for (auto& v : row) v = std::nanf("");
      }
      traces::SummaryRow want;
      traces::Summarize(traces::DType::kF32, row.data(), cols, &want);
      const auto got = kernels::RowStatsF32(row.data(), cols);
      const uint64_t hash = kernels::xxh3::Hash64(reinterpret_cast<const uint8_t*>(row.data()), cols * 4, XXH3_kSecret);
      ExpectSame(want, got, hash, "f32 cols " + std::to_string(cols) + " kind " + std::to_string(kind));
    }
  }
}

TEST(RowStats, EqualsSummarizeOnInt32Rows) {
  std::mt19937 rng(4);
  for (int64_t cols : {0, 1, 6, 64, 2048}) {
    std::vector<int32_t> row(cols);
    for (auto& v : row) v = static_cast<int32_t>(rng()) >> static_cast<int>(rng() % 31);
    traces::SummaryRow want;
    traces::Summarize(traces::DType::kI32, row.data(), cols, &want);
    const auto got = kernels::RowStatsI32(row.data(), cols);
    const uint64_t hash = kernels::xxh3::Hash64(reinterpret_cast<const uint8_t*>(row.data()), cols * 4, XXH3_kSecret);
    ExpectSame(want, got, hash, "i32 cols " + std::to_string(cols));
  }
}

}  // namespace
}  // namespace lockstep
