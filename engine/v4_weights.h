// engine/v4_weights.h — the parameters of a DeepSeek-V4 checkpoint, held as stored.
//
// Names are transformers 5.17's (`model.layers.L.self_attn.q_a_proj.weight`, …); a checkpoint
// in DeepSeek's official naming (`layers.L.attn.wq_a.weight`, `layers.L.ffn.experts.E.w1.weight`,
// `layers.L.hc_attn_fn`, …) is read through V4OfficialToHf, the conversion_mapping of
// transformers written out as an ordered list of renames. Every matrix is read by
// LoadConfiguredMatrix (engine/weights.h), as V2/V3's are: kernels::WeightView views of the
// mapped file in F32, BF16, F16, F8_E4M3 with 128×128 block scales (`weight_scale_inv` F32 or the
// official `.scale` F8_E8M0), or the routed experts' 4-bit MXFP4 (`.scale`) and NVFP4
// (`.weight_scale`, `.weight_scale_2`); vectors are decoded to fp32 at load.
//
// Lifetime: the matrices keep the checkpoint's mapping alive. Immutable after load.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/config.h"
#include "engine/safetensors.h"
#include "engine/weights.h"

namespace lockstep::engine {

// A hyper-connection's mixing weights: mix = RMS(flatten(X)) · fnᵀ, split into pre / post / comb.
struct V4HcWeights {
  Matrix fn;     // [(2 + hc)·hc, hc·D] (hc_head: [hc, hc·D])
  Matrix base;   // [(2 + hc)·hc]        (hc_head: [hc])
  Matrix scale;  // [3]                  (hc_head: [1])
};

// Gated pooling of m token rows into one entry (width w = d, or 2d for CSA's overlap; the
// indexer's: di or 2di).
struct V4CompressorWeights {
  Matrix kv_proj, gate_proj;  // [w, D]
  Matrix position_bias;       // [m, w]
  Matrix kv_norm;             // [d] (indexer: [di])
};

struct V4LayerWeights {
  V4HcWeights attn_hc, ffn_hc;
  Matrix input_norm, post_attn_norm;  // [D]
  // Attention.
  Matrix q_a_proj, q_a_norm, q_b_proj;  // [r, D], [r], [H·d, r]
  Matrix kv_proj, kv_norm;              // [d, D], [d]
  Matrix sinks;                         // [H]
  Matrix o_a_proj, o_b_proj;            // [G·R, H·d/G], [D, G·R]
  V4CompressorWeights compressor;       // CSA / HCA
  V4CompressorWeights indexer;          // CSA: the indexer's compressor
  Matrix indexer_q_b;                   // CSA: [Hi·di, r]
  Matrix indexer_weights;               // CSA: scorer.weights_proj [Hi, D]
  // MoE.
  Matrix router;                        // [E, D]
  Matrix router_bias;                   // [E] e_score_correction_bias (kMoe), selection only
  std::vector<int32_t> tid2eid;         // kHashMoe: [V, k] expert ids by token id
  std::vector<MlpWeights> experts;      // E routed experts (gate = w1, up = w3, down = w2)
  MlpWeights shared;                    // the shared expert (n_shared_experts 1), else empty
};

struct V4Weights {
  V4HcWeights head;  // hc_head: the streams' weighted sum before the final norm
  std::vector<V4LayerWeights> layers;
  int64_t parameters = 0;         // every V4-only parameter (the embeddings, norm and head are ModelWeights')
  int64_t inactive_experts = 0;   // parameters of the experts a token does not run (E − k per layer)
};

// f(m) for every V4 matrix of a product (GEMM) — the ones a lower-precision gemm variant computes
// in its precision (engine/gemm.h): the attention's projections, the compressors' and the
// indexer's, the routed and shared experts. The router, the hyper-connections' mixing weights,
// position biases and norms stay fp32 (ForEachProductMatrix adds lm_head). `experts_only`: the
// routed experts alone (the 4-bit variants' matrices).
template <typename F>
void ForEachV4ProductMatrix(V4Weights& w, bool experts_only, F f) {
  for (V4LayerWeights& L : w.layers) {
    for (MlpWeights& e : L.experts) {
      f(e.gate);
      f(e.up);
      f(e.down);
    }
    if (experts_only) continue;
    for (Matrix* m : {&L.q_a_proj, &L.q_b_proj, &L.kv_proj, &L.o_a_proj, &L.o_b_proj, &L.compressor.kv_proj,
                      &L.compressor.gate_proj, &L.indexer.kv_proj, &L.indexer.gate_proj, &L.indexer_q_b,
                      &L.indexer_weights, &L.shared.gate, &L.shared.up, &L.shared.down}) {
      f(*m);
    }
  }
}

// The transformers name of an official-named tensor ("layers.3.attn.wq_a.weight" →
// "model.layers.3.self_attn.q_a_proj.weight"); other names are returned unchanged.
std::string V4OfficialToHf(const std::string& name);

// Every V4 tensor of `ck` into w (embed, final_norm, lm_head and w->v4); unused tensors go to
// w->skipped, MTP ones (layers ≥ num_hidden_layers, `mtp.*`) counted in w->mtp_tensors.
Status LoadV4Weights(const ModelConfig& c, const Checkpoint& ck, ModelWeights* w);

}  // namespace lockstep::engine
