// Decode attention on tensor cores for GQA groups (n_rep >= 2), every storage configuration:
// key and value codes of 2, 4 or 8 bits or 16-bit rows, any group size G >= 16 with
// D / G <= 8, attention sinks and the 16-bit residual.
//
// One warp per CTA, one CTA per (split, KV head × head chunk of <= 8 query heads, sequence).
// A split walks its tiles in cache order (sinks, quantized blocks, residual; tile sizes from
// decode_mma_plan.h), the next tile's bytes in flight by cp.async while this one is computed.
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
//   ulp of the largest term. The bias q · m_k is one mma<T> with exact products.
//   16-bit keys: A = q, B = K rows (ldmatrix), exact products.
// Softmax: fp32, log2 units, per head (row g of the C fragment holds head g, tokens 2i and
//   2i + 1 of each n-tile: exactly the B fragment P·V needs, no shuffle or shared memory).
// PV: M = channels (16 per m-tile), N = heads, K = tokens.
//   Quantized values: out = Σ_t (p s_v) · code + Σ_t p · m_v. A = codes of two tokens per
//   register (PRMT + LOP3, fp16 subnormals as above). B = fp16(p · s_v · 2^Sv): the one
//   rounding MINIKV.md allows, Sv a per-tile power of two that keeps the tile's largest
//   p · s_v near 2^14 (the accumulators are rescaled when it moves). The bias Σ p · m_v is an
//   mma of m_v (rows = value groups) against p rounded once (fp16 · 2^12; bf16: two pieces).
//   16-bit values: A = V rows transposed by ldmatrix.trans, B = p as above.
// In a launch of minikv_append_decode the residual's newest row is staged from the caller's
// k/v, and one CTA per (sequence, KV head) stores it into the slot (decode_common.cuh).
// A CTA with one split writes the normalized output, otherwise (max, sum, unnormalized
// output) partials that decode_merge.cu combines.
#include <type_traits>

#include "common.cuh"
#include "decode_common.cuh"
#include "decode_mma_plan.h"
#include "decode_tiles.cuh"
#include "dispatch.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

constexpr uint32_t kFull = 0xffffffffu;
constexpr float kP16Scale = 4096.0f;  // fp16 probabilities ride as p · 2^12 (kept normal)

// ---- small helpers ----------------------------------------------------------------------
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
// 2^e for e in [-126, 127].
__device__ __forceinline__ float pow2i(int e) { return __int_as_float((127 + e) << 23); }
// floor(log2 x) of a finite x > 0 in the normal range (-127 for 0 and denormals).
__device__ __forceinline__ int exponent_of(float x) {
  return int((__float_as_uint(x) >> 23) & 0xffu) - 127;
}
__device__ __forceinline__ int clamp_exp(int e, int lim) { return e < -lim ? -lim : e > lim ? lim : e; }
__device__ __forceinline__ uint32_t pack_f16(float a, float b) { return DType<__half>::pack2(a, b); }
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b));
  return *reinterpret_cast<const uint32_t *>(&r);
}
// a · b − c, rounded once.
__device__ __forceinline__ uint32_t hfms2_bits(uint32_t a, uint32_t b, uint32_t c) {
  const __half2 r = __hfma2(*reinterpret_cast<const __half2 *>(&a), *reinterpret_cast<const __half2 *>(&b),
                            __hneg2(*reinterpret_cast<const __half2 *>(&c)));
  return *reinterpret_cast<const uint32_t *>(&r);
}
__device__ __forceinline__ uint32_t word_of(const uint4 &v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}
template <typename T> __device__ __forceinline__ float elem_to_float(uint32_t w, int half) {
  const float2 f = word_to_float2(w, T{});
  return half ? f.y : f.x;
}
// p (fp32, <= 1) as the B operand of a 16-bit mma: fp16 · 2^12, or bf16 in two pieces.
template <typename T> struct ProbOperand {
  uint32_t hi[2], lo[2];
  __device__ __forceinline__ ProbOperand(float p0, float p1, float p2, float p3) {
    if constexpr (std::is_same<T, __half>::value) {
      hi[0] = pack_f16(p0 * kP16Scale, p1 * kP16Scale);
      hi[1] = pack_f16(p2 * kP16Scale, p3 * kP16Scale);
    } else {
      hi[0] = DType<T>::pack2(p0, p1);
      hi[1] = DType<T>::pack2(p2, p3);
      const float2 h0 = word_to_float2(hi[0], T{}), h1 = word_to_float2(hi[1], T{});
      lo[0] = DType<T>::pack2(p0 - h0.x, p1 - h0.y);  // exact differences
      lo[1] = DType<T>::pack2(p2 - h1.x, p3 - h1.y);
    }
  }
  static constexpr float kScale = std::is_same<T, __half>::value ? kP16Scale : 1.0f;
  __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4]) const {
    mma_16816<T>(d, a, hi[0], hi[1]);
    if constexpr (!std::is_same<T, __half>::value) mma_16816<T>(d, a, lo[0], lo[1]);
  }
};

// ---- staging (one warp) -----------------------------------------------------------------
// `rows` rows of `row_bytes` (a multiple of 16) into rows of `stride` bytes, and zeros up to
// row `padded`: the mma reads whole 16-token k-steps, and a stale row of an earlier tile
// (codes read as fp16) may be Inf or NaN, which 0 · row would not cancel. Row `sub` (if
// below `rows`) comes from `sub_src` instead: the appended token (decode_common.cuh).
__device__ __forceinline__ void copy_rows(uint8_t *dst, uint32_t stride, const uint8_t *src,
                                          uint64_t row_bytes, uint32_t rows, uint32_t padded,
                                          uint32_t lane, uint32_t sub = kNoAppendedRow,
                                          const uint8_t *sub_src = nullptr) {
  const uint32_t units = static_cast<uint32_t>(row_bytes / 16);
  const uint32_t shift = __ffs(units) - 1;
  const bool pow2 = (units & (units - 1)) == 0;
  for (uint32_t x = lane; x < padded * units; x += 32) {
    const uint32_t r = pow2 ? x >> shift : x / units, u = pow2 ? x & (units - 1) : x % units;
    const bool live = r < rows;
    const uint8_t *row = r == sub ? sub_src : src + (live ? r : 0) * row_bytes;
    cp_async_16(dst + r * stride + u * 16, row + u * 16, live);
  }
}
__device__ __forceinline__ void copy_bytes(uint8_t *dst, const uint8_t *src, uint64_t bytes,
                                           uint32_t lane) {
  for (uint32_t u = lane; u < bytes / 16; u += 32) cp_async_16(dst + u * 16, src + u * 16, true);
}

__device__ void stage_tile(const DecodeParams &p, const MmaDecodePlan &g, const TileRef &tr,
                           const int32_t *table, const uint8_t *res_slot, uint32_t kvh,
                           uint8_t *stage, uint32_t lane) {
  const BlockLayout &bl = p.st.block;
  const ResidualLayout &rl = p.st.res;
  const uint64_t D = bl.head_dim, e = bl.elem_bytes, G = bl.group;
  if (tr.segment == kSegQuantized) {
    const uint32_t R = bl.tokens, row0 = tr.first % R;  // qtile divides R
    const uint8_t *block = p.st.pool + uint64_t(table[tr.first / R]) * bl.bytes;
    // Quantized counts are multiples of G >= 16: no padding.
    copy_rows(stage, g.k_stride, block + bl.k_codes + kvh * bl.k_codes_head() + row0 * bl.k_row_bytes,
              bl.k_row_bytes, tr.count, tr.count, lane);
    copy_rows(stage + g.q_vcodes, g.v_stride,
              block + bl.v_codes + kvh * bl.v_codes_head() + row0 * bl.v_row_bytes, bl.v_row_bytes,
              tr.count, tr.count, lane);
    if (bl.key_bits != 16) {
      const uint64_t groups = (tr.count + G - 1) / G, at = (row0 / G) * D * e;
      copy_bytes(stage + g.q_kscale, block + bl.k_scale + kvh * bl.k_scale_head() + at, groups * D * e, lane);
      copy_bytes(stage + g.q_kmin, block + bl.k_min + kvh * bl.k_scale_head() + at, groups * D * e, lane);
    }
    if (bl.value_bits != 16) {
      const uint64_t at = row0 * (D / G) * e, bytes = tr.count * (D / G) * e;
      copy_bytes(stage + g.q_vscale, block + bl.v_scale + kvh * bl.v_scale_head() + at,
                 (bytes + 15) / 16 * 16, lane);
      copy_bytes(stage + g.q_vmin, block + bl.v_min + kvh * bl.v_scale_head() + at,
                 (bytes + 15) / 16 * 16, lane);
    }
  } else {
    const uint8_t *k, *v;
    if (tr.segment == kSegSinks) {
      k = res_slot + rl.sink_k + kvh * rl.sink_head_stride();
      v = res_slot + rl.sink_v + kvh * rl.sink_head_stride();
    } else {
      k = res_slot + rl.k + kvh * rl.kv_head_stride();
      v = res_slot + rl.v + kvh * rl.kv_head_stride();
    }
    const uint32_t padded = (tr.count + 15) / 16 * 16;
    // The appended token's row (the residual's last) from the caller's k/v.
    uint32_t sub = kNoAppendedRow;
    const uint8_t *sub_k = nullptr, *sub_v = nullptr;
    if (tr.segment == kSegResidual) {
      const AppendedRow a = appended_row(p, blockIdx.z, kvh);
      sub = a.row - tr.first;  // none (kNoAppendedRow) or an earlier row: wraps past the tile
      sub_k = a.k;
      sub_v = a.v;
    }
    copy_rows(stage, g.p_stride, k + tr.first * D * e, D * e, tr.count, padded, lane, sub, sub_k);
    copy_rows(stage + g.p_v, g.p_stride, v + tr.first * D * e, D * e, tr.count, padded, lane, sub, sub_v);
  }
}

// ---- key codes as the QK B operand ------------------------------------------------------
// The lane's quarter i of a key row holds channels [i·D/4, (i+1)·D/4). Its 32-bit words pair
// up codes l and l + 16/KB of a word (low and high half, same offset): pair P of the quarter
// is word P / (16/KB), index l = P % (16/KB), channels lo = word · 32/KB + l and lo + 16/KB,
// code offset (l · KB) mod 8 once the word is shifted right by 8 for l · KB >= 8. k-step ks
// uses pairs 2ks (k rows 2i, 2i+1) and 2ks + 1 (k rows 2i + 8, 2i + 9).
template <int KB> struct KeyPairs {
  static constexpr int kPerWord = 16 / KB;
  static __host__ __device__ constexpr int lo(int P) { return (P / kPerWord) * (32 / KB) + P % kPerWord; }
  static __host__ __device__ constexpr int hi(int P) { return lo(P) + kPerWord; }
  static __host__ __device__ constexpr int offset(int P) { return ((P % kPerWord) * KB) % 8; }
  static __device__ __forceinline__ uint32_t code_pair(uint32_t w, int P) {
    const int l = P % kPerWord;
    const uint32_t src = l * KB >= 8 ? w >> 8 : w;
    return src & ((((1u << KB) - 1u) * 0x00010001u) << offset(P));
  }
};

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
template <typename T, int D, int KB>
__device__ __forceinline__ void build_key_operand(const T *ks_row, uint32_t lane,
                                                  const uint32_t *q2_s, uint32_t (&xh)[D / 8],
                                                  uint32_t (&xl)[D / 8], float &us) {
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
  const bool native = std::is_same<T, __half>::value && ks >= -14 && ks <= 15;
  if (native) {  // fp16 scales: the power of two is exact in fp16 arithmetic
    const uint32_t f2 = pack_f16(pow2i(ks), pow2i(ks));
#pragma unroll
    for (int P = 0; P < D / 8; ++P) {
      const int lo = KP::lo(P), hi = KP::hi(P);
      const uint32_t sel = (lo & 1 ? 0x32u : 0x10u) | (hi & 1 ? 0x7600u : 0x5400u);
      const uint32_t s2 = hmul2_bits(prmt(w[lo / 2], w[hi / 2], sel), f2);
      const uint32_t q2 = q2_s[P * 32 + lane];
      xh[P] = hmul2_bits(q2, s2);
      xl[P] = hfms2_bits(q2, s2, xh[P]);
    }
  } else {
    const float f = pow2i(ks);
#pragma unroll
    for (int P = 0; P < D / 8; ++P) {
      const int lo = KP::lo(P), hi = KP::hi(P);
      const uint32_t s2 = pack_f16(elem_to_float<T>(w[lo / 2], lo & 1) * f,
                                   elem_to_float<T>(w[hi / 2], hi & 1) * f);
      const uint32_t q2 = q2_s[P * 32 + lane];
      xh[P] = hmul2_bits(q2, s2);
      xl[P] = hfms2_bits(q2, s2, xh[P]);
    }
  }
}

// Logits of a quantized-key tile: lg[nt][j] = head g, token 8·nt + 2i + j (log2 units).
template <typename T, int D, int KB>
__device__ __forceinline__ void qk_quantized(const uint8_t *stage, const MmaDecodePlan &g,
                                             const BlockLayout &bl, uint32_t ntiles,
                                             const uint32_t *q2_s, const uint32_t *qp_s, float uq, float scale_log2, uint32_t lane,
                                             float (&lg)[kMmaMaxTile / 8][2]) {
  using KP = KeyPairs<KB>;
  constexpr int QB = D * KB / 32;  // bytes of a row's quarter
  constexpr int QW = QB / 4;
  const uint32_t gq = lane >> 2, qi = lane & 3, G = bl.group;
  const T *kscale = reinterpret_cast<const T *>(stage + g.q_kscale);
  const uint8_t *kmin = stage + g.q_kmin;

  // Bias q · m_k of the tile's key groups: C row g = head g, columns = groups.
  const uint32_t ngroups = g.qtile >= G ? g.qtile / G : 1;
  float cb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint32_t a[4] = {qp_s[(2 * ks) * 32 + lane], 0u, qp_s[(2 * ks + 1) * 32 + lane], 0u};
    const uint8_t *mrow = kmin + gq * D * sizeof(T) + (16 * ks + 2 * qi) * sizeof(T);
    const bool live = gq < ngroups;
    const uint32_t b0 = live ? *reinterpret_cast<const uint32_t *>(mrow) : 0u;
    const uint32_t b1 = live ? *reinterpret_cast<const uint32_t *>(mrow + 8 * sizeof(T)) : 0u;
    mma_16816<T>(cb, a, b0, b1);
  }

  uint32_t xh[D / 8], xl[D / 8];
  float us = 1.0f, bias = 0.0f;
  int group = -1;
  // Two n-tiles (16 tokens, one key group: G >= 16) at a time: four independent mma chains.
#pragma unroll
  for (int nt = 0; nt < int(kMmaMaxTile / 8); nt += 2) {
    if (uint32_t(nt) >= ntiles) break;
    const int gl = int((8u * nt) / G);
    if (gl != group) {
      group = gl;
      build_key_operand<T, D, KB>(kscale + gl * D, lane, q2_s, xh, xl, us);
      const float b0 = __shfl_sync(kFull, cb[0], 4 * gq + gl / 2);
      const float b1 = __shfl_sync(kFull, cb[1], 4 * gq + gl / 2);
      bias = gl & 1 ? b1 : b0;
    }
    uint32_t wd[2][QW];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t *row = stage + (8 * (nt + h) + gq) * g.k_stride + qi * QB;
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
    float d[4][4] = {};  // (n-tile, piece)
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      constexpr int kPw = KP::kPerWord;
      const uint32_t ah[4] = {xh[2 * ks], 0u, xh[2 * ks + 1], 0u};
      const uint32_t al[4] = {xl[2 * ks], 0u, xl[2 * ks + 1], 0u};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t b0 = KP::code_pair(wd[h][(2 * ks) / kPw], 2 * ks);
        const uint32_t b1 = KP::code_pair(wd[h][(2 * ks + 1) / kPw], 2 * ks + 1);
        mma_16816<__half>(d[2 * h], ah, b0, b1);
        mma_16816<__half>(d[2 * h + 1], al, b0, b1);
      }
    }
    const float unscale = uq * us;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lg[nt + h][0] = fmaf(d[2 * h][0] + d[2 * h + 1][0], unscale, bias) * scale_log2;
      lg[nt + h][1] = fmaf(d[2 * h][1] + d[2 * h + 1][1], unscale, bias) * scale_log2;
    }
  }
}

// Logits of 16-bit key rows (row stride `stride`): exact products.
template <typename T, int D>
__device__ __forceinline__ void qk_rows(const uint8_t *rows, uint32_t stride, uint32_t ntiles,
                                        const uint32_t *qp_s, float scale_log2,
                                        uint32_t lane, float (&lg)[kMmaMaxTile / 8][2]) {
#pragma unroll
  for (int nt = 0; nt < int(kMmaMaxTile / 8); nt += 2) {
    if (uint32_t(nt) >= ntiles) break;
    float d[2][2][4] = {};  // (n-tile, k-step parity): four independent chains
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // ldmatrix.x4: matrices (k-step ks, channels +0 / +8) and (ks + 1, +0 / +8) of 8 tokens.
      const uint8_t *addr =
          rows + (8 * (nt + h) + (lane & 7)) * stride + ((lane >> 3) * 8) * sizeof(T);
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
      lg[nt + h][0] = (d[h][0][0] + d[h][1][0]) * scale_log2;
      lg[nt + h][1] = (d[h][0][1] + d[h][1][1]) * scale_log2;
    }
  }
}

// P·V̂ of a quantized-value tile into acc (units: code patterns · 2^Sv, see the header).
template <int D, int VB>
__device__ __forceinline__ void pv_codes(const uint8_t *vrows, uint32_t stride, const float *sv_s,
                                         uint32_t G, uint32_t kk, float pscale,
                                         const float (&p)[kMmaMaxTile / 8][2], uint32_t lane,
                                         float (&acc)[D / 16][4]) {
  constexpr int U = D * VB / 128;  // 16-byte units of a row
  constexpr int MPU = 8 / VB;      // m-tiles (16 channels) per unit
  constexpr int WPM = VB / 2;      // 32-bit words per m-tile
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
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint4 r0 = *reinterpret_cast<const uint4 *>(vrows + (t0) * stride + u * 16);
    const uint4 r1 = *reinterpret_cast<const uint4 *>(vrows + (t0 + 1) * stride + u * 16);
    const uint4 r2 = *reinterpret_cast<const uint4 *>(vrows + (t0 + 8) * stride + u * 16);
    const uint4 r3 = *reinterpret_cast<const uint4 *>(vrows + (t0 + 9) * stride + u * 16);
#pragma unroll
    for (int m = 0; m < MPU; ++m) {
      const int mt = u * MPU + m;
      if ((16u * mt) % G == 0) {  // first m-tile of a value group: B = p · s_v · 2^Sv
        const float *s = sv_s + ((16u * mt) / G) * kMmaMaxTile + t0;
        const float2 s01 = *reinterpret_cast<const float2 *>(s);
        const float2 s23 = *reinterpret_cast<const float2 *>(s + 8);
        b0 = pack_f16(pf0 * s01.x, pf1 * s01.y);
        b1 = pack_f16(pf2 * s23.x, pf3 * s23.y);
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

/// \tparam T dtype of q/out and of scales and 16-bit rows (__half or __nv_bfloat16)
/// \tparam D head_dim (64 or 128)
template <typename T, int D>
__global__ void __launch_bounds__(32, 8) decode_mma_kernel(const __grid_constant__ DecodeParams p) {
  using Prob = ProbOperand<T>;
  extern __shared__ __align__(16) uint8_t smem[];
  const BlockLayout &bl = p.st.block;
  const MmaDecodePlan g = make_mma_decode_plan(bl);
  const uint32_t lane = threadIdx.x, gq = lane >> 2, qi = lane & 3;
  const uint32_t split = blockIdx.x, seq = blockIdx.z;
  const uint32_t n_rep = p.num_heads / p.num_kv_heads, per = p.heads_per_cta;
  const uint32_t chunks = (n_rep + per - 1) / per;
  const uint32_t kvh = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
  const uint32_t h0 = kvh * n_rep + chunk * per, nh = min(per, n_rep - chunk * per);
  const uint32_t G = bl.group, VG = D / G, vg_shift = __ffs(VG) - 1;
  const bool quant_values = bl.value_bits != 16;

  float *sv_s = reinterpret_cast<float *>(smem + g.sv);  // [group][token] fp32
  T *mv_s = reinterpret_cast<T *>(smem + g.mv);          // [group][token]
  // Stage bytes past the staged regions are read (and multiplied by 0) before any tile has
  // written them: they start as zeros.
  for (uint32_t x = lane; x < g.total / 16; x += 32)
    reinterpret_cast<uint4 *>(smem)[x] = make_uint4(0, 0, 0, 0);
  __syncwarp();

  // Query of head g (zeros past the chunk's heads): natural pairs for the 16-bit mma, and
  // the key-pair order for quantized keys.
  const T *qh = gq < nh ? static_cast<const T *>(p.q) + (uint64_t(seq) * p.num_heads + h0 + gq) * D
                        : nullptr;
  // Both live in shared memory, [word][lane] (conflict-free), read where used: registers
  // are what bounds the resident warps.
  uint32_t *qp_s = reinterpret_cast<uint32_t *>(smem + g.qp);  // [D / 8][32]
  uint32_t *q2_s = reinterpret_cast<uint32_t *>(smem + g.q2);  // [D / 8][32]
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    qp_s[(2 * ks) * 32 + lane] = qh ? *reinterpret_cast<const uint32_t *>(qh + 16 * ks + 2 * qi) : 0u;
    qp_s[(2 * ks + 1) * 32 + lane] =
        qh ? *reinterpret_cast<const uint32_t *>(qh + 16 * ks + 2 * qi + 8) : 0u;
  }
  float uq = 1.0f;
  {
    uint32_t q2[D / 8];
    switch (bl.key_bits) {
      case 2: build_query_pairs<T, D, 2>(qh, qi, q2, uq); break;
      case 4: build_query_pairs<T, D, 4>(qh, qi, q2, uq); break;
      case 8: build_query_pairs<T, D, 8>(qh, qi, q2, uq); break;
      default:
#pragma unroll
        for (int P = 0; P < D / 8; ++P) q2[P] = 0u;
    }
#pragma unroll
    for (int P = 0; P < D / 8; ++P) q2_s[P * 32 + lane] = q2[P];
  }
  __syncwarp();

  const SequenceTiles<MmaDecodePlan> tiles(p.sinks[seq], p.quantized[seq], p.residual[seq], g);
  const uint32_t per_split = (tiles.total + p.splits - 1) / p.splits;
  const uint32_t t_begin = min(tiles.total, split * per_split);
  const uint32_t t_end = min(tiles.total, t_begin + per_split);
  const uint32_t slot = p.slot[seq];
  const int32_t *table = p.st.block_table + uint64_t(slot) * p.st.max_blocks_per_seq;
  const uint8_t *res_slot = p.st.residual + uint64_t(slot) * p.st.res.bytes;

  float m_run = -INFINITY, l_part = 0.0f;  // head g; l_part: this lane's tokens only
  float acc[D / 16][4], vb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
  int Sv = 0;  // acc = Σ p·s_v·2^Sv · (code patterns); 16-bit tiles are folded in these units
  const int row_off = int((gq * bl.value_bits) % 8);  // code offset of this lane's rows

  // minikv_append_decode: the first split of the first head chunk stores the appended token
  // (decode_common.cuh); every CTA reads it from the caller's k/v (stage_tile).
  if (split == 0 && chunk == 0) store_appended_row(p, seq, kvh, lane, 32);

  if (t_begin < t_end) stage_tile(p, g, tiles.tile(t_begin, g), table, res_slot, kvh, smem, lane);
  cp_async_commit();
  for (uint32_t ti = t_begin; ti < t_end; ++ti) {
    const uint8_t *stage = smem + ((ti - t_begin) & 1) * g.stage_bytes;
    cp_async_wait<0>();
    __syncwarp();
    if (ti + 1 < t_end)
      stage_tile(p, g, tiles.tile(ti + 1, g), table, res_slot, kvh,
                 smem + ((ti + 1 - t_begin) & 1) * g.stage_bytes, lane);
    cp_async_commit();

    const TileRef tr = tiles.tile(ti, g);
    const bool quantized = tr.segment == kSegQuantized;
    const uint32_t kb = quantized ? bl.key_bits : 16, vbits = quantized ? bl.value_bits : 16;
    const uint32_t tsize = quantized ? g.qtile : g.ptile;
    const uint32_t ntiles = (tr.count + 7) / 8;
    const uint8_t *krows = stage;
    const uint32_t kstride = quantized ? g.k_stride : g.p_stride;
    const uint8_t *vrows = stage + (quantized ? g.q_vcodes : g.p_v);
    const uint32_t vstride = quantized ? g.v_stride : g.p_stride;

    // 1. Logits.
    float lg[kMmaMaxTile / 8][2];
    switch (kb) {
      case 2: qk_quantized<T, D, 2>(stage, g, bl, ntiles, q2_s, qp_s, uq, p.scale_log2, lane, lg); break;
      case 4: qk_quantized<T, D, 4>(stage, g, bl, ntiles, q2_s, qp_s, uq, p.scale_log2, lane, lg); break;
      case 8: qk_quantized<T, D, 8>(stage, g, bl, ntiles, q2_s, qp_s, uq, p.scale_log2, lane, lg); break;
      default: qk_rows<T, D>(krows, kstride, ntiles, qp_s, p.scale_log2, lane, lg); break;
    }

    // 2. Online softmax of head g over the tile.
    float tmax = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < int(kMmaMaxTile / 8); ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t t = 8 * nt + 2 * qi + j;
        if (t >= tr.count) lg[nt][j] = -INFINITY;
        tmax = fmaxf(tmax, lg[nt][j]);
      }
    tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(kFull, tmax, 2));
    const float m_new = fmaxf(m_run, tmax);
    const float base = m_new == -INFINITY ? 0.0f : m_new;
    const float corr = exp2f(m_run - base);
    float(&pr)[kMmaMaxTile / 8][2] = lg;  // probabilities replace the logits
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < int(kMmaMaxTile / 8); ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        pr[nt][j] = exp2f(lg[nt][j] - base);  // 0 past the tile
        sum += pr[nt][j];
      }
    l_part = fmaf(l_part, corr, sum);
    m_run = m_new;
    // The accumulators' columns are heads 2i and 2i + 1.
    const float corr_c[2] = {__shfl_sync(kFull, corr, 8 * qi), __shfl_sync(kFull, corr, 8 * qi + 4)};
    float rescale = 1.0f;  // of acc, when the tile moves Sv

    // 3. Value scales of a quantized tile, by group, as fp32 (and minima as dtype); the
    //    tile's power of two Sv.
    if (vbits != 16) {
      const T *vs = reinterpret_cast<const T *>(stage + g.q_vscale);
      const T *vm = reinterpret_cast<const T *>(stage + g.q_vmin);
      float vmx = 0.0f;
      for (uint32_t x = lane; x < tsize * VG; x += 32) {
        const uint32_t t = x >> vg_shift, gv = x & (VG - 1);
        const bool live = t < tr.count;
        const float s = live ? DType<T>::to_float(vs[x]) : 0.0f;
        sv_s[gv * kMmaMaxTile + t] = s;
        mv_s[gv * kMmaMaxTile + t] = live ? vm[x] : DType<T>::from_float(0.0f);
        vmx = fmaxf(vmx, fabsf(s));
      }
      vmx = warp_max(vmx);
      const int sv_new = vmx > 0.0f ? clamp_exp(14 - exponent_of(vmx), 60) : Sv;
      rescale = pow2i(sv_new - Sv);
      Sv = sv_new;
      __syncwarp();
    }
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][e] *= corr_c[e & 1] * rescale;
#pragma unroll
    for (int e = 0; e < 4; ++e) vb[e] *= corr_c[e & 1];  // vb's units do not depend on Sv

    // 4. P·V̂, 16 tokens (two n-tiles of the logits) per k-step.
#pragma unroll
    for (uint32_t kk = 0; kk < kMmaMaxTile / 16; ++kk) {
      if (16 * kk >= tr.count) break;
      const Prob pb(pr[2 * kk][0], pr[2 * kk][1], pr[2 * kk + 1][0], pr[2 * kk + 1][1]);
      if (vbits != 16) {
        // Σ p · m_v: rows = value groups.
        const uint32_t t0 = 16 * kk + 2 * qi;
        const bool live = gq < VG;
        const uint32_t a[4] = {
            live ? *reinterpret_cast<const uint32_t *>(mv_s + gq * kMmaMaxTile + t0) : 0u, 0u,
            live ? *reinterpret_cast<const uint32_t *>(mv_s + gq * kMmaMaxTile + t0 + 8) : 0u, 0u};
        pb.mma(vb, a);
        const float pscale = pow2i(Sv);
        switch (vbits) {
          case 2: pv_codes<D, 2>(vrows, vstride, sv_s, G, kk, pscale, pr, lane, acc); break;
          case 4: pv_codes<D, 4>(vrows, vstride, sv_s, G, kk, pscale, pr, lane, acc); break;
          default: pv_codes<D, 8>(vrows, vstride, sv_s, G, kk, pscale, pr, lane, acc); break;
        }
      } else {
        // 16-bit rows, transposed by ldmatrix: A = V^T (16 channels × 16 tokens).
        const uint8_t *addr = vrows + (16 * kk + ((lane >> 4) << 3) + (lane & 7)) * vstride +
                              ((lane >> 3) & 1) * 8 * sizeof(T);
        const float fold = quant_values ? pow2i(Sv + row_off - 24) / Prob::kScale : 1.0f;
#pragma unroll
        for (int mt = 0; mt < D / 16; ++mt) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, addr + mt * 16 * sizeof(T));
          if (!quant_values) {
            pb.mma(acc[mt], a);  // units 1 / Prob::kScale
          } else {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            pb.mma(c, a);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][e] = fmaf(c[e], fold, acc[mt][e]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // Sum over the lanes of a head; columns 2i, 2i + 1 for the accumulators.
  float l_run = l_part + __shfl_xor_sync(kFull, l_part, 1);
  l_run += __shfl_xor_sync(kFull, l_run, 2);
  const float m_c[2] = {__shfl_sync(kFull, m_run, 8 * qi), __shfl_sync(kFull, m_run, 8 * qi + 4)};
  const float l_c[2] = {__shfl_sync(kFull, l_run, 8 * qi), __shfl_sync(kFull, l_run, 8 * qi + 4)};
  const float unit = quant_values ? pow2i(24 - row_off - Sv) : 1.0f / Prob::kScale;
  const float vb_unit = 1.0f / Prob::kScale;
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
    const uint32_t grp = (16u * mt) / G;
    float bias[2] = {0.0f, 0.0f};
    if (quant_values) {
      bias[0] = __shfl_sync(kFull, vb[0], 4 * grp + qi) * vb_unit;
      bias[1] = __shfl_sync(kFull, vb[1], 4 * grp + qi) * vb_unit;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t col = 2 * qi + (e & 1), ch = 16 * mt + gq + 8 * (e >> 1);
      if (col >= nh) continue;
      const float o = fmaf(acc[mt][e], unit, bias[e & 1]);
      const uint64_t head = uint64_t(seq) * p.num_heads + h0 + col;
      if (p.splits == 1) {
        static_cast<T *>(p.out)[head * D + ch] = output_value<T>(o / l_c[e & 1]);
      } else {
        const uint64_t part = head * p.splits + split;
        p.part_o[part * D + ch] = o;
        if (ch == 0) {
          p.part_ml[part * 2] = m_c[e & 1];
          p.part_ml[part * 2 + 1] = l_c[e & 1];
        }
      }
    }
  }
}

template <typename Fn> void dispatch_mma(minikv_dtype dtype, uint32_t head_dim, Fn &&fn) {
  dispatch_dtype_head_dim<MmaDecodeHeadDims>(dtype, head_dim, "minikv_decode", [&](auto tag, auto hd) {
    fn(decode_mma_kernel<decltype(tag), decltype(hd)::value>);
  });
}

}  // namespace

bool decode_mma_path(const BlockLayout &bl, uint32_t n_rep) {
  return n_rep >= 2 && bl.elem_bytes == 2 && in_list(MmaDecodeHeadDims{}, bl.head_dim) &&
         head_dim_compiled(bl.head_dim) &&
         bl.group >= 16 && bl.head_dim % bl.group == 0 && bl.head_dim / bl.group <= kMmaMaxGroups &&
         bl.k_row_bytes % 16 == 0 && bl.v_row_bytes % 16 == 0;
}

uint32_t decode_mma_heads_per_cta(uint32_t n_rep) {
  const uint32_t chunks = (n_rep + kMmaMaxHeads - 1) / kMmaMaxHeads;
  return (n_rep + chunks - 1) / chunks;
}

uint32_t configure_decode_mma(minikv_dtype dtype, const BlockLayout &bl) {
  const uint32_t smem = make_mma_decode_plan(bl).total;
  int blocks = 0;
  dispatch_mma(dtype, bl.head_dim, [&](auto kernel) {
    MINIKV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
    MINIKV_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 32, smem));
  });
  return static_cast<uint32_t>(blocks > 0 ? blocks : 1);
}

void launch_decode_mma(minikv_dtype dtype, const DecodeParams &p, cudaStream_t stream) {
  const BlockLayout &bl = p.st.block;
  const uint32_t n_rep = p.num_heads / p.num_kv_heads;
  const uint32_t chunks = (n_rep + p.heads_per_cta - 1) / p.heads_per_cta;
  const uint32_t smem = make_mma_decode_plan(bl).total;
  dispatch_mma(dtype, bl.head_dim, [&](auto kernel) {
    kernel<<<dim3(p.splits, p.num_kv_heads * chunks, p.n), 32, smem, stream>>>(p);
    check_launch_error("decode_mma_kernel");
  });
  if (p.splits > 1) launch_decode_merge(dtype, bl.head_dim, p, stream);
}

}  // namespace kernels
}  // namespace minikv
