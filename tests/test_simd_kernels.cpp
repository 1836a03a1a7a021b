// minikv-test: white-box. The CPU backend's vector kernels (src/cpu/simd_kernels.h) give
// the same bits on every SIMD target this machine supports (the scalar fallback included),
// and those bits are the documented order of operations, written here as plain loops:
// SEQUENTIAL sums, CANONICAL16 sums, products fused with std::fma. The conversions match
// src/dtype.h on every 16-bit pattern and on special floats; exp stays within 3 ulp of
// std::exp.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cpu/simd_kernels.h"
#include "dtype.h"
#include "reference/quant_ref.hpp"
#include "splitmix64.hpp"

namespace {

using minikv::cpu::simd_force_target;
using minikv::cpu::simd_targets;

struct Data : testdata::SplitMix64 {
  using SplitMix64::SplitMix64;
  float uniform(float lo, float hi) { return lo + (hi - lo) * float((next() >> 40) * 0x1.0p-24); }
  std::vector<float> floats(size_t n, float lo = -2.0f, float hi = 2.0f) {
    std::vector<float> x(n);
    for (float &v : x) v = uniform(lo, hi);
    return x;
  }
  std::vector<uint32_t> words(size_t n) {
    std::vector<uint32_t> w(n);
    for (uint32_t &v : w) v = static_cast<uint32_t>(next());
    return w;
  }
};

bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Runs `fn` on every supported target; each result must equal `want` bit for bit.
void on_every_target(const std::vector<float> &want, const std::function<std::vector<float>()> &fn) {
  REQUIRE(!simd_targets().empty());
  for (const auto &[target, name] : simd_targets()) {
    simd_force_target(target);
    CAPTURE(std::string(name));
    CHECK(std::string(minikv::cpu::simd_target_name()) == name);
    const std::vector<float> got = fn();
    size_t first = got.size();
    for (size_t i = 0; i < got.size() && i < want.size(); ++i)
      if (std::memcmp(&got[i], &want[i], 4) != 0) {
        first = i;
        break;
      }
    INFO("first difference at ", first, ": got ", first < got.size() ? got[first] : 0.0f,
         " want ", first < want.size() ? want[first] : 0.0f);
    CHECK(same_bits(got, want));
  }
  simd_force_target(0);
}

// CANONICAL16 of the products a(i) * b(i), each fused into its partial sum.
float canonical16(const std::function<float(uint32_t)> &a, const std::function<float(uint32_t)> &b,
                  uint32_t n) {
  float s[16] = {};
  for (uint32_t i = 0; i < n; ++i) s[i % 16] = std::fma(a(i), b(i), s[i % 16]);
  for (uint32_t w = 8; w >= 1; w /= 2)
    for (uint32_t l = 0; l < w; ++l) s[l] = s[l] + s[l + w];
  return s[0];
}

uint32_t code_of(const uint32_t *row, uint32_t c, uint32_t bits) {
  const uint32_t per = 32 / bits;
  return (row[c / per] >> ((c % per) * bits)) & ((1u << bits) - 1u);
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("simd kernels: targets are listed and the best one is in use") {
  const auto targets = simd_targets();
  REQUIRE(!targets.empty());
  MESSAGE("SIMD targets on this machine: ", [&] {
    std::string s;
    for (const auto &t : targets) s += std::string(t.second) + " ";
    return s;
  }());
  simd_force_target(0);
  CHECK(std::string(minikv::cpu::simd_target_name()) == targets.front().second);
}

TEST_CASE("simd kernels: 16-bit conversions equal the scalar ones on every pattern") {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> want_h(65536), want_b(65536);
  for (uint32_t i = 0; i < 65536; ++i) {
    want_h[i] = minikv::half_bits_to_float(all[i]);
    want_b[i] = minikv::bf16_bits_to_float(all[i]);
  }
  // Floats: every half and bf16 value, their midpoints (ties), random bits, specials; an
  // odd count so that the tail path runs.
  Data rng(7);
  std::vector<float> xs;
  for (uint32_t i = 0; i < 65536; ++i) {
    xs.push_back(want_h[i]);
    xs.push_back(want_b[i]);
    const uint32_t mid = minikv::float_to_bits(want_h[i]) + (1u << 12);
    xs.push_back(minikv::bits_to_float(mid));
    xs.push_back(minikv::bits_to_float(static_cast<uint32_t>(rng.next())));
  }
  for (float f : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 65504.0f, 65520.0f, 65519.99f, 6e-8f, 3e-8f,
                  2.9802322e-8f, 1e-45f, 3.4e38f})
    xs.push_back(f);
  std::vector<float> want_f16(xs.size()), want_bf16(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    want_f16[i] = float(minikv::float_to_half_bits(xs[i]));
    want_bf16[i] = float(minikv::float_to_bf16_bits(xs[i]));
  }
  on_every_target(want_h, [&] {
    std::vector<float> out(65536);
    minikv::cpu::f16_to_float(all.data(), out.data(), all.size());
    return out;
  });
  on_every_target(want_b, [&] {
    std::vector<float> out(65536);
    minikv::cpu::bf16_to_float(all.data(), out.data(), all.size());
    return out;
  });
  on_every_target(want_f16, [&] {
    std::vector<uint16_t> h(xs.size());
    minikv::cpu::float_to_f16(xs.data(), h.data(), xs.size());
    return std::vector<float>(h.begin(), h.end());
  });
  on_every_target(want_bf16, [&] {
    std::vector<uint16_t> h(xs.size());
    minikv::cpu::float_to_bf16(xs.data(), h.data(), xs.size());
    return std::vector<float>(h.begin(), h.end());
  });
}

TEST_CASE("simd kernels: key logits from packed codes are SEQUENTIAL over channels") {
  Data rng(11);
  for (uint32_t bits : {2u, 4u, 8u}) {
    for (uint32_t n_rep : {1u, 3u, 4u, 7u}) {
      for (uint32_t G : {16u, 32u}) {
        for (uint32_t d : {48u, 64u}) {  // 48: rows of 3 or 6 words, gathered, not transposed
          const uint32_t n = 3 * G, words = d * bits / 32;
          CAPTURE(d);
          CAPTURE(bits);
          CAPTURE(n_rep);
          CAPTURE(G);
          const std::vector<float> qs = rng.floats(size_t(n / G) * n_rep * d);
          const std::vector<float> bias = rng.floats(size_t(n / G) * n_rep);
          const std::vector<uint32_t> codes = rng.words(size_t(n) * (words + 1));  // stride words + 1
          const float scale = 0.125f;
          const uint64_t ld = n + 5;
          std::vector<float> want(n_rep * ld, -1.0f);
          for (uint32_t r = 0; r < n_rep; ++r)
            for (uint32_t t = 0; t < n; ++t) {
              const uint32_t g = t / G;
              float acc = 0.0f;
              for (uint32_t c = 0; c < d; ++c)
                acc = std::fma(qs[(size_t(g) * n_rep + r) * d + c],
                               float(code_of(codes.data() + size_t(t) * (words + 1), c, bits)), acc);
              want[r * ld + t] = (acc + bias[size_t(r) * (n / G) + g]) * scale;
            }
          on_every_target(want, [&] {
            std::vector<float> got(n_rep * ld, -1.0f);
            minikv::cpu::key_logits_codes(qs.data(), bias.data(), n_rep, d, codes.data(), words + 1, bits,
                                          G, n, scale, got.data(), ld);
            return got;
          });
        }
      }
    }
  }
}

TEST_CASE("simd kernels: dot products of float rows are CANONICAL16") {
  Data rng(13);
  for (uint32_t n_rep : {1u, 4u, 6u}) {
    for (uint32_t d : {16u, 48u, 128u}) {
      const uint32_t n = 19, stride = d + 3;
      const std::vector<float> q = rng.floats(size_t(n_rep) * d), rows = rng.floats(size_t(n) * stride);
      const uint64_t ld = 23;
      std::vector<float> want(n_rep * ld, -1.0f);
      for (uint32_t r = 0; r < n_rep; ++r)
        for (uint32_t t = 0; t < n; ++t)
          want[r * ld + t] = canonical16([&](uint32_t c) { return q[r * d + c]; },
                                         [&](uint32_t c) { return rows[t * stride + c]; }, d) * 0.5f;
      on_every_target(want, [&] {
        std::vector<float> got(n_rep * ld, -1.0f);
        minikv::cpu::dot_rows(q.data(), n_rep, d, rows.data(), stride, n, 0.5f, got.data(), ld);
        return got;
      });
    }
  }
}

TEST_CASE("simd kernels: value accumulation is SEQUENTIAL over tokens") {
  Data rng(17);
  // Dequantized values are clamped to [-limit, limit]: most of them exceed 1.25; with 100
  // only the group whose scale is 200 does (the kernel clamps only where some may exceed).
  for (float limit : {1.25f, 100.0f, 3.4e38f})
  for (uint32_t bits : {2u, 4u, 8u, 32u}) {  // 32: float rows
    for (uint32_t n_rep : {1u, 2u, 4u, 5u}) {
      const uint32_t d = 128, G = 32, n = 37, groups = d / G;
      const uint32_t words = bits == 32 ? d : d * bits / 32;
      CAPTURE(limit);
      CAPTURE(bits);
      CAPTURE(n_rep);
      const uint64_t ldp = 40;
      const std::vector<float> p = rng.floats(n_rep * ldp, 0.0f, 1.0f);
      std::vector<float> scale = rng.floats(size_t(n) * groups, 0.0f, 0.5f), minimum = rng.floats(size_t(n) * groups);
      scale[size_t(n / 2) * groups + 1] = 200.0f;
      const std::vector<uint32_t> codes = rng.words(size_t(n) * words);
      const std::vector<float> rows = rng.floats(size_t(n) * d);
      const std::vector<float> acc0 = rng.floats(size_t(n_rep) * d);
      std::vector<float> want = acc0;
      for (uint32_t r = 0; r < n_rep; ++r)
        for (uint32_t c = 0; c < d; ++c)
          for (uint32_t t = 0; t < n; ++t) {
            const float v = bits == 32 ? rows[t * d + c]
                                       : std::min(std::max(ref::dequant(code_of(codes.data() + size_t(t) * words, c, bits),
                                                                        minimum[t * groups + c / G],
                                                                        scale[t * groups + c / G]),
                                                           -limit),
                                                  limit);
            want[r * d + c] = std::fma(p[r * ldp + t], v, want[r * d + c]);
          }
      on_every_target(want, [&] {
        std::vector<float> got = acc0;
        if (bits == 32)
          minikv::cpu::value_accumulate_rows(p.data(), n_rep, ldp, n, rows.data(), d, d, got.data());
        else
          minikv::cpu::value_accumulate_codes(p.data(), n_rep, ldp, n, codes.data(), words, bits,
                                              scale.data(), minimum.data(), G, d, limit, got.data());
        return got;
      });
    }
  }
}

TEST_CASE("simd kernels: the running softmax is the same on every target and close to std::exp") {
  Data rng(19);
  for (uint32_t n : {1u, 15u, 16u, 33u, 128u}) {
    const uint32_t n_rep = 3;
    const uint64_t ld = 128 + 16;
    const std::vector<float> x0 = rng.floats(n_rep * ld, -30.0f, 10.0f);
    std::vector<float> m0 = {-INFINITY, 2.0f, 40.0f}, l0 = {0.0f, 3.0f, 0.5f};
    std::vector<float> reference;
    bool have_reference = false;
    for (const auto &[target, name] : simd_targets()) {
      simd_force_target(target);
      CAPTURE(std::string(name));
      std::vector<float> x = x0, m = m0, l = l0, corr(n_rep);
      minikv::cpu::softmax_update(x.data(), n_rep, ld, n, m.data(), l.data(), corr.data());
      std::vector<float> all = x;
      all.insert(all.end(), m.begin(), m.end());
      all.insert(all.end(), l.begin(), l.end());
      all.insert(all.end(), corr.begin(), corr.end());
      if (!have_reference) {
        reference = all;
        have_reference = true;
        for (uint32_t r = 0; r < n_rep; ++r) {
          float mx = m0[r];
          for (uint32_t t = 0; t < n; ++t) mx = std::max(mx, x0[r * ld + t]);
          CHECK(m[r] == mx);
          CHECK(corr[r] == doctest::Approx(std::exp(double(m0[r]) - mx)).epsilon(4e-7));
          double sum = 0.0;
          for (uint32_t t = 0; t < n; ++t) {
            const double e = std::exp(double(x0[r * ld + t] - mx));  // the float difference
            sum += e;
            CHECK(std::fabs(x[r * ld + t] - e) <= 3.0 * 0x1.0p-24 * e + 1e-38);
          }
          CHECK(l[r] == doctest::Approx(l0[r] * std::exp(double(m0[r]) - mx) + sum).epsilon(1e-6));
        }
      } else {
        size_t first = 0;
        while (first < all.size() && std::memcmp(&all[first], &reference[first], 4) == 0) ++first;
        INFO("first difference at ", first, " of ", all.size(), ": ",
             first < all.size() ? all[first] : 0.0f, " vs ", first < all.size() ? reference[first] : 0.0f);
        CHECK(same_bits(all, reference));
      }
    }
    simd_force_target(0);
  }
}

}  // TEST_SUITE
