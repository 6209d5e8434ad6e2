// kernels/shm_collective.cc — see shm_collective.h.
#include "kernels/shm_collective.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <random>
#include <string>

namespace lockstep::kernels {
namespace {

constexpr uint64_t kMagic = 0x314d4853'5054534cULL;  // "LSTPSHM1", little-endian
constexpr uint32_t kVersion = 1;
constexpr int kMaxRanks = 64;
constexpr const char* kPrefix = "/lockstep-tp-";

// The shared page. Every field after the constants is touched only through atomics (lock-free,
// so address-free: valid across the processes' different mappings).
struct Shared {
  uint64_t magic;
  uint32_t version;
  uint32_t ranks;
  int64_t slot_floats;
  uint64_t total_bytes;
  alignas(64) std::atomic<uint32_t> arrived;
  std::atomic<uint32_t> generation;  // the futex every waiter sleeps on
  alignas(64) std::atomic<uint64_t> joined;  // bit r: rank r has joined
  std::atomic<uint32_t> abort_state;         // 0 running, 1 a reason being written, 2 aborted
  char why[1024];
  alignas(64) std::atomic<int64_t> counts[kMaxRanks];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free &&
              std::atomic<uint64_t>::is_always_lock_free);

constexpr size_t kDataOffset = (sizeof(Shared) + 63) / 64 * 64;

uint64_t TotalBytes(int ranks, int64_t slot_floats) {
  return kDataOffset + static_cast<uint64_t>(ranks) * static_cast<uint64_t>(slot_floats) * sizeof(float);
}

void FutexWake(std::atomic<uint32_t>* a) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Sleeps while *a == expected, at most 50 ms (the caller re-checks the abort flag).
void FutexWait(std::atomic<uint32_t>* a, uint32_t expected) {
  timespec t{0, 50 * 1000 * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAIT, expected, &t, nullptr, 0);
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

class ShmCollective final : public Collective {
 public:
  ShmCollective(std::string name, Shared* s, int rank, bool owner)
      : name_(std::move(name)), s_(s), rank_(rank), linked_(owner) {}
  ~ShmCollective() override {
    if (linked_) shm_unlink(name_.c_str());
    munmap(s_, s_->total_bytes);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(s_->ranks); }

  Status AllGather(const float* send, int64_t n, float* recv) override {
    if (n < 0) return Status::InvalidArgument("collective: a gather of " + std::to_string(n) + " values");
    const int ranks = size();
    s_->counts[rank_].store(n, std::memory_order_relaxed);
    LS_RETURN_IF_ERROR(Barrier());  // every rank has posted its size (and has joined)
    if (linked_) {                  // rank 0: nobody opens the name any more
      shm_unlink(name_.c_str());
      linked_ = false;
    }
    for (int q = 0; q < ranks; ++q) {
      const int64_t theirs = s_->counts[q].load(std::memory_order_relaxed);
      if (theirs != n) {
        const Status bad = Status::Internal("collective: rank " + std::to_string(q) + " gathers " +
                                            std::to_string(theirs) + " values, rank " + std::to_string(rank_) + " " +
                                            std::to_string(n) + " (the ranks' steps differ)");
        Abort(bad);
        return bad;
      }
    }
    const int64_t slot = s_->slot_floats;
    float* data = reinterpret_cast<float*>(reinterpret_cast<char*>(s_) + kDataOffset);
    if (n == 0) return Barrier();  // (no rank posts its next size before every rank read this one's)
    for (int64_t off = 0; off < n; off += slot) {
      const int64_t c = std::min(slot, n - off);
      std::memcpy(data + rank_ * slot, send + off, static_cast<size_t>(c) * sizeof(float));
      LS_RETURN_IF_ERROR(Barrier());  // every slot written
      for (int q = 0; q < ranks; ++q) {
        std::memcpy(recv + q * n + off, data + q * slot, static_cast<size_t>(c) * sizeof(float));
      }
      LS_RETURN_IF_ERROR(Barrier());  // every slot read: free for the next chunk or call
    }
    return Status::Ok();
  }

  void Abort(const Status& why) override {
    uint32_t expected = 0;
    if (s_->abort_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
      const std::string m = why.ok() ? std::string("collective aborted") : why.message();
      const size_t len = std::min(m.size(), sizeof(s_->why) - 1);
      std::memcpy(s_->why, m.data(), len);
      s_->why[len] = '\0';
      s_->abort_state.store(2, std::memory_order_release);
    }
    FutexWake(&s_->generation);
  }

 private:
  Status Aborted() const {
    uint32_t st = s_->abort_state.load(std::memory_order_acquire);
    if (st == 0) return Status::Ok();
    while (st == 1) st = s_->abort_state.load(std::memory_order_acquire);  // (a memcpy away)
    return Status::Internal(std::string(s_->why));
  }

  // Waits until every rank has arrived (sense by generation), or the group aborted.
  Status Barrier() {
    LS_RETURN_IF_ERROR(Aborted());
    const uint32_t gen = s_->generation.load(std::memory_order_acquire);
    if (s_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == s_->ranks) {
      s_->arrived.store(0, std::memory_order_relaxed);
      s_->generation.fetch_add(1, std::memory_order_release);
      FutexWake(&s_->generation);
      return Status::Ok();
    }
    for (int spin = 0;; ++spin) {
      if (s_->generation.load(std::memory_order_acquire) != gen) return Status::Ok();
      LS_RETURN_IF_ERROR(Aborted());
      if (spin < 2000) continue;  // a decode step's gathers are microseconds apart
      FutexWait(&s_->generation, gen);
    }
  }

  std::string name_;
  Shared* s_;
  int rank_;
  bool linked_;  // rank 0 until the name is unlinked
};

Result<Shared*> Map(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::IoError(Errno("collective " + name + ": mmap"));
  return static_cast<Shared*>(p);
}

}  // namespace

Result<ShmGroup> CreateShmGroup(int ranks, int64_t slot_floats) {
  if (ranks < 1 || ranks > kMaxRanks) {
    return Status::InvalidArgument("collective: " + std::to_string(ranks) + " ranks, not 1 to 64");
  }
  if (slot_floats < 1 || slot_floats > (int64_t{1} << 28)) {
    return Status::InvalidArgument("collective: a slot of " + std::to_string(slot_floats) + " values");
  }
  std::random_device rd;
  const uint64_t tag = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(tag));
  const std::string name = std::string(kPrefix) + std::to_string(getpid()) + "-" + hex;
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return Status::IoError(Errno("collective: shm_open " + name));
  const uint64_t total = TotalBytes(ranks, slot_floats);
  if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
    const Status s = Status::IoError(Errno("collective " + name + ": ftruncate to " + std::to_string(total) + " bytes"));
    close(fd);
    shm_unlink(name.c_str());
    return s;
  }
  auto mapped = Map(fd, total, name);
  close(fd);
  if (!mapped.ok()) {
    shm_unlink(name.c_str());
    return mapped.status();
  }
  Shared* s = new (*mapped) Shared();
  s->magic = kMagic;
  s->version = kVersion;
  s->ranks = static_cast<uint32_t>(ranks);
  s->slot_floats = slot_floats;
  s->total_bytes = total;
  s->joined.store(1, std::memory_order_release);
  ShmGroup g;
  g.name = name;
  g.rank0 = std::make_shared<ShmCollective>(name, s, 0, /*owner=*/true);
  return g;
}

Result<std::shared_ptr<Collective>> JoinShmGroup(const std::string& name, int rank, int ranks) {
  const std::string where = "collective " + name;
  if (name.rfind(kPrefix, 0) != 0 || name.size() > 200 || name.find('/', 1) != std::string::npos) {
    return Status::InvalidArgument("collective: '" + name + "' is not a lockstep group name (" + kPrefix + "…)");
  }
  if (ranks < 1 || ranks > kMaxRanks || rank < 1 || rank >= ranks) {
    return Status::InvalidArgument(where + ": rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                                   " (ranks 1 to N − 1 join; rank 0 creates)");
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return Status::IoError(Errno(where + ": shm_open"));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < kDataOffset) {
    close(fd);
    return Status::Corruption(where + ": " + std::to_string(st.st_size) + " bytes, not a group's header");
  }
  auto mapped = Map(fd, static_cast<size_t>(st.st_size), name);
  close(fd);
  if (!mapped.ok()) return mapped.status();
  Shared* s = *mapped;
  auto fail = [&](Status why) {
    munmap(s, static_cast<size_t>(st.st_size));
    return why;
  };
  if (s->magic != kMagic || s->version != kVersion) return fail(Status::Corruption(where + ": not a version-1 group"));
  if (s->ranks != static_cast<uint32_t>(ranks)) {
    return fail(Status::InvalidArgument(where + ": the group has " + std::to_string(s->ranks) + " ranks, not " +
                                        std::to_string(ranks)));
  }
  if (s->slot_floats < 1 || s->slot_floats > (int64_t{1} << 28) ||
      s->total_bytes != TotalBytes(ranks, s->slot_floats) || s->total_bytes != static_cast<uint64_t>(st.st_size)) {
    return fail(Status::Corruption(where + ": its size fields disagree with the file's " +
                                   std::to_string(st.st_size) + " bytes"));
  }
  const uint64_t bit = uint64_t{1} << rank;
  if (s->joined.fetch_or(bit, std::memory_order_acq_rel) & bit) {
    return fail(Status::InvalidArgument(where + ": rank " + std::to_string(rank) + " joined twice"));
  }
  return std::shared_ptr<Collective>(std::make_shared<ShmCollective>(name, s, rank, /*owner=*/false));
}

}  // namespace lockstep::kernels
