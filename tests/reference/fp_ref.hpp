// Reference rounding to the storage dtypes, written independently of src/dtype.h: a value
// is rounded to the nearest multiple of its binade's quantum (ties to even, via
// std::nearbyint in the default rounding mode), in double, which is exact for every float
// input. Encoding/decoding of IEEE binary16 and bfloat16 bit patterns for building the
// caller's buffers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "minikv.h"

namespace ref {

// Rounds |a| (finite, >= 0) to a format with `mant_bits` significand bits (including the
// implicit one), smallest normal 2^min_exp, largest finite `max_finite`.
inline double round_binary(double x, int mant_bits, int min_exp, double max_finite) {
  if (std::isnan(x)) return x;
  const double a = std::fabs(x);
  if (a == 0.0 || std::isinf(a)) return x;
  double quantum;
  if (a < std::ldexp(1.0, min_exp)) {
    quantum = std::ldexp(1.0, min_exp - (mant_bits - 1));  // subnormal spacing
  } else {
    int e;
    std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    quantum = std::ldexp(1.0, e - mant_bits);
  }
  double r = std::nearbyint(a / quantum) * quantum;
  if (r > max_finite) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

inline double round_f16(double x) { return round_binary(x, 11, -14, 65504.0); }
inline double round_bf16(double x) {
  return round_binary(x, 8, -126, std::ldexp(255.0, 120));  // (2 - 2^-7) * 2^127
}
inline double round_f32(double x) { return static_cast<double>(static_cast<float>(x)); }

inline double round_dtype(minikv_dtype dt, double x) {
  switch (dt) {
    case MINIKV_DTYPE_F16: return round_f16(x);
    case MINIKV_DTYPE_BF16: return round_bf16(x);
    default: return round_f32(x);
  }
}

// Bits of a value already representable in binary16 / bfloat16.
inline uint16_t f16_bits(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(round_f16(x));
  if (std::isnan(x)) return 0x7e00;
  if (std::isinf(a)) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(std::ldexp(a, 24));
  int e;
  const double m = std::frexp(a, &e);  // a = m * 2^e
  const uint16_t exponent = static_cast<uint16_t>(e - 1 + 15);
  const uint16_t mantissa = static_cast<uint16_t>(std::ldexp(2.0 * m - 1.0, 10));
  return sign | static_cast<uint16_t>(exponent << 10) | mantissa;
}

inline double f16_value(uint16_t b) {
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  const int exponent = (b >> 10) & 0x1f;
  const int mantissa = b & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  if (exponent == 31)
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(1024 + mantissa, exponent - 15 - 10);
}

// bfloat16 is the top half of a float32 once rounded.
inline uint16_t bf16_bits(double x) {
  const float f = static_cast<float>(round_bf16(x));
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

inline double bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline size_t dtype_size(minikv_dtype dt) { return dt == MINIKV_DTYPE_F32 ? 4 : 2; }

inline const char *dtype_label(minikv_dtype dt) {
  return dt == MINIKV_DTYPE_F16 ? "F16" : dt == MINIKV_DTYPE_BF16 ? "BF16" : "F32";
}

// Unit roundoff of a dtype (half an ulp of 1).
inline double dtype_eps(minikv_dtype dt) {
  return dt == MINIKV_DTYPE_F16 ? std::ldexp(1.0, -11)
         : dt == MINIKV_DTYPE_BF16 ? std::ldexp(1.0, -8)
                                   : std::ldexp(1.0, -24);
}

}  // namespace ref
