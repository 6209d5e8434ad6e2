// tests/xxh3_test.cc — kernels/xxh3.h (the header the GPU will hash tap rows with) against
// libxxhash's XXH3_64bits: every length 0..2100 (each code path and every block/stripe
// boundary of the long path) and random rows the size of real taps, byte for byte.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#define XXH_INLINE_ALL  // the default secret (XXH3_kSecret) is private to the header
#include <xxhash.h>

#include "kernels/xxh3.h"

namespace lockstep {
namespace {

TEST(Xxh3, EqualsLibxxhashAtEveryLengthTo2100) {
  std::mt19937_64 rng(42);
  std::vector<uint8_t> buf(2100 + 64);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t len = 0; len <= 2100; ++len) {
    for (size_t off : {size_t{0}, size_t{3}}) {  // unaligned too
      const uint8_t* p = buf.data() + off;
      ASSERT_EQ(kernels::xxh3::Hash64(p, len, XXH3_kSecret), XXH3_64bits(p, len)) << "length " << len << " offset " << off;
    }
  }
}

TEST(Xxh3, EqualsLibxxhashOnTapSizedRows) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t floats : {6u, 64u, 576u, 2048u, 7168u, 102400u, 129280u}) {
    std::vector<float> row(floats);
    for (auto& v : row) v = nd(rng);
    const auto* p = reinterpret_cast<const uint8_t*>(row.data());
    EXPECT_EQ(kernels::xxh3::Hash64(p, floats * 4, XXH3_kSecret), XXH3_64bits(p, floats * 4)) << floats << " floats";
  }
}

}  // namespace
}  // namespace lockstep
