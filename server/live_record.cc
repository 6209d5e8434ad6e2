// server/live_record.cc — see live_record.h.
#include "server/live_record.h"

namespace lockstep::server {

std::vector<int32_t> LiveRecord::tokens() const {
  std::vector<int32_t> t;
  t.reserve(steps.size());
  for (const auto& s : steps) t.push_back(s.token);
  return t;
}

size_t LiveRecord::Bytes() const {
  size_t b = sizeof(*this) + id.size() + prompt_text.size() + request.prompt.size() * 4 +
             request.stop_tokens.size() * 4 + request.name.size() + prompt_chunks.capacity() * 8;
  for (const auto& s : steps) b += sizeof(s) + s.batch.capacity() * 8;
  b += (steps.capacity() - steps.size()) * sizeof(LiveStep);
  for (const auto& t : taps) b += sizeof(t) + t.name.capacity() + t.rows.capacity() * sizeof(LiveTapRow);
  b += (taps.capacity() - taps.size()) * sizeof(LiveTap);
  return b;
}

const LiveTap* LiveRecord::FindTap(const std::string& name) const {
  for (const auto& t : taps) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

void RequestRing::Add(std::shared_ptr<const LiveRecord> r) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ += r->Bytes();
  by_id_[r->id] = r;
  order_.push_back(std::move(r));
  // Always keep the newest record, even when it alone exceeds the budget.
  while (bytes_ > budget_ && order_.size() > 1) {
    const auto& old = order_.front();
    bytes_ -= old->Bytes();
    auto it = by_id_.find(old->id);
    if (it != by_id_.end() && it->second == old) by_id_.erase(it);
    order_.pop_front();
  }
}

std::shared_ptr<const LiveRecord> RequestRing::Find(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

size_t RequestRing::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

size_t RequestRing::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return order_.size();
}

}  // namespace lockstep::server
