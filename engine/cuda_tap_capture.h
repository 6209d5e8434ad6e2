// engine/cuda_tap_capture.h — the CUDA backend's tap capture: a step's taps copied or
// summarised where the tensors live and handed to the hook together, with one device→host copy
// and one synchronisation (engine/tap_capture.h says what a capture is).
//
// Three ways a step's taps travel, chosen per step by the backend:
//   * the arena (prefill steps, grafting): each Tap copies the rows (full capture) or queues
//     them for a batched summary launch (summary capture, SummaryFence) into a device arena;
//     Flush copies the arena to the host and hands every tap over (TapHook::OnStepTaps).
//   * the slab (decode steps of up to kSlabMaxRows rows): the forward pass writes every tapped
//     tensor into its own place of the slab (CudaStep::SlabAt), so Tap only remembers where;
//     SummarizeSlab summarises all of them in one launch, and Flush hands over the summaries, or
//     the whole slab with them in a pinned buffer lent to the hook (TapEvent::owner, from a
//     LendingPool: the recorder's writer compresses the rows where they landed).
//   * KV events (TapHook::WantsKvTaps): the step's new cache rows, from the backend's cache
//     mirror, as kv/layers.L.… taps after the step's own (TapKvRows).
// The step's logits come last, from a host buffer the capture lends with them (LogitsBuffer,
// TapLogits).
// Everything a captured CUDA graph replays (the arena copies, the summary launches and their
// descriptor tables) stays put between its launches; Held/Restore carry the pending list a
// graph's launch leaves behind.
// Private to the CUDA backend (engine/cuda_backend.cc, cuda_forward.cc, cuda_blocks.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/cuda_scratch.h"
#include "engine/kv_cache.h"
#include "engine/lending_pool.h"
#include "engine/tap_capture.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

namespace lockstep::engine::cuda_impl {

class CudaTapCapture final : public TapCapture {
 public:
  // A step whose slab would pass 1 GiB (large models at large batches; V2-Lite takes 2 MB a row)
  // takes the arena instead.
  static constexpr int64_t kSlabMaxRows = 256;
  static constexpr size_t kSlabMaxBytes = size_t{1} << 30;

  static constexpr size_t kNoSummaries = ~size_t{0};
  struct PendingTap {
    std::string_view name;  // stable for the engine's life (TapCapture::Tap)
    size_t offset = 0;
    bool summary = false;  // the arena holds rows TapRowSummary at offset, not the values
    int64_t cols = 0;
    int64_t stride = 0;  // values: row stride in elements (the slab keeps a tensor's layout)
    TapDType dtype = TapDType::kF32;
    // Values with summaries (full capture from the slab): the rows' summaries in the arena at
    // sum_offset; kNoSummaries when none were made.
    size_t sum_offset = kNoSummaries;
    // A summary-only tensor outside the slab in a slab step (the KV rows in the cache mirror):
    // where SummarizeSlab reads it, `stride` elements of `dtype` apart.
    const void* dev = nullptr;
  };

  // `generation`: the backend's buffer-move counter (Scratch).
  explicit CudaTapCapture(int64_t* generation);
  // The backend's main stream, which the copies, summaries and synchronisations go on.
  void set_stream(kernels::cuda::CudaStream* s) { stream_ = s; }

  // The step's start: its hook (null: no taps), segments and rows (they must live through the step).
  void BeginStep(TapHook* hook, std::span<const Segment> segs, std::span<const int64_t> row0, int64_t rows);
  void EndStep();
  // Whether this step has a hook (Tap does nothing without one).
  bool active() const { return hook_ != nullptr; }
  // The hook reads summaries only (TapHook::WantsTapValues false): set by BeginStep.
  bool summaries_only() const { return summaries_only_; }
  // The slab of `bytes` for this step when `on`; Tap then requires every tensor inside it.
  Status UseSlab(bool on, size_t bytes);
  bool slab() const { return slab_; }
  const Scratch& slab_buffer() const { return slab_buf_; }
  // Whether this step's cache rows go to the hook as kv/ events (TapKvRows).
  void set_kv_events(bool on) { kv_events_ = on; }
  bool kv_events() const { return kv_events_; }
  // The arena, made on the first step with a hook.
  Status EnsureArena();

  Status Tap(std::string_view name, const void* dev, int64_t cols, int64_t stride, TapDType dtype) override;
  // Copies x to the host, offers each segment's rows to the hook and copies them back when it
  // changed any (grafting steps run plainly, never as a graph).
  Status Override(std::string_view name, float* dev_x, int64_t cols) override;
  Status Flush() override;
  // Summary capture through the arena: summarises the queued taps in one launch. The forward
  // pass calls it before a tapped buffer is written again; Flush calls it too.
  Status SummaryFence();
  // Slab steps: summarises every pending tap in one launch on `launch` (summary capture: the
  // summaries are the taps; full capture: beside the values).
  Status SummarizeSlab(kernels::cuda::Stream launch);
  // The step's new cache rows in the mirror at `mirror` (mirror_off: where each layer's streams
  // lie, in PagedKvCache order; the cache's layout is fixed for the engine's life) as taps named
  // kv/layers.L.<stream><part>, one per part (PagedKvCache::parts).
  Status TapKvRows(const PagedKvCache& cache, int64_t layers, const uint8_t* mirror, std::span<const size_t> mirror_off);

  // CUDA graphs: a graph's capture fails rather than flush (set_capturing), and its launch
  // leaves the pending taps it captured (Held at the capture, Restore after each launch).
  void set_capturing(bool on) { capturing_ = on; }
  struct Captured {
    std::vector<PendingTap> pending;
    size_t used = 0;
  };
  Captured Held() const;
  void Restore(const Captured& c);
  void Drop();

  // The step's logits on the host [logit rows, vocab], where the device copies them: a pinned
  // buffer nobody else holds. With a hook it is one of kLogitsShared buffers lent with the
  // logits taps (TapEvent::owner: the recorder's writer thread summarises the rows in place),
  // the first whose holders let go; when all are held, and without a hook, a private one (the
  // hook then copies).
  Result<float*> LogitsBuffer(size_t bytes);
  // Each segment's logits rows (its last, or all with all_logits) of lg — LogitsBuffer's, after
  // the step's synchronisation — as tap "logits".
  void TapLogits(const float* lg, int64_t vocab);

  // Nanoseconds steps waited for the hook to give back a lent buffer (Backend::tap_wait_ns).
  int64_t wait_ns() const { return wait_retired_ns_ + (lend_ ? lend_->waited_ns() : 0); }

 private:
  kernels::cuda::CudaStream* stream_ = nullptr;
  bool summaries_only_ = false;
  bool capturing_ = false;
  std::vector<PendingTap> pending_;
  size_t used_ = 0;  // bytes of the arena the pending taps hold
  Scratch arena_;
  kernels::cuda::PinnedBuffer host_;
  kernels::cuda::SummarizeBatchParams summary_batch_;

  bool slab_ = false;
  size_t slab_bytes_ = 0;
  Scratch slab_buf_;
  // SummarizeSlab's descriptor table, by rows: uploaded when a step runs uncaptured, and
  // required unchanged while a graph is captured (the graph replays its device copy).
  struct SlabTable {
    std::vector<kernels::cuda::SummarizeBatchParams::Tensor> host;
    kernels::cuda::DeviceBuffer dev;
  };
  std::map<int64_t, SlabTable> slab_tables_;

  bool kv_events_ = false;
  struct KvTap {
    size_t mirror;        // the layer's stream's index in mirror_off
    int64_t token_bytes;  // the stream's
    KvPart part;
    std::string name;  // stable: made once (the hook keys on the address)
  };
  std::vector<KvTap> kv_taps_;

  std::vector<std::vector<uint32_t>> strided_rows_;  // Flush: each strided tap's rows, contiguous
  std::vector<TapEvent> step_events_;                 // Flush: the step's, for TapHook::OnStepTaps
  std::vector<TapSegment> step_segments_;
  // Full capture from the slab: TapLendBuffers(step) pinned buffers lent to the hook
  // (engine/lending_pool.h), allocated as steps find all others lent; then a step waits for one
  // to come back, and after kLendPatience hands its rows over unlent from host_. The pool is
  // remade when a step needs far less than its buffers would hold.
  static constexpr std::chrono::seconds kLendPatience{5};
  static constexpr size_t kLogitsShared = 4;
  std::vector<std::shared_ptr<kernels::cuda::PinnedBuffer>> logits_shared_;
  kernels::cuda::PinnedBuffer logits_private_;
  kernels::cuda::PinnedBuffer* logits_host_ = nullptr;
  std::shared_ptr<const void> logits_owner_;  // logits_host_'s, when shared
  std::unique_ptr<LendingPool> lend_;
  size_t lend_max_ = 0;
  int64_t wait_retired_ns_ = 0;  // waits of pools replaced since
};

}  // namespace lockstep::engine::cuda_impl
