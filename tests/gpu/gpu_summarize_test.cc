// tests/gpu/gpu_summarize_test.cc — SummarizeRows on the GPU against traces::Summarize on the
// host: every SummaryRow field bit for bit (hash, NaN/Inf counts, rms, absmax, min, max) on
// fp32 rows (finite, signed-zero extremes, NaN/±Inf, overflowing squares), int32 rows, and the
// KV cache's bf16 / E4M3 parts, in a batch of rows with a stride. Skips without a GPU.
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
      p.type = i32 ? cu::RowType::kI32 : cu::RowType::kF32;
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
    p.t[i].type = ints[i] ? cu::RowType::kI32 : cu::RowType::kF32;
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

// The KV cache as stored: rows of one FP8 token layout (656 bytes: 512 E4M3 values, 4 fp32
// scales, 64 bf16 rope values) and of a bf16 latent (576 values), read where they lie with the
// token as the stride — every field the host's for random bytes, NaN patterns, ±Inf, signed
// zeros and subnormals, in one batch launch and in a table launch.
TEST(CudaSummarizeRows, Bf16AndE4m3RowsOfTheCacheLayoutsMatchTheHost) {
  LS_REQUIRE_GPU();
  std::mt19937 rng(33);
  const int64_t rows = 9, fp8_token = 656, bf16_token = 1152;
  std::vector<uint8_t> fp8(rows * fp8_token), bf(rows * bf16_token);
  for (auto& v : fp8) v = static_cast<uint8_t>(rng());
  for (auto& v : bf) v = static_cast<uint8_t>(rng());
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* t = &fp8[r * fp8_token];
    uint8_t* b = &bf[r * bf16_token];
    float scales[4] = {0.5f, 1.0f / 448, 3.0f, r % 3 == 0 ? -0.0f : 2.0f};
    std::memcpy(t + 512, scales, 16);
    if (r % 4 == 0) {  // no NaN in the values
      for (int i = 0; i < 512; ++i) t[i] = (t[i] & 0x7f) == 0x7f ? t[i] & 0xfe : t[i];
      for (int i = 0; i < 576; ++i) b[2 * i + 1] &= 0xbf;
      for (int i = 0; i < 64; ++i) t[528 + 2 * i + 1] &= 0xbf;
    }
    if (r % 4 == 1) {  // zeros and subnormals only
      for (int i = 0; i < 512; ++i) t[i] &= 0x87;
      for (int i = 0; i < 576; ++i) b[2 * i + 1] &= 0x80;
    }
    if (r % 4 == 2) {  // a NaN and an −Inf among finite values
      t[7] = 0x7f;
      b[10] = 0x80, b[11] = 0xff;
      b[100] = 0xc0, b[101] = 0x7f;
    }
  }
  struct Part {
    const std::vector<uint8_t>* host;
    int64_t offset, cols, token;
    cu::RowType type;
    traces::DType dtype;
  };
  const Part parts[] = {{&fp8, 0, 512, fp8_token, cu::RowType::kFp8E4m3, traces::DType::kFp8E4m3},
                        {&fp8, 512, 4, fp8_token, cu::RowType::kF32, traces::DType::kF32},
                        {&fp8, 528, 64, fp8_token, cu::RowType::kBf16, traces::DType::kBf16},
                        {&bf, 0, 576, bf16_token, cu::RowType::kBf16, traces::DType::kBf16}};
  const int n = 4;
  auto dfp8 = cu::DeviceBuffer::Allocate(fp8.size());
  auto dbf = cu::DeviceBuffer::Allocate(bf.size());
  auto dout = cu::DeviceBuffer::Allocate(2 * n * rows * sizeof(cu::RowSummaryOut));
  ASSERT_TRUE(dfp8.ok() && dbf.ok() && dout.ok());
  ASSERT_TRUE(dfp8->CopyFromHost(fp8.data(), fp8.size()).ok());
  ASSERT_TRUE(dbf->CopyFromHost(bf.data(), bf.size()).ok());
  cu::SummarizeBatchParams p;
  p.rows = rows;
  p.count = n;
  for (int i = 0; i < n; ++i) {
    const int esize = parts[i].type == cu::RowType::kBf16 ? 2 : parts[i].type == cu::RowType::kFp8E4m3 ? 1 : 4;
    p.t[i].x = (parts[i].host == &fp8 ? dfp8->as<uint8_t>() : dbf->as<uint8_t>()) + parts[i].offset;
    p.t[i].x_stride = parts[i].token / esize;
    p.t[i].cols = parts[i].cols;
    p.t[i].type = parts[i].type;
    p.t[i].out = dout->as<cu::RowSummaryOut>() + i * rows;
  }
  const Status st = cu::SummarizeBatch(p);
  ASSERT_TRUE(st.ok()) << st.message();
  cu::SummarizeBatchParams::Tensor desc[n];
  for (int i = 0; i < n; ++i) {
    desc[i] = p.t[i];
    desc[i].out = dout->as<cu::RowSummaryOut>() + (n + i) * rows;
  }
  auto table = cu::DeviceBuffer::Allocate(sizeof(desc));
  ASSERT_TRUE(table.ok() && table->CopyFromHost(desc, sizeof(desc)).ok());
  cu::SummarizeTableParams tp;
  tp.tensors = table->as<cu::SummarizeBatchParams::Tensor>();
  tp.count = n;
  tp.rows = rows;
  const Status ts = cu::SummarizeTable(tp);
  ASSERT_TRUE(ts.ok()) << ts.message();
  std::vector<cu::RowSummaryOut> got(2 * n * rows);
  ASSERT_TRUE(dout->CopyToHost(got.data(), got.size() * sizeof(cu::RowSummaryOut)).ok());
  int nans = 0, infs = 0;
  for (int launch = 0; launch < 2; ++launch) {
    for (int i = 0; i < n; ++i) {
      for (int64_t r = 0; r < rows; ++r) {
        const cu::RowSummaryOut& g = got[(launch * n + i) * rows + r];
        traces::SummaryRow want;
        traces::Summarize(parts[i].dtype, parts[i].host->data() + r * parts[i].token + parts[i].offset, parts[i].cols,
                          &want);
        const std::string what = (launch ? "table " : "batch ") + std::string("part ") + std::to_string(i) + " row " +
                                 std::to_string(r);
        EXPECT_EQ(g.hash, want.hash) << what;
        EXPECT_EQ(g.nan_count, want.nan_count) << what;
        EXPECT_EQ(g.inf_count, want.inf_count) << what;
        EXPECT_TRUE(Same(g.rms, want.rms)) << what << ": rms " << g.rms << " vs " << want.rms;
        EXPECT_TRUE(Same(g.absmax, want.absmax)) << what << ": absmax";
        EXPECT_TRUE(Same(g.min, want.min)) << what << ": min";
        EXPECT_TRUE(Same(g.max, want.max)) << what << ": max";
        nans += g.nan_count > 0;
        infs += g.inf_count > 0;
      }
    }
  }
  EXPECT_GT(nans, 0);  // the rows meant to hold them did
  EXPECT_GT(infs, 0);

  p.t[0].cols = 510;  // E4M3 rows of a length that is not whole words: refused
  const Status bad = cu::SummarizeBatch(p);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("cols"), std::string::npos) << bad.message();
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
