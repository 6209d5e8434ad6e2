// engine/mla_model.h — the DeepSeek V2 / V3 / V3.2 forward pass on the CPU reference (fp32).
//
// Model::Forward checks a step (LayOutSegments, the caches reserved, the RoPE tables long
// enough) and hands an MLA model's step here. The pass is a loop over the layers' specs
// (ModelConfig::layers: dense or sparse MLA attention, dense or MoE FFN) calling the blocks of
// engine/mla_model.cc — the query and the shared key, the V3.2 lightning indexer, attention
// (expanded or absorbed), the output projection, the FFN — each with its taps (engine/tap.h).
#pragma once

#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/model.h"

namespace lockstep::engine {

// What the pass reads from its Model besides the config and the weights; read-only while it runs.
struct MlaTables {
  std::span<const float> rope_cos, rope_sin;                // [positions ≥ layout.max_end, qk_rope/2]
  const std::vector<std::vector<std::string>>& tap_names;  // [layer][TapId]
};

Status MlaForward(const ModelConfig& c, const ModelWeights& w, std::span<Segment> segs, const SegmentLayout& layout,
                  PagedKvCache& cache, const kernels::KernelPlan& plan, const MlaTables& tables, TapHook* hook,
                  ForwardOutput* out);

}  // namespace lockstep::engine
