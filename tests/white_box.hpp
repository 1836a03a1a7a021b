// Checks through the handle's internals, for tests that link the static core (the marker
// "minikv-test: white-box", and every GPU test).
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "handle.h"

namespace test {

// Both caches hold the same bytes in every pool block and every residual slot (the CUDA
// backend synchronizes the device to read them).
inline void check_same_storage(const minikv_cache *a, const minikv_cache *b, const std::string &when) {
  std::vector<uint8_t> pool_a, res_a, pool_b, res_b;
  a->impl.backend().read_storage(pool_a, res_a);
  b->impl.backend().read_storage(pool_b, res_b);
  INFO(when);
  CHECK(pool_a == pool_b);
  CHECK(res_a == res_b);
}

}  // namespace test
