// recorder/rank_shard_writer.cc — see rank_shard_writer.h.
#include "recorder/rank_shard_writer.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "engine/tap.h"
#include "recorder/recorder.h"
#include "traces/trace_format.h"
#include "traces/trace_writer.h"

namespace lockstep::recorder {
namespace {

using Clock = std::chrono::steady_clock;

// Rank r ≥ 1's shard: the column block r of every tap ShardsTap keeps, as the recorder's shard
// writer r would have appended it on rank 0 (Recorder::DefineSharded / AppendShards).
class RankShardWriter final : public engine::FollowerObserver, public engine::TapHook {
 public:
  RankShardWriter(const RecordSessionOptions& o, int rank) : options_(o), rank_(rank) {}
  ~RankShardWriter() override {
    if (engine_ != nullptr) engine_->SetTapHook(nullptr);
    if (writer_) (void)writer_->Close();  // a failed run: what was flushed, marked incomplete
  }

  Status Attach(engine::Engine& eng) override {
    group_ = eng.options().tp_ranks;
    if (!group_ || group_->rank() != rank_) {
      return Status::Internal("rank " + std::to_string(rank_) + "'s shard writer: the engine is not that rank");
    }
    ranks_ = group_->size();
    LS_ASSIGN_OR_RETURN(const std::string run_id, ShareRunId(*group_, ""));
    auto w = traces::TraceWriter::Create(traces::ShardPath(options_.output, rank_), ShardWriterOptionsOf(options_, ranks_));
    if (!w.ok()) return w.status();
    writer_ = std::move(*w);
    LS_RETURN_IF_ERROR(SetShardMeta(*writer_, rank_, ranks_, run_id, rank_));
    engine_ = &eng;
    eng.SetTapHook(this);
    last_flush_ = Clock::now();
    return Status::Ok();
  }

  void OnTap(const engine::TapEvent& e) override {
    if (!status_.ok() || e.data == nullptr || e.rows <= 0) return;
    const Entry* t = Resolve(e);
    if (t == nullptr || t->handle < 0) return;
    positions_.clear();
    for (int64_t i = 0; i < e.rows; ++i) {
      if (options_.policy.WantsPosition(e.position + i)) positions_.push_back(e.position + i);
    }
    if (positions_.empty()) return;
    const size_t row_bytes = static_cast<size_t>(e.cols) * t->elem;
    const auto* base = static_cast<const uint8_t*>(e.data);
    Fail(AppendRankColumns(
        *writer_, t->handle, e.request_id, steps_, positions_,
        [&](int64_t k) { return base + static_cast<size_t>(positions_[k] - e.position) * row_bytes; },
        row_bytes / static_cast<size_t>(ranks_), rank_, &gather_));
  }

  Status EndStep() override {
    ++steps_;
    const auto now = Clock::now();
    if (status_.ok() && (options_.flush_interval_s <= 0 ||
                         std::chrono::duration<double>(now - last_flush_).count() >= options_.flush_interval_s)) {
      Fail(writer_->Flush(steps_));
      last_flush_ = now;
    } else {
      writer_->Submit();
    }
    if (status_.ok()) Fail(writer_->status());
    return status_;
  }

  Status Finish() override {
    if (status_.ok()) Fail(writer_->Flush(steps_));
    if (status_.ok()) Fail(writer_->Close());
    LS_RETURN_IF_ERROR(status_);
    return MeetShardsClosed(*group_);
  }

 private:
  struct Entry {
    std::string name;
    int32_t handle = -1;  // −1: not a sharded tap
    size_t elem = 4;
  };
  const Entry* Resolve(const engine::TapEvent& e) {
    auto hit = by_address_.find(e.name.data());
    if (hit != by_address_.end() && hit->second.name == e.name) return &hit->second;
    Entry fresh;
    fresh.name = std::string(e.name);
    if (ShardsTap(options_.policy, ranks_, fresh.name, e.cols)) {
      const traces::DType dtype = ToTraceDType(e.dtype);
      fresh.elem = traces::DTypeSize(dtype);
      auto h = writer_->DefineTensor(
          traces::TensorSpec{std::string(traces::kTapsGroup) + "/" + fresh.name, dtype, e.cols / ranks_, true});
      if (!h.ok()) {
        Fail(h.status());
        return nullptr;
      }
      fresh.handle = *h;
    }
    return &(by_address_[e.name.data()] = std::move(fresh));
  }
  // The first error is kept (the writer's name the shard's file, the launcher adds the rank).
  void Fail(const Status& s) {
    if (status_.ok() && !s.ok()) status_ = s;
  }

  RecordSessionOptions options_;
  int rank_;
  int64_t ranks_ = 0;
  std::shared_ptr<kernels::Collective> group_;
  engine::Engine* engine_ = nullptr;
  std::unique_ptr<traces::TraceWriter> writer_;
  std::unordered_map<const void*, Entry> by_address_;
  std::vector<int64_t> positions_;
  std::vector<uint8_t> gather_;
  int64_t steps_ = 0;
  Clock::time_point last_flush_;
  Status status_;
};

}  // namespace

Result<std::string> ShareRunId(kernels::Collective& group, const std::string& rank0_id) {
  // 64 bits as four 16-bit pieces, each exact as a float (as engine::CheckSameWork carries its digest).
  uint64_t id = 0;
  if (group.rank() == 0) {
    char* end = nullptr;
    id = std::strtoull(rank0_id.c_str(), &end, 16);
    if (rank0_id.size() != 16 || *end != '\0') return Status::Internal("run id '" + rank0_id + "': not 16 hex digits");
  }
  float mine[4];
  for (int i = 0; i < 4; ++i) mine[i] = static_cast<float>((id >> (16 * i)) & 0xffff);
  std::vector<float> all(static_cast<size_t>(group.size()) * 4);
  LS_RETURN_IF_ERROR(group.AllGather(mine, 4, all.data()));
  uint64_t theirs = 0;
  for (int i = 0; i < 4; ++i) theirs |= static_cast<uint64_t>(all[i]) << (16 * i);
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(theirs));
  return std::string(buf);
}

Status MeetShardsClosed(kernels::Collective& group) {
  // A barrier: a rank whose shard failed never arrives, it aborts the group with the reason.
  const float arrived = 1.0f;
  std::vector<float> all(static_cast<size_t>(group.size()));
  return group.AllGather(&arrived, 1, all.data());
}

Result<std::unique_ptr<engine::FollowerObserver>> NewRankShardWriter(const RecordSessionOptions& options, int rank) {
  // Rank 0 shards under the same conditions (RecordRun); when it does not, it refuses the run
  // itself, and this rank records nothing (its group is aborted before the first step).
  if (!options.rank_shards || options.policy.mode != CapturePolicy::Mode::kFull || rank < 1) {
    return std::unique_ptr<engine::FollowerObserver>();
  }
  return std::unique_ptr<engine::FollowerObserver>(new RankShardWriter(options, rank));
}

}  // namespace lockstep::recorder
