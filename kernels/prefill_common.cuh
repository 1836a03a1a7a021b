// Device helpers shared by the prefill kernels (prefill_attention.cu: mma.sync, sm_80+;
// prefill_wgmma.cu: warpgroup MMA, sm_90a).
#pragma once

#include <algorithm>

#include "common.cuh"
#include "launchers.h"
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
// chunks of `chunk` groups of per_group (a group: a KV head's query heads for the forward, 1
// for the score pass), the CTAs of one chunk adjacent, tile by tile, the chunk's heads
// fastest. The CTAs resident at once then stream a few KV heads' K/V (forward) or Q rows
// (score pass) nearly in step, so L2 serves all but the first read. With all heads of a tile
// adjacent instead, the 128K MHA forward (H200) found 28% of its reads in L2 and ran
// DRAM-bound (76% of its bandwidth). A chunk of more than one group (the forward of a short
// launch: head_chunk) keeps the longest tiles from starting in the last round.
struct CtaTileHead {
  uint32_t tile;
  int head;
};
__device__ __forceinline__ CtaTileHead cta_tile_head(uint32_t block, uint32_t tiles, uint32_t per_group,
                                                     uint32_t chunk = 1) {
  const uint32_t heads = chunk * per_group, span = tiles * heads, c = block / span, rest = block - c * span;
  const uint32_t tile = rest / heads;
  return {tile, static_cast<int>(c * heads + (rest - tile * heads))};
}

// KV heads per chunk of a forward or score grid (cta_tile_head; the params'
// kv_heads_per_chunk) whose KV heads take `ctas_per_kv_head` CTAs each and stream
// `bytes_per_kv_head` (K and V for the forward, the group's queries for the score pass): the
// fewest that divide num_kv_heads and give a chunk at least 1.5 rounds of the `resident` CTAs
// a launch holds at once, as long as a chunk streams at most kChunkStreamBytes (a third of an
// H100's or H200's L2, 40% of an A100's). Each chunk runs its longest tiles first; with one
// KV head per chunk, the last head's longest tiles start in the launch's last round and end
// it late. At 4K MHA (32 query tiles of 32 heads, 132 SMs) a schedule simulation puts that at
// 1.13x the balanced time for the forward, the gap measured between the 4K MHA and GQA 32/8
// forwards (same FLOPs), and at 1.29x for the score pass (two CTAs an SM). Over 28-64 heads,
// groups 1-8 and 2-128 tiles the rule stays within 2.5% of the best divisor in that
// simulation; long launches keep one KV head per chunk.
constexpr uint64_t kChunkStreamBytes = uint64_t(16) << 20;
inline uint32_t head_chunk(uint32_t num_kv_heads, uint64_t ctas_per_kv_head, uint64_t resident,
                           uint64_t bytes_per_kv_head) {
  uint32_t chunk = 1;
  for (uint32_t c = 1; c <= num_kv_heads; ++c) {
    if (num_kv_heads % c != 0) continue;
    if (c > 1 && c * bytes_per_kv_head > kChunkStreamBytes) break;
    chunk = c;
    if (2 * c * ctas_per_kv_head >= 3 * resident) break;
  }
  return chunk;
}

// head_chunk of a forward launch (its query heads' CTAs per KV head; K and V of every key
// of its sequences, a chunk's earlier positions included) and of a score launch (its key
// tiles' parts per KV head; the group's query rows), for rows of `row_bytes` (D · sizeof(T)).
inline uint32_t forward_head_chunk(const PrefillAttnParams &p, uint64_t resident, uint64_t row_bytes) {
  uint64_t keys = 0;
  for (uint32_t i = 0; i < p.seqs.n; ++i) keys += uint64_t(p.keys.q_pos[i]) + p.seqs.len[i];
  const uint32_t n_rep = p.num_heads / p.num_kv_heads;
  return head_chunk(p.num_kv_heads, uint64_t(p.seqs.tile_begin[p.seqs.n]) * n_rep, resident, keys * 2 * row_bytes);
}
inline uint32_t score_head_chunk(const PrefillScoreParams &p, uint64_t resident, uint64_t row_bytes) {
  uint64_t rows = 0;
  for (uint32_t i = 0; i < p.seqs.n; ++i) rows += p.seqs.len[i];
  const uint32_t n_rep = p.num_heads / p.num_kv_heads;
  return head_chunk(p.num_kv_heads, uint64_t(p.seqs.tile_begin[p.seqs.n]) * p.parts, resident, rows * n_rep * row_bytes);
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

// ---- The score passes' parts ----------------------------------------------------------
// Both score passes (prefill_scores_kernel on mma.sync, prefill_scores_wgmma_kernel) give a
// CTA one kPrefillKeyTile-key tile of one KV head and stream kScoreQueries-row query tiles
// of the group's heads through it. Key tile j of a prompt sums the query tiles at or after
// it, so the first tile walks every query tile and the last one: in a launch of a wave or
// so (4K under GQA 32/8: 256 CTAs) the longest CTA walks twice the mean. Such a launch
// splits each (key tile, KV head)'s items into `parts` equal runs, one CTA each (adjacent
// CTAs), whose column sums wait in scratch until the last part to arrive adds them in part
// order: deterministic, whichever CTA that is.
constexpr int kScoreQueries = 64;  // query rows per streamed item

// The query tiles [qt0, qt_end) of one query head that the key tile at k0 sums: those with
// a row at a position >= max(row_begin, k0), of the n rows at positions [qp, qp + n).
struct ScoreTileItems {
  int qt0, qt_end;
};
__host__ __device__ inline ScoreTileItems score_tile_items(int n, int qp, int row_begin, int k0) {
  const int first = (row_begin > k0 ? row_begin : k0) - qp;
  const int qt0 = (first > 0 ? first : 0) / kScoreQueries, qt_end = (n + kScoreQueries - 1) / kScoreQueries;
  return {qt0, qt_end > qt0 ? qt_end : qt0};
}

// Part `part` of `parts` of a key tile's n_rep · (qt_end − qt0) items, heads outer: its first
// item's head (of the group) and query tile, and how many items it takes.
struct ScorePartItems {
  int head, qt, count;
};
__host__ __device__ inline ScorePartItems score_part_items(ScoreTileItems t, int n_rep, int parts, int part) {
  const int per_head = t.qt_end - t.qt0, all = n_rep * per_head, share = (all + parts - 1) / parts;
  const int first = part * share < all ? part * share : all;
  return {per_head > 0 ? first / per_head : 0, t.qt0 + (per_head > 0 ? first % per_head : 0),
          share < all - first ? share : all - first};
}

// Parts per (key tile, KV head) of a launch: the fewest that bring the longest CTA's items
// down to the launch's mean items per resident CTA (`slots` of them), at most
// kScoreMaxParts; 1 for a launch of more pairs than the scratch holds (`max_pairs`), or
// without scratch. Sizes only: a graph replays the same grid.
inline uint32_t score_parts(const PrefillScoreParams &p, uint64_t slots, uint64_t max_pairs) {
  const uint64_t pairs = uint64_t(p.seqs.tile_begin[p.seqs.n]) * p.num_kv_heads;
  if (p.part_sums == nullptr || pairs == 0 || pairs > max_pairs) return 1;
  uint64_t total = 0, most = 0;
  for (uint32_t s = 0; s < p.seqs.n; ++s)
    for (uint32_t t = p.seqs.tile_begin[s]; t < p.seqs.tile_begin[s + 1]; ++t) {
      const ScoreTileItems ti = score_tile_items(static_cast<int>(p.seqs.len[s]), static_cast<int>(p.keys.q_pos[s]),
                                                 static_cast<int>(p.row_begin[s]),
                                                 static_cast<int>((t - p.seqs.tile_begin[s]) * kPrefillKeyTile));
      const uint64_t items = uint64_t(ti.qt_end - ti.qt0);
      total += items;
      most = std::max(most, items);
    }
  if (total == 0) return 1;
  total *= p.num_kv_heads;  // items per query head: a factor n_rep of both sides
  return static_cast<uint32_t>(std::min<uint64_t>(std::max<uint64_t>((most * slots + total - 1) / total, 1),
                                                  kScoreMaxParts));
}

// A score CTA's (key tile, KV head) pair of the launch (cta_tile_head's block index) and its
// part of it: a pair's parts are adjacent CTAs.
struct ScoreCta {
  uint32_t parts, pair, part;
};
__device__ __forceinline__ ScoreCta score_cta(const PrefillScoreParams &p) {
  const uint32_t parts = p.parts > 1 ? p.parts : 1, pair = blockIdx.x / parts;
  return {parts, pair, blockIdx.x - pair * parts};
}

// The end of a CTA's part (every thread calls it): x[i], the part's column sum of its tile's
// key key_of(i) held by the owner threads, goes to scratch, and the CTA arrives on its
// pair's counter. In the pair's last part to arrive, x becomes the sum of every part's, in
// part order, the counter is reset for the next launch, and the call returns true; false
// elsewhere. The fences order every part's sums before its arrival, and the last part's
// reads (from L2: __ldcg) after it. (decode_common.cuh arrive_last_split is the one-warp
// counterpart.)
template <int K, typename KeyOf>
__device__ __forceinline__ bool sum_score_parts(const PrefillScoreParams &p, const ScoreCta &c, float (&x)[K],
                                                KeyOf key_of, bool owner) {
  auto sum_of = [&](uint32_t part, int i) {
    return p.part_sums + (uint64_t(part) * p.part_stride + c.pair) * kPrefillKeyTile + key_of(i);
  };
  __shared__ uint32_t arrived_last;
#pragma unroll
  for (int i = 0; i < K; ++i)
    if (owner) *sum_of(c.part, i) = x[i];
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) arrived_last = atomicAdd(p.part_counters + c.pair, 1u) + 1 == c.parts;
  __syncthreads();
  if (!arrived_last) return false;
  __threadfence();
  if (threadIdx.x == 0) p.part_counters[c.pair] = 0;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    x[i] = 0.0f;
    if (owner)
      for (uint32_t q = 0; q < c.parts; ++q) x[i] += __ldcg(sum_of(q, i));
  }
  return true;
}

}  // namespace kernels
}  // namespace minikv
