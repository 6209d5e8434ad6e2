// server/live_record.h — what the server keeps of every request it runs, always, cheaply:
// everything that determines the numbers (prompt ids, sampling parameters, seed, stop tokens,
// the batch each step ran in); per generated token, the sampler's record (Philox counter,
// uniform draw, probability, candidates) and a hash of the logits row that chose it; and per
// tap and position, the summary a summary-mode trace stores (traces::Summarize: rms, absmax,
// min, max, NaN/Inf counts and the XXH3-64 content hash of the row). That is enough to re-run
// the request offline and check, tap by tap and token by token, that the re-run computed the
// same numbers (server/capture.h). The model fingerprint, build and kernel variants are the
// same for every request of a server, so they live once in ServerOptions::trace_meta.
//
// RequestRing keeps the records of recent requests under a byte budget, oldest evicted first.
// Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace lockstep::server {

struct LiveStep {
  int64_t engine_step = 0;        // the live engine's step number
  int32_t token = -1;
  double probability = 0;         // sampler's, under the filtered distribution
  double uniform = -1;            // the Philox draw (−1 greedy)
  uint64_t counter = 0;           // the Philox counter it was keyed with
  int64_t candidates = 0;
  uint64_t logits_hash = 0;       // XXH3-64 of the fp32 logits row that chose `token`
  std::vector<int64_t> batch;     // engine ids of the requests in that step's forward
};

// One tap row's summary, as traces::Summarize computes it for a trace (the step is left out:
// a re-run's step numbers differ from the live engine's).
struct LiveTapRow {
  int32_t position = 0;
  uint32_t nan_count = 0, inf_count = 0;
  uint64_t hash = 0;              // XXH3-64 (traces::kHashSeed) of the row's bytes
  float rms = 0, absmax = 0, min = 0, max = 0;
};
static_assert(sizeof(LiveTapRow) == 40);

// A tap's rows for one request, in the order the engine produced them (prompt, then decode).
struct LiveTap {
  std::string name;               // "layers.3.attn.out", "logits", … (the trace's taps/<name>)
  std::vector<LiveTapRow> rows;
};

struct LiveRecord {
  std::string id;                 // the x-request-id (with a "-<choice>" suffix when n > 1)
  std::string prompt_text;        // empty under --capture-redact
  engine::Request request;        // prompt ids, sampling (seed), max tokens, stop tokens
  std::vector<LiveStep> steps;
  std::vector<LiveTap> taps;      // empty without tap summaries (--no-tap-summaries, --no-record)
  std::string finish_reason;      // "stop" | "length" | "abort" (client gone, stop string)
  double created_unix = 0;
  int64_t engine_epoch = 0;       // which engine instance the batch ids refer to
  std::vector<int64_t> prompt_chunks;  // chunked prefill: where each prompt chunk began (else empty)

  std::vector<int32_t> tokens() const;
  size_t Bytes() const;           // memory held (steps, tap summaries, strings), for the ring's budget
  const LiveTap* FindTap(const std::string& name) const;
};

class RequestRing {
 public:
  explicit RequestRing(size_t byte_budget) : budget_(byte_budget) {}
  void Add(std::shared_ptr<const LiveRecord> r);
  std::shared_ptr<const LiveRecord> Find(const std::string& id) const;
  size_t bytes() const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  size_t budget_, bytes_ = 0;
  std::deque<std::shared_ptr<const LiveRecord>> order_;
  std::map<std::string, std::shared_ptr<const LiveRecord>> by_id_;
};

}  // namespace lockstep::server
