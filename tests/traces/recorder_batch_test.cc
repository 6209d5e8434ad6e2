// tests/traces/recorder_batch_test.cc — TapHook::OnTapSummaries, the hand-over the CUDA
// backend's summary capture uses: a recorder fed a step's summarised taps in one call must
// write the same trace as one fed them one OnTap at a time (the reference path), with the
// position and tap filters, several requests and rows, and events the batch cannot take (a
// logits row with values, a summary-only tap arriving with values) in the middle. Both traces
// are read back with TraceReader and compared table by table, byte for byte.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/model.h"
#include "recorder/recorder.h"
#include "traces/row_summary.h"
#include "traces/trace_reader.h"
#include "traces/trace_writer.h"

namespace lockstep {
namespace {

std::filesystem::path TempTrace(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / "lockstep_recorder_batch_test";
  std::filesystem::create_directories(dir);
  const auto p = dir / name;
  std::filesystem::remove(p);
  return p;
}

struct Step {
  std::vector<engine::TapEvent> events;
  std::vector<engine::TapRowSummary> summaries;
  std::vector<float> values;
};

// Records `steps` with a fresh recorder into `path`, through OnTapSummaries (batch) or OnTap.
void Record(const std::filesystem::path& path, engine::Engine* eng, const recorder::CapturePolicy& policy,
            const std::vector<Step>& steps, bool batch) {
  traces::TraceWriterOptions wo;
  wo.batch_width = 2;
  auto w = traces::TraceWriter::Create(path, wo);
  ASSERT_TRUE(w.ok()) << w.status().message();
  recorder::RecorderOptions ro;
  ro.policy = policy;
  {
    recorder::Recorder rec(eng, w->get(), ro);
    for (const Step& s : steps) {
      if (batch) {
        rec.OnTapSummaries(s.events);
      } else {
        for (const engine::TapEvent& e : s.events) rec.OnTap(e);
      }
      ASSERT_TRUE(rec.EndStep().ok()) << rec.status().message();
    }
    ASSERT_TRUE(rec.Finish().ok()) << rec.status().message();
  }
  ASSERT_TRUE((*w)->Close().ok());
}

TEST(RecorderBatch, SameTraceAsOneEventAtATime) {
  auto model = engine::Model::Load(std::string(LOCKSTEP_SOURCE_DIR) + "/tests/fixtures/models/v32_sparse");
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto eng = engine::Engine::Create(*model, engine::EngineOptions{});
  ASSERT_TRUE(eng.ok()) << eng.status().message();

  // Tap names live as long as the run (the engine's do): their addresses identify them.
  const std::vector<std::string> names = {"embed", "layers.0.attn.q", "layers.0.ffn.router.topk_ids",
                                          "layers.1.attn.out", "layers.1.resid_out", "final_norm"};
  const std::string logits = "logits";
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<Step> steps(5);
  for (size_t si = 0; si < steps.size(); ++si) {
    Step& s = steps[si];
    // Request 0 decodes one row a step; request 1 starts with a 3-row prompt chunk.
    const int64_t rows1 = si == 0 ? 3 : 1;
    const int64_t pos0 = 10 + static_cast<int64_t>(si), pos1 = si == 0 ? 0 : 2 + static_cast<int64_t>(si);
    s.summaries.resize(names.size() * 4);
    s.values.resize(64 * 4 + 128);
    for (auto& v : s.values) v = u(rng);
    for (auto& r : s.summaries) {
      r.hash = rng();
      r.nan_count = rng() % 3;
      r.rms = u(rng);
      r.absmax = u(rng);
      r.min = u(rng);
      r.max = u(rng);
    }
    for (size_t t = 0; t < names.size(); ++t) {
      for (int64_t req = 0; req < 2; ++req) {
        engine::TapEvent e;
        e.name = names[t];
        e.request_id = req;
        e.position = req == 0 ? pos0 : pos1;
        e.rows = req == 0 ? 1 : rows1;
        e.cols = t == 2 ? 6 : 64;
        e.dtype = t == 2 ? engine::TapDType::kI32 : engine::TapDType::kF32;
        if (si == 3 && t == 3 && req == 1) {
          e.data = s.values.data();  // values where summaries usually come: the host summarises
        } else {
          e.summaries = &s.summaries[t * 4 + (req == 0 ? 0 : 1)];
        }
        s.events.push_back(e);
      }
      if (t == 3) {  // a logits row (values) among the summarised taps
        engine::TapEvent e;
        e.name = logits;
        e.request_id = 0;
        e.position = pos0;
        e.rows = 1;
        e.cols = 128;
        e.data = s.values.data() + 64 * 4;
        s.events.push_back(e);
      }
    }
  }

  recorder::CapturePolicy policy;
  policy.mode = recorder::CapturePolicy::Mode::kSummary;
  policy.taps = {"embed", "layers.*", "logits"};  // not final_norm
  policy.pos_first = 1;
  policy.pos_stride = 2;  // odd positions only
  const auto a = TempTrace("one_at_a_time.h5"), b = TempTrace("batch.h5");
  Record(a, eng->get(), policy, steps, false);
  Record(b, eng->get(), policy, steps, true);

  auto ra = traces::TraceReader::Open(a);
  auto rb = traces::TraceReader::Open(b);
  ASSERT_TRUE(ra.ok()) << ra.status().message();
  ASSERT_TRUE(rb.ok()) << rb.status().message();
  ASSERT_EQ((*ra)->tensors().size(), (*rb)->tensors().size());
  int64_t rows = 0;
  for (const traces::TensorInfo& ta : (*ra)->tensors()) {
    const traces::TensorInfo* tb = (*rb)->FindTensor(ta.path);
    ASSERT_NE(tb, nullptr) << ta.path;
    EXPECT_NE(ta.name, "final_norm");  // the tap filter held
    auto sa = (*ra)->ReadSummary(ta);
    auto sb = (*rb)->ReadSummary(*tb);
    ASSERT_TRUE(sa.ok() && sb.ok()) << ta.path;
    ASSERT_EQ(sa->size(), sb->size()) << ta.path;
    ASSERT_EQ(0, std::memcmp(sa->data(), sb->data(), sa->size() * sizeof(traces::SummaryRow))) << ta.path;
    for (const traces::SummaryRow& r : *sa) EXPECT_EQ(r.position % 2, 1) << ta.path;  // the position filter held
    rows += static_cast<int64_t>(sa->size());
    ASSERT_EQ(ta.has_values, tb->has_values);
    if (ta.has_values) {
      auto va = (*ra)->ReadValues(ta, 0, ta.rows);
      auto vb = (*rb)->ReadValues(*tb, 0, tb->rows);
      ASSERT_TRUE(va.ok() && vb.ok()) << ta.path;
      EXPECT_EQ(*va, *vb) << ta.path;
    }
  }
  // 5 taps pass the filter; their odd-position rows: request 0 at 11, 13 (steps 1, 3); request 1
  // at 1 (step 0's prompt rows 0–2), 3, 5 (steps 1, 3) — 5 a tap; logits: 2.
  EXPECT_EQ(rows, 5 * 5 + 2);
  // A summary the backend computed reaches the trace as it was (one row checked by hand).
  const traces::TensorInfo* q = (*rb)->FindTensor("taps/layers.0.attn.q");
  ASSERT_NE(q, nullptr);
  auto sq = (*rb)->ReadSummary(*q);
  ASSERT_TRUE(sq.ok());
  ASSERT_FALSE(sq->empty());
  const traces::SummaryRow& first = sq->front();  // step 0, request 1, position 1 (its prompt's second row)
  EXPECT_EQ(first.step, 0);
  EXPECT_EQ(first.request, 1);
  EXPECT_EQ(first.position, 1);
  EXPECT_EQ(first.hash, steps[0].summaries[1 * 4 + 1 + 1].hash);
}

// TapHook::OnStepTaps, the CUDA backend's hand-over (one event a tensor, its rows every
// segment's): TapHook's default splits each event into one a segment — request, position,
// rows, the data and summaries at the segment's first row, in order, the summary-only ones
// gathered into OnTapSummaries calls between the others.
TEST(RecorderBatch, StepTapsSplitIntoOneEventASegment) {
  struct Seen : engine::TapHook {
    std::vector<std::string> log;
    void OnTap(const engine::TapEvent& e) override {
      log.push_back("tap " + std::string(e.name) + " r" + std::to_string(e.request_id) + " p" +
                    std::to_string(e.position) + " n" + std::to_string(e.rows) + " d" +
                    std::to_string(e.data ? *static_cast<const float*>(e.data) : -1.0f) + " s" +
                    std::to_string(e.summaries ? static_cast<int64_t>(e.summaries->hash) : -1));
    }
    void OnTapSummaries(std::span<const engine::TapEvent> events) override {
      log.push_back("batch of " + std::to_string(events.size()));
      for (const auto& e : events) OnTap(e);
    }
  } hook;
  const std::vector<float> values = {0, 1, 2, 3, 4, 5, 6, 7};  // 4 rows × 2 cols
  std::vector<engine::TapRowSummary> sums(4);
  for (int i = 0; i < 4; ++i) sums[i].hash = 10 + i;
  const std::string a = "a", b = "b", c = "c";
  std::vector<engine::TapEvent> events(3);
  for (auto& e : events) {
    e.rows = 4;
    e.cols = 2;
  }
  events[0].name = a;
  events[0].summaries = sums.data();  // summary-only
  events[1].name = b;
  events[1].summaries = sums.data();
  events[2].name = c;
  events[2].data = values.data();  // values with summaries
  events[2].summaries = sums.data();
  const std::vector<engine::TapSegment> segs = {{7, 40, 1}, {3, 0, 3}};
  hook.engine::TapHook::OnStepTaps(events, segs);
  const std::vector<std::string> want = {
      "batch of 4",
      "tap a r7 p40 n1 d-1.000000 s10", "tap a r3 p0 n3 d-1.000000 s11",
      "tap b r7 p40 n1 d-1.000000 s10", "tap b r3 p0 n3 d-1.000000 s11",
      "tap c r7 p40 n1 d0.000000 s10", "tap c r3 p0 n3 d2.000000 s11"};
  EXPECT_EQ(hook.log, want);
}

// The recorder's own OnStepTaps writes the trace TapHook's split would have made it write,
// table by table and byte for byte: summary capture, and full capture with the values lent
// (one append a tensor) — with every position kept, and with a position filter (the rows then
// go one segment at a time); a step whose events cover a prompt's 3 rows and a decode row.
TEST(RecorderBatch, StepTapsWriteTheSameTraceAsTheirSplit) {
  auto model = engine::Model::Load(std::string(LOCKSTEP_SOURCE_DIR) + "/tests/fixtures/models/v32_sparse");
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto eng = engine::Engine::Create(*model, engine::EngineOptions{});
  ASSERT_TRUE(eng.ok()) << eng.status().message();
  const std::vector<std::string> names = {"embed", "layers.0.attn.q", "layers.0.ffn.router.topk_ids", "layers.1.resid_out"};
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  struct StepData {
    std::vector<engine::TapSegment> segs;
    std::vector<std::vector<float>> values;  // a tensor's rows
    std::vector<std::vector<engine::TapRowSummary>> sums;
  };
  std::vector<StepData> steps(4);
  for (size_t si = 0; si < steps.size(); ++si) {
    StepData& d = steps[si];
    d.segs = {{0, 10 + static_cast<int64_t>(si), 1}, {1, si == 0 ? 0 : 2 + static_cast<int64_t>(si), si == 0 ? 3 : 1}};
    const int64_t rows = d.segs[0].rows + d.segs[1].rows;
    for (size_t t = 0; t < names.size(); ++t) {
      const int64_t cols = t == 2 ? 6 : 64;
      std::vector<float> v(rows * cols);
      for (auto& x : v) x = u(rng);
      if (t == 2) {
        for (auto& x : v) {
          const int32_t k = static_cast<int32_t>(rng() % 64);
          std::memcpy(&x, &k, 4);
        }
      }
      std::vector<engine::TapRowSummary> sm(rows);
      for (int64_t r = 0; r < rows; ++r) {  // the host's summaries of the rows (as the GPU's are)
        traces::SummaryRow h;
        traces::Summarize(t == 2 ? traces::DType::kI32 : traces::DType::kF32, &v[r * cols], cols, &h);
        sm[r] = {h.hash, h.nan_count, h.inf_count, h.rms, h.absmax, h.min, h.max};
      }
      d.values.push_back(std::move(v));
      d.sums.push_back(std::move(sm));
    }
  }
  auto record = [&](const std::filesystem::path& path, recorder::CapturePolicy::Mode mode, int64_t stride, bool own) {
    traces::TraceWriterOptions wo;
    wo.batch_width = 2;
    auto w = traces::TraceWriter::Create(path, wo);
    ASSERT_TRUE(w.ok()) << w.status().message();
    recorder::RecorderOptions ro;
    ro.policy.mode = mode;
    ro.policy.pos_stride = stride;
    ro.policy.kv = false;
    {
      recorder::Recorder rec(eng->get(), w->get(), ro);
      for (const StepData& d : steps) {
        std::vector<engine::TapEvent> events(names.size());
        auto owner = std::make_shared<int>(0);  // stands for the backend's lent buffer
        for (size_t t = 0; t < names.size(); ++t) {
          engine::TapEvent& e = events[t];
          e.name = names[t];
          e.rows = d.segs[0].rows + d.segs[1].rows;
          e.cols = t == 2 ? 6 : 64;
          e.dtype = t == 2 ? engine::TapDType::kI32 : engine::TapDType::kF32;
          e.summaries = d.sums[t].data();
          if (mode == recorder::CapturePolicy::Mode::kFull) {
            e.data = d.values[t].data();
            e.owner = owner;
          }
        }
        if (own) {
          rec.OnStepTaps(events, d.segs);
        } else {
          rec.engine::TapHook::OnStepTaps(events, d.segs);
        }
        ASSERT_TRUE(rec.EndStep().ok()) << rec.status().message();
      }
      ASSERT_TRUE(rec.Finish().ok()) << rec.status().message();
    }
    ASSERT_TRUE((*w)->Close().ok());
  };
  int64_t compared = 0;
  for (auto mode : {recorder::CapturePolicy::Mode::kSummary, recorder::CapturePolicy::Mode::kFull}) {
    for (int64_t stride : {1, 2}) {
      const std::string tag = std::string(recorder::CapturePolicy::ModeName(mode)) + "_" + std::to_string(stride);
      const auto a = TempTrace("step_split_" + tag + ".h5"), b = TempTrace("step_own_" + tag + ".h5");
      record(a, mode, stride, false);
      record(b, mode, stride, true);
      auto ra = traces::TraceReader::Open(a);
      auto rb = traces::TraceReader::Open(b);
      ASSERT_TRUE(ra.ok() && rb.ok()) << tag;
      ASSERT_EQ((*ra)->tensors().size(), (*rb)->tensors().size()) << tag;
      for (const traces::TensorInfo& ta : (*ra)->tensors()) {
        const traces::TensorInfo* tb = (*rb)->FindTensor(ta.path);
        ASSERT_NE(tb, nullptr) << tag << " " << ta.path;
        auto sa = (*ra)->ReadSummary(ta);
        auto sb = (*rb)->ReadSummary(*tb);
        ASSERT_TRUE(sa.ok() && sb.ok()) << ta.path;
        ASSERT_EQ(sa->size(), sb->size()) << tag << " " << ta.path;
        ASSERT_EQ(0, std::memcmp(sa->data(), sb->data(), sa->size() * sizeof(traces::SummaryRow))) << tag << " " << ta.path;
        ASSERT_EQ(ta.has_values, tb->has_values);
        EXPECT_EQ(ta.has_values, mode == recorder::CapturePolicy::Mode::kFull) << ta.path;
        if (ta.has_values) {
          auto va = (*ra)->ReadValues(ta, 0, ta.rows);
          auto vb = (*rb)->ReadValues(*tb, 0, tb->rows);
          ASSERT_TRUE(va.ok() && vb.ok()) << ta.path;
          EXPECT_EQ(*va, *vb) << tag << " " << ta.path;
        }
        compared += static_cast<int64_t>(sa->size());
      }
    }
  }
  // Every position kept: 4 tensors × 10 rows (4 in the first step, 2 in each of three more) in
  // each mode; the stride keeps some of them too.
  EXPECT_GT(compared, 2 * 4 * 10);
}

// TapHook::WantsKvTaps: a backend that summarised a step's KV cache rows where it stores
// them sends kv/ events, and the host cache does not hold those rows. The recorder in summary
// capture asks for them, writes the events' summaries to the KV tensors OnForward would have
// written (the same paths), and does not read the cache in that step; in a step without kv/
// events it reads the cache as before. A kv/ event for a layer the policy drops is dropped.
TEST(RecorderBatch, KvSummariesFromTheBackendReplaceTheCacheRows) {
  auto model = engine::Model::Load(std::string(LOCKSTEP_SOURCE_DIR) + "/tests/fixtures/models/v32_sparse");
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto eng = engine::Engine::Create(*model, engine::EngineOptions{});
  ASSERT_TRUE(eng.ok()) << eng.status().message();
  engine::PagedKvCache& cache = (*eng)->cache();
  ASSERT_GE(cache.streams(0).size(), 1u);
  const std::string stream = cache.streams(0)[0].name;
  const engine::KvPart part = cache.parts(0, 0).at(0);
  const int64_t layers = (*model)->config().num_hidden_layers;
  ASSERT_GE(layers, 2);

  // One request's cache holding two tokens of known bytes.
  engine::SeqCache seq;
  ASSERT_TRUE(cache.Reserve(&seq, 2).ok());
  std::mt19937 rng(11);
  for (int64_t l = 0; l < layers; ++l) {
    for (size_t si = 0; si < cache.streams(l).size(); ++si) {
      for (int64_t pos = 0; pos < 2; ++pos) {
        uint8_t* b = cache.MutableTokenBytes(l, si, seq, pos);
        std::vector<float> v(static_cast<size_t>(cache.streams(l)[si].bytes_per_token / 4));
        for (auto& x : v) x = static_cast<float>(rng() % 1000) / 100.0f - 5.0f;
        std::memcpy(b, v.data(), v.size() * 4);
      }
    }
  }
  const std::vector<int32_t> token = {5};

  const auto path = TempTrace("kv_summaries.h5");
  traces::TraceWriterOptions wo;
  auto w = traces::TraceWriter::Create(path, wo);
  ASSERT_TRUE(w.ok()) << w.status().message();
  recorder::RecorderOptions ro;
  ro.policy.mode = recorder::CapturePolicy::Mode::kSummary;
  ro.policy.layer_first = ro.policy.layer_last = 0;  // layer 1's events are dropped
  engine::TapRowSummary fed;
  fed.hash = 0x1234;
  fed.rms = 2.5f;
  fed.min = -1;
  fed.max = 3;
  fed.absmax = 3;
  const std::string name0 = "kv/layers.0." + stream + part.suffix, name1 = "kv/layers.1." + stream + part.suffix;
  {
    recorder::Recorder rec(eng->get(), w->get(), ro);
    EXPECT_TRUE(rec.WantsKvTaps());
    EXPECT_FALSE(rec.WantsTapValues());
    // Step 0 (position 0): the backend's summaries; the cache is not read.
    std::vector<engine::TapEvent> events(2);
    for (int i = 0; i < 2; ++i) {
      events[i].name = i == 0 ? name0 : name1;
      events[i].request_id = 0;
      events[i].position = 0;
      events[i].rows = 1;
      events[i].cols = part.cols;
      events[i].dtype = part.type;
      events[i].summaries = &fed;
    }
    rec.OnTapSummaries(events);
    engine::Segment seg;
    seg.cache = &seq;
    seg.tokens = token;
    seg.start_pos = 0;
    rec.OnForward(std::span<const engine::Segment>(&seg, 1), cache);
    ASSERT_TRUE(rec.EndStep().ok()) << rec.status().message();
    // Step 1 (position 1): no kv/ events, so the rows come from the cache.
    seg.start_pos = 1;
    rec.OnForward(std::span<const engine::Segment>(&seg, 1), cache);
    ASSERT_TRUE(rec.EndStep().ok()) << rec.status().message();
    ASSERT_TRUE(rec.Finish().ok()) << rec.status().message();
    // Its time on the engine thread, by callback: each of them ran.
    const recorder::Recorder::EngineThreadTimes& times = rec.engine_thread_times();
    EXPECT_GT(times.taps_ns, 0);
    EXPECT_GT(times.kv_ns, 0);
    EXPECT_GT(times.steps_ns, 0);
  }
  ASSERT_TRUE((*w)->Close().ok());
  auto r = traces::TraceReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const traces::TensorInfo* t = (*r)->FindTensor(name0);
  ASSERT_NE(t, nullptr) << name0;
  EXPECT_EQ((*r)->FindTensor(name1), nullptr);
  auto rows = (*r)->ReadSummary(*t);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_EQ((*rows)[0].position, 0);
  EXPECT_EQ((*rows)[0].step, 0);
  EXPECT_EQ((*rows)[0].hash, 0x1234u);
  EXPECT_EQ((*rows)[0].rms, 2.5f);
  EXPECT_EQ((*rows)[1].position, 1);
  traces::SummaryRow want;
  traces::Summarize(part.type == engine::TapDType::kF32 ? traces::DType::kF32 : traces::DType::kBf16,
                    cache.TokenBytes(0, 0, seq, 1) + part.offset, part.cols, &want);
  EXPECT_EQ((*rows)[1].hash, want.hash);
  EXPECT_EQ((*rows)[1].rms, want.rms);
  // The other streams of layer 0 (index keys) came from neither: step 0 had kv/ events, so
  // only step 1's row.
  for (size_t si = 1; si < cache.streams(0).size(); ++si) {
    const traces::TensorInfo* k = (*r)->FindTensor("kv/layers.0." + cache.streams(0)[si].name);
    ASSERT_NE(k, nullptr);
    auto kr = (*r)->ReadSummary(*k);
    ASSERT_TRUE(kr.ok());
    ASSERT_EQ(kr->size(), 1u);
    EXPECT_EQ((*kr)[0].position, 1);
  }
  cache.Release(&seq);
}

TEST(TraceWriter, AppendSummariesRefusesWhatAppendWould) {
  const auto p = TempTrace("append_summaries.h5");
  auto w = traces::TraceWriter::Create(p, traces::TraceWriterOptions{});
  ASSERT_TRUE(w.ok());
  traces::TensorSpec s;
  s.path = "taps/a";
  s.cols = 4;
  s.values = false;
  auto ha = (*w)->DefineTensor(s);
  s.path = "taps/b";
  s.values = true;
  auto hb = (*w)->DefineTensor(s);
  ASSERT_TRUE(ha.ok() && hb.ok());
  std::vector<traces::SummaryRow> rows(2);
  const std::vector<int32_t> one = {*ha};
  Status st = (*w)->AppendSummaries(one, rows);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("1 tensor handles for 2 summary rows"), std::string::npos) << st.message();
  const std::vector<int32_t> unknown = {*ha, 99};
  st = (*w)->AppendSummaries(unknown, rows);
  EXPECT_NE(st.message().find("unknown tensor handle 99"), std::string::npos) << st.message();
  const std::vector<int32_t> valued = {*ha, *hb};
  st = (*w)->AppendSummaries(valued, rows);
  EXPECT_NE(st.message().find("'taps/b' stores values"), std::string::npos) << st.message();
  const std::vector<int32_t> ok = {*ha, *ha};
  EXPECT_TRUE((*w)->AppendSummaries(ok, rows).ok());
  ASSERT_TRUE((*w)->Close().ok());
  auto r = traces::TraceReader::Open(p);
  ASSERT_TRUE(r.ok());
  const traces::TensorInfo* a = (*r)->FindTensor("taps/a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->rows, 2);
  const traces::TensorInfo* b = (*r)->FindTensor("taps/b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->rows, 0);
}

}  // namespace
}  // namespace lockstep
