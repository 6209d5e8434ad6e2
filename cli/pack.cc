// cli/pack.cc — `lockstep pack run.h5 --request ID -o report.h5`: one request of a trace made
// into a file a stranger can replay (traces/trace_pack.h), and the receiver's checks of one
// (PackChecks, which `replay` runs before it replays a pack).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "base/version.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/pack.h"
#include "recorder/fingerprint.h"
#include "traces/row_summary.h"
#include "traces/trace_pack.h"

namespace lockstep::cli {

std::string ThisLockstep() { return std::string("lockstep ") + kVersion + " (" + kGitRevision + ")"; }

namespace {

// "lockstep 0.1.0 (abc123) replay" → "lockstep 0.1.0 (abc123)": the version and revision.
std::string VersionOf(const std::string& writer) {
  const size_t close = writer.find(')');
  return close == std::string::npos ? writer : writer.substr(0, close + 1);
}

std::string Meta(const traces::TraceReader& t, const char* k) {
  auto it = t.meta().find(k);
  return it == t.meta().end() ? std::string() : it->second;
}

struct PackArgs {
  std::string trace, output, model;
  int64_t request = 0;
  bool no_tokenizer = false, json = false;
};

Status RunPack(const PackArgs& a) {
  {
    std::error_code ec;
    if (std::filesystem::equivalent(a.output, a.trace, ec)) {
      return Status::InvalidArgument("--output " + a.output + " is the trace being packed; name another file");
    }
  }
  LS_ASSIGN_OR_RETURN(auto src, OpenTrace(a.trace));
  traces::PackOptions o;
  o.request = static_cast<int32_t>(a.request);
  o.output = a.output;
  o.packed_with = ThisLockstep();
  {
    bool found = false;
    std::string ids;
    for (const auto& r : src->requests()) {
      found |= r.id == o.request;
      ids += (ids.empty() ? "" : ", ") + std::to_string(r.id);
    }
    if (!found) {
      return Status::InvalidArgument(a.trace + ": no request " + std::to_string(a.request) + " (it holds " +
                                     (ids.empty() ? std::string("none") : ids) + ")");
    }
  }
  const std::string tok_hash = Meta(*src, "tokenizer_hash");
  if (!a.no_tokenizer && !tok_hash.empty() && tok_hash != "none") {
    // The tokenizer the recording used: from --model, else the recorded folder; its hash must
    // be the recorded one.
    const std::filesystem::path dir = a.model.empty() ? std::filesystem::path(Meta(*src, "model_dir")) : std::filesystem::path(a.model);
    const std::filesystem::path tok = dir / "tokenizer.json";
    if (!std::filesystem::is_regular_file(tok)) {
      return Status::NotFound(tok.string() + ": not there, and the pack carries the recording's tokenizer; pass the "
                              "model folder with --model DIR (or --no-tokenizer)");
    }
    LS_ASSIGN_OR_RETURN(std::string h, recorder::FileFingerprint(tok));
    if (h != tok_hash) {
      return Status::InvalidArgument(tok.string() + ": hash " + h + " is not the recorded meta.tokenizer_hash " +
                                     tok_hash + "; pass the recorded model with --model DIR");
    }
    std::ifstream in(tok, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    o.tokenizer_json = ss.str();
    if (o.tokenizer_json.size() > traces::kMaxPackFileBytes) {
      return Status::InvalidArgument(tok.string() + ": larger than a pack holds (256 MiB)");
    }
  }
  LS_ASSIGN_OR_RETURN(traces::PackSummary s, traces::WritePack(*src, o));
  if (a.json) {
    nlohmann::json j = {{"pack", a.output},           {"source", a.trace},      {"request", a.request},
                        {"rows", s.rows},             {"tensors", s.tensors},   {"tokens", s.tokens},
                        {"bytes", s.file_bytes},      {"tokenizer", !o.tokenizer_json.empty()},
                        {"recorded_with", VersionOf(src->meta().count(traces::kMetaRecordedWith)
                                                        ? Meta(*src, traces::kMetaRecordedWith)
                                                        : src->writer())},
                        {"model_fingerprint", Meta(*src, "model_fingerprint")}};
    std::cout << JsonText(j, 2) << "\n";
  } else {
    std::printf("packed request %lld of %s into %s: %lld rows of %lld tensors, %lld tokens, %.1f kB%s\n",
                static_cast<long long>(a.request), a.trace.c_str(), a.output.c_str(), static_cast<long long>(s.rows),
                static_cast<long long>(s.tensors), static_cast<long long>(s.tokens), s.file_bytes / 1e3,
                o.tokenizer_json.empty() ? " (no tokenizer)" : "");
    std::printf("the receiver needs the model with fingerprint %s and %s: lockstep replay %s -m MODEL\n",
                Meta(*src, "model_fingerprint").c_str(),
                VersionOf(src->meta().count(traces::kMetaRecordedWith) ? Meta(*src, traces::kMetaRecordedWith)
                                                                       : src->writer())
                    .c_str(),
                a.output.c_str());
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<std::string>> PackChecks(const traces::TraceReader& t, const std::filesystem::path& model_dir) {
  LS_ASSIGN_OR_RETURN(traces::PackContents pc, traces::ReadPack(t));
  LS_ASSIGN_OR_RETURN(std::vector<std::string> diffs, traces::CheckManifest(t, pc));
  // The version: the exact lockstep that recorded the rows.
  const std::string recorded = VersionOf(Meta(t, traces::kMetaRecordedWith));
  if (recorded != ThisLockstep()) {
    diffs.push_back("lockstep version: recorded with " + (recorded.empty() ? std::string("(not recorded)") : recorded) +
                    ", this is " + ThisLockstep() + "; replay it with the recording's version");
  }
  // The model: weights (fingerprint), config and tokenizer as recorded.
  if (model_dir.empty()) {
    diffs.push_back("model: a pack carries no weights; pass the model folder with -m DIR (fingerprint " +
                    Meta(t, "model_fingerprint") + ")");
    return diffs;
  }
  if (!std::filesystem::is_directory(model_dir)) {
    diffs.push_back("model: " + model_dir.string() + " is not a directory");
    return diffs;
  }
  LS_ASSIGN_OR_RETURN(std::string fp, recorder::ModelFingerprint(model_dir));
  if (fp != Meta(t, "model_fingerprint")) {
    diffs.push_back("model fingerprint: " + model_dir.string() + " has " + fp + ", the recording " +
                    Meta(t, "model_fingerprint") + " (other weights)");
  }
  {
    std::ifstream in(model_dir / "config.json", std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in || ss.str() != pc.config_json) {
      const auto a = nlohmann::json::parse(ss.str(), nullptr, false), b = nlohmann::json::parse(pc.config_json, nullptr, false);
      std::string keys;
      if (a.is_object() && b.is_object()) {
        for (const auto& [k, v] : b.items()) {
          if (!a.contains(k) || a[k] != v) keys += (keys.empty() ? "" : ", ") + k;
        }
        for (const auto& [k, v] : a.items()) {
          if (!b.contains(k)) keys += (keys.empty() ? "" : ", ") + k;
        }
      }
      diffs.push_back("model config: " + (model_dir / "config.json").string() + " differs from the packed one" +
                      (keys.empty() ? std::string(" (in its bytes)") : " in " + keys));
    }
  }
  const std::string want_tok = Meta(t, "tokenizer_hash");
  const std::filesystem::path tok = model_dir / "tokenizer.json";
  std::string have_tok = "none";
  if (std::filesystem::exists(tok)) {
    LS_ASSIGN_OR_RETURN(have_tok, recorder::FileFingerprint(tok));
  }
  if (!want_tok.empty() && have_tok != want_tok) {
    diffs.push_back("tokenizer: " + tok.string() + " is " + have_tok + ", the recording's " + want_tok +
                    (pc.tokenizer_json.empty() ? "" : " (the pack holds the recorded one: pack/tokenizer.json)"));
  }
  return diffs;
}

void RegisterPack(CLI::App& app, SetAction set_action) {
  auto a = std::make_shared<PackArgs>();
  CLI::App* cmd = app.add_subcommand("pack", "Make one request of a trace into a file a stranger can replay (a bug report)");
  cmd->footer(
      "A pack is a trace of one request (renumbered 0): its rows of every tap and KV stream, its sampling\n"
      "rows, the model's config.json, tokenizer.json and fingerprint (not its weights), the engine options,\n"
      "the exact lockstep version that recorded it, and a manifest of content hashes of every part.\n"
      "The receiver runs `lockstep replay report.h5 -m MODEL`: the manifest, the fingerprint, the config,\n"
      "the tokenizer and the version are checked first, each difference named on its own line.\n"
      "`lockstep inspect report.h5` shows what a pack holds and needs. docs/trace-format.md, \"Packs\".\n"
      "Example: lockstep pack run.h5 --request 2 -o report.h5");
  cmd->add_option("trace", a->trace, "The recorded trace (complete)")->required();
  cmd->add_option("--request,-r", a->request, "Request id to pack (inspect lists them)")
      ->required()
      ->check(WholeIn(0, INT32_MAX, "0 to 2^31 - 1"));
  cmd->add_option("--output,-o", a->output, "The pack to write (replaced if it exists)")->required();
  cmd->add_option("--model,-m", a->model, "Model folder whose tokenizer.json goes in (default: the trace's meta.model_dir)");
  cmd->add_flag("--no-tokenizer", a->no_tokenizer, "Pack without tokenizer.json (the receiver needs the model's own)");
  cmd->add_flag("--json", a->json, "Machine-readable report");
  cmd->callback([a, set_action] { set_action([a] { return RunPack(*a); }); });
}

}  // namespace lockstep::cli
