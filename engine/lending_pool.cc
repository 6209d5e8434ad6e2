// engine/lending_pool.cc — see lending_pool.h.
#include "engine/lending_pool.h"

#include <algorithm>

namespace lockstep::engine {

LendingPool::LendingPool(Allocator allocate, size_t max_buffers) : state_(std::make_shared<State>()) {
  state_->allocate = std::move(allocate);
  state_->max_buffers = std::max<size_t>(1, max_buffers);
}

Result<LendingPool::Lease> LendingPool::Take(size_t bytes, std::chrono::nanoseconds patience) {
  State& st = *state_;
  std::unique_lock<std::mutex> l(st.mu);
  auto free_slot = [&]() -> Slot* {
    for (Slot& s : st.slots) {
      if (!s.lent) return &s;
    }
    return nullptr;
  };
  Slot* slot = free_slot();
  if (slot == nullptr && st.slots.size() < st.max_buffers) {
    st.slots.emplace_back();
    slot = &st.slots.back();
  }
  if (slot == nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    st.back.wait_for(l, patience, [&] { return (slot = free_slot()) != nullptr; });
    st.waited_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    if (slot == nullptr) return Lease{};
  }
  if (slot->bytes < bytes) {
    slot->mem.reset();  // (the old buffer first: pinned memory is scarce)
    slot->bytes = 0;
    LS_ASSIGN_OR_RETURN(slot->mem, st.allocate(bytes));
    slot->bytes = bytes;
  }
  slot->lent = true;
  const size_t index = static_cast<size_t>(slot - st.slots.data());
  Lease lease;
  lease.data = slot->mem.get();
  // The deleter keeps the state (and so the buffer) alive; slots never shrink, so the index holds.
  lease.owner = std::shared_ptr<const void>(lease.data, [state = state_, index](const void*) {
    {
      std::lock_guard<std::mutex> g(state->mu);
      state->slots[index].lent = false;
    }
    state->back.notify_all();
  });
  return lease;
}

int64_t LendingPool::waited_ns() const {
  std::lock_guard<std::mutex> l(state_->mu);
  return state_->waited_ns;
}

size_t LendingPool::buffers() const {
  std::lock_guard<std::mutex> l(state_->mu);
  return state_->slots.size();
}

size_t LendingPool::lent() const {
  std::lock_guard<std::mutex> l(state_->mu);
  return static_cast<size_t>(std::count_if(state_->slots.begin(), state_->slots.end(), [](const Slot& s) { return s.lent; }));
}

}  // namespace lockstep::engine
