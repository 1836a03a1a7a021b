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
constexpr uint32_t kStoreGroupThreads = 128;  // the CTA size of store_group's callers
// Rows a thread holds in registers at once: a group's rows of 16-byte chunks spread over
// the CTA, so G · head_dim ≤ 4,096 (the default G = 32 at head_dim 128) is one batch.
constexpr uint32_t kStoreBatchRows = 4;

// The scans of src/quant.h's callers: `x < mn ? x : mn` (std::min) with `x` after `mn`,
// so among equal values (−0 and +0) the earlier stays and NaN never enters; likewise for
// the maximum. Combining the results of two adjacent ranges, the earlier range's as `mn`,
// gives the scan of both.
__device__ __forceinline__ float min_after(float mn, float x) { return x < mn ? x : mn; }
__device__ __forceinline__ float max_after(float mx, float x) { return mx < x ? x : mx; }

// The eight elements of a 16-byte chunk as floats.
template <typename T>
__device__ __forceinline__ void chunk_floats(const uint4 &u, float (&f)[8]) {
  const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = DType<T>::to_float(e[j]);
}

// Eight values of the dtype (each exactly representable: elements or ±inf) as a chunk.
template <typename T>
__device__ __forceinline__ uint4 chunk_of(const float (&f)[8]) {
  uint4 u;
  T *e = reinterpret_cast<T *>(&u);
#pragma unroll
  for (int j = 0; j < 8; ++j) e[j] = DType<T>::from_float(f[j]);
  return u;
}

// quantize_code out of line: the rare division (see pack_word) costs a call, not a copy of
// the IEEE division's slow path in every unrolled code of the loops below.
static __device__ __noinline__ uint32_t quantize_code_by_division(float x, float mn, float scale,
                                                                  uint32_t levels) {
  return quantize_code(x, mn, scale, levels);
}

// The codes of x[0..P) packed into one word (element j at bit j·BITS) with (mn(j), scale(j),
// r(j) = quantize_reciprocal(scale(j))): by multiplication, and where any code needs it, the
// whole word again by division (rare: a code within 2^-12 of a rounding boundary, or a
// scale without a reciprocal). Equals the packed quantize_code of every element.
template <uint32_t BITS, uint32_t P, typename Mn, typename Scale, typename Recip>
__device__ __forceinline__ uint32_t pack_word(const float (&x)[P], Mn mn, Scale scale, Recip r) {
  static_assert(P * BITS <= 32, "one word");
  constexpr uint32_t kLevels = (1u << BITS) - 1u;
  uint32_t word = 0;
  bool ok = true;
#pragma unroll
  for (uint32_t j = 0; j < P; ++j) {
    uint32_t code;
    ok &= quantize_code_by_reciprocal(x[j], mn(j), r(j), kLevels, &code);
    word |= code << (j * BITS);
  }
  if (!ok) {
    word = 0;
#pragma unroll  // x[j] in registers: a loop indexing it would move it to local memory
    for (uint32_t j = 0; j < P; ++j)
      word |= quantize_code_by_division(x[j], mn(j), scale(j), kLevels) << (j * BITS);
  }
  return word;
}

// The codes of one chunk (channels 8·col .. 8·col + 7 of a row) into a packed row: the chunk
// is 2 bytes of codes at 2 bits, 4 at 4 bits, 8 at 8 bits (element 0 lowest, as a word's).
template <uint32_t BITS, typename Mn, typename Scale, typename Recip>
__device__ __forceinline__ void store_chunk_codes(uint8_t *row, uint32_t col, const float (&x)[8], Mn mn,
                                                  Scale scale, Recip r) {
  if constexpr (BITS == 8) {
    const float lo[4] = {x[0], x[1], x[2], x[3]}, hi[4] = {x[4], x[5], x[6], x[7]};
    const auto up = [](auto f) { return [f](uint32_t j) { return f(j + 4); }; };
    reinterpret_cast<uint2 *>(row)[col] =
        make_uint2(pack_word<8>(lo, mn, scale, r), pack_word<8>(hi, up(mn), up(scale), up(r)));
  } else if constexpr (BITS == 4) {
    reinterpret_cast<uint32_t *>(row)[col] = pack_word<4>(x, mn, scale, r);
  } else {
    static_assert(BITS == 2, "2, 4 or 8 bits");
    reinterpret_cast<uint16_t *>(row)[col] = static_cast<uint16_t>(pack_word<2>(x, mn, scale, r));
  }
}

// How store_group spreads a group of G rows of D elements over its threads: 16-byte chunks,
// C = D / 8 a row; thread i takes chunk column i % C of the consecutive rows [first, end) of
// slice i / C, one of S = threads / C slices of ⌈G / S⌉ rows (the threads past S · C have
// none, and join every shuffle). Rows go kStoreBatchRows at a time; `batches` is the same
// for every thread.
struct GroupTiling {
  uint32_t chunks, slices, col, slice, first, end, batches;
  __device__ GroupTiling(uint32_t G, uint32_t D) {
    chunks = D / 8;
    slices = kStoreGroupThreads / chunks;
    col = threadIdx.x % chunks;
    slice = threadIdx.x / chunks;
    const uint32_t per_slice = (G + slices - 1) / slices;
    first = min(G, slice * per_slice);
    end = slice < slices ? min(G, first + per_slice) : first;
    batches = (per_slice + kStoreBatchRows - 1) / kStoreBatchRows;
  }
  // Loads this thread's chunk of rows [from, from + kStoreBatchRows) ∩ [first, end), issued
  // together; the others are left as they are.
  template <typename T>
  __device__ __forceinline__ void load(uint4 (&x)[kStoreBatchRows], const T *const *rows, uint32_t from) const {
#pragma unroll
    for (uint32_t i = 0; i < kStoreBatchRows; ++i)
      if (from + i < end) x[i] = reinterpret_cast<const uint4 *>(rows[from + i])[col];
  }
};

// Values of rows [from, from + kStoreBatchRows) ∩ [first, end) from x: per token, over groups
// of G consecutive channels, L = G / 8 chunks held by L aligned lanes of one warp (L divides
// C, since G divides D). Every thread runs every shuffle, also for rows it does not have.
template <typename T, uint32_t BITS>
__device__ __forceinline__ void value_batch(const BlockLayout &bl, uint8_t *block, uint32_t head, uint32_t row0,
                                            const GroupTiling &gt, const uint4 (&x)[kStoreBatchRows], uint32_t from) {
  using Tr = DType<T>;
  constexpr uint32_t kLevels = (1u << BITS) - 1u;
  const uint32_t G = bl.group, groups = bl.head_dim / G, L = G / 8, g = gt.col / L;
  uint8_t *v_codes = block + bl.v_codes + head * bl.v_codes_head();
  T *scale = reinterpret_cast<T *>(block + bl.v_scale + head * bl.v_scale_head());
  T *minimum = reinterpret_cast<T *>(block + bl.v_min + head * bl.v_scale_head());
  const uint32_t lead = (threadIdx.x & 31u) & ~(L - 1u);  // the group's first lane
#pragma unroll
  for (uint32_t i = 0; i < kStoreBatchRows; ++i) {
    const uint32_t t = from + i;
    const bool mine = t < gt.end;
    float f[8];
    chunk_floats<T>(x[i], f);
    float mn = INFINITY, mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      mn = min_after(mn, f[j]);
      mx = max_after(mx, f[j]);
    }
    // Each lane takes its own range as the earlier one: exact for the group's first lane,
    // which stores the minimum; the others may differ from it only in a zero's sign, which
    // changes no code.
    for (uint32_t m = 1; m < L; m <<= 1) {
      mn = min_after(mn, __shfl_xor_sync(0xffffffffu, mn, m));
      mx = max_after(mx, __shfl_xor_sync(0xffffffffu, mx, m));
    }
    // std::min_element / std::max_element start at the group's first element: a NaN there
    // is the result (a NaN elsewhere never is, as in the scans above).
    if (__shfl_sync(0xffffffffu, isnan(f[0]) ? 1 : 0, lead)) mn = mx = NAN;
    if (!mine) continue;
    const T scale_t = Tr::from_float(group_scale(mn, mx, kLevels));
    const T min_t = Tr::from_float(mn);
    if (gt.col % L == 0) {
      scale[(row0 + t) * groups + g] = scale_t;
      minimum[(row0 + t) * groups + g] = min_t;
    }
    const float s = Tr::to_float(scale_t), m = Tr::to_float(min_t), r = quantize_reciprocal(s);
    store_chunk_codes<BITS>(
        v_codes + (row0 + t) * bl.v_row_bytes, gt.col, f, [m](uint32_t) { return m; },
        [s](uint32_t) { return s; }, [r](uint32_t) { return r; });
  }
}

// Key codes of rows [from, from + kStoreBatchRows) ∩ [first, end) from x, with their
// channels' minima and reciprocals (kmin, krecip) and the scales for the rare division.
template <typename T, uint32_t BITS>
__device__ __forceinline__ void key_batch(uint8_t *k_codes, uint64_t row_bytes, uint32_t row0, const GroupTiling &gt,
                                          const uint4 (&x)[kStoreBatchRows], uint32_t from, const float (&kmin)[8],
                                          const float (&krecip)[8], const T *kscale) {
#pragma unroll
  for (uint32_t i = 0; i < kStoreBatchRows; ++i) {
    const uint32_t t = from + i;
    if (t >= gt.end) break;
    float f[8];
    chunk_floats<T>(x[i], f);
    store_chunk_codes<BITS>(
        k_codes + (row0 + t) * row_bytes, gt.col, f, [&](uint32_t j) { return kmin[j]; },
        [&](uint32_t j) { return DType<T>::to_float(kscale[j]); }, [&](uint32_t j) { return krecip[j]; });
  }
}

// 16-bit rows [from, from + kStoreBatchRows) ∩ [first, end) from x, stored as they are.
__device__ __forceinline__ void copy_batch(uint8_t *dst, uint64_t row_bytes, uint32_t row0, const GroupTiling &gt,
                                           const uint4 (&x)[kStoreBatchRows], uint32_t from) {
#pragma unroll
  for (uint32_t i = 0; i < kStoreBatchRows; ++i)
    if (from + i < gt.end) reinterpret_cast<uint4 *>(dst + (row0 + from + i) * row_bytes)[gt.col] = x[i];
}

// CTA-cooperative (every thread of the block must call it; it ends with __syncthreads()),
// kStoreGroupThreads threads. Rows come from functors: krow(t), vrow(t) give a 16-byte
// aligned `const T *` to head_dim elements of token t of the group, pos(t) its position;
// each is called once per token (the row addresses wait in shared memory). Every element is
// loaded once (twice where a thread's share of the group exceeds a batch), 16 bytes a load;
// codes as pack_word makes them: the same as quantize_code's, mostly without a division.
template <typename T, typename KRow, typename VRow, typename Pos>
__device__ void store_group(const BlockLayout &bl, uint8_t *block, uint32_t head, uint32_t row0,
                            KRow krow, VRow vrow, Pos pos) {
  using Tr = DType<T>;
  __shared__ const T *k_rows[kStoreMaxGroup], *v_rows[kStoreMaxGroup];
  // Each slice's per-channel key minima and maxima ([slice][channel], S · D ≤ 8 · threads),
  // then each channel's minimum, scale (as stored) and scale reciprocal.
  __shared__ __align__(16) T part_min[8 * kStoreGroupThreads], part_max[8 * kStoreGroupThreads];
  __shared__ __align__(16) float s_min[kStoreMaxHeadDim], s_recip[kStoreMaxHeadDim];
  __shared__ T s_scale[kStoreMaxHeadDim];
  const uint32_t G = bl.group, D = bl.head_dim, kb = bl.key_bits, vb = bl.value_bits;
  const uint32_t tid = threadIdx.x;

  int32_t *positions = reinterpret_cast<int32_t *>(block + bl.positions + head * bl.positions_head());
  for (uint32_t t = tid; t < G; t += kStoreGroupThreads) {
    positions[row0 + t] = pos(t);
    k_rows[t] = krow(t);
    v_rows[t] = vrow(t);
  }
  __syncthreads();

  const GroupTiling gt(G, D);
  uint8_t *k_codes = block + bl.k_codes + head * bl.k_codes_head();
  uint4 xk[kStoreBatchRows] = {}, xv[kStoreBatchRows] = {};
  gt.load(xk, k_rows, gt.first);  // the first batch of keys and values in flight together
  gt.load(xv, v_rows, gt.first);

  // ---- values: per token over G consecutive channels, within a warp ----
  for (uint32_t b = 0; b < gt.batches; ++b) {
    const uint32_t from = gt.first + b * kStoreBatchRows;
    if (b > 0) gt.load(xv, v_rows, from);
    switch (vb) {
      case 2: value_batch<T, 2>(bl, block, head, row0, gt, xv, from); break;
      case 4: value_batch<T, 4>(bl, block, head, row0, gt, xv, from); break;
      case 8: value_batch<T, 8>(bl, block, head, row0, gt, xv, from); break;
      default: copy_batch(block + bl.v_codes + head * bl.v_codes_head(), bl.v_row_bytes, row0, gt, xv, from);
    }
  }

  // ---- keys: per channel over the G tokens, across the slices ----
  if (kb == 16) {
    for (uint32_t b = 0; b < gt.batches; ++b) {
      const uint32_t from = gt.first + b * kStoreBatchRows;
      if (b > 0) gt.load(xk, k_rows, from);
      copy_batch(k_codes, bl.k_row_bytes, row0, gt, xk, from);
    }
  } else {
    float mn[8], mx[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) mn[j] = INFINITY, mx[j] = -INFINITY;
    for (uint32_t b = 0; b < gt.batches; ++b) {
      const uint32_t from = gt.first + b * kStoreBatchRows;
      if (b > 0) gt.load(xk, k_rows, from);
#pragma unroll
      for (uint32_t i = 0; i < kStoreBatchRows; ++i) {
        if (from + i >= gt.end) break;
        float f[8];
        chunk_floats<T>(xk[i], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          mn[j] = min_after(mn[j], f[j]);
          mx[j] = max_after(mx[j], f[j]);
        }
      }
    }
    if (gt.slice < gt.slices) {
      reinterpret_cast<uint4 *>(part_min + gt.slice * D)[gt.col] = chunk_of<T>(mn);
      reinterpret_cast<uint4 *>(part_max + gt.slice * D)[gt.col] = chunk_of<T>(mx);
    }
    __syncthreads();
    T *scale = reinterpret_cast<T *>(block + bl.k_scale + head * bl.k_scale_head()) + (row0 / G) * D;
    T *minimum = reinterpret_cast<T *>(block + bl.k_min + head * bl.k_scale_head()) + (row0 / G) * D;
    const uint32_t levels = quant_levels(kb);
    for (uint32_t c = tid; c < D; c += kStoreGroupThreads) {
      float lo = INFINITY, hi = -INFINITY;  // slices in token order
      for (uint32_t s = 0; s < gt.slices; ++s) {
        lo = min_after(lo, Tr::to_float(part_min[s * D + c]));
        hi = max_after(hi, Tr::to_float(part_max[s * D + c]));
      }
      const T scale_t = Tr::from_float(group_scale(lo, hi, levels));
      const T min_t = Tr::from_float(lo);
      scale[c] = scale_t;
      minimum[c] = min_t;
      s_scale[c] = scale_t;
      s_min[c] = Tr::to_float(min_t);
      s_recip[c] = quantize_reciprocal(Tr::to_float(scale_t));
    }
    __syncthreads();
    float kmin[8], krecip[8];
#pragma unroll
    for (uint32_t j = 0; j < 8; j += 4) {
      *reinterpret_cast<float4 *>(kmin + j) = *reinterpret_cast<const float4 *>(s_min + gt.col * 8 + j);
      *reinterpret_cast<float4 *>(krecip + j) = *reinterpret_cast<const float4 *>(s_recip + gt.col * 8 + j);
    }
    const T *kscale = s_scale + gt.col * 8;
    for (uint32_t b = 0; b < gt.batches; ++b) {
      const uint32_t from = gt.first + b * kStoreBatchRows;
      if (gt.batches > 1) gt.load(xk, k_rows, from);
      switch (kb) {
        case 2: key_batch<T, 2>(k_codes, bl.k_row_bytes, row0, gt, xk, from, kmin, krecip, kscale); break;
        case 4: key_batch<T, 4>(k_codes, bl.k_row_bytes, row0, gt, xk, from, kmin, krecip, kscale); break;
        default: key_batch<T, 8>(k_codes, bl.k_row_bytes, row0, gt, xk, from, kmin, krecip, kscale); break;
      }
    }
  }
  __syncthreads();
}

}  // namespace kernels
}  // namespace minikv
