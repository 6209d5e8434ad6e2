// engine/backend.cc — the CPU backend and the backend factory.
#include "engine/backend.h"

#include <thread>

#include "engine/cuda_backend.h"

namespace lockstep::engine {

namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(std::shared_ptr<Model> model) : model_(std::move(model)) {}
  std::string_view name() const override { return "cpu"; }
  std::string device() const override {
    return "cpu (" + std::to_string(std::thread::hardware_concurrency()) + " hardware threads)";
  }
  Status Forward(std::span<Segment> segments, PagedKvCache& cache, const kernels::KernelPlan& plan,
                 TapHook* hook, ForwardOutput* out) override {
    return model_->Forward(segments, cache, plan, hook, out);
  }

 private:
  std::shared_ptr<Model> model_;
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, std::shared_ptr<Model> model,
                                               const PagedKvCache& cache, const kernels::KernelPlan& plan,
                                               const BackendOptions& options) {
  if (model->config().is_v4()) {  // engine/v4_model.cc: the CPU reference, fp32 GEMMs; caches fp32, bf16, FP8 MODEL1
    if (name == "cuda") return Status::Unsupported(
          "--backend cuda: deepseek_v4 runs on the CPU reference only so far (V2, V3 and V3.2 run on CUDA: the "
          "embedded V3.2 model is -m models/lockstep-tiny-v32)");
  }
  if (name == "cpu" && model->random_weights()) {
    return Status::Unsupported("--random-weights: the weights exist only on the GPU; run with --backend cuda");
  }
  if (name == "cpu") return std::unique_ptr<Backend>(new CpuBackend(std::move(model)));
  if (name == "cuda") return CreateCudaBackend(std::move(model), cache, plan, options);
  return Status::InvalidArgument("--backend " + std::string(name) + ": unknown backend (backends: cpu, cuda)");
}

}  // namespace lockstep::engine
