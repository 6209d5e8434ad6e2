// cli/model_info_v4.cc — `lockstep model info` for a DeepSeek-V4 directory: the layer pattern
// (attention kind and compression rate, FFN kind), hyper-connections, and the KV cache per
// token in each format — as serving engines store it (window rows per request, a compressed row
// every m tokens, the indexer's keys) and as this reference's cache streams hold it.
#include "cli/model_info_v4.h"

#include "base/json_text.h"

#include <cstdio>
#include <iostream>

#include "engine/kv_cache.h"

namespace lockstep::cli {
namespace {

// Bytes of one window / compressed kv row of d values, rd of them rotated.
//   fp32: 4d; bf16: 2d (1024 for V4-Flash); fp8 MODEL1 (FlashMLA): the d − rd others as e4m3,
//   the rd rotated as bf16, one ue8m0 scale per 64 e4m3 values, the scale slot padded to 8 bytes
//   (448 + 128 + 7 + 1 = 584 for V4-Flash).
int64_t KvRowBytes(const std::string& fmt, int64_t d, int64_t rd) {
  if (fmt == "fp32") return 4 * d;
  if (fmt == "bf16") return 2 * d;
  const int64_t nope = d - rd, scales = (nope + 63) / 64;
  return nope + 2 * rd + (scales + 7) / 8 * 8;
}
// An indexer key of di values: fp32, or FP8 (di e4m3 + a fp32 scale per 128: 132 for di 128).
int64_t IndexKeyBytes(const std::string& fmt, int64_t di) {
  return fmt == "fp8_model1" ? di + 4 * ((di + 127) / 128) : 4 * di;
}

}  // namespace

Status PrintV4Info(const engine::ModelConfig& c, const engine::ModelWeights& w, const std::string& dir,
                   int64_t params, int64_t active, bool config_only, int64_t tokenizer_vocab, bool json_out) {
  const engine::V4Config& v = c.v4;
  nlohmann::json j;
  j["model_dir"] = dir;
  j["model_type"] = c.model_type;
  std::string pattern, ffn;
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& s : c.layers) {
    const char k = s.attention == engine::AttentionKind::kSliding            ? 'S'
                   : s.attention == engine::AttentionKind::kCompressedSparse ? 'C'
                                                                              : 'H';
    pattern += std::string(pattern.empty() ? "" : " ") + k;
    ffn += std::string(ffn.empty() ? "" : " ") + (s.ffn == engine::FfnKind::kHashMoe ? "hash" : "topk");
    layers.push_back({{"attention", engine::V4AttentionName(s)}, {"compress_rate", s.compress_rate},
                      {"ffn", engine::V4FfnName(s)}});
  }
  j["layers"] = layers;
  j["hidden_size"] = c.hidden_size;
  j["vocab_size"] = c.vocab_size;
  j["hyper_connections"] = {{"streams", v.hc_mult}, {"sinkhorn_iters", v.hc_sinkhorn_iters}, {"eps", v.hc_eps}};
  j["attention"] = {{"heads", c.num_attention_heads}, {"head_dim", v.head_dim}, {"rope_dim", v.rope_dim},
                    {"q_lora_rank", c.q_lora_rank}, {"o_groups", v.o_groups}, {"o_lora_rank", v.o_lora_rank},
                    {"sliding_window", v.sliding_window}, {"csa_rate", v.csa_rate}, {"hca_rate", v.hca_rate},
                    {"main_rope_theta", v.main_rope.theta}, {"compress_rope_theta", v.compress_rope.theta},
                    {"compress_yarn", v.compress_rope.yarn}};
  j["indexer"] = {{"heads", c.index_n_heads}, {"head_dim", c.index_head_dim}, {"topk", c.index_topk}};
  j["moe"] = {{"routed_experts", c.n_routed_experts}, {"experts_per_token", c.num_experts_per_tok},
              {"shared_experts", c.n_shared_experts}, {"hash_layers", v.num_hash_layers},
              {"scoring", "sqrtsoftplus"}, {"routed_scaling_factor", c.routed_scaling_factor},
              {"swiglu_limit", v.swiglu_limit}};
  j["parameters"] = {{"total", params}, {"active_per_token", active}};
  j["weights"] = {{"dtypes", w.dtype_counts}, {"fp8_block_scaled_tensors", w.fp8_tensors},
                  {"skipped", w.skipped}, {"mtp_tensors", w.mtp_tensors},
                  {"checkpoint", config_only ? "none: from config.json" : "mapped"}, {"mapped_bytes", w.mapped_bytes}};

  // The cache as serving engines hold it: per token, Σ over compressed layers of a row every m
  // tokens (+ CSA's indexer key every m); per request, every layer's W − 1 window rows.
  nlohmann::json served, reference;
  for (const std::string fmt : {"fp32", "bf16", "fp8_model1"}) {
    double per_token = 0;
    int64_t window = 0;
    for (const auto& s : c.layers) {
      window += (v.sliding_window - 1) * KvRowBytes(fmt, v.head_dim, v.rope_dim);
      if (s.compress_rate > 0) per_token += static_cast<double>(KvRowBytes(fmt, v.head_dim, v.rope_dim)) / s.compress_rate;
      if (s.attention == engine::AttentionKind::kCompressedSparse) {
        per_token += static_cast<double>(IndexKeyBytes(fmt, c.index_head_dim)) / s.compress_rate;
      }
    }
    served[fmt] = {{"bytes_per_token", per_token}, {"window_bytes_per_request", window},
                   {"kv_row_bytes", KvRowBytes(fmt, v.head_dim, v.rope_dim)},
                   {"index_key_bytes", IndexKeyBytes(fmt, c.index_head_dim)}};
  }
  for (engine::KvFormat f : {engine::KvFormat::kFp32, engine::KvFormat::kBf16, engine::KvFormat::kFp8E4m3}) {
    const engine::PagedKvCache cache(c, f, 1, 0);
    int64_t slot_bytes = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      for (const auto& st : cache.streams(l)) slot_bytes += st.bytes_per_token;
    }
    reference[std::string(engine::KvFormatName(f))] = slot_bytes;
  }
  j["kv_cache"] = {{"served", served}, {"reference_bytes_per_token", reference}};
  j["tokenizer_vocab"] = tokenizer_vocab;
  if (json_out) {
    std::cout << JsonText(j, 2) << "\n";
    return Status::Ok();
  }
  auto M = [](int64_t n) { return std::to_string(n) + " (" + std::to_string(n / 1e6).substr(0, 6) + "M)"; };
  std::cout << "model       " << dir << "\n"
            << "type        " << c.model_type << ", " << c.num_hidden_layers << " layers, hidden " << c.hidden_size
            << ", vocab " << c.vocab_size << "\n"
            << "layers      attention " << pattern << "   (S sliding window " << v.sliding_window << ", C CSA every "
            << v.csa_rate << " + indexer, H HCA every " << v.hca_rate << ")\n"
            << "            ffn       " << ffn << "\n"
            << "residual    hyper-connections: " << v.hc_mult << " streams, Sinkhorn " << v.hc_sinkhorn_iters
            << " iterations\n"
            << "attention   " << c.num_attention_heads << " heads × " << v.head_dim << " (rope on the last " << v.rope_dim
            << "), one shared K = V head, sinks; q_lora " << c.q_lora_rank << "; output " << v.o_groups
            << " groups × rank " << v.o_lora_rank << "\n"
            << "rope        main theta " << v.main_rope.theta << "; compress theta " << v.compress_rope.theta
            << (v.compress_rope.yarn ? ", YaRN factor " + std::to_string(v.compress_rope.factor) : std::string())
            << "\n"
            << "indexer     " << c.index_n_heads << " heads × " << c.index_head_dim << ", top-" << c.index_topk
            << " compressed rows per query\n"
            << "moe         " << c.n_routed_experts << " routed (top-" << c.num_experts_per_tok << "), "
            << c.n_shared_experts << " shared; sqrt-softplus, " << v.num_hash_layers
            << " hash-routed layer(s); clamped SwiGLU (limit " << v.swiglu_limit << "); scaling "
            << c.routed_scaling_factor << "\n"
            << "parameters  total " << M(params) << ", active per token " << M(active) << "\n"
            << "weights     ";
  for (const auto& [d, n] : w.dtype_counts) std::cout << n << " " << d << " ";
  if (config_only) std::cout << "(no checkpoint)";
  std::cout << "\nskipped     " << w.skipped.size() << " tensors (" << w.mtp_tensors << " of MTP layers: reported, not run)\n";
  char buf[256];
  std::snprintf(buf, sizeof buf, "fp32 %.1f B, bf16 %.1f B, fp8 MODEL1 %.1f B",
                served["fp32"]["bytes_per_token"].get<double>(), served["bf16"]["bytes_per_token"].get<double>(),
                served["fp8_model1"]["bytes_per_token"].get<double>());
  std::cout << "kv cache    per token (compressed rows and index keys, all layers): " << buf << "\n";
  std::cout << "            per request (the windows' W − 1 rows, all layers): fp32 "
            << served["fp32"]["window_bytes_per_request"] << " B, bf16 " << served["bf16"]["window_bytes_per_request"]
            << " B, fp8 MODEL1 " << served["fp8_model1"]["window_bytes_per_request"] << " B; a row "
            << served["bf16"]["kv_row_bytes"] << " B in bf16, " << served["fp8_model1"]["kv_row_bytes"]
            << " B in MODEL1\n"
            << "            this reference's streams keep every row: fp32 " << reference["fp32"] << " B, bf16 "
            << reference["bf16"] << " B, fp8 MODEL1 " << reference["fp8_e4m3"] << " B per token\n"
            << "memory      cpu   checkpoint " << w.mapped_bytes << " B mapped read-only\n"
            << "            cuda  deepseek_v4 runs on the CPU reference only so far\n"
            << "tokenizer   " << (tokenizer_vocab > 0 ? std::to_string(tokenizer_vocab) + " tokens" : "none") << "\n";
  return Status::Ok();
}

}  // namespace lockstep::cli
