// kernels/cuda/ops.h — the CUDA kernels of lockstep, callable from plain C++.
//
// This header includes no CUDA header, so CPU-only code (the engine, the CLI, tests built
// without a GPU) can include it; the definitions live in kernels/cuda/*.cu and exist only
// when the build found a CUDA toolkit (LOCKSTEP_HAVE_CUDA).
//
// Every launcher takes one flat params struct (FlashMLA's csrc/params.h style): raw device
// pointers, a shape comment on each tensor and explicit strides in elements. Launchers
// validate every host-visible field before the launch and name the one at fault; they are
// asynchronous on `stream` (nullptr = the legacy default stream) and return launch errors
// only. Facts that live in device memory (page ids, sequence lengths, positions, slots)
// cannot be checked on the host: kernels that read them report a violation by OR-ing a
// KernelError bit into `error_flag` (optional, a device int32 the caller zeroes) and treat
// the offending key/row as absent; tests read the flag back.
//
// Numerics (docs/determinism.md): each kernel has one fixed reduction order that depends
// on the operand lengths only — never on the batch, the grid, the device's SM count or the
// timing — so a request's output bits are the same at batch 1 and batch 64 and from run to
// run. Where a kernel names its CPU twin as "bitwise", it reproduces the CPU reference's
// exact fp32 operation sequence (explicit FMAs, no contraction: the library is built with
// --fmad=false, like the CPU's -ffp-contract=off).
//
// Thread-safety: launchers are stateless and may be called from any thread. A Gemm object
// holds a cuBLASLt handle and workspace and must be used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace lockstep::kernels::cuda {

using Stream = CUstream_st*;

// ---------------------------------------------------------------------------------------
// Device, memory

// Number of usable CUDA devices; 0 when there is no driver or no device (never fails).
int DeviceCount();
// "NVIDIA H200 (sm_90, 132 SMs)" for device 0, or the reason there is none.
std::string DeviceDescription();
// Multiprocessors of device 0 (read once); 1 when there is no device.
int SmCount();
// Programmatic dependent launch (sm_90+; docs/gpu.md "Overlapped launches"): every kernel of
// this folder may be scheduled while the kernel before it on its stream is still running; it
// waits for that kernel's results (griddepcontrol.wait) before it reads or writes anything
// but constant weights, so results are the same bits either way. On by default where the
// device supports it; SetOverlappedLaunch(false) turns it off for the calling thread's later
// launches (and for CUDA graphs that thread captures). Returns the setting it replaced.
bool SetOverlappedLaunch(bool on);
// Whether the calling thread's launches overlap (the setting and the device's support).
bool OverlappedLaunch();
// Marks the span an external profiler (ncu --profile-from-start off) collects; no-ops otherwise.
void ProfilerStart();
void ProfilerStop();

// A device allocation, freed on destruction. Move-only. Not thread-safe.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // cudaMalloc of `bytes` (0 gives an empty buffer).
  static Result<DeviceBuffer> Allocate(size_t bytes);

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

  // Synchronous copies; offsets and sizes in bytes, checked against size().
  Status CopyFromHost(const void* src, size_t bytes, size_t offset = 0);
  Status CopyToHost(void* dst, size_t bytes, size_t offset = 0) const;
  Status Fill(uint8_t byte);  // cudaMemset of the whole buffer

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// cudaDeviceSynchronize, reporting any error a kernel left behind.
Status Synchronize();
// cudaStreamSynchronize(stream).
Status SynchronizeStream(Stream stream);

// Bits kernels OR into `error_flag` when device-resident arguments break their contract.
enum KernelError : int32_t {
  kErrSeqLen = 1,     // seq_lens[b] < 0, > max_seq_len, or beyond the page table
  kErrPageId = 2,     // a page-table entry outside [0, num_pages)
  kErrSlot = 4,       // a global slot outside [-1, num_pages·page_size)
  kErrPosition = 8,   // a RoPE position outside [0, max_position)
  kErrToken = 16,     // an embedding id outside [0, vocab)
  kErrExpert = 32,    // an expert id outside [0, experts)
};

// ---------------------------------------------------------------------------------------
// Formats: the latent cache's bytes per token, as engine/kv_cache.h (docs/kv-cache.md):
//   fp32     (kv_lora + rope) fp32
//   bf16     (kv_lora + rope) bf16, round to nearest even
//   fp8_e4m3 kv_lora e4m3 | ceil(kv_lora/128) fp32 power-of-two scales | rope bf16
//            (FlashMLA's V3.2 layout: 656 bytes for 512 + 64)
// The enumerators are in engine::KvFormat's order.
enum class LatentFormat : int32_t { kFp32 = 0, kBf16 = 1, kFp8E4m3 = 2 };
inline constexpr int64_t kFp8TileValues = 128;  // latent values per fp32 scale
int64_t LatentBytesPerToken(LatentFormat f, int64_t kv_lora, int64_t rope_dim);

// ---------------------------------------------------------------------------------------
// RMSNorm: y = weight · (x · 1/sqrt(mean(x²) + eps)), one CTA per row.
// Sum of squares in fp32 (no fp64): 256 threads each accumulate x[i]² by FMA over
// i ≡ thread (mod 256), then a fixed butterfly tree over lanes and warps. The order depends
// on n only. Twin: cpu::RmsNorm (which sums in fp64) within a bound derived from that tree.
struct RmsNormParams {
  const float* x = nullptr;       // [rows, n], row stride x_stride
  int64_t x_stride = 0;
  const float* weight = nullptr;  // [n]
  float* y = nullptr;             // [rows, n], row stride y_stride (may alias x when equal strides)
  int64_t y_stride = 0;
  int64_t rows = 0, n = 0;
  float eps = 1e-6f;
  // Residual add fused in (optional): the row normalised is s = x + add (one rounding, as
  // Add), which is also written to sum (may alias x). The decode step's residual adds.
  const float* add = nullptr;
  int64_t add_stride = 0;
  float* sum = nullptr;
  int64_t sum_stride = 0;
  // The hidden fault zoo (kernels/hidden_fault.h, cuda_norm_mean_n_minus_1; tests only): the
  // mean of squares over n − 1. The engine sets it from its plan; false everywhere else.
  bool fault_mean_n_minus_1 = false;
};
Status RmsNorm(const RmsNormParams& p, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------
// RoPE in place over [rows, heads, dim] vectors at per-row positions. The three styles are
// engine/config.h's RopeStyle. Bitwise twin: cpu::RopePairsAdjacent / RopePairsToHalves /
// RopeHalves (each output is a·cos − b·sin or b·cos + a·sin with separate roundings).
enum class RopeStyle : int32_t { kPairsAdjacent = 0, kPairsToHalves = 1, kHalves = 2 };
struct RopeParams {
  float* x = nullptr;                // [rows, heads, dim]: (r, h, i) at x[r·row_stride + h·head_stride + i]
  int64_t row_stride = 0, head_stride = 0;
  int64_t rows = 0, heads = 0, dim = 0;  // dim even, ≤ 2048
  const int32_t* positions = nullptr;    // [rows] device
  const float* cos = nullptr;            // [max_position, dim/2] (attention factor applied)
  const float* sin = nullptr;            // [max_position, dim/2]
  int64_t max_position = 0;
  RopeStyle style = RopeStyle::kPairsAdjacent;
  int32_t* error_flag = nullptr;  // optional; kErrPosition
  // The hidden fault zoo (cuda_latent_rope_pos_minus_1; tests only): rows at p > 0 rotate at
  // p − 1 — honoured by WriteLatentPath's key only.
  bool fault_pos_minus_1 = false;
};
Status Rope(const RopeParams& p, Stream stream = nullptr);

// In-place Walsh–Hadamard transform (Sylvester order) of `rows` vectors of n values (n a power
// of two, ≤ 4096), vector r at x + r·stride, scaled by float(n^-1/2): cpu::Hadamard's
// butterflies (each a single fp32 add or subtract of the same pair) and scaling, bitwise. The
// V3.2 indexer's rotation of q and k (--kernel indexer=hadamard).
Status Hadamard(float* x, int64_t stride, int64_t rows, int64_t n, Stream stream = nullptr);

// engine::Fp8RoundTrip row by row (gemm=w8a8_dot's activations): per tile of 128 values from
// each row's start, y = e4m3(x / s)·s with the tile's power-of-two scale s (engine/kv_cache.cc
// Fp8TileScale: 2^ceil(log2(amax / 448)), 1 when amax is 0 or not finite; NaN is ignored by the
// amax and stays NaN) — bitwise the CPU's. y may be x when the strides are equal.
Status Fp8RoundTrip(const float* x, int64_t x_stride, float* y, int64_t y_stride, int64_t rows, int64_t n,
                    Stream stream = nullptr);


// ---------------------------------------------------------------------------------------
// Latent-cache write (quantise on write). Row r goes to global slot slots[r]
// (= page · page_size + offset) of a pool of `num_slots` tokens. The bytes are identical to
// engine::PagedKvCache::WriteLatent's for every format, NaN/Inf/subnormals included.
struct LatentWriteParams {
  const float* latent = nullptr;  // [rows, kv_lora], row stride latent_stride
  int64_t latent_stride = 0;
  const float* rope = nullptr;    // [rows, rope_dim], row stride rope_stride (already RoPE'd)
  int64_t rope_stride = 0;
  const int32_t* slots = nullptr; // [rows] device; −1 skips the row; null: row r to slot r
  uint8_t* cache = nullptr;       // [num_slots, LatentBytesPerToken(format, kv_lora, rope_dim)]
  int64_t num_slots = 0;
  int64_t rows = 0, kv_lora = 0, rope_dim = 0;
  LatentFormat format = LatentFormat::kFp8E4m3;
  int32_t* error_flag = nullptr;  // optional; kErrSlot
  // Optional: each written row's stored bytes also at copy + r·LatentBytesPerToken (a
  // contiguous copy of the step's new cache rows, for the host's mirror of the cache).
  uint8_t* copy = nullptr;
};
Status WriteLatent(const LatentWriteParams& p, Stream stream = nullptr);
// A decode step's latent-cache path in one kernel, one CTA a row: RmsNorm(norm) of the latent,
// Rope(rope) of the rope key (one head, in place), then WriteLatent(write) of both — the three
// ops' bits in their order. write.latent must be norm.y and write.rope rope.x (same strides); no
// residual add; the rows agree.
Status WriteLatentPath(const RmsNormParams& norm, const RopeParams& rope, const LatentWriteParams& write,
                       Stream stream = nullptr);

// ---------------------------------------------------------------------------------------
// MLA absorbed decode over the paged latent cache (one query token per request).
//   score_t = (q_latent·c_t + q_rope·k_rope_t) · softmax_scale    (c_t, k_rope_t dequantised)
//   o_latent = Σ_t softmax(score)_t · c_t,   lse = log Σ_t exp(score_t)
// The caller applies W_UV and o_proj afterwards. Dense: keys 0..seq_lens[b]−1 through the
// page table. Sparse (MlaSparseDecode): keys are global slots indices[b][0..topk), −1 = none.
//
// Fixed order: score dot products are cpu::Dot's (16 FMA lanes, pairwise fold; bitwise the
// CPU's scores). Each request's keys are cut into splits whose length depends on the
// request's own key count only (MlaSplitKeys); a CTA runs one split for 16 heads with an
// online softmax over 32-key tiles in ascending order; a combine kernel merges the splits in
// ascending order. Nothing depends on the batch or on the hardware, hence batch-invariant.
// fp32 throughout, exp by dev::ExpF: the output is cpu::MlaAttend's bits (the CPU's absorbed
// attention; kernels/mla_splits.h holds the split rule both follow). Limits: kv_lora ≤ 512,
// rope_dim ≤ 64.
struct MlaDecodeParams {
  int64_t batch = 0, heads = 0, kv_lora = 0, rope_dim = 0;
  LatentFormat format = LatentFormat::kFp8E4m3;
  float softmax_scale = 0.0f;

  const float* q_latent = nullptr;  // [batch, heads, kv_lora]: (b, h, i) at b·q_latent_batch_stride + h·q_latent_head_stride + i
  int64_t q_latent_batch_stride = 0, q_latent_head_stride = 0;
  const float* q_rope = nullptr;    // [batch, heads, rope_dim], RoPE applied
  int64_t q_rope_batch_stride = 0, q_rope_head_stride = 0;

  const uint8_t* cache = nullptr;   // [num_pages, page_size, LatentBytesPerToken(...)]
  int64_t num_pages = 0, page_size = 0;

  // Dense keys (MlaDecode).
  const int32_t* page_table = nullptr;  // [batch, page_table_stride] physical page ids
  int64_t page_table_stride = 0;
  const int32_t* seq_lens = nullptr;    // [batch] keys per request (device)
  int64_t max_seq_len = 0;              // host upper bound on seq_lens (sizes the grid)

  // Sparse keys (MlaSparseDecode).
  const int32_t* indices = nullptr;     // [batch, indices_stride ≥ topk] global slots, −1 = none
  int64_t indices_stride = 0, topk = 0;

  float* o_latent = nullptr;  // [batch, heads, kv_lora]: (b, h, i) at b·o_batch_stride + h·o_head_stride + i
  int64_t o_batch_stride = 0, o_head_stride = 0;
  float* lse = nullptr;       // [batch, heads] contiguous, natural log; optional (−inf when no key)

  void* workspace = nullptr;  // MlaDecodeWorkspaceBytes(*this) bytes, 256-byte aligned
  size_t workspace_bytes = 0;
  int32_t* error_flag = nullptr;  // optional; kErrSeqLen | kErrPageId | kErrSlot
  // Heads a split CTA takes: 0 picks by the grid's size (16; 8 when 16 would leave SMs idle; 1
  // when 8 still would at one or two requests: batch-1 decode); 1, 8 or 16 force it (tests,
  // benchmarks). Speed only: the same bits.
  int32_t heads_per_cta = 0;
  // How a split CTA reads its keys: 0 picks (tiles staged in shared memory by 16-byte copies,
  // the next tile's in flight during this one's arithmetic, with one head a CTA when a token's
  // bytes are whole 16-byte chunks of a bf16 or fp8 cache; else row by row); 1 row by row; 2
  // staged wherever the format allows. Speed only: the same bits.
  int32_t key_staging = 0;
};
// Keys per split for a request with n keys: 32 (one tile) up to 2048 keys, then the smallest
// multiple of 32 that keeps the request at ≤ 64 splits. A function of n alone.
int64_t MlaSplitKeys(int64_t n_keys);
size_t MlaDecodeWorkspaceBytes(const MlaDecodeParams& p);  // dense or sparse, by indices != nullptr
Status MlaDecode(const MlaDecodeParams& p, Stream stream = nullptr);
Status MlaSparseDecode(const MlaDecodeParams& p, Stream stream = nullptr);

// An MLA decode's split results before their combine, in its workspace: what
// ExpertGemmParams::x_partials merges where it reads them (kernels/cuda/mla_combine.cuh).
struct MlaPartials {
  const float* o = nullptr;  // [batch, heads, splits, kv_lora] unnormalised outputs
  const float* m = nullptr;  // [batch, heads, splits] running maxima
  const float* l = nullptr;  // [batch, heads, splits] sums of exp
  int64_t batch = 0, heads = 0, kv_lora = 0, splits = 0;  // splits: allocated per (request, head)
  // Request b's key count, as the decode reads it: seq_lens[b] (dense; 0 outside
  // [0, min(max_seq_len, key_capacity)]), or topk where seq_lens is null (sparse).
  const int32_t* seq_lens = nullptr;
  int64_t max_seq_len = 0, key_capacity = 0, topk = 0;
};
// MlaDecode (MlaSparseDecode) without its combine: the split kernel alone, and `partials`
// describes what it writes into p.workspace (valid until the workspace is written again). The
// combine is then the reader's: ExpertGemm with x_partials (the W_UV absorption) forms
// o_latent's rows as MlaDecode's combine kernel would, bit for bit, one launch fewer.
// p.o_latent and p.lse are not written.
Status MlaDecodeSplits(const MlaDecodeParams& p, MlaPartials* partials, Stream stream = nullptr);
Status MlaSparseDecodeSplits(const MlaDecodeParams& p, MlaPartials* partials, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------
// V3.2 lightning indexer, reference variant (engine/model.cc):
//   score[b, t] = Σ_h w[b,h] · ReLU(Dot(q[b,h], k_t) · key_scale),  t < seq_lens[b]
// with h summed in ascending order and Dot = cpu::Dot: bitwise the CPU's scores.
// Positions ≥ seq_lens[b] (up to max_seq_len) get −inf.
struct IndexerScoreParams {
  int64_t batch = 0, heads = 0, head_dim = 0;  // heads·head_dim ≤ 16384, head_dim ≤ 256
  const float* q = nullptr;        // [batch, heads, head_dim]: (b, h, i) at b·q_batch_stride + h·q_head_stride + i
  int64_t q_batch_stride = 0, q_head_stride = 0;
  const float* weights = nullptr;  // [batch, heads] (already × heads^-0.5), row stride weights_stride
  int64_t weights_stride = 0;
  float key_scale = 0.0f;          // head_dim^-0.5
  const float* keys = nullptr;     // [num_pages, page_size, head_dim] indexer keys, fp32
  // indexer=fp8_paged instead of q and keys: FP8 rows (engine::QuantizeFp8Row's layout, which
  // WriteLatent's fp8 format without rope writes), q_fp8 [batch·heads] (row b·heads + h) and
  // keys_fp8 [num_pages·page_size]. Then Dot(q_h, k_t) above is float(engine::Fp8RowDot):
  // exact per 128-value tile in fp64 whatever the order, so the kernel tiles freely.
  const uint8_t* q_fp8 = nullptr;
  const uint8_t* keys_fp8 = nullptr;
  int64_t num_pages = 0, page_size = 0;
  const int32_t* page_table = nullptr;  // [batch, page_table_stride]
  int64_t page_table_stride = 0;
  const int32_t* seq_lens = nullptr;    // [batch] causal key counts (position + 1)
  int64_t max_seq_len = 0;
  float* scores = nullptr;              // [batch, scores_stride ≥ max_seq_len]
  int64_t scores_stride = 0;
  int32_t* error_flag = nullptr;        // optional; kErrSeqLen | kErrPageId
};
Status IndexerScores(const IndexerScoreParams& p, Stream stream = nullptr);

// Deterministic top-k per row: the k = min(topk, seq_lens[b]) best positions by
// (score descending, position ascending) — −0 equals +0; NaN ranks below −∞ (the CPU
// reference leaves NaN order unspecified) — written in ascending position order, −1 after.
// Exact radix select on the scores' order-preserving bit patterns; one CTA per row.
struct TopKParams {
  int64_t batch = 0, topk = 0;
  const float* scores = nullptr;   // [batch, scores_stride]
  int64_t scores_stride = 0;
  const int32_t* seq_lens = nullptr;  // [batch] valid scores per row (device)
  int64_t max_seq_len = 0;
  int32_t* positions = nullptr;    // [batch, topk] ascending, −1 padding
  // Optional: also write global slots (page·page_size + offset) for MlaSparseDecode.
  int32_t* slots = nullptr;        // [batch, topk], −1 padding
  const int32_t* page_table = nullptr;  // [batch, page_table_stride]; needed with slots
  int64_t page_table_stride = 0, page_size = 0, num_pages = 0;
  int32_t* error_flag = nullptr;   // optional; kErrSeqLen | kErrPageId
};
Status TopK(const TopKParams& p, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------
// Sampler: engine/sampler.cc's algorithm (docs/sampling.md) on the GPU. Greedy rows: argmax,
// lowest id on ties, NaN = −∞. Other rows: ids sorted by (logit desc, id asc) with a stable
// radix sort; fp64 weights exp((l − l0)/T); the CPU's left-to-right fp64 running sums, bitwise
// (SequentialPrefixSums' passes, one CTA a request); top-p / min-p / inverse-CDF cut points
// found as "first index satisfying", exactly the CPU loops' answers; the draw is
// kernels/philox.h's PhiloxUniform.
// The only possible divergence is CUDA's double exp vs glibc's (≤ 1 ulp), which can change
// a token only when u·S lies within ~1e-16 relative of a cumulative boundary.
struct SampleRequest {  // mirrors engine::SamplingParams plus the step
  double temperature = 0.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  double min_p = 0.0;
  uint64_t seed = 0;
  uint64_t step = 0;
};
struct SampleOutput {  // mirrors engine::SampleResult
  int32_t token = -1;
  int32_t reserved = 0;
  double probability = 1.0;
  double uniform = -1.0;
  uint64_t counter = 0;
  int64_t candidates = 0;
};
struct SamplerParams {
  int64_t batch = 0, vocab = 0;            // batch ≤ 65535, batch·vocab < 2^31
  const float* logits = nullptr;           // [batch, vocab], row stride logits_stride
  int64_t logits_stride = 0;
  const SampleRequest* requests = nullptr; // [batch] device
  SampleOutput* out = nullptr;             // [batch] device
  void* workspace = nullptr;               // SamplerWorkspaceBytes(batch, vocab)
  size_t workspace_bytes = 0;
  // Every request has temperature ≤ 0 (the caller's promise): argmax rows only, no sort. A row
  // that breaks the promise gets token −1.
  bool all_greedy = false;
};
size_t SamplerWorkspaceBytes(int64_t batch, int64_t vocab);
Status Sample(const SamplerParams& p, Stream stream = nullptr);
// The sampler's running sums on their own (for their test): pre[i] = the fp64 sum of w[0..i]
// added left to right, up to *settled = the first i whose addition leaves the sum unchanged
// (n if none), the sum before it from there on. w [n]: finite, ≥ 0, w[0] > 0, every running
// sum finite, as the sampler's weights are (device pointers; one CTA, in parallel, bitwise the
// serial chain).
Status SequentialPrefixSums(const double* w, int64_t n, double* pre, int32_t* settled, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------
// GEMM through cuBLASLt: y[rows, out] = x[rows, in] · w[out, in]ᵀ (row-major, fp32 out).
//   kFp32Pedantic — fp32 inputs, CUBLAS_COMPUTE_32F_PEDANTIC (no TF32, no reduced
//                   precision): the reference-compatible variant.
//   kBf16         — bf16 inputs (raw uint16 bits), fp32 accumulation (CUBLAS_COMPUTE_32F):
//                   the fast variant.
// Determinism: cuBLAS is deterministic for a fixed shape, algorithm and device. Batch
// invariance is not free: its heuristics pick a kernel (tile, split-K, stream-K) per shape,
// so one row's reduction order can change with the number of rows. With pin_algorithm the
// algorithm for an (out, in) pair is chosen once, from the heuristic at a fixed reference
// row count (kGemmPinRows) with split-K excluded (reduction-scheme mask NONE, SPLITK_NUM 1),
// and reused for every row count, so a row's output no longer depends on its batch.
enum class GemmVariant : int32_t { kFp32Pedantic = 0, kBf16 = 1 };
inline constexpr int64_t kGemmPinRows = 256;
struct GemmOptions {
  GemmVariant variant = GemmVariant::kFp32Pedantic;
  bool pin_algorithm = true;  // false: cuBLASLt's heuristic per shape (deterministic, not batch-invariant)
  size_t workspace_bytes = size_t{32} << 20;
};
struct GemmParams {
  int64_t rows = 0, out = 0, in = 0;
  const void* x = nullptr;  // [rows, in] fp32 or bf16 per variant, row stride x_stride (elements)
  int64_t x_stride = 0;
  const void* w = nullptr;  // [out, in], row stride w_stride
  int64_t w_stride = 0;
  float* y = nullptr;       // [rows, out], row stride y_stride
  int64_t y_stride = 0;
};
class Gemm {
 public:
  static Result<std::unique_ptr<Gemm>> Create(const GemmOptions& options);
  ~Gemm();
  Status Run(const GemmParams& p, Stream stream = nullptr);
  // The algorithm Run would use for (rows, out, in), e.g. "algo 21 tile 15 stages 8 splitK 1".
  Result<std::string> Describe(int64_t rows, int64_t out, int64_t in);

  struct Impl;

 private:
  explicit Gemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------
// The rest of the forward pass (kernels/cuda/model_ops.cu; the grouped expert GEMM in
// expert_gemm.cu, expert_gemm_stream.cu, expert_tc.cu): embedding, elementwise ops,
// LayerNorm, MoE routing, the grouped expert GEMM and the MoE combine. Twins: engine/model.cc
// and kernels/cpu/ops.h. "Bitwise" below means the CPU's exact fp32/fp64 operation sequence.
// exp: the GPU rounds CUDA's double exp to fp32, which is the correctly rounded value in
// practice; the CPU does the same with glibc's double exp (cpu::ExpF), so SwiGlu and Route's
// softmax/sigmoid scores are the CPU's bits (glibc's expf, which neither calls, is 1 ulp off in
// ≈0.06 % of inputs).

// Embedding gather, bitwise: y[r, :] = table[ids[r], :]. An id outside [0, vocab) sets
// kErrToken and fills the row with NaN. One CTA per row.
struct EmbedParams {
  const float* table = nullptr;  // [vocab, n] contiguous
  int64_t vocab = 0, n = 0;
  const int32_t* ids = nullptr;  // [rows] device
  int64_t rows = 0;
  float* y = nullptr;            // [rows, n], row stride y_stride
  int64_t y_stride = 0;
  int32_t* error_flag = nullptr; // optional; kErrToken
};
Status Embed(const EmbedParams& p, Stream stream = nullptr);

// Residual add, bitwise the CPU's `x[i] += o[i]`: y[r, i] = y[r, i] + x[r, i] over [rows, n].
Status AddInPlace(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t rows, int64_t n,
                  Stream stream = nullptr);
// out[r, i] = a[r, i] + b[r, i] (out may be a: AddInPlace). Bitwise the CPU's x[i] += o[i].
Status Add(float* out, int64_t out_stride, const float* a, int64_t a_stride, const float* b, int64_t b_stride,
           int64_t rows, int64_t n, Stream stream = nullptr);

// x[r, i] *= s over [rows, n], bitwise.
Status Scale(float* x, int64_t stride, int64_t rows, int64_t n, float s, Stream stream = nullptr);

// fp32 → bf16 bits (round to nearest even, NaN stays a quiet NaN), bitwise kernels::F32ToBf16.
Status ToBf16(const float* x, int64_t x_stride, uint16_t* y, int64_t y_stride, int64_t rows, int64_t n,
              Stream stream = nullptr);

// out[r, i] = silu(g[r, i]) · u[r, i] with silu(v) = v / (1 + exp(−v)) — cpu::SwiGlu's
// expression order and exp (see above): its bits.
// out may alias g or u (same strides).
struct SwiGluParams {
  const float* g = nullptr;  // [rows, n], row stride g_stride
  int64_t g_stride = 0;
  const float* u = nullptr;  // [rows, n], row stride u_stride
  int64_t u_stride = 0;
  float* out = nullptr;      // [rows, n], row stride out_stride
  int64_t out_stride = 0;
  int64_t rows = 0, n = 0;
};
Status SwiGlu(const SwiGluParams& p, Stream stream = nullptr);

// LayerNorm with weight and bias (the V3.2 indexer's k_norm), bitwise cpu::LayerNorm: one
// warp per row whose lane 0 forms the fp64 mean and biased variance left to right, exactly
// the CPU's loops (O(n) serial per row: meant for n = index_head_dim = 128), then every lane
// writes float((x − mean)·inv)·weight + bias. eps is double like the CPU's (pass 1e-6, not
// 1e-6f, to get the CPU's bits).
struct LayerNormParams {
  const float* x = nullptr;       // [rows, n], row stride x_stride
  int64_t x_stride = 0;
  const float* weight = nullptr;  // [n]
  const float* bias = nullptr;    // [n]
  float* y = nullptr;             // [rows, n], row stride y_stride (may alias x with equal strides)
  int64_t y_stride = 0;
  int64_t rows = 0, n = 0;
  double eps = 1e-6;
};
Status LayerNorm(const LayerNormParams& p, Stream stream = nullptr);

// MoE routing: engine/model.cc Model::Impl::Route after the router logits, one warp per row.
// The enumerators are engine::GateKind's, in order.
//   kSoftmaxGreedy       scores = softmax(logits) (max-subtracted, fp64 sum); choice = scores
//   kSoftmaxGroupLimited as greedy, but only the topk_group groups with the largest max score
//   kSigmoidNoauxTc      scores = sigmoid(logits); choice = scores + bias; groups ranked by
//                        the sum of their top-2 choices (V3)
// Grouping applies when gate ≠ greedy and n_group > 1. Ranking is by (choice descending, id
// ascending) — std::stable_sort's answer — with NaN below −∞ (the CPU leaves NaN order
// unspecified). ids are written ascending; weights = scores[ids], divided by
// float(fp64 Σ) + 1e-20f when norm_topk_prob, then × routed_scaling_factor.
enum class GateKind : int32_t { kSoftmaxGreedy = 0, kSoftmaxGroupLimited = 1, kSigmoidNoauxTc = 2 };
inline constexpr int64_t kRouteMaxExperts = 1024;
struct RouteParams {
  const float* logits = nullptr;  // [rows, experts], row stride logits_stride (the caller's fp32 GEMM)
  int64_t logits_stride = 0;
  const float* bias = nullptr;    // [experts] e_score_correction_bias, or null (= 0)
  int64_t rows = 0, experts = 0, k = 0;  // experts ≤ kRouteMaxExperts, k ≤ experts
  int64_t n_group = 1, topk_group = 1;   // experts % n_group == 0, n_group ≤ 64
  GateKind gate = GateKind::kSoftmaxGreedy;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;  // the CPU's float(routed_scaling_factor)
  int32_t* ids = nullptr;         // [rows, k] contiguous, ascending
  float* weights = nullptr;       // [rows, k] contiguous
  // The hidden fault zoo (cuda_route_bias_in_weights; tests only): the weights from score + bias.
  bool fault_bias_in_weights = false;
};
Status Route(const RouteParams& p, Stream stream = nullptr);

// The MoE layer's entry at decode in one launch: the residual add and the FFN's RMSNorm
// (`norm`, with add and sum: RmsNorm's bits), the router logits h · routerᵀ (RowDots' bits:
// cpu::Dot of fp32 rows) and Route (`route`; its logits are `logits`) — three kernels and the
// two waits between them on the decode step's critical path. A cluster of kNormRouteCluster
// CTAs a row: each requests its share of the router's rows into shared memory before the wait
// for the previous kernel (the router is fixed), normalises the row itself, takes its
// experts' dots, and hands them to the cluster's first CTA through distributed shared memory,
// which routes and stores sum, y and the ids and weights. For routers whose fp32 rows fit the
// cluster's shared memory, rows of ≤ 4096 values and ≤ 65535 rows (NormRouteFits; V2-Lite's
// 64 × 2048 at decode and in prefill chunks of up to 65535 tokens).
inline constexpr int kNormRouteCluster = 8;
struct NormRouteParams {
  RmsNormParams norm;             // add and sum required (sum may alias x)
  const float* router = nullptr;  // [experts, norm.n] fp32, row stride router_stride (16-byte rows)
  int64_t router_stride = 0;
  float* logits = nullptr;        // [rows, experts] (stored as RowDots would), row stride logits_stride
  int64_t logits_stride = 0;
  RouteParams route;              // rows, experts, k, gate…, ids, weights (route.logits unused)
};
bool NormRouteFits(int64_t experts, int64_t n, int64_t rows);
Status NormRoute(const NormRouteParams& p, Stream stream = nullptr);

// Grouped expert GEMM for MoE. For every row r and slot j < k with e = ids[r·k + j]:
//   y[r·k + j, o] = Σ_i W[e][o, i] · x[xrow, i],   xrow = r (x_per_slot false) or r·k + j (true)
// W: [experts, out, in] fp32, bf16 (raw uint16) or FP8 e4m3 (raw bytes), element (e, o, i) at
// e·w_expert_stride + o·w_row_stride + i. An FP8 element's value is
// fp8(W[e][o, i]) × w_scale[e·w_scale_expert_stride + o·w_scale_row_stride + i / 128], one
// fp32 product rounded once (engine/weights.h's dequantisation: a row's scales for each 128
// columns, so 128 × 128 blocks and rows of stacked or sliced matrices all fit). round_x_bf16
// rounds x to bf16 first (the precision of a bf16 GEMM; the CPU engine's gemm=bf16 path). Each sum is cpu::Dot's exactly (16
// interleaved FMA chains, lane = i mod 16, pairwise fold), so y is bitwise cpu::MatMulNT of
// the same operands — and depends on `in` only, never on rows, k, the routing or the grid.
// A CTA owns (64 output rows, one expert): it gathers the slots routed to its expert and
// reads each weight row once per chunk of ≤ 8 slots (16-byte loads when W rows are 16-byte
// aligned; bf16 rows with in % 16 = 0 may stream through shared memory with cp.async, and an
// expert's chunks may spread over several CTAs — speed only, the bits are the same). An id
// outside [0, experts) sets kErrExpert and that slot's row is NaN.
struct ExpertGemmParams {
  int64_t rows = 0, k = 0, experts = 0, out = 0, in = 0;
  const void* w = nullptr;  // [experts, out, in] fp32, or bf16 when w_bf16, or e4m3 when w_fp8
  bool w_bf16 = false;
  bool w_fp8 = false;
  int64_t w_expert_stride = 0, w_row_stride = 0;  // elements
  const float* w_scale = nullptr;                 // w_fp8: a row's scale per 128 columns
  int64_t w_scale_expert_stride = 0, w_scale_row_stride = 0;  // floats; row stride ≥ ⌈in / 128⌉
  const float* x = nullptr;  // [rows or rows·k, in], row stride x_stride
  int64_t x_stride = 0;
  bool x_per_slot = false;
  bool round_x_bf16 = false;
  const int32_t* ids = nullptr;  // [rows, k] device
  // Expert parallelism (a rank's block of the routed experts): w holds experts [expert0,
  // expert0 + experts) of the ids' numbering, and with skip_foreign a slot whose id lies outside
  // them is another rank's — not computed, its y row untouched, no error. Otherwise (expert0 0)
  // an id outside [0, experts) is kErrExpert and its y row NaN.
  int32_t expert0 = 0;
  bool skip_foreign = false;
  // ids written by no kernel of the step (a dense product's 0s, the heads of the absorbed
  // products): the streaming shape requests its weights before the previous kernel finishes.
  bool ids_fixed = false;
  float* y = nullptr;            // [rows·k, out], row stride y_stride
  int64_t y_stride = 0;
  int32_t* error_flag = nullptr; // optional; kErrExpert
  // Instead of x (which is then unused): slot s = r·k + j reads the MLA decode output of request
  // r, head ids[s] — its splits merged as MlaDecode's combine merges them, the same bits — when
  // x_partials.o is set (MlaDecodeSplits). Needs in = kv_lora ≤ 4096, rows ≤ x_partials.batch,
  // experts ≤ x_partials.heads, the splits MlaDecodeSplits allocates for max_seq_len (or topk),
  // and bf16 or FP8 weights (the bulk-copy shape runs it).
  MlaPartials x_partials;
  // SwiGLU in the epilogue when > 0 (= I): the product's out = 2·I rows are [gate | up] (a
  // SwiGLU MLP's gate_up) and y receives SwiGlu(gate, up) — [rows·k, I], y_stride ≥ I, SwiGlu's
  // bits — instead of the 2·I products: one launch and one wait fewer. Only where the bulk-copy
  // shape runs (ExpertGemmSwiGluFits; an error otherwise): each CTA takes 8 gate rows and the 8
  // up rows that pair with them.
  int64_t swiglu_inter = 0;
  // The launch shape: kAuto picks by shape and device (ResolveLaunch in expert_gemm.cu);
  // the others force one, for tests (every shape gives the same bits) and benchmarks. The
  // kFast* and kStream* shapes need bf16 weights, 16-byte aligned rows and in % 16 = 0 (else
  // an error); the kFast* and kBulkBySlot shapes take FP8 weights so aligned too (kStreamBySlot
  // does not).
  enum class Launch : int32_t {
    kAuto = 0,
    kRegBySlot,    // register path, a CTA per (64 outputs, slot)
    kRegChunk,     // register path, a CTA per (64 outputs, expert), chunks of 8 slots
    kFastBySlot4,  // cp.async, 4 warps = 64 outputs per CTA, one slot per CTA
    kFastChunk4,   // cp.async, 4 warps, per-expert chunks of 8 slots spread over CTAs
    kFastBySlot1,  // cp.async, 1 warp = 16 outputs per CTA, 6 stages (few outputs, one slot)
    kFastChunk1,   // cp.async, 1 warp, per-expert chunks (a dense layer at a handful of rows)
    kStreamBySlot, // cp.async, a CTA per (16 outputs, slot), 8 lanes an output, whole rows in flight
    kBulkBySlot,   // kStreamBySlot's split with bulk copies on mbarriers (sm_90)
  };
  Launch launch = Launch::kAuto;
  // On tensor cores instead (kernels/cuda/expert_tc.cu; `launch` is then unused): bf16 x and
  // W, mma.m16n8k16 with fp32 accumulation over 32-column blocks in ascending order — one fixed
  // order of its own, deterministic and independent of rows, k and the routing (batch-invariant),
  // but not cpu::Dot's bits. gemm=bf16's routed experts. Needs ExpertGemmTcFits (an error otherwise).
  bool tensor_cores = false;
};
Status ExpertGemm(const ExpertGemmParams& p, Stream stream = nullptr);
// Whether p can run on tensor cores: bf16 weights, round_x_bf16, plain x (no x_partials, no
// SwiGLU epilogue), in % 32 = 0, 16-byte aligned W and x rows.
bool ExpertGemmTcFits(const ExpertGemmParams& p);
// Whether ExpertGemm runs p with the SwiGLU epilogue (p.swiglu_inter > 0, out = 2·swiglu_inter,
// no x_partials): p's launch — its own, or kAuto's pick — is the bulk-copy shape. Callers
// fall back to the product and SwiGlu when not.
bool ExpertGemmSwiGluFits(const ExpertGemmParams& p);

// MoE combine, bitwise engine/model.cc's loop: out[r, :] = 0; for j ascending:
// out[r, :] += y[r·k + j, :] · w[r, j] (product rounded, then the add); then
// out[r, :] += shared[r, :] when shared is not null.
struct MoeCombineParams {
  const float* y = nullptr;        // [rows·k, n], row stride y_stride
  int64_t y_stride = 0;
  const float* weights = nullptr;  // [rows, k] contiguous
  const float* shared = nullptr;   // [rows, n], row stride shared_stride, or null
  int64_t shared_stride = 0;
  float* out = nullptr;            // [rows, n], row stride out_stride
  int64_t out_stride = 0;
  int64_t rows = 0, k = 0, n = 0;
};
Status MoeCombine(const MoeCombineParams& p, Stream stream = nullptr);

// The MoE layer's exit at decode in one launch: MoeCombine (`combine`, its bits) into
// combine.out, the residual add sum = x + out (Add's), and the next RMSNorm of sum into y
// (RmsNorm's bits) — two kernels and the wait between them. A cluster of kNormRouteCluster CTAs
// a row: each combines and adds a slice of the row and hands its sums to the first CTA through
// distributed shared memory, which normalises the row after cluster.sync(). Rows of ≤ 4096
// values, ≤ 65535 rows (MoeCombineNormFits).
struct MoeCombineNormParams {
  MoeCombineParams combine;
  const float* x = nullptr;  // [rows, n] the residual, row stride x_stride
  int64_t x_stride = 0;
  float* sum = nullptr;      // [rows, n] x + out, row stride sum_stride (may alias x)
  int64_t sum_stride = 0;
  const float* weight = nullptr;  // [n] the next RMSNorm's
  float eps = 1e-6f;
  float* y = nullptr;        // [rows, n] RmsNorm(sum), row stride y_stride
  int64_t y_stride = 0;
  bool fault_mean_n_minus_1 = false;  // RmsNormParams' (hidden fault zoo)
};
bool MoeCombineNormFits(int64_t n, int64_t rows);
Status MoeCombineNorm(const MoeCombineNormParams& p, Stream stream = nullptr);

// --- emulated tensor parallelism (engine/tensor_parallel.h; kernels/cuda/tensor_parallel.cu) ---

// The order an all-reduce sums the ranks' partials in (engine/tensor_parallel.h AllReduce; the
// same order as kernels::AllReduce).
enum class ReduceOrder : int32_t {
  kRankOrder = 0,    // every element from rank 0 up
  kRing = 1,         // the buffer of rows·n elements in `ranks` chunks, chunk c from rank c + 1 round
  kRotateByRow = 2,  // the fault zoo's: row r from rank r mod ranks
};
// y[r, i] = Σ over the ranks of partials[r][q][i] ([rows][ranks][n], rank-major within a row),
// left to right in fp32 from the order's first rank.
struct AllReduceParams {
  // Element i of row r from rank q at partials[q·rank_stride + r·row_stride + i]; both 0: the
  // emulation's [rows, ranks, n] contiguous (rank_stride n, row_stride ranks·n). An all-gather's
  // rank-major [ranks, rows, n] is rank_stride rows·n, row_stride n.
  const float* partials = nullptr;
  int64_t rank_stride = 0, row_stride = 0;
  float* y = nullptr;               // [rows, n], row stride y_stride
  int64_t y_stride = 0;
  int64_t rows = 0, n = 0;
  int32_t ranks = 1;
  ReduceOrder order = ReduceOrder::kRankOrder;
};
Status AllReduce(const AllReduceParams& p, Stream stream = nullptr);

// Expert parallelism's partial outputs, bitwise engine/mla_model.cc's loop: rank q holds the
// routed experts [E·q/ranks, E·(q+1)/ranks); out[r][q][i] = 0, then for j ascending whose
// ids[r, j] is the rank's: += y[r·k + j, i] · weights[r, j] (product rounded, then the add);
// then += shared[r][q][i] when shared is not null (the rank's slice of the shared experts).
// out may be shared (in place).
struct TpExpertPartialsParams {
  const float* y = nullptr;  // [rows·k, n], row stride y_stride
  int64_t y_stride = 0;
  const float* weights = nullptr;  // [rows, k] contiguous
  const int32_t* ids = nullptr;    // [rows, k] contiguous
  int64_t experts = 0;
  const float* shared = nullptr;  // [rows, ranks, n] contiguous, or null
  float* out = nullptr;           // [rows, ranks, n] contiguous
  int64_t rows = 0, k = 0, n = 0;
  int32_t ranks = 1;
  // ≥ 0: rank `rank`'s partial alone (a real rank's, not the emulation's): shared and out are
  // [rows, n] contiguous (y computed for that rank's slots only: ExpertGemmParams::skip_foreign).
  int32_t rank = -1;
};
Status TpExpertPartials(const TpExpertPartialsParams& p, Stream stream = nullptr);

// out[r, j] = e4m3(w[r, col0 + j]) · scale[r, (col0 + j) / 128] in fp32 (ExpertGemm's FP8
// weight values): a slice of FP8 weights off their 128-column scale blocks as fp32, for a
// product over it with fp32 weights (the same values, so the same bits).
struct Fp8SliceParams {
  const uint8_t* w = nullptr;  // [rows, ≥ col0 + n], row stride w_stride bytes
  int64_t w_stride = 0;
  const float* scale = nullptr;  // [rows, ⌈cols / 128⌉], row stride scale_stride floats
  int64_t scale_stride = 0;
  int64_t rows = 0, col0 = 0, n = 0;
  float* out = nullptr;  // [rows, n] contiguous
};
Status Fp8SliceToF32(const Fp8SliceParams& p, Stream stream = nullptr);

}  // namespace lockstep::kernels::cuda
