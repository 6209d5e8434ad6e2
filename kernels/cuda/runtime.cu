// kernels/cuda/runtime.cu — device queries, DeviceBuffer, synchronisation, format sizes.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls start clean
    return 0;
  }
  return n;
}

std::string DeviceDescription() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(e);
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "device 0: properties unavailable";
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         std::to_string(prop.multiProcessorCount) + " SMs, " + std::to_string(prop.totalGlobalMem >> 20) +
         " MiB; driver " + std::to_string(driver) + ", runtime " + std::to_string(runtime) + ")";
}

int SmCount() {
  static const int n = [] {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
      cudaGetLastError();
      return 1;
    }
    return v > 0 ? v : 1;
  }();
  return n;
}

namespace {
thread_local bool overlapped_launch = true;
bool DeviceOverlaps() {
  static const bool ok = [] {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return major >= 9;
  }();
  return ok;
}
}  // namespace

bool SetOverlappedLaunch(bool on) { return std::exchange(overlapped_launch, on); }
bool OverlappedLaunch() { return overlapped_launch && DeviceOverlaps(); }

void ProfilerStart() { cudaProfilerStart(); }
void ProfilerStop() { cudaProfilerStop(); }

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return Result<DeviceBuffer>(std::move(b));
  LS_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.ptr_, bytes));
  b.bytes_ = bytes;
  return Result<DeviceBuffer>(std::move(b));
}

Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, size_t offset) {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return Status::InvalidArgument("DeviceBuffer::CopyFromHost: " + std::to_string(bytes) + " bytes at offset " +
                                   std::to_string(offset) + " overrun a buffer of " + std::to_string(bytes_));
  }
  if (bytes == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpy(static_cast<char*>(ptr_) + offset, src, bytes, cudaMemcpyHostToDevice));
  return Status::Ok();
}

Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, size_t offset) const {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return Status::InvalidArgument("DeviceBuffer::CopyToHost: " + std::to_string(bytes) + " bytes at offset " +
                                   std::to_string(offset) + " overrun a buffer of " + std::to_string(bytes_));
  }
  if (bytes == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
  return Status::Ok();
}

Status DeviceBuffer::Fill(uint8_t byte) {
  if (bytes_ == 0) return Status::Ok();
  LS_CUDA_RETURN_IF_ERROR(cudaMemset(ptr_, byte, bytes_));
  return Status::Ok();
}

Status Synchronize() {
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  LS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status SynchronizeStream(Stream stream) {
  LS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return Status::Ok();
}

int64_t LatentBytesPerToken(LatentFormat f, int64_t kv_lora, int64_t rope_dim) {
  switch (f) {
    case LatentFormat::kFp32: return (kv_lora + rope_dim) * 4;
    case LatentFormat::kBf16: return (kv_lora + rope_dim) * 2;
    case LatentFormat::kFp8E4m3: return kv_lora + 4 * ((kv_lora + kFp8TileValues - 1) / kFp8TileValues) + 2 * rope_dim;
  }
  return -1;
}

}  // namespace lockstep::kernels::cuda
