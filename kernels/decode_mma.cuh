// Decode attention on tensor cores, every storage configuration: key and value codes of 2,
// 4 or 8 bits or 16-bit rows, any group size G >= 16 with D / G <= 8, attention sinks and
// the 16-bit residual. Made for GQA groups (n_rep >= 2); MHA can run it too.
//
// One CTA of four warps per (split, KV head × head chunk of <= 8 query heads, sequence). A
// split walks its tiles in cache order (sinks, quantized blocks, residual; tile sizes and
// pipeline depth from decode_mma_plan.h), staged by every thread with cp.async, one or two
// tiles ahead, one barrier per tile. Each warp takes a quarter of every tile (16 or 32
// tokens) and keeps its own softmax state; the four are merged through shared memory at
// the end. One instance per (dtype, head_dim, key bits, value bits), in one file per key
// bit width (decode_mma_k<KB>.cu): tile strides and code layouts are compile-time.
// Both products run on mma.sync m16n8k16 with fp32 accumulation; lane (g, i) = (lane / 4,
// lane % 4) in the fragment notation.
//
// QK: M = the CTA's query heads (rows 0..7 live), N = 8 tokens, K = channels.
//   Quantized keys: logit = Σ_c (q_c s_c) · code_c + q · m_k. B = codes as fp16 subnormals
//   (code c at bit offset o of a 16-bit half is the fp16 c · 2^o · 2^-24: one LOP3 per code
//   pair, exact). A = q ⊙ s_k in two fp16 pieces, exact: q' = q · 2^(kq − o) (per head, once)
//   and s' = s · 2^ks (per key group) are fp16 with max |q'| < 2^7 and max |s'| < 2^8, so
//   hi = fp16(q' · s') and lo = fma(q', s', −hi) (the product has <= 22 significant bits,
//   its residual <= 11) carry it exactly, except where a value or a residual falls below
//   fp16's normal range: each such element is off by at most 2^-25 in units of q' · s',
//   i.e. |logit error| <= 3 · D · 2^-25 · 2^-(kq + ks) · (2^bits − 1) / 3
//   ~ D · 2^-39 · (2^bits − 1) · max|q| · max|s| (plus fp32 accumulation), below one fp32
//   ulp of the largest term. The bias q · m_k is one mma<T> with exact products. The
//   pieces are built once per key group and warp, into the warp's shared memory.
//   16-bit keys: A = q, B = K rows (ldmatrix), exact products.
// Softmax: fp32, log2 units, per head (row g of the C fragment holds head g, tokens 2i and
//   2i + 1 of each n-tile: exactly the B fragment P·V needs, no shuffle or shared memory).
// PV: M = channels (16 per m-tile), N = heads, K = tokens.
//   Quantized values: out = Σ_t (p s_v) · code + Σ_t p · m_v. A = codes of two tokens per
//   register (PRMT + LOP3, fp16 subnormals as above). B = fp16(p · s_v · 2^Sv): the one
//   rounding MINIKV.md allows, Sv a per-warp power of two that keeps the largest p · s_v
//   below 2^15 (set by the warp's first quantized tile, lowered when a tile needs it, the
//   accumulators rescaled then). The bias Σ p · m_v is an mma of m_v (rows = value groups)
//   against p rounded once (fp16 · 2^12; bf16: two pieces).
//   16-bit values: A = V rows transposed by ldmatrix.trans, B = p as above.
// In a launch of minikv_append_decode the residual's newest row is staged from the caller's
// k/v, and one CTA per (sequence, KV head) stores it into the slot (decode_common.cuh).
// A CTA with one split writes the normalized output, otherwise (max, sum, unnormalized
// output) partials that decode_merge.cu combines.
#pragma once

#include <type_traits>

#include "common.cuh"
#include "decode_common.cuh"
#include "decode_mma_plan.h"
#include "decode_operands.cuh"
#include "decode_tiles.cuh"
#include "dispatch.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

// The cache's group size G: kG where an instance fixes it at compile time (the default
// storage's: every group branch and scale index below then folds), else the layout's.
template <int kG> __device__ __forceinline__ uint32_t group_size(const BlockLayout &bl) {
  return kG != 0 ? uint32_t(kG) : bl.group;
}
template <int kG> __device__ __forceinline__ uint32_t group_shift(const BlockLayout &bl) {
  static_assert(kG == 0 || (kG >= 16 && (kG & (kG - 1)) == 0), "G: a power of two >= 16");
  if constexpr (kG != 0) return uint32_t(__builtin_ctz(kG));
  else return __ffs(bl.group) - 1;
}

// ---- staging (the CTA's threads) --------------------------------------------------------
// Staged rows are kStride bytes apart (an odd number of 16-byte units: conflict-free reads,
// decode_generic_plan.h); a row of 16-bit values or of 16-byte-multiple codes.
__host__ __device__ constexpr uint32_t mma_row_stride(uint32_t row_bytes) {
  return ((row_bytes / 16) | 1u) * 16;
}

// `rows` (<= kMmaMaxTile) code rows of kRowBytes (a power-of-two multiple of 16), contiguous
// at src, into rows kStride apart: each thread copies the same 16-byte unit of every
// (threads / units)-th row, at constant offsets: a fixed number of predicated copies where
// rows are short (a loop's bookkeeping was a fifth of the 4-bit-key kernel's instructions).
template <uint32_t kRowBytes>
__device__ __forceinline__ void copy_code_rows(uint32_t dst, const uint8_t *src, uint32_t rows,
                                               uint32_t tid) {
  constexpr uint32_t kUnits = kRowBytes / 16, kStride = mma_row_stride(kRowBytes);
  static_assert(kUnits > 0 && (kUnits & (kUnits - 1)) == 0 && kMmaThreads % kUnits == 0, "");
  constexpr uint32_t kRowsPerPass = kMmaThreads / kUnits;
  constexpr uint32_t kPasses = (kMmaMaxTile + kRowsPerPass - 1) / kRowsPerPass;
  const uint32_t r = tid / kUnits;
  const uint32_t d = dst + r * kStride + (tid % kUnits) * 16;
  const uint8_t *s = src + tid * 16;
  if constexpr (kPasses <= 8) {
#pragma unroll
    for (uint32_t j = 0; j < kPasses; ++j)
      if (r + j * kRowsPerPass < rows) cp_async_16(d + j * kRowsPerPass * kStride, s + j * kMmaThreads * 16);
  } else {  // 16-bit rows of head_dim 128: unrolled, they measured 20% slower (H200)
    for (uint32_t j = 0; r + j * kRowsPerPass < rows; ++j)
      cp_async_16(d + j * kRowsPerPass * kStride, s + j * kMmaThreads * 16);
  }
}

// `rows` 16-bit rows (kRowBytes) into rows kStride apart, and zeros up to the next multiple
// of 16: the mma reads whole 16-token k-steps, and a stale row of an earlier tile (codes
// read as fp16) may be Inf or NaN, which 0 · row would not cancel. Row `sub` (if below
// `rows`) comes from `sub_src` instead: the appended token (decode_common.cuh).
template <uint32_t kRowBytes>
__device__ __forceinline__ void copy_value_rows(uint32_t dst, const uint8_t *src, uint32_t rows,
                                                uint32_t tid, uint32_t sub,
                                                const uint8_t *sub_src) {
  constexpr uint32_t kUnits = kRowBytes / 16, kStride = mma_row_stride(kRowBytes);
  const uint32_t padded = (rows + 15) / 16 * 16;
  for (uint32_t x = tid; x < padded * kUnits; x += kMmaThreads) {
    const uint32_t r = x / kUnits, u = x % kUnits;
    const bool live = r < rows;
    const uint8_t *row = r == sub ? sub_src : src + (live ? r : 0) * kRowBytes;
    cp_async_16(dst + r * kStride + u * 16, row + u * 16, live);
  }
}

// `bytes` (a multiple of 16, at most kMaxBytes) from src to dst.
template <uint32_t kMaxBytes>
__device__ __forceinline__ void copy_bytes(uint32_t d, const uint8_t *src, uint32_t bytes,
                                           uint32_t tid) {
#pragma unroll
  for (uint32_t j = 0; j < (kMaxBytes + 16 * kMmaThreads - 1) / (16 * kMmaThreads); ++j) {
    const uint32_t at = (tid + j * kMmaThreads) * 16;
    if (at < bytes) cp_async_16(d + at, src + at);
  }
}

// Everything a launch of the kernel reads from its parameters: the decode's, and the plan
// and divisor the host computed once.
struct MmaDecodeArgs {
  DecodeParams p;
  MmaDecodePlan g;
  FastDivU32 block_tokens;  // R
};
static_assert(sizeof(MmaDecodeArgs) <= 4096, "kernel parameters exceed 4 KB");

// Stages tile `tr` into the stage buffer at shared-state-space address `stage`.
template <typename T, int D, int KB, int VB, int kG>
__device__ void stage_tile(const MmaDecodeArgs &a, const TileRef &tr, const int32_t *table,
                           const uint8_t *res_slot, uint32_t kvh, const HeadRegions &hr,
                           uint32_t stage, uint32_t tid) {
  const DecodeParams &p = a.p;
  const MmaDecodePlan &g = a.g;
  const BlockLayout &bl = p.st.block;
  constexpr uint32_t e = sizeof(T), kKRow = D * KB / 8, kVRow = D * VB / 8;
  if (tr.segment == kSegQuantized) {
    const uint32_t blk = a.block_tokens.div(tr.first);
    const uint32_t row0 = tr.first - blk * bl.tokens;  // qtile divides R
    const uint32_t G = group_size<kG>(bl), gshift = group_shift<kG>(bl);
    const uint8_t *block = p.st.pool + uint64_t(table[blk]) * bl.bytes;
    // Quantized counts are multiples of G >= 16: no padding.
    copy_code_rows<kKRow>(stage, block + hr.k_codes + row0 * kKRow, tr.count, tid);
    copy_code_rows<kVRow>(stage + g.q_vcodes, block + hr.v_codes + row0 * kVRow, tr.count, tid);
    // At most 128 tokens, G >= 16, D / G <= 8: each scale region is at most 2 KB.
    constexpr uint32_t kMaxScaleBytes = (kMmaMaxTile / 16) * D * e;
    if constexpr (KB != 16) {
      // Every key group the tile touches: a whole tile of G = 128 may hold 64 tokens.
      const uint32_t groups = (tr.count + G - 1) >> gshift;
      const uint32_t bytes = groups * D * e, at = (row0 >> gshift) * D * e;
      copy_bytes<kMaxScaleBytes>(stage + g.q_kscale, block + hr.k_scale + at, bytes, tid);
      copy_bytes<kMaxScaleBytes>(stage + g.q_kmin, block + hr.k_min + at, bytes, tid);
    }
    if constexpr (VB != 16) {
      const uint32_t vg = D >> gshift;  // value groups per token
      const uint32_t at = row0 * vg * e, bytes = (tr.count * vg * e + 15) / 16 * 16;
      constexpr uint32_t kMaxVBytes = kMmaMaxTile * kMmaMaxGroups * e;
      copy_bytes<kMaxVBytes>(stage + g.q_vscale, block + hr.v_scale + at, bytes, tid);
      copy_bytes<kMaxVBytes>(stage + g.q_vmin, block + hr.v_min + at, bytes, tid);
    }
  } else {
    const RowTileSource src = row_tile_source(p, tr, res_slot, kvh);
    constexpr uint32_t kRow = D * e;
    copy_value_rows<kRow>(stage, src.k, tr.count, tid, src.sub, src.sub_k);
    copy_value_rows<kRow>(stage + g.p_v, src.v, tr.count, tid, src.sub, src.sub_v);
  }
}

// q of head g in the key-pair order of its quarter, prescaled: q2[P] = fp16x2(q[lo], q[hi]) ·
// 2^(kq − offset), max |q2| < 2^7; uq = 2^(12 − kq).
template <typename T, int D, int KB>
__device__ __forceinline__ void build_query_pairs(const T *qh, uint32_t qi, uint32_t (&q2)[D / 8],
                                                  float &uq) {
  using KP = KeyPairs<KB>;
  constexpr int QC = D / 4;
  float qq[QC];
#pragma unroll
  for (int v = 0; v < QC / 8; ++v) {
    float f[8];
    if (qh != nullptr) {
      unpack8<T>(reinterpret_cast<const uint4 *>(qh + qi * QC)[v], f);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) qq[v * 8 + e] = f[e];
  }
  float mx = 0.0f;
#pragma unroll
  for (int P = 0; P < D / 8; ++P) {
    const float inv = pow2i(-KP::offset(P));
    mx = fmaxf(mx, fmaxf(fabsf(qq[KP::lo(P)] * inv), fabsf(qq[KP::hi(P)] * inv)));
  }
  mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
  const int kq = mx > 0.0f ? clamp_exp(6 - exponent_of(mx), 100) : 0;
#pragma unroll
  for (int P = 0; P < D / 8; ++P) {
    const float f = pow2i(kq - KP::offset(P));  // kq - offset in [-106, 100]
    q2[P] = pack_f16(qq[KP::lo(P)] * f, qq[KP::hi(P)] * f);
  }
  uq = pow2i(12 - kq);
}

// A = (q ⊙ s_k of one key group) in fp16 pieces hi + lo, key-pair order; us = 2^(12 − ks).
// Written to the warp's xs_s[D / 16][32 lanes]: per k-step ks the A fragment {hi[2ks],
// lo[2ks], hi[2ks + 1], lo[2ks + 1]}: rows g = the hi pieces of head g, rows g + 8 its lo
// pieces (rows the heads leave empty), so one mma multiplies both. Shared memory, not
// registers: the accumulators need those.
template <typename T, int D, int KB>
__device__ __forceinline__ void build_key_operand(const T *ks_row, uint32_t lane,
                                                  const uint32_t *q2_s, uint4 *xs_s, float &us) {
  const uint32_t qi = lane & 3;
  using KP = KeyPairs<KB>;
  constexpr int QC = D / 4, NW = QC / 2;
  uint32_t w[NW];  // natural channel pairs (2j, 2j + 1) of the quarter
#pragma unroll
  for (int v = 0; v < QC / 8; ++v) {
    const uint4 u = reinterpret_cast<const uint4 *>(ks_row + qi * QC)[v];
    w[4 * v] = u.x;
    w[4 * v + 1] = u.y;
    w[4 * v + 2] = u.z;
    w[4 * v + 3] = u.w;
  }
  float mx;
  if constexpr (std::is_same<T, __half>::value) {
    __half2 m2 = __habs2(*reinterpret_cast<const __half2 *>(&w[0]));
#pragma unroll
    for (int j = 1; j < NW; ++j) m2 = __hmax2(m2, __habs2(*reinterpret_cast<const __half2 *>(&w[j])));
    const float2 f = __half22float2(m2);
    mx = fmaxf(f.x, f.y);
  } else {
    mx = 0.0f;
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const float2 f = word_to_float2(w[j], T{});
      mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
  const int ks = mx > 0.0f ? clamp_exp(7 - exponent_of(mx), 100) : 0;
  us = pow2i(12 - ks);
  // All of q's pairs first: loaded between the stores below, each would wait out its own
  // shared-memory latency (the compiler cannot move a load past a store that may alias it).
  uint32_t q2[D / 8];
#pragma unroll
  for (int P = 0; P < D / 8; ++P) q2[P] = q2_s[P * 32 + lane];
  const bool native = std::is_same<T, __half>::value && ks >= -14 && ks <= 15;
  // s' of channels lo and hi as an fp16 pair; both forms give the same bits where both apply.
  auto store_pieces = [&](auto scaled_pair) {
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
      uint32_t xh[2], xl[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int P = 2 * step + h;
        const uint32_t s2 = scaled_pair(KP::lo(P), KP::hi(P));
        xh[h] = hmul2_bits(q2[P], s2);
        xl[h] = hfms2_bits(q2[P], s2, xh[h]);
      }
      xs_s[step * 32 + lane] = make_uint4(xh[0], xl[0], xh[1], xl[1]);
    }
  };
  if (native) {  // fp16 scales: the power of two is exact in fp16 arithmetic
    const uint32_t f2 = pack_f16(pow2i(ks), pow2i(ks));
    store_pieces([&](int lo, int hi) {
      const uint32_t sel = (lo & 1 ? 0x32u : 0x10u) | (hi & 1 ? 0x7600u : 0x5400u);
      return hmul2_bits(prmt(w[lo / 2], w[hi / 2], sel), f2);
    });
  } else {
    const float f = pow2i(ks);
    store_pieces([&](int lo, int hi) {
      return pack_f16(elem_to_float<T>(w[lo / 2], lo & 1) * f, elem_to_float<T>(w[hi / 2], hi & 1) * f);
    });
  }
}

constexpr int kMaxSteps = kMmaWarpTokens / 16;  // 16-token k-steps of a warp's share, at most
using WarpLogits = float[2 * kMaxSteps][2];      // [n-tile][j]: head g, token 8·nt + 2i + j

// Logits of the warp's `steps` k-steps of quantized keys, tokens tok0.. of the staged tile.
template <typename T, int D, int KB>
__device__ __forceinline__ void qk_quantized(const uint8_t *stage, const MmaDecodePlan &g,
                                             uint32_t gshift, uint32_t tok0, uint32_t steps,
                                             const uint32_t *q2_s, const uint32_t *qp_s, uint4 *xs_s, float uq,
                                             float scale_log2, uint32_t lane, WarpLogits &lg) {
  using KP = KeyPairs<KB>;
  constexpr int QB = D * KB / 32;  // bytes of a row's quarter
  constexpr int QW = QB / 4;
  const uint32_t gq = lane >> 2, qi = lane & 3;
  const T *kscale = reinterpret_cast<const T *>(stage + g.q_kscale);
  const uint8_t *kmin = stage + g.q_kmin;

  // Bias q · m_k of the warp's key groups (one or two): C row g = head g, column c = group
  // g0 + c.
  constexpr uint32_t kStride = mma_row_stride(D * KB / 8);
  const uint32_t g0 = tok0 >> gshift, ngroups = ((tok0 + 16 * steps - 1) >> gshift) - g0 + 1;
  float cb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  {
    const bool live = gq < ngroups;
    const uint8_t *mrow = kmin + (g0 + (live ? gq : 0)) * D * sizeof(T) + 2 * qi * sizeof(T);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t a[4] = {qp_s[(2 * ks) * 32 + lane], 0u, qp_s[(2 * ks + 1) * 32 + lane], 0u};
      const uint32_t b0 = live ? *reinterpret_cast<const uint32_t *>(mrow + 16 * ks * sizeof(T)) : 0u;
      const uint32_t b1 = live ? *reinterpret_cast<const uint32_t *>(mrow + (16 * ks + 8) * sizeof(T)) : 0u;
      mma_16816<T>(cb, a, b0, b1);
    }
  }

  float us = 1.0f, bias = 0.0f;
  int group = -1;
  // One k-step (two n-tiles of 8 tokens, one key group: G >= 16) at a time: four
  // independent mma chains.
#pragma unroll
  for (int st = 0; st < kMaxSteps; ++st) {
    if (uint32_t(st) >= steps) break;
    const int gl = int((tok0 + 16u * st) >> gshift);
    if (gl != group) {
      group = gl;
      build_key_operand<T, D, KB>(kscale + gl * D, lane, q2_s, xs_s, us);
      __syncwarp();
      const int c = gl - int(g0);
      const float b0 = __shfl_sync(kFull, cb[0], 4 * gq + c / 2);
      const float b1 = __shfl_sync(kFull, cb[1], 4 * gq + c / 2);
      bias = c & 1 ? b1 : b0;
    }
    uint32_t wd[2][QW];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t *row = stage + (tok0 + 16 * st + 8 * h + gq) * kStride + qi * QB;
      if constexpr (QB % 16 == 0) {
#pragma unroll
        for (int v = 0; v < QB / 16; ++v) {
          const uint4 u = reinterpret_cast<const uint4 *>(row)[v];
          wd[h][4 * v] = u.x;
          wd[h][4 * v + 1] = u.y;
          wd[h][4 * v + 2] = u.z;
          wd[h][4 * v + 3] = u.w;
        }
      } else if constexpr (QB == 8) {
        const uint2 u = *reinterpret_cast<const uint2 *>(row);
        wd[h][0] = u.x;
        wd[h][QW - 1] = u.y;
      } else {
        wd[h][0] = *reinterpret_cast<const uint32_t *>(row);
      }
    }
    float d[2][2][4] = {};  // (n-tile, k-step parity): four independent chains
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      constexpr int kPw = KP::kPerWord;
      const uint4 x = xs_s[ks * 32 + lane];
      const uint32_t a[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t b0 = KP::code_pair(wd[h][(2 * ks) / kPw], 2 * ks);
        const uint32_t b1 = KP::code_pair(wd[h][(2 * ks + 1) / kPw], 2 * ks + 1);
        mma_16816<__half>(d[h][ks & 1], a, b0, b1);
      }
    }
    // Row g (c0, c1): head g's hi products; row g + 8 (c2, c3): its lo products.
    const float unscale = uq * us * scale_log2, bias_log2 = bias * scale_log2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float s0 = (d[h][0][0] + d[h][0][2]) + (d[h][1][0] + d[h][1][2]);
      const float s1 = (d[h][0][1] + d[h][0][3]) + (d[h][1][1] + d[h][1][3]);
      lg[2 * st + h][0] = fmaf(s0, unscale, bias_log2);
      lg[2 * st + h][1] = fmaf(s1, unscale, bias_log2);
    }
  }
}

// Logits of the warp's `steps` k-steps of 16-bit key rows (row stride `stride`, `rows` at
// the warp's first token): exact products.
template <typename T, int D>
__device__ __forceinline__ void qk_rows(const uint8_t *rows, uint32_t stride, uint32_t steps,
                                        const uint32_t *qp_s, float scale_log2,
                                        uint32_t lane, WarpLogits &lg) {
#pragma unroll
  for (int st = 0; st < kMaxSteps; ++st) {
    if (uint32_t(st) >= steps) break;
    float d[2][2][4] = {};  // (n-tile, k-step parity): four independent chains
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // ldmatrix.x4: matrices (k-step ks, channels +0 / +8) and (ks + 1, +0 / +8) of 8 tokens.
      const uint8_t *addr =
          rows + (16 * st + 8 * h + (lane & 7)) * stride + ((lane >> 3) * 8) * sizeof(T);
#pragma unroll
      for (int ks = 0; ks < D / 16; ks += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, addr + ks * 16 * sizeof(T));
        const uint32_t a0[4] = {qp_s[(2 * ks) * 32 + lane], 0u, qp_s[(2 * ks + 1) * 32 + lane], 0u};
        const uint32_t a1[4] = {qp_s[(2 * ks + 2) * 32 + lane], 0u, qp_s[(2 * ks + 3) * 32 + lane], 0u};
        mma_16816<T>(d[h][0], a0, b[0], b[1]);
        mma_16816<T>(d[h][1], a1, b[2], b[3]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lg[2 * st + h][0] = (d[h][0][0] + d[h][1][0]) * scale_log2;
      lg[2 * st + h][1] = (d[h][0][1] + d[h][1][1]) * scale_log2;
    }
  }
}

// P·V̂ of a quantized-value tile into acc (units: code patterns · 2^Sv, see the header).
// vrows: the warp's first token; sv_s: [group][kMmaWarpTokens] scales of the warp's tokens;
// kk: the warp's k-step.
template <int D, int VB>
__device__ __forceinline__ void pv_codes(const uint8_t *vrows, const float *sv_s,
                                         uint32_t gshift, uint32_t kk, float pscale,
                                         const WarpLogits &p, uint32_t lane,
                                         float (&acc)[D / 16][4]) {
  constexpr int U = D * VB / 128;  // 16-byte units of a row
  constexpr int MPU = 8 / VB;      // m-tiles (16 channels) per unit
  constexpr int WPM = VB / 2;      // 32-bit words per m-tile
  constexpr uint32_t stride = mma_row_stride(D * VB / 8);
  const uint32_t gq = lane >> 2, qi = lane & 3;
  const uint32_t t0 = 16 * kk + 2 * qi;
  // Rows g and g + 8 of an m-tile: channel 16·mt + g (+ 8) at bit (g·VB) mod 32 (+ 8·VB).
  const uint32_t bg = ((gq * VB) % 32) / 8, bg8 = (((gq + 8) * VB) % 32) / 8;
  const uint32_t sel_g = bg | bg << 4 | (bg + 4) << 8 | (bg + 4) << 12;
  const uint32_t sel_g8 = bg8 | bg8 << 4 | (bg8 + 4) << 8 | (bg8 + 4) << 12;
  const uint32_t mask = (((1u << VB) - 1u) * 0x00010001u) << ((gq * VB) % 8);
  // Word of rows g and g + 8 inside the m-tile's words; 8-bit rows g >= 4 sit one further.
  constexpr int wg = 0, wg8 = VB == 2 ? 0 : VB == 4 ? 1 : 2;
  const bool hi_word = VB == 8 && gq >= 4;
  const float pf0 = p[2 * kk][0] * pscale, pf1 = p[2 * kk][1] * pscale;
  const float pf2 = p[2 * kk + 1][0] * pscale, pf3 = p[2 * kk + 1][1] * pscale;
  uint32_t b0 = 0, b1 = 0;
  // The scales of the group whose first m-tile comes next, loaded one group ahead: read
  // where they are used, their latency stood between every group's first mma and its operand.
  const float *s_next = sv_s + t0;
  float2 s01 = *reinterpret_cast<const float2 *>(s_next);
  float2 s23 = *reinterpret_cast<const float2 *>(s_next + 8);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint4 r0 = *reinterpret_cast<const uint4 *>(vrows + (t0) * stride + u * 16);
    const uint4 r1 = *reinterpret_cast<const uint4 *>(vrows + (t0 + 1) * stride + u * 16);
    const uint4 r2 = *reinterpret_cast<const uint4 *>(vrows + (t0 + 8) * stride + u * 16);
    const uint4 r3 = *reinterpret_cast<const uint4 *>(vrows + (t0 + 9) * stride + u * 16);
#pragma unroll
    for (int m = 0; m < MPU; ++m) {
      const int mt = u * MPU + m;
      if (((16u * mt) & ((1u << gshift) - 1)) == 0) {  // a value group's first m-tile: B = p · s_v · 2^Sv
        b0 = pack_f16(pf0 * s01.x, pf1 * s01.y);
        b1 = pack_f16(pf2 * s23.x, pf3 * s23.y);
        const uint32_t next = ((16u * mt) >> gshift) + 1;
        if (next < (uint32_t(D) >> gshift)) {
          s_next = sv_s + next * kMmaWarpTokens + t0;
          s01 = *reinterpret_cast<const float2 *>(s_next);
          s23 = *reinterpret_cast<const float2 *>(s_next + 8);
        }
      }
      const int w0 = m * WPM + wg, w8 = m * WPM + wg8;
      auto pick = [&](const uint4 &r, int w) {
        return hi_word ? word_of(r, w + 1) : word_of(r, w);
      };
      uint32_t a[4];
      a[0] = prmt(pick(r0, w0), pick(r1, w0), sel_g) & mask;
      a[1] = prmt(pick(r0, w8), pick(r1, w8), sel_g8) & mask;
      a[2] = prmt(pick(r2, w0), pick(r3, w0), sel_g) & mask;
      a[3] = prmt(pick(r2, w8), pick(r3, w8), sel_g8) & mask;
      mma_16816<__half>(acc[mt], a, b0, b1);
    }
  }
}

// What one warp carries across the tiles of its split: head g's running max and this lane's
// part of the sum, the output accumulators (channels × heads, mma C fragments), the value
// minima's part, and the power of two Sv of the accumulators' units.
template <int D> struct WarpState {
  float m_run = -INFINITY, l_part = 0.0f;
  float acc[D / 16][4];
  float vb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // acc = Σ p·s_v·2^Sv · (code patterns) where values are quantized; 16-bit tiles are folded
  // in these units. The warp's first quantized tile sets Sv, later ones only lower it (no
  // product above 2^15).
  int Sv = 0;
  bool sv_set = false;
};

// Shared-memory operands every tile reads.
struct TileOperands {
  const uint32_t *qp_s, *q2_s;  // query pairs (natural, key-pair order), [D / 8][32]
  uint4 *xs_s;                  // the warp's q ⊙ s_k pieces
  float *sv_s;                  // the warp's value scales, [group][kMmaWarpTokens]
  void *mv_s;                   // the warp's value minima (dtype), same layout
  float uq, scale_log2;
  uint32_t gshift;              // log2 G
};

// The warp's share of one staged tile: k-steps [warp · spw, (warp + 1) · spw) of its
// 16-token k-steps. kQuantSeg: a tile of the quantized segment (value rows at q_vcodes, else
// a sink or residual tile: at p_v; both are 16-bit rows in an eviction-only cache); TKB /
// TVB: the tile's key / value bits (16 for 16-bit rows); VB: the cache's value bits (the
// accumulators' units).
template <typename T, int D, bool kQuantSeg, int TKB, int TVB, int VB>
__device__ __forceinline__ void decode_tile(const uint8_t *stage, const MmaDecodePlan &g,
                                            uint32_t count, uint32_t tsize, uint32_t warp,
                                            uint32_t lane, const TileOperands &op,
                                            WarpState<D> &ws) {
  using Prob = ProbOperand<T>;
  constexpr bool kQuantValues = VB != 16;
  constexpr uint32_t kKStride = mma_row_stride(D * TKB / 8), kVStride = mma_row_stride(D * TVB / 8);
  const uint32_t gq = lane >> 2, qi = lane & 3;
  const uint32_t spw = tsize >= 64 ? tsize / 64 : 1;
  const uint32_t tok0 = warp * spw * 16;
  if (tok0 >= count) return;
  const uint32_t steps = min(spw, (count - tok0 + 15) / 16);
  const uint8_t *vrows = stage + (kQuantSeg ? g.q_vcodes : g.p_v) + tok0 * kVStride;

  // 1. Logits.
  WarpLogits lg;
  if constexpr (TKB != 16)
    qk_quantized<T, D, TKB>(stage, g, op.gshift, tok0, steps, op.q2_s, op.qp_s, op.xs_s, op.uq,
                            op.scale_log2, lane, lg);
  else
    qk_rows<T, D>(stage + tok0 * kKStride, kKStride, steps, op.qp_s, op.scale_log2, lane, lg);

  // 2. Online softmax of head g over the warp's tokens.
  float tmax = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < 2 * kMaxSteps; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // Quantized tiles hold whole k-steps (counts are multiples of G >= 16).
      const uint32_t t = tok0 + 8 * nt + 2 * qi + j;
      if (uint32_t(nt) >= 2 * steps || (!kQuantSeg && t >= count)) lg[nt][j] = -INFINITY;
      tmax = fmaxf(tmax, lg[nt][j]);
    }
  tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 1));
  tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 2));
  const float m_new = fmaxf(ws.m_run, tmax);
  const float base = m_new == -INFINITY ? 0.0f : m_new;
  const float corr = ex2(ws.m_run - base);
  float(&pr)[2 * kMaxSteps][2] = lg;  // probabilities replace the logits
  float sum = 0.0f;
#pragma unroll
  for (int nt = 0; nt < 2 * kMaxSteps; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      pr[nt][j] = ex2(lg[nt][j] - base);  // 0 past the warp's tokens
      sum += pr[nt][j];
    }
  ws.l_part = fmaf(ws.l_part, corr, sum);
  ws.m_run = m_new;

  // 3. Value scales of the warp's tokens, by group, as fp32 (and minima as dtype); Sv.
  float rescale = 1.0f;  // of acc, when the tile moves Sv
  T *mv_s = static_cast<T *>(op.mv_s);
  if constexpr (TVB != 16) {
    constexpr uint32_t VGmax = kMmaMaxGroups;
    const uint32_t vg_shift = __ffs(D) - 1 - op.gshift, VG = 1u << vg_shift;  // D / G groups
    const T *vs = reinterpret_cast<const T *>(stage + g.q_vscale) + tok0 * VG;
    const T *vm = reinterpret_cast<const T *>(stage + g.q_vmin) + tok0 * VG;
    float vmx = 0.0f;
    // Four (token, group) entries per lane and pass, 8-byte loads (quantized counts: whole
    // k-steps, so 16 · steps · VG is a multiple of 4; the stage is 16-byte aligned).
    for (uint32_t x = 4 * lane; x < ((16 * steps) << vg_shift); x += 128) {
      const uint2 s4 = *reinterpret_cast<const uint2 *>(vs + x);
      const uint2 m4 = *reinterpret_cast<const uint2 *>(vm + x);
      const float2 s01 = word_to_float2(s4.x, T{}), s23 = word_to_float2(s4.y, T{});
      const float sf[4] = {s01.x, s01.y, s23.x, s23.y};
      const T *mh = reinterpret_cast<const T *>(&m4);
#pragma unroll
      for (uint32_t j = 0; j < 4; ++j) {
        const uint32_t t = (x + j) >> vg_shift, gv = (x + j) & (VG - 1);
        op.sv_s[gv * kMmaWarpTokens + t] = sf[j];
        mv_s[gv * kMmaWarpTokens + t] = mh[j];
        vmx = fmaxf(vmx, fabsf(sf[j]));
      }
    }
    static_assert(VGmax * kMmaWarpTokens * 4 > 0, "");
    vmx = warp_max(vmx);
    if (vmx > 0.0f) {
      const int want = clamp_exp(14 - exponent_of(vmx), 60);
      const int sv_new = ws.sv_set ? min(ws.Sv, want) : want;
      ws.sv_set = true;
      rescale = pow2i(sv_new - ws.Sv);
      ws.Sv = sv_new;
    }
    __syncwarp();
  }
  // The accumulators' columns are heads 2i and 2i + 1.
  if (__any_sync(kFull, corr != 1.0f || rescale != 1.0f)) {
    const float corr_c[2] = {__shfl_sync(kFull, corr, 8 * qi), __shfl_sync(kFull, corr, 8 * qi + 4)};
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ws.acc[mt][e] *= corr_c[e & 1] * rescale;
#pragma unroll
    for (int e = 0; e < 4; ++e) ws.vb[e] *= corr_c[e & 1];  // vb's units do not depend on Sv
  }

  // 4. P·V̂, 16 tokens (two n-tiles of the logits) per k-step.
#pragma unroll
  for (uint32_t kk = 0; kk < uint32_t(kMaxSteps); ++kk) {
    if (kk >= steps) break;
    const Prob pb(pr[2 * kk][0], pr[2 * kk][1], pr[2 * kk + 1][0], pr[2 * kk + 1][1]);
    if constexpr (TVB != 16) {
      // Σ p · m_v: rows = value groups.
      const uint32_t t0 = 16 * kk + 2 * qi;
      const bool live = gq < (uint32_t(D) >> op.gshift);
      const uint32_t a[4] = {
          live ? *reinterpret_cast<const uint32_t *>(mv_s + gq * kMmaWarpTokens + t0) : 0u, 0u,
          live ? *reinterpret_cast<const uint32_t *>(mv_s + gq * kMmaWarpTokens + t0 + 8) : 0u, 0u};
      pb.mma(ws.vb, a);
      pv_codes<D, TVB>(vrows, op.sv_s, op.gshift, kk, pow2i(ws.Sv), pr, lane, ws.acc);
    } else {
      // 16-bit rows, transposed by ldmatrix: A = V^T (16 channels × 16 tokens).
      const uint8_t *addr = vrows + (16 * kk + ((lane >> 4) << 3) + (lane & 7)) * kVStride +
                            ((lane >> 3) & 1) * 8 * sizeof(T);
      const int row_off = int((gq * VB) % 8);  // the code offset the accumulators carry
      const float fold = kQuantValues ? pow2i(ws.Sv + row_off - 24) / Prob::kScale : 1.0f;
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, addr + mt * 16 * sizeof(T));
        if constexpr (!kQuantValues) {
          pb.mma(ws.acc[mt], a);  // units 1 / Prob::kScale
        } else {
          float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          pb.mma(c, a);
#pragma unroll
          for (int e = 0; e < 4; ++e) ws.acc[mt][e] = fmaf(c[e], fold, ws.acc[mt][e]);
        }
      }
    }
  }
}

// Resident CTAs per SM the registers are sized for: 3 (168 registers) up to head_dim 128;
// head_dim 256 keeps twice the accumulators and would spill at that bound.
template <int D> constexpr int kMmaMinBlocks = D >= 256 ? 2 : 3;

/// \tparam T  dtype of q/out and of scales and 16-bit rows (__half or __nv_bfloat16)
/// \tparam D  head_dim (64, 128 or 256)
/// \tparam KB key bits of the quantized storage (2, 4, 8; 16 = 16-bit rows)
/// \tparam VB value bits, likewise
/// \tparam kG group size fixed at compile time, or 0: the layout's (run time)
template <typename T, int D, int KB, int VB, int kG>
__global__ void __launch_bounds__(kMmaThreads, kMmaMinBlocks<D>) decode_mma_kernel(const __grid_constant__ MmaDecodeArgs a) {
  using Prob = ProbOperand<T>;
  constexpr bool kQuantValues = VB != 16;
  MINIKV_DYNAMIC_SMEM(smem, 16);
  const uint32_t smem_s = smem_addr(smem);  // the stages' shared-state-space base, for cp.async
  const DecodeParams &p = a.p;
  const MmaDecodePlan &g = a.g;
  const BlockLayout &bl = p.st.block;
  const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, qi = lane & 3;
  const DecodeCta cta(p);
  const uint32_t split = cta.split, seq = cta.seq, kvh = cta.kvh, chunk = cta.chunk, h0 = cta.h0, nh = cta.nh;
  const uint32_t G = group_size<kG>(bl);

  // Stage bytes past the staged regions are read (and multiplied by 0) before any tile has
  // written them: they start as zeros.
  for (uint32_t x = tid; x < g.total / 16; x += kMmaThreads)
    reinterpret_cast<uint4 *>(smem)[x] = make_uint4(0, 0, 0, 0);

  TileOperands op;
  op.qp_s = reinterpret_cast<const uint32_t *>(smem + g.qp);
  op.q2_s = reinterpret_cast<const uint32_t *>(smem + g.q2);
  op.xs_s = reinterpret_cast<uint4 *>(smem + g.xs) + warp * (D / 16) * 32;
  op.sv_s = reinterpret_cast<float *>(smem + g.sv) + warp * kMmaMaxGroups * kMmaWarpTokens;
  op.mv_s = reinterpret_cast<T *>(smem + g.mv) + warp * kMmaMaxGroups * kMmaWarpTokens;
  op.scale_log2 = p.scale_log2;
  op.gshift = group_shift<kG>(bl);
  op.uq = 1.0f;

  // Query of head g (zeros past the chunk's heads): natural pairs for the 16-bit mma, and
  // the key-pair order for quantized keys, written by warp 0. Both live in shared memory,
  // [word][lane] (conflict-free), read where used: registers bound the resident warps.
  const T *qh = gq < nh ? static_cast<const T *>(p.q) + (uint64_t(seq) * p.num_heads + h0 + gq) * D
                        : nullptr;
  {
    uint32_t q2[D / 8];
    if constexpr (KB != 16) {
      build_query_pairs<T, D, KB>(qh, qi, q2, op.uq);  // every warp: uq lives in registers
    } else {
#pragma unroll
      for (int P = 0; P < D / 8; ++P) q2[P] = 0u;
    }
    __syncthreads();  // the zero fill is done
    if (warp == 0) {
      uint32_t *q2_s = reinterpret_cast<uint32_t *>(smem + g.q2);
      uint32_t *qp_s = reinterpret_cast<uint32_t *>(smem + g.qp);
#pragma unroll
      for (int P = 0; P < D / 8; ++P) q2_s[P * 32 + lane] = q2[P];
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        qp_s[(2 * ks) * 32 + lane] = qh ? *reinterpret_cast<const uint32_t *>(qh + 16 * ks + 2 * qi) : 0u;
        qp_s[(2 * ks + 1) * 32 + lane] =
            qh ? *reinterpret_cast<const uint32_t *>(qh + 16 * ks + 2 * qi + 8) : 0u;
      }
    }
  }

  const SequenceTiles<MmaDecodePlan> tiles(p.sinks[seq], p.quantized[seq], p.residual[seq], g);
  const SplitTiles range(tiles.total, p.splits, split);
  const uint32_t t_begin = range.begin, t_end = range.end;
  const SequenceSlot sslot(p, seq);
  const int32_t *table = sslot.table;
  const uint8_t *res_slot = sslot.residual;
  const HeadRegions regions(bl, kvh);

  WarpState<D> ws;
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) ws.acc[mt][0] = ws.acc[mt][1] = ws.acc[mt][2] = ws.acc[mt][3] = 0.0f;

  // minikv_append_decode: the first split of the first head chunk stores the appended token
  // (decode_common.cuh); every CTA reads it from the caller's k/v (stage_tile).
  if (split == 0 && chunk == 0) store_appended_row(p, seq, kvh, tid, kMmaThreads);

  // Pipeline: g.stages buffers, g.stages - 1 tiles in flight ahead of the one computed. One
  // barrier per tile: after it the tile is visible to every warp and every warp is done with
  // the buffer the next copy overwrites.
  const uint32_t ahead = g.stages - 1;
  for (uint32_t s = 0; s < ahead; ++s) {
    if (t_begin + s < t_end)
      stage_tile<T, D, KB, VB, kG>(a, tiles.tile(t_begin + s, g), table, res_slot, kvh, regions,
                                   smem_s + s * g.stage_bytes, tid);
    cp_async_commit();
  }
  uint32_t buf = 0, next = ahead;  // stage buffers of tile ti and of tile ti + ahead
  for (uint32_t ti = t_begin; ti < t_end; ++ti) {
    const uint8_t *stage = smem + buf * g.stage_bytes;
    if (g.stages == 3) cp_async_wait<1>(); else cp_async_wait<0>();
    __syncthreads();
    if (ti + ahead < t_end)
      stage_tile<T, D, KB, VB, kG>(a, tiles.tile(ti + ahead, g), table, res_slot, kvh, regions,
                                   smem_s + next * g.stage_bytes, tid);
    cp_async_commit();
    buf = buf + 1 == g.stages ? 0 : buf + 1;
    next = next + 1 == g.stages ? 0 : next + 1;
    const TileRef tr = tiles.tile(ti, g);
    if (tr.segment == kSegQuantized)
      decode_tile<T, D, true, KB, VB, VB>(stage, g, tr.count, g.qtile, warp, lane, op, ws);
    else
      decode_tile<T, D, false, 16, 16, VB>(stage, g, tr.count, g.ptile, warp, lane, op, ws);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: the merge area overlays them

  // The warp's unnormalized output, running max and sum per head, into shared memory.
  float *merge_o = reinterpret_cast<float *>(smem + g.merge_o);    // [warp][head][D]
  float *merge_ml = reinterpret_cast<float *>(smem + g.merge_ml);  // [warp][head][2]
  {
    float l_run = ws.l_part + __shfl_xor_sync(kFull, ws.l_part, 1);
    l_run += __shfl_xor_sync(kFull, l_run, 2);
    if (qi == 0) {
      merge_ml[(warp * kMmaMaxHeads + gq) * 2] = ws.m_run;
      merge_ml[(warp * kMmaMaxHeads + gq) * 2 + 1] = l_run;
    }
    const int row_off = int((gq * VB) % 8);  // code offset of this lane's rows
    const float unit = kQuantValues ? pow2i(24 - row_off - ws.Sv) : 1.0f / Prob::kScale;
    const float vb_unit = 1.0f / Prob::kScale;
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      const uint32_t grp = (16u * mt) >> op.gshift;
      float bias[2] = {0.0f, 0.0f};
      if constexpr (kQuantValues) {
        bias[0] = __shfl_sync(kFull, ws.vb[0], 4 * grp + qi) * vb_unit;
        bias[1] = __shfl_sync(kFull, ws.vb[1], 4 * grp + qi) * vb_unit;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t col = 2 * qi + (e & 1), ch = 16 * mt + gq + 8 * (e >> 1);
        merge_o[(warp * kMmaMaxHeads + col) * D + ch] = fmaf(ws.acc[mt][e], unit, bias[e & 1]);
      }
    }
  }
  __syncthreads();

  // Combine the warps: normalized output (one split) or the split's partial.
  for (uint32_t x = tid; x < nh * D; x += kMmaThreads) {
    const uint32_t col = x / D, ch = x % D;
    float m = -INFINITY;
#pragma unroll
    for (uint32_t w = 0; w < kMmaWarps; ++w) m = fmaxf(m, merge_ml[(w * kMmaMaxHeads + col) * 2]);
    float o = 0.0f, l = 0.0f;
    if (m != -INFINITY) {
#pragma unroll
      for (uint32_t w = 0; w < kMmaWarps; ++w) {
        const float mw = merge_ml[(w * kMmaMaxHeads + col) * 2];
        if (mw == -INFINITY) continue;  // a warp without tokens (its sums are 0)
        const float f = ex2(mw - m);
        o = fmaf(merge_o[(w * kMmaMaxHeads + col) * D + ch], f, o);
        l = fmaf(merge_ml[(w * kMmaMaxHeads + col) * 2 + 1], f, l);
      }
    }
    store_decode_result<T, D>(p, uint64_t(seq) * p.num_heads + h0 + col, split, ch, m, o, l);
  }
}

// The launch and the shared-memory setup of the instances with KB key bits (one file each:
// decode_mma_k<KB>.cu), for decode_mma.cu's dispatch.
template <int KB> struct DecodeMmaKeyBits {
  static constexpr int kDefaultGroup = KB == 4 ? 32 : 0;  // instantiated for 4-bit keys only
  template <typename Fn> static void dispatch(minikv_dtype dtype, const BlockLayout &bl, Fn &&fn) {
    dispatch_dtype_head_dim<MmaDecodeHeadDims>(dtype, bl.head_dim, "minikv_decode", [&](auto tag, auto hd) {
      using T = decltype(tag);
      constexpr int D = decltype(hd)::value;
      switch (bl.value_bits) {
        case 2:
          // The default storage (K4V2 G32) has its own instance with G fixed.
          if (kDefaultGroup != 0 && bl.group == kDefaultGroup)
            fn(decode_mma_kernel<T, D, KB, 2, kDefaultGroup>);
          else fn(decode_mma_kernel<T, D, KB, 2, 0>);
          break;
        case 4: fn(decode_mma_kernel<T, D, KB, 4, 0>); break;
        case 8: fn(decode_mma_kernel<T, D, KB, 8, 0>); break;
        default: fn(decode_mma_kernel<T, D, KB, 16, 0>); break;
      }
    });
  }
  static uint32_t configure(minikv_dtype dtype, const BlockLayout &bl) {
    const uint32_t smem = make_mma_decode_plan(bl).total;
    int blocks = 0;
    dispatch(dtype, bl, [&](auto kernel) {
      MINIKV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem)));
      MINIKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kMmaThreads, smem));
    });
    return static_cast<uint32_t>(blocks > 0 ? blocks : 1);
  }
#ifndef MINIKV_WARP_EMULATION  // a CPU emulation (tests/emulation) runs the kernel itself
  static void launch(minikv_dtype dtype, const DecodeParams &p, const MmaLaunchPlan &plan,
                     cudaStream_t stream) {
    const BlockLayout &bl = p.st.block;
    const uint32_t n_rep = p.num_heads / p.num_kv_heads;
    const uint32_t chunks = (n_rep + p.heads_per_cta - 1) / p.heads_per_cta;
    const MmaDecodeArgs args{p, plan.g, plan.block_tokens};
    const uint32_t smem = args.g.total;
    dispatch(dtype, bl, [&](auto kernel) {
      kernel<<<dim3(p.splits, p.num_kv_heads * chunks, p.n), kMmaThreads, smem, stream>>>(args);
      check_launch_error("decode_mma_kernel");
    });
  }
#endif
};

}  // namespace

// One per key bit width, defined in decode_mma_k<KB>.cu.
#define MINIKV_DECODE_MMA_KEY_BITS(KB)                                                    \
  uint32_t configure_decode_mma_k##KB(minikv_dtype dtype, const BlockLayout &bl);        \
  void launch_decode_mma_k##KB(minikv_dtype dtype, const DecodeParams &p, const MmaLaunchPlan &plan, \
                               cudaStream_t stream);
MINIKV_DECODE_MMA_KEY_BITS(2)
MINIKV_DECODE_MMA_KEY_BITS(4)
MINIKV_DECODE_MMA_KEY_BITS(8)
MINIKV_DECODE_MMA_KEY_BITS(16)
#undef MINIKV_DECODE_MMA_KEY_BITS

}  // namespace kernels
}  // namespace minikv
