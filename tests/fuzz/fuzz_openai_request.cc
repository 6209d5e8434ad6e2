// tests/fuzz/fuzz_openai_request.cc — the server's request parser (server/openai.h
// ParseGenerationRequest) on arbitrary bytes: every body is either a 4xx ApiError with a
// message, or a request the scheduler can run as it stands — a non-empty prompt of in-vocab ids
// within the limits, every sampling field in its documented range. Nothing may throw: an
// exception escaping the parser would be a 500 from the HTTP layer instead of the 400 that
// names the field. The first byte picks /v1/chat/completions (bit 0) and an X-Lockstep-Capture
// header (bits 1–2); the rest is the body (the seeds, tests/fuzz/seeds/openai/*.req, are laid out
// so). The embedded model's tokenizer encodes the prompts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "server/openai.h"

#ifndef LOCKSTEP_SOURCE_DIR
#error "LOCKSTEP_SOURCE_DIR: the repository root (the embedded model's tokenizer)"
#endif

namespace {

const lockstep::engine::Tokenizer& Tok() {
  static const std::shared_ptr<const lockstep::engine::Tokenizer> tok = [] {
    auto t = lockstep::engine::Tokenizer::Load(std::string(LOCKSTEP_SOURCE_DIR) +
                                               "/models/lockstep-tiny-v32/tokenizer.json");
    if (!t.ok()) {
      std::fprintf(stderr, "fuzz_openai_request: %s\n", t.status().message().c_str());
      std::abort();
    }
    return *t;
  }();
  return *tok;
}

void Require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_openai_request: accepted a request with %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) != 0;
  static const char* const kHeaders[] = {"", "summary", "full", "bogus"};
  const std::string header = kHeaders[(data[0] >> 1) & 3];
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  lockstep::server::Limits limits;
  limits.max_prompt_tokens = 512;
  lockstep::server::ChatTemplate tmpl;  // the embedded model's format
  lockstep::server::GenerationRequest r;
  const auto err = lockstep::server::ParseGenerationRequest(body, chat, header, Tok(), tmpl, limits, &r);
  if (err) {
    Require(err->status >= 400 && err->status < 500 && !err->message.empty(), "an error that is not a 4xx with a message");
    return 0;
  }
  Require(!r.prompt.empty(), "an empty prompt");
  Require(static_cast<int64_t>(r.prompt.size()) <= limits.max_prompt_tokens, "a prompt over the limit");
  for (int32_t t : r.prompt) Require(t >= 0 && t < Tok().vocab_size(), "a token id outside the vocabulary");
  Require(r.max_tokens >= 0 && r.max_tokens <= limits.max_tokens, "max_tokens out of range");
  Require(r.n >= 1 && r.n <= limits.max_n, "n out of range");
  Require(static_cast<int64_t>(r.stop.size()) <= limits.max_stop, "too many stop strings");
  for (const auto& s : r.stop) Require(!s.empty(), "an empty stop string");
  Require(r.top_logprobs >= -1 && r.top_logprobs <= 20, "top_logprobs out of range");
  Require(r.sampling.temperature >= 0 && r.sampling.temperature <= 2, "temperature out of range");
  Require(r.sampling.top_p > 0 && r.sampling.top_p <= 1, "top_p out of range");
  Require(r.sampling.min_p >= 0 && r.sampling.min_p <= 1, "min_p out of range");
  Require(r.sampling.top_k >= 0, "a negative top_k");
  Require(r.capture.empty() || r.capture == "summary" || r.capture == "full", "an unknown capture mode");
  Require(r.chat == chat, "the wrong endpoint");
  return 0;
}
