// kernels/cuda/nccl_api_stub.cc — nccl_api.h for a CUDA toolkit without NCCL's headers: every call
// says so (the build found no nccl.h; tensor parallelism over several GPUs needs it).
#include "kernels/cuda/nccl_api.h"

namespace lockstep::kernels::cuda {
namespace {
Status NoNccl() {
  return Status::Unsupported("NCCL: this lockstep was built without NCCL's headers (nccl.h beside the CUDA toolkit's); "
                             "tensor parallelism over several GPUs needs a build with them");
}
}  // namespace

Status NcclAvailable() { return NoNccl(); }
std::string NcclComm::Version() { return "NCCL (not in this build)"; }
Result<std::string> NcclComm::NewId() { return NoNccl(); }
Result<std::unique_ptr<NcclComm>> NcclComm::Join(const std::string&, int, int) { return NoNccl(); }
NcclComm::~NcclComm() = default;
Status NcclComm::AllGather(const float*, int64_t, float*, Stream) { return NoNccl(); }
void NcclComm::Abort() {}

}  // namespace lockstep::kernels::cuda
