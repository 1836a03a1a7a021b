// The QK operands of the decode fast path, as host + device arithmetic (tested on the CPU by
// tests/test_qk_pieces.cpp; the kernel uses the same functions). fp16 and bf16 data both run
// the fp16 mma below.
//
// Logit (before the bias q·m_k and the softmax scale) of token t of key group g:
//   dot = Σ_ch c[t][ch] · x[ch],   x[ch] = q[ch] · s_k[g][ch]   (c ∈ {0..3})
// x is exact in fp32: fp16 × fp16 has ≤ 22 significant bits and 2^-48 ≤ |x| < 2^32 when not 0;
// bf16 × bf16 has ≤ 16 bits and any fp32 magnitude (a product below 2^-126 is rounded to
// fp32's denormal grid, as in every fp32 computation of it).
// The mma is m16n8k16 f16 → f32: A = the codes, B = x. A B column n (one query head × one key
// group) holds the D channels of x.
//   A: code c of channel ch as the fp16 SUBNORMAL whose bit pattern is c · 4^j, j = ch mod 4,
//      i.e. the value c · 4^j · 2^-24 exactly: one LOP3 per two codes (the pair of channels
//      ch, ch + 8 of a 16-channel code word; j ≤ 3 keeps the pattern below 2^10).
//   B: x' = x · 2^k · 4^-j in two fp16 pieces hi + lo. k (per column) puts the column's
//      max |x| into [2^14, 2^15): no piece overflows and the pieces of the large elements are
//      normal fp16, where hi = fp16(x'), lo = fp16(x' − hi) is exact (x' − hi is exact in fp32
//      and has ≤ 11 significant bits).
//   The mma then sums c · x · 2^(k−24) exactly per product; the fp32 result is multiplied by
//   2^(24−k) (f16_col_unscale, and f16_col_unscale_big past 2^127), powers of two.
// Error bound (what is not exact): an element whose |x'| < 2^-3 may have lo (or hi) below the
// fp16 normal range, where fp16 has a quantum of 2^-24: |x' − (hi + lo)| ≤ 2^-25 for every
// element (round to nearest), 0 when |x'| ≥ 2^-3. In units of x that is ≤ 2^-25 · 4^j · 2^-k
// ≤ 2^-25 · 64 · 2^-14 · M = 2^-33 · M per element, M = max |x| of the column, so
//   |dot − dot_exact| ≤ 3 · D · 2^-33 · max(M, 2^-63)  (= 3 · 2^-26 · M at D = 128)
// plus the fp32 accumulation, which is the same as before. 3 · 2^-26 · M is below one fp32 ulp
// of M (ulp(M) ≥ 2^-24 · M): within the rounding of the fp32 sum itself, and the logits are
// still never rounded to 16 bits. The 2^-63 floor is the prescale's clamp (k ≤ 77): a bf16
// column whose every |x| < 2^-63 is off by at most 3 · D · 2^-96 in absolute terms.
//
// Why not bf16 pieces for bf16 data: the codes must then be built as bf16 integers
// (LOP3 + HFMA2 per code pair, the subnormal trick needs B scaled by ~2^120); fp16 data needed
// 3 bf16 pieces of its 22-bit products (1.5× the mma.sync).
#pragma once

#include <cstdint>
#include <cstring>

#include "../src/dtype.h"   // float_to_half_bits, half_bits_to_float: the host's fp16 codec
#include "../src/layout.h"  // MINIKV_HD

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace minikv {
namespace kernels {

MINIKV_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
MINIKV_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// Biased fp32 exponent E of a column's max |x| (max_abs ≥ 0, finite). E ≥ 64 keeps the scale
// factors below finite for an all-zero column (any scale is right for zeros) and bounds the
// prescale of tiny bf16 columns; a nonzero x = fp16 · fp16 has 79 ≤ E ≤ 158, bf16 · bf16
// any E ≤ 254.
MINIKV_HD uint32_t f16_col_exp(float max_abs) {
  const uint32_t e = f32_bits(max_abs) >> 23;
  return e > 64u ? e : 64u;
}
// B prescale of a channel with code position j (= ch mod 4): 2^k · 4^-j, k = 141 − E
// (max |x| · 2^k ∈ [2^14, 2^15)).
MINIKV_HD float f16_col_scale(uint32_t e, uint32_t j) { return bits_f32((268u - e - 2u * j) << 23); }
// A as fp16 subnormals relies on mma.sync taking subnormal f16 operands exactly (IEEE;
// flushing them would zero every logit's code part: every fp16 GPU test fails). The fallback,
// false here: normal codes c · 4^j ((pattern | 1024.0) − 1024.0, one HADD2 more per pair) with
// the same B, undone by 2^-k instead of 2^(24 − k).
constexpr bool kF16SubnormalCodes = true;
// Undo of the column after the mma: × 2^(24 − k) = 2^(E − 117) (subnormal codes), else 2^-k.
// A single fp32 factor reaches 2^127 (E = 244); bf16 columns past that (max |x| ≥ 2^118)
// take the rest from f16_col_unscale_big, 2^(E − 244), which is 1 for every fp16 column.
MINIKV_HD float f16_col_unscale(uint32_t e, bool subnormal_codes = kF16SubnormalCodes) {
  return bits_f32((subnormal_codes ? (e < 244u ? e : 244u) + 10u : e - 14u) << 23);
}
MINIKV_HD float f16_col_unscale_big(uint32_t e, bool subnormal_codes = kF16SubnormalCodes) {
  return subnormal_codes && e > 244u ? bits_f32((e - 117u) << 23) : 1.0f;
}

// Code pair `s` (0..7) of a 16-code word w (code i at bits 2i; channel i of the word) as the
// fp16x2 word (code s, code s + 8) of subnormal patterns c · 4^(s mod 4). The kernel spells the
// same masks out (one LOP3 each); this is the definition the test checks against.
MINIKV_HD uint32_t f16_code_pair(uint32_t w, uint32_t s) {
  const uint32_t mask = 0x00030003u << (2u * (s & 3u));
  return (s < 4 ? w : w >> 8) & mask;
}

// fp16 pieces (hi, lo) of the scaled pair (a, b) (a in the low halves). Exact when |a|, |b| ≥
// 2^-3; otherwise each of a, b is off by at most 2^-25. |a|, |b| < 2^15.
MINIKV_HD void f16_split_pair(float a, float b, uint32_t &hi, uint32_t &lo) {
#if defined(__CUDA_ARCH__)
  const __half2 h = __floats2half2_rn(a, b);
  const float2 hf = __half22float2(h);
  const __half2 l = __floats2half2_rn(a - hf.x, b - hf.y);  // the differences are exact
  hi = *reinterpret_cast<const uint32_t *>(&h);
  lo = *reinterpret_cast<const uint32_t *>(&l);
#else
  const uint16_t ha = float_to_half_bits(a), hb = float_to_half_bits(b);
  const uint16_t la = float_to_half_bits(a - half_bits_to_float(ha));
  const uint16_t lb = float_to_half_bits(b - half_bits_to_float(hb));
  hi = uint32_t(ha) | uint32_t(hb) << 16;
  lo = uint32_t(la) | uint32_t(lb) << 16;
#endif
}

}  // namespace kernels
}  // namespace minikv
