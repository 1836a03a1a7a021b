// The QK operands of the CUDA decode fast path (kernels/qk_pieces.h), on the CPU:
//  * the host fp16 conversions (src/dtype.h, which qk_pieces.h uses) equal IEEE binary16 (exhaustively for fp16 → fp32; for
//    fp32 → fp16 over every exponent with the rounding-relevant low bits), checked against
//    the compiler's _Float16 where it has one, and on hand-picked values everywhere;
//  * the A patterns: f16_code_pair gives code c of channel ch as exactly c · 4^(ch mod 4) · 2^-24;
//  * one B column = D channels of x = q · s_k (fp16 × fp16 or bf16 × bf16) split into
//    prescaled fp16 pieces: per element |x' − (hi + lo)| ≤ 2^-25 (0 when |x'| ≥ 2^-3), no
//    piece overflows, and the emulated mma Σ A · (hi + lo) · unscale is within
//    3 · D · 2^-33 · max(max|x|, 2^-63) of the exact Σ c · x (the bound qk_pieces.h states),
//    on random columns over the whole fp16 range and most of the bf16 range, and on the
//    extremes: zero columns, fp16 max, subnormal scales, one huge element among tiny ones,
//    bf16 products up to 2^128 and below 2^-63.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../kernels/qk_pieces.h"
#include "support.hpp"

namespace {

using namespace minikv::kernels;
using minikv::float_to_half_bits;  // the library's host fp16 codec (src/dtype.h)
using minikv::half_bits_to_float;

constexpr float kF16Max = 65504.0f;

// A random fp16 value (as float) with its exponent uniform over the whole binade range,
// subnormals included; `zero_every` > 0 makes about 1 in zero_every values zero.
float random_f16(test::Rng &rng, uint32_t zero_every = 0) {
  if (zero_every && rng.below(zero_every) == 0) return 0.0f;
  uint16_t h;
  do {
    h = static_cast<uint16_t>(rng.below(0x7c00u));  // finite, non-negative
  } while (h == 0);
  const float v = half_bits_to_float(h);
  return rng.below(2) ? -v : v;
}

// A random bf16 value (as float): sign, exponent uniform in [emin, emax], 7 random mantissa bits.
float random_bf16(test::Rng &rng, int emin, int emax) {
  const uint32_t e = uint32_t(emin + int(rng.below(uint32_t(emax - emin + 1))) + 127);
  return bits_f32(uint32_t(rng.below(2)) << 31 | e << 23 | uint32_t(rng.below(128)) << 16);
}

// q · s in fp32, required exact (fp16 × fp16 and bf16 × bf16 products fit fp32's 24 bits;
// the inputs here stay clear of fp32's denormal range).
float exact_product(float q, float s) {
  const float p = q * s;
  REQUIRE(double(p) == double(q) * double(s));
  return p;
}

// One column: codes c[ch] and x[ch] = q[ch] · s[ch]. Emulates the kernel's B build (prescale,
// pieces) and the mma (in double: products and their sum exact to 2^-50 relative), and checks
// the per-element and per-column bounds. Returns the column error in units of
// max(max |x|, 2^-63).
// subnormal_codes selects the A form (kernels/qk_pieces.h: kF16SubnormalCodes and its fallback).
double check_column(const std::vector<uint32_t> &code, const std::vector<float> &x,
                    bool subnormal_codes) {
  const size_t D = x.size();
  float mx = 0.0f;
  double exact = 0.0, abs_sum = 0.0;
  for (size_t ch = 0; ch < D; ++ch) {
    mx = std::fmax(mx, std::fabs(x[ch]));
    exact += double(code[ch]) * double(x[ch]);
    abs_sum += double(code[ch]) * std::fabs(double(x[ch]));
  }
  const uint32_t e = f16_col_exp(mx);
  const double unscale =
      double(f16_col_unscale(e, subnormal_codes)) * double(f16_col_unscale_big(e, subnormal_codes));
  // The packed code words (16 channels per word, channel i at bits 2i).
  std::vector<uint32_t> words(D / 16, 0u);
  for (size_t ch = 0; ch < D; ++ch) words[ch / 16] |= code[ch] << (2 * (ch % 16));
  double mma = 0.0;
  for (size_t w = 0; w < D / 16; ++w) {
    for (uint32_t s = 0; s < 8; ++s) {
      const uint32_t a = f16_code_pair(words[w], s);  // (channel 16w + s, channel 16w + s + 8)
      const size_t ch0 = 16 * w + s, ch1 = ch0 + 8;
      // The kernel's A halves: the pattern itself, or (pattern | 1024.0) − 1024.0 (exact).
      auto a_value = [&](uint32_t half) {
        return subnormal_codes ? double(half_bits_to_float(uint16_t(half)))
                               : double(half_bits_to_float(uint16_t(half | 0x6400u))) - 1024.0;
      };
      const double a0 = a_value(a & 0xffffu), a1 = a_value(a >> 16);
      const double pos = std::ldexp(1.0, int(2 * (s & 3u)) - (subnormal_codes ? 24 : 0));
      REQUIRE(a0 == double(code[ch0]) * pos);
      REQUIRE(a1 == double(code[ch1]) * pos);
      const float sc = f16_col_scale(e, s & 3u);
      // × a power of two: exact, except where a bf16 column's small elements fall under
      // fp32's normal range (off by ≤ 2^-150 there, far under the pieces' 2^-25).
      const float b0 = x[ch0] * sc, b1 = x[ch1] * sc;
      const double xb0 = double(x[ch0]) * double(sc), xb1 = double(x[ch1]) * double(sc);
      REQUIRE((double(b0) == xb0 || std::fabs(xb0) < 0x1.0p-126));
      REQUIRE((double(b1) == xb1 || std::fabs(xb1) < 0x1.0p-126));
      REQUIRE(std::fabs(b0) < 32768.0f);
      REQUIRE(std::fabs(b1) < 32768.0f);
      uint32_t hi = 0, lo = 0;
      f16_split_pair(b0, b1, hi, lo);
      const double p0 = double(half_bits_to_float(uint16_t(hi & 0xffffu))) +
                        double(half_bits_to_float(uint16_t(lo & 0xffffu)));
      const double p1 = double(half_bits_to_float(uint16_t(hi >> 16))) +
                        double(half_bits_to_float(uint16_t(lo >> 16)));
      REQUIRE(std::isfinite(p0));
      REQUIRE(std::isfinite(p1));
      const double err0 = std::fabs(p0 - xb0), err1 = std::fabs(p1 - xb1);
      REQUIRE(err0 <= 0x1.0p-25);
      REQUIRE(err1 <= 0x1.0p-25);
      if (std::fabs(b0) >= 0.125f) REQUIRE(err0 == 0.0);
      if (std::fabs(b1) >= 0.125f) REQUIRE(err1 == 0.0);
      mma += a0 * p0 + a1 * p1;
    }
  }
  const double got = mma * unscale;
  const double M = double(mx);
  const double bound = 3.0 * double(D) * 0x1.0p-33 * std::fmax(M, 0x1.0p-63) + 0x1.0p-50 * abs_sum;
  const double err = std::fabs(got - exact);
  if (!(err <= bound)) {
    CAPTURE(M);
    CAPTURE(exact);
    CAPTURE(got);
    CHECK(err <= bound);
  }
  return err / std::fmax(M, 0x1.0p-63);
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("qk_pieces: host fp16 conversions are IEEE binary16") {
  // Hand-picked: zero, subnormals, normals, the max, rounding ties, overflow.
  struct Pair { float f; uint16_t h; };
  const Pair pairs[] = {
      {0.0f, 0x0000}, {-0.0f, 0x8000}, {1.0f, 0x3c00}, {-2.0f, 0xc000},
      {0x1.0p-24f, 0x0001}, {0x1.0p-25f, 0x0000}, {0x1.8p-25f, 0x0001}, {0x1.8p-24f, 0x0002},
      {0x1.0p-14f, 0x0400}, {0x1.ff8p-15f, 0x03ff}, {0x1.ffcp-15f, 0x0400}, {kF16Max, 0x7bff}, {65519.0f, 0x7bff},
      {65520.0f, 0x7c00}, {1e30f, 0x7c00}, {1.0f + 0x1.0p-11f, 0x3c00},
      {1.0f + 0x1.8p-10f, 0x3c02}, {2049.0f, 0x6800}, {2051.0f, 0x6802}};
  for (const Pair &p : pairs) {
    CAPTURE(p.f);
    CHECK(float_to_half_bits(p.f) == p.h);
  }
  for (uint32_t h = 0; h < 0x7c00u; ++h) {  // every finite positive fp16 round-trips
    const float f = half_bits_to_float(uint16_t(h));
    if (float_to_half_bits(f) != h || half_bits_to_float(uint16_t(h | 0x8000u)) != -f) {
      CAPTURE(h);
      CHECK(float_to_half_bits(f) == h);
    }
  }
#if defined(__FLT16_MAX__)
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) continue;  // NaN payloads
    _Float16 v;
    const uint16_t hh = uint16_t(h);
    std::memcpy(&v, &hh, 2);
    if (half_bits_to_float(hh) != float(v)) {
      CAPTURE(h);
      CHECK(half_bits_to_float(hh) == float(v));
    }
  }
  // fp32 → fp16: every sign/exponent/high-mantissa prefix with the low 13 bits that decide
  // rounding (below, at and above the tie, odd and even) plus random ones.
  test::Rng rng(11);
  const uint32_t lows[] = {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu, 0x07ffu, 0x1800u};
  uint64_t mismatches = 0;
  for (uint32_t hi = 0; hi < (1u << 19); ++hi) {
    for (int k = 0; k < 9; ++k) {
      const uint32_t low = k < 8 ? lows[k] : uint32_t(rng.next() & 0x1fffu);
      const uint32_t bits = (hi << 13) | low;
      if ((bits & 0x7f800000u) == 0x7f800000u) continue;  // inf/NaN: not produced here
      const float f = bits_f32(bits);
      const _Float16 want = static_cast<_Float16>(f);
      uint16_t wb;
      std::memcpy(&wb, &want, 2);
      if (float_to_half_bits(f) != wb && ++mismatches < 10) {
        CAPTURE(bits);
        CHECK(float_to_half_bits(f) == wb);
      }
    }
  }
  CHECK(mismatches == 0);
#endif
}

TEST_CASE("qk_pieces: prescale keeps every column inside the fp16 pieces' range") {
  // E over every finite fp32 magnitude (|fp16 · fp16| has E ≤ 158, |bf16 · bf16| any), and
  // the clamp for a zero or tiny column.
  for (uint32_t e = 0; e <= 254; ++e) {
    const float mx = e == 0 ? 0.0f : bits_f32(e << 23);
    const uint32_t ce = f16_col_exp(mx);
    CHECK(ce >= 64u);
    for (uint32_t j = 0; j < 4; ++j) CHECK(std::isfinite(f16_col_scale(ce, j)));
    for (const bool subnormal : {true, false}) {
      const float u = f16_col_unscale(ce, subnormal), big = f16_col_unscale_big(ce, subnormal);
      CHECK(std::isfinite(u));
      CHECK(u > 0.0f);
      CHECK(std::isfinite(big));
      if (ce <= 158) CHECK(big == 1.0f);  // every fp16 column: one factor
      // Together the undo of 2^k · 2^-24 (subnormal codes) or of 2^k.
      CHECK(double(u) * double(big) == std::ldexp(1.0, int(ce) - (subnormal ? 117 : 141)));
    }
    if (e >= 64) {  // max |x'| lands in [2^14, 2^15); below, the clamp leaves it smaller
      const float top = mx * f16_col_scale(ce, 0);
      CHECK(top >= 16384.0f);
      CHECK(top < 32768.0f);
    }
    if (e > 0 && e < 64) CHECK(mx * f16_col_scale(ce, 0) < 16384.0f);
  }
}

TEST_CASE("qk_pieces: fp16 pieces of q * s_k reconstruct the column dot within the bound") {
  test::Rng rng(2026);
  double worst = 0.0;
  for (const bool subnormal : {true, false}) {
    for (size_t D : {size_t(64), size_t(128)}) {
    std::vector<uint32_t> code(D);
    std::vector<float> x(D);
    // Random columns: q and s over the whole fp16 range (subnormals included), some zeros.
    for (int it = 0; it < 3000; ++it) {
      const int kind = it % 4;
      for (size_t ch = 0; ch < D; ++ch) {
        code[ch] = rng.below(4);
        float q, s;
        if (kind == 0) {  // both full range
          q = random_f16(rng, 16);
          s = random_f16(rng, 16);
        } else if (kind == 1) {  // realistic: q ~ N(0, 1), scales small and positive
          q = half_bits_to_float(float_to_half_bits(float(rng.normal())));
          s = half_bits_to_float(float_to_half_bits(float(std::ldexp(rng.uniform() + 0.01, -4))));
        } else if (kind == 2) {  // subnormal scales
          q = random_f16(rng);
          s = half_bits_to_float(uint16_t(1 + rng.below(0x3ffu)));
        } else {  // wide spread within a column: exponents of q over [-24, 15]
          q = half_bits_to_float(float_to_half_bits(
              float(std::ldexp(rng.uniform() + 0.5, int(rng.below(40)) - 24))));
          s = random_f16(rng, 8);
        }
        x[ch] = exact_product(q, s);
      }
      worst = std::fmax(worst, check_column(code, x, subnormal));
    }
    // Extremes.
    std::fill(code.begin(), code.end(), 3u);
    std::fill(x.begin(), x.end(), 0.0f);
    CHECK(check_column(code, x, subnormal) == 0.0);  // zero column: exact zero
    std::fill(x.begin(), x.end(), exact_product(kF16Max, kF16Max));
    CHECK(check_column(code, x, subnormal) == 0.0);  // every element at (fp16 max)^2: exact
    std::fill(x.begin(), x.end(), exact_product(-kF16Max, kF16Max));
    CHECK(check_column(code, x, subnormal) == 0.0);
    for (size_t ch = 0; ch < D; ++ch)  // one huge element among the smallest products
      x[ch] = ch == 5 ? exact_product(kF16Max, kF16Max) : exact_product(0x1.0p-24f, (ch % 2 ? -1 : 1) * 0x1.0p-24f);
    check_column(code, x, subnormal);
    for (size_t ch = 0; ch < D; ++ch)  // all at the smallest nonzero product: exact
      x[ch] = exact_product(0x1.0p-24f, (ch % 3 ? 1 : -1) * 0x1.0p-24f);
    CHECK(check_column(code, x, subnormal) == 0.0);
    for (size_t ch = 0; ch < D; ++ch)  // every code position, alternating codes
      code[ch] = uint32_t(ch % 4), x[ch] = exact_product(half_bits_to_float(uint16_t(0x3c01u + ch)), 0x1.8p-20f);
    CHECK(check_column(code, x, subnormal) == 0.0);
    }
  }
  MESSAGE("worst column error / max|x|: " << worst << " (bound 3*128*2^-33 = " << 3.0 * 128 * 0x1.0p-33 << ")");
}

TEST_CASE("qk_pieces: bf16 q * s_k through the fp16 pieces stays within the bound") {
  test::Rng rng(2027);
  double worst = 0.0;
  for (const bool subnormal : {true, false}) {
    for (size_t D : {size_t(64), size_t(128)}) {
      std::vector<uint32_t> code(D);
      std::vector<float> x(D);
      for (int it = 0; it < 3000; ++it) {
        const int kind = it % 4;
        // One exponent window per column (so that max |x| spans the bf16 range across
        // columns) and, for kind 3, 40 binades within the column.
        const int center = int(rng.below(240)) - 120;
        for (size_t ch = 0; ch < D; ++ch) {
          code[ch] = rng.below(4);
          float q, s;
          if (kind == 0) {  // both over most of the range: products in [2^-124, 2^126)
            q = random_bf16(rng, -62, 62);
            s = random_bf16(rng, -62, 62);
          } else if (kind == 1) {  // realistic: q ~ N(0, 1) in bf16, small positive scales
            q = bits_f32(f32_bits(float(rng.normal())) & 0xffff0000u);
            s = std::fabs(random_bf16(rng, -8, -2));
          } else if (kind == 2) {  // one window, anywhere in the range
            q = random_bf16(rng, center / 2 - 2, center / 2 + 2);
            s = random_bf16(rng, center / 2 - 2, center / 2 + 2);
          } else {  // wide spread: 40 binades around the window
            q = random_bf16(rng, center / 2 - 20, center / 2 + 20);
            s = random_bf16(rng, -1, 1);
          }
          x[ch] = exact_product(q, s);
          if (kind != 1 && rng.below(16) == 0) x[ch] = 0.0f;
        }
        worst = std::fmax(worst, check_column(code, x, subnormal));
      }
      std::fill(code.begin(), code.end(), 3u);
      // The top of fp32: max |x| in [2^127, 2^128) (E = 254), the second unscale factor.
      const float big = bits_f32(0x5f7f0000u);  // (2 − 2^-7) · 2^63, a bf16 value
      std::fill(x.begin(), x.end(), exact_product(big, big));
      CHECK(check_column(code, x, subnormal) == 0.0);
      for (size_t ch = 0; ch < D; ++ch)  // one at the top, the rest 40 binades down, mixed signs
        x[ch] = ch == 7 ? exact_product(big, big) : exact_product((ch % 2 ? -1.0f : 1.0f) * big, 0x1.0p-40f);
      check_column(code, x, subnormal);
      // Tiny columns: max |x| < 2^-63, where the prescale clamps (error ≤ 3 · D · 2^-96).
      for (size_t ch = 0; ch < D; ++ch)
        x[ch] = exact_product((ch % 3 ? 1.0f : -1.0f) * 0x1.0p-60f, random_bf16(rng, -9, -5));
      check_column(code, x, subnormal);
      for (size_t ch = 0; ch < D; ++ch) x[ch] = exact_product(0x1.0p-63f, 0x1.0p-63f);  // 2^-126
      check_column(code, x, subnormal);
    }
  }
  MESSAGE("bf16: worst column error / max(max|x|, 2^-63): " << worst << " (bound 3*128*2^-33 = "
          << 3.0 * 128 * 0x1.0p-33 << ")");
}

}  // TEST_SUITE
