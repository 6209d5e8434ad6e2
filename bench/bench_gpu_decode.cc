// bench/bench_gpu_decode.cc — GPU decode speed of the CUDA backend against the HBM roofline
// measured in the same run (issue 6).
//
// A model of a published shape (models/shapes/<name>/config.json) with random bf16 weights
// made on the GPU (--random-weights). Decode at batch B over prompts of L tokens: time per
// step after the prefill, tokens/s, and the bytes a step must read at least — every active
// weight once (the experts some request in the batch routed to, estimated as all experts
// a batch of B×k draws would touch: E·(1 − (1 − k/E)^B) per MoE layer), plus each request's
// latent cache — over the step time, against a device-to-device copy (read + write bytes).
//
//   bench_gpu_decode [--model DIR] [--batch 1,64] [--prompt-len 512] [--tokens 64]
//                    [--kv-cache bf16] [--gemm bf16] [--kernel OP=V] [--emulate-tp N] [--profile]
//                    [--no-cuda-graphs] [--json]
//                    [--no-side-stream] [--no-overlapped-launch] [--temperature T] [--top-p P]
//                    [--host-sampler] [--keep-logits] [--timeline FILE.csv] [--help]
//                    [--profiler-steps N]  (cudaProfilerStart/Stop around N decode steps after the
//                    warm-up, for `ncu --profile-from-start off`)
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "kernels/registry.h"
#include "bench/bench_args.h"
#ifdef LOCKSTEP_HAVE_CUPTI
#include "bench/gpu_timeline.h"
#endif

using namespace lockstep;
namespace cu = kernels::cuda;

namespace {

// Device copy bandwidth in GB/s (read + write), the roofline of this run.
double CopyBandwidthGBs() {
  auto bw = cu::MeasureCopyBandwidth(5);
  return bw.ok() ? *bw / 1e9 : 0;
}

// Bytes one decode step must read at least (weights at wbytes each, the cache at its format).
struct StepBytes {
  double weights = 0, cache = 0;
};
StepBytes MinimumBytes(const engine::ModelConfig& c, int64_t batch, int64_t context, double cache_bytes_per_token,
                       double wbytes) {
  const double H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
               dv = c.v_head_dim, C = c.kv_lora_rank;
  double per_layer_attn = (c.q_lora_rank > 0 ? c.q_lora_rank * H + nh * (dn + dr) * c.q_lora_rank : nh * (dn + dr) * H) +
                          (C + dr) * H + nh * (dn + dv) * C + H * nh * dv;
  if (c.has_indexer()) {
    per_layer_attn += c.index_n_heads * c.index_head_dim * c.q_lora_rank + c.index_head_dim * H + c.index_n_heads * H;
  }
  StepBytes b;
  double params = c.vocab_size * H;  // lm_head
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    params += per_layer_attn;
    if (c.layers[l].ffn == engine::FfnKind::kDense) {
      params += 3 * H * c.intermediate_size;
    } else {
      const double E = c.n_routed_experts, k = c.num_experts_per_tok;
      const double touched = E * (1 - std::pow(1 - k / E, static_cast<double>(batch)));
      params += touched * 3 * H * c.moe_intermediate_size + 3 * H * c.moe_intermediate_size * c.n_shared_experts;
      b.weights += E * H * 4;  // router, fp32
    }
  }
  b.weights += params * wbytes;
  b.cache = static_cast<double>(batch) * context * c.num_hidden_layers * cache_bytes_per_token;
  return b;
}

}  // namespace

// A failed diagnostic step ends the benchmark with its message.
void Check(const Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "bench_gpu_decode: %s\n", s.message().c_str());
    std::exit(1);
  }
}

int main(int argc, char** argv) {
  constexpr const char* kMe = "bench_gpu_decode";  // (in its flag errors)
  kernels::KernelChoice overrides;  // --kernel OP=V
  std::string model_dir = "models/shapes/deepseek-v2-lite", kv = "bf16", gemm = "bf16", batches = "1,64";
  int64_t prompt_len = 512, tokens = 64, profiler_steps = 0, emulate_tp = 1;
  std::string timeline;
  bool json_out = false, profile = false, graphs = true, side = true, overlap = true, device_sampler = true;
  bool keep_logits = false;
  double temperature = 0.0, top_p = 1.0;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf(
          "bench_gpu_decode: decode tokens/s of the CUDA backend on a published model shape with random bf16\n"
          "weights, against the device copy bandwidth measured in the same run (docs/performance.md).\n\n"
          "  --model DIR            models/shapes/<name> (default models/shapes/deepseek-v2-lite)\n"
          "  --batch B[,B...]       batch sizes, one engine each (default 1,64)\n"
          "  --prompt-len N         prompt tokens per request (default 512)\n"
          "  --tokens N             decode steps timed (default 64)\n"
          "  --kv-cache F           fp32 | bf16 | fp8_e4m3 (default bf16)\n"
          "  --gemm V               fp32 | bf16 | bf16_dot | fp8_dot | w8a8_dot (default bf16: cuBLAS; fp8_dot: FP8\n"
          "                         weights with 128x128 block scales, random e4m3 bytes)\n"
          "  --kernel OP=V          another kernel variant (repeatable; `lockstep kernels` lists them), e.g.\n"
          "                         indexer=fp8_paged\n"
          "  --emulate-tp N         tensor parallelism over N ranks emulated on the GPU (default 1: none;\n"
          "                         docs/parallelism.md): what the ranks' products and the all-reduce cost\n"
          "  --profile              GPU time per phase of a step, on stderr\n"
          "  --no-cuda-graphs       launch kernel by kernel\n"
          "  --no-side-stream       one stream for the whole step\n"
          "  --no-overlapped-launch each kernel starts only after the previous one finished\n"
          "  --temperature T        sample at T (default 0: greedy)\n"
          "  --top-p P              nucleus sampling (default 1: off)\n"
          "  --host-sampler         sample on the host instead of the GPU\n"
          "  --keep-logits          copy each step's logits rows to the host although the device sampled them\n"
          "                         (Request::keep_logits: what logprobs, entropies and logits hashes need)\n"
          "  --profiler-steps N     cudaProfilerStart/Stop around N steps (ncu --profile-from-start off)\n"
          "  --timeline FILE.csv    every kernel's GPU start and end over the profiled steps (CUPTI; 4 steps\n"
          "                         unless --profiler-steps says), and a digest: each kernel's share of the\n"
          "                         critical path (how far it moved the step's latest end), busy time, GPU idle\n"
          "  --json                 the report as JSON on stdout\n");
      return 0;
    }
    if (k == "--json" || k == "--profile" || k == "--no-cuda-graphs" || k == "--no-side-stream" ||
        k == "--no-overlapped-launch" || k == "--host-sampler" || k == "--keep-logits") {
      device_sampler &= k != "--host-sampler";
      keep_logits |= k == "--keep-logits";
      json_out |= k == "--json";
      profile |= k == "--profile";
      graphs &= k != "--no-cuda-graphs";
      side &= k != "--no-side-stream";
      overlap &= k != "--no-overlapped-launch";
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_gpu_decode: %s needs a value\n", k.c_str());
      return 2;
    }
    std::string v = argv[++i];
    bool ok = true;
    if (k == "--model") model_dir = v;
    else if (k == "--batch") batches = v;
    else if (k == "--prompt-len") ok = bench::ParseInt(kMe, k, v, 1, int64_t{1} << 24, &prompt_len);
    else if (k == "--tokens") ok = bench::ParseInt(kMe, k, v, 2, int64_t{1} << 24, &tokens);
    else if (k == "--kv-cache") kv = v;
    else if (k == "--gemm") gemm = v;
    else if (k == "--kernel") {
      const Status st = kernels::ParseKernelOverride(v, &overrides);
      if (!st.ok()) {
        std::fprintf(stderr, "bench_gpu_decode: %s\n", st.message().c_str());
        return 2;
      }
    }
    else if (k == "--emulate-tp") ok = bench::ParseInt(kMe, k, v, 1, 64, &emulate_tp);
    else if (k == "--profiler-steps") ok = bench::ParseInt(kMe, k, v, 0, int64_t{1} << 24, &profiler_steps);
    else if (k == "--timeline") timeline = v;
    else if (k == "--temperature") ok = bench::ParseNumber(kMe, k, v, 0.0, 100.0, &temperature);
    else if (k == "--top-p") ok = bench::ParseNumber(kMe, k, v, 1e-6, 1.0, &top_p);
    else {
      std::fprintf(stderr, "bench_gpu_decode: unknown flag %s (--help lists them)\n", k.c_str());
      return 2;
    }
    if (!ok) return 2;
  }
  // The batch list and the cache format, checked before the model is made.
  std::vector<int64_t> batch_list;
  {
    std::stringstream bs(batches);
    for (std::string item; std::getline(bs, item, ',');) {
      int64_t b = 0;
      if (!bench::ParseInt(kMe, "--batch", item, 1, 4096, &b)) return 2;
      batch_list.push_back(b);
    }
    if (batch_list.empty()) {
      std::fprintf(stderr, "bench_gpu_decode: --batch: expected B[,B...], got '%s'\n", batches.c_str());
      return 2;
    }
    const auto format = engine::ParseKvFormat(kv);
    if (!format.ok()) {
      std::fprintf(stderr, "bench_gpu_decode: %s\n", format.status().message().c_str());
      return 2;
    }
  }
#ifndef LOCKSTEP_HAVE_CUPTI
  if (!timeline.empty()) {
    std::fprintf(stderr, "bench_gpu_decode: --timeline: this build has no CUPTI\n");
    return 2;
  }
#endif
  if (!timeline.empty() && profiler_steps == 0) profiler_steps = 4;
  if (cu::DeviceCount() == 0) {
    std::fprintf(stderr, "bench_gpu_decode: %s\n", cu::DeviceDescription().c_str());
    return 1;
  }
  const double copy = CopyBandwidthGBs();
  auto model = engine::Model::RandomWeights(model_dir, 0);
  if (!model.ok()) {
    std::fprintf(stderr, "bench_gpu_decode: %s\n", model.status().message().c_str());
    return 1;
  }
  const engine::ModelConfig& c = (*model)->config();
  nlohmann::json report = {{"device", cu::DeviceDescription()}, {"model", model_dir}, {"kv_cache", kv},
                           {"gemm", gemm}, {"emulate_tp", emulate_tp}, {"kernels", overrides}, {"prompt_len", prompt_len}, {"tokens", tokens},
                           {"copy_GBps", copy}, {"cuda_graphs", graphs}, {"side_stream", side},
                           {"overlapped_launch", overlap}, {"device_sampler", device_sampler},
                           {"keep_logits", keep_logits},
                           {"temperature", temperature}, {"top_p", top_p}, {"runs", nlohmann::json::array()}};
  std::printf("device: %s\ncopy bandwidth (device→device, read+write): %.0f GB/s\n", cu::DeviceDescription().c_str(),
              copy);
  std::unique_ptr<engine::Engine> eng;
  for (const int64_t batch : batch_list) {
    engine::EngineOptions o;
    o.backend = "cuda";
    o.max_batch = batch;
    o.kv_format = *engine::ParseKvFormat(kv);
    o.kernels = overrides;
    o.kernels["gemm"] = gemm;
    o.emulate_tp = emulate_tp;
    o.device.cuda_graphs = graphs;
    o.device.side_stream = side;
    o.device.overlapped_launch = overlap;
    o.device.device_sampler = device_sampler;
    o.device.profile = profile;  // per-phase GPU time on stderr when the engine ends
    o.kv_cache_tokens = batch * (prompt_len + tokens + 64);
    eng.reset();  // free the previous engine's device memory first
    auto t_load = std::chrono::steady_clock::now();
    auto e = engine::Engine::Create(*model, o);
    if (!e.ok()) {
      std::fprintf(stderr, "bench_gpu_decode: %s\n", e.status().message().c_str());
      return 1;
    }
    eng = std::move(*e);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
    std::mt19937 rng(1);
    for (int64_t b = 0; b < batch; ++b) {
      engine::Request r;
      for (int64_t i = 0; i < prompt_len; ++i) r.prompt.push_back(static_cast<int32_t>(rng() % c.vocab_size));
      r.max_new_tokens = tokens + 1;
      r.sampling.temperature = temperature;
      r.sampling.top_p = top_p;
      r.sampling.seed = static_cast<uint64_t>(b) + 1;
      r.keep_logits = keep_logits;
      if (!eng->AddRequest(r).ok()) return 1;
    }
    auto t0 = std::chrono::steady_clock::now();
    auto st = eng->Step();  // the prefill
    if (!st.ok()) {
      std::fprintf(stderr, "bench_gpu_decode: %s\n", st.status().message().c_str());
      return 1;
    }
    auto t1 = std::chrono::steady_clock::now();
    int64_t steps = 0;
    // Two warm-up decode steps (first-use allocations, cuBLAS algorithm choice), then timed.
    for (int w = 0; w < 2; ++w) {
      auto warm = eng->Step();
      if (!warm.ok()) {
        std::fprintf(stderr, "bench_gpu_decode: %s\n", warm.status().message().c_str());
        return 1;
      }
    }
    auto t2 = std::chrono::steady_clock::now();
    while (true) {
      if (profiler_steps > 0 && steps == 0) {
        cu::ProfilerStart();
#ifdef LOCKSTEP_HAVE_CUPTI
        if (!timeline.empty()) Check(bench::GpuTimeline::Start());
#endif
      }
      if (profiler_steps > 0 && steps == profiler_steps) {
        cu::ProfilerStop();
#ifdef LOCKSTEP_HAVE_CUPTI
        if (!timeline.empty()) {
          auto spans = bench::GpuTimeline::Stop();
          Check(spans.status());
          std::string digest;
          const std::string path = batches.find(',') == std::string::npos
                                       ? timeline
                                       : timeline + ".batch" + std::to_string(batch) + ".csv";
          Check(bench::WriteTimeline(*spans, path, profiler_steps, &digest));
          std::printf("batch %lld %s(spans in %s)\n", static_cast<long long>(batch), digest.c_str(), path.c_str());
        }
#endif
      }
      auto more = eng->Step();
      if (!more.ok()) {
        std::fprintf(stderr, "bench_gpu_decode: %s\n", more.status().message().c_str());
        return 1;
      }
      if (!*more) break;
      ++steps;
    }
    auto t3 = std::chrono::steady_clock::now();
    const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
    const double step_s = std::chrono::duration<double>(t3 - t2).count() / std::max<int64_t>(steps, 1);
    const double bpt = static_cast<double>(eng->cache().latent_bytes_per_token());
    // FP8 weights: a byte each plus a row's fp32 scale per 128 of them.
    const bool fp8_weights = gemm == "fp8_dot" || gemm == "w8a8_dot";
    const double wbytes = fp8_weights ? 1.0 + 4.0 / 128 : gemm.rfind("bf16", 0) == 0 ? 2 : 4;
    const StepBytes need = MinimumBytes(c, batch, prompt_len + tokens / 2, bpt, wbytes);
    const double gbps = (need.weights + need.cache) / step_s / 1e9;
    std::printf(
        "batch %3lld: engine+weights %.1f s, prefill %lld×%lld tokens %.3f s (%.0f tok/s); decode %.3f ms/step, "
        "%.1f tok/s; ≥ %.2f GB read per step (weights %.2f, cache %.3f) → %.0f GB/s = %.1f%% of copy\n",
        static_cast<long long>(batch), load_s, static_cast<long long>(batch), static_cast<long long>(prompt_len),
        prefill_s, batch * prompt_len / prefill_s, step_s * 1e3, batch / step_s, (need.weights + need.cache) / 1e9,
        need.weights / 1e9, need.cache / 1e9, gbps, 100 * gbps / copy);
    report["runs"].push_back({{"batch", batch}, {"prefill_s", prefill_s}, {"decode_ms_per_step", step_s * 1e3},
                              {"tokens_per_s", batch / step_s}, {"min_bytes_per_step", need.weights + need.cache},
                              {"achieved_GBps", gbps}, {"fraction_of_copy", gbps / copy}});
  }
  if (json_out) std::printf("%s\n", report.dump(2).c_str());
  return 0;
}
