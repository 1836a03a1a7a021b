// Prefill attention with importance scores, for ragged batches (sequences packed back to
// back), tensor cores through mma.sync m16n8k16 (sm_80+), fp32 accumulation.
//
// Pass 1 (prefill_attention_kernel): FlashAttention-2 forward. One CTA = 128 query rows of
//   one query head (4 warps × 32 rows: two 16-row m-tiles share every K/V fragment read
//   from shared memory; head_dim 256: 8 warps × 16 rows, PrefillTiling); K/V tiles of 64 keys up to the causal diagonal, double-buffered by
//   cp.async one tile ahead; online softmax on raw scores with the scale folded into the
//   exponent (log2 units); writes out and the row LSE (fp32, log2 units) to a workspace.
//   A few KV heads' tiles run together, the longest (last) query tiles first (cta_tile_head).
// Pass 2 (prefill_scores_kernel): one CTA = 128 key columns of one KV head, transposed:
//   each warp keeps its 32 keys in registers as the A operand and streams 64-query tiles
//   (with their LSE) as B, S^T = K·Q^T, for every query tile on or below the diagonal
//   (tiles above it are never visited) and every query head of the GQA group; it adds
//   exp2(s - LSE) — the exact normalized probabilities — into per-key sums held in
//   registers. Each column is owned by one thread and summed in a fixed order:
//   deterministic, no atomics, no L×L buffer.
// WINDOW mode's pass (prefill_window_scores_kernel): the window's rows against every scored
//   key, a dense product with the rows held in shared memory and the keys streamed (below).
// Chunked prefill (params.h PrefillKeys): a launch's rows of a sequence may be a chunk of
//   its prompt, at prompt positions [q_pos, q_pos + len), over keys [0, q_pos + len) read
//   from the prompt's staging rows; pass 2 then adds the chunk's part of each column to the
//   sums of the earlier chunks (one owner thread per column: still no atomics).
#include <algorithm>

#include "dispatch.cuh"
#include "prefill_common.cuh"
#include "launchers.h"
#include "programmatic_launch.h"

namespace minikv {
namespace kernels {
namespace {

constexpr int kBM = static_cast<int>(kPrefillQueryTile);    // forward: query rows per CTA
constexpr int kSK = static_cast<int>(kPrefillKeyTile);      // scores: key columns per CTA
constexpr int kSQ = kScoreQueries;                          // scores: queries per streamed tile
static_assert(kSK == kBM, "both kernels split 128 rows over their warps alike");

/// Warps of a CTA, 16-row m-tiles per warp and keys per forward K/V tile, per head_dim. Two
/// m-tiles per warp share every K/V fragment read from shared memory (4 warps × 32 rows), up
/// to D = 128; at D = 256 two m-tiles' O accumulators (or score-pass key fragments) do not
/// fit the registers, so 8 warps take 16 rows each (FlashAttention-2's head_dim-256 tiling),
/// and K/V tiles of 32 keys keep the forward's shared memory (Q + two K/V stages) at 135 KB,
/// within an A100's 163 KB.
/// \tparam D head_dim
template <int D> struct PrefillTiling {
  static constexpr int kMT = D <= 128 ? 2 : 1;       // m-tiles per warp
  static constexpr int kWarpRows = 16 * kMT;         // query rows (scores: keys) per warp
  static constexpr int kWarps = kBM / kWarpRows;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBN = D <= 128 ? 64 : 32;     // forward: keys per K/V tile
  // Full K/V/Q tiles load through a fixed per-thread chunk where a whole number of rows
  // takes every thread (D / 8 divides kThreads); head_dim 80 and 96 index each chunk.
  static constexpr bool kFixedChunk = kThreads % (D / 8) == 0;
};

template <int D> __host__ __device__ constexpr int smem_stride() { return D + 8; }  // +16 B: conflict-free ldmatrix

// cp.async of rows [0, ROWS) of a tile (row r at base + r * row_stride elements) into
// shared [ROWS][D + 8] by the CTA's NT threads; rows >= valid_rows are zero-filled without
// reading memory.
template <typename T, int D, int ROWS, int NT = PrefillTiling<D>::kThreads>
__device__ __forceinline__ void load_tile(T *smem, const T *base, int64_t row_stride,
                                          int valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static_assert(ROWS * kChunks % NT == 0, "whole chunks per thread");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / NT; ++it) {
    const int i = it * NT + threadIdx.x;
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const bool ok = r < valid_rows;
    cp_async_16(smem + r * smem_stride<D>() + c, ok ? base + r * row_stride + c : base, ok);
  }
}

// cp.async of a tile whose ROWS rows all lie inside the sequence (every K/V tile but a
// sequence's last): no predicate, no clamp. smem_t / src_t are this thread's first chunk
// (row threadIdx.x / (D / 8), chunk threadIdx.x % (D / 8)); chunk `it` is kRowsPerIt rows on.
// Only where PrefillTiling<D>::kFixedChunk.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_full_tile(T *smem_t, const T *src_t, int64_t row_stride) {
  static_assert(PrefillTiling<D>::kFixedChunk, "a whole number of rows per pass");
  constexpr int kRowsPerIt = PrefillTiling<D>::kThreads / (D / 8);
#pragma unroll
  for (int it = 0; it < ROWS / kRowsPerIt; ++it)
    cp_async_16(smem_t + it * kRowsPerIt * smem_stride<D>(), src_t + it * kRowsPerIt * row_stride,
                true);
}

// A fragment (16 rows × 16 of the k dimension at kk) of rows [row0, row0 + 16) of a
// shared [rows][D + 8] tile.
template <typename T, int D>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const T *tile, int row0, int kk,
                                            int lane) {
  ldmatrix_x4(a, tile + (row0 + (lane % 8) + ((lane / 8) % 2) * 8) * smem_stride<D>() + kk * 16 +
                     (lane / 16) * 8);
}

// B fragments of n-tiles 2·np and 2·np + 1 at k-step kk, from a shared [64][D + 8] tile
// whose rows are the n (column) index.
template <typename T, int D>
__device__ __forceinline__ void load_b_frags(uint32_t (&b)[4], const T *tile, int np, int kk,
                                             int lane) {
  ldmatrix_x4(b, tile + (np * 16 + (lane % 8) + (lane / 16) * 8) * smem_stride<D>() + kk * 16 +
                     ((lane / 8) % 2) * 8);
}

/// \tparam T dtype of q/k/v/out (__half or __nv_bfloat16)
/// \tparam D head_dim (64, 80, 96, 128, 256)
/// 2 CTAs/SM (8 warps): 255 registers at D = 128; its 64 B of spills are the clamped cp.async
/// addresses of a sequence's last (partial) K/V tile, off the per-tile path. D = 256: one
/// CTA of 8 warps per SM (135 KB of shared memory).
template <typename T, int D>
__global__ void __launch_bounds__(PrefillTiling<D>::kThreads, PrefillTiling<D>::kWarps == 4 ? 2 : 1)
    prefill_attention_kernel(const __grid_constant__ PrefillAttnParams p) {
  using Tl = PrefillTiling<D>;
  constexpr int MT = Tl::kMT, kBN = Tl::kBN, kNS = kBN / 2;  // kNS: scores of an m-tile row pair
  pdl_launch_dependents();  // the score pass may start behind the last wave (launchers.h)
  MINIKV_DYNAMIC_SMEM(smem_raw, 16);
  constexpr int S = smem_stride<D>();
  T *q_s = reinterpret_cast<T *>(smem_raw);  // [kBM][S]; the warp's rows stage O at the end
  T *k_s = q_s + kBM * S;                    // [2][kBN][S]
  T *v_s = k_s + 2 * kBN * S;                // [2][kBN][S]

  const CtaTileHead th = cta_tile_head(blockIdx.x, p.seqs.tile_begin[p.seqs.n], p.num_heads / p.num_kv_heads,
                                           p.kv_heads_per_chunk);
  const uint32_t tile = th.tile;
  const int h = th.head;
  const uint32_t seq = find_seq(p.seqs, tile);
  // n query rows at prompt positions [qp, qp + n) over the keys [0, L) (params.h PrefillKeys).
  const int n = static_cast<int>(p.seqs.len[seq]), qp = static_cast<int>(p.keys.q_pos[seq]);
  const int L = qp + n;
  const uint32_t last = p.seqs.tile_begin[seq + 1] - 1;
  const int q0 = static_cast<int>(last - tile) * kBM;  // longest query tiles first
  const int qa = qp + q0;  // prompt position of the tile's first row
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const int64_t tb = p.seqs.token_begin[seq], kb = p.keys.kv_begin[seq];
  const int64_t q_stride = int64_t(p.num_heads) * D, kv_stride = int64_t(p.num_kv_heads) * D;
  const T *q = static_cast<const T *>(p.q) + tb * q_stride + int64_t(h) * D;
  const T *k = static_cast<const T *>(p.k) + kb * kv_stride + int64_t(kvh) * D;
  const T *v = static_cast<const T *>(p.v) + kb * kv_stride + int64_t(kvh) * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int wrow = warp * Tl::kWarpRows;  // this warp's rows in the tile: m-tile mt = wrow + 16 mt
  const float scale = p.scale_log2;

  load_tile<T, D, kBM>(q_s, q + q0 * q_stride, q_stride, n - q0);
  load_tile<T, D, kBN>(k_s, k, kv_stride, L);
  load_tile<T, D, kBN>(v_s, v, kv_stride, L);
  cp_async_commit();

  // This thread's cp.async chunk of full K/V tiles: a running global offset (elements, one
  // register pair for K and V alike) and a shared offset, so a prefetch costs 16 LDGSTS and
  // a few adds instead of per-chunk index math and clamps (v2 spilled those addresses).
  // Without a fixed chunk (head_dim 80, 96) full tiles go through load_tile.
  [[maybe_unused]] const int chunk_s = (threadIdx.x / (D / 8)) * S + (threadIdx.x % (D / 8)) * 8;
  const int64_t tile_step = int64_t(kBN) * kv_stride;
  [[maybe_unused]] int64_t next_off = tile_step + int64_t(threadIdx.x / (D / 8)) * kv_stride +
                                      (threadIdx.x % (D / 8)) * 8;  // chunk of tile j + 1

  const int n_kv = min((L + kBN - 1) / kBN, (qa + kBM - 1) / kBN + 1);  // up to the diagonal
  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
  // Per row (m-tile, g / g + 8): running max of the raw scores and this thread's partial sum.
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[mt][r] = -INFINITY;
      l[mt][r] = 0.0f;
    }

  for (int j = 0; j < n_kv; ++j) {
    const int k0 = j * kBN;
    const T *ks = k_s + (j & 1) * kBN * S;
    const T *vs = v_s + (j & 1) * kBN * S;
    if (j + 1 < n_kv) {  // stage (j + 1) & 1 was released by the barrier ending iteration j - 1
      const int nk0 = k0 + kBN, st = ((j + 1) & 1) * kBN * S;
      if (nk0 + kBN <= L) {
        if constexpr (Tl::kFixedChunk) {
          load_full_tile<T, D, kBN>(k_s + st + chunk_s, k + next_off, kv_stride);
          load_full_tile<T, D, kBN>(v_s + st + chunk_s, v + next_off, kv_stride);
        } else {
          load_tile<T, D, kBN>(k_s + st, k + nk0 * kv_stride, kv_stride, kBN);
          load_tile<T, D, kBN>(v_s + st, v + nk0 * kv_stride, kv_stride, kBN);
        }
      } else {
        load_tile<T, D, kBN>(k_s + st, k + nk0 * kv_stride, kv_stride, L - nk0);
        load_tile<T, D, kBN>(v_s + st, v + nk0 * kv_stride, kv_stride, L - nk0);
      }
      next_off += tile_step;
      cp_async_commit();
      cp_async_wait<1>();  // tile j (and Q) have landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // Every key of the tile lies after every row of this warp (only on the diagonal's last
    // tile): the scores would all be masked, p = 0 and the row maxima unchanged, so skipping
    // the tile leaves o, m and l bit-identical.
    if (k0 <= qa + wrow + Tl::kWarpRows - 1) {
      float s[MT][kBN / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a_frag<T, D>(a[mt], q_s, wrow + 16 * mt, kk, lane);
#pragma unroll
        for (int np = 0; np < kBN / 16; ++np) {
          uint32_t b[4];
          load_b_frags<T, D>(b, ks, np, kk, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
            mma_16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }

      // Causal + length mask only on tiles that reach past the warp's first row or past L;
      // then the online softmax, one 16-row m-tile at a time (prefill_common.cuh).
      if (k0 + kBN - 1 > qa + wrow || k0 + kBN > L) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          mask_mtile(reinterpret_cast<float(&)[kNS]>(s[mt]), qa + wrow + 16 * mt, k0, L, g, tq);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        online_softmax_mtile<D>(reinterpret_cast<float(&)[kNS]>(s[mt]),
                                reinterpret_cast<float(&)[D / 2]>(o[mt]), m[mt], l[mt], scale);

      // O += P · V_j, P straight from the score registers.
#pragma unroll
      for (int kc = 0; kc < kBN / 16; ++kc) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = DType<T>::pack2(s[mt][2 * kc][0], s[mt][2 * kc][1]);
          a[mt][1] = DType<T>::pack2(s[mt][2 * kc][2], s[mt][2 * kc][3]);
          a[mt][2] = DType<T>::pack2(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
          a[mt][3] = DType<T>::pack2(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vs + (kc * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * S + dp * 16 +
                                   (lane / 16) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(o[mt][2 * dp], a[mt], b[0], b[1]);
            mma_16816<T>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with stage j & 1 (refilled in iteration j + 1)
  }

  // O through shared memory: this warp's rows of q_s (read only by this warp, and no
  // longer) take the normalized rows, then each row leaves as 16-byte stores, 2 rows per
  // warp instruction at D = 128, instead of 4-byte stores that fill 16 B of each 32 B sector.
  float *lse = p.lse + int64_t(h) * p.ws_tokens + p.seqs.ws_offset[seq];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int trow = wrow + 16 * mt + g + 8 * r;
      const float inv = 1.0f / sum;
      uint32_t *dst = reinterpret_cast<uint32_t *>(q_s + trow * S + 2 * tq);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        dst[dt * 4] = output_pair<T>(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      const float base = m[mt][r] == -INFINITY ? 0.0f : m[mt][r] * scale;
      if (tq == 0 && q0 + trow < n) lse[q0 + trow] = base + log2f(sum);
    }
  __syncwarp();
  T *out = static_cast<T *>(p.out) + tb * q_stride + int64_t(h) * D;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  if constexpr (32 % kChunks == 0) {
    constexpr int kRowsPerIt = 32 / kChunks;
    const int r0 = wrow + lane / kChunks, c = (lane % kChunks) * 8;
    const int rows_left = n - q0 - r0;  // store row r0 + it·kRowsPerIt while it·kRowsPerIt < this
    T *dst = out + int64_t(q0 + r0) * q_stride + c;
    const int64_t dst_step = kRowsPerIt * q_stride;
#pragma unroll
    for (int it = 0; it < Tl::kWarpRows / kRowsPerIt; ++it, dst += dst_step)
      if (it * kRowsPerIt < rows_left)
        *reinterpret_cast<uint4 *>(dst) =
            *reinterpret_cast<const uint4 *>(q_s + (r0 + it * kRowsPerIt) * S + c);
  } else {  // head_dim 80, 96: chunk i of the warp's rows is row i / kChunks
#pragma unroll
    for (int i = lane; i < Tl::kWarpRows * kChunks; i += 32) {
      const int r = wrow + i / kChunks, c = (i % kChunks) * 8;
      if (q0 + r < n)
        *reinterpret_cast<uint4 *>(out + int64_t(q0 + r) * q_stride + c) =
            *reinterpret_cast<const uint4 *>(q_s + r * S + c);
    }
  }
}

/// \tparam T dtype of q/k (__half or __nv_bfloat16)
/// \tparam D head_dim (64, 80, 96, 128, 256)
/// 3 CTAs/SM (12 warps): 168 registers at D = 128 on sm_80; its 64 B of spills (none on
/// sm_90a) serve the clamped cp.async of a sequence's last (partial) Q tile, off the
/// per-tile path. D = 256: 8 warps
/// of 16 keys, one CTA per SM (135 KB of shared memory).
template <int D> constexpr int scores_ctas_per_sm() { return PrefillTiling<D>::kWarps == 4 ? 3 : 1; }
template <typename T, int D>
__global__ void __launch_bounds__(PrefillTiling<D>::kThreads, scores_ctas_per_sm<D>())
    prefill_scores_kernel(const __grid_constant__ PrefillScoreParams p) {
  using Tl = PrefillTiling<D>;
  constexpr int MT = Tl::kMT;
  MINIKV_DYNAMIC_SMEM(smem_raw, 16);
  constexpr int S = smem_stride<D>();
  T *k_s = reinterpret_cast<T *>(smem_raw);                    // [kSK][S]
  T *q_s = k_s + kSK * S;                                      // [2][kSQ][S]
  float *lse_s = reinterpret_cast<float *>(q_s + 2 * kSQ * S);  // [2][kSQ]
  pdl_launch_dependents();

  const ScoreCta sc = score_cta(p);  // its part (prefill_common.cuh)
  const CtaTileHead th = cta_tile_head(sc.pair, p.seqs.tile_begin[p.seqs.n], 1, p.kv_heads_per_chunk);
  const uint32_t tile = th.tile;
  const int kvh = th.head;
  const uint32_t seq = find_seq(p.seqs, tile);
  // n query rows (and their LSE) at prompt positions [qp, qp + n), keys [0, L) from kv_begin.
  const int n = static_cast<int>(p.seqs.len[seq]), qp = static_cast<int>(p.keys.q_pos[seq]);
  const int L = qp + n;
  const int k0 = static_cast<int>(tile - p.seqs.tile_begin[seq]) * kSK;  // longest first
  const int n_rep = p.num_heads / p.num_kv_heads;
  const int row_begin = static_cast<int>(p.row_begin[seq]);  // a prompt position
  const int64_t tb = p.seqs.token_begin[seq];
  const uint32_t ws_off = p.seqs.ws_offset[seq];
  const int64_t q_stride = int64_t(p.num_heads) * D, kv_stride = int64_t(p.num_kv_heads) * D;
  const T *k = static_cast<const T *>(p.k) + (p.keys.kv_begin[seq] + k0) * kv_stride + int64_t(kvh) * D;
  const float scale = p.scale_log2;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int wkey = k0 + warp * Tl::kWarpRows;  // this warp's keys: m-tile mt = wkey + 16 mt
  // The masks compare in query-row coordinates (position - qp): keys and the window's first
  // position shifted once here, not per tile.
  const int k0_row = k0 - qp, wkey_row = wkey - qp, row_first = row_begin - qp;

  // Query tiles (of the n rows) with a row at a position >= max(row_begin, k0): on or below
  // the diagonal, in the window; this CTA's part of them: `total` items from head
  // first.head, tile first.qt.
  const ScoreTileItems items = score_tile_items(n, qp, row_begin, k0);
  const int qt0 = items.qt0, qt_end = items.qt_end;
  const ScorePartItems first = score_part_items(items, n_rep, static_cast<int>(sc.parts), static_cast<int>(sc.part));
  const int total = first.count;
  // This thread's cp.async chunk of a full Q tile (see the forward kernel).
  [[maybe_unused]] const int64_t chunk_off =
      int64_t(threadIdx.x / (D / 8)) * q_stride + (threadIdx.x % (D / 8)) * 8;
  [[maybe_unused]] const int chunk_s = (threadIdx.x / (D / 8)) * S + (threadIdx.x % (D / 8)) * 8;
  // Queue item `it`: query tile qt of head h, into buffer `it & 1`. Items are issued in order
  // and (h, qt) advances by counters: no division per item, and full tiles (all but a
  // sequence's last) load without predicates.
  auto issue = [&](int it, int h, int qt) {
    const T *src =
        static_cast<const T *>(p.q) + (tb + int64_t(qt) * kSQ) * q_stride + int64_t(h) * D;
    T *dst = q_s + (it & 1) * kSQ * S;
    const int row = qt * kSQ + threadIdx.x;
    if (qt * kSQ + kSQ <= n) {
      if constexpr (Tl::kFixedChunk) load_full_tile<T, D, kSQ>(dst + chunk_s, src + chunk_off, q_stride);
      else load_tile<T, D, kSQ>(dst, src, q_stride, kSQ);
    } else {
      load_tile<T, D, kSQ>(dst, src, q_stride, n - qt * kSQ);
    }
    if (threadIdx.x < kSQ) {
      const float *lse = p.lse + int64_t(h) * p.ws_tokens + ws_off;
      cp_async_4(lse_s + (it & 1) * kSQ + threadIdx.x, row < n ? lse + row : lse, row < n);
    }
  };
  int nh = kvh * n_rep + first.head, nqt = first.qt;  // the next item to issue
  auto advance = [&](int &h, int &qt) {
    if (++qt == qt_end) {
      qt = qt0;
      ++h;
    }
  };

  if (total > 0) load_tile<T, D, kSK>(k_s, k, kv_stride, L - k0);  // (a part without items only adds its zero sums)
  pdl_wait();  // the forward's LSE, read by every item's issue
  if (total > 0) {
    issue(0, nh, nqt);
    advance(nh, nqt);
    cp_async_commit();
  }

  float cs[MT][2];  // keys (m-tile, g / g + 8), this thread's queries
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) cs[mt][0] = cs[mt][1] = 0.0f;
  uint32_t ka[MT][D / 16][4];
  int cur_qt = first.qt;  // query tile of item it

  for (int it = 0; it < total; ++it) {
    if (it + 1 < total) {  // buffer (it + 1) & 1 was released by the barrier ending it - 1
      issue(it + 1, nh, nqt);
      advance(nh, nqt);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          load_a_frag<T, D>(ka[mt][kk], k_s, warp * Tl::kWarpRows + 16 * mt, kk, lane);
    }
    const T *qs = q_s + (it & 1) * kSQ * S;
    const float *ls = lse_s + (it & 1) * kSQ;

    float s[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        load_b_frags<T, D>(b, qs, np, kk, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(s[mt][2 * np], ka[mt][kk], b[0], b[1]);
          mma_16816<T>(s[mt][2 * np + 1], ka[mt][kk], b[2], b[3]);
        }
      }

    // s[mt][nt][e]: key wkey + 16 mt + g + 8 (e / 2), query row i0 + 8 nt + 2 tq + (e & 1)
    // (prompt position qp + that).
    const int i0 = cur_qt * kSQ;
    if (++cur_qt == qt_end) cur_qt = qt0;
    if (i0 >= k0_row + kSK - 1 && i0 + kSQ <= n && i0 >= row_first) {  // no key or query masked
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 lv = *reinterpret_cast<const float2 *>(ls + nt * 8 + 2 * tq);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            cs[mt][e / 2] += ex2(fmaf(s[mt][nt][e], scale, -(e & 1 ? lv.y : lv.x)));
      }
    } else {
      // Query offset 8 nt + (e & 1) (a constant) is kept when lo <= it <= hi, i.e. key <=
      // query, query >= row_begin and query row < n: two compares + one select per score.
      const int hi = n - 1 - i0 - 2 * tq;
      int lo[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          lo[mt][r] = max(wkey_row + 16 * mt + g + 8 * r, row_first) - i0 - 2 * tq;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 lv = *reinterpret_cast<const float2 *>(ls + nt * 8 + 2 * tq);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int x = nt * 8 + (e & 1);
            const bool ok = x >= lo[mt][e / 2] && x <= hi;
            const float y = ex2(fmaf(s[mt][nt][e], scale, -(e & 1 ? lv.y : lv.x)));
            cs[mt][e / 2] += ok ? y : 0.0f;
          }
      }
    }
    __syncthreads();  // buffer it & 1 is refilled by iteration it + 1's prefetch of it + 2
  }

  // Key totals: the 4 lanes of a quad hold the same keys (different queries). A column an
  // earlier chunk of the prompt summed (below col_done) adds this chunk's part to it.
  // Split into parts: every part's sums, added in part order by the last to arrive. Sum i
  // of this thread is key wkey + 16 (i / 2) + g + 8 (i % 2).
  float *scores = p.scores + int64_t(kvh) * p.scores_stride + p.score_offset[seq];
  const int col_done = static_cast<int>(p.col_done[seq]);
  float x[2 * MT];
  auto key_of = [&](int i) { return wkey + 16 * (i / 2) + g + 8 * (i % 2); };
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    x[i] = cs[i / 2][i % 2];
    x[i] += __shfl_xor_sync(0xffffffffu, x[i], 1);
    x[i] += __shfl_xor_sync(0xffffffffu, x[i], 2);
  }
  if (sc.parts > 1 && !sum_score_parts(p, sc, x, [&](int i) { return key_of(i) - k0; }, tq == 0)) return;
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    const int key = key_of(i);
    if (tq == 0 && key < static_cast<int>(p.col_end[seq]))
      scores[key] = key < col_done ? scores[key] + x[i] : x[i];
  }
}

// ---- WINDOW scores ---------------------------------------------------------------------
// The window's rows (prompt positions >= row_begin) come after every scored key (col_end <=
// row_begin), so no causal mask applies and every key column sums the same rows: a dense
// (keys × window rows) product. One CTA = tiles_per_cta consecutive kWinKeys-key tiles of
// one KV head: the window rows of all n_rep query heads ((head, row) pairs, at most rows_cap
// of them per batch) wait in shared memory, loaded once per batch, while the key tiles stream
// through two cp.async stages; warp w's 16 keys of a tile are the mma's M rows and the pairs
// its N columns. A key's sum is added by one thread in a fixed order (batch, row chunk,
// n-tile, query): deterministic, no atomics, no L×L buffer. The general score pass instead
// gives each CTA one 128-key tile and streams the window's query tiles through it, so at 32K
// it spends more on per-CTA setup than on its 4 MB of keys per head.
constexpr int kWinKeys = 64;     // keys per streamed tile, 16 per warp
constexpr int kWinThreads = 128;
constexpr int kWinChunk = 64;    // pairs per row chunk: 8 n-tiles of accumulators
// (head, row) pairs per batch of window rows in shared memory.
__host__ __device__ constexpr uint32_t win_rows_max(uint32_t head_dim) { return head_dim > 128 ? 128 : 256; }
// Batches a launch may take: each batch streams every key again.
constexpr uint32_t kWinMaxBatches = 4;
// 128 registers (4 CTAs per SM where shared memory allows; ~20 B of spills of loop-invariant
// addresses at head_dim 128) instead of 142 (3 CTAs).

struct WindowScoreArgs {
  PrefillScoreParams p;
  uint32_t tiles_per_cta;  // kWinKeys-key tiles per CTA
  uint32_t rows_cap;       // pairs per batch: a multiple of kWinChunk, <= win_rows_max(D)
};

template <typename T, int D> __host__ __device__ constexpr size_t window_scores_smem(uint32_t rows_cap) {
  return (size_t(rows_cap) + 2 * kWinKeys) * smem_stride<D>() * sizeof(T) + size_t(rows_cap) * sizeof(float);
}

/// \tparam T dtype of q/k (__half or __nv_bfloat16)
/// \tparam D head_dim (64, 80, 96, 128, 256)
template <typename T, int D>
__global__ void __launch_bounds__(kWinThreads, 4) prefill_window_scores_kernel(const __grid_constant__ WindowScoreArgs a) {
  const PrefillScoreParams &p = a.p;
  constexpr int S = smem_stride<D>();
  MINIKV_DYNAMIC_SMEM(smem_raw, 16);
  T *q_s = reinterpret_cast<T *>(smem_raw);  // [rows_cap][S]: the batch's (head, row) pairs
  T *k_s = q_s + a.rows_cap * S;             // [2][kWinKeys][S]
  float *lse_s = reinterpret_cast<float *>(k_s + 2 * kWinKeys * S);  // [rows_cap]
  pdl_launch_dependents();

  // The CTA's sequence and its tiles: each sequence has ceil(tiles / tiles_per_cta) CTAs.
  uint32_t cta = blockIdx.x, seq = 0;
  for (; seq + 1 < p.seqs.n; ++seq) {
    const uint32_t tiles = (p.col_end[seq] + kWinKeys - 1) / kWinKeys;
    const uint32_t ctas = (tiles + a.tiles_per_cta - 1) / a.tiles_per_cta;
    if (cta < ctas) break;
    cta -= ctas;
  }
  const int kvh = static_cast<int>(blockIdx.y);
  const int n = static_cast<int>(p.seqs.len[seq]), qp = static_cast<int>(p.keys.q_pos[seq]);
  const int col_end = static_cast<int>(p.col_end[seq]), col_done = static_cast<int>(p.col_done[seq]);
  const int tiles = (col_end + kWinKeys - 1) / kWinKeys;
  const int t_begin = static_cast<int>(cta * a.tiles_per_cta);
  const int t_end = min(t_begin + static_cast<int>(a.tiles_per_cta), tiles);
  if (t_begin >= t_end) return;  // (the launch's other CTAs pdl_wait)
  const int n_rep = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int row_first = max(static_cast<int>(p.row_begin[seq]) - qp, 0);  // the chunk's first window row
  const int wrows = n - row_first;                                         // > 0 (chunk_scores)
  const int pairs = n_rep * wrows;
  const int64_t tb = p.seqs.token_begin[seq];
  const uint32_t ws_off = p.seqs.ws_offset[seq];
  const int64_t q_stride = int64_t(p.num_heads) * D, kv_stride = int64_t(p.num_kv_heads) * D;
  const T *q = static_cast<const T *>(p.q);
  const T *k = static_cast<const T *>(p.k) + p.keys.kv_begin[seq] * kv_stride + int64_t(kvh) * D;
  float *scores = p.scores + int64_t(kvh) * p.scores_stride + p.score_offset[seq];
  const float scale = p.scale_log2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row

  auto issue_keys = [&](int t, int stage) {
    const int k0 = t * kWinKeys;
    load_tile<T, D, kWinKeys, kWinThreads>(k_s + stage * kWinKeys * S, k + int64_t(k0) * kv_stride, kv_stride,
                                           min(kWinKeys, col_end - k0));
  };

  for (int batch0 = 0; batch0 < pairs; batch0 += static_cast<int>(a.rows_cap)) {
    const int rows = min(static_cast<int>(a.rows_cap), pairs - batch0);
    // Pair i of the batch: query head kvh · n_rep + (batch0 + i) / wrows, chunk row
    // row_first + (batch0 + i) % wrows; pairs beyond `rows` are zero-filled and masked. A
    // thread's pairs advance by ~kWinThreads / kChunks: one division, then steps.
    int pi = static_cast<int>(threadIdx.x) / kChunks;
    int ph = (batch0 + pi) / wrows, pr = (batch0 + pi) % wrows;  // pair pi's head in the group, row
    for (int c = threadIdx.x; c < static_cast<int>(a.rows_cap) * kChunks; c += kWinThreads) {
      const int i = c / kChunks, ch = (c % kChunks) * 8;
      for (pr += i - pi, pi = i; pr >= wrows; pr -= wrows) ++ph;
      const bool ok = i < rows;
      const int h = kvh * n_rep + ph, r = row_first + pr;
      cp_async_16(q_s + i * S + ch, ok ? q + (tb + r) * q_stride + int64_t(h) * D + ch : q, ok);
    }
    issue_keys(t_begin, 0);  // stage 0 is free: the previous batch's last tile ended at a barrier
    cp_async_commit();
    pdl_wait();  // the forward's LSE (the window rows and the keys, in flight, are the caller's)
    for (int i = threadIdx.x; i < static_cast<int>(a.rows_cap); i += kWinThreads) {
      const int pair = batch0 + i, h = kvh * n_rep + pair / wrows, r = row_first + pair % wrows;
      lse_s[i] = i < rows ? p.lse[int64_t(h) * p.ws_tokens + ws_off + r] : 0.0f;
    }

    for (int t = t_begin; t < t_end; ++t) {
      const int stage = (t - t_begin) & 1;
      if (t + 1 < t_end) {  // stage ^ 1 was released by the barrier ending tile t - 1
        issue_keys(t + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const T *ks = k_s + stage * kWinKeys * S;
      float cs[2] = {0.0f, 0.0f};  // keys g and g + 8 of the warp's 16, this thread's pairs
      for (int rc = 0; rc < rows; rc += kWinChunk) {
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t af[4];
          load_a_frag<T, D>(af, ks, warp * 16, kk, lane);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            if (rc + np * 16 < rows) {  // warp-uniform: the chunk's pairs end at `rows`
              uint32_t b[4];
              load_b_frags<T, D>(b, q_s + rc * S, np, kk, lane);
              mma_16816<T>(s[2 * np], af, b[0], b[1]);
              mma_16816<T>(s[2 * np + 1], af, b[2], b[3]);
            }
          }
        }
        // s[nt][e]: key warp·16 + g + 8 (e / 2), pair rc + 8 nt + 2 tq + (e & 1).
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          if (rc + nt * 8 < rows) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = rc + nt * 8 + 2 * tq + (e & 1);
              const float y = ex2(fmaf(s[nt][e], scale, -lse_s[i]));  // lse_s is 0 beyond `rows`
              cs[e / 2] += i < rows ? y : 0.0f;
            }
          }
        }
      }
      // Key totals: the 4 lanes of a quad hold the same keys. A column an earlier chunk of
      // the prompt (below col_done) or an earlier batch summed gets this part added.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float x = cs[r];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        const int key = t * kWinKeys + warp * 16 + g + 8 * r;
        if (tq == 0 && key < col_end) scores[key] = batch0 > 0 || key < col_done ? scores[key] + x : x;
      }
      __syncthreads();  // the stage is refilled by tile t + 1's issue of t + 2
    }
  }
}

template <typename T, int D> constexpr size_t attention_smem() {
  return size_t(kBM + 4 * PrefillTiling<D>::kBN) * smem_stride<D>() * sizeof(T);
}
template <typename T, int D> constexpr size_t scores_smem() {
  return size_t(kSK + 2 * kSQ) * smem_stride<D>() * sizeof(T) + 2u * kSQ * sizeof(float);
}

}  // namespace

bool prefill_window_scores_fit(uint32_t head_dim, uint32_t n_rep, uint32_t window_size) {
  return uint64_t(n_rep) * window_size <= uint64_t(kWinMaxBatches) * win_rows_max(head_dim);
}

#ifndef MINIKV_WARP_EMULATION  // a CPU emulation (tests/emulation) runs the kernels themselves
void configure_prefill_kernels(minikv_dtype dtype, uint32_t head_dim) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_cache_create", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    MINIKV_CUDA_CHECK(cudaFuncSetAttribute(prefill_attention_kernel<T, D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(attention_smem<T, D>())));
    MINIKV_CUDA_CHECK(cudaFuncSetAttribute(prefill_scores_kernel<T, D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(scores_smem<T, D>())));
    MINIKV_CUDA_CHECK(cudaFuncSetAttribute(prefill_window_scores_kernel<T, D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(window_scores_smem<T, D>(win_rows_max(D)))));
  });
}

void launch_prefill_attention(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                              uint32_t num_sms, cudaStream_t stream) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_prefill", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    PrefillAttnParams ordered = p;
    ordered.kv_heads_per_chunk =
        forward_head_chunk(p, uint64_t(num_sms) * (PrefillTiling<D>::kWarps == 4 ? 2 : 1), D * sizeof(T));
    const uint32_t grid = p.seqs.tile_begin[p.seqs.n] * p.num_heads;  // cta_tile_head
    prefill_attention_kernel<T, D>
        <<<grid, PrefillTiling<D>::kThreads, attention_smem<T, D>(), stream>>>(ordered);
    check_launch_error("prefill_attention_kernel");
  });
}

void launch_prefill_window_scores(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &p,
                                  uint32_t num_sms, cudaStream_t stream, bool programmatic) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_prefill", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    static_assert(win_rows_max(D) % kWinChunk == 0, "whole row chunks per batch");
    const uint32_t n_rep = p.num_heads / p.num_kv_heads;
    uint32_t most_rows = 0;  // window rows of the launch's largest window part
    uint64_t tiles = 0;
    for (uint32_t s = 0; s < p.seqs.n; ++s) {
      const uint32_t first = p.row_begin[s] > p.keys.q_pos[s] ? p.row_begin[s] - p.keys.q_pos[s] : 0;
      most_rows = std::max(most_rows, p.seqs.len[s] - first);
      tiles += (p.col_end[s] + kWinKeys - 1) / kWinKeys;
    }
    const uint32_t rows_cap = std::min<uint32_t>(
        win_rows_max(D), (n_rep * most_rows + kWinChunk - 1) / kWinChunk * kWinChunk);
    // One round of resident CTAs (up to 4 per SM: registers; shared memory by rows_cap):
    // enough key tiles in flight for the copy bandwidth, each CTA's window rows loaded once
    // for many tiles, and no partial last round.
    const size_t smem = window_scores_smem<T, D>(rows_cap);
    int per_sm = 0;
    MINIKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, prefill_window_scores_kernel<T, D>,
                                                                    kWinThreads, smem));
    const uint64_t want = std::max<uint64_t>(uint64_t(num_sms) * std::max(per_sm, 1), 1);
    const uint32_t per_cta = static_cast<uint32_t>(std::max<uint64_t>((tiles * p.num_kv_heads + want - 1) / want, 1));
    uint32_t grid = 0;
    for (uint32_t s = 0; s < p.seqs.n; ++s)
      grid += ((p.col_end[s] + kWinKeys - 1) / kWinKeys + per_cta - 1) / per_cta;
    if (grid == 0) return;
    const WindowScoreArgs args{p, per_cta, rows_cap};
    launch_kernel(prefill_window_scores_kernel<T, D>, dim3(grid, p.num_kv_heads), kWinThreads, smem, stream,
                  programmatic, "prefill_window_scores_kernel", args);
  });
}

void launch_prefill_scores(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &params,
                           uint32_t num_sms, cudaStream_t stream, bool programmatic) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_prefill", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    PrefillScoreParams p = params;
    p.parts = score_parts(p, uint64_t(num_sms) * scores_ctas_per_sm<D>(), prefill_score_part_ctas(num_sms));
    p.kv_heads_per_chunk = score_head_chunk(p, uint64_t(num_sms) * scores_ctas_per_sm<D>(), D * sizeof(T));
    const uint32_t grid = p.seqs.tile_begin[p.seqs.n] * p.num_kv_heads * p.parts;
    launch_kernel(prefill_scores_kernel<T, D>, grid, PrefillTiling<D>::kThreads, scores_smem<T, D>(), stream,
                  programmatic, "prefill_scores_kernel", p);
  });
}
#endif

}  // namespace kernels
}  // namespace minikv
