// kernels/xxh3.h — XXH3-64 (seed 0), the content hash of every trace row (traces/trace_format.h),
// as plain header code that compiles for the host and, marked LS_HD, for CUDA devices: the
// building block for summarising tap rows on the GPU without copying them to the host.
//
// Written from the published XXH3 specification (xxHash 0.8, "XXH3 algorithm overview"); the
// 192-byte default secret is not repeated here — callers pass the library's (a host translation
// unit reads it from <xxhash.h>, the device gets a copy). tests/xxh3_test.cc checks every input
// length from 0 to 2100 bytes and random longer rows against libxxhash's XXH3_64bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/host_device.h"

namespace lockstep::kernels::xxh3 {

inline constexpr uint32_t kP32_1 = 0x9E3779B1U, kP32_2 = 0x85EBCA77U, kP32_3 = 0xC2B2AE3DU;
inline constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ULL, kP64_2 = 0xC2B2AE3D27D4EB4FULL,
                          kP64_3 = 0x165667B19E3779F9ULL, kP64_4 = 0x85EBCA77C2B2AE63ULL,
                          kP64_5 = 0x27D4EB2F165667C5ULL;
inline constexpr uint64_t kMx1 = 0x165667919E3779F9ULL, kMx2 = 0x9FB21C651E98DF25ULL;
inline constexpr size_t kSecretSize = 192;

// Little-endian loads (hosts and NVIDIA GPUs are little-endian); byte-wise so any alignment works.
LS_HD inline uint32_t Read32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}
LS_HD inline uint64_t Read64(const uint8_t* p) {
  return static_cast<uint64_t>(Read32(p)) | static_cast<uint64_t>(Read32(p + 4)) << 32;
}
LS_HD inline uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
LS_HD inline uint32_t Swap32(uint32_t x) {
  return (x << 24) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) | (x >> 24);
}
LS_HD inline uint64_t Swap64(uint64_t x) {
  return static_cast<uint64_t>(Swap32(static_cast<uint32_t>(x))) << 32 | Swap32(static_cast<uint32_t>(x >> 32));
}

// The 128-bit product of a and b, folded: low 64 bits XOR high 64 bits.
LS_HD inline uint64_t MulFold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

LS_HD inline uint64_t Xxh64Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kP64_2;
  h ^= h >> 29;
  h *= kP64_3;
  h ^= h >> 32;
  return h;
}
LS_HD inline uint64_t Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kMx1;
  h ^= h >> 32;
  return h;
}
LS_HD inline uint64_t RrMxMx(uint64_t h, uint64_t len) {
  h ^= Rotl64(h, 49) ^ Rotl64(h, 24);
  h *= kMx2;
  h ^= (h >> 35) + len;
  h *= kMx2;
  h ^= h >> 28;
  return h;
}
LS_HD inline uint64_t Mix16(const uint8_t* in, const uint8_t* secret) {
  return MulFold64(Read64(in) ^ Read64(secret), Read64(in + 8) ^ Read64(secret + 8));
}

// One 64-byte stripe into the 8 accumulators: lane i takes word i's keyed 32×32 product, and its
// neighbour i^1 takes the raw word.
LS_HD inline void Accumulate512(uint64_t acc[8], const uint8_t* in, const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t v = Read64(in + 8 * i);
    const uint64_t k = v ^ Read64(secret + 8 * i);
    acc[i ^ 1] += v;
    acc[i] += static_cast<uint64_t>(static_cast<uint32_t>(k)) * (k >> 32);
  }
}
LS_HD inline void Scramble(uint64_t acc[8], const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= Read64(secret + 8 * i);
    a *= kP32_1;
    acc[i] = a;
  }
}

LS_HD inline uint64_t HashLong(const uint8_t* in, size_t len, const uint8_t* secret) {
  uint64_t acc[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  const size_t stripes_per_block = (kSecretSize - 64) / 8;  // 16
  const size_t block_len = 64 * stripes_per_block;          // 1024 bytes
  const size_t blocks = (len - 1) / block_len;
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t s = 0; s < stripes_per_block; ++s) Accumulate512(acc, in + b * block_len + s * 64, secret + s * 8);
    Scramble(acc, secret + kSecretSize - 64);
  }
  const size_t stripes = ((len - 1) - block_len * blocks) / 64;
  for (size_t s = 0; s < stripes; ++s) Accumulate512(acc, in + blocks * block_len + s * 64, secret + s * 8);
  Accumulate512(acc, in + len - 64, secret + kSecretSize - 64 - 7);  // the last stripe
  uint64_t h = static_cast<uint64_t>(len) * kP64_1;
  const uint8_t* ms = secret + 11;  // merge secret
  for (int i = 0; i < 4; ++i) h += MulFold64(acc[2 * i] ^ Read64(ms + 16 * i), acc[2 * i + 1] ^ Read64(ms + 16 * i + 8));
  return Avalanche(h);
}

// XXH3_64bits(in, len) with the default secret `secret` (kSecretSize bytes) and seed 0.
LS_HD inline uint64_t Hash64(const uint8_t* in, size_t len, const uint8_t* secret) {
  if (len == 0) return Xxh64Avalanche(Read64(secret + 56) ^ Read64(secret + 64));
  if (len <= 3) {
    const uint32_t c = static_cast<uint32_t>(in[0]) << 16 | static_cast<uint32_t>(in[len >> 1]) << 24 |
                       static_cast<uint32_t>(in[len - 1]) | static_cast<uint32_t>(len) << 8;
    const uint64_t flip = static_cast<uint64_t>(Read32(secret) ^ Read32(secret + 4));
    return Xxh64Avalanche(static_cast<uint64_t>(c) ^ flip);
  }
  if (len <= 8) {
    const uint64_t flip = Read64(secret + 8) ^ Read64(secret + 16);
    const uint64_t v = static_cast<uint64_t>(Read32(in + len - 4)) + (static_cast<uint64_t>(Read32(in)) << 32);
    return RrMxMx(v ^ flip, len);
  }
  if (len <= 16) {
    const uint64_t lo = Read64(in) ^ (Read64(secret + 24) ^ Read64(secret + 32));
    const uint64_t hi = Read64(in + len - 8) ^ (Read64(secret + 40) ^ Read64(secret + 48));
    return Avalanche(static_cast<uint64_t>(len) + Swap64(lo) + hi + MulFold64(lo, hi));
  }
  if (len <= 128) {
    uint64_t acc = static_cast<uint64_t>(len) * kP64_1;
    if (len > 32) {
      if (len > 64) {
        if (len > 96) {
          acc += Mix16(in + 48, secret + 96);
          acc += Mix16(in + len - 64, secret + 112);
        }
        acc += Mix16(in + 32, secret + 64);
        acc += Mix16(in + len - 48, secret + 80);
      }
      acc += Mix16(in + 16, secret + 32);
      acc += Mix16(in + len - 32, secret + 48);
    }
    acc += Mix16(in, secret);
    acc += Mix16(in + len - 16, secret + 16);
    return Avalanche(acc);
  }
  if (len <= 240) {
    uint64_t acc = static_cast<uint64_t>(len) * kP64_1;
    const size_t rounds = len / 16;
    for (size_t i = 0; i < 8; ++i) acc += Mix16(in + 16 * i, secret + 16 * i);
    acc = Avalanche(acc);
    for (size_t i = 8; i < rounds; ++i) acc += Mix16(in + 16 * i, secret + 16 * (i - 8) + 3);
    acc += Mix16(in + len - 16, secret + 136 - 17);
    return Avalanche(acc);
  }
  return HashLong(in, len, secret);
}

}  // namespace lockstep::kernels::xxh3
