// cli/model_info_v4.h — `lockstep model info` for a DeepSeek-V4 directory (model_info.cc
// hands a deepseek_v4 config here).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "engine/config.h"
#include "engine/weights.h"

namespace lockstep::cli {

Status PrintV4Info(const engine::ModelConfig& c, const engine::ModelWeights& w, const std::string& dir,
                   int64_t params, int64_t active, bool config_only, int64_t tokenizer_vocab, bool json_out);

}  // namespace lockstep::cli
