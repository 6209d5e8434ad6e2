// tests/traces/row_stats_test.cc — kernels/row_stats.h + kernels/xxh3.h (the host/device code a
// GPU backend will summarise tap rows with) give exactly traces::Summarize's SummaryRow fields:
// fp32 rows (finite; with signed zeros at the extremes; with NaN and ±Inf; all non-finite;
// empty), int32 rows, and bf16 / E4M3 rows (the KV cache as stored), at tap-like widths. Bitwise: rms is compared bit for bit in traces.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
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

// bf16 and E4M3 rows (a device backend's summaries of the KV cache as stored): every E4M3 byte
// decodes to Fp8E4m3ToFloat's float (NaN patterns to a NaN), every bf16 exponent/sign pattern
// to Bf16ToFloat's, and rows — random, with NaN / ±Inf / signed zeros / subnormals, empty — give
// Summarize's fields bit for bit, at the KV parts' widths (512-value latents, 64 rope values,
// 128-value index keys, 576-value bf16 latents) and odd ones.
TEST(RowStats, EqualsSummarizeOnBf16AndE4m3Rows) {
  for (int b = 0; b < 256; ++b) {
    const float want = traces::Fp8E4m3ToFloat(static_cast<uint8_t>(b)), got = kernels::Fp8E4m3Value(static_cast<uint8_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "e4m3 byte " << b;
    } else {
      EXPECT_TRUE(Same(want, got)) << "e4m3 byte " << b << ": " << want << " vs " << got;
    }
  }
  for (uint32_t h = 0; h < 65536; h += 7) {
    const float want = traces::Bf16ToFloat(static_cast<uint16_t>(h)), got = kernels::Bf16Value(static_cast<uint16_t>(h));
    EXPECT_EQ(std::memcmp(&want, &got, 4), 0) << "bf16 bits " << h;
  }
  std::mt19937 rng(5);
  for (int64_t cols : {0, 1, 5, 64, 128, 512, 576, 1000}) {
    for (int kind = 0; kind < 4; ++kind) {
      std::vector<uint8_t> e4(cols), bf(2 * cols);
      for (auto& v : e4) v = static_cast<uint8_t>(rng());
      for (auto& v : bf) v = static_cast<uint8_t>(rng());
      if (kind == 0) {  // no NaN / Inf: clear E4M3's NaN patterns and bf16's all-ones exponents
        for (auto& v : e4) v = (v & 0x7f) == 0x7f ? v & 0xfe : v;
        for (int64_t i = 0; i < cols; ++i) bf[2 * i + 1] &= 0xbf;
      }
      if (kind == 1 && cols > 0) {  // zeros of both signs and subnormals only
        for (int64_t i = 0; i < cols; ++i) {
          e4[i] &= 0x87;
          bf[2 * i + 1] &= 0x80;
        }
      }
      if (kind == 2 && cols > 1) {  // NaN and −Inf among finite values
        e4[1] = 0xff;
        bf[2] = 0xc0, bf[3] = 0x7f;       // bf16 quiet NaN
        bf[2 * cols - 2] = 0x80, bf[2 * cols - 1] = 0xff;  // −Inf
      }
      if (kind == 3) {
        for (auto& v : e4) v = 0x7f;
        for (int64_t i = 0; i < cols; ++i) bf[2 * i] = 0x80, bf[2 * i + 1] = 0x7f;  // +Inf
      }
      traces::SummaryRow want;
      const std::string what = " cols " + std::to_string(cols) + " kind " + std::to_string(kind);
      traces::Summarize(traces::DType::kFp8E4m3, e4.data(), cols, &want);
      ExpectSame(want, kernels::RowStatsFp8E4m3(e4.data(), cols),
                 kernels::xxh3::Hash64(e4.data(), static_cast<size_t>(cols), XXH3_kSecret), "e4m3" + what);
      traces::Summarize(traces::DType::kBf16, bf.data(), cols, &want);
      ExpectSame(want, kernels::RowStatsBf16(bf.data(), cols),
                 kernels::xxh3::Hash64(bf.data(), static_cast<size_t>(2 * cols), XXH3_kSecret), "bf16" + what);
    }
  }
}

// traces::LogitsTopK on hand-made rows: highest first, ties to the lower id, NaNs first (in id
// order), −inf last; logsumexp against the formula; k = cols sorts the whole row.
TEST(LogitsTopK, OrderTiesNansAndLogsumexp) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> row = {1.0f, 3.0f, nan, 3.0f, -inf, 2.5f, nan, 0.0f};
  std::vector<int32_t> ids(8);
  std::vector<float> vals(8);
  float lse = 0;
  traces::LogitsTopK(row.data(), 8, 4, ids.data(), vals.data(), &lse);
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 4), (std::vector<int32_t>{2, 6, 1, 3}));
  EXPECT_TRUE(std::isnan(vals[0]) && std::isnan(vals[1]));
  EXPECT_EQ(vals[2], 3.0f);
  EXPECT_TRUE(std::isnan(lse));  // NaN in the row: the sum is NaN
  traces::LogitsTopK(row.data(), 8, 8, ids.data(), vals.data(), &lse);
  EXPECT_EQ(ids, (std::vector<int32_t>{2, 6, 1, 3, 5, 0, 7, 4}));
  const std::vector<float> clean = {0.5f, -1.0f, 2.0f, 2.0f, -inf};
  traces::LogitsTopK(clean.data(), 5, 2, ids.data(), vals.data(), &lse);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 3);
  double sum = 0;  // in row order, as the definition
  for (double x : {0.5, -1.0, 2.0, 2.0}) sum += std::exp(x - 2.0);
  EXPECT_EQ(lse, static_cast<float>(2.0 + std::log(sum)));
}

}  // namespace
}  // namespace lockstep
