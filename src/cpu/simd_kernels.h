// The CPU backend's vector kernels (Google Highway, one binary for every x86-64 / Arm CPU:
// the best target the CPU supports is chosen on first use; EMU128 is the scalar fallback).
//
// Every kernel computes, bit for bit, the same float32 result on every target and for any
// vector width, so the CPU backend stays a reference: results depend on the inputs only,
// not on the machine, the SIMD target or the thread count (tests/test_simd_kernels.cpp
// runs each kernel on every target the machine supports and compares the bits).
// Two rules make that hold:
//  * a product added to a sum is one fused multiply-add, fma(a, b, acc), rounded once: the
//    FMA instruction where the CPU has one (x86-64 since 2013, AVX-512, Arm64), else
//    std::fma lane by lane (exact, slower: SSE4-only CPUs and the scalar fallback); no other
//    contraction (the kernels are compiled with -ffp-contract=off);
//  * every sum has one fixed order, independent of the vector width. Either
//      SEQUENTIAL: acc = 0; acc = fma(a_0, b_0, acc); acc = fma(a_1, b_1, acc); ... (lanes
//                  are independent outputs, each summing its own terms in index order), or
//      CANONICAL16: 16 partial sums s_l = SEQUENTIAL sum of the terms i with i % 16 == l,
//                  then folded in halves: s_l += s_{l+8} (l < 8), s_l += s_{l+4} (l < 4),
//                  s_l += s_{l+2}, s_0 += s_1.
//    Each kernel below says which.
// exp is one polynomial (Cephes expf, Cody-Waite range reduction, about 2 ulp), evaluated
// with the same operations (fused as above) on every target; inputs below -87 give 0.
//
// Buffers are host memory, float32 unless said otherwise; no kernel allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "dtype.h"

namespace minikv::cpu {

// ---- conversions (exact, bit-identical with src/dtype.h's scalar conversions, NaN included)
void f16_to_float(const uint16_t *in, float *out, size_t n);
void bf16_to_float(const uint16_t *in, float *out, size_t n);
void float_to_f16(const float *in, uint16_t *out, size_t n);
void float_to_bf16(const float *in, uint16_t *out, size_t n);

// Rows of the storage type T as float32 and back (float: a copy).
inline void to_floats(const float *in, size_t n, float *out) { std::memcpy(out, in, n * 4); }
inline void to_floats(const half_t *in, size_t n, float *out) {
  f16_to_float(reinterpret_cast<const uint16_t *>(in), out, n);
}
inline void to_floats(const bfloat16_t *in, size_t n, float *out) {
  bf16_to_float(reinterpret_cast<const uint16_t *>(in), out, n);
}
inline void from_floats(const float *in, size_t n, float *out) { std::memcpy(out, in, n * 4); }
// Rows as float32 without a copy where they already are: `in` itself for float, else the
// conversion into `buffer`.
inline const float *as_floats(const float *in, size_t, float *) { return in; }
template <typename T>
const float *as_floats(const T *in, size_t n, float *buffer) {
  to_floats(in, n, buffer);
  return buffer;
}
inline void from_floats(const float *in, size_t n, half_t *out) {
  float_to_f16(in, reinterpret_cast<uint16_t *>(out), n);
}
inline void from_floats(const float *in, size_t n, bfloat16_t *out) {
  float_to_bf16(in, reinterpret_cast<uint16_t *>(out), n);
}

// ---- decode -----------------------------------------------------------------------------
// logits[r * ld + t] = (SEQUENTIAL over c of qs[g][r][c] * code(t, c) + bias[r][g]) * scale
// for heads r < n_rep and tokens t < n (a multiple of the group size G, which is a multiple
// of 16), g = t / G. qs is [n / G][n_rep][d], bias [n_rep][n / G]. code(t, c) is channel c
// of the packed row `codes + t * row_words` (bits = 2, 4 or 8; 32 / bits codes per uint32,
// channel 0 in the lowest bits), as a float.
void key_logits_codes(const float *qs, const float *bias, uint32_t n_rep, uint32_t d,
                      const uint32_t *codes, uint64_t row_words, uint32_t bits, uint32_t group,
                      uint32_t n, float scale, float *logits, uint64_t ld);

// out[(g * n_rep + r) * d + c] = q[r * d + c] * s[g * d + c] for g < groups, r < n_rep, c < d
// (d a multiple of 16).
void scale_channels(const float *q, uint32_t n_rep, uint32_t d, const float *s, uint32_t groups,
                    float *out);

// logits[r * ld + t] = (CANONICAL16 over c of q[r * d + c] * rows[t * row_stride + c]) * scale
// for r < n_rep, t < n; d a multiple of 16.
void dot_rows(const float *q, uint32_t n_rep, uint32_t d, const float *rows,
              uint64_t row_stride, uint32_t n, float scale, float *logits, uint64_t ld);

// Folds n new logits per head into a running softmax, in place: for each head r,
//   m' = max(m[r], max_t x[r][t]),  correction[r] = exp(m[r] - m')  (0 while m[r] = -inf),
//   x[r][t] = exp(x[r][t] - m'),    l[r] = l[r] * correction[r] + CANONICAL16_t x[r][t],
//   m[r] = m'.
// Rows of x are read in whole 16-float chunks: each must be readable up to
// align_up(n, 16) floats; only [0, n) is written.
void softmax_update(float *x, uint32_t n_rep, uint64_t ld, uint32_t n, float *m, float *l,
                    float *correction);

// acc[r * d + c] = acc[r * d + c] * correction[r] for r < n_rep.
void scale_rows(float *acc, uint32_t n_rep, uint32_t d, const float *correction);

// acc[r * d + c] += p[r * ldp + t] * value(t, c), SEQUENTIAL over t < n, for r < n_rep,
// where value(t, c) = code(t, c) * scale[t][c / group] + minimum[t][c / group] (the product
// rounded, then the sum: dequantize_code of src/quant.h), clamped to [-limit, limit] (the
// storage dtype's finite range), from packed rows as in key_logits_codes; scale and minimum
// are [n][d / group]. group >= 16.
void value_accumulate_codes(const float *p, uint32_t n_rep, uint64_t ldp, uint32_t n,
                            const uint32_t *codes, uint64_t row_words, uint32_t bits,
                            const float *scale, const float *minimum, uint32_t group,
                            uint32_t d, float limit, float *acc);

// acc[r * d + c] += p[r * ldp + t] * rows[t * row_stride + c], SEQUENTIAL over t < n.
void value_accumulate_rows(const float *p, uint32_t n_rep, uint64_t ldp, uint32_t n,
                           const float *rows, uint64_t row_stride, uint32_t d, float *acc);

// ---- prefill ----------------------------------------------------------------------------
// Causal attention of a block of `rows` query rows i = first_row + r over keys j <= i.
// Keys and values come packed in panels of kPanelWidth columns, so that every tile reads
// contiguous memory:
//   k_panels [ceil(keys / W)][d][W]: key j, channel c at ((j / W) * d + c) * W + j % W
//   v_panels [ceil(d / W)][keys][W]: key j, channel c at (c / W) * panel_stride + j * W + c % W
// zero padded to whole panels.
constexpr uint32_t kPanelWidth = 32;

// s[r * lds + j] = SEQUENTIAL over c < d of q[r * d + c] * key(j, c), for j <= i (keys beyond
// the row's last one, up to the end of its panel, may be written too: lds must leave room).
void causal_logits(const float *q, uint32_t rows, uint32_t d, const float *k_panels,
                   uint32_t first_row, float *s, uint64_t lds);

// Row r of s becomes the probabilities softmax(scale * s[r][0..i]): x = s * scale, m = max x,
// e = exp(x - m), p = e * (1 / CANONICAL16_j e); then p = 0 for i < j < first_row + rows.
// When col is not null, rows r >= score_row0 add their probabilities to the column sums:
// col[j] += double(p[j]), j <= i.
void softmax_rows(float *s, uint32_t rows, uint64_t lds, uint32_t first_row, float scale,
                  double *col, uint32_t score_row0);

// o[r * d + c] = SEQUENTIAL over j of p[r * ldp + j] * value(j, c), from 0, over the keys of
// the row's tile of 4 rows (the probabilities of masked keys are 0: those terms can change
// nothing but the sign of an exactly zero result).
void causal_pv(const float *p, uint32_t rows, uint64_t ldp, const float *v_panels,
               uint64_t panel_stride, uint32_t d, uint32_t first_row, float *o);

// ---- targets (tests and benchmarks) -------------------------------------------------------
// The targets compiled in and supported by this CPU, best first: (Highway bit, name).
std::vector<std::pair<int64_t, const char *>> simd_targets();
// Restricts dispatch to one target of simd_targets() (0 restores the best). Not thread-safe:
// for single-threaded tests.
void simd_force_target(int64_t target);
// Name of the target the kernels use now.
const char *simd_target_name();

}  // namespace minikv::cpu
