// tests/gpu/gpu_nccl_collective_test.cc — NcclCollective (kernels/cuda/nccl_api.h) on the real
// NCCL library with what one GPU allows: a communicator of one rank made the way the launcher
// makes a group (engine::NewNcclGroupId, JoinNcclGroup). Its all-gather copies bit for bit on a
// stream, inside a captured CUDA graph replayed with new inputs (the engine's graphs hold it),
// and from host memory; Abort fails every later gather with the reason given. Two ranks need
// two GPUs (NCCL refuses two ranks on one device): tests/gpu/tp_processes_gpu.sh runs them.
// Skips without a CUDA device or without NCCL.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "engine/cuda_backend.h"
#include "kernels/cuda/nccl_api.h"
#include "kernels/cuda/runtime.h"
#include "tests/gpu/gpu_test_util.h"

namespace lockstep {
namespace {

namespace cu = kernels::cuda;

std::shared_ptr<kernels::Collective> GroupOfOne() {
  auto id = engine::NewNcclGroupId();
  EXPECT_TRUE(id.ok()) << id.status().message();
  if (!id.ok()) return nullptr;
  EXPECT_EQ(id->size(), 256u) << "NCCL_UNIQUE_ID_BYTES (128) as hex";
  auto g = engine::JoinNcclGroup(*id, 0, 1);
  EXPECT_TRUE(g.ok()) << g.status().message();
  return g.ok() ? *g : nullptr;
}

std::vector<float> Values(size_t n, double seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(std::sin(seed + 0.37 * static_cast<double>(i)) * 1e3);
  return v;
}

#define LS_REQUIRE_NCCL()                                                   \
  do {                                                                      \
    LS_REQUIRE_GPU();                                                       \
    const Status _n = cu::NcclAvailable();                                  \
    if (!_n.ok()) GTEST_SKIP() << "NCCL not here: " << _n.message();        \
  } while (0)

TEST(GpuNcclCollective, GathersOnAStreamAndInsideAGraph) {
  LS_REQUIRE_NCCL();
  auto g = GroupOfOne();
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->size(), 1);
  EXPECT_EQ(g->rank(), 0);
  EXPECT_TRUE(g->device_native());
  const size_t n = 4099;
  auto stream = cu::CudaStream::Create();
  LS_ASSERT_OK(stream.status());
  const cu::Stream s = (*stream)->get();
  std::vector<float> a = Values(n, 0.5);
  auto send = gpu_testing::Upload(a);
  auto recv = gpu_testing::Zeros<float>(n);
  LS_ASSERT_OK(g->AllGatherDevice(send.as<const float>(), static_cast<int64_t>(n), recv.as<float>(), s));
  LS_ASSERT_OK((*stream)->Synchronize());
  EXPECT_TRUE(gpu_testing::BitwiseEqual(gpu_testing::Download<float>(recv, n), a, "stream gather"));

  // Captured once, replayed with the send buffer rewritten: the graph's gather reads it anew.
  LS_ASSERT_OK(cu::CudaGraph::BeginCapture(s));
  const Status enq = g->AllGatherDevice(send.as<const float>(), static_cast<int64_t>(n), recv.as<float>(), s);
  auto graph = cu::CudaGraph::EndCapture(s);
  LS_ASSERT_OK(enq);
  LS_ASSERT_OK(graph.status());
  for (double seed : {1.5, 2.5}) {
    const std::vector<float> b = Values(n, seed);
    LS_ASSERT_OK(send.CopyFromHost(b.data(), n * sizeof(float)));
    LS_ASSERT_OK(recv.Fill(0));
    LS_ASSERT_OK((*graph)->Launch(s));
    LS_ASSERT_OK((*stream)->Synchronize());
    EXPECT_TRUE(gpu_testing::BitwiseEqual(gpu_testing::Download<float>(recv, n), b, "graph replay"));
  }
}

TEST(GpuNcclCollective, HostGatherAndAbort) {
  LS_REQUIRE_NCCL();
  auto g = GroupOfOne();
  ASSERT_NE(g, nullptr);
  for (size_t n : {size_t{1}, size_t{777}, size_t{1} << 18}) {
    const std::vector<float> a = Values(n, static_cast<double>(n));
    std::vector<float> got(n, -1.0f);
    LS_ASSERT_OK(g->AllGather(a.data(), static_cast<int64_t>(n), got.data()));
    EXPECT_TRUE(gpu_testing::BitwiseEqual(got, a, "host gather of " + std::to_string(n)));
  }
  float x = 1, y = 0;
  LS_ASSERT_OK(g->AllGather(&x, 0, &y));  // nothing to gather is fine
  EXPECT_FALSE(g->AllGather(&x, -1, &y).ok());
  g->Abort(Status::Internal("rank 1 (pid 42) was killed by signal Killed"));
  const Status after = g->AllGather(&x, 1, &y);
  EXPECT_FALSE(after.ok());
  EXPECT_NE(after.message().find("rank 1 (pid 42) was killed"), std::string::npos) << after.message();
  auto dev = gpu_testing::Zeros<float>(2);
  const Status dev_after = g->AllGatherDevice(dev.as<const float>(), 1, dev.as<float>() + 1, nullptr);
  EXPECT_FALSE(dev_after.ok());
}

TEST(GpuNcclCollective, BadIdsAreRefusedByName) {
  LS_REQUIRE_NCCL();
  for (const char* id : {"", "zz", "abc"}) {
    auto g = engine::JoinNcclGroup(id, 0, 1);
    EXPECT_FALSE(g.ok()) << "id '" << id << "' accepted";
  }
  auto id = engine::NewNcclGroupId();
  LS_ASSERT_OK(id.status());
  EXPECT_FALSE(engine::JoinNcclGroup(*id, 1, 1).ok()) << "rank 1 of a group of one";
  EXPECT_FALSE(engine::JoinNcclGroup(*id, 0, 0).ok()) << "a group of no ranks";
}

}  // namespace
}  // namespace lockstep
