// Host-side conversions between float and the 16-bit storage types, bit-exact with the
// CUDA intrinsics (__float2half_rn, __float2bfloat16_rn): round to nearest, ties to even.
#pragma once

#include <cstdint>
#include <cstring>

#include "minikv.h"

namespace minikv {

struct half_t { uint16_t bits; };
struct bfloat16_t { uint16_t bits; };

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline uint16_t float_to_half_bits(float f) {
  // After F. Giesen's float_to_half_fast3_rtne (public domain): relies on the default
  // round-to-nearest-even FPU mode for the subnormal range.
  constexpr uint32_t kF32Infinity = 255u << 23;
  constexpr uint32_t kF16Overflow = (127u + 16u) << 23;  // 2^16: rounds to infinity
  constexpr uint32_t kDenormMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = float_to_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t out;
  if (u >= kF16Overflow) {
    out = u > kF32Infinity ? 0x7e00 : 0x7c00;
  } else if (u < (113u << 23)) {  // below the smallest normal half: subnormal or zero
    const float rounded = bits_to_float(u) + bits_to_float(kDenormMagic);
    out = static_cast<uint16_t>(float_to_bits(rounded) - kDenormMagic);
  } else {
    const uint32_t mantissa_odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
    u += mantissa_odd;
    out = static_cast<uint16_t>(u >> 13);
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// Element access by storage type.
inline float to_float(float x) { return x; }
inline float to_float(half_t x) { return half_bits_to_float(x.bits); }
inline float to_float(bfloat16_t x) { return bf16_bits_to_float(x.bits); }

template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline half_t from_float<half_t>(float x) { return half_t{float_to_half_bits(x)}; }
template <> inline bfloat16_t from_float<bfloat16_t>(float x) { return bfloat16_t{float_to_bf16_bits(x)}; }

// Not NaN and not +-inf, from the bits (exponent all ones).
inline bool is_finite(float x) { return (float_to_bits(x) & 0x7f800000u) != 0x7f800000u; }
inline bool is_finite(half_t x) { return (x.bits & 0x7c00u) != 0x7c00u; }
inline bool is_finite(bfloat16_t x) { return (x.bits & 0x7f80u) != 0x7f80u; }

// The largest finite value of the storage type T, as a float.
template <typename T> constexpr float finite_max();
template <> constexpr float finite_max<float>() { return 3.40282347e38f; }
template <> constexpr float finite_max<half_t>() { return 65504.0f; }
template <> constexpr float finite_max<bfloat16_t>() { return 3.38953139e38f; }  // 0x7f7f

// x clamped to T's finite range (NaN stays NaN).
template <typename T> inline float clamp_finite(float x) {
  return x > finite_max<T>() ? finite_max<T>() : x < -finite_max<T>() ? -finite_max<T>() : x;
}

// Rounds x to the precision of the storage type T and back.
template <typename T> inline float round_to(float x) { return to_float(from_float<T>(x)); }

// Calls fn.template operator()<T>() with T the element type of `dtype`.
template <typename Fn> decltype(auto) dispatch_dtype(minikv_dtype dtype, Fn &&fn) {
  switch (dtype) {
    case MINIKV_DTYPE_F16: return fn(half_t{});
    case MINIKV_DTYPE_BF16: return fn(bfloat16_t{});
    default: return fn(float{});
  }
}

}  // namespace minikv
