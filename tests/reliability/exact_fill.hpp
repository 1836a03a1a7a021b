// Input tensors of the reliability suites: values m/256 with |m| <= 512, exact in F32 and F16,
// so results never depend on rounding and a retry or another thread count must match bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "../splitmix64.hpp"
#include "minikv.h"

namespace reliability {

inline void fill(std::vector<uint8_t> &buf, size_t elems, uint64_t seed, minikv_dtype dtype) {
  const bool f32 = dtype == MINIKV_DTYPE_F32;
  buf.assign(elems * (f32 ? 4 : 2), 0);
  testdata::SplitMix64 rng(seed * 0x9e3779b97f4a7c15ull + 12345);
  for (size_t i = 0; i < elems; ++i) {
    const int m = static_cast<int>(rng.next() % 1025) - 512;
    if (f32) {
      const float x = static_cast<float>(m) / 256.0f;
      std::memcpy(buf.data() + 4 * i, &x, 4);
    } else {
      uint16_t h = 0;  // the half built directly: sign, exponent, mantissa
      if (m != 0) {
        const int a = m < 0 ? -m : m;
        int e = 0;
        while ((a >> (e + 1)) != 0) ++e;  // a in [2^e, 2^(e+1))
        const uint32_t mant = static_cast<uint32_t>(((a << 10) >> e) & 0x3ff);
        h = static_cast<uint16_t>(((e - 8 + 15) << 10) | mant);  // a/256 = 2^(e-8) * 1.mant
        if (m < 0) h |= 0x8000;
      }
      std::memcpy(buf.data() + 2 * i, &h, 2);
    }
  }
}

}  // namespace reliability
