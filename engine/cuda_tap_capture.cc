// engine/cuda_tap_capture.cc — CudaTapCapture: a CUDA step's taps copied or summarised on the
// device and handed to the hook together (engine/cuda_tap_capture.h says the three ways).
#include "engine/cuda_tap_capture.h"

#include <atomic>
#include <cstddef>
#include <cstring>

namespace lockstep::engine::cuda_impl {

namespace cu = kernels::cuda;

CudaTapCapture::CudaTapCapture(int64_t* generation) {
  arena_.generation = generation;
  slab_buf_.generation = generation;
}

void CudaTapCapture::BeginStep(TapHook* hook, std::span<const Segment> segs, std::span<const int64_t> row0,
                               int64_t rows) {
  Begin(hook, segs, row0, rows);
  summaries_only_ = hook != nullptr && !hook->WantsTapValues();
  summary_batch_.count = 0;
  slab_ = false;
  kv_events_ = false;
}

Status CudaTapCapture::UseSlab(bool on, size_t bytes) {
  slab_ = on;
  if (!on) return Status::Ok();
  slab_bytes_ = bytes;
  return slab_buf_.Ensure(bytes);
}

Status CudaTapCapture::EnsureArena() {
  if (arena_.buf.size() != 0) return Status::Ok();
  LS_RETURN_IF_ERROR(arena_.Ensure(size_t{64} << 20));
  LS_ASSIGN_OR_RETURN(host_, cu::PinnedBuffer::Allocate(arena_.buf.size()));
  return Status::Ok();
}

CudaTapCapture::Captured CudaTapCapture::Held() const { return {pending_, used_}; }

void CudaTapCapture::Restore(const Captured& c) {
  pending_ = c.pending;
  used_ = c.used;
}

void CudaTapCapture::Drop() {
  pending_.clear();
  used_ = 0;
}

static cu::RowType ToRowType(TapDType t) {
  switch (t) {
    case TapDType::kI32: return cu::RowType::kI32;
    case TapDType::kBf16: return cu::RowType::kBf16;
    case TapDType::kFp8E4m3: return cu::RowType::kFp8E4m3;
    case TapDType::kU8:  // (V4's MODEL1 scales: no V4 on CUDA yet)
    case TapDType::kF32: break;
  }
  return cu::RowType::kF32;
}

Status CudaTapCapture::Tap(std::string_view name, const void* dev, int64_t cols, int64_t stride, TapDType dtype) {
  if (hook_ == nullptr) return Status::Ok();
  if (slab_) {  // already in its own place: remember where (summaries are placed by SummarizeSlab)
    const char* p = static_cast<const char*>(dev);
    if (p < slab_buf_.as<char>() || p + (rows_ - 1) * stride * 4 + cols * 4 > slab_buf_.as<char>() + slab_bytes_) {
      return Status::Internal("cuda tap capture: tap '" + std::string(name) + "' lies outside the tap slab");
    }
    const size_t at = static_cast<size_t>(p - slab_buf_.as<char>());
    pending_.push_back({name, at, summaries_only_, cols, stride, dtype});
    return Status::Ok();
  }
  const size_t bytes = summaries_only_ ? static_cast<size_t>(rows_) * sizeof(TapRowSummary)
                                     : static_cast<size_t>(rows_ * cols) * 4;
  if (used_ + bytes > arena_.buf.size()) {
    // A graph cannot hand taps over in the middle of a step: such a step runs plainly.
    if (capturing_) return Status::Unsupported("tap arena full during graph capture");
    LS_RETURN_IF_ERROR(Flush());
    if (bytes > arena_.buf.size()) {
      LS_RETURN_IF_ERROR(arena_.Ensure(std::max<size_t>(bytes, size_t{64} << 20)));
      LS_ASSIGN_OR_RETURN(host_, cu::PinnedBuffer::Allocate(arena_.buf.size()));
    }
  }
  if (summaries_only_) {
    if (summary_batch_.count == cu::kSummarizeBatchMax) LS_RETURN_IF_ERROR(SummaryFence());
    cu::SummarizeBatchParams::Tensor& t = summary_batch_.t[summary_batch_.count++];
    t.x = dev;
    t.x_stride = stride;
    t.cols = cols;
    t.type = ToRowType(dtype);
    t.out = reinterpret_cast<cu::RowSummaryOut*>(arena_.as<char>() + used_);
  } else {
    if (dtype != TapDType::kF32 && dtype != TapDType::kI32) {
      return Status::Internal("cuda tap capture: tap '" + std::string(name) + "': only summaries of bf16 / E4M3 rows");
    }
    LS_RETURN_IF_ERROR(cu::Copy2DAsync(arena_.as<char>() + used_, static_cast<size_t>(cols) * 4, dev,
                                       static_cast<size_t>(stride) * 4, static_cast<size_t>(cols) * 4,
                                       static_cast<size_t>(rows_), stream_->get()));
  }
  pending_.push_back({name, used_, summaries_only_, cols, cols, dtype});
  used_ += (bytes + 255) / 256 * 256;
  return Status::Ok();
}

static_assert(sizeof(TapRowSummary) == sizeof(cu::RowSummaryOut) &&
              offsetof(TapRowSummary, rms) == offsetof(cu::RowSummaryOut, rms) &&
              offsetof(TapRowSummary, max) == offsetof(cu::RowSummaryOut, max));

Status CudaTapCapture::SummaryFence() {
  if (summary_batch_.count == 0) return Status::Ok();
  summary_batch_.rows = rows_;
  const Status st = cu::SummarizeBatch(summary_batch_, stream_->get());
  summary_batch_.count = 0;
  return st;
}

Status CudaTapCapture::SummarizeSlab(cu::Stream launch) {
  // Summaries go to the tap arena, tap i's rows at i·rows_: summary capture's pending offsets
  // become theirs; full capture's keep the values' place in the slab and gain sum_offset.
  const size_t need = pending_.size() * static_cast<size_t>(rows_) * sizeof(TapRowSummary);
  if (arena_.buf.size() < need) {
    if (capturing_) return Status::Unsupported("tap arena too small during graph capture");
    LS_RETURN_IF_ERROR(arena_.Ensure(need));
  }
  std::vector<cu::SummarizeBatchParams::Tensor> table(pending_.size());
  for (size_t i = 0; i < pending_.size(); ++i) {
    PendingTap& t = pending_[i];
    cu::SummarizeBatchParams::Tensor& d = table[i];
    d.x = t.dev != nullptr ? t.dev : slab_buf_.as<char>() + t.offset;
    d.x_stride = t.stride;
    d.cols = t.cols;
    d.type = ToRowType(t.dtype);
    const size_t at = i * static_cast<size_t>(rows_) * sizeof(TapRowSummary);
    (t.summary ? t.offset : t.sum_offset) = at;
    d.out = reinterpret_cast<cu::RowSummaryOut*>(arena_.as<char>() + at);
  }
  used_ = need;
  SlabTable& st = slab_tables_[rows_];
  const size_t bytes = table.size() * sizeof(table[0]);
  // Field by field (the struct has padding, which memcmp would read).
  auto eq = [](const cu::SummarizeBatchParams::Tensor& a, const cu::SummarizeBatchParams::Tensor& b) {
    return a.x == b.x && a.x_stride == b.x_stride && a.cols == b.cols && a.type == b.type && a.out == b.out;
  };
  const bool same = st.host.size() == table.size() && std::equal(table.begin(), table.end(), st.host.begin(), eq);
  if (!same) {
    // A graph replays the table's device copy as it is: it is written outside captures only.
    if (capturing_) return Status::Unsupported("tap summary table changed during graph capture");
    if (st.dev.size() < bytes) {
      LS_ASSIGN_OR_RETURN(st.dev, cu::DeviceBuffer::Allocate(bytes));
    }
    LS_RETURN_IF_ERROR(stream_->Synchronize());  // a previous step may still read the old table
    LS_RETURN_IF_ERROR(st.dev.CopyFromHost(table.data(), bytes));
    st.host = std::move(table);
  }
  cu::SummarizeTableParams p;
  p.tensors = st.dev.as<cu::SummarizeBatchParams::Tensor>();
  p.count = static_cast<int64_t>(pending_.size());
  p.rows = rows_;
  return cu::SummarizeTable(p, launch);
}

Status CudaTapCapture::TapKvRows(const PagedKvCache& cache, int64_t layers, const uint8_t* mirror, std::span<const size_t> mirror_off) {
  if (kv_taps_.empty()) {  // once: the cache's layout is the engine's for life
    std::vector<KvTap> taps;
    size_t idx = 0;
    for (int64_t l = 0; l < layers; ++l) {
      for (size_t si = 0; si < cache.streams(l).size(); ++si, ++idx) {
        const StreamSpec& st = cache.streams(l)[si];
        for (KvPart& part : cache.parts(l, si)) {
          std::string name = "kv/layers." + std::to_string(l) + "." + st.name + part.suffix;
          taps.push_back({idx, st.bytes_per_token, std::move(part), std::move(name)});
        }
      }
    }
    kv_taps_ = std::move(taps);  // (the strings stay where they are: the hook keys on their address)
  }
  for (const KvTap& k : kv_taps_) {
    const int64_t esize = TapDTypeSize(k.part.type);
    // The summary kernel reads whole 4-byte words from 4-byte aligned rows.
    if (k.mirror >= mirror_off.size() || k.token_bytes % 4 != 0 || k.part.offset % 4 != 0 ||
        (k.part.cols * esize) % 4 != 0) {
      return Status::Internal("cuda tap capture: KV part '" + k.name + "' cannot be summarised on the device");
    }
    const uint8_t* dev = mirror + mirror_off[k.mirror] + k.part.offset;
    const int64_t stride = k.token_bytes / esize;
    if (!summaries_only_) {  // values: the mirror lies in the slab (summaries by SummarizeSlab)
      const size_t at = static_cast<size_t>(dev - slab_buf_.as<uint8_t>());
      if (!slab_ || dev < slab_buf_.as<uint8_t>() || at + static_cast<size_t>(rows_ * k.token_bytes) > slab_bytes_ + k.part.offset) {
        return Status::Internal("cuda tap capture: KV part '" + k.name + "' lies outside the tap slab");
      }
      pending_.push_back({k.name, at, false, k.part.cols, stride, k.part.type});
    } else if (slab_) {
      pending_.push_back({k.name, 0, true, k.part.cols, stride, k.part.type, kNoSummaries, dev});
    } else {
      LS_RETURN_IF_ERROR(Tap(k.name, dev, k.part.cols, stride, k.part.type));
    }
  }
  return Status::Ok();
}

Status CudaTapCapture::Flush() {
  LS_RETURN_IF_ERROR(SummaryFence());
  if (pending_.empty()) return Status::Ok();
  // Values from the slab come in one copy of the whole slab, followed by their summaries from
  // the arena, into a buffer lent to the hook when one comes back in time; anything else
  // from the arena into host_.
  const bool from_slab = slab_ && !summaries_only_;
  const size_t sum_bytes = from_slab ? used_ : 0;
  const size_t bytes = from_slab ? slab_bytes_ + sum_bytes : used_;
  LendingPool::Lease lease;
  if (from_slab) {
    const size_t want = TapLendBuffers(bytes);
    if (!lend_ || lend_max_ > 2 * want) {
      // (re)made for this step's size: lent buffers of an old pool go when their holders let go
      if (lend_) wait_retired_ns_ += lend_->waited_ns();
      lend_ = std::make_unique<LendingPool>(
          [](size_t n) -> Result<std::shared_ptr<void>> {
            LS_ASSIGN_OR_RETURN(cu::PinnedBuffer b, cu::PinnedBuffer::Allocate(n));
            auto held = std::make_shared<cu::PinnedBuffer>(std::move(b));
            return std::shared_ptr<void>(held, held->data());
          },
          want);
      lend_max_ = want;
    }
    LS_ASSIGN_OR_RETURN(lease, lend_->Take(bytes, kLendPatience));
  }
  char* host = static_cast<char*>(lease.data);
  if (host == nullptr) {
    if (host_.size() < bytes) {
      LS_ASSIGN_OR_RETURN(host_, cu::PinnedBuffer::Allocate(bytes));
    }
    host = host_.as<char>();
  }
  LS_RETURN_IF_ERROR(cu::CopyAsync(host, from_slab ? slab_buf_.buf.data() : arena_.buf.data(),
                                   from_slab ? slab_bytes_ : bytes, stream_->get()));
  if (sum_bytes > 0) {
    LS_RETURN_IF_ERROR(cu::CopyAsync(host + slab_bytes_, arena_.buf.data(), sum_bytes, stream_->get()));
  }
  LS_RETURN_IF_ERROR(stream_->Synchronize());
  // The step's taps go to the hook in one call (TapHook::OnStepTaps): an event a tapped
  // tensor, its rows every segment's (the arena and the slab keep a tensor's rows in the
  // step's row order, segment after segment).
  step_segments_.clear();
  for (size_t s = 0; s < segs_.size(); ++s) {
    step_segments_.push_back({segs_[s].request_id, segs_[s].start_pos, static_cast<int64_t>(segs_[s].tokens.size())});
  }
  step_events_.clear();
  size_t strided = 0;
  for (const PendingTap& t : pending_) {
    const char* base = host + t.offset;
    TapEvent e;
    e.name = t.name;
    e.rows = rows_;
    e.cols = t.cols;
    e.dtype = t.dtype;
    if (t.summary) {
      e.summaries = reinterpret_cast<const TapRowSummary*>(base);
    } else {
      if (t.sum_offset != kNoSummaries && sum_bytes > 0) {
        e.summaries = reinterpret_cast<const TapRowSummary*>(host + slab_bytes_ + t.sum_offset);
      }
      if (t.stride == t.cols) {
        e.data = base;
        e.owner = lease.owner;  // (null when not lent)
      } else {  // a strided slab tensor (k_rope inside kv, an FP8 cache's parts): its rows made contiguous here
        const int64_t esize = TapDTypeSize(t.dtype);
        const size_t row_bytes = static_cast<size_t>(t.cols * esize);
        if (strided_rows_.size() <= strided) strided_rows_.resize(strided + 1);
        std::vector<uint32_t>& rows = strided_rows_[strided++];
        rows.resize((static_cast<size_t>(rows_) * row_bytes + 3) / 4);
        auto* out = reinterpret_cast<char*>(rows.data());
        for (int64_t r = 0; r < rows_; ++r) std::memcpy(out + r * row_bytes, base + r * t.stride * esize, row_bytes);
        e.data = rows.data();
      }
    }
    step_events_.push_back(std::move(e));
  }
  hook_->OnStepTaps(step_events_, step_segments_);
  step_events_.clear();  // (the owners' copies: the hook keeps what it keeps)
  pending_.clear();
  used_ = 0;
  return Status::Ok();
}

Status CudaTapCapture::Override(std::string_view name, float* dev_x, int64_t cols) {
  if (hook_ == nullptr || !hook_->WantsOverride()) return Status::Ok();
  LS_RETURN_IF_ERROR(Flush());
  std::vector<float> host(static_cast<size_t>(rows_ * cols));
  LS_RETURN_IF_ERROR(cu::CopyAsync(host.data(), dev_x, host.size() * 4, stream_->get()));
  LS_RETURN_IF_ERROR(stream_->Synchronize());
  bool changed = false;
  for (size_t s = 0; s < segs_.size(); ++s) {
    TapEvent e;
    e.name = name;
    e.request_id = segs_[s].request_id;
    e.position = segs_[s].start_pos;
    e.rows = static_cast<int64_t>(segs_[s].tokens.size());
    e.cols = cols;
    e.data = host.data() + row0_[s] * cols;
    changed |= hook_->Override(e, host.data() + row0_[s] * cols);
  }
  if (changed) {
    LS_RETURN_IF_ERROR(cu::CopyAsync(dev_x, host.data(), host.size() * 4, stream_->get()));
    LS_RETURN_IF_ERROR(stream_->Synchronize());
  }
  return Status::Ok();
}

Result<float*> CudaTapCapture::LogitsBuffer(size_t bytes) {
  const bool share = hook_ != nullptr;
  logits_owner_.reset();
  logits_host_ = nullptr;
  if (share) {
    for (auto& b : logits_shared_) {
      if (b.use_count() != 1) continue;  // a hook's copy of the owner: its reader is not done
      // Its last holder let go after reading (a release); this acquire orders our writes after.
      std::atomic_thread_fence(std::memory_order_acquire);
      if (b->size() < bytes) {
        LS_ASSIGN_OR_RETURN(*b, cu::PinnedBuffer::Allocate(bytes * 3 / 2));
      }
      logits_host_ = b.get();
      logits_owner_ = b;
      return logits_host_->as<float>();
    }
    if (logits_shared_.size() < kLogitsShared) {
      LS_ASSIGN_OR_RETURN(cu::PinnedBuffer fresh, cu::PinnedBuffer::Allocate(bytes * 3 / 2));
      logits_shared_.push_back(std::make_shared<cu::PinnedBuffer>(std::move(fresh)));
      logits_host_ = logits_shared_.back().get();
      logits_owner_ = logits_shared_.back();
      return logits_host_->as<float>();
    }
  }
  if (logits_private_.size() < bytes) {
    LS_ASSIGN_OR_RETURN(logits_private_, cu::PinnedBuffer::Allocate(bytes * 3 / 2));
  }
  logits_host_ = &logits_private_;
  return logits_host_->as<float>();
}

void CudaTapCapture::TapLogits(const float* lg, int64_t vocab) {
  if (hook_ == nullptr) return;
  int64_t lr = 0;
  for (const Segment& g : segs_) {
    const int64_t n = static_cast<int64_t>(g.tokens.size());
    const int64_t first = g.all_logits ? 0 : n - 1, rows = n - first;
    TapEvent e;
    e.name = kModelTaps[kTapLogits].name;
    e.request_id = g.request_id;
    e.position = g.start_pos + first;
    e.rows = rows;
    e.cols = vocab;
    e.data = lg + lr * vocab;  // the pinned copy: with an owner, a hook may keep it
    e.owner = logits_owner_;
    hook_->OnTap(e);
    lr += rows;
  }
}

void CudaTapCapture::EndStep() {
  End();
  logits_owner_.reset();  // the hook's copies, if any, keep the buffer
}

}  // namespace lockstep::engine::cuda_impl
