// kernels/cuda/nccl_collective.cc — NcclCollective (nccl_api.h): the group collective of a process
// per GPU. Only NcclComm's calls, so it builds with or without NCCL's headers (the stub's fail).
#include <mutex>
#include <string>

#include "kernels/cuda/nccl_api.h"

namespace lockstep::kernels::cuda {
namespace {

class NcclGroup final : public Collective {
 public:
  explicit NcclGroup(std::unique_ptr<NcclComm> comm) : comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->ranks(); }
  bool device_native() const override { return true; }

  Status AllGatherDevice(const float* send, int64_t n, float* recv, void* stream) override {
    LS_RETURN_IF_ERROR(Aborted());
    return comm_->AllGather(send, n, recv, static_cast<Stream>(stream));
  }

  // Host memory (the launcher's checks, a CPU-side caller): through device buffers, synchronously.
  Status AllGather(const float* send, int64_t n, float* recv) override {
    LS_RETURN_IF_ERROR(Aborted());
    if (n < 0) return Status::InvalidArgument("collective: a gather of " + std::to_string(n) + " values");
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    if (staging_.size() < bytes * (size() + 1)) {
      LS_ASSIGN_OR_RETURN(staging_, DeviceBuffer::Allocate(bytes * (size() + 1)));
    }
    if (n == 0) return Status::Ok();
    LS_RETURN_IF_ERROR(staging_.CopyFromHost(send, bytes));
    float* dev = staging_.as<float>();
    LS_RETURN_IF_ERROR(comm_->AllGather(dev, n, dev + n, nullptr));
    LS_RETURN_IF_ERROR(SynchronizeStream(nullptr));
    return staging_.CopyToHost(recv, bytes * size(), bytes);
  }

  void Abort(const Status& why) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (why_.ok()) why_ = why.ok() ? Status::Internal("collective aborted") : why;
    }
    comm_->Abort();  // wakes this rank's operations waiting on a peer that will not come
  }

 private:
  Status Aborted() {
    std::lock_guard<std::mutex> l(mu_);
    return why_;
  }

  std::unique_ptr<NcclComm> comm_;
  DeviceBuffer staging_;
  std::mutex mu_;
  Status why_ = Status::Ok();
};

}  // namespace

std::shared_ptr<Collective> NcclCollective(std::unique_ptr<NcclComm> comm) {
  return std::make_shared<NcclGroup>(std::move(comm));
}

}  // namespace lockstep::kernels::cuda
