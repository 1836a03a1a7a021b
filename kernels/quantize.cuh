// Quantize + pack of one group of G cached tokens of one KV head into a pool block, in the
// layout of src/layout.h, with arithmetic bit-identical to the CPU backend (src/quant.h):
// fp32, scale and min rounded to the storage dtype before the codes, round-half-even, the
// same min/max scan order (so even signed zeros resolve the same way). Used by the prefill
// store (gathered kept rows) and by the residual flush (residual rows).
#pragma once

#include "../src/quant.h"
#include "common.cuh"

namespace minikv {
namespace kernels {

constexpr uint32_t kStoreMaxGroup = 128;    // group_size's largest value (src/config.cpp)
constexpr uint32_t kStoreMaxHeadDim = 256;  // head_dim's largest value (src/config.cpp)

// Eight consecutive elements of a row (16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void load8(const T *x, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4 *>(x);
  const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = DType<T>::to_float(e[j]);
}

// quantize_code out of line: the rare division (see pack_word) costs a call, not a copy of
// the IEEE division's slow path in every unrolled code of the loops below.
static __device__ __noinline__ uint32_t quantize_code_by_division(float x, float mn, float scale,
                                                                  uint32_t levels) {
  return quantize_code(x, mn, scale, levels);
}

// max and min that return NaN when either operand is NaN (fmaxf and fminf return the other
// one): a NaN quotient must reach the check in pack_word. One FMNMX each (sm_80+).
__device__ __forceinline__ float max_nan(float a, float b) {
#ifdef MINIKV_WARP_EMULATION
  return a != a || b != b ? NAN : fmaxf(a, b);
#else
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#endif
}
__device__ __forceinline__ float min_nan(float a, float b) {
#ifdef MINIKV_WARP_EMULATION
  return a != a || b != b ? NAN : fminf(a, b);
#else
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#endif
}

// The word of P = 32 / BITS codes (element j at bit j·BITS) of x[j] with (mn[j], scale[j],
// r[j] = quantize_reciprocal(scale[j])): by multiplication, and where any code needs it, the
// whole word again by division (rare: a code within 2^-12 of a rounding boundary, or a
// scale without a reciprocal; src/quant.h says why elsewhere the two agree). Equals the
// packed quantize_code of every element. t + 1.5 · 2^23 rounds t ∈ [0, 255] to the nearest
// integer, ties to even, into the sum's low mantissa bits (one FADD, where rintf and a
// conversion to an integer would each take the conversion pipe), and the word's distances
// |t − round(t)| meet in one maximum. The clamp and the maximum keep NaN, so a NaN quotient
// (a reciprocal of NaN) sends the word to the division; for a NaN x that costs time, not a
// different code (both give 0).
template <uint32_t BITS, uint32_t P, typename Mn, typename Scale, typename Recip>
__device__ __forceinline__ uint32_t pack_word(const float (&x)[P], Mn mn, Scale scale, Recip r) {
  constexpr uint32_t kLevels = (1u << BITS) - 1u;
  constexpr float kRound = 12582912.0f;  // 1.5 · 2^23
  uint32_t word = 0;
  float worst = 0.0f;  // the largest |t − round(t)| of the word
#pragma unroll
  for (uint32_t j = 0; j < P; ++j) {
    const float t = min_nan(max_nan((x[j] - mn(j)) * r(j), 0.0f), static_cast<float>(kLevels));
    const float shifted = t + kRound;
    worst = max_nan(worst, fabsf(t - (shifted - kRound)));
    word |= (__float_as_uint(shifted) & kLevels) << (j * BITS);
  }
  if (!(worst <= 0.5f - 0x1p-12f)) {
    word = 0;
#pragma unroll  // x[j] in registers: a loop indexing it would move it to local memory
    for (uint32_t j = 0; j < P; ++j)
      word |= quantize_code_by_division(x[j], mn(j), scale(j), kLevels) << (j * BITS);
  }
  return word;
}

// P = 32 / BITS consecutive elements of a row (P·2 bytes, 16-byte aligned for P ≥ 8; 8-byte
// for P = 4) as floats.
template <typename T, uint32_t P>
__device__ __forceinline__ void load_word(const T *x, float (&f)[P]) {
  if constexpr (P >= 8) {
#pragma unroll
    for (uint32_t j = 0; j < P; j += 8) {
      float g[8];
      load8(x + j, g);
#pragma unroll
      for (uint32_t e = 0; e < 8; ++e) f[j + e] = g[e];
    }
  } else {
    const uint2 u = *reinterpret_cast<const uint2 *>(x);
    const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
    for (uint32_t j = 0; j < P; ++j) f[j] = DType<T>::to_float(e[j]);
  }
}

// Key codes of rows[t], t < G: word w of a row packs channels [w·P, w·P + P), P = 32 / BITS,
// with channel c's (s_min, s_scale, s_recip). Thread i takes words i, i + nthreads, ...,
// walked without a division per word.
template <typename T, uint32_t BITS>
__device__ __forceinline__ void key_codes(const BlockLayout &bl, uint8_t *k_codes, uint32_t row0,
                                          const T *const *rows, const float *s_scale,
                                          const float *s_min, const float *s_recip) {
  constexpr uint32_t P = 32 / BITS;
  const uint32_t G = bl.group, words = bl.head_dim / P, nthreads = blockDim.x;
  uint32_t t = threadIdx.x / words, w = threadIdx.x % words;
  const uint32_t dt = nthreads / words, dw = nthreads % words;
  while (t < G) {
    float x[P];
    load_word<T, P>(rows[t] + w * P, x);
    float mn[P], r[P];  // channel w·P + j's minimum and scale reciprocal, 16-byte loads
#pragma unroll
    for (uint32_t j = 0; j < P; j += 4) {
      *reinterpret_cast<float4 *>(mn + j) = *reinterpret_cast<const float4 *>(s_min + w * P + j);
      *reinterpret_cast<float4 *>(r + j) = *reinterpret_cast<const float4 *>(s_recip + w * P + j);
    }
    const uint32_t word = pack_word<BITS>(
        x, [&](uint32_t j) { return mn[j]; }, [&](uint32_t j) { return s_scale[w * P + j]; },
        [&](uint32_t j) { return r[j]; });
    reinterpret_cast<uint32_t *>(k_codes + (row0 + t) * bl.k_row_bytes)[w] = word;
    t += dt;
    w += dw;
    if (w >= words) {
      w -= words;
      ++t;
    }
  }
}

// Value scales, minima and codes of rows[t], t < G: per token over each group of G
// consecutive channels. Tasks (token, group) i = thread, thread + nthreads, ...
template <typename T, uint32_t BITS>
__device__ __forceinline__ void value_codes(const BlockLayout &bl, uint8_t *block, uint32_t head,
                                            uint32_t row0, const T *const *rows) {
  using Tr = DType<T>;
  constexpr uint32_t P = 32 / BITS, kLevels = (1u << BITS) - 1u;
  const uint32_t G = bl.group, groups = bl.head_dim / G, nthreads = blockDim.x;
  uint8_t *v_codes = block + bl.v_codes + head * bl.v_codes_head();
  T *scale = reinterpret_cast<T *>(block + bl.v_scale + head * bl.v_scale_head());
  T *minimum = reinterpret_cast<T *>(block + bl.v_min + head * bl.v_scale_head());
  uint32_t t = threadIdx.x / groups, g = threadIdx.x % groups;
  const uint32_t dt = nthreads / groups, dg = nthreads % groups;
  while (t < G) {
    const T *x = rows[t] + g * G;
    // std::min_element / std::max_element: first extreme element wins.
    float mn = Tr::to_float(x[0]), mx = mn;
    for (uint32_t c = 0; c < G; c += 8) {
      float f[8];
      load8(x + c, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        mn = f[e] < mn ? f[e] : mn;
        mx = mx < f[e] ? f[e] : mx;
      }
    }
    const T scale_t = Tr::from_float(group_scale(mn, mx, kLevels));
    const T min_t = Tr::from_float(mn);
    scale[(row0 + t) * groups + g] = scale_t;
    minimum[(row0 + t) * groups + g] = min_t;
    const float s = Tr::to_float(scale_t), m = Tr::to_float(min_t), r = quantize_reciprocal(s);
    uint32_t *row = reinterpret_cast<uint32_t *>(v_codes + (row0 + t) * bl.v_row_bytes) + g * (G / P);
    for (uint32_t w = 0; w < G / P; ++w) {
      float xs[P];
      load_word<T, P>(x + w * P, xs);
      row[w] = pack_word<BITS>(
          xs, [&](uint32_t) { return m; }, [&](uint32_t) { return s; }, [&](uint32_t) { return r; });
    }
    t += dt;
    g += dg;
    if (g >= groups) {
      g -= groups;
      ++t;
    }
  }
}

// CTA-cooperative (every thread of the block must call it; it ends with __syncthreads()).
// Rows come from functors: krow(t), vrow(t) give a 16-byte aligned `const T *` to head_dim
// elements of token t of the group, pos(t) its position; each is called once per token (the
// row addresses wait in shared memory). Codes as pack_word makes them: the same as
// quantize_code's, mostly without a division.
template <typename T, typename KRow, typename VRow, typename Pos>
__device__ void store_group(const BlockLayout &bl, uint8_t *block, uint32_t head, uint32_t row0,
                            KRow krow, VRow vrow, Pos pos) {
  using Tr = DType<T>;
  __shared__ const T *k_rows[kStoreMaxGroup], *v_rows[kStoreMaxGroup];
  // Each channel's key scale, minimum and scale reciprocal (16-byte loads in key_codes).
  __shared__ __align__(16) float s_scale[kStoreMaxHeadDim], s_min[kStoreMaxHeadDim], s_recip[kStoreMaxHeadDim];
  const uint32_t G = bl.group, D = bl.head_dim, kb = bl.key_bits, vb = bl.value_bits;
  const uint32_t tid = threadIdx.x, nthreads = blockDim.x;

  int32_t *positions = reinterpret_cast<int32_t *>(block + bl.positions + head * bl.positions_head());
  for (uint32_t t = tid; t < G; t += nthreads) {
    positions[row0 + t] = pos(t);
    k_rows[t] = krow(t);
    v_rows[t] = vrow(t);
  }
  __syncthreads();

  // ---- keys: per channel over the G tokens ----
  uint8_t *k_codes = block + bl.k_codes + head * bl.k_codes_head();
  if (kb == 16) {
    for (uint32_t i = tid; i < G * D / 8; i += nthreads) {
      const uint32_t t = i / (D / 8), u = i % (D / 8);
      reinterpret_cast<uint4 *>(k_codes + (row0 + t) * bl.k_row_bytes)[u] =
          reinterpret_cast<const uint4 *>(k_rows[t])[u];
    }
  } else {
    T *scale = reinterpret_cast<T *>(block + bl.k_scale + head * bl.k_scale_head()) + (row0 / G) * D;
    T *minimum = reinterpret_cast<T *>(block + bl.k_min + head * bl.k_scale_head()) + (row0 / G) * D;
    const uint32_t levels = quant_levels(kb);
    for (uint32_t c = tid; c < D; c += nthreads) {
      float mn = INFINITY, mx = -INFINITY;  // as the CPU: std::min / std::max from ±inf
#pragma unroll 8
      for (uint32_t t = 0; t < G; ++t) {
        const float x = Tr::to_float(k_rows[t][c]);
        mn = x < mn ? x : mn;
        mx = mx < x ? x : mx;
      }
      const T scale_t = Tr::from_float(group_scale(mn, mx, levels));
      const T min_t = Tr::from_float(mn);
      scale[c] = scale_t;
      minimum[c] = min_t;
      s_scale[c] = Tr::to_float(scale_t);
      s_min[c] = Tr::to_float(min_t);
      s_recip[c] = quantize_reciprocal(Tr::to_float(scale_t));
    }
    __syncthreads();
    switch (kb) {
      case 2: key_codes<T, 2>(bl, k_codes, row0, k_rows, s_scale, s_min, s_recip); break;
      case 4: key_codes<T, 4>(bl, k_codes, row0, k_rows, s_scale, s_min, s_recip); break;
      default: key_codes<T, 8>(bl, k_codes, row0, k_rows, s_scale, s_min, s_recip); break;
    }
  }

  // ---- values: per token over G consecutive channels ----
  if (vb == 16) {
    uint8_t *v_codes = block + bl.v_codes + head * bl.v_codes_head();
    for (uint32_t i = tid; i < G * D / 8; i += nthreads) {
      const uint32_t t = i / (D / 8), u = i % (D / 8);
      reinterpret_cast<uint4 *>(v_codes + (row0 + t) * bl.v_row_bytes)[u] =
          reinterpret_cast<const uint4 *>(v_rows[t])[u];
    }
  } else {
    switch (vb) {
      case 2: value_codes<T, 2>(bl, block, head, row0, v_rows); break;
      case 4: value_codes<T, 4>(bl, block, head, row0, v_rows); break;
      default: value_codes<T, 8>(bl, block, head, row0, v_rows); break;
    }
  }
  __syncthreads();
}

}  // namespace kernels
}  // namespace minikv
