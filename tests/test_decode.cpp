// minikv_append + minikv_decode against float64 oracles (tests/cache_model.hpp):
//  * differential: bits = 16 with a keep-everything budget reproduces exact attention over
//    prompt + generated tokens at every step, across several flushes, in both score modes;
//    decode after an append equals the last row of a prefill one token longer;
//  * quantized caches: decode equals the oracle computed on the reference-dequantized cache
//    (the same kept tokens, codes and scales) to float32 tolerance, at every step;
//  * a derived bound of the 2/4/8-bit error with respect to the exact (unquantized) kept
//    tokens, documented at the test.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cache_model.hpp"
#include "support.hpp"

namespace {

struct Run {
  minikv_dtype dt = MINIKV_DTYPE_F32;
  uint32_t H = 4, Hkv = 2, D = 64;
  std::vector<uint32_t> lens = {37, 20};
  uint32_t steps = 70;
  uint32_t key_bits = 16, value_bits = 16, G = 16, R = 16;
  uint32_t F = 0;  // flush_tokens (0: the whole residual)
  float heavy = 1.0f, recent = 0.25f;
  uint32_t sinks = 0;  // sink_tokens
  minikv_score_mode mode = MINIKV_SCORE_CUMULATIVE;
  bool dequantized_oracle = false;  // false: exact attention over the kept tokens
  double q_scale = 1.5;             // q ~ N(0, q_scale^2)
  double atol = 0.0, rtol = 0.0;    // 0: the dtype's (atol_for, rtol_for)
};

std::string describe(const Run &r) {
  std::string lens;
  for (uint32_t l : r.lens) lens += std::to_string(l) + " ";
  return std::string(ref::dtype_label(r.dt)) + " H=" + std::to_string(r.H) + " Hkv=" +
         std::to_string(r.Hkv) + " D=" + std::to_string(r.D) + " bits=" +
         std::to_string(r.key_bits) + "/" + std::to_string(r.value_bits) + " G=" +
         std::to_string(r.G) + " R=" + std::to_string(r.R) + " F=" + std::to_string(r.F) +
         " S=" + std::to_string(r.sinks) +
         " h=" + std::to_string(r.heavy) +
         " lens=" + lens + (r.mode == MINIKV_SCORE_WINDOW ? "WINDOW" : "CUMULATIVE");
}

// Float32 accumulation plus one rounding of the output to the dtype.
double atol_for(minikv_dtype dt) { return dt == MINIKV_DTYPE_F32 ? 2e-5 : 3e-5; }
double rtol_for(minikv_dtype dt) {
  return dt == MINIKV_DTYPE_F32 ? 2e-5 : 3.0 * ref::dtype_eps(dt);
}

minikv_config config_of(const Run &r) {
  minikv_config c = test::cpu_config(1, r.H, r.Hkv, r.D, r.dt);
  c.max_sequences = static_cast<uint32_t>(r.lens.size());
  c.max_seq_len = *std::max_element(r.lens.begin(), r.lens.end()) + r.steps;
  c.key_bits = r.key_bits;
  c.value_bits = r.value_bits;
  c.group_size = r.G;
  c.residual_length = r.R;
  c.flush_tokens = r.F;
  c.heavy_ratio = r.heavy;
  c.recent_ratio = r.recent;
  c.score_mode = r.mode;
  c.sink_tokens = r.sinks;
  return c;
}

// Prefills r.lens as one batch, then `steps` rounds of append + decode for every
// sequence, comparing each decode with the oracle. Returns the largest error seen.
double drive(const Run &r, uint64_t seed) {
  INFO(describe(r));
  test::Rng rng(seed);
  const uint32_t n = static_cast<uint32_t>(r.lens.size());
  const uint32_t H = r.H, Hkv = r.Hkv, D = r.D;
  test::CachePtr cache = test::make_cache(config_of(r));
  const std::vector<int32_t> cu = test::cu_from_lengths(r.lens);
  const size_t total = static_cast<size_t>(cu.back());
  test::Buf q(r.dt, total * H * D), k(r.dt, total * Hkv * D), v(r.dt, total * Hkv * D),
      out(r.dt, total * H * D);
  q.fill_normal(rng, r.q_scale);
  k.fill_normal(rng);
  v.fill_normal(rng);
  std::vector<uint32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i) ids[i] = i;
  MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, n, ids.data(), cu.data(), q.data(), k.data(),
                                v.data(), out.data(), nullptr));
  std::vector<test::SeqModel> model;
  for (uint32_t i = 0; i < n; ++i) {
    model.emplace_back(Hkv, D, r.G, r.R, r.sinks, r.F);
    std::vector<std::vector<int32_t>> kept(Hkv);
    for (uint32_t h = 0; h < Hkv; ++h) kept[h] = test::kept_positions(cache.get(), i, 0, h);
    model[i].prefill(kept, k, v, static_cast<size_t>(cu[i]));
    if (r.heavy >= 1.0f) CHECK(model[i].n == r.lens[i]);  // keep-everything budget
  }
  double worst = 0.0;
  test::Buf k_step(r.dt, size_t(n) * Hkv * D), v_step(r.dt, size_t(n) * Hkv * D),
      q_step(r.dt, size_t(n) * H * D), o_step(r.dt, size_t(n) * H * D);
  for (uint32_t step = 0; step < r.steps; ++step) {
    CAPTURE(step);
    k_step.fill_normal(rng);
    v_step.fill_normal(rng);
    q_step.fill_normal(rng, r.q_scale);
    MKV_REQUIRE_OK(minikv_append(cache.get(), 0, n, ids.data(), k_step.data(), v_step.data(),
                                 nullptr));
    o_step.fill(std::nan(""));
    MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, n, ids.data(), q_step.data(), o_step.data(),
                                 nullptr));
    for (uint32_t i = 0; i < n; ++i) {
      CAPTURE(i);
      model[i].append(k_step, v_step, i);
      uint64_t seen = 0, cached = 0;
      MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), i, 0, &seen, &cached));
      CHECK(seen == r.lens[i] + step + 1);
      CHECK(cached == model[i].n);
      const std::vector<double> want =
          model[i].decode(test::rows(q_step, i, 1, size_t(H) * D), H, r.dequantized_oracle,
                          r.key_bits, r.value_bits, r.dt);
      const std::vector<double> got = test::rows(o_step, i, 1, size_t(H) * D);
      MKV_CHECK_CLOSE(got, want, r.atol > 0 ? r.atol : atol_for(r.dt),
                      r.rtol > 0 ? r.rtol : rtol_for(r.dt));
      for (size_t e = 0; e < got.size(); ++e) worst = std::max(worst, std::fabs(got[e] - want[e]));
    }
  }
  return worst;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("decode: bits = 16 with keep-everything is exact attention at every step") {
  for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
    for (uint32_t R : {16u, 32u}) {
      for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
        Run r;
        r.dt = dt;
        r.mode = mode;
        r.R = R;
        r.steps = 3 * R + 5;  // several flushes, and a partial residual at the end
        drive(r, 1000 + R + mode * 7 + dt);
      }
    }
  }
}

TEST_CASE("decode: bits = 16 keep-everything with GQA groups and head_dim 128") {
  for (uint32_t Hkv : {8u, 4u, 1u}) {
    Run r;
    r.H = 8;
    r.Hkv = Hkv;
    r.D = 128;
    r.G = 32;
    r.R = 32;
    r.lens = {1, 50, 16};
    r.steps = 40;
    drive(r, 2000 + Hkv);
  }
}

TEST_CASE("decode: after an append equals the last row of a prefill one token longer") {
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16}) {
    for (uint32_t L : {1u, 16u, 33u, 200u}) {
      CAPTURE(L);
      const uint32_t H = 4, Hkv = 2, D = 64;
      Run r;
      r.dt = dt;
      r.lens = {L + 1};
      r.steps = 1;
      minikv_config c = config_of(r);
      c.max_sequences = 1;
      test::CachePtr shorter = test::make_cache(c), longer = test::make_cache(c);
      test::Rng rng(3000 + L);
      test::Buf q(dt, size_t(L + 1) * H * D), k(dt, size_t(L + 1) * Hkv * D),
          v(dt, size_t(L + 1) * Hkv * D), out(dt, size_t(L + 1) * H * D), o1(dt, size_t(H) * D);
      q.fill_normal(rng, 1.5);
      k.fill_normal(rng);
      v.fill_normal(rng);
      const uint32_t seq = 0;
      const int32_t cu_long[2] = {0, static_cast<int32_t>(L + 1)};
      const int32_t cu_short[2] = {0, static_cast<int32_t>(L)};
      MKV_REQUIRE_OK(minikv_prefill(longer.get(), 0, 1, &seq, cu_long, q.data(), k.data(),
                                    v.data(), out.data(), nullptr));
      MKV_REQUIRE_OK(minikv_prefill(shorter.get(), 0, 1, &seq, cu_short, q.data(), k.data(),
                                    v.data(), out.data(), nullptr));
      MKV_REQUIRE_OK(minikv_append(shorter.get(), 0, 1, &seq, k.row(size_t(L) * Hkv * D),
                                   v.row(size_t(L) * Hkv * D), nullptr));
      MKV_REQUIRE_OK(minikv_decode(shorter.get(), 0, 1, &seq, q.row(size_t(L) * H * D),
                                   o1.data(), nullptr));
      const std::vector<double> last = test::rows(out, L, 1, size_t(H) * D);
      MKV_CHECK_CLOSE(o1.doubles(), last, atol_for(dt), rtol_for(dt));
    }
  }
}

TEST_CASE("decode: quantized cache equals the oracle on the dequantized cache") {
  struct Bits {
    uint32_t k, v;
  };
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
    for (Bits b : {Bits{2, 2}, Bits{4, 4}, Bits{2, 16}, Bits{16, 4}, Bits{8, 8}, Bits{8, 2}}) {
      for (uint32_t G : {16u, 32u}) {
        Run r;
        r.dt = dt;
        r.key_bits = b.k;
        r.value_bits = b.v;
        r.G = G;
        r.R = 2 * G;
        r.heavy = 0.25f;
        r.lens = {100, 61, 16, 5};
        r.steps = 2 * r.R + 3;
        r.dequantized_oracle = true;
        drive(r, 4000 + dt * 100 + b.k * 10 + b.v + G);
      }
    }
  }
}

TEST_CASE("decode: sliding flushes keep the newest R - F tokens 16-bit at every step") {
  // flush_tokens F < R: each flush quantizes the residual's oldest F tokens and the rest move
  // to the slot's front. Exact attention with bits = 16 (the moved rows keep their values and
  // order), and the dequantized oracle with 2/4/8 bits: F dividing R and not, F = G, F = R - G,
  // sinks, every dtype, past several flushes; F rounded up to whole groups (24 -> 32 at G = 16,
  // 1 -> 32 at G = 32) and capped at R (200 -> 64: the whole residual).
  struct Geo {
    uint32_t kb, vb, G, R, F, sinks;
  };
  for (const Geo geo : {Geo{16, 16, 16, 64, 16, 0}, Geo{4, 2, 32, 128, 32, 4}, Geo{4, 2, 32, 64, 32, 4},
                        Geo{2, 2, 16, 80, 48, 0}, Geo{8, 4, 16, 48, 32, 3}, Geo{2, 16, 16, 32, 16, 0},
                        Geo{4, 2, 16, 64, 24, 0}, Geo{4, 4, 32, 96, 1, 4}, Geo{2, 2, 16, 64, 200, 0}}) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
      Run r;
      r.dt = dt;
      r.key_bits = geo.kb;
      r.value_bits = geo.vb;
      r.G = geo.G;
      r.R = geo.R;
      r.F = geo.F;
      r.sinks = geo.sinks;
      r.heavy = geo.kb == 16 ? 1.0f : 0.25f;
      r.lens = {100, 61, 5};
      r.steps = geo.R + 3 * std::min(geo.F + geo.G, geo.R) + 2;
      r.dequantized_oracle = geo.kb != 16;
      drive(r, 4100 + geo.R + geo.F + dt);
    }
  }
}

TEST_CASE("decode: sinks with bits = 16 keep-everything is exact attention") {
  // More sinks than residual rows (S = 40 > R = 16: the sink segment spans several
  // chunks), prompts shorter than S (all sinks, nothing quantized or residual), every dtype.
  for (uint32_t sinks : {1u, 4u, 40u}) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
      Run r;
      r.dt = dt;
      r.sinks = sinks;
      r.lens = {3, 37, 90};
      r.steps = 3 * r.R + 5;
      drive(r, 4200 + sinks + dt);
    }
  }
}

TEST_CASE("decode: quantized cache with sinks equals the oracle on the dequantized cache") {
  struct Bits {
    uint32_t k, v;
  };
  for (uint32_t sinks : {4u, 64u}) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
      for (Bits b : {Bits{2, 2}, Bits{4, 2}, Bits{16, 4}, Bits{8, 4}}) {
        Run r;
        r.dt = dt;
        r.key_bits = b.k;
        r.value_bits = b.v;
        r.G = 32;
        r.R = 64;
        r.sinks = sinks;
        r.heavy = 0.25f;
        r.lens = {300, 61, 5, 64};
        r.steps = r.R + 3;
        r.dequantized_oracle = true;
        drive(r, 4300 + sinks + dt * 10 + b.k + b.v);
      }
    }
  }
}

TEST_CASE("decode: long sequences decode in parts that equal the float64 oracles") {
  // A sequence of 1024 or more quantized tokens decodes in up to 4 parts of whole blocks
  // (src/cpu/cpu_backend.cpp), merged in order: beside short sequences of one part, with
  // sinks, with blocks of R = 192 tokens, unquantized and 2/4-bit.
  struct Case {
    uint32_t kb, vb, G, R, sinks;
    float heavy;
    std::vector<uint32_t> lens;
  };
  for (const Case &cs : {Case{16, 16, 16, 128, 0, 1.0f, {1300, 40}},
                         Case{2, 2, 16, 128, 0, 0.25f, {4200, 100, 2100}},
                         Case{4, 2, 32, 192, 4, 0.25f, {3000, 1100}}}) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16}) {
      Run r;
      r.dt = dt;
      r.key_bits = cs.kb;
      r.value_bits = cs.vb;
      r.G = cs.G;
      r.R = cs.R;
      r.sinks = cs.sinks;
      r.heavy = cs.heavy;
      r.lens = cs.lens;
      r.steps = 5;
      r.dequantized_oracle = cs.kb != 16;
      drive(r, 4500 + cs.kb + cs.R + dt);
    }
  }
}

TEST_CASE("decode: quantized with group sizes 64/128 and head_dim 128/256") {
  struct Geo {
    uint32_t D, G, R;
  };
  for (const Geo geo : {Geo{128, 64, 64}, Geo{128, 128, 128}, Geo{256, 128, 128}, Geo{256, 16, 48}}) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16}) {
      Run r;
      r.dt = dt;
      r.H = 4;
      r.Hkv = 1;
      r.D = geo.D;
      r.G = geo.G;
      r.R = geo.R;
      r.key_bits = 2;
      r.value_bits = 4;
      r.heavy = 0.25f;
      r.lens = {300, 77, 3};
      r.steps = geo.R + 9;
      r.dequantized_oracle = true;
      drive(r, 4500 + geo.D + geo.G + dt);
    }
  }
}

TEST_CASE("decode: blocks of R tokens that 128 does not divide (R = 160 or 192 or 320)") {
  // The decode walks quantized tokens in tiles of <= 128 that must end at a block's end: a
  // tile that ran from row 128 of a 192-row block read past it (the CUDA fuzz found it).
  struct Geo {
    uint32_t G, R;
    uint32_t sinks;
  };
  for (const Geo geo : {Geo{64, 192, 17}, Geo{32, 160, 0}, Geo{64, 320, 4}, Geo{16, 48, 0}}) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16}) {
      Run r;
      r.dt = dt;
      r.H = 3;
      r.Hkv = 1;
      r.D = 64;
      r.G = geo.G;
      r.R = geo.R;
      r.sinks = geo.sinks;
      r.key_bits = 4;
      r.value_bits = 2;
      r.heavy = 0.3f;
      r.recent = 0.3f;
      r.lens = {900, 300, 40};
      r.steps = geo.R + 5;
      r.dequantized_oracle = true;
      drive(r, 4600 + geo.R + dt);
    }
  }
}

TEST_CASE("decode: quantized with head_dim 80 and 96 in every bit width") {
  // Code rows of 20, 24 and 40 bytes (2- and 4-bit), value groups 16 and 32 (96 = 3 x 32),
  // against the oracle on the dequantized cache, across flushes.
  struct Geo {
    uint32_t D, G, key_bits, value_bits;
  };
  for (const Geo geo : {Geo{80, 16, 2, 2}, Geo{80, 16, 4, 8}, Geo{80, 64, 2, 16},
                        Geo{96, 16, 2, 4}, Geo{96, 32, 4, 2}, Geo{96, 32, 8, 8}}) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_BF16}) {
      Run r;
      r.dt = dt;
      r.H = 6;
      r.Hkv = 2;
      r.D = geo.D;
      r.G = geo.G;
      r.R = 2 * geo.G;
      r.key_bits = geo.key_bits;
      r.value_bits = geo.value_bits;
      r.heavy = 0.25f;
      r.sinks = geo.D == 96 ? 4 : 0;
      r.lens = {300, 77, 3};
      r.steps = r.R + 9;
      r.dequantized_oracle = true;
      drive(r, 4700 + geo.D + geo.G + geo.key_bits * 3 + geo.value_bits + dt);
    }
  }
}

TEST_CASE("decode: max_seq_len below residual_length with GQA 8 at every prompt length") {
  // Residual slots and scratch sized by max_seq_len < R: prompts of 1..8 tokens, appends up
  // to max_seq_len, exact (bits = 16) and quantized.
  for (uint32_t bits : {16u, 2u}) {
    for (uint32_t L = 1; L <= 8; ++L) {
      CAPTURE(L);
      Run r;
      r.H = 8;
      r.Hkv = 1;
      r.D = 64;
      r.G = 16;
      r.R = 128;
      r.key_bits = r.value_bits = bits;
      r.heavy = bits == 16 ? 1.0f : 0.25f;
      r.lens = {L};
      r.steps = 9 - L;  // max_seq_len = L + steps = 9
      r.dequantized_oracle = true;
      drive(r, 4600 + L + bits);
    }
  }
}

TEST_CASE("decode: quantized with WINDOW scores + PYRAMID-like small budgets + GQA 4") {
  Run r;
  r.H = 8;
  r.Hkv = 2;
  r.D = 128;
  r.key_bits = 2;
  r.value_bits = 2;
  r.G = 16;
  r.R = 64;
  r.heavy = 0.1f;
  r.recent = 0.05f;
  r.mode = MINIKV_SCORE_WINDOW;
  r.lens = {300, 45};
  r.steps = 70;
  r.dequantized_oracle = true;
  drive(r, 5000);
}

// The quantization error bound (F32 storage, so scale and min are stored exactly up to
// one float32 rounding of the scale).
//
// Per group, mn <= x <= mx and x^ = q s + mn with q = round((x - mn)/s), s = (mx - mn)/l
// (l = 2^b - 1), so |x - x^| <= s/2 = (mx - mn)/(2l) =: delta(x). Both delta's are computed
// here from the raw data (group ranges), not from the library or the reference quantizer.
//
// Keys: the logit error of cached token t is |Delta_t| <= eps_t = sum_c |q_c| delta_k(t,c)
// / sqrt(D) (quantized tokens; 0 for residual tokens, stored exactly).
// Softmax: p^_t = p_t exp(Delta_t) / Z with Z = sum_s p_s exp(Delta_s), hence
//   exp(-eps_t) / Z_hi <= p^_t / p_t <= exp(eps_t) / Z_lo,
//   Z_lo = sum_s p_s exp(-eps_s), Z_hi = sum_s p_s exp(eps_s),
// so |p^_t - p_t| <= p_t beta_t, beta_t = max(exp(eps_t)/Z_lo - 1, 1 - exp(-eps_t)/Z_hi),
// and sum_t |p^_t - p_t| <= B := sum_t p_t beta_t (p from the exact-cache oracle).
// Output, channel c: o^ - o = sum_t (p^_t - p_t)(v_tc - m_c) + sum_t p^_t (v^_tc - v_tc)
// for any m_c (sum_t (p^_t - p_t) = 0); with m_c the mid-range of v_.c over the cache,
//   |o^_c - o_c| <= B (max_t v_tc - min_t v_tc) / 2 + sum_t p^_t delta_v(t,c),
// and sum_t p^_t delta_v(t,c) <= min(max_t delta_v(t,c), sum_t p_t (1 + beta_t) delta_v(t,c)).
// Plus float32 arithmetic slack (atol_for) and 1e-6 relative on the deltas (the float32
// rounding of s and of (x - mn)/s).
//
// The bound is worst-case over the signs of the per-element errors, so at 2 bits (logit
// errors of the order of the logit spread) it is loose; with sparse queries at 4 bits it
// is also informative: below the trivial bound (max - min)/2 that any convex combination
// of the values meets. Both are checked.
TEST_CASE("decode: 2/4/8-bit error within the derived bound w.r.t. the exact kept tokens") {
  struct Regime {
    uint32_t bits;
    bool sparse_q;  // queries on 4 channels only (magnitude ~2), else dense N(0, 0.5^2)
  };
  for (const Regime rg : {Regime{2, false}, Regime{4, false}, Regime{8, false}, Regime{2, true},
                          Regime{4, true}, Regime{8, true}}) {
    const uint32_t bits = rg.bits;
    const uint32_t H = 4, Hkv = 2, D = 64, G = 16, R = 32, L = 200, steps = 40;
    CAPTURE(bits);
    CAPTURE(rg.sparse_q);
    minikv_config c = test::cpu_config(1, H, Hkv, D, MINIKV_DTYPE_F32);
    c.key_bits = c.value_bits = bits;
    c.group_size = G;
    c.residual_length = R;
    c.max_seq_len = L + steps;
    test::CachePtr cache = test::make_cache(c);
    test::Rng rng(6000 + bits);
    // LLM-like keys: per-channel offsets (a few outlier channels) plus token noise;
    // moderate query norms (logit std ~ 1).
    std::vector<double> mu(D);
    for (uint32_t ch = 0; ch < D; ++ch) mu[ch] = (ch % 16 == 3) ? 6.0 * rng.normal() : 0.5 * rng.normal();
    auto fill_k = [&](test::Buf &b, size_t rows_n) {
      for (size_t t = 0; t < rows_n; ++t)
        for (uint32_t h = 0; h < Hkv; ++h)
          for (uint32_t ch = 0; ch < D; ++ch) b.set((t * Hkv + h) * D + ch, mu[ch] + rng.normal());
    };
    auto fill_q = [&](test::Buf &b) {
      b.fill_normal(rng, 0.5);
      if (!rg.sparse_q) return;
      for (size_t i = 0; i < b.size(); ++i)
        b.set(i, i % 16 == 7 ? 2.0 * rng.normal() : 0.0);
    };
    test::Buf q(c.dtype, size_t(L) * H * D), k(c.dtype, size_t(L) * Hkv * D),
        v(c.dtype, size_t(L) * Hkv * D), out(c.dtype, size_t(L) * H * D);
    fill_q(q);
    fill_k(k, L);
    v.fill_normal(rng);
    const uint32_t seq = 0;
    const int32_t cu[2] = {0, static_cast<int32_t>(L)};
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, q.data(), k.data(), v.data(),
                                  out.data(), nullptr));
    test::SeqModel m(Hkv, D, G, R);
    std::vector<std::vector<int32_t>> kept(Hkv);
    for (uint32_t h = 0; h < Hkv; ++h) kept[h] = test::kept_positions(cache.get(), 0, 0, h);
    m.prefill(kept, k, v, 0);
    const double levels = double((1u << bits) - 1);
    double worst_ratio = 0.0, worst_err = 0.0, worst_informative = 0.0;
    test::Buf ks(c.dtype, size_t(Hkv) * D), vs(c.dtype, size_t(Hkv) * D), qs(c.dtype, size_t(H) * D),
        os(c.dtype, size_t(H) * D);
    for (uint32_t step = 0; step < steps; ++step) {
      CAPTURE(step);
      fill_k(ks, 1);
      vs.fill_normal(rng);
      fill_q(qs);
      MKV_REQUIRE_OK(minikv_append(cache.get(), 0, 1, &seq, ks.data(), vs.data(), nullptr));
      MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, 1, &seq, qs.data(), os.data(), nullptr));
      m.append(ks, vs, 0);
      const std::vector<double> qd = qs.doubles();
      const std::vector<double> exact = m.decode(qd, H, false, 16, 16, c.dtype);
      for (uint32_t h = 0; h < H; ++h) {
        const uint32_t g = h / (H / Hkv);
        const std::vector<float> &K = m.k[g], &V = m.v[g];
        const uint32_t n = m.n;
        // delta_k(t, c): half the per-channel range over the token group of t.
        std::vector<double> eps(n, 0.0), p(n);
        for (uint32_t t0 = 0; t0 < m.quantized; t0 += G) {
          for (uint32_t ch = 0; ch < D; ++ch) {
            double lo = INFINITY, hi = -INFINITY;
            for (uint32_t t = t0; t < t0 + G; ++t) {
              lo = std::min(lo, double(K[size_t(t) * D + ch]));
              hi = std::max(hi, double(K[size_t(t) * D + ch]));
            }
            const double delta = (hi - lo) / (2.0 * levels) * (1.0 + 1e-6);
            for (uint32_t t = t0; t < t0 + G; ++t)
              eps[t] += std::fabs(qd[size_t(h) * D + ch]) * delta / std::sqrt(double(D));
          }
        }
        // Exact softmax over the cache.
        double mx = -INFINITY;
        for (uint32_t t = 0; t < n; ++t) {
          double s = 0.0;
          for (uint32_t ch = 0; ch < D; ++ch) s += qd[size_t(h) * D + ch] * K[size_t(t) * D + ch];
          p[t] = s / std::sqrt(double(D));
          mx = std::max(mx, p[t]);
        }
        double sum = 0.0;
        for (uint32_t t = 0; t < n; ++t) sum += (p[t] = std::exp(p[t] - mx));
        double z_lo = 0.0, z_hi = 0.0;
        for (uint32_t t = 0; t < n; ++t) {
          p[t] /= sum;
          z_lo += p[t] * std::exp(-eps[t]);
          z_hi += p[t] * std::exp(eps[t]);
        }
        double B = 0.0;
        std::vector<double> beta(n);
        for (uint32_t t = 0; t < n; ++t) {
          beta[t] = std::max(std::exp(eps[t]) / z_lo - 1.0, 1.0 - std::exp(-eps[t]) / z_hi);
          B += p[t] * beta[t];
        }
        for (uint32_t ch = 0; ch < D; ++ch) {
          double lo = INFINITY, hi = -INFINITY, dv_max = 0.0, dv_weighted = 0.0;
          for (uint32_t t = 0; t < n; ++t) {
            lo = std::min(lo, double(V[size_t(t) * D + ch]));
            hi = std::max(hi, double(V[size_t(t) * D + ch]));
          }
          for (uint32_t t = 0; t < m.quantized; ++t) {  // value groups: G channels of token t
            const uint32_t c0 = ch / G * G;
            const float *row = &V[size_t(t) * D + c0];
            const double glo = *std::min_element(row, row + G), ghi = *std::max_element(row, row + G);
            const double delta = (ghi - glo) / (2.0 * levels) * (1.0 + 1e-6);
            dv_max = std::max(dv_max, delta);
            dv_weighted += p[t] * (1.0 + beta[t]) * delta;  // >= p^_t delta
          }
          const double dv = std::min(dv_max, dv_weighted);
          const double bound = B * (hi - lo) / 2.0 + dv + atol_for(c.dtype);
          const double err = std::fabs(os.get(size_t(h) * D + ch) - exact[size_t(h) * D + ch]);
          worst_err = std::max(worst_err, err);
          worst_ratio = std::max(worst_ratio, err / bound);
          worst_informative = std::max(worst_informative, bound / ((hi - lo) / 2.0));
          if (!(err <= bound)) {
            INFO("head ", h, " channel ", ch, ": |err| ", err, " > bound ", bound, " (B = ", B, ")");
            CHECK(err <= bound);
          }
        }
      }
    }
    // The quantization really happened (error well above float32 noise) and the bound holds.
    CHECK(worst_err > (bits == 8 ? 1e-4 : 1e-3));
    if ((bits == 4 && rg.sparse_q) || bits == 8) CHECK(worst_informative < 1.0);
    MESSAGE(bits, std::string(rg.sparse_q ? "-bit (sparse q)" : "-bit"), ": max |decode - exact| = ",
            worst_err, ", at most ", worst_ratio, " of the derived bound; bound / trivial "
            "bound <= ", worst_informative);
  }
}

// The same bound where it is attained: exact keys (key_bits = 16, so eps = B = 0) and
// queries aligned with one cached key, so attention is one-hot (within e^-20) on a quantized
// token t* and the output is that token's dequantized value row. Every value group spans
// [-1, 1] (two anchor channels), so each has scale s = 2 / (2^b - 1) and the bound is
// |o^_c - o_c| <= s/2 (+ float32 slack): round-to-nearest codes. The rest of each group is
// uniform in (-1, 1), so over the channels and steps the error comes within a few percent
// of s/2, and a quantizer that rounds down (error up to s) or mis-scales exceeds it.
TEST_CASE("decode: 2/4-bit value error reaches its derived bound s/2 and stays within it") {
  for (uint32_t bits : {2u, 4u}) {
    CAPTURE(bits);
    const uint32_t H = 2, Hkv = 1, D = 64, G = 16, R = 32, L = 96, steps = 64;
    minikv_config c = test::cpu_config(1, H, Hkv, D, MINIKV_DTYPE_F32);
    c.key_bits = 16;
    c.value_bits = bits;
    c.group_size = G;
    c.residual_length = R;
    c.heavy_ratio = 1.0f;  // keep every token: all L prompt tokens quantized (L % G == 0)
    c.recent_ratio = 0.0f;
    c.max_seq_len = L + steps;
    test::CachePtr cache = test::make_cache(c);
    test::Rng rng(6100 + bits);
    auto fill_v = [&](test::Buf &b, size_t rows_n) {
      for (size_t i = 0; i < rows_n * Hkv * D; ++i) {
        const uint32_t in_group = static_cast<uint32_t>(i % G);
        b.set(i, in_group == 0 ? -1.0 : in_group == 1 ? 1.0 : 2.0 * rng.uniform() - 1.0);
      }
    };
    test::Buf q(c.dtype, size_t(L) * H * D), k(c.dtype, size_t(L) * Hkv * D),
        v(c.dtype, size_t(L) * Hkv * D), out(c.dtype, size_t(L) * H * D);
    q.fill_normal(rng);
    k.fill_normal(rng);
    fill_v(v, L);
    const uint32_t seq = 0;
    const int32_t cu[2] = {0, static_cast<int32_t>(L)};
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, q.data(), k.data(), v.data(),
                                  out.data(), nullptr));
    test::SeqModel m(Hkv, D, G, R);
    m.prefill({test::kept_positions(cache.get(), 0, 0, 0)}, k, v, 0);
    REQUIRE(m.quantized == L);
    const double s = 2.0 / double((1u << bits) - 1);
    const double bound = s / 2.0 * (1.0 + 1e-6) + atol_for(c.dtype);
    double worst = 0.0;
    test::Buf ks(c.dtype, size_t(Hkv) * D), vs(c.dtype, size_t(Hkv) * D),
        qs(c.dtype, size_t(H) * D), os(c.dtype, size_t(H) * D);
    for (uint32_t step = 0; step < steps; ++step) {
      CAPTURE(step);
      ks.fill_normal(rng);
      fill_v(vs, 1);
      MKV_REQUIRE_OK(minikv_append(cache.get(), 0, 1, &seq, ks.data(), vs.data(), nullptr));
      m.append(ks, vs, 0);
      // Head h attends to quantized token t*: q = 160 k_t* / |k_t*|, a logit of 20 |k_t*|
      // (about 160) against about 20 N(0, 1) for the others.
      for (uint32_t h = 0; h < H; ++h) {
        const uint32_t target = (step * 37 + h * 11) % m.quantized;
        const float *kt = &m.k[0][size_t(target) * D];
        double norm = 0.0;
        for (uint32_t ch = 0; ch < D; ++ch) norm += double(kt[ch]) * kt[ch];
        for (uint32_t ch = 0; ch < D; ++ch) qs.set(size_t(h) * D + ch, 160.0 * kt[ch] / std::sqrt(norm));
      }
      MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, 1, &seq, qs.data(), os.data(), nullptr));
      const std::vector<double> exact = m.decode(qs.doubles(), H, false, 16, 16, c.dtype);
      for (size_t e = 0; e < exact.size(); ++e) {
        const double err = std::fabs(os.get(e) - exact[e]);
        worst = std::max(worst, err);
        if (!(err <= bound)) {
          INFO("element ", e, ": |err| ", err, " > s/2 = ", s / 2.0);
          CHECK(err <= bound);
        }
      }
    }
    // Tight: the largest error is within 5% of the bound.
    CHECK(worst >= 0.95 * s / 2.0);
    MESSAGE(bits, "-bit values: max |decode - exact| = ", worst, " = ", worst / (s / 2.0),
            " of s/2");
  }
}

TEST_CASE("decode: large-magnitude q against the float64 oracle") {
  // q ~ N(0, 100^2): logits of several hundred, which overflow exp() unless the running
  // maximum is subtracted. float32 logits of that size carry ~1e-4 absolute error, hence the
  // tolerance of 1e-3 (plus the output rounding of F16/BF16).
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
    for (uint32_t bits : {16u, 2u}) {
      Run r;
      r.dt = dt;
      r.key_bits = r.value_bits = bits;
      r.heavy = bits == 16 ? 1.0f : 0.25f;
      r.dequantized_oracle = bits != 16;
      r.q_scale = 100.0;
      r.steps = 2 * r.R + 3;
      r.atol = 1e-3;
      r.rtol = 1e-3 + rtol_for(dt);
      drive(r, 7000 + dt * 10 + bits);
    }
  }
}

// Finite inputs at the edge of the dtype's range give finite outputs: the dequantized value
// of a group's top code can exceed the largest finite value by the scale's rounding (F16
// 65504 came back as 65520 = inf); a group spanning more than FLT_MAX had an infinite scale
// (BF16/F32: NaN for the group's tokens, or for the whole KV head through the keys); and
// decode summed values near the maximum before dividing (inf where prefill is finite).
TEST_CASE("decode: values at the edge of the dtype's range give finite outputs") {
  const uint32_t H = 1, D = 16, G = 16, L = 32;
  auto setup = [&](minikv_dtype dt, uint32_t bits) {
    minikv_config c = test::cpu_config(1, H, H, D, dt);
    c.key_bits = c.value_bits = bits;
    c.group_size = G;
    c.residual_length = G;
    c.heavy_ratio = 1.0f;  // keep everything: both groups of the prompt quantized
    c.recent_ratio = 0.0f;
    c.max_seq_len = L + 1;
    return c;
  };
  // Prefill of rows (L of them), then one appended token (row L) and its decode with q = 0
  // (uniform attention); returns the decode output and the prefill's last row.
  auto run = [&](const minikv_config &c, const std::function<double(size_t t, uint32_t ch)> &key,
                 const std::function<double(size_t t, uint32_t ch)> &value,
                 std::vector<double> &decoded, std::vector<double> &prefill_last) {
    test::CachePtr cache = test::make_cache(c);
    test::Buf q(c.dtype, size_t(L) * D), k(c.dtype, size_t(L) * D), v(c.dtype, size_t(L) * D),
        out(c.dtype, size_t(L) * D);
    q.fill(0.0);
    for (size_t t = 0; t < L; ++t)
      for (uint32_t ch = 0; ch < D; ++ch) {
        k.set(t * D + ch, key(t, ch));
        v.set(t * D + ch, value(t, ch));
      }
    const uint32_t seq = 0;
    const int32_t cu[2] = {0, static_cast<int32_t>(L)};
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, q.data(), k.data(), v.data(),
                                  out.data(), nullptr));
    prefill_last = test::rows(out, L - 1, 1, D);
    test::Buf ks(c.dtype, D), vs(c.dtype, D), qs(c.dtype, D), os(c.dtype, D);
    for (uint32_t ch = 0; ch < D; ++ch) {
      ks.set(ch, key(L, ch));
      vs.set(ch, value(L, ch));
    }
    qs.fill(0.0);
    MKV_REQUIRE_OK(minikv_append(cache.get(), 0, 1, &seq, ks.data(), vs.data(), nullptr));
    MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, 1, &seq, qs.data(), os.data(), nullptr));
    decoded = os.doubles();
  };
  std::vector<double> decoded, prefill_last;
  SUBCASE("F16 groups topped by 65504") {
    // Value groups [-65504, 65504, ..., 65504]: the scale 131008/3 rounds up to 43680 in
    // F16, so the top code dequantizes to -65504 + 3 x 43680 = 65536 (inf in F16).
    // Attention is uniform over identical rows: out = the row.
    run(setup(MINIKV_DTYPE_F16, 2), [](size_t, uint32_t ch) { return 0.125 * ch; },
        [](size_t, uint32_t ch) { return ch == 0 ? -65504.0 : 65504.0; }, decoded, prefill_last);
    for (uint32_t ch = 0; ch < D; ++ch) {
      CAPTURE(ch);
      CHECK(decoded[ch] == (ch == 0 ? -65504.0 : 65504.0));
      CHECK(prefill_last[ch] == (ch == 0 ? -65504.0 : 65504.0));
    }
  }
  SUBCASE("BF16 and F32 groups spanning more than FLT_MAX") {
    for (minikv_dtype dt : {MINIKV_DTYPE_BF16, MINIKV_DTYPE_F32}) {
      CAPTURE(dt);
      const double M = 0.99 * (dt == MINIKV_DTYPE_F32 ? 3.4028234663852886e38 : 3.3895313892515355e38);
      // Keys: every channel spans [-M, M] within each group of tokens; values: every token
      // spans [-M, M] within each group of channels; the rest in between.
      auto spread = [M](size_t t, uint32_t ch) {
        const uint32_t i = static_cast<uint32_t>((t * 7 + ch * 3) % 11);
        return M * (double(i) / 5.0 - 1.0);  // -M .. M
      };
      auto key = [&](size_t t, uint32_t ch) {
        return t % G == 0 ? -M : t % G == 1 ? M : spread(t, ch);
      };
      auto value = [&](size_t t, uint32_t ch) { return ch == 0 ? -M : ch == 1 ? M : spread(t, ch); };
      run(setup(dt, 2), key, value, decoded, prefill_last);
      // Uniform attention over the L + 1 tokens: the mean of the values, each dequantized
      // within s/2 = M/3 (2-bit, range 2M) of its value.
      for (uint32_t ch = 0; ch < D; ++ch) {
        CAPTURE(ch);
        double mean = 0.0;
        for (size_t t = 0; t <= L; ++t) mean += value(t, ch) / double(L + 1);
        REQUIRE(std::isfinite(decoded[ch]));
        CHECK(std::fabs(decoded[ch] - mean) <= M / 3.0 * 1.01);
        CHECK(std::isfinite(prefill_last[ch]));
      }
    }
  }
  SUBCASE("decode's running sum of values near the maximum") {
    for (minikv_dtype dt : {MINIKV_DTYPE_BF16, MINIKV_DTYPE_F32}) {
      CAPTURE(dt);
      const double M = dt == MINIKV_DTYPE_F32 ? 3.0e38 : 3.3e38;
      run(setup(dt, 16), [](size_t t, uint32_t ch) { return 0.01 * double((t + ch) % 5); },
          [M](size_t, uint32_t) { return M; }, decoded, prefill_last);
      test::Buf one(dt, 1);
      one.set(0, M);
      const double stored = one.get(0);  // M in the dtype
      for (uint32_t ch = 0; ch < D; ++ch) {
        CAPTURE(ch);
        CHECK(prefill_last[ch] == doctest::Approx(stored).epsilon(1e-6));
        CHECK(decoded[ch] == doctest::Approx(stored).epsilon(1e-6));
      }
    }
  }
}

TEST_CASE("decode: a sequence decoded alone or in a batch gives identical rows") {
  Run r;
  r.dt = MINIKV_DTYPE_F16;
  r.key_bits = r.value_bits = 2;
  r.heavy = 0.25f;
  r.R = 32;
  r.lens = {90, 40, 64};
  minikv_config c = config_of(r);
  test::CachePtr cache = test::make_cache(c);
  test::Rng rng(7000);
  const std::vector<int32_t> cu = test::cu_from_lengths(r.lens);
  const size_t total = 194;
  test::Buf q(r.dt, total * r.H * r.D), k(r.dt, total * r.Hkv * r.D), v(r.dt, total * r.Hkv * r.D),
      out(r.dt, total * r.H * r.D);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  const uint32_t ids[3] = {0, 1, 2};
  MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 3, ids, cu.data(), q.data(), k.data(), v.data(),
                                out.data(), nullptr));
  test::Buf qd(r.dt, size_t(3) * r.H * r.D), o_batch(r.dt, size_t(3) * r.H * r.D),
      o_one(r.dt, size_t(r.H) * r.D);
  qd.fill_normal(rng);
  MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, 3, ids, qd.data(), o_batch.data(), nullptr));
  for (uint32_t i = 0; i < 3; ++i) {
    MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, 1, &ids[i], qd.row(size_t(i) * r.H * r.D),
                                 o_one.data(), nullptr));
    CHECK(std::memcmp(o_one.data(), o_batch.row(size_t(i) * r.H * r.D), size_t(r.H) * r.D * 2) == 0);
  }
  // Reversed order in the batch: rows follow seq_ids.
  const uint32_t rev[3] = {2, 1, 0};
  test::Buf q_rev(r.dt, size_t(3) * r.H * r.D), o_rev(r.dt, size_t(3) * r.H * r.D);
  for (uint32_t i = 0; i < 3; ++i)
    std::memcpy(q_rev.row(size_t(i) * r.H * r.D), qd.row(size_t(2 - i) * r.H * r.D), size_t(r.H) * r.D * 2);
  MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, 3, rev, q_rev.data(), o_rev.data(), nullptr));
  for (uint32_t i = 0; i < 3; ++i)
    CHECK(std::memcmp(o_rev.row(size_t(i) * r.H * r.D), o_batch.row(size_t(2 - i) * r.H * r.D),
                      size_t(r.H) * r.D * 2) == 0);
}

}  // TEST_SUITE
