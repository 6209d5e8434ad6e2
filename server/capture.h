// server/capture.h — turns a live record into a trace, and proves the trace is the request
// that ran.
//
// The server records cheaply: per token, the sampler's record and a hash of the logits row;
// per tap row, its summary (server/live_record.h). A capture re-runs the request alone,
// offline, on a fresh Engine with the server's engine options and writes a trace
// (recorder::RecordRun) named after the request id. Because the engine is batch-invariant and
// the sampler is stateless (Philox keyed by seed and token index), the re-run must reproduce
// the live numbers bit for bit, whatever the live batches were; the capture checks every
// token, Philox counter, uniform draw, probability and logits hash as the re-run goes, then
// reads the written trace back and checks every tap row's hash and statistics against the
// live record, and says loudly when one differs: then the trace is NOT the request that
// failed, and that is itself the finding (nondeterminism, a batch-variant kernel, a changed
// model).
//
// Beside the trace, <id>.live.json keeps the live record (the batch each step ran in) and the
// verdict. Capture files are written into a directory created 0700.
//
// Thread-safety: CaptureRequest builds its own Engine over the shared Model (whose Forward
// may run on several threads at once, engine/model.h), so it runs on any thread; the server
// runs it on its capture thread (server/capture_queue.h), never on the scheduler's.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "recorder/capture_policy.h"
#include "server/live_record.h"

namespace lockstep::server {

struct CaptureOptions {
  std::filesystem::path dir;
  engine::EngineOptions engine;                 // the server's
  std::map<std::string, std::string> trace_meta;  // model fingerprint, build, … (cli/serve.cc)
  bool redact = false;                          // token ids only, no text
  std::function<std::string(const std::vector<int32_t>&)> detokenize;  // may be empty
};

struct CaptureResult {
  std::string request_id;
  std::string trigger;       // "request" | "admin" | "degeneration"
  std::string mode;          // "summary" | "full"
  std::filesystem::path trace, live_json;
  bool verified = false;
  std::string detail;        // the first mismatch, or "N tokens verified"
  int64_t tokens = 0;
  int64_t tap_rows = 0;      // tap rows whose summary was checked against the live record
  uint64_t bytes = 0;        // trace + sidecar
};

// Creates `dir` (and parents) with mode 0700, or checks that an existing one is a directory.
Status MakePrivateDir(const std::filesystem::path& dir);

// A request id that is safe as a file name ([A-Za-z0-9._-], 1…128 chars, not starting '.').
bool SafeRequestId(const std::string& id);

Result<CaptureResult> CaptureRequest(const std::shared_ptr<engine::Model>& model, const LiveRecord& live,
                                     const std::string& trigger, recorder::CapturePolicy::Mode mode,
                                     const CaptureOptions& options);

}  // namespace lockstep::server
