// engine/cuda_forward.cc — CudaBackend::Forward: one engine step on the GPU (the class and the
// set-up are engine/cuda_backend_impl.h and engine/cuda_backend.cc; the file header there
// describes the computation).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cuda_backend_impl.h"

namespace lockstep::engine::cuda_impl {

// Rows (requests) up to which W_UV's absorption merges MLA decode's splits itself (the
// `combine_in_uv` of Forward). Its bulk-copy shape merges a head's splits again in each of the
// head's CTAs: one launch fewer on the chain at one row (H200, V2-Lite batch 1, +4.6 %,
// 2026-11-30); at more rows the absorption takes other shapes.
constexpr int64_t kCombineInUvMaxRows = 1;

Status CudaBackend::Forward(std::span<Segment> segs, PagedKvCache& cache, const kernels::KernelPlan& plan,
                            TapHook* hook, ForwardOutput* out) {
  const ModelConfig& c = model_->config();
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, C = c.kv_lora_rank, dqk = dn + dr, V = c.vocab_size;
  const float scale = static_cast<float>(c.softmax_scale());
  if (plan.gemm != gemm_) {
    return Status::Internal("cuda backend: the weights were uploaded for another gemm variant than this step's (" +
                            plan.Describe() + ")");
  }
  // --kernel indexer=hadamard: q and k rotated after RoPE, as engine/model.cc does;
  // indexer=fp8_paged: rotated, then q through FP8 and back and k into the cache as FP8.
  const bool indexer_fp8 = plan.indexer == kernels::Indexer::kFp8Paged;
  const bool indexer_hadamard = plan.indexer_hadamard();
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
  segs_ = segs;
  rows_ = R;
  hook_ = hook;
  summary_taps_ = hook != nullptr && !hook->WantsTapValues();
  summary_batch_.count = 0;

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
  const int64_t nhi = c.has_indexer() ? c.index_n_heads : 0, di = c.has_indexer() ? c.index_head_dim : 0;
  const int64_t topk = c.has_indexer() ? c.index_topk : 0;
  const int64_t k = c.num_experts_per_tok, E = c.n_routed_experts;
  const int64_t E_ = E > 0 ? E : 1, k_ = k > 0 ? k : 1;
  int64_t moe_inter = 1;
  for (const DevLayer& D : weights_->layers) moe_inter = std::max(moe_inter, D.moe_inter);
  struct Part {
    float** ptr;
    int64_t n;
  };
  float *x, *h, *o, *qa, *qr, *q, *kv, *latent, *qlat, *olat, *heads, *iq, *ik, *ikn, *iw, *rlog, *wts, *gu, *act,
      *ey, *sh, *hq, *qrq, *headsq;
  float *topk_pos_f, *topk_slot_f, *ids_f;
  std::vector<Part> parts = {{&x, R * H},          {&h, R * H},
                             {&o, R * H},          {&qa, R * qlora},
                             {&qr, R * qlora},     {&q, R * nh * dqk},
                             {&kv, R * (C + dr)},  {&latent, R * C},
                             {&qlat, R * nh * C},  {&olat, R * nh * C},
                             {&heads, R * nh * dv}, {&iq, R * std::max<int64_t>(nhi * di, 1)},
                             {&ik, R * std::max<int64_t>(di, 1)}, {&ikn, R * std::max<int64_t>(di, 1)},
                             {&iw, R * std::max<int64_t>(nhi, 1)}, {&topk_pos_f, R * std::max<int64_t>(topk, 1)},
                             {&topk_slot_f, R * std::max<int64_t>(topk, 1)}, {&rlog, R * E_},
                             {&ids_f, R * k_},     {&wts, R * k_},
                             {&gu, R * k_ * 2 * moe_inter}, {&act, R * k_ * moe_inter},
                             {&ey, R * k_ * H},    {&sh, R * H},
                             // gemm=w8a8_dot: the linear layers' inputs through FP8 (Fp8RoundTrip)
                             {&hq, w8a8_ ? R * H : 0}, {&qrq, w8a8_ ? R * qlora : 0},
                             {&headsq, w8a8_ ? R * nh * dv : 0}};
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
  int32_t* topk_pos = reinterpret_cast<int32_t*>(topk_pos_f);
  int32_t* topk_slot = reinterpret_cast<int32_t*>(topk_slot_f);
  int32_t* ids = reinterpret_cast<int32_t*>(ids_f);
  int32_t* err = error_flag_.as<int32_t>();
  float* const o_shared = o;

  // The new cache rows go back into the host cache when a reader wants them: the kernels that
  // store a layer's rows write the same bytes to a mirror too (LatentWriteParams::copy,
  // ScatterRowsParams::copy; inside the step, so a graph includes it), R rows a layer's stream
  // (mirror_off), then one copy. A hook that takes them as kv/ events (TapHook::WantsKvTaps)
  // gets them from the mirror instead, summarised on the device, and with their values from
  // the tap slab in a slab step of full capture (the mirror then lies in the slab, so the rows
  // travel with the taps in the lent buffer); the host cache does not get them then.
  std::vector<size_t> mirror_off;
  std::vector<std::array<uint8_t*, 2>> mirror_at(static_cast<size_t>(c.num_hidden_layers), {nullptr, nullptr});
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
  enum SlabPart { kSAttnNorm, kSQ, kSLatent, kSKv, kSTopk, kSHeads, kSAttnOut, kSResidMid, kSFfnNorm, kSIds, kSWts,
                  kSFfnOut, kSResidOut, kSParts };
  const int64_t part_cols[kSParts] = {H, nh * dqk, C, C + dr, std::max<int64_t>(topk, 1), nh * dv, H, H, H, k_, k_, H, H};
  int64_t part_off[kSParts], layer_floats = 0;
  for (int i = 0; i < kSParts; ++i) {
    part_off[i] = layer_floats;
    layer_floats += (R * part_cols[i] + 63) / 64 * 64;
  }
  const int64_t ends_floats = (R * H + 63) / 64 * 64;  // embed, final_norm
  const size_t slab_taps = static_cast<size_t>(2 * ends_floats + c.num_hidden_layers * layer_floats) * 4;
  const bool kv_wanted = hook != nullptr && mirror_ && hook->WantsKvTaps();
  const bool kv_values = kv_wanted && !summary_taps_;  // full capture: the rows in the slab
  const size_t slab_need = slab_taps + (kv_values ? mirror_bytes : 0);
  slab_ = hook != nullptr && all_decode && R <= kSlabMaxRows && slab_need <= kSlabMaxBytes && !hook->WantsOverride();
  if (slab_) {
    slab_bytes_ = slab_need;
    LS_RETURN_IF_ERROR(slab_buf_.Ensure(slab_bytes_));
  }
  // This step's cache rows go to the hook as kv/ events: summaries in any step, values in slab
  // steps (elsewhere full capture's rows take the host cache's way).
  kv_events_ = kv_wanted && (summary_taps_ || slab_);
  uint8_t* mirror_base = nullptr;
  if (mirror_) {
    if (kv_events_ && !summary_taps_) {
      mirror_base = slab_buf_.as<uint8_t>() + slab_taps;
    } else {
      LS_RETURN_IF_ERROR(mirror_dev_.Ensure(mirror_bytes));
      mirror_base = mirror_dev_.as<uint8_t>();
    }
    if (!kv_events_ && mirror_host_.size() < mirror_bytes) {
      LS_ASSIGN_OR_RETURN(mirror_host_, cu::PinnedBuffer::Allocate(mirror_bytes * 3 / 2));
    }
    size_t idx = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      for (const StreamSpec& st : cache.streams(l)) {
        mirror_at[l][st.kind == StreamKind::kMlaLatent ? 0 : 1] = mirror_base + mirror_off[idx++];
      }
    }
  }
  auto slab_at = [&](int64_t l, int part) {  // l = −1: embed, num_hidden_layers: final_norm
    float* base = slab_buf_.as<float>();
    if (l < 0) return base;
    if (l >= c.num_hidden_layers) return base + ends_floats + c.num_hidden_layers * layer_floats;
    return base + ends_floats + l * layer_floats + part_off[part];
  };
  if (hook != nullptr && tap_arena_.buf.size() == 0) {
    LS_RETURN_IF_ERROR(tap_arena_.Ensure(size_t{64} << 20));
    LS_ASSIGN_OR_RETURN(tap_host_, cu::PinnedBuffer::Allocate(tap_arena_.buf.size()));
  }

  LS_RETURN_IF_ERROR(TakeLogitsBuffer(static_cast<size_t>(RL * V) * 4, hook != nullptr));
  LS_RETURN_IF_ERROR(logits_dev_.Ensure(static_cast<size_t>(RL * V) * 4));
  auto body = [&]() -> Status {
LS_RETURN_IF_ERROR(Mark("start"));
    // x = embed(tokens)
    if (slab_) x = slab_at(-1, 0);
    {
      cu::EmbedParams ep;
      ep.table = weights_->embed.f32();
      ep.vocab = V;
      ep.n = H;
      ep.ids = d_tok;
      ep.rows = R;
      ep.y = x;
      ep.y_stride = H;
      ep.error_flag = err;
      LS_RETURN_IF_ERROR(cu::Embed(ep, s));
    }
    LS_RETURN_IF_ERROR(Tap(kModelTaps[kTapEmbed].name, x, H, H, TapDType::kF32));
    LS_RETURN_IF_ERROR(SummaryFence());  // x is added to next
    LS_RETURN_IF_ERROR(OverrideRows(kModelTaps[kTapEmbed].name, x, H));
    LS_RETURN_IF_ERROR(Mark("embed"));
  
    auto norm_params = [&](const float* in, int64_t in_stride, const DevTensor& w, int64_t n, float eps, float* y,
                           int64_t y_stride) {
      cu::RmsNormParams p;
      p.x = in;
      p.x_stride = in_stride;
      p.weight = w.f32();
      p.y = y;
      p.y_stride = y_stride;
      p.rows = R;
      p.n = n;
      p.eps = eps;
      return p;
    };
    auto rmsnorm = [&](const float* in, int64_t in_stride, const DevTensor& w, int64_t n, float eps, float* y,
                       int64_t y_stride) { return cu::RmsNorm(norm_params(in, in_stride, w, n, eps, y, y_stride), s); };
    auto rope_params = [&](float* v, int64_t row_stride, int64_t heads_n, int64_t head_stride, cu::RopeStyle style) {
      cu::RopeParams p;
      p.x = v;
      p.row_stride = row_stride;
      p.head_stride = head_stride;
      p.rows = R;
      p.heads = heads_n;
      p.dim = dr;
      p.positions = d_pos;
      p.cos = rope_cos_.f32();
      p.sin = rope_sin_.f32();
      p.max_position = rope_positions_;
      p.style = style;
      p.error_flag = err;
      return p;
    };
    auto rope = [&](float* v, int64_t row_stride, int64_t heads_n, int64_t head_stride, cu::RopeStyle style) {
      return cu::Rope(rope_params(v, row_stride, heads_n, head_stride, style), s);
    };
    const float rms_eps = static_cast<float>(c.rms_norm_eps);
    LS_RETURN_IF_ERROR(mla_ws_.Ensure(256));
    // The residual adds carry the next RMSNorm (one kernel, Add's and RmsNorm's bits) unless
    // taps outside the slab need each buffer summarised or copied before the next write.
    const bool fuse_norms = hook == nullptr || slab_;
    bool h_ready = false;  // h already holds this layer's input norm (from the last residual add)
    // Independent branches on two streams (see side_), where taps need no copies or fences
    // in stream order. The side stream's GEMMs have their own scratch and workspace; not for
    // cuBLAS fp32, whose objects may each fall back from PEDANTIC on their own.
    const bool overlap = use_side_ && (dot_ || bf16_) && (hook == nullptr || slab_);
    if (dot_) LS_RETURN_IF_ERROR(EnsureZeroIds(R));  // before any branch reads it
    const cu::Stream main_stream = s;
    // Runs fn's launches on the side stream after what `s` has queued; join_ marks their end.
    auto on_side = [&](auto&& fn) -> Status {
      LS_RETURN_IF_ERROR(fork_->Record(main_stream));
      LS_RETURN_IF_ERROR(fork_->WaitOn(side_->get()));
      s = launch_ = side_->get();
      const Status st = fn();
      s = launch_ = main_stream;
      LS_RETURN_IF_ERROR(st);
      return join_->Record(side_->get());
    };
    auto add_norm = [&](float* sum, const float* a, const float* b, const DevTensor& w, float* y) {
      cu::RmsNormParams p = norm_params(a, H, w, H, rms_eps, y, H);
      p.add = b;
      p.add_stride = H;
      p.sum = sum;
      p.sum_stride = H;
      return cu::RmsNorm(p, s);
    };
  
    // What gemm=w8a8_dot's linear layers read of x [R, n]: x through FP8 per 128 values, in
    // `buf` (the tapped tensor stays as it is); x itself under every other variant.
    auto linear_in = [&](const float* x_in, int64_t n, float* buf) -> Result<const float*> {
      if (!w8a8_) return x_in;
      LS_RETURN_IF_ERROR(cu::Fp8RoundTrip(x_in, n, buf, n, R, n, s));
      return static_cast<const float*>(buf);
    };

    // Route's parameters for layer D's routing of the R rows' logits (rlog) into ids / weights.
    auto route_params = [&](const DevLayer& D, int32_t* ids_out, float* wts_out) {
      cu::RouteParams rp;
      rp.logits = rlog;
      rp.logits_stride = E;
      rp.bias = D.router_bias.empty() ? nullptr : D.router_bias.f32();
      rp.rows = R;
      rp.experts = E;
      rp.k = k;
      // Groups matter only with more than one (the CPU ignores n_group ≤ 1, e.g. V2's null).
      const bool grouped = c.gate != GateKind::kSoftmaxGreedy && c.n_group > 1;
      rp.n_group = grouped ? c.n_group : 1;
      rp.topk_group = grouped ? c.topk_group : 1;
      rp.gate = ToGateKind(c.gate);
      rp.norm_topk_prob = c.norm_topk_prob;
      rp.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
      rp.ids = ids_out;
      rp.weights = wts_out;
      return rp;
    };

    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const DevLayer& D = weights_->layers[l];
      auto tn = [&](TapId t) -> const std::string& { return model_->tap_name(l, t); };
      if (slab_) {  // this layer's tapped tensors in their slab places
        h = slab_at(l, kSAttnNorm);
        q = slab_at(l, kSQ);
        latent = slab_at(l, kSLatent);
        kv = slab_at(l, kSKv);
        topk_pos = reinterpret_cast<int32_t*>(slab_at(l, kSTopk));
        heads = slab_at(l, kSHeads);
        o = slab_at(l, kSAttnOut);
      }
  
      if (!h_ready) LS_RETURN_IF_ERROR(rmsnorm(x, H, D.input_norm, H, rms_eps, h, H));
      h_ready = false;
      LS_RETURN_IF_ERROR(Tap(tn(kTapAttnNorm), h, H, H, TapDType::kF32));
      LS_ASSIGN_OR_RETURN(const float* hl, linear_in(h, H, hq));  // q's, kv_a's and the indexer's wk input
      LS_RETURN_IF_ERROR(Mark("rmsnorm"));
  
      const cu::RopeStyle style = ToRopeStyle(c.rope_style);
      // The latent-cache path: [c_kv | k_rope] = kv_a(h); latent = RMSNorm(c_kv); RoPE on
      // k_rope in place; then appended to the device cache in its format (attention reads what
      // was stored). Independent of q's path until attention: with `overlap` it runs on the
      // side stream while q's runs here.
      auto kv_path = [&]() -> Status {
        LS_RETURN_IF_ERROR(Linear(hl, H, R, D.kv_a_proj, kv, C + dr));
        if (!overlap) LS_RETURN_IF_ERROR(Mark("kv_a_proj"));
        // latent = RMSNorm(c_kv), RoPE on k_rope, both into the cache: one kernel
        // (WriteLatentPath: the three ops' bits, a CTA a row).
        cu::LatentWriteParams wp;
        wp.latent = latent;
        wp.latent_stride = C;
        wp.rope = kv + C;
        wp.rope_stride = C + dr;
        wp.slots = d_slot;
        wp.cache = latent_pool_[l].as<uint8_t>();
        wp.num_slots = num_pages_ * page_size_;
        wp.rows = R;
        wp.kv_lora = C;
        wp.rope_dim = dr;
        wp.format = format_;
        wp.error_flag = err;
        wp.copy = mirror_at[l][0];
        LS_RETURN_IF_ERROR(cu::WriteLatentPath(norm_params(kv, C + dr, D.kv_a_norm, C, 1e-6f, latent, C),
                                               rope_params(kv + C, C + dr, 1, dr, style), wp, s));
        if (!overlap) LS_RETURN_IF_ERROR(Mark("norm_rope_write"));
        return Status::Ok();
      };
      if (overlap) LS_RETURN_IF_ERROR(on_side(kv_path));
      // q = q_b(RMSNorm(q_a(h))) or q_proj(h); RoPE on its rope part.
      const float* qrl = qr;  // what q_b and the indexer's wq_b read of qr
      if (c.q_lora_rank > 0) {
        LS_RETURN_IF_ERROR(Linear(hl, H, R, D.q_a_proj, qa, c.q_lora_rank));
        LS_RETURN_IF_ERROR(rmsnorm(qa, c.q_lora_rank, D.q_a_norm, c.q_lora_rank, 1e-6f, qr, c.q_lora_rank));
        LS_ASSIGN_OR_RETURN(qrl, linear_in(qr, c.q_lora_rank, qrq));
        LS_RETURN_IF_ERROR(Linear(qrl, c.q_lora_rank, R, D.q_b_proj, q, nh * dqk));
      } else {
        LS_RETURN_IF_ERROR(Linear(hl, H, R, D.q_proj, q, nh * dqk));
      }
      LS_RETURN_IF_ERROR(rope(q + dn, nh * dqk, nh, dqk, style));
      LS_RETURN_IF_ERROR(Mark("q_proj"));
      if (!overlap) LS_RETURN_IF_ERROR(kv_path());
      LS_RETURN_IF_ERROR(Tap(tn(kTapQ), q, nh * dqk, nh * dqk, TapDType::kF32));
      LS_RETURN_IF_ERROR(Tap(tn(kTapLatent), latent, C, C, TapDType::kF32));
      LS_RETURN_IF_ERROR(Tap(tn(kTapKRope), kv + C, dr, C + dr, TapDType::kF32));
  
      // V3.2 indexer: scores over every causal key, exact top-k → the keys sparse attention reads.
      const bool sparse = c.layers[l].attention == AttentionKind::kMlaSparse;
      if (sparse) {
        LS_RETURN_IF_ERROR(Linear(qrl, c.q_lora_rank, R, D.iq_b, iq, nhi * di));
        LS_RETURN_IF_ERROR(Linear(hl, H, R, D.ik, ik, di));
        cu::LayerNormParams lp;
        lp.x = ik;
        lp.x_stride = di;
        lp.weight = D.ik_norm_w.f32();
        lp.bias = D.ik_norm_b.f32();
        lp.y = ikn;
        lp.y_stride = di;
        lp.rows = R;
        lp.n = di;
        lp.eps = 1e-6;
        LS_RETURN_IF_ERROR(cu::LayerNorm(lp, s));
        LS_RETURN_IF_ERROR(Linear(h, H, R, D.iw_proj, iw, nhi));
        LS_RETURN_IF_ERROR(rope(iq, nhi * di, nhi, di, cu::RopeStyle::kHalves));
        LS_RETURN_IF_ERROR(rope(ikn, di, 1, di, cu::RopeStyle::kHalves));
        if (indexer_hadamard) {
          LS_RETURN_IF_ERROR(cu::Hadamard(iq, di, R * nhi, di, s));
          LS_RETURN_IF_ERROR(cu::Hadamard(ikn, di, R, di, s));
        }
        if (indexer_fp8) {  // each head's query as an FP8 row (the cache's key layout), row r·nhi + h
          LS_RETURN_IF_ERROR(iq8_.Ensure(static_cast<size_t>(R * nhi * Fp8RowBytes(di))));
          cu::LatentWriteParams qw;
          qw.latent = iq;
          qw.latent_stride = di;
          qw.rope = iq;  // rope_dim 0: never read
          qw.cache = iq8_.as<uint8_t>();
          qw.num_slots = R * nhi;
          qw.rows = R * nhi;
          qw.kv_lora = di;
          qw.format = cu::LatentFormat::kFp8E4m3;
          LS_RETURN_IF_ERROR(cu::WriteLatent(qw, s));
        }
        LS_RETURN_IF_ERROR(cu::Scale(iw, nhi, R, nhi, 1.0f / std::sqrt(static_cast<float>(nhi)), s));
        if (indexer_fp8) {  // quantised on write: the latent's FP8 layout without a rope part
          cu::LatentWriteParams kw;
          kw.latent = ikn;
          kw.latent_stride = di;
          kw.rope = ikn;  // rope_dim 0: never read
          kw.slots = d_slot;
          kw.cache = index_pool_[l].as<uint8_t>();
          kw.num_slots = num_pages_ * page_size_;
          kw.rows = R;
          kw.kv_lora = di;
          kw.format = cu::LatentFormat::kFp8E4m3;
          kw.error_flag = err;
          kw.copy = mirror_at[l][1];
          LS_RETURN_IF_ERROR(cu::WriteLatent(kw, s));
        } else {
          cu::ScatterRowsParams sp;
          sp.src = ikn;
          sp.src_stride = di * 4;
          sp.slots = d_slot;
          sp.n = R;
          sp.dst = index_pool_[l].data();
          sp.dst_rows = num_pages_ * page_size_;
          sp.dst_stride = di * 4;
          sp.row_bytes = di * 4;
          sp.error_flag = err;
          sp.copy = mirror_at[l][1];
          LS_RETURN_IF_ERROR(cu::ScatterRows(sp, s));
        }
  
        LS_RETURN_IF_ERROR(scores_.Ensure(static_cast<size_t>(R * max_len) * 4));
        cu::IndexerScoreParams ip;
        ip.batch = R;
        ip.heads = nhi;
        ip.head_dim = di;
        ip.q = iq;
        ip.q_batch_stride = nhi * di;
        ip.q_head_stride = di;
        ip.weights = iw;
        ip.weights_stride = nhi;
        ip.key_scale = 1.0f / std::sqrt(static_cast<float>(di));
        if (indexer_fp8) {
          ip.q_fp8 = iq8_.as<uint8_t>();
          ip.keys_fp8 = index_pool_[l].as<uint8_t>();
        } else {
          ip.keys = index_pool_[l].as<float>();
        }
        ip.num_pages = num_pages_;
        ip.page_size = page_size_;
        ip.page_table = d_table;
        ip.page_table_stride = P;
        ip.seq_lens = d_len;
        ip.max_seq_len = max_len;
        ip.scores = scores_.as<float>();
        ip.scores_stride = max_len;
        ip.error_flag = err;
        LS_RETURN_IF_ERROR(cu::IndexerScores(ip, s));
        cu::TopKParams tp;
        tp.batch = R;
        tp.topk = topk;
        tp.scores = scores_.as<float>();
        tp.scores_stride = max_len;
        tp.seq_lens = d_len;
        tp.max_seq_len = max_len;
        tp.positions = topk_pos;
        tp.slots = topk_slot;
        tp.page_table = d_table;
        tp.page_table_stride = P;
        tp.page_size = page_size_;
        tp.num_pages = num_pages_;
        tp.error_flag = err;
        LS_RETURN_IF_ERROR(cu::TopK(tp, s));
        LS_RETURN_IF_ERROR(Tap(tn(kTapIndexerTopk), topk_pos, topk, topk, TapDType::kI32));
        LS_RETURN_IF_ERROR(Mark("indexer"));
      }
  
      // Absorbed attention for every row: q_lat_h = W_UK_hᵀ q_nope_h; attend over the latent;
      // heads_h = W_UV_h o_lat_h.
      // Per head as a grouped GEMV (heads = "experts", one slot per head): a fixed reduction
      // order per output element whatever the number of rows (ExpertGemm is cpu::MatMulNT's).
      cu::ExpertGemmParams ab;
      ab.rows = R;
      ab.k = nh;
      ab.experts = nh;
      ab.out = C;
      ab.in = dn;
      D.w_ukt.Bind(&ab, 0, C);
      ab.x = q;  // slot (r, h) reads q[r, h, 0:dn]: row (r·nh + h) at stride dqk
      ab.x_stride = dqk;
      ab.x_per_slot = true;
      ab.round_x_bf16 = bf16_;
      ab.ids = d_heads;  // copied in with the step's inputs: no kernel writes them
      ab.ids_fixed = true;
      ab.y = qlat;
      ab.y_stride = C;
      ab.error_flag = err;
      LS_RETURN_IF_ERROR(cu::ExpertGemm(ab, s));
      LS_RETURN_IF_ERROR(Mark("absorb_q"));
      // At one row the absorption of W_UV takes the attention's split results and merges them
      // itself (ExpertGemmParams::x_partials: MlaDecode's combine, the same bits, one launch and
      // one wait fewer on the chain; kCombineInUvMaxRows).
      const bool combine_in_uv = dot_ && R <= kCombineInUvMaxRows && (D.kv_b.bf16 || D.kv_b.fp8);
      if (overlap) {
        LS_RETURN_IF_ERROR(join_->WaitOn(s));  // the cache holds this step's latents
        LS_RETURN_IF_ERROR(Mark("kv_path_wait"));
      }
      {
        cu::MlaDecodeParams mp;
        mp.batch = R;
        mp.heads = nh;
        mp.kv_lora = C;
        mp.rope_dim = dr;
        mp.format = format_;
        mp.softmax_scale = scale;
        mp.q_latent = qlat;
        mp.q_latent_batch_stride = nh * C;
        mp.q_latent_head_stride = C;
        mp.q_rope = q + dn;
        mp.q_rope_batch_stride = nh * dqk;
        mp.q_rope_head_stride = dqk;
        mp.cache = latent_pool_[l].as<uint8_t>();
        mp.num_pages = num_pages_;
        mp.page_size = page_size_;
        mp.o_latent = olat;
        mp.o_batch_stride = nh * C;
        mp.o_head_stride = C;
        mp.error_flag = err;
        if (sparse) {
          mp.indices = topk_slot;
          mp.indices_stride = topk;
          mp.topk = topk;
        } else {
          mp.page_table = d_table;
          mp.page_table_stride = P;
          mp.seq_lens = d_len;
          mp.max_seq_len = max_len;
        }
        const size_t need = cu::MlaDecodeWorkspaceBytes(mp);
        LS_RETURN_IF_ERROR(mla_ws_.Ensure(std::max<size_t>(need, 256)));
        mp.workspace = mla_ws_.buf.data();
        mp.workspace_bytes = mla_ws_.buf.size();
        if (combine_in_uv) {  // the splits only: W_UV's absorption below merges them
          LS_RETURN_IF_ERROR(sparse ? cu::MlaSparseDecodeSplits(mp, &ab.x_partials, s)
                                    : cu::MlaDecodeSplits(mp, &ab.x_partials, s));
        } else {
          LS_RETURN_IF_ERROR(sparse ? cu::MlaSparseDecode(mp, s) : cu::MlaDecode(mp, s));
        }
        LS_RETURN_IF_ERROR(Mark("mla_decode"));
      }
      // heads_h = W_UV_h o_lat_h: W_UV_h is rows [h·(dn+dv) + dn, +dv) of kv_b_proj.
      ab.out = dv;
      ab.in = C;
      D.kv_b.Bind(&ab, dn, dn + dv);
      ab.x = combine_in_uv ? nullptr : olat;  // (x_partials set above when combine_in_uv)
      ab.x_stride = C;
      ab.y = heads;
      ab.y_stride = dv;
      LS_RETURN_IF_ERROR(cu::ExpertGemm(ab, s));
      LS_RETURN_IF_ERROR(Mark("absorb_v"));
      LS_RETURN_IF_ERROR(Tap(tn(kTapHeads), heads, nh * dv, nh * dv, TapDType::kF32));
  
      // x = x + o_proj(heads)
      {
        LS_ASSIGN_OR_RETURN(const float* headsl, linear_in(heads, nh * dv, headsq));
        LS_RETURN_IF_ERROR(Linear(headsl, nh * dv, R, D.o_proj, o, H));
      }
      LS_RETURN_IF_ERROR(Mark("o_proj"));
      LS_RETURN_IF_ERROR(Tap(tn(kTapAttnOut), o, H, H, TapDType::kF32));
      // An MoE layer whose router fits NormRoute takes the residual add, the FFN's norm, the
      // router logits and the routing in that one launch (the same bits as add_norm, RowDots
      // and Route).
      const bool routed = fuse_norms && c.layers[l].ffn != FfnKind::kDense && cu::NormRouteFits(E, H, R) &&
                          reinterpret_cast<uintptr_t>(D.router.f32()) % 16 == 0;
      {
        float* x_mid = slab_ ? slab_at(l, kSResidMid) : x;
        float* h_ffn = slab_ ? slab_at(l, kSFfnNorm) : h;
        if (routed) {
          cu::NormRouteParams nr;
          nr.norm = norm_params(x, H, D.post_attn_norm, H, rms_eps, h_ffn, H);
          nr.norm.add = o;
          nr.norm.add_stride = H;
          nr.norm.sum = x_mid;
          nr.norm.sum_stride = H;
          nr.router = D.router.f32();
          nr.router_stride = H;
          nr.logits = rlog;
          nr.logits_stride = E;
          nr.route = route_params(D, slab_ ? reinterpret_cast<int32_t*>(slab_at(l, kSIds)) : ids,
                                  slab_ ? slab_at(l, kSWts) : wts);
          LS_RETURN_IF_ERROR(cu::NormRoute(nr, s));
          LS_RETURN_IF_ERROR(Mark("norm_route"));
        } else if (fuse_norms) {  // x + o and the FFN's norm of it (h: the attention's inputs are done)
          LS_RETURN_IF_ERROR(add_norm(x_mid, x, o, D.post_attn_norm, h_ffn));
        } else {
          LS_RETURN_IF_ERROR(cu::Add(x_mid, H, x, H, o, H, R, H, s));
        }
        x = x_mid;
      }
      LS_RETURN_IF_ERROR(Tap(tn(kTapResidMid), x, H, H, TapDType::kF32));
      LS_RETURN_IF_ERROR(SummaryFence());  // h, o and x are written next
  
      // FFN on RMSNorm(x).
      if (slab_) {
        h = slab_at(l, kSFfnNorm);
        ids = reinterpret_cast<int32_t*>(slab_at(l, kSIds));
        wts = slab_at(l, kSWts);
        o = slab_at(l, kSFfnOut);
      }
      if (!fuse_norms) LS_RETURN_IF_ERROR(rmsnorm(x, H, D.post_attn_norm, H, rms_eps, h, H));
      LS_RETURN_IF_ERROR(Tap(tn(kTapFfnNorm), h, H, H, TapDType::kF32));
      // The experts' and MLP's input (hq is free again: the attention's products are done).
      LS_ASSIGN_OR_RETURN(const float* hfl, linear_in(h, H, hq));
      // Where the layer's residual sum and the next norm go (the last layer's: the final norm).
      float* x_out = slab_ ? slab_at(l, kSResidOut) : x;
      const bool last = l + 1 == c.num_hidden_layers;
      float* h_next = !slab_ ? h : last ? slab_at(c.num_hidden_layers, 0) : slab_at(l + 1, kSAttnNorm);
      const DevTensor& next_norm = last ? weights_->final_norm : weights_->layers[l + 1].input_norm;
      bool combined_norm = false;  // the MoE combine did the residual add and the next norm
      if (c.layers[l].ffn == FfnKind::kDense) {
        LS_RETURN_IF_ERROR(SwiGluMlp(D.mlp_gate_up, D.mlp_down, D.mlp_inter, hfl, R, o));
        LS_RETURN_IF_ERROR(Mark("dense_mlp"));
      } else {
        // The shared experts read only h: with `overlap` they run on the side stream beside
        // the router and the routed experts.
        const bool shared_side = overlap && c.n_shared_experts > 0;
        if (shared_side) {
          LS_RETURN_IF_ERROR(
              on_side([&] { return SwiGluMlp(D.shared_gate_up, D.shared_down, D.shared_inter, hfl, R, sh); }));
        }
        // Router logits: fp32 weights (the router is never rounded), cpu::Dot's order (RowDots)
        // — the CPU's exact bits, so the experts chosen are the CPU's whenever the inputs are;
        // the routing on the device.
        if (!routed) {  // (NormRoute did both above otherwise)
          cu::RowDotsParams rg;
          rg.x = h;
          rg.x_stride = H;
          rg.w = D.router.f32();
          rg.w_stride = H;
          rg.y = rlog;
          rg.y_stride = E;
          rg.rows = R;
          rg.outs = E;
          rg.n = H;
          rg.w_fixed = true;
          LS_RETURN_IF_ERROR(cu::RowDots(rg, s));
          LS_RETURN_IF_ERROR(Mark("router_logits"));
          LS_RETURN_IF_ERROR(cu::Route(route_params(D, ids, wts), s));
          LS_RETURN_IF_ERROR(Mark("router"));
        }
        LS_RETURN_IF_ERROR(Tap(tn(kTapTopkIds), ids, k, k, TapDType::kI32));
        LS_RETURN_IF_ERROR(Tap(tn(kTapTopkWeights), wts, k, k, TapDType::kF32));
        // Each (row, slot) through its expert: gate_up, SwiGLU, down; combined in slot order.
        const int64_t I = D.moe_inter;
        cu::ExpertGemmParams ge;
        ge.rows = R;
        ge.k = k;
        ge.experts = E;
        ge.out = 2 * I;
        ge.in = H;
        D.experts_gate_up.Bind(&ge, 0, 2 * I);
        ge.x = hfl;
        ge.x_stride = H;
        ge.x_per_slot = false;
        ge.round_x_bf16 = bf16_;
        ge.ids = ids;
        ge.y = gu;
        ge.y_stride = 2 * I;
        ge.error_flag = err;
        // gemm=bf16 (cuBLAS's bf16 GEMMs for the dense products): the routed experts on tensor
        // cores too — their own fixed order, batch-invariant; bf16_dot keeps cpu::Dot's.
        const bool experts_tc = !dot_ && bf16_;
        ge.tensor_cores = experts_tc && cu::ExpertGemmTcFits(ge);
        LS_RETURN_IF_ERROR(cu::ExpertGemm(ge, s));
        LS_RETURN_IF_ERROR(Mark("experts_gate_up"));
        cu::SwiGluParams sp;
        sp.g = gu;
        sp.g_stride = 2 * I;
        sp.u = gu + I;
        sp.u_stride = 2 * I;
        sp.out = act;
        sp.out_stride = I;
        sp.rows = R * k;
        sp.n = I;
        LS_RETURN_IF_ERROR(cu::SwiGlu(sp, s));
        if (w8a8_) LS_RETURN_IF_ERROR(cu::Fp8RoundTrip(act, I, act, I, R * k, I, s));  // the down's input
        ge.out = H;
        ge.in = I;
        D.experts_down.Bind(&ge, 0, H);
        ge.x = act;
        ge.x_stride = I;
        ge.x_per_slot = true;
        ge.y = ey;
        ge.y_stride = H;
        ge.tensor_cores = experts_tc && cu::ExpertGemmTcFits(ge);
        LS_RETURN_IF_ERROR(cu::ExpertGemm(ge, s));
        LS_RETURN_IF_ERROR(Mark("experts_down"));
        if (shared_side) {
          LS_RETURN_IF_ERROR(join_->WaitOn(s));
          LS_RETURN_IF_ERROR(Mark("shared_experts_wait"));
        } else if (c.n_shared_experts > 0) {
          LS_RETURN_IF_ERROR(SwiGluMlp(D.shared_gate_up, D.shared_down, D.shared_inter, hfl, R, sh));
          LS_RETURN_IF_ERROR(Mark("shared_experts"));
        }
        cu::MoeCombineParams mc;
        mc.y = ey;
        mc.y_stride = H;
        mc.weights = wts;
        mc.shared = c.n_shared_experts > 0 ? sh : nullptr;
        mc.shared_stride = H;
        mc.out = o;
        mc.out_stride = H;
        mc.rows = R;
        mc.k = k;
        mc.n = H;
        if (fuse_norms && cu::MoeCombineNormFits(H, R)) {
          // The combine, x + o and the next layer's input norm (or the final norm) in one launch.
          cu::MoeCombineNormParams cn;
          cn.combine = mc;
          cn.x = x;
          cn.x_stride = H;
          cn.sum = x_out;
          cn.sum_stride = H;
          cn.weight = next_norm.f32();
          cn.eps = rms_eps;
          cn.y = h_next;
          cn.y_stride = H;
          LS_RETURN_IF_ERROR(cu::MoeCombineNorm(cn, s));
          combined_norm = true;
        } else {
          LS_RETURN_IF_ERROR(cu::MoeCombine(mc, s));
        }
        LS_RETURN_IF_ERROR(Mark("combine"));
      }
      LS_RETURN_IF_ERROR(Tap(tn(kTapFfnOut), o, H, H, TapDType::kF32));
      {
        if (combined_norm) {
          h_ready = true;
        } else if (fuse_norms) {  // x + o and the next layer's input norm (or the final norm)
          LS_RETURN_IF_ERROR(add_norm(x_out, x, o, next_norm, h_next));
          h_ready = true;
        } else {
          LS_RETURN_IF_ERROR(cu::Add(x_out, H, x, H, o, H, R, H, s));
        }
        x = x_out;
      }
      LS_RETURN_IF_ERROR(Tap(tn(kTapResidOut), x, H, H, TapDType::kF32));
      LS_RETURN_IF_ERROR(SummaryFence());  // the next layer writes every buffer again
      LS_RETURN_IF_ERROR(OverrideRows(tn(kTapResidOut), x, H));
    }
  
    // Final norm; logits for the rows that need them, gathered first so lm_head is read once.
    if (slab_) h = slab_at(c.num_hidden_layers, 0);
    if (!h_ready) LS_RETURN_IF_ERROR(rmsnorm(x, H, weights_->final_norm, H, rms_eps, h, H));
    LS_RETURN_IF_ERROR(Tap(kModelTaps[kTapFinalNorm].name, h, H, H, TapDType::kF32));
    if (kv_events_) LS_RETURN_IF_ERROR(TapKvRows(cache, mirror_base, mirror_off));
    LS_RETURN_IF_ERROR(SummaryFence());
    // The step's tail besides the logits: the slab's tap summaries. They read what the layers
    // wrote and nothing lm_head writes, so with `overlap` they run on the side stream while
    // lm_head (the step's largest read) runs here. (The new cache rows for the host were
    // copied as they were written.)
    auto tail = [&]() -> Status {
      if (slab_) LS_RETURN_IF_ERROR(SummarizeSlab());  // (full capture: beside the values)
      return Status::Ok();
    };
    const bool tail_side = overlap && slab_;
    if (tail_side) LS_RETURN_IF_ERROR(on_side(tail));
    LS_RETURN_IF_ERROR(Mark("final_norm_taps"));
    {
      cu::GatherRowsParams gp;
      gp.src = h;
      gp.src_rows = R;
      gp.src_stride = H * 4;
      gp.rows = d_lrow;
      gp.n = RL;
      gp.dst = o_shared;  // R ≥ RL rows
      gp.dst_stride = H * 4;
      gp.row_bytes = H * 4;
      gp.error_flag = err;
      LS_RETURN_IF_ERROR(cu::GatherRows(gp, s));
    }
    LS_RETURN_IF_ERROR(Linear(o_shared, H, RL, weights_->lm_head, logits_dev_.as<float>(), V));
    LS_RETURN_IF_ERROR(Mark("lm_head"));
    if (tail_side) {
      LS_RETURN_IF_ERROR(join_->WaitOn(s));
    } else {
      LS_RETURN_IF_ERROR(tail());
    }
    LS_RETURN_IF_ERROR(Mark("tap_summaries"));
    return Status::Ok();
  };
  if (!graph) {
    LS_RETURN_IF_ERROR(body());
  } else {
    // With taps the graph has the arena copies, or the summary launches (with the KV rows').
    const int64_t key = 8 * R + (hook != nullptr ? 1 : 0) + (summary_taps_ ? 2 : 0) + (kv_events_ ? 4 : 0);
    StepGraph& sg = graphs_[key];
    auto warm = warmed_.find(key);
    if (sg.graph && sg.generation == alloc_generation_) {
      LS_RETURN_IF_ERROR(sg.graph->Launch(s));
      ++graph_launches_;
      if (prof_) prof_->SetUsed(sg.marks);
      pending_ = sg.pending;
      tap_used_ = sg.tap_used;
    } else if (!sg.failed && warm != warmed_.end() && warm->second == alloc_generation_) {
      LS_RETURN_IF_ERROR(cu::CudaGraph::BeginCapture(s));
      capturing_ = true;
      const Status st = body();
      capturing_ = false;
      auto captured = cu::CudaGraph::EndCapture(s);
      if (st.ok() && captured.ok() && alloc_generation_ == warm->second) {
        sg.graph = std::move(*captured);
        sg.generation = alloc_generation_;
        if (prof_) sg.marks = prof_->used();
        sg.pending = pending_;
        sg.tap_used = tap_used_;
        LS_RETURN_IF_ERROR(sg.graph->Launch(s));
      } else {
        // Something in the step cannot be captured: run it plainly from now on.
        sg.failed = true;
        sg.graph.reset();
        cu::ClearLastError();
        pending_.clear();
        tap_used_ = 0;
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
          LS_RETURN_IF_ERROR(cu::CopyAsync(logits_host_->as<char>() + off, logits_dev_.as<char>() + off,
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

  if (mirror_ && !kv_events_) {
    LS_RETURN_IF_ERROR(cu::CopyAsync(mirror_host_.data(), mirror_dev_.buf.data(), mirror_bytes, s));
  }

  // One synchronisation: taps, logits, cache rows and the kernels' error flag.
  // (Into pinned memory: a copy into pageable memory would hold the host until the step ends.)
  if (flag_host_.size() < 4) {
    LS_ASSIGN_OR_RETURN(flag_host_, cu::PinnedBuffer::Allocate(256));
  }
  LS_RETURN_IF_ERROR(cu::CopyAsync(flag_host_.data(), err, 4, s));
  LS_RETURN_IF_ERROR(FlushTaps());
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
  if (mirror_ && !kv_events_) {
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
  const float* lg = logits_host_->as<float>();
  int64_t lr = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(segs[i].tokens.size());
    const int64_t first = segs[i].all_logits ? 0 : n - 1;
    const int64_t rows = n - first;
    if (copied[i]) out->logits[i].assign(lg + lr * V, lg + (lr + rows) * V);
    lr += rows;
    if (hook != nullptr) {
      TapEvent e;
      e.name = kModelTaps[kTapLogits].name;
      e.request_id = segs[i].request_id;
      e.position = segs[i].start_pos + first;
      e.rows = rows;
      e.cols = V;
      e.data = lg + (lr - rows) * V;  // the pinned copy: with an owner, a hook may keep it
      e.owner = logits_owner_;
      hook->OnTap(e);
    }
  }
  LS_RETURN_IF_ERROR(CollectSamples(segs, out));
  for (auto& g : segs) g.cache->length = g.start_pos + static_cast<int64_t>(g.tokens.size());
  hook_ = nullptr;
  logits_owner_.reset();  // the hook's copies, if any, keep the buffer
  segs_ = {};
  return Status::Ok();
}

}  // namespace lockstep::engine::cuda_impl
