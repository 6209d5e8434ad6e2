// server/capture_queue.cc — see capture_queue.h.
#include "server/capture_queue.h"

namespace lockstep::server {

CaptureQueue::CaptureQueue(size_t max_queued) : max_queued_(max_queued) {
  thread_ = std::thread([this] { Loop(); });
}

CaptureQueue::~CaptureQueue() {
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    dropped.swap(jobs_);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& j : dropped) {
    if (j.cancel) j.cancel();
  }
}

bool CaptureQueue::Submit(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // One running plus max_queued waiting.
    if (stop_ || jobs_.size() + (running_ ? 1 : 0) > max_queued_) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
  return true;
}

size_t CaptureQueue::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

bool CaptureQueue::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

void CaptureQueue::Loop() {
  while (true) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
      running_ = true;
    }
    job.run();
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }
}

}  // namespace lockstep::server
