// tests/gpu/gpu_summarize_test.cc — SummarizeRows on the GPU against traces::Summarize on the
// host: every SummaryRow field bit for bit (hash, NaN/Inf counts, rms, absmax, min, max) on
// fp32 rows (finite, signed-zero extremes, NaN/±Inf, overflowing squares) and int32 rows, in a
// batch of rows with a stride. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "traces/row_summary.h"

namespace lockstep {
namespace {

namespace cu = kernels::cuda;

#define LS_REQUIRE_GPU()                                                                      \
  do {                                                                                        \
    if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device (" << cu::DeviceDescription() \
                                             << "): GPU test skipped";                        \
  } while (0)

bool Same(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

TEST(CudaSummarizeRows, SameFieldsAsTheHost) {
  LS_REQUIRE_GPU();
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (bool i32 : {false, true}) {
    // Short (≤ 60 values: XXH3's short paths), around the stripe and block edges, staged and
    // (> 8192 values) read in place.
    for (int64_t cols : {1, 6, 60, 61, 64, 65, 255, 256, 257, 2047, 2048, 7168, 8193, 9001}) {
      const int64_t rows = 37, stride = cols + 5;
      std::vector<float> x(rows * stride);
      for (auto& v : x) v = nd(rng);
      if (i32) {
        for (auto& v : x) {
          const int32_t k = static_cast<int32_t>(rng()) >> static_cast<int>(rng() % 31);
          std::memcpy(&v, &k, 4);
        }
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          float* row = &x[r * stride];
          if (r % 5 == 1) {
            for (int64_t i = 0; i < cols; ++i) row[i] = std::fabs(row[i]) + 1.0f;
            row[cols / 2] = -0.0f;
            row[cols - 1] = 0.0f;
          }
          if (r % 5 == 2) row[cols - 1] = std::nanf("");
          if (r % 5 == 3) row[0] = -INFINITY;
          if (r % 5 == 4) row[0] = 3.0e38f;
        }
      }
      auto dx = cu::DeviceBuffer::Allocate(x.size() * 4);
      auto dout = cu::DeviceBuffer::Allocate(rows * sizeof(cu::RowSummaryOut));
      ASSERT_TRUE(dx.ok() && dout.ok());
      ASSERT_TRUE(dx->CopyFromHost(x.data(), x.size() * 4).ok());
      cu::SummarizeRowsParams p;
      p.x = dx->data();
      p.x_stride = stride;
      p.rows = rows;
      p.cols = cols;
      p.i32 = i32;
      p.out = dout->as<cu::RowSummaryOut>();
      const Status st = cu::SummarizeRows(p);
      ASSERT_TRUE(st.ok()) << st.message();
      std::vector<cu::RowSummaryOut> got(rows);
      ASSERT_TRUE(dout->CopyToHost(got.data(), rows * sizeof(cu::RowSummaryOut)).ok());
      for (int64_t r = 0; r < rows; ++r) {
        traces::SummaryRow want;
        traces::Summarize(i32 ? traces::DType::kI32 : traces::DType::kF32, &x[r * stride], cols, &want);
        const std::string what = (i32 ? "i32" : "f32") + std::string(" cols ") + std::to_string(cols) + " row " +
                                 std::to_string(r);
        EXPECT_EQ(got[r].hash, want.hash) << what;
        EXPECT_EQ(got[r].nan_count, want.nan_count) << what;
        EXPECT_EQ(got[r].inf_count, want.inf_count) << what;
        EXPECT_TRUE(Same(got[r].rms, want.rms)) << what << ": rms";
        EXPECT_TRUE(Same(got[r].absmax, want.absmax)) << what << ": absmax";
        EXPECT_TRUE(Same(got[r].min, want.min)) << what << ": min";
        EXPECT_TRUE(Same(got[r].max, want.max)) << what << ": max";
      }
    }
  }
}

// Several tensors of one batch (different widths, dtypes and strides) in one launch: each row's
// summary is the host's.
TEST(CudaSummarizeRows, BatchOfTensorsMatchesTheHost) {
  LS_REQUIRE_GPU();
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t rows = 5;
  const int64_t widths[] = {2048, 6, 576, 3072, 64};
  const bool ints[] = {false, true, false, false, false};
  std::vector<std::vector<float>> host;
  std::vector<cu::DeviceBuffer> dx, dout;
  cu::SummarizeBatchParams p;
  p.rows = rows;
  for (int i = 0; i < 5; ++i) {
    const int64_t stride = widths[i] + 3 * i;
    std::vector<float> x(rows * stride);
    for (auto& v : x) v = nd(rng);
    if (ints[i]) {
      for (auto& v : x) {
        const int32_t k = static_cast<int32_t>(rng() % 64);
        std::memcpy(&v, &k, 4);
      }
    }
    auto b = cu::DeviceBuffer::Allocate(x.size() * 4);
    auto o = cu::DeviceBuffer::Allocate(rows * sizeof(cu::RowSummaryOut));
    ASSERT_TRUE(b.ok() && o.ok());
    ASSERT_TRUE(b->CopyFromHost(x.data(), x.size() * 4).ok());
    p.t[i].x = b->data();
    p.t[i].x_stride = stride;
    p.t[i].cols = widths[i];
    p.t[i].i32 = ints[i];
    p.t[i].out = o->as<cu::RowSummaryOut>();
    host.push_back(std::move(x));
    dx.push_back(std::move(*b));
    dout.push_back(std::move(*o));
  }
  p.count = 5;
  const Status st = cu::SummarizeBatch(p);
  ASSERT_TRUE(st.ok()) << st.message();
  for (int i = 0; i < 5; ++i) {
    std::vector<cu::RowSummaryOut> got(rows);
    ASSERT_TRUE(dout[i].CopyToHost(got.data(), rows * sizeof(cu::RowSummaryOut)).ok());
    for (int64_t r = 0; r < rows; ++r) {
      traces::SummaryRow want;
      traces::Summarize(ints[i] ? traces::DType::kI32 : traces::DType::kF32, &host[i][r * p.t[i].x_stride],
                        widths[i], &want);
      const std::string what = "tensor " + std::to_string(i) + " row " + std::to_string(r);
      EXPECT_EQ(got[r].hash, want.hash) << what;
      EXPECT_TRUE(Same(got[r].rms, want.rms)) << what;
      EXPECT_TRUE(Same(got[r].min, want.min) && Same(got[r].max, want.max) && Same(got[r].absmax, want.absmax))
          << what;
    }
  }
  // The same tensors described in device memory (SummarizeTable): the same summaries.
  auto table = cu::DeviceBuffer::Allocate(sizeof(p.t));
  auto tout = cu::DeviceBuffer::Allocate(5 * rows * sizeof(cu::RowSummaryOut));
  ASSERT_TRUE(table.ok() && tout.ok());
  cu::SummarizeBatchParams::Tensor desc[5];
  for (int i = 0; i < 5; ++i) {
    desc[i] = p.t[i];
    desc[i].out = tout->as<cu::RowSummaryOut>() + i * rows;
  }
  ASSERT_TRUE(table->CopyFromHost(desc, sizeof(desc)).ok());
  cu::SummarizeTableParams tp;
  tp.tensors = table->as<cu::SummarizeBatchParams::Tensor>();
  tp.count = 5;
  tp.rows = rows;
  const Status ts = cu::SummarizeTable(tp);
  ASSERT_TRUE(ts.ok()) << ts.message();
  std::vector<cu::RowSummaryOut> all(5 * rows);
  ASSERT_TRUE(tout->CopyToHost(all.data(), all.size() * sizeof(cu::RowSummaryOut)).ok());
  for (int i = 0; i < 5; ++i) {
    std::vector<cu::RowSummaryOut> got(rows);
    ASSERT_TRUE(dout[i].CopyToHost(got.data(), rows * sizeof(cu::RowSummaryOut)).ok());
    EXPECT_EQ(0, std::memcmp(got.data(), &all[i * rows], rows * sizeof(cu::RowSummaryOut))) << "table tensor " << i;
  }

  p.count = cu::kSummarizeBatchMax + 1;
  const Status bad = cu::SummarizeBatch(p);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("count"), std::string::npos) << bad.message();
}

TEST(CudaSummarizeRows, RefusesBadArguments) {
  cu::SummarizeRowsParams p;
  p.rows = 3;
  p.cols = 4;
  p.x_stride = 2;
  const Status st = cu::SummarizeRows(p);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("SummarizeRows"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace lockstep
