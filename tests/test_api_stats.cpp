// minikv_memory_stats_get: used bytes computed by hand for several configurations, the
// FP16-equivalent size, token counts, the struct_size contract, and the paper's headline
// compression (MHA, head_dim 128, 4096-token prompt + 512 generated, 50% budget, 2-bit,
// G = 16, fp16: ~86%).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "reference/attention_ref.hpp"
#include "support.hpp"

namespace {

minikv_memory_stats stats_of(const minikv_cache *c) {
  minikv_memory_stats st;
  std::memset(&st, 0, sizeof(st));
  st.struct_size = sizeof(st);
  MKV_REQUIRE_OK(minikv_memory_stats_get(c, &st));
  return st;
}

// Bytes of one KV head's storage, by hand from the format (MINIKV.md §3):
// per quantized token: key codes D*kb/8 + value codes D*vb/8 (a 16-bit side stores D
// elements of the dtype instead); per group of G quantized tokens: a (scale, min) pair
// per key channel, 2*D elements; per quantized token: a (scale, min) pair per group of G
// value channels, 2*D/G elements; per sink or residual token: K and V rows, 2*D elements.
uint64_t head_bytes(uint32_t D, uint32_t G, uint32_t kb, uint32_t vb, uint32_t elem,
                    uint64_t sinks, uint64_t quantized, uint64_t residual) {
  const uint64_t k_codes = kb == 16 ? uint64_t(D) * elem : uint64_t(D) * kb / 8;
  const uint64_t v_codes = vb == 16 ? uint64_t(D) * elem : uint64_t(D) * vb / 8;
  uint64_t bytes = quantized * (k_codes + v_codes);
  if (kb != 16) bytes += quantized / G * 2ull * D * elem;
  if (vb != 16) bytes += quantized * 2ull * (D / G) * elem;
  return bytes + (sinks + residual) * 2ull * D * elem;
}

struct Case {
  minikv_dtype dt;
  uint32_t kb, vb, G, R, D, Hkv;
  uint32_t sinks = 0;
};

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("stats: used bytes equal the hand-computed size at every step") {
  const Case cases[] = {
      {MINIKV_DTYPE_F16, 2, 2, 16, 32, 64, 2},   {MINIKV_DTYPE_F16, 4, 4, 32, 64, 128, 1},
      {MINIKV_DTYPE_F32, 2, 2, 16, 16, 64, 2},   {MINIKV_DTYPE_BF16, 2, 16, 16, 32, 64, 4},
      {MINIKV_DTYPE_F16, 16, 4, 64, 64, 128, 2}, {MINIKV_DTYPE_F16, 16, 16, 16, 16, 64, 1},
      {MINIKV_DTYPE_F32, 4, 2, 128, 128, 128, 1},
      // Sinks: 4 of them inside the budget; 64, more than a 77-token prompt's heavy share
      // (that prompt keeps everything: 64 sinks and 13 more).
      {MINIKV_DTYPE_F16, 4, 2, 32, 64, 64, 2, 4},  {MINIKV_DTYPE_F32, 2, 2, 16, 16, 64, 2, 64},
      {MINIKV_DTYPE_BF16, 8, 8, 32, 32, 64, 1, 7}, {MINIKV_DTYPE_F16, 8, 2, 16, 32, 128, 2},
  };
  for (const Case &cs : cases) {
    CAPTURE(cs.kb);
    CAPTURE(cs.vb);
    CAPTURE(cs.G);
    CAPTURE(cs.R);
    CAPTURE(cs.D);
    CAPTURE(cs.sinks);
    const uint32_t H = cs.Hkv * 2, layers = 2;
    const uint32_t elem = static_cast<uint32_t>(ref::dtype_size(cs.dt));
    minikv_config c = test::cpu_config(layers, H, cs.Hkv, cs.D, cs.dt);
    c.key_bits = cs.kb;
    c.value_bits = cs.vb;
    c.group_size = cs.G;
    c.residual_length = cs.R;
    c.max_sequences = 2;
    c.max_seq_len = 400;
    c.sink_tokens = cs.sinks;
    c.budget_policy = MINIKV_BUDGET_UNIFORM;  // both layers keep half their prompt
    test::CachePtr cache = test::make_cache(c);
    const minikv_memory_stats empty = stats_of(cache.get());
    const std::vector<uint32_t> lens = {203, 77};
    const std::vector<int32_t> cu = test::cu_from_lengths(lens);
    test::Rng rng(cs.kb * 100 + cs.G);
    test::Buf q(cs.dt, size_t(280) * H * cs.D), k(cs.dt, size_t(280) * cs.Hkv * cs.D),
        v(cs.dt, size_t(280) * cs.Hkv * cs.D), out(cs.dt, size_t(280) * H * cs.D);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    const uint32_t ids[2] = {0, 1};
    // Layer 0: both sequences; layer 1: only sequence 1.
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 2, ids, cu.data(), q.data(), k.data(), v.data(),
                                  out.data(), nullptr));
    const int32_t cu1[2] = {0, 77};
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), 1, 1, &ids[1], cu1, q.data(), k.data(), v.data(),
                                  out.data(), nullptr));
    // Bookkeeping per (seq, layer): kept = 0.5 L (the oracle's budget, sinks inside it),
    // the sinks apart, quantized = the rest rounded down to G, then appends.
    struct St {
      uint64_t seen, sinks, quantized, residual;
    };
    auto prefilled = [&](uint32_t L) {
      const ref::Budget b = ref::budget(0.25, 0.25, L, false, 0, cs.sinks);
      CHECK(b.kept() == (b.keep_all ? L : std::max(L / 4, b.n_sink) + L / 4));
      const uint64_t rest = b.kept() - b.n_sink;
      return St{L, b.n_sink, rest - rest % cs.G, rest % cs.G};
    };
    std::vector<St> st = {prefilled(203), prefilled(77), prefilled(77)};  // (0,0) (1,0) (1,1)
    auto check = [&]() {
      const minikv_memory_stats s = stats_of(cache.get());
      uint64_t used = 0, seen = 0, cached = 0;
      for (const St &x : st) {
        used += cs.Hkv * head_bytes(cs.D, cs.G, cs.kb, cs.vb, elem, x.sinks, x.quantized, x.residual);
        seen += x.seen;
        cached += x.sinks + x.quantized + x.residual;
      }
      CHECK(s.used_bytes == used);
      CHECK(s.tokens_seen == seen);
      CHECK(s.tokens_cached == cached);
      CHECK(s.fp16_equivalent_bytes == seen * cs.Hkv * cs.D * 2 * 2);
      CHECK(s.compression_ratio == doctest::Approx(1.0 - double(used) / double(seen * cs.Hkv * cs.D * 4)).epsilon(1e-12));
      CHECK(s.pool_bytes == empty.pool_bytes);  // reserved at create, never grows
      CHECK(s.workspace_bytes == empty.workspace_bytes);
    };
    check();
    test::Buf k1(cs.dt, size_t(2) * cs.Hkv * cs.D), v1(cs.dt, size_t(2) * cs.Hkv * cs.D);
    for (uint32_t step = 0; step < cs.R + 5; ++step) {
      CAPTURE(step);
      k1.fill_normal(rng);
      v1.fill_normal(rng);
      MKV_REQUIRE_OK(minikv_append(cache.get(), 0, 2, ids, k1.data(), v1.data(), nullptr));
      for (uint32_t i = 0; i < 2; ++i) {
        St &x = st[i];
        ++x.seen;
        if (++x.residual == cs.R) {
          x.quantized += cs.R;
          x.residual = 0;
        }
      }
      check();
    }
    MKV_REQUIRE_OK(minikv_sequence_release(cache.get(), 1));
    st = {st[0]};
    check();
  }
}

TEST_CASE("stats: the paper's setting compresses by ~86%") {
  // One layer and one head: the ratio does not depend on either.
  const uint32_t L = 4096, gen = 512, D = 128;
  minikv_config c = test::cpu_config(1, 1, 1, D, MINIKV_DTYPE_F16);
  c.max_seq_len = L + gen;  // the paper's: h = r = 0.25, 2-bit, G = 16, R = 128
  test::CachePtr cache = test::make_cache(c);
  test::Rng rng(42);
  test::Buf q(c.dtype, size_t(L) * D), k(c.dtype, size_t(L) * D), v(c.dtype, size_t(L) * D),
      out(c.dtype, size_t(L) * D);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  const uint32_t seq = 0;
  const int32_t cu[2] = {0, static_cast<int32_t>(L)};
  MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, q.data(), k.data(), v.data(),
                                out.data(), nullptr));
  test::Buf k1(c.dtype, D), v1(c.dtype, D), q1(c.dtype, D), o1(c.dtype, D);
  for (uint32_t t = 0; t < gen; ++t) {
    k1.fill_normal(rng);
    v1.fill_normal(rng);
    q1.fill_normal(rng);
    MKV_REQUIRE_OK(minikv_append(cache.get(), 0, 1, &seq, k1.data(), v1.data(), nullptr));
    MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, 1, &seq, q1.data(), o1.data(), nullptr));
  }
  const minikv_memory_stats s = stats_of(cache.get());
  // 2048 kept + 512 generated = 2560 tokens, all quantized (4 flushes of 128).
  // Per token: 32 B key codes + 32 B value codes + 8 value (scale, min) pairs (32 B);
  // per 16 tokens: 128 key (scale, min) pairs (512 B) -> 160 groups * 512 = 81920 B.
  CHECK(s.tokens_seen == 4608);
  CHECK(s.tokens_cached == 2560);
  CHECK(s.used_bytes == 2560ull * (32 + 32 + 32) + 160ull * 512);  // 327680
  CHECK(s.fp16_equivalent_bytes == 4608ull * 128 * 2 * 2);          // 2359296
  CHECK(s.compression_ratio == doctest::Approx(1.0 - 327680.0 / 2359296.0).epsilon(1e-12));
  CHECK(s.compression_ratio == doctest::Approx(0.861).epsilon(1e-3));  // the paper's ~86%
  uint64_t seen = 0, cached = 0;
  MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), 0, 0, &seen, &cached));
  CHECK(seen == 4608);
  CHECK(cached == 2560);
}

TEST_CASE("stats: pool size follows max_tokens rounded up to whole blocks") {
  minikv_config c = test::cpu_config(1, 2, 1, 64);
  c.residual_length = 32;
  c.max_tokens = 96;  // 3 blocks
  const minikv_memory_stats a = stats_of(test::make_cache(c).get());
  c.max_tokens = 65;  // rounds up to 3 blocks as well
  const minikv_memory_stats b = stats_of(test::make_cache(c).get());
  c.max_tokens = 97;  // 4 blocks
  const minikv_memory_stats d = stats_of(test::make_cache(c).get());
  CHECK(a.pool_bytes == b.pool_bytes);
  CHECK(d.pool_bytes > a.pool_bytes);
  // max_tokens = 0: enough for every slot at max_seq_len, i.e. larger than 3 blocks here.
  c.max_tokens = 0;
  c.max_seq_len = 4096;
  const minikv_memory_stats full = stats_of(test::make_cache(c).get());
  CHECK(full.pool_bytes > d.pool_bytes);
  // Block bytes are at least the payload of 32 tokens: a (d - a) block holds codes+scales.
  CHECK(d.pool_bytes - a.pool_bytes >= uint64_t(32) * (16 + 16) + 2 * 64 * 2 + 32 * 2 * 4 * 2);
}

TEST_CASE("stats: struct_size of a newer caller: our fields written and the tail untouched") {
  minikv_config c = test::cpu_config(1, 2, 1, 64);
  test::CachePtr cache = test::make_cache(c);
  struct Bigger {
    minikv_memory_stats s;
    uint64_t future[3];
  } big;
  std::memset(&big, 0xa5, sizeof(big));
  big.s.struct_size = sizeof(big);
  MKV_REQUIRE_OK(minikv_memory_stats_get(cache.get(), &big.s));
  CHECK(big.s.struct_size == sizeof(big));  // the caller's size is kept
  CHECK(big.s.used_bytes == 0);
  CHECK(big.s.pool_bytes > 0);
  for (uint64_t f : big.future) CHECK(f == 0xa5a5a5a5a5a5a5a5ull);
}

TEST_CASE("stats: the workspace is sized by what the config can use") {
  auto workspace = [](const minikv_config &c, const char *threads) {
    const char *env = std::getenv("MINIKV_NUM_THREADS");
    const std::string saved = env ? env : "";
    setenv("MINIKV_NUM_THREADS", threads, 1);  // read at create
    minikv_cache *cache = nullptr;
    const minikv_status st = minikv_cache_create(&c, &cache);
    if (env) {
      setenv("MINIKV_NUM_THREADS", saved.c_str(), 1);
    } else {
      unsetenv("MINIKV_NUM_THREADS");
    }
    REQUIRE(st == MINIKV_OK);
    minikv_memory_stats s;
    std::memset(&s, 0, sizeof(s));
    s.struct_size = sizeof(s);
    REQUIRE(minikv_memory_stats_get(cache, &s) == MINIKV_OK);
    minikv_cache_destroy(cache);
    return s.workspace_bytes;
  };
  minikv_config c = test::cpu_config(2, 8, 2, 64);
  c.budget_policy = MINIKV_BUDGET_UNIFORM;
  c.max_sequences = 4;
  c.max_seq_len = 4096;
  // A budget that keeps every prompt whole never scores: no score buffers
  // ([num_heads][max_seq_len] doubles and three [max_seq_len] vectors per thread).
  minikv_config keep_all = c;
  keep_all.heavy_ratio = 1.0f;
  const uint64_t scoring = workspace(c, "2"), whole = workspace(keep_all, "2");
  CHECK(whole + uint64_t(8) * 4096 * 8 + 2 * 3 * 4096 * 4 == scoring);
  // One query head, one KV head, one sequence too short to decode in parts (1024 tokens):
  // one work item at a time, one thread.
  minikv_config tiny = test::cpu_config(1, 1, 1, 64);
  tiny.max_seq_len = 1023;
  CHECK(workspace(tiny, "4") == workspace(tiny, "1"));
  // Long enough for 4 decode parts of 512 tokens: 4 threads.
  tiny.max_seq_len = 4096;
  CHECK(workspace(tiny, "4") > workspace(tiny, "2"));
  CHECK(workspace(tiny, "8") == workspace(tiny, "4"));
  // Threads up to the widest loop (8 query heads; 4 sequences x 2 KV heads x 4 decode
  // parts) are used.
  CHECK(workspace(c, "32") > workspace(c, "16"));
  CHECK(workspace(c, "64") == workspace(c, "32"));
}

}  // TEST_SUITE
