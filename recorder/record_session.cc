// recorder/record_session.cc — see record_session.h.
#include "recorder/record_session.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/version.h"
#include "recorder/rank_shard_writer.h"

namespace lockstep::recorder {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string CpuName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

std::string CommandLine() {
  const std::string raw = ReadFile("/proc/self/cmdline");
  std::string out;
  size_t start = 0;
  while (start < raw.size()) {
    size_t end = raw.find('\0', start);
    if (end == std::string::npos) end = raw.size();
    std::string arg = raw.substr(start, end - start);
    if (!out.empty()) out += ' ';
    if (arg.find_first_of(" \t\n'\"\\$`") != std::string::npos || arg.empty()) {
      std::string q = "'";
      for (char c : arg) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
      arg = q + "'";
    }
    out += arg;
    start = end + 1;
  }
  return out;
}

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

traces::TraceWriterOptions TraceWriterOptionsOf(const RecordSessionOptions& o) {
  traces::TraceWriterOptions wo = o.writer;
  // Every trace names the lockstep that wrote it (record, replay, degen's failures, the
  // server's captures alike), unless the caller names another writer.
  if (wo.writer.empty()) wo.writer = std::string("lockstep ") + kVersion + " (" + kGitRevision + ")";
  wo.alloc_block_bytes = RecorderOptions::AllocBlockBytes(o.policy);
  wo.target_chunk_bytes = RecorderOptions::TargetChunkBytes(o.policy);
  return wo;
}

traces::TraceWriterOptions ShardWriterOptionsOf(const RecordSessionOptions& o, int64_t ranks) {
  // Each shard's writer gets a share of the workers (the ranks of a real run write in parallel).
  traces::TraceWriterOptions so = TraceWriterOptionsOf(o);
  so.compression_threads = std::max(1, so.compression_threads / static_cast<int>(std::max<int64_t>(ranks, 1)));
  return so;
}

Status SetShardMeta(traces::TraceWriter& w, int rank, int64_t ranks, const std::string& run_id, int writer_rank) {
  LS_RETURN_IF_ERROR(w.SetMeta(traces::kMetaShardRank, std::to_string(rank)));
  LS_RETURN_IF_ERROR(w.SetMeta(traces::kMetaShardRanks, std::to_string(ranks)));
  LS_RETURN_IF_ERROR(w.SetMeta(traces::kMetaShardRunId, run_id));
  LS_RETURN_IF_ERROR(w.SetMeta(traces::kMetaShardWriterRank, std::to_string(writer_rank)));
  return w.SetMeta(traces::kMetaShardWriterPid, std::to_string(static_cast<long long>(getpid())));
}

Result<RecordSessionResult> RecordRun(engine::Engine& eng, const std::vector<RecordedRequest>& requests,
                                      const RecordSessionOptions& o) {
  const std::string out = o.output.string();
  const traces::TraceWriterOptions wo = TraceWriterOptionsOf(o);
  const engine::EngineOptions& eo0 = eng.options();
  const int64_t tp = eo0.tp_ranks ? eo0.tp_ranks->size() : eo0.emulate_tp;
  const int64_t ranks = o.rank_shards ? tp : 0;
  if (o.rank_shards && (ranks < 2 || o.policy.mode != CapturePolicy::Mode::kFull)) {
    return Status::InvalidArgument("--rank-shards: needs --emulate-tp N > 1 (or --tp-ranks N) and --capture full (the "
                                   "shards hold the ranks' values; this run has TP " + std::to_string(tp) + ", capture " +
                                   std::string(CapturePolicy::ModeName(o.policy.mode)) + ")");
  }
  // Real ranks write their own shards (rank_shard_writer.h); this one writes shard 0. Emulated TP
  // writes them all here.
  kernels::Collective* group = ranks > 1 && eo0.tp_ranks ? eo0.tp_ranks.get() : nullptr;
  std::vector<std::unique_ptr<traces::TraceWriter>> shards;  // null: written by its own rank
  std::vector<std::string> shard_files;
  std::string run_id;
  if (ranks > 1) {
    std::random_device rd;
    char id[24];
    std::snprintf(id, sizeof id, "%08x%08x", rd(), rd());
    run_id = id;
    if (group != nullptr) {
      LS_ASSIGN_OR_RETURN(run_id, ShareRunId(*group, run_id));
    }
    const traces::TraceWriterOptions so = ShardWriterOptionsOf(o, ranks);
    for (int r = 0; r < ranks; ++r) {
      const std::filesystem::path sp = traces::ShardPath(o.output, r);
      shard_files.push_back(sp.filename().string());
      if (group != nullptr && r != group->rank()) {
        shards.push_back(nullptr);
        continue;
      }
      LS_ASSIGN_OR_RETURN(auto sw, traces::TraceWriter::Create(sp, so));
      LS_RETURN_IF_ERROR(SetShardMeta(*sw, r, ranks, run_id, group != nullptr ? group->rank() : 0));
      shards.push_back(std::move(sw));
    }
  }
  LS_ASSIGN_OR_RETURN(auto writer, traces::TraceWriter::Create(o.output, wo));
  if (ranks > 1) {
    LS_RETURN_IF_ERROR(writer->SetMeta(traces::kMetaShardRanks, std::to_string(ranks)));
    LS_RETURN_IF_ERROR(writer->SetMeta(traces::kMetaShardRunId, run_id));
    for (int r = 0; r < ranks; ++r) {
      LS_RETURN_IF_ERROR(writer->SetMeta(std::string(traces::kMetaShardFile) + std::to_string(r), shard_files[r]));
    }
  }

  // /meta: what the engine knows, then the caller's keys (which win).
  const engine::EngineOptions& eo = eng.options();
  json engine_options = {{"kv_cache", std::string(engine::KvFormatName(eo.kv_format))},
                         {"page_size", eo.page_size},
                         {"kv_cache_tokens", eo.kv_cache_tokens},
                         {"max_batch", eo.max_batch},
                         {"kernels", eo.kernels},
                         {"fault", eo.fault},
                         {"backend", eo.backend},
                         {"max_prefill_tokens", eo.max_prefill_tokens},
                         {"emulate_tp", eo.emulate_tp},
                         {"tp_ranks", eo.tp_ranks ? eo.tp_ranks->size() : 1},
                         {"cuda_graphs", eo.device.cuda_graphs},
                         {"side_stream", eo.device.side_stream},
                         {"overlapped_launch", eo.device.overlapped_launch},
                         {"device_sampler", eo.device.device_sampler}};
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::map<std::string, std::string> meta = {
      {"lockstep_version", kVersion},
      {"git_revision", kGitRevision},
      {"build_type", kBuildType},
      {"backend", eo.backend},
      {"device", eo.backend == "cpu" ? CpuName() : eng.backend().device()},
      {"kernels", json(eng.kernels()).dump()},
      {"kv_cache_format", std::string(engine::KvFormatName(eo.kv_format))},
      {"engine_options", engine_options.dump()},
      {"capture_policy", o.policy.ToJson()},
      {"command_line", CommandLine()},
      {"host", host},
      {"time", UtcNow()},
      {"zstd_level", std::to_string(o.writer.zstd_level)},
      {"flush_interval_s", std::to_string(o.flush_interval_s)},
  };
  for (const auto& [k, v] : o.meta) meta[k] = v;
  for (const auto& [k, v] : meta) LS_RETURN_IF_ERROR(writer->SetMeta(k, v));

  RecorderOptions ro;
  ro.policy = o.policy;
  ro.flush_interval_s = o.flush_interval_s;
  ro.summarize_here_max_row_bytes = o.summarize_here_max_row_bytes;
  ro.detokenize = o.detokenize;
  for (auto& sw : shards) ro.shard_writers.push_back(sw.get());  // (null: its rank's)
  ro.shard_files = shard_files;
  Recorder rec(&eng, writer.get(), ro);
  rec.Attach();
  if (o.wrap) eng.SetTapHook(o.wrap(&rec));
  for (const auto& r : requests) {
    LS_ASSIGN_OR_RETURN(int64_t id, eng.AddRequest(r.request));
    LS_RETURN_IF_ERROR(rec.AddRequest(id, r.prompt_text));
  }

  RecordSessionResult res;
  const auto t0 = Clock::now();
  auto fail = [&](const Status& s) {
    const Status stopped = Status(s).WithContext(out + ": recording stopped after " + std::to_string(rec.steps()) +
                                                 " steps (the trace keeps what was flushed before): ");
    for (auto& sw : shards) {
      if (sw) (void)sw->Close();
    }
    // The trace says why it ends here (a healthy writer closes it complete: what it holds is whole,
    // the run is not); a failed writer leaves it as of its last flush, marked incomplete.
    (void)writer->SetMeta(traces::kMetaStopped, s.message());
    (void)writer->Close();
    return stopped;
  };
  while (true) {
    auto more = eng.Step();
    if (!more.ok()) return fail(more.status());
    if (!*more) break;
    Status s = rec.EndStep();
    if (!s.ok()) return fail(s);
    if (o.on_step) o.on_step(rec, *writer);
  }
  Status s = rec.Finish();
  if (!s.ok()) return fail(s);
  res.run_s = std::chrono::duration<double>(Clock::now() - t0).count();
  res.stall_ns = writer->stall_ns() + eng.backend().tap_wait_ns();  // (the queue and lent tap buffers)
  {
    const Recorder::EngineThreadTimes& t = rec.engine_thread_times();
    res.recorder_ns = t.taps_ns + t.kv_ns + t.steps_ns;
  }
  for (auto& sw : shards) {  // the shards close first: a complete trace's shards are complete
    if (!sw) continue;
    s = sw->Close();
    if (!s.ok()) return fail(s);
  }
  if (group != nullptr) {  // … the other ranks' too
    s = MeetShardsClosed(*group);
    if (!s.ok()) return fail(s);
  }
  s = writer->Close();
  if (!s.ok()) return fail(s);
  for (int r = 0; r < ranks; ++r) {
    std::error_code ec;
    res.file_bytes += std::filesystem::file_size(traces::ShardPath(o.output, r), ec);
  }
  res.close_s = std::chrono::duration<double>(Clock::now() - t0).count() - res.run_s;
  res.steps = rec.steps();
  res.tokens = rec.tokens();
  std::error_code ec;
  res.file_bytes += std::filesystem::file_size(o.output, ec);
  return res;
}

}  // namespace lockstep::recorder
