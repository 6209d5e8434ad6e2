// kernels/cuda/runtime.h — what a GPU forward pass needs around the kernels of ops.h:
// streams, pinned host memory, asynchronous copies, CUDA graphs, and a few data-movement
// kernels (random fill, row gather/scatter). Like ops.h it includes no CUDA header, so the
// engine (plain C++) can hold these objects; definitions in kernels/cuda/stream.cu.
//
// Thread-safety: each object is used by one thread at a time; the free functions are
// stateless.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "kernels/cuda/ops.h"

struct CUgraphExec_st;

namespace lockstep::kernels::cuda {

// A non-blocking CUDA stream, destroyed with the object.
class CudaStream {
 public:
  static Result<std::unique_ptr<CudaStream>> Create();
  ~CudaStream();
  Stream get() const { return s_; }
  Status Synchronize() const { return SynchronizeStream(s_); }

 private:
  CudaStream() = default;
  Stream s_ = nullptr;
};

// An event for ordering streams (no timing): Record on one stream, Wait on another makes the
// second wait for the work the first had queued. Both may be captured into a CUDA graph (a
// fork and a join of its branches).
class CudaEvent {
 public:
  static Result<std::unique_ptr<CudaEvent>> Create();
  ~CudaEvent();
  Status Record(Stream stream);
  Status WaitOn(Stream stream) const;  // `stream` waits for the last Record

 private:
  CudaEvent() = default;
  void* e_ = nullptr;  // cudaEvent_t
};

// Page-locked host memory (cudaMallocHost), so asynchronous copies really are asynchronous.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  static Result<PinnedBuffer> Allocate(size_t bytes);
  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// cudaMemcpyAsync with the direction inferred from the pointers (unified addressing).
Status CopyAsync(void* dst, const void* src, size_t bytes, Stream stream);
// cudaMemcpy2DAsync: `height` rows of `width` bytes, pitches in bytes.
Status Copy2DAsync(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                   Stream stream);
Status MemsetAsync(void* dst, int value, size_t bytes, Stream stream);
// Clears the calling thread's sticky CUDA error (after a failed capture that was handled).
void ClearLastError();

// A CUDA graph captured from a stream (cudaStreamBeginCapture … EndCapture), then replayed
// with Launch. The captured kernels keep the pointers and scalar arguments of capture time:
// inputs change by writing into the same device buffers before a launch.
class CudaGraph {
 public:
  ~CudaGraph();
  static Status BeginCapture(Stream stream);
  // Ends the capture begun on `stream` and instantiates it.
  static Result<std::unique_ptr<CudaGraph>> EndCapture(Stream stream);
  Status Launch(Stream stream);

 private:
  CudaGraph() = default;
  CUgraphExec_st* exec_ = nullptr;
};

// Attributes GPU time to named phases of a stream's work: Mark(name) closes the interval that
// began at the previous mark; Collect() waits for the stream and adds each interval (ms) to
// `totals`. Diagnostics only (--gpu-profile): the events serialise nothing but cost
// a little launch time. Marks may be captured into a CUDA graph (event-record nodes).
class EventTimer {
 public:
  ~EventTimer();
  static Result<std::unique_ptr<EventTimer>> Create();
  Status Mark(const std::string& name, Stream stream);
  Status Collect(std::map<std::string, double>* totals);
  // Marks recorded since the last Collect. A CUDA graph captured with marks re-records the same
  // events when launched: SetUsed(n) tells Collect to read them.
  size_t used() const { return used_; }
  void SetUsed(size_t n) { used_ = n; }

 private:
  EventTimer() = default;
  std::vector<void*> events_;  // cudaEvent_t, reused
  std::vector<std::string> names_;
  size_t used_ = 0;
};

// The device-to-device copy bandwidth, bytes/s with read and write both counted: `reps`
// copies of 2 GiB after two warm-ups, timed with events. The roofline every GPU benchmark
// sets its bandwidth against, measured in the same run.
Result<double> MeasureCopyBandwidth(int reps);

// Fills n values with Philox uniforms in [lo, hi): value i is a pure function of (seed, i),
// so a random-weights model is the same on every run and device. bf16 = raw uint16 bits
// (round to nearest even), else fp32.
Status FillUniform(void* dst, int64_t n, bool bf16, float lo, float hi, uint64_t seed, Stream stream);
// n FP8 e4m3 bytes: e4m3(U(−448, 448)) with FillUniform's Philox stream (NaN never drawn).
Status FillUniformFp8(uint8_t* dst, int64_t n, uint64_t seed, Stream stream);
// Fills n values with one constant (fp32, or bf16 bits when bf16).
Status FillConstant(void* dst, int64_t n, bool bf16, float value, Stream stream);

// dst[i, :] = src[rows[i], :] for i < n: rows of `row_bytes` bytes (a multiple of 4), strides
// in bytes. rows[i] < 0 or ≥ src_rows → that row is zero-filled and kErrSlot is set.
struct GatherRowsParams {
  const void* src = nullptr;
  int64_t src_rows = 0, src_stride = 0;
  const int32_t* rows = nullptr;  // [n] device
  int64_t n = 0;
  void* dst = nullptr;
  int64_t dst_stride = 0;
  int64_t row_bytes = 0;
  int32_t* error_flag = nullptr;
};
Status GatherRows(const GatherRowsParams& p, Stream stream = nullptr);

// dst[slots[i], :] = src[i, :] for i < n; slots[i] = −1 skips; ≥ dst_rows sets kErrSlot.
struct ScatterRowsParams {
  const void* src = nullptr;
  int64_t src_stride = 0;
  const int32_t* slots = nullptr;  // [n] device
  int64_t n = 0;
  void* dst = nullptr;
  int64_t dst_rows = 0, dst_stride = 0;
  int64_t row_bytes = 0;
  int32_t* error_flag = nullptr;
  void* copy = nullptr;  // optional: each scattered row also at copy + i·row_bytes (contiguous)
};
Status ScatterRows(const ScatterRowsParams& p, Stream stream = nullptr);

// y[r, o] = cpu::Dot(x[r, :], w[o, :], n) for small fp32 products (the MoE router): 16 threads
// per dot, thread l accumulating elements i ≡ l (mod 16) by FMA in ascending order, then the
// CPU's pairwise fold 16→8→4→2→1 — bitwise the CPU's Dot, whatever the number of rows.
struct RowDotsParams {
  const float* x = nullptr;  // [rows, n], row stride x_stride
  int64_t x_stride = 0;
  const float* w = nullptr;  // [outs, n], row stride w_stride
  int64_t w_stride = 0;
  float* y = nullptr;        // [rows, outs], row stride y_stride
  int64_t y_stride = 0;
  int64_t rows = 0, outs = 0, n = 0;
  // w is no kernel's output (a weight): the staged kernel requests its first tile before it
  // waits for the previous kernel on the stream (launch.cuh). Speed only.
  bool w_fixed = false;
};
Status RowDots(const RowDotsParams& p, Stream stream = nullptr);

// Trace summaries of rows on the device (kernels/row_stats.h + kernels/xxh3.h): the SummaryRow
// fields traces::Summarize computes on the host, the same bits (the one caveat is in
// row_stats.h), so a device backend can summarise taps (and the KV cache rows it stores)
// without copying them. A warp per row: the row is staged in shared memory (≤ 32 KB; longer
// rows are read in place), lanes 0–7 carry XXH3's eight accumulators (independent lanes
// between merges), lanes 0–3 the four fp64 sums of squares in their order, every lane a share
// of min / max by (value, first index); a row with NaN or ±Inf, and int32, bf16 and E4M3
// rows, take the host's sequential loop in lane 0.
// What a summarised row holds: its elements' type (the hash covers cols · size bytes).
enum class RowType : uint8_t { kF32, kI32, kBf16, kFp8E4m3 };
struct RowSummaryOut {
  uint64_t hash = 0;  // XXH3-64 (seed 0) of the row's bytes
  uint32_t nan_count = 0, inf_count = 0;
  float rms = 0, absmax = 0, min = 0, max = 0;
};
struct SummarizeRowsParams {
  const void* x = nullptr;   // [rows, cols] of `type`, row stride x_stride elements; every row
  int64_t x_stride = 0;      // starts 4-byte aligned and is whole 4-byte words (bf16 / E4M3 too)
  int64_t rows = 0, cols = 0;
  RowType type = RowType::kF32;
  RowSummaryOut* out = nullptr;  // [rows] device
};
Status SummarizeRows(const SummarizeRowsParams& p, Stream stream = nullptr);

// Several tensors of `rows` rows each in one launch (one graph node): what a backend does at
// a point where the tapped buffers are about to be overwritten.
inline constexpr int kSummarizeBatchMax = 10;
struct SummarizeBatchParams {
  struct Tensor {
    const void* x = nullptr;  // [rows, cols] of `type`, as SummarizeRowsParams
    int64_t x_stride = 0, cols = 0;
    RowType type = RowType::kF32;
    RowSummaryOut* out = nullptr;  // [rows] device
  };
  Tensor t[kSummarizeBatchMax];
  int32_t count = 0;
  int64_t rows = 0;
};
Status SummarizeBatch(const SummarizeBatchParams& p, Stream stream = nullptr);

// Any number of tensors, described in device memory (a step's taps, uploaded once per batch
// size): one launch. The descriptors cannot be checked on the host; the caller vouches for
// them as it would for SummarizeBatch's.
struct SummarizeTableParams {
  const SummarizeBatchParams::Tensor* tensors = nullptr;  // [count] device
  int64_t count = 0, rows = 0;                            // count ≤ 65535
};
Status SummarizeTable(const SummarizeTableParams& p, Stream stream = nullptr);

}  // namespace lockstep::kernels::cuda
