// kernels/mla_splits.h — how MLA attention over a request's n keys is cut into splits and
// tiles: the one definition the CUDA kernels (kernels/cuda/mla_decode.cu, mla_combine.cuh) and
// the CPU reference's absorbed attention (cpu::MlaAttend) both follow, so that they add the
// same numbers in the same order. Header-only, free of library calls (LS_HD).
//
// Keys 0 … n−1 (positions, or a top-k list with masked entries) are cut into MlaNumSplits(n)
// splits of MlaSplitKeys(n) keys, ascending; each split walks its keys in tiles of
// kMlaTileKeys with an online softmax; the splits are merged in ascending order. Every split
// but the last holds a whole number of tiles. A function of n alone: batch-invariant.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace lockstep::kernels {

inline constexpr int kMlaTileKeys = 32;      // keys a tile holds (= the warp width)
inline constexpr int kMlaMaxSplits = 64;
inline constexpr int kMlaBaseSplitKeys = 32;  // one tile a split up to 2048 keys: a batch-1 decode still spreads

// Keys per split for a request with n keys.
LS_HD inline int64_t MlaSplitKeysOf(int64_t n) {
  if (n <= int64_t{kMlaBaseSplitKeys} * kMlaMaxSplits) return kMlaBaseSplitKeys;
  const int64_t per = (n + kMlaMaxSplits - 1) / kMlaMaxSplits;
  return (per + kMlaTileKeys - 1) / kMlaTileKeys * kMlaTileKeys;
}
// The splits that makes (0 for no key).
LS_HD inline int64_t MlaNumSplits(int64_t n) {
  return n <= 0 ? 0 : (n + MlaSplitKeysOf(n) - 1) / MlaSplitKeysOf(n);
}

}  // namespace lockstep::kernels
