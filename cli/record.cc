// cli/record.cc — `lockstep record`: run prompts like `generate` and write everything needed
// to replay and compare the run into an HDF5 trace (docs/trace-format.md).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "cli/prompts.h"
#include "recorder/fingerprint.h"
#include "recorder/rank_shard_writer.h"
#include "recorder/record_session.h"
#include "recorder/recorder.h"
#include "traces/trace_writer.h"

namespace lockstep::cli {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct RecordArgs {
  std::string model, prompt, prompts_file, prompt_ids, output;
  std::string capture = "full";
  std::vector<std::string> taps;
  std::string layers, positions;
  int64_t stride = 1;
  bool no_kv = false;
  std::string logits = "auto";
  int64_t logits_topk = 32;
  double flush_interval = 1.0;
  int zstd_level = 0;            // 0: RecorderOptions::ZstdLevel of the capture
  int compression_threads = -1;  // −1: RecorderOptions::CompressionThreads of the capture
  int64_t queue_mb = 256;
  bool quiet = false;
  bool rank_shards = false;
  EngineFlags flags;
};

Status RunRecord(RecordArgs& a) {
  recorder::CapturePolicy policy;
  LS_ASSIGN_OR_RETURN(policy.mode, recorder::CapturePolicy::ParseMode(a.capture));
  policy.taps = a.taps;
  if (!a.layers.empty()) {
    LS_RETURN_IF_ERROR(recorder::CapturePolicy::ParseRange(a.layers, "--layers", &policy.layer_first, &policy.layer_last));
  }
  if (!a.positions.empty()) {
    LS_RETURN_IF_ERROR(
        recorder::CapturePolicy::ParseRange(a.positions, "--positions", &policy.pos_first, &policy.pos_last));
  }
  policy.pos_stride = a.stride;
  policy.kv = !a.no_kv;
  policy.logits = a.logits == "full"   ? recorder::CapturePolicy::Logits::kFull
                  : a.logits == "topk" ? recorder::CapturePolicy::Logits::kTopK
                                       : recorder::CapturePolicy::Logits::kAuto;
  policy.logits_topk = a.logits_topk;
  // Everything that needs no model first: a typo must not wait for a load.
  LS_RETURN_IF_ERROR(a.flags.Validate());
  LS_ASSIGN_OR_RETURN(std::vector<PromptSpec> specs, CollectPrompts(a.prompts_file, a.prompt, a.prompt_ids));

  LS_ASSIGN_OR_RETURN(LoadedModel m, LoadModel(a.model.empty() ? DefaultModelDir() : std::filesystem::path(a.model), a.quiet));
  LS_ASSIGN_OR_RETURN(const std::string note, a.flags.ApplyGenerationConfig(m.dir));
  if (!note.empty() && !a.quiet) std::cerr << "lockstep: " << note << "\n";
  LS_ASSIGN_OR_RETURN(engine::EngineOptions opts, a.flags.ToOptions());
  std::vector<engine::Request> requests;
  int64_t budget = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    LS_ASSIGN_OR_RETURN(engine::Request r, MakeRequest(specs[i], i, a.flags, m));
    budget += r.max_new_tokens;
    requests.push_back(std::move(r));
  }
  recorder::RecordSessionOptions so;
  so.output = a.output;
  so.policy = policy;
  so.writer.zstd_level = a.zstd_level > 0 ? a.zstd_level : recorder::RecorderOptions::ZstdLevel(policy);
  so.writer.compression_threads =
      a.compression_threads >= 0 ? a.compression_threads
                                 : recorder::RecorderOptions::CompressionThreads(policy, std::thread::hardware_concurrency());
  so.writer.queue_bytes = a.queue_mb << 20;
  so.writer.batch_width = opts.max_batch;
  so.flush_interval_s = a.flush_interval;
  so.rank_shards = a.rank_shards;
  if (m.tokenizer) so.detokenize = [&m](const std::vector<int32_t>& ids) { return m.tokenizer->Decode(ids); };
  LS_ASSIGN_OR_RETURN(so.meta, ModelMeta(m));
  // --tp-ranks N: ranks 1 … N − 1 run beside this engine (rank 0); with --rank-shards each writes
  // its own shard.
  engine::FollowerObservers shard_writers;
  if (a.rank_shards) {
    shard_writers = [shard_options = so](int rank) { return recorder::NewRankShardWriter(shard_options, rank); };
  }
  LS_ASSIGN_OR_RETURN(RankedEngine ranked, CreateRankedEngine(m.model, opts, a.flags, requests, shard_writers));
  std::unique_ptr<engine::Engine> eng = std::move(ranked.engine);
  std::vector<recorder::RecordedRequest> recorded;
  for (size_t i = 0; i < requests.size(); ++i) recorded.push_back({requests[i], specs[i].text});
  int64_t prompt_positions = 0;
  for (const auto& r : requests) prompt_positions += static_cast<int64_t>(r.prompt.size());
  Progress progress(!a.quiet, "recording", budget);
  bool estimated = false;
  so.on_step = [&](const recorder::Recorder& rec, const traces::TraceWriter& w) {
    // After the first step that produced a token (the prefill), what a position costs is known:
    // say what the whole run will write before it is written.
    if (!estimated && !a.quiet && rec.tokens() > 0 && w.bytes_in() > 0) {
      estimated = true;
      const double per_position = static_cast<double>(w.bytes_in()) / std::max<int64_t>(prompt_positions, 1);
      const double total = per_position * static_cast<double>(prompt_positions + budget);
      progress.Done();
      std::fprintf(stderr,
                   "lockstep: this capture takes ~%s a position before compression (measured on the prompt): up "
                   "to ~%s for %lld positions%s\n",
                   HumanBytes(per_position).c_str(), HumanBytes(total).c_str(),
                   static_cast<long long>(prompt_positions + budget),
                   total > 1e9 && policy.mode == recorder::CapturePolicy::Mode::kFull
                       ? "; --capture summary, --taps, --layers or --stride capture less"
                       : "");
    }
    progress.Update(rec.tokens(), HumanBytes(static_cast<double>(w.bytes_in())) + " captured");
  };
  auto res = recorder::RecordRun(*eng, recorded, so);
  progress.Done();
  LS_RETURN_IF_ERROR(ranked.Finish(res.status()));
  if (!res.ok()) return res.status();
  if (!a.quiet) {
    const auto bytes = res->file_bytes;
    std::fprintf(stderr,
                 "lockstep: recorded %lld requests, %lld tokens in %lld steps to %s (%s capture): %.2f s run + %.2f s "
                 "to close, %.1f MB (%.0f bytes/token), engine stalled %.3f s on the trace, the recorder took %.3f s "
                 "of the engine thread (%.0f µs a step)\n",
                 static_cast<long long>(requests.size()), static_cast<long long>(res->tokens),
                 static_cast<long long>(res->steps), a.output.c_str(), a.capture.c_str(), res->run_s, res->close_s,
                 bytes / 1e6, res->tokens ? static_cast<double>(bytes) / res->tokens : 0.0, res->stall_ns / 1e9,
                 res->recorder_ns / 1e9, res->steps ? res->recorder_ns / 1e3 / static_cast<double>(res->steps) : 0.0);
  }
  return Status::Ok();
}

}  // namespace

void RegisterRecord(CLI::App& app, SetAction set_action) {
  auto args = std::make_shared<RecordArgs>();
  CLI::App* cmd = app.add_subcommand("record", "Run prompts and record a trace (HDF5) for replay and diff");
  cmd->footer(
      "Examples:\n"
      "  lockstep record --prompt '<!DOCTYPE html>' -n 64 -o run.h5\n"
      "  lockstep record --prompts prompts.jsonl --capture summary -o run.h5\n"
      "  lockstep record --prompt-ids 5,6,7 --taps 'layers.*.resid_out' --layers 0:2 --positions 0:63 -o x.h5\n"
      "Capture: full = tensors + summaries; summary = per-row statistics and content hashes only;\n"
      "none = tokens, sampler records and meta. The trace format is docs/trace-format.md;\n"
      "h5py/h5dump read it with HDF5_PLUGIN_PATH=<build>/hdf5-plugins.");
  cmd->add_option("--model,-m", args->model, ModelOptionHelp());
  cmd->add_option("--prompt,-p", args->prompt, "Prompt text");
  cmd->add_option("--prompts", args->prompts_file, "JSONL file of prompts (see `lockstep generate --help`)");
  cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt as comma-separated token ids");
  cmd->add_option("--output,-o", args->output, "Trace file to write (replaced if it exists)")->required();
  cmd->add_option("--capture", args->capture, "full | summary | none")
      ->check(CLI::IsMember({"full", "summary", "none"}));
  cmd->add_option("--taps", args->taps, "Capture only taps matching this glob (repeatable), e.g. 'layers.*.attn.out'");
  cmd->add_option("--layers", args->layers, "Capture only layers A:B (inclusive; 'A:' = A to the last)");
  cmd->add_option("--positions", args->positions, "Capture only positions A:B (inclusive)");
  cmd->add_option("--stride", args->stride, "Capture every N-th position of the range, 1 to 2^31")
      ->check(WholeIn(1, uint64_t{1} << 31, "1 to 2^31"));
  cmd->add_flag("--no-kv", args->no_kv, "Do not capture the KV cache");
  cmd->add_option("--logits", args->logits,
                  "auto (all when vocab ≤ 4096, else top-k) | full | topk; top-k rows keep the row's logsumexp, and "
                  "at the sampling temperature too for sampled requests (what verify redraws a token from)")
      ->check(CLI::IsMember({"auto", "full", "topk"}));
  cmd->add_option("--logits-topk", args->logits_topk, "k for top-k logits")->check(CLI::Range(1, 65536));
  cmd->add_option("--flush-interval", args->flush_interval,
                  "Seconds between flushes (what survives a crash); 0 = after every step")
      ->check(kNonNegative);
  cmd->add_option("--zstd-level", args->zstd_level,
                  "Zstandard level 1..22 (full capture's activations compress ~1.1:1 at any level)")
      ->check(CLI::Range(1, 22))
      ->default_str("1 for full capture, else 3");
  cmd->add_option("--compression-threads", args->compression_threads,
                  "zstd workers beside the writer thread (0: the writer compresses; a large model at batch > 1 "
                  "needs several)")
      ->check(CLI::Range(0, 64))
      ->default_str("full capture: half the cores, at most 8; else 1");
  cmd->add_option("--queue-mb", args->queue_mb, "Capture queue bound; the engine waits (and the trace says how long) when full")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_flag("--rank-shards", args->rank_shards,
                "With --emulate-tp N (or --tp-ranks N) and full capture: each rank's columns of the rank-split "
                "taps (attn.q, attn.heads, attn.partials, ffn.partials) in its own shard, <output>.rank<r>, stitched into the "
                "trace by HDF5 virtual datasets — the files a run over N GPUs writes (docs/trace-format.md); "
                "under --tp-ranks each rank writes its own shard. Keep the shards beside the trace");
  cmd->add_flag("--quiet,-q", args->quiet, "No progress or statistics on stderr");
  args->flags.Register(cmd);
  cmd->callback([args, set_action] { set_action([args] { return RunRecord(*args); }); });
}

}  // namespace lockstep::cli
