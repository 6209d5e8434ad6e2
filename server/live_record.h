// server/live_record.h — what the server keeps of every request it runs, always, cheaply:
// everything that determines the numbers (prompt ids, sampling parameters, seed, stop tokens,
// the batch each step ran in) and, per generated token, the sampler's record (Philox counter,
// uniform draw, probability, candidates) and a hash of the logits row that chose it. That is
// enough to re-run the request offline and check, token by token, that the re-run saw the
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

struct LiveRecord {
  std::string id;                 // the x-request-id (with a "-<choice>" suffix when n > 1)
  std::string prompt_text;        // empty under --capture-redact
  engine::Request request;        // prompt ids, sampling (seed), max tokens, stop tokens
  std::vector<LiveStep> steps;
  std::string finish_reason;      // "stop" | "length" | "abort" (client gone, stop string)
  double created_unix = 0;
  int64_t engine_epoch = 0;       // which engine instance the batch ids refer to

  std::vector<int32_t> tokens() const;
  size_t Bytes() const;           // approximate memory held, for the ring's budget
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
