// tests/fault_zoo_test.cc — each deliberately faulty variant really breaks what it claims to
// break, and nothing else: the instruments issue 5's bisect and diff are tested with.
#include <gtest/gtest.h>

#include <random>

#include "engine/engine.h"
#include "test_util.h"

namespace lockstep::engine {
namespace {

struct Outcome {
  std::vector<float> prompt_logits;            // [T, V]
  std::vector<std::vector<float>> step_logits;  // per generated token
};

Outcome RunOne(const std::string& fixture, const std::vector<std::vector<int32_t>>& prompts, EngineOptions o,
               int64_t new_tokens = 4, size_t which = 0) {
  auto m = Model::Load(testing::FixtureDir() / "models" / fixture);
  EXPECT_TRUE(m.ok()) << m.status().message();
  auto e = Engine::Create(*m, o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  Outcome out;
  (*e)->SetStepCallback([&](const StepEvent& ev) {
    if (ev.request_id == static_cast<int64_t>(which)) out.step_logits.push_back((*e)->request(ev.request_id).last_logits);
  });
  for (const auto& p : prompts) {
    Request r;
    r.prompt = p;
    r.max_new_tokens = new_tokens;
    r.all_prompt_logits = true;
    EXPECT_TRUE((*e)->AddRequest(r).ok());
  }
  Status s = (*e)->RunToCompletion();
  EXPECT_TRUE(s.ok()) << s.message();
  out.prompt_logits = (*e)->request(which).prompt_logits;
  return out;
}

std::vector<int32_t> Prompt(int n, int64_t vocab, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (auto& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

bool RowsEqual(const std::vector<float>& a, const std::vector<float>& b, int64_t row, int64_t V) {
  return std::memcmp(&a[row * V], &b[row * V], V * 4) == 0;
}

bool AnyNan(const std::vector<float>& v) {
  for (float x : v) {
    if (std::isnan(x)) return true;
  }
  return false;
}

TEST(FaultZoo, UnknownFaultIsRefusedAndFaultsAreNotKernels) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok());
  EngineOptions o;
  o.fault = "gremlins";
  auto e = Engine::Create(*m, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("fault_cross_request"), std::string::npos) << "lists the known faults";
  EngineOptions k;
  k.kernels = {{"page_table", "fault_cross_request"}};
  EXPECT_FALSE(Engine::Create(*m, k).ok()) << "a fault is reachable only through --fault";
}

TEST(FaultZoo, Neg1AsToken0BreaksOnlyQueriesWithFewerKeysThanTopk) {
  const int64_t V = 256, topk = 16;  // v32_sparse: index_topk 16
  auto p = Prompt(40, V);
  EngineOptions good, bad;
  bad.fault = "fault_neg1_as_token0";
  Outcome a = RunOne("v32_sparse", {p}, good), b = RunOne("v32_sparse", {p}, bad);
  // Position 0's only key is token 0 itself: 16 copies of it average to the same value (up to
  // rounding). Positions 1..14 have fewer than 16 keys and over-weight token 0.
  EXPECT_LT(testing::RelMaxErr(&b.prompt_logits[0], &a.prompt_logits[0], V), 1e-5);
  for (int64_t pos = 1; pos < topk - 1; ++pos) {
    EXPECT_GT(testing::RelMaxErr(&b.prompt_logits[pos * V], &a.prompt_logits[pos * V], V), 1e-3) << "position " << pos;
  }
}

TEST(FaultZoo, SkipPartialPageBreaksTheSparseModel) {
  const int64_t V = 256;
  auto p = Prompt(40, V);
  EngineOptions good, bad;
  good.page_size = bad.page_size = 16;
  bad.fault = "fault_skip_partial_page";
  Outcome a = RunOne("v32_sparse", {p}, good), b = RunOne("v32_sparse", {p}, bad);
  int differing = 0;
  for (int64_t pos = 0; pos < 40; ++pos) differing += !RowsEqual(a.prompt_logits, b.prompt_logits, pos, V);
  EXPECT_GT(differing, 20);
}

TEST(FaultZoo, Fp8WithoutClampTurnsOverflowIntoNan) {
  const int64_t V = 256;
  auto p = Prompt(60, V);
  EngineOptions good, bad;
  good.kv_format = bad.kv_format = KvFormat::kFp8E4m3;
  bad.fault = "fault_fp8_no_clamp";
  Outcome a = RunOne("v3_basic", {p}, good), b = RunOne("v3_basic", {p}, bad);
  EXPECT_FALSE(AnyNan(a.prompt_logits));
  EXPECT_TRUE(AnyNan(b.prompt_logits)) << "some tile must overflow e4m3 without the clamp";
}

TEST(FaultZoo, WrongDecodeRopeLeavesPrefillIntact) {
  const int64_t V = 256;
  auto p = Prompt(30, V);
  EngineOptions good, bad;
  bad.fault = "fault_decode_wrong_interleave";
  Outcome a = RunOne("v3_basic", {p}, good), b = RunOne("v3_basic", {p}, bad);
  EXPECT_EQ(a.prompt_logits, b.prompt_logits) << "prefill is untouched";
  ASSERT_EQ(a.step_logits.size(), b.step_logits.size());
  EXPECT_EQ(a.step_logits[0], b.step_logits[0]) << "the first token comes from the prefill";
  EXPECT_NE(a.step_logits[1], b.step_logits[1]) << "the first decode step is wrong";
}

TEST(FaultZoo, CrossRequestPageReadsAnotherRequestsData) {
  const int64_t V = 256;
  auto p0 = Prompt(20, V, 1), p1 = Prompt(20, V, 2);
  EngineOptions good, bad;
  good.page_size = bad.page_size = 8;
  bad.fault = "fault_cross_request";
  Outcome a = RunOne("v3_basic", {p0, p1}, good), b = RunOne("v3_basic", {p0, p1}, bad);
  // Positions in logical page 0 (0..7) attend only to page 0: intact. From position 8 on the
  // request reads page 1 from elsewhere.
  for (int64_t pos = 0; pos < 8; ++pos) EXPECT_TRUE(RowsEqual(a.prompt_logits, b.prompt_logits, pos, V)) << pos;
  EXPECT_FALSE(RowsEqual(a.prompt_logits, b.prompt_logits, 8, V));
  // And what it read depends on the neighbour: change request 1's prompt, request 0 changes.
  Outcome c = RunOne("v3_basic", {p0, Prompt(20, V, 3)}, bad);
  EXPECT_NE(b.prompt_logits, c.prompt_logits) << "request 0 must be reading request 1's page";
}

TEST(FaultZoo, SoftmaxWithoutMaxSubtractionDrifts) {
  const int64_t V = 256;
  auto p = Prompt(200, V);
  EngineOptions good, bad;
  bad.fault = "fault_no_max_fp16_sum";
  Outcome a = RunOne("v3_basic", {p}, good, 1), b = RunOne("v3_basic", {p}, bad, 1);
  double worst = 0;
  for (int64_t pos = 0; pos < 200; ++pos) {
    worst = std::max(worst, testing::RelMaxErr(&b.prompt_logits[pos * V], &a.prompt_logits[pos * V], V));
  }
  EXPECT_GT(worst, 1e-3);
}

}  // namespace
}  // namespace lockstep::engine
