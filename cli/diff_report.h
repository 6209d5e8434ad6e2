// cli/diff_report.h — how a diff::TraceDiffReport is shown: a terminal table, JSON, or a
// self-contained HTML page (heatmap of error by layer × position, the token strip with the
// divergence marked). Shared by `diff`, `replay` and `bisect`.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "diff/trace_diff.h"

namespace lockstep::cli {

using Detokenize = std::function<std::string(const std::vector<int32_t>&)>;  // may be empty

void PrintDiffText(const diff::TraceDiffReport& r, const Detokenize& detok, bool verbose);
nlohmann::json DiffJson(const diff::TraceDiffReport& r, const Detokenize& detok);
std::string DiffHtml(const diff::TraceDiffReport& r, const Detokenize& detok, const std::string& title);

// The model's tokenizer, from a trace's meta.model_dir, when it is there.
Detokenize TokenizerFromTrace(const std::map<std::string, std::string>& meta);

}  // namespace lockstep::cli
