// server/capture_queue.h — where captures run: one background thread with a bounded queue,
// so that a capture's offline re-run (seconds on a large model) never pauses serving. Each
// job builds its own Engine over the server's Model (CaptureRequest); the scheduler keeps
// stepping meanwhile. When the queue is full a capture is refused at once — the caller says
// so (HTTP 503, lockstep:captures_refused_total) — rather than queueing work that would grow
// without bound under a burst of triggers.
//
// Thread-safety: Submit and the accessors may be called from any thread. The destructor runs
// the job in progress to its end and drops the queued ones (their `cancel` runs instead).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace lockstep::server {

class CaptureQueue {
 public:
  struct Job {
    std::function<void()> run;     // on the capture thread
    std::function<void()> cancel;  // when the queue is destroyed before `run` started; may be empty
  };

  // `max_queued` jobs may wait behind the one running (≥ 0).
  explicit CaptureQueue(size_t max_queued);
  ~CaptureQueue();
  CaptureQueue(const CaptureQueue&) = delete;
  CaptureQueue& operator=(const CaptureQueue&) = delete;

  // Queues `job`; false (and nothing queued) when one job runs and max_queued already wait.
  bool Submit(Job job);
  size_t queued() const;   // waiting, not counting the one running
  bool running() const;
  size_t max_queued() const { return max_queued_; }

 private:
  void Loop();
  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool running_ = false, stop_ = false;
  std::thread thread_;
};

}  // namespace lockstep::server
