// engine/tap_capture.cc — HostTapCapture: the CPU forward passes' taps, straight to the hook.
#include "engine/tap_capture.h"

#include <cstring>
#include <string>
#include <vector>

namespace lockstep::engine {

namespace {

// Segment g's rows of a step buffer [R, cols] of `dtype`, its first row at row0, as a tap event.
TapEvent SegmentRowsEvent(const Segment& g, int64_t row0, std::string_view name, const void* data, int64_t cols,
                          TapDType dtype) {
  TapEvent e;
  e.name = name;
  e.request_id = g.request_id;
  e.position = g.start_pos;
  e.rows = static_cast<int64_t>(g.tokens.size());
  e.cols = cols;
  e.dtype = dtype;
  e.data = static_cast<const uint8_t*>(data) + row0 * cols * TapDTypeSize(dtype);
  return e;
}

}  // namespace

Status HostTapCapture::Tap(std::string_view name, const void* data, int64_t cols, int64_t stride, TapDType dtype) {
  if (hook_ == nullptr) return Status::Ok();
  if (cols < 0 || stride < cols) {
    return Status::Internal("tap '" + std::string(name) + "': row stride " + std::to_string(stride) + " below its " +
                            std::to_string(cols) + " columns");
  }
  if (stride == cols) {
    Emit(name, data, cols, dtype);
    return Status::Ok();
  }
  // Strided rows (a part of a wider buffer): contiguous here, as the hook takes them.
  const int64_t esize = TapDTypeSize(dtype);
  std::vector<uint8_t> rows(static_cast<size_t>(rows_ * cols * esize));
  for (int64_t r = 0; r < rows_; ++r) {
    std::memcpy(rows.data() + r * cols * esize, static_cast<const uint8_t*>(data) + r * stride * esize,
                static_cast<size_t>(cols * esize));
  }
  Emit(name, rows.data(), cols, dtype);
  return Status::Ok();
}

void HostTapCapture::Emit(std::string_view name, const void* data, int64_t cols, TapDType dtype) const {
  if (hook_ == nullptr) return;
  for (size_t s = 0; s < segs_.size(); ++s) hook_->OnTap(SegmentRowsEvent(segs_[s], row0_[s], name, data, cols, dtype));
}

void HostTapCapture::EmitOverride(std::string_view name, float* x, int64_t cols) const {
  if (hook_ == nullptr || !hook_->WantsOverride()) return;
  for (size_t s = 0; s < segs_.size(); ++s) {
    hook_->Override(SegmentRowsEvent(segs_[s], row0_[s], name, x, cols, TapDType::kF32), x + row0_[s] * cols);
  }
}

void HostTapCapture::EmitRow(std::string_view name, size_t seg, int64_t position, const void* data, int64_t cols,
                             TapDType dtype) const {
  if (hook_ == nullptr) return;
  TapEvent e;
  e.name = name;
  e.request_id = segs_[seg].request_id;
  e.position = position;
  e.rows = 1;
  e.cols = cols;
  e.dtype = dtype;
  e.data = data;
  hook_->OnTap(e);
}

}  // namespace lockstep::engine
