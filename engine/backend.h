// engine/backend.h — where a forward pass runs: the CPU reference or the CUDA fast path.
//
// A Backend runs Model::Forward's contract (engine/model.h): segments in, logits out, the
// segments' tokens appended to their requests' caches, taps emitted with the same names and
// shapes. The engine keeps the PagedKvCache on the host for page allocation and for readers
// (recorders, tests); a device backend holds its own copy of the pages with the same page ids
// and, when asked (SetMirrorCache), copies each forward's new rows back into the host cache
// so a recorder reads the bytes attention read.
//
// Kernel choices are resolved per backend (kernels::Registry::Resolve(…, backend)): the
// same op names, each backend's own variants.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "base/status.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/tap.h"
#include "kernels/plan.h"
#include "kernels/registry.h"

namespace lockstep::engine {

// How a device backend runs (no effect on the CPU backend, and none on any result).
struct BackendOptions {
  bool cuda_graphs = true;  // decode steps captured once per batch size and replayed as CUDA graphs
  bool side_stream = true;  // a step's independent branches on a second stream (docs/gpu.md)
  // Each kernel scheduled while the one before it finishes (programmatic dependent launch,
  // sm_90; docs/gpu.md "Overlapped launches").
  bool overlapped_launch = true;
  // Sample on the device (kernels/cuda/sampler.cu: the host Sampler's algorithm and Philox
  // stream — the same tokens; `probability` may differ in its last bit, docs/sampling.md)
  // instead of copying every logit row through the host sampler.
  bool device_sampler = true;
  bool profile = false;     // GPU time per phase of a step, printed to stderr when the backend ends
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;  // "cpu" | "cuda"
  virtual std::string device() const = 0;     // what it runs on, for traces and `--json`
  virtual Status Forward(std::span<Segment> segments, PagedKvCache& cache, const kernels::KernelPlan& plan,
                         TapHook* hook, ForwardOutput* out) = 0;
  // Device backends: copy each forward's new cache rows back into the host cache (the CPU
  // backend writes there anyway). Off by default on the GPU: it costs a copy per step.
  virtual void SetMirrorCache(bool on) {}
  // Nanoseconds steps spent waiting for a tap hook to give back buffers the backend lent it
  // (TapEvent::owner: the CUDA backend's full capture), in total — recording's back-pressure.
  virtual int64_t tap_wait_ns() const { return 0; }
};

// The backends this build has: "cpu", plus "cuda" when built with a CUDA toolkit.
bool HaveCudaBackend();

// Creates the named backend for `model` over a cache of `cache`'s geometry. "cuda" fails with
// a one-line reason when the build has no CUDA or the machine no GPU.
Result<std::unique_ptr<Backend>> CreateBackend(std::string_view name, std::shared_ptr<Model> model,
                                               const PagedKvCache& cache, const kernels::KernelPlan& plan,
                                               const BackendOptions& options = {});

}  // namespace lockstep::engine
