// engine/cuda_scratch.h — a grow-only device scratch buffer of the CUDA backend (its
// activations, inputs, cache mirror) and of its tap capture (arena, slab). Private to the
// CUDA backend's files.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "base/status.h"
#include "kernels/cuda/runtime.h"

namespace lockstep::engine::cuda_impl {

// Every move bumps the owning backend's generation counter: captured CUDA graphs hold the old
// address and must be captured again.
struct Scratch {
  kernels::cuda::DeviceBuffer buf;
  int64_t* generation = nullptr;  // the owning backend's
  Status Ensure(size_t bytes) {
    if (buf.size() >= bytes) return Status::Ok();
    const size_t grown = std::max(bytes, buf.size() * 3 / 2);
    buf = kernels::cuda::DeviceBuffer();  // free first: the pool may be nearly full
    LS_ASSIGN_OR_RETURN(buf, kernels::cuda::DeviceBuffer::Allocate(grown));
    ++*generation;
    return Status::Ok();
  }
  template <typename T>
  T* as() const {
    return buf.as<T>();
  }
};

}  // namespace lockstep::engine::cuda_impl
