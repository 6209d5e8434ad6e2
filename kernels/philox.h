// kernels/philox.h — Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC'11), the counter-based generator of the sampler. Header-only and free of
// library calls so the CUDA sampler compiles the very same code (LS_HD marks it).
//
// A draw is a pure function of (key, counter): the sampler keys it with the request's seed
// and counts with the decode step, so step n of a request can be replayed without running
// steps 0..n-1, and no batch neighbour can disturb it (docs/sampling.md).
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace lockstep::kernels {

struct Philox4x32 {
  uint32_t v[4];
};

LS_HD inline void PhiloxMulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Ten rounds of Philox4x32 on counter `c` with key (k0, k1).
LS_HD inline Philox4x32 Philox4x32_10(Philox4x32 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments (golden ratio, √3−1)
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    PhiloxMulHiLo(kM0, c.v[0], &hi0, &lo0);
    PhiloxMulHiLo(kM1, c.v[2], &hi1, &lo1);
    c = Philox4x32{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// The sampler's uniform for (seed, step): counter = (step lo, step hi, stream, 0), key = seed.
// 53 random bits → a double in [0, 1).
LS_HD inline double PhiloxUniform(uint64_t seed, uint64_t step, uint32_t stream) {
  Philox4x32 c{{static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), stream, 0u}};
  Philox4x32 r = Philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = (static_cast<uint64_t>(r.v[0]) << 21) | (static_cast<uint64_t>(r.v[1]) >> 11);
  return static_cast<double>(bits & ((uint64_t{1} << 53) - 1)) * (1.0 / 9007199254740992.0);
}

}  // namespace lockstep::kernels
