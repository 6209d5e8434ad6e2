// tests/collective_test.cc — kernels/collective.h's LocalCollectives, the ranks-as-threads
// collective of the CPU rank mode: every rank receives every rank's buffer, rank-major, call
// after call (ranks racing ahead never read a buffer another rank has moved on from); a call
// with another size fails on every rank instead of reading past a buffer; an abort wakes the
// ranks waiting for a rank that will not come, with its reason.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "kernels/collective.h"

namespace lockstep::kernels {
namespace {

TEST(LocalCollectives, EveryRankGetsEveryBufferCallAfterCall) {
  for (int n : {1, 2, 3, 8}) {
    auto group = LocalCollectives(n);
    ASSERT_EQ(group.size(), static_cast<size_t>(n));
    std::atomic<int> bad{0};
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        for (int call = 0; call < 300; ++call) {
          const int64_t len = 1 + (call * 7) % 13;  // the same on every rank, changing per call
          std::vector<float> send(len), recv(n * len, -1.0f);
          for (int64_t i = 0; i < len; ++i) send[i] = static_cast<float>(1000 * call + 100 * r + i);
          if (!group[r]->AllGather(send.data(), len, recv.data()).ok()) ++bad;
          for (int q = 0; q < n; ++q) {
            for (int64_t i = 0; i < len; ++i) {
              if (recv[q * len + i] != static_cast<float>(1000 * call + 100 * q + i)) ++bad;
            }
          }
          send.assign(len, -7.0f);  // reused at once: the others have copied it already
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(bad.load(), 0) << n << " ranks";
    EXPECT_EQ(group[0]->rank(), 0);
    EXPECT_EQ(group[n - 1]->rank(), n - 1);
    EXPECT_EQ(group[0]->size(), n);
  }
  EXPECT_TRUE(LocalCollectives(0).empty());
  EXPECT_TRUE(LocalCollectives(65).empty());
}

TEST(LocalCollectives, DifferentSizesFailOnEveryRank) {
  auto group = LocalCollectives(2);
  std::vector<Status> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> send(r == 0 ? 4 : 9, 1.0f), recv(2 * 9);
      got[r] = group[r]->AllGather(send.data(), static_cast<int64_t>(send.size()), recv.data());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(got[r].ok()) << "rank " << r;
    EXPECT_NE(got[r].message().find("steps differ"), std::string::npos) << got[r].message();
  }
}

TEST(LocalCollectives, AnAbortWakesTheWaitingRanksWithItsReason) {
  auto group = LocalCollectives(3);
  std::vector<Status> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {  // rank 2 never calls: it failed
    threads.emplace_back([&, r] {
      float send = 1.0f, recv[3];
      got[r] = group[r]->AllGather(&send, 1, recv);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  group[2]->Abort(Status::Internal("rank 2's step failed"));
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(got[r].ok());
    EXPECT_NE(got[r].message().find("rank 2's step failed"), std::string::npos) << got[r].message();
  }
  float send = 1.0f, recv[3];
  EXPECT_FALSE(group[0]->AllGather(&send, 1, recv).ok()) << "a later call after the abort";
}

}  // namespace
}  // namespace lockstep::kernels
