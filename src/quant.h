// KIVI-style asymmetric quantization, the arithmetic both backends share bit for bit.
//
// A group of values x is stored as b-bit codes plus (scale, min) in the caller's dtype.
// The scale and min are rounded to the storage dtype *before* the codes are computed, so
// that codes are optimal for the values dequantization will actually use:
//   mn = min x, mx = max x            (exact)
//   scale_s = dtype((mx - mn) / (2^b - 1)),  mn_s = dtype(mn)   (group_scale: finite
//                                                              also where mx - mn overflows)
//   q = scale_s == 0 ? 0 : round_half_even(clamp((x - mn_s) / scale_s, 0, 2^b - 1))
//   x^ = q * scale_s + mn_s
// All of it in IEEE float32 (no fast-math: CUDA must be built without it).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "layout.h"

namespace minikv {

MINIKV_HD uint32_t quant_levels(uint32_t bits) { return (1u << bits) - 1u; }

// The scale of a group with minimum mn and maximum mx, (mx - mn) / levels, before rounding
// to the storage dtype. Where mx - mn overflows float (a group spanning more than FLT_MAX:
// values near the BF16/F32 maximum) the same quotient is formed as mx / levels - mn /
// levels, which stays finite; otherwise these are the bits of (mx - mn) / levels.
MINIKV_HD float group_scale(float mn, float mx, uint32_t levels) {
  const float range = mx - mn;
  const float lv = static_cast<float>(levels);
  return range > FLT_MAX ? mx / lv - mn / lv : range / lv;
}

MINIKV_HD uint32_t quantize_code(float x, float mn_s, float scale_s, uint32_t levels) {
  if (!(scale_s > 0.0f)) return 0;  // constant group (or an unusable scale)
  float t = (x - mn_s) / scale_s;
  t = fminf(fmaxf(t, 0.0f), static_cast<float>(levels));  // fmaxf maps NaN to 0
  return static_cast<uint32_t>(rintf(t));
}

// RN(1 / scale_s) for scale_s in [2^-126, 2^126], NaN outside: the GPU store's codes by
// multiplication (kernels/quantize.cuh pack_word). t = RN((x - mn_s) · r) is within
// 3 · 2^-24 · t of the quotient RN((x - mn_s) / scale_s); codes only depend on the quotient
// clamped to [0, levels ≤ 255], where that is below 2^-13, so both round to the same code
// unless t lies within 2^-12 of a half-integer, and there (or without a reciprocal) the
// store divides. Equal to quantize_code for every input (tests/emulation/test_emulated_store.cpp).
MINIKV_HD float quantize_reciprocal(float scale_s) {
  return scale_s >= 0x1p-126f && scale_s <= 0x1p126f ? 1.0f / scale_s : NAN;
}

MINIKV_HD float dequantize_code(uint32_t q, float mn_s, float scale_s) {
  return static_cast<float>(q) * scale_s + mn_s;
}

// Code of element i of a packed row (32/bits codes per uint32, element 0 lowest).
MINIKV_HD uint32_t unpack_code(const uint32_t *row, uint32_t i, uint32_t bits) {
  const uint32_t per_word = 32u / bits;
  return (row[i / per_word] >> ((i % per_word) * bits)) & quant_levels(bits);
}

}  // namespace minikv
