// cli/model_info.cc — `lockstep model info DIR`: architecture, parameter counts, what loads.
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"

namespace lockstep::cli {
namespace {

struct InfoArgs {
  std::string dir;
  bool json = false;
};

const char* GateName(engine::GateKind g) {
  switch (g) {
    case engine::GateKind::kSoftmaxGreedy: return "softmax, greedy top-k";
    case engine::GateKind::kSoftmaxGroupLimited: return "softmax, group-limited greedy";
    case engine::GateKind::kSigmoidNoauxTc: return "sigmoid + correction bias, group-limited (noaux_tc)";
  }
  return "?";
}

const char* RopeName(engine::RopeStyle s) {
  switch (s) {
    case engine::RopeStyle::kPairsAdjacent: return "interleaved pairs (complex form)";
    case engine::RopeStyle::kPairsToHalves: return "interleaved pairs, de-interleaved output (rope_interleave)";
    case engine::RopeStyle::kHalves: return "rotate-half";
  }
  return "?";
}

Status RunInfo(const InfoArgs& a) {
  LS_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.dir.empty() ? DefaultModelDir() : std::filesystem::path(a.dir), /*quiet=*/true));
  const engine::ModelConfig& c = m.model->config();
  const engine::ModelWeights& w = m.model->weights();
  int64_t dense = 0, moe = 0;
  for (const auto& l : c.layers) (l.ffn == engine::FfnKind::kMoe ? moe : dense)++;
  nlohmann::json j;
  j["model_dir"] = m.dir.string();
  j["model_type"] = c.model_type;
  j["layers"] = {{"total", c.num_hidden_layers}, {"dense_ffn", dense}, {"moe_ffn", moe}};
  j["hidden_size"] = c.hidden_size;
  j["vocab_size"] = c.vocab_size;
  j["attention"] = {{"kind", c.has_indexer() ? "MLA + lightning indexer (sparse)" : "MLA"},
                    {"heads", c.num_attention_heads},
                    {"q_lora_rank", c.q_lora_rank},
                    {"kv_lora_rank", c.kv_lora_rank},
                    {"qk_nope_head_dim", c.qk_nope_head_dim},
                    {"qk_rope_head_dim", c.qk_rope_head_dim},
                    {"v_head_dim", c.v_head_dim},
                    {"softmax_scale", c.softmax_scale()},
                    {"rope", RopeName(c.rope_style)},
                    {"rope_theta", c.rope.theta},
                    {"yarn", c.rope.yarn}};
  if (c.rope.yarn) {
    j["attention"]["yarn_factor"] = c.rope.factor;
    j["attention"]["yarn_attention_factor"] = c.rope.attention_factor;
  }
  if (c.has_indexer()) {
    j["indexer"] = {{"heads", c.index_n_heads}, {"head_dim", c.index_head_dim}, {"topk", c.index_topk}};
  }
  if (moe > 0) {
    j["moe"] = {{"routed_experts", c.n_routed_experts}, {"experts_per_token", c.num_experts_per_tok},
                {"shared_experts", c.n_shared_experts}, {"gate", GateName(c.gate)},
                {"n_group", c.n_group}, {"topk_group", c.topk_group},
                {"norm_topk_prob", c.norm_topk_prob}, {"routed_scaling_factor", c.routed_scaling_factor}};
  }
  j["parameters"] = {{"total", m.model->ParameterCount()}, {"active_per_token", m.model->ActiveParameterCount()}};
  j["weights"] = {{"dtypes", w.dtype_counts}, {"fp8_block_scaled_tensors", w.fp8_tensors},
                  {"skipped", w.skipped}, {"mtp_layers_skipped", c.num_mtp_layers}};
  j["kv_cache_bytes_per_token_per_layer"] = {
      {"fp32", (c.kv_lora_rank + c.qk_rope_head_dim) * 4},
      {"bf16", (c.kv_lora_rank + c.qk_rope_head_dim) * 2},
      {"fp8_e4m3", c.kv_lora_rank + 4 * ((c.kv_lora_rank + 127) / 128) + 2 * c.qk_rope_head_dim}};
  j["tokenizer"] = m.tokenizer ? nlohmann::json{{"vocab_size", m.tokenizer->vocab_size()}} : nlohmann::json(nullptr);
  if (a.json) {
    std::cout << j.dump(2) << "\n";
    return Status::Ok();
  }
  auto M = [](int64_t n) { return std::to_string(n) + " (" + std::to_string(n / 1e6).substr(0, 6) + "M)"; };
  std::cout << "model       " << m.dir.string() << "\n"
            << "type        " << c.model_type << ", " << c.num_hidden_layers << " layers (" << dense << " dense FFN, "
            << moe << " MoE), hidden " << c.hidden_size << ", vocab " << c.vocab_size << "\n"
            << "attention   " << j["attention"]["kind"].get<std::string>() << ": " << c.num_attention_heads
            << " heads, q_lora " << c.q_lora_rank << ", kv_lora " << c.kv_lora_rank << ", nope/rope/v "
            << c.qk_nope_head_dim << "/" << c.qk_rope_head_dim << "/" << c.v_head_dim << "\n"
            << "rope        " << RopeName(c.rope_style) << ", theta " << c.rope.theta
            << (c.rope.yarn ? ", YaRN factor " + std::to_string(c.rope.factor) : std::string()) << "\n";
  if (c.has_indexer()) {
    std::cout << "indexer     " << c.index_n_heads << " heads × " << c.index_head_dim << ", top-" << c.index_topk
              << " keys per query\n";
  }
  if (moe > 0) {
    std::cout << "moe         " << c.n_routed_experts << " routed (top-" << c.num_experts_per_tok << "), "
              << c.n_shared_experts << " shared; gate " << GateName(c.gate) << ", " << c.n_group << " groups keep "
              << c.topk_group << "; scaling " << c.routed_scaling_factor << "\n";
  }
  std::cout << "parameters  total " << M(m.model->ParameterCount()) << ", active per token "
            << M(m.model->ActiveParameterCount()) << "\n";
  std::cout << "weights     ";
  for (const auto& [d, n] : w.dtype_counts) std::cout << n << " " << d << " ";
  if (w.fp8_tensors) std::cout << "(" << w.fp8_tensors << " FP8 with 128×128 block scales)";
  std::cout << "\n";
  std::cout << "skipped     " << w.skipped.size() << " tensors";
  if (c.num_mtp_layers > 0) std::cout << " (config declares " << c.num_mtp_layers << " MTP layer(s): not used)";
  std::cout << "\n";
  for (const auto& s : w.skipped) std::cout << "              " << s << "\n";
  std::cout << "kv cache    per token per layer: fp32 " << j["kv_cache_bytes_per_token_per_layer"]["fp32"]
            << " B, bf16 " << j["kv_cache_bytes_per_token_per_layer"]["bf16"] << " B, fp8_e4m3 "
            << j["kv_cache_bytes_per_token_per_layer"]["fp8_e4m3"] << " B\n";
  std::cout << "tokenizer   "
            << (m.tokenizer ? "tokenizer.json, " + std::to_string(m.tokenizer->vocab_size()) + " tokens" : "none")
            << "\n";
  return Status::Ok();
}

}  // namespace

void RegisterModelInfo(CLI::App& app, SetAction set_action) {
  auto args = std::make_shared<InfoArgs>();
  CLI::App* model = app.add_subcommand("model", "Inspect model directories");
  model->require_subcommand(1);
  CLI::App* info = model->add_subcommand("info", "Architecture, parameter counts, and what loads and what is skipped");
  info->add_option("dir", args->dir, "Model directory (default: the embedded tiny model)");
  info->add_flag("--json", args->json, "Machine-readable output");
  info->callback([args, set_action] { set_action([args] { return RunInfo(*args); }); });
}

}  // namespace lockstep::cli
