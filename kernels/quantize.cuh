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

// CTA-cooperative (every thread of the block must call it; it ends with __syncthreads()).
// Rows come from functors: krow(t), vrow(t) give a `const T *` to head_dim elements of
// token t of the group, pos(t) its position. s_scale / s_min: shared scratch [head_dim].
template <typename T, typename KRow, typename VRow, typename Pos>
__device__ void store_group(const BlockLayout &bl, uint8_t *block, uint32_t head, uint32_t row0,
                            KRow krow, VRow vrow, Pos pos, float *s_scale, float *s_min) {
  using Tr = DType<T>;
  const uint32_t G = bl.group, D = bl.head_dim, kb = bl.key_bits, vb = bl.value_bits;
  const uint32_t tid = threadIdx.x, nthreads = blockDim.x;

  int32_t *positions = reinterpret_cast<int32_t *>(block + bl.positions + head * bl.positions_head());
  for (uint32_t t = tid; t < G; t += nthreads) positions[row0 + t] = pos(t);

  // ---- keys: per channel over the G tokens ----
  uint8_t *k_codes = block + bl.k_codes + head * bl.k_codes_head();
  if (kb == 16) {
    for (uint32_t i = tid; i < G * D; i += nthreads) {
      const uint32_t t = i / D, c = i % D;
      reinterpret_cast<T *>(k_codes + (row0 + t) * bl.k_row_bytes)[c] = krow(t)[c];
    }
  } else {
    T *scale = reinterpret_cast<T *>(block + bl.k_scale + head * bl.k_scale_head()) + (row0 / G) * D;
    T *minimum = reinterpret_cast<T *>(block + bl.k_min + head * bl.k_scale_head()) + (row0 / G) * D;
    for (uint32_t c = tid; c < D; c += nthreads) {
      float mn = INFINITY, mx = -INFINITY;  // as the CPU: std::min / std::max from ±inf
      for (uint32_t t = 0; t < G; ++t) {
        const float x = Tr::to_float(krow(t)[c]);
        mn = x < mn ? x : mn;
        mx = mx < x ? x : mx;
      }
      const T scale_t = Tr::from_float(group_scale(mn, mx, quant_levels(kb)));
      const T min_t = Tr::from_float(mn);
      scale[c] = scale_t;
      minimum[c] = min_t;
      s_scale[c] = Tr::to_float(scale_t);
      s_min[c] = Tr::to_float(min_t);
    }
    __syncthreads();
    const uint32_t per_word = 32u / kb;
    const uint32_t words = D / per_word;
    for (uint32_t i = tid; i < G * words; i += nthreads) {
      const uint32_t t = i / words, w = i % words;
      const T *x = krow(t);
      uint32_t word = 0;
      for (uint32_t j = 0; j < per_word; ++j) {
        const uint32_t c = w * per_word + j;
        word |= quantize_code(Tr::to_float(x[c]), s_min[c], s_scale[c], quant_levels(kb)) << (j * kb);
      }
      reinterpret_cast<uint32_t *>(k_codes + (row0 + t) * bl.k_row_bytes)[w] = word;
    }
  }

  // ---- values: per token over G consecutive channels ----
  uint8_t *v_codes = block + bl.v_codes + head * bl.v_codes_head();
  if (vb == 16) {
    for (uint32_t i = tid; i < G * D; i += nthreads) {
      const uint32_t t = i / D, c = i % D;
      reinterpret_cast<T *>(v_codes + (row0 + t) * bl.v_row_bytes)[c] = vrow(t)[c];
    }
  } else {
    const uint32_t groups = D / G;
    T *scale = reinterpret_cast<T *>(block + bl.v_scale + head * bl.v_scale_head());
    T *minimum = reinterpret_cast<T *>(block + bl.v_min + head * bl.v_scale_head());
    const uint32_t per_word = 32u / vb;
    const uint32_t words_per_group = G / per_word;
    for (uint32_t i = tid; i < G * groups; i += nthreads) {
      const uint32_t t = i / groups, g = i % groups;
      const T *x = vrow(t) + g * G;
      // std::min_element / std::max_element: first extreme element wins.
      float mn = Tr::to_float(x[0]), mx = mn;
      for (uint32_t c = 1; c < G; ++c) {
        const float xc = Tr::to_float(x[c]);
        mn = xc < mn ? xc : mn;
        mx = mx < xc ? xc : mx;
      }
      const T scale_t = Tr::from_float(group_scale(mn, mx, quant_levels(vb)));
      const T min_t = Tr::from_float(mn);
      scale[(row0 + t) * groups + g] = scale_t;
      minimum[(row0 + t) * groups + g] = min_t;
      const float s = Tr::to_float(scale_t), m = Tr::to_float(min_t);
      uint32_t *row = reinterpret_cast<uint32_t *>(v_codes + (row0 + t) * bl.v_row_bytes) + g * words_per_group;
      for (uint32_t w = 0; w < words_per_group; ++w) {
        uint32_t word = 0;
        for (uint32_t j = 0; j < per_word; ++j)
          word |= quantize_code(Tr::to_float(x[w * per_word + j]), m, s, quant_levels(vb)) << (j * vb);
        row[w] = word;
      }
    }
  }
  __syncthreads();
}

}  // namespace kernels
}  // namespace minikv
