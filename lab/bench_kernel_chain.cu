// lab/bench_kernel_chain.cu — what one kernel boundary costs inside a CUDA graph, and what a
// flag between two kernels costs instead: the fact behind batch-1 decode's latency (a step is
// ~460 kernels in a chain; docs/performance.md "GPU decode").
//
// A graph of --kernels launches, each of --ctas CTAs of 128 threads; kernel i's CTA c adds 1 to
// every value of its slice of a buffer kernel i-1 wrote (so each kernel depends on the one
// before), and the host checks every value equals the chain's length. Modes:
//
//   serial  plain launches: kernel i starts after kernel i-1 has completed
//   pdl     programmatic dependent launch, as kernels/cuda/launch.cuh does it: kernel i is
//           scheduled once every CTA of i-1 has passed its wait, and waits in
//           griddepcontrol.wait for i-1's completion and memory flush
//   flag    programmatic dependent launch without griddepcontrol.wait: each CTA of i-1 adds 1
//           to a counter after its stores (fence + atomic, the pattern of a grid barrier), and
//           kernel i's CTAs spin (one thread, acquire loads) until the counter reaches i-1's
//           CTA count; counters are zeroed by a memset node at the graph's start
//   flag-early  flag, with each CTA letting the next kernel be scheduled as its first
//           statement (before its own spin), so several kernels of the chain may be resident
//   persistent  one launch of the same CTAs doing every kernel's work in turn, a grid barrier
//           (fence, atomic arrive on one counter, acquire spin) between two (the CTA count must
//           fit on the device at once: it is skipped when it does not)
//
// Prints µs per kernel for each mode and CTA count, and the flag's saving against pdl.
//
//   bench_kernel_chain [--kernels N] [--reps N] [--ctas 16,132,1056] [--values-per-cta N]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/cuda_bench.h"

namespace {

constexpr int kThreads = 128;

enum class Mode { kSerial, kPdl, kFlag, kFlagEarly };
const char* ModeName(Mode m) {
  return m == Mode::kSerial ? "serial" : m == Mode::kPdl ? "pdl" : m == Mode::kFlag ? "flag" : "flag-early";
}


template <Mode kMode>
__global__ void __launch_bounds__(kThreads)
    Step(const float* in, float* out, int per_cta, const unsigned* wait_on, unsigned wait_for, unsigned* post) {
  if constexpr (kMode == Mode::kPdl) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  } else if constexpr (kMode == Mode::kFlag || kMode == Mode::kFlagEarly) {
    if constexpr (kMode == Mode::kFlagEarly) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (wait_on != nullptr && threadIdx.x == 0) {
      while (LoadAcquire(wait_on) < wait_for) {
      }
    }
    __syncthreads();
    if constexpr (kMode == Mode::kFlag) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
  const size_t base = static_cast<size_t>(blockIdx.x) * per_cta;
  for (int i = threadIdx.x; i < per_cta; i += kThreads) out[base + i] = in[base + i] + 1.0f;
  if constexpr (kMode == Mode::kFlag || kMode == Mode::kFlagEarly) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(post, 1u);
    }
  }
}

// Every kernel of the chain in one grid: `phases` rounds of Step's work, a grid barrier between.
__global__ void __launch_bounds__(kThreads)
    Persistent(float* a, float* b, int per_cta, int phases, unsigned* arrived) {
  const size_t base = static_cast<size_t>(blockIdx.x) * per_cta;
  for (int k = 0; k < phases; ++k) {
    const float* in = k % 2 == 0 ? a : b;
    float* out = k % 2 == 0 ? b : a;
    // A CTA's slice moves to the next CTA each phase, so phase k reads what another CTA wrote.
    const size_t from = (base + static_cast<size_t>(per_cta)) % (static_cast<size_t>(gridDim.x) * per_cta);
    for (int i = threadIdx.x; i < per_cta; i += kThreads) out[base + i] = in[from + i] + 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(arrived, 1u);
      const unsigned target = static_cast<unsigned>(k + 1) * gridDim.x;
      while (LoadAcquire(arrived) < target) {
      }
    }
    __syncthreads();
  }
}

template <Mode kMode>
void Launch(int ctas, cudaStream_t s, const float* in, float* out, int per_cta, const unsigned* wait_on,
            unsigned wait_for, unsigned* post) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kThreads);
  config.stream = s;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = kMode == Mode::kSerial ? 0 : 1;
  CHECK_CUDA(cudaLaunchKernelEx(&config, Step<kMode>, in, out, per_cta, wait_on, wait_for, post));
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    const long x = std::strtol(p, &end, 10);
    if (end == p || x <= 0) {
      std::fprintf(stderr, "bench_kernel_chain: --ctas: '%s' is not a list of positive counts\n", s);
      std::exit(2);
    }
    v.push_back(static_cast<int>(x));
    p = *end == ',' ? end + 1 : end;
  }
  return v;
}

// Two value buffers of `ctas` slices, a stream, and the check that every value of the chain's
// last output equals its length (each of `kernels` links added 1 to it).
struct Chain {
  size_t n = 0;
  float *a = nullptr, *b = nullptr;
  cudaStream_t s = nullptr;
  Chain(int ctas, int per_cta) : n(static_cast<size_t>(ctas) * per_cta) {
    CHECK_CUDA(cudaMalloc(&a, n * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&b, n * sizeof(float)));
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  ~Chain() {
    cudaStreamDestroy(s);
    cudaFree(a);
    cudaFree(b);
  }
  void Check(int kernels, const char* mode, int ctas) const {
    std::vector<float> host(n);
    CHECK_CUDA(cudaMemcpy(host.data(), kernels % 2 == 0 ? a : b, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) {
      if (host[i] != static_cast<float>(kernels)) {
        std::fprintf(stderr, "bench_kernel_chain: %s, %d CTAs: value %zu is %g, not %d — the chain broke\n", mode,
                     ctas, i, host[i], kernels);
        std::exit(1);
      }
    }
  }
};

// µs per kernel of one mode; checks the chain's values.
template <Mode kMode>
double Run(int kernels, int ctas, int per_cta, int reps) {
  Chain c(ctas, per_cta);
  unsigned* counters = nullptr;
  CHECK_CUDA(cudaMalloc(&counters, kernels * sizeof(unsigned)));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal));
  CHECK_CUDA(cudaMemsetAsync(c.a, 0, c.n * sizeof(float), c.s));
  CHECK_CUDA(cudaMemsetAsync(counters, 0, kernels * sizeof(unsigned), c.s));
  for (int k = 0; k < kernels; ++k) {
    const float* in = k % 2 == 0 ? c.a : c.b;
    float* out = k % 2 == 0 ? c.b : c.a;
    Launch<kMode>(ctas, c.s, in, out, per_cta, k == 0 ? nullptr : counters + k - 1, static_cast<unsigned>(ctas),
                  counters + k);
  }
  CHECK_CUDA(cudaStreamEndCapture(c.s, &graph));
  const double ms = GraphReplayMs(c.s, graph, reps);
  c.Check(kernels, ModeName(kMode), ctas);
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaFree(counters));
  return 1000.0 * ms / kernels;
}

// µs per phase of the persistent form, or a negative value when the CTAs do not fit at once.
double RunPersistent(int kernels, int ctas, int per_cta, int reps) {
  int per_sm = 0, sms = 0;
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Persistent, kThreads, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (ctas > per_sm * sms) return -1.0;
  Chain c(ctas, per_cta);
  unsigned* arrived = nullptr;
  CHECK_CUDA(cudaMalloc(&arrived, sizeof(unsigned)));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal));
  CHECK_CUDA(cudaMemsetAsync(c.a, 0, c.n * sizeof(float), c.s));
  CHECK_CUDA(cudaMemsetAsync(arrived, 0, sizeof(unsigned), c.s));
  Persistent<<<ctas, kThreads, 0, c.s>>>(c.a, c.b, per_cta, kernels, arrived);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaStreamEndCapture(c.s, &graph));
  const double ms = GraphReplayMs(c.s, graph, reps);
  c.Check(kernels, "persistent", ctas);
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaFree(arrived));
  return 1000.0 * ms / kernels;
}

}  // namespace

int main(int argc, char** argv) {
  int kernels = 400, reps = 20, per_cta = 1024;
  std::vector<int> ctas = {16, 132, 528, 1056};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_kernel_chain: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--kernels") kernels = std::atoi(value());
    else if (arg == "--reps") reps = std::atoi(value());
    else if (arg == "--values-per-cta") per_cta = std::atoi(value());
    else if (arg == "--ctas") ctas = ParseList(value());
    else if (arg == "--help" || arg == "-h") {
      std::printf("bench_kernel_chain [--kernels N] [--reps N] [--ctas 16,132,1056] [--values-per-cta N]\n"
                  "µs per kernel of a graph of dependent kernels: plain launches, programmatic\n"
                  "dependent launch with griddepcontrol.wait, and a counter flag instead of the wait.\n");
      return 0;
    } else {
      std::fprintf(stderr, "bench_kernel_chain: unknown flag %s (see --help)\n", arg.c_str());
      return 2;
    }
  }
  if (kernels < 2 || reps < 1 || per_cta < 1) {
    std::fprintf(stderr, "bench_kernel_chain: --kernels ≥ 2, --reps ≥ 1, --values-per-cta ≥ 1\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; %d kernels a graph, %d replays, %d values a CTA\n", prop.name, prop.multiProcessorCount,
              kernels, reps, per_cta);
  std::printf("%8s %11s %11s %11s %11s %14s %14s\n", "CTAs", "serial µs", "pdl µs", "flag µs", "early µs",
              "persistent µs", "flag − pdl µs");
  for (int c : ctas) {
    const double serial = Run<Mode::kSerial>(kernels, c, per_cta, reps);
    const double pdl = Run<Mode::kPdl>(kernels, c, per_cta, reps);
    const double flag = Run<Mode::kFlag>(kernels, c, per_cta, reps);
    const double early = Run<Mode::kFlagEarly>(kernels, c, per_cta, reps);
    const double persistent = RunPersistent(kernels, c, per_cta, reps);
    char p[32] = "(not resident)";
    if (persistent >= 0) std::snprintf(p, sizeof p, "%.2f", persistent);
    std::printf("%8d %11.2f %11.2f %11.2f %11.2f %14s %14.2f\n", c, serial, pdl, flag, early, p, flag - pdl);
  }
  return 0;
}
