// verify/file_config.cc — see file_config.h.
#include "verify/file_config.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace lockstep::verify {

FileConfig ReadFileConfig(const std::filesystem::path& model_dir, bool deepseek_v2) {
  FileConfig f;
  std::ifstream in(model_dir / "config.json", std::ios::binary);
  if (!in) return f;
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return f;
  auto number = [](const nlohmann::json& o, const char* k) -> std::optional<double> {
    auto it = o.find(k);
    if (it == o.end() || !it->is_number()) return std::nullopt;
    return it->get<double>();
  };
  f.rms_norm_eps = number(j, "rms_norm_eps");
  f.routed_scaling_factor = number(j, "routed_scaling_factor");
  if (!deepseek_v2) {
    if (auto it = j.find("norm_topk_prob"); it != j.end() && it->is_boolean()) f.norm_topk_prob = it->get<bool>();
  }
  // transformers 5's rope_parameters first, then the older rope_scaling, then the top level.
  for (const char* sub : {"rope_parameters", "rope_scaling"}) {
    if (f.rope_theta) break;
    if (auto it = j.find(sub); it != j.end() && it->is_object()) f.rope_theta = number(*it, "rope_theta");
  }
  if (!f.rope_theta) f.rope_theta = number(j, "rope_theta");
  return f;
}

}  // namespace lockstep::verify
