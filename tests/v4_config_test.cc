// tests/v4_config_test.cc — deepseek_v4 config.json parsing: transformers 5.17's defaults and
// normalisation (../shared/reference/deepseek-v4.md §1.1), and one-line errors naming the field.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "engine/config.h"

namespace lockstep::engine {
namespace {

// The tiny config of the reference doc §5 (it runs in transformers), with `extra` spliced in.
std::string Tiny(const std::string& extra = "") {
  std::string s = R"({"model_type":"deepseek_v4","vocab_size":96,"hidden_size":64,"num_hidden_layers":3,
    "num_attention_heads":4,"num_key_value_heads":1,"head_dim":32,"partial_rotary_factor":0.25,"q_lora_rank":32,
    "o_groups":2,"o_lora_rank":16,"moe_intermediate_size":32,"n_routed_experts":4,"n_shared_experts":1,
    "num_experts_per_tok":2,"sliding_window":8,"hc_mult":4,"hc_sinkhorn_iters":5,"index_n_heads":4,
    "index_head_dim":16,"index_topk":3,"max_position_embeddings":256,"num_nextn_predict_layers":0)";
  return s + extra + "}";
}
const char* kTypes = R"(,"layer_types":["sliding_attention","compressed_sparse_attention","heavily_compressed_attention"],
    "mlp_layer_types":["hash_moe","moe","moe"],
    "compress_rates":{"compressed_sparse_attention":4,"heavily_compressed_attention":8})";

Result<ModelConfig> Parse(const std::string& s) { return ModelConfig::FromJson(s, "config.json"); }

void ExpectError(const std::string& json, const std::string& field) {
  auto c = Parse(json);
  ASSERT_FALSE(c.ok()) << "accepted: " << json;
  const std::string m = c.status().message();
  EXPECT_NE(m.find("config.json: field '" + field + "'"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
}

TEST(V4Config, DefaultsAreV4Flash) {
  auto c = Parse(R"({"model_type":"deepseek_v4"})");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(c->is_v4());
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->num_hidden_layers, 43);
  EXPECT_EQ(c->num_attention_heads, 64);
  EXPECT_EQ(c->v4.head_dim, 512);
  EXPECT_EQ(c->v4.rope_dim, 64);
  EXPECT_EQ(c->qk_rope_head_dim, 64);
  EXPECT_EQ(c->q_lora_rank, 1024);
  EXPECT_EQ(c->v4.o_groups, 8);
  EXPECT_EQ(c->v4.o_lora_rank, 1024);
  EXPECT_EQ(c->n_routed_experts, 256);
  EXPECT_EQ(c->num_experts_per_tok, 6);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 1.5);
  EXPECT_EQ(c->v4.sliding_window, 128);
  EXPECT_EQ(c->v4.hc_mult, 4);
  EXPECT_EQ(c->v4.hc_sinkhorn_iters, 20);
  EXPECT_DOUBLE_EQ(c->v4.swiglu_limit, 10.0);
  EXPECT_EQ(c->index_topk, 512);
  EXPECT_DOUBLE_EQ(c->v4.main_rope.theta, 1e4);
  EXPECT_DOUBLE_EQ(c->v4.compress_rope.theta, 1.6e5);
  EXPECT_FALSE(c->v4.compress_rope.yarn);
  // The V4-Pro default pattern: HCA, HCA, then HCA on even i, CSA on odd i (i from 0 after the two).
  EXPECT_EQ(c->layers[0].attention, AttentionKind::kHeavilyCompressed);
  EXPECT_EQ(c->layers[1].attention, AttentionKind::kHeavilyCompressed);
  EXPECT_EQ(c->layers[2].attention, AttentionKind::kHeavilyCompressed);
  EXPECT_EQ(c->layers[3].attention, AttentionKind::kCompressedSparse);
  EXPECT_EQ(c->layers[3].compress_rate, 4);
  EXPECT_EQ(c->layers[0].compress_rate, 128);
  // num_hash_layers defaults to 3.
  EXPECT_EQ(c->layers[2].ffn, FfnKind::kHashMoe);
  EXPECT_EQ(c->layers[3].ffn, FfnKind::kMoe);
  EXPECT_EQ(c->layers[0].residual, ResidualKind::kHyperConnection);
  EXPECT_EQ(c->v4.num_hash_layers, 3);
}

TEST(V4Config, TinyReferenceConfig) {
  auto c = Parse(Tiny(kTypes));
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->v4.rope_dim, 8);
  EXPECT_EQ(c->layers[0].attention, AttentionKind::kSliding);
  EXPECT_EQ(c->layers[0].compress_rate, 0);
  EXPECT_EQ(c->layers[1].attention, AttentionKind::kCompressedSparse);
  EXPECT_EQ(c->layers[1].compress_rate, 4);
  EXPECT_EQ(c->layers[2].attention, AttentionKind::kHeavilyCompressed);
  EXPECT_EQ(c->layers[2].compress_rate, 8);
  EXPECT_EQ(c->layers[0].ffn, FfnKind::kHashMoe);
  EXPECT_EQ(c->layers[1].ffn, FfnKind::kMoe);
  // Streams: window everywhere; compressor + compressed on CSA / HCA; the indexer's on CSA.
  auto s0 = V4LayerStreams(*c, 0), s1 = V4LayerStreams(*c, 1), s2 = V4LayerStreams(*c, 2);
  ASSERT_EQ(s0.size(), 1u);
  EXPECT_EQ(s0[0].width, 32);
  EXPECT_EQ(s0[0].retention, 7);
  ASSERT_EQ(s1.size(), 5u);
  EXPECT_EQ(s1[1].width, 4 * 32);  // [kv | gate], each 2d wide
  EXPECT_EQ(s1[2].cadence, 4);
  EXPECT_EQ(s1[4].width, 16);
  EXPECT_EQ(s1[4].cadence, 4);
  ASSERT_EQ(s2.size(), 3u);
  EXPECT_EQ(s2[1].width, 2 * 32);
  EXPECT_EQ(s2[2].cadence, 8);
}

TEST(V4Config, LegacyFieldsFoldIn) {
  // compress_ratios (44 entries for 43 layers + MTP in the official config: truncated to n).
  auto c = Parse(Tiny(R"(,"compress_ratios":[0,4,128,4],"num_hash_layers":1,
      "compress_rate_csa":4,"compress_rate_hca":16)"));
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->layers[0].attention, AttentionKind::kSliding);
  EXPECT_EQ(c->layers[1].attention, AttentionKind::kCompressedSparse);
  EXPECT_EQ(c->layers[2].attention, AttentionKind::kHeavilyCompressed);
  EXPECT_EQ(c->layers[2].compress_rate, 16);
  EXPECT_EQ(c->layers[0].ffn, FfnKind::kHashMoe);
  EXPECT_EQ(c->layers[1].ffn, FfnKind::kMoe);
  // With ≤ 3 layers the default num_hash_layers makes every layer hash-routed.
  auto all = Parse(Tiny(R"(,"compress_ratios":[0,4,128])"));
  ASSERT_TRUE(all.ok()) << all.status().message();
  for (const auto& l : all->layers) EXPECT_EQ(l.ffn, FfnKind::kHashMoe);
  // attribute_map aliases.
  auto a = Parse(R"({"model_type":"deepseek_v4","num_local_experts":16,"intermediate_size":64})");
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(a->n_routed_experts, 16);
  EXPECT_EQ(a->moe_intermediate_size, 64);
}

TEST(V4Config, RopeParametersNestedAndFlat) {
  // Flat YaRN keys go to the compress table only, with attention_factor defaulting to 1.
  auto flat = Parse(Tiny(std::string(kTypes) + R"(,"rope_theta":10000,"compress_rope_theta":160000,
      "rope_parameters":{"rope_type":"yarn","factor":16,"original_max_position_embeddings":64})"));
  ASSERT_TRUE(flat.ok()) << flat.status().message();
  EXPECT_FALSE(flat->v4.main_rope.yarn);
  EXPECT_TRUE(flat->v4.compress_rope.yarn);
  EXPECT_DOUBLE_EQ(flat->v4.compress_rope.factor, 16);
  EXPECT_EQ(flat->v4.compress_rope.original_max_position_embeddings, 64);
  EXPECT_DOUBLE_EQ(flat->v4.compress_rope.attention_factor, 1.0);
  EXPECT_DOUBLE_EQ(flat->v4.compress_rope.theta, 160000);
  // Nested: each table as given; YaRN's own attention factor (0.1 ln f + 1) when none is set.
  auto nested = Parse(Tiny(std::string(kTypes) + R"(,"rope_parameters":{
      "main":{"rope_type":"default","rope_theta":5000,"partial_rotary_factor":0.25},
      "compress":{"rope_type":"yarn","rope_theta":40000,"factor":4,"original_max_position_embeddings":64,
                  "partial_rotary_factor":0.25}})"));
  ASSERT_TRUE(nested.ok()) << nested.status().message();
  EXPECT_DOUBLE_EQ(nested->v4.main_rope.theta, 5000);
  EXPECT_DOUBLE_EQ(nested->v4.compress_rope.theta, 40000);
  EXPECT_NEAR(nested->v4.compress_rope.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-12);
  // A nested table without partial_rotary_factor rotates the whole head: not the attention's width.
  ExpectError(Tiny(std::string(kTypes) + R"(,"rope_parameters":{
      "main":{"rope_type":"default","rope_theta":5000},
      "compress":{"rope_type":"default","rope_theta":40000,"partial_rotary_factor":0.25}})"),
              "rope_parameters.main.partial_rotary_factor");
  ExpectError(Tiny(std::string(kTypes) + R"(,"rope_parameters":{"main":{"rope_type":"default"}})"),
              "rope_parameters.compress");
  ExpectError(Tiny(std::string(kTypes) + R"(,"rope_parameters":{"rope_type":"linear"})"),
              "rope_parameters.rope_type");
  ExpectError(Tiny(std::string(kTypes) + R"(,"rope_parameters":{"rope_type":"yarn","factor":-2})"),
              "rope_parameters.factor");
}

TEST(V4Config, RefusesWhatTransformersRefuses) {
  // layer_types: membership, and at least num_hidden_layers entries (a longer list is truncated).
  ExpectError(Tiny(R"(,"layer_types":["sliding_attention","full_attention","sliding_attention"])"), "layer_types");
  ExpectError(Tiny(R"(,"layer_types":["sliding_attention","sliding_attention"])"), "layer_types");
  EXPECT_TRUE(Parse(Tiny(R"(,"layer_types":["sliding_attention","sliding_attention","sliding_attention",
      "sliding_attention"],"mlp_layer_types":["moe","moe","moe"])")).ok());
  ExpectError(Tiny(R"(,"compress_ratios":[0,8,128])"), "compress_ratios");
  ExpectError(Tiny(R"(,"mlp_layer_types":["hash_moe","moe"])"), "mlp_layer_types");
  ExpectError(Tiny(R"(,"mlp_layer_types":["hash_moe","dense","moe"])"), "mlp_layer_types");
  // Both compress_rates keys when a CSA layer exists (transformers: KeyError).
  ExpectError(Tiny(R"(,"layer_types":["sliding_attention","compressed_sparse_attention","sliding_attention"],
      "compress_rates":{"compressed_sparse_attention":4})"),
              "compress_rates.heavily_compressed_attention");
  ExpectError(Tiny(R"(,"layer_types":["sliding_attention","compressed_sparse_attention","sliding_attention"],
      "compress_rates":{"heavily_compressed_attention":8})"),
              "compress_rates.compressed_sparse_attention");
  ExpectError(Tiny(R"(,"compress_ratios":[0,4,128],"compress_rates":{"compressed_sparse_attention":0,
      "heavily_compressed_attention":8})"),
              "compress_rates.compressed_sparse_attention");
  ExpectError(Tiny(R"(,"o_groups":3)"), "o_groups");
  ExpectError(Tiny(R"(,"q_lora_rank":0)"), "q_lora_rank");
  ExpectError(Tiny(R"(,"swiglu_limit":0)"), "swiglu_limit");
  ExpectError(Tiny(R"(,"sliding_window":1)"), "sliding_window");
  ExpectError(Tiny(R"(,"partial_rotary_factor":0.1)"), "partial_rotary_factor");  // int(32 × 0.1) = 3: odd
  ExpectError(Tiny(R"(,"scoring_func":"sigmoid")"), "scoring_func");
  ExpectError(Tiny(R"(,"hidden_act":"gelu")"), "hidden_act");
  ExpectError(Tiny(R"(,"hc_mult":0)"), "hc_mult");
  ExpectError(Tiny(R"(,"hc_sinkhorn_iters":0)"), "hc_sinkhorn_iters");
  ExpectError(Tiny(R"(,"hc_eps":-1)"), "hc_eps");
  ExpectError(Tiny(R"(,"num_experts_per_tok":5)"), "num_experts_per_tok");
  ExpectError(Tiny(R"(,"head_dim":"x")"), "head_dim");
  // rd ≤ index_head_dim when a CSA layer exists (the indexer's keys carry the rotated dims).
  ExpectError(Tiny(std::string(kTypes) + R"(,"index_head_dim":4)"), "index_head_dim");
  ExpectError(Tiny(std::string(kTypes) + R"(,"index_topk":0)"), "index_topk");
  ExpectError(Tiny(R"(,"quantization_config":{"quant_method":"mxfp4"})"), "quantization_config.quant_method");
}

}  // namespace
}  // namespace lockstep::engine
