// cli/taps_cmd.cc — `lockstep taps`: the tap table (engine/tap.h), the names a trace's
// tensors carry and diff joins on: as a table, --json, or --markdown (docs/tap-points.md's
// table is exactly that output; tests/cli/taps_doc_test.sh holds them together).
#include <iostream>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/table.h"
#include "engine/tap.h"

namespace lockstep::cli {
namespace {

const char* DTypeName(engine::TapDType d) {
  switch (d) {
    case engine::TapDType::kF32: return "f32";
    case engine::TapDType::kI32: return "i32";
    case engine::TapDType::kBf16: return "bf16";
    case engine::TapDType::kFp8E4m3: return "fp8_e4m3";
    case engine::TapDType::kU8: return "u8";
  }
  return "?";
}

// Every tap point in causal order: embed, one layer's taps (the KV cache's place among them
// noted), final_norm, logits.
struct Row {
  std::string name, cols, dtype, meaning;
  int order;
};
std::vector<Row> Rows() {
  using namespace engine;
  std::vector<Row> rows;
  auto add = [&](const TapPoint& t) {
    rows.push_back({t.per_layer ? "layers.L." + std::string(t.name) : std::string(t.name), std::string(t.cols),
                    DTypeName(t.dtype), std::string(t.meaning), t.order});
  };
  add(kModelTaps[kTapEmbed]);
  for (const TapPoint& t : kLayerTaps) add(t);
  add(kModelTaps[kTapFinalNorm]);
  add(kModelTaps[kTapLogits]);
  return rows;
}

}  // namespace

void RegisterTaps(CLI::App& app, SetAction set_action) {
  auto json = std::make_shared<bool>(false);
  auto md = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("taps", "List the tap points: the tensors a trace records, in causal order");
  cmd->footer(
      "Widths: H = hidden_size, nh = num_attention_heads, dn/dr/dv = qk_nope/qk_rope/v head dims,\n"
      "C = kv_lora_rank, k = num_experts_per_tok, K = index_topk, V = vocab_size. The KV cache as stored\n"
      "(kv/layers.L.*) is written right after attn.k_rope. docs/tap-points.md explains the conventions.");
  cmd->add_flag("--json", *json, "Machine-readable output");
  cmd->add_flag("--markdown", *md, "The Markdown table docs/tap-points.md holds");
  cmd->callback([json, md, set_action] {
    const bool as_json = *json, as_md = *md;
    set_action([as_json, as_md] {
      const std::vector<Row> rows = Rows();
      if (as_json) {
        nlohmann::json j = nlohmann::json::array();
        for (const Row& r : rows) {
          j.push_back({{"name", r.name}, {"cols", r.cols}, {"dtype", r.dtype}, {"order", r.order},
                       {"per_layer", r.name.rfind("layers.L.", 0) == 0}, {"meaning", r.meaning}});
        }
        std::cout << JsonText(j, 2) << "\n";
      } else if (as_md) {
        std::cout << "| name | cols | dtype | what it is |\n|---|---|---|---|\n";
        for (const Row& r : rows) {
          std::cout << "| `" << r.name << "` | " << r.cols << " | " << r.dtype << " | " << r.meaning << " |\n";
        }
      } else {
        Table t({"name", "cols", "dtype", "what it is"});
        for (const Row& r : rows) t.Add({r.name, r.cols, r.dtype, r.meaning});
        t.Print();
      }
      return Status::Ok();
    });
  });
}

}  // namespace lockstep::cli
