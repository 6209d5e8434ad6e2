// kernels/cuda/summarize.cu — SummarizeRows (runtime.h): trace summaries of rows on the device.
#include <cuda_runtime.h>

#include <mutex>

#define XXH_INLINE_ALL  // the default XXH3 secret, copied once to the device
#include <xxhash.h>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/runtime.h"
#include "kernels/row_stats.h"
#include "kernels/xxh3.h"

namespace lockstep::kernels::cuda {

namespace {

__constant__ uint8_t kSecret[xxh3::kSecretSize];

// One thread per row: the host's sequential order, which the summary's bits are defined by.
__global__ void SummarizeRowsKernel(SummarizeRowsParams p) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= p.rows) return;
  const size_t esize = 4;
  const uint8_t* row = static_cast<const uint8_t*>(p.x) + static_cast<size_t>(r * p.x_stride) * esize;
  const RowStats st = p.i32 ? RowStatsI32(reinterpret_cast<const int32_t*>(row), p.cols)
                            : RowStatsF32(reinterpret_cast<const float*>(row), p.cols);
  RowSummaryOut o;
  o.hash = xxh3::Hash64(row, static_cast<size_t>(p.cols) * esize, kSecret);
  o.nan_count = st.nan_count;
  o.inf_count = st.inf_count;
  o.rms = st.rms;
  o.absmax = st.absmax;
  o.min = st.min;
  o.max = st.max;
  p.out[r] = o;
}

Status UploadSecretOnce() {
  static std::once_flag once;
  static cudaError_t err = cudaSuccess;
  std::call_once(once, [] { err = cudaMemcpyToSymbol(kSecret, XXH3_kSecret, xxh3::kSecretSize); });
  LS_CUDA_RETURN_IF_ERROR(err);
  return Status::Ok();
}

}  // namespace

Status SummarizeRows(const SummarizeRowsParams& p, Stream stream) {
  const char* op = "SummarizeRows";
  LS_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31), op, "rows", p.rows);
  LS_CHECK_ARG(p.cols >= 0, op, "cols", p.cols);
  if (p.rows == 0) return Status::Ok();
  LS_CHECK_ARG(p.x != nullptr, op, "x", p.x);
  LS_CHECK_ARG(p.out != nullptr, op, "out", static_cast<const void*>(p.out));
  LS_CHECK_ARG(p.x_stride >= p.cols, op, "x_stride", p.x_stride);
  LS_RETURN_IF_ERROR(UploadSecretOnce());
  SummarizeRowsKernel<<<static_cast<unsigned>((p.rows + 127) / 128), 128, 0, stream>>>(p);
  LS_CUDA_LAUNCH_CHECK();
  return Status::Ok();
}

}  // namespace lockstep::kernels::cuda
