// bench/bench_nccl.cc — the collective of tensor parallelism over real GPUs, checked and timed:
// one process per GPU, NCCL's all-gather of each rank's partial output [rows, hidden] (a copy),
// then every rank's own sum in the plan's order (the AllReduce kernel over the gathered,
// rank-major buffer). Each rank checks, bit for bit, that the gathered partials are every rank's
// and that its sums are engine::AllReduce's over the emulation's layout — the bits emulated TP
// gives on one device — for each order; then times the pair (what one of a layer's two
// all-reduces costs a decode step) against the same-size device copy. docs/parallelism.md.
//
//   bench_nccl [--ranks N (default: the visible GPUs)] [--rows 1,64] [--hidden 7168] [--iters 200]
//              [--layers 61] [--json]
//
// Exit 0 when every rank's bits matched; 1 when any did not (or a rank failed); 77 when NCCL or
// the GPUs it needs are not here (CTest gpu_nccl skips then). Keep NCCL_NVLS_ENABLE=0.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "engine/tensor_parallel.h"
#include "kernels/cuda/nccl_api.h"
#include "kernels/cuda/ops.h"

namespace cu = lockstep::kernels::cuda;
using lockstep::Status;

namespace {

constexpr const char* kMe = "bench_nccl";

// Rank q's partial, element (r, i): a deterministic value of wide range (so orders round apart).
float PartialAt(int q, int64_t r, int64_t i) {
  const double t = std::sin(0.37 * static_cast<double>(q * 7919 + r * 131 + i) + q);
  return static_cast<float>(t * std::pow(10.0, static_cast<double>((i + 3 * q) % 6)));
}

#define RANK_CHECK(expr)                                                                  \
  do {                                                                                    \
    const Status _s = (expr);                                                             \
    if (!_s.ok()) {                                                                       \
      std::fprintf(stderr, "%s: rank %d: %s: %s\n", kMe, rank, #expr, _s.message().c_str()); \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

int RunRank(int rank, int ranks, const std::string& id, const std::vector<int64_t>& row_list, int64_t H, int64_t iters,
            int64_t layers, bool json) {
  if (cudaSetDevice(rank) != cudaSuccess) {
    std::fprintf(stderr, "%s: rank %d: cudaSetDevice(%d) failed\n", kMe, rank, rank);
    return 1;
  }
  auto comm = cu::NcclComm::Join(id, rank, ranks);
  if (!comm.ok()) {
    std::fprintf(stderr, "%s: rank %d: %s\n", kMe, rank, comm.status().message().c_str());
    return 1;
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  int bad = 0;
  for (const int64_t R : row_list) {
    const int64_t n = R * H;
    std::vector<float> mine(n), all(static_cast<size_t>(ranks) * n), emu(static_cast<size_t>(ranks) * n);
    for (int q = 0; q < ranks; ++q) {
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t i = 0; i < H; ++i) {
          const float v = PartialAt(q, r, i);
          all[q * n + r * H + i] = v;             // the gather's rank-major layout
          emu[(r * ranks + q) * H + i] = v;       // the emulation's [rows][ranks][H]
          if (q == rank) mine[r * H + i] = v;
        }
      }
    }
    auto send = cu::DeviceBuffer::Allocate(n * 4), recv = cu::DeviceBuffer::Allocate(ranks * n * 4),
         y = cu::DeviceBuffer::Allocate(n * 4), copy = cu::DeviceBuffer::Allocate(ranks * n * 4);
    if (!send.ok() || !recv.ok() || !y.ok() || !copy.ok()) {
      std::fprintf(stderr, "%s: rank %d: device allocation failed\n", kMe, rank);
      return 1;
    }
    RANK_CHECK(send->CopyFromHost(mine.data(), n * 4));
    auto reduce = [&](lockstep::kernels::AllReduce v) {
      cu::AllReduceParams ap;
      ap.partials = recv->as<const float>();
      ap.rank_stride = n;
      ap.row_stride = H;
      ap.y = y->as<float>();
      ap.y_stride = H;
      ap.rows = R;
      ap.n = H;
      ap.ranks = ranks;
      ap.order = static_cast<cu::ReduceOrder>(v);
      return cu::AllReduce(ap, stream);
    };
    // Bits: the gathered partials are every rank's; each order's sums are the emulation's.
    RANK_CHECK((*comm)->AllGather(send->as<const float>(), n, recv->as<float>(), stream));
    RANK_CHECK(cu::SynchronizeStream(stream));
    std::vector<float> got(static_cast<size_t>(ranks) * n);
    RANK_CHECK(recv->CopyToHost(got.data(), got.size() * 4));
    if (std::memcmp(got.data(), all.data(), got.size() * 4) != 0) {
      std::fprintf(stderr, "%s: rank %d: rows %lld: the gathered partials are not every rank's\n", kMe, rank,
                   static_cast<long long>(R));
      ++bad;
    }
    for (auto v : {lockstep::kernels::AllReduce::kOrdered, lockstep::kernels::AllReduce::kRing}) {
      RANK_CHECK(reduce(v));
      std::vector<float> sum(n), want(n);
      RANK_CHECK(cu::SynchronizeStream(stream));
      RANK_CHECK(y->CopyToHost(sum.data(), n * 4));
      lockstep::engine::AllReduce(v, emu.data(), ranks, R, H, want.data());
      if (std::memcmp(sum.data(), want.data(), n * 4) != 0) {
        std::fprintf(stderr, "%s: rank %d: rows %lld, order %d: the sums are not the emulation's bits\n", kMe, rank,
                     static_cast<long long>(R), static_cast<int>(v));
        ++bad;
      }
    }
    // Time: the all-gather and the ordered sum, back to back as a layer runs them; the copy of
    // the gathered bytes on one device as the yardstick.
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int64_t w = 0; w < 10; ++w) {
      RANK_CHECK((*comm)->AllGather(send->as<const float>(), n, recv->as<float>(), stream));
      RANK_CHECK(reduce(lockstep::kernels::AllReduce::kOrdered));
    }
    cudaEventRecord(a, stream);
    for (int64_t it = 0; it < iters; ++it) {
      RANK_CHECK((*comm)->AllGather(send->as<const float>(), n, recv->as<float>(), stream));
      RANK_CHECK(reduce(lockstep::kernels::AllReduce::kOrdered));
    }
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0, copy_ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    cudaEventRecord(a, stream);
    for (int64_t it = 0; it < iters; ++it) {
      cudaMemcpyAsync(copy->data(), recv->as<float>(), ranks * n * 4, cudaMemcpyDeviceToDevice, stream);
    }
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&copy_ms, a, b);
    const double us = 1e3 * ms / static_cast<double>(iters), copy_us = 1e3 * copy_ms / static_cast<double>(iters);
    if (rank == 0) {
      if (json) {
        std::printf("{\"ranks\": %d, \"rows\": %lld, \"hidden\": %lld, \"allgather_sum_us\": %.2f, "
                    "\"copy_us\": %.2f, \"per_step_ms\": %.3f, \"layers\": %lld, \"bits_ok\": %s}\n",
                    ranks, static_cast<long long>(R), static_cast<long long>(H), us, copy_us,
                    2e-3 * us * static_cast<double>(layers), static_cast<long long>(layers), bad ? "false" : "true");
      } else {
        std::printf("ranks %d, rows %lld x %lld: all-gather + ordered sum %.2f us (one device's copy of the gathered "
                    "bytes: %.2f us); a decode step's %lld layers x 2: %.3f ms; bits %s\n",
                    ranks, static_cast<long long>(R), static_cast<long long>(H), us, copy_us,
                    static_cast<long long>(layers), 2e-3 * us * static_cast<double>(layers),
                    bad ? "DIFFER" : "the emulation's");
      }
      std::fflush(stdout);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  cudaStreamDestroy(stream);
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t ranks = 0, H = 7168, iters = 200, layers = 61, rank = -1;
  std::string rows = "1,64", id;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf(
          "bench_nccl: tensor parallelism's collective over real GPUs (one process each): NCCL's all-gather of\n"
          "each rank's partial output, then each rank's own sum in rank order — checked bit for bit against\n"
          "the emulation's sums (engine::AllReduce), then timed against a device copy (docs/parallelism.md).\n\n"
          "  --ranks N      ranks, one GPU each (default: every visible GPU)\n"
          "  --rows R[,R]   rows of a step's partials (default 1,64: decode at batch 1 and 64)\n"
          "  --hidden H     hidden size (default 7168: DeepSeek-V3)\n"
          "  --iters N      timed repetitions (default 200)\n"
          "  --layers L     layers a step runs (two all-reduces each) for the per-step figure (default 61)\n"
          "  --json         one JSON line per row count\n"
          "Exit: 0 bits matched, 1 they did not (or a rank failed), 77 no NCCL or too few GPUs.\n");
      return 0;
    }
    if (k == "--json") {
      json = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s: %s needs a value\n", kMe, k.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    bool ok = true;
    if (k == "--ranks") ok = lockstep::bench::ParseInt(kMe, k, v, 1, 64, &ranks);
    else if (k == "--rows") rows = v;
    else if (k == "--hidden") ok = lockstep::bench::ParseInt(kMe, k, v, 1, 1 << 20, &H);
    else if (k == "--iters") ok = lockstep::bench::ParseInt(kMe, k, v, 1, 1 << 20, &iters);
    else if (k == "--layers") ok = lockstep::bench::ParseInt(kMe, k, v, 1, 1 << 12, &layers);
    else if (k == "--rank") ok = lockstep::bench::ParseInt(kMe, k, v, 0, 63, &rank);  // (the launcher's)
    else if (k == "--id") id = v;
    else {
      std::fprintf(stderr, "%s: unknown flag %s (--help lists them)\n", kMe, k.c_str());
      return 2;
    }
    if (!ok) return 2;
  }
  std::vector<int64_t> row_list;
  {
    std::stringstream ss(rows);
    for (std::string item; std::getline(ss, item, ',');) {
      int64_t r = 0;
      if (!lockstep::bench::ParseInt(kMe, "--rows", item, 1, 4096, &r)) return 2;
      row_list.push_back(r);
    }
  }
  if (rank >= 0) return RunRank(static_cast<int>(rank), static_cast<int>(ranks), id, row_list, H, iters, layers, json);

  // The launcher: no CUDA context here (the ranks fork from a process without one).
  if (const Status s = cu::NcclAvailable(); !s.ok()) {
    std::printf("SKIP: %s\n", s.message().c_str());
    return 77;
  }
  int devices = 0;
  {
    // Counted in a child, so that this process forks the ranks without a CUDA context.
    int fd[2];
    if (pipe(fd) != 0) return 1;
    const pid_t pid = fork();
    if (pid == 0) {
      const int n = cu::DeviceCount();
      (void)!write(fd[1], &n, sizeof n);
      _exit(0);
    }
    close(fd[1]);
    if (read(fd[0], &devices, sizeof devices) != sizeof devices) devices = 0;
    close(fd[0]);
    waitpid(pid, nullptr, 0);
  }
  if (ranks == 0) ranks = devices;
  if (devices == 0) {
    std::printf("SKIP: no GPU visible\n");
    return 77;
  }
  if (ranks > devices) {
    std::printf("SKIP: %lld ranks need %lld GPUs; %d visible\n", static_cast<long long>(ranks),
                static_cast<long long>(ranks), devices);
    return 77;
  }
  auto made = cu::NcclComm::NewId();
  if (!made.ok()) {
    std::fprintf(stderr, "%s: %s\n", kMe, made.status().message().c_str());
    return 1;
  }
  if (const char* nvls = std::getenv("NCCL_NVLS_ENABLE"); nvls == nullptr || std::string(nvls) != "0") {
    setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off in every run
  }
  std::printf("%s, %lld ranks\n", cu::NcclComm::Version().c_str(), static_cast<long long>(ranks));
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int64_t r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string rs = std::to_string(r), ns = std::to_string(ranks), hs = std::to_string(H),
                        is = std::to_string(iters), ls = std::to_string(layers);
      std::vector<const char*> args = {argv[0], "--rank", rs.c_str(), "--ranks", ns.c_str(), "--id", made->c_str(),
                                       "--rows", rows.c_str(), "--hidden", hs.c_str(), "--iters", is.c_str(),
                                       "--layers", ls.c_str()};
      if (json) args.push_back("--json");
      args.push_back(nullptr);
      execv("/proc/self/exe", const_cast<char* const*>(args.data()));
      _exit(127);
    }
    pids.push_back(pid);
  }
  int worst = 0;
  for (const pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    worst = std::max(worst, code);
  }
  if (worst == 0) std::printf("PASS: every rank's sums are the emulation's bits\n");
  return worst == 0 ? 0 : 1;
}
