// engine/rank_group.h — real tensor parallelism's other ranks in this process (the CPU reference's
// rank mode, EngineOptions::tp_ranks; docs/parallelism.md): ranks 1 … N − 1 of a group as
// engines on threads, each running the same requests to completion beside rank 0, which the
// caller drives (records, streams, prints) like any engine. Every rank computes the same tokens.
//
// Start, then create rank 0's engine with the options Start filled in and add the same requests
// in the same order, run it, then Finish. Not thread-safe (the caller's thread).
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"

namespace lockstep::engine {

class RankFollowers {
 public:
  // `ranks` ≥ 2; sets rank0->tp_ranks (a copy of `options` otherwise).
  static Result<std::unique_ptr<RankFollowers>> Start(std::shared_ptr<Model> model, const EngineOptions& options,
                                                      int ranks, const std::vector<Request>& requests,
                                                      EngineOptions* rank0);
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

}  // namespace lockstep::engine
