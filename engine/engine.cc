// engine/engine.cc — see engine.h.
#include "engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "engine/tensor_parallel.h"

namespace lockstep::engine {
namespace {

// A KV pool the machine cannot hold is refused with its size before any of it is allocated
// (a 2^60-token pool threw std::bad_alloc from the page table). The pool's pages are allocated
// on first use, but its page table is sized by the capacity: the bound is the capacity at full
// use against the host's physical memory, and page ids are int32.
Status CheckCacheFits(const ModelConfig& c, const EngineOptions& o, bool fp8_index_keys) {
  const int64_t pages = (o.kv_cache_tokens + o.page_size - 1) / o.page_size;
  PagedKvCache probe(c, o.kv_format, o.page_size, 1, fp8_index_keys);
  double per_token = 0;  // bytes, all layers and streams
  double streams = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (const auto& s : probe.streams(l)) per_token += static_cast<double>(s.bytes_per_token);
    streams += static_cast<double>(probe.streams(l).size());
  }
  // The host page table: a pointer per page and stream, and a free-list entry per page (on
  // every backend; the CPU backend also holds the pages themselves on the host).
  const double table = static_cast<double>(pages) * (4 + 8 * streams);
  const double bytes = per_token * static_cast<double>(pages) * static_cast<double>(o.page_size);
  const double phys = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  char what[160];
  std::snprintf(what, sizeof what, "%.3g GB (%.0f bytes a token × %lld tokens)", bytes / 1e9, per_token,
                static_cast<long long>(pages * o.page_size));
  if (pages > INT32_MAX) {
    return Status::InvalidArgument("--kv-cache-tokens " + std::to_string(o.kv_cache_tokens) + ": " +
                                   std::to_string(pages) + " pages of " + std::to_string(o.page_size) +
                                   " tokens; the pool holds at most 2^31 - 1 pages");
  }
  if (phys > 0 && (table > phys / 2 || (o.backend == "cpu" && bytes > phys))) {
    char mem[32];
    std::snprintf(mem, sizeof mem, "%.3g GB", phys / 1e9);
    return Status::InvalidArgument("--kv-cache-tokens " + std::to_string(o.kv_cache_tokens) + ": the KV cache would take " +
                                   what + ", more than this machine's " + mem + " of memory; give a smaller one");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::Create(std::shared_ptr<Model> model, EngineOptions options) {
  if (options.page_size <= 0 || options.page_size > (1 << 20)) {
    return Status::InvalidArgument("--page-size: must be in 1..1048576");
  }
  if (options.kv_cache_tokens < options.page_size) {
    return Status::InvalidArgument("--kv-cache-tokens: must be at least one page (" +
                                   std::to_string(options.page_size) + " tokens)");
  }
  if (options.max_batch <= 0) return Status::InvalidArgument("--max-batch: must be > 0");
  if (options.max_prefill_tokens < 0) return Status::InvalidArgument("--max-prefill-tokens: must be ≥ 0");
  std::unique_ptr<Engine> e(new Engine());
  LS_ASSIGN_OR_RETURN(e->kernels_, kernels::Registry::Get().Resolve(options.kernels, options.backend, options.fault));
  LS_ASSIGN_OR_RETURN(e->plan_, kernels::KernelPlan::From(e->kernels_));
  // Test-only, and recorded nowhere: the trace names the defaults (kernels/hidden_fault.h).
  LS_ASSIGN_OR_RETURN(e->plan_.hidden, kernels::ActiveHiddenFault());
  if (options.emulate_tp != 1 && options.backend != "cpu" && options.backend != "cuda") {
    return Status::Unsupported("--emulate-tp " + std::to_string(options.emulate_tp) + ": the " + options.backend +
                               " backend runs TP 1 only; emulated tensor parallelism runs on the cpu and cuda backends");
  }
  int64_t tp = options.emulate_tp;
  if (options.tp_ranks) {
    const int64_t n = options.tp_ranks->size();
    if (options.backend != "cpu" && options.backend != "cuda") {
      return Status::Unsupported("tensor parallelism over real ranks: the " + options.backend +
                                 " backend has no rank mode (the cpu and cuda backends do)");
    }
    if (tp != 1 && tp != n) {
      return Status::InvalidArgument("--emulate-tp " + std::to_string(tp) + " with " + std::to_string(n) +
                                     " real ranks: give one degree");
    }
    tp = n;
    e->plan_.ranks = options.tp_ranks;
    e->plan_.tp_gather_taps = options.tp_gather_taps;
  }
  LS_RETURN_IF_ERROR(CheckTensorParallel(model->config(), tp, options.tp_ranks ? "--tp-ranks" : "--emulate-tp"));
  e->plan_.emulate_tp = static_cast<int>(tp);
  LS_RETURN_IF_ERROR(CheckCacheFits(model->config(), options, e->plan_.indexer == kernels::Indexer::kFp8Paged));
  // A variant made for one family's weights (the 4-bit experts: DeepSeek-V4's) is refused
  // elsewhere rather than run at another precision.
  for (const auto& [op, name] : e->kernels_) {
    const kernels::KernelVariant* v = kernels::Registry::Get().Find(op, name, options.backend);
    if (v != nullptr && !v->RunsOn(model->config().model_type)) {
      std::string types;
      for (const std::string& t : v->model_types) types += (types.empty() ? "" : ", ") + t;
      return Status::Unsupported("--kernel " + op + "=" + name + ": runs on model_type " + types + "; this model is " +
                                 model->config().model_type);
    }
  }
  e->cache_ = std::make_unique<PagedKvCache>(model->config(), options.kv_format, options.page_size,
                                             (options.kv_cache_tokens + options.page_size - 1) / options.page_size,
                                             e->plan_.indexer == kernels::Indexer::kFp8Paged);
  e->cache_->SetFaultFp8NoClamp(e->plan_.kv_quant == kernels::KvQuant::kFaultFp8NoClamp);
  e->cache_->SetHiddenFault(e->plan_.hidden);
  LS_ASSIGN_OR_RETURN(e->backend_, CreateBackend(options.backend, model, *e->cache_, e->plan_, options.device));
  e->model_ = std::move(model);
  e->options_ = std::move(options);
  return e;
}

Result<int64_t> Engine::AddRequest(Request r) {
  const ModelConfig& c = model_->config();
  if (r.prompt.empty()) return Status::InvalidArgument("request '" + r.name + "': empty prompt");
  for (int32_t t : r.prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return Status::InvalidArgument("request '" + r.name + "': prompt token " + std::to_string(t) +
                                     " outside the vocabulary (0.." + std::to_string(c.vocab_size - 1) + ")");
    }
  }
  if (r.max_new_tokens < 0) return Status::InvalidArgument("request '" + r.name + "': max_new_tokens < 0");
  for (int32_t t : r.forced_tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return Status::InvalidArgument("request '" + r.name + "': forced token " + std::to_string(t) +
                                     " outside the vocabulary");
    }
  }
  const int64_t total = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens;
  if (total > c.max_position_embeddings) {
    return Status::InvalidArgument("request '" + r.name + "': prompt + max_new_tokens = " + std::to_string(total) +
                                   " exceeds max_position_embeddings " + std::to_string(c.max_position_embeddings));
  }
  if (total > options_.kv_cache_tokens) {
    return Status::InvalidArgument("request '" + r.name + "': needs " + std::to_string(total) +
                                   " cache tokens, more than --kv-cache-tokens " +
                                   std::to_string(options_.kv_cache_tokens));
  }
  const SamplingParams& s = r.sampling;
  if (!(s.temperature >= 0) || !(s.top_p > 0 && s.top_p <= 1) || !(s.min_p >= 0 && s.min_p <= 1) || s.top_k < 0) {
    return Status::InvalidArgument("request '" + r.name +
                                   "': sampling needs temperature ≥ 0, 0 < top_p ≤ 1, 0 ≤ min_p ≤ 1, top_k ≥ 0");
  }
  auto st = std::make_unique<RequestState>();
  st->id = static_cast<int64_t>(requests_.size());
  st->request = std::move(r);
  if (st->request.max_new_tokens == 0) {
    st->finished = true;
    st->finish_reason = "length";
  } else {
    waiting_.push_back(st->id);
  }
  requests_.push_back(std::move(st));
  return requests_.back()->id;
}

Result<bool> Engine::Step() {
  auto more = StepImpl();
  // A rank that fails leaves the others waiting in the collective: they fail with its error.
  if (!more.ok() && plan_.ranks) plan_.ranks->Abort(more.status());
  return more;
}

Result<bool> Engine::StepImpl() {
  // Admit waiting requests while the batch has room and the cache can hold them whole.
  while (!waiting_.empty() && static_cast<int64_t>(running_.size()) < options_.max_batch) {
    RequestState& r = *requests_[waiting_.front()];
    const int64_t need = static_cast<int64_t>(r.request.prompt.size()) + r.request.max_new_tokens;
    const int64_t pages = (need + options_.page_size - 1) / options_.page_size;
    int64_t reserved = 0;  // pages the running requests will still claim
    for (int64_t id : running_) {
      const RequestState& q = *requests_[id];
      const int64_t qn = static_cast<int64_t>(q.request.prompt.size()) + q.request.max_new_tokens;
      reserved += (qn + options_.page_size - 1) / options_.page_size - static_cast<int64_t>(q.cache.pages.size());
    }
    if (pages > cache_->free_pages() - reserved) break;
    running_.push_back(waiting_.front());
    waiting_.erase(waiting_.begin());
  }
  if (running_.empty()) return false;

  // One segment per running request: its next prompt chunk, or its last token. Chunked
  // prefill (max_prefill_tokens) shares a prompt-token budget across the step in admission
  // order; a request the budget does not reach sits this step out.
  std::vector<Segment> segs;
  std::vector<size_t> seg_owner;  // index into running_ of each segment
  std::vector<int32_t> last(running_.size());
  int64_t budget = options_.max_prefill_tokens > 0 ? options_.max_prefill_tokens : INT64_MAX;
  for (size_t i = 0; i < running_.size(); ++i) {
    RequestState& r = *requests_[running_[i]];
    Segment g;
    g.request_id = r.id;
    g.cache = &r.cache;
    g.start_pos = r.cache.length;
    if (!r.prefilled) {
      const int64_t remaining = static_cast<int64_t>(r.request.prompt.size()) - r.cache.length;
      const int64_t n = std::min(remaining, budget);
      if (n <= 0) continue;
      budget -= n;
      g.tokens = std::span<const int32_t>(r.request.prompt).subspan(static_cast<size_t>(r.cache.length),
                                                                     static_cast<size_t>(n));
      g.all_logits = r.request.all_prompt_logits;
      g.prefill = true;
      r.prompt_chunks.push_back(r.cache.length);
      if (n == remaining) g.sampling = &r.request.sampling;  // the prompt's last chunk: its last row samples
    } else {
      last[i] = r.generated.back();
      g.tokens = std::span<const int32_t>(&last[i], 1);
      g.sampling = &r.request.sampling;
    }
    g.sample_step = static_cast<uint64_t>(r.generated.size());
    g.want_logits = r.request.keep_logits || g.all_logits;
    segs.push_back(g);
    seg_owner.push_back(i);
  }
  ForwardOutput out;
  LS_RETURN_IF_ERROR(backend_->Forward(segs, *cache_, plan_, hook_, &out));
  if (on_forward_) on_forward_(segs, *cache_);

  const int64_t V = model_->config().vocab_size;
  std::vector<int64_t> batch_ids;
  for (size_t k : seg_owner) batch_ids.push_back(running_[k]);
  std::vector<bool> stays(running_.size(), true);
  for (size_t k = 0; k < segs.size(); ++k) {
    RequestState& r = *requests_[running_[seg_owner[k]]];
    std::vector<float>& lg = out.logits[k];
    if (!r.prefilled) {
      if (r.request.all_prompt_logits) r.prompt_logits.insert(r.prompt_logits.end(), lg.begin(), lg.end());
      // A middle chunk: its last row's logits predict a prompt token; nothing to sample.
      if (r.cache.length < static_cast<int64_t>(r.request.prompt.size())) continue;
      r.prefilled = true;
    }
    const bool on_device = k < out.samples.size() && out.samples[k].has_value();
    if (static_cast<int64_t>(lg.size()) == V) {
      r.last_logits.swap(lg);  // one row (decode): take it, no copy
    } else if (static_cast<int64_t>(lg.size()) > V) {
      r.last_logits.assign(lg.end() - V, lg.end());
    } else if (lg.empty() && on_device && !r.request.keep_logits) {
      r.last_logits.clear();  // sampled on the device; nobody reads the row
    } else {
      return Status::Internal("engine: the " + std::string(backend_->name()) + " backend gave " +
                              std::to_string(lg.size()) + " logits for request " + std::to_string(r.id) +
                              " (vocabulary " + std::to_string(V) + ")");
    }
    StepEvent ev;
    ev.request_id = r.id;
    ev.step = step_;
    ev.token_index = static_cast<int64_t>(r.generated.size());
    // Sampled on the device when the backend did (the same algorithm and Philox stream), else here.
    ev.sample = on_device ? *out.samples[k]
                          : Sampler::Sample(r.last_logits, r.request.sampling, static_cast<uint64_t>(ev.token_index));
    ev.sampled_on_device = on_device;
    ev.token = ev.sample.token;
    const auto& forced = r.request.forced_tokens;
    if (ev.token_index < static_cast<int64_t>(forced.size())) {
      ev.token = forced[ev.token_index];
      ev.forced = true;
    }
    ev.batch_size = static_cast<int64_t>(batch_ids.size());
    ev.batch = batch_ids;
    if (r.generated.empty() && r.prompt_chunks.size() > 1) ev.prompt_chunks = r.prompt_chunks;
    r.generated.push_back(ev.token);
    const auto& stops = r.request.stop_tokens;
    if (std::find(stops.begin(), stops.end(), ev.token) != stops.end()) {
      r.finished = true;
      r.finish_reason = "stop";
    } else if (static_cast<int64_t>(r.generated.size()) >= r.request.max_new_tokens) {
      r.finished = true;
      r.finish_reason = "length";
    }
    ev.finished = r.finished;
    ev.finish_reason = r.finish_reason;
    if (r.finished) {
      cache_->Release(&r.cache);
      stays[seg_owner[k]] = false;
    }
    if (on_step_) on_step_(ev);
  }
  std::vector<int64_t> still;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (stays[i]) still.push_back(running_[i]);
  }
  running_ = std::move(still);
  ++step_;
  return true;
}

Status Engine::Cancel(int64_t id) {
  if (id < 0 || id >= num_requests()) return Status::InvalidArgument("Cancel: no request " + std::to_string(id));
  RequestState& r = *requests_[id];
  if (r.finished) return Status::Ok();
  std::erase(waiting_, id);
  std::erase(running_, id);
  cache_->Release(&r.cache);
  r.finished = true;
  r.finish_reason = "abort";
  return Status::Ok();
}

Status Engine::RunToCompletion() {
  while (true) {
    LS_ASSIGN_OR_RETURN(bool more, Step());
    if (!more) return Status::Ok();
  }
}

}  // namespace lockstep::engine
