// kernels/cuda/stream.cu — see runtime.h.
#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/philox.h"

namespace lockstep::kernels::cuda {

Result<std::unique_ptr<CudaStream>> CudaStream::Create() {
  std::unique_ptr<CudaStream> s(new CudaStream());
  cudaStream_t raw = nullptr;
  LS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  s->s_ = raw;
  return Result<std::unique_ptr<CudaStream>>(std::move(s));
}

Result<std::unique_ptr<CudaEvent>> CudaEvent::Create() {
  std::unique_ptr<CudaEvent> e(new CudaEvent());
  cudaEvent_t raw = nullptr;
  LS_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  e->e_ = raw;
  return Result<std::unique_ptr<CudaEvent>>(std::move(e));
}

CudaEvent::~CudaEvent() {
  if (e_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(e_));
}

Status CudaEvent::Record(Stream stream) {
  LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(e_), stream));
  return Status::Ok();
}

Status CudaEvent::WaitOn(Stream stream) const {
  LS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(e_), 0));
  return Status::Ok();
}

CudaStream::~CudaStream() {
  if (s_ != nullptr) cudaStreamDestroy(s_);
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

Result<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  PinnedBuffer b;
  if (bytes == 0) return Result<PinnedBuffer>(std::move(b));
  LS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&b.ptr_, bytes));
  b.bytes_ = bytes;
  return Result<PinnedBuffer>(std::move(b));
}

Status CopyAsync(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  return Status::Ok();
}

Status Copy2DAsync(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                   Stream stream) {
  if (width == 0 || height == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault, stream));
  return Status::Ok();
}

Status MemsetAsync(void* dst, int value, size_t bytes, Stream stream) {
  if (bytes == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, stream));
  return Status::Ok();
}

void ClearLastError() { cudaGetLastError(); }

Result<double> MeasureCopyBandwidth(int reps) {
  const size_t bytes = size_t{1} << 31;
  LS_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::Allocate(bytes));
  LS_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(bytes));
  LS_RETURN_IF_ERROR(a.Fill(1));
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  LS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e0));
  LS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e1));
  for (int i = 0; i < 2; ++i) LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
  LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) {
    LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
  }
  LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(e1));
  LS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(e1));
  float ms = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * static_cast<double>(bytes) * reps / (ms * 1e-3);
}

EventTimer::~EventTimer() {
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

Result<std::unique_ptr<EventTimer>> EventTimer::Create() {
  return Result<std::unique_ptr<EventTimer>>(std::unique_ptr<EventTimer>(new EventTimer()));
}

Status EventTimer::Mark(const std::string& name, Stream stream) {
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    LS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    events_.push_back(e);
    names_.emplace_back();
  }
  names_[used_] = name;
  // Inside a stream capture a plain record only orders streams; an external record becomes a
  // node that records the event each time the graph runs.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  LS_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capturing));
  if (capturing == cudaStreamCaptureStatusActive) {
    LS_CUDA_RETURN_IF_ERROR(
        cudaEventRecordWithFlags(static_cast<cudaEvent_t>(events_[used_]), stream, cudaEventRecordExternal));
  } else {
    LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(events_[used_]), stream));
  }
  ++used_;
  return Status::Ok();
}

Status EventTimer::Collect(std::map<std::string, double>* totals) {
  if (used_ == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[used_ - 1])));
  for (size_t i = 1; i < used_; ++i) {
    float ms = 0;
    LS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[i - 1]),
                                                 static_cast<cudaEvent_t>(events_[i])));
    (*totals)[names_[i]] += ms;
  }
  used_ = 0;
  return Status::Ok();
}

CudaGraph::~CudaGraph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
}

Status CudaGraph::BeginCapture(Stream stream) {
  LS_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  return Status::Ok();
}

Result<std::unique_ptr<CudaGraph>> CudaGraph::EndCapture(Stream stream) {
  cudaGraph_t graph = nullptr;
  LS_CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  std::unique_ptr<CudaGraph> g(new CudaGraph());
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  LS_CUDA_RETURN_IF_ERROR(e);
  g->exec_ = exec;
  return Result<std::unique_ptr<CudaGraph>>(std::move(g));
}

Status CudaGraph::Launch(Stream stream) {
  LS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream));
  return Status::Ok();
}

namespace {

__global__ void FillUniformKernel(void* dst, int64_t n, bool bf16, float lo, float hi, uint64_t seed) {
  dev::GridDependencySync();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  // One Philox block per value: counter = (i lo, i hi, 0x77656967 "weig", 0), key = seed.
  Philox4x32 c{{static_cast<uint32_t>(i), static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32), 0x77656967u, 0u}};
  const Philox4x32 r = Philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const float u = static_cast<float>(r.v[0] >> 8) * (1.0f / 16777216.0f);  // 24 bits → [0, 1)
  const float v = __fadd_rn(lo, __fmul_rn(u, __fsub_rn(hi, lo)));
  if (bf16) {
    static_cast<uint16_t*>(dst)[i] = dev::F32ToBf16(v);
  } else {
    static_cast<float*>(dst)[i] = v;
  }
}

__global__ void FillUniformFp8Kernel(uint8_t* dst, int64_t n, uint64_t seed) {
  dev::GridDependencySync();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  Philox4x32 c{{static_cast<uint32_t>(i), static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32), 0x77656967u, 0u}};
  const Philox4x32 r = Philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const float u = static_cast<float>(r.v[0] >> 8) * (1.0f / 16777216.0f);
  dst[i] = dev::F32ToFp8E4m3(__fsub_rn(__fmul_rn(u, 896.0f), 448.0f));
}

__global__ void FillConstantKernel(void* dst, int64_t n, bool bf16, float value) {
  dev::GridDependencySync();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (bf16) {
    static_cast<uint16_t*>(dst)[i] = dev::F32ToBf16(value);
  } else {
    static_cast<float*>(dst)[i] = value;
  }
}

// One CTA per row, 32-bit words.
__global__ void GatherRowsKernel(GatherRowsParams p) {
  dev::GridDependencySync();
  const int64_t i = blockIdx.x;
  const int32_t r = p.rows[i];
  uint32_t* d = reinterpret_cast<uint32_t*>(static_cast<char*>(p.dst) + i * p.dst_stride);
  const int64_t words = p.row_bytes / 4;
  if (r < 0 || r >= p.src_rows) {
    if (threadIdx.x == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrSlot);
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) d[w] = 0;
    return;
  }
  const uint32_t* s = reinterpret_cast<const uint32_t*>(static_cast<const char*>(p.src) + r * p.src_stride);
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) d[w] = s[w];
}

__global__ void ScatterRowsKernel(ScatterRowsParams p) {
  dev::GridDependencySync();
  const int64_t i = blockIdx.x;
  const int32_t r = p.slots[i];
  if (r < 0) return;
  if (r >= p.dst_rows) {
    if (threadIdx.x == 0 && p.error_flag != nullptr) atomicOr(p.error_flag, kErrSlot);
    return;
  }
  const uint32_t* s = reinterpret_cast<const uint32_t*>(static_cast<const char*>(p.src) + i * p.src_stride);
  uint32_t* d = reinterpret_cast<uint32_t*>(static_cast<char*>(p.dst) + r * p.dst_stride);
  uint32_t* c = p.copy == nullptr ? nullptr : reinterpret_cast<uint32_t*>(static_cast<char*>(p.copy) + i * p.row_bytes);
  for (int64_t w = threadIdx.x; w < p.row_bytes / 4; w += blockDim.x) {
    const uint32_t v = s[w];
    d[w] = v;
    if (c != nullptr) c[w] = v;
  }
}

// 16 lanes per dot (two dots per warp): lane l's chain, then the fold by shuffles.
__global__ void RowDotsKernel(RowDotsParams p) {
  dev::GridDependencySync();
  const int64_t dot = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 16;
  const int l = threadIdx.x % 16;
  const bool live = dot < p.rows * p.outs;
  const int64_t r = live ? dot / p.outs : 0, o = live ? dot % p.outs : 0;
  float acc = 0.0f;
  if (live) {
    const float* x = p.x + r * p.x_stride;
    const float* w = p.w + o * p.w_stride;
    // 32 elements' loads issued before their FMAs (a router row is latency-bound: 2048 / 16
    // = 128 elements per lane would otherwise be that many round trips); the FMAs keep their
    // order.
    int64_t i = l;
    for (; i + 16 * 31 < p.n; i += 16 * 32) {
      float xv[32], wv[32];
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        xv[j] = __ldg(x + i + 16 * j);
        wv[j] = __ldg(w + i + 16 * j);
      }
#pragma unroll
      for (int j = 0; j < 32; ++j) acc = __fmaf_rn(xv[j], wv[j], acc);
    }
    for (; i < p.n; i += 16) acc = __fmaf_rn(x[i], w[i], acc);
  }
  acc = dev::FoldHalfWarp16(acc);  // Fold16: chains l + 8, 4, 2, 1
  if (live && l == 0) p.y[r * p.y_stride + o] = acc;
}

// The same products with the operands staged: a CTA per (output, 4 rows) copies the weight
// row and the x rows into shared memory with every copy in flight at once (a router row is
// 8 KB: one round trip instead of one per 32 elements a lane reads), then half-warp i runs x
// row i's chains from shared memory, Dot's order as above (chain l: elements ≡ l mod 16,
// ascending across tiles). Needs 16-byte aligned rows.
constexpr int kRdTile = 2048, kRdRows = 4, kRdThreads = 128, kRdPad = 16;

__global__ void __launch_bounds__(kRdThreads) RowDotsStagedKernel(RowDotsParams p) {
  __shared__ __align__(16) float ws[kRdTile];
  __shared__ __align__(16) float xs[kRdRows][kRdTile + kRdPad];  // pad: two half-warps, two bank halves
  const int64_t o = blockIdx.x, r0 = static_cast<int64_t>(blockIdx.y) * kRdRows;
  const int nr = static_cast<int>(p.rows - r0 < kRdRows ? p.rows - r0 : kRdRows);
  const int tid = threadIdx.x, half = tid / 16, l = tid % 16;
  auto request_w = [&](int64_t t0) {
    const int tn = static_cast<int>(p.n - t0 < kRdTile ? p.n - t0 : kRdTile);
    const float* wrow = p.w + o * p.w_stride + t0;
    for (int i = tid; i < tn / 4; i += kRdThreads) dev::CpAsync16(ws + 4 * i, wrow + 4 * i);
  };
  // Fixed weights (the router's): the first tile is requested while the previous kernel
  // finishes (launch.cuh); its group is committed with x's below.
  if (p.w_fixed) request_w(0);
  dev::GridDependencySync();
  float acc = 0.0f;
  for (int64_t t0 = 0; t0 < p.n; t0 += kRdTile) {
    const int tn = static_cast<int>(p.n - t0 < kRdTile ? p.n - t0 : kRdTile);
    if (t0 > 0) __syncthreads();  // every chain is done with the last tile
    if (t0 > 0 || !p.w_fixed) request_w(t0);
    for (int rr = 0; rr < nr; ++rr) {
      const float* xr = p.x + (r0 + rr) * p.x_stride + t0;
      for (int i = tid; i < tn / 4; i += kRdThreads) dev::CpAsync16(&xs[rr][4 * i], xr + 4 * i);
    }
    dev::CpAsyncCommit();
    dev::CpAsyncWait<0>();
    __syncthreads();
    if (half < nr) {
      const float* xr = xs[half];
      for (int i = l; i < tn; i += 16) acc = __fmaf_rn(xr[i], ws[i], acc);
    }
  }
  acc = dev::FoldHalfWarp16(acc);
  if (half < nr && l == 0) p.y[(r0 + half) * p.y_stride + o] = acc;
}

}  // namespace

Status RowDots(const RowDotsParams& p, Stream stream) {
  const char* op = "RowDots";
  LS_CHECK_ARG(p.rows >= 0, op, "rows", p.rows);
  LS_CHECK_ARG(p.outs > 0, op, "outs", p.outs);
  LS_CHECK_ARG(p.n > 0, op, "n", p.n);
  LS_CHECK_ARG(p.rows * p.outs * 16 < (int64_t{1} << 31), op, "rows·outs", p.rows * p.outs);
  LS_CHECK_ARG(p.x != nullptr, op, "x", p.x);
  LS_CHECK_ARG(p.w != nullptr, op, "w", p.w);
  LS_CHECK_ARG(p.y != nullptr, op, "y", p.y);
  LS_CHECK_ARG(p.x_stride >= p.n, op, "x_stride", p.x_stride);
  LS_CHECK_ARG(p.w_stride >= p.n, op, "w_stride", p.w_stride);
  LS_CHECK_ARG(p.y_stride >= p.outs, op, "y_stride", p.y_stride);
  if (p.rows == 0) return Status::Ok();
  const bool staged = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
                      p.x_stride % 4 == 0 && p.w_stride % 4 == 0 && p.n % 4 == 0 &&
                      (p.rows + kRdRows - 1) / kRdRows <= 65535 && p.outs < (int64_t{1} << 31);
  if (staged) {
    const dim3 grid(static_cast<unsigned>(p.outs), static_cast<unsigned>((p.rows + kRdRows - 1) / kRdRows));
    LS_CUDA_RETURN_IF_ERROR(LaunchKernel(RowDotsStagedKernel, grid, kRdThreads, 0, stream, p));
    LS_CUDA_LAUNCH_CHECK();
    return Status::Ok();
  }
  const int64_t threads = p.rows * p.outs * 16;
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(RowDotsKernel, static_cast<unsigned>((threads + 255) / 256), 256, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status FillUniform(void* dst, int64_t n, bool bf16, float lo, float hi, uint64_t seed, Stream stream) {
  LS_CHECK_ARG(n >= 0, "FillUniform", "n", n);
  LS_CHECK_ARG(dst != nullptr || n == 0, "FillUniform", "dst", dst);
  if (n == 0) return Status::Ok();
  const int64_t blocks = (n + 255) / 256;
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(FillUniformKernel, static_cast<unsigned>(blocks), 256, 0, stream, dst, n, bf16, lo, hi, seed));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status FillUniformFp8(uint8_t* dst, int64_t n, uint64_t seed, Stream stream) {
  LS_CHECK_ARG(n >= 0, "FillUniformFp8", "n", n);
  LS_CHECK_ARG(dst != nullptr || n == 0, "FillUniformFp8", "dst", dst);
  if (n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(FillUniformFp8Kernel, static_cast<unsigned>((n + 255) / 256), 256, 0, stream, dst, n, seed));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status FillConstant(void* dst, int64_t n, bool bf16, float value, Stream stream) {
  LS_CHECK_ARG(n >= 0, "FillConstant", "n", n);
  LS_CHECK_ARG(dst != nullptr || n == 0, "FillConstant", "dst", dst);
  if (n == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(
      LaunchKernel(FillConstantKernel, static_cast<unsigned>((n + 255) / 256), 256, 0, stream, dst, n, bf16, value));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status GatherRows(const GatherRowsParams& p, Stream stream) {
  const char* op = "GatherRows";
  LS_CHECK_ARG(p.n >= 0 && p.n < (int64_t{1} << 31), op, "n", p.n);
  if (p.n == 0) return Status::Ok();
  LS_CHECK_ARG(p.row_bytes > 0 && p.row_bytes % 4 == 0, op, "row_bytes", p.row_bytes);
  LS_CHECK_ARG(p.src != nullptr, op, "src", p.src);
  LS_CHECK_ARG(p.dst != nullptr, op, "dst", p.dst);
  LS_CHECK_ARG(p.rows != nullptr, op, "rows", static_cast<const void*>(p.rows));
  LS_CHECK_ARG(p.src_stride >= p.row_bytes && p.src_stride % 4 == 0, op, "src_stride", p.src_stride);
  LS_CHECK_ARG(p.dst_stride >= p.row_bytes && p.dst_stride % 4 == 0, op, "dst_stride", p.dst_stride);
  LS_CHECK_ARG(p.src_rows > 0, op, "src_rows", p.src_rows);
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(GatherRowsKernel, static_cast<unsigned>(p.n), 128, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

Status ScatterRows(const ScatterRowsParams& p, Stream stream) {
  const char* op = "ScatterRows";
  LS_CHECK_ARG(p.n >= 0 && p.n < (int64_t{1} << 31), op, "n", p.n);
  if (p.n == 0) return Status::Ok();
  LS_CHECK_ARG(p.row_bytes > 0 && p.row_bytes % 4 == 0, op, "row_bytes", p.row_bytes);
  LS_CHECK_ARG(p.src != nullptr, op, "src", p.src);
  LS_CHECK_ARG(p.dst != nullptr, op, "dst", p.dst);
  LS_CHECK_ARG(p.slots != nullptr, op, "slots", static_cast<const void*>(p.slots));
  LS_CHECK_ARG(p.src_stride >= p.row_bytes && p.src_stride % 4 == 0, op, "src_stride", p.src_stride);
  LS_CHECK_ARG(p.dst_stride >= p.row_bytes && p.dst_stride % 4 == 0, op, "dst_stride", p.dst_stride);
  LS_CHECK_ARG(p.dst_rows > 0, op, "dst_rows", p.dst_rows);
  LS_CHECK_ARG(reinterpret_cast<uintptr_t>(p.copy) % 4 == 0, op, "copy", p.copy);
  LS_CUDA_RETURN_IF_ERROR(LaunchKernel(ScatterRowsKernel, static_cast<unsigned>(p.n), 128, 0, stream, p));
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
