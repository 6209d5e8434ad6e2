// tests/traces/lent_rows_test.cc — full capture without copies: the CUDA backend lends each
// step's tap values to the recorder in a pooled buffer (engine/lending_pool.h, TapEvent::owner
// with summaries), and the trace writer compresses whole chunks where the rows lie
// (TraceWriter::Append's values_owner). Checked here without a GPU:
//   - the pool lends at most its buffers, waits for one to come back (or gives up after its
//     patience), grows a free one on demand, and its buffers outlive it while lent;
//   - a trace written from lent rows reads back identical, table by table, to one written from
//     copies of the same rows — rows that fill, straddle and finish chunks, wait lent for the
//     next step's to finish theirs, one request's row at a time (merged where they continue
//     each other) or several at once, with and without compression workers — with two buffers
//     lent in turn (so the writer never holds one for rows not yet lent), and every buffer is
//     back once the writer is closed;
//   - the recorder stores the backend's summaries as given (not recomputed) beside the lent
//     values, and copies only when the position filter drops rows.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/lending_pool.h"
#include "engine/model.h"
#include "recorder/recorder.h"
#include "traces/trace_reader.h"
#include "traces/trace_writer.h"

namespace lockstep {
namespace {

using namespace std::chrono_literals;

std::filesystem::path TempTrace(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / "lockstep_lent_rows_test";
  std::filesystem::create_directories(dir);
  const auto p = dir / name;
  std::filesystem::remove(p);
  return p;
}

// Plain memory standing in for pinned buffers; counts allocations and their sizes.
engine::LendingPool::Allocator CountingAllocator(std::vector<size_t>* sizes) {
  return [sizes](size_t n) -> Result<std::shared_ptr<void>> {
    sizes->push_back(n);
    auto b = std::make_shared<std::vector<uint8_t>>(n, 0);
    return std::shared_ptr<void>(b, b->data());
  };
}

TEST(LendingPool, LendsAtMostItsBuffersAndWaitsForOneBack) {
  std::vector<size_t> sizes;
  engine::LendingPool pool(CountingAllocator(&sizes), 2);
  auto a = pool.Take(100, 0ns);
  auto b = pool.Take(100, 0ns);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_NE(a->data, nullptr);
  ASSERT_NE(b->data, nullptr);
  EXPECT_NE(a->data, b->data);
  EXPECT_EQ(pool.buffers(), 2u);
  EXPECT_EQ(pool.lent(), 2u);

  // Both lent: a third waits out its patience and comes back empty.
  auto none = pool.Take(100, 20ms);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->data, nullptr);
  EXPECT_GE(pool.waited_ns(), 20'000'000);

  // A lease dropped on another thread wakes a waiting Take, which gets that very buffer; a
  // copy of the owner keeps it lent until the copy goes too.
  void* const a_data = a->data;
  std::shared_ptr<const void> copy = a->owner;
  a->owner.reset();
  EXPECT_EQ(pool.lent(), 2u);
  std::thread t([&] {
    std::this_thread::sleep_for(30ms);
    copy.reset();
  });
  auto c = pool.Take(100, 5s);  // (b is still lent: only a can come back)
  t.join();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data, a_data);
  EXPECT_EQ(sizes, (std::vector<size_t>{100, 100}));

  // A free buffer too small for a request is replaced by one large enough.
  c->owner.reset();
  auto big = pool.Take(1000, 0ns);
  ASSERT_TRUE(big.ok());
  ASSERT_NE(big->data, nullptr);
  EXPECT_EQ(sizes.back(), 1000u);
  EXPECT_EQ(pool.buffers(), 2u);

  // The pool may go first: a held buffer stays readable and is freed with its last lease.
  std::memset(big->data, 7, 1000);
  std::shared_ptr<const void> keep = big->owner;
  const auto* bytes = static_cast<const uint8_t*>(big->data);
  { engine::LendingPool gone = std::move(pool); }
  EXPECT_EQ(bytes[999], 7);
  keep.reset();
  big->owner.reset();
  b->owner.reset();
}

// The CUDA backend's rule for full capture (hand-computed): 256 MB worth of a step, 2 to 128.
TEST(LendingPool, TapLendBuffersIs256MBWorthWithinTwoTo128) {
  EXPECT_EQ(engine::TapLendBuffers(size_t{2} << 20), 128u);        // 2 MB steps (batch 1): 128
  EXPECT_EQ(engine::TapLendBuffers(size_t{18} << 20), 14u);        // 18 MB (batch 8): 256 / 18
  EXPECT_EQ(engine::TapLendBuffers(size_t{100} << 20), 2u);        // 100 MB: 2, not 2.56
  EXPECT_EQ(engine::TapLendBuffers(size_t{1} << 30), 2u);          // 1 GB: still 2
  EXPECT_EQ(engine::TapLendBuffers(1), 128u);
}

TEST(LendingPool, AFailedAllocationIsAnErrorAndTheSlotStaysUsable) {
  int calls = 0;
  engine::LendingPool pool(
      [&](size_t n) -> Result<std::shared_ptr<void>> {
        if (++calls == 1) return Status::Internal("no pinned memory left");
        auto b = std::make_shared<std::vector<uint8_t>>(n);
        return std::shared_ptr<void>(b, b->data());
      },
      1);
  auto a = pool.Take(64, 0ns);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("no pinned memory left"), std::string::npos);
  auto b = pool.Take(64, 0ns);
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_NE(b->data, nullptr);
}

struct Shape {
  std::string path;
  traces::DType dtype;
  int64_t cols;
};

// Writes `steps` steps of `batch` rows for each shape, each step's rows in one lent buffer
// (tensor after tensor, a tensor's rows back to back, as the backend's slab), into two traces:
// one through Append with the owner (lent), one through Append copying. `per_row`: one Append
// per row (as the recorder calls it, a request at a time); else one per tensor and step.
void WriteBoth(const std::filesystem::path& lent_path, const std::filesystem::path& copy_path,
               const std::vector<Shape>& shapes, int64_t steps, int64_t batch, bool per_row, int workers,
               engine::LendingPool* pool) {
  traces::TraceWriterOptions wo;
  wo.batch_width = batch;
  wo.compression_threads = workers;
  wo.target_chunk_bytes = 4096;  // a few rows a chunk: many chunks, tails and straddles
  auto wl = traces::TraceWriter::Create(lent_path, wo);
  auto wc = traces::TraceWriter::Create(copy_path, wo);
  ASSERT_TRUE(wl.ok() && wc.ok());
  std::vector<int32_t> hl, hc;
  for (const Shape& s : shapes) {
    traces::TensorSpec spec;
    spec.path = s.path;
    spec.dtype = s.dtype;
    spec.cols = s.cols;
    auto a = (*wl)->DefineTensor(spec);
    auto b = (*wc)->DefineTensor(spec);
    ASSERT_TRUE(a.ok() && b.ok());
    hl.push_back(*a);
    hc.push_back(*b);
  }
  size_t step_bytes = 0;
  for (const Shape& s : shapes) step_bytes += static_cast<size_t>(batch * s.cols) * traces::DTypeSize(s.dtype);
  std::mt19937 rng(11);
  for (int64_t step = 0; step < steps; ++step) {
    auto lease = pool->Take(step_bytes, 5s);
    ASSERT_TRUE(lease.ok());
    ASSERT_NE(lease->data, nullptr);
    auto* buf = static_cast<uint8_t*>(lease->data);
    for (size_t i = 0; i < step_bytes; ++i) buf[i] = static_cast<uint8_t>(rng() >> 5);
    size_t at = 0;
    for (size_t k = 0; k < shapes.size(); ++k) {
      const size_t row_bytes = static_cast<size_t>(shapes[k].cols) * traces::DTypeSize(shapes[k].dtype);
      std::vector<traces::SummaryRow> sums(static_cast<size_t>(batch));
      for (int64_t r = 0; r < batch; ++r) {
        sums[r].position = 100 + step;
        sums[r].request = static_cast<int32_t>(r);
        sums[r].step = static_cast<int32_t>(step);
        sums[r].hash = rng();
      }
      if (per_row) {
        for (int64_t r = 0; r < batch; ++r) {
          const uint8_t* row = buf + at + r * row_bytes;
          ASSERT_TRUE((*wl)->Append(hl[k], {&sums[r], 1}, row, lease->owner).ok());
          ASSERT_TRUE((*wc)->Append(hc[k], {&sums[r], 1}, row).ok());
        }
      } else {
        ASSERT_TRUE((*wl)->Append(hl[k], sums, buf + at, lease->owner).ok());
        ASSERT_TRUE((*wc)->Append(hc[k], sums, buf + at).ok());
      }
      at += batch * row_bytes;
    }
    // The copying writer has its own copies now: the lent one holds the buffer alone.
    traces::StepRow sr;
    sr.step = step;
    ASSERT_TRUE((*wl)->AppendStep(sr, {}).ok());
    ASSERT_TRUE((*wc)->AppendStep(sr, {}).ok());
    (*wl)->Submit();
    (*wc)->Submit();
    if (step % 3 == 2) {
      ASSERT_TRUE((*wl)->Flush(step + 1).ok());
      ASSERT_TRUE((*wc)->Flush(step + 1).ok());
    }
  }
  ASSERT_TRUE((*wl)->Close().ok()) << (*wl)->status().message();
  ASSERT_TRUE((*wc)->Close().ok());
}

void ExpectSameTables(const std::filesystem::path& a, const std::filesystem::path& b, int64_t want_rows) {
  auto ra = traces::TraceReader::Open(a);
  auto rb = traces::TraceReader::Open(b);
  ASSERT_TRUE(ra.ok()) << ra.status().message();
  ASSERT_TRUE(rb.ok()) << rb.status().message();
  ASSERT_EQ((*ra)->tensors().size(), (*rb)->tensors().size());
  for (const traces::TensorInfo& ta : (*ra)->tensors()) {
    const traces::TensorInfo* tb = (*rb)->FindTensor(ta.path);
    ASSERT_NE(tb, nullptr) << ta.path;
    EXPECT_EQ(ta.rows, want_rows) << ta.path;
    auto sa = (*ra)->ReadSummary(ta);
    auto sb = (*rb)->ReadSummary(*tb);
    ASSERT_TRUE(sa.ok() && sb.ok()) << ta.path;
    ASSERT_EQ(sa->size(), sb->size()) << ta.path;
    EXPECT_EQ(0, std::memcmp(sa->data(), sb->data(), sa->size() * sizeof(traces::SummaryRow))) << ta.path;
    auto va = (*ra)->ReadValues(ta, 0, ta.rows);
    auto vb = (*rb)->ReadValues(*tb, 0, tb->rows);
    ASSERT_TRUE(va.ok() && vb.ok()) << ta.path;
    EXPECT_EQ(*va, *vb) << ta.path;
  }
}

TEST(TraceWriter, LentRowsWriteTheSameTraceAsCopiedOnes) {
  // Rows of 2048 f32 (8 KB: a chunk is one row), 700 f32 (1 a chunk, 1.4 KB short of the target:
  // chunk_rows from the target), 96 f32 (10 a chunk), 6 i32 (170 a chunk), 5 bf16.
  const std::vector<Shape> shapes = {{"taps/wide", traces::DType::kF32, 2048},
                                     {"taps/odd", traces::DType::kF32, 700},
                                     {"taps/narrow", traces::DType::kF32, 96},
                                     {"taps/ids", traces::DType::kI32, 6},
                                     {"kv/rope", traces::DType::kBf16, 5}};
  for (int workers : {0, 2}) {
    for (bool per_row : {true, false}) {
      for (int64_t batch : {1, 3, 5, 6, 8}) {  // 5 and 6 of 8-row chunks: pieces wait for the next step's
        SCOPED_TRACE("workers " + std::to_string(workers) + (per_row ? " per row" : " per tensor") + " batch " +
                     std::to_string(batch));
        std::vector<size_t> sizes;
        // Two buffers (the backend's least) for 13 steps: each must come back while the next
        // is lent — rows waiting in a tail for the next step's may hold only that one.
        engine::LendingPool pool(CountingAllocator(&sizes), 2);
        const auto a = TempTrace("lent.h5"), b = TempTrace("copied.h5");
        const int64_t steps = 13;
        WriteBoth(a, b, shapes, steps, batch, per_row, workers, &pool);
        EXPECT_EQ(pool.lent(), 0u) << "a lent buffer was still held after Close";
        EXPECT_LE(sizes.size(), 2u);
        ExpectSameTables(a, b, steps * batch);
      }
    }
  }
}

TEST(TraceWriter, LentValuesAreRefusedWhereCopiedOnesWouldBe) {
  const auto p = TempTrace("lent_refused.h5");
  auto w = traces::TraceWriter::Create(p, traces::TraceWriterOptions{});
  ASSERT_TRUE(w.ok());
  traces::TensorSpec s;
  s.path = "taps/a";
  s.cols = 4;
  auto h = (*w)->DefineTensor(s);
  ASSERT_TRUE(h.ok());
  std::vector<traces::SummaryRow> rows(1);
  auto owner = std::make_shared<std::vector<float>>(4, 1.0f);
  Status st = (*w)->Append(*h, rows, nullptr, owner);
  EXPECT_NE(st.message().find("'taps/a': values missing"), std::string::npos) << st.message();
  st = (*w)->Append(*h + 5, rows, owner->data(), owner);
  EXPECT_NE(st.message().find("unknown tensor handle"), std::string::npos) << st.message();
  ASSERT_TRUE((*w)->Close().ok());
  EXPECT_EQ(owner.use_count(), 1);  // nothing kept
  auto r = traces::TraceReader::Open(p);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->FindTensor("taps/a")->rows, 0);  // nothing half-appended
}

TEST(Recorder, FullCaptureKeepsTheBackendsSummariesBesideLentValues) {
  auto model = engine::Model::Load(std::string(LOCKSTEP_SOURCE_DIR) + "/tests/fixtures/models/v32_sparse");
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto eng = engine::Engine::Create(*model, engine::EngineOptions{});
  ASSERT_TRUE(eng.ok()) << eng.status().message();

  const std::string name = "layers.0.attn.out";
  constexpr int64_t kCols = 64, kRows = 4;  // one event: a request's 4 prompt rows, positions 0–3
  std::vector<size_t> sizes;
  engine::LendingPool pool(CountingAllocator(&sizes), 2);
  std::vector<float> expect;
  for (bool filter : {false, true}) {
    SCOPED_TRACE(filter ? "odd positions only" : "every position");
    const auto path = TempTrace(filter ? "rec_filtered.h5" : "rec_all.h5");
    {
      auto w = traces::TraceWriter::Create(path, traces::TraceWriterOptions{});
      ASSERT_TRUE(w.ok());
      recorder::RecorderOptions ro;
      ro.policy.mode = recorder::CapturePolicy::Mode::kFull;
      ro.policy.taps = {"layers.*"};
      if (filter) {
        ro.policy.pos_first = 1;
        ro.policy.pos_stride = 2;
      }
      recorder::Recorder rec(eng->get(), w->get(), ro);
      auto lease = pool.Take(kRows * kCols * 4, 5s);
      ASSERT_TRUE(lease.ok());
      auto* v = static_cast<float*>(lease->data);
      for (int64_t i = 0; i < kRows * kCols; ++i) v[i] = 0.25f * static_cast<float>(i % 97) - 3.0f;
      expect.assign(v, v + kRows * kCols);
      // Summaries no host pass would produce (the hash is not the values'): kept as given.
      std::vector<engine::TapRowSummary> sums(kRows);
      for (int64_t r = 0; r < kRows; ++r) {
        sums[r].hash = 0xabcd0000u + static_cast<uint64_t>(r);
        sums[r].rms = 100.0f + static_cast<float>(r);
      }
      engine::TapEvent e;
      e.name = name;
      e.request_id = 0;
      e.position = 0;
      e.rows = kRows;
      e.cols = kCols;
      e.data = v;
      e.summaries = sums.data();
      e.owner = lease->owner;
      lease->owner.reset();
      rec.OnTap(e);
      e.owner.reset();
      ASSERT_TRUE(rec.EndStep().ok()) << rec.status().message();
      ASSERT_TRUE(rec.Finish().ok()) << rec.status().message();
      ASSERT_TRUE((*w)->Close().ok());
    }
    EXPECT_EQ(pool.lent(), 0u);
    auto r = traces::TraceReader::Open(path);
    ASSERT_TRUE(r.ok()) << r.status().message();
    const traces::TensorInfo* t = (*r)->FindTensor("taps/" + name);
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE(t->has_values);
    auto s = (*r)->ReadSummary(*t);
    auto vals = (*r)->ReadValues(*t, 0, t->rows);
    ASSERT_TRUE(s.ok() && vals.ok());
    const std::vector<int64_t> kept = filter ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{0, 1, 2, 3};
    ASSERT_EQ(s->size(), kept.size());
    ASSERT_EQ(vals->size(), kept.size() * kCols * 4);
    for (size_t k = 0; k < kept.size(); ++k) {
      EXPECT_EQ((*s)[k].position, kept[k]);
      EXPECT_EQ((*s)[k].hash, 0xabcd0000u + static_cast<uint64_t>(kept[k]));
      EXPECT_EQ((*s)[k].rms, 100.0f + static_cast<float>(kept[k]));
      EXPECT_EQ(0, std::memcmp(vals->data() + k * kCols * 4, expect.data() + kept[k] * kCols, kCols * 4)) << k;
    }
  }
}

}  // namespace
}  // namespace lockstep
