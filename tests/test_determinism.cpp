// Determinism: two identical runs are bit-identical, and so are runs with 1, 2 and 3 CPU
// threads (MINIKV_NUM_THREADS, read when a cache is created): every prefill output, kept
// position, decode output and statistic.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "support.hpp"

namespace {

// Runs a 2-layer workload (ragged prompts, quantized, both score modes by layer count...)
// and returns every byte the API produced. Prompts whose kept tokens reach 1024 decode in
// parts (src/cpu/cpu_backend.cpp).
std::vector<uint8_t> run(minikv_dtype dt, minikv_score_mode mode, const char *threads,
                         const std::vector<uint32_t> &lens = {513, 129, 40}) {
  if (threads) {
    REQUIRE(setenv("MINIKV_NUM_THREADS", threads, 1) == 0);
  } else {
    unsetenv("MINIKV_NUM_THREADS");
  }
  const uint32_t layers = 2, H = 8, Hkv = 2, D = 64, steps = 40;
  minikv_config c = test::cpu_config(layers, H, Hkv, D, dt);
  c.max_sequences = 3;
  c.max_seq_len = *std::max_element(lens.begin(), lens.end()) + 87;
  c.residual_length = 32;
  c.score_mode = mode;
  c.budget_policy = MINIKV_BUDGET_PYRAMID;
  test::CachePtr cache = test::make_cache(c);
  unsetenv("MINIKV_NUM_THREADS");
  const std::vector<int32_t> cu = test::cu_from_lengths(lens);
  const size_t total = static_cast<size_t>(cu.back());
  test::Rng rng(77);
  std::vector<uint8_t> bytes;
  auto put = [&](const void *p, size_t n) {
    bytes.insert(bytes.end(), static_cast<const uint8_t *>(p), static_cast<const uint8_t *>(p) + n);
  };
  const size_t e = ref::dtype_size(dt);
  const uint32_t ids[3] = {2, 0, 1};
  for (uint32_t layer = 0; layer < layers; ++layer) {
    test::Buf q(dt, total * H * D), k(dt, total * Hkv * D), v(dt, total * Hkv * D),
        out(dt, total * H * D);
    q.fill_normal(rng, 1.5);
    k.fill_normal(rng);
    v.fill_normal(rng);
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), layer, 3, ids, cu.data(), q.data(), k.data(),
                                  v.data(), out.data(), nullptr));
    put(out.data(), total * H * D * e);
    for (uint32_t s = 0; s < 3; ++s)
      for (uint32_t h = 0; h < Hkv; ++h) {
        const std::vector<int32_t> kept = test::kept_positions(cache.get(), s, layer, h);
        put(kept.data(), kept.size() * 4);
      }
  }
  test::Buf k1(dt, size_t(3) * Hkv * D), v1(dt, size_t(3) * Hkv * D), q1(dt, size_t(3) * H * D),
      o1(dt, size_t(3) * H * D);
  for (uint32_t step = 0; step < steps; ++step) {
    for (uint32_t layer = 0; layer < layers; ++layer) {
      k1.fill_normal(rng);
      v1.fill_normal(rng);
      q1.fill_normal(rng, 1.5);
      MKV_REQUIRE_OK(minikv_append(cache.get(), layer, 3, ids, k1.data(), v1.data(), nullptr));
      MKV_REQUIRE_OK(minikv_decode(cache.get(), layer, 3, ids, q1.data(), o1.data(), nullptr));
      put(o1.data(), size_t(3) * H * D * e);
    }
  }
  minikv_memory_stats st;
  std::memset(&st, 0, sizeof(st));
  st.struct_size = sizeof(st);
  MKV_REQUIRE_OK(minikv_memory_stats_get(cache.get(), &st));
  st.workspace_bytes = 0;  // per-thread scratch: legitimately depends on the thread count
  put(&st, sizeof(st));
  return bytes;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("determinism: identical runs are bit-identical") {
  for (minikv_dtype dt : {MINIKV_DTYPE_F16, MINIKV_DTYPE_F32}) {
    const std::vector<uint8_t> a = run(dt, MINIKV_SCORE_CUMULATIVE, nullptr);
    const std::vector<uint8_t> b = run(dt, MINIKV_SCORE_CUMULATIVE, nullptr);
    REQUIRE(a.size() == b.size());
    CHECK(a == b);
  }
}

TEST_CASE("determinism: 1/2/3 threads are bit-identical") {
  for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
    CAPTURE(static_cast<int>(mode));
    const std::vector<uint8_t> one = run(MINIKV_DTYPE_BF16, mode, "1");
    const std::vector<uint8_t> two = run(MINIKV_DTYPE_BF16, mode, "2");
    const std::vector<uint8_t> three = run(MINIKV_DTYPE_BF16, mode, "3");
    REQUIRE(one.size() == two.size());
    CHECK(one == two);
    CHECK(one == three);
  }
}

TEST_CASE("determinism: decode in parts is bit-identical for 1/2/3 threads") {
  // The PYRAMID budget keeps 3142 / 1642 / 91 tokens of these prompts in layer 0 (4, 3 and
  // 1 parts) and 1257 / 657 / 36 in layer 1 (2, 1 and 1).
  const std::vector<uint32_t> lens = {2300, 129, 4400};
  const std::vector<uint8_t> one = run(MINIKV_DTYPE_F32, MINIKV_SCORE_CUMULATIVE, "1", lens);
  const std::vector<uint8_t> two = run(MINIKV_DTYPE_F32, MINIKV_SCORE_CUMULATIVE, "2", lens);
  const std::vector<uint8_t> three = run(MINIKV_DTYPE_F32, MINIKV_SCORE_CUMULATIVE, "3", lens);
  REQUIRE(one.size() == two.size());
  CHECK(one == two);
  CHECK(one == three);
}

TEST_CASE("determinism: the thread count is read at create (workspace per thread)") {
  // The per-thread scratch shows in workspace_bytes: more threads, more workspace.
  auto workspace = [](const char *threads) {
    REQUIRE(setenv("MINIKV_NUM_THREADS", threads, 1) == 0);
    minikv_config c = test::cpu_config(1, 2, 1, 64);
    test::CachePtr cache = test::make_cache(c);
    unsetenv("MINIKV_NUM_THREADS");
    minikv_memory_stats st;
    st.struct_size = sizeof(st);
    REQUIRE(minikv_memory_stats_get(cache.get(), &st) == MINIKV_OK);
    return st.workspace_bytes;
  };
  CHECK(workspace("1") < workspace("4"));
}

}  // TEST_SUITE
