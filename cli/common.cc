// cli/common.cc — see common.h.
#include "cli/common.h"

#include <sstream>

#include "kernels/registry.h"
#include "recorder/fingerprint.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

namespace lockstep::cli {

std::filesystem::path DefaultModelDir() {
  if (const char* env = std::getenv("LOCKSTEP_DEFAULT_MODEL")) return env;
  return LOCKSTEP_DEFAULT_MODEL_DIR;
}

std::string ModelOptionHelp() {
  return "Model directory (HF layout) [default: " + DefaultModelDir().string() +
         "] (the embedded default is models/lockstep-tiny-v4, DeepSeek-V4; models/lockstep-tiny-v32 is the V3.2 "
         "model, which also runs on CUDA)";
}

Result<LoadedModel> LoadModel(const std::filesystem::path& dir, bool quiet, bool random_weights) {
  if (!std::filesystem::is_directory(dir)) {
    return Status::NotFound(dir.string() + ": not a model directory (expected config.json, *.safetensors)");
  }
  auto t0 = std::chrono::steady_clock::now();
  LoadedModel m;
  m.dir = dir;
  if (random_weights) {
    LS_ASSIGN_OR_RETURN(m.model, engine::Model::RandomWeights(dir, /*seed=*/0));
  } else {
    LS_ASSIGN_OR_RETURN(m.model, engine::Model::Load(dir));
  }
  const auto tok_path = dir / "tokenizer.json";
  if (std::filesystem::exists(tok_path)) {
    LS_ASSIGN_OR_RETURN(m.tokenizer, engine::Tokenizer::Load(tok_path));
  }
  for (int64_t e : m.model->config().eos_token_ids) m.eos_ids.push_back(static_cast<int32_t>(e));
  if (!quiet) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto& c = m.model->config();
    std::cerr << "lockstep: loaded " << dir.string() << " (" << engine::FamilyName(c.family) << ", "
              << c.num_hidden_layers << " layers, "
              << (random_weights ? std::string("random weights")
                                 : (std::ostringstream() << m.model->ParameterCount() / 1e6 << "M params").str())
              << ") in " << s << " s\n";
    const auto& w = m.model->weights();
    if (w.mtp_tensors > 0) {
      std::cerr << "lockstep: skipped " << w.mtp_tensors << " tensors of the multi-token-prediction (MTP) layer(s); "
                << "inference does not use them\n";
    }
    if (static_cast<int64_t>(w.skipped.size()) > w.mtp_tensors) {
      std::cerr << "lockstep: skipped " << w.skipped.size() - w.mtp_tensors
                << " other unused tensors (`lockstep model info` lists them)\n";
    }
  }
  return m;
}

Result<std::map<std::string, std::string>> ModelMeta(const LoadedModel& m) {
  LS_ASSIGN_OR_RETURN(std::string fingerprint, recorder::ModelFingerprint(m.dir));
  std::string tok_hash = "none";
  if (std::filesystem::exists(m.dir / "tokenizer.json")) {
    LS_ASSIGN_OR_RETURN(tok_hash, recorder::FileFingerprint(m.dir / "tokenizer.json"));
  }
  std::ifstream in(m.dir / "config.json", std::ios::binary);
  std::stringstream config;
  config << in.rdbuf();
  return std::map<std::string, std::string>{{"model_dir", std::filesystem::absolute(m.dir).string()},
                                            {"model_config", config.str()},
                                            {"model_fingerprint", fingerprint},
                                            {"tokenizer_hash", tok_hash}};
}

// CLI11's NonNegativeNumber and PositiveNumber name their range as 0 to 1.797e308 when they
// refuse; these say it plainly.
extern const CLI::Validator kNonNegative(
    [](std::string& in) -> std::string {
      char* end = nullptr;
      const double v = std::strtod(in.c_str(), &end);
      if (end == in.c_str() || *end != '\0') return "not a number: " + in;
      if (!std::isfinite(v)) return "must be a finite number (got " + in + ")";
      return v >= 0 ? std::string() : "must be ≥ 0 (got " + in + ")";
    },
    "≥ 0", "non-negative");
extern const CLI::Validator kPositive(
    [](std::string& in) -> std::string {
      char* end = nullptr;
      const double v = std::strtod(in.c_str(), &end);
      if (end == in.c_str() || *end != '\0') return "not a number: " + in;
      if (!std::isfinite(v)) return "must be a finite number (got " + in + ")";
      return v > 0 ? std::string() : "must be > 0 (got " + in + ")";
    },
    "> 0", "positive");

CLI::Validator WholeIn(uint64_t lo, uint64_t hi, const std::string& text) {
  return CLI::Validator(
      [lo, hi, text](std::string& in) -> std::string {
        uint64_t v = 0;
        const char* b = in.data();
        const char* e = b + in.size();
        const auto [end, ec] = std::from_chars(b, e, v, 10);
        if (in.empty() || ec != std::errc() || end != e || !(v >= lo && v <= hi)) {
          return "must be a whole number from " + text + " (got " + in + ")";
        }
        return std::string();
      },
      text);
}

CLI::Validator NumberIn(double lo, double hi, const std::string& text) {
  return CLI::Validator(
      [lo, hi, text](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end == in.c_str() || *end != '\0' || !(v >= lo && v <= hi)) {
          return "must be a finite number in " + text + " (got " + in + ")";
        }
        return std::string();
      },
      text);
}

bool InRange(const nlohmann::json& v, const FieldRange& r) {
  if (!v.is_number()) return false;
  const double x = v.get<double>();
  if (!(x >= r.lo && x <= r.hi)) return false;
  return !r.integral || (x == std::floor(x) && (v.is_number_integer() || x < 9.2e18));
}

void EngineFlags::Register(CLI::App* app) {
  app->add_option("--max-tokens,-n", max_tokens, "Tokens to generate per prompt, 0 to 2^26 (67108864)")
      ->check(WholeIn(0, kMaxTokensFlag, "0 to 2^26"));
  sampling_options_ = {
      app->add_option("--temperature,-t", temperature, "Sampling temperature in [0, 1e6]; 0 = greedy (argmax)")
          ->check(NumberIn(0, 1e6, "[0, 1e6]"))
          ->default_str("the model's generation_config.json, else 0"),
      app->add_option("--top-p", top_p, "Nucleus sampling mass in (0, 1]; 1 = off")
          ->check(CLI::Range(0.0, 1.0))
          ->default_str("generation_config.json, else 1"),
      app->add_option("--top-k", top_k, "Keep the k most likely tokens, 0 to 2^26; 0 = off")
          ->check(WholeIn(0, uint64_t{1} << 26, "0 to 2^26"))
          ->default_str("generation_config.json, else 0"),
      app->add_option("--min-p", min_p, "Drop tokens below min_p × the top probability; 0 = off")
          ->check(CLI::Range(0.0, 1.0))
          ->default_str("generation_config.json, else 0")};
  app->add_option("--seed", seed,
                  "Per-request sampling seed (Philox key), 0 to 2^64 - 1; request i of --prompts uses seed + i")
      ->check(WholeIn(0, UINT64_MAX, "0 to 2^64 - 1"));
  app->add_option("--kv-cache", kv_cache,
                  "KV cache storage: fp32 | bf16 | fp8_e4m3 (V2-V3.2: FlashMLA's V3.2 FP8 latent layout; V4: its "
                  "window and compressed rows in FlashMLA's MODEL1 layout)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp8_e4m3"}));
  app->add_option("--kernel", kernels, "Kernel variant override op=variant (repeatable; `lockstep kernels` lists them)");
  app->add_option("--max-batch", max_batch, "Requests run together per step, 1 to 4096 (what a trace's step table holds)")
      ->check(WholeIn(1, kMaxBatchFlag, "1 to 4096"));
  app->add_option("--max-prefill-tokens", max_prefill_tokens,
                  "Chunked prefill: prompt tokens per step across requests, 0 to 2^31 (0 = whole prompts); numbers do "
                  "not change")
      ->check(WholeIn(0, uint64_t{1} << 31, "0 to 2^31"));
  app->add_option("--page-size", page_size, "Tokens per KV-cache page, 1 to 2^20")
      ->check(WholeIn(1, uint64_t{1} << 20, "1 to 2^20"));
  app->add_option("--kv-cache-tokens", kv_cache_tokens,
                  "KV-cache capacity in tokens, across all requests, 1 to 2^36 (and what memory holds)")
      ->check(WholeIn(1, kMaxKvCacheTokensFlag, "1 to 2^36"));
  app->add_option("--emulate-tp", emulate_tp,
                  "Tensor parallelism over N ranks emulated on one device (cpu or cuda), 1 to 64 (1 = none): heads "
                  "and MLP dims sharded, experts split by rank, the partials all-reduced (--kernel allreduce=…; "
                  "docs/parallelism.md); V2-V3.2")
      ->check(WholeIn(1, 64, "1 to 64"));
  app->add_option("--tp-ranks", tp_ranks,
                  "Tensor parallelism over N real ranks, 1 to 64 (1 = none): N engines, each computing only its "
                  "shard (its heads, its MLP slice, its experts) and gathering the partials — emulated TP N's bits. "
                  "Ranks are threads of this process (the cpu backend, or one GPU with --backend cuda: each rank its own "
                  "weight shard, the partials gathered through host memory, no CUDA graphs) or processes "
                  "(--tp-launch processes: over NCCL a GPU each; docs/parallelism.md)")
      ->check(WholeIn(1, 64, "1 to 64"));
  app->add_option("--tp-launch", tp_launch,
                  "With --tp-ranks N: threads (the ranks are threads of this process) | processes (ranks 1 … N − 1 "
                  "are this command started again, one process each, as a multi-GPU run has them: the same "
                  "tokens and trace; cli/rank_launch.h)")
      ->check(CLI::IsMember({"threads", "processes"}))
      ->capture_default_str();
  app->add_option("--tp-transport", tp_transport,
                  "--tp-launch processes: where the ranks meet — auto (nccl on --backend cuda when the machine has a "
                  "GPU a rank, else shm) | shm (shared memory: the cpu backend, or GPU ranks sharing a GPU) | nccl "
                  "(a GPU a rank, rank r on GPU r)")
      ->check(CLI::IsMember({"auto", "shm", "nccl"}))
      ->capture_default_str();
  app->add_flag("--ignore-eos", ignore_eos, "Keep generating past the end-of-sequence token");
  app->add_flag("--no-special-tokens", no_special_tokens,
                "Encode prompts without the tokenizer's template (no BOS); by default it is applied, as transformers does");
  app->add_option("--backend", backend,
                  "Where the forward pass runs: cpu (the fp32 reference) | cuda (needs a GPU and a CUDA build)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_flag("--no-cuda-graphs", no_cuda_graphs,
                "--backend cuda: launch every decode step kernel by kernel instead of replaying a CUDA graph "
                "(slower; the same bits)");
  app->add_flag("--no-side-stream", no_side_stream,
                "--backend cuda: run a step's independent branches (the latent-cache path, the shared experts) in "
                "order on one stream instead of beside the others on a second (slower; the same bits)");
  app->add_flag("--no-overlapped-launch", no_overlapped_launch,
                "--backend cuda: start each kernel only once the one before it has finished, instead of letting it "
                "fetch its weights while that one runs (slower; the same bits)");
  app->add_flag("--host-sampler", host_sampler,
                "--backend cuda: copy each step's logits to the host and sample there instead of on the GPU (the "
                "same algorithm and random stream: the same tokens)");
  app->add_flag("--gpu-profile", gpu_profile,
                "--backend cuda: print the GPU time of each phase of a step (ms/step) on stderr at the end");
  app->add_option("--fault", fault,
                  "Enable one deliberately wrong kernel, a test instrument (docs/fault-zoo.md; `lockstep kernels "
                  "--faults` lists them)");
}

Result<std::string> EngineFlags::ApplyGenerationConfig(const std::filesystem::path& model_dir) {
  const std::filesystem::path path = model_dir / "generation_config.json";
  std::ifstream in(path);
  if (!in) return std::string();
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::string();
  // Sampling applies only when the model's authors ask for it (do_sample true); otherwise —
  // absent, null, or not a boolean at all — greedy.
  const bool sample = j.contains("do_sample") && j["do_sample"].is_boolean() && j["do_sample"].get<bool>();
  if (!sample) return std::string();
  std::string note;
  // A number in its range becomes the flag's default; one outside is an error naming the file,
  // the field and the flag that overrides it.
  auto take = [&](CLI::Option* opt, const char* key, auto* dst, const FieldRange& r) -> Status {
    if (opt->count() > 0 || !j.contains(key) || !j[key].is_number()) return Status::Ok();
    if (!InRange(j[key], r)) {
      return Status::InvalidArgument(path.string() + ": field '" + key + "' is " + j[key].dump() + ", not " + r.text +
                                     " (override it with " + opt->get_name() + ")");
    }
    *dst = j[key].get<std::remove_reference_t<decltype(*dst)>>();
    note += std::string(note.empty() ? "" : ", ") + key + " " + j[key].dump();
    return Status::Ok();
  };
  LS_RETURN_IF_ERROR(take(sampling_options_[0], "temperature", &temperature, kTemperatureRange));
  LS_RETURN_IF_ERROR(take(sampling_options_[1], "top_p", &top_p, kTopPRange));
  LS_RETURN_IF_ERROR(take(sampling_options_[2], "top_k", &top_k, kTopKRange));
  LS_RETURN_IF_ERROR(take(sampling_options_[3], "min_p", &min_p, kMinPRange));
  return note.empty() ? std::string() : "sampling defaults from generation_config.json: " + note;
}

Status RankedEngine::Finish(const Status& rank0) {
  if (followers) return followers->Finish(rank0);
  if (processes) return processes->Finish(rank0);
  return rank0;
}

Result<RankedEngine> CreateRankedEngine(const std::shared_ptr<engine::Model>& model, engine::EngineOptions options,
                                        const EngineFlags& flags, const std::vector<engine::Request>& requests,
                                        const engine::FollowerObservers& observers) {
  RankedEngine out;
  const int ranks = static_cast<int>(flags.tp_ranks);
  if (ranks > 1 && flags.tp_launch == "processes") {
    if (IsLaunchedRank()) {  // rank r ≥ 1 of a group its rank 0 started: run, and end here
      const int rc = RunLaunchedRank(model, options, ranks, requests, observers);
      std::fflush(stdout);
      std::fflush(stderr);
      std::exit(rc);
    }
    LS_ASSIGN_OR_RETURN(out.processes, RankProcesses::Launch(options, ranks, flags.tp_transport, requests, &options));
  } else if (ranks > 1) {
    LS_ASSIGN_OR_RETURN(out.followers,
                        engine::RankFollowers::Start(model, options, ranks, requests, &options, observers));
  }
  auto created = engine::Engine::Create(model, options);
  if (!created.ok()) return out.Finish(created.status());
  out.engine = std::move(*created);
  return out;
}

Result<engine::EngineOptions> EngineFlags::ToOptions() const {
  engine::EngineOptions o;
  LS_ASSIGN_OR_RETURN(o.kv_format, engine::ParseKvFormat(kv_cache));
  for (const auto& k : kernels) LS_RETURN_IF_ERROR(kernels::ParseKernelOverride(k, &o.kernels));
  o.fault = fault;
  o.backend = backend;
  o.device.cuda_graphs = !no_cuda_graphs;
  o.device.side_stream = !no_side_stream;
  o.device.overlapped_launch = !no_overlapped_launch;
  o.device.device_sampler = !host_sampler;
  o.device.profile = gpu_profile;
  o.max_batch = max_batch;
  o.max_prefill_tokens = max_prefill_tokens;
  o.page_size = page_size;
  o.kv_cache_tokens = kv_cache_tokens;
  o.emulate_tp = emulate_tp;
  return o;
}

Status EngineFlags::Validate() const {
  if (tp_launch == "processes" && tp_ranks < 2) {
    return Status::InvalidArgument("--tp-launch processes: starts ranks 1 … N − 1 of --tp-ranks N; give N ≥ 2");
  }
  if (tp_transport != "auto" && tp_launch != "processes") {
    return Status::InvalidArgument("--tp-transport " + tp_transport + ": the group of --tp-launch processes (threads "
                                   "meet in this process's memory)");
  }
  if (tp_transport == "nccl" && backend != "cuda") {
    return Status::InvalidArgument("--tp-transport nccl: NCCL joins GPUs (--backend cuda); the cpu backend's "
                                   "processes meet in shared memory (--tp-transport shm, the default there)");
  }
  LS_ASSIGN_OR_RETURN(engine::EngineOptions o, ToOptions());
  return kernels::Registry::Get().Resolve(o.kernels, o.backend, o.fault).status();
}

Status EngineFlags::RefuseRanks(const std::string& command) const {
  if (tp_ranks > 1 || tp_launch != "threads" || tp_transport != "auto") {
    return Status::Unsupported(command + " --tp-ranks / --tp-launch / --tp-transport: " + command +
                               " runs one engine (generate and record run rank groups); --emulate-tp " +
                               std::to_string(std::max<int64_t>(tp_ranks, 2)) + " gives the same bits on one device");
  }
  return Status::Ok();
}

engine::SamplingParams EngineFlags::Sampling() const {
  engine::SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.top_k = top_k;
  p.min_p = min_p;
  p.seed = seed;
  return p;
}

Result<std::unique_ptr<traces::TraceReader>> OpenTrace(const std::string& path) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    // The child only opens and reads the structure; its stderr (a sanitizer's report) is dropped.
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, 2);
    // Open and the reads that touch every object's header: the tables' summaries, sampling and
    // steps (HDF5 decodes an object header when it first opens the object).
    if (auto r = traces::TraceReader::Open(path); r.ok()) {
      (void)(*r)->ReadSampling();
      (void)(*r)->ReadSteps();
      int64_t width = 0;
      (void)(*r)->ReadStepBatch(&width);
      for (const auto& t : (*r)->tensors()) {
        (void)(*r)->ReadSummary(t);
        if (t.has_values) (void)(*r)->ReadValues(t, 0, std::min<int64_t>(t.rows, 1));
      }
    }
    _exit(0);
  }
  if (pid > 0) {
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    if (WIFSIGNALED(st) || (WIFEXITED(st) && WEXITSTATUS(st) != 0)) {
      return Status::Corruption(path + ": damaged beyond what the HDF5 library can read (it crashed reading the " +
                                "file's structure" + (WIFSIGNALED(st) ? ", signal " + std::to_string(WTERMSIG(st)) : "") +
                                "), so not a readable trace");
    }
  }
  return traces::TraceReader::Open(path);
}

int Report(const Status& s) {
  if (s.ok()) return 0;
  std::cerr << "lockstep: " << s.message() << "\n";
  return s.code() == Status::Code::kInvalidArgument ? 2 : 1;
}

}  // namespace lockstep::cli
