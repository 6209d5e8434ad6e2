// kernels/shm_collective.h — the collective of ranks that are processes of one machine meeting in
// shared memory (a POSIX shm object): the CPU reference's ranks launched one process each
// (`--tp-launch processes`), and GPU ranks that share a GPU (NCCL refuses two ranks on one
// device). Over one GPU each, the processes use NCCL's (kernels/cuda/nccl_api.h) instead.
//
// Same contract as LocalCollectives (kernels/collective.h): AllGather copies, so every rank sums
// the gathered partials itself in the plan's order. A call is a few barriers on futexes in the
// shared page; gathers larger than a rank's slot go in slot-sized chunks, so no size is refused.
//
// Lifetime: rank 0 creates the group, hands its name to ranks 1 … N − 1 (an environment
// variable), and the name is unlinked once every rank has met in a first call (or rank 0's object
// is destroyed), so a crash leaves nothing in /dev/shm past that. A rank that dies without
// calling Abort leaves the others waiting: the launcher (cli/rank_launch.h) watches its
// processes and aborts the group for it.
//
// Thread-safety: one thread per rank's object; Abort from any thread or process.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"
#include "kernels/collective.h"

namespace lockstep::kernels {

struct ShmGroup {
  std::string name;                  // "/lockstep-tp-…", what JoinShmGroup takes
  std::shared_ptr<Collective> rank0;
};

// A new group of `ranks` (1 … 64) processes; each rank's slot holds `slot_floats` values (a
// larger gather goes in chunks). The caller is rank 0.
Result<ShmGroup> CreateShmGroup(int ranks, int64_t slot_floats = int64_t{1} << 20);

// Joins group `name` as `rank` of `ranks` (both must match the group's header).
Result<std::shared_ptr<Collective>> JoinShmGroup(const std::string& name, int rank, int ranks);

}  // namespace lockstep::kernels
