// Importance scores on Hopper warpgroup MMA (wgmma, sm_90a): the same column sums as
// prefill_scores_kernel (kernels/prefill_attention.cu), for H100/H200 at head_dim 64 and 128.
//
// One CTA = 128 key columns of one KV head (the host's key tile) = two warpgroups of 64 keys.
// Each warpgroup keeps its keys in registers for the CTA's lifetime, as the A operand of
// wgmma (mma.sync A-fragment layout, loaded once from global memory), and the CTA streams
// 64-query tiles with their LSE through a ring of four shared-memory stages (128-byte
// swizzled, filled by cp.async two items ahead). Per item:
//   Sᵀ_{t+1} = K·Q_{t+1}ᵀ is issued (async, m64n64k16 per 16 channels) before the exp2 of
//   S_t, so the tensor cores work under the MUFU; then the warpgroup waits for it.
// Each thread adds exp2(s·scale − LSE) of its two keys over its queries into two fp32 sums,
// in item order; the quad's four partial sums are added by shuffles at the end: a fixed
// order, deterministic, no atomics. Items are (query head of the GQA group, query tile on or
// below the diagonal and at or after row_begin), heads outer; masks, WINDOW rows, ragged
// batches and chunks of a prompt (col_done, params.h PrefillKeys) are the mma.sync kernel's.

#include "dispatch.cuh"
#include "launchers.h"
#include "prefill_common.cuh"
#include "wgmma.cuh"

namespace minikv {
namespace kernels {
namespace {

constexpr int kScWarpgroups = 2;              // 64 keys each
constexpr int kScThreads = 128 * kScWarpgroups;
constexpr int kScKeys = 64 * kScWarpgroups;   // keys per CTA
constexpr int kScQueries = 64;                // queries per streamed tile (wgmma N)
constexpr int kScStages = 4;                  // item it + 2 loads while it + 1 multiplies
static_assert(kScKeys == int(kPrefillKeyTile), "one CTA per host key tile");
static_assert((kScStages & (kScStages - 1)) == 0, "stage index by mask");

// Shared memory, bytes: the query stages (each 1024-byte aligned for the swizzle), then the
// LSE stages.
template <typename T, int D> struct ScSmem {
  static constexpr int kQTile = kScQueries * D * int(sizeof(T));
  static constexpr int kLse = kScStages * kQTile;  // [kScStages][kScQueries] float
  static constexpr int kBytes = kLse + kScStages * kScQueries * 4;
  static constexpr int kLaunchBytes = kBytes + 1024;  // + the alignment slack
};

/// \tparam T dtype of q/k (__half or __nv_bfloat16)
/// \tparam D head_dim (64 or 128)
template <typename T, int D>
__global__ void __launch_bounds__(kScThreads, 2)
    prefill_scores_wgmma_kernel(const __grid_constant__ PrefillScoreParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Sm = ScSmem<T, D>;
  extern __shared__ uint8_t smem_dyn[];
  uint8_t *const smem = smem_dyn + ((1024u - (smem_addr(smem_dyn) & 1023u)) & 1023u);
  float *const lse_s = reinterpret_cast<float *>(smem + Sm::kLse);
  const uint32_t q_addr = smem_addr(smem);

  const CtaTileHead th = cta_tile_head(blockIdx.x, p.seqs.tile_begin[p.seqs.n], 1);  // a KV head's tiles adjacent
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
  const int64_t q_stride = int64_t(p.num_heads) * D, kv_stride = int64_t(p.num_kv_heads) * D;
  const float scale = p.scale_log2;

  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;  // warp of the warpgroup
  const int g = lane / 4, tq = lane % 4;
  const int wkey = k0 + (threadIdx.x / 128) * 64 + 16 * warp;  // this warp's keys: wkey + g (+ 8)
  // The masks compare in query-row coordinates (position - qp).
  const int wkey_row = wkey - qp, row_first = row_begin - qp;

  // Query tiles (of the n rows) with a row at a position >= max(row_begin, k0).
  const int qt0 = max(max(row_first, k0 - qp), 0) / kScQueries;
  const int qt_end = (n + kScQueries - 1) / kScQueries;
  const int total = n_rep * (qt_end - qt0);

  // Item `it` = query tile qt of head h, into stage it % kScStages; (h, qt) advance by
  // counters in issue order. This thread's 16-byte chunks of a tile: chunk lchunk of rows
  // lrow + j · kPassRows (j < kPasses); kPassRows is a multiple of the swizzle's 8 rows, so
  // their shared offsets differ by whole 8-row groups.
  constexpr int kChunks = D / 8, kPassRows = kScThreads / kChunks, kPasses = kScQueries / kPassRows;
  static_assert(kPassRows % 8 == 0 && kScQueries % kPassRows == 0, "whole swizzle groups per pass");
  const int lrow = threadIdx.x / kChunks, lchunk = threadIdx.x % kChunks;
  const uint32_t chunk_smem = q_addr + wg::swizzled_offset<kScQueries>(lrow, lchunk);
  const T *const q_chunk = static_cast<const T *>(p.q) + (tb + lrow) * q_stride + lchunk * 8;
  const int64_t pass_stride = int64_t(kPassRows) * q_stride;
  auto issue = [&](int it, int h, int qt) {
    const int st = it & (kScStages - 1);
    const uint32_t dst = chunk_smem + st * Sm::kQTile;
    const T *src = q_chunk + (int64_t(qt) * kScQueries * q_stride + int64_t(h) * D);
    const int valid = n - qt * kScQueries - lrow;  // this thread's rows below it are real
#pragma unroll
    for (int j = 0; j < kPasses; ++j)  // rows past n: zero-filled, their address not read
      cp_async_16(dst + j * kPassRows * 128, src + j * pass_stride, j * kPassRows < valid);
    if (threadIdx.x < kScQueries) {
      const int row = qt * kScQueries + threadIdx.x;
      const float *lse = p.lse + int64_t(h) * p.ws_tokens + ws_off;
      cp_async_4(lse_s + st * kScQueries + threadIdx.x, row < n ? lse + row : lse, row < n);
    }
  };
  int nh = kvh * n_rep, nqt = qt0;  // the next item to issue
  auto issue_next = [&](int it) {
    issue(it, nh, nqt);
    if (++nqt == qt_end) {
      nqt = qt0;
      ++nh;
    }
  };
  if (total > 0) issue_next(0);
  cp_async_commit();
  if (total > 1) issue_next(1);
  cp_async_commit();

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
      const uint32_t lo = stage_lo + uint32_t((kk / 4) * (kScQueries * 128) + (kk % 4) * 32 >> 4);
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
    cp_async_wait<1>();  // item 0
    wg::fence_proxy_async();
    __syncthreads();
    issue_qk(sa, 0);
    wg::wait<0>();
    wg::fence_regs(sa);
  }

  int cur_qt = qt0;  // query tile of item it
  // Item it, whose Sᵀ is in s; issues item it + 1's product into s_next and item it + 2's loads.
  auto step = [&](float(&s)[32], float(&s_next)[32], int it) {
    // Item it + 2 into the stage of item it − 2: every thread finished it − 2 (its GEMM and
    // its LSE reads) before the barrier of iteration it − 1.
    if (it + 2 < total) issue_next(it + 2);
    cp_async_commit();
    if (it + 1 < total) {
      cp_async_wait<1>();  // item it + 1 (it + 2 may be in flight)
      wg::fence_proxy_async();
      __syncthreads();
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
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x = cs[r];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    const int key = wkey + g + 8 * r;
    if (tq == 0 && key < static_cast<int>(p.col_end[seq]))
      scores[key] = key < col_done ? scores[key] + x : x;
  }
#endif
}

}  // namespace

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

void launch_prefill_scores_wgmma(minikv_dtype dtype, uint32_t head_dim,
                                 const PrefillScoreParams &p, cudaStream_t stream) {
  dispatch_dtype_head_dim<WgmmaHeadDims>(dtype, head_dim, "minikv_prefill",
                                         [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    const uint32_t grid = p.seqs.tile_begin[p.seqs.n] * p.num_kv_heads;
    prefill_scores_wgmma_kernel<T, D>
        <<<grid, kScThreads, ScSmem<T, D>::kLaunchBytes, stream>>>(p);
    check_launch_error("prefill_scores_wgmma_kernel");
  });
}

}  // namespace kernels
}  // namespace minikv
