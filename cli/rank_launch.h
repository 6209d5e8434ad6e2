// cli/rank_launch.h — `--tp-ranks N --tp-launch processes`: tensor parallelism's ranks as
// processes, the way a multi-GPU run has them (docs/parallelism.md, "Ranks as processes").
//
// The command the user ran is rank 0. It prepares the group (engine/rank_group.h: shared memory,
// or NCCL with a GPU a rank), starts ranks 1 … N − 1 as this program with the same command line
// and the group's token in their environment (LOCKSTEP_TP_RANK, LOCKSTEP_TP_RANKS,
// LOCKSTEP_TP_GROUP), joins, and checks every rank was given the same work. A started rank
// parses the same flags, loads the same model, joins, runs the same requests to completion and
// exits (CreateRankedEngine does that for it, in cli/common.cc); its stdout is /dev/null and its
// stderr a log file whose last line an error quotes. Under NCCL rank r sees GPU r first
// (CUDA_VISIBLE_DEVICES rotated, every GPU still visible for NCCL's peer-to-peer paths).
//
// Failure: a rank that exits early aborts the group with its exit status and log line, so no
// rank waits for it; a rank 0 that fails kills the others; a started rank dies with its parent
// (PR_SET_PDEATHSIG).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"
#include "engine/rank_group.h"

namespace lockstep::cli {

// This process is a started rank r ≥ 1 (LOCKSTEP_TP_RANK is set).
bool IsLaunchedRank();

// A started rank's whole run: joins the group its environment names (its rank count must be
// `ranks`), checks its work against rank 0's, runs `requests` to completion. The process's exit
// status; errors on stderr.
// `observers` (may be empty) gives the rank what runs beside its engine (engine/rank_group.h).
int RunLaunchedRank(const std::shared_ptr<engine::Model>& model, engine::EngineOptions options, int ranks,
                    const std::vector<engine::Request>& requests, const engine::FollowerObservers& observers = {});

// Rank 0's side. Not thread-safe (the caller's thread).
class RankProcesses {
 public:
  // transport: "auto" (nccl when the backend is cuda and this machine has a GPU a rank, else shm),
  // "shm" or "nccl". Sets rank0 = options with tp_ranks the group's rank 0.
  static Result<std::unique_ptr<RankProcesses>> Launch(const engine::EngineOptions& options, int ranks,
                                                       const std::string& transport,
                                                       const std::vector<engine::Request>& requests,
                                                       engine::EngineOptions* rank0);
  // After rank 0's run, with its outcome: waits for every rank (killing them when rank 0 failed);
  // the first error of rank 0's or theirs.
  Status Finish(const Status& rank0);
  ~RankProcesses();  // Finish(aborted) unless done

  const std::string& transport() const { return transport_; }

 private:
  RankProcesses() = default;
  struct Child {
    pid_t pid = -1;
    std::string log;
    int status = -1;  // waitpid's, once exited
  };
  Status ChildError(int r) const;
  void KillAll();

  std::string transport_;
  std::shared_ptr<kernels::Collective> group_;
  std::vector<Child> children_;  // ranks 1 … N − 1 at [r − 1]
  std::vector<std::thread> watchers_;  // one a child: waitpid, and an abort when it exits early
  mutable std::mutex mu_;              // children_[i].status
  std::atomic<bool> joined_{false};    // rank 0 is in the group (before: a dead child ends rank 0)
  std::atomic<bool> finishing_{false};  // Finish has begun: an exit is no news
  bool done_ = false;
};

}  // namespace lockstep::cli
