// recorder/recorder.cc — see recorder.h.
#include "recorder/recorder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/tensor_parallel.h"
#include "traces/row_summary.h"
#include "traces/trace_format.h"

namespace lockstep::recorder {

using traces::DType;
using Clock = std::chrono::steady_clock;

Recorder::Recorder(engine::Engine* engine, traces::TraceWriter* writer, RecorderOptions options)
    : engine_(engine), writer_(writer), opts_(std::move(options)) {
  step_start_ = last_flush_ = Clock::now();
}

Recorder::~Recorder() {
  // Detach: the engine may outlive us.
  engine_->SetTapHook(nullptr);
  engine_->SetForwardCallback(nullptr);
  engine_->SetStepCallback(nullptr);
}

void Recorder::Attach() {
  engine_->SetTapHook(opts_.policy.mode == CapturePolicy::Mode::kNone ? nullptr : this);
  engine_->SetForwardCallback(
      [this](std::span<const engine::Segment> segs, const engine::PagedKvCache& cache) { OnForward(segs, cache); });
  engine_->SetStepCallback([this](const engine::StepEvent& ev) { OnStep(ev); });
  step_start_ = last_flush_ = Clock::now();
  stall_at_step_start_ = Stalled();
}

// The engine's waits on the trace so far: a full writer queue, or (the CUDA backend's full
// capture) no lent tap buffer back yet.
int64_t Recorder::Stalled() const { return writer_->stall_ns() + engine_->backend().tap_wait_ns(); }

Status Recorder::AddRequest(int64_t id, const std::string& prompt_text) {
  const engine::Request& r = engine_->request(id).request;
  traces::RequestRecord rec;
  rec.id = static_cast<int32_t>(id);
  rec.name = r.name;
  rec.prompt = r.prompt;
  rec.prompt_text = prompt_text;
  rec.max_new_tokens = r.recorded_max_new_tokens >= 0 ? r.recorded_max_new_tokens : r.max_new_tokens;
  rec.seed = r.sampling.seed;
  rec.temperature = r.sampling.temperature;
  rec.top_k = r.sampling.top_k;
  rec.top_p = r.sampling.top_p;
  rec.min_p = r.sampling.min_p;
  return writer_->AddRequest(rec);
}

const Recorder::Tensor* Recorder::Define(const std::string& path, DType dtype, int64_t cols, bool values,
                                         std::map<std::string, std::string> attrs,
                                         std::map<std::string, int64_t> int_attrs) {
  auto it = tensors_.find(path);
  if (it != tensors_.end()) return &it->second;
  traces::TensorSpec spec{path, dtype, cols, values, std::move(attrs), std::move(int_attrs)};
  auto h = writer_->DefineTensor(spec);
  if (!h.ok()) {
    Fail(h.status());
    return nullptr;
  }
  Tensor t{*h, dtype, cols, values};
  return &tensors_.emplace(path, t).first->second;
}

bool ShardsTap(const CapturePolicy& policy, int64_t ranks, std::string_view name, int64_t cols) {
  return policy.mode == CapturePolicy::Mode::kFull && ranks > 1 && cols % ranks == 0 && policy.WantsTap(name) &&
         name != engine::kModelTaps[engine::kTapLogits].name && engine::IsRankSplitTap(name);
}

Status AppendRankColumns(traces::TraceWriter& shard, int32_t handle, int64_t request, int64_t step,
                         std::span<const int64_t> positions, const std::function<const uint8_t*(int64_t)>& row,
                         size_t part, int64_t rank, std::vector<uint8_t>* scratch) {
  if (positions.empty()) return Status::Ok();
  scratch->resize(positions.size() * part);
  for (size_t k = 0; k < positions.size(); ++k) {
    std::memcpy(scratch->data() + k * part, row(static_cast<int64_t>(k)) + static_cast<size_t>(rank) * part, part);
  }
  return shard.AppendToSummarize(handle, static_cast<int32_t>(request), static_cast<int32_t>(step), positions,
                                 scratch->data());
}

const Recorder::Tensor* Recorder::DefineSharded(const std::string& path, DType dtype, int64_t cols) {
  auto it = tensors_.find(path);
  if (it != tensors_.end()) return &it->second;
  traces::TensorSpec spec{path, dtype, cols, false};
  spec.shard_files = opts_.shard_files;
  auto h = writer_->DefineTensor(spec);
  if (!h.ok()) {
    Fail(h.status());
    return nullptr;
  }
  Tensor t{*h, dtype, cols, false};
  const int64_t n = static_cast<int64_t>(opts_.shard_writers.size());
  for (traces::TraceWriter* w : opts_.shard_writers) {
    if (w == nullptr) {  // written by its own rank
      t.shard_handles.push_back(-1);
      continue;
    }
    auto sh = w->DefineTensor(traces::TensorSpec{path, dtype, cols / n, true});
    if (!sh.ok()) {
      Fail(sh.status());
      return nullptr;
    }
    t.shard_handles.push_back(*sh);
  }
  return &tensors_.emplace(path, t).first->second;
}

void Recorder::AppendShards(const Tensor& t, int64_t request, std::span<const int64_t> positions,
                            const std::function<const uint8_t*(int64_t)>& row) {
  const size_t n = t.shard_handles.size();
  if (n == 0 || positions.empty()) return;
  const size_t part = static_cast<size_t>(t.cols / static_cast<int64_t>(n)) * traces::DTypeSize(t.dtype);
  for (size_t r = 0; r < n && status_.ok(); ++r) {
    if (opts_.shard_writers[r] == nullptr) continue;
    Fail(AppendRankColumns(*opts_.shard_writers[r], t.shard_handles[r], request, steps_, positions, row, part,
                           static_cast<int64_t>(r), &shard_gather_));
  }
}

void Recorder::Capture(const Tensor& t, int64_t request, int64_t position, int64_t rows, const void* data,
                       int64_t row_stride_bytes, const traces::TraceWriter::LogitsTopKTensors* topk,
                       const std::shared_ptr<const void>& owner) {
  const auto* base = static_cast<const uint8_t*>(data);
  CaptureRows(t, request, position, rows, [&](int64_t i) { return base + i * row_stride_bytes; },
              row_stride_bytes == static_cast<int64_t>(t.cols * traces::DTypeSize(t.dtype)) ? base : nullptr, topk,
              owner);
}

void Recorder::CaptureRows(const Tensor& t, int64_t request, int64_t position, int64_t rows,
                           const std::function<const uint8_t*(int64_t)>& row, const uint8_t* contiguous,
                           const traces::TraceWriter::LogitsTopKTensors* topk,
                           const std::shared_ptr<const void>& owner) {
  const CapturePolicy& p = opts_.policy;
  const size_t row_bytes = static_cast<size_t>(t.cols) * traces::DTypeSize(t.dtype);
  positions_.clear();
  for (int64_t i = 0; i < rows; ++i) {
    if (p.WantsPosition(position + i)) positions_.push_back(position + i);
  }
  if (positions_.empty()) return;
  if (!t.shard_handles.empty()) AppendShards(t, request, positions_, [&](int64_t k) { return row(positions_[k] - position); });
  Status s;
  if (!t.values && topk == nullptr && row_bytes <= opts_.summarize_here_max_row_bytes) {
    // Summary only: the statistics and the hash are computed here, in one pass over rows the
    // engine has just written (still in cache). That costs the engine thread less than
    // copying the rows out for the writer thread did, and the rows never travel. Wider rows
    // (a 100k-vocabulary logits row: 400 KB) are copied instead and summarised on the
    // writer's thread, where the copy costs the engine a tenth of the summary.
    const size_t n = positions_.size();
    summaries_.resize(n);
    for (size_t k = 0; k < n; ++k) {
      traces::SummaryRow& r = summaries_[k];
      r = traces::SummaryRow();
      r.position = positions_[k];
      r.request = static_cast<int32_t>(request);
      r.step = static_cast<int32_t>(steps_);
      traces::Summarize(t.dtype, row(positions_[k] - position), t.cols, &r);
    }
    s = writer_->Append(t.handle, summaries_, nullptr);
  } else {
    // The values are stored (or the rows are wide, or the writer derives their top-k): the
    // summaries are computed on the writer's thread, from a copy of the rows — or from the
    // rows where they are, when an owner keeps them there and no position was dropped.
    const uint8_t* values = contiguous;
    const bool in_place = owner != nullptr && values != nullptr && static_cast<int64_t>(positions_.size()) == rows;
    if (static_cast<int64_t>(positions_.size()) != rows || values == nullptr) {
      gather_.resize(positions_.size() * row_bytes);
      for (size_t k = 0; k < positions_.size(); ++k) {
        std::memcpy(gather_.data() + k * row_bytes, row(positions_[k] - position), row_bytes);
      }
      values = gather_.data();
    }
    s = writer_->AppendToSummarize(t.handle, static_cast<int32_t>(request), static_cast<int32_t>(steps_), positions_,
                                   values, topk, in_place ? owner : nullptr);
  }
  if (!s.ok()) Fail(s);
}

traces::SummaryRow ToSummaryRow(const engine::TapRowSummary& s) {
  traces::SummaryRow r;
  r.hash = s.hash;
  r.nan_count = s.nan_count;
  r.inf_count = s.inf_count;
  r.rms = s.rms;
  r.absmax = s.absmax;
  r.min = s.min;
  r.max = s.max;
  return r;
}

traces::DType ToTraceDType(engine::TapDType t) {
  switch (t) {
    case engine::TapDType::kI32: return DType::kI32;
    case engine::TapDType::kBf16: return DType::kBf16;
    case engine::TapDType::kFp8E4m3: return DType::kFp8E4m3;
    case engine::TapDType::kU8: return DType::kU8;
    case engine::TapDType::kF32: break;
  }
  return DType::kF32;
}

traces::SummaryRow Recorder::RowOf(const engine::TapRowSummary& s, int64_t request, int64_t position) const {
  traces::SummaryRow r = ToSummaryRow(s);
  r.position = position;
  r.request = static_cast<int32_t>(request);
  r.step = static_cast<int32_t>(steps_);
  return r;
}

bool Recorder::WantsTapValues() const { return opts_.policy.mode == CapturePolicy::Mode::kFull; }
bool Recorder::WantsKvTaps() const { return opts_.policy.mode != CapturePolicy::Mode::kNone && opts_.policy.kv; }

void Recorder::CaptureSummaries(const Tensor& t, int64_t request, int64_t position, int64_t rows,
                                const engine::TapRowSummary* in, const void* values,
                                const std::shared_ptr<const void>& owner) {
  summaries_.clear();
  for (int64_t i = 0; i < rows; ++i) {
    if (opts_.policy.WantsPosition(position + i)) summaries_.push_back(RowOf(in[i], request, position + i));
  }
  if (summaries_.empty()) return;
  if (!t.shard_handles.empty() && values != nullptr) {
    ShardRowsOf(t, request, position, rows, static_cast<const uint8_t*>(values));  // (summaries_' positions)
  }
  Status s;
  if (!t.values) {
    s = writer_->Append(t.handle, summaries_, nullptr);
  } else if (static_cast<int64_t>(summaries_.size()) == rows) {
    s = writer_->Append(t.handle, summaries_, values, owner);  // every row: lent when owned
  } else {  // the kept positions' rows, gathered
    const size_t row_bytes = static_cast<size_t>(t.cols) * traces::DTypeSize(t.dtype);
    gather_.resize(summaries_.size() * row_bytes);
    for (size_t k = 0; k < summaries_.size(); ++k) {
      std::memcpy(gather_.data() + k * row_bytes,
                  static_cast<const uint8_t*>(values) + (summaries_[k].position - position) * row_bytes, row_bytes);
    }
    s = writer_->Append(t.handle, summaries_, gather_.data());
  }
  if (!s.ok()) Fail(s);
}

const Recorder::TapEntry* Recorder::Resolve(const engine::TapEvent& e) {
  // The engine's tap names live as long as the model, so their address identifies them;
  // the name check guards against an engine that builds names on the fly.
  auto hit = by_address_.find(e.name.data());
  if (hit != by_address_.end() && hit->second.name == e.name) return &hit->second;
  TapEntry fresh;
  fresh.name = std::string(e.name);
  if (fresh.name.rfind(traces::kKvGroup, 0) == 0 && fresh.name.size() > std::strlen(traces::kKvGroup) &&
      fresh.name[std::strlen(traces::kKvGroup)] == '/') {
    // A KV part's rows from the backend: its tensor is the one OnForward would use (none
    // when its layer is not kept, or the policy keeps no KV rows).
    fresh.kv = true;
    if (opts_.policy.kv) {
      if (kv_parts_.empty()) DefineKvTensors(engine_->cache());
      if (!status_.ok()) return nullptr;
      auto it = tensors_.find(fresh.name);
      if (it != tensors_.end()) fresh.tensor = &it->second;
    }
    fresh.wanted = fresh.tensor != nullptr;
    return &(by_address_[e.name.data()] = std::move(fresh));
  }
  fresh.wanted = opts_.policy.WantsTap(e.name);
  if (fresh.wanted && e.name != engine::kModelTaps[engine::kTapLogits].name) {
    const DType dtype = ToTraceDType(e.dtype);
    const bool full = opts_.policy.mode == CapturePolicy::Mode::kFull;
    const int64_t ranks = static_cast<int64_t>(opts_.shard_writers.size());
    const std::string path = std::string(traces::kTapsGroup) + "/" + fresh.name;
    fresh.tensor = ShardsTap(opts_.policy, ranks, fresh.name, e.cols) ? DefineSharded(path, dtype, e.cols)
                                                                       : Define(path, dtype, e.cols, full);
    if (!fresh.tensor) return nullptr;
  }
  return &(by_address_[e.name.data()] = std::move(fresh));  // (map nodes never move)
}

// A step's summary-only rows gather in batch_rows_ / batch_tensors_ and go to the writer in one
// AppendSummaries (FlushBatch); event i of a step is looked up once and then recognised by its
// name's address and length (engine/tap.h: the names of batched events live as long as the
// engine).
const Recorder::TapEntry* Recorder::EntryOfBatch(size_t i, const engine::TapEvent& e) {
  if (batch_entries_.size() <= i) batch_entries_.resize(i + 1);
  const TapEntry* entry = batch_entries_[i].entry;
  if (entry == nullptr || batch_entries_[i].name != e.name.data() || entry->name.size() != e.name.size()) {
    entry = Resolve(e);
    if (entry == nullptr) return nullptr;
    batch_entries_[i] = {entry, e.name.data()};
  }
  kv_came_ |= entry->kv;
  return entry;
}

void Recorder::BatchSummaryRows(const TapEntry& entry, const engine::TapRowSummary* in, int64_t request,
                                int64_t position, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!opts_.policy.WantsPosition(position + r)) continue;
    batch_rows_.push_back(RowOf(in[r], request, position + r));
    batch_tensors_.push_back(entry.tensor->handle);
  }
}

void Recorder::FlushBatch() {
  if (!batch_rows_.empty()) {
    const Status s = writer_->AppendSummaries(batch_tensors_, batch_rows_);
    if (!s.ok()) Fail(s);
  }
  batch_tensors_.clear();
  batch_rows_.clear();
}

void Recorder::OnTapSummaries(std::span<const engine::TapEvent> events) {
  Timed timed(this, &times_.taps_ns);
  if (!status_.ok() || opts_.policy.mode == CapturePolicy::Mode::kNone) return;
  FlushBatch();
  for (size_t i = 0; i < events.size() && status_.ok(); ++i) {
    const engine::TapEvent& e = events[i];
    const TapEntry* entry = EntryOfBatch(i, e);
    if (entry == nullptr) return;
    if (!entry->wanted) continue;
    if (entry->tensor == nullptr || entry->tensor->values || e.summaries == nullptr) {
      FlushBatch();  // what the batch holds goes first: the order is OnTap's
      OnTap(e);      // (and its errors)
      continue;
    }
    BatchSummaryRows(*entry, e.summaries, e.request_id, e.position, e.rows);
    if (!entry->tensor->shard_handles.empty() && e.data != nullptr) {
      ShardRowsOf(*entry->tensor, e.request_id, e.position, e.rows, static_cast<const uint8_t*>(e.data));
    }
  }
  if (status_.ok()) FlushBatch();
}

void Recorder::ShardRowsOf(const Tensor& t, int64_t request, int64_t position, int64_t rows, const uint8_t* data) {
  const size_t row_bytes = static_cast<size_t>(t.cols) * traces::DTypeSize(t.dtype);
  shard_positions_.clear();
  for (int64_t i = 0; i < rows; ++i) {
    if (opts_.policy.WantsPosition(position + i)) shard_positions_.push_back(position + i);
  }
  AppendShards(t, request, shard_positions_,
               [&](int64_t k) { return data + static_cast<size_t>(shard_positions_[k] - position) * row_bytes; });
}


void Recorder::OnStepTaps(std::span<const engine::TapEvent> events, std::span<const engine::TapSegment> segments) {
  Timed timed(this, &times_.taps_ns);
  if (!status_.ok() || opts_.policy.mode == CapturePolicy::Mode::kNone) return;
  FlushBatch();
  int64_t step_rows = 0;
  bool every_position = true;  // the position filter keeps every row of the step
  for (const engine::TapSegment& g : segments) {
    step_rows += g.rows;
    for (int64_t r = 0; r < g.rows && every_position; ++r) every_position = opts_.policy.WantsPosition(g.position + r);
  }
  for (size_t i = 0; i < events.size() && status_.ok(); ++i) {
    const engine::TapEvent& e = events[i];
    const TapEntry* entry = EntryOfBatch(i, e);
    if (entry == nullptr) return;
    if (!entry->wanted) continue;
    const bool summaries_only = entry->tensor != nullptr && !entry->tensor->values && e.summaries != nullptr;
    const bool lent_values = entry->tensor != nullptr && entry->tensor->values && e.summaries != nullptr &&
                             e.data != nullptr && every_position && e.rows == step_rows;
    if (summaries_only) {
      int64_t row0 = 0;
      for (const engine::TapSegment& g : segments) {
        BatchSummaryRows(*entry, e.summaries + row0, g.request_id, g.position, g.rows);
        if (!entry->tensor->shard_handles.empty() && e.data != nullptr) {
          ShardRowsOf(*entry->tensor, g.request_id, g.position, g.rows,
                      static_cast<const uint8_t*>(e.data) + row0 * e.cols * engine::TapDTypeSize(e.dtype));
        }
        row0 += g.rows;
      }
      continue;
    }
    FlushBatch();  // what the batch holds goes first: the order is OnTap's
    if (lent_values) {  // every segment's rows at once: one append of summaries and values
      summaries_.clear();
      int64_t row0 = 0;
      for (const engine::TapSegment& g : segments) {
        for (int64_t r = 0; r < g.rows; ++r) {
          summaries_.push_back(RowOf(e.summaries[row0 + r], g.request_id, g.position + r));
        }
        row0 += g.rows;
      }
      const Status s = writer_->Append(entry->tensor->handle, summaries_, e.data, e.owner);
      if (!s.ok()) Fail(s);
      continue;
    }
    // Anything else (logits, rows the host summarises, a position filter): one event a segment.
    int64_t row0 = 0;
    for (const engine::TapSegment& g : segments) {
      OnTap(engine::SegmentEvent(e, g, row0));
      row0 += g.rows;
    }
  }
  if (status_.ok()) FlushBatch();
}

void Recorder::OnTap(const engine::TapEvent& e) {
  Timed timed(this, &times_.taps_ns);
  if (!status_.ok() || opts_.policy.mode == CapturePolicy::Mode::kNone) return;
  const TapEntry* entry = Resolve(e);
  if (entry == nullptr) return;
  kv_came_ |= entry->kv;
  if (!entry->wanted) return;
  if (!entry->tensor) {
    CaptureLogits(e);
    return;
  }
  if (e.data == nullptr) {
    if (e.summaries == nullptr || entry->tensor->values) {
      Fail(Status::Internal("tap '" + entry->name + "' came without the values the trace stores"));
      return;
    }
    CaptureSummaries(*entry->tensor, e.request_id, e.position, e.rows, e.summaries);
    return;
  }
  if (e.summaries != nullptr) {  // values with the backend's summaries of them: nothing to compute
    CaptureSummaries(*entry->tensor, e.request_id, e.position, e.rows, e.summaries, e.data, e.owner);
    return;
  }
  Capture(*entry->tensor, e.request_id, e.position, e.rows, e.data, e.cols * 4);
}

// Logits: the summary of every row always; the values themselves in full capture when the
// vocabulary is small (or asked for), otherwise the top-k ids and values plus logsumexp,
// which the writer's thread derives from a copy of the rows (traces::LogitsTopK).
void Recorder::CaptureLogits(const engine::TapEvent& e) {
  const CapturePolicy& p = opts_.policy;
  const int64_t V = e.cols;
  const bool full = p.mode == CapturePolicy::Mode::kFull;
  const bool all = full && p.StoreLogitsInFull(V);
  const std::string base = std::string(traces::kTapsGroup) + "/logits";
  const Tensor* t = Define(base, DType::kF32, V, all);
  if (!t) return;
  if (!full || all) {
    Capture(*t, e.request_id, e.position, e.rows, e.data, V * 4, nullptr, e.owner);
    return;
  }
  const int64_t k = std::min<int64_t>(p.logits_topk, V);
  const Tensor* ids = Define(base + ".topk_ids", DType::kI32, k, true, {{"of", "logits"}});
  const Tensor* vals = Define(base + ".topk_values", DType::kF32, k, true, {{"of", "logits"}});
  const Tensor* lse = Define(base + ".logsumexp", DType::kF32, 1, true, {{"of", "logits"}});
  if (!ids || !vals || !lse) return;
  traces::TraceWriter::LogitsTopKTensors topk{ids->handle, vals->handle, lse->handle, k};
  // A sampled request's rows also get their logsumexp at its temperature: the total mass its
  // sampler drew from, which the top-k alone leaves open (verify's SampleFromTopK).
  const double T = engine_->request(e.request_id).request.sampling.temperature;
  if (T > 0 && std::isfinite(T)) {
    const Tensor* lse_t = Define(base + ".logsumexp_t", DType::kF32, 1, true,
                                 {{"of", "logits"}, {"at", "the request's sampling temperature"}});
    if (!lse_t) return;
    topk.logsumexp_t = lse_t->handle;
    topk.temperature = T;
  }
  Capture(*t, e.request_id, e.position, e.rows, e.data, V * 4, &topk, e.owner);
}

// The KV cache rows this forward pass wrote, read back as stored. Tensors per layer and
// stream: kv/layers.L.<stream> — fp32 and bf16 latents whole (kv_lora + rope values), the
// fp8 latent as its three parts (e4m3 values, fp32 scales, bf16 rope), indexer keys fp32.
void Recorder::OnForward(std::span<const engine::Segment> segs, const engine::PagedKvCache& cache) {
  Timed timed(this, &times_.kv_ns);
  step_batch_.clear();
  step_tokens_ = 0;
  for (const auto& s : segs) {
    step_batch_.push_back(s.request_id);
    step_tokens_ += static_cast<int64_t>(s.tokens.size());
  }
  const CapturePolicy& p = opts_.policy;
  // The backend handed this step's rows over as kv/ taps: the host cache does not hold them.
  const bool came = kv_came_;
  kv_came_ = false;
  if (came || !status_.ok() || p.mode == CapturePolicy::Mode::kNone || !p.kv) return;
  if (kv_parts_.empty()) DefineKvTensors(cache);
  for (const KvPart& part : kv_parts_) {
    const int64_t cadence = cache.streams(part.layer)[part.stream].cadence;
    for (const auto& s : segs) {
      const int64_t n = static_cast<int64_t>(s.tokens.size());
      if (cadence > 1) {
        // A row every `cadence` tokens (DeepSeek-V4's compressed rows): slot w is written at
        // the position that closes its window, (w + 1)·cadence − 1, and recorded there.
        for (int64_t p = s.start_pos; p < s.start_pos + n; ++p) {
          if ((p + 1) % cadence != 0) continue;
          CaptureRows(*part.tensor, s.request_id, p, 1, [&](int64_t) {
            return cache.PartBytes(part.layer, part.stream, *s.cache, (p + 1) / cadence - 1, part.part);
          });
        }
        continue;
      }
      // A part's bytes are contiguous in its page; tokens are not.
      CaptureRows(*part.tensor, s.request_id, s.start_pos, n, [&](int64_t i) {
        return cache.PartBytes(part.layer, part.stream, *s.cache, s.start_pos + i, part.part);
      });
    }
  }
}

// The KV tensors, once: per kept layer and stream, the parts of a token's bytes
// (PagedKvCache::parts).
void Recorder::DefineKvTensors(const engine::PagedKvCache& cache) {
  const bool full = opts_.policy.mode == CapturePolicy::Mode::kFull;
  const engine::ModelConfig& c = engine_->model().config();
  const std::string fmt(engine::KvFormatName(cache.format()));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!opts_.policy.WantsKvLayer(l)) continue;
    const auto& streams = cache.streams(l);
    for (size_t si = 0; si < streams.size(); ++si) {
      const engine::StreamSpec& st = streams[si];
      for (const engine::KvPart& part : cache.parts(l, si)) {
        const DType dtype = ToTraceDType(part.type);
        const std::string path =
            std::string(traces::kKvGroup) + "/layers." + std::to_string(l) + "." + st.name + part.suffix;
        const Tensor* t = Define(path, dtype, part.cols, full,
                                 {{"kv_format", fmt}, {"stream", st.name}, {"part", part.what}},
                                 {{"token_bytes", st.bytes_per_token}, {"byte_offset", part.offset}});
        if (!t) return;
        kv_parts_.push_back({l, si, part, t});
      }
    }
  }
}

void Recorder::OnStep(const engine::StepEvent& ev) {
  Timed timed(this, &times_.steps_ns);
  const engine::RequestState& r = engine_->request(ev.request_id);
  const engine::SamplingParams& sp = r.request.sampling;
  traces::SamplingRow row;
  row.request = static_cast<int32_t>(ev.request_id);
  row.token = ev.token;
  row.token_index = ev.token_index;
  row.step = ev.step;
  row.seed = sp.seed;
  row.counter = ev.sample.counter;
  row.top_k = sp.top_k;
  row.candidates = ev.sample.candidates;
  row.probability = ev.sample.probability;
  row.uniform = ev.sample.uniform;
  row.temperature = sp.temperature;
  row.top_p = sp.top_p;
  row.min_p = sp.min_p;
  row.batch_size = static_cast<int32_t>(ev.batch_size);
  row.finished = !ev.finished ? 0 : ev.finish_reason == "length" ? 1 : ev.finish_reason == "stop" ? 2 : 3;
  row.sampled = ev.sample.token;
  row.forced = ev.forced ? 1 : 0;
  ++tokens_;
  Status s = writer_->AppendSampling(row);
  if (s.ok() && ev.finished) {
    const std::string text = opts_.detokenize ? opts_.detokenize(r.generated) : "";
    s = writer_->FinishRequest(static_cast<int32_t>(ev.request_id), r.generated, text, ev.finish_reason);
  }
  if (!s.ok()) Fail(s);
}

Status Recorder::EndStep() {
  Timed timed(this, &times_.steps_ns);
  const auto now = Clock::now();
  traces::StepRow row;
  row.step = steps_;
  row.batch_size = static_cast<int32_t>(step_batch_.size());
  row.tokens = static_cast<int32_t>(step_tokens_);
  row.wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - step_start_).count();
  const int64_t stall = Stalled();
  row.stall_ns = stall - stall_at_step_start_;
  stall_at_step_start_ = stall;
  Status s = writer_->AppendStep(row, step_batch_);
  if (!s.ok()) Fail(s);
  ++steps_;
  if (status_.ok() &&
      (opts_.flush_interval_s <= 0 || std::chrono::duration<double>(now - last_flush_).count() >= opts_.flush_interval_s)) {
    // The shards first: a trace's flushed rows never point past what its shards hold.
    for (traces::TraceWriter* w : opts_.shard_writers) {
      if (w != nullptr) Fail(w->Flush(steps_));
    }
    Fail(writer_->Flush(steps_));
    last_flush_ = now;
  } else {
    for (traces::TraceWriter* w : opts_.shard_writers) {
      if (w != nullptr) w->Submit();
    }
    writer_->Submit();  // the step's rows go to the writer thread in one hand-over
  }
  step_start_ = Clock::now();
  for (traces::TraceWriter* w : opts_.shard_writers) {
    if (w != nullptr && status_.ok()) Fail(w->status());
  }
  if (status_.ok()) Fail(writer_->status());
  return status_;
}

Status Recorder::Finish() {
  for (traces::TraceWriter* w : opts_.shard_writers) {
    if (w != nullptr && status_.ok()) Fail(w->Flush(steps_));
  }
  if (status_.ok()) Fail(writer_->Flush(steps_));
  return status_;
}

}  // namespace lockstep::recorder
