// tests/replay_test.cc — replay and diff, end to end through real traces: exact replays are
// bit-exact, a changed kernel is named at the right place, teacher forcing lines positions up,
// free replays report where the text parts, grafting isolates each layer's own error, and
// every fault of the zoo is found at the layer, position and tap where it strikes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "diff/trace_diff.h"
#include "recorder/fingerprint.h"
#include "recorder/record_session.h"
#include "traces/row_summary.h"
#include "replayer/replay_session.h"
#include "test_util.h"

namespace lockstep {
namespace {

namespace fs = std::filesystem;

class ReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A parameterised test's name has a '/' ("Case/3"): flattened, so TearDown removes all.
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = fs::temp_directory_path() / ("lockstep_replay_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::vector<int32_t> Prompt(int n, uint32_t seed, int64_t vocab = 256) {
    std::mt19937 rng(seed);
    std::vector<int32_t> p(n);
    for (auto& t : p) t = static_cast<int32_t>(rng() % vocab);
    return p;
  }

  // Records `prompts` on a fixture model into dir_/name.
  fs::path Record(const std::string& fixture, const std::string& name, std::vector<std::vector<int32_t>> prompts,
                  engine::EngineOptions eo = {}, double temperature = 0.0, int64_t new_tokens = 6,
                  recorder::CapturePolicy::Mode mode = recorder::CapturePolicy::Mode::kFull,
                  size_t summarize_here_max_row_bytes = size_t{64} << 10) {
    const fs::path model_dir = testing::FixtureDir() / "models" / fixture;
    auto model = engine::Model::Load(model_dir);
    EXPECT_TRUE(model.ok()) << model.status().message();
    auto eng = engine::Engine::Create(*model, eo);
    EXPECT_TRUE(eng.ok()) << eng.status().message();
    std::vector<recorder::RecordedRequest> reqs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      engine::Request r;
      r.name = "r" + std::to_string(i);
      r.prompt = prompts[i];
      r.max_new_tokens = new_tokens;
      r.sampling.temperature = temperature;
      r.sampling.seed = 100 + i;
      reqs.push_back({r, ""});
    }
    recorder::RecordSessionOptions so;
    so.output = dir_ / name;
    so.policy.mode = mode;
    so.policy.logits = logits_;
    so.policy.logits_topk = logits_topk_;
    so.summarize_here_max_row_bytes = summarize_here_max_row_bytes;
    auto fp = recorder::ModelFingerprint(model_dir);
    EXPECT_TRUE(fp.ok());
    so.meta = {{"model_dir", model_dir.string()}, {"model_fingerprint", *fp}, {"tokenizer_hash", "none"}};
    for (const auto& [k, v] : extra_meta_) so.meta[k] = v;
    auto res = recorder::RecordRun(**eng, reqs, so);
    EXPECT_TRUE(res.ok()) << res.status().message();
    if (res.ok()) {  // the recorder's own engine-thread time: some, and within the run
      EXPECT_GT(res->recorder_ns, 0);
      EXPECT_LE(res->recorder_ns, static_cast<int64_t>(res->run_s * 1e9));
    }
    return so.output;
  }

  replayer::ReplayResult Replay(const fs::path& trace, replayer::ReplayOptions o) {
    auto t = traces::TraceReader::Open(trace);
    EXPECT_TRUE(t.ok()) << t.status().message();
    o.output = dir_ / ("replay_" + std::to_string(counter_++) + ".h5");
    auto r = replayer::Replay(**t, o);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? *r : replayer::ReplayResult{};
  }

  diff::TraceDiffReport Diff(const fs::path& a, const fs::path& b) {
    auto ta = traces::TraceReader::Open(a);
    auto tb = traces::TraceReader::Open(b);
    EXPECT_TRUE(ta.ok() && tb.ok());
    auto r = diff::CompareTraces(**ta, **tb);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return *r;
  }

  fs::path dir_;
  int counter_ = 0;
  std::map<std::string, std::string> extra_meta_;  // meta keys Record writes over the recorder's
  recorder::CapturePolicy::Logits logits_ = recorder::CapturePolicy::Logits::kFull;  // for Record
  int64_t logits_topk_ = 32;
};

TEST_F(ReplayTest, ExactReplayIsBitExactInFullAndSummaryCapture) {
  for (auto mode : {recorder::CapturePolicy::Mode::kFull, recorder::CapturePolicy::Mode::kSummary}) {
    auto t = Record("v32_sparse", "run.h5", {Prompt(20, 1), Prompt(33, 2)}, {}, 0.8, 8, mode);
    auto r = Replay(t, {});
    EXPECT_TRUE(r.deterministic) << r.verdict;
    EXPECT_NE(r.verdict.find("deterministic"), std::string::npos);
    EXPECT_GT(r.diff.tensors.size(), 20u);
  }
}

// Summary capture summarises narrow rows on the engine's thread and wide ones (above
// RecorderOptions::summarize_here_max_row_bytes) on the writer's: with every row sent to the
// writer the trace's summaries are the same, tensor for tensor.
TEST_F(ReplayTest, SummariesAreTheSameMadeOnEitherThread) {
  const auto summary = recorder::CapturePolicy::Mode::kSummary;
  auto here = Record("v3_basic", "here.h5", {Prompt(14, 6), Prompt(9, 7)}, {}, 0.8, 6, summary);
  auto writer = Record("v3_basic", "writer.h5", {Prompt(14, 6), Prompt(9, 7)}, {}, 0.8, 6, summary, 0);
  auto d = Diff(here, writer);
  EXPECT_FALSE(d.has_divergence) << d.first.tensor;
  EXPECT_GT(d.tensors.size(), 20u);
}

// Full capture with top-k logits (the mode for large vocabularies): the stored ids and values
// are the k best of the row (value descending, the lower id first on ties) and logsumexp is
// within a float ulp of log Σ exp over the row (long double) and exactly traces::LogitsTopK's,
// checked against a recording of the same run that keeps the whole rows.
TEST_F(ReplayTest, TopKLogitsAreTheBestOfTheWholeRow) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(10, 8), Prompt(7, 9)};
  auto whole = Record("v3_basic", "whole.h5", prompts, {}, 0.8, 5);
  logits_ = recorder::CapturePolicy::Logits::kTopK;
  logits_topk_ = 8;
  auto top = Record("v3_basic", "top.h5", prompts, {}, 0.8, 5);
  auto rw = traces::TraceReader::Open(whole);
  auto rt = traces::TraceReader::Open(top);
  ASSERT_TRUE(rw.ok() && rt.ok());
  const traces::TensorInfo* lw = (*rw)->FindTensor("taps/logits");
  const traces::TensorInfo* ids = (*rt)->FindTensor("taps/logits.topk_ids");
  const traces::TensorInfo* vals = (*rt)->FindTensor("taps/logits.topk_values");
  const traces::TensorInfo* lse = (*rt)->FindTensor("taps/logits.logsumexp");
  ASSERT_TRUE(lw && ids && vals && lse);
  ASSERT_TRUE(lw->has_values);
  const int64_t V = lw->cols, k = 8, rows = lw->rows;
  ASSERT_EQ(ids->cols, k);
  ASSERT_EQ(ids->rows, rows);
  ASSERT_GE(rows, 10);
  auto w = (*rw)->ReadValues(*lw, 0, rows);
  auto i_ = (*rt)->ReadValues(*ids, 0, rows);
  auto v_ = (*rt)->ReadValues(*vals, 0, rows);
  auto l_ = (*rt)->ReadValues(*lse, 0, rows);
  ASSERT_TRUE(w.ok() && i_.ok() && v_.ok() && l_.ok());
  const auto* wf = reinterpret_cast<const float*>(w->data());
  const auto* gi = reinterpret_cast<const int32_t*>(i_->data());
  const auto* gv = reinterpret_cast<const float*>(v_->data());
  const auto* gl = reinterpret_cast<const float*>(l_->data());
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = wf + r * V;
    std::vector<int32_t> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    long double m = -INFINITY, sum = 0;  // the exact value, to within long double's rounding
    for (int64_t i = 0; i < V; ++i) m = std::fmax(m, static_cast<long double>(row[i]));
    for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<long double>(row[i]) - m);
    const float exact = static_cast<float>(m + std::log(sum));
    EXPECT_LE(std::fabs(gl[r] - exact), std::nextafter(std::fabs(exact), INFINITY) - std::fabs(exact)) << "row " << r;
    float lse = 0;  // and exactly the trace format's definition
    std::vector<int32_t> di(k);
    std::vector<float> dv(k);
    traces::LogitsTopK(row, V, k, di.data(), dv.data(), &lse);
    EXPECT_EQ(std::memcmp(&gl[r], &lse, 4), 0) << "row " << r;
    for (int64_t j = 0; j < k; ++j) {
      ASSERT_EQ(gi[r * k + j], order[j]) << "row " << r << " rank " << j;
      ASSERT_EQ(std::memcmp(&gv[r * k + j], &row[order[j]], 4), 0) << "row " << r << " rank " << j;
    }
  }
}

// And each row's logsumexp at its request's sampling temperature (logits.logsumexp_t, what
// verify redraws a top-p token with): within a float ulp of log Σ exp(x / T) over the whole row
// (long double) and exactly traces::LogitsLogSumExp's; a greedy recording has none.
TEST_F(ReplayTest, TopKLogitsKeepTheLogsumexpAtTheSamplingTemperature) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(10, 8), Prompt(7, 9)};
  const double T = 0.8;
  auto whole = Record("v3_basic", "whole_t.h5", prompts, {}, T, 5);
  logits_ = recorder::CapturePolicy::Logits::kTopK;
  logits_topk_ = 8;
  auto top = Record("v3_basic", "top_t.h5", prompts, {}, T, 5);
  auto greedy = Record("v3_basic", "top_greedy.h5", prompts, {}, 0.0, 5);
  auto rw = traces::TraceReader::Open(whole);
  auto rt = traces::TraceReader::Open(top);
  auto rg = traces::TraceReader::Open(greedy);
  ASSERT_TRUE(rw.ok() && rt.ok() && rg.ok());
  EXPECT_EQ((*rg)->FindTensor("taps/logits.logsumexp_t"), nullptr);
  ASSERT_NE((*rg)->FindTensor("taps/logits.logsumexp"), nullptr);
  const traces::TensorInfo* lw = (*rw)->FindTensor("taps/logits");
  const traces::TensorInfo* lt = (*rt)->FindTensor("taps/logits.logsumexp_t");
  ASSERT_TRUE(lw && lt);
  ASSERT_EQ(lt->cols, 1);
  ASSERT_EQ(lt->dtype, traces::DType::kF32);
  const int64_t V = lw->cols, rows = lw->rows;
  ASSERT_EQ(lt->rows, rows);
  auto w = (*rw)->ReadValues(*lw, 0, rows);
  auto l_ = (*rt)->ReadValues(*lt, 0, rows);
  ASSERT_TRUE(w.ok() && l_.ok());
  const auto* wf = reinterpret_cast<const float*>(w->data());
  const auto* gl = reinterpret_cast<const float*>(l_->data());
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = wf + r * V;
    long double m = -INFINITY, sum = 0;
    for (int64_t i = 0; i < V; ++i) m = std::fmax(m, static_cast<long double>(row[i]));
    for (int64_t i = 0; i < V; ++i) sum += std::exp((static_cast<long double>(row[i]) - m) / T);
    const float exact = static_cast<float>(m / T + std::log(sum));
    EXPECT_LE(std::fabs(gl[r] - exact), std::nextafter(std::fabs(exact), INFINITY) - std::fabs(exact)) << "row " << r;
    const float mine = traces::LogitsLogSumExp(row, V, T);
    EXPECT_EQ(std::memcmp(&gl[r], &mine, 4), 0) << "row " << r;
  }
}

TEST_F(ReplayTest, ExactReplayNamesTheFirstDifferingTensor) {
  auto t = Record("v3_basic", "run.h5", {Prompt(12, 3)});
  replayer::ReplayOptions o;
  o.overrides.kernels = {{"attn_decode", "expanded"}};  // same math, other summation order
  auto r = Replay(t, o);
  EXPECT_FALSE(r.deterministic);
  ASSERT_TRUE(r.diff.has_divergence);
  // Prefill uses the same kernel either way; the first decode row (position 12) differs first,
  // in layer 0's attention output.
  EXPECT_EQ(r.diff.first.position, 12);
  EXPECT_EQ(r.diff.first.layer, 0);
  EXPECT_EQ(r.diff.first.tensor, "taps/layers.0.attn.heads");
  EXPECT_NE(r.verdict.find("NOT deterministic"), std::string::npos) << r.verdict;
  EXPECT_EQ(r.verdict.find("recorded by lockstep"), std::string::npos) << "same build: " << r.verdict;

  // A trace from another build says so: a kernel's definition may have moved between them.
  extra_meta_ = {{"git_revision", "0123456789ab"}};
  auto old = Record("v3_basic", "old.h5", {Prompt(12, 3)});
  auto r2 = Replay(old, o);
  EXPECT_FALSE(r2.deterministic);
  EXPECT_NE(r2.verdict.find("recorded by lockstep 0123456789ab"), std::string::npos) << r2.verdict;
  EXPECT_TRUE(Replay(old, {}).deterministic) << "the revision alone changes nothing";
}

TEST_F(ReplayTest, ForcedReplayFeedsTheRecordedTokens) {
  auto t = Record("v3_basic", "run.h5", {Prompt(12, 4)}, {}, 0.9, 10);
  replayer::ReplayOptions o;
  o.mode = replayer::ReplayMode::kForced;
  o.overrides.temperature = 0.0;  // would choose other tokens if it were free
  o.overrides.kv_cache = engine::KvFormat::kBf16;
  auto r = Replay(t, o);
  ASSERT_EQ(r.diff.requests.size(), 1u);
  EXPECT_EQ(r.diff.requests[0].first_token_diff, -1) << "teacher forcing keeps the recorded tokens";
  ASSERT_TRUE(r.diff.has_divergence);
  EXPECT_EQ(r.diff.first.position, 0);
  EXPECT_EQ(r.diff.first.tensor, "taps/layers.0.attn.heads") << "the first read of the bf16 cache";
}

TEST_F(ReplayTest, FreeReplayReportsWhereTheTextParts) {
  auto t = Record("v3_basic", "run.h5", {Prompt(12, 5)}, {}, 0.0, 12);
  replayer::ReplayOptions o;
  o.mode = replayer::ReplayMode::kFree;
  o.overrides.temperature = 1.5;
  auto r = Replay(t, o);
  ASSERT_EQ(r.diff.requests.size(), 1u);
  EXPECT_GE(r.diff.requests[0].first_token_diff, 0) << r.verdict;
  EXPECT_NE(r.verdict.find("first differ at token"), std::string::npos) << r.verdict;
  // The same seeds and settings reproduce the run: free replay without overrides matches.
  replayer::ReplayOptions same;
  same.mode = replayer::ReplayMode::kFree;
  auto s = Replay(t, same);
  EXPECT_EQ(s.diff.requests[0].first_token_diff, -1) << s.verdict;
}

// A trace from another backend replays in the kernels that ran there wherever this backend has
// them: the recording engine's resolved choices (meta.kernels), its defaults included. Here a
// CPU recording whose meta says what a CUDA engine's would — backend cuda, nothing asked for,
// attn_prefill=absorbed resolved (the CUDA backend's only form; the CPU's default is expanded)
// and a softmax variant this backend lacks — replays on the CPU in the absorbed prefill, with
// the CPU's own softmax.
TEST_F(ReplayTest, AnotherBackendsTraceReplaysInTheKernelsThatRan) {
  const engine::EngineOptions d;
  const nlohmann::json cuda_options = {{"kv_cache", "fp32"},     {"page_size", d.page_size},
                                       {"kv_cache_tokens", d.kv_cache_tokens}, {"max_batch", d.max_batch},
                                       {"kernels", nlohmann::json::object()}, {"fault", ""},
                                       {"backend", "cuda"},      {"max_prefill_tokens", 0}};
  extra_meta_ = {{"backend", "cuda"},
                 {"engine_options", cuda_options.dump()},
                 {"kernels", nlohmann::json({{"attn_prefill", "absorbed"},
                                             {"attn_decode", "absorbed"},
                                             {"gemm", "fp32"},
                                             {"softmax", "online_tiles_cuda_only"}})
                                 .dump()}};
  const fs::path trace = Record("v3_basic", "cuda_like.h5", {Prompt(9, 4)});
  replayer::ReplayOptions o;
  o.overrides.backend = "cpu";
  o.mode = replayer::ReplayMode::kForced;
  const replayer::ReplayResult r = Replay(trace, o);
  EXPECT_EQ(r.engine_options.backend, "cpu");
  EXPECT_EQ(r.engine_options.kernels.count("attn_prefill") ? r.engine_options.kernels.at("attn_prefill") : "",
            "absorbed");
  EXPECT_EQ(r.engine_options.kernels.count("gemm") ? r.engine_options.kernels.at("gemm") : "", "fp32");
  EXPECT_EQ(r.engine_options.kernels.count("softmax"), 0u) << "a variant the CPU lacks must not carry over";
  // cuBLAS (the GPU's gemm=fp32) and a variant the CPU lacks: differing bits are expected, and
  // the verdict says which kernels make them so.
  EXPECT_NE(r.verdict.find("Not bit-identical, as expected: gemm=fp32, softmax=online_tiles_cuda_only ran on cuda"),
            std::string::npos)
      << r.verdict;

  // A replay on the recording's own backend is what was asked for, defaults left to resolve.
  extra_meta_.clear();
  const fs::path cpu_trace = Record("v3_basic", "cpu.h5", {Prompt(9, 4)});
  const replayer::ReplayResult same = Replay(cpu_trace, {});
  EXPECT_EQ(same.engine_options.kernels.count("attn_prefill"), 0u);
}

// Across backends with nothing else changed, the verdict says whether equal bits were to be
// expected: a "GPU" trace (recorded here under variants whose CUDA twins share the CPU's bits,
// its meta claiming cuda) replays bit-identical and says so; when the recording's own kernels
// were other than its meta names, the difference is flagged as not rounding.
TEST_F(ReplayTest, AcrossBackendsTheVerdictSaysWhetherBitsShouldMatch) {
  const nlohmann::json shared = {{"gemm", "bf16_dot"}, {"attn_prefill", "absorbed"}, {"attn_decode", "absorbed"},
                                 {"norm", "lanes256"}};
  const engine::EngineOptions d;
  const nlohmann::json cuda_options = {{"kv_cache", "fp32"},     {"page_size", d.page_size},
                                       {"kv_cache_tokens", d.kv_cache_tokens}, {"max_batch", d.max_batch},
                                       {"kernels", shared}, {"fault", ""},
                                       {"backend", "cuda"},      {"max_prefill_tokens", 0}};
  extra_meta_ = {{"backend", "cuda"}, {"engine_options", cuda_options.dump()}, {"kernels", shared.dump()}};
  engine::EngineOptions same;
  for (const auto& [op, v] : shared.items()) same.kernels[op] = v.get<std::string>();
  replayer::ReplayOptions o;
  o.overrides.backend = "cpu";
  o.mode = replayer::ReplayMode::kForced;
  const replayer::ReplayResult r = Replay(Record("v3_basic", "shared.h5", {Prompt(40, 3)}, same), o);
  EXPECT_TRUE(r.diff.identical) << r.verdict;
  EXPECT_NE(r.verdict.find("every captured row is bit-identical across the two backends"), std::string::npos)
      << r.verdict;
  // The same claim over a recording that really ran gemm=fp32: the kernels named share their
  // bits, so the difference is a finding.
  const replayer::ReplayResult f = Replay(Record("v3_basic", "claims.h5", {Prompt(40, 3)}), o);
  EXPECT_FALSE(f.diff.identical);
  EXPECT_NE(f.verdict.find("although every kernel that ran computes the same bits on both backends"),
            std::string::npos)
      << f.verdict;
  // Another override besides the backend: no such claim either way.
  o.overrides.kv_cache = engine::KvFormat::kBf16;
  const replayer::ReplayResult k = Replay(Record("v3_basic", "kv.h5", {Prompt(40, 3)}, same), o);
  EXPECT_EQ(k.verdict.find("bit-identical"), std::string::npos) << k.verdict;
}

TEST_F(ReplayTest, GraftingSeparatesLocalFromPropagatedError) {
  auto t = Record("v3_basic", "run.h5", {Prompt(40, 6)}, {}, 0.0, 4);
  replayer::ReplayOptions o;
  o.mode = replayer::ReplayMode::kForced;
  o.overrides.kv_cache = engine::KvFormat::kFp8E4m3;
  auto free_run = Replay(t, o);
  o.graft = true;
  auto grafted = Replay(t, o);
  ASSERT_EQ(free_run.diff.layer_growth.size(), 3u);
  ASSERT_EQ(grafted.diff.layer_growth.size(), 3u);
  // Layer 0 sees the same input either way; from layer 1 on the un-grafted run carries the
  // error of the layers before it, the grafted one only its own.
  EXPECT_NEAR(grafted.diff.layer_growth[0], free_run.diff.layer_growth[0], 1e-12);
  EXPECT_LT(grafted.diff.layer_growth[2], free_run.diff.layer_growth[2]);
}

TEST_F(ReplayTest, RefusesAnotherModelsTrace) {
  auto t = Record("v3_basic", "run.h5", {Prompt(8, 7)});
  auto tr = traces::TraceReader::Open(t);
  ASSERT_TRUE(tr.ok());
  replayer::ReplayOptions o;
  o.output = dir_ / "x.h5";
  o.model_dir = testing::FixtureDir() / "models" / "v3_bf16";
  auto r = replayer::Replay(**tr, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("fingerprint"), std::string::npos) << r.status().message();
  auto other = Record("v3_bf16", "other.h5", {Prompt(8, 7)});
  auto to = traces::TraceReader::Open(other);
  auto d = diff::CompareTraces(**tr, **to);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("different models"), std::string::npos) << d.status().message();
}

// The fault zoo: record clean and faulty, and the diff must put the first divergence where
// the fault strikes.
struct FaultCase {
  const char* fault;
  const char* fixture;
  int prompt_len;
  int requests;
  int64_t page_size;
  engine::KvFormat kv;
  int64_t position;      // −1: don't check
  int64_t layer;         // −1: don't check
  const char* tensor;    // prefix of the first divergent tensor's path
};

class FaultZooDiff : public ReplayTest, public ::testing::WithParamInterface<FaultCase> {};

TEST_P(FaultZooDiff, DiffFindsWhereTheFaultStrikes) {
  const FaultCase& c = GetParam();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < c.requests; ++i) prompts.push_back(Prompt(c.prompt_len, 10 + i));
  engine::EngineOptions clean;
  clean.page_size = c.page_size;
  clean.kv_format = c.kv;
  engine::EngineOptions faulty = clean;
  faulty.fault = c.fault;
  auto a = Record(c.fixture, "clean.h5", prompts, clean, 0.0, 6);
  auto b = Record(c.fixture, "faulty.h5", prompts, faulty, 0.0, 6);
  diff::TraceDiffReport r = Diff(a, b);
  ASSERT_TRUE(r.has_divergence) << c.fault;
  if (c.position >= 0) {
    EXPECT_EQ(r.first.position, c.position) << c.fault << ": " << r.first.tensor << " " << r.first.how;
  }
  if (c.layer >= 0) {
    EXPECT_EQ(r.first.layer, c.layer) << c.fault << ": " << r.first.tensor;
  }
  EXPECT_EQ(r.first.tensor.rfind(c.tensor, 0), 0u) << c.fault << ": first divergence in " << r.first.tensor << " ("
                                                     << r.first.how << ")";
}

INSTANTIATE_TEST_SUITE_P(
    Zoo, FaultZooDiff,
    ::testing::Values(
        FaultCase{"fault_decode_wrong_interleave", "v3_basic", 12, 1, 64, engine::KvFormat::kFp32, 12, 0, "taps/layers.0.attn.q"},
        FaultCase{"fault_neg1_as_token0", "v32_sparse", 30, 1, 64, engine::KvFormat::kFp32, 1, 0, "taps/layers.0.attn.heads"},
        FaultCase{"fault_skip_partial_page", "v32_sparse", 30, 1, 16, engine::KvFormat::kFp32, 0, 0, "taps/layers.0.indexer.topk"},
        FaultCase{"fault_fp8_no_clamp", "v3_basic", 40, 1, 64, engine::KvFormat::kFp8E4m3, -1, -1, "kv/layers."},
        FaultCase{"fault_cross_request", "v3_basic", 20, 2, 8, engine::KvFormat::kFp32, 8, 0, "taps/layers.0.attn.heads"},
        FaultCase{"fault_no_max_fp16_sum", "v3_basic", 60, 1, 64, engine::KvFormat::kFp32, -1, -1, "taps/layers."}),
    [](const auto& info) { return std::string(info.param.fault); });

}  // namespace
}  // namespace lockstep

#include "replayer/bisect.h"

namespace lockstep {
namespace {

// Bisect's verdict on a --fault recording: verify's twin names the faulty op (its variant is in
// the defect's kernels) at the first (request, layer, position) where it acts.
TEST_F(ReplayTest, BisectNamesTheFaultyComponentLayerAndPosition) {
  engine::EngineOptions eo;
  eo.kv_format = engine::KvFormat::kFp8E4m3;
  eo.fault = "fault_decode_wrong_interleave";
  auto t = Record("v3_basic", "run.h5", {Prompt(12, 21)}, eo, 0.0, 10);
  auto tr = traces::TraceReader::Open(t);
  ASSERT_TRUE(tr.ok());
  replayer::BisectOptions o;
  o.work_dir = dir_ / "bisect";
  o.configuration = false;
  auto r = replayer::Bisect(**tr, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->reproducible);
  ASSERT_FALSE(r->defects.empty()) << r->verdict;
  const auto& top = r->defects[0];
  EXPECT_NE(top.kernels.find("rope=fault_decode_wrong_interleave"), std::string::npos) << r->verdict;
  EXPECT_EQ(top.first.layer, 0);
  EXPECT_EQ(top.first.position, 12);  // the first decode row
  EXPECT_EQ(top.first.tensor, "layers.0.attn.q");
  EXPECT_NE(r->verdict.find("layer 0, position 12"), std::string::npos) << r->verdict;
}

TEST_F(ReplayTest, BisectSaysARequestReadAnotherRequestsData) {
  engine::EngineOptions eo;
  eo.page_size = 8;
  eo.fault = "fault_cross_request";
  auto t = Record("v3_basic", "run.h5", {Prompt(20, 31), Prompt(20, 32)}, eo, 0.0, 4);
  auto tr = traces::TraceReader::Open(t);
  ASSERT_TRUE(tr.ok());
  replayer::BisectOptions o;
  o.work_dir = dir_ / "bisect";
  o.configuration = false;
  auto r = replayer::Bisect(**tr, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_FALSE(r->defects.empty()) << r->verdict;
  EXPECT_EQ(r->defects[0].op, "attention") << r->verdict;
  EXPECT_NE(r->defects[0].kernels.find("page_table=fault_cross_request"), std::string::npos) << r->verdict;
  EXPECT_EQ(r->defects[0].first.position, 8) << r->verdict;
  EXPECT_TRUE(r->defects[0].first.prefill) << r->verdict;  // found on a prompt row: every row is checked
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

// Every fault of the zoo, recorded and bisected: bisect must rank the faulty op first and
// place the divergence where diff places it.
struct BisectCase {
  const char* fault;
  const char* op;
  const char* fixture;
  int prompt_len, requests;
  int64_t page_size;
  engine::KvFormat kv;
  int64_t position;  // −1: not checked
};

class FaultZooBisect : public ReplayTest, public ::testing::WithParamInterface<BisectCase> {};

TEST_P(FaultZooBisect, BisectNamesTheFaultyComponent) {
  const BisectCase& c = GetParam();
  engine::EngineOptions eo;
  eo.page_size = c.page_size;
  eo.kv_format = c.kv;
  eo.fault = c.fault;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < c.requests; ++i) prompts.push_back(Prompt(c.prompt_len, 40 + i));
  auto t = Record(c.fixture, "run.h5", prompts, eo, 0.0, 6);
  auto tr = traces::TraceReader::Open(t);
  ASSERT_TRUE(tr.ok());
  replayer::BisectOptions o;
  o.work_dir = dir_ / "bisect";
  o.configuration = false;
  auto r = replayer::Bisect(**tr, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_FALSE(r->defects.empty()) << r->verdict;
  EXPECT_NE(r->defects[0].kernels.find(std::string(c.op) + "=" + c.fault), std::string::npos) << r->verdict;
  if (c.position >= 0) {
    EXPECT_EQ(r->defects[0].first.position, c.position) << r->verdict;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Zoo, FaultZooBisect,
    ::testing::Values(
        BisectCase{"fault_decode_wrong_interleave", "rope", "v3_basic", 12, 1, 64, engine::KvFormat::kFp32, 12},
        BisectCase{"fault_neg1_as_token0", "attn_sparse", "v32_sparse", 30, 1, 64, engine::KvFormat::kFp32, 1},
        BisectCase{"fault_skip_partial_page", "indexer", "v32_sparse", 30, 1, 16, engine::KvFormat::kFp32, 0},
        BisectCase{"fault_fp8_no_clamp", "kv_quant", "v3_basic", 40, 1, 64, engine::KvFormat::kFp8E4m3, -1},
        BisectCase{"fault_cross_request", "page_table", "v3_basic", 20, 2, 8, engine::KvFormat::kFp32, 8},
        BisectCase{"fault_no_max_fp16_sum", "softmax", "v3_basic", 60, 1, 64, engine::KvFormat::kFp32, -1}),
    [](const auto& info) { return std::string(info.param.fault); });

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

TEST_F(ReplayTest, Bf16GemmIsCloseToFp32AndBisectNamesIt) {
  engine::EngineOptions eo;
  eo.kernels = {{"gemm", "bf16"}};
  auto t = Record("v3_basic", "run.h5", {Prompt(16, 51)}, eo, 0.0, 6);
  auto ref = Record("v3_basic", "ref.h5", {Prompt(16, 51)}, {}, 0.0, 6);
  diff::TraceDiffReport d = Diff(ref, t);
  ASSERT_TRUE(d.has_divergence);
  // bf16 has 8 significant bits: ~0.4% per rounding, a few roundings deep.
  for (const auto& tr : d.tensors) {
    if (tr.tensor == "taps/layers.0.attn.q") {
      EXPECT_GT(tr.worst_rel_l2, 1e-4);
      EXPECT_LT(tr.worst_rel_l2, 5e-2);
    }
  }
  // gemm=bf16 is a declared precision, not a defect: verify's budgets include its rounding, and
  // bisect's swap back to fp32 measures what it costs.
  auto tr = traces::TraceReader::Open(t);
  replayer::BisectOptions o;
  o.work_dir = dir_ / "bisect";
  auto r = replayer::Bisect(**tr, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->defects.empty()) << r->verdict;
  EXPECT_EQ(r->verdict.rfind("No defect found", 0), 0u) << r->verdict;
  bool swapped = false;
  for (const auto& s : r->swaps) {
    if (s.op == "gemm" && s.from == "bf16" && s.to == "fp32") {
      swapped = true;
      EXPECT_GT(s.mean_logit_kl, 0) << r->verdict;
    }
  }
  EXPECT_TRUE(swapped) << r->verdict;
}

}  // namespace
}  // namespace lockstep
