// Prefill attention forward on Hopper (sm_90a) in the FlashAttention-3 style: the same result
// as prefill_attention_kernel (out and the row LSE in log2 units), for H100/H200.
//
// One CTA = 128 query rows of one query head, three warpgroups:
//   - a producer (warp 0 of warpgroup 0; the other three warps leave at once) that loads Q
//     once and the K/V tiles of 128 keys (64 at head_dim 256) by TMA (cp.async.bulk.tensor,
//     tensor maps made on the host per launch) into a ring of kStages stages, with
//     mbarriers: full[stage] counts the bytes landed, empty[stage] the consumer warps done
//     with it (K and V separately, so a K stage refills while its V is still being read);
//   - two consumer warpgroups, 64 query rows each. Per K/V tile j, a warpgroup issues
//     S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} together (asynchronous wgmma), waits for S_j
//     only, runs the softmax of S_j while its P·V is still on the tensor cores, then rescales
//     O and packs P_j (registers, the A operand of the next P·V). The two warpgroups take
//     turns to issue their GEMMs (named barriers, "ping-pong"), so one's softmax runs under
//     the other's GEMMs.
// setmaxnreg moves registers from the producer (24) to the consumers (240).
// Shared memory: Q [128][D] and the K and V stages [keys][D], each as D / 64 column blocks of
// [rows][64 elements] in the 128-byte swizzle that both TMA (CU_TENSOR_MAP_SWIZZLE_128B)
// and the wgmma descriptors use: 16-byte chunk c of row r at chunk c ^ (r mod 8).
//
// Ragged batches: the tensor maps span the launch's packed rows; a tile's rows past its
// sequence's last key are another sequence's (or zero past the tensor). Their scores are
// masked; their V rows are zeroed by the producer before the consumers see the tile (the
// tile that holds the last key), so a non-finite value elsewhere never meets a zero
// probability (0 · inf = NaN). Masks, softmax, LSE, the longest-tiles-first order and chunks
// of a prompt over its staged keys (params.h PrefillKeys) are prefill_attention_kernel's.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <type_traits>

#include "bulk_copy.cuh"
#include "dispatch.cuh"
#include "prefill_common.cuh"
#include "launchers.h"
#include "tensor_maps.h"
#include "wgmma.cuh"

namespace minikv {
namespace kernels {
namespace {

constexpr int kFaRows = 128;      // query rows per CTA
constexpr int kFaThreads = 384;   // producer warpgroup + two consumer warpgroups
static_assert(kPrefillQueryTile == kFaRows, "one CTA per host query tile");

// The launch's tensor maps (built on the host for each launch: the caller's pointers).
struct FaMaps {
  CUtensorMap q, k, v;
};

/// \tparam D head_dim (64, 128 or 256)
template <int D> struct FaSmem {
  // Keys per K/V tile: 128, and 64 at head_dim 256, where a 128-key tile's scores (64 floats
  // a thread) beside O (128) would outgrow a consumer thread's 240 registers.
  static constexpr int kKeys = D == 256 ? 64 : 128;
  static constexpr int kStages = D == 64 ? 4 : 2;
  static constexpr int kTileColBlock = kKeys * 128;  // one [kKeys rows][64 elements] column block
  static constexpr int kTile = kKeys * D * 2;    // one K or V tile, 16-bit elements
  static_assert(kTile == kTileColBlock * (D / 64), "a tile is D / 64 column blocks");
  static constexpr int kK = kFaRows * D * 2;     // Q first, at 0
  static constexpr int kV = kK + kStages * kTile;
  static constexpr int kBars = kV + kStages * kTile;
  // mbarriers: Q; K full, V full, K empty, V empty per stage; the V tile being zeroed.
  static constexpr int kNumBars = 2 + 4 * kStages;
  static constexpr int kBytes = kBars + 8 * kNumBars;
  static constexpr int kLaunchBytes = kBytes + 1024;  // + the alignment slack
  static_assert(kLaunchBytes <= 227 * 1024, "fits an H100/H200 CTA");
};

// The device helpers exist for the sm_90a device pass (and the host pass, which only parses
// them); an sm_80 image compiles the kernel below as an empty body that is never launched.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)

constexpr int kFaWgRows = 64;     // query rows per consumer warpgroup
constexpr int kFaColBlock = kFaRows * 128;  // bytes of one column block of Q
constexpr int kFaEmptyArrivals = 8;     // consumer warps releasing a stage
constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // setmaxnreg: 24·128 + 240·256 ≤ 64K
// Named barriers (0 is __syncthreads): the consumers' turns to issue GEMMs, one each, and
// one per consumer warpgroup for its epilogue.
constexpr int kBarTurn = 1, kBarEpilogue = 3;

// ---- mbarriers (bulk_copy.cuh), TMA, named barriers, setmaxnreg (PTX ISA 8.0, sm_90) -----
using bulk::mbar_arrive;
using bulk::mbar_arrive_expect_tx;
using bulk::mbar_init;
using bulk::mbar_wait;
using bulk::fence_proxy_async_shared;
using bulk::prefetch_tensor_map;
using bulk::tma_load_3d;
#ifdef MINIKV_WARP_EMULATION
__device__ __forceinline__ void named_sync(int id, int threads) { emulation::named_barrier(id, threads); }
__device__ __forceinline__ void named_arrive(int id, int threads) { emulation::named_arrive(id, threads); }
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {}
#else
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
#endif

// S = Q·K_tileᵀ for a warpgroup's 64 rows: D / 16 k-steps of m64n128k16 (m64n64k16 for the
// 64-key tiles of head_dim 256), issued and committed, not waited. q_addr: the warpgroup's
// first row in Q's column block 0.
template <typename T, int D>
__device__ __forceinline__ void issue_qk(float (&s)[FaSmem<D>::kKeys / 2], uint32_t q_addr, uint32_t k_addr) {
  constexpr int kKeys = FaSmem<D>::kKeys;
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint64_t qd = wg::kmajor_desc<kFaRows>(q_addr, kk), kd = wg::kmajor_desc<kKeys>(k_addr, kk);
    if constexpr (kKeys == 128) wg::ss_m64n128k16<T>(s, qd, kd, kk > 0);
    else wg::ss_m64n64k16<T>(s, qd, kd, kk > 0);
  }
  wg::commit();
}

// O += P·V_tile: k-steps of 16 keys; V is [keys][D] swizzled = MN-major B with the next 64
// channels one column block on (LBO) and the next 8 keys 1 KB on (SBO); head_dim 256 takes
// its 256 channels as two products of 128. p holds P packed as the A fragments: p[4kc + i]
// is k-step kc's register i.
template <typename T, int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&p)[FaSmem<D>::kKeys / 4],
                                         uint32_t v_addr) {
  using Sm = FaSmem<D>;
  wg::fence();
#pragma unroll
  for (int kc = 0; kc < Sm::kKeys / 16; ++kc) {
    const uint32_t keys = v_addr + kc * 2048;  // 16 rows of 128 B into each column block
    if constexpr (D == 64) {
      wg::rs_m64n64k16<T, 1>(o, p + 4 * kc, wg::sw128_desc(keys, Sm::kTileColBlock, 1024), 1);
    } else {
#pragma unroll
      for (int half = 0; half < D / 128; ++half)  // channels [128 half, 128 half + 128)
        wg::rs_m64n128k16_mn<T>(*reinterpret_cast<float(*)[64]>(o + 64 * half), p + 4 * kc,
                                wg::sw128_desc(keys + 2 * half * Sm::kTileColBlock, Sm::kTileColBlock, 1024));
    }
  }
  wg::commit();
}

#endif  // sm_90a helpers

/// \tparam T dtype of q/k/v/out (__half or __nv_bfloat16)
/// \tparam D head_dim (64, 128 or 256)
template <typename T, int D>
__global__ void __launch_bounds__(kFaThreads, 1)
    prefill_wgmma_kernel(const __grid_constant__ PrefillAttnParams p,
                         const __grid_constant__ FaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(MINIKV_WARP_EMULATION)
  using Sm = FaSmem<D>;
  constexpr int S = Sm::kStages, kKeys = Sm::kKeys;
  pdl_launch_dependents();  // the score pass may start behind the last wave (launchers.h)
  // The swizzle pattern repeats on 1024-byte boundaries: the base is rounded up to one (the
  // launch asks for Sm::kBytes + 1024).
  MINIKV_DYNAMIC_SMEM(smem_dyn, 16);
  uint8_t *const smem = smem_dyn + ((1024u - (smem_addr(smem_dyn) & 1023u)) & 1023u);
  const uint32_t q_addr = smem_addr(smem), k_addr0 = q_addr + Sm::kK, v_addr0 = q_addr + Sm::kV;
  const uint32_t bar_q = q_addr + Sm::kBars;
  auto bar_k_full = [&](int st) { return bar_q + 8 * (1 + st); };
  auto bar_v_full = [&](int st) { return bar_q + 8 * (1 + S + st); };
  auto bar_k_empty = [&](int st) { return bar_q + 8 * (1 + 2 * S + st); };
  auto bar_v_empty = [&](int st) { return bar_q + 8 * (1 + 3 * S + st); };
  const uint32_t bar_v_tail = bar_q + 8 * (1 + 4 * S);

  // blockIdx.x = (chunk of KV heads, host tile, head of the chunk): a chunk's tiles adjacent,
  // the longest first (cta_tile_head).
  const CtaTileHead th = cta_tile_head(blockIdx.x, p.seqs.tile_begin[p.seqs.n], p.num_heads / p.num_kv_heads,
                                           p.kv_heads_per_chunk);
  const uint32_t host_tile = th.tile;
  const int h = th.head;
  const uint32_t seq = find_seq(p.seqs, host_tile);
  // n query rows at prompt positions [qp, qp + n) over the keys [0, L) (params.h PrefillKeys).
  const int n = static_cast<int>(p.seqs.len[seq]), qp = static_cast<int>(p.keys.q_pos[seq]);
  const int L = qp + n;
  const uint32_t last = p.seqs.tile_begin[seq + 1] - 1;
  const int q0 = static_cast<int>(last - host_tile) * kFaRows;  // < n
  const int qa = qp + q0;  // prompt position of the CTA's first row
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  // Key tiles up to the diagonal of the CTA's last row (or the last key): the same count for
  // both consumer warpgroups, which keeps their turns and the stage releases paired.
  const int n_kv = min(qa + kFaRows - 1, L - 1) / kKeys + 1;

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    for (int st = 0; st < S; ++st) {
      mbar_init(bar_k_full(st), 1);
      mbar_init(bar_v_full(st), 1);
      mbar_init(bar_k_empty(st), kFaEmptyArrivals);
      mbar_init(bar_v_empty(st), kFaEmptyArrivals);
    }
    mbar_init(bar_v_tail, 1);
    bulk::fence_mbar_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // ---- producer ----------------------------------------------------------
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const int q_row = static_cast<int>(p.seqs.token_begin[seq]) + q0;
    const int kv_row = static_cast<int>(p.keys.kv_begin[seq]);
    constexpr uint32_t kTileBytes = Sm::kTile;
    if (lane == 0) {
      prefetch_tensor_map(&maps.q);
      prefetch_tensor_map(&maps.k);
      prefetch_tensor_map(&maps.v);
      mbar_arrive_expect_tx(bar_q, kFaRows * D * 2);
      for (int cb = 0; cb < D / 64; ++cb)
        tma_load_3d(q_addr + cb * kFaColBlock, &maps.q, bar_q, 64 * cb, h, q_row);
    }
    for (int j = 0; j < n_kv; ++j) {
      const int st = j % S, k0 = j * kKeys;
      const uint32_t free_parity = ((j / S) & 1) ^ 1;
      // The tile that holds the last key and rows past it (only the last tile can).
      const bool tail = k0 + kKeys > L;
      if (lane == 0) {
        mbar_wait(bar_k_empty(st), free_parity);
        mbar_arrive_expect_tx(bar_k_full(st), kTileBytes);
        for (int cb = 0; cb < D / 64; ++cb)
          tma_load_3d(k_addr0 + st * Sm::kTile + cb * Sm::kTileColBlock, &maps.k, bar_k_full(st),
                      64 * cb, kvh, kv_row + k0);
        mbar_wait(bar_v_empty(st), free_parity);
        const uint32_t bar = tail ? bar_v_tail : bar_v_full(st);
        mbar_arrive_expect_tx(bar, kTileBytes);
        for (int cb = 0; cb < D / 64; ++cb)
          tma_load_3d(v_addr0 + st * Sm::kTile + cb * Sm::kTileColBlock, &maps.v, bar, 64 * cb, kvh,
                      kv_row + k0);
      }
      if (tail) {
        // Zero the V rows past the last key, then hand the tile to the consumers.
        mbar_wait(bar_v_tail, 0);
        const int first = L - k0;
        uint8_t *const vt = smem + Sm::kV + st * Sm::kTile;
        for (int i = lane; i < (kKeys - first) * 8 * (D / 64); i += 32) {
          const int cb = i / ((kKeys - first) * 8), rest = i % ((kKeys - first) * 8);
          *reinterpret_cast<uint4 *>(vt + cb * Sm::kTileColBlock + (first + rest / 8) * 128 +
                                     (rest % 8) * 16) = make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async_shared();
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_v_full(st));
      }
    }
    return;
  }

  // ---- consumers ---------------------------------------------------------------------------
  setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the CTA's tile
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  const int g = lane / 4, tq = lane % 4;
  const int row0 = qa + kFaWgRows * cw + 16 * warp;  // prompt position of the warp's first row
  const uint32_t q_wg = q_addr + cw * kFaWgRows * 128;  // the warpgroup's rows of Q
  const float scale = p.scale_log2;
  auto release = [&](uint32_t bar) {
    if (lane == 0) mbar_arrive(bar);
  };
  // Mask where the tile reaches past this warp's first row or past L.
  auto mask = [&](float (&s)[kKeys / 2], int k0) {
    if (k0 + kKeys - 1 > row0 || k0 + kKeys > L) mask_mtile(s, row0, k0, L, g, tq);
  };
  auto pack = [&](uint32_t (&pk)[kKeys / 4], const float (&s)[kKeys / 2]) {
#pragma unroll
    for (int i = 0; i < kKeys / 4; ++i) pk[i] = DType<T>::pack2(s[2 * i], s[2 * i + 1]);
  };

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g, g + 8 of the warp
  float s[kKeys / 2], corr[2];
  uint32_t pk[kKeys / 4];

  // Turns: warpgroup 0 issues first; warpgroup 1 signals it once here and after each of its
  // own turns but the last, so that every bar.sync meets exactly one bar.arrive.
  if (n_kv > 1 && cw == 1) named_arrive(kBarTurn + 0, 256);
  mbar_wait(bar_q, 0);
  mbar_wait(bar_k_full(0), 0);
  issue_qk<T, D>(s, q_wg, k_addr0);
  wg::wait<0>();
  wg::fence_regs(s);
  release(bar_k_empty(0));
  mask(s, 0);
  softmax_mtile(s, m, l, scale, corr);  // o is still 0: nothing to rescale
  pack(pk, s);

  for (int j = 1; j < n_kv; ++j) {
    const int st = j % S, sp = (j - 1) % S;
    mbar_wait(bar_k_full(st), (j / S) & 1);
    mbar_wait(bar_v_full(sp), ((j - 1) / S) & 1);
    named_sync(kBarTurn + cw, 256);
    wg::fence_regs(s);
    issue_qk<T, D>(s, q_wg, k_addr0 + st * Sm::kTile);
    wg::fence_regs(o);
    issue_pv<T, D>(o, pk, v_addr0 + sp * Sm::kTile);
    if (cw == 0 || j + 1 < n_kv) named_arrive(kBarTurn + 1 - cw, 256);
    wg::wait<1>();  // S_j (P_{j-1}·V_{j-1} may still run)
    wg::fence_regs(s);
    release(bar_k_empty(st));
    mask(s, j * kKeys);
    const bool moved = softmax_mtile(s, m, l, scale, corr);
    wg::wait<0>();
    wg::fence_regs(o);
    wg::fence_regs(pk);
    release(bar_v_empty(sp));
    if (moved) rescale_o_mtile<D>(o, corr);
    pack(pk, s);
  }
  {
    const int sp = (n_kv - 1) % S;
    mbar_wait(bar_v_full(sp), ((n_kv - 1) / S) & 1);
    wg::fence_regs(o);
    issue_pv<T, D>(o, pk, v_addr0 + sp * Sm::kTile);
    wg::wait<0>();
    wg::fence_regs(o);
    wg::fence_regs(pk);
  }

  // Epilogue: normalize, stage the warpgroup's 64 rows in its own (now unread) rows of Q in
  // the swizzled layout (conflict-free 4-byte writes, 16-byte reads), store 16-byte chunks.
  named_sync(kBarEpilogue + cw, 128);  // every warp of the warpgroup is past its wgmma
  uint8_t *const stage = smem + cw * kFaWgRows * 128;
  auto staged = [&](int row, int chunk) {  // byte offset of 16-byte chunk `chunk` of a row
    return (chunk / 8) * kFaColBlock + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
  };
  float *lse = p.lse + int64_t(h) * p.ws_tokens + p.seqs.ws_offset[seq];
  const int wg_row = q0 + kFaWgRows * cw;  // sequence row of the warpgroup's row 0
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = 16 * warp + g + 8 * r;
    const float inv = 1.0f / sum;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t *>(stage + staged(row, i) + 4 * tq) =
          output_pair<T>(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    const float base = m[r] == -INFINITY ? 0.0f : m[r] * scale;
    if (tq == 0 && wg_row + row < n) lse[wg_row + row] = base + log2f(sum);
  }
  named_sync(kBarEpilogue + cw, 128);
  const int64_t q_stride = int64_t(p.num_heads) * D;
  T *out = static_cast<T *>(p.out) + (p.seqs.token_begin[seq] + wg_row) * q_stride + int64_t(h) * D;
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int it = 0; it < kFaWgRows * kChunks / 128; ++it) {
    const int i = it * 128 + t;
    const int r = i / kChunks, c = i % kChunks;
    if (wg_row + r < n)
      *reinterpret_cast<uint4 *>(out + int64_t(r) * q_stride + c * 8) =
          *reinterpret_cast<const uint4 *>(stage + staged(r, c));
  }
#endif
}

}  // namespace

// ---- host side -------------------------------------------------------------------------
#ifndef MINIKV_WARP_EMULATION  // a CPU emulation (tests/emulation) runs the kernel itself
namespace {
// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda); nullptr when
// the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}
}  // namespace

bool tensor_maps_available() { return tensor_map_encoder() != nullptr; }

CUtensorMap rows_tensor_map(minikv_dtype dtype, const void *base, uint32_t heads, uint32_t D, uint64_t rows,
                            uint32_t box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {D, heads, rows};
  const cuuint64_t strides[2] = {uint64_t(D) * 2, uint64_t(heads) * D * 2};  // bytes, dims 1, 2
  const cuuint32_t box[3] = {64, 1, box_rows};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, dtype == MINIKV_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      3, const_cast<void *>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fail(MINIKV_ERR_DEVICE, "minikv_prefill: cuTensorMapEncodeTiled failed (CUresult %d) for a "
                            "[%llu][%u][%u] tensor at %p",
         int(r), static_cast<unsigned long long>(rows), heads, D, base);
  }
  return map;
}

bool prefill_wgmma_usable(minikv_dtype dtype, uint32_t head_dim) {
#if defined(MINIKV_BUILD_SM90A)
  return sm90a_prefill_usable(dtype, head_dim, [](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    return std::make_pair(prefill_wgmma_kernel<T, D>, FaSmem<D>::kLaunchBytes);
  });
#else
  (void)dtype;
  (void)head_dim;
  return false;
#endif
}

void launch_prefill_wgmma(minikv_dtype dtype, uint32_t head_dim, const PrefillAttnParams &p,
                          uint32_t num_sms, cudaStream_t stream) {
  dispatch_dtype_head_dim<WgmmaHeadDims>(dtype, head_dim, "minikv_prefill",
                                         [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    // The maps span the rows this launch reads: every sequence's query rows and keys.
    uint64_t kv_rows = 1;
    for (uint32_t i = 0; i < p.seqs.n; ++i)
      kv_rows = std::max<uint64_t>(kv_rows, uint64_t(p.keys.kv_begin[i]) + p.keys.q_pos[i] + p.seqs.len[i]);
    FaMaps maps;
    maps.q = rows_tensor_map(dtype, p.q, p.num_heads, D, launch_query_rows(p.seqs), kFaRows);
    maps.k = rows_tensor_map(dtype, p.k, p.num_kv_heads, D, kv_rows, FaSmem<D>::kKeys);
    maps.v = rows_tensor_map(dtype, p.v, p.num_kv_heads, D, kv_rows, FaSmem<D>::kKeys);
    PrefillAttnParams ordered = p;
    ordered.kv_heads_per_chunk = forward_head_chunk(p, num_sms, D * sizeof(T));  // one CTA an SM
    const uint32_t grid = p.seqs.tile_begin[p.seqs.n] * p.num_heads;
    prefill_wgmma_kernel<T, D><<<grid, kFaThreads, FaSmem<D>::kLaunchBytes, stream>>>(ordered, maps);
    check_launch_error("prefill_wgmma_kernel");
  });
}
#endif

}  // namespace kernels
}  // namespace minikv
