// bench/bench_sampler.cc — the host sampler's cost per token at DeepSeek vocabulary sizes,
// against a plain comparison sort of the same candidates (the straightforward implementation
// and the floor it must beat), measured in the same run.
//
//   bench_sampler [--iters N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "engine/sampler.h"

using namespace lockstep;

int main(int argc, char** argv) {
  int iters = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf(
          "bench_sampler: the host sampler's time per token at DeepSeek vocabulary sizes (greedy, top-p,\n"
          "top-k), against a plain comparison sort of the same logits in the same run (docs/performance.md).\n\n"
          "  --iters N   samples timed per figure (default 50)\n");
      return 0;
    }
    int64_t n = 0;
    if (k != "--iters" || i + 1 >= argc) {
      std::fprintf(stderr, "bench_sampler: %s\n",
                   k == "--iters" ? "--iters needs a value" : ("unknown flag " + k + " (see --help)").c_str());
      return 2;
    }
    if (!bench::ParseInt("bench_sampler", k, argv[++i], 1, 1000000, &n)) return 2;
    iters = static_cast<int>(n);
  }
  std::printf("| vocab | sampling | Sampler::Sample µs | comparison sort alone µs | ratio |\n|---|---|---|---|---|\n");
  for (int64_t n : {6144, 102400, 129280}) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::vector<float> l(n);
    for (auto& v : l) v = nd(rng);
    struct Mode {
      const char* name;
      double t, top_p;
      int64_t top_k;
    };
    for (const Mode m : {Mode{"greedy", 0.0, 1.0, 0}, Mode{"T 0.6 top-p 0.95", 0.6, 0.95, 0}, Mode{"T 1 top-k 50", 1.0, 1.0, 50}}) {
      engine::SamplingParams p;
      p.temperature = m.t;
      p.top_p = m.top_p;
      p.top_k = m.top_k;
      p.seed = 3;
      auto t0 = std::chrono::steady_clock::now();
      int64_t sink = 0;
      for (int i = 0; i < iters; ++i) sink += engine::Sampler::Sample(l, p, i).token;
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
      // The peer: the documented order by a comparison sort of ids (what the sampler did before).
      t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) {
        std::vector<int32_t> ids(n);
        std::iota(ids.begin(), ids.end(), 0);
        auto cmp = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
        if (m.top_k > 0) {
          std::partial_sort(ids.begin(), ids.begin() + m.top_k, ids.end(), cmp);
        } else {
          std::sort(ids.begin(), ids.end(), cmp);
        }
        sink += ids[0];
      }
      const double sort_us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
      std::printf("| %lld | %s | %.0f | %.0f | %.2f |\n", static_cast<long long>(n), m.name, us, sort_us, us / sort_us);
      if (sink == -1) std::printf("\n");
    }
  }
  return 0;
}
