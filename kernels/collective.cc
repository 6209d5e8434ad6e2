// kernels/collective.cc — see collective.h.
#include "kernels/collective.h"

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>

namespace lockstep::kernels {
namespace {

// The group's meeting place: each call is two barriers — every rank posts its buffer, every
// rank copies all of them, then every rank has copied (so no rank reuses its buffer early).
struct Room {
  explicit Room(int n) : size(n), sends(static_cast<size_t>(n), nullptr), counts(static_cast<size_t>(n), 0) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<const float*> sends;
  std::vector<int64_t> counts;
  int arrived = 0;
  int64_t generation = 0;
  Status aborted = Status::Ok();

  // Waits until all `size` ranks arrived at this barrier (true), or the group aborted (false).
  bool Barrier(std::unique_lock<std::mutex>& l) {
    if (!aborted.ok()) return false;
    const int64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return true;
    }
    cv.wait(l, [&] { return generation != gen || !aborted.ok(); });
    return generation != gen;
  }
};

class LocalCollective final : public Collective {
 public:
  LocalCollective(std::shared_ptr<Room> room, int rank) : room_(std::move(room)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return room_->size; }

  Status AllGather(const float* send, int64_t n, float* recv) override {
    Room& g = *room_;
    std::unique_lock<std::mutex> l(g.mu);
    if (!g.aborted.ok()) return g.aborted;
    g.sends[rank_] = send;
    g.counts[rank_] = n;
    if (!g.Barrier(l)) return g.aborted;
    for (int q = 0; q < g.size; ++q) {
      if (g.counts[q] != n) {
        const Status bad = Status::Internal("collective: rank " + std::to_string(q) + " gathers " +
                                            std::to_string(g.counts[q]) + " values, rank " + std::to_string(rank_) +
                                            " " + std::to_string(n) + " (the ranks' steps differ)");
        if (g.aborted.ok()) g.aborted = bad;
        g.cv.notify_all();
        return bad;
      }
    }
    l.unlock();
    for (int q = 0; q < g.size; ++q) std::memcpy(recv + q * n, g.sends[q], static_cast<size_t>(n) * sizeof(float));
    l.lock();
    if (!g.Barrier(l)) return g.aborted;
    return Status::Ok();
  }

  void Abort(const Status& why) override {
    std::lock_guard<std::mutex> l(room_->mu);
    if (room_->aborted.ok()) room_->aborted = why.ok() ? Status::Internal("collective aborted") : why;
    room_->cv.notify_all();
  }

 private:
  std::shared_ptr<Room> room_;
  int rank_;
};

}  // namespace

std::vector<std::shared_ptr<Collective>> LocalCollectives(int n) {
  std::vector<std::shared_ptr<Collective>> out;
  if (n < 1 || n > 64) return out;
  auto room = std::make_shared<Room>(n);
  for (int r = 0; r < n; ++r) out.push_back(std::make_shared<LocalCollective>(room, r));
  return out;
}

}  // namespace lockstep::kernels
