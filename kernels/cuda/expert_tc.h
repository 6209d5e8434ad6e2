// kernels/cuda/expert_tc.h — ExpertGemm's tensor-core launch (expert_tc.cu), for expert_gemm.cu's
// ExpertGemm to hand ExpertGemmParams::tensor_cores products to once it has checked them.
#pragma once

#include "kernels/cuda/ops.h"

namespace lockstep::kernels::cuda {

Status LaunchExpertGemmTc(const ExpertGemmParams& p, Stream stream);

}  // namespace lockstep::kernels::cuda
