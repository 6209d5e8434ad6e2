// tests/traces/row_stats_test.cc — kernels/row_stats.h + kernels/xxh3.h (the host/device code a
// GPU backend will summarise tap rows with) give exactly traces::Summarize's SummaryRow fields:
// fp32 rows (finite; with signed zeros at the extremes; with NaN and ±Inf; all non-finite;
// empty), int32 rows, and bf16 / E4M3 rows (the KV cache as stored), at tap-like widths. Bitwise: rms is compared bit for bit in traces.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <algorithm>
#include <random>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kernels/cpu/numerics.h"
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
// decodes to the CPU engine's float (kernels/cpu/numerics.h; NaN patterns to a NaN), every bf16
// exponent/sign pattern to its Bf16ToF32's, and rows — random, with NaN / ±Inf / signed zeros /
// subnormals, empty — give Summarize's fields bit for bit, at the KV parts' widths (512-value
// latents, 64 rope values, 128-value index keys, 576-value bf16 latents) and odd ones.
TEST(RowStats, EqualsSummarizeOnBf16AndE4m3Rows) {
  for (int b = 0; b < 256; ++b) {
    const float want = kernels::Fp8E4m3ToF32(static_cast<uint8_t>(b)), got = kernels::Fp8E4m3Value(static_cast<uint8_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "e4m3 byte " << b;
    } else {
      EXPECT_TRUE(Same(want, got)) << "e4m3 byte " << b << ": " << want << " vs " << got;
    }
  }
  for (uint32_t h = 0; h < 65536; h += 7) {
    const float want = kernels::Bf16ToF32(static_cast<uint16_t>(h)), got = kernels::Bf16Value(static_cast<uint16_t>(h));
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
  long double sum = 0;  // the exact value, rounded once
  for (long double x : {0.5L, -1.0L, 2.0L, 2.0L}) sum += std::exp(x - 2.0L);
  EXPECT_EQ(lse, static_cast<float>(2.0L + std::log(sum)));
  // No finite value: NaN for a NaN / +inf row, −inf for an empty one.
  const std::vector<float> all_nan = {nan, nan}, with_inf = {1.0f, inf};
  traces::LogitsTopK(all_nan.data(), 2, 1, ids.data(), vals.data(), &lse);
  EXPECT_TRUE(std::isnan(lse));
  traces::LogitsTopK(with_inf.data(), 2, 1, ids.data(), vals.data(), &lse);
  EXPECT_TRUE(std::isnan(lse));
  EXPECT_EQ(ids[0], 1);
  traces::LogitsTopK(nullptr, 0, 0, ids.data(), vals.data(), &lse);
  EXPECT_EQ(lse, -inf);
}

// LseExp and LseLog (logsumexp's e^t and ln x, lockstep's own so that every machine derives the
// same bits) against long-double libm: within 2 ulp of the double over their range, exact at
// 0 and 1, and the edges (underflow to 0 below −708, +inf above 709, NaN kept).
TEST(LogitsTopK, ExpAndLogAreWithinTwoUlp) {
  auto ulps = [](double got, long double want) {
    const double w = static_cast<double>(want);
    const double ulp = std::nextafter(std::fabs(w), INFINITY) - std::fabs(w);
    return static_cast<double>(std::fabs(static_cast<long double>(got) - want) / ulp);
  };
  std::mt19937_64 rng(12);
  std::uniform_real_distribution<double> te(-708.0, 709.0), tn(-40.0, 0.0);
  double worst = 0;
  for (int i = 0; i < 400000; ++i) {
    const double t = i % 2 ? te(rng) : tn(rng);  // half where a softmax's terms live
    worst = std::max(worst, ulps(traces::LseExp(t), std::exp(static_cast<long double>(t))));
  }
  EXPECT_LE(worst, 2.0) << "LseExp";
  EXPECT_EQ(traces::LseExp(0.0), 1.0);
  EXPECT_EQ(traces::LseExp(-0.0), 1.0);
  EXPECT_EQ(traces::LseExp(-708.5), 0.0);
  EXPECT_EQ(traces::LseExp(-INFINITY), 0.0);
  EXPECT_EQ(traces::LseExp(709.1), INFINITY);
  EXPECT_TRUE(std::isnan(traces::LseExp(NAN)));
  EXPECT_GT(traces::LseExp(-707.9), 0.0);
  worst = 0;
  std::uniform_real_distribution<double> lg(-1070.0, 1020.0), near1(0.5, 2.0);
  for (int i = 0; i < 400000; ++i) {
    const double x = i % 2 ? std::exp2(lg(rng)) : near1(rng);
    worst = std::max(worst, ulps(traces::LseLog(x), std::log(static_cast<long double>(x))));
  }
  EXPECT_LE(worst, 2.0) << "LseLog";
  EXPECT_EQ(traces::LseLog(1.0), 0.0);
  EXPECT_EQ(traces::LseLog(0.0), -INFINITY);
  EXPECT_EQ(traces::LseLog(INFINITY), INFINITY);
  EXPECT_TRUE(std::isnan(traces::LseLog(-1.0)));
  EXPECT_TRUE(std::isnan(traces::LseLog(NAN)));
}

// The vectorised LogitsTopK is its definition, bit for bit: a plain reference written from the
// header's words (a full sort for the top k; the max, LseExp over eight lanes in row order, the
// lanes' pairwise sum, LseLog) on random rows of many lengths (not multiples of 8 included),
// with ties, NaNs, ±inf and k from 1 to the whole row; and logsumexp within one float ulp of
// the exact value (long double) where the row is finite.
TEST(LogitsTopK, IsItsDefinitionBitForBit) {
  std::mt19937 rng(13);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  int checked = 0;
  for (int64_t cols : {1, 7, 8, 9, 31, 64, 100, 1000, 4099, 102400}) {
    for (int kind = 0; kind < 5; ++kind) {
      std::vector<float> row(cols);
      for (auto& v : row) v = nd(rng);
      if (kind == 1) {
        for (auto& v : row) v = std::round(v);  // many ties
      }
      if (kind == 2 && cols > 3) {
        row[cols / 3] = nan;
        row[cols - 1] = nan;
      }
      if (kind == 3 && cols > 2) row[cols / 2] = -inf;
      if (kind == 4 && cols > 2) row[1] = inf;
      for (int64_t k : {int64_t{1}, std::min<int64_t>(cols, 5), std::min<int64_t>(cols, 32), cols}) {
        std::vector<int32_t> ids(k);
        std::vector<float> vals(k);
        float lse = 0;
        traces::LogitsTopK(row.data(), cols, k, ids.data(), vals.data(), &lse);
        // Reference top k: a full stable sort by the rule (NaNs first in id order, then value
        // descending, ties to the lower id).
        std::vector<int32_t> order(cols);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
          const bool na = std::isnan(row[a]), nb = std::isnan(row[b]);
          if (na || nb) return na && !nb;
          return row[a] > row[b];
        });
        const std::string what = "cols " + std::to_string(cols) + " kind " + std::to_string(kind) + " k " + std::to_string(k);
        for (int64_t j = 0; j < k; ++j) {
          ASSERT_EQ(ids[j], order[j]) << what << " rank " << j;
          ASSERT_EQ(std::memcmp(&vals[j], &row[order[j]], 4), 0) << what;
        }
        // Reference logsumexp.
        double m = -INFINITY;
        for (float v : row) m = v > m ? v : m;
        double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t j = 0; j < cols; ++j) lane[j % 8] += traces::LseExp(static_cast<double>(row[j]) - m);
        const double sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
        const float want = static_cast<float>(m + traces::LseLog(sum));
        ASSERT_EQ(std::memcmp(&lse, &want, 4), 0) << what << ": " << lse << " vs " << want;
        if (kind == 0 || kind == 1) {  // finite rows: against the exact value
          long double em = -INFINITY, es = 0;
          for (float v : row) em = std::max<long double>(em, v);
          for (float v : row) es += std::exp(static_cast<long double>(v) - em);
          const float exact = static_cast<float>(em + std::log(es));
          EXPECT_LE(std::fabs(lse - exact), std::nextafter(std::fabs(exact), INFINITY) - std::fabs(exact)) << what;
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 10 * 5 * 4);
}

}  // namespace
}  // namespace lockstep
