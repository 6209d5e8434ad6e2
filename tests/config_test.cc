// tests/config_test.cc — config.json parsing: transformers' defaults, YaRN, errors.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/config.h"

namespace lockstep::engine {
namespace {

TEST(Config, AppliesTransformersDefaultsPerFamily) {
  auto v3 = ModelConfig::FromJson(R"({"model_type":"deepseek_v3"})", "config.json");
  ASSERT_TRUE(v3.ok()) << v3.status().message();
  EXPECT_EQ(v3->hidden_size, 7168);
  EXPECT_EQ(v3->n_routed_experts, 256);
  EXPECT_EQ(v3->first_k_dense_replace, 3);
  EXPECT_EQ(v3->layers[2].ffn, FfnKind::kDense);
  EXPECT_EQ(v3->layers[3].ffn, FfnKind::kMoe);
  EXPECT_EQ(v3->rope_style, RopeStyle::kPairsToHalves);
  EXPECT_DOUBLE_EQ(v3->routed_scaling_factor, 2.5);
  auto v2 = ModelConfig::FromJson(R"({"model_type":"deepseek_v2","num_experts_per_tok":6})", "config.json");
  ASSERT_TRUE(v2.ok()) << v2.status().message();
  EXPECT_EQ(v2->gate, GateKind::kSoftmaxGreedy);
  EXPECT_EQ(v2->rope_style, RopeStyle::kPairsAdjacent);
  EXPECT_EQ(v2->layers[0].ffn, FfnKind::kMoe);  // first_k_dense_replace defaults to 0
  auto v32 = ModelConfig::FromJson(R"({"model_type":"deepseek_v32"})", "config.json");
  ASSERT_TRUE(v32.ok()) << v32.status().message();
  EXPECT_EQ(v32->index_topk, 2048);
  EXPECT_EQ(v32->layers[0].attention, AttentionKind::kMlaSparse);
}

TEST(Config, YarnMatchesDeepSeekV3sPublishedNumbers) {
  // DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1 → attention factor 1, and the softmax
  // scale 192^-0.5 × (0.1·ln 40 + 1)² — 0.135234 × 192^-0.5·… as in the reference code.
  auto c = ModelConfig::FromJson(
      R"({"model_type":"deepseek_v3","max_position_embeddings":163840,"rope_theta":10000,
          "rope_scaling":{"type":"yarn","factor":40,"original_max_position_embeddings":4096,
                          "beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0}})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(c->rope.yarn);
  EXPECT_DOUBLE_EQ(c->rope.attention_factor, 1.0);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c->softmax_scale(), m * m / std::sqrt(192.0), 1e-12);
  EXPECT_NEAR(c->softmax_scale(), 0.135234, 1e-6);
}

TEST(Config, ErrorsNameTheFileAndField) {
  struct Case {
    const char* json;
    const char* field;
  };
  const Case cases[] = {
      {R"({"model_type":"llama"})", "model_type"},
      {R"({"hidden_size":4})", "model_type"},
      {R"({"model_type":"deepseek_v3","hidden_size":"big"})", "hidden_size"},
      {R"({"model_type":"deepseek_v3","hidden_size":-3})", "hidden_size"},
      {R"({"model_type":"deepseek_v3","qk_rope_head_dim":7})", "qk_rope_head_dim"},
      {R"({"model_type":"deepseek_v3","n_group":7})", "n_group"},
      {R"({"model_type":"deepseek_v3","hidden_act":"gelu"})", "hidden_act"},
      {R"({"model_type":"deepseek_v3","rope_scaling":{"type":"dynamic","factor":2}})", "rope"},
      {R"({"model_type":"deepseek_v3","quantization_config":{"quant_method":"gptq"}})", "quant_method"},
      {R"({"model_type":"deepseek_v3","quantization_config":{"quant_method":"fp8","weight_block_size":[0,128]}})",
       "weight_block_size"},
      {R"({"model_type":"deepseek_v32","q_lora_rank":null})", "q_lora_rank"},
      {R"({"model_type":"deepseek_v32","mlp_layer_types":["dense"]})", "mlp_layer_types"},
      {"not json", "config.json"},
  };
  for (const auto& c : cases) {
    auto r = ModelConfig::FromJson(c.json, "/m/config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.status().message().find("/m/config.json"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace lockstep::engine
