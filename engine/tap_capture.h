// engine/tap_capture.h — tap capture: what a forward pass calls at its tap points, whichever
// backend runs it, and how the rows reach the hook.
//
// A backend's forward pass holds one TapCapture for its step. At each tap point (engine/tap.h's
// table) it calls Tap with the step's rows of the tensor, where the backend keeps them, and at
// the points whose values feed the next layer (embed, layers.L.resid_out) Override, which lets a
// grafting hook overwrite them (replay --graft). The capture decides how the rows travel:
// HostTapCapture (below: the CPU forward passes) hands each segment's rows to the hook at once;
// CudaTapCapture (engine/cuda_tap_capture.h) copies or summarises them on the device and hands
// the step's taps over together at Flush (TapHook::OnStepTaps). The hook sees the same events
// either way, in causal order per request.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "base/status.h"
#include "engine/model.h"
#include "engine/tap.h"

namespace lockstep::engine {

class TapCapture {
 public:
  virtual ~TapCapture() = default;

  // The step's hook; null when nobody listens — a forward pass then builds no tap names and
  // calls nothing (the cost of a tap point is this test).
  TapHook* hook() const { return hook_; }
  bool active() const { return hook_ != nullptr; }

  // Tap `name`: the step's rows (every segment's, back to back in the step's row order) of a
  // tensor with `cols` elements of `dtype` a row, row r at `data` + r·stride elements, in the
  // backend's memory. `name` must stay where it is for the engine's life (the model's tap names,
  // or a literal): a hook may key on its address (TapHook::OnTapSummaries).
  virtual Status Tap(std::string_view name, const void* data, int64_t cols, int64_t stride, TapDType dtype) = 0;
  // Grafting (TapHook::Override, where the hook wants it): offers the step's rows of x [rows,
  // cols] (f32, contiguous, in the backend's memory) to the hook segment by segment, and keeps
  // what it wrote. Taps still held are handed over first, so the hook sees causal order.
  virtual Status Override(std::string_view name, float* x, int64_t cols) = 0;
  // Hands over whatever the capture still holds (the end of the step).
  virtual Status Flush() = 0;

 protected:
  // The step the taps are rows of: segment s owns rows [row0[s], row0[s] + its tokens) of `rows`.
  void Begin(TapHook* hook, std::span<const Segment> segs, std::span<const int64_t> row0, int64_t rows) {
    hook_ = hook;
    segs_ = segs;
    row0_ = row0;
    rows_ = rows;
  }
  void End() { Begin(nullptr, {}, {}, 0); }

  TapHook* hook_ = nullptr;
  std::span<const Segment> segs_;
  std::span<const int64_t> row0_;
  int64_t rows_ = 0;
};

// The CPU forward passes' capture: the rows are in host memory, and each segment's go to the
// hook (TapHook::OnTap) the moment they are tapped — nothing is held, so Flush has nothing to do
// and nothing here can fail (the Emit forms say so in their type).
class HostTapCapture final : public TapCapture {
 public:
  // segs' rows laid out as LayOutSegments does: segment s from row0[s].
  HostTapCapture(TapHook* hook, std::span<const Segment> segs, std::span<const int64_t> row0) {
    const int64_t rows = segs.empty() ? 0 : row0.back() + static_cast<int64_t>(segs.back().tokens.size());
    Begin(hook, segs, row0, rows);
  }
  Status Tap(std::string_view name, const void* data, int64_t cols, int64_t stride, TapDType dtype) override;
  Status Override(std::string_view name, float* x, int64_t cols) override {
    EmitOverride(name, x, cols);
    return Status::Ok();
  }
  Status Flush() override { return Status::Ok(); }

  // Tap of a contiguous step buffer [rows, cols] of `dtype` (4-byte elements for the tap points).
  void Emit(std::string_view name, const void* data, int64_t cols, TapDType dtype = TapDType::kF32) const;
  void EmitOverride(std::string_view name, float* x, int64_t cols) const;
  // One row of segment `seg` at sequence position `position` (taps with rows only where an event
  // happens: V4's compressor entries).
  void EmitRow(std::string_view name, size_t seg, int64_t position, const void* data, int64_t cols,
               TapDType dtype = TapDType::kF32) const;
};

}  // namespace lockstep::engine
