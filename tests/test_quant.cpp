// minikv-test: white-box (links minikv_core: src/quant.h)
// The KIVI quantizer: the shared arithmetic of src/quant.h against the reference
// (tests/reference/quant_ref.hpp), and the codes + scales the CPU backend actually writes,
// read back exactly through the public API with "probe" queries:
//  * values: keys stored 16-bit and one-hot (k_t = A e_t); the query B e_t gives token t a
//    logit A*B/sqrt(D) >= 300 above every other, so softmax is exactly one-hot in float32
//    (exp(-300) == 0) and decode returns token t's dequantized value row itself;
//  * keys: values stored 16-bit and one-hot (v_t = e_t), query sqrt(D) e_c: the output is
//    the softmax vector p_t = exp(k^_t[c]) / sum, so log p_t - log p_0 = k^_t[c] - k^_0[c].
#include <cmath>
#include <string>
#include <vector>

#include "quant.h"
#include "reference/quant_ref.hpp"
#include "support.hpp"

TEST_SUITE("cpu") {

TEST_CASE("quant: quantize_code matches the reference on random inputs") {
  test::Rng rng(3);
  for (uint32_t bits : {2u, 4u, 8u}) {
    for (int i = 0; i < 20000; ++i) {
      const float mn = static_cast<float>(rng.normal());
      const float scale = static_cast<float>(std::fabs(rng.normal()) + 1e-3);
      const float x = static_cast<float>(mn + scale * (rng.uniform() * 1.4 * ref::levels(bits) - 0.2));
      const uint32_t got = minikv::quantize_code(x, mn, scale, minikv::quant_levels(bits));
      const uint32_t want = ref::code_of(x, mn, scale, bits);
      if (got != want) {
        CAPTURE(bits);
        CAPTURE(x);
        CAPTURE(mn);
        CAPTURE(scale);
        CHECK(got == want);
      }
    }
  }
}

TEST_CASE("quant: round half to even + clamping + the scale == 0 rule") {
  const uint32_t l2 = minikv::quant_levels(2), l4 = minikv::quant_levels(4);
  CHECK(l2 == 3);
  CHECK(l4 == 15);
  // (x - 0) / 1 exactly at .5: ties to even.
  CHECK(minikv::quantize_code(0.5f, 0.0f, 1.0f, l2) == 0);
  CHECK(minikv::quantize_code(1.5f, 0.0f, 1.0f, l2) == 2);
  CHECK(minikv::quantize_code(2.5f, 0.0f, 1.0f, l2) == 2);
  CHECK(minikv::quantize_code(2.5000002f, 0.0f, 1.0f, l2) == 3);
  CHECK(minikv::quantize_code(0.49999997f, 0.0f, 1.0f, l2) == 0);
  CHECK(minikv::quantize_code(0.50000006f, 0.0f, 1.0f, l2) == 1);
  CHECK(minikv::quantize_code(13.5f, 0.0f, 1.0f, l4) == 14);
  CHECK(minikv::quantize_code(14.5f, 0.0f, 1.0f, l4) == 14);
  CHECK(minikv::quantize_code(7.5f, 0.0f, 1.0f, l4) == 8);
  // Ties with a non-trivial scale and min: (x - 1) / 0.25 = 1.5 -> 2.
  CHECK(minikv::quantize_code(1.375f, 1.0f, 0.25f, l2) == 2);
  CHECK(minikv::quantize_code(1.125f, 1.0f, 0.25f, l2) == 0);
  // Clamping to [0, levels].
  CHECK(minikv::quantize_code(-5.0f, 0.0f, 1.0f, l2) == 0);
  CHECK(minikv::quantize_code(3.6f, 0.0f, 1.0f, l2) == 3);
  CHECK(minikv::quantize_code(1e30f, 0.0f, 1.0f, l4) == 15);
  CHECK(minikv::quantize_code(-1e30f, 0.0f, 1.0f, l4) == 0);
  // scale == 0 (constant group), negative or NaN scale, NaN input: code 0.
  CHECK(minikv::quantize_code(5.0f, 5.0f, 0.0f, l2) == 0);
  CHECK(minikv::quantize_code(7.0f, 5.0f, 0.0f, l2) == 0);
  CHECK(minikv::quantize_code(7.0f, 5.0f, -1.0f, l2) == 0);
  CHECK(minikv::quantize_code(7.0f, 5.0f, std::nanf(""), l2) == 0);
  CHECK(minikv::quantize_code(std::nanf(""), 0.0f, 1.0f, l2) == 0);
  for (float x : {0.5f, 1.5f, 2.5f, 3.5f, -1.0f, 1.25f}) {
    CHECK(minikv::quantize_code(x, 0.0f, 1.0f, l2) == ref::code_of(x, 0.0f, 1.0f, 2));
  }
}

TEST_CASE("quant: dequantize_code is q * scale + min in float32") {
  test::Rng rng(5);
  for (int i = 0; i < 10000; ++i) {
    const uint32_t q = rng.below(16);
    const float s = static_cast<float>(rng.normal()), m = static_cast<float>(rng.normal());
    CHECK(minikv::dequantize_code(q, m, s) == ref::dequant(q, m, s));
  }
  CHECK(minikv::dequantize_code(0, 1.5f, 0.0f) == 1.5f);
}

TEST_CASE("quant: unpack_code reads 32/b codes per word with element 0 lowest") {
  test::Rng rng(9);
  for (uint32_t bits : {2u, 4u, 8u}) {
    const uint32_t n = 128, per_word = 32 / bits;
    std::vector<uint32_t> codes(n), words(n / per_word, 0);
    for (uint32_t i = 0; i < n; ++i) {
      codes[i] = rng.below(1u << bits);
      words[i / per_word] |= codes[i] << (bits * (i % per_word));
    }
    for (uint32_t i = 0; i < n; ++i) {
      CAPTURE(i);
      CHECK(minikv::unpack_code(words.data(), i, bits) == codes[i]);
    }
  }
  const uint32_t word = 0xE4u;  // 2-bit codes 0, 1, 2, 3 from the lowest bits
  for (uint32_t i = 0; i < 4; ++i) CHECK(minikv::unpack_code(&word, i, 2) == i);
  const uint32_t nibbles = 0x87654321u;
  for (uint32_t i = 0; i < 8; ++i) CHECK(minikv::unpack_code(&nibbles, i, 4) == i + 1);
}

TEST_CASE("quant: reference quantizer error is at most scale/2 (F32 storage)") {
  test::Rng rng(13);
  for (uint32_t bits : {2u, 4u, 8u}) {
    for (int g = 0; g < 500; ++g) {
      std::vector<float> x(16);
      for (float &v : x) v = static_cast<float>(rng.normal() * 3.0);
      const ref::QuantGroup q = ref::quantize(x.data(), 16, 1, bits, MINIKV_DTYPE_F32);
      for (int i = 0; i < 16; ++i) {
        const float xh = ref::dequant(q.codes[i], q.min, q.scale);
        CHECK(std::fabs(xh - x[i]) <= q.scale * 0.5f * (1.0f + 1e-5f) + 1e-6f);
      }
    }
  }
}

namespace {

struct ProbeSetup {
  minikv_dtype dt;
  uint32_t bits;  // of the quantized side
  uint32_t group;
};

// Cache with one head, D = 128, prompt of 48 tokens kept entirely (heavy_ratio 1), then
// `appended` tokens with R = 32 (a flush after the 32nd). Returns the token rows used.
struct ProbeCache {
  static constexpr uint32_t D = 128, L = 48, R = 32;
  test::CachePtr cache;
  test::Buf k_all, v_all;  // [L + appended][D]
  uint32_t tokens = 0;
};

ProbeCache build(const ProbeSetup &s, bool probe_values, uint32_t appended, uint64_t seed) {
  constexpr uint32_t D = ProbeCache::D, L = ProbeCache::L, R = ProbeCache::R;
  minikv_config c = test::cpu_config(1, 1, 1, D, s.dt);
  c.heavy_ratio = 1.0f;
  c.group_size = s.group;
  c.residual_length = R;
  c.max_seq_len = 256;
  c.key_bits = probe_values ? 16 : s.bits;
  c.value_bits = probe_values ? s.bits : 16;
  ProbeCache p;
  p.cache = test::make_cache(c);
  p.tokens = L + appended;
  p.k_all = test::Buf(s.dt, size_t(p.tokens) * D);
  p.v_all = test::Buf(s.dt, size_t(p.tokens) * D);
  test::Rng rng(seed);
  for (uint32_t t = 0; t < p.tokens; ++t) {
    for (uint32_t ch = 0; ch < D; ++ch) {
      double kx, vx;
      if (probe_values) {
        kx = ch == t ? 32.0 : 0.0;  // one-hot keys
        vx = rng.normal() * (ch < 16 ? 4.0 : 1.0);
        if (t % 5 == 1 && ch >= 32 && ch < 32 + s.group) vx = 0.75;  // constant group: scale 0
        if (t % 7 == 3 && ch == 70) vx = 40.0;                        // an outlier
      } else {
        kx = rng.normal() * (ch % 8 == 0 ? 2.0 : 0.7);
        if (t >= 16 && t < 32 && ch == 5) kx = -1.25;  // a constant key group (tokens 16..31)
        vx = ch == t ? 1.0 : 0.0;  // one-hot values
      }
      p.k_all.set(size_t(t) * D + ch, kx);
      p.v_all.set(size_t(t) * D + ch, vx);
    }
  }
  // Prefill the first L tokens; q is irrelevant here.
  test::Buf q(s.dt, size_t(L) * D), out(s.dt, size_t(L) * D);
  q.fill(0.0);
  const uint32_t seq = 0;
  const int32_t cu[2] = {0, static_cast<int32_t>(L)};
  MKV_REQUIRE_OK(minikv_prefill(p.cache.get(), 0, 1, &seq, cu, q.data(), p.k_all.data(),
                                p.v_all.data(), out.data(), nullptr));
  for (uint32_t t = L; t < p.tokens; ++t) {
    MKV_REQUIRE_OK(minikv_append(p.cache.get(), 0, 1, &seq, p.k_all.row(size_t(t) * D),
                                 p.v_all.row(size_t(t) * D), nullptr));
  }
  return p;
}

// Cache-order rows as floats, and how many of them are quantized (MINIKV.md §4).
void expected_rows(const ProbeCache &p, uint32_t group, std::vector<float> &k,
                   std::vector<float> &v, uint32_t &quantized) {
  constexpr uint32_t D = ProbeCache::D, L = ProbeCache::L, R = ProbeCache::R;
  k.resize(size_t(p.tokens) * D);
  v.resize(size_t(p.tokens) * D);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(p.k_all.get(i));
    v[i] = static_cast<float>(p.v_all.get(i));
  }
  quantized = L - L % group;
  uint32_t residual = L % group;
  for (uint32_t t = L; t < p.tokens; ++t) {
    if (++residual == R) {
      quantized += R;
      residual = 0;
    }
  }
}

}  // namespace

TEST_CASE("quant: value codes and scales written by the CPU backend read back exactly") {
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
    for (uint32_t bits : {2u, 4u, 8u}) {
      for (uint32_t group : {16u, 32u}) {
        for (uint32_t appended : {0u, 20u, 32u, 40u}) {
          const std::string dtype_name = ref::dtype_label(dt);
          CAPTURE(dtype_name);
          CAPTURE(bits);
          CAPTURE(group);
          CAPTURE(appended);
          constexpr uint32_t D = ProbeCache::D;
          ProbeCache p = build({dt, bits, group}, true, appended, 100 + bits + group + appended);
          std::vector<float> k, v;
          uint32_t quantized = 0;
          expected_rows(p, group, k, v, quantized);
          uint64_t cached = 0;
          MKV_REQUIRE_OK(minikv_sequence_length(p.cache.get(), 0, 0, nullptr, &cached));
          REQUIRE(cached == p.tokens);
          std::vector<double> k_hat, v_hat;
          ref::dequantize_cache(k, v, p.tokens, quantized, D, group, 16, bits, dt, k_hat, v_hat);
          test::Buf q(dt, D), out(dt, D);
          const uint32_t seq = 0;
          size_t bad = 0;
          for (uint32_t t = 0; t < p.tokens; ++t) {
            for (uint32_t ch = 0; ch < D; ++ch) q.set(ch, ch == t ? 128.0 : 0.0);
            MKV_REQUIRE_OK(minikv_decode(p.cache.get(), 0, 1, &seq, q.data(), out.data(), nullptr));
            for (uint32_t ch = 0; ch < D; ++ch) {
              const double want = ref::round_dtype(dt, v_hat[size_t(t) * D + ch]);
              const double got = out.get(ch);
              // Exact up to one rounding of the output (an FMA in the kernel may move the
              // float32 value by an ulp before it is rounded to the dtype).
              const double tol = 2.0 * ref::dtype_eps(dt) * std::fabs(want) + 1e-30;
              if (!(std::fabs(got - want) <= tol)) {
                if (bad++ < 5) {
                  INFO("token ", t, " channel ", ch, " (quantized: ", t < quantized,
                       "): got ", got, " want ", want, " exact value ", v[size_t(t) * D + ch]);
                  CHECK(got == want);
                }
              }
            }
          }
          CHECK(bad == 0);
        }
      }
    }
  }
}

TEST_CASE("quant: key codes and scales written by the CPU backend (per channel over G tokens)") {
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16}) {
    for (uint32_t bits : {2u, 4u, 8u}) {
      for (uint32_t group : {16u, 32u}) {
        for (uint32_t appended : {0u, 32u}) {
          const std::string dtype_name = ref::dtype_label(dt);
          CAPTURE(dtype_name);
          CAPTURE(bits);
          CAPTURE(group);
          CAPTURE(appended);
          constexpr uint32_t D = ProbeCache::D;
          ProbeCache p = build({dt, bits, group}, false, appended, 200 + bits + group + appended);
          std::vector<float> k, v;
          uint32_t quantized = 0;
          expected_rows(p, group, k, v, quantized);
          std::vector<double> k_hat, v_hat;
          ref::dequantize_cache(k, v, p.tokens, quantized, D, group, bits, 16, dt, k_hat, v_hat);
          test::Buf q(dt, D), out(dt, D);
          const uint32_t seq = 0;
          // Output rounding of p_t to the dtype: relative error eps, so log error ~eps;
          // float32 softmax: ~1e-6. A wrong code moves k^ by a whole step (>= 0.05 here).
          const double tol = dt == MINIKV_DTYPE_F32 ? 2e-5 : 6.0 * ref::dtype_eps(dt);
          double worst = 0.0;
          for (uint32_t ch = 0; ch < D; ch += 3) {
            for (uint32_t c = 0; c < D; ++c) q.set(c, c == ch ? std::sqrt(double(D)) : 0.0);
            MKV_REQUIRE_OK(minikv_decode(p.cache.get(), 0, 1, &seq, q.data(), out.data(), nullptr));
            double total = 0.0;
            for (uint32_t t = 0; t < p.tokens; ++t) total += out.get(t);
            CHECK(total == doctest::Approx(1.0).epsilon(dt == MINIKV_DTYPE_F32 ? 1e-5 : 2e-2));
            for (uint32_t t = 1; t < p.tokens; ++t) {
              const double got = std::log(out.get(t)) - std::log(out.get(0));
              const double want = k_hat[size_t(t) * D + ch] - k_hat[ch];
              // fp16 outputs below 2^-14 are subnormal: absolute quantum 2^-24.
              const double sub = dt == MINIKV_DTYPE_F32 ? 0.0 : std::ldexp(1.0, -25);
              const double tol_t = tol + sub / out.get(t) + sub / out.get(0);
              worst = std::max(worst, std::fabs(got - want));
              if (!(std::fabs(got - want) <= tol_t)) {
                INFO("channel ", ch, " token ", t, " (quantized: ", t < quantized, ")");
                CHECK(got == doctest::Approx(want));
              }
            }
          }
          CHECK(worst <= tol * 64);  // the loop above reports each element
        }
      }
    }
  }
}

}  // TEST_SUITE
