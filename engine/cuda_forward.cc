// engine/cuda_forward.cc — CudaBackend::Forward: one engine step on the GPU — the step's inputs,
// buffers, cache mirror and tap slab laid out (CudaStep, engine/cuda_step.h), its blocks run
// (engine/cuda_blocks.cc) plainly or as a CUDA graph, then the logits, cache rows and taps back
// to the host. The class and the set-up are engine/cuda_backend_impl.h and cuda_backend.cc.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cuda_step.h"

namespace lockstep::engine::cuda_impl {

Status CudaBackend::Forward(std::span<Segment> segs, PagedKvCache& cache, const kernels::KernelPlan& plan,
                            TapHook* hook, ForwardOutput* out) {
  const ModelConfig& c = model_->config();
  CudaStep step(c, plan, cache);
  const int64_t H = step.H, nh = step.nh, dr = step.dr, dv = step.dv, C = step.C, dqk = step.dqk, V = step.V;
  if (plan.gemm != gemm_) {
    return Status::Internal("cuda backend: the weights were uploaded for another gemm variant than this step's (" +
                            plan.Describe() + ")");
  }
  // --kernel indexer=hadamard: q and k rotated after RoPE, as engine/model.cc does;
  // indexer=fp8_paged: rotated, then q through FP8 and back and k into the cache as FP8.
  const bool indexer_fp8 = step.indexer_fp8;
  const bool indexer_hadamard = step.indexer_hadamard;
  if (indexer_fp8 != fp8_index_keys_) {
    return Status::Internal(std::string("cuda backend: indexer ") + (indexer_fp8 ? "fp8_paged" : "in fp32") +
                            " over a cache whose index keys are " +
                            (fp8_index_keys_ ? "FP8" : "fp32"));
  }
  if (indexer_hadamard && c.has_indexer() && (c.index_head_dim & (c.index_head_dim - 1)) != 0) {
    return Status::InvalidArgument(std::string("--kernel indexer=") + (indexer_fp8 ? "fp8_paged" : "hadamard") +
                                   ": index_head_dim " +
                                   std::to_string(c.index_head_dim) + " is not a power of two (the Hadamard rotation)");
  }
  cu::Stream s = stream_->get();
  launch_ = s;
  // This thread's launches (and the graphs it captures) overlap or not, as the options say.
  struct OverlapScope {
    bool prev;
    ~OverlapScope() { cu::SetOverlappedLaunch(prev); }
  } overlap_scope{cu::SetOverlappedLaunch(overlap_launch_)};

  // Rows, positions, validation, cache pages (the host cache allocates; the device mirrors ids).
  LS_ASSIGN_OR_RETURN(SegmentLayout layout, LayOutSegments(segs, c));
  row0_ = std::move(layout.row0);
  const int64_t R = layout.rows;
  int64_t max_len = layout.max_end, max_pages = 1;
  if (max_len > rope_positions_) {
    return Status::InvalidArgument("position " + std::to_string(max_len - 1) + " beyond the cuda backend's RoPE table (" +
                                   std::to_string(rope_positions_) + " positions)");
  }
  for (auto& g : segs) {
    LS_RETURN_IF_ERROR(cache.Reserve(g.cache, g.start_pos + static_cast<int64_t>(g.tokens.size())));
    max_pages = std::max<int64_t>(max_pages, static_cast<int64_t>(g.cache->pages.size()));
  }
  taps_.BeginStep(hook, segs, row0_, R);
  const bool summary_taps = taps_.summaries_only();

  // Decode-only steps run as a CUDA graph (taps too: their device copies are graph nodes and
  // the arena is handed over after the launch; not when grafting, which needs the host inside
  // the step). Their launches
  // must not depend on the step: keys up to the cache's capacity (kernels skip what a
  // request does not have; results do not depend on this bound) and a full-width page table.
  bool all_decode = true;
  for (const auto& g : segs) all_decode = all_decode && g.tokens.size() == 1;
  const bool graph = use_graphs_ && all_decode && (hook == nullptr || !hook->WantsOverride());
  if (graph) {
    max_len = std::min<int64_t>(rope_positions_, num_pages_ * page_size_);
    max_pages = num_pages_;
  }

  // Logit rows: every row of an all_logits segment, else its last.
  std::vector<int32_t> logit_rows;
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(segs[i].tokens.size());
    for (int64_t j = segs[i].all_logits ? 0 : n - 1; j < n; ++j) logit_rows.push_back(static_cast<int32_t>(row0_[i] + j));
  }
  const int64_t RL = static_cast<int64_t>(logit_rows.size());

  // Host inputs, packed: tokens | positions | slots | seq_lens | logit rows | page table [R, P]
  // | head ids [R, nh] (0..nh−1 per row: the per-head absorption products run as grouped GEMVs)
  const int64_t P = max_pages;
  const size_t in_ints = static_cast<size_t>(4 * R + RL + R * P + R * nh);
  if (host_in_.size() < in_ints * 4) {
    LS_ASSIGN_OR_RETURN(host_in_, cu::PinnedBuffer::Allocate(in_ints * 4 * 2));
  }
  int32_t* hin = host_in_.as<int32_t>();
  int32_t *h_tok = hin, *h_pos = hin + R, *h_slot = hin + 2 * R, *h_len = hin + 3 * R, *h_lrow = hin + 4 * R,
          *h_table = hin + 4 * R + RL;
  for (size_t i = 0; i < segs.size(); ++i) {
    const Segment& g = segs[i];
    for (size_t j = 0; j < g.tokens.size(); ++j) {
      const int64_t r = row0_[i] + static_cast<int64_t>(j);
      const int64_t p = g.start_pos + static_cast<int64_t>(j);
      h_tok[r] = g.tokens[j];
      h_pos[r] = static_cast<int32_t>(p);
      h_slot[r] = static_cast<int32_t>(g.cache->pages[p / page_size_] * page_size_ + p % page_size_);
      h_len[r] = static_cast<int32_t>(p + 1);
      int32_t* row = h_table + r * P;
      std::fill(row, row + P, 0);
      std::copy(g.cache->pages.begin(), g.cache->pages.end(), row);
    }
  }
  std::copy(logit_rows.begin(), logit_rows.end(), h_lrow);
  int32_t* h_heads = h_table + R * P;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t hd = 0; hd < nh; ++hd) h_heads[r * nh + hd] = static_cast<int32_t>(hd);
  }

  LS_RETURN_IF_ERROR(dev_in_.Ensure(in_ints * 4));
  LS_RETURN_IF_ERROR(cu::CopyAsync(dev_in_.buf.data(), hin, in_ints * 4, s));
  const int32_t* d_in = dev_in_.as<int32_t>();
  const int32_t *d_tok = d_in, *d_pos = d_in + R, *d_slot = d_in + 2 * R, *d_len = d_in + 3 * R,
                *d_lrow = d_in + 4 * R, *d_table = d_in + 4 * R + RL, *d_heads = d_table + R * P;

  // Activations, one allocation carved up (floats unless noted).
  const int64_t qlora = std::max<int64_t>(c.q_lora_rank, 1);
  const int64_t nhi = step.nhi, di = step.di, topk = step.topk, k = step.k, E = step.E;
  const int64_t E_ = E > 0 ? E : 1, k_ = k > 0 ? k : 1;
  int64_t moe_inter = 1;
  for (const DevLayer& D : weights_->layers) moe_inter = std::max(moe_inter, D.moe_inter);
  step.tp = plan.emulate_tp;
  const int64_t tp_cols = step.tp > 1 ? R * step.tp * H : 0;
  struct Part {
    float** ptr;
    int64_t n;
  };
  CudaStep& t = step;
  float *topk_pos_f, *topk_slot_f, *ids_f;
  std::vector<Part> parts = {{&t.x, R * H},          {&t.h, R * H},
                             {&t.o, R * H},          {&t.qa, R * qlora},
                             {&t.qr, R * qlora},     {&t.q, R * nh * dqk},
                             {&t.kv, R * (C + dr)},  {&t.latent, R * C},
                             {&t.qlat, R * nh * C},  {&t.olat, R * nh * C},
                             {&t.heads, R * nh * dv}, {&t.iq, R * std::max<int64_t>(nhi * di, 1)},
                             {&t.ik, R * std::max<int64_t>(di, 1)}, {&t.ikn, R * std::max<int64_t>(di, 1)},
                             {&t.iw, R * std::max<int64_t>(nhi, 1)}, {&topk_pos_f, R * std::max<int64_t>(topk, 1)},
                             {&topk_slot_f, R * std::max<int64_t>(topk, 1)}, {&t.rlog, R * E_},
                             {&ids_f, R * k_},     {&t.wts, R * k_},
                             {&t.gu, R * k_ * 2 * moe_inter}, {&t.act, R * k_ * moe_inter},
                             {&t.ey, R * k_ * H},    {&t.sh, R * H},
                             // gemm=w8a8_dot: the linear layers' inputs through FP8 (Fp8RoundTrip)
                             {&t.hq, w8a8_ ? R * H : 0}, {&t.qrq, w8a8_ ? R * qlora : 0},
                             {&t.headsq, w8a8_ ? R * nh * dv : 0},
                             // emulated TP: the ranks' partials of o_proj and of the FFN
                             {&t.attn_parts, tp_cols}, {&t.ffn_parts, tp_cols},
                             // rank mode: the head-sharded taps' whole rows (every rank's heads)
                             {&t.q_whole, step.ranked() ? R * c.num_attention_heads * dqk : 0},
                             {&t.heads_whole, step.ranked() ? R * c.num_attention_heads * dv : 0}};
  size_t total = 0;
  for (const Part& p : parts) total += static_cast<size_t>((p.n + 63) / 64 * 64);
  LS_RETURN_IF_ERROR(act_.Ensure(total * 4));
  {
    float* base = act_.as<float>();
    for (const Part& p : parts) {
      *p.ptr = base;
      base += (p.n + 63) / 64 * 64;
    }
  }
  step.topk_pos = reinterpret_cast<int32_t*>(topk_pos_f);
  step.topk_slot = reinterpret_cast<int32_t*>(topk_slot_f);
  step.ids = reinterpret_cast<int32_t*>(ids_f);
  step.err = error_flag_.as<int32_t>();
  int32_t* const err = step.err;
  step.o_shared = step.o;

  // The new cache rows go back into the host cache when a reader wants them: the kernels that
  // store a layer's rows write the same bytes to a mirror too (LatentWriteParams::copy,
  // ScatterRowsParams::copy; inside the step, so a graph includes it), R rows a layer's stream
  // (mirror_off), then one copy. A hook that takes them as kv/ events (TapHook::WantsKvTaps)
  // gets them from the mirror instead, summarised on the device, and with their values from
  // the tap slab in a slab step of full capture (the mirror then lies in the slab, so the rows
  // travel with the taps in the lent buffer); the host cache does not get them then.
  std::vector<size_t>& mirror_off = step.mirror_off;
  step.mirror_at.assign(static_cast<size_t>(c.num_hidden_layers), {nullptr, nullptr});
  std::vector<std::array<uint8_t*, 2>>& mirror_at = step.mirror_at;
  size_t mirror_bytes = 0;
  if (mirror_) {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      for (const StreamSpec& st : cache.streams(l)) {
        if (st.bytes_per_token % 4 != 0) {
          return Status::Internal("cuda backend: cache stream '" + st.name + "' has " +
                                  std::to_string(st.bytes_per_token) + " bytes per token, not a multiple of 4");
        }
        mirror_off.push_back(mirror_bytes);
        mirror_bytes += static_cast<size_t>(R * st.bytes_per_token + 255) / 256 * 256;
      }
    }
  }
  // The tap slab (decode steps with a tap hook): every tapped tensor of the step gets its own
  // place, per layer, so nothing a tap saw is overwritten during the step; the step's taps then
  // leave the device in one copy (values) or one summary launch at the end (summaries), not as
  // a copy or launch per tap. Prefill steps (and grafting) use the per-tap arena instead.
  // (CudaStep::SlabPart: the places, in this order.)
  // (attn.q and attn.heads: every head's, in rank mode too — a rank gathers them there.)
  const int64_t nh_all = c.num_attention_heads;
  const int64_t part_cols[CudaStep::kSParts] = {H, nh_all * dqk, C, C + dr, std::max<int64_t>(topk, 1), nh_all * dv, H,
                                                H, H,        k_,    k_,     H,                          H,
                                                step.tp > 1 ? step.tp * H : 0, step.tp > 1 ? step.tp * H : 0};
  int64_t& layer_floats = step.layer_floats;
  for (int i = 0; i < CudaStep::kSParts; ++i) {
    step.part_off[i] = layer_floats;
    layer_floats += (R * part_cols[i] + 63) / 64 * 64;
  }
  step.ends_floats = (R * H + 63) / 64 * 64;  // embed, final_norm
  const int64_t ends_floats = step.ends_floats;
  step.slab_buf = &taps_.slab_buffer();
  const size_t slab_taps = static_cast<size_t>(2 * ends_floats + c.num_hidden_layers * layer_floats) * 4;
  const bool kv_wanted = hook != nullptr && mirror_ && hook->WantsKvTaps();
  const bool kv_values = kv_wanted && !summary_taps;  // full capture: the rows in the slab
  const size_t slab_need = slab_taps + (kv_values ? mirror_bytes : 0);
  LS_RETURN_IF_ERROR(taps_.UseSlab(hook != nullptr && all_decode && R <= CudaTapCapture::kSlabMaxRows &&
                                       slab_need <= CudaTapCapture::kSlabMaxBytes && !hook->WantsOverride(),
                                   slab_need));
  const bool slab = taps_.slab();
  // This step's cache rows go to the hook as kv/ events: summaries in any step, values in slab
  // steps (elsewhere full capture's rows take the host cache's way).
  taps_.set_kv_events(kv_wanted && (summary_taps || slab));
  const bool kv_events = taps_.kv_events();
  uint8_t*& mirror_base = step.mirror_base;
  if (mirror_) {
    if (kv_events && !summary_taps) {
      mirror_base = taps_.slab_buffer().as<uint8_t>() + slab_taps;
    } else {
      LS_RETURN_IF_ERROR(mirror_dev_.Ensure(mirror_bytes));
      mirror_base = mirror_dev_.as<uint8_t>();
    }
    if (!kv_events && mirror_host_.size() < mirror_bytes) {
      LS_ASSIGN_OR_RETURN(mirror_host_, cu::PinnedBuffer::Allocate(mirror_bytes * 3 / 2));
    }
    size_t idx = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      for (const StreamSpec& st : cache.streams(l)) {
        mirror_at[l][st.kind == StreamKind::kMlaLatent ? 0 : 1] = mirror_base + mirror_off[idx++];
      }
    }
  }
  if (hook != nullptr) LS_RETURN_IF_ERROR(taps_.EnsureArena());

  LS_ASSIGN_OR_RETURN(float* const logits_host, taps_.LogitsBuffer(static_cast<size_t>(RL * V) * 4));
  LS_RETURN_IF_ERROR(logits_dev_.Ensure(static_cast<size_t>(RL * V) * 4));

  // What the blocks read.
  step.R = R;
  step.RL = RL;
  step.P = P;
  step.max_len = max_len;
  step.w8a8 = w8a8_;
  step.s = step.main_stream = s;
  step.rope_cos = rope_cos_.f32();
  step.rope_sin = rope_sin_.f32();
  step.rope_positions = rope_positions_;
  step.d_tok = d_tok;
  step.d_pos = d_pos;
  step.d_slot = d_slot;
  step.d_len = d_len;
  step.d_lrow = d_lrow;
  step.d_table = d_table;
  step.d_heads = d_heads;
  step.fuse_norms = hook == nullptr || slab;
  // Independent branches on two streams (see side_), where taps need no copies or fences
  // in stream order. The side stream's GEMMs have their own scratch and workspace; not for
  // cuBLAS fp32, whose objects may each fall back from PEDANTIC on their own.
  // (Not under emulated TP: its rank-by-rank products share one scratch, on one stream.)
  step.overlap = use_side_ && (dot_ || bf16_) && (hook == nullptr || slab) && step.tp == 1;
  auto body = [&]() -> Status { return StepBody(step); };
  if (!graph) {
    LS_RETURN_IF_ERROR(body());
  } else {
    // With taps the graph has the arena copies, or the summary launches (with the KV rows').
    const int64_t key = 8 * R + (hook != nullptr ? 1 : 0) + (summary_taps ? 2 : 0) + (kv_events ? 4 : 0);
    StepGraph& sg = graphs_[key];
    auto warm = warmed_.find(key);
    if (sg.graph && sg.generation == alloc_generation_) {
      LS_RETURN_IF_ERROR(sg.graph->Launch(s));
      ++graph_launches_;
      if (prof_) prof_->SetUsed(sg.marks);
      taps_.Restore(sg.taps);
    } else if (!sg.failed && warm != warmed_.end() && warm->second == alloc_generation_) {
      LS_RETURN_IF_ERROR(cu::CudaGraph::BeginCapture(s));
      taps_.set_capturing(true);
      const Status st = body();
      taps_.set_capturing(false);
      auto captured = cu::CudaGraph::EndCapture(s);
      if (st.ok() && captured.ok() && alloc_generation_ == warm->second) {
        sg.graph = std::move(*captured);
        sg.generation = alloc_generation_;
        if (prof_) sg.marks = prof_->used();
        sg.taps = taps_.Held();
        LS_RETURN_IF_ERROR(sg.graph->Launch(s));
      } else {
        // Something in the step cannot be captured: run it plainly from now on.
        sg.failed = true;
        sg.graph.reset();
        cu::ClearLastError();
        taps_.Drop();
        if (prof_) prof_->SetUsed(0);
        LS_RETURN_IF_ERROR(body());
      }
    } else {
      LS_RETURN_IF_ERROR(body());
      warmed_[key] = alloc_generation_;
    }
  }
  LS_RETURN_IF_ERROR(SampleOnDevice(segs, V, s));
  // The logits rows someone reads (the segment's caller, the tap hook, the host sampler), in
  // runs of adjacent rows: a decode step whose tokens the device sampled copies none.
  std::vector<bool> copied(segs.size());
  {
    size_t next = 0;  // sampled_ is ascending
    for (size_t i = 0; i < segs.size(); ++i) {
      const bool on_device = next < sampled_.size() && sampled_[next] == i;
      next += on_device ? 1 : 0;
      copied[i] = segs[i].want_logits || hook != nullptr || !on_device;
    }
    int64_t lr = 0, run0 = 0, run_rows = 0;
    for (size_t i = 0; i <= segs.size(); ++i) {
      const int64_t rows = i == segs.size() ? 0 : segs[i].all_logits ? static_cast<int64_t>(segs[i].tokens.size()) : 1;
      if (i == segs.size() || !copied[i]) {
        if (run_rows > 0) {
          const size_t off = static_cast<size_t>(run0 * V) * 4;
          LS_RETURN_IF_ERROR(cu::CopyAsync(reinterpret_cast<char*>(logits_host) + off, logits_dev_.as<char>() + off,
                                           static_cast<size_t>(run_rows * V) * 4, s));
        }
        run0 = lr + rows;
        run_rows = 0;
      } else {
        run_rows += rows;
      }
      lr += rows;
    }
  }

  if (mirror_ && !kv_events) {
    LS_RETURN_IF_ERROR(cu::CopyAsync(mirror_host_.data(), mirror_dev_.buf.data(), mirror_bytes, s));
  }

  // One synchronisation: taps, logits, cache rows and the kernels' error flag.
  // (Into pinned memory: a copy into pageable memory would hold the host until the step ends.)
  if (flag_host_.size() < 4) {
    LS_ASSIGN_OR_RETURN(flag_host_, cu::PinnedBuffer::Allocate(256));
  }
  LS_RETURN_IF_ERROR(cu::CopyAsync(flag_host_.data(), err, 4, s));
  LS_RETURN_IF_ERROR(taps_.Flush());
  LS_RETURN_IF_ERROR(stream_->Synchronize());
  const int32_t flag = *flag_host_.as<int32_t>();
  if (flag != 0) {
    LS_RETURN_IF_ERROR(error_flag_.Fill(0));
    return Status::Internal("cuda backend: a kernel reported bad device arguments (KernelError bits " +
                            std::to_string(flag) + ")");
  }
  if (prof_) {  // decode-only steps apart from steps with prompt rows (different work)
    LS_RETURN_IF_ERROR(prof_->Collect(&prof_ms_[all_decode ? 0 : 1]));
    ++prof_steps_[all_decode ? 0 : 1];
  }
  if (mirror_ && !kv_events) {
    size_t idx = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const auto& streams = cache.streams(l);
      for (size_t si = 0; si < streams.size(); ++si) {
        const char* base = mirror_host_.as<char>() + mirror_off[idx++];
        for (size_t i = 0; i < segs.size(); ++i) {
          for (size_t j = 0; j < segs[i].tokens.size(); ++j) {
            const int64_t r = row0_[i] + static_cast<int64_t>(j);
            std::memcpy(cache.MutableTokenBytes(l, si, *segs[i].cache, segs[i].start_pos + static_cast<int64_t>(j)),
                        base + r * streams[si].bytes_per_token, static_cast<size_t>(streams[si].bytes_per_token));
          }
        }
      }
    }
  }

  out->logits.assign(segs.size(), {});
  const float* lg = logits_host;
  int64_t lr = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(segs[i].tokens.size());
    const int64_t rows = segs[i].all_logits ? n : 1;
    if (copied[i]) out->logits[i].assign(lg + lr * V, lg + (lr + rows) * V);
    lr += rows;
  }
  taps_.TapLogits(lg, V);
  LS_RETURN_IF_ERROR(CollectSamples(segs, out));
  for (auto& g : segs) g.cache->length = g.start_pos + static_cast<int64_t>(g.tokens.size());
  taps_.EndStep();
  return Status::Ok();
}

}  // namespace lockstep::engine::cuda_impl
