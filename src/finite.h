// Finding non-finite elements (NaN, +-inf) in caller tensors of the CPU backend: the policy
// in minikv.h is that inputs must be finite, checked where it is cheap (host memory: one
// pass over the inputs) so that a NaN or inf never reaches the cache.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dtype.h"

namespace minikv {

// Index of the first non-finite element of x[0, n), or n. A branch-free pass per chunk
// (vectorizable), then a scan of the chunk that has one.
template <typename T>
uint64_t first_non_finite(const T *x, uint64_t n) {
  constexpr uint64_t kChunk = 512;
  for (uint64_t i0 = 0; i0 < n; i0 += kChunk) {
    const uint64_t end = std::min(n, i0 + kChunk);
    bool any = false;
    for (uint64_t i = i0; i < end; ++i) any |= !is_finite(x[i]);
    if (!any) continue;
    for (uint64_t i = i0; i < end; ++i)
      if (!is_finite(x[i])) return i;
  }
  return n;
}

}  // namespace minikv
