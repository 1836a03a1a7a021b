// Importance scores on Hopper warpgroup MMA (wgmma, sm_90a): the same column sums as
// prefill_scores_kernel (kernels/prefill_attention.cu), for H100/H200 at head_dim 64, 128 and
// 256.
//
// One CTA = 128 key columns of one KV head (the host's key tile) = two warpgroups of 64 keys.
// Each warpgroup keeps its keys in registers for the CTA's lifetime, as the A operand of
// wgmma (mma.sync A-fragment layout, loaded once from global memory), and the CTA streams
// 64-query tiles with their LSE through a ring of four shared-memory stages (128-byte
// swizzled), loaded by thread 0 two items ahead (the query tile by TMA with a tensor map
// made per launch, its LSE values by a bulk copy) on a `full` mbarrier per stage; a CTA
// barrier per item hands a stage back once every warp is done with it. Per item:
//   Sᵀ_{t+1} = K·Q_{t+1}ᵀ is issued (async, m64n64k16 per 16 channels) before the exp2 of
//   S_t, so the tensor cores work under the MUFU; then the warpgroup waits for it.
// Each thread adds exp2(s·scale − LSE) of its two keys over its queries into two fp32 sums,
// in item order; the quad's four partial sums are added by shuffles at the end: a fixed
// order, deterministic, no atomic additions. Items are (query head of the GQA group, query
// tile on or below the diagonal and at or after row_begin), heads outer; masks, WINDOW rows,
// ragged batches and chunks of a prompt (col_done, params.h PrefillKeys) are the mma.sync
// kernel's.
// A short launch splits each key tile's items into parts (prefill_common.cuh, score_parts).

#include "bulk_copy.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "prefill_common.cuh"
#include "programmatic_launch.h"
#include "tensor_maps.h"
#include "wgmma.cuh"

namespace minikv {
namespace kernels {
namespace {

constexpr int kScWarpgroups = 2;              // 64 keys each
constexpr int kScThreads = 128 * kScWarpgroups;
constexpr int kScKeys = 64 * kScWarpgroups;   // keys per CTA
constexpr int kScQueries = kScoreQueries;     // queries per streamed tile (wgmma N)
constexpr int kScStages = 4;                  // item it + 2 loads while it + 1 multiplies
static_assert(kScKeys == int(kPrefillKeyTile), "one CTA per host key tile");
static_assert((kScStages & (kScStages - 1)) == 0, "stage index by mask");

// The launch's tensor map of the query rows ([tokens][num_heads][D], boxes of 64 rows).
struct ScMaps {
  CUtensorMap q;
};

// Shared memory, bytes: the query stages (each 1024-byte aligned for the swizzle, D / 64
// column blocks of [64 rows][64 elements]), the LSE stages, the full mbarriers.
template <typename T, int D> struct ScSmem {
  static constexpr int kQTile = kScQueries * D * int(sizeof(T));
  static constexpr int kLse = kScStages * kQTile;  // [kScStages][kScQueries] float
  static constexpr int kFull = kLse + kScStages * kScQueries * 4;
  static constexpr int kBytes = kFull + kScStages * 8;
  static constexpr int kLaunchBytes = kBytes + 1024;  // + the alignment slack
};

// Resident CTAs per SM: two, and one at head_dim 256, whose keys (64 registers a thread) and
// two Sᵀ tiles (64) do not fit two CTAs' 128 registers a thread.
constexpr int sc_ctas_per_sm(int D) { return D == 256 ? 1 : 2; }

/// \tparam T dtype of q/k (__half or __nv_bfloat16)
/// \tparam D head_dim (64, 128 or 256)
template <typename T, int D>
__global__ void __launch_bounds__(kScThreads, sc_ctas_per_sm(D))
    prefill_scores_wgmma_kernel(const __grid_constant__ PrefillScoreParams p, const __grid_constant__ ScMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(MINIKV_WARP_EMULATION)
  using Sm = ScSmem<T, D>;
  MINIKV_DYNAMIC_SMEM(smem_dyn, 16);
  uint8_t *const smem = smem_dyn + ((1024u - (smem_addr(smem_dyn) & 1023u)) & 1023u);
  float *const lse_s = reinterpret_cast<float *>(smem + Sm::kLse);
  const uint32_t q_addr = smem_addr(smem);
  auto full = [&](int st) { return q_addr + Sm::kFull + 8 * st; };
  pdl_launch_dependents();
  if (threadIdx.x == 0) {
    bulk::prefetch_tensor_map(&maps.q);
    for (int st = 0; st < kScStages; ++st) bulk::mbar_init(full(st), 1);
    bulk::fence_mbar_init();
  }
  __syncthreads();

  const ScoreCta sc = score_cta(p);
  const CtaTileHead th = cta_tile_head(sc.pair, p.seqs.tile_begin[p.seqs.n], 1, p.kv_heads_per_chunk);
  const uint32_t tile = th.tile;
  const int kvh = th.head;
  const uint32_t seq = find_seq(p.seqs, tile);
  // n query rows (and their LSE) at prompt positions [qp, qp + n), keys [0, L) from kv_begin.
  const int n = static_cast<int>(p.seqs.len[seq]), qp = static_cast<int>(p.keys.q_pos[seq]);
  const int L = qp + n;
  const int k0 = static_cast<int>(tile - p.seqs.tile_begin[seq]) * kScKeys;  // longest first
  const int n_rep = p.num_heads / p.num_kv_heads;
  const int row_begin = static_cast<int>(p.row_begin[seq]);  // a prompt position
  const int64_t tb = p.seqs.token_begin[seq];
  const uint32_t ws_off = p.seqs.ws_offset[seq];
  const int64_t kv_stride = int64_t(p.num_kv_heads) * D;
  const float scale = p.scale_log2;

  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;  // warp of the warpgroup
  const int g = lane / 4, tq = lane % 4;
  const int wkey = k0 + (threadIdx.x / 128) * 64 + 16 * warp;  // this warp's keys: wkey + g (+ 8)
  // The masks compare in query-row coordinates (position - qp).
  const int wkey_row = wkey - qp, row_first = row_begin - qp;

  // This CTA's part of the tile's items: `total` of them from head first.head, tile first.qt.
  const ScoreTileItems items = score_tile_items(n, qp, row_begin, k0);
  const int qt0 = items.qt0, qt_end = items.qt_end;
  const ScorePartItems first = score_part_items(items, n_rep, static_cast<int>(sc.parts), static_cast<int>(sc.part));
  const int total = first.count;

  // Item `it` = query tile qt of head h, into stage it % kScStages, by thread 0 (every warp
  // is done with the stage's previous item, it − 4: step it − 2's barrier): the query rows
  // by TMA (rows past the tensor load as zeros) and their 64 LSE values by a bulk copy (each
  // sequence's workspace rows start 16-byte aligned; the LSE buffer has a tile of slack past
  // its last row). Rows past the sequence's (the next sequence's, or the padding's) are
  // masked below.
  auto issue = [&](int it, int h, int qt) {
    constexpr int kColBlock = kScQueries * 128;                       // [64 rows][64 elements]
    constexpr uint32_t kStageBytes = Sm::kQTile + kScQueries * 4;  // the tile and its LSE
    const int st = it & (kScStages - 1);
    bulk::mbar_arrive_expect_tx(full(st), kStageBytes);
    const int row = static_cast<int>(tb) + qt * kScQueries;
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb)
      bulk::tma_load_3d(q_addr + st * Sm::kQTile + cb * kColBlock, &maps.q, full(st), 64 * cb, h, row);
    bulk::copy(smem_addr(lse_s + st * kScQueries), p.lse + int64_t(h) * p.ws_tokens + ws_off + qt * kScQueries,
               kScQueries * 4, full(st));
  };
  int nh = kvh * n_rep + first.head, nqt = first.qt;  // the next item to issue
  auto issue_next = [&](int it) {
    issue(it, nh, nqt);
    if (++nqt == qt_end) {
      nqt = qt0;
      ++nh;
    }
  };
  if (threadIdx.x == 0) {
    pdl_wait();  // the forward's LSE, copied by every issue (the other threads read it from the stages)
    if (total > 0) issue_next(0);
    if (total > 1) issue_next(1);
  }

  // This warp's 16 keys as the wgmma A operand, straight from global memory (once per CTA):
  // a[kk] = rows g / g + 8, channels 16 kk + 2 tq (+1) and + 8; keys at or past L are zeros.
  uint32_t ka[D / 16][4];
  {
    const T *kb = static_cast<const T *>(p.k) + p.keys.kv_begin[seq] * kv_stride + int64_t(kvh) * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = wkey + g + 8 * r;
      const uint32_t *row =
          reinterpret_cast<const uint32_t *>(kb + int64_t(min(key, L - 1)) * kv_stride) + tq;
      const bool ok = key < L;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        ka[kk][r] = ok ? __ldg(row + 8 * kk) : 0u;
        ka[kk][2 + r] = ok ? __ldg(row + 8 * kk + 4) : 0u;
      }
    }
  }

  // Sᵀ = K·Q_stageᵀ for the warpgroup's 64 keys and the stage's 64 queries (issued, not
  // waited). A descriptor's address field is bits 0-13 (address >> 4): the stages' and
  // k-steps' descriptors are the first one plus their offset >> 4.
  const uint64_t desc0 = wg::kmajor_desc<kScQueries>(q_addr, 0);
  const uint32_t desc0_lo = uint32_t(desc0);
  auto issue_qk = [&](float(&s)[32], int st) {
    const uint32_t stage_lo = desc0_lo + uint32_t(st * Sm::kQTile >> 4);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t lo = stage_lo + (uint32_t((kk / 4) * (kScQueries * 128) + (kk % 4) * 32) >> 4);
      wg::rs_m64n64k16<T>(s, ka[kk], (desc0 >> 32 << 32) | lo, kk > 0);
    }
    wg::commit();
  };

  float cs[2] = {0.0f, 0.0f};  // keys wkey + g, wkey + g + 8: this thread's queries
  // Sᵀ of two items in turn (the loop runs two items an iteration, so no copy between them).
  float sa[32], sb[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) sa[i] = sb[i] = 0.0f;
  if (total > 0) {
    bulk::mbar_wait(full(0), 0);
    __syncwarp();  // converged for the warpgroup's wgmma
    issue_qk(sa, 0);
    wg::wait<0>();
    wg::fence_regs(sa);
  }

  int cur_qt = first.qt;  // query tile of item it
  // Item it, whose Sᵀ is in s; issues item it + 1's product into s_next and item it + 2's loads.
  auto step = [&](float(&s)[32], float(&s_next)[32], int it) {
    // Every warp finished step it − 1, so item it − 2's stage (item it + 2's) is free.
    __syncthreads();
    if (threadIdx.x == 0 && it + 2 < total) issue_next(it + 2);
    if (it + 1 < total) {
      bulk::mbar_wait(full((it + 1) & (kScStages - 1)), ((it + 1) / kScStages) & 1);
      __syncwarp();
      issue_qk(s_next, (it + 1) & (kScStages - 1));
      wg::fence_regs(s_next);
    }

    // s[4i + 2r + c]: key wkey + g + 8r, query row i0 + 8i + 2tq + c (position qp + that).
    const float *ls = lse_s + (it & (kScStages - 1)) * kScQueries;
    const int i0 = cur_qt * kScQueries;
    if (++cur_qt == qt_end) cur_qt = qt0;
    if (i0 >= wkey_row + 15 && i0 + kScQueries <= n && i0 >= row_first) {  // nothing masked
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 lv = *reinterpret_cast<const float2 *>(ls + 8 * i + 2 * tq);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          cs[e / 2] += ex2(fmaf(s[4 * i + e], scale, -(e & 1 ? lv.y : lv.x)));
      }
    } else {
      // Query offset 8i + c (a constant) is kept when lo <= it <= hi: key <= query, query >=
      // row_begin and query row < n.
      const int hi = n - 1 - i0 - 2 * tq;
      int lo[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) lo[r] = max(wkey_row + g + 8 * r, row_first) - i0 - 2 * tq;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 lv = *reinterpret_cast<const float2 *>(ls + 8 * i + 2 * tq);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int x = 8 * i + (e & 1);
          const bool ok = x >= lo[e / 2] && x <= hi;
          const float y = ex2(fmaf(s[4 * i + e], scale, -(e & 1 ? lv.y : lv.x)));
          cs[e / 2] += ok ? y : 0.0f;
        }
      }
    }

    wg::wait<0>();  // Sᵀ of item it + 1
    wg::fence_regs(s_next);
  };
  for (int it = 0; it < total; it += 2) {
    step(sa, sb, it);
    if (it + 1 < total) step(sb, sa, it + 1);
  }

  // Key totals: the 4 lanes of a quad hold the same keys (different queries). A column an
  // earlier chunk of the prompt summed (below col_done) adds this chunk's part to it.
  float *scores = p.scores + int64_t(kvh) * p.scores_stride + p.score_offset[seq];
  const int col_done = static_cast<int>(p.col_done[seq]);
  // Split into parts: every part's sums, added in part order by the last to arrive.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    cs[r] += __shfl_xor_sync(0xffffffffu, cs[r], 1);
    cs[r] += __shfl_xor_sync(0xffffffffu, cs[r], 2);
  }
  if (sc.parts > 1 && !sum_score_parts(p, sc, cs, [&](int r) { return wkey - k0 + g + 8 * r; }, tq == 0)) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = wkey + g + 8 * r;
    if (tq == 0 && key < static_cast<int>(p.col_end[seq]))
      scores[key] = key < col_done ? scores[key] + cs[r] : cs[r];
  }
#endif
}

}  // namespace

#ifndef MINIKV_WARP_EMULATION  // a CPU emulation (tests/emulation) runs the kernel itself
bool prefill_scores_wgmma_usable(minikv_dtype dtype, uint32_t head_dim) {
#if defined(MINIKV_BUILD_SM90A)
  return sm90a_prefill_usable(dtype, head_dim, [](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    return std::make_pair(prefill_scores_wgmma_kernel<T, D>, ScSmem<T, D>::kLaunchBytes);
  });
#else
  (void)dtype;
  (void)head_dim;
  return false;
#endif
}

void launch_prefill_scores_wgmma(minikv_dtype dtype, uint32_t head_dim, const PrefillScoreParams &params,
                                 uint32_t num_sms, cudaStream_t stream, bool programmatic) {
  dispatch_dtype_head_dim<WgmmaHeadDims>(dtype, head_dim, "minikv_prefill",
                                         [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    PrefillScoreParams p = params;
    p.parts = score_parts(p, uint64_t(num_sms) * sc_ctas_per_sm(D), prefill_score_part_ctas(num_sms));
    p.kv_heads_per_chunk = score_head_chunk(p, uint64_t(num_sms) * sc_ctas_per_sm(D), D * sizeof(T));
    ScMaps maps;
    maps.q = rows_tensor_map(dtype, p.q, p.num_heads, D, launch_query_rows(p.seqs), kScQueries);
    const uint32_t grid = p.seqs.tile_begin[p.seqs.n] * p.num_kv_heads * p.parts;
    launch_kernel(prefill_scores_wgmma_kernel<T, D>, grid, kScThreads, ScSmem<T, D>::kLaunchBytes, stream,
                  programmatic, "prefill_scores_wgmma_kernel", p, maps);
  });
}
#endif

}  // namespace kernels
}  // namespace minikv
