// minikv_prefill against the float64 oracle (tests/reference/attention_ref.hpp): every
// output element for F32/F16/BF16, awkward lengths, head_dim 16-256, GQA groups 1/2/4/8,
// ragged batches; and the kept positions against the oracle's selection (CUMULATIVE and
// WINDOW scores, UNIFORM and PYRAMID budgets), on random and on structured data.
#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "reference/attention_ref.hpp"
#include "support.hpp"

namespace {

struct Shape {
  minikv_dtype dt = MINIKV_DTYPE_F32;
  uint32_t H = 4, Hkv = 2, D = 64;
  std::vector<uint32_t> lens;
  minikv_score_mode mode = MINIKV_SCORE_CUMULATIVE;
  uint32_t window = 32, pool = 7;
  float heavy = 0.25f, recent = 0.25f;
  uint32_t sinks = 0;    // sink_tokens
  double q_scale = 1.5;  // sharper than uniform attention
  double atol = 0.0, rtol = 0.0;  // 0: the dtype's (atol_for, rtol_for)
};

// Per-dtype tolerance: float32 accumulation (atol) plus one rounding of the output to the
// dtype (rtol = unit roundoff, x1.5 for slack). Inputs are the same dtype-rounded values
// for the kernel and the oracle, so nothing else differs.
double atol_for(minikv_dtype dt) { return dt == MINIKV_DTYPE_F32 ? 2e-5 : 3e-5; }
double rtol_for(minikv_dtype dt) {
  return dt == MINIKV_DTYPE_F32 ? 2e-5 : 1.5 * ref::dtype_eps(dt) * 2.0;
}

std::string describe(const Shape &s) {
  std::string lens;
  for (uint32_t l : s.lens) lens += std::to_string(l) + " ";
  return std::string(ref::dtype_label(s.dt)) + " H=" + std::to_string(s.H) + " Hkv=" +
         std::to_string(s.Hkv) + " D=" + std::to_string(s.D) + " sinks=" +
         std::to_string(s.sinks) + " lens=" + lens +
         (s.mode == MINIKV_SCORE_WINDOW ? "WINDOW" : "CUMULATIVE");
}

// Scores the oracle selects by (per KV head, [L]): cumulative, or window scores max-pooled
// over the scored prefix [0, L - min(w, L)).
std::vector<double> oracle_scores(const ref::PrefillResult &r, const Shape &s, uint32_t L,
                                  uint32_t g) {
  if (s.mode == MINIKV_SCORE_CUMULATIVE)
    return std::vector<double>(r.cumul.begin() + size_t(g) * L, r.cumul.begin() + size_t(g + 1) * L);
  const uint32_t prefix = L - std::min(s.window, L);
  std::vector<double> w(r.window.begin() + size_t(g) * L, r.window.begin() + size_t(g) * L + prefix);
  if (s.pool > 1) w = ref::max_pool(w, s.pool);
  w.resize(L, 0.0);
  return w;
}

// Kept positions must be the oracle's selection; where the oracle's scores have a near-tie
// at the selection threshold (closer than float32 score accumulation can resolve), any
// choice among the tied candidates is accepted.
void check_selection(const std::vector<int32_t> &got, const std::vector<double> &scores,
                     uint32_t L, const ref::Budget &b) {
  const std::vector<int32_t> want = ref::select(scores, L, b);
  REQUIRE(got.size() == want.size());
  CHECK(std::is_sorted(got.begin(), got.end()));
  if (got == want) return;
  const uint32_t candidates = L - b.n_protected;
  double max_score = 0.0;
  for (uint32_t j = b.n_sink; j < candidates; ++j)
    max_score = std::max(max_score, std::fabs(scores[j]));
  const double tol = 1e-5 * max_score + 1e-7;
  std::set<int32_t> kept(got.begin(), got.end());
  double min_kept = INFINITY, max_dropped = -INFINITY;
  for (uint32_t j = 0; j < L; ++j) {
    const bool k = kept.count(static_cast<int32_t>(j)) > 0;
    if (j < b.n_sink || j >= candidates) {
      CHECK_MESSAGE(k, "sink or protected position ", j, " not kept");
      continue;
    }
    if (k) min_kept = std::min(min_kept, scores[j]);
    else max_dropped = std::max(max_dropped, scores[j]);
  }
  INFO("selection differs from the oracle beyond a near-tie: lowest kept score ", min_kept,
       ", highest dropped score ", max_dropped);
  CHECK(max_dropped <= min_kept + tol);
}

struct Inputs {
  test::Buf q, k, v;
};

Inputs random_inputs(const Shape &s, uint32_t total, uint64_t seed) {
  test::Rng rng(seed);
  Inputs in{test::Buf(s.dt, size_t(total) * s.H * s.D), test::Buf(s.dt, size_t(total) * s.Hkv * s.D),
            test::Buf(s.dt, size_t(total) * s.Hkv * s.D)};
  in.q.fill_normal(rng, s.q_scale);
  in.k.fill_normal(rng);
  in.v.fill_normal(rng);
  return in;
}

// Prefills every sequence of s.lens in one call (seq_ids in reverse order, to exercise the
// mapping) and compares outputs and kept positions with the oracle.
void run_and_check(const Shape &s, const Inputs &in, bool check_kept = true) {
  INFO(describe(s));
  const uint32_t n = static_cast<uint32_t>(s.lens.size());
  const std::vector<int32_t> cu = test::cu_from_lengths(s.lens);
  const uint32_t total = static_cast<uint32_t>(cu.back());
  minikv_config c = test::cpu_config(1, s.H, s.Hkv, s.D, s.dt);
  c.max_sequences = n;
  c.max_seq_len = *std::max_element(s.lens.begin(), s.lens.end());
  c.score_mode = s.mode;
  c.window_size = s.window;
  c.pool_kernel = s.pool;
  c.heavy_ratio = s.heavy;
  c.recent_ratio = s.recent;
  c.sink_tokens = s.sinks;
  test::CachePtr cache = test::make_cache(c);
  std::vector<uint32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i) ids[i] = n - 1 - i;
  test::Buf out(s.dt, size_t(total) * s.H * s.D);
  out.fill(std::nan(""));
  MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, n, ids.data(), cu.data(), in.q.data(),
                                in.k.data(), in.v.data(), out.data(), nullptr));
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t L = s.lens[i];
    CAPTURE(L);
    const size_t t0 = static_cast<size_t>(cu[i]);
    const ref::PrefillResult r =
        ref::prefill(test::rows(in.q, t0, L, size_t(s.H) * s.D), test::rows(in.k, t0, L, size_t(s.Hkv) * s.D),
                     test::rows(in.v, t0, L, size_t(s.Hkv) * s.D), L, s.H, s.Hkv, s.D, s.window);
    const std::vector<double> got = test::rows(out, t0, L, size_t(s.H) * s.D);
    MKV_CHECK_CLOSE(got, r.out, s.atol > 0 ? s.atol : atol_for(s.dt),
                    s.rtol > 0 ? s.rtol : rtol_for(s.dt));
    if (!check_kept) continue;
    const double h_l = ref::layer_ratios(false, 1, s.heavy, s.recent, 7.0)[0];
    const ref::Budget b =
        ref::budget(h_l, s.recent, L, s.mode == MINIKV_SCORE_WINDOW, s.window, s.sinks);
    uint64_t seen = 0, cached = 0;
    MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), ids[i], 0, &seen, &cached));
    CHECK(seen == L);
    CHECK(cached == b.kept());
    if (b.keep_all) CHECK(cached == L);
    for (uint32_t g = 0; g < s.Hkv; ++g) {
      CAPTURE(g);
      const std::vector<int32_t> kept = test::kept_positions(cache.get(), ids[i], 0, g);
      check_selection(kept, oracle_scores(r, s, L, g), L, b);
    }
  }
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("prefill: ragged batch of awkward lengths in every dtype") {
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
    Shape s;
    s.dt = dt;
    s.lens = {1, 2, 15, 16, 17, 127, 128, 129};
    run_and_check(s, random_inputs(s, 435, 1 + dt));
  }
}

TEST_CASE("prefill: L = 1000 in every dtype with head_dim 128") {
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
    Shape s;
    s.dt = dt;
    s.H = 2;
    s.Hkv = 1;
    s.D = 128;
    s.lens = {1000};
    run_and_check(s, random_inputs(s, 1000, 10 + dt));
  }
}

TEST_CASE("prefill: L = 4096 in F32") {
  Shape s;
  s.H = 1;
  s.Hkv = 1;
  s.D = 64;
  s.lens = {4096};
  run_and_check(s, random_inputs(s, 4096, 20));
}

TEST_CASE("prefill: GQA groups 1/2/4/8") {
  for (uint32_t Hkv : {8u, 4u, 2u, 1u}) {
    for (uint32_t D : {64u, 128u}) {
      Shape s;
      s.dt = MINIKV_DTYPE_F16;
      s.H = 8;
      s.Hkv = Hkv;
      s.D = D;
      s.lens = {129, 40, 7};
      run_and_check(s, random_inputs(s, 176, 30 + Hkv + D));
    }
  }
}

TEST_CASE("prefill: head_dim 16 80 96 and 256") {
  // 80 and 96 (Phi, Gemma-like shapes): rows not a multiple of 64 channels.
  for (uint32_t D : {16u, 80u, 96u, 256u}) {
    Shape s;
    s.D = D;
    s.H = 2;
    s.Hkv = 1;
    s.lens = {33, 70};
    run_and_check(s, random_inputs(s, 103, 40 + D));
  }
}

TEST_CASE("prefill: WINDOW scores max-pooled with the window always kept") {
  for (uint32_t pool : {1u, 3u, 7u}) {
    for (uint32_t window : {8u, 32u}) {
      Shape s;
      s.mode = MINIKV_SCORE_WINDOW;
      s.pool = pool;
      s.window = window;
      s.lens = {17, 64, 100, 301};
      run_and_check(s, random_inputs(s, 482, 50 + pool + window));
    }
  }
  Shape wide;  // recent window (0.4 L) longer than the scoring window
  wide.mode = MINIKV_SCORE_WINDOW;
  wide.recent = 0.4f;
  wide.heavy = 0.1f;
  wide.window = 16;
  wide.lens = {200};
  run_and_check(wide, random_inputs(wide, 200, 60));
}

TEST_CASE("prefill: other budgets (h = 0.1 r = 0.05 / keep-all / nothing but the window)") {
  Shape s;
  s.heavy = 0.1f;
  s.recent = 0.05f;
  s.lens = {300, 31};
  run_and_check(s, random_inputs(s, 331, 70));
  s.heavy = 1.0f;
  run_and_check(s, random_inputs(s, 331, 71));
  s.heavy = 0.0f;
  s.recent = 0.5f;
  run_and_check(s, random_inputs(s, 331, 72));
}

TEST_CASE("prefill: attention sinks are kept and counted inside the budget") {
  // S in {1, 4, 64}: prompts shorter than S (all sinks), equal to S, just above the
  // keep-all threshold, and long; both score modes; budgets where the sinks exceed the
  // heavy-hitter share (h L < S: no heavy hitters, the sinks are still kept).
  for (uint32_t sinks : {1u, 4u, 64u}) {
    for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
      Shape s;
      s.sinks = sinks;
      s.mode = mode;
      s.window = 16;
      s.lens = {1, 3, sinks, sinks + 1, 2 * sinks + 3, 90, 300};
      run_and_check(s, random_inputs(s, 398 + 4 * sinks, 100 + sinks + mode));
      s.heavy = 0.05f;
      s.recent = 0.1f;
      run_and_check(s, random_inputs(s, 398 + 4 * sinks, 110 + sinks + mode));
    }
  }
}

TEST_CASE("prefill: large-magnitude q (logits in the hundreds) against the float64 oracle") {
  // q ~ N(0, 100^2): logits reach several hundred, so exp() without subtracting the row
  // maximum overflows float (at 88.7) and the output is NaN. With it, the float32 logits
  // carry an absolute error of about |logit| 2^-22 (~1e-4 here), which moves the output by
  // about that much relative to |v| <= 4: tolerance 1e-3 (F32), plus the output rounding of
  // F16/BF16.
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
    Shape s;
    s.dt = dt;
    s.q_scale = 100.0;
    s.lens = {1, 77, 300};
    s.atol = 1e-3;
    s.rtol = 1e-3 + rtol_for(dt);
    run_and_check(s, random_inputs(s, 378, 90 + dt));
  }
}

TEST_CASE("prefill: decimal ratios keep their decimal budgets and h + r = 1 keeps everything") {
  // The float fields carry decimals: 0.7f (0.69999998807907) x 1000 kept 699 heavy hitters,
  // and the keep-everything recipes below dropped 1-2 tokens of many prompt lengths.
  struct Case {
    float h, r;
    std::vector<uint32_t> lens;
    bool keep_all;
    uint32_t kept_1000;  // tokens kept of a 1000-token prompt when not keep_all
  };
  const Case cases[] = {{0.7f, 0.1f, {1000}, false, 800},
                        {0.9f, 0.1f, {}, true, 0},
                        {0.65f, 0.35f, {}, true, 0},
                        {0.95f, 0.05f, {}, true, 0},
                        {0.35f, 0.65f, {}, true, 0}};
  const uint32_t H = 1, D = 16;
  for (const Case &cs : cases) {
    CAPTURE(cs.h);
    CAPTURE(cs.r);
    minikv_config c = test::cpu_config(1, H, H, D);
    c.heavy_ratio = cs.h;
    c.recent_ratio = cs.r;
    c.max_seq_len = 1024;
    test::CachePtr cache = test::make_cache(c);
    std::vector<uint32_t> lens = cs.lens;
    if (cs.keep_all)
      for (uint32_t L : {3u, 7u, 20u, 33u, 59u, 99u, 101u, 153u, 333u, 1005u}) lens.push_back(L);
    Shape s;
    s.H = s.Hkv = H;
    s.D = D;
    for (uint32_t L : lens) {
      CAPTURE(L);
      const Inputs in = random_inputs(s, L, L);
      test::Buf out(s.dt, size_t(L) * H * D);
      const uint32_t seq = 0;
      const int32_t cu[2] = {0, static_cast<int32_t>(L)};
      MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, in.q.data(), in.k.data(),
                                    in.v.data(), out.data(), nullptr));
      uint64_t cached = 0;
      MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), 0, 0, nullptr, &cached));
      CHECK(cached == (cs.keep_all ? L : cs.kept_1000));
      MKV_REQUIRE_OK(minikv_sequence_release(cache.get(), 0));
    }
  }
}

TEST_CASE("prefill: sinks take their place in the heavy-hitter budget") {
  // L = 100, h = r = 0.25: 25 heavy-hitter slots, 4 of them the sinks, 25 recent.
  Shape s;
  s.sinks = 4;
  s.lens = {100};
  const Inputs in = random_inputs(s, 100, 120);
  minikv_config c = test::cpu_config(1, s.H, s.Hkv, s.D, s.dt);
  c.sink_tokens = 4;
  c.max_seq_len = 100;
  test::CachePtr cache = test::make_cache(c);
  test::Buf out(s.dt, size_t(100) * s.H * s.D);
  const uint32_t seq = 0;
  const int32_t cu[2] = {0, 100};
  MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, in.q.data(), in.k.data(),
                                in.v.data(), out.data(), nullptr));
  for (uint32_t g = 0; g < s.Hkv; ++g) {
    const std::vector<int32_t> kept = test::kept_positions(cache.get(), 0, 0, g);
    REQUIRE(kept.size() == 50);
    for (int32_t t = 0; t < 4; ++t) CHECK(kept[size_t(t)] == t);
    const size_t heavy = std::count_if(kept.begin(), kept.end(), [](int32_t p) { return p >= 4 && p < 75; });
    CHECK(heavy == 21);
    for (int32_t t = 75; t < 100; ++t) CHECK(kept[size_t(t - 50)] == t);
  }
  uint64_t cached = 0;
  MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), 0, 0, nullptr, &cached));
  CHECK(cached == 50);
}

TEST_CASE("prefill: WINDOW max-pool at the edges of the scored prefix") {
  // L = 100, window 8, r = 0.2: the protected suffix [80, 100) is longer than the window, so
  // the scored prefix [0, 92) reaches past the candidates [0, 80). The window queries
  // attend only to keys 1 and 80 (equal logits of 20, the other keys are orthogonal to
  // them). Max-pooling with kernel 7 over the scored prefix spreads key 80's score (a
  // protected token) to candidates 77-79, and key 1's to 0-4 (clipped at 0); with
  // h = 0.08 those 8 candidates are exactly the heavy hitters. Pooling only over the
  // candidates, or not at all, or without clipping, keeps other tokens.
  const uint32_t L = 100, D = 16;
  minikv_config c = test::cpu_config(1, 1, 1, D);
  c.score_mode = MINIKV_SCORE_WINDOW;
  c.window_size = 8;
  c.pool_kernel = 7;
  c.heavy_ratio = 0.08f;
  c.recent_ratio = 0.2f;
  c.budget_policy = MINIKV_BUDGET_UNIFORM;
  c.sink_tokens = 0;
  c.max_seq_len = L;
  test::CachePtr cache = test::make_cache(c);
  test::Rng rng(140);
  test::Buf q(c.dtype, size_t(L) * D), k(c.dtype, size_t(L) * D), v(c.dtype, size_t(L) * D),
      out(c.dtype, size_t(L) * D);
  v.fill_normal(rng);
  for (uint32_t t = 0; t < L; ++t) {
    for (uint32_t ch = 0; ch < D; ++ch) {
      // Channel 0 carries the spikes; the rest is small noise, orthogonal to the queries.
      k.set(size_t(t) * D + ch, ch == 0 ? (t == 1 || t == 80 ? 4.0 : 0.0) : 0.05 * rng.normal());
      q.set(size_t(t) * D + ch, ch == 0 ? 20.0 : 0.0);
    }
  }
  const uint32_t seq = 0;
  const int32_t cu[2] = {0, static_cast<int32_t>(L)};
  MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, q.data(), k.data(), v.data(),
                                out.data(), nullptr));
  std::vector<int32_t> want = {0, 1, 2, 3, 4, 77, 78, 79};
  for (int32_t t = 80; t < int32_t(L); ++t) want.push_back(t);
  CHECK(test::kept_positions(cache.get(), 0, 0, 0) == want);
}

TEST_CASE("prefill: PYRAMID budgets per layer") {
  const uint32_t layers = 4, L = 200, H = 2, Hkv = 1, D = 64;
  minikv_config c = test::cpu_config(layers, H, Hkv, D);
  c.budget_policy = MINIKV_BUDGET_PYRAMID;
  c.max_seq_len = L;
  test::CachePtr cache = test::make_cache(c);
  Shape s;
  s.H = H;
  s.Hkv = Hkv;
  s.D = D;
  s.lens = {L};
  const std::vector<double> ratios = ref::layer_ratios(true, layers, 0.25, 0.25, 7.0);
  const uint32_t seq = 0;
  const int32_t cu[2] = {0, static_cast<int32_t>(L)};
  for (uint32_t layer = 0; layer < layers; ++layer) {
    CAPTURE(layer);
    const Inputs in = random_inputs(s, L, 80 + layer);
    test::Buf out(MINIKV_DTYPE_F32, size_t(L) * H * D);
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), layer, 1, &seq, cu, in.q.data(), in.k.data(),
                                  in.v.data(), out.data(), nullptr));
    const ref::PrefillResult r = ref::prefill(in.q.doubles(), in.k.doubles(), in.v.doubles(), L, H,
                                              Hkv, D, 32);
    MKV_CHECK_CLOSE(out.doubles(), r.out, 2e-5, 2e-5);
    const ref::Budget b = ref::budget(ratios[layer], 0.25, L, false, 32);
    const std::vector<int32_t> kept = test::kept_positions(cache.get(), 0, layer, 0);
    CHECK(kept.size() == b.n_heavy + b.n_protected);
    check_selection(kept, std::vector<double>(r.cumul.begin(), r.cumul.end()), L, b);
  }
  // Lower layers keep more.
  CHECK(test::kept_positions(cache.get(), 0, 0, 0).size() >
        test::kept_positions(cache.get(), 0, layers - 1, 0).size());
}

TEST_CASE("prefill: strongly attended tokens are kept (structured data)") {
  // Keys of a few "heavy" positions (and the sink, position 0) share a direction u that
  // every query also carries, so every query puts most of its mass on them; the rest is
  // noise. They must be among the kept tokens of every head in both score modes, and the
  // selection must still equal the oracle's. With max-pooling (kernel 7) a heavy token's
  // 6 neighbours tie with it and ties go to lower positions, so that case gets a budget
  // of 45 >= 6 x 7 heavy slots.
  const std::vector<uint32_t> heavy = {0, 5, 61, 62, 150, 233};
  struct Mode {
    minikv_score_mode mode;
    uint32_t pool;
    float h;
  };
  for (const Mode m : {Mode{MINIKV_SCORE_CUMULATIVE, 7, 0.05f}, Mode{MINIKV_SCORE_WINDOW, 1, 0.05f},
                       Mode{MINIKV_SCORE_WINDOW, 7, 0.15f}}) {
    for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_BF16}) {
      Shape s;
      s.dt = dt;
      s.mode = m.mode;
      s.pool = m.pool;
      s.H = 4;
      s.Hkv = 2;
      s.D = 64;
      s.heavy = m.h;
      s.recent = 0.1f;
      s.lens = {300};
      const uint32_t L = 300;
      test::Rng rng(90 + m.mode);
      Inputs in = random_inputs(s, L, 91 + m.mode);
      for (uint32_t t = 0; t < L; ++t) {
        for (uint32_t h = 0; h < s.H; ++h)
          for (uint32_t c = 0; c < 4; ++c) in.q.set((size_t(t) * s.H + h) * s.D + c, 3.0);
        const bool is_heavy = std::find(heavy.begin(), heavy.end(), t) != heavy.end();
        for (uint32_t g = 0; g < s.Hkv; ++g)
          for (uint32_t c = 0; c < 4; ++c)
            in.k.set((size_t(t) * s.Hkv + g) * s.D + c, is_heavy ? 3.0 : 0.1 * rng.normal());
      }
      run_and_check(s, in);
      // Directly: the heavy positions are kept.
      minikv_config c = test::cpu_config(1, s.H, s.Hkv, s.D, dt);
      c.score_mode = m.mode;
      c.pool_kernel = m.pool;
      c.heavy_ratio = s.heavy;
      c.recent_ratio = s.recent;
      c.max_seq_len = L;
      test::CachePtr cache = test::make_cache(c);
      test::Buf out(dt, size_t(L) * s.H * s.D);
      const uint32_t seq = 0;
      const int32_t cu[2] = {0, static_cast<int32_t>(L)};
      MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, in.q.data(), in.k.data(),
                                    in.v.data(), out.data(), nullptr));
      const size_t n_heavy = static_cast<size_t>(std::floor(double(s.heavy) * L));
      const size_t n_protected = m.mode == MINIKV_SCORE_WINDOW ? 32 : 30;  // max(0.1 L, w)
      for (uint32_t g = 0; g < s.Hkv; ++g) {
        const std::vector<int32_t> kept = test::kept_positions(cache.get(), 0, 0, g);
        CHECK(kept.size() == n_heavy + n_protected);
        for (uint32_t p : heavy) {
          CAPTURE(p);
          CHECK(std::binary_search(kept.begin(), kept.end(), static_cast<int32_t>(p)));
        }
      }
    }
  }
}

TEST_CASE("prefill: outputs do not depend on the batch composition") {
  // The same sequence prefilled alone and inside a ragged batch gives bit-identical rows.
  Shape s;
  s.dt = MINIKV_DTYPE_F16;
  s.lens = {50, 77, 3};
  const Inputs in = random_inputs(s, 130, 99);
  minikv_config c = test::cpu_config(1, s.H, s.Hkv, s.D, s.dt);
  c.max_sequences = 3;
  c.max_seq_len = 77;
  test::CachePtr batch = test::make_cache(c), alone = test::make_cache(c);
  const std::vector<int32_t> cu = test::cu_from_lengths(s.lens);
  const uint32_t ids[3] = {0, 1, 2};
  test::Buf out_batch(s.dt, size_t(130) * s.H * s.D), out_alone(s.dt, size_t(77) * s.H * s.D);
  MKV_REQUIRE_OK(minikv_prefill(batch.get(), 0, 3, ids, cu.data(), in.q.data(), in.k.data(),
                                in.v.data(), out_batch.data(), nullptr));
  const int32_t cu1[2] = {0, 77};
  const size_t q_off = size_t(50) * s.H * s.D, kv_off = size_t(50) * s.Hkv * s.D;
  MKV_REQUIRE_OK(minikv_prefill(alone.get(), 0, 1, &ids[1], cu1, in.q.row(q_off), in.k.row(kv_off),
                                in.v.row(kv_off), out_alone.data(), nullptr));
  CHECK(std::memcmp(out_batch.row(q_off), out_alone.data(), size_t(77) * s.H * s.D * 2) == 0);
  CHECK(test::kept_positions(batch.get(), 1, 0, 1) == test::kept_positions(alone.get(), 1, 0, 1));
}

}  // TEST_SUITE
