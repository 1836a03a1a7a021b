// minikv-test: white-box (links minikv_core: src/policy.h)
// Budget policies, selection plans, top-k selection and max-pooling, against the
// reference oracles of tests/reference/attention_ref.hpp.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <vector>

#include "policy.h"
#include "reference/attention_ref.hpp"
#include "support.hpp"

namespace {

minikv_config cfg_with(uint32_t layers, float h, float r, minikv_budget_policy p, float depth) {
  minikv_config c = test::cpu_config(layers, 4, 4, 64);
  c.heavy_ratio = h;
  c.recent_ratio = r;
  c.budget_policy = p;
  c.pyramid_depth = depth;
  return c;
}

std::vector<int32_t> run_select(const minikv::SelectionPlan &plan, const std::vector<float> &s) {
  std::vector<int32_t> kept(plan.n_keep + 1, -7);
  std::vector<uint32_t> scratch(std::max<uint32_t>(plan.candidates, 1));
  minikv::select_kept(plan, s.empty() ? nullptr : s.data(), kept.data(), scratch.data());
  CHECK(kept[plan.n_keep] == -7);  // wrote exactly n_keep entries
  kept.resize(plan.n_keep);
  return kept;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("policy: UNIFORM gives h to every layer") {
  const minikv_config c = cfg_with(5, 0.3f, 0.2f, MINIKV_BUDGET_UNIFORM, 7.0f);
  const std::vector<double> r = minikv::layer_heavy_ratios(c);
  REQUIRE(r.size() == 5);
  for (double x : r) CHECK(x == doctest::Approx(0.3).epsilon(1e-7));
}

TEST_CASE("policy: PYRAMID ratios: bottom h(2-1/d) + top h/d + linear + mean h") {
  for (uint32_t layers : {2u, 3u, 8u, 32u, 80u}) {
    for (double depth : {1.0, 2.0, 7.0, 20.0, 1.5}) {
      for (double h : {0.05, 0.125, 0.25, 0.3}) {  // the decimals the float fields carry
        CAPTURE(layers);
        CAPTURE(depth);
        CAPTURE(h);
        const minikv_config c = cfg_with(layers, static_cast<float>(h), 0.25f,
                                         MINIKV_BUDGET_PYRAMID, static_cast<float>(depth));
        const std::vector<double> r = minikv::layer_heavy_ratios(c);
        const std::vector<double> want =
            ref::layer_ratios(true, layers, h, 0.25, depth);
        REQUIRE(r.size() == layers);
        const double hd = h, dd = depth;
        CHECK(r.front() == doctest::Approx(hd * (2.0 - 1.0 / dd)).epsilon(1e-9));
        CHECK(r.back() == doctest::Approx(hd / dd).epsilon(1e-9));
        double mean = 0.0;
        for (uint32_t l = 0; l < layers; ++l) {
          CHECK(r[l] == doctest::Approx(want[l]).epsilon(1e-9));
          if (l > 0) CHECK(r[l] <= r[l - 1] + 1e-12);  // more budget in lower layers
          mean += r[l] / layers;
        }
        CHECK(mean == doctest::Approx(hd).epsilon(1e-9));
      }
    }
  }
}

TEST_CASE("policy: PYRAMID with one layer is uniform") {
  const minikv_config c = cfg_with(1, 0.25f, 0.25f, MINIKV_BUDGET_PYRAMID, 7.0f);
  const std::vector<double> r = minikv::layer_heavy_ratios(c);
  REQUIRE(r.size() == 1);
  CHECK(r[0] == doctest::Approx(0.25));
}

TEST_CASE("policy: PYRAMID is clipped so h_l + r <= 1") {
  // h = 0.6, depth 7: bottom = 0.6 * (2 - 1/7) = 1.114 > 1 - r = 0.7.
  const minikv_config c = cfg_with(4, 0.6f, 0.3f, MINIKV_BUDGET_PYRAMID, 7.0f);
  const std::vector<double> r = minikv::layer_heavy_ratios(c);
  const std::vector<double> want = ref::layer_ratios(true, 4, 0.6, 0.3, 7.0);
  for (uint32_t l = 0; l < 4; ++l) {
    CHECK(r[l] <= 1.0 - 0.3 + 1e-12);
    CHECK(r[l] == doctest::Approx(want[l]).epsilon(1e-9));
  }
  CHECK(r[0] == doctest::Approx(1.0 - 0.3));
  CHECK(r[3] == doctest::Approx(0.6 / 7.0));
  // UNIFORM is h itself (MINIKV.md: h_l = h), not clipped; its plan keeps everything.
  const minikv_config u = cfg_with(2, 0.9f, 0.3f, MINIKV_BUDGET_UNIFORM, 7.0f);
  for (double x : minikv::layer_heavy_ratios(u)) CHECK(x == doctest::Approx(0.9));
  CHECK(minikv::plan_selection(u, minikv::layer_heavy_ratios(u)[0], 37).keep_all);
}

TEST_CASE("policy: float ratios are read as the decimals they carry") {
  // 0.7f is 0.69999998807907: 0.7f * 1000 floored kept 699 tokens.
  const minikv_config c = cfg_with(1, 0.7f, 0.1f, MINIKV_BUDGET_UNIFORM, 7.0f);
  const minikv::SelectionPlan p = minikv::plan_selection(c, minikv::layer_heavy_ratios(c)[0], 1000);
  CHECK(p.n_heavy == 700);
  CHECK(p.n_keep == 800);
  CHECK(minikv::decimal_value(0.7f) == 0.7);
  CHECK(minikv::decimal_value(0.35f) == 0.35);
  CHECK(minikv::decimal_value(1.0f / 3.0f) == 0.33333334);
  CHECK(minikv::decimal_value(7.0f) == 7.0);
}

// The budget of MINIKV.md in exact integer arithmetic, for ratios given in thousandths and a
// rational PYRAMID depth: h_l = h ((2 delta - 1)(m - 1) - (2 delta - 2) l) / (delta (m - 1)),
// clipped to 1 - r (h in every layer when h + r >= 1); n_hh = floor(h_l L), n_rw = floor(r L);
// everything when h_l + r >= 1 or n_hh + n_rw >= L.
struct ExactBudget {
  uint64_t h_num, h_den, n_heavy, n_recent;
  bool keep_all;
};
ExactBudget exact_budget(bool pyramid, uint32_t layers, uint32_t layer, uint64_t h_milli,
                         uint64_t r_milli, uint64_t depth_num, uint64_t depth_den, uint64_t L) {
  ExactBudget b{h_milli, 1000, 0, 0, false};
  if (pyramid && layers > 1 && h_milli + r_milli < 1000) {
    const uint64_t m1 = layers - 1;
    b.h_num = h_milli * ((2 * depth_num - depth_den) * m1 - (2 * depth_num - 2 * depth_den) * layer);
    b.h_den = 1000 * depth_num * m1;
    if (b.h_num * 1000 > (1000 - r_milli) * b.h_den) {  // clip to 1 - r
      b.h_num = 1000 - r_milli;
      b.h_den = 1000;
    }
  }
  b.n_heavy = b.h_num * L / b.h_den;
  b.n_recent = r_milli * L / 1000;
  b.keep_all = b.h_num * 1000 + r_milli * b.h_den >= 1000 * b.h_den || b.n_heavy + b.n_recent >= L;
  return b;
}

TEST_CASE("policy: budget sweep against the exact formula (layers 3/4/8/32 and L = 1..4096)") {
  struct Recipe {
    bool pyramid;
    uint32_t h_milli, r_milli, depth_num, depth_den;
  };
  const Recipe recipes[] = {
      {false, 250, 250, 7, 1}, {false, 700, 100, 7, 1}, {false, 300, 200, 7, 1},
      {false, 100, 50, 7, 1},  {false, 330, 330, 7, 1},
      // The README's keep-everything recipes (h + r = 1) lost 1-2 tokens of some prompts.
      {false, 900, 100, 7, 1}, {false, 650, 350, 7, 1}, {false, 950, 50, 7, 1},
      {false, 350, 650, 7, 1},
      {true, 250, 250, 7, 1},  {true, 250, 250, 2, 1},  {true, 300, 100, 7, 1},
      {true, 125, 250, 3, 2},  {true, 600, 300, 7, 1},  {true, 700, 300, 7, 1},
      {true, 50, 250, 20, 1}};
  uint64_t checked = 0, mismatches = 0;
  for (const Recipe &rc : recipes) {
    for (uint32_t layers : {3u, 4u, 8u, 32u}) {
      const minikv_config c =
          cfg_with(layers, rc.h_milli / 1000.0f, rc.r_milli / 1000.0f,
                   rc.pyramid ? MINIKV_BUDGET_PYRAMID : MINIKV_BUDGET_UNIFORM,
                   static_cast<float>(double(rc.depth_num) / rc.depth_den));
      const std::vector<double> ratios = minikv::layer_heavy_ratios(c);
      for (uint32_t layer = 0; layer < layers; ++layer) {
        for (uint32_t L = 1; L <= 4096; ++L) {
          const minikv::SelectionPlan p = minikv::plan_selection(c, ratios[layer], L);
          const ExactBudget b = exact_budget(rc.pyramid, layers, layer, rc.h_milli, rc.r_milli,
                                             rc.depth_num, rc.depth_den, L);
          const bool same = p.keep_all == b.keep_all &&
                            (b.keep_all ? p.n_keep == L
                                        : p.n_heavy == b.n_heavy && p.candidates == L - b.n_recent &&
                                              p.n_keep == b.n_heavy + b.n_recent);
          ++checked;
          if (!same && mismatches++ < 8) {
            INFO("pyramid ", rc.pyramid, " h ", rc.h_milli, "/1000 r ", rc.r_milli,
                 "/1000 depth ", rc.depth_num, "/", rc.depth_den, " layers ", layers, " layer ",
                 layer, " L ", L, ": library keep_all ", p.keep_all, " n_heavy ", p.n_heavy,
                 " n_keep ", p.n_keep, "; exact keep_all ", b.keep_all, " n_heavy ", b.n_heavy,
                 " n_recent ", b.n_recent);
            CHECK(same);
          }
        }
      }
    }
  }
  CHECK(checked == uint64_t(4096) * (3 + 4 + 8 + 32) * (sizeof(recipes) / sizeof(recipes[0])));
  CHECK(mismatches == 0);
}

TEST_CASE("policy: plan_selection sizes (CUMULATIVE)") {
  minikv_config c = cfg_with(1, 0.25f, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
  for (uint32_t L : {1u, 2u, 3u, 4u, 5u, 7u, 8u, 15u, 16u, 17u, 100u, 127u, 128u, 129u, 1000u,
                     4096u, 4099u}) {
    CAPTURE(L);
    const minikv::SelectionPlan p = minikv::plan_selection(c, 0.25, L);
    const ref::Budget b = ref::budget(0.25, 0.25, L, false, 0);
    const uint32_t n_hh = L / 4, n_rw = L / 4;  // floor(0.25 L)
    CHECK(p.prompt_len == L);
    if (n_hh + n_rw >= L) {  // only L = 1 here... and never for L >= 2? floor(L/4)*2 < L
      CHECK(p.keep_all);
      CHECK(p.n_keep == L);
    } else {
      CHECK_FALSE(p.keep_all);
      CHECK(p.n_heavy == n_hh);
      CHECK(p.candidates == L - n_rw);
      CHECK(p.n_keep == n_hh + n_rw);
    }
    CHECK(p.keep_all == b.keep_all);
    CHECK(p.n_keep == (b.keep_all ? L : b.n_heavy + b.n_protected));
  }
}

TEST_CASE("policy: keep-all boundary n_hh + n_rw >= L") {
  // h + r = 1 is the whole prompt, also for odd L where floor(0.5 L) * 2 = L - 1.
  minikv_config c = cfg_with(1, 0.5f, 0.5f, MINIKV_BUDGET_UNIFORM, 7.0f);
  for (uint32_t L : {10u, 11u}) {
    const minikv::SelectionPlan p = minikv::plan_selection(c, 0.5, L);
    CHECK(p.keep_all);
    CHECK(p.n_keep == L);
  }
  // Just below the whole prompt: h = 0.49, r = 0.5, L = 100 keeps 49 + 50.
  const minikv::SelectionPlan below = minikv::plan_selection(c, 0.49, 100);
  CHECK_FALSE(below.keep_all);
  CHECK(below.n_heavy == 49);
  CHECK(below.candidates == 50);
  CHECK(below.n_keep == 99);
  // WINDOW mode: the protected window can cover the rest (10 + 32 >= 40, not 43).
  minikv_config w = cfg_with(1, 0.25f, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
  w.score_mode = MINIKV_SCORE_WINDOW;
  CHECK(minikv::plan_selection(w, 0.25, 40).keep_all);
  CHECK(minikv::plan_selection(w, 0.25, 42).keep_all);
  CHECK_FALSE(minikv::plan_selection(w, 0.25, 43).keep_all);
  CHECK(minikv::plan_selection(w, 0.25, 43).n_keep == 42);
  // heavy_ratio 1 always keeps everything.
  for (uint32_t L : {1u, 17u, 1000u}) CHECK(minikv::plan_selection(c, 1.0, L).keep_all);
  // heavy_ratio 1 with the default r = 0.25 keeps the whole prompt.
  minikv_config d = cfg_with(1, 1.0f, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
  const double h_l = minikv::layer_heavy_ratios(d)[0];
  for (uint32_t L : {5u, 37u, 1001u}) {
    CAPTURE(L);
    CHECK(minikv::plan_selection(d, h_l, L).keep_all);
    CHECK(minikv::plan_selection(d, h_l, L).n_keep == L);
    // Clipped to 0.75 (as PYRAMID does), still the whole prompt although
    // floor(0.75 L) + floor(0.25 L) = L - 1 when L % 4 != 0.
    CHECK(minikv::plan_selection(d, 0.75, L).keep_all);
  }
  // PYRAMID layers clipped to 1 - r keep everything too.
  d.budget_policy = MINIKV_BUDGET_PYRAMID;
  d.num_layers = 4;
  d.heavy_ratio = 0.7f;
  const std::vector<double> pyr = minikv::layer_heavy_ratios(d);
  CHECK(minikv::plan_selection(d, pyr.front(), 37).keep_all);
  CHECK_FALSE(minikv::plan_selection(d, pyr.back(), 37).keep_all);
  // A budget of the whole prompt keeps every PYRAMID layer whole (heavy_ratio = 1, r = 0:
  // the pyramid would otherwise give the top layer 1/7 of it).
  d.heavy_ratio = 1.0f;
  d.recent_ratio = 0.0f;
  for (double h_l : minikv::layer_heavy_ratios(d)) CHECK(minikv::plan_selection(d, h_l, 37).keep_all);
  // Nothing kept at all: h = r = 0.
  c.recent_ratio = 0.0f;
  const minikv::SelectionPlan none = minikv::plan_selection(c, 0.0, 50);
  CHECK_FALSE(none.keep_all);
  CHECK(none.n_keep == 0);
  CHECK(none.n_heavy == 0);
}

TEST_CASE("policy: WINDOW mode protects the last window_size tokens") {
  minikv_config c = cfg_with(1, 0.25f, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
  c.score_mode = MINIKV_SCORE_WINDOW;
  c.window_size = 32;
  for (uint32_t L : {1u, 16u, 32u, 33u, 63u, 64u, 65u, 100u, 127u, 128u, 129u, 1000u}) {
    CAPTURE(L);
    const minikv::SelectionPlan p = minikv::plan_selection(c, 0.25, L);
    const ref::Budget b = ref::budget(0.25, 0.25, L, true, 32);
    const uint32_t protect = std::max(L / 4, std::min(32u, L));
    CHECK(p.keep_all == (L / 4 + protect >= L));
    CHECK(p.keep_all == b.keep_all);
    CHECK(p.scored_prefix == L - std::min(32u, L));
    if (!p.keep_all) {
      CHECK(p.candidates == L - protect);
      CHECK(p.n_heavy == L / 4);
      CHECK(p.n_keep == L / 4 + protect);
      CHECK(p.candidates <= p.scored_prefix);
    }
  }
}

TEST_CASE("policy: select_kept matches the oracle on random scores") {
  test::Rng rng(7);
  minikv_config c = cfg_with(1, 0.25f, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
  for (uint32_t L : {3u, 8u, 17u, 64u, 129u, 1000u}) {
    for (int trial = 0; trial < 5; ++trial) {
      CAPTURE(L);
      const minikv::SelectionPlan p = minikv::plan_selection(c, 0.25, L);
      std::vector<float> s(L);
      std::vector<double> sd(L);
      for (uint32_t j = 0; j < L; ++j) {
        // Few distinct values at trial 0 to force many ties.
        s[j] = trial == 0 ? static_cast<float>(rng.below(4)) : static_cast<float>(rng.normal());
        sd[j] = s[j];
      }
      const std::vector<int32_t> got = run_select(p, s);
      const std::vector<int32_t> want = ref::select(sd, L, ref::budget(0.25, 0.25, L, false, 0));
      CHECK(got == want);
      CHECK(std::is_sorted(got.begin(), got.end()));
    }
  }
}

TEST_CASE("policy: sinks in plan_selection and select_kept match the oracle") {
  // Every prompt length around the thresholds, sink counts below, at and above the
  // heavy-hitter share, both score modes; scores with many ties and with the sinks scored
  // highest (they must not also be picked as heavy hitters).
  test::Rng rng(13);
  for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
    for (uint32_t sinks : {1u, 4u, 13u, 64u}) {
      for (float h : {0.0f, 0.1f, 0.25f, 0.75f}) {
        minikv_config c = cfg_with(1, h, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
        c.sink_tokens = sinks;
        c.score_mode = mode;
        c.window_size = 8;
        for (uint32_t L = 1; L <= 160; L += (L < 80 ? 1 : 7)) {
          CAPTURE(mode);
          CAPTURE(sinks);
          CAPTURE(h);
          CAPTURE(L);
          const minikv::SelectionPlan p = minikv::plan_selection(c, h, L);
          const bool window = mode == MINIKV_SCORE_WINDOW;
          const ref::Budget b = ref::budget(h, 0.25, L, window, 8, sinks);
          CHECK(p.n_sink == std::min(sinks, L));
          CHECK(p.n_sink == b.n_sink);
          CHECK(p.keep_all == b.keep_all);
          CHECK(p.n_keep == b.kept());
          if (!p.keep_all) {
            CHECK(p.n_heavy == b.n_heavy);
            CHECK(p.candidates == L - b.n_protected);
            CHECK(p.n_heavy + p.n_sink == std::max<uint32_t>(uint32_t(std::floor(h * L + 1e-7)), p.n_sink));
          }
          std::vector<float> s(L);
          std::vector<double> sd(L);
          for (uint32_t j = 0; j < L; ++j) {
            s[j] = j < sinks ? 1e6f : static_cast<float>(rng.below(5));
            sd[j] = s[j];
          }
          const std::vector<int32_t> got = run_select(p, s);
          CHECK(got == ref::select(sd, L, b));
          for (uint32_t t = 0; t < p.n_sink; ++t) CHECK(got[t] == int32_t(t));
          CHECK(std::adjacent_find(got.begin(), got.end(), std::greater_equal<int32_t>()) == got.end());
        }
      }
    }
  }
}

TEST_CASE("policy: ties go to the higher score and then the lower position") {
  minikv_config c = cfg_with(1, 0.25f, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
  // L = 12: n_hh = 3, recent = [9, 12), candidates [0, 9).
  const minikv::SelectionPlan p = minikv::plan_selection(c, 0.25, 12);
  REQUIRE(p.n_heavy == 3);
  REQUIRE(p.candidates == 9);
  const std::vector<float> s = {1, 5, 2, 5, 5, 2, 0, 5, 9, 100, 100, 100};
  // 8 (9.0) first, then the 5.0s at the lowest positions: 1, 3.
  CHECK(run_select(p, s) == std::vector<int32_t>{1, 3, 8, 9, 10, 11});
  const std::vector<float> flat(12, 0.5f);  // all equal: the first positions win
  CHECK(run_select(p, flat) == std::vector<int32_t>{0, 1, 2, 9, 10, 11});
}

TEST_CASE("policy: NaN scores rank lowest") {
  minikv_config c = cfg_with(1, 0.25f, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
  const minikv::SelectionPlan p = minikv::plan_selection(c, 0.25, 12);
  const float nan = std::nanf("");
  std::vector<float> s = {nan, nan, -1e30f, nan, -INFINITY, 3, nan, nan, 2, 0, 0, 0};
  CHECK(run_select(p, s) == std::vector<int32_t>{2, 5, 8, 9, 10, 11});
  // All NaN: deterministic, the lowest positions.
  std::vector<float> all(12, nan);
  CHECK(run_select(p, all) == std::vector<int32_t>{0, 1, 2, 9, 10, 11});
  // NaN and -inf tie with each other (both "lowest"): lower position first.
  std::vector<float> mixed = {nan, -INFINITY, nan, -INFINITY, nan, 1, nan, nan, nan, 0, 0, 0};
  CHECK(run_select(p, mixed) == std::vector<int32_t>{0, 1, 5, 9, 10, 11});
}

TEST_CASE("policy: keep-all and no-heavy selections") {
  minikv_config c = cfg_with(1, 1.0f, 0.25f, MINIKV_BUDGET_UNIFORM, 7.0f);
  const minikv::SelectionPlan all = minikv::plan_selection(c, 1.0, 9);
  std::vector<int32_t> want(9);
  std::iota(want.begin(), want.end(), 0);
  CHECK(run_select(all, {}) == want);
  c.heavy_ratio = 0.0f;
  const minikv::SelectionPlan recent = minikv::plan_selection(c, 0.0, 9);  // n_rw = 2
  CHECK(run_select(recent, std::vector<float>(9, 1.0f)) == std::vector<int32_t>{7, 8});
}

TEST_CASE("policy: max_pool_1d against brute force") {
  test::Rng rng(11);
  for (uint32_t n : {1u, 2u, 3u, 6u, 7u, 8u, 50u, 333u}) {
    for (uint32_t k : {1u, 3u, 5u, 7u, 9u, 15u, 101u}) {
      CAPTURE(n);
      CAPTURE(k);
      std::vector<float> x(n), y(n, -123.0f);
      std::vector<double> xd(n);
      for (uint32_t i = 0; i < n; ++i) xd[i] = x[i] = static_cast<float>(rng.normal());
      minikv::max_pool_1d(x.data(), y.data(), n, k);
      const std::vector<double> want = ref::max_pool(xd, k);
      for (uint32_t i = 0; i < n; ++i) CHECK(y[i] == static_cast<float>(want[i]));
    }
  }
  // A spike spreads k/2 to each side, clipped at the edges.
  std::vector<float> x(10, 0.0f), y(10);
  x[1] = 5.0f;
  minikv::max_pool_1d(x.data(), y.data(), 10, 7);
  CHECK(y == std::vector<float>{5, 5, 5, 5, 5, 0, 0, 0, 0, 0});
}

}  // TEST_SUITE
