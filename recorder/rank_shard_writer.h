// recorder/rank_shard_writer.h — each rank writes its own shard. Under real ranks (--tp-ranks N,
// threads or processes) with --rank-shards, rank r ≥ 1 writes <trace>.rank<r> itself, beside its
// engine, while rank 0's RecordRun writes the trace and shard 0 (docs/parallelism.md, "Rank
// shards"): the compression and the disk writes of a multi-GPU recording spread over the ranks.
// The files are the ones the emulation's single writer makes (the same tensors, rows, chunks and
// bytes); a shard's /meta also says which rank and process wrote it (kMetaShardWriterRank, _Pid).
//
// The ranks agree through their group's collective (kernels/collective.h), at two points that
// every rank reaches in the same order among the engine's own collectives:
//   start — the run id rank 0 drew reaches every rank (each shard names its run);
//   end   — every rank has closed its shard before rank 0 closes the trace: a trace marked
//           complete has complete shards.
// In between each writer flushes on its own timer (RecorderOptions::flush_interval_s), so after
// a crash each file holds what it flushed and the reader keeps the rows every shard holds (the
// rest: "no values", with a note). A rank whose shard fails aborts the group with the reason,
// which rank 0 reports.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "engine/rank_group.h"
#include "kernels/collective.h"
#include "recorder/record_session.h"

namespace lockstep::recorder {

// Start: every rank calls it; rank 0 gives the run id it drew (16 hex digits), the others ""; the
// result is rank 0's on every rank.
Result<std::string> ShareRunId(kernels::Collective& group, const std::string& rank0_id);
// End: every rank calls it once its shard is closed; returns when all have.
Status MeetShardsClosed(kernels::Collective& group);

// Rank `rank` ≥ 1's shard writer, for RecordRun's options on rank 0 (the same command line): the
// observer RunFollower runs beside the rank's engine (engine/rank_group.h).
Result<std::unique_ptr<engine::FollowerObserver>> NewRankShardWriter(const RecordSessionOptions& options, int rank);

}  // namespace lockstep::recorder
