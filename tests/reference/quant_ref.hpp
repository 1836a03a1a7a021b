// Reference KIVI quantizer, written from the specification in MINIKV.md §3 and the
// normative arithmetic documented in src/quant.h (not from its code):
//   mn = min x, mx = max x                         (exact)
//   scale_s = dtype(float32(mx - mn) / (2^b - 1)),  mn_s = dtype(mn)
//   (mx / l - mn / l where float32(mx - mn) overflows)
//   q = scale_s == 0 ? 0 : round_half_even(clamp((x - mn_s) / scale_s, 0, 2^b - 1))
//   x^ = q * scale_s + mn_s                        (float32, no fused multiply-add)
// Keys: one group per channel over G consecutive cached tokens. Values: one group per
// token over G consecutive channels.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fp_ref.hpp"

namespace ref {

struct QuantGroup {
  float scale = 0.0f;  // scale_s (a value of the storage dtype)
  float min = 0.0f;    // mn_s
  std::vector<uint32_t> codes;
};

inline uint32_t levels(uint32_t bits) { return (1u << bits) - 1u; }

// Round half to even of a float in [0, 2^b - 1], by hand (not rintf).
inline uint32_t round_half_even(float t) {
  const double fl = std::floor(static_cast<double>(t));
  const double frac = static_cast<double>(t) - fl;
  uint32_t q = static_cast<uint32_t>(fl);
  if (frac > 0.5 || (frac == 0.5 && (q & 1u))) ++q;
  return q;
}

inline uint32_t code_of(float x, float mn_s, float scale_s, uint32_t bits) {
  if (!(scale_s > 0.0f)) return 0;
  volatile float t = (x - mn_s) / scale_s;  // float32 arithmetic, as specified
  float c = t;
  if (!(c >= 0.0f)) c = 0.0f;  // also NaN
  if (c > static_cast<float>(levels(bits))) c = static_cast<float>(levels(bits));
  return round_half_even(c);
}

inline float dequant(uint32_t code, float mn_s, float scale_s) {
  volatile float prod = static_cast<float>(code) * scale_s;  // no contraction into an FMA
  return prod + mn_s;
}

// Quantizes x[0], x[stride], ..., x[(n-1)*stride] (float values of the storage dtype).
inline QuantGroup quantize(const float *x, uint32_t n, size_t stride, uint32_t bits,
                           minikv_dtype dt) {
  QuantGroup g;
  float mn = x[0], mx = x[0];
  for (uint32_t i = 1; i < n; ++i) {
    mn = std::fmin(mn, x[i * stride]);
    mx = std::fmax(mx, x[i * stride]);
  }
  volatile float range = mx - mn;
  const float lv = static_cast<float>(levels(bits));
  // A range beyond FLT_MAX (values near the BF16/F32 maximum): the same quotient, finite.
  const float scale = range > FLT_MAX ? mx / lv - mn / lv : range / lv;
  g.scale = static_cast<float>(round_dtype(dt, scale));
  g.min = static_cast<float>(round_dtype(dt, mn));
  g.codes.resize(n);
  for (uint32_t i = 0; i < n; ++i) g.codes[i] = code_of(x[i * stride], g.min, g.scale, bits);
  return g;
}

// Dequantized copy of a head's cache as the decode kernel sees it. `rows` holds n cached
// tokens [n][D] (float values of the storage dtype) in cache order; rows [first, first +
// quantized) (quantized a multiple of G) are quantized, keys per channel over groups of G
// tokens, values per token over groups of G channels; the rest stay as they are (16-bit
// sinks before them, 16-bit residual after).
inline void dequantize_cache(const std::vector<float> &k_rows, const std::vector<float> &v_rows,
                             uint32_t n, uint32_t quantized, uint32_t D, uint32_t G,
                             uint32_t key_bits, uint32_t value_bits, minikv_dtype dt,
                             std::vector<double> &k_hat, std::vector<double> &v_hat,
                             uint32_t first = 0) {
  k_hat.assign(size_t(n) * D, 0.0);
  v_hat.assign(size_t(n) * D, 0.0);
  for (size_t i = 0; i < size_t(n) * D; ++i) {
    k_hat[i] = k_rows[i];
    v_hat[i] = v_rows[i];
  }
  for (uint32_t t0 = first; t0 < first + quantized; t0 += G) {
    if (key_bits != 16) {
      for (uint32_t c = 0; c < D; ++c) {
        const QuantGroup g = quantize(&k_rows[size_t(t0) * D + c], G, D, key_bits, dt);
        for (uint32_t t = 0; t < G; ++t)
          k_hat[size_t(t0 + t) * D + c] = dequant(g.codes[t], g.min, g.scale);
      }
    }
    if (value_bits != 16) {
      for (uint32_t t = t0; t < t0 + G; ++t) {
        for (uint32_t c0 = 0; c0 < D; c0 += G) {
          const QuantGroup g = quantize(&v_rows[size_t(t) * D + c0], G, 1, value_bits, dt);
          for (uint32_t c = 0; c < G; ++c)
            v_hat[size_t(t) * D + c0 + c] = dequant(g.codes[c], g.min, g.scale);
        }
      }
    }
  }
}

}  // namespace ref
