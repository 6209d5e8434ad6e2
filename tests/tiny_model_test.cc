// tests/tiny_model_test.cc — the embedded default model (models/lockstep-tiny-v32, trained by
// tools/train-tiny-model) against transformers: its tokenizer gives HF's prompt ids, and the
// engine's greedy tokens equal transformers' fp32 greedy tokens for 128 steps (issue 3), with
// the first 16 steps' logits within the engine's 1e-4 tolerance (issue 2).
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/tokenizer.h"
#include "test_util.h"

namespace lockstep {
namespace {

TEST(TinyModel, GreedyDecodeMatchesTransformersFor128Steps) {
  const auto model_dir = testing::SourceDir() / "models" / "lockstep-tiny-v32";
  auto model = engine::Model::Load(model_dir);
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto tok = engine::Tokenizer::Load(model_dir / "tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status().message();
  auto ref = engine::SafetensorsFile::Open(testing::FixtureDir() / "tiny_reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status().message();
  std::ifstream jf(testing::FixtureDir() / "tiny_reference.json");
  const nlohmann::json meta = nlohmann::json::parse(jf);
  const int64_t V = (*model)->config().vocab_size;
  const auto& t = (*ref)->tensors();

  for (int p = 0; p < 2; ++p) {
    const std::string pre = "prompt" + std::to_string(p);
    const auto prompt = testing::ReadIds(t.at(pre + "_ids"));
    const auto want = testing::ReadIds(t.at(pre + "_decode_ids"));
    const auto logits = testing::ReadF32(t.at(pre + "_logits"));
    const std::string text = meta["prompts"][p]["text"];
    EXPECT_EQ((*tok)->Encode(text, /*add_special_tokens=*/true), prompt) << "tokenizer vs HF on: " << text;

    auto eng = engine::Engine::Create(*model, engine::EngineOptions{});
    ASSERT_TRUE(eng.ok());
    engine::Request r;
    r.prompt = prompt;
    r.max_new_tokens = static_cast<int64_t>(want.size());
    std::vector<std::vector<float>> steps;
    (*eng)->SetStepCallback([&](const engine::StepEvent& ev) {
      if (steps.size() < 16) steps.push_back((*eng)->request(ev.request_id).last_logits);
    });
    ASSERT_TRUE((*eng)->AddRequest(r).ok());
    ASSERT_TRUE((*eng)->RunToCompletion().ok());
    const auto& got = (*eng)->request(0).generated;
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << pre << ": first differing greedy token at step " << i;
    }
    double worst = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const double e = testing::RelMaxErr(steps[i].data(), &logits[i * V], V);
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-4) << pre << " step " << i;
    }
    std::printf("[ %s ] 128/128 greedy tokens equal; worst logit error (16 steps) %.3g\n", pre.c_str(), worst);
    EXPECT_EQ((*tok)->Decode(got), meta["prompts"][p]["decode_text"].get<std::string>());
  }
}

}  // namespace
}  // namespace lockstep
