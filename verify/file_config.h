// verify/file_config.h — the few config.json fields verify's MLA twins compute with, read from
// the file by verify itself, so a model parser that misreads one (the engine's ModelConfig) is a
// defect of the op that uses it rather than an assumption verify shares. Only fields the file
// states are taken; a field it leaves out keeps the engine's default (the family's documented
// value), so defaults are not checked here.
#pragma once

#include <filesystem>
#include <optional>

namespace lockstep::verify {

struct FileConfig {
  std::optional<double> rms_norm_eps;           // every RMSNorm of the layers and the final norm
  std::optional<double> routed_scaling_factor;  // the router's weights
  std::optional<bool> norm_topk_prob;           // V3 / V3.2 only: transformers' V2 never normalises
  std::optional<double> rope_theta;             // rope_parameters', rope_scaling's, or the top level's
};

// model_dir/config.json's fields as stated (numbers of the right kind only; anything else, or an
// unreadable file, leaves the field empty: the model loader reports bad files, not this).
FileConfig ReadFileConfig(const std::filesystem::path& model_dir, bool deepseek_v2);

}  // namespace lockstep::verify
