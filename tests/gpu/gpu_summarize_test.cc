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
    for (int64_t cols : {1, 6, 64, 2048, 7168}) {
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
