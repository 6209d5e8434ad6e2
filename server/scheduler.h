// server/scheduler.h — continuous batching: one thread owns the Engine and runs Step() in a
// loop; requests join and leave between steps. HTTP workers submit requests and read their
// tokens from a Stream; the engine is batch-invariant, so a request's numbers do not depend
// on which others share its steps.
//
// Every finished request leaves a LiveRecord (server/live_record.h) and goes to
// Options::on_finished. While recording, the scheduler is its engine's tap hook: every tap row
// of every request is summarised (traces::Summarize, the summary a trace stores) into that
// request's record. Captures re-run requests on their own Engine and thread
// (server/capture_queue.h); RunBetweenSteps is for the little that must touch this engine.
//
// Thread-safety: Submit, RunBetweenSteps, the stats and Stream's consumer side may be called
// from any thread. The Model must outlive the Scheduler.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "server/live_record.h"

namespace lockstep::server {

struct TokenEvent {
  int index = 0;                 // the choice (0 … n−1)
  int32_t token = -1;
  double logprob = 0;            // log-softmax of the model's logits (temperature 1); when asked
  std::vector<std::pair<int32_t, double>> top_logprobs;
  bool finished = false;
  std::string finish_reason;     // "stop" | "length" | "abort" | "error"
  std::string error;             // when the engine refused or failed the request
};

// One HTTP request's tokens, all its choices interleaved. Produced by the scheduler thread,
// consumed by one HTTP worker.
class Stream {
 public:
  // Waits up to `timeout` for the next event; false when none came.
  bool Next(TokenEvent* ev, std::chrono::milliseconds timeout);
  // Ends choice `index` at the next step boundary (stop string matched); -1: all (client gone).
  void Cancel(int index);

 private:
  friend class Scheduler;
  void Push(TokenEvent ev);
  bool cancelled(int index) const;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
  std::vector<int> cancelled_;
  bool cancel_all_ = false;
};

struct Submission {
  std::string id;                        // the x-request-id
  std::string prompt_text;               // kept in the record ("" under redact)
  std::vector<engine::Request> choices;  // n requests (seed, seed+1, … chosen by the caller)
  int top_logprobs = -1;                 // −1: no logprobs; else how many alternatives
};

class Scheduler : private engine::TapHook {
 public:
  struct Options {
    engine::EngineOptions engine;
    // A fresh Engine replaces the current one when it is idle and has held this many
    // requests: the Engine keeps every request's state, and a server runs for days.
    int64_t recycle_after = 4096;
    // false (`lockstep serve --no-record`): keep no per-token record (no logits hash, no batch
    // list); on_finished still gets the record, with its inputs and no steps. For measuring
    // what recording costs.
    bool record = true;
    // With `record`: also keep every tap row's summary (hash and statistics) per request.
    bool tap_summaries = true;
    std::function<void(std::shared_ptr<const LiveRecord>)> on_finished;  // scheduler thread
  };

  static Result<std::unique_ptr<Scheduler>> Start(std::shared_ptr<engine::Model> model, Options options);
  ~Scheduler() override;  // stops the thread; pending streams get an "abort" event

  // Queues the request's choices; events arrive on the returned Stream.
  std::shared_ptr<Stream> Submit(Submission s);
  // Runs `fn` on the scheduler thread between two steps.
  void RunBetweenSteps(std::function<void()> fn);

  int64_t running() const { return running_.load(); }
  int64_t waiting() const { return waiting_.load(); }
  double kv_cache_usage() const { return kv_usage_.load(); }  // 0 … 1
  const Options& options() const { return options_; }
  const std::shared_ptr<engine::Model>& model() const { return model_; }

 private:
  Scheduler(std::shared_ptr<engine::Model> model, Options options);
  void Loop();
  void OnStep(const engine::StepEvent& ev);
  void OnTap(const engine::TapEvent& e) override;  // scheduler thread, inside Step()
  bool WantsTapValues() const override { return false; }  // summaries only: the GPU may make them
  void Finish(int64_t engine_id, const std::string& reason);
  Status NewEngine();

  struct Active {
    std::shared_ptr<Stream> stream;
    int index = 0;
    int top_logprobs = -1;
    std::shared_ptr<LiveRecord> record;
  };

  std::shared_ptr<engine::Model> model_;
  Options options_;
  std::unique_ptr<engine::Engine> engine_;  // scheduler thread only
  int64_t epoch_ = 0;
  std::map<int64_t, Active> active_;        // engine id → request; scheduler thread only
  // Tap summaries (scheduler thread only): the tap names seen, indexed densely, found by the
  // address of the engine's name string (stable for the model's life) and checked by value;
  // and the record the last tap event went to (taps come request by request).
  std::vector<std::string> tap_names_;
  std::map<const void*, size_t> tap_index_;
  int64_t tap_request_ = -1;
  LiveRecord* tap_record_ = nullptr;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<Submission, std::shared_ptr<Stream>>> pending_streams_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::atomic<int64_t> running_{0}, waiting_{0}, queued_{0};
  std::atomic<double> kv_usage_{0};
  std::thread thread_;
};

}  // namespace lockstep::server
