// Highway implementations of src/cpu/simd_kernels.h, compiled once per target
// (foreach_target.h re-includes this file) and dispatched at run time.
// Compiled with -ffp-contract=off (CMakeLists.txt): the order of every rounding is the
// one written here, on every target; products are fused into sums only through Fma.

// Scalable vectors (SVE, RVV) cannot live in arrays, which the register tiles below use;
// Arm builds use NEON. SSSE3-only CPUs (no SSE4) take the EMU128 fallback.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS \
  (HWY_SSSE3 | HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <algorithm>
#include <cmath>
#include <hwy/highway.h>

#include "cpu/simd_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace minikv::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;
using VU = hn::Vec<DU>;
constexpr size_t kLanes = hn::MaxLanes(DF());
static_assert(16 % kLanes == 0, "CANONICAL16 needs a vector width that divides 16 floats");
constexpr size_t kCanon = 16 / kLanes;  // vectors holding the 16 canonical partial sums

// Applies fn(const TIn *in, TOut *out), which converts kLanes elements, to n elements; the
// tail goes through a zero-padded copy.
template <typename TIn, typename TOut, class Fn>
HWY_INLINE void MapLanes(const TIn *HWY_RESTRICT in, TOut *HWY_RESTRICT out, size_t n, Fn fn) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) fn(in + i, out + i);
  if (i < n) {
    TIn tmp[kLanes] = {};
    TOut res[kLanes];
    for (size_t j = 0; j < n - i; ++j) tmp[j] = in[i + j];
    fn(tmp, res);
    for (size_t j = 0; j < n - i; ++j) out[i + j] = res[j];
  }
}

// ---- CANONICAL16 -------------------------------------------------------------------------
// Folds a vector in halves: lane l + N/2 onto lane l, until one lane is left.
template <class D>
HWY_INLINE float FoldHalves(D d, hn::Vec<D> v) {
#if HWY_TARGET == HWY_SCALAR
  return hn::GetLane(v);
#else
  if constexpr (hn::MaxLanes(D()) == 1) {
    return hn::GetLane(v);
  } else {
    const hn::Half<D> dh;
    return FoldHalves(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  }
#endif
}

// The 16 partial sums, canonical lane l in s[l / kLanes] lane l % kLanes: the upper half
// of the set is folded onto the lower half (l += l + 8, ...), then inside the last vector.
HWY_INLINE float FoldCanonical(VF (&s)[kCanon]) {
  for (size_t count = kCanon; count > 1; count /= 2)
    for (size_t i = 0; i < count / 2; ++i) s[i] = hn::Add(s[i], s[i + count / 2]);
  return FoldHalves(DF(), s[0]);
}

// ---- fused multiply-add ------------------------------------------------------------------
// a * b + c rounded once, on every target: the instruction where the target has it, else
// std::fma lane by lane (exact, slower: SSE4-only CPUs and the scalar fallback).
HWY_INLINE VF Fma(VF a, VF b, VF c) {
#if HWY_NATIVE_FMA
  return hn::MulAdd(a, b, c);
#else
  const DF df;
  HWY_ALIGN float x[kLanes], y[kLanes], z[kLanes];
  hn::Store(a, df, x);
  hn::Store(b, df, y);
  hn::Store(c, df, z);
  for (size_t i = 0; i < kLanes; ++i) z[i] = std::fma(x[i], y[i], z[i]);
  return hn::Load(df, z);
#endif
}

// ---- exp -----------------------------------------------------------------------------------
// Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a polynomial, times 2^n.
constexpr float kExpLow = -87.0f, kExpHigh = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

HWY_INLINE VF Exp(VF x) {
  const DF df;
  const DI di;
  const auto in_range = hn::Ge(x, hn::Set(df, kExpLow));  // false for NaN and -inf
  x = hn::Min(x, hn::Set(df, kExpHigh));
  const VF n = hn::Round(hn::Mul(x, hn::Set(df, kLog2e)));
  VF r = Fma(n, hn::Set(df, -kLn2Hi), x);
  r = Fma(n, hn::Set(df, -kLn2Lo), r);
  const VF z = hn::Mul(r, r);
  VF y = hn::Set(df, kP0);
  y = Fma(y, r, hn::Set(df, kP1));
  y = Fma(y, r, hn::Set(df, kP2));
  y = Fma(y, r, hn::Set(df, kP3));
  y = Fma(y, r, hn::Set(df, kP4));
  y = Fma(y, r, hn::Set(df, kP5));
  y = hn::Add(Fma(y, z, r), hn::Set(df, 1.0f));
  // n is in [-126, 127] here, so 2^n is a normal float built from its exponent bits.
  const VI e = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
  return hn::IfThenElseZero(in_range, hn::Mul(y, hn::BitCast(df, e)));
}

// exp of one value: lane 0 of Exp, so the same operations.
HWY_INLINE float ExpOne(float x) { return hn::GetLane(Exp(hn::Set(DF(), x))); }

// ---- conversions -------------------------------------------------------------------------
// As half_bits_to_float (src/dtype.h): normal, subnormal (mantissa * 2^-24), inf/NaN.
HWY_INLINE VF HalfBitsToFloat(VU h) {
  const DF df;
  const DU du;
  const VU sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)));
  const VU exponent = hn::And(hn::ShiftRight<10>(h), hn::Set(du, 0x1fu));
  const VU mantissa = hn::And(h, hn::Set(du, 0x3ffu));
  const VU normal = hn::Or(hn::ShiftLeft<23>(hn::Add(exponent, hn::Set(du, 112u))),
                           hn::ShiftLeft<13>(mantissa));
  const VU special = hn::Or(hn::Set(du, 0x7f800000u), hn::ShiftLeft<13>(mantissa));
  const VF subnormal = hn::Mul(hn::ConvertTo(df, hn::BitCast(DI(), mantissa)),
                               hn::Set(df, 5.9604644775390625e-8f));
  VU bits = hn::IfThenElse(hn::Eq(exponent, hn::Set(du, 0x1fu)), special, normal);
  bits = hn::IfThenElse(hn::Eq(exponent, hn::Zero(du)), hn::BitCast(du, subnormal), bits);
  return hn::BitCast(df, hn::Or(bits, sign));
}

void F16ToFloat(const uint16_t *HWY_RESTRICT in, float *HWY_RESTRICT out, size_t n) {
  MapLanes(in, out, n, [](const uint16_t *i, float *o) {
    const hn::Rebind<uint16_t, DF> d16;
    hn::StoreU(HalfBitsToFloat(hn::PromoteTo(DU(), hn::LoadU(d16, i))), DF(), o);
  });
}

void BF16ToFloat(const uint16_t *HWY_RESTRICT in, float *HWY_RESTRICT out, size_t n) {
  MapLanes(in, out, n, [](const uint16_t *i, float *o) {
    const hn::Rebind<uint16_t, DF> d16;
    const VU bits = hn::ShiftLeft<16>(hn::PromoteTo(DU(), hn::LoadU(d16, i)));
    hn::StoreU(hn::BitCast(DF(), bits), DF(), o);
  });
}

// As float_to_half_bits (src/dtype.h, after F. Giesen's float_to_half_fast3_rtne).
void FloatToF16(const float *HWY_RESTRICT in, uint16_t *HWY_RESTRICT out, size_t n) {
  MapLanes(in, out, n, [](const float *i, uint16_t *o) {
    const DF df;
    const DI di;
    const hn::Rebind<uint16_t, DF> d16;
    const VI all = hn::BitCast(di, hn::LoadU(df, i));
    const VI sign = hn::And(all, hn::Set(di, int32_t(0x80000000u)));
    const VI u = hn::Xor(all, sign);  // |x| bits, < 2^31: signed compares are safe
    const VI overflow = hn::IfThenElse(hn::Gt(u, hn::Set(di, 0x7f800000)), hn::Set(di, 0x7e00),
                                       hn::Set(di, 0x7c00));
    const VI magic = hn::Set(di, ((127 - 15) + (23 - 10) + 1) << 23);
    const VI subnormal = hn::Sub(
        hn::BitCast(di, hn::Add(hn::BitCast(df, u), hn::BitCast(df, magic))), magic);
    const VI odd = hn::And(hn::ShiftRight<13>(u), hn::Set(di, 1));
    const VI normal = hn::ShiftRight<13>(
        hn::Add(hn::Add(u, hn::Set(di, int32_t((uint32_t(15 - 127) << 23) + 0xfffu))), odd));
    VI h = hn::IfThenElse(hn::Lt(u, hn::Set(di, 113 << 23)), subnormal, normal);
    h = hn::IfThenElse(hn::Gt(u, hn::Set(di, ((127 + 16) << 23) - 1)), overflow, h);
    h = hn::Or(h, hn::BitCast(di, hn::ShiftRight<16>(hn::BitCast(DU(), sign))));
    hn::StoreU(hn::DemoteTo(d16, h), d16, o);
  });
}

// As float_to_bf16_bits (src/dtype.h): round to nearest even, NaN kept quiet.
void FloatToBF16(const float *HWY_RESTRICT in, uint16_t *HWY_RESTRICT out, size_t n) {
  MapLanes(in, out, n, [](const float *i, uint16_t *o) {
    const DF df;
    const DU du;
    const DI di;
    const hn::Rebind<uint16_t, DF> d16;
    const VU u = hn::BitCast(du, hn::LoadU(df, i));
    const VU rounded = hn::ShiftRight<16>(
        hn::Add(hn::Add(u, hn::Set(du, 0x7fffu)), hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u))));
    const VU quiet = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u));
    const auto is_nan = hn::Gt(hn::BitCast(di, hn::And(u, hn::Set(du, 0x7fffffffu))),
                               hn::Set(di, 0x7f800000));
    const VU h = hn::IfThenElse(hn::RebindMask(du, is_nan), quiet, rounded);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, h)), d16, o);
  });
}

// ---- decode ------------------------------------------------------------------------------
// Channel c .. c + kLanes - 1 codes of a packed row, as unsigned lanes. `shift` holds the
// per-lane bit offsets ((c + lane) % per_word) * bits where the lanes share one word.
template <uint32_t kBits>
HWY_INLINE VU CodeLanes(const uint32_t *HWY_RESTRICT row, uint32_t c, VU shift) {
  const DU du;
  constexpr uint32_t kPer = 32 / kBits;
  if constexpr (kLanes <= kPer) {
    return hn::And(hn::Set(du, row[c / kPer]) >> shift,
                   hn::Set(du, (1u << kBits) - 1));
  } else if constexpr (kBits == 8) {
    const hn::Rebind<uint8_t, DF> d8;
    return hn::PromoteTo(du, hn::LoadU(d8, reinterpret_cast<const uint8_t *>(row) + c));
  } else {
    const DI di;
    const VI word = hn::ShiftRight<kPer == 8 ? 3 : 4>(hn::Iota(di, int32_t(c)));
    const VU w = hn::BitCast(du, hn::GatherIndex(di, reinterpret_cast<const int32_t *>(row), word));
    return hn::And(w >> shift, hn::Set(du, (1u << kBits) - 1));
  }
}

template <uint32_t kBits>
HWY_INLINE VU CodeShift(uint32_t c) {
  const DU du;
  constexpr uint32_t kPer = 32 / kBits;
  return hn::Mul(hn::And(hn::Iota(du, c % kPer), hn::Set(du, kPer - 1)), hn::Set(du, kBits));
}

// Loads words [w0, w0 + 4) of kLanes consecutive packed rows (row_words apart) and stores
// them transposed, out[k * kLanes + lane] = word w0 + k of row `lane`: 4x4 transposes of
// 128-bit blocks instead of a gather per word.
#if HWY_TARGET != HWY_SCALAR
using D4 = hn::FixedTag<uint32_t, 4>;

template <class D>
HWY_INLINE hn::Vec<D> JoinBlocks(D d, const hn::Vec<D4> *blocks) {
  if constexpr (hn::MaxLanes(D()) == 4) {
    return blocks[0];
  } else {
    const hn::Half<D> dh;
    return hn::Combine(d, JoinBlocks(dh, blocks + hn::MaxLanes(dh) / 4), JoinBlocks(dh, blocks));
  }
}

HWY_INLINE void LoadTransposed4(const uint32_t *HWY_RESTRICT rows, uint64_t row_words,
                                uint32_t *HWY_RESTRICT out) {
  const D4 d4;
  const hn::Repartition<uint64_t, D4> d64;
  constexpr size_t kBlocks = kLanes / 4;
  hn::Vec<D4> col[4][kBlocks];
  for (size_t b = 0; b < kBlocks; ++b) {
    const uint32_t *p = rows + 4 * b * row_words;
    const auto r0 = hn::LoadU(d4, p), r1 = hn::LoadU(d4, p + row_words);
    const auto r2 = hn::LoadU(d4, p + 2 * row_words), r3 = hn::LoadU(d4, p + 3 * row_words);
    const auto t0 = hn::BitCast(d64, hn::InterleaveLower(d4, r0, r1));
    const auto t1 = hn::BitCast(d64, hn::InterleaveLower(d4, r2, r3));
    const auto t2 = hn::BitCast(d64, hn::InterleaveUpper(d4, r0, r1));
    const auto t3 = hn::BitCast(d64, hn::InterleaveUpper(d4, r2, r3));
    col[0][b] = hn::BitCast(d4, hn::InterleaveLower(d64, t0, t1));
    col[1][b] = hn::BitCast(d4, hn::InterleaveUpper(d64, t0, t1));
    col[2][b] = hn::BitCast(d4, hn::InterleaveLower(d64, t2, t3));
    col[3][b] = hn::BitCast(d4, hn::InterleaveUpper(d64, t2, t3));
  }
  for (size_t k = 0; k < 4; ++k) hn::Store(JoinBlocks(DU(), col[k]), DU(), out + k * kLanes);
}
#endif

// Logits of heads [r0, r0 + kHeads) for tokens [t, ...) in tiles of kVecs token vectors
// (lanes = tokens; each vector lies in one key group since kLanes <= 16 <= group and n is a
// multiple of the group).
// Returns the first token not done (fewer than kVecs * kLanes left).
template <uint32_t kBits, size_t kHeads, size_t kVecs>
HWY_INLINE uint32_t KeyLogitsTile(const float *HWY_RESTRICT qs, const float *HWY_RESTRICT bias,
                                  uint32_t n_rep, uint32_t r0, uint32_t d,
                                  const uint32_t *HWY_RESTRICT codes, uint64_t row_words,
                                  uint32_t group, uint32_t t, uint32_t n, float scale,
                                  float *HWY_RESTRICT logits, uint64_t ld) {
  constexpr uint32_t kPer = 32 / kBits;
  // The tile's tokens start at a multiple of their count: up to 16 they lie in one group
  // (16 divides the group) and share its scaled query.
  constexpr bool kOneGroup = kVecs * kLanes <= 16;
  const DF df;
  const DI di;
  const DU du;
  const int32_t *words = reinterpret_cast<const int32_t *>(codes);
  for (; t + kVecs * kLanes <= n; t += kVecs * kLanes) {
    VI index[kVecs];
    const float *q[kVecs];
    const float *b[kVecs];
    for (size_t v = 0; v < kVecs; ++v) {
      const uint32_t first = t + uint32_t(v * kLanes);
      index[v] = hn::Mul(hn::Iota(di, int32_t(first)), hn::Set(di, int32_t(row_words)));
      const uint64_t g = first / group;
      q[v] = qs + (g * n_rep + r0) * d;
      b[v] = bias + uint64_t(r0) * (n / group) + g;
    }
    VF acc[kHeads][kVecs];
    for (size_t h = 0; h < kHeads; ++h)
      for (size_t v = 0; v < kVecs; ++v) acc[h][v] = hn::Zero(df);
#if HWY_TARGET != HWY_SCALAR
    const bool transpose = (d / kPer) % 4 == 0;
#else
    const bool transpose = false;
#endif
    HWY_ALIGN uint32_t transposed[kVecs][4 * kLanes];
    for (uint32_t w = 0; w < d / kPer; ++w) {
      VU word[kVecs];
      if (transpose) {
#if HWY_TARGET != HWY_SCALAR
        if (w % 4 == 0)
          for (size_t v = 0; v < kVecs; ++v)
            LoadTransposed4(codes + (t + v * kLanes) * row_words + w, row_words, transposed[v]);
#endif
        for (size_t v = 0; v < kVecs; ++v) word[v] = hn::Load(du, transposed[v] + (w % 4) * kLanes);
      } else {
        for (size_t v = 0; v < kVecs; ++v)
          word[v] = hn::BitCast(du, hn::GatherIndex(di, words + w, index[v]));
      }
      for (uint32_t i = 0; i < kPer; ++i) {
        const uint32_t c = w * kPer + i;
        VF code[kVecs];
        for (size_t v = 0; v < kVecs; ++v)
          code[v] = hn::ConvertTo(df, hn::BitCast(di, hn::And(hn::ShiftRightSame(word[v], int(i * kBits)),
                                                              hn::Set(du, (1u << kBits) - 1))));
        for (size_t h = 0; h < kHeads; ++h) {
          if constexpr (kOneGroup) {
            const VF qv = hn::Set(df, q[0][h * d + c]);
            for (size_t v = 0; v < kVecs; ++v) acc[h][v] = Fma(qv, code[v], acc[h][v]);
          } else {
            for (size_t v = 0; v < kVecs; ++v) acc[h][v] = Fma(hn::Set(df, q[v][h * d + c]), code[v], acc[h][v]);
          }
        }
      }
    }
    for (size_t h = 0; h < kHeads; ++h)
      for (size_t v = 0; v < kVecs; ++v)
        hn::StoreU(hn::Mul(hn::Add(acc[h][v], hn::Set(df, b[v][h * (n / group)])), hn::Set(df, scale)), df,
                   logits + (r0 + h) * ld + t + v * kLanes);
  }
  return t;
}

template <uint32_t kBits>
void KeyLogitsBits(const float *qs, const float *bias, uint32_t n_rep, uint32_t d,
                   const uint32_t *codes, uint64_t row_words, uint32_t group, uint32_t n,
                   float scale, float *logits, uint64_t ld) {
  uint32_t r0 = 0;
  for (; r0 + 4 <= n_rep; r0 += 4) {
    const uint32_t t = KeyLogitsTile<kBits, 4, 2>(qs, bias, n_rep, r0, d, codes, row_words, group, 0, n, scale, logits, ld);
    KeyLogitsTile<kBits, 4, 1>(qs, bias, n_rep, r0, d, codes, row_words, group, t, n, scale, logits, ld);
  }
  for (; r0 + 2 <= n_rep; r0 += 2) {
    const uint32_t t = KeyLogitsTile<kBits, 2, 2>(qs, bias, n_rep, r0, d, codes, row_words, group, 0, n, scale, logits, ld);
    KeyLogitsTile<kBits, 2, 1>(qs, bias, n_rep, r0, d, codes, row_words, group, t, n, scale, logits, ld);
  }
  for (; r0 < n_rep; ++r0) {
    const uint32_t t = KeyLogitsTile<kBits, 1, 4>(qs, bias, n_rep, r0, d, codes, row_words, group, 0, n, scale, logits, ld);
    KeyLogitsTile<kBits, 1, 1>(qs, bias, n_rep, r0, d, codes, row_words, group, t, n, scale, logits, ld);
  }
}

void KeyLogitsCodes(const float *qs, const float *bias, uint32_t n_rep, uint32_t d,
                    const uint32_t *codes, uint64_t row_words, uint32_t bits, uint32_t group,
                    uint32_t n, float scale, float *logits, uint64_t ld) {
  switch (bits) {
    case 2: return KeyLogitsBits<2>(qs, bias, n_rep, d, codes, row_words, group, n, scale, logits, ld);
    case 4: return KeyLogitsBits<4>(qs, bias, n_rep, d, codes, row_words, group, n, scale, logits, ld);
    default: return KeyLogitsBits<8>(qs, bias, n_rep, d, codes, row_words, group, n, scale, logits, ld);
  }
}

void ScaleChannels(const float *HWY_RESTRICT q, uint32_t n_rep, uint32_t d,
                   const float *HWY_RESTRICT s, uint32_t groups, float *HWY_RESTRICT out) {
  const DF df;
  for (uint32_t g = 0; g < groups; ++g)
    for (uint32_t r = 0; r < n_rep; ++r)
      for (uint32_t c = 0; c < d; c += kLanes)
        hn::StoreU(hn::Mul(hn::LoadU(df, q + r * d + c), hn::LoadU(df, s + uint64_t(g) * d + c)), df,
                   out + (uint64_t(g) * n_rep + r) * d + c);
}

// CANONICAL16 dot products of kHeads query rows with one row.
template <size_t kHeads>
HWY_INLINE void DotRowHeads(const float *HWY_RESTRICT q, uint32_t d, const float *HWY_RESTRICT row,
                            float scale, float *HWY_RESTRICT out, uint64_t ld) {
  const DF df;
  VF s[kHeads][kCanon];
  for (size_t h = 0; h < kHeads; ++h)
    for (size_t k = 0; k < kCanon; ++k) s[h][k] = hn::Zero(df);
  for (uint32_t c0 = 0; c0 < d; c0 += 16) {
    for (size_t k = 0; k < kCanon; ++k) {
      const VF x = hn::LoadU(df, row + c0 + k * kLanes);
      for (size_t h = 0; h < kHeads; ++h)
        s[h][k] = Fma(hn::LoadU(df, q + h * d + c0 + k * kLanes), x, s[h][k]);
    }
  }
  for (size_t h = 0; h < kHeads; ++h) out[h * ld] = FoldCanonical(s[h]) * scale;
}

void DotRows(const float *q, uint32_t n_rep, uint32_t d, const float *rows, uint64_t row_stride,
             uint32_t n, float scale, float *logits, uint64_t ld) {
  for (uint32_t t = 0; t < n; ++t) {
    const float *row = rows + t * row_stride;
    uint32_t r = 0;
    for (; r + 4 <= n_rep; r += 4) DotRowHeads<4>(q + uint64_t(r) * d, d, row, scale, logits + r * ld + t, ld);
    for (; r < n_rep; ++r) DotRowHeads<1>(q + uint64_t(r) * d, d, row, scale, logits + r * ld + t, ld);
  }
}

void SoftmaxUpdate(float *xs, uint32_t n_rep, uint64_t ld, uint32_t n, float *m, float *l,
                   float *correction) {
  const DF df;
  for (uint32_t r = 0; r < n_rep; ++r) {
    float *x = xs + r * ld;
    VF mx = hn::Set(df, -INFINITY);
    for (uint32_t i = 0; i < n; i += kLanes) {
      const VF v = hn::LoadU(df, x + i);
      mx = hn::Max(mx, i + kLanes <= n ? v : hn::IfThenElse(hn::FirstN(df, n - i), v, hn::Set(df, -INFINITY)));
    }
    const float tile_max = hn::GetLane(hn::MaxOfLanes(df, mx));
    const float m_new = m[r] < tile_max ? tile_max : m[r];
    const float corr = ExpOne(m[r] - m_new);
    const VF sub = hn::Set(df, m_new);
    VF s[kCanon];
    for (size_t k = 0; k < kCanon; ++k) s[k] = hn::Zero(df);
    for (uint32_t i = 0; i < n; i += 16) {
      for (size_t k = 0; k < kCanon; ++k) {
        const uint32_t at = i + uint32_t(k * kLanes);
        if (at >= n) break;
        VF e = Exp(hn::Sub(hn::LoadU(df, x + at), sub));
        if (at + kLanes <= n) {
          hn::StoreU(e, df, x + at);
        } else {
          const auto valid = hn::FirstN(df, n - at);
          e = hn::IfThenElseZero(valid, e);
          hn::BlendedStore(e, valid, df, x + at);
        }
        s[k] = hn::Add(s[k], e);
      }
    }
    l[r] = l[r] * corr + FoldCanonical(s);
    m[r] = m_new;
    correction[r] = corr;
  }
}

void ScaleRows(float *acc, uint32_t n_rep, uint32_t d, const float *correction) {
  const DF df;
  for (uint32_t r = 0; r < n_rep; ++r) {
    const VF f = hn::Set(df, correction[r]);
    for (uint32_t c = 0; c < d; c += kLanes) {
      float *a = acc + uint64_t(r) * d + c;
      hn::StoreU(hn::Mul(hn::LoadU(df, a), f), df, a);
    }
  }
}

// Values: lanes = channels [c0, c0 + kCh * kLanes), heads [r0, r0 + kHeads), accumulators in
// registers across the n tokens.
template <uint32_t kBits, bool kClamp, size_t kHeads, size_t kCh>
HWY_INLINE uint32_t ValueCodesTile(const float *HWY_RESTRICT p, uint32_t r0, uint64_t ldp,
                                   uint32_t n, const uint32_t *HWY_RESTRICT codes,
                                   uint64_t row_words, const float *HWY_RESTRICT scale,
                                   const float *HWY_RESTRICT minimum, uint32_t group,
                                   uint32_t d, float limit, float *HWY_RESTRICT acc, uint32_t c0) {
  const DF df;
  const DI di;
  const uint32_t groups = d / group;
  for (; c0 + kCh * kLanes <= d; c0 += uint32_t(kCh * kLanes)) {
    VF a[kHeads][kCh];
    VU shift[kCh];
    uint32_t g[kCh];
    for (size_t v = 0; v < kCh; ++v) {
      shift[v] = CodeShift<kBits>(c0 + uint32_t(v * kLanes));
      g[v] = (c0 + uint32_t(v * kLanes)) / group;
      for (size_t h = 0; h < kHeads; ++h) a[h][v] = hn::LoadU(df, acc + (r0 + h) * d + c0 + v * kLanes);
    }
    for (uint32_t t = 0; t < n; ++t) {
      const uint32_t *row = codes + t * row_words;
      // The tile's kCh vectors span kCh * kLanes channels from a multiple of that count: up
      // to 16 they lie in one quantization group (16 divides the group), and up to
      // 32 / kBits in one packed word: one load of each serves them all.
      VF group_scale, group_min;
      VU word;
      if constexpr (kCh * kLanes <= 16) {
        group_scale = hn::Set(df, scale[t * groups + g[0]]);
        group_min = hn::Set(df, minimum[t * groups + g[0]]);
      }
      if constexpr (kCh * kLanes <= 32 / kBits) word = hn::Set(DU(), row[c0 / (32 / kBits)]);
      VF value[kCh];
      for (size_t v = 0; v < kCh; ++v) {
        VU bits;
        if constexpr (kCh * kLanes <= 32 / kBits)
          bits = hn::And(word >> shift[v], hn::Set(DU(), (1u << kBits) - 1));
        else
          bits = CodeLanes<kBits>(row, c0 + uint32_t(v * kLanes), shift[v]);
        const VF code = hn::ConvertTo(df, hn::BitCast(di, bits));
        // dequantize_code (src/quant.h): the product rounded, then the sum; then clamped to
        // the storage dtype's finite range (a group near its maximum can exceed it).
        if constexpr (kCh * kLanes <= 16)
          value[v] = hn::Add(hn::Mul(code, group_scale), group_min);
        else
          value[v] = hn::Add(hn::Mul(code, hn::Set(df, scale[t * groups + g[v]])),
                             hn::Set(df, minimum[t * groups + g[v]]));
        if constexpr (kClamp) value[v] = hn::Min(hn::Max(value[v], hn::Set(df, -limit)), hn::Set(df, limit));
      }
      for (size_t h = 0; h < kHeads; ++h) {
        const VF pv = hn::Set(df, p[(r0 + h) * ldp + t]);
        for (size_t v = 0; v < kCh; ++v) a[h][v] = Fma(pv, value[v], a[h][v]);
      }
    }
    for (size_t h = 0; h < kHeads; ++h)
      for (size_t v = 0; v < kCh; ++v) hn::StoreU(a[h][v], df, acc + (r0 + h) * d + c0 + v * kLanes);
  }
  return c0;
}

template <uint32_t kBits, bool kClamp, size_t kHeads>
HWY_INLINE void ValueCodesHeads(const float *p, uint32_t r0, uint64_t ldp, uint32_t n,
                                const uint32_t *codes, uint64_t row_words, const float *scale,
                                const float *minimum, uint32_t group, uint32_t d, float limit,
                                float *acc) {
  constexpr size_t kCh = kHeads >= 4 ? 2 : 4;
  const uint32_t c = ValueCodesTile<kBits, kClamp, kHeads, kCh>(p, r0, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc, 0);
  ValueCodesTile<kBits, kClamp, kHeads, 1>(p, r0, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc, c);
}

template <uint32_t kBits, bool kClamp>
void ValueCodesBits(const float *p, uint32_t n_rep, uint64_t ldp, uint32_t n, const uint32_t *codes,
                    uint64_t row_words, const float *scale, const float *minimum, uint32_t group,
                    uint32_t d, float limit, float *acc) {
  uint32_t r0 = 0;
  for (; r0 + 4 <= n_rep; r0 += 4) ValueCodesHeads<kBits, kClamp, 4>(p, r0, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
  for (; r0 + 2 <= n_rep; r0 += 2) ValueCodesHeads<kBits, kClamp, 2>(p, r0, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
  for (; r0 < n_rep; ++r0) ValueCodesHeads<kBits, kClamp, 1>(p, r0, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
}

// Whether some dequantized value of the pairs (scale[i], minimum[i]), i < count, could lie
// outside [-limit, limit]: its magnitude is at most fl(fl(max_code * |scale|) + |minimum|)
// (rounding is monotonic), so where every such bound is within the limit the clamp changes
// nothing and is left out. A NaN bound counts as outside.
bool ValuesMayExceed(const float *HWY_RESTRICT scale, const float *HWY_RESTRICT minimum, uint64_t count,
                     float max_code, float limit) {
  const DF df;
  const VF top = hn::Set(df, max_code);
  VF bound = hn::Zero(df);
  uint64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const VF b = hn::Add(hn::Mul(top, hn::Abs(hn::LoadU(df, scale + i))), hn::Abs(hn::LoadU(df, minimum + i)));
    bound = hn::IfThenElse(hn::Le(b, bound), bound, b);  // keeps a NaN
  }
  bool exceed = !hn::AllTrue(df, hn::Le(bound, hn::Set(df, limit)));
  for (; i < count; ++i) exceed |= !(std::fabs(minimum[i]) + max_code * std::fabs(scale[i]) <= limit);
  return exceed;
}

void ValueAccumulateCodes(const float *p, uint32_t n_rep, uint64_t ldp, uint32_t n,
                          const uint32_t *codes, uint64_t row_words, uint32_t bits,
                          const float *scale, const float *minimum, uint32_t group, uint32_t d,
                          float limit, float *acc) {
  const bool clamp = ValuesMayExceed(scale, minimum, uint64_t(n) * (d / group), float((1u << bits) - 1), limit);
  switch (bits * 2 + clamp) {
    case 4: return ValueCodesBits<2, false>(p, n_rep, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
    case 5: return ValueCodesBits<2, true>(p, n_rep, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
    case 8: return ValueCodesBits<4, false>(p, n_rep, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
    case 9: return ValueCodesBits<4, true>(p, n_rep, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
    case 16: return ValueCodesBits<8, false>(p, n_rep, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
    default: return ValueCodesBits<8, true>(p, n_rep, ldp, n, codes, row_words, scale, minimum, group, d, limit, acc);
  }
}

template <size_t kHeads, size_t kCh>
HWY_INLINE uint32_t ValueRowsTile(const float *HWY_RESTRICT p, uint32_t r0, uint64_t ldp,
                                  uint32_t n, const float *HWY_RESTRICT rows,
                                  uint64_t row_stride, uint32_t d, float *HWY_RESTRICT acc,
                                  uint32_t c0) {
  const DF df;
  for (; c0 + kCh * kLanes <= d; c0 += uint32_t(kCh * kLanes)) {
    VF a[kHeads][kCh];
    for (size_t h = 0; h < kHeads; ++h)
      for (size_t v = 0; v < kCh; ++v) a[h][v] = hn::LoadU(df, acc + (r0 + h) * d + c0 + v * kLanes);
    for (uint32_t t = 0; t < n; ++t) {
      VF value[kCh];
      for (size_t v = 0; v < kCh; ++v) value[v] = hn::LoadU(df, rows + t * row_stride + c0 + v * kLanes);
      for (size_t h = 0; h < kHeads; ++h) {
        const VF pv = hn::Set(df, p[(r0 + h) * ldp + t]);
        for (size_t v = 0; v < kCh; ++v) a[h][v] = Fma(pv, value[v], a[h][v]);
      }
    }
    for (size_t h = 0; h < kHeads; ++h)
      for (size_t v = 0; v < kCh; ++v) hn::StoreU(a[h][v], df, acc + (r0 + h) * d + c0 + v * kLanes);
  }
  return c0;
}

void ValueAccumulateRows(const float *p, uint32_t n_rep, uint64_t ldp, uint32_t n,
                         const float *rows, uint64_t row_stride, uint32_t d, float *acc) {
  uint32_t r0 = 0;
  for (; r0 + 4 <= n_rep; r0 += 4) {
    const uint32_t c = ValueRowsTile<4, 2>(p, r0, ldp, n, rows, row_stride, d, acc, 0);
    ValueRowsTile<4, 1>(p, r0, ldp, n, rows, row_stride, d, acc, c);
  }
  for (; r0 < n_rep; ++r0) {
    const uint32_t c = ValueRowsTile<1, 4>(p, r0, ldp, n, rows, row_stride, d, acc, 0);
    ValueRowsTile<1, 1>(p, r0, ldp, n, rows, row_stride, d, acc, c);
  }
}

// ---- prefill -----------------------------------------------------------------------------
// A kRows x (kVecs * kLanes) tile of C = A B: lanes along the columns of B, each element
// SEQUENTIAL over k in [k_begin, k_end), starting from C (accumulate) or from 0.
template <size_t kRows, size_t kVecs>
HWY_INLINE void MatTile(const float *HWY_RESTRICT a, uint64_t lda, const float *HWY_RESTRICT b,
                        uint64_t ldb, float *HWY_RESTRICT c, uint64_t ldc, uint32_t k_begin,
                        uint32_t k_end, bool accumulate) {
  const DF df;
  VF acc[kRows][kVecs];
  for (size_t r = 0; r < kRows; ++r)
    for (size_t v = 0; v < kVecs; ++v)
      acc[r][v] = accumulate ? hn::LoadU(df, c + r * ldc + v * kLanes) : hn::Zero(df);
  for (uint32_t k = k_begin; k < k_end; ++k) {
    VF bv[kVecs];
    for (size_t v = 0; v < kVecs; ++v) bv[v] = hn::LoadU(df, b + uint64_t(k) * ldb + v * kLanes);
    for (size_t r = 0; r < kRows; ++r) {
      const VF av = hn::Set(df, a[r * lda + k]);
      for (size_t v = 0; v < kVecs; ++v) acc[r][v] = Fma(av, bv[v], acc[r][v]);
    }
  }
  for (size_t r = 0; r < kRows; ++r)
    for (size_t v = 0; v < kVecs; ++v) hn::StoreU(acc[r][v], df, c + r * ldc + v * kLanes);
}

constexpr size_t kTileRows = 4, kTileVecs = 2;
constexpr uint32_t kPanel = kPanelWidth;
static_assert(kPanel % (kTileVecs * kLanes) == 0, "tiles must not straddle panels");
constexpr uint32_t kStrip = uint32_t(kTileVecs * kLanes);  // columns of one tile

void CausalLogits(const float *HWY_RESTRICT q, uint32_t rows, uint32_t d,
                  const float *HWY_RESTRICT kt, uint32_t first_row, float *HWY_RESTRICT s,
                  uint64_t lds) {
  const uint32_t n_keys = first_row + rows;
  for (uint32_t j0 = 0; j0 < n_keys; j0 += kStrip) {
    const float *b = kt + uint64_t(j0 / kPanel) * d * kPanel + j0 % kPanel;
    uint32_t r0 = 0;
    for (; r0 + kTileRows <= rows; r0 += kTileRows)
      if (j0 <= first_row + r0 + kTileRows - 1)  // the tile's last row sees key j0
        MatTile<kTileRows, kTileVecs>(q + uint64_t(r0) * d, d, b, kPanel, s + r0 * lds + j0, lds, 0, d, false);
    for (; r0 < rows; ++r0)
      if (j0 <= first_row + r0) MatTile<1, kTileVecs>(q + uint64_t(r0) * d, d, b, kPanel, s + r0 * lds + j0, lds, 0, d, false);
  }
}

// Rows [0, rows) of o, channels [c0, c0 + kVecs * kLanes), keys [k0, k0 + chunk).
template <size_t kVecs>
HWY_INLINE void PVColumns(const float *HWY_RESTRICT p, uint32_t rows, uint64_t ldp,
                          const float *HWY_RESTRICT b, uint32_t d, uint32_t first_row,
                          float *HWY_RESTRICT o, uint32_t c0, uint32_t k0, uint32_t chunk) {
  uint32_t r0 = 0;
  for (; r0 + kTileRows <= rows; r0 += kTileRows) {
    const uint32_t k_end = std::min(k0 + chunk, first_row + r0 + uint32_t(kTileRows));
    if (k0 < k_end)
      MatTile<kTileRows, kVecs>(p + uint64_t(r0) * ldp, ldp, b, kPanel, o + uint64_t(r0) * d + c0, d, k0,
                                k_end, k0 > 0);
  }
  for (; r0 < rows; ++r0) {
    const uint32_t k_end = std::min(k0 + chunk, first_row + r0 + 1);
    if (k0 < k_end)
      MatTile<1, kVecs>(p + uint64_t(r0) * ldp, ldp, b, kPanel, o + uint64_t(r0) * d + c0, d, k0, k_end, k0 > 0);
  }
}

void CausalPV(const float *HWY_RESTRICT p, uint32_t rows, uint64_t ldp, const float *HWY_RESTRICT v,
              uint64_t panel_stride, uint32_t d, uint32_t first_row, float *HWY_RESTRICT o) {
  constexpr uint32_t kChunk = 256;  // keys per pass: the P rows and V panel chunk stay in L1
  const uint32_t n_keys = first_row + rows;
  for (uint32_t k0 = 0; k0 < n_keys; k0 += kChunk) {
    uint32_t c0 = 0;
    for (; c0 + kStrip <= d; c0 += kStrip)
      PVColumns<kTileVecs>(p, rows, ldp, v + (c0 / kPanel) * panel_stride + c0 % kPanel, d, first_row, o, c0, k0, kChunk);
    for (; c0 < d; c0 += uint32_t(kLanes))
      PVColumns<1>(p, rows, ldp, v + (c0 / kPanel) * panel_stride + c0 % kPanel, d, first_row, o, c0, k0, kChunk);
  }
}

void SoftmaxRows(float *HWY_RESTRICT s, uint32_t rows, uint64_t lds, uint32_t first_row, float scale,
                 double *HWY_RESTRICT col, uint32_t score_row0) {
  const DF df;
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;  // as many floats as a vector of doubles
  constexpr size_t kDoubles = hn::MaxLanes(decltype(dd)());
  const uint32_t n_keys = first_row + rows;
  for (uint32_t r = 0; r < rows; ++r) {
    float *x = s + r * lds;
    const uint32_t n = first_row + r + 1;
    const VF vscale = hn::Set(df, scale);
    VF mx = hn::Set(df, -INFINITY);
    uint32_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      const VF v = hn::Mul(hn::LoadU(df, x + j), vscale);
      hn::StoreU(v, df, x + j);
      mx = hn::Max(mx, v);
    }
    for (; j < n; ++j) {
      x[j] = x[j] * scale;
      mx = hn::Max(mx, hn::Set(df, x[j]));
    }
    const VF m = hn::MaxOfLanes(df, mx);
    VF acc[kCanon];
    for (size_t k = 0; k < kCanon; ++k) acc[k] = hn::Zero(df);
    for (j = 0; j < n; j += 16) {
      for (size_t k = 0; k < kCanon; ++k) {
        const uint32_t at = j + uint32_t(k * kLanes);
        if (at >= n) break;
        VF e = Exp(hn::Sub(hn::LoadU(df, x + at), m));
        if (at + kLanes <= n) {
          hn::StoreU(e, df, x + at);
        } else {
          const auto valid = hn::FirstN(df, n - at);
          e = hn::IfThenElseZero(valid, e);
          hn::BlendedStore(e, valid, df, x + at);
        }
        acc[k] = hn::Add(acc[k], e);
      }
    }
    const VF inv = hn::Set(df, 1.0f / FoldCanonical(acc));
    for (j = 0; j + kLanes <= n; j += kLanes) hn::StoreU(hn::Mul(hn::LoadU(df, x + j), inv), df, x + j);
    for (; j < n; ++j) x[j] = x[j] * hn::GetLane(inv);
    for (j = n; j < n_keys; ++j) x[j] = 0.0f;  // causal: no weight (the PV tiles read them)
    if (col && r >= score_row0) {
      for (j = 0; j + kDoubles <= n; j += uint32_t(kDoubles))
        hn::StoreU(hn::Add(hn::LoadU(dd, col + j), hn::PromoteTo(dd, hn::LoadU(dfh, x + j))), dd, col + j);
      for (; j < n; ++j) col[j] += double(x[j]);
    }
  }
}

const char *TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace minikv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace minikv::cpu {

HWY_EXPORT(F16ToFloat);
HWY_EXPORT(BF16ToFloat);
HWY_EXPORT(FloatToF16);
HWY_EXPORT(FloatToBF16);
HWY_EXPORT(KeyLogitsCodes);
HWY_EXPORT(ScaleChannels);
HWY_EXPORT(DotRows);
HWY_EXPORT(SoftmaxUpdate);
HWY_EXPORT(ScaleRows);
HWY_EXPORT(ValueAccumulateCodes);
HWY_EXPORT(ValueAccumulateRows);
HWY_EXPORT(CausalLogits);
HWY_EXPORT(CausalPV);
HWY_EXPORT(SoftmaxRows);
HWY_EXPORT(TargetName);

void f16_to_float(const uint16_t *in, float *out, size_t n) { HWY_DYNAMIC_DISPATCH(F16ToFloat)(in, out, n); }
void bf16_to_float(const uint16_t *in, float *out, size_t n) { HWY_DYNAMIC_DISPATCH(BF16ToFloat)(in, out, n); }
void float_to_f16(const float *in, uint16_t *out, size_t n) { HWY_DYNAMIC_DISPATCH(FloatToF16)(in, out, n); }
void float_to_bf16(const float *in, uint16_t *out, size_t n) { HWY_DYNAMIC_DISPATCH(FloatToBF16)(in, out, n); }

void key_logits_codes(const float *qs, const float *bias, uint32_t n_rep, uint32_t d,
                      const uint32_t *codes, uint64_t row_words, uint32_t bits, uint32_t group,
                      uint32_t n, float scale, float *logits, uint64_t ld) {
  HWY_DYNAMIC_DISPATCH(KeyLogitsCodes)(qs, bias, n_rep, d, codes, row_words, bits, group, n, scale, logits, ld);
}

void scale_channels(const float *q, uint32_t n_rep, uint32_t d, const float *s, uint32_t groups,
                    float *out) {
  HWY_DYNAMIC_DISPATCH(ScaleChannels)(q, n_rep, d, s, groups, out);
}

void dot_rows(const float *q, uint32_t n_rep, uint32_t d, const float *rows, uint64_t row_stride,
              uint32_t n, float scale, float *logits, uint64_t ld) {
  HWY_DYNAMIC_DISPATCH(DotRows)(q, n_rep, d, rows, row_stride, n, scale, logits, ld);
}

void softmax_update(float *x, uint32_t n_rep, uint64_t ld, uint32_t n, float *m, float *l,
                    float *correction) {
  HWY_DYNAMIC_DISPATCH(SoftmaxUpdate)(x, n_rep, ld, n, m, l, correction);
}

void scale_rows(float *acc, uint32_t n_rep, uint32_t d, const float *correction) {
  HWY_DYNAMIC_DISPATCH(ScaleRows)(acc, n_rep, d, correction);
}

void value_accumulate_codes(const float *p, uint32_t n_rep, uint64_t ldp, uint32_t n,
                            const uint32_t *codes, uint64_t row_words, uint32_t bits,
                            const float *scale, const float *minimum, uint32_t group,
                            uint32_t d, float limit, float *acc) {
  HWY_DYNAMIC_DISPATCH(ValueAccumulateCodes)(p, n_rep, ldp, n, codes, row_words, bits, scale, minimum, group, d, limit,
                                             acc);
}

void value_accumulate_rows(const float *p, uint32_t n_rep, uint64_t ldp, uint32_t n,
                           const float *rows, uint64_t row_stride, uint32_t d, float *acc) {
  HWY_DYNAMIC_DISPATCH(ValueAccumulateRows)(p, n_rep, ldp, n, rows, row_stride, d, acc);
}

void causal_logits(const float *q, uint32_t rows, uint32_t d, const float *k_panels,
                   uint32_t first_row, float *s, uint64_t lds) {
  HWY_DYNAMIC_DISPATCH(CausalLogits)(q, rows, d, k_panels, first_row, s, lds);
}

void causal_pv(const float *p, uint32_t rows, uint64_t ldp, const float *v_panels,
               uint64_t panel_stride, uint32_t d, uint32_t first_row, float *o) {
  HWY_DYNAMIC_DISPATCH(CausalPV)(p, rows, ldp, v_panels, panel_stride, d, first_row, o);
}

void softmax_rows(float *s, uint32_t rows, uint64_t lds, uint32_t first_row, float scale,
                  double *col, uint32_t score_row0) {
  HWY_DYNAMIC_DISPATCH(SoftmaxRows)(s, rows, lds, first_row, scale, col, score_row0);
}

std::vector<std::pair<int64_t, const char *>> simd_targets() {
  std::vector<std::pair<int64_t, const char *>> out;
  for (int64_t left = hwy::SupportedTargets() & HWY_TARGETS; left != 0; left &= left - 1) {
    const int64_t target = left & -left;  // lowest bit first: the best target
    out.emplace_back(target, hwy::TargetName(target));
  }
  return out;
}

void simd_force_target(int64_t target) {
  hwy::SetSupportedTargetsForTest(target);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

const char *simd_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace minikv::cpu
#endif  // HWY_ONCE
