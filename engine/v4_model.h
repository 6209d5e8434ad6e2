// engine/v4_model.h — the DeepSeek-V4 forward pass on the CPU reference (fp32).
//
// Model::Forward hands a deepseek_v4 model's step here. The pass is a loop over the layers'
// specs (ModelConfig::layers: attention kind, FFN kind, hyper-connection residual, cache streams
// from V4LayerStreams) calling the blocks of engine/v4_blocks.h. Everything a request carries
// from one step to the next lives in its PagedKvCache streams — window rows, compressor state,
// compressed rows, indexer keys — each row written once at its slot and read back as stored, so
// prefill, decode and any chunking of a prompt compute the same numbers bit for bit.
#pragma once

#include <span>

#include "base/status.h"
#include "engine/model.h"

namespace lockstep::engine {

Status V4Forward(const ModelConfig& c, const ModelWeights& w, std::span<Segment> segs, PagedKvCache& cache,
                 const kernels::KernelPlan& plan, TapHook* hook, ForwardOutput* out);

}  // namespace lockstep::engine
