// cli/model_info.cc — `lockstep model info DIR`: architecture, parameter counts, what loads,
// and the memory each backend needs. A folder with a config.json and no checkpoint
// (models/shapes/*) is described from its config: its weights' shapes, and the dtypes the
// config declares (torch_dtype / dtype, quantization_config).
#include <cstdio>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/model_info_v4.h"
#include "engine/memory.h"

namespace lockstep::cli {
namespace {

struct InfoArgs {
  std::string dir;
  bool json = false;
  int64_t tokens = 4096;
  int64_t kv_pool_tokens = engine::EngineOptions{}.kv_cache_tokens;
};

// "14.7 MB": decimal units, three significant digits.
std::string Bytes(uint64_t n) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1000 && u < 5) {
    v /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s", v,
                units[u]);
  return buf;
}

bool HasCheckpoint(const std::filesystem::path& dir) {
  return std::filesystem::exists(dir / "model.safetensors") ||
         std::filesystem::exists(dir / "model.safetensors.index.json");
}

// The dtype config.json declares for the weights (torch_dtype, or transformers 5's dtype);
// bf16, DeepSeek's, when it says none.
kernels::WeightDType DeclaredDType(const std::filesystem::path& dir) {
  std::ifstream in(dir / "config.json");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  std::string d;
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (j.is_object() && j.contains(key) && j[key].is_string()) d = j[key].get<std::string>();
  }
  if (d == "float32") return kernels::WeightDType::kF32;
  if (d == "float16") return kernels::WeightDType::kF16;
  return kernels::WeightDType::kBf16;
}

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
  const std::filesystem::path dir = a.dir.empty() ? DefaultModelDir() : std::filesystem::path(a.dir);
  LoadedModel m;
  engine::ModelConfig shapes_config;
  engine::ModelWeights shapes;
  const bool config_only = std::filesystem::exists(dir / "config.json") && !HasCheckpoint(dir);
  if (config_only) {
    LS_ASSIGN_OR_RETURN(shapes_config, engine::ModelConfig::Load(dir));
    shapes = engine::ModelWeights::Shapes(shapes_config, DeclaredDType(dir));
    m.dir = dir;
    if (std::filesystem::exists(dir / "tokenizer.json")) {
      LS_ASSIGN_OR_RETURN(m.tokenizer, engine::Tokenizer::Load(dir / "tokenizer.json"));
    }
  } else {
    LS_ASSIGN_OR_RETURN(m, LoadModel(dir, /*quiet=*/true));
  }
  const engine::ModelConfig& c = config_only ? shapes_config : m.model->config();
  const engine::ModelWeights& w = config_only ? shapes : m.model->weights();
  const int64_t params = engine::ParameterCount(c, w), active = engine::ActiveParameterCount(c, w);
  if (c.is_v4()) {
    return PrintV4Info(c, w, m.dir.string(), params, active, config_only,
                       m.tokenizer ? m.tokenizer->vocab_size() : 0, a.json);
  }
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
  j["parameters"] = {{"total", params}, {"active_per_token", active}};
  j["weights"] = {{"dtypes", w.dtype_counts}, {"fp8_block_scaled_tensors", w.fp8_tensors},
                  {"skipped", w.skipped}, {"mtp_layers_skipped", c.num_mtp_layers},
                  {"checkpoint", config_only ? "none: shapes from config.json, dtypes as it declares" : "mapped"}};
  // Memory: the CPU reads the checkpoint in place; the CUDA backend uploads it in its precision.
  uint64_t stored = 0;  // the bytes of every weight as stored (a config-only folder: as declared)
  engine::ForEachMatrix(c, w, [&](const engine::Matrix& x) { stored += x.stored_bytes(); });
  const uint64_t mapped = config_only ? stored : w.mapped_bytes;
  nlohmann::json kv_token, kv_pool;
  for (engine::KvFormat f : {engine::KvFormat::kFp32, engine::KvFormat::kBf16, engine::KvFormat::kFp8E4m3}) {
    const uint64_t per = engine::KvBytesPerToken(c, f);
    kv_token[std::string(engine::KvFormatName(f))] = per;
    kv_pool[std::string(engine::KvFormatName(f))] = per * static_cast<uint64_t>(a.kv_pool_tokens);
  }
  const uint64_t act = engine::CpuActivationBytes(c, a.tokens), fp8_copies = engine::CpuFp8CopyBytes(w);
  const uint64_t dev32 = engine::DeviceWeightBytes(c, w, engine::DeviceWeights::kFp32),
                 dev16 = engine::DeviceWeightBytes(c, w, engine::DeviceWeights::kBf16),
                 dev8 = engine::DeviceWeightBytes(c, w, engine::DeviceWeights::kFp8);
  j["memory"] = {
      {"cpu",
       {{"checkpoint_bytes", mapped},
        {"weight_bytes", stored},
        {"fp8_copy_bytes", fp8_copies},
        {"activation_bytes", act},
        {"activation_tokens", a.tokens},
        {"kv_cache_bytes_per_token", kv_token}}},
      {"cuda",
       {{"weight_bytes", {{"fp32", dev32}, {"bf16", dev16}, {"fp8", dev8}}},
        {"kv_pool_tokens", a.kv_pool_tokens},
        {"kv_pool_bytes", kv_pool}}}};
  j["kv_cache_bytes_per_token_per_layer"] = {
      {"fp32", (c.kv_lora_rank + c.qk_rope_head_dim) * 4},
      {"bf16", (c.kv_lora_rank + c.qk_rope_head_dim) * 2},
      {"fp8_e4m3", c.kv_lora_rank + 4 * ((c.kv_lora_rank + 127) / 128) + 2 * c.qk_rope_head_dim}};
  j["tokenizer"] = m.tokenizer ? nlohmann::json{{"vocab_size", m.tokenizer->vocab_size()}} : nlohmann::json(nullptr);
  if (a.json) {
    std::cout << JsonText(j, 2) << "\n";
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
  std::cout << "parameters  total " << M(params) << ", active per token " << M(active) << "\n";
  std::cout << "weights     ";
  for (const auto& [d, n] : w.dtype_counts) std::cout << n << " " << d << " ";
  if (w.fp8_tensors) std::cout << "(" << w.fp8_tensors << " FP8 with 128×128 block scales)";
  if (config_only) std::cout << "(no checkpoint: the dtypes config.json declares)";
  std::cout << "\n";
  std::cout << "skipped     " << w.skipped.size() << " tensors";
  if (c.num_mtp_layers > 0) std::cout << " (config declares " << c.num_mtp_layers << " MTP layer(s): not used)";
  std::cout << "\n";
  for (const auto& s : w.skipped) std::cout << "              " << s << "\n";
  std::cout << "kv cache    per token per layer: fp32 " << j["kv_cache_bytes_per_token_per_layer"]["fp32"]
            << " B, bf16 " << j["kv_cache_bytes_per_token_per_layer"]["bf16"] << " B, fp8_e4m3 "
            << j["kv_cache_bytes_per_token_per_layer"]["fp8_e4m3"] << " B\n";
  const uint64_t kv32 = kv_token["fp32"], kv16 = kv_token["bf16"], kv8 = kv_token["fp8_e4m3"];
  std::cout << "memory      cpu   " << (config_only ? "a checkpoint of " : "checkpoint ") << Bytes(mapped)
            << ", mapped read-only: resident as far as a run reads it";
  if (!config_only && stored < mapped - mapped / 100) std::cout << " (" << Bytes(stored) << " of weights it uses)";
  std::cout << "\n                  + ≈ " << Bytes(act) << " for a " << a.tokens << "-token prefill step"
            << ", KV cache " << Bytes(kv32 * 1024) << " per 1k tokens (fp32; bf16 " << Bytes(kv16 * 1024)
            << ", fp8_e4m3 " << Bytes(kv8 * 1024) << ")\n";
  if (fp8_copies > 0) {
    std::cout << "                  gemm=fp8_dot, w8a8_dot: + " << Bytes(fp8_copies)
              << " of FP8 copies (the checkpoint has no FP8 weights)\n";
  }
  std::cout << "            cuda  weights " << Bytes(dev32) << " (gemm=fp32, fp32_dot), " << Bytes(dev16)
            << " (bf16, bf16_dot), " << Bytes(dev8) << " (fp8_dot, w8a8_dot)\n"
            << "                  + KV pool " << Bytes(kv32 * a.kv_pool_tokens) << " (" << a.kv_pool_tokens
            << " tokens fp32; bf16 " << Bytes(kv16 * a.kv_pool_tokens) << ", fp8_e4m3 "
            << Bytes(kv8 * a.kv_pool_tokens) << ")\n";
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
  info->add_option("dir", args->dir, ModelOptionHelp());
  info->add_flag("--json", args->json, "Machine-readable output");
  info->add_option("--tokens", args->tokens, "Prefill tokens the CPU activation estimate assumes")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  info->add_option("--kv-cache-tokens", args->kv_pool_tokens, "KV pool size the CUDA estimate assumes (as generate's)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  info->callback([args, set_action] { set_action([args] { return RunInfo(*args); }); });
}

}  // namespace lockstep::cli
