// tests/shm_collective_test.cc — kernels/shm_collective.h, the collective of ranks that are
// processes: forked ranks receive every rank's buffer, rank-major, call after call, in gathers
// larger than a slot (chunked) and of zero values; a call with another size fails on every rank;
// an abort from outside wakes a waiting rank with its reason; a damaged or foreign name, a wrong
// rank count, a rank joining twice are refused; the name is gone once the group has met.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/shm_collective.h"

namespace lockstep::kernels {
namespace {

// Runs `body(rank)` in ranks 1 … n − 1 as forked processes (exit status: its return value) and
// in this process as rank 0; the ranks' results, [0] this one's.
template <typename F>
std::vector<int> RunRanks(int n, F body) {
  std::vector<pid_t> pids;
  for (int r = 1; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(body(r));
    pids.push_back(pid);
  }
  std::vector<int> out{body(0)};
  for (pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    out.push_back(WIFEXITED(st) ? WEXITSTATUS(st) : 100 + WTERMSIG(st));
  }
  return out;
}

int Gathers(Collective& c, int n, int calls) {
  int bad = 0;
  for (int call = 0; call < calls; ++call) {
    const int64_t len = (call * 7) % 23;  // 0 … 22 values, the slot holds 5: up to 5 chunks
    std::vector<float> send(len), recv(n * len + 1, -1.0f);
    for (int64_t i = 0; i < len; ++i) send[i] = static_cast<float>(1000 * call + 100 * c.rank() + i);
    if (!c.AllGather(send.data(), len, recv.data()).ok()) return 99;
    for (int q = 0; q < n; ++q) {
      for (int64_t i = 0; i < len; ++i) bad += recv[q * len + i] != static_cast<float>(1000 * call + 100 * q + i);
    }
    bad += recv[n * len] != -1.0f;  // nothing past the gather
  }
  return bad > 0 ? 1 : 0;
}

TEST(ShmCollective, EveryRankGetsEveryBufferCallAfterCallInChunks) {
  for (int n : {1, 2, 3, 8}) {
    auto g = CreateShmGroup(n, /*slot_floats=*/5);
    ASSERT_TRUE(g.ok()) << g.status().message();
    const std::string name = g->name;
    const std::vector<int> got = RunRanks(n, [&](int r) {
      if (r == 0) return Gathers(*g->rank0, n, 200);
      auto mine = JoinShmGroup(name, r, n);
      if (!mine.ok()) return 98;
      if ((*mine)->rank() != r || (*mine)->size() != n) return 97;
      return Gathers(**mine, n, 200);
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(got[r], 0) << n << " ranks, rank " << r;
    // Met: the name is unlinked, so nobody else joins, and nothing stays in /dev/shm.
    if (n > 1) EXPECT_FALSE(JoinShmGroup(name, 1, n).ok());
  }
}

TEST(ShmCollective, DifferentSizesFailOnEveryRank) {
  auto g = CreateShmGroup(2);
  ASSERT_TRUE(g.ok());
  const std::vector<int> got = RunRanks(2, [&](int r) {
    std::shared_ptr<Collective> c = g->rank0;
    if (r == 1) {
      auto j = JoinShmGroup(g->name, 1, 2);
      if (!j.ok()) return 98;
      c = *j;
    }
    std::vector<float> send(r == 0 ? 4 : 9, 1.0f), recv(2 * 9);
    const Status s = c->AllGather(send.data(), static_cast<int64_t>(send.size()), recv.data());
    if (s.ok() || s.message().find("steps differ") == std::string::npos) return 1;
    return c->AllGather(send.data(), 1, recv.data()).ok() ? 2 : 0;  // and the group stays failed
  });
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(got[1], 0);
}

TEST(ShmCollective, AbortWakesAWaitingRankWithItsReason) {
  auto g = CreateShmGroup(3);
  ASSERT_TRUE(g.ok());
  const std::string name = g->name;
  std::vector<pid_t> pids;
  for (int r = 1; r < 3; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      auto c = JoinShmGroup(name, r, 3);
      if (!c.ok()) _exit(98);
      float x = 1, y[3];
      const Status s = (*c)->AllGather(&x, 1, y);  // rank 0 never comes
      _exit(!s.ok() && s.message() == "rank 7 (pid 1) was killed by signal 9" ? 0 : 1);
    }
    pids.push_back(pid);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // both asleep on the futex
  g->rank0->Abort(Status::Internal("rank 7 (pid 1) was killed by signal 9"));
  for (pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "status " << st;
  }
  float x = 1, y[3];
  EXPECT_FALSE(g->rank0->AllGather(&x, 1, y).ok());
}

TEST(ShmCollective, JoinRefusesWhatIsNotItsGroup) {
  auto g = CreateShmGroup(2);
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(JoinShmGroup("/etc/passwd", 1, 2).ok());
  EXPECT_FALSE(JoinShmGroup("/lockstep-tp-../x", 1, 2).ok());
  EXPECT_FALSE(JoinShmGroup("/lockstep-tp-0-nosuchgroup", 1, 2).ok());
  EXPECT_FALSE(JoinShmGroup(g->name, 1, 3).ok());  // its header says 2 ranks
  EXPECT_FALSE(JoinShmGroup(g->name, 0, 2).ok());  // rank 0 creates
  EXPECT_FALSE(JoinShmGroup(g->name, 2, 2).ok());
  auto once = JoinShmGroup(g->name, 1, 2);
  ASSERT_TRUE(once.ok()) << once.status().message();
  const auto twice = JoinShmGroup(g->name, 1, 2);
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("joined twice"), std::string::npos) << twice.status().message();
  // A group object whose size fields were damaged: refused, not mapped past its end.
  auto h = CreateShmGroup(2, 16);
  ASSERT_TRUE(h.ok());
  const int fd = shm_open(h->name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 64), 0);  // shorter than a header
  close(fd);
  const auto damaged = JoinShmGroup(h->name, 1, 2);
  ASSERT_FALSE(damaged.ok());
  EXPECT_NE(damaged.status().message().find(h->name), std::string::npos) << damaged.status().message();
  EXPECT_FALSE(CreateShmGroup(0).ok());
  EXPECT_FALSE(CreateShmGroup(65).ok());
}

}  // namespace
}  // namespace lockstep::kernels
