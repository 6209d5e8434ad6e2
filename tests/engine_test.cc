// tests/engine_test.cc — scheduling and batch invariance: a request's bits must not depend
// on what it is batched with (issue 2 acceptance: batch 1 vs batch 8).
#include <gtest/gtest.h>

#include <random>

#include "engine/engine.h"
#include "test_util.h"

namespace lockstep::engine {
namespace {

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;  // the last step's logits per request
};

Outcome Generate(std::shared_ptr<Model> m, const std::vector<std::vector<int32_t>>& prompts, int64_t max_batch,
             double temperature, KvFormat kv = KvFormat::kFp32,
                 uint64_t seed_base = 1000) {
  EngineOptions o;
  o.max_batch = max_batch;
  o.page_size = 8;
  o.kv_format = kv;
  auto e = Engine::Create(m, o);
  EXPECT_TRUE(e.ok());
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request r;
    r.prompt = prompts[i];
    r.max_new_tokens = 12;
    r.sampling.temperature = temperature;
    r.sampling.top_p = 0.95;
    r.sampling.seed = seed_base + i;
    EXPECT_TRUE((*e)->AddRequest(r).ok());
  }
  Status s = (*e)->RunToCompletion();
  EXPECT_TRUE(s.ok()) << s.message();
  Outcome run;
  for (int64_t i = 0; i < (*e)->num_requests(); ++i) {
    run.tokens.push_back((*e)->request(i).generated);
    run.logits.push_back((*e)->request(i).last_logits);
  }
  return run;
}

std::vector<std::vector<int32_t>> Prompts(int64_t vocab, int n) {
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p(5 + 7 * i);  // ragged: 5..54 tokens
    for (auto& t : p) t = static_cast<int32_t>(rng() % vocab);
    out.push_back(p);
  }
  return out;
}

class BatchInvariance : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchInvariance, SameBitsAtBatch1AndBatch8) {
  auto m = Model::Load(testing::FixtureDir() / "models" / GetParam());
  ASSERT_TRUE(m.ok()) << m.status().message();
  const auto prompts = Prompts((*m)->config().vocab_size, 8);
  for (double temp : {0.0, 0.9}) {
    Outcome together = Generate(*m, prompts, 8, temp);
    Outcome staggered = Generate(*m, prompts, 3, temp);  // requests join as others leave
    for (size_t i = 0; i < prompts.size(); ++i) {
      // Alone, with the seed it had in the batch.
      Outcome alone = Generate(*m, {prompts[i]}, 1, temp, KvFormat::kFp32, 1000 + i);
      EXPECT_EQ(together.tokens[i], alone.tokens[0]) << "request " << i << " temperature " << temp;
      EXPECT_EQ(staggered.tokens[i], alone.tokens[0]) << "request " << i << " temperature " << temp;
      ASSERT_EQ(together.logits[i].size(), alone.logits[0].size());
      EXPECT_EQ(0, std::memcmp(together.logits[i].data(), alone.logits[0].data(), alone.logits[0].size() * 4))
          << "request " << i << ": logits bits differ between batch 8 and batch 1";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BatchInvariance, ::testing::Values("v3_basic", "v32_sparse", "v2_lite_like"));

TEST(Engine, ReducedPrecisionCachesStayCloseButDiffer) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok()) << m.status().message();
  const auto prompts = Prompts((*m)->config().vocab_size, 2);
  Outcome f32 = Generate(*m, prompts, 2, 0.0, KvFormat::kFp32);
  for (KvFormat kv : {KvFormat::kBf16, KvFormat::kFp8E4m3}) {
    Outcome r = Generate(*m, {prompts[0]}, 1, 0.0, kv);
    // Compare the first generated step only (later steps may follow other tokens).
    EXPECT_NE(r.logits[0], f32.logits[0]) << KvFormatName(kv) << " should not be bit-identical to fp32";
  }
}

TEST(Engine, RejectsBadRequests) {
  auto m = Model::Load(testing::FixtureDir() / "models" / "v3_basic");
  ASSERT_TRUE(m.ok()) << m.status().message();
  auto e = Engine::Create(*m, EngineOptions{});
  ASSERT_TRUE(e.ok());
  Request r;
  EXPECT_FALSE((*e)->AddRequest(r).ok()) << "empty prompt";
  r.prompt = {1, 2, static_cast<int32_t>((*m)->config().vocab_size)};
  EXPECT_FALSE((*e)->AddRequest(r).ok()) << "token outside the vocabulary";
  r.prompt = {1, 2};
  r.max_new_tokens = (*m)->config().max_position_embeddings;
  EXPECT_FALSE((*e)->AddRequest(r).ok()) << "longer than max_position_embeddings";
  r.max_new_tokens = 4;
  r.sampling.top_p = 0;
  EXPECT_FALSE((*e)->AddRequest(r).ok()) << "top_p 0";
  EngineOptions bad;
  bad.kernels = {{"attn_decode", "nonsense"}};
  auto e2 = Engine::Create(*m, bad);
  ASSERT_FALSE(e2.ok());
  EXPECT_NE(e2.status().message().find("attn_decode"), std::string::npos);
}

}  // namespace
}  // namespace lockstep::engine
