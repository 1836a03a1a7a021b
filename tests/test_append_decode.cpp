// minikv_append_decode against minikv_append followed by minikv_decode on the CPU backend:
// two caches driven with the same steps, one through each path, must agree bit for bit on
// every output, on every sequence's lengths and on the whole storage (pool blocks and
// residual slots), across flushes, ragged batches (a different subset of the sequences at
// each step, in shuffled order), GQA, sinks, every dtype, and a prompt that kept no token
// (decode alone refuses it until its first append; append_decode appends first).
// minikv-test: white-box (reads the backends' storage through the handle)
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "support.hpp"
#include "white_box.hpp"

namespace {

struct Setup {
  const char *name;
  minikv_dtype dt;
  uint32_t H, Hkv, D;
  uint32_t key_bits, value_bits, G, R, sinks;
};

void check_same_lengths(const minikv_cache *a, const minikv_cache *b, uint32_t seqs,
                        uint32_t layers) {
  for (uint32_t s = 0; s < seqs; ++s)
    for (uint32_t l = 0; l < layers; ++l) {
      uint64_t seen_a = 0, cached_a = 0, seen_b = 1, cached_b = 1;
      MKV_REQUIRE_OK(minikv_sequence_length(a, s, l, &seen_a, &cached_a));
      MKV_REQUIRE_OK(minikv_sequence_length(b, s, l, &seen_b, &cached_b));
      CAPTURE(s);
      CAPTURE(l);
      CHECK(seen_a == seen_b);
      CHECK(cached_a == cached_b);
    }
}

void run(const Setup &st) {
  INFO(std::string(st.name));
  constexpr uint32_t kLayers = 2, kSteps = 70;
  const std::vector<uint32_t> lens = {1, 17, 40, 90, 3};  // 1 and 3 keep no token
  const uint32_t n = static_cast<uint32_t>(lens.size());
  minikv_config c = test::cpu_config(kLayers, st.H, st.Hkv, st.D, st.dt);
  c.max_sequences = n;
  c.max_seq_len = 90 + kSteps;  // the longest prompt, then one token a step
  c.key_bits = st.key_bits;
  c.value_bits = st.value_bits;
  c.group_size = st.G;
  c.residual_length = st.R;
  c.sink_tokens = st.sinks;
  test::CachePtr fused = test::make_cache(c), split = test::make_cache(c);

  test::Rng rng(4242);
  const std::vector<int32_t> cu = test::cu_from_lengths(lens);
  const size_t T = static_cast<size_t>(cu.back());
  const size_t q_row = size_t(st.H) * st.D, kv_row = size_t(st.Hkv) * st.D;
  std::vector<uint32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i) ids[i] = n - 1 - i;  // slots not in batch order
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    test::Buf q(st.dt, T * q_row), k(st.dt, T * kv_row), v(st.dt, T * kv_row), out(st.dt, T * q_row);
    q.fill_normal(rng);
    k.fill_normal(rng, 1.5);
    v.fill_normal(rng);
    for (minikv_cache *cache : {fused.get(), split.get()})
      MKV_REQUIRE_OK(minikv_prefill(cache, layer, n, ids.data(), cu.data(), q.data(), k.data(),
                                    v.data(), out.data(), nullptr));
  }

  std::vector<uint32_t> appended(n, 0);
  for (uint32_t step = 0; step < kSteps; ++step) {
    // Every third step the whole batch; otherwise a shuffled subset of it.
    std::vector<uint32_t> batch = ids;
    for (uint32_t i = n; i > 1; --i) std::swap(batch[i - 1], batch[rng.below(i)]);
    if (step % 3 != 0) batch.resize(1 + rng.below(n));
    const uint32_t b = static_cast<uint32_t>(batch.size());
    for (uint32_t id : batch) ++appended[id];
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      CAPTURE(step);
      CAPTURE(layer);
      test::Buf q(st.dt, b * q_row), k(st.dt, b * kv_row), v(st.dt, b * kv_row);
      test::Buf out_fused(st.dt, b * q_row), out_split(st.dt, b * q_row);
      q.fill_normal(rng);
      k.fill_normal(rng, 1.5);
      v.fill_normal(rng);
      MKV_REQUIRE_OK(minikv_append_decode(fused.get(), layer, b, batch.data(), q.data(), k.data(),
                                          v.data(), out_fused.data(), nullptr));
      MKV_REQUIRE_OK(minikv_append(split.get(), layer, b, batch.data(), k.data(), v.data(), nullptr));
      MKV_REQUIRE_OK(minikv_decode(split.get(), layer, b, batch.data(), q.data(), out_split.data(), nullptr));
      CHECK(out_fused.bit_equal(out_split));
    }
    if (step % 15 == 14) test::check_same_storage(fused.get(), split.get(), "after step " + std::to_string(step));
  }
  // A residual holds fewer than R tokens: R appends to one sequence flushed it at least once.
  CHECK(*std::max_element(appended.begin(), appended.end()) >= st.R);
  check_same_lengths(fused.get(), split.get(), n, kLayers);
  test::check_same_storage(fused.get(), split.get(), "at the end");
  minikv_memory_stats sa{}, sb{};
  sa.struct_size = sb.struct_size = sizeof(minikv_memory_stats);
  MKV_REQUIRE_OK(minikv_memory_stats_get(fused.get(), &sa));
  MKV_REQUIRE_OK(minikv_memory_stats_get(split.get(), &sb));
  CHECK(std::memcmp(&sa, &sb, sizeof(sa)) == 0);
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("append_decode: equals append then decode bit for bit across flushes and ragged batches") {
  const Setup setups[] = {
      {"f32 paper 2/2 G16 gqa2", MINIKV_DTYPE_F32, 4, 2, 64, 2, 2, 16, 16, 0},
      {"f16 4/2 G32 4 sinks gqa3", MINIKV_DTYPE_F16, 6, 2, 64, 4, 2, 32, 32, 4},
      {"bf16 8/8 G16 mha hd128", MINIKV_DTYPE_BF16, 2, 2, 128, 8, 8, 16, 16, 0},
      {"f16 16/16 eviction gqa4 2 sinks", MINIKV_DTYPE_F16, 4, 1, 32, 16, 16, 16, 16, 2},
  };
  for (const Setup &st : setups) {
    SUBCASE(st.name) { run(st); }
  }
}

TEST_CASE("append_decode: the first token after a prompt that kept nothing attends to itself") {
  // decode alone refuses such a sequence until its first append (BAD_STATE); the combined
  // call appends first, so its output is the token's own value (softmax over one token).
  minikv_config c = test::cpu_config(1, 2, 1, 16, MINIKV_DTYPE_F32);
  test::CachePtr cache = test::make_cache(c);
  const uint32_t id = 0;
  const int32_t cu[2] = {0, 2};  // 2 tokens: 25% of each keeps none
  test::Buf q(MINIKV_DTYPE_F32, 2 * 2 * 16), k(MINIKV_DTYPE_F32, 2 * 16), v(MINIKV_DTYPE_F32, 2 * 16),
      out(MINIKV_DTYPE_F32, 2 * 2 * 16);
  test::Rng rng(3);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &id, cu, q.data(), k.data(), v.data(), out.data(), nullptr));
  uint64_t cached = 1;
  MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), id, 0, nullptr, &cached));
  REQUIRE(cached == 0);
  CHECK(minikv_decode(cache.get(), 0, 1, &id, q.data(), out.data(), nullptr) == MINIKV_ERR_BAD_STATE);
  test::Buf k1(MINIKV_DTYPE_F32, 16), v1(MINIKV_DTYPE_F32, 16), o1(MINIKV_DTYPE_F32, 2 * 16);
  k1.fill_normal(rng);
  v1.fill_normal(rng);
  MKV_REQUIRE_OK(minikv_append_decode(cache.get(), 0, 1, &id, q.data(), k1.data(), v1.data(), o1.data(), nullptr));
  for (uint32_t h = 0; h < 2; ++h)
    for (uint32_t ch = 0; ch < 16; ++ch) CHECK(o1.get(h * 16 + ch) == v1.get(ch));
}

}  // TEST_SUITE
