// Decode attention for the default storage (4-bit keys, 2-bit values, G = 32; attention
// sinks and the 16-bit residual), sm_90: the tensor-core kernel of decode_mma.cuh with its
// work split differently across the four warps of a CTA, so that per-warp bookkeeping is
// paid per 128-token tile of the CTA, not per 32-token share of each warp.
//
// One CTA of four warps per (split, KV head × chunk of <= kH query heads, sequence), kH = 4
// or 8 head slots. Every warp stages its share of a tile with bulk copies (one per region of
// the block, which stores a tile's rows contiguously) completed on the stage's mbarrier;
// three stages (two with 8 head slots), the layout compile-time (decode_k4v2_plan.h).
// Lane (g, i) = (lane / 4, lane % 4) in the mma fragment notation; lane i holds query heads
// i + 4η (η < kH / 4).
//
// QK, per 64-token pass (M = tokens, N = (head, hi / lo), K = channels, mma.sync m16n8k16):
//   warp w takes tokens 16w + g and 16w + g + 8 of the pass, which lie in key group
//   2·pass + w / 2. A = the codes as fp16 subnormals, key pairs as in decode_mma.cuh (one
//   LOP3 per pair). B = q ⊙ s_k of the group in the exact hi + lo fp16 pieces of
//   decode_mma.cuh, built once per tile by all 128 threads (thread = key group × head ×
//   quarter of the channels × half) into shared memory, rows (group parity, head, piece),
//   and read by ldmatrix. The bias q · m_k of each (head, group) is one mma<T> of exact
//   products per warp over its quarter of the channels, summed over the warps.
// Softmax: one running max per head for the whole CTA (the tile's maxima meet in shared
//   memory), so every warp's probabilities share one scale and P·V can sum over every
//   warp's tokens.
// PV (M = channels, N = (head, value group), K = the tile's tokens): warp w owns, in each
//   64-channel span, the channels 8g + 2w (row g) and 8g + 2w + 1 (row g + 8): ldmatrix.trans
//   of the value rows puts chunk g (channels 8g .. 8g + 7, 2 bits each) of two tokens in one
//   register, and one LOP3 (after a shift by 8 for w >= 2) takes code 2w or 2w + 1 of both as
//   fp16 subnormals. Rows g < 4 lie in the span's first value group, rows g >= 4 in its
//   second, so B has a column per (head, group): fp16(p · s_v · 2^Sv), written by the lanes
//   that hold p (the one rounding MINIKV.md allows), Sv a power of two common to the CTA
//   that keeps every p · s_v · 2^Sv below 2^15 (lowered when a tile needs it, the
//   accumulators rescaled). K positions 2m and 2m + 1 of a k-step are its tokens m and
//   m + 8, so a lane's two probabilities of a head are one 32-bit store. Σ p · m_v runs on
//   the CUDA cores (per lane: its tokens × value groups).
// 16-bit tiles (sinks, residual; 30 rows): QK is an mma<T> of the K rows (ldmatrix)
//   against q (exact products); PV an mma<T> of the V rows against p (fp16 · 2^12, or bf16
//   in two pieces) into separate accumulators.
// Error against the CPU backend's fp32 decode: the bounds of decode_mma.cuh (the same
// operands and roundings). Results: the normalized output (one split) or the split's
// (max, sum, unnormalized output) for decode_merge.cu.
#include <type_traits>

#include "bulk_copy.cuh"
#include "common.cuh"
#include "decode_common.cuh"
#include "decode_k4v2.cuh"
#include "decode_k4v2_plan.h"
#include "decode_operands.cuh"
#include "decode_tiles.cuh"
#include "dispatch.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

// Warp w's share of staging tile `tr` into the stage at shared address dst: one bulk copy per
// block region of a quantized tile (key codes, value codes, key scales and minima, value
// scales and minima: one or two per warp), the rows r ≡ w (mod 4) of a 16-bit tile (the
// appended token's row from the caller's buffer). Each warp announces its own bytes to the
// stage's barrier (four arrivals per phase) before its copies.
template <typename T, int D>
__device__ __forceinline__ void k4v2_stage(const K4V2Args &a, const TileRef &tr, const uint8_t *block,
                                           const uint8_t *res_slot, uint32_t kvh, const HeadRegions &hr,
                                           uint32_t dst, uint32_t bar, uint32_t w, uint32_t lane) {
  using Lay = K4V2Layout<sizeof(T), D, 4>;  // stage offsets do not depend on the head slots
  const DecodeParams &p = a.p;
  constexpr uint32_t e = sizeof(T), VG = D / kK4V2Group;
  if (tr.segment == kSegQuantized) {
    if (lane != 0) return;
    const uint32_t row0 = tr.first - a.block_tokens.div(tr.first) * p.st.block.tokens;
    const uint32_t n = tr.count;  // a multiple of G; the tile lies in one block
    const uint32_t ks = n / kK4V2Group * D * e, vs = n * VG * e;
    const uint32_t kat = row0 / kK4V2Group * D * e, vat = row0 * VG * e;
    switch (w) {
      case 0:
        bulk::mbar_arrive_expect_tx(bar, n * D / 2);
        bulk::copy(dst + Lay::kKCodes, block + hr.k_codes + row0 * (D / 2), n * D / 2, bar);
        break;
      case 1:
        bulk::mbar_arrive_expect_tx(bar, n * D / 4);
        bulk::copy(dst + Lay::kVCodes, block + hr.v_codes + row0 * (D / 4), n * D / 4, bar);
        break;
      case 2:
        bulk::mbar_arrive_expect_tx(bar, 2 * ks);
        bulk::copy(dst + Lay::kKScale, block + hr.k_scale + kat, ks, bar);
        bulk::copy(dst + Lay::kKMin, block + hr.k_min + kat, ks, bar);
        break;
      default:
        bulk::mbar_arrive_expect_tx(bar, 2 * vs);
        bulk::copy(dst + Lay::kVScale, block + hr.v_scale + vat, vs, bar);
        bulk::copy(dst + Lay::kVMin, block + hr.v_min + vat, vs, bar);
        break;
    }
  } else {
    const RowTileSource src = row_tile_source(p, tr, res_slot, kvh);
    constexpr uint32_t kRow = D * e;
    const uint32_t mine = tr.count > w ? (tr.count - 1 - w) / 4 + 1 : 0;
    if (lane == 0) bulk::mbar_arrive_expect_tx(bar, 2 * mine * kRow);
    __syncwarp();
    const uint32_t r = 4 * lane + w;
    if (r < tr.count) {
      const bool sub = r == src.sub;
      bulk::copy(dst + r * Lay::kRowStride, sub ? src.sub_k : src.k + r * kRow, kRow, bar);
      bulk::copy(dst + Lay::kRowV + r * Lay::kRowStride, sub ? src.sub_v : src.v + r * kRow, kRow, bar);
    }
  }
}

/// \tparam T  dtype of q/out, scales and 16-bit rows (__half or __nv_bfloat16)
/// \tparam D  head_dim (64 or 128)
/// \tparam kH query-head slots per CTA (4 or 8)
template <typename T, int D, int kH>
__global__ void __launch_bounds__(kK4V2Threads, 3) decode_k4v2_kernel(const __grid_constant__ K4V2Args a) {
#if __CUDA_ARCH__ >= 900 || defined(MINIKV_WARP_EMULATION)
  using KP = KeyPairs<4>;
  using Prob = ProbOperand<T>;
  constexpr int KS = D / 16;          // 16-channel k-steps of a key row
  constexpr int S = D / 64;           // 64-channel spans of a value row (one 16-byte unit each)
  constexpr int VG = D / kK4V2Group;  // value groups of a token
  constexpr int NE = kH / 4;          // query heads per lane
  constexpr uint32_t e = sizeof(T);
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(kH == 4 || kH == 8, "4 or 8 head slots");

  MINIKV_DYNAMIC_SMEM(smem, 16);
  const uint32_t smem_s = smem_addr(smem);
  const DecodeParams &p = a.p;
  using Lay = K4V2Layout<sizeof(T), D, kH>;
  constexpr uint32_t kStages = Lay::kStages;
  const uint32_t tid = threadIdx.x, w = tid >> 5, lane = tid & 31, gq = lane >> 2, qi = lane & 3;
  const DecodeCta cta(p);
  const uint32_t split = cta.split, seq = cta.seq, kvh = cta.kvh, chunk = cta.chunk, h0 = cta.h0, nh = cta.nh;

  T *qn = reinterpret_cast<T *>(smem + Lay::kQn);
  float *uq_s = reinterpret_cast<float *>(smem + Lay::kUq);
  float *us_s = reinterpret_cast<float *>(smem + Lay::kUs);
  float *bias_part = reinterpret_cast<float *>(smem + Lay::kBiasPart);  // [warp][8][8]
  float *red = reinterpret_cast<float *>(smem + Lay::kRed);              // [warp][kH + 1]
  float *fin = reinterpret_cast<float *>(smem + Lay::kFin);              // [warp][kH][1 + VG]
  const uint32_t bar0 = smem_s + Lay::kMbar;

  // The CTA's queries (zeros past its heads), and the stages' barriers.
  for (uint32_t x = tid; x < kH * D / 8; x += kK4V2Threads) {
    const uint32_t h = x / (D / 8), c8 = x % (D / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (h < nh) v = reinterpret_cast<const uint4 *>(static_cast<const T *>(p.q) + (uint64_t(seq) * p.num_heads + h0 + h) * D)[c8];
    reinterpret_cast<uint4 *>(qn)[x] = v;
  }
  if (tid == 0) {
    for (uint32_t s = 0; s < kStages; ++s) bulk::mbar_init(bar0 + 8 * s, kK4V2Warps);
    bulk::fence_mbar_init();
  }
  __syncthreads();

  // This thread's share of the key operand: key group w of a tile, head slots uh + 4η,
  // quarter ui of the channels, half uk of its key pairs (D / 8 contiguous channels).
  const uint32_t uh = lane >> 3, ui = (lane >> 1) & 3, uk = lane & 1;
  const uint32_t uc0 = ui * (D / 4) + uk * (D / 8);
  uint32_t q2[NE][KS];  // q' pairs (key-pair order), prescaled by 2^(kq - offset)
#pragma unroll
  for (int eta = 0; eta < NE; ++eta) {
    const T *qh = qn + (uh + 4 * eta) * D + uc0;
    float qq[D / 8];
#pragma unroll
    for (int v = 0; v < D / 64; ++v) {
      float f[8];
      unpack8<T>(reinterpret_cast<const uint4 *>(qh)[v], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) qq[8 * v + j] = f[j];
    }
    float mx = 0.0f;
#pragma unroll
    for (int P = 0; P < KS; ++P) {
      const float inv = pow2i(-KP::offset(P));
      mx = fmaxf(mx, fmaxf(fabsf(qq[KP::lo(P)] * inv), fabsf(qq[KP::hi(P)] * inv)));
    }
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 4));
    const int kq = mx > 0.0f ? clamp_exp(6 - exponent_of(mx), 100) : 0;
#pragma unroll
    for (int P = 0; P < KS; ++P) {
      const float f = pow2i(kq - KP::offset(P));
      q2[eta][P] = pack_f16(qq[KP::lo(P)] * f, qq[KP::hi(P)] * f);
    }
    if (w == 0 && (lane & 7) == 0) uq_s[uh + 4 * eta] = pow2i(12 - kq);
  }
  // The bias mma's A operand: q of head g (rows 0..7), this warp's quarter of the k-steps.
  uint32_t qa[KS / 4][2];
#pragma unroll
  for (int kk = 0; kk < KS / 4; ++kk) {
    const int ks = w * (KS / 4) + kk;
    const bool live = gq < uint32_t(kH);
    qa[kk][0] = live ? lds32(reinterpret_cast<const uint8_t *>(qn + gq * D + 16 * ks + 2 * qi)) : 0u;
    qa[kk][1] = live ? lds32(reinterpret_cast<const uint8_t *>(qn + gq * D + 16 * ks + 8 + 2 * qi)) : 0u;
  }

  const SequenceTiles<K4V2Tiles> tiles(p.sinks[seq], p.quantized[seq], p.residual[seq], a.tiles);
  const SplitTiles range(tiles.total, p.splits, split);
  const uint32_t t_begin = range.begin, t_end = range.end;
  const SequenceSlot sslot(p, seq);
  const int32_t *table = sslot.table;
  const uint8_t *res_slot = sslot.residual;
  const HeadRegions regions(p.st.block, kvh);

  // Per lane: running max and its part of the sum per head; the quantized values'
  // accumulators (units: code patterns · 2^(o − 24) · 2^Sv) and the 16-bit rows' (p ·
  // Prob::kScale), [span][head block][C fragment]; Σ p · m_v per head and value group.
  float m_run[NE], l_part[NE], acc[S][NE][4], acc16[S][NE][4], vb[NE][VG];
#pragma unroll
  for (int eta = 0; eta < NE; ++eta) {
    m_run[eta] = -INFINITY;
    l_part[eta] = 0.0f;
#pragma unroll
    for (int j = 0; j < VG; ++j) vb[eta][j] = 0.0f;
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[s][eta][c] = acc16[s][eta][c] = 0.0f;
  }
  int Sv = 0;
  bool sv_set = false;

  if (split == 0 && chunk == 0) store_appended_row(p, seq, kvh, tid, kK4V2Threads);

  // The key operand of a quantized tile (stage, count): group w's hi and lo pieces per
  // (head, channel pair), its 2^(12 − ks), and this warp's q · m_k partial sums. Read by
  // every warp's QK after the next CTA barrier.
  auto build_key_operand = [&](const uint8_t *stage, uint32_t count) {
    const uint32_t groups = count / kK4V2Group;
    // 1. The key operand of group w: hi and lo pieces per (head, channel pair).
    if (w < groups) {
      uint32_t sw[D / 16];
      load_words(stage + Lay::kKScale + w * D * e + uc0 * e, sw);
      const int ks = key_scale_exponent<T, 8>(sw);
      if (lane == 0) us_s[w] = pow2i(12 - ks);
      uint32_t s2[KS];  // s' = s · 2^ks of each key pair's channels
      scaled_key_scales<T, 4>(sw, ks, s2);
      uint8_t *bq = smem + Lay::kBqk + (w >> 1) * Lay::kBqkPass;
#pragma unroll
      for (int eta = 0; eta < NE; ++eta) {
        const uint32_t n = 2 * kH * (w & 1) + 2 * (uh + 4 * eta);  // the hi row; lo is n + 1
#pragma unroll
        for (int P = 0; P < KS; ++P) {
          const uint32_t hi = hmul2_bits(q2[eta][P], s2[P]);
          const uint32_t lo = hfms2_bits(q2[eta][P], s2[P], hi);
          const int Pq = int(uk) * KS + P;  // the pair's index in its quarter
          const uint32_t k = 16 * (Pq / 2) + 8 * (Pq % 2) + 2 * ui;
          sts32(bq + n * Lay::kBqkStride + 2 * k, hi);
          sts32(bq + (n + 1) * Lay::kBqkStride + 2 * k, lo);
        }
      }
    }
    // The bias q · m_k: rows = heads, columns = the tile's key groups; this warp's k-steps.
    {
      const uint8_t *kmin = stage + Lay::kKMin;
      float cb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const bool live = gq < groups;
#pragma unroll
      for (int kk = 0; kk < KS / 4; ++kk) {
        const int ks = int(w) * (KS / 4) + kk;
        const uint8_t *mrow = kmin + (live ? gq : 0) * D * e + (16 * ks + 2 * qi) * e;
        const uint32_t b0 = live ? lds32(mrow) : 0u, b1 = live ? lds32(mrow + 8 * e) : 0u;
        const uint32_t av[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
        mma_16816<T>(cb, av, b0, b1);
      }
      if (gq < uint32_t(kH)) {
        bias_part[(w * 8 + gq) * 8 + 2 * qi] = cb[0];
        bias_part[(w * 8 + gq) * 8 + 2 * qi + 1] = cb[1];
      }
    }
  };

  // Every warp stages its share of a tile (k4v2_stage); the block pointer of the next tile
  // to stage is loaded a tile ahead, so its latency is off the path to the copies.
  constexpr uint32_t ahead = kStages - 1;
  for (uint32_t s = 0; s < ahead; ++s)
    if (t_begin + s < t_end) {
      const TileRef tr = tiles.tile(t_begin + s, a.tiles);
      k4v2_stage<T, D>(a, tr, k4v2_block_of(a, tr, table), res_slot, kvh, regions,
                       smem_s + s * Lay::kStageBytes, bar0 + 8 * s, w, lane);
    }
  const uint8_t *next_block =
      t_begin + ahead < t_end ? k4v2_block_of(a, tiles.tile(t_begin + ahead, a.tiles), table) : nullptr;
  uint32_t phases = 0, buf = 0, nxt = ahead;
  auto wait_stage = [&](uint32_t b) {
    bulk::mbar_wait(bar0 + 8 * b, (phases >> b) & 1u);
    phases ^= 1u << b;
  };
  for (uint32_t ti = t_begin; ti < t_end; ++ti) {
    wait_stage(buf);
    const uint8_t *stage = smem + buf * Lay::kStageBytes;
    const uint32_t next_stage = buf + 1 == kStages ? 0 : buf + 1;
    const TileRef tr = tiles.tile(ti, a.tiles);
    const uint32_t count = tr.count;
    const bool quant = tr.segment == kSegQuantized;
    // Every warp's share of the tile `ahead` on, into the previous tile's stage (free once
    // every warp is past this tile's barrier (1)), and the block pointer of the one after.
    auto issue_next = [&] {
      if (ti + ahead < t_end) {
        const TileRef nt = tiles.tile(ti + ahead, a.tiles);
        k4v2_stage<T, D>(a, nt, next_block, res_slot, kvh, regions, smem_s + nxt * Lay::kStageBytes,
                         bar0 + 8 * nxt, w, lane);
        next_block = ti + ahead + 1 < t_end ? k4v2_block_of(a, tiles.tile(ti + ahead + 1, a.tiles), table)
                                             : nullptr;
      }
      nxt = nxt + 1 == kStages ? 0 : nxt + 1;
    };
    // Three CTA barriers per tile: after the key operand (1), the tile's maxima (2) and P·V's
    // B operand (3). The previous tile's readers of what this tile rewrites before (1) (the
    // key operand, the bias partials) all passed its barrier (2).
    if (quant) build_key_operand(stage, count);
    __syncthreads();  // (1) the key operand and the bias partials are complete
    issue_next();

    float lg[2][NE][2];  // [pass][head][row r: token 16w + g + 8r of the pass], log2 units
    uint32_t vmx_bits = 0;  // the largest value scale of the lane's tokens (>= 0: as integers)
    uint32_t svw[2][2][(VG + 1) / 2], mvw[2][2][(VG + 1) / 2];  // their value scales, minima (dtype)
    if (quant) {
      // 2. Logits of the warp's tokens, pass by pass.
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        const bool valid = 64u * pass + 16u * w < count;
        if (!valid) {
#pragma unroll
          for (int eta = 0; eta < NE; ++eta) lg[pass][eta][0] = lg[pass][eta][1] = -INFINITY;
          continue;
        }
        const uint32_t t0 = 64 * pass + 16 * w + gq;
        uint32_t w0[D / 32], w1[D / 32];
        load_key_quarter<D>(stage + t0 * (D / 2) + qi * (D / 8), w0);
        load_key_quarter<D>(stage + (t0 + 8) * (D / 2) + qi * (D / 8), w1);
        const uint8_t *brow = smem + Lay::kBqk + pass * Lay::kBqkPass + 2 * kH * (w >> 1) * Lay::kBqkStride;
        float d[NE][2][4] = {};  // (head block, k-step parity): independent chains
#pragma unroll
        for (int ks = 0; ks < KS; ks += 2) {
          uint32_t b[NE][4];
#pragma unroll
          for (int eta = 0; eta < NE; ++eta)
            ldmatrix_x4(b[eta], brow + (8 * eta + (lane & 7)) * Lay::kBqkStride + (16 * ks + 8 * (lane >> 3)) * 2);
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int k = ks + h2;
            const uint32_t av[4] = {KP::code_pair(w0[(2 * k) / 4], 2 * k), KP::code_pair(w1[(2 * k) / 4], 2 * k),
                                    KP::code_pair(w0[(2 * k + 1) / 4], 2 * k + 1),
                                    KP::code_pair(w1[(2 * k + 1) / 4], 2 * k + 1)};
#pragma unroll
            for (int eta = 0; eta < NE; ++eta) mma_16816<__half>(d[eta][h2], av, b[eta][2 * h2], b[eta][2 * h2 + 1]);
          }
        }
        const uint32_t kg = 2 * pass + (w >> 1);  // the warp's key group in the tile
#pragma unroll
        for (int eta = 0; eta < NE; ++eta) {
          const uint32_t h = qi + 4 * eta;
          float bias = 0.0f;
#pragma unroll
          for (int ww = 0; ww < int(kK4V2Warps); ++ww) bias += bias_part[(ww * 8 + h) * 8 + kg];
          const float un = uq_s[h] * us_s[kg] * p.scale_log2, bl2 = bias * p.scale_log2;
          lg[pass][eta][0] = fmaf((d[eta][0][0] + d[eta][0][1]) + (d[eta][1][0] + d[eta][1][1]), un, bl2);
          lg[pass][eta][1] = fmaf((d[eta][0][2] + d[eta][0][3]) + (d[eta][1][2] + d[eta][1][3]), un, bl2);
        }
        // The value scales and minima of the two tokens.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t t = t0 + 8 * r;
          load_value_scales<VG>(stage + Lay::kVScale + t * VG * e, stage + Lay::kVMin + t * VG * e, svw[pass][r],
                                mvw[pass][r]);
#pragma unroll
          for (int j = 0; j < VG / 2; ++j) vmx_bits = __vmaxu2(vmx_bits, svw[pass][r][j] & 0x7fff7fffu);
        }
      }
    } else {
      // 1'. 16-bit rows: logits of tokens 16w + g (+ 8) on warps 0 and 1 (ptile <= 32).
#pragma unroll
      for (int eta = 0; eta < NE; ++eta) lg[0][eta][0] = lg[0][eta][1] = lg[1][eta][0] = lg[1][eta][1] = -INFINITY;
      if (16 * w < count) {
        float d[NE][4] = {};
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          uint32_t av[4];
          ldmatrix_x4(av, stage + (16 * w + (lane & 7) + 8 * ((lane >> 3) & 1)) * Lay::kRowStride +
                              (16 * ks + 8 * (lane >> 4)) * e);
#pragma unroll
          for (int eta = 0; eta < NE; ++eta) {
            // B column g: head g / 2 (+ 4η) for even g, zero for odd g (the "lo" columns).
            const uint8_t *qrow = reinterpret_cast<const uint8_t *>(qn + ((gq >> 1) + 4 * eta) * D + 16 * ks + 2 * qi);
            const uint32_t b0 = gq & 1 ? 0u : lds32(qrow), b1 = gq & 1 ? 0u : lds32(qrow + 8 * e);
            mma_16816<T>(d[eta], av, b0, b1);
          }
        }
#pragma unroll
        for (int eta = 0; eta < NE; ++eta)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            lg[0][eta][r] = 16 * w + gq + 8 * r < count ? d[eta][2 * r] * p.scale_log2 : -INFINITY;
      }
    }

    // 3. The CTA's running max per head (and, for quantized values, Sv).
    float tmax[NE];
#pragma unroll
    for (int eta = 0; eta < NE; ++eta) {
      tmax[eta] = fmaxf(fmaxf(lg[0][eta][0], lg[0][eta][1]), fmaxf(lg[1][eta][0], lg[1][eta][1]));
      tmax[eta] = fmaxf(tmax[eta], __shfl_xor_sync(kFull, tmax[eta], 4));
      tmax[eta] = fmaxf(tmax[eta], __shfl_xor_sync(kFull, tmax[eta], 8));
      tmax[eta] = fmaxf(tmax[eta], __shfl_xor_sync(kFull, tmax[eta], 16));
    }
    float vmx = elem_to_float<T>(max(vmx_bits & 0xffffu, vmx_bits >> 16), 0);
    vmx = fmaxf(vmx, __shfl_xor_sync(kFull, vmx, 4));
    vmx = fmaxf(vmx, __shfl_xor_sync(kFull, vmx, 8));
    vmx = fmaxf(vmx, __shfl_xor_sync(kFull, vmx, 16));
    if (gq == 0) {
#pragma unroll
      for (int eta = 0; eta < NE; ++eta) red[w * (kH + 1) + qi + 4 * eta] = tmax[eta];
      if (qi == 0) red[w * (kH + 1) + kH] = vmx;
    }
    __syncthreads();  // (2)
    float base[NE], corr[NE];
#pragma unroll
    for (int eta = 0; eta < NE; ++eta) {
      float mt = m_run[eta];
#pragma unroll
      for (int ww = 0; ww < int(kK4V2Warps); ++ww) mt = fmaxf(mt, red[ww * (kH + 1) + qi + 4 * eta]);
      base[eta] = mt == -INFINITY ? 0.0f : mt;
      corr[eta] = ex2(m_run[eta] - base[eta]);
      m_run[eta] = mt;
    }
    float rescale = 1.0f;
    if (quant) {
      float vt = 0.0f;
#pragma unroll
      for (int ww = 0; ww < int(kK4V2Warps); ++ww) vt = fmaxf(vt, red[ww * (kH + 1) + kH]);
      if (vt > 0.0f) {
        const int want = clamp_exp(14 - exponent_of(vt), 60);
        const int sv_new = sv_set ? min(Sv, want) : want;
        sv_set = true;
        rescale = pow2i(sv_new - Sv);
        Sv = sv_new;
      }
    }
    float pr[2][NE][2];
#pragma unroll
    for (int eta = 0; eta < NE; ++eta) {
      float sum = 0.0f;
#pragma unroll
      for (int pass = 0; pass < 2; ++pass)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          pr[pass][eta][r] = ex2(lg[pass][eta][r] - base[eta]);  // 0 where masked
          sum += pr[pass][eta][r];
        }
      l_part[eta] = fmaf(l_part[eta], corr[eta], sum);
#pragma unroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[s][eta][c] *= corr[eta] * rescale;
          acc16[s][eta][c] *= corr[eta];
        }
#pragma unroll
      for (int j = 0; j < VG; ++j) vb[eta][j] *= corr[eta];
    }

    // 4. The B operand of P·V: this warp's k-step(s), K positions 2g and 2g + 1.
    uint8_t *bpv = smem + Lay::kBpv;
    if (quant) {
      const float unit = pow2i(Sv);
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        if (64u * pass + 16u * w >= count) continue;
        const uint32_t kpos = 16 * (4 * pass + w) + 2 * gq;
        float sv[2][VG], mv[2][VG];
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int j = 0; j < VG; ++j) {
            sv[r][j] = elem_to_float<T>(svw[pass][r][j / 2], j & 1) * unit;
            mv[r][j] = elem_to_float<T>(mvw[pass][r][j / 2], j & 1);
          }
#pragma unroll
        for (int eta = 0; eta < NE; ++eta) {
          const float p0 = pr[pass][eta][0], p1 = pr[pass][eta][1];
          const uint32_t h = qi + 4 * eta;
#pragma unroll
          for (int j = 0; j < VG; ++j) {
            // Value group j = span j / 2, column (h, j % 2).
            sts32(bpv + (j / 2) * Lay::kBpvSpan + (2 * h + (j & 1)) * Lay::kBpvStride + 2 * kpos,
                  pack_f16(p0 * sv[0][j], p1 * sv[1][j]));
            vb[eta][j] = fmaf(p0, mv[0][j], fmaf(p1, mv[1][j], vb[eta][j]));
          }
        }
      }
    } else if (16 * w < count) {
      const uint32_t kpos = 16 * w + 2 * gq;
#pragma unroll
      for (int eta = 0; eta < NE; ++eta) {
        const uint32_t h = qi + 4 * eta;
        const Prob pb(pr[0][eta][0], pr[0][eta][1], 0.0f, 0.0f);
#pragma unroll
        for (int c = 0; c < 2; ++c) {  // both columns of the head: the value-group slots
          sts32(bpv + (2 * h + c) * Lay::kBpvStride + 2 * kpos, pb.hi[0]);
          if constexpr (!std::is_same<T, __half>::value)
            sts32(bpv + Lay::kBpvSpan + (2 * h + c) * Lay::kBpvStride + 2 * kpos, pb.lo[0]);
        }
      }
    }
    __syncthreads();  // (3) B of P·V is complete

    // 5. P·V over the tile's k-steps, this warp's channels.
    if (quant) {
      const uint8_t *vc = stage + Lay::kVCodes;
      const uint32_t sh = w >= 2 ? 8u : 0u;
      const uint32_t m0 = (3u << (4 * (w & 1))) * 0x00010001u, m1 = m0 << 2;
      // ldmatrix.trans row addresses: matrix mi = (K half, span), row = K position → token.
      const uint32_t mi = lane >> 3, pp = (mi & 1) * 8 + (lane & 7);
      const uint32_t tok = (pp & 1) ? pp / 2 + 8 : pp / 2;
      const uint8_t *vaddr = vc + tok * (D / 4) + (S > 1 ? (mi >> 1) * 16 : 0);
      for (uint32_t kk = 0; kk < count / 16; kk += 2) {
        uint32_t b[S][NE][4];
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
          for (int eta = 0; eta < NE; ++eta)
            ldmatrix_x4(b[s][eta], bpv + s * Lay::kBpvSpan + (8 * eta + (lane & 7)) * Lay::kBpvStride +
                                       (16 * kk + 8 * (lane >> 3)) * 2);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          uint32_t R[4];
          ldmatrix_x4_trans(R, vaddr + (16 * (kk + h2)) * (D / 4));
#pragma unroll
          for (int s = 0; s < S; ++s) {
            const uint32_t lo = R[2 * s] >> sh, hi = R[2 * s + 1] >> sh;
            const uint32_t av[4] = {lo & m0, lo & m1, hi & m0, hi & m1};
#pragma unroll
            for (int eta = 0; eta < NE; ++eta)
              mma_16816<__half>(acc[s][eta], av, b[s][eta][2 * h2], b[s][eta][2 * h2 + 1]);
          }
        }
      }
    } else {
      const uint8_t *vrows = stage + Lay::kRowV;
      for (uint32_t kk = 0; kk * 16 < count; ++kk) {
        // K positions 2i, 2i + 1, 2i + 8, 2i + 9 are tokens i, i + 8, i + 4, i + 12.
        const uint32_t tk[4] = {16 * kk + qi, 16 * kk + qi + 8, 16 * kk + qi + 4, 16 * kk + qi + 12};
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const uint32_t c = 64 * s + 8 * gq + 2 * w;
          uint32_t W[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) W[j] = tk[j] < count ? lds32(vrows + tk[j] * Lay::kRowStride + c * e) : 0u;
          const uint32_t av[4] = {prmt(W[0], W[1], 0x5410u), prmt(W[0], W[1], 0x7632u),
                                  prmt(W[2], W[3], 0x5410u), prmt(W[2], W[3], 0x7632u)};
#pragma unroll
          for (int eta = 0; eta < NE; ++eta) {
            const uint8_t *brow = bpv + (8 * eta + gq) * Lay::kBpvStride + (16 * kk + 2 * qi) * 2;
            mma_16816<T>(acc16[s][eta], av, lds32(brow), lds32(brow + 16));
            if constexpr (!std::is_same<T, __half>::value)
              mma_16816<T>(acc16[s][eta], av, lds32(brow + Lay::kBpvSpan), lds32(brow + Lay::kBpvSpan + 16));
          }
        }
      }
    }
    buf = next_stage;
  }

  // The sums and Σ p · m_v over the warp's lanes of each head, then over the warps.
#pragma unroll
  for (int eta = 0; eta < NE; ++eta) {
    float l = l_part[eta];
    l += __shfl_xor_sync(kFull, l, 4);
    l += __shfl_xor_sync(kFull, l, 8);
    l += __shfl_xor_sync(kFull, l, 16);
    float v[VG];
#pragma unroll
    for (int j = 0; j < VG; ++j) {
      v[j] = vb[eta][j];
      v[j] += __shfl_xor_sync(kFull, v[j], 4);
      v[j] += __shfl_xor_sync(kFull, v[j], 8);
      v[j] += __shfl_xor_sync(kFull, v[j], 16);
    }
    if (gq == 0) {
      float *f = fin + (w * kH + qi + 4 * eta) * (1 + VG);
      f[0] = l;
#pragma unroll
      for (int j = 0; j < VG; ++j) f[1 + j] = v[j];
    }
  }
  __syncthreads();

  // Each (head, channel) of the output lives in one lane: channel 64s + 8g + 2w + r, its
  // value group's column 2i + (g / 4) of head block η. The outputs and each head's (max,
  // sum) go to shared memory over stage 0 (no copy is in flight after the last tile, and the
  // barrier above ends its reads), then out as whole rows with 16-byte stores: the owners'
  // channels lie 8 apart, so stored from the fragments every 4 bytes took a sector.
  float *out_s = reinterpret_cast<float *>(smem);  // [kH][D]
  float *ml_s = out_s + kH * D;                    // [kH][2]
  const uint32_t col = gq >> 2;
#pragma unroll
  for (int eta = 0; eta < NE; ++eta) {
    const uint32_t h = qi + 4 * eta;
    if (h >= nh) continue;
    float L = 0.0f;
#pragma unroll
    for (int ww = 0; ww < int(kK4V2Warps); ++ww) L += fin[(ww * kH + h) * (1 + VG)];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      float VB = 0.0f;
#pragma unroll
      for (int ww = 0; ww < int(kK4V2Warps); ++ww) VB += fin[(ww * kH + h) * (1 + VG) + 1 + 2 * s + col];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t ch = 64 * s + 8 * gq + 2 * w + r;
        const int off = int(4 * (w & 1) + 2 * r);  // the code's bit offset in its fp16 half
        const float q = col ? acc[s][eta][2 * r + 1] : acc[s][eta][2 * r];
        const float q16 = col ? acc16[s][eta][2 * r + 1] : acc16[s][eta][2 * r];
        out_s[h * D + ch] = fmaf(q, pow2i(24 - off - Sv), fmaf(q16, 1.0f / Prob::kScale, VB));
      }
    }
    if (w == 0 && gq == 0) {
      ml_s[2 * h] = m_run[eta];
      ml_s[2 * h + 1] = L;
    }
  }
  __syncthreads();
  store_decode_rows<T, D>(p, uint64_t(seq) * p.num_heads + h0, nh, split, out_s, ml_s, tid, kK4V2Threads);
#endif
}

// The launchers; a CPU emulation (tests/emulation) runs the kernel itself.
#ifndef MINIKV_WARP_EMULATION
// fn(kernel, its dynamic shared memory) of (dtype, head_dim, head slots).
template <typename Fn> void dispatch_k4v2(minikv_dtype dtype, uint32_t head_dim, uint32_t kH, Fn &&fn) {
  dispatch_dtype_head_dim<K4V2DecodeHeadDims>(dtype, head_dim, "minikv_decode", [&](auto tag, auto hd) {
    using T = decltype(tag);
    constexpr int D = decltype(hd)::value;
    if (kH <= 4) fn(decode_k4v2_kernel<T, D, 4>, K4V2Layout<sizeof(T), D, 4>::kTotal);
    else fn(decode_k4v2_kernel<T, D, 8>, K4V2Layout<sizeof(T), D, 8>::kTotal);
  });
}
#endif  // MINIKV_WARP_EMULATION

}  // namespace

#ifndef MINIKV_WARP_EMULATION
bool decode_k4v2_path(const BlockLayout &bl, uint32_t n_rep) {
  return n_rep >= 1 && bl.elem_bytes == 2 && bl.key_bits == 4 && bl.value_bits == 2 &&
         bl.group == kK4V2Group && in_list(K4V2DecodeHeadDims{}, bl.head_dim) &&
         head_dim_compiled(bl.head_dim);
}

uint32_t configure_decode_k4v2(minikv_dtype dtype, const BlockLayout &bl, uint32_t heads_per_cta) {
  uint32_t ctas = 0;
  dispatch_k4v2(dtype, bl.head_dim, k4v2_head_slots(heads_per_cta), [&](auto kernel, uint32_t smem) {
    ctas = configure_sm90_kernel(kernel, kK4V2Threads, smem);
  });
  return ctas;
}

void launch_decode_k4v2(minikv_dtype dtype, const DecodeParams &p, const K4V2LaunchPlan &plan,
                        cudaStream_t stream) {
  const uint32_t n_rep = p.num_heads / p.num_kv_heads;
  const uint32_t chunks = (n_rep + p.heads_per_cta - 1) / p.heads_per_cta;
  const K4V2Args args{p, plan.tiles, plan.block_tokens};
  dispatch_k4v2(dtype, p.st.block.head_dim, k4v2_head_slots(p.heads_per_cta), [&](auto kernel, uint32_t smem) {
    kernel<<<dim3(p.splits, p.num_kv_heads * chunks, p.n), kK4V2Threads, smem, stream>>>(args);
    check_launch_error("decode_k4v2_kernel");
  });
  if (p.splits > 1) launch_decode_merge(dtype, p.st.block.head_dim, p, stream);
}

#endif  // MINIKV_WARP_EMULATION
}  // namespace kernels
}  // namespace minikv
