// engine/rank_group.h — real tensor parallelism's other ranks in this process (the CPU reference's
// rank mode, EngineOptions::tp_ranks; docs/parallelism.md): ranks 1 … N − 1 of a group as
// engines on threads, each running the same requests to completion beside rank 0, which the
// caller drives (records, streams, prints) like any engine. Every rank computes the same tokens.
//
// Start, then create rank 0's engine with the options Start filled in and add the same requests
// in the same order, run it, then Finish. Not thread-safe (the caller's thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"

namespace lockstep::engine {

// What runs beside a follower rank's engine (rank r ≥ 1): the recorder's shard writer
// (recorder/rank_shard_writer.h) — each rank writes its own shard of a trace. Attach comes
// after the engine is made and before its requests are added, EndStep after every step that
// did work (Engine::Step true), Finish once the run is done; a failed run skips Finish and
// destroys the observer. Each may meet the other ranks in the group's collectives: rank 0 does
// the same calls at the same points, so the order of collectives stays the same on every rank.
class FollowerObserver {
 public:
  virtual ~FollowerObserver() = default;
  virtual Status Attach(Engine& engine) = 0;
  virtual Status EndStep() = 0;
  virtual Status Finish() = 0;
};
// Rank r's observer (null: none), made on the rank's own thread or process.
using FollowerObservers = std::function<Result<std::unique_ptr<FollowerObserver>>(int rank)>;

class RankFollowers {
 public:
  // `ranks` ≥ 2; sets rank0->tp_ranks (a copy of `options` otherwise).
  // `observers`, when set, gives each follower its observer.
  static Result<std::unique_ptr<RankFollowers>> Start(std::shared_ptr<Model> model, const EngineOptions& options,
                                                      int ranks, const std::vector<Request>& requests,
                                                      EngineOptions* rank0, FollowerObservers observers = {});
  // After rank 0's run, with its outcome: a rank 0 that stopped early aborts the group (the
  // followers would wait for it forever); waits for every follower; the first error of rank 0's
  // or theirs.
  Status Finish(const Status& rank0);
  ~RankFollowers();  // Finish(aborted) unless done

 private:
  RankFollowers() = default;
  std::vector<std::shared_ptr<kernels::Collective>> group_;
  std::vector<std::thread> threads_;
  std::vector<Status> results_;
  bool done_ = false;
};

// Ranks that are processes (cli/rank_launch.h starts them, one per GPU or several on one
// device): the group they meet in. transport "shm" — processes of one machine in shared memory
// (kernels/shm_collective.h), any backend, several ranks per GPU allowed — or "nccl", one GPU a
// rank (NCCL refuses two on one device). Rank 0 prepares the group before it starts the others,
// who join with `token`; for shm rank 0's collective is ready at once, for nccl rank 0 joins
// too (JoinProcessGroup blocks until every rank has).
struct PreparedGroup {
  std::string token;                            // "shm:/lockstep-tp-…" | "nccl:<hex id>"
  std::shared_ptr<kernels::Collective> rank0;  // shm only
};
Result<PreparedGroup> PrepareProcessGroup(const std::string& transport, int ranks);
Result<std::shared_ptr<kernels::Collective>> JoinProcessGroup(const std::string& token, int rank, int ranks);

// A fingerprint of the work a rank was given (requests and the options that shape a step), to be
// compared across ranks before the first step: processes that parsed the same command line but
// read different files would otherwise fail somewhere mid-run.
uint64_t WorkDigest(const EngineOptions& options, const std::vector<Request>& requests);
// Gathers every rank's digest; an error naming the first rank whose work differs from rank 0's.
Status CheckSameWork(kernels::Collective& group, uint64_t digest);

// Rank r ≥ 1's whole run: an engine on `options` (tp_ranks set), the requests, to completion,
// with `observer` (may be null) beside it.
Status RunFollower(std::shared_ptr<Model> model, const EngineOptions& options, const std::vector<Request>& requests,
                   FollowerObserver* observer = nullptr);

}  // namespace lockstep::engine
