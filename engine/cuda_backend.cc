// engine/cuda_backend.cc — the DeepSeek V2/V3/V3.2 forward pass on the GPU.
//
// The same computation as engine/model.cc, step for step, with kernels/cuda's launchers:
// the projections through cuBLASLt (pinned algorithms: batch-invariant), RMSNorm, RoPE, the
// latent written into a device copy of the paged cache in its own format, attention in the
// absorbed form for every row (a prefill row is a decode query over its causal prefix, so a
// token's numbers do not depend on how its prompt was chunked or batched), the V3.2 indexer
// + exact top-k + sparse decode, MoE routing and grouped expert products on the device (no
// host round trip inside a step), logits copied back for the host sampler.
//
// Shapes as in model.cc: R rows, H hidden, nh heads, dn/dr/dv head dims, C kv_lora.
// Every device buffer lives as long as the backend (grown, never shrunk), so a step's
// launches see the same pointers from step to step.
// This file: set-up (weights, cache, scratch), GEMMs, taps; the forward pass is
// engine/cuda_forward.cc; the class is engine/cuda_backend_impl.h.
#include <algorithm>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "engine/cuda_backend_impl.h"
#include "engine/tensor_parallel.h"
#include "kernels/cpu/numerics.h"

namespace lockstep::engine {

bool HaveCudaBackend() { return true; }

namespace cuda_impl {
namespace {

// An FP8 device tensor, allocated: bytes [rows, cols] and each row's scale per 128 columns
// [rows, ⌈cols / 128⌉].
Result<DevTensor> AllocateFp8(int64_t rows, int64_t cols) {
  DevTensor t;
  t.rows = rows;
  t.cols = cols;
  t.fp8 = true;
  t.scale_cols = (cols + 127) / 128;
  if (rows * cols == 0) return t;
  LS_ASSIGN_OR_RETURN(t.buf, cu::DeviceBuffer::Allocate(static_cast<size_t>(rows * cols)));
  LS_ASSIGN_OR_RETURN(t.scale, cu::DeviceBuffer::Allocate(static_cast<size_t>(rows * t.scale_cols) * 4));
  return t;
}

// FP8 bytes [rows, cols] and their row scales, uploaded.
Result<DevTensor> UploadFp8(const std::vector<uint8_t>& values, const std::vector<float>& row_scales, int64_t rows,
                            int64_t cols) {
  LS_ASSIGN_OR_RETURN(DevTensor t, AllocateFp8(rows, cols));
  if (rows * cols == 0) return t;
  LS_RETURN_IF_ERROR(t.buf.CopyFromHost(values.data(), values.size()));
  LS_RETURN_IF_ERROR(t.scale.CopyFromHost(row_scales.data(), row_scales.size() * 4));
  return t;
}

// Appends f's rows' scales per 128 columns to `out`; false when a 128-column chunk spans blocks
// of different scales (block_cols not a multiple of 128).
bool AppendRowScales(const Fp8Blocks& f, std::vector<float>* out) {
  const int64_t chunks = (f.cols + 127) / 128;
  for (int64_t r = 0; r < f.rows; ++r) {
    for (int64_t j = 0; j < chunks; ++j) {
      const int64_t c0 = 128 * j, c1 = std::min(f.cols, c0 + 128);
      const float sc = f.scale(r, c0);
      if (f.block_cols < 128 || f.scale(r, c1 - 1) != sc) return false;
      out->push_back(sc);
    }
  }
  return true;
}

// m's FP8 form for gemm=fp8_dot: its own (an FP8 checkpoint's tensor), or — `quantize`, for a
// checkpoint without FP8 tensors — Fp8Blocks::Quantize's, made here (as Model::Fp8Weights makes
// it for the CPU, without keeping a dequantised fp32 copy of the model on the host); null for an
// FP8 checkpoint's other tensors, which stay as stored.
std::shared_ptr<const Fp8Blocks> Fp8Of(const Matrix& m, bool quantize) {
  if (m.fp8 != nullptr || !quantize || m.empty()) return m.fp8;
  const std::vector<float> v = m.Dequantized();
  return std::make_shared<Fp8Blocks>(Fp8Blocks::Quantize(v.data(), m.rows, m.cols));
}

// The fp32 values gemm=fp8_dot computes with: the FP8 form's dequantisation, else the stored ones.
std::vector<float> Fp8Values(const Matrix& m, const Fp8Blocks* f) {
  if (f == nullptr) return m.Dequantized();
  std::vector<float> v(static_cast<size_t>(m.rows * m.cols));
  f->Dequantize(v.data());
  return v;
}

// Host memory an upload holds at once: one chunk of this many fp32 values (16 MB), never a
// stacked tensor's fp32 copy (a 671B model's stacked experts are ~30 GB a layer in fp32).
constexpr int64_t kUploadChunkValues = int64_t{4} << 20;

// Rows [row0, row0 + rows) of t (fp32 or bf16, allocated) from `decode(r, n, dst)`, which gives
// rows [r, r + n) of the source as fp32 [n, t.cols]: a chunk of rows at a time, rounded to bf16
// when t is bf16.
template <typename Decode>
Status UploadRows(DevTensor& t, int64_t row0, int64_t rows, Decode&& decode) {
  const int64_t cols = t.cols;
  if (rows * cols == 0) return Status::Ok();
  const int64_t step = std::max<int64_t>(1, kUploadChunkValues / cols);
  std::vector<float> f(static_cast<size_t>(std::min(step, rows) * cols));
  std::vector<uint16_t> b(t.bf16 ? f.size() : 0);
  for (int64_t r = 0; r < rows; r += step) {
    const int64_t n = std::min(step, rows - r), count = n * cols;
    decode(r, n, f.data());
    const size_t at = static_cast<size_t>((row0 + r) * cols) * (t.bf16 ? 2 : 4);
    if (t.bf16) {
      for (int64_t i = 0; i < count; ++i) b[i] = kernels::F32ToBf16(f[i]);
      LS_RETURN_IF_ERROR(t.buf.CopyFromHost(b.data(), static_cast<size_t>(count) * 2, at));
    } else {
      LS_RETURN_IF_ERROR(t.buf.CopyFromHost(f.data(), static_cast<size_t>(count) * 4, at));
    }
  }
  return Status::Ok();
}

// An fp32 or bf16 device tensor [rows, cols], allocated.
Result<DevTensor> Allocate(int64_t rows, int64_t cols, bool bf16) {
  DevTensor t;
  t.rows = rows;
  t.cols = cols;
  t.bf16 = bf16;
  if (rows * cols == 0) return t;
  LS_ASSIGN_OR_RETURN(t.buf, cu::DeviceBuffer::Allocate(static_cast<size_t>(rows * cols) * (bf16 ? 2 : 4)));
  return t;
}

// Device copy of host fp32 values [rows, cols], rounded to bf16 when asked.
Result<DevTensor> Upload(const float* data, int64_t rows, int64_t cols, bool bf16) {
  LS_ASSIGN_OR_RETURN(DevTensor t, Allocate(rows, cols, bf16));
  LS_RETURN_IF_ERROR(UploadRows(t, 0, rows, [&](int64_t r, int64_t n, float* dst) {
    std::memcpy(dst, data + r * cols, static_cast<size_t>(n * cols) * 4);
  }));
  return t;
}

// Rows of several matrices stacked into one device tensor (gate ; up → [2I, in]), in the
// backend's weight precision: bf16; or (fp8) FP8 when every part has an FP8 form (Fp8Of) whose
// blocks fit 128-column chunks — else fp32, the values those forms dequantise to. Each part
// goes up on its own (FP8: its bytes from where they lie; else a chunk of rows at a time).
Result<DevTensor> UploadStacked(const std::vector<const Matrix*>& parts, bool bf16, bool fp8 = false,
                                bool quantize = false) {
  int64_t rows = 0;
  const int64_t cols = parts.empty() ? 0 : parts[0]->cols;
  for (const Matrix* m : parts) {
    if (m->cols != cols) return Status::Internal("UploadStacked: column counts differ");
    rows += m->rows;
  }
  // Host memory held at once: one part's FP8 form and row scales (or a chunk of its rows).
  std::vector<float> scales;
  if (fp8) {
    // Every part needs an FP8 form whose blocks fit 128-column chunks: a checkpoint's own is
    // checked; one Fp8Blocks::Quantize makes (128 × 128 blocks) always fits.
    bool ok = true;
    for (size_t i = 0; i < parts.size() && ok; ++i) {
      const Matrix& m = *parts[i];
      scales.clear();
      ok = m.fp8 != nullptr ? AppendRowScales(*m.fp8, &scales) : quantize && !m.empty();
    }
    if (ok) {
      LS_ASSIGN_OR_RETURN(DevTensor t, AllocateFp8(rows, cols));
      if (rows * cols == 0) return t;
      size_t at = 0, scale_at = 0;
      for (const Matrix* m : parts) {
        const std::shared_ptr<const Fp8Blocks> f = Fp8Of(*m, quantize);
        scales.clear();
        if (f == nullptr || !AppendRowScales(*f, &scales)) {
          return Status::Internal("UploadStacked: an FP8 form without 128-column row scales");
        }
        LS_RETURN_IF_ERROR(t.buf.CopyFromHost(f->values.data(), f->values.size(), at));
        LS_RETURN_IF_ERROR(t.scale.CopyFromHost(scales.data(), scales.size() * 4, scale_at));
        at += f->values.size();
        scale_at += scales.size() * 4;
      }
      return t;
    }
    bf16 = false;  // fp32 of the values the FP8 forms dequantise to
  }
  // The values the CPU computes with (the FP8 forms' under fp8), dequantised a chunk at a time.
  LS_ASSIGN_OR_RETURN(DevTensor t, Allocate(rows, cols, bf16));
  int64_t row0 = 0;
  for (const Matrix* m : parts) {
    const std::shared_ptr<const Fp8Blocks> f = fp8 ? Fp8Of(*m, quantize) : nullptr;
    const kernels::WeightView view = f != nullptr ? f->view() : m->data;
    LS_RETURN_IF_ERROR(
        UploadRows(t, row0, m->rows, [&](int64_t r, int64_t n, float* dst) { view.DecodeRows(r, n, dst); }));
    row0 += m->rows;
  }
  return t;
}

Result<DevTensor> Upload(const Matrix& m, bool bf16, bool fp8 = false, bool quantize = false) {
  return UploadStacked({&m}, bf16, fp8, quantize);
}

// W_UKᵀ per head, [nh·C, dn] (row h·C + k, column a = kv_b_proj[h·(dn + dv) + a, k]): FP8 when
// kv_b_proj has an FP8 form and each transposed row's 128-column chunk lies in one block of it
// (dn and dn + dv multiples of 128: DeepSeek's shapes), else fp32 / bf16 of the values the
// product uses (under fp8, the FP8 form's dequantisation).
Result<DevTensor> UploadUkT(const Matrix& kv_b, int64_t nh, int64_t C, int64_t dn, int64_t dv, bool bf16, bool fp8,
                            bool quantize) {
  const int64_t chunks = (dn + 127) / 128;
  const std::shared_ptr<const Fp8Blocks> blocks = fp8 ? Fp8Of(kv_b, quantize) : nullptr;
  if (blocks != nullptr) {
    const Fp8Blocks& f = *blocks;
    std::vector<uint8_t> values(static_cast<size_t>(nh * C * dn));
    std::vector<float> scales(static_cast<size_t>(nh * C * chunks));
    bool ok = true;
    for (int64_t h = 0; h < nh && ok; ++h) {
      for (int64_t k = 0; k < C && ok; ++k) {
        for (int64_t a = 0; a < dn; ++a) {
          const int64_t src = h * (dn + dv) + a;
          values[(h * C + k) * dn + a] = f.values[src * f.cols + k];
          float& sc = scales[(h * C + k) * chunks + a / 128];
          if (a % 128 == 0) {
            sc = f.scale(src, k);
          } else if (f.scale(src, k) != sc) {
            ok = false;
            break;
          }
        }
      }
    }
    if (ok) return UploadFp8(values, scales, nh * C, dn);
  }
  const std::vector<float> kvb = fp8 ? Fp8Values(kv_b, blocks.get()) : kv_b.Dequantized();
  std::vector<float> ukt(static_cast<size_t>(nh * C * dn));
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t a = 0; a < dn; ++a) {
      const float* row = &kvb[(h * (dn + dv) + a) * C];
      for (int64_t k = 0; k < C; ++k) ukt[(h * C + k) * dn + a] = row[k];
    }
  }
  return Upload(ukt.data(), nh * C, dn, bf16);
}

// Random weights made on the device (--random-weights): U(−bound, bound) with Philox seeded
// by (seed, tensor number), so a run is reproducible without a checkpoint on disk. FP8: e4m3
// of U(−448, 448) with every scale bound / 448.
Result<DevTensor> Random(int64_t rows, int64_t cols, bool bf16, float bound, uint64_t seed, cu::Stream s,
                         bool fp8 = false) {
  if (fp8) {
    LS_ASSIGN_OR_RETURN(DevTensor t, AllocateFp8(rows, cols));
    if (rows * cols == 0) return t;
    LS_RETURN_IF_ERROR(cu::FillUniformFp8(t.buf.as<uint8_t>(), rows * cols, seed, s));
    LS_RETURN_IF_ERROR(cu::FillConstant(t.scale.data(), rows * t.scale_cols, false, bound / 448.0f, s));
    return t;
  }
  LS_ASSIGN_OR_RETURN(DevTensor t, Allocate(rows, cols, bf16));
  if (rows * cols == 0) return t;
  LS_RETURN_IF_ERROR(cu::FillUniform(t.buf.data(), rows * cols, bf16, -bound, bound, seed, s));
  return t;
}

Result<DevTensor> Constant(int64_t rows, int64_t cols, float value, cu::Stream s) {
  DevTensor t;
  t.rows = rows;
  t.cols = cols;
  LS_ASSIGN_OR_RETURN(t.buf, cu::DeviceBuffer::Allocate(static_cast<size_t>(rows * cols) * 4));
  LS_RETURN_IF_ERROR(cu::FillConstant(t.buf.data(), rows * cols, false, value, s));
  return t;
}

// Columns [k0, k0 + n) of FP8 tensor t decoded to fp32 into out [t.rows, n] (Fp8SliceToF32).
cu::Fp8SliceParams Fp8Slice(const DevTensor& t, int64_t k0, int64_t n, float* out) {
  cu::Fp8SliceParams fp;
  fp.w = t.buf.as<const uint8_t>();
  fp.w_stride = t.cols;
  fp.scale = t.scale.as<const float>();
  fp.scale_stride = t.scale_cols;
  fp.rows = t.rows;
  fp.col0 = k0;
  fp.n = n;
  fp.out = out;
  return fp;
}

// Rank mode's weight shards (docs/parallelism.md, "The rank mode on the GPU"): a rank's part of
// a whole tensor, a tensor of its own, copied on the device (the whole one is then dropped, so
// uploading holds the rank's shard and one whole tensor at a time).

// Row ranges [begin, end) of t stacked, in order (FP8: with their rows' scales).
Result<DevTensor> RowRangesOf(const DevTensor& t, const std::vector<Shard>& ranges, cu::Stream s) {
  int64_t rows = 0;
  for (const Shard& r : ranges) {
    if (r.begin < 0 || r.end > t.rows || r.begin > r.end) return Status::Internal("RowRangesOf: rows outside the tensor");
    rows += r.end - r.begin;
  }
  DevTensor out;
  if (t.fp8) {
    LS_ASSIGN_OR_RETURN(out, AllocateFp8(rows, t.cols));
  } else {
    LS_ASSIGN_OR_RETURN(out, Allocate(rows, t.cols, t.bf16));
  }
  const size_t row_bytes = static_cast<size_t>(t.cols) * t.element_bytes(), scale_bytes = t.scale_cols * 4;
  int64_t at = 0;
  for (const Shard& r : ranges) {
    const int64_t n = r.end - r.begin;
    if (n == 0) continue;
    LS_RETURN_IF_ERROR(cu::CopyAsync(out.buf.as<char>() + at * row_bytes, t.buf.as<const char>() + r.begin * row_bytes,
                                     n * row_bytes, s));
    if (t.fp8) {
      LS_RETURN_IF_ERROR(cu::CopyAsync(out.scale.as<char>() + at * scale_bytes,
                                       t.scale.as<const char>() + r.begin * scale_bytes, n * scale_bytes, s));
    }
    at += n;
  }
  return out;
}

// Columns [k0, k1) of t. FP8 from a 128-column scale block's start: the bytes and their scales;
// FP8 off the blocks: fp32 of the kernels' FP8 values (as LinearCols decodes such a slice, so a
// rank's product over it is the emulation's).
Result<DevTensor> ColsOf(const DevTensor& t, int64_t k0, int64_t k1, cu::Stream s) {
  if (k0 < 0 || k1 > t.cols || k0 >= k1) return Status::Internal("ColsOf: columns outside the tensor");
  const int64_t n = k1 - k0;
  if (t.fp8 && k0 % 128 != 0) {
    LS_ASSIGN_OR_RETURN(DevTensor out, Allocate(t.rows, n, false));
    LS_RETURN_IF_ERROR(cu::Fp8SliceToF32(Fp8Slice(t, k0, n, out.buf.as<float>()), s));
    return out;
  }
  DevTensor out;
  if (t.fp8) {
    LS_ASSIGN_OR_RETURN(out, AllocateFp8(t.rows, n));
  } else {
    LS_ASSIGN_OR_RETURN(out, Allocate(t.rows, n, t.bf16));
  }
  const size_t es = t.element_bytes();
  LS_RETURN_IF_ERROR(cu::Copy2DAsync(out.buf.data(), n * es, t.buf.as<const char>() + k0 * es, t.cols * es, n * es,
                                     t.rows, s));
  if (t.fp8) {
    LS_RETURN_IF_ERROR(cu::Copy2DAsync(out.scale.data(), out.scale_cols * 4, t.scale.as<const float>() + k0 / 128,
                                       t.scale_cols * 4, out.scale_cols * 4, t.rows, s));
  }
  return out;
}

// Replaces t by its part, once the copy is done (t's memory is then free).
template <typename Part>
Status Keep(DevTensor& t, Part&& part, cu::Stream s) {
  if (t.empty()) return Status::Ok();
  LS_ASSIGN_OR_RETURN(DevTensor mine, part(t));
  LS_RETURN_IF_ERROR(cu::SynchronizeStream(s));
  t = std::move(mine);
  return Status::Ok();
}

}  // namespace

Status CudaBackend::ShardLayer(DevLayer& D, int64_t l, cu::Stream s) const {
  const ModelConfig& c = model_->config();
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim, C = c.kv_lora_rank, H = c.hidden_size;
  const Shard heads = ShardOf(c.num_attention_heads, ranks_, rank_);
  auto rows = [&](int64_t per) {
    return [&, per](const DevTensor& t) { return RowRangesOf(t, {{heads.begin * per, heads.end * per}}, s); };
  };
  // Heads: q's rows, W_UKᵀ's and kv_b's (W_UK, W_UV) of the rank's heads; o_proj their columns.
  LS_RETURN_IF_ERROR(Keep(D.q_b_proj, rows(dn + dr), s));
  LS_RETURN_IF_ERROR(Keep(D.q_proj, rows(dn + dr), s));
  LS_RETURN_IF_ERROR(Keep(D.w_ukt, rows(C), s));
  LS_RETURN_IF_ERROR(Keep(D.kv_b, rows(dn + dv), s));
  LS_RETURN_IF_ERROR(
      Keep(D.o_proj, [&](const DevTensor& t) { return ColsOf(t, heads.begin * dv, heads.end * dv, s); }, s));
  // An MLP: gate's and up's rows of the rank's intermediate slice, down's columns.
  auto mlp = [&](DevTensor& gate_up, DevTensor& down, int64_t& inter) -> Status {
    if (gate_up.empty()) return Status::Ok();
    const Shard i = ShardOf(inter, ranks_, rank_);
    LS_RETURN_IF_ERROR(Keep(gate_up, [&](const DevTensor& t) {
      return RowRangesOf(t, {{i.begin, i.end}, {inter + i.begin, inter + i.end}}, s);
    }, s));
    LS_RETURN_IF_ERROR(Keep(down, [&](const DevTensor& t) { return ColsOf(t, i.begin, i.end, s); }, s));
    inter = i.end - i.begin;
    return Status::Ok();
  };
  LS_RETURN_IF_ERROR(mlp(D.mlp_gate_up, D.mlp_down, D.mlp_inter));
  LS_RETURN_IF_ERROR(mlp(D.shared_gate_up, D.shared_down, D.shared_inter));
  // EP: the rank's block of routed experts (whole).
  if (c.layers[l].ffn != FfnKind::kDense) {
    const Shard e = ShardOf(c.n_routed_experts, ranks_, rank_);
    const int64_t I = D.moe_inter;
    LS_RETURN_IF_ERROR(
        Keep(D.experts_gate_up, [&](const DevTensor& t) { return RowRangesOf(t, {{e.begin * 2 * I, e.end * 2 * I}}, s); }, s));
    LS_RETURN_IF_ERROR(
        Keep(D.experts_down, [&](const DevTensor& t) { return RowRangesOf(t, {{e.begin * H, e.end * H}}, s); }, s));
    D.expert0 = static_cast<int32_t>(e.begin);
    D.experts = e.end - e.begin;
  }
  return Status::Ok();
}

Result<std::unique_ptr<Backend>> CudaBackend::Create(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                     const kernels::KernelPlan& plan,
                                                     const BackendOptions& options) {
  if (cu::DeviceCount() == 0) {
    return Status::Unsupported("--backend cuda: " + cu::DeviceDescription());
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->model_ = std::move(model);
  b->device_ = cu::DeviceDescription();
  b->use_graphs_ = options.cuda_graphs;
  b->use_side_ = options.side_stream;
  b->overlap_launch_ = options.overlapped_launch;
  b->device_sampler_ = options.device_sampler;
  if (options.profile) {
    LS_ASSIGN_OR_RETURN(b->prof_, cu::EventTimer::Create());
  }
  if (plan.ranks) {
    b->coll_ = plan.ranks;
    b->rank_ = plan.ranks->rank();
    b->ranks_ = plan.ranks->size();
    // Ranks that are threads meet on the host inside a step, which no CUDA graph can hold.
    if (!b->coll_->device_native()) b->use_graphs_ = false;
  }
  b->gemm_ = plan.gemm;
  b->bf16_ = plan.bf16();
  b->w8a8_ = plan.w8a8();
  b->fp8_ = plan.fp8_weights();
  const bool pinned = plan.pinned_algorithm();
  b->dot_ = plan.dot();
  LS_ASSIGN_OR_RETURN(b->stream_, cu::CudaStream::Create());
  b->taps_.set_stream(b->stream_.get());
  LS_ASSIGN_OR_RETURN(b->side_, cu::CudaStream::Create());
  LS_ASSIGN_OR_RETURN(b->fork_, cu::CudaEvent::Create());
  LS_ASSIGN_OR_RETURN(b->join_, cu::CudaEvent::Create());
  b->launch_ = b->stream_->get();
  cu::GemmOptions go;
  go.variant = cu::GemmVariant::kFp32Pedantic;
  go.pin_algorithm = pinned;
  LS_ASSIGN_OR_RETURN(b->gemm_f32_, cu::Gemm::Create(go));
  if (b->bf16_) {
    go.variant = cu::GemmVariant::kBf16;
    LS_ASSIGN_OR_RETURN(b->gemm_bf16_, cu::Gemm::Create(go));
    if (b->use_side_ && !b->dot_) {  // the side stream's (fp32 for any fp32 weights of a bf16 model)
      LS_ASSIGN_OR_RETURN(b->gemm_bf16_side_, cu::Gemm::Create(go));
      go.variant = cu::GemmVariant::kFp32Pedantic;
      LS_ASSIGN_OR_RETURN(b->gemm_f32_side_, cu::Gemm::Create(go));
    }
  }
  LS_RETURN_IF_ERROR(b->AcquireWeights());
  LS_RETURN_IF_ERROR(b->AllocateCache(cache));
  LS_ASSIGN_OR_RETURN(b->error_flag_, cu::DeviceBuffer::Allocate(4));
  LS_RETURN_IF_ERROR(b->error_flag_.Fill(0));
  LS_RETURN_IF_ERROR(b->stream_->Synchronize());
  return std::unique_ptr<Backend>(std::move(b));
}

Status CudaBackend::AcquireWeights() {
  static std::mutex mu;
  // (model, precision, rank, ranks): a rank's shard is its own.
  static std::map<std::tuple<const Model*, int, int, int>, std::weak_ptr<const DeviceWeights>> shared;
  std::lock_guard<std::mutex> lock(mu);  // held while uploading: a second engine waits, then shares
  auto& slot = shared[{model_.get(), fp8_ ? 2 : bf16_ ? 1 : 0, rank_, ranks_}];
  if (auto live = slot.lock()) {
    weights_ = std::move(live);
    return Status::Ok();
  }
  auto w = std::make_shared<DeviceWeights>();
  const ModelWeights& host = model_->weights();
  if (host.random_seed.has_value()) {
    LS_RETURN_IF_ERROR(RandomWeights(*host.random_seed, w.get()));
  } else {
    LS_RETURN_IF_ERROR(UploadWeights(w.get()));
  }
  LS_RETURN_IF_ERROR(stream_->Synchronize());  // complete before another engine's stream reads them
  weights_ = w;
  slot = w;
  return Status::Ok();
}

Status CudaBackend::UploadWeights(DeviceWeights* dw) {
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  // gemm=fp8_dot: a checkpoint without FP8 tensors is quantised here, matrix by matrix (the
  // matrices Model::Fp8Weights quantises for the CPU: the same Fp8Blocks::Quantize).
  const bool q8 = fp8_ && W.fp8_tensors == 0;
  const int64_t nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dv = c.v_head_dim, C = c.kv_lora_rank;
  LS_ASSIGN_OR_RETURN(dw->embed, Upload(W.embed, false));
  LS_ASSIGN_OR_RETURN(dw->final_norm, Upload(W.final_norm, false));
  LS_ASSIGN_OR_RETURN(dw->lm_head, Upload(W.lm_head, bf16_, fp8_, q8));
  dw->layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = W.layers[l];
    DevLayer& D = dw->layers[l];
    LS_ASSIGN_OR_RETURN(D.input_norm, Upload(L.input_norm, false));
    LS_ASSIGN_OR_RETURN(D.post_attn_norm, Upload(L.post_attn_norm, false));
    if (c.q_lora_rank > 0) {
      LS_ASSIGN_OR_RETURN(D.q_a_proj, Upload(L.q_a_proj, bf16_, fp8_, q8));
      LS_ASSIGN_OR_RETURN(D.q_a_norm, Upload(L.q_a_norm, false));
      LS_ASSIGN_OR_RETURN(D.q_b_proj, Upload(L.q_b_proj, bf16_, fp8_, q8));
    } else {
      LS_ASSIGN_OR_RETURN(D.q_proj, Upload(L.q_proj, bf16_, fp8_, q8));
    }
    LS_ASSIGN_OR_RETURN(D.kv_a_proj, Upload(L.kv_a_proj, bf16_, fp8_, q8));
    LS_ASSIGN_OR_RETURN(D.kv_a_norm, Upload(L.kv_a_norm, false));
    LS_ASSIGN_OR_RETURN(D.kv_b, Upload(L.kv_b_proj, bf16_, fp8_, q8));
    LS_ASSIGN_OR_RETURN(D.w_ukt, UploadUkT(L.kv_b_proj, nh, C, dn, dv, bf16_, fp8_, q8));
    LS_ASSIGN_OR_RETURN(D.o_proj, Upload(L.o_proj, bf16_, fp8_, q8));
    if (c.has_indexer()) {
      LS_ASSIGN_OR_RETURN(D.iq_b, Upload(L.indexer.wq_b, bf16_, fp8_, q8));
      LS_ASSIGN_OR_RETURN(D.ik, Upload(L.indexer.wk, bf16_, fp8_, q8));
      LS_ASSIGN_OR_RETURN(D.ik_norm_w, Upload(L.indexer.k_norm_w, false));
      LS_ASSIGN_OR_RETURN(D.ik_norm_b, Upload(L.indexer.k_norm_b, false));
      LS_ASSIGN_OR_RETURN(D.iw_proj, Upload(L.indexer.weights_proj, bf16_, fp8_, q8));
    }
    if (c.layers[l].ffn == FfnKind::kDense) {
      D.mlp_inter = L.mlp.gate.rows;
      LS_ASSIGN_OR_RETURN(D.mlp_gate_up, UploadStacked({&L.mlp.gate, &L.mlp.up}, bf16_, fp8_, q8));
      LS_ASSIGN_OR_RETURN(D.mlp_down, Upload(L.mlp.down, bf16_, fp8_, q8));
    } else {
      LS_ASSIGN_OR_RETURN(D.router, Upload(L.router, false));
      if (!L.router_bias.empty()) {
        LS_ASSIGN_OR_RETURN(D.router_bias, Upload(L.router_bias, false));
      }
      D.moe_inter = L.experts.at(0).gate.rows;
      std::vector<const Matrix*> gu, dn_;
      for (const auto& e : L.experts) {
        gu.push_back(&e.gate);
        gu.push_back(&e.up);
        dn_.push_back(&e.down);
      }
      LS_ASSIGN_OR_RETURN(D.experts_gate_up, UploadStacked(gu, bf16_, fp8_, q8));
      LS_ASSIGN_OR_RETURN(D.experts_down, UploadStacked(dn_, bf16_, fp8_, q8));
      if (c.n_shared_experts > 0) {
        D.shared_inter = L.shared.gate.rows;
        LS_ASSIGN_OR_RETURN(D.shared_gate_up, UploadStacked({&L.shared.gate, &L.shared.up}, bf16_, fp8_, q8));
        LS_ASSIGN_OR_RETURN(D.shared_down, Upload(L.shared.down, bf16_, fp8_, q8));
      }
      D.experts = c.n_routed_experts;
    }
    if (rank_ >= 0) LS_RETURN_IF_ERROR(ShardLayer(D, l, stream_->get()));
  }
  return Status::Ok();
}

Status CudaBackend::RandomWeights(uint64_t seed, DeviceWeights* dw) {
  const ModelConfig& c = model_->config();
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, C = c.kv_lora_rank, dqk = dn + dr, V = c.vocab_size;
  cu::Stream s = stream_->get();
  uint64_t tensor = 0;
  // Kaiming-uniform-like bounds keep activations of order one through the layers.
  // A product's weight (product: in the GEMM's precision) or an fp32 one.
  auto rnd = [&](int64_t rows, int64_t cols, bool product) {
    return Random(rows, cols, product && bf16_, 1.0f / std::sqrt(static_cast<float>(cols)), seed * 1000003u + tensor++,
                  s, product && fp8_);
  };
  LS_ASSIGN_OR_RETURN(dw->embed, Random(V, H, false, 1.0f, seed * 1000003u + tensor++, s));
  LS_ASSIGN_OR_RETURN(dw->final_norm, Constant(1, H, 1.0f, s));
  LS_ASSIGN_OR_RETURN(dw->lm_head, rnd(V, H, true));
  dw->layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    DevLayer& D = dw->layers[l];
    LS_ASSIGN_OR_RETURN(D.input_norm, Constant(1, H, 1.0f, s));
    LS_ASSIGN_OR_RETURN(D.post_attn_norm, Constant(1, H, 1.0f, s));
    if (c.q_lora_rank > 0) {
      LS_ASSIGN_OR_RETURN(D.q_a_proj, rnd(c.q_lora_rank, H, true));
      LS_ASSIGN_OR_RETURN(D.q_a_norm, Constant(1, c.q_lora_rank, 1.0f, s));
      LS_ASSIGN_OR_RETURN(D.q_b_proj, rnd(nh * dqk, c.q_lora_rank, true));
    } else {
      LS_ASSIGN_OR_RETURN(D.q_proj, rnd(nh * dqk, H, true));
    }
    LS_ASSIGN_OR_RETURN(D.kv_a_proj, rnd(C + dr, H, true));
    LS_ASSIGN_OR_RETURN(D.kv_a_norm, Constant(1, C, 1.0f, s));
    LS_ASSIGN_OR_RETURN(D.kv_b, rnd(nh * (dn + dv), C, true));
    LS_ASSIGN_OR_RETURN(D.w_ukt, rnd(nh * C, dn, true));  // independent of kv_b: random either way
    LS_ASSIGN_OR_RETURN(D.o_proj, rnd(H, nh * dv, true));
    if (c.has_indexer()) {
      LS_ASSIGN_OR_RETURN(D.iq_b, rnd(c.index_n_heads * c.index_head_dim, c.q_lora_rank, true));
      LS_ASSIGN_OR_RETURN(D.ik, rnd(c.index_head_dim, H, true));
      LS_ASSIGN_OR_RETURN(D.ik_norm_w, Constant(1, c.index_head_dim, 1.0f, s));
      LS_ASSIGN_OR_RETURN(D.ik_norm_b, Constant(1, c.index_head_dim, 0.0f, s));
      LS_ASSIGN_OR_RETURN(D.iw_proj, rnd(c.index_n_heads, H, true));
    }
    if (c.layers[l].ffn == FfnKind::kDense) {
      D.mlp_inter = c.intermediate_size;
      LS_ASSIGN_OR_RETURN(D.mlp_gate_up, rnd(2 * D.mlp_inter, H, true));
      LS_ASSIGN_OR_RETURN(D.mlp_down, rnd(H, D.mlp_inter, true));
    } else {
      const int64_t E = c.n_routed_experts;
      LS_ASSIGN_OR_RETURN(D.router, rnd(E, H, false));
      if (c.gate == GateKind::kSigmoidNoauxTc) {
        LS_ASSIGN_OR_RETURN(D.router_bias, Constant(1, E, 0.0f, s));
      }
      D.moe_inter = c.moe_intermediate_size;
      LS_ASSIGN_OR_RETURN(D.experts_gate_up, rnd(E * 2 * D.moe_inter, H, true));
      LS_ASSIGN_OR_RETURN(D.experts_down, rnd(E * H, D.moe_inter, true));
      if (c.n_shared_experts > 0) {
        D.shared_inter = c.moe_intermediate_size * c.n_shared_experts;
        LS_ASSIGN_OR_RETURN(D.shared_gate_up, rnd(2 * D.shared_inter, H, true));
        LS_ASSIGN_OR_RETURN(D.shared_down, rnd(H, D.shared_inter, true));
      }
      D.experts = E;
    }
    // Rank mode: the rank's part of the same random tensors (each made whole, then cut).
    if (rank_ >= 0) LS_RETURN_IF_ERROR(ShardLayer(D, l, s));
  }
  return Status::Ok();
}

Status CudaBackend::AllocateCache(const PagedKvCache& cache) {
  const ModelConfig& c = model_->config();
  num_pages_ = cache.max_pages();
  fp8_index_keys_ = cache.fp8_index_keys();
  page_size_ = cache.page_size();
  format_ = ToLatentFormat(cache.format());
  latent_bytes_ = cu::LatentBytesPerToken(format_, c.kv_lora_rank, c.qk_rope_head_dim);
  if (latent_bytes_ != cache.latent_bytes_per_token()) {
    return Status::Internal("cuda backend: latent bytes per token " + std::to_string(latent_bytes_) +
                            " differ from the host cache's " + std::to_string(cache.latent_bytes_per_token()));
  }
  const int64_t slots = num_pages_ * page_size_;
  latent_pool_.resize(c.num_hidden_layers);
  index_pool_.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LS_ASSIGN_OR_RETURN(latent_pool_[l], cu::DeviceBuffer::Allocate(static_cast<size_t>(slots * latent_bytes_)));
    LS_RETURN_IF_ERROR(latent_pool_[l].Fill(0));
    if (c.layers[l].attention == AttentionKind::kMlaSparse) {
      // fp32 keys, or FP8 rows (indexer=fp8_paged): the host cache's stream decides.
      const int64_t key_bytes = cache.streams(l).at(1).bytes_per_token;
      LS_ASSIGN_OR_RETURN(index_pool_[l], cu::DeviceBuffer::Allocate(static_cast<size_t>(slots * key_bytes)));
      LS_RETURN_IF_ERROR(index_pool_[l].Fill(0));
    }
  }
  // RoPE tables for every position the cache can hold.
  rope_positions_ = std::min<int64_t>(slots, c.max_position_embeddings);
  std::vector<float> cs, sn;
  model_->RopeTable(rope_positions_, &cs, &sn);
  LS_ASSIGN_OR_RETURN(rope_cos_, Upload(cs.data(), rope_positions_, c.qk_rope_head_dim / 2, false));
  LS_ASSIGN_OR_RETURN(rope_sin_, Upload(sn.data(), rope_positions_, c.qk_rope_head_dim / 2, false));
  return Status::Ok();
}

Status CudaBackend::EnsureZeroIds(int64_t rows) {
  LS_RETURN_IF_ERROR(zero_ids_.Ensure(static_cast<size_t>(rows) * 4));
  // A new buffer (a new size: Ensure grows by half at least) is zeroed once. Never inside a
  // graph capture: a shape's first step runs uncaptured and grows every buffer.
  if (zero_rows_ != static_cast<int64_t>(zero_ids_.buf.size() / 4)) {
    // A memset, not a kernel: the GEMVs reading these ids do so before waiting for the kernel
    // launched just before them (ExpertGemmParams::ids_fixed), which a memset node precedes whole.
    LS_RETURN_IF_ERROR(cu::MemsetAsync(zero_ids_.buf.data(), 0, zero_ids_.buf.size(), stream_->get()));
    zero_rows_ = static_cast<int64_t>(zero_ids_.buf.size() / 4);
  }
  return Status::Ok();
}

Result<cu::ExpertGemmParams> CudaBackend::DotParams(const float* x, int64_t x_stride, int64_t rows,
                                                   const DevTensor& wt, float* y, int64_t y_stride) {
  LS_RETURN_IF_ERROR(EnsureZeroIds(rows));
  cu::ExpertGemmParams g;
  g.rows = rows;
  g.k = 1;
  g.experts = 1;
  g.out = wt.rows;
  g.in = wt.cols;
  wt.Bind(&g, 0, wt.rows);  // one expert: only e = 0 is ever read
  g.x = x;
  g.x_stride = x_stride;
  g.round_x_bf16 = wt.bf16;
  g.ids = zero_ids_.as<int32_t>();
  g.ids_fixed = true;
  g.y = y;
  g.y_stride = y_stride;
  return g;
}

Status CudaBackend::Linear(const float* x, int64_t x_stride, int64_t rows, const DevTensor& wt, float* y,
                           int64_t y_stride) {
  return LinearCols(x, x_stride, rows, wt, 0, wt.cols, y, y_stride);
}

Status CudaBackend::SampleOnDevice(std::span<const Segment> segs, int64_t V, cu::Stream s) {
  sampled_.clear();
  if (!device_sampler_) return Status::Ok();
  for (size_t i = 0; i < segs.size(); ++i) {
    if (segs[i].sampling != nullptr) sampled_.push_back(i);
  }
  const int64_t n = static_cast<int64_t>(sampled_.size());
  if (n == 0) return Status::Ok();
  // Each sampled segment's last row in logits_dev_, whose rows are the segments' in order (all
  // of an all_logits segment's, else its last). One row per segment, all sampled: no gather.
  std::vector<int32_t> rows(static_cast<size_t>(n));
  bool contiguous = n == static_cast<int64_t>(segs.size());
  int64_t lr = 0;
  size_t next = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t nrows = segs[i].all_logits ? static_cast<int64_t>(segs[i].tokens.size()) : 1;
    contiguous = contiguous && nrows == 1;
    if (next < sampled_.size() && sampled_[next] == i) rows[next++] = static_cast<int32_t>(lr + nrows - 1);
    lr += nrows;
  }
  // Host (pinned) and device: [n requests][n outputs][n row ids]; then, on the device only, the
  // sampler's workspace and the gathered rows.
  const size_t req_bytes = n * sizeof(cu::SampleRequest), out_bytes = n * sizeof(cu::SampleOutput);
  const size_t row_off = req_bytes + out_bytes, head = row_off + n * sizeof(int32_t);
  const size_t ws_off = (head + 255) / 256 * 256, ws_bytes = cu::SamplerWorkspaceBytes(n, V);
  const size_t gather_off = (ws_off + ws_bytes + 255) / 256 * 256;
  if (sample_host_.size() < head) {
    LS_ASSIGN_OR_RETURN(sample_host_, cu::PinnedBuffer::Allocate(head * 2));
  }
  auto* req = sample_host_.as<cu::SampleRequest>();
  bool all_greedy = true;
  for (int64_t j = 0; j < n; ++j) {
    const Segment& g = segs[sampled_[j]];
    req[j] = cu::SampleRequest{g.sampling->temperature, g.sampling->top_k, g.sampling->top_p, g.sampling->min_p,
                               g.sampling->seed, g.sample_step};
    all_greedy = all_greedy && g.sampling->temperature <= 0.0;
  }
  std::memcpy(sample_host_.as<char>() + row_off, rows.data(), n * sizeof(int32_t));
  LS_RETURN_IF_ERROR(sample_dev_.Ensure(gather_off + (contiguous ? 0 : static_cast<size_t>(n * V) * 4)));
  char* d = sample_dev_.as<char>();
  LS_RETURN_IF_ERROR(cu::CopyAsync(d, sample_host_.data(), head, s));  // one copy (the outputs' bytes ride along)
  const float* logits = logits_dev_.as<float>();
  if (!contiguous) {
    cu::GatherRowsParams gp;
    gp.src = logits;
    gp.src_rows = lr;
    gp.src_stride = V * 4;
    gp.rows = reinterpret_cast<const int32_t*>(d + row_off);
    gp.n = n;
    gp.dst = d + gather_off;
    gp.dst_stride = V * 4;
    gp.row_bytes = V * 4;
    LS_RETURN_IF_ERROR(cu::GatherRows(gp, s));
    logits = reinterpret_cast<const float*>(d + gather_off);
  }
  cu::SamplerParams sp;
  sp.batch = n;
  sp.vocab = V;
  sp.logits = logits;
  sp.logits_stride = V;
  sp.requests = reinterpret_cast<const cu::SampleRequest*>(d);
  sp.out = reinterpret_cast<cu::SampleOutput*>(d + req_bytes);
  sp.workspace = d + ws_off;
  sp.workspace_bytes = ws_bytes;
  sp.all_greedy = all_greedy;
  LS_RETURN_IF_ERROR(cu::Sample(sp, s));
  return cu::CopyAsync(sample_host_.as<char>() + req_bytes, d + req_bytes, out_bytes, s);
}

Status CudaBackend::CollectSamples(std::span<const Segment> segs, ForwardOutput* out) const {
  out->samples.clear();
  if (sampled_.empty()) return Status::Ok();
  out->samples.assign(segs.size(), std::nullopt);
  const auto* o = reinterpret_cast<const cu::SampleOutput*>(sample_host_.as<char>() +
                                                            sampled_.size() * sizeof(cu::SampleRequest));
  const int64_t V = model_->config().vocab_size;
  for (size_t j = 0; j < sampled_.size(); ++j) {
    if (o[j].token < 0 || o[j].token >= V) {
      return Status::Internal("cuda backend: the device sampler gave token " + std::to_string(o[j].token) +
                              " for request " + std::to_string(segs[sampled_[j]].request_id));
    }
    SampleResult r;
    r.token = o[j].token;
    r.probability = o[j].probability;
    r.uniform = o[j].uniform;
    r.counter = o[j].counter;
    r.candidates = o[j].candidates;
    out->samples[sampled_[j]] = r;
  }
  return Status::Ok();
}

Result<float*> CudaBackend::SwiGluAct(const DevTensor& gate_up, int64_t inter, const float* x, int64_t rows,
                                      int ranks) {
  // gate_up: [R, 2I] (gate then up), act: [R, I]; both in the `gather_` scratch. x is the
  // caller's (already through FP8 under gemm=w8a8_dot).
  const ModelConfig& c = model_->config();
  const int64_t H = c.hidden_size;
  LS_RETURN_IF_ERROR(gather_.Ensure(static_cast<size_t>(rows * 3 * inter) * 4));
  float* gu = gather_.as<float>();
  float* act = gu + rows * 2 * inter;
  // The dot products' bulk shape (decode's few rows) forms the activations in its epilogue: the
  // same bits as the product and SwiGlu, one launch and one wait fewer on the side stream's
  // chain. bf16 weights only: measured on the H200 (2026-11-30, V2-Lite batch 1), bf16_dot
  // 402.5 → 412.2 tok/s, but fp8_dot 430.2 → 424.5.
  bool fused = false;
  if (dot_ && rows > 0 && gate_up.bf16) {
    LS_ASSIGN_OR_RETURN(cu::ExpertGemmParams g, DotParams(x, H, rows, gate_up, act, inter));
    g.swiglu_inter = inter;
    if (cu::ExpertGemmSwiGluFits(g)) {
      LS_RETURN_IF_ERROR(cu::ExpertGemm(g, launch_));
      fused = true;
    }
  }
  if (!fused) {
    LS_RETURN_IF_ERROR(Linear(x, H, rows, gate_up, gu, 2 * inter));
    cu::SwiGluParams sp;
    sp.g = gu;
    sp.g_stride = 2 * inter;
    sp.u = gu + inter;
    sp.u_stride = 2 * inter;
    sp.out = act;
    sp.out_stride = inter;
    sp.rows = rows;
    sp.n = inter;
    LS_RETURN_IF_ERROR(cu::SwiGlu(sp, launch_));
  }
  // gemm=w8a8_dot: the down projection's input through FP8 too (in place: only it reads act),
  // each emulated rank's slice from its own start.
  for (int q = 0; w8a8_ && q < ranks; ++q) {
    const Shard sh = ShardOf(inter, ranks, q);
    LS_RETURN_IF_ERROR(cu::Fp8RoundTrip(act + sh.begin, inter, act + sh.begin, inter, rows, sh.end - sh.begin, launch_));
  }
  return act;
}

Status CudaBackend::SwiGluMlp(const DevTensor& gate_up, const DevTensor& down, int64_t inter, const float* x,
                              int64_t rows, float* y) {
  LS_ASSIGN_OR_RETURN(float* act, SwiGluAct(gate_up, inter, x, rows));
  return Linear(act, inter, rows, down, y, model_->config().hidden_size);
}

Status CudaBackend::MlpPartials(const DevTensor& gate_up, const DevTensor& down, int64_t inter, const float* x,
                                int64_t rows, int ranks, float* partials) {
  // Gate and up are column-parallel (each output the same bits as on one device), the down
  // projection row-parallel over the intermediate dims.
  LS_ASSIGN_OR_RETURN(float* act, SwiGluAct(gate_up, inter, x, rows, ranks));
  return RowParallel(act, inter, rows, down, ranks, 1, partials);
}

Status CudaBackend::LinearCols(const float* x, int64_t x_stride, int64_t rows, const DevTensor& wt, int64_t k0,
                               int64_t k1, float* y, int64_t y_stride) {
  if (rows == 0) return Status::Ok();
  if (k0 < 0 || k1 > wt.cols || k0 >= k1) {
    return Status::Internal("cuda backend: LinearCols [" + std::to_string(k0) + ", " + std::to_string(k1) +
                            ") is not inside the weight's " + std::to_string(wt.cols) + " columns");
  }
  const int64_t n = k1 - k0, es = static_cast<int64_t>(wt.element_bytes());
  if (dot_) {
    LS_ASSIGN_OR_RETURN(cu::ExpertGemmParams g, DotParams(x + k0, x_stride, rows, wt, y, y_stride));
    g.in = n;
    g.w = static_cast<const char*>(wt.ptr()) + k0 * es;
    if (wt.fp8 && k0 % 128 == 0) {
      g.w_scale = wt.scale.as<const float>() + k0 / 128;  // the slice starts a scale block
    } else if (wt.fp8) {
      // Off the scale blocks: the slice's weight values as fp32 (the kernels' FP8 values), and
      // the product over them — the same values, the same order, the same bits.
      LS_RETURN_IF_ERROR(tp_w_.Ensure(static_cast<size_t>(wt.rows * n) * 4));
      const cu::Fp8SliceParams fp = Fp8Slice(wt, k0, n, tp_w_.as<float>());
      LS_RETURN_IF_ERROR(cu::Fp8SliceToF32(fp, launch_));
      g.w = fp.out;
      g.w_fp8 = false;
      g.w_scale = nullptr;
      g.w_row_stride = n;
      g.w_expert_stride = wt.rows * n;
    }
    return cu::ExpertGemm(g, launch_);
  }
  if (wt.fp8) return Status::Internal("cuda backend: FP8 weights outside gemm=*_dot");
  cu::GemmParams p;
  p.rows = rows;
  p.out = wt.rows;
  p.in = n;
  p.w = static_cast<const char*>(wt.ptr()) + k0 * es;
  p.w_stride = wt.cols;
  p.y = y;
  p.y_stride = y_stride;
  // On the side stream: its own conversion buffer and cuBLASLt workspace (the same pinned
  // algorithms: the heuristic's answer depends only on the shape, so the same bits).
  const bool side = launch_ != stream_->get();
  if (!wt.bf16) {
    p.x = x + k0;
    p.x_stride = x_stride;
    return (side ? gemm_f32_side_ : gemm_f32_)->Run(p, launch_);
  }
  Scratch& xb = side ? xb_side_ : xb_;
  LS_RETURN_IF_ERROR(xb.Ensure(static_cast<size_t>(rows * n) * 2));
  LS_RETURN_IF_ERROR(cu::ToBf16(x + k0, x_stride, xb.as<uint16_t>(), n, rows, n, launch_));
  p.x = xb.as<uint16_t>();
  p.x_stride = n;
  return (side ? gemm_bf16_side_ : gemm_bf16_)->Run(p, launch_);
}

Status CudaBackend::RowParallel(const float* x, int64_t x_stride, int64_t rows, const DevTensor& wt, int ranks,
                                int64_t unit, float* partials) {
  const int64_t units = wt.cols / unit;
  for (int r = 0; r < ranks; ++r) {
    const Shard s = ShardOf(units, ranks, r);
    LS_RETURN_IF_ERROR(
        LinearCols(x, x_stride, rows, wt, s.begin * unit, s.end * unit, partials + r * wt.rows, ranks * wt.rows));
  }
  return Status::Ok();
}

}  // namespace cuda_impl

Result<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<Model> model, const PagedKvCache& cache,
                                                   const kernels::KernelPlan& plan, const BackendOptions& options) {
  return cuda_impl::CudaBackend::Create(std::move(model), cache, plan, options);
}

}  // namespace lockstep::engine
