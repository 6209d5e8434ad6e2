// engine/rank_group.cc — see rank_group.h.
#include "engine/rank_group.h"

#include <cstring>
#include <string>

#include "engine/cuda_backend.h"
#include "kernels/shm_collective.h"

namespace lockstep::engine {

Status RunFollower(std::shared_ptr<Model> model, const EngineOptions& options, const std::vector<Request>& requests,
                   FollowerObserver* observer) {
  LS_ASSIGN_OR_RETURN(auto eng, Engine::Create(std::move(model), options));
  if (observer != nullptr) LS_RETURN_IF_ERROR(observer->Attach(*eng));
  for (Request q : requests) LS_RETURN_IF_ERROR(eng->AddRequest(std::move(q)).status());
  if (observer == nullptr) return eng->RunToCompletion();
  while (true) {  // rank 0's loop (recorder/record_session.cc RecordRun)
    LS_ASSIGN_OR_RETURN(bool more, eng->Step());
    if (!more) break;
    LS_RETURN_IF_ERROR(observer->EndStep());
  }
  return observer->Finish();
}

Result<std::unique_ptr<RankFollowers>> RankFollowers::Start(std::shared_ptr<Model> model, const EngineOptions& options,
                                                            int ranks, const std::vector<Request>& requests,
                                                            EngineOptions* rank0, FollowerObservers observers) {
  if (ranks < 2 || ranks > 64) {
    return Status::InvalidArgument("--tp-ranks " + std::to_string(ranks) + ": not in 2..64");
  }
  std::unique_ptr<RankFollowers> f(new RankFollowers());
  f->group_ = kernels::LocalCollectives(ranks);
  f->results_.assign(static_cast<size_t>(ranks), Status::Ok());
  *rank0 = options;
  rank0->tp_ranks = f->group_[0];
  for (int r = 1; r < ranks; ++r) {
    f->threads_.emplace_back([model, options, requests, r, observers, f = f.get()] {
      EngineOptions mine = options;
      mine.tp_ranks = f->group_[r];
      Status s = [&]() -> Status {
        std::unique_ptr<FollowerObserver> observer;
        if (observers) {
          LS_ASSIGN_OR_RETURN(observer, observers(r));
        }
        return RunFollower(model, mine, requests, observer.get());
      }();
      if (!s.ok()) {
        s = s.WithContext("rank " + std::to_string(r) + ": ");
        f->group_[r]->Abort(s);  // (Engine::Step aborts on its own failures; this covers the rest)
      }
      f->results_[r] = s;
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

Result<PreparedGroup> PrepareProcessGroup(const std::string& transport, int ranks) {
  PreparedGroup g;
  if (transport == "shm") {
    LS_ASSIGN_OR_RETURN(kernels::ShmGroup shm, kernels::CreateShmGroup(ranks));
    g.token = "shm:" + shm.name;
    g.rank0 = std::move(shm.rank0);
    return g;
  }
  if (transport == "nccl") {
    LS_ASSIGN_OR_RETURN(std::string id, NewNcclGroupId());
    g.token = "nccl:" + id;
    return g;
  }
  return Status::InvalidArgument("--tp-transport " + transport + ": not shm or nccl");
}

Result<std::shared_ptr<kernels::Collective>> JoinProcessGroup(const std::string& token, int rank, int ranks) {
  if (token.rfind("shm:", 0) == 0) return kernels::JoinShmGroup(token.substr(4), rank, ranks);
  if (token.rfind("nccl:", 0) == 0) return JoinNcclGroup(token.substr(5), rank, ranks);
  return Status::InvalidArgument("rank group '" + token.substr(0, 40) + "': not shm:… or nccl:…");
}

namespace {

// FNV-1a, 64 bits: a fingerprint, not a defence (the ranks are the user's own processes).
struct Digest {
  uint64_t h = 0xcbf29ce484222325ULL;
  void Bytes(const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 0x100000001b3ULL;
  }
  template <typename T>
  void Pod(const T& v) {
    Bytes(&v, sizeof v);
  }
  void Str(const std::string& s) {
    Pod(s.size());
    Bytes(s.data(), s.size());
  }
  template <typename T>
  void Vec(const std::vector<T>& v) {
    Pod(v.size());
    Bytes(v.data(), v.size() * sizeof(T));
  }
};

}  // namespace

uint64_t WorkDigest(const EngineOptions& o, const std::vector<Request>& requests) {
  Digest d;
  d.Str(o.backend);
  d.Pod(static_cast<int>(o.kv_format));
  d.Pod(o.page_size);
  d.Pod(o.kv_cache_tokens);
  d.Pod(o.max_batch);
  d.Pod(o.max_prefill_tokens);
  d.Pod(o.emulate_tp);
  d.Pod(o.tp_gather_taps);
  for (const auto& [op, variant] : o.kernels) d.Str(op + "=" + variant);
  d.Str(o.fault);
  d.Pod(requests.size());
  for (const Request& r : requests) {
    d.Vec(r.prompt);
    d.Pod(r.max_new_tokens);
    d.Pod(r.sampling.temperature);
    d.Pod(r.sampling.top_k);
    d.Pod(r.sampling.top_p);
    d.Pod(r.sampling.min_p);
    d.Pod(r.sampling.seed);
    d.Vec(r.stop_tokens);
    d.Vec(r.forced_tokens);
    d.Pod(r.all_prompt_logits);
  }
  return d.h;
}

Status CheckSameWork(kernels::Collective& group, uint64_t digest) {
  // Four 16-bit pieces, each exact as a float.
  float mine[4];
  for (int i = 0; i < 4; ++i) mine[i] = static_cast<float>((digest >> (16 * i)) & 0xffff);
  std::vector<float> all(static_cast<size_t>(group.size()) * 4);
  LS_RETURN_IF_ERROR(group.AllGather(mine, 4, all.data()));
  for (int q = 1; q < group.size(); ++q) {
    if (std::memcmp(all.data() + 4 * q, all.data(), sizeof mine) != 0) {
      return Status::InvalidArgument("rank " + std::to_string(q) + " was given other work than rank 0 (its requests "
                                     "or engine options differ: did the ranks read different prompt files?)");
    }
  }
  return Status::Ok();
}

}  // namespace lockstep::engine
