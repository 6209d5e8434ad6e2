// tests/traces/trace_roundtrip_test.cc — TraceWriter → file → TraceReader, against the rows
// the test generated itself (seeded): values, summaries, hashes, sampler rows, requests;
// and the crash rule: a copy of the file taken right after a flush reads back every row
// appended before that flush, tails included.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <fstream>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>

#include "traces/row_summary.h"
#include "traces/trace_reader.h"
#include "traces/trace_writer.h"
#include "traces/zstd_filter.h"

namespace lockstep::traces {
namespace {

namespace fs = std::filesystem;

fs::path TempPath(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / "lockstep_traces_test";
  fs::create_directories(dir);
  return dir / name;
}

struct Rows {
  std::vector<float> values;  // [n, cols]
  std::vector<SummaryRow> summaries;
};

Rows MakeRows(std::mt19937& rng, int64_t n, int64_t cols, int32_t request, int64_t first_pos) {
  Rows r;
  std::normal_distribution<float> dist(0.0f, 2.0f);
  r.values.resize(n * cols);
  for (auto& v : r.values) v = dist(rng);
  for (int64_t i = 0; i < n; ++i) {
    SummaryRow s;
    s.request = request;
    s.position = first_pos + i;
    s.step = static_cast<int32_t>(first_pos + i);
    Summarize(DType::kF32, &r.values[i * cols], cols, &s);
    r.summaries.push_back(s);
  }
  return r;
}

TEST(RowSummary, HandComputedStatistics) {
  const float row[] = {3.0f, -4.0f, NAN, INFINITY, 0.0f};
  SummaryRow s;
  Summarize(DType::kF32, row, 5, &s);
  EXPECT_EQ(s.nan_count, 1u);
  EXPECT_EQ(s.inf_count, 1u);
  EXPECT_FLOAT_EQ(s.rms, std::sqrt(25.0f / 3.0f));  // over the 3 finite values
  EXPECT_EQ(s.absmax, 4.0f);
  EXPECT_EQ(s.min, -4.0f);
  EXPECT_EQ(s.max, 3.0f);
  // XXH3-64 of "abc" (seed 0), as printed by python3-xxhash's xxh3_64_intdigest(b"abc").
  EXPECT_EQ(ContentHash("abc", 3), 8696274497037089104ull);
  // bf16 0x3FC0 = 1.5; E4M3 0x7E = 448 (max), 0x7F = NaN, 0x01 = 2^-9.
  EXPECT_EQ(Bf16ToFloat(0x3FC0), 1.5f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0x7F)));
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4m3ToFloat(0xB8), -1.0f);
}

// The f32 statistics as the format defines them (docs/trace-format.md): the loop the first
// traces were written with, kept here so that a faster Summarize stays bit-identical (replay
// compares stored summaries with fresh ones bit for bit, old traces included).
void ReferenceF32(const float* p, int64_t cols, SummaryRow* out) {
  double s[4] = {0, 0, 0, 0};
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t i = 0; i < cols; ++i) {
    s[i & 3] += static_cast<double>(p[i]) * p[i];
    lo = p[i] < lo ? p[i] : lo;
    hi = p[i] > hi ? p[i] : hi;
  }
  const double sumsq = (s[0] + s[1]) + (s[2] + s[3]);
  out->rms = cols > 0 ? static_cast<float>(std::sqrt(sumsq / static_cast<double>(cols))) : 0;
  out->min = cols > 0 ? lo : 0;
  out->max = cols > 0 ? hi : 0;
  out->absmax = cols > 0 ? std::fmax(std::fabs(lo), std::fabs(hi)) : 0;
}

TEST(RowSummary, F32MatchesTheReferenceLoopBitForBit) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  for (int trial = 0; trial < 4000; ++trial) {
    const int64_t cols = trial % 67 + (trial % 5 == 0 ? 300 : 0);
    std::vector<float> row(cols);
    const int kind = trial % 4;  // 0 normal, 1 signed zeros and ties, 2 non-negative, 3 non-positive
    for (auto& v : row) {
      v = normal(rng);
      if (kind == 1) v = (rng() % 3 == 0) ? (rng() % 2 ? 0.0f : -0.0f) : std::round(v);
      if (kind == 2) v = rng() % 4 == 0 ? (rng() % 2 ? 0.0f : -0.0f) : std::fabs(v);
      if (kind == 3) v = rng() % 4 == 0 ? (rng() % 2 ? 0.0f : -0.0f) : -std::fabs(v);
    }
    SummaryRow got, want;
    Summarize(DType::kF32, row.data(), cols, &got);
    ReferenceF32(row.data(), cols, &want);
    ASSERT_EQ(bits(got.rms), bits(want.rms)) << "cols " << cols << " trial " << trial;
    ASSERT_EQ(bits(got.min), bits(want.min)) << "cols " << cols << " trial " << trial;
    ASSERT_EQ(bits(got.max), bits(want.max)) << "cols " << cols << " trial " << trial;
    ASSERT_EQ(bits(got.absmax), bits(want.absmax)) << "cols " << cols << " trial " << trial;
    EXPECT_EQ(got.nan_count, 0u);
  }
}

TEST(TraceRoundTrip, TensorsSamplingRequestsAndFlushCopies) {
  const fs::path path = TempPath("roundtrip.h5");
  const fs::path snap = TempPath("roundtrip.snapshot.h5");
  std::mt19937 rng(7);
  constexpr int64_t kCols = 5;

  TraceWriterOptions opts;
  opts.target_chunk_bytes = 16 * kCols * 4;  // 16-row value chunks: many chunks, tails in use
  opts.compression_threads = 1;
  opts.batch_width = 3;
  int64_t snapshot_at = -1;
  opts.on_flushed = [&](int64_t steps) {
    // On the writer thread, right after H5Fflush: what a SIGKILL now would leave behind.
    if (steps == 2) {
      fs::copy_file(path, snap, fs::copy_options::overwrite_existing);
      fs::copy_file(TailsPath(path), TailsPath(snap), fs::copy_options::overwrite_existing);
      snapshot_at = steps;
    }
  };
  auto w = TraceWriter::Create(path, opts);
  ASSERT_TRUE(w.ok()) << w.status().message();
  TraceWriter& tw = **w;
  ASSERT_TRUE(tw.SetMeta("model", "{\"hidden\": 5}").ok());
  RequestRecord rq;
  rq.id = 0;
  rq.name = "first";
  rq.prompt = {5, 6, 7};
  rq.prompt_text = "héllo";
  rq.seed = 42;
  rq.temperature = 0.7;
  rq.max_new_tokens = 60;  // the 60 steps below each sample one token
  ASSERT_TRUE(tw.AddRequest(rq).ok());
  TensorSpec full{"taps/layers.0.x", DType::kF32, kCols, true, {{"note", "a tap"}}};
  TensorSpec summ{"taps/layers.0.y", DType::kF32, kCols, false, {}};
  auto tf = tw.DefineTensor(full);
  auto ts = tw.DefineTensor(summ);
  ASSERT_TRUE(tf.ok() && ts.ok());
  EXPECT_FALSE(tw.DefineTensor(full).ok());  // twice

  Rows all;
  std::vector<SamplingRow> sampled;
  int64_t pos = 0;
  Rows before_snapshot;
  // Step 0: a prefill of 37 rows; then one row per step.
  for (int64_t step = 0; step < 60; ++step) {
    const int64_t n = step == 0 ? 37 : 1;
    Rows r = MakeRows(rng, n, kCols, 0, pos);
    pos += n;
    ASSERT_TRUE(tw.Append(*tf, r.summaries, r.values.data()).ok());
    ASSERT_TRUE(tw.Append(*ts, r.summaries, nullptr).ok());
    all.values.insert(all.values.end(), r.values.begin(), r.values.end());
    all.summaries.insert(all.summaries.end(), r.summaries.begin(), r.summaries.end());
    SamplingRow sr;
    sr.request = 0;
    sr.token = static_cast<int32_t>(step * 3);
    sr.token_index = step;
    sr.step = step;
    sr.seed = rq.seed;  // what the recorder writes: the request's own sampling parameters
    sr.temperature = rq.temperature;
    sr.top_p = rq.top_p;
    sr.top_k = rq.top_k;
    sr.min_p = rq.min_p;
    sr.uniform = step / 100.0;
    sampled.push_back(sr);
    ASSERT_TRUE(tw.AppendSampling(sr).ok());
    StepRow st;
    st.step = step;
    st.batch_size = 1;
    const int64_t ids[] = {0};
    ASSERT_TRUE(tw.AppendStep(st, ids).ok());
    if (step == 20) {
      before_snapshot = all;
      ASSERT_TRUE(tw.Flush(2).ok());
    } else if (step % 10 == 5) {
      ASSERT_TRUE(tw.Flush(1).ok());
    }
  }
  std::vector<int32_t> generated;
  for (const auto& s : sampled) generated.push_back(s.token);
  ASSERT_TRUE(tw.FinishRequest(0, generated, "done!", "length").ok());
  ASSERT_TRUE(tw.Close().ok()) << tw.status().message();
  ASSERT_EQ(snapshot_at, 2);
  EXPECT_FALSE(fs::exists(TailsPath(path)));  // a clean close removes the sidecar

  // The complete file.
  auto r = TraceReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const TraceReader& tr = **r;
  EXPECT_TRUE(tr.complete());
  EXPECT_EQ(tr.format_major(), kFormatMajor);
  EXPECT_EQ(tr.meta().at("model"), "{\"hidden\": 5}");
  ASSERT_EQ(tr.requests().size(), 1u);
  EXPECT_EQ(tr.requests()[0].name, "first");
  EXPECT_EQ(tr.requests()[0].prompt_text, "héllo");
  EXPECT_EQ(tr.requests()[0].prompt, rq.prompt);
  EXPECT_EQ(tr.requests()[0].generated, generated);
  EXPECT_EQ(tr.requests()[0].finish_reason, "length");
  EXPECT_EQ(tr.requests()[0].seed, 42u);
  const TensorInfo* x = tr.FindTensor("layers.0.x");
  const TensorInfo* y = tr.FindTensor("taps/layers.0.y");
  ASSERT_TRUE(x && y);
  EXPECT_EQ(x->attrs.at("note"), "a tap");
  EXPECT_EQ(x->rows, pos);
  EXPECT_EQ(y->rows, pos);
  EXPECT_FALSE(y->has_values);
  auto vals = tr.ReadValues(*x, 0, x->rows);
  ASSERT_TRUE(vals.ok()) << vals.status().message();
  ASSERT_EQ(vals->size(), all.values.size() * 4);
  EXPECT_EQ(std::memcmp(vals->data(), all.values.data(), vals->size()), 0);
  auto sum = tr.ReadSummary(*y);
  ASSERT_TRUE(sum.ok());
  for (int64_t i = 0; i < pos; ++i) {
    EXPECT_EQ((*sum)[i].hash, all.summaries[i].hash);
    EXPECT_EQ((*sum)[i].hash, ContentHash(vals->data() + i * kCols * 4, kCols * 4)) << i;
    EXPECT_EQ((*sum)[i].position, i);
    EXPECT_EQ((*sum)[i].rms, all.summaries[i].rms);
  }
  auto samp = tr.ReadSampling();
  ASSERT_TRUE(samp.ok());
  ASSERT_EQ(samp->size(), sampled.size());
  EXPECT_EQ(std::memcmp(samp->data(), sampled.data(), sampled.size() * sizeof(SamplingRow)), 0);
  int64_t width = 0;
  auto batch = tr.ReadStepBatch(&width);
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(width, 3);
  EXPECT_EQ((*batch)[0], 0);
  EXPECT_EQ((*batch)[1], -1);
  // Compression happened (random normals compress a little; summaries a lot).
  EXPECT_LT(x->stored_bytes, x->raw_bytes);

  // The snapshot: incomplete, holds exactly the rows of steps 0..20 (37 + 20 rows).
  auto s = TraceReader::Open(snap);
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_FALSE((*s)->complete());
  EXPECT_EQ((*s)->flushed_steps(), 2);
  const TensorInfo* sx = (*s)->FindTensor("layers.0.x");
  ASSERT_TRUE(sx);
  ASSERT_EQ(sx->rows, 57);
  auto svals = (*s)->ReadValues(*sx, 0, sx->rows);
  ASSERT_TRUE(svals.ok()) << svals.status().message();
  EXPECT_EQ(std::memcmp(svals->data(), before_snapshot.values.data(), svals->size()), 0);
  auto ssamp = (*s)->ReadSampling();
  ASSERT_TRUE(ssamp.ok());
  EXPECT_EQ(ssamp->size(), 21u);
  ASSERT_EQ((*s)->requests().size(), 1u);
  EXPECT_EQ((*s)->requests()[0].generated.size(), 21u);  // rebuilt from /sampling
  EXPECT_EQ((*s)->requests()[0].finish_reason, "");
}

// Rows the writer summarises (AppendToSummarize), with and without top-k logits, come out the
// same whether the writer thread derives them alone (no compression workers) or shares the work
// with three workers (steps of more than 2 MB: a full capture at batch 8), byte for byte: the
// summary tables, the values and the derived top-k tensors. The same again with the logits
// lent in place (AppendToSummarize's values_owner, as the CUDA backend's pinned buffers are):
// each step's buffer is dropped by the caller right after the call, so only the writer's
// copy of the owner keeps it alive, and every one is let go by the close.
TEST(TraceWriter, DerivedRowsAreTheSameWithWorkersSharingThem) {
  constexpr int64_t kCols = 4096, kVocab = 3000, kRows = 160, kSteps = 4;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> values(kRows * kCols), logits(8 * kVocab);
  std::vector<std::weak_ptr<std::vector<float>>> lent;  // the buffers lent in place
  auto write = [&](const fs::path& path, int threads, bool lend) {
    TraceWriterOptions opts;
    opts.compression_threads = threads;
    auto w = TraceWriter::Create(path, opts);
    ASSERT_TRUE(w.ok()) << w.status().message();
    TraceWriter& tw = **w;
    auto tv = tw.DefineTensor({"taps/x", DType::kF32, kCols, true, {}});
    auto tsum = tw.DefineTensor({"taps/y", DType::kF32, kCols, false, {}});
    auto tl = tw.DefineTensor({"taps/logits", DType::kF32, kVocab, false, {}});
    auto ti = tw.DefineTensor({"taps/logits.topk_ids", DType::kI32, 16, true, {}});
    auto tk = tw.DefineTensor({"taps/logits.topk_values", DType::kF32, 16, true, {}});
    auto te = tw.DefineTensor({"taps/logits.logsumexp", DType::kF32, 1, true, {}});
    ASSERT_TRUE(tv.ok() && tsum.ok() && tl.ok() && ti.ok() && tk.ok() && te.ok());
    TraceWriter::LogitsTopKTensors topk{*ti, *tk, *te, 16};
    std::mt19937 r2(5);
    for (int64_t step = 0; step < kSteps; ++step) {
      for (float& v : values) v = nd(r2);
      for (float& v : logits) v = nd(r2);
      std::vector<int64_t> lpos(8);
      for (int64_t i = 0; i < 8; ++i) lpos[i] = step * 8 + i;
      // The logits first, so they share a command with rows (commands go at 4 MB).
      if (lend) {
        auto buf = std::make_shared<std::vector<float>>(logits);
        lent.push_back(buf);
        ASSERT_TRUE(tw.AppendToSummarize(*tl, 0, static_cast<int32_t>(step), lpos, buf->data(), &topk, buf).ok());
      } else {
        ASSERT_TRUE(tw.AppendToSummarize(*tl, 0, static_cast<int32_t>(step), lpos, logits.data(), &topk).ok());
      }
      std::vector<int64_t> pos(kRows);
      for (int64_t i = 0; i < kRows; ++i) pos[i] = step * kRows + i;
      // Rows in pieces, as a recorder appends a step's taps.
      for (int64_t at = 0; at < kRows; at += 8) {
        std::span<const int64_t> p(pos.data() + at, 8);
        ASSERT_TRUE(tw.AppendToSummarize(*tv, 0, static_cast<int32_t>(step), p, values.data() + at * kCols).ok());
        ASSERT_TRUE(tw.AppendToSummarize(*tsum, 1, static_cast<int32_t>(step), p, values.data() + at * kCols).ok());
      }
      ASSERT_TRUE(tw.Flush(step + 1).ok());
    }
    ASSERT_TRUE(tw.Close().ok()) << tw.status().message();
  };
  const fs::path alone = TempPath("derived_alone.h5"), shared = TempPath("derived_shared.h5");
  write(alone, 0, false);
  write(shared, 3, true);
  ASSERT_EQ(lent.size(), static_cast<size_t>(kSteps));
  for (const auto& w : lent) EXPECT_TRUE(w.expired()) << "the writer still holds a lent buffer after close";
  auto a = TraceReader::Open(alone);
  auto b = TraceReader::Open(shared);
  ASSERT_TRUE(a.ok() && b.ok());
  int64_t compared = 0;
  for (const char* name : {"taps/x", "taps/y", "taps/logits", "taps/logits.topk_ids", "taps/logits.topk_values",
                           "taps/logits.logsumexp"}) {
    const TensorInfo* ta = (*a)->FindTensor(name);
    const TensorInfo* tb = (*b)->FindTensor(name);
    ASSERT_TRUE(ta && tb) << name;
    auto sa = (*a)->ReadSummary(*ta);
    auto sb = (*b)->ReadSummary(*tb);
    ASSERT_TRUE(sa.ok() && sb.ok()) << name;
    ASSERT_EQ(sa->size(), sb->size()) << name;
    ASSERT_GT(sa->size(), 0u) << name;
    EXPECT_EQ(0, std::memcmp(sa->data(), sb->data(), sa->size() * sizeof(SummaryRow))) << name << " summaries";
    if (ta->has_values) {
      auto va = (*a)->ReadValues(*ta, 0, ta->rows);
      auto vb = (*b)->ReadValues(*tb, 0, tb->rows);
      ASSERT_TRUE(va.ok() && vb.ok()) << name;
      EXPECT_TRUE(*va == *vb) << name << " values";
    }
    compared += static_cast<int64_t>(sa->size());
  }
  EXPECT_EQ(compared, 2 * kRows * kSteps + 4 * 8 * kSteps);
  fs::remove(alone);
  fs::remove(shared);
}

// AppendToSummarize with top-k tensors refuses, naming what is wrong and writing nothing, a k
// out of range, a logits tensor that is not f32, and top-k tensors of the wrong type or width or
// that store no values.
// TraceWriter::thread_times counts the chunks its thread stored (the full ones; the close
// writes the partial last chunks itself) and the time that took: 100 rows of 4 KB values with
// 8-row chunks are 12 full chunks, their 100 48-byte summaries one of 64 rows.
TEST(TraceWriter, ThreadTimesCountTheChunksStored) {
  const fs::path path = TempPath("thread_times.h5");
  TraceWriterOptions opts;
  opts.target_chunk_bytes = 4096;  // 8 rows of 4 KB (the least); 64 summary rows of 48 bytes
  opts.compression_threads = 2;
  auto w = TraceWriter::Create(path, opts);
  ASSERT_TRUE(w.ok()) << w.status().message();
  auto t = (*w)->DefineTensor({"taps/x", DType::kF32, 1024, true, {}});
  ASSERT_TRUE(t.ok());
  std::vector<float> row(1024, 1.5f);
  for (int64_t i = 0; i < 100; ++i) {
    SummaryRow s;
    s.position = i;
    ASSERT_TRUE((*w)->Append(*t, {&s, 1}, row.data()).ok());
    if (i % 10 == 9) (*w)->Submit();
  }
  ASSERT_TRUE((*w)->Flush(1).ok());
  ASSERT_TRUE((*w)->Close().ok());
  const TraceWriter::ThreadTimes tt = (*w)->thread_times();
  EXPECT_EQ(tt.chunks, 12 + 1);
  EXPECT_GT(tt.append_ns, 0);
  EXPECT_GT(tt.write_ns, 0);
  EXPECT_GT(tt.flush_ns, 0);
  EXPECT_GE(tt.append_ns, tt.derive_wait_ns);
}

TEST(TraceWriter, TopKTensorsAreChecked) {
  const fs::path path = TempPath("topk_checks.h5");
  auto w = TraceWriter::Create(path, TraceWriterOptions{});
  ASSERT_TRUE(w.ok()) << w.status().message();
  TraceWriter& tw = **w;
  auto tl = tw.DefineTensor({"taps/logits", DType::kF32, 100, false, {}});
  auto ti = tw.DefineTensor({"taps/logits.topk_ids", DType::kI32, 4, true, {}});
  auto tv = tw.DefineTensor({"taps/logits.topk_values", DType::kF32, 4, true, {}});
  auto te = tw.DefineTensor({"taps/logits.logsumexp", DType::kF32, 1, true, {}});
  auto tbad = tw.DefineTensor({"taps/not_stored", DType::kF32, 4, false, {}});
  auto tint = tw.DefineTensor({"taps/ints", DType::kI32, 100, false, {}});
  ASSERT_TRUE(tl.ok() && ti.ok() && tv.ok() && te.ok() && tbad.ok() && tint.ok());
  std::vector<float> row(100, 1.0f);
  const std::vector<int64_t> pos = {0};
  auto append = [&](int32_t tensor, TraceWriter::LogitsTopKTensors k) {
    return tw.AppendToSummarize(tensor, 0, 0, pos, row.data(), &k);
  };
  const TraceWriter::LogitsTopKTensors good{*ti, *tv, *te, 4};
  Status s = append(*tl, {*ti, *tv, *te, 0});
  EXPECT_NE(s.message().find("1 ≤ k ≤ cols"), std::string::npos) << s.message();
  s = append(*tl, {*ti, *tv, *te, 101});
  EXPECT_FALSE(s.ok());
  s = append(*tint, good);
  EXPECT_NE(s.message().find("taps/ints"), std::string::npos) << s.message();
  s = append(*tl, {*tv, *tv, *te, 4});  // values where the ids go
  EXPECT_NE(s.message().find("i32"), std::string::npos) << s.message();
  s = append(*tl, {*ti, *tbad, *te, 4});  // stores no values
  EXPECT_NE(s.message().find("stored"), std::string::npos) << s.message();
  s = append(*tl, {*ti, *tv, *te, 3});  // k is not the tensors' width
  EXPECT_NE(s.message().find("columns"), std::string::npos) << s.message();
  s = append(*tl, {*ti, *tv, 99, 4});  // no such handle
  EXPECT_FALSE(s.ok());
  s = append(*tl, good);
  EXPECT_TRUE(s.ok()) << s.message();
  ASSERT_TRUE(tw.Close().ok()) << tw.status().message();
  auto r = TraceReader::Open(path);
  ASSERT_TRUE(r.ok());
  const TensorInfo* ids = (*r)->FindTensor("taps/logits.topk_ids");
  ASSERT_TRUE(ids);
  EXPECT_EQ(ids->rows, 1) << "only the good call wrote";
  fs::remove(path);
}

TEST(TraceWriter, UnwritablePathIsOneLineError) {
  auto w = TraceWriter::Create("/nonexistent-dir/x/run.h5");
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("/nonexistent-dir/x/run.h5"), std::string::npos);
  EXPECT_EQ(w.status().message().find('\n'), std::string::npos);
}

// A full disk, simulated with RLIMIT_FSIZE in a child process: the writer reports one line
// naming the trace, stops, and leaves the file as its last successful flush had it.
TEST(TraceWriter, DiskFullLeavesFlushedStepsReadable) {
  const fs::path path = TempPath("diskfull.h5");
  const fs::path report = TempPath("diskfull.txt");
  fs::remove(path);
  constexpr int64_t kCols = 64;
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);  // writes past the limit fail with EFBIG instead of killing us
    rlimit lim{3 << 20, 3 << 20};
    setrlimit(RLIMIT_FSIZE, &lim);
    int64_t flushed_rows = 0, appended = 0;
    TraceWriterOptions o;
    o.target_chunk_bytes = 16 << 10;
    o.alloc_block_bytes = 64 << 10;
    o.on_flushed = [&](int64_t rows) { flushed_rows = rows; };
    auto w = TraceWriter::Create(path, o);
    if (!w.ok()) _exit(3);
    auto t = (*w)->DefineTensor({"taps/noise", DType::kF32, kCols, true, {}});
    std::mt19937 rng(11);
    Status s;
    for (int i = 0; i < 2000 && s.ok(); ++i) {
      Rows r = MakeRows(rng, 16, kCols, 0, appended);  // random floats barely compress
      s = (*w)->Append(*t, r.summaries, r.values.data());
      appended += 16;
      if (s.ok()) s = (*w)->Flush(appended);
    }
    Status c = (*w)->Close();
    std::ofstream(report) << flushed_rows << "\n" << (s.ok() ? c.message() : s.message()) << "\n";
    _exit(s.ok() && c.ok() ? 4 : 0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "the writer never failed (exit " << WEXITSTATUS(st) << ")";
  std::ifstream in(report);
  int64_t flushed_rows = 0;
  std::string message;
  in >> flushed_rows;
  std::getline(in >> std::ws, message);
  EXPECT_NE(message.find(path.string()), std::string::npos) << message;
  EXPECT_NE(message.find("File too large"), std::string::npos) << message;
  ASSERT_GT(flushed_rows, 0);
  auto r = TraceReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_FALSE((*r)->complete());
  const TensorInfo* t = (*r)->FindTensor("noise");
  ASSERT_TRUE(t);
  EXPECT_GE(t->rows, flushed_rows);
  auto sum = (*r)->ReadSummary(*t);
  auto vals = (*r)->ReadValues(*t, 0, t->rows);
  ASSERT_TRUE(sum.ok() && vals.ok()) << vals.status().message();
  for (int64_t i = 0; i < t->rows; ++i) {
    ASSERT_EQ(ContentHash(vals->data() + i * kCols * 4, kCols * 4), (*sum)[i].hash) << i;
  }
}

}  // namespace
// The chunk shuffle (the writer's, before zstd) is HDF5's byte shuffle — byte j of element i at
// j·n + i, a partial last element's bytes left at the end — for every element size, whatever
// fast path it takes (4-byte elements: 16 at a time), and UnshuffleBytes undoes it. The
// reference is the definition, written plainly here.
TEST(ZstdFilter, ShuffleIsHdf5sByteShuffleAndUnshuffleUndoesIt) {
  std::mt19937 rng(3);
  std::vector<size_t> sizes;
  for (size_t b = 0; b <= 260; ++b) sizes.push_back(b);
  for (size_t b : {size_t{4096}, size_t{4099}, size_t{65536 + 7}, size_t{1} << 20}) sizes.push_back(b);
  int64_t checked = 0;
  for (size_t es : {size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{8}, size_t{12}}) {
    for (size_t bytes : sizes) {
      std::vector<uint8_t> in(bytes), want(bytes), got(bytes + 1, 0xEE), back(bytes, 0);
      for (auto& v : in) v = static_cast<uint8_t>(rng());
      const size_t n = es > 1 && bytes > es ? bytes / es : 0;
      if (n == 0) {
        want = in;
      } else {
        for (size_t i = 0; i < n; ++i) {
          for (size_t j = 0; j < es; ++j) want[j * n + i] = in[i * es + j];
        }
        for (size_t k = n * es; k < bytes; ++k) want[k] = in[k];
      }
      ShuffleBytes(in.data(), bytes, es, got.data());
      ASSERT_TRUE(std::equal(want.begin(), want.end(), got.begin())) << "element size " << es << ", " << bytes << " bytes";
      ASSERT_EQ(got[bytes], 0xEE) << "wrote past the end: element size " << es << ", " << bytes << " bytes";
      UnshuffleBytes(got.data(), bytes, es, back.data());
      ASSERT_EQ(back, in) << "element size " << es << ", " << bytes << " bytes";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6 * static_cast<int64_t>(sizes.size()));
}

}  // namespace lockstep::traces

namespace lockstep::traces {
namespace {

// What the reader refuses, the writer refuses to write (issue 31: `record --max-batch 5000`
// wrote a trace no reader accepted): a batch wider than /step_batch holds, a tensor wider than
// kMaxCols, a layer index past kMaxLayer, request numbers past the reader's ranges. And the widest
// tensor it accepts gets chunks within the decoded-size limit, and reads back.
TEST(TraceWriterLimits, RefusesWhatTheReaderRefuses) {
  const fs::path path = TempPath("limits.h5");
  TraceWriterOptions wide;
  wide.batch_width = kMaxBatchWidth + 1;
  EXPECT_FALSE(TraceWriter::Create(path, wide).ok());
  auto w = TraceWriter::Create(path, {});
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_FALSE((*w)->DefineTensor({"taps/x", DType::kF32, kMaxCols + 1, true, {}, {}}).ok());
  EXPECT_FALSE((*w)->DefineTensor({"taps/layers.65536.x", DType::kF32, 4, true, {}, {}}).ok());
  EXPECT_FALSE((*w)->DefineTensor({"kv/layers.-1.latent", DType::kU8, 4, true, {}, {}}).ok());
  EXPECT_TRUE((*w)->DefineTensor({"taps/layers.65535.x", DType::kF32, 4, true, {}, {}}).ok());
  RequestRecord r;
  r.prompt = {1};
  r.max_new_tokens = kMaxRequestTokens + 1;
  EXPECT_FALSE((*w)->AddRequest(r).ok());
  r.max_new_tokens = 1;
  r.temperature = 2e6;
  EXPECT_FALSE((*w)->AddRequest(r).ok());
  r.temperature = 1;
  r.top_k = kMaxTopK + 1;
  EXPECT_FALSE((*w)->AddRequest(r).ok());
  r.top_k = 0;
  r.top_p = std::nan("");
  EXPECT_FALSE((*w)->AddRequest(r).ok());
  r.top_p = 1;
  EXPECT_TRUE((*w)->AddRequest(r).ok());
  // 2^22 f32 columns: 16 MiB a row, so chunks of 4 rows (64 MiB decoded), not 8.
  auto t = (*w)->DefineTensor({"taps/widest", DType::kF32, kMaxCols, true, {}, {}});
  ASSERT_TRUE(t.ok()) << t.status().message();
  std::vector<float> row(kMaxCols);
  for (int64_t i = 0; i < kMaxCols; ++i) row[i] = static_cast<float>(i % 97);
  for (int i = 0; i < 5; ++i) {
    SummaryRow s;
    s.position = i;
    Summarize(DType::kF32, row.data(), kMaxCols, &s);
    ASSERT_TRUE((*w)->Append(*t, std::span(&s, 1), row.data()).ok());
  }
  ASSERT_TRUE((*w)->Close().ok()) << (*w)->status().message();
  auto rd = TraceReader::Open(path);
  ASSERT_TRUE(rd.ok()) << rd.status().message();
  const TensorInfo* ti = (*rd)->FindTensor("widest");
  ASSERT_TRUE(ti);
  ASSERT_EQ(ti->rows, 5);
  auto v = (*rd)->ReadValues(*ti, 4, 1);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(std::memcmp(v->data(), row.data(), v->size()), 0);
}

}  // namespace
}  // namespace lockstep::traces
