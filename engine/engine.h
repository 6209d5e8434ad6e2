// engine/engine.h — requests in, tokens out: the scheduler around Model::Forward.
//
// An Engine owns the paged KV cache and a set of requests. Each Step() runs one forward over
// a batch: newly admitted requests contribute their whole prompt (ragged prefill), running
// ones their last token (decode). Then each request samples its next token with its own
// Philox stream. Because Model::Forward is batch-invariant and sampling depends only on
// (logits, params, seed, step), a request's tokens do not depend on its neighbours.
//
// Not thread-safe: drive an Engine from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/backend.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/tap.h"
#include "kernels/registry.h"

namespace lockstep::engine {

struct EngineOptions {
  std::string backend = "cpu";        // "cpu" (the fp32 reference) | "cuda"
  KvFormat kv_format = KvFormat::kFp32;
  int64_t page_size = 64;             // tokens per KV page (FlashMLA uses 64)
  int64_t kv_cache_tokens = 1 << 16;  // pool capacity, in tokens, across all requests
  int64_t max_batch = 8;              // requests per step
  // Chunked prefill: at most this many prompt tokens enter a step (across requests; decode
  // tokens are not counted); a longer prompt is fed over several steps. 0 = whole prompts.
  // A token's numbers do not depend on the chunking (batch invariance).
  int64_t max_prefill_tokens = 0;
  // Tensor parallelism emulated on one device (engine/tensor_parallel.h): the sharded products and
  // all-reduces of `emulate_tp` ranks. 1 = none. CPU and CUDA backends, V2–V3.2.
  int64_t emulate_tp = 1;
  // Set: real tensor parallelism — this engine is rank tp_ranks->rank() of tp_ranks->size(),
  // computing only its shard (its heads, its slice of the MLPs, its block of experts) and
  // gathering the partials through the collective; every rank of the group runs the same
  // requests in the same steps and gives emulated TP N's bits (docs/parallelism.md). CPU and
  // CUDA backends; emulate_tp must be 1 or the group's size. A failed step aborts the group.
  std::shared_ptr<kernels::Collective> tp_ranks;
  // With tp_ranks: every step also gathers the head-sharded tensors (attn.q, attn.heads) to
  // every rank, so that a rank's tap hook sees whole rows (the recorder's summaries need them).
  // Every rank of a group must agree; off, a rank whose hook asks for those taps fails.
  bool tp_gather_taps = true;
  kernels::KernelChoice kernels;      // op → variant; empty = defaults
  std::string fault;                  // a fault-zoo variant (docs/fault-zoo.md); empty = none
  BackendOptions device;              // how a device backend runs (graphs, profiling); no effect on results
};

struct Request {
  std::string name;                // caller's label ("0", a request id, …)
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 16;
  // What a trace records as this request's limit when it is not max_new_tokens (−1): an exact or
  // forced replay runs to the recording's token count, but the request it replays asked for
  // the recording's limit (a request that stopped at EOS early is not "another limit").
  int64_t recorded_max_new_tokens = -1;
  SamplingParams sampling;
  std::vector<int32_t> stop_tokens;  // generation ends after emitting one of these
  bool all_prompt_logits = false;    // keep the logits of every prompt position (tests, traces)
  // Teacher forcing (replay --mode forced): generated token i is forced_tokens[i] while there
  // is one; the sampler still runs, and its own choice is reported in StepEvent::sample.
  std::vector<int32_t> forced_tokens;
  // Keep the logits row that chose each token in RequestState::last_logits. Off, a device
  // backend that samples on the device copies no logits to the host for this request
  // (last_logits stays empty): 400 KB a token at a 102400-token vocabulary, 26 MB a step at
  // batch 64. Consumers of last_logits (logprobs, entropies, logits hashes) need it on.
  bool keep_logits = true;
};

// What the engine did for one request in one step.
struct StepEvent {
  int64_t request_id = 0;
  int64_t step = 0;          // the engine step number
  int64_t token_index = 0;   // index of the generated token within the request
  int32_t token = -1;         // the token appended (the forced one when teacher-forcing)
  bool forced = false;
  SampleResult sample;        // what the sampler chose from these logits
  bool sampled_on_device = false;  // by the backend's device sampler (BackendOptions::device_sampler)
  int64_t batch_size = 0;    // requests in this step's forward
  std::vector<int64_t> batch;  // their ids
  // Chunked prefill: the positions at which this request's prompt chunks began (0, c1, c2, …),
  // on the event of its first token; empty otherwise.
  std::vector<int64_t> prompt_chunks;
  bool finished = false;
  std::string finish_reason;   // "length" | "stop"
};

struct RequestState {
  int64_t id = 0;
  Request request;
  SeqCache cache;
  std::vector<int32_t> generated;
  std::vector<float> prompt_logits;  // [prompt, vocab] when all_prompt_logits
  std::vector<float> last_logits;    // logits that chose the last token (empty without keep_logits)
  bool prefilled = false;
  std::vector<int64_t> prompt_chunks;  // start position of each prefill chunk
  bool finished = false;
  std::string finish_reason;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(std::shared_ptr<Model> model, EngineOptions options);

  // Validates and queues a request; returns its id (0, 1, 2, … in order of addition).
  Result<int64_t> AddRequest(Request request);
  // Runs one step. Returns false when nothing was left to do.
  Result<bool> Step();
  // Runs until every request finished.
  Status RunToCompletion();
  // Ends a request between steps (a server's client went away, or a stop string matched):
  // it leaves the queue or the batch, gives its cache pages back and finishes with reason
  // "abort". Its neighbours are unaffected (batch invariance). No-op when already finished.
  Status Cancel(int64_t id);

  void SetTapHook(TapHook* hook) { hook_ = hook; }
  void SetStepCallback(std::function<void(const StepEvent&)> cb) { on_step_ = std::move(cb); }
  // Called after each forward pass, before sampling and before finished requests give their
  // cache pages back: the segments just run and the cache they wrote, so a recorder can read
  // the new rows as stored (PagedKvCache::TokenBytes, positions [start_pos, +tokens)).
  using ForwardCallback = std::function<void(std::span<const Segment>, const PagedKvCache&)>;
  // Setting one makes a device backend copy each step's new cache rows back to the host —
  // except in steps whose rows it handed to the tap hook as kv/ taps instead (TapHook::WantsKvTaps).
  void SetForwardCallback(ForwardCallback cb) {
    on_forward_ = std::move(cb);
    backend_->SetMirrorCache(static_cast<bool>(on_forward_));
  }

  const RequestState& request(int64_t id) const { return *requests_[id]; }
  int64_t num_requests() const { return static_cast<int64_t>(requests_.size()); }
  const Model& model() const { return *model_; }
  const kernels::KernelChoice& kernels() const { return kernels_; }
  const Backend& backend() const { return *backend_; }
  const EngineOptions& options() const { return options_; }
  PagedKvCache& cache() { return *cache_; }

 private:
  // Step without the rank group's abort on failure.
  Result<bool> StepImpl();
  Engine() = default;
  std::shared_ptr<Model> model_;
  EngineOptions options_;
  kernels::KernelChoice kernels_;  // by name, as traces record them
  kernels::KernelPlan plan_;       // the same choice, typed, as the forward passes read it
  std::unique_ptr<PagedKvCache> cache_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<RequestState>> requests_;
  std::vector<int64_t> waiting_, running_;
  int64_t step_ = 0;
  TapHook* hook_ = nullptr;
  std::function<void(const StepEvent&)> on_step_;
  ForwardCallback on_forward_;
};

}  // namespace lockstep::engine
