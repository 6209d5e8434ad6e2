// cli/common.h — what every sub-command shares: loading a model directory with progress,
// parsing sampling/engine flags, and reporting errors as one line.
#pragma once

#include <CLI/CLI.hpp>

#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "cli/rank_launch.h"
#include "engine/engine.h"
#include "engine/rank_group.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "traces/trace_reader.h"

namespace lockstep::cli {

// Flag checks that name the range they want in plain words (CLI11's print 0 to 1.797e308).
extern const CLI::Validator kNonNegative;  // ≥ 0
extern const CLI::Validator kPositive;     // > 0
// A whole decimal number in [lo, hi], checked as written: CLI11 itself reads
// 99999999999999999999 as 2^63 - 1 and -1 as 2^64 - 1 for an unsigned option. `text` names the
// range in --help and in the error ("0 to 2^26").
CLI::Validator WholeIn(uint64_t lo, uint64_t hi, const std::string& text);
// A finite number in [lo, hi].
CLI::Validator NumberIn(double lo, double hi, const std::string& text);
// The engine flags' ranges: what a trace can hold (traces/trace_format.h), so a run that records
// is never refused by the reader afterwards.
inline constexpr uint64_t kMaxTokensFlag = uint64_t{1} << 26;
inline constexpr uint64_t kMaxBatchFlag = 4096;
inline constexpr uint64_t kMaxKvCacheTokensFlag = uint64_t{1} << 36;

// The range a numeric field of a JSON file (--prompts, generation_config.json) must be in, and
// how an error names it.
struct FieldRange {
  double lo, hi;
  bool integral;
  const char* text;  // "a number ≥ 0", …
};
// The sampling fields', as the engine checks them (engine::SamplingParams).
inline constexpr FieldRange kTemperatureRange{0, 1e6, false, "a number in [0, 1e6]"};
inline constexpr FieldRange kTopPRange{std::numeric_limits<double>::denorm_min(), 1, false, "a number in (0, 1]"};
inline constexpr FieldRange kTopKRange{0, 67108864, true, "an integer in [0, 2^26]"};
inline constexpr FieldRange kMaxTokensRange{0, 67108864, true, "an integer in [0, 2^26]"};
inline constexpr FieldRange kSeedRange{0, 18446744073709551615.0, true, "an integer in [0, 2^64 - 1]"};
inline constexpr FieldRange kMinPRange{0, 1, false, "a number in [0, 1]"};
// Whether v is a number in r: whole when r.integral, and past 2^63 only when written as an
// integer (a float there has no exact integer value).
bool InRange(const nlohmann::json& v, const FieldRange& r);

// The model used when --model is not given: the trained tiny model shipped in models/.
std::filesystem::path DefaultModelDir();
// --model's help: what the default is, by path (LOCKSTEP_DEFAULT_MODEL overrides it).
std::string ModelOptionHelp();

struct LoadedModel {
  std::filesystem::path dir;
  std::shared_ptr<engine::Model> model;
  std::shared_ptr<const engine::Tokenizer> tokenizer;  // null when the directory has none
  std::vector<int32_t> eos_ids;
};

// Loads config, weights and (if present) tokenizer.json; prints progress on stderr unless quiet.
// random_weights: config.json only, weights generated on the GPU (--random-weights).
Result<LoadedModel> LoadModel(const std::filesystem::path& dir, bool quiet, bool random_weights = false);

struct EngineFlags;

// The engine a command drives, and with --tp-ranks N (N > 1) the other N − 1 ranks running
// `requests` beside it — threads of this process, or processes (--tp-launch processes,
// cli/rank_launch.h). It is rank 0; the caller adds the same requests, runs it, then calls
// Finish with the outcome. In a process started as rank r ≥ 1, CreateRankedEngine runs that
// rank to completion and exits the process with its status (it never returns there).
struct RankedEngine {
  std::unique_ptr<engine::RankFollowers> followers;  // --tp-launch threads
  std::unique_ptr<RankProcesses> processes;          // --tp-launch processes
  std::unique_ptr<engine::Engine> engine;
  // The run's outcome with the other ranks': waits for them (rank 0's error first).
  Status Finish(const Status& rank0);
};
// `observers` (may be empty): what runs beside each other rank's engine (record's shard writers).
Result<RankedEngine> CreateRankedEngine(const std::shared_ptr<engine::Model>& model, engine::EngineOptions options,
                                        const EngineFlags& flags, const std::vector<engine::Request>& requests,
                                        const engine::FollowerObservers& observers = {});

// The model part of a trace's /meta: model_dir, model_config, model_fingerprint, tokenizer_hash.
Result<std::map<std::string, std::string>> ModelMeta(const LoadedModel& m);

// Flags shared by generate, record, replay, degen: sampling, cache, kernels.
struct EngineFlags {
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  double min_p = 0.0;
  uint64_t seed = 0;
  int64_t max_tokens = 64;
  std::string kv_cache = "fp32";
  std::vector<std::string> kernels;
  int64_t max_batch = 8;
  int64_t max_prefill_tokens = 0;
  int64_t page_size = 64;
  int64_t kv_cache_tokens = 1 << 16;
  int64_t emulate_tp = 1;
  int64_t tp_ranks = 1;  // real TP: ranks (engine/rank_group.h); 1 = none
  std::string tp_launch = "threads";  // threads of this process | processes (cli/rank_launch.h)
  std::string tp_transport = "auto";  // processes' group: auto | shm | nccl
  bool ignore_eos = false;
  bool no_special_tokens = false;  // encode prompts without the tokenizer's template (BOS)
  std::string fault;
  std::string backend = "cpu";
  bool no_cuda_graphs = false;
  bool no_side_stream = false;
  bool no_overlapped_launch = false;
  bool host_sampler = false;
  bool gpu_profile = false;
  std::vector<CLI::Option*> sampling_options_;  // temperature, top_p, top_k, min_p: were they given?

  void Register(CLI::App* app);
  // Takes temperature / top_p / top_k / min_p from the model's generation_config.json where the
  // user gave no flag (as transformers and vLLM do); returns a note for stderr, or "" — or an
  // error naming the file and field when a value is outside the flag's range.
  Result<std::string> ApplyGenerationConfig(const std::filesystem::path& model_dir);
  Result<engine::EngineOptions> ToOptions() const;
  // The checks that need no model — the KV format, every --kernel op=variant and --fault named in
  // the registry for the backend — so a typo fails at once, not after a minutes-long load.
  Status Validate() const;
  // For commands that run no rank group (degen, serve): --tp-ranks and its launch flags refused
  // by name instead of ignored (--emulate-tp gives the same bits on one device).
  Status RefuseRanks(const std::string& command) const;
  engine::SamplingParams Sampling() const;
};

// Opens a trace that may be a stranger's (every command that reads one goes through this): first
// in a child process, because libhdf5 1.10 itself crashes on some damaged object headers
// (docs/fuzzing.md, tests/fuzz/regressions/hdf5-1.10/), so that such a file is refused with one
// line instead of taking lockstep down (the child opens it and reads every table's summary and
// first row, which is where those headers are decoded); then here, with every check of Open.
Result<std::unique_ptr<traces::TraceReader>> OpenTrace(const std::string& path);

// Prints "lockstep: <message>" to stderr and returns the exit code for `s` (0 when ok).
int Report(const Status& s);

}  // namespace lockstep::cli
