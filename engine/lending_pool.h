// engine/lending_pool.h — host buffers a backend lends past a call: a tap hook may keep a
// step's buffer (TapEvent::owner) until its writer has stored the rows, while the next step
// fills another. The pool bounds how many exist; when all are lent, Take waits for one to
// come back (that wait is the recording's back-pressure, counted in waited_ns()).
//
//   LendingPool pool(allocate, 8);
//   LS_ASSIGN_OR_RETURN(LendingPool::Lease l, pool.Take(bytes, std::chrono::seconds(2)));
//   if (l.data == nullptr) { ... nothing came back in time: hand the rows over unlent ... }
//   fill l.data; event.owner = l.owner;   // the buffer returns when the last copy is dropped
//
// Thread-safe: leases are dropped on any thread (the writer's). Buffers outlive the pool
// while lent (the leases share its state).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "base/status.h"

namespace lockstep::engine {

// How many buffers the CUDA backend lends for full capture's steps of `step_bytes` (its tap
// values and summaries): 256 MB worth — the bound the trace writer's default queue puts on
// copied rows, so a writer that falls behind for a while (a flush) is absorbed the same way —
// and 2 to 128 of them. bench_recorder_host's full-gpu mode lends by the same rule.
inline size_t TapLendBuffers(size_t step_bytes) {
  constexpr size_t kBudget = size_t{256} << 20, kMin = 2, kMax = 128;
  const size_t n = kBudget / (step_bytes > 0 ? step_bytes : 1);
  return n < kMin ? kMin : n > kMax ? kMax : n;
}

class LendingPool {
 public:
  // allocate(bytes): an owning pointer to at least `bytes` (pinned memory, for the CUDA backend).
  using Allocator = std::function<Result<std::shared_ptr<void>>(size_t bytes)>;
  LendingPool(Allocator allocate, size_t max_buffers);

  struct Lease {
    void* data = nullptr;               // null: none came back within the patience
    std::shared_ptr<const void> owner;  // the buffer is free again when the last copy goes
  };
  // A buffer of at least `bytes` that nobody holds: a free one (grown when too small), else a
  // new one while fewer than max_buffers exist, else the first to come back within `patience`.
  Result<Lease> Take(size_t bytes, std::chrono::nanoseconds patience);

  int64_t waited_ns() const;  // total time Take spent waiting for a buffer to come back
  size_t buffers() const;     // how many exist (lent or free)
  size_t lent() const;        // how many are lent now

 private:
  struct Slot {
    std::shared_ptr<void> mem;
    size_t bytes = 0;
    bool lent = false;
  };
  struct State {
    Allocator allocate;
    size_t max_buffers = 1;
    mutable std::mutex mu;
    std::condition_variable back;  // a lease was dropped
    std::vector<Slot> slots;
    int64_t waited_ns = 0;
  };
  std::shared_ptr<State> state_;
};

}  // namespace lockstep::engine
