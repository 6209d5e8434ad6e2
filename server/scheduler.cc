// server/scheduler.cc — see scheduler.h.
#include "server/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "recorder/recorder.h"
#include "traces/row_summary.h"

namespace lockstep::server {

bool Stream::Next(TokenEvent* ev, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  *ev = std::move(events_.front());
  events_.pop_front();
  return true;
}

void Stream::Cancel(int index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index < 0) {
    cancel_all_ = true;
  } else {
    cancelled_.push_back(index);
  }
}

void Stream::Push(TokenEvent ev) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(ev));
  }
  cv_.notify_all();
}

bool Stream::cancelled(int index) const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancel_all_ || std::find(cancelled_.begin(), cancelled_.end(), index) != cancelled_.end();
}

Scheduler::Scheduler(std::shared_ptr<engine::Model> model, Options options)
    : model_(std::move(model)), options_(std::move(options)) {}

Result<std::unique_ptr<Scheduler>> Scheduler::Start(std::shared_ptr<engine::Model> model, Options options) {
  std::unique_ptr<Scheduler> s(new Scheduler(std::move(model), std::move(options)));
  LS_RETURN_IF_ERROR(s->NewEngine());
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Status Scheduler::NewEngine() {
  LS_ASSIGN_OR_RETURN(engine_, engine::Engine::Create(model_, options_.engine));
  ++epoch_;
  engine_->SetStepCallback([this](const engine::StepEvent& ev) { OnStep(ev); });
  if (options_.record && options_.tap_summaries) engine_->SetTapHook(this);
  tap_request_ = -1;
  tap_record_ = nullptr;
  return Status::Ok();
}

std::shared_ptr<Stream> Scheduler::Submit(Submission s) {
  auto stream = std::make_shared<Stream>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_ += static_cast<int64_t>(s.choices.size());
    pending_streams_.emplace_back(std::move(s), stream);
  }
  cv_.notify_all();
  return stream;
}

void Scheduler::RunBetweenSteps(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(fn));
  }
  cv_.notify_all();
}

void Scheduler::Loop() {
  const int64_t page = options_.engine.page_size;
  const double total_pages = static_cast<double>((options_.engine.kv_cache_tokens + page - 1) / page);
  while (true) {
    std::deque<std::pair<Submission, std::shared_ptr<Stream>>> subs;
    std::deque<std::function<void()>> jobs;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !pending_streams_.empty() || !jobs_.empty() || !active_.empty(); });
      if (stop_) break;
      subs.swap(pending_streams_);
      jobs.swap(jobs_);
    }
    for (auto& job : jobs) job();

    // A fresh engine when the old one is idle and has grown (it keeps every request's state).
    if (active_.empty() && engine_->num_requests() >= options_.recycle_after) {
      Status s = NewEngine();
      if (!s.ok()) std::cerr << "lockstep serve: could not renew the engine: " << s.message() << "\n";
    }

    for (auto& [sub, stream] : subs) {
      for (size_t i = 0; i < sub.choices.size(); ++i) {
        engine::Request req = sub.choices[i];
        const std::string rid = sub.choices.size() == 1 ? sub.id : sub.id + "-" + std::to_string(i);
        req.name = rid;
        // The step's logits row comes to the host only for what reads it: the live record's
        // hash, the logprobs.
        req.keep_logits = options_.record || sub.top_logprobs >= 0;
        auto id = engine_->AddRequest(req);
        if (!id.ok()) {
          TokenEvent ev;
          ev.index = static_cast<int>(i);
          ev.finished = true;
          ev.finish_reason = "error";
          ev.error = id.status().message();
          stream->Push(std::move(ev));
          --waiting_;
          continue;
        }
        auto rec = std::make_shared<LiveRecord>();
        rec->id = rid;
        rec->prompt_text = sub.prompt_text;
        rec->request = std::move(req);
        rec->created_unix =
            std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
        rec->engine_epoch = epoch_;
        active_[*id] = Active{stream, static_cast<int>(i), sub.top_logprobs, std::move(rec)};
        if (engine_->request(*id).finished) Finish(*id, engine_->request(*id).finish_reason);  // max_tokens 0
      }
    }

    // Cancellations (client gone, stop string) take effect between steps.
    std::vector<int64_t> cancel;
    for (const auto& [id, a] : active_) {
      if (a.stream->cancelled(a.index)) cancel.push_back(id);
    }
    for (int64_t id : cancel) {
      (void)engine_->Cancel(id);
      Finish(id, "abort");
    }

    if (!active_.empty()) {
      tap_request_ = -1;  // active_ changed since the last step
      auto more = engine_->Step();
      if (!more.ok()) {
        // An engine error fails every request in flight; the server keeps serving.
        std::cerr << "lockstep serve: engine step failed: " << more.status().message() << "\n";
        std::vector<int64_t> ids;
        for (const auto& [id, a] : active_) ids.push_back(id);
        for (int64_t id : ids) {
          (void)engine_->Cancel(id);
          active_[id].stream->Push(TokenEvent{active_[id].index, -1, 0, {}, true, "error", more.status().message()});
          active_.erase(id);
        }
        (void)NewEngine();
      }
    }
    int64_t run = 0;
    for (const auto& [id, a] : active_) run += engine_->request(id).prefilled ? 1 : 0;
    running_ = run;
    waiting_ = static_cast<int64_t>(active_.size()) - run;
    kv_usage_ = 1.0 - static_cast<double>(engine_->cache().free_pages()) / total_pages;
  }
  for (auto& [id, a] : active_) a.stream->Push(TokenEvent{a.index, -1, 0, {}, true, "abort", "server stopping"});
  active_.clear();
}

void Scheduler::OnStep(const engine::StepEvent& ev) {
  auto it = active_.find(ev.request_id);
  if (it == active_.end()) return;
  Active& a = it->second;
  const std::vector<float>& logits = engine_->request(ev.request_id).last_logits;
  if (options_.record) {
    LiveStep st;
    st.engine_step = ev.step;
    st.token = ev.token;
    st.probability = ev.sample.probability;
    st.uniform = ev.sample.uniform;
    st.counter = ev.sample.counter;
    st.candidates = ev.sample.candidates;
    st.logits_hash = XXH3_64bits(logits.data(), logits.size() * sizeof(float));
    st.batch = ev.batch;
    if (!ev.prompt_chunks.empty()) a.record->prompt_chunks = ev.prompt_chunks;
    a.record->steps.push_back(std::move(st));
  }

  TokenEvent out;
  out.index = a.index;
  out.token = ev.token;
  if (a.top_logprobs >= 0 && !logits.empty()) {
    // log-softmax in double: the logprob of the model's distribution, before sampling filters.
    const float mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float l : logits) sum += std::exp(static_cast<double>(l) - mx);
    const double lse = mx + std::log(sum);
    out.logprob = logits[ev.token] - lse;
    const size_t k = std::min<size_t>(a.top_logprobs, logits.size());
    std::vector<int32_t> idx(logits.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int32_t x, int32_t y) { return logits[x] > logits[y] || (logits[x] == logits[y] && x < y); });
    for (size_t i = 0; i < k; ++i) out.top_logprobs.emplace_back(idx[i], logits[idx[i]] - lse);
  }
  a.stream->Push(std::move(out));
  if (ev.finished) Finish(ev.request_id, ev.finish_reason);
}

// The summary a summary-mode trace keeps of each row (traces::Summarize, the recorder's own
// code), computed here on the scheduler thread: one pass over the row, no copy.
void Scheduler::OnTap(const engine::TapEvent& e) {
  if (e.request_id != tap_request_) {
    auto it = active_.find(e.request_id);
    tap_record_ = it == active_.end() ? nullptr : it->second.record.get();
    tap_request_ = e.request_id;
  }
  if (tap_record_ == nullptr || e.rows <= 0) return;
  size_t idx;
  auto hit = tap_index_.find(e.name.data());
  if (hit != tap_index_.end() && tap_names_[hit->second] == e.name) {
    idx = hit->second;
  } else {
    auto named = std::find(tap_names_.begin(), tap_names_.end(), e.name);
    idx = static_cast<size_t>(named - tap_names_.begin());
    if (named == tap_names_.end()) tap_names_.emplace_back(e.name);
    tap_index_[e.name.data()] = idx;
  }
  std::vector<LiveTap>& taps = tap_record_->taps;
  if (taps.size() <= idx) {
    const size_t had = taps.size();
    taps.resize(idx + 1);
    for (size_t i = had; i <= idx; ++i) taps[i].name = tap_names_[i];
  }
  LiveTap& t = taps[idx];
  const traces::DType dtype = e.dtype == engine::TapDType::kI32 ? traces::DType::kI32 : traces::DType::kF32;
  const size_t row_bytes = static_cast<size_t>(e.cols) * 4;  // f32 and i32
  const auto* base = static_cast<const uint8_t*>(e.data);
  for (int64_t r = 0; r < e.rows; ++r) {
    traces::SummaryRow s;
    if (e.data == nullptr && e.summaries != nullptr) {  // summarised by the backend (the GPU)
      s = recorder::ToSummaryRow(e.summaries[r]);
    } else {
      traces::Summarize(dtype, base + r * row_bytes, e.cols, &s);
    }
    t.rows.push_back({static_cast<int32_t>(e.position + r), s.nan_count, s.inf_count, s.hash, s.rms, s.absmax, s.min,
                      s.max});
  }
}

void Scheduler::Finish(int64_t engine_id, const std::string& reason) {
  auto it = active_.find(engine_id);
  if (it == active_.end()) return;
  Active a = std::move(it->second);
  active_.erase(it);
  if (tap_request_ == engine_id) tap_request_ = -1;
  a.record->finish_reason = reason;
  // The ring's budget counts capacity: give the growth slack back before the record is kept.
  for (LiveTap& t : a.record->taps) t.rows.shrink_to_fit();
  a.record->taps.shrink_to_fit();
  a.record->steps.shrink_to_fit();
  std::shared_ptr<const LiveRecord> rec = a.record;
  // The record is handed over before the final event, so that a client that reads the final
  // event can already capture the request.
  if (options_.on_finished) options_.on_finished(rec);
  TokenEvent done;
  done.index = a.index;
  done.finished = true;
  done.finish_reason = reason;
  a.stream->Push(std::move(done));
}

}  // namespace lockstep::server
