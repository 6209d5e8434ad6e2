// tests/gpu/gpu_test_util.h — shared helpers of the GPU tests: skipping without a device,
// device round trips, and the comparison rules of docs/conventions (NaN positions must
// match exactly, then a per-element tolerance derived from the arithmetic, reporting the
// worst element; bitwise equality for determinism).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"

namespace lockstep::gpu_testing {

namespace cu = ::lockstep::kernels::cuda;

// Unit roundoff of fp32 (half an ulp at 1): the u in the error bounds of the tests.
inline constexpr double kU32 = 5.9604644775390625e-08;  // 2^-24

// Skips the test (it counts as skipped, not passed) when no CUDA device is present, so CI
// machines without a GPU run the suite green.
#define LS_REQUIRE_GPU()                                                                      \
  do {                                                                                        \
    if (::lockstep::kernels::cuda::DeviceCount() == 0) {                                      \
      GTEST_SKIP() << "no CUDA device (" << ::lockstep::kernels::cuda::DeviceDescription() \
                   << "): GPU test skipped";                                                  \
    }                                                                                         \
  } while (0)

#define LS_ASSERT_OK(expr)                                    \
  do {                                                        \
    const ::lockstep::Status _s = (expr);                     \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s.message();    \
  } while (0)

// A device copy of a host vector (fails the test on error).
template <typename T>
cu::DeviceBuffer Upload(const std::vector<T>& v) {
  auto b = cu::DeviceBuffer::Allocate(std::max<size_t>(1, v.size() * sizeof(T)));
  EXPECT_TRUE(b.ok()) << b.status().message();
  if (!b.ok()) return {};
  const Status s = b->CopyFromHost(v.data(), v.size() * sizeof(T));
  EXPECT_TRUE(s.ok()) << s.message();
  return std::move(b).value();
}

template <typename T>
cu::DeviceBuffer Zeros(size_t n) {
  auto b = cu::DeviceBuffer::Allocate(std::max<size_t>(1, n * sizeof(T)));
  EXPECT_TRUE(b.ok()) << b.status().message();
  if (!b.ok()) return {};
  EXPECT_TRUE(b->Fill(0).ok());
  return std::move(b).value();
}

template <typename T>
std::vector<T> Download(const cu::DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  const Status s = b.CopyToHost(v.data(), n * sizeof(T));
  EXPECT_TRUE(s.ok()) << s.message();
  return v;
}

// got vs want: NaN exactly where want has NaN, infinities equal, else |got − want| ≤ tol(i).
// On success prints the worst |error| / tolerance, the figure the report quotes.
inline ::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<float>& want,
                                           const std::function<double(size_t)>& tol, const std::string& what,
                                           const std::function<std::string(size_t)>& where = nullptr) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs " << want.size();
  }
  auto name = [&](size_t i) {
    if (where) return where(i);
    std::string s = std::to_string(i);  // not "[" + to_string(i): GCC 12's -Wrestrict false positive
    s.insert(s.begin(), '[');
    return s + "]";
  };
  double worst = 0;
  size_t worst_i = 0, bad = 0, first_bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = got[i], w = want[i];
    if (std::isnan(g) != std::isnan(w)) {
      return ::testing::AssertionFailure() << what << ": NaN positions differ at " << name(i) << ": got " << g
                                           << ", want " << w;
    }
    if (std::isnan(w)) continue;
    if (std::isinf(w) || std::isinf(g)) {
      if (g != w) return ::testing::AssertionFailure() << what << ": at " << name(i) << " got " << g << ", want " << w;
      continue;
    }
    const double err = std::fabs(static_cast<double>(g) - static_cast<double>(w));
    const double t = tol(i);
    const double ratio = t > 0 ? err / t : (err > 0 ? INFINITY : 0.0);
    if (ratio > worst) {
      worst = ratio;
      worst_i = i;
    }
    if (err > t) {
      if (bad++ == 0) first_bad = i;
    }
  }
  if (bad > 0) {
    std::ostringstream os;
    os.precision(9);
    os << what << ": " << bad << " of " << got.size() << " elements outside tolerance; first at " << name(first_bad)
       << " got " << got[first_bad] << " want " << want[first_bad] << " tol " << tol(first_bad) << "; worst at "
       << name(worst_i) << " (" << worst << "× tolerance)";
    return ::testing::AssertionFailure() << os.str();
  }
  std::printf("  [%s] %zu elements, worst error %.3g of tolerance at %s\n", what.c_str(), got.size(), worst,
              name(worst_i).c_str());
  return ::testing::AssertionSuccess();
}

template <typename T>
::testing::AssertionResult BitwiseEqual(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << what << ": first differing element " << i << " (" << a[i] << " vs "
                                           << b[i] << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// CPU vs GPU bitwise: the same bits, except that NaNs need only agree in position (x86
// propagates a NaN operand's payload, the GPU returns its canonical NaN).
inline ::testing::AssertionResult SameBitsOrBothNan(const std::vector<float>& got, const std::vector<float>& want,
                                                    const std::string& what) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << what << ": sizes " << got.size() << " vs " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << what << ": first differing element " << i << " (got " << got[i]
                                           << ", want " << want[i] << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace lockstep::gpu_testing
