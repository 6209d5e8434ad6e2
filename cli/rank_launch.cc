// cli/rank_launch.cc — see rank_launch.h.
#include "cli/rank_launch.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "engine/cuda_backend.h"
#include "engine/rank_group.h"

extern char** environ;

namespace lockstep::cli {
namespace {

constexpr const char* kRankVar = "LOCKSTEP_TP_RANK";
constexpr const char* kRanksVar = "LOCKSTEP_TP_RANKS";
constexpr const char* kGroupVar = "LOCKSTEP_TP_GROUP";

Result<std::vector<std::string>> OwnCommandLine() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.eof() && !in.good()) return Status::IoError("/proc/self/cmdline: cannot read this command's arguments");
  std::vector<std::string> argv;
  for (size_t start = 0; start < all.size();) {
    const size_t end = all.find('\0', start);
    argv.push_back(all.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (argv.empty()) return Status::IoError("/proc/self/cmdline: empty");
  return argv;
}

// The last non-empty line of a rank's log (what it said before it stopped).
std::string LastLine(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  const std::streamoff from = std::max<std::streamoff>(0, size - 8192);
  in.seekg(from);
  std::string tail((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == '\r' || tail.back() == ' ')) tail.pop_back();
  const size_t nl = tail.find_last_of('\n');
  std::string line = nl == std::string::npos ? tail : tail.substr(nl + 1);
  if (line.rfind("\r", 0) == 0) line.erase(0, 1);
  const size_t cr = line.find_last_of('\r');  // a progress line's last redraw
  return cr == std::string::npos ? line : line.substr(cr + 1);
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// Whether this process's parent is this program (a rank 0), not a shell that has the variables.
bool StartedByLockstep() {
  char self[4096] = {0}, parent[4096] = {0};
  const std::string pexe = "/proc/" + std::to_string(getppid()) + "/exe";
  const ssize_t a = readlink("/proc/self/exe", self, sizeof self - 1);
  const ssize_t b = readlink(pexe.c_str(), parent, sizeof parent - 1);
  return a > 0 && a == b && std::memcmp(self, parent, static_cast<size_t>(a)) == 0;
}

bool CleanExit(int status) { return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0; }

}  // namespace

bool IsLaunchedRank() {
  const char* r = std::getenv(kRankVar);
  return r != nullptr && *r != '\0';
}

int RunLaunchedRank(const std::shared_ptr<engine::Model>& model, engine::EngineOptions options, int ranks,
                    const std::vector<engine::Request>& requests, const engine::FollowerObservers& observers) {
  const char* rank_s = std::getenv(kRankVar);
  const char* ranks_s = std::getenv(kRanksVar);
  const char* token = std::getenv(kGroupVar);
  Status s = [&]() -> Status {
    char* end = nullptr;
    const long rank = std::strtol(rank_s, &end, 10);
    if (*end != '\0' || rank < 1 || rank >= ranks) {
      return Status::InvalidArgument(std::string(kRankVar) + "=" + rank_s + ": not a rank in 1.." +
                                     std::to_string(ranks - 1) + " (--tp-ranks " + std::to_string(ranks) + ")");
    }
    if (ranks_s == nullptr || std::to_string(ranks) != ranks_s || token == nullptr) {
      return Status::InvalidArgument(std::string(kRanksVar) + " / " + kGroupVar + ": missing or not --tp-ranks " +
                                     std::to_string(ranks) + " (a rank is started by its rank 0)");
    }
    auto joined = engine::JoinProcessGroup(token, static_cast<int>(rank), ranks);
    if (!joined.ok() && !StartedByLockstep()) {  // a variable left in a shell: a typed command
      return Status::InvalidArgument(joined.status().message() + " (" + kRankVar + " in the environment makes this "
                                     "command a started rank; unset it to start the ranks)");
    }
    if (!joined.ok()) return joined.status();
    options.tp_ranks = *joined;
    Status run = engine::CheckSameWork(*options.tp_ranks, engine::WorkDigest(options, requests));
    std::unique_ptr<engine::FollowerObserver> observer;
    if (run.ok() && observers) {
      auto made = observers(static_cast<int>(rank));
      if (made.ok()) observer = std::move(*made);
      run = made.status();
    }
    if (run.ok()) run = engine::RunFollower(model, options, requests, observer.get());
    observer.reset();  // (a failed run's shard closes, keeping what it flushed)
    if (!run.ok()) options.tp_ranks->Abort(run.WithContext("rank " + std::to_string(rank) + ": "));
    return run;
  }();
  if (s.ok()) return 0;
  std::fprintf(stderr, "lockstep rank %s: %s\n", rank_s, s.message().c_str());
  return 1;
}

Result<std::unique_ptr<RankProcesses>> RankProcesses::Launch(const engine::EngineOptions& options, int ranks,
                                                             const std::string& transport,
                                                             const std::vector<engine::Request>& requests,
                                                             engine::EngineOptions* rank0) {
  if (ranks < 2 || ranks > 64) return Status::InvalidArgument("--tp-ranks " + std::to_string(ranks) + ": not in 2..64");
  const bool cuda = options.backend == "cuda";
  const int gpus = cuda ? engine::CudaDeviceCount() : 0;
  std::string t = transport;
  if (t == "auto") t = cuda && gpus >= ranks ? "nccl" : "shm";
  if (t == "nccl" && !cuda) {
    return Status::InvalidArgument("--tp-transport nccl: NCCL joins GPUs; the cpu backend's ranks meet in shared "
                                   "memory (--tp-transport shm)");
  }
  if (t == "nccl" && gpus < ranks) {
    return Status::InvalidArgument("--tp-transport nccl: " + std::to_string(ranks) + " ranks need a GPU each, this "
                                   "machine shows " + std::to_string(gpus) + " (NCCL refuses two ranks on one GPU; "
                                   "--tp-transport shm shares one)");
  }
  if (t != "shm" && t != "nccl") return Status::InvalidArgument("--tp-transport " + t + ": not auto, shm or nccl");
  LS_ASSIGN_OR_RETURN(std::vector<std::string> argv, OwnCommandLine());
  LS_ASSIGN_OR_RETURN(engine::PreparedGroup prepared, engine::PrepareProcessGroup(t, ranks));

  std::unique_ptr<RankProcesses> p(new RankProcesses());
  p->transport_ = t;
  p->group_ = prepared.rank0;  // shm: ready; nccl: after the join below
  p->children_.resize(static_cast<size_t>(ranks - 1));

  // The environment of every started rank: ours, without a previous group's variables.
  std::vector<std::string> env_base;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (name == kRankVar || name == kRanksVar || name == kGroupVar || (t == "nccl" && name == "CUDA_VISIBLE_DEVICES")) {
      continue;
    }
    env_base.push_back(kv);
  }
  std::vector<std::string> devices;
  if (t == "nccl") {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    if (visible != nullptr && *visible != '\0') devices = Split(visible, ',');
    if (devices.size() < static_cast<size_t>(gpus)) {
      devices.clear();
      for (int g = 0; g < gpus; ++g) devices.push_back(std::to_string(g));
    }
  }
  const char* tmp = std::getenv("TMPDIR");
  const std::string tmpdir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  const pid_t parent = getpid();
  for (int r = 1; r < ranks; ++r) {
    Child& c = p->children_[r - 1];
    std::string log = tmpdir + "/lockstep-rank" + std::to_string(r) + "-XXXXXX";
    const int log_fd = mkstemp(log.data());
    if (log_fd < 0) {
      return p->Finish(Status::IoError(log + ": cannot create rank " + std::to_string(r) + "'s log: " +
                                       std::strerror(errno)));
    }
    c.log = log;
    std::vector<std::string> env = env_base;
    env.push_back(std::string(kRankVar) + "=" + std::to_string(r));
    env.push_back(std::string(kRanksVar) + "=" + std::to_string(ranks));
    env.push_back(std::string(kGroupVar) + "=" + prepared.token);
    if (t == "nccl") {  // its GPU first, every GPU visible (NCCL's peer paths need them)
      std::string list = devices[r];
      for (size_t g = 0; g < devices.size(); ++g) {
        if (g != static_cast<size_t>(r)) list += "," + devices[g];
      }
      env.push_back("CUDA_VISIBLE_DEVICES=" + list);
    }
    std::vector<char*> cargv, cenv;
    for (std::string& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    for (std::string& e : env) cenv.push_back(e.data());
    cenv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      close(log_fd);
      return p->Finish(Status::IoError("fork (rank " + std::to_string(r) + "): " + std::strerror(errno)));
    }
    if (pid == 0) {  // the child: only async-signal-safe calls until execve
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      const int null_fd = open("/dev/null", O_RDWR);
      if (null_fd >= 0) {
        dup2(null_fd, 0);
        dup2(null_fd, 1);
      }
      dup2(log_fd, 2);
      execve("/proc/self/exe", cargv.data(), cenv.data());
      static const char kMsg[] = "lockstep: execve /proc/self/exe failed\n";
      (void)!write(2, kMsg, sizeof kMsg - 1);
      _exit(127);
    }
    close(log_fd);
    c.pid = pid;
    p->watchers_.emplace_back([p = p.get(), r] {
      int st = 0;
      while (waitpid(p->children_[r - 1].pid, &st, 0) < 0 && errno == EINTR) {
      }
      {
        std::lock_guard<std::mutex> l(p->mu_);
        p->children_[r - 1].status = st;
      }
      if (CleanExit(st) || p->finishing_.load()) return;
      const Status why = p->ChildError(r);
      if (!p->joined_.load()) {  // rank 0 is blocked joining a group this rank will never join
        std::fprintf(stderr, "lockstep: %s\n", why.message().c_str());
        p->KillAll();
        _exit(1);
      }
      p->group_->Abort(why);
    });
  }
  if (!p->group_) {
    auto joined = engine::JoinProcessGroup(prepared.token, 0, ranks);
    if (!joined.ok()) return p->Finish(joined.status());
    p->group_ = *joined;
  }
  p->joined_.store(true);
  Status same = engine::CheckSameWork(*p->group_, engine::WorkDigest(options, requests));
  if (!same.ok()) return p->Finish(same);
  *rank0 = options;
  rank0->tp_ranks = p->group_;
  return p;
}

Status RankProcesses::ChildError(int r) const {
  int st;
  {
    std::lock_guard<std::mutex> l(mu_);
    st = children_[r - 1].status;
  }
  const Child& c = children_[r - 1];
  std::string how = WIFSIGNALED(st) ? std::string("was killed by signal ") + strsignal(WTERMSIG(st))
                                    : "exited with status " + std::to_string(WEXITSTATUS(st));
  const std::string said = LastLine(c.log);
  return Status::Internal("rank " + std::to_string(r) + " (pid " + std::to_string(c.pid) + ") " + how +
                          (said.empty() ? "" : ": " + said) + " (its log: " + c.log + ")");
}

void RankProcesses::KillAll() {
  std::lock_guard<std::mutex> l(mu_);
  for (const Child& c : children_) {
    if (c.pid > 0 && c.status < 0) kill(c.pid, SIGKILL);
  }
}

Status RankProcesses::Finish(const Status& rank0) {
  if (done_) return rank0;
  done_ = true;
  finishing_.store(true);
  if (!rank0.ok()) {
    if (group_) group_->Abort(rank0.WithContext("rank 0: "));
    // The others fail on the aborted group (shared memory) or wait inside NCCL for rank 0: give
    // them a moment to exit on their own, then end them.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (;;) {
      bool all = true;
      {
        std::lock_guard<std::mutex> l(mu_);
        for (const Child& c : children_) all = all && (c.pid < 0 || c.status >= 0);
      }
      if (all || std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    KillAll();
  }
  for (auto& w : watchers_) w.join();
  if (!rank0.ok()) return rank0;
  for (size_t i = 0; i < children_.size(); ++i) {
    if (children_[i].pid > 0 && !CleanExit(children_[i].status)) return ChildError(static_cast<int>(i) + 1);
  }
  for (const Child& c : children_) {
    if (!c.log.empty()) std::remove(c.log.c_str());
  }
  return Status::Ok();
}

RankProcesses::~RankProcesses() { (void)Finish(Status::Internal("rank 0 stopped")); }

}  // namespace lockstep::cli
