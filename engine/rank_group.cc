// engine/rank_group.cc — see rank_group.h.
#include "engine/rank_group.h"

#include <string>

namespace lockstep::engine {

Result<std::unique_ptr<RankFollowers>> RankFollowers::Start(std::shared_ptr<Model> model, const EngineOptions& options,
                                                            int ranks, const std::vector<Request>& requests,
                                                            EngineOptions* rank0) {
  if (ranks < 2 || ranks > 64) {
    return Status::InvalidArgument("--tp-ranks " + std::to_string(ranks) + ": not in 2..64");
  }
  std::unique_ptr<RankFollowers> f(new RankFollowers());
  f->group_ = kernels::LocalCollectives(ranks);
  f->results_.assign(static_cast<size_t>(ranks), Status::Ok());
  *rank0 = options;
  rank0->tp_ranks = f->group_[0];
  for (int r = 1; r < ranks; ++r) {
    f->threads_.emplace_back([model, options, requests, r, f = f.get()] {
      EngineOptions mine = options;
      mine.tp_ranks = f->group_[r];
      Status s = [&]() -> Status {
        LS_ASSIGN_OR_RETURN(auto eng, Engine::Create(model, mine));
        for (Request q : requests) LS_RETURN_IF_ERROR(eng->AddRequest(std::move(q)).status());
        return eng->RunToCompletion();
      }();
      if (!s.ok()) f->group_[r]->Abort(s);  // (Engine::Step aborts on its own failures; this covers the rest)
      f->results_[r] = s.ok() ? s : s.WithContext("rank " + std::to_string(r) + ": ");
    });
  }
  return f;
}

Status RankFollowers::Finish(const Status& rank0) {
  if (done_) return rank0;
  done_ = true;
  // Rank 0 done: the others are past every collective of the run (or it stopped early: they
  // would wait for it).
  group_[0]->Abort(rank0.ok() ? Status::Internal("rank 0 finished") : rank0.WithContext("rank 0: "));
  for (auto& t : threads_) t.join();
  if (!rank0.ok()) return rank0;
  for (const Status& s : results_) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

RankFollowers::~RankFollowers() { (void)Finish(Status::Internal("rank 0 stopped")); }

}  // namespace lockstep::engine
