// Device helpers shared by the prefill kernels (prefill_attention.cu: mma.sync, sm_80+;
// prefill_wgmma.cu: warpgroup MMA, sm_90a).
#pragma once

#include "common.cuh"
#include "params.h"

namespace minikv {
namespace kernels {

// 4-byte cp.async (zero-filled when !valid): LSE rows have no 16-byte alignment.
__device__ __forceinline__ void cp_async_4(void *smem, const void *gmem, bool valid) {
#ifdef MINIKV_WARP_EMULATION
  emulation::cp_async(smem_addr(smem), gmem, 4, valid);
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(valid ? 4 : 0));
#endif
}

// A CTA's (tile, head) from blockIdx.x in a grid of tiles × heads: the heads are taken in
// groups of per_group (a KV head's query heads for the forward, 1 for the score pass), the
// CTAs of one group adjacent, tile by tile, the group's heads fastest. The CTAs resident at
// once then stream one KV head's K/V (forward) or Q rows (score pass) nearly in step, so L2
// serves all but the first read. With all heads of a tile adjacent instead, the 128K MHA
// forward (H200) found 28% of its reads in L2 and ran DRAM-bound (76% of its bandwidth).
struct CtaTileHead {
  uint32_t tile;
  int head;
};
__device__ __forceinline__ CtaTileHead cta_tile_head(uint32_t block, uint32_t tiles, uint32_t per_group) {
  const uint32_t span = tiles * per_group, group = block / span, rest = block - group * span;
  return {rest / per_group, static_cast<int>(group * per_group + rest % per_group)};
}

// Sequence of a launch-wide tile index.
__device__ __forceinline__ uint32_t find_seq(const PrefillSeqs &s, uint32_t tile) {
  uint32_t i = 0;
  while (i + 1 < s.n && s.tile_begin[i + 1] <= tile) ++i;
  return i;
}

// The two forward kernels (mma.sync and wgmma) hold a 16-row m-tile of scores in the same
// fragment layout: s[4i + 2r + c] is key k0 + 8i + 2tq + c of row row0 + g + 8r (g = lane / 4,
// tq = lane % 4), and O's fragment o[4i + 2r + c] is channel 8i + 2tq + c of the same rows.
// A K/V tile of N / 2 keys fills s[N] (64 keys: N = 32; 32 keys at head_dim 256: N = 16).

// Causal + length mask of one m-tile against the K/V tile at k0: masked when 8i + c exceeds
// min(row − k0 − 2tq, L − 1 − k0 − 2tq), whose left side is a compile-time constant: one
// compare + select per score.
template <int N>
__device__ __forceinline__ void mask_mtile(float (&s)[N], int row0, int k0, int L, int g, int tq) {
  const int len_lim = L - 1 - k0 - 2 * tq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int lim = min(row0 + g + 8 * r - k0 - 2 * tq, len_lim);
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (8 * i + c > lim) s[4 * i + 2 * r + c] = -INFINITY;
  }
}

// Online softmax of one m-tile in log2 units on raw scores (the scale folded into one FFMA
// before ex2), in three steps: the new row maxima (row_max_mtile), the rescale of the rows'
// earlier sums and outputs when a maximum moved, then p = 2^(s·scale − max·scale) in place
// of s with the rows' sums (exp_mtile).
template <int N>
__device__ __forceinline__ void row_max_mtile(const float (&s)[N], const float (&m)[2], float (&mx)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = m[r];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) mx[r] = fmaxf(mx[r], fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
}
// Updates m to mx, turns s into p and adds this thread's part of each row's sum to l.
template <int N>
__device__ __forceinline__ void exp_mtile(float (&s)[N], float (&m)[2], const float (&mx)[2],
                                          float (&l)[2], float scale) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = mx[r];
    const float base = mx[r] == -INFINITY ? 0.0f : mx[r] * scale;  // no key yet: keep 0s
    float rs = 0.0f;
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float pr = ex2(fmaf(s[4 * i + 2 * r + c], scale, -base));
        s[4 * i + 2 * r + c] = pr;
        rs += pr;
      }
    l[r] += rs;
  }
}
// The factor by which a row's earlier sums and outputs shrink when its maximum moves from m to mx.
__device__ __forceinline__ float rescale_factor(float m, float mx, float scale) {
  const float base = mx == -INFINITY ? 0.0f : mx * scale;
  return ex2(fmaf(m, scale, -base));
}

// All three steps with the output rescaled in place (the mma.sync forward, whose P·V is
// synchronous). Rescale only when a row maximum of the m-tile moved (warp-uniform branch):
// an unmoved row's factor is ex2(0) = 1 exactly, so skipping is bit-identical; after the
// first tiles most maxima stay put and the D/2 FMULs are saved.
template <int D, int N>
__device__ __forceinline__ void online_softmax_mtile(float (&s)[N], float (&o)[D / 2],
                                                     float (&m)[2], float (&l)[2], float scale) {
  float mx[2];
  row_max_mtile(s, m, mx);
  if (__any_sync(0xffffffffu, mx[0] != m[0] || mx[1] != m[1])) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float corr = rescale_factor(m[r], mx[r], scale);
      l[r] *= corr;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        o[4 * i + 2 * r] *= corr;
        o[4 * i + 2 * r + 1] *= corr;
      }
    }
  }
  exp_mtile(s, m, mx, l, scale);
}

// The same with the output's rescale left to the caller (the sm_90a forward applies it once
// its asynchronous P·V of the previous tile has finished): returns whether a row maximum of
// the warp moved (warp-uniform); then corr holds the rows' factors (rescale_o_mtile), and l
// is already rescaled.
template <int N>
__device__ __forceinline__ bool softmax_mtile(float (&s)[N], float (&m)[2], float (&l)[2],
                                              float scale, float (&corr)[2]) {
  float mx[2];
  row_max_mtile(s, m, mx);
  const bool moved = __any_sync(0xffffffffu, mx[0] != m[0] || mx[1] != m[1]);
  if (moved) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      corr[r] = rescale_factor(m[r], mx[r], scale);
      l[r] *= corr[r];
    }
  }
  exp_mtile(s, m, mx, l, scale);
  return moved;
}
template <int D>
__device__ __forceinline__ void rescale_o_mtile(float (&o)[D / 2], const float (&corr)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[4 * i + 2 * r] *= corr[r];
      o[4 * i + 2 * r + 1] *= corr[r];
    }
}

}  // namespace kernels
}  // namespace minikv
