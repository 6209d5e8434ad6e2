// bench/bench_gpu_sampler.cc — the device sampler (kernels/cuda/sampler.cu) per call, against
// the host sampler it reproduces (engine::Sampler::Sample, one core) on the same rows.
//
//   bench_gpu_sampler [--vocab 102400] [--reps 20] [--help]
//
// Rows of `vocab` logits, two shapes: "flat" (N(0, 1): a random-weights model's logits, where
// nearly every weight moves the running sum) and "peaked" (N(0, 3) with the top logit 15
// above the rest, closer to a trained model's). Per shape, batch 1 and 64, greedy and
// T 0.8 top-p 0.95: µs per Sample call (CUDA events, median of 5 timings of `reps` calls),
// the running sums' part alone (SequentialPrefixSums over one row's sorted weights), the host
// sampler's µs for the same rows, and `settled`: how many running sums the row's weights
// move before adding one changes nothing (the prefix's length).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "bench/cuda_bench.h"
#include "engine/sampler.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

namespace cu = lockstep::kernels::cuda;
using lockstep::engine::Sampler;
using lockstep::engine::SamplingParams;

namespace {

double Median5(const std::vector<double>& v) {
  std::vector<double> s = v;
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t vocab = 102400, reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf(
          "bench_gpu_sampler: the device sampler's µs per call against the host sampler on the same rows\n\n"
          "  --vocab N   logits per row (default 102400, DeepSeek-V2's vocabulary)\n"
          "  --reps N    calls per timing (default 20; the median of 5 timings is reported)\n");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_gpu_sampler: %s needs a value (or unknown flag; --help lists them)\n", k.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    if (k == "--vocab") {
      if (!lockstep::bench::ParseInt("bench_gpu_sampler", k, v, 2, 1 << 24, &vocab)) return 2;
    } else if (k == "--reps") {
      if (!lockstep::bench::ParseInt("bench_gpu_sampler", k, v, 1, 100000, &reps)) return 2;
    } else {
      std::fprintf(stderr, "bench_gpu_sampler: unknown flag %s (--help lists them)\n", k.c_str());
      return 2;
    }
  }
  if (cu::DeviceCount() == 0) {
    std::fprintf(stderr, "bench_gpu_sampler: no CUDA device (%s)\n", cu::DeviceDescription().c_str());
    return 1;
  }
  std::printf("device: %s\nvocab %lld, %lld calls a timing\n\n", cu::DeviceDescription().c_str(),
              static_cast<long long>(vocab), static_cast<long long>(reps));
  std::printf("| logits | batch | sampling | settled | GPU µs/call | running sums alone µs | host µs (one core) | host / GPU |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  const int64_t max_batch = 64;
  auto dl = cu::DeviceBuffer::Allocate(static_cast<size_t>(max_batch * vocab) * 4);
  auto dr = cu::DeviceBuffer::Allocate(max_batch * sizeof(cu::SampleRequest));
  auto dout = cu::DeviceBuffer::Allocate(max_batch * sizeof(cu::SampleOutput));
  auto ws = cu::DeviceBuffer::Allocate(cu::SamplerWorkspaceBytes(max_batch, vocab));
  auto dw = cu::DeviceBuffer::Allocate(static_cast<size_t>(vocab) * 8);
  auto dpre = cu::DeviceBuffer::Allocate(static_cast<size_t>(vocab) * 8);
  auto dset = cu::DeviceBuffer::Allocate(4);
  CHECK_OK(dl.status());
  CHECK_OK(dr.status());
  CHECK_OK(dout.status());
  CHECK_OK(ws.status());
  CHECK_OK(dw.status());
  CHECK_OK(dpre.status());
  CHECK_OK(dset.status());
  for (const char* shape : {"flat", "peaked"}) {
    const bool peaked = std::string(shape) == "peaked";
    std::mt19937_64 rng(peaked ? 2 : 1);
    std::normal_distribution<float> g(0.0f, peaked ? 3.0f : 1.0f);
    std::vector<float> logits(static_cast<size_t>(max_batch * vocab));
    for (int64_t r = 0; r < max_batch; ++r) {
      float* l = &logits[r * vocab];
      for (int64_t i = 0; i < vocab; ++i) l[i] = g(rng);
      if (peaked) l[rng() % vocab] = *std::max_element(l, l + vocab) + 15.0f;
    }
    CHECK_CUDA(cudaMemcpy(dl->data(), logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
    struct Mode {
      const char* name;
      SamplingParams p;
    };
    for (const Mode& m : {Mode{"greedy", {0.0, 0, 1.0, 0.0, 1}}, Mode{"T 0.8 top-p 0.95", {0.8, 0, 0.95, 0.0, 1}}}) {
      // The running sums' length and their part alone, from row 0's sorted weights ("–" for greedy).
      std::string settled_s = "–", prefix_s = "–";
      if (m.p.temperature > 0) {
        std::vector<float> l0(logits.begin(), logits.begin() + vocab);
        std::sort(l0.begin(), l0.end(), std::greater<float>());
        std::vector<double> w(static_cast<size_t>(vocab));
        for (int64_t i = 0; i < vocab; ++i) w[i] = std::exp((static_cast<double>(l0[i]) - l0[0]) / m.p.temperature);
        double s = 0;
        int64_t settled = 0;
        for (; settled < vocab && s + w[settled] != s; ++settled) s += w[settled];
        settled_s = std::to_string(settled);
        CHECK_CUDA(cudaMemcpy(dw->data(), w.data(), w.size() * 8, cudaMemcpyHostToDevice));
        std::vector<double> t;
        for (int k = 0; k < 5; ++k) {
          t.push_back(1e3 * MsPerCall(
                                [&] {
                                  CHECK_OK(cu::SequentialPrefixSums(dw->as<double>(), vocab, dpre->as<double>(),
                                                                    dset->as<int32_t>()));
                                },
                                static_cast<int>(reps)));
        }
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.1f", Median5(t));
        prefix_s = buf;
      }
      for (int64_t batch : {int64_t{1}, max_batch}) {
        std::vector<cu::SampleRequest> reqs(static_cast<size_t>(batch));
        for (int64_t r = 0; r < batch; ++r) {
          reqs[r] = cu::SampleRequest{m.p.temperature, m.p.top_k, m.p.top_p, m.p.min_p, static_cast<uint64_t>(r + 1), 7};
        }
        CHECK_CUDA(cudaMemcpy(dr->data(), reqs.data(), reqs.size() * sizeof(cu::SampleRequest), cudaMemcpyHostToDevice));
        cu::SamplerParams sp;
        sp.batch = batch;
        sp.vocab = vocab;
        sp.logits = dl->as<float>();
        sp.logits_stride = vocab;
        sp.requests = dr->as<cu::SampleRequest>();
        sp.out = dout->as<cu::SampleOutput>();
        sp.workspace = ws->data();
        sp.workspace_bytes = ws->size();
        sp.all_greedy = m.p.temperature <= 0;
        std::vector<double> t;
        for (int k = 0; k < 5; ++k) {
          t.push_back(1e3 * MsPerCall([&] { CHECK_OK(cu::Sample(sp)); }, static_cast<int>(reps)));
        }
        const double gpu_us = Median5(t);
        // The host sampler over the same rows (its time per batch), and the tokens checked.
        std::vector<cu::SampleOutput> got(static_cast<size_t>(batch));
        CHECK_CUDA(cudaMemcpy(got.data(), dout->data(), got.size() * sizeof(cu::SampleOutput), cudaMemcpyDeviceToHost));
        const int host_reps = batch == 1 ? 5 : 1;
        const auto h0 = std::chrono::steady_clock::now();
        int64_t mismatches = 0;
        for (int k = 0; k < host_reps; ++k) {
          for (int64_t r = 0; r < batch; ++r) {
            SamplingParams p = m.p;
            p.seed = static_cast<uint64_t>(r + 1);
            const auto res = Sampler::Sample(std::span<const float>(&logits[r * vocab], static_cast<size_t>(vocab)), p, 7);
            mismatches += res.token != got[r].token;
          }
        }
        const double host_us =
            1e6 * std::chrono::duration<double>(std::chrono::steady_clock::now() - h0).count() / host_reps;
        std::printf("| %s | %lld | %s | %s | %.1f | %s | %.0f | %.0f× |%s\n", shape, static_cast<long long>(batch),
                    m.name, settled_s.c_str(), gpu_us, prefix_s.c_str(), host_us, host_us / gpu_us,
                    mismatches ? " TOKENS DIFFER" : "");
      }
    }
  }
  return 0;
}
