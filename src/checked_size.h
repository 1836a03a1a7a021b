// Size arithmetic on counts that come from the caller's configuration. Every product or sum
// that sizes memory goes through checked_size, so a configuration whose sizes do not fit 64
// bits fails with a message naming it instead of wrapping to a small allocation.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "error.h"

namespace minikv {

// The product of `factors`; fails with MINIKV_ERR_INVALID_ARGUMENT "<call>: <what> (a x b x
// ...) does not fit 64 bits" when it overflows.
inline uint64_t checked_size(const char *call, const char *what,
                             std::initializer_list<uint64_t> factors) {
  uint64_t product = 1;
  for (uint64_t f : factors) {
    if (__builtin_mul_overflow(product, f, &product)) {
      fail(MINIKV_ERR_INVALID_ARGUMENT, "%s: %s does not fit 64 bits", call, what);
    }
  }
  return product;
}

// a + b, failing like checked_size.
inline uint64_t checked_sum(const char *call, const char *what, uint64_t a, uint64_t b) {
  uint64_t sum;
  if (__builtin_add_overflow(a, b, &sum)) {
    fail(MINIKV_ERR_INVALID_ARGUMENT, "%s: %s does not fit 64 bits", call, what);
  }
  return sum;
}

// ceil(a / b) for b > 0, exact for every a (a + b - 1 wraps for a near 2^64).
constexpr uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace minikv
