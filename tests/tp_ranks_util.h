// tests/tp_ranks_util.h — running N ranks of one model as threads for the rank-mode tests
// (tests/tp_ranks_test.cc on the CPU, tests/gpu/gpu_tp_ranks_test.cc on the GPU): each rank an
// engine with its end of a LocalCollectives group, its prompts, greedy, every prompt logit kept;
// and how many prompt logits two runs do not share bit for bit.
#pragma once

#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "kernels/collective.h"

namespace lockstep::tp_testing {

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;  // each request's prompt logits
  Status status;
};

// The prompts through one engine of `m` under `o`, `new_tokens` each; rank 0's taps to `hook`.
// An engine that cannot be made aborts its group (the other ranks would wait for it).
inline Outcome Run(const std::shared_ptr<engine::Model>& m, const engine::EngineOptions& o,
                   const std::vector<std::vector<int32_t>>& prompts, engine::TapHook* hook, int64_t new_tokens) {
  Outcome out;
  auto e = engine::Engine::Create(m, o);
  if (!e.ok()) {
    out.status = e.status();
    if (o.tp_ranks) o.tp_ranks->Abort(out.status);
    return out;
  }
  if (hook != nullptr) (*e)->SetTapHook(hook);
  for (const auto& p : prompts) {
    engine::Request r;
    r.prompt = p;
    r.max_new_tokens = new_tokens;
    r.all_prompt_logits = true;
    if (auto id = (*e)->AddRequest(r); !id.ok()) {
      out.status = id.status();
      return out;
    }
  }
  out.status = (*e)->RunToCompletion();
  for (int64_t i = 0; i < (*e)->num_requests(); ++i) {
    out.tokens.push_back((*e)->request(i).generated);
    out.logits.push_back((*e)->request(i).prompt_logits);
  }
  return out;
}

// N ranks as threads; rank r runs prompts_of(r), rank 0 with `hook`.
inline std::vector<Outcome> RunRanks(const std::shared_ptr<engine::Model>& m, const engine::EngineOptions& o, int n,
                                     const std::function<std::vector<std::vector<int32_t>>(int)>& prompts_of,
                                     engine::TapHook* hook, int64_t new_tokens) {
  auto group = kernels::LocalCollectives(n);
  std::vector<Outcome> outs(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      engine::EngineOptions mine = o;
      mine.tp_ranks = group[r];
      outs[r] = Run(m, mine, prompts_of(r), r == 0 ? hook : nullptr, new_tokens);
    });
  }
  for (auto& t : threads) t.join();
  return outs;
}

// Prompt logits of `a` not bitwise `b`'s (all of them, as ~0, when the shapes differ).
inline size_t LogitsApart(const Outcome& a, const Outcome& b) {
  if (a.logits.size() != b.logits.size()) return ~size_t{0};
  size_t d = 0;
  for (size_t i = 0; i < a.logits.size(); ++i) {
    if (a.logits[i].size() != b.logits[i].size()) return ~size_t{0};
    for (size_t j = 0; j < a.logits[i].size(); ++j) d += std::memcmp(&a.logits[i][j], &b.logits[i][j], 4) != 0;
  }
  return d;
}

}  // namespace lockstep::tp_testing
