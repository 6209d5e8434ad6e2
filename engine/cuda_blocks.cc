// engine/cuda_blocks.cc — the CUDA forward pass's blocks, in step order: a loop over the layers'
// specs (ModelConfig::layers) calling them (StepBody). Each block launches on st.s the kernels
// of kernels/cuda whose bits are its CPU twin's (engine/mla_model.cc), taps what it made, and
// leaves its outputs in the step's buffers (engine/cuda_step.h).
#include <algorithm>
#include <cmath>
#include <string>

#include "engine/cuda_step.h"

namespace lockstep::engine::cuda_impl {
namespace {

// Rows (requests) up to which W_UV's absorption merges MLA decode's splits itself (the
// `combine_in_uv` of AttendBlock). Its bulk-copy shape merges a head's splits again in each of
// the head's CTAs: one launch fewer on the chain at one row (H200, V2-Lite batch 1, +4.6 %,
// 2026-11-30); at more rows the absorption takes other shapes.
constexpr int64_t kCombineInUvMaxRows = 1;

}  // namespace

Status CudaBackend::OnSide(CudaStep& st, const std::function<Status()>& fn) {
  LS_RETURN_IF_ERROR(fork_->Record(st.main_stream));
  LS_RETURN_IF_ERROR(fork_->WaitOn(side_->get()));
  st.s = launch_ = side_->get();
  const Status status = fn();
  st.s = launch_ = st.main_stream;
  LS_RETURN_IF_ERROR(status);
  return join_->Record(side_->get());
}

Status CudaBackend::StepBody(CudaStep& st) {
  const ModelConfig& c = st.c;
  LS_RETURN_IF_ERROR(Mark("start"));
  LS_RETURN_IF_ERROR(EmbedBlock(st));
  LS_RETURN_IF_ERROR(mla_ws_.Ensure(256));
  if (dot_) LS_RETURN_IF_ERROR(EnsureZeroIds(st.R));  // before any branch reads it
  st.h_ready = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    // x = x + Attention(RMSNorm(x))
    LS_RETURN_IF_ERROR(QueryAndKeyBlock(st, l));
    if (c.layers[l].attention == AttentionKind::kMlaSparse) LS_RETURN_IF_ERROR(IndexerBlock(st, l));
    LS_RETURN_IF_ERROR(AttendBlock(st, l));
    LS_RETURN_IF_ERROR(OutProjBlock(st, l));
    // x = x + FFN(RMSNorm(x))
    LS_RETURN_IF_ERROR(FfnBlock(st, l));
  }
  return HeadBlock(st);
}

// x = embed(tokens)                                              [R, H]
Status CudaBackend::EmbedBlock(CudaStep& st) {
  const int64_t H = st.H;
  if (taps_.slab()) st.x = st.SlabAt(-1, 0);
  cu::EmbedParams ep;
  ep.table = weights_->embed.f32();
  ep.vocab = st.V;
  ep.n = H;
  ep.ids = st.d_tok;
  ep.rows = st.R;
  ep.y = st.x;
  ep.y_stride = H;
  ep.error_flag = st.err;
  LS_RETURN_IF_ERROR(cu::Embed(ep, st.s));
  LS_RETURN_IF_ERROR(taps_.Tap(kModelTaps[kTapEmbed].name, st.x, H, H, TapDType::kF32));
  LS_RETURN_IF_ERROR(taps_.SummaryFence());  // x is added to next
  LS_RETURN_IF_ERROR(taps_.Override(kModelTaps[kTapEmbed].name, st.x, H));
  return Mark("embed");
}

// h = RMSNorm(x)                                                  [R, H]
// q = q_b(RMSNorm(q_a(h))) or q_proj(h), RoPE on its rope part     [R, nh, dn + dr]
// [c_kv | k_rope] = kv_a(h); latent = RMSNorm(c_kv); RoPE on k_rope; both into the cache.
Status CudaBackend::QueryAndKeyBlock(CudaStep& st, int64_t l) {
  const ModelConfig& c = st.c;
  const DevLayer& D = weights_->layers[l];
  const int64_t R = st.R, H = st.H, nh = st.nh, dn = st.dn, dr = st.dr, C = st.C, dqk = st.dqk;
  auto tn = [&](TapId t) -> const std::string& { return model_->tap_name(l, t); };
  if (taps_.slab()) {  // this layer's tapped tensors in their slab places
    st.h = st.SlabAt(l, CudaStep::kSAttnNorm);
    st.latent = st.SlabAt(l, CudaStep::kSLatent);
    st.kv = st.SlabAt(l, CudaStep::kSKv);
    st.topk_pos = reinterpret_cast<int32_t*>(st.SlabAt(l, CudaStep::kSTopk));
    st.o = st.SlabAt(l, CudaStep::kSAttnOut);
    if (!st.ranked()) {  // (a rank's heads stay in its buffers: TapHeads gathers the whole rows there)
      st.q = st.SlabAt(l, CudaStep::kSQ);
      st.heads = st.SlabAt(l, CudaStep::kSHeads);
    }
  }
  if (!st.h_ready) LS_RETURN_IF_ERROR(st.RmsNorm(st.x, H, D.input_norm, H, st.rms_eps, st.h, H));
  st.h_ready = false;
  LS_RETURN_IF_ERROR(taps_.Tap(tn(kTapAttnNorm), st.h, H, H, TapDType::kF32));
  LS_ASSIGN_OR_RETURN(st.h_lin, st.LinearIn(st.h, H, st.hq));  // q's, kv_a's and the indexer's wk input
  LS_RETURN_IF_ERROR(Mark("rmsnorm"));

  const cu::RopeStyle style = ToRopeStyle(c.rope_style);
  // The latent-cache path, independent of q's until attention: with `overlap` it runs on the
  // side stream while q's runs here. latent = RMSNorm(c_kv), RoPE on k_rope, both into the
  // cache in its format: one kernel (WriteLatentPath: the three ops' bits, a CTA a row).
  auto kv_path = [&]() -> Status {
    LS_RETURN_IF_ERROR(Linear(st.h_lin, H, R, D.kv_a_proj, st.kv, C + dr));
    if (!st.overlap) LS_RETURN_IF_ERROR(Mark("kv_a_proj"));
    cu::LatentWriteParams wp;
    wp.latent = st.latent;
    wp.latent_stride = C;
    wp.rope = st.kv + C;
    wp.rope_stride = C + dr;
    wp.slots = st.d_slot;
    wp.cache = latent_pool_[l].as<uint8_t>();
    wp.num_slots = num_pages_ * page_size_;
    wp.rows = R;
    wp.kv_lora = C;
    wp.rope_dim = dr;
    wp.format = format_;
    wp.error_flag = st.err;
    wp.copy = st.mirror_at[l][0];
    cu::RopeParams key_rope = st.RopeParams(st.kv + C, C + dr, 1, dr, style);
    key_rope.fault_pos_minus_1 = st.plan.hidden == kernels::HiddenFault::kCudaLatentRopePosMinus1;
    LS_RETURN_IF_ERROR(cu::WriteLatentPath(st.NormParams(st.kv, C + dr, D.kv_a_norm, C, 1e-6f, st.latent, C),
                                           key_rope, wp, st.s));
    if (!st.overlap) LS_RETURN_IF_ERROR(Mark("norm_rope_write"));
    return Status::Ok();
  };
  if (st.overlap) LS_RETURN_IF_ERROR(OnSide(st, kv_path));
  st.qr_lin = st.qr;  // what q_b and the indexer's wq_b read of qr
  if (c.q_lora_rank > 0) {
    LS_RETURN_IF_ERROR(Linear(st.h_lin, H, R, D.q_a_proj, st.qa, c.q_lora_rank));
    LS_RETURN_IF_ERROR(st.RmsNorm(st.qa, c.q_lora_rank, D.q_a_norm, c.q_lora_rank, 1e-6f, st.qr, c.q_lora_rank));
    LS_ASSIGN_OR_RETURN(st.qr_lin, st.LinearIn(st.qr, c.q_lora_rank, st.qrq));
    LS_RETURN_IF_ERROR(Linear(st.qr_lin, c.q_lora_rank, R, D.q_b_proj, st.q, nh * dqk));
  } else {
    LS_RETURN_IF_ERROR(Linear(st.h_lin, H, R, D.q_proj, st.q, nh * dqk));
  }
  LS_RETURN_IF_ERROR(st.Rope(st.q + dn, nh * dqk, nh, dqk, style));
  LS_RETURN_IF_ERROR(Mark("q_proj"));
  if (!st.overlap) LS_RETURN_IF_ERROR(kv_path());
  LS_RETURN_IF_ERROR(TapHeads(st, l, kTapQ, st.q, dqk));
  LS_RETURN_IF_ERROR(taps_.Tap(tn(kTapLatent), st.latent, C, C, TapDType::kF32));
  return taps_.Tap(tn(kTapKRope), st.kv + C, dr, C + dr, TapDType::kF32);
}

// V3.2 lightning indexer: scores over every causal key, exact top-k → the keys sparse
// attention reads (topk_pos: positions, topk_slot: cache slots)          [R, topk]
Status CudaBackend::IndexerBlock(CudaStep& st, int64_t l) {
  const ModelConfig& c = st.c;
  const DevLayer& D = weights_->layers[l];
  const int64_t R = st.R, H = st.H, nhi = st.nhi, di = st.di, topk = st.topk;
  const cu::Stream s = st.s;
  LS_RETURN_IF_ERROR(Linear(st.qr_lin, c.q_lora_rank, R, D.iq_b, st.iq, nhi * di));
  LS_RETURN_IF_ERROR(Linear(st.h_lin, H, R, D.ik, st.ik, di));
  cu::LayerNormParams lp;
  lp.x = st.ik;
  lp.x_stride = di;
  lp.weight = D.ik_norm_w.f32();
  lp.bias = D.ik_norm_b.f32();
  lp.y = st.ikn;
  lp.y_stride = di;
  lp.rows = R;
  lp.n = di;
  lp.eps = 1e-6;
  LS_RETURN_IF_ERROR(cu::LayerNorm(lp, s));
  LS_RETURN_IF_ERROR(Linear(st.h, H, R, D.iw_proj, st.iw, nhi));
  LS_RETURN_IF_ERROR(st.Rope(st.iq, nhi * di, nhi, di, cu::RopeStyle::kHalves));
  LS_RETURN_IF_ERROR(st.Rope(st.ikn, di, 1, di, cu::RopeStyle::kHalves));
  // --kernel indexer=hadamard: q and k rotated after RoPE, as engine/mla_model.cc does;
  // indexer=fp8_paged: rotated, then q through FP8 and back and k into the cache as FP8.
  if (st.indexer_hadamard) {
    LS_RETURN_IF_ERROR(cu::Hadamard(st.iq, di, R * nhi, di, s));
    LS_RETURN_IF_ERROR(cu::Hadamard(st.ikn, di, R, di, s));
  }
  if (st.indexer_fp8) {  // each head's query as an FP8 row (the cache's key layout), row r·nhi + h
    LS_RETURN_IF_ERROR(iq8_.Ensure(static_cast<size_t>(R * nhi * Fp8RowBytes(di))));
    cu::LatentWriteParams qw;
    qw.latent = st.iq;
    qw.latent_stride = di;
    qw.rope = st.iq;  // rope_dim 0: never read
    qw.cache = iq8_.as<uint8_t>();
    qw.num_slots = R * nhi;
    qw.rows = R * nhi;
    qw.kv_lora = di;
    qw.format = cu::LatentFormat::kFp8E4m3;
    LS_RETURN_IF_ERROR(cu::WriteLatent(qw, s));
  }
  LS_RETURN_IF_ERROR(cu::Scale(st.iw, nhi, R, nhi, 1.0f / std::sqrt(static_cast<float>(nhi)), s));
  if (st.indexer_fp8) {  // quantised on write: the latent's FP8 layout without a rope part
    cu::LatentWriteParams kw;
    kw.latent = st.ikn;
    kw.latent_stride = di;
    kw.rope = st.ikn;  // rope_dim 0: never read
    kw.slots = st.d_slot;
    kw.cache = index_pool_[l].as<uint8_t>();
    kw.num_slots = num_pages_ * page_size_;
    kw.rows = R;
    kw.kv_lora = di;
    kw.format = cu::LatentFormat::kFp8E4m3;
    kw.error_flag = st.err;
    kw.copy = st.mirror_at[l][1];
    LS_RETURN_IF_ERROR(cu::WriteLatent(kw, s));
  } else {
    cu::ScatterRowsParams sp;
    sp.src = st.ikn;
    sp.src_stride = di * 4;
    sp.slots = st.d_slot;
    sp.n = R;
    sp.dst = index_pool_[l].data();
    sp.dst_rows = num_pages_ * page_size_;
    sp.dst_stride = di * 4;
    sp.row_bytes = di * 4;
    sp.error_flag = st.err;
    sp.copy = st.mirror_at[l][1];
    LS_RETURN_IF_ERROR(cu::ScatterRows(sp, s));
  }

  LS_RETURN_IF_ERROR(scores_.Ensure(static_cast<size_t>(R * st.max_len) * 4));
  cu::IndexerScoreParams ip;
  ip.batch = R;
  ip.heads = nhi;
  ip.head_dim = di;
  ip.q = st.iq;
  ip.q_batch_stride = nhi * di;
  ip.q_head_stride = di;
  ip.weights = st.iw;
  ip.weights_stride = nhi;
  ip.key_scale = 1.0f / std::sqrt(static_cast<float>(di));
  if (st.indexer_fp8) {
    ip.q_fp8 = iq8_.as<uint8_t>();
    ip.keys_fp8 = index_pool_[l].as<uint8_t>();
  } else {
    ip.keys = index_pool_[l].as<float>();
  }
  ip.num_pages = num_pages_;
  ip.page_size = page_size_;
  ip.page_table = st.d_table;
  ip.page_table_stride = st.P;
  ip.seq_lens = st.d_len;
  ip.max_seq_len = st.max_len;
  ip.scores = scores_.as<float>();
  ip.scores_stride = st.max_len;
  ip.error_flag = st.err;
  LS_RETURN_IF_ERROR(cu::IndexerScores(ip, s));
  cu::TopKParams tp;
  tp.batch = R;
  tp.topk = topk;
  tp.scores = scores_.as<float>();
  tp.scores_stride = st.max_len;
  tp.seq_lens = st.d_len;
  tp.max_seq_len = st.max_len;
  tp.positions = st.topk_pos;
  tp.slots = st.topk_slot;
  tp.page_table = st.d_table;
  tp.page_table_stride = st.P;
  tp.page_size = page_size_;
  tp.num_pages = num_pages_;
  tp.error_flag = st.err;
  LS_RETURN_IF_ERROR(cu::TopK(tp, s));
  LS_RETURN_IF_ERROR(taps_.Tap(model_->tap_name(l, kTapIndexerTopk), st.topk_pos, topk, topk, TapDType::kI32));
  return Mark("indexer");
}

// Absorbed attention for every row: q_lat_h = W_UK_hᵀ q_nope_h [R, nh, C]; attend over the
// latent (every causal key, or the indexer's selection) → o_lat_h; heads_h = W_UV_h o_lat_h
// [R, nh, dv].
Status CudaBackend::AttendBlock(CudaStep& st, int64_t l) {
  const ModelConfig& c = st.c;
  const DevLayer& D = weights_->layers[l];
  const int64_t R = st.R, nh = st.nh, dn = st.dn, dr = st.dr, dv = st.dv, C = st.C, dqk = st.dqk, topk = st.topk;
  const bool sparse = c.layers[l].attention == AttentionKind::kMlaSparse;
  // Per head as a grouped GEMV (heads = "experts", one slot per head): a fixed reduction
  // order per output element whatever the number of rows (ExpertGemm is cpu::MatMulNT's).
  cu::ExpertGemmParams ab;
  ab.rows = R;
  ab.k = nh;
  ab.experts = nh;
  ab.out = C;
  ab.in = dn;
  D.w_ukt.Bind(&ab, 0, C);
  ab.x = st.q;  // slot (r, h) reads q[r, h, 0:dn]: row (r·nh + h) at stride dqk
  ab.x_stride = dqk;
  ab.x_per_slot = true;
  ab.round_x_bf16 = bf16_;
  ab.ids = st.d_heads;  // copied in with the step's inputs: no kernel writes them
  ab.ids_fixed = true;
  ab.y = st.qlat;
  ab.y_stride = C;
  ab.error_flag = st.err;
  LS_RETURN_IF_ERROR(cu::ExpertGemm(ab, st.s));
  LS_RETURN_IF_ERROR(Mark("absorb_q"));
  // At one row the absorption of W_UV takes the attention's split results and merges them
  // itself (ExpertGemmParams::x_partials: MlaDecode's combine, the same bits, one launch and
  // one wait fewer on the chain; kCombineInUvMaxRows).
  const bool combine_in_uv = dot_ && R <= kCombineInUvMaxRows && (D.kv_b.bf16 || D.kv_b.fp8);
  if (st.overlap) {
    LS_RETURN_IF_ERROR(join_->WaitOn(st.s));  // the cache holds this step's latents
    LS_RETURN_IF_ERROR(Mark("kv_path_wait"));
  }
  {
    cu::MlaDecodeParams mp;
    mp.batch = R;
    mp.heads = nh;
    mp.kv_lora = C;
    mp.rope_dim = dr;
    mp.format = format_;
    mp.softmax_scale = st.scale;
    mp.q_latent = st.qlat;
    mp.q_latent_batch_stride = nh * C;
    mp.q_latent_head_stride = C;
    mp.q_rope = st.q + dn;
    mp.q_rope_batch_stride = nh * dqk;
    mp.q_rope_head_stride = dqk;
    mp.cache = latent_pool_[l].as<uint8_t>();
    mp.num_pages = num_pages_;
    mp.page_size = page_size_;
    mp.o_latent = st.olat;
    mp.o_batch_stride = nh * C;
    mp.o_head_stride = C;
    mp.error_flag = st.err;
    if (sparse) {
      mp.indices = st.topk_slot;
      mp.indices_stride = topk;
      mp.topk = topk;
    } else {
      mp.page_table = st.d_table;
      mp.page_table_stride = st.P;
      mp.seq_lens = st.d_len;
      mp.max_seq_len = st.max_len;
    }
    const size_t need = cu::MlaDecodeWorkspaceBytes(mp);
    LS_RETURN_IF_ERROR(mla_ws_.Ensure(std::max<size_t>(need, 256)));
    mp.workspace = mla_ws_.buf.data();
    mp.workspace_bytes = mla_ws_.buf.size();
    if (combine_in_uv) {  // the splits only: W_UV's absorption below merges them
      LS_RETURN_IF_ERROR(sparse ? cu::MlaSparseDecodeSplits(mp, &ab.x_partials, st.s)
                                : cu::MlaDecodeSplits(mp, &ab.x_partials, st.s));
    } else {
      LS_RETURN_IF_ERROR(sparse ? cu::MlaSparseDecode(mp, st.s) : cu::MlaDecode(mp, st.s));
    }
    LS_RETURN_IF_ERROR(Mark("mla_decode"));
  }
  // heads_h = W_UV_h o_lat_h: W_UV_h is rows [h·(dn+dv) + dn, +dv) of kv_b_proj.
  ab.out = dv;
  ab.in = C;
  D.kv_b.Bind(&ab, dn, dn + dv);
  ab.x = combine_in_uv ? nullptr : st.olat;  // (x_partials set above when combine_in_uv)
  ab.x_stride = C;
  ab.y = st.heads;
  ab.y_stride = dv;
  LS_RETURN_IF_ERROR(cu::ExpertGemm(ab, st.s));
  LS_RETURN_IF_ERROR(Mark("absorb_v"));
  return TapHeads(st, l, kTapHeads, st.heads, dv);
}

Status CudaBackend::TapHeads(CudaStep& st, int64_t l, TapId t, const float* mine, int64_t w) {
  const std::string& name = model_->tap_name(l, t);
  const int64_t cols = st.nh * w;
  if (!st.ranked()) return taps_.Tap(name, mine, cols, cols, TapDType::kF32);
  // Rank mode: every rank gathers them or none does (the group's collectives must match).
  if (!st.plan.tp_gather_taps) {
    if (!taps_.active()) return Status::Ok();
    return Status::InvalidArgument(name + ": a rank's tap of a head-sharded tensor needs tp_gather_taps on every rank");
  }
  float* whole = taps_.slab() ? st.SlabAt(l, t == kTapQ ? CudaStep::kSQ : CudaStep::kSHeads)
                              : t == kTapQ ? st.q_whole : st.heads_whole;
  LS_RETURN_IF_ERROR(GatherRows(st, mine, cols, whole));
  return taps_.Tap(name, whole, st.tp * cols, st.tp * cols, TapDType::kF32);
}

// o = o_proj(heads) [R, H]; x = x + o; h = RMSNorm(x) (the FFN's input) — and in an MoE layer
// whose router fits NormRoute, the router logits and the routing in that one launch (the same
// bits as AddNorm, RowDots and Route).
Status CudaBackend::OutProjBlock(CudaStep& st, int64_t l) {
  const ModelConfig& c = st.c;
  const DevLayer& D = weights_->layers[l];
  const int64_t R = st.R, H = st.H, nh = st.nh, dv = st.dv;
  {
    // (Emulated TP: each rank's heads rounded as that rank holds them; a rank holds its own.)
    LS_ASSIGN_OR_RETURN(const float* headsl, st.LinearIn(st.heads, nh * dv, st.headsq, st.ranked() ? 1 : st.tp, dv));
    if (st.tp > 1) {  // emulated TP: each rank's heads through its slice of o_proj, then the all-reduce
      float* parts = taps_.slab() ? st.SlabAt(l, CudaStep::kSAttnParts) : st.attn_parts;
      if (st.ranked()) {  // a rank: its heads through its columns (o holds its partial), every rank's gathered
        LS_RETURN_IF_ERROR(Linear(headsl, nh * dv, R, D.o_proj, st.o, H));
        LS_RETURN_IF_ERROR(Mark("o_proj"));
        LS_RETURN_IF_ERROR(GatherRows(st, st.o, H, parts));
        LS_RETURN_IF_ERROR(Mark("gather"));  // (--gpu-profile: the collective's time a step)
      } else {
        LS_RETURN_IF_ERROR(RowParallel(headsl, nh * dv, R, D.o_proj, st.tp, dv, parts));
      }
      LS_RETURN_IF_ERROR(taps_.Tap(model_->tap_name(l, kTapAttnPartials), parts, st.tp * H, st.tp * H, TapDType::kF32));
      LS_RETURN_IF_ERROR(TpAllReduce(st, parts, st.o));
    } else {
      LS_RETURN_IF_ERROR(Linear(headsl, nh * dv, R, D.o_proj, st.o, H));
    }
  }
  LS_RETURN_IF_ERROR(Mark("o_proj"));
  LS_RETURN_IF_ERROR(taps_.Tap(model_->tap_name(l, kTapAttnOut), st.o, H, H, TapDType::kF32));
  st.routed = st.fuse_norms && c.layers[l].ffn != FfnKind::kDense && cu::NormRouteFits(st.E, H, R) &&
              reinterpret_cast<uintptr_t>(D.router.f32()) % 16 == 0;
  float* x_mid = taps_.slab() ? st.SlabAt(l, CudaStep::kSResidMid) : st.x;
  float* h_ffn = taps_.slab() ? st.SlabAt(l, CudaStep::kSFfnNorm) : st.h;
  if (st.routed) {
    cu::NormRouteParams nr;
    nr.norm = st.NormParams(st.x, H, D.post_attn_norm, H, st.rms_eps, h_ffn, H);
    nr.norm.add = st.o;
    nr.norm.add_stride = H;
    nr.norm.sum = x_mid;
    nr.norm.sum_stride = H;
    nr.router = D.router.f32();
    nr.router_stride = H;
    nr.logits = st.rlog;
    nr.logits_stride = st.E;
    nr.route = st.RouteParams(D, taps_.slab() ? reinterpret_cast<int32_t*>(st.SlabAt(l, CudaStep::kSIds)) : st.ids,
                              taps_.slab() ? st.SlabAt(l, CudaStep::kSWts) : st.wts);
    LS_RETURN_IF_ERROR(cu::NormRoute(nr, st.s));
    LS_RETURN_IF_ERROR(Mark("norm_route"));
  } else if (st.fuse_norms) {  // x + o and the FFN's norm of it (h: the attention's inputs are done)
    LS_RETURN_IF_ERROR(st.AddNorm(x_mid, st.x, st.o, D.post_attn_norm, h_ffn));
  } else {
    LS_RETURN_IF_ERROR(cu::Add(x_mid, H, st.x, H, st.o, H, R, H, st.s));
  }
  st.x = x_mid;
  LS_RETURN_IF_ERROR(taps_.Tap(model_->tap_name(l, kTapResidMid), st.x, H, H, TapDType::kF32));
  return taps_.SummaryFence();  // h, o and x are written next
}

// o = MLP(h), or Σ_j w_j·expert_{id_j}(h) + shared(h) over the k routed experts   [R, H];
// x = x + o, and the next layer's input norm (or the final norm) where it fuses.
Status CudaBackend::FfnBlock(CudaStep& st, int64_t l) {
  const ModelConfig& c = st.c;
  const DevLayer& D = weights_->layers[l];
  const int64_t R = st.R, H = st.H, k = st.k, E = st.E;
  auto tn = [&](TapId t) -> const std::string& { return model_->tap_name(l, t); };
  if (taps_.slab()) {
    st.h = st.SlabAt(l, CudaStep::kSFfnNorm);
    st.ids = reinterpret_cast<int32_t*>(st.SlabAt(l, CudaStep::kSIds));
    st.wts = st.SlabAt(l, CudaStep::kSWts);
    st.o = st.SlabAt(l, CudaStep::kSFfnOut);
  }
  if (!st.fuse_norms) LS_RETURN_IF_ERROR(st.RmsNorm(st.x, H, D.post_attn_norm, H, st.rms_eps, st.h, H));
  LS_RETURN_IF_ERROR(taps_.Tap(tn(kTapFfnNorm), st.h, H, H, TapDType::kF32));
  // The experts' and MLP's input (hq is free again: the attention's products are done).
  LS_ASSIGN_OR_RETURN(const float* hfl, st.LinearIn(st.h, H, st.hq));
  // Where the layer's residual sum and the next norm go (the last layer's: the final norm).
  float* x_out = taps_.slab() ? st.SlabAt(l, CudaStep::kSResidOut) : st.x;
  const bool last = l + 1 == c.num_hidden_layers;
  float* h_next = !taps_.slab() ? st.h : last ? st.SlabAt(c.num_hidden_layers, 0) : st.SlabAt(l + 1, CudaStep::kSAttnNorm);
  const DevTensor& next_norm = last ? weights_->final_norm : weights_->layers[l + 1].input_norm;
  bool combined_norm = false;  // the MoE combine did the residual add and the next norm
  // Emulated TP: each rank's partial output (its slice of the dense MLP or the shared experts,
  // plus its block of routed experts), then the all-reduce into o.
  const int tp = st.tp;
  float* const parts = tp == 1 ? nullptr : taps_.slab() ? st.SlabAt(l, CudaStep::kSFfnParts) : st.ffn_parts;
  // Rank mode: this rank's partial alone, in sh (its MLP slice, or its shared-expert slice plus
  // its experts' sum), every rank's gathered into parts before the all-reduce.
  if (c.layers[l].ffn == FfnKind::kDense && st.ranked()) {
    LS_RETURN_IF_ERROR(SwiGluMlp(D.mlp_gate_up, D.mlp_down, D.mlp_inter, hfl, R, st.sh));
    LS_RETURN_IF_ERROR(Mark("dense_mlp"));
  } else if (c.layers[l].ffn == FfnKind::kDense && tp > 1) {
    LS_RETURN_IF_ERROR(MlpPartials(D.mlp_gate_up, D.mlp_down, D.mlp_inter, hfl, R, tp, parts));
    LS_RETURN_IF_ERROR(Mark("dense_mlp"));
  } else if (c.layers[l].ffn == FfnKind::kDense) {
    LS_RETURN_IF_ERROR(SwiGluMlp(D.mlp_gate_up, D.mlp_down, D.mlp_inter, hfl, R, st.o));
    LS_RETURN_IF_ERROR(Mark("dense_mlp"));
  } else {
    // The shared experts read only h: with `overlap` they run on the side stream beside
    // the router and the routed experts.
    const bool shared_side = st.overlap && c.n_shared_experts > 0;
    if (shared_side) {
      LS_RETURN_IF_ERROR(
          OnSide(st, [&] { return SwiGluMlp(D.shared_gate_up, D.shared_down, D.shared_inter, hfl, R, st.sh); }));
    }
    // Router logits: fp32 weights (the router is never rounded), cpu::Dot's order (RowDots)
    // — the CPU's exact bits, so the experts chosen are the CPU's whenever the inputs are;
    // the routing on the device.
    if (!st.routed) {  // (NormRoute did both in OutProjBlock otherwise)
      cu::RowDotsParams rg;
      rg.x = st.h;
      rg.x_stride = H;
      rg.w = D.router.f32();
      rg.w_stride = H;
      rg.y = st.rlog;
      rg.y_stride = E;
      rg.rows = R;
      rg.outs = E;
      rg.n = H;
      rg.w_fixed = true;
      LS_RETURN_IF_ERROR(cu::RowDots(rg, st.s));
      LS_RETURN_IF_ERROR(Mark("router_logits"));
      LS_RETURN_IF_ERROR(cu::Route(st.RouteParams(D, st.ids, st.wts), st.s));
      LS_RETURN_IF_ERROR(Mark("router"));
    }
    LS_RETURN_IF_ERROR(taps_.Tap(tn(kTapTopkIds), st.ids, k, k, TapDType::kI32));
    LS_RETURN_IF_ERROR(taps_.Tap(tn(kTapTopkWeights), st.wts, k, k, TapDType::kF32));
    // Each (row, slot) through its expert: gate_up, SwiGLU, down; combined in slot order.
    const int64_t I = D.moe_inter;
    cu::ExpertGemmParams ge;
    ge.rows = R;
    ge.k = k;
    ge.experts = D.experts;  // (rank mode: its block, from expert0; the other ranks' slots skipped)
    ge.expert0 = D.expert0;
    ge.skip_foreign = st.ranked();
    ge.out = 2 * I;
    ge.in = H;
    D.experts_gate_up.Bind(&ge, 0, 2 * I);
    ge.x = hfl;
    ge.x_stride = H;
    ge.x_per_slot = false;
    ge.round_x_bf16 = bf16_;
    ge.ids = st.ids;
    ge.y = st.gu;
    ge.y_stride = 2 * I;
    ge.error_flag = st.err;
    // gemm=bf16 (cuBLAS's bf16 GEMMs for the dense products): the routed experts on tensor
    // cores too — their own fixed order, batch-invariant; bf16_dot keeps cpu::Dot's.
    const bool experts_tc = !dot_ && bf16_;
    ge.tensor_cores = experts_tc && cu::ExpertGemmTcFits(ge);
    LS_RETURN_IF_ERROR(cu::ExpertGemm(ge, st.s));
    LS_RETURN_IF_ERROR(Mark("experts_gate_up"));
    cu::SwiGluParams sp;
    sp.g = st.gu;
    sp.g_stride = 2 * I;
    sp.u = st.gu + I;
    sp.u_stride = 2 * I;
    sp.out = st.act;
    sp.out_stride = I;
    sp.rows = R * k;
    sp.n = I;
    LS_RETURN_IF_ERROR(cu::SwiGlu(sp, st.s));
    if (w8a8_) LS_RETURN_IF_ERROR(cu::Fp8RoundTrip(st.act, I, st.act, I, R * k, I, st.s));  // the down's input
    ge.out = H;
    // (The hidden fault zoo's cuda_expert_down_k_tail: K cut to the last full 64-wide tile.)
    ge.in = st.plan.hidden == kernels::HiddenFault::kCudaExpertDownKTail ? I / 64 * 64 : I;
    D.experts_down.Bind(&ge, 0, H);
    ge.x = st.act;
    ge.x_stride = I;
    ge.x_per_slot = true;
    ge.y = st.ey;
    ge.y_stride = H;
    ge.tensor_cores = experts_tc && cu::ExpertGemmTcFits(ge);
    LS_RETURN_IF_ERROR(cu::ExpertGemm(ge, st.s));
    LS_RETURN_IF_ERROR(Mark("experts_down"));
    if (tp > 1) {
      // Rank q holds experts ShardOf(E, tp, q) and its slice of the shared experts: every q's
      // partial in parts (emulated), or this rank's alone in sh (rank mode: st.rank ≥ 0).
      float* mine = st.ranked() ? st.sh : parts;
      if (c.n_shared_experts > 0 && st.ranked()) {
        LS_RETURN_IF_ERROR(SwiGluMlp(D.shared_gate_up, D.shared_down, D.shared_inter, hfl, R, mine));
      } else if (c.n_shared_experts > 0) {
        LS_RETURN_IF_ERROR(MlpPartials(D.shared_gate_up, D.shared_down, D.shared_inter, hfl, R, tp, mine));
      }
      cu::TpExpertPartialsParams pp;
      pp.y = st.ey;
      pp.y_stride = H;
      pp.weights = st.wts;
      pp.ids = st.ids;
      pp.experts = E;
      pp.shared = c.n_shared_experts > 0 ? mine : nullptr;
      pp.out = mine;
      pp.rows = R;
      pp.k = k;
      pp.n = H;
      pp.ranks = tp;
      pp.rank = st.rank;
      LS_RETURN_IF_ERROR(cu::TpExpertPartials(pp, st.s));
      LS_RETURN_IF_ERROR(Mark("combine"));
    } else {
      if (shared_side) {
        LS_RETURN_IF_ERROR(join_->WaitOn(st.s));
        LS_RETURN_IF_ERROR(Mark("shared_experts_wait"));
      } else if (c.n_shared_experts > 0) {
        LS_RETURN_IF_ERROR(SwiGluMlp(D.shared_gate_up, D.shared_down, D.shared_inter, hfl, R, st.sh));
        LS_RETURN_IF_ERROR(Mark("shared_experts"));
      }
      cu::MoeCombineParams mc;
      mc.y = st.ey;
      mc.y_stride = H;
      mc.weights = st.wts;
      mc.shared = c.n_shared_experts > 0 ? st.sh : nullptr;
      mc.shared_stride = H;
      mc.out = st.o;
      mc.out_stride = H;
      mc.rows = R;
      mc.k = k;
      mc.n = H;
      if (st.fuse_norms && cu::MoeCombineNormFits(H, R)) {
        // The combine, x + o and the next layer's input norm (or the final norm) in one launch.
        cu::MoeCombineNormParams cn;
        cn.combine = mc;
        cn.x = st.x;
        cn.x_stride = H;
        cn.sum = x_out;
        cn.sum_stride = H;
        cn.weight = next_norm.f32();
        cn.eps = st.rms_eps;
        cn.fault_mean_n_minus_1 = st.plan.hidden == kernels::HiddenFault::kCudaNormMeanOverNMinus1;
        cn.y = h_next;
        cn.y_stride = H;
        LS_RETURN_IF_ERROR(cu::MoeCombineNorm(cn, st.s));
        combined_norm = true;
      } else {
        LS_RETURN_IF_ERROR(cu::MoeCombine(mc, st.s));
      }
      LS_RETURN_IF_ERROR(Mark("combine"));
    }
  }
  if (st.ranked()) {
    LS_RETURN_IF_ERROR(Mark("ffn_partial"));
    LS_RETURN_IF_ERROR(GatherRows(st, st.sh, H, parts));
    LS_RETURN_IF_ERROR(Mark("gather"));
  }
  if (tp > 1) {
    LS_RETURN_IF_ERROR(taps_.Tap(tn(kTapFfnPartials), parts, tp * H, tp * H, TapDType::kF32));
    LS_RETURN_IF_ERROR(TpAllReduce(st, parts, st.o));
    LS_RETURN_IF_ERROR(Mark("allreduce"));
  }
  LS_RETURN_IF_ERROR(taps_.Tap(tn(kTapFfnOut), st.o, H, H, TapDType::kF32));
  if (combined_norm) {
    st.h_ready = true;
  } else if (st.fuse_norms) {  // x + o and the next layer's input norm (or the final norm)
    LS_RETURN_IF_ERROR(st.AddNorm(x_out, st.x, st.o, next_norm, h_next));
    st.h_ready = true;
  } else {
    LS_RETURN_IF_ERROR(cu::Add(x_out, H, st.x, H, st.o, H, R, H, st.s));
  }
  st.x = x_out;
  LS_RETURN_IF_ERROR(taps_.Tap(tn(kTapResidOut), st.x, H, H, TapDType::kF32));
  LS_RETURN_IF_ERROR(taps_.SummaryFence());  // the next layer writes every buffer again
  return taps_.Override(tn(kTapResidOut), st.x, H);
}

// h = RMSNorm(x); logits = lm_head(h) for the rows that need them [RL, V], gathered first so
// lm_head is read once; the step's KV events and slab summaries.
Status CudaBackend::HeadBlock(CudaStep& st) {
  const ModelConfig& c = st.c;
  const int64_t R = st.R, H = st.H;
  if (taps_.slab()) st.h = st.SlabAt(c.num_hidden_layers, 0);
  if (!st.h_ready) LS_RETURN_IF_ERROR(st.RmsNorm(st.x, H, weights_->final_norm, H, st.rms_eps, st.h, H));
  LS_RETURN_IF_ERROR(taps_.Tap(kModelTaps[kTapFinalNorm].name, st.h, H, H, TapDType::kF32));
  if (taps_.kv_events()) LS_RETURN_IF_ERROR(taps_.TapKvRows(st.cache, c.num_hidden_layers, st.mirror_base, st.mirror_off));
  LS_RETURN_IF_ERROR(taps_.SummaryFence());
  // The step's tail besides the logits: the slab's tap summaries. They read what the layers
  // wrote and nothing lm_head writes, so with `overlap` they run on the side stream while
  // lm_head (the step's largest read) runs here. (The new cache rows for the host were
  // copied as they were written.)
  auto tail = [&]() -> Status {
    if (taps_.slab()) LS_RETURN_IF_ERROR(taps_.SummarizeSlab(launch_));  // (full capture: beside the values)
    return Status::Ok();
  };
  const bool tail_side = st.overlap && taps_.slab();
  if (tail_side) LS_RETURN_IF_ERROR(OnSide(st, tail));
  LS_RETURN_IF_ERROR(Mark("final_norm_taps"));
  {
    cu::GatherRowsParams gp;
    gp.src = st.h;
    gp.src_rows = R;
    gp.src_stride = H * 4;
    gp.rows = st.d_lrow;
    gp.n = st.RL;
    gp.dst = st.o_shared;  // R ≥ RL rows
    gp.dst_stride = H * 4;
    gp.row_bytes = H * 4;
    gp.error_flag = st.err;
    LS_RETURN_IF_ERROR(cu::GatherRows(gp, st.s));
  }
  LS_RETURN_IF_ERROR(Linear(st.o_shared, H, st.RL, weights_->lm_head, logits_dev_.as<float>(), st.V));
  LS_RETURN_IF_ERROR(Mark("lm_head"));
  if (tail_side) {
    LS_RETURN_IF_ERROR(join_->WaitOn(st.s));
  } else {
    LS_RETURN_IF_ERROR(tail());
  }
  return Mark("tap_summaries");
}

Status CudaBackend::DeviceAllGather(const CudaStep& st, const float* send, int64_t n, float* recv) {
  if (coll_->device_native()) return coll_->AllGatherDevice(send, n, recv, st.s);
  // Ranks on threads: the rows through host memory (the step waits for its stream twice).
  const size_t bytes = static_cast<size_t>(n) * 4;
  if (gather_host_.size() < bytes * (ranks_ + 1)) {
    LS_ASSIGN_OR_RETURN(gather_host_, cu::PinnedBuffer::Allocate(bytes * (ranks_ + 1) * 2));
  }
  float* host = gather_host_.as<float>();
  LS_RETURN_IF_ERROR(cu::CopyAsync(host, send, bytes, st.s));
  LS_RETURN_IF_ERROR(cu::SynchronizeStream(st.s));
  LS_RETURN_IF_ERROR(coll_->AllGather(host, n, host + n));
  LS_RETURN_IF_ERROR(cu::CopyAsync(recv, host + n, bytes * ranks_, st.s));
  return cu::SynchronizeStream(st.s);  // (the host buffer serves the next gather)
}

Status CudaBackend::GatherRows(const CudaStep& st, const float* mine, int64_t cols, float* out) {
  const int64_t R = st.R, n = R * cols;
  LS_RETURN_IF_ERROR(tp_gather_.Ensure(static_cast<size_t>(n * ranks_) * 4));
  float* all = tp_gather_.as<float>();  // rank-major [ranks][R][cols]
  LS_RETURN_IF_ERROR(DeviceAllGather(st, mine, n, all));
  for (int q = 0; q < ranks_; ++q) {  // → [R][ranks][cols]
    LS_RETURN_IF_ERROR(cu::Copy2DAsync(out + q * cols, static_cast<size_t>(ranks_ * cols) * 4, all + q * n,
                                       static_cast<size_t>(cols) * 4, static_cast<size_t>(cols) * 4, R, st.s));
  }
  return Status::Ok();
}

Status CudaBackend::TpAllReduce(const CudaStep& st, const float* partials, float* y) {
  cu::AllReduceParams ap;
  ap.partials = partials;
  ap.y = y;
  ap.y_stride = st.H;
  ap.rows = st.R;
  ap.n = st.H;
  ap.ranks = st.plan.emulate_tp;
  ap.order = ToReduceOrder(st.plan.allreduce);
  return cu::AllReduce(ap, st.s);
}

}  // namespace lockstep::engine::cuda_impl
