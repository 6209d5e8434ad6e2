// cli/pack.h — the receiver's side of a pack (cli/pack.cc, traces/trace_pack.h).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "base/status.h"
#include "traces/trace_reader.h"

namespace lockstep::cli {

// "lockstep 0.1.0 (rev)": this binary, as a trace's writer and a pack's version name it.
std::string ThisLockstep();

// What differs between a pack and this machine, one line each ("" lines: none): the manifest
// against the pack's contents, the recorded lockstep version against this one, and the model
// folder's fingerprint, config.json and tokenizer.json against the recorded ones.
Result<std::vector<std::string>> PackChecks(const traces::TraceReader& pack, const std::filesystem::path& model_dir);

}  // namespace lockstep::cli
