// cli/diff_report.h — how a diff::TraceDiffReport is shown: a terminal table, JSON, or a
// self-contained HTML page (cli/report_html.cc: the verdict, per request KL/top-1 and entropy
// per position, both traces' tokens aligned, a layer × position heatmap with a log colour
// bar, error per layer as curves). Shared by `diff`, `replay` and `bisect`. Tensors are
// listed in natural order (layers.2 before layers.10).
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
// One self-contained page (inline CSS, SVG and script; no network): every request of the
// report selectable by a tab, or by #request-ID in the URL.
std::string DiffHtml(const diff::TraceDiffReport& r, const Detokenize& detok, const std::string& title);

// The report's tensors as every listing shows them: natural order of the name without its
// group ("layers.2.attn.out" before "layers.10.attn.out"; "kv/layers.1.latent" beside
// "taps/layers.1.attn.q"). Pointers into r.tensors.
std::vector<const diff::TensorReport*> NaturalTensors(const diff::TraceDiffReport& r);

// The model's tokenizer, from a trace's meta.model_dir, when it is there.
Detokenize TokenizerFromTrace(const std::map<std::string, std::string>& meta);

}  // namespace lockstep::cli
