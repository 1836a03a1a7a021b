// Sequence lifecycle through the C API: slots, layers, release and reuse, kept-position
// introspection (capacity 0 / partial), max_seq_len, empty caches.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "support.hpp"

namespace {

constexpr uint32_t kH = 2, kHkv = 1, kD = 64;

struct Data {
  test::Buf q, k, v, out;
  Data(uint32_t L, uint64_t seed)
      : q(MINIKV_DTYPE_F16, size_t(L) * kH * kD), k(MINIKV_DTYPE_F16, size_t(L) * kHkv * kD),
        v(MINIKV_DTYPE_F16, size_t(L) * kHkv * kD), out(MINIKV_DTYPE_F16, size_t(L) * kH * kD) {
    test::Rng rng(seed);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
  }
};

minikv_config config(uint32_t layers = 2, uint32_t seqs = 2) {
  minikv_config c = test::cpu_config(layers, kH, kHkv, kD, MINIKV_DTYPE_F16);
  c.max_sequences = seqs;
  c.max_seq_len = 160;
  c.residual_length = 32;
  c.budget_policy = MINIKV_BUDGET_UNIFORM;  // every layer keeps half its prompt
  return c;
}

void prefill(minikv_cache *c, uint32_t layer, uint32_t seq, uint32_t L, Data &d) {
  const int32_t cu[2] = {0, static_cast<int32_t>(L)};
  MKV_REQUIRE_OK(minikv_prefill(c, layer, 1, &seq, cu, d.q.data(), d.k.data(), d.v.data(),
                                d.out.data(), nullptr));
}

std::vector<uint8_t> decode_bytes(minikv_cache *c, uint32_t layer, uint32_t seq, const Data &d) {
  test::Buf o(MINIKV_DTYPE_F16, size_t(kH) * kD);
  MKV_REQUIRE_OK(minikv_decode(c, layer, 1, &seq, d.q.data(), o.data(), nullptr));
  const uint8_t *p = static_cast<const uint8_t *>(o.data());
  return std::vector<uint8_t>(p, p + size_t(kH) * kD * 2);
}

void lengths(minikv_cache *c, uint32_t seq, uint32_t layer, uint64_t &seen, uint64_t &cached) {
  MKV_REQUIRE_OK(minikv_sequence_length(c, seq, layer, &seen, &cached));
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("lifecycle: a fresh cache is empty") {
  test::CachePtr c = test::make_cache(config());
  for (uint32_t seq = 0; seq < 2; ++seq) {
    for (uint32_t layer = 0; layer < 2; ++layer) {
      uint64_t seen = 99, cached = 99;
      lengths(c.get(), seq, layer, seen, cached);
      CHECK(seen == 0);
      CHECK(cached == 0);
    }
  }
  // Either output pointer may be NULL.
  uint64_t seen = 5;
  MKV_REQUIRE_OK(minikv_sequence_length(c.get(), 0, 0, &seen, nullptr));
  CHECK(seen == 0);
  MKV_REQUIRE_OK(minikv_sequence_length(c.get(), 0, 0, nullptr, nullptr));
  minikv_memory_stats st;
  std::memset(&st, 0xff, sizeof(st));
  st.struct_size = sizeof(st);
  MKV_REQUIRE_OK(minikv_memory_stats_get(c.get(), &st));
  CHECK(st.struct_size == sizeof(st));
  CHECK(st.used_bytes == 0);
  CHECK(st.tokens_seen == 0);
  CHECK(st.tokens_cached == 0);
  CHECK(st.fp16_equivalent_bytes == 0);
  CHECK(st.compression_ratio == 0.0);
  CHECK(st.pool_bytes > 0);
}

TEST_CASE("lifecycle: layers of a sequence are independent and prefilled once each") {
  test::CachePtr c = test::make_cache(config());
  Data d(100, 1);
  prefill(c.get(), 1, 0, 100, d);  // layer 1 before layer 0 is fine
  uint64_t seen = 0, cached = 0;
  lengths(c.get(), 0, 1, seen, cached);
  CHECK(seen == 100);
  CHECK(cached == 50);
  lengths(c.get(), 0, 0, seen, cached);
  CHECK(seen == 0);
  const uint32_t seq = 0;
  MKV_REQUIRE_OK(minikv_append(c.get(), 1, 1, &seq, d.k.data(), d.v.data(), nullptr));
  lengths(c.get(), 0, 1, seen, cached);
  CHECK(seen == 101);
  CHECK(cached == 51);
  prefill(c.get(), 0, 0, 60, d);
  lengths(c.get(), 0, 0, seen, cached);
  CHECK(seen == 60);
  CHECK(cached == 30);
  lengths(c.get(), 0, 1, seen, cached);  // untouched
  CHECK(seen == 101);
  // The other slot is still empty.
  lengths(c.get(), 1, 1, seen, cached);
  CHECK(seen == 0);
}

TEST_CASE("lifecycle: release frees every layer and the slot takes a new prompt") {
  test::CachePtr c = test::make_cache(config());
  Data a(120, 2), b(90, 3);
  prefill(c.get(), 0, 0, 120, a);
  prefill(c.get(), 1, 0, 120, a);
  prefill(c.get(), 0, 1, 90, b);
  const std::vector<uint8_t> seq1_before = decode_bytes(c.get(), 0, 1, b);
  MKV_REQUIRE_OK(minikv_sequence_release(c.get(), 0));
  uint64_t seen = 0, cached = 0;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    lengths(c.get(), 0, layer, seen, cached);
    CHECK(seen == 0);
    CHECK(cached == 0);
  }
  uint32_t count = 0;
  CHECK(minikv_kept_positions(c.get(), 0, 0, 0, nullptr, 0, &count) == MINIKV_ERR_BAD_STATE);
  const uint32_t seq0 = 0;
  test::Buf o(MINIKV_DTYPE_F16, size_t(kH) * kD);
  CHECK(minikv_decode(c.get(), 0, 1, &seq0, a.q.data(), o.data(), nullptr) == MINIKV_ERR_BAD_STATE);
  // Sequence 1 is untouched.
  CHECK(decode_bytes(c.get(), 0, 1, b) == seq1_before);
  // Reuse: the new prompt behaves exactly as in a fresh cache.
  prefill(c.get(), 0, 0, 90, b);
  test::CachePtr fresh = test::make_cache(config());
  prefill(fresh.get(), 0, 0, 90, b);
  CHECK(decode_bytes(c.get(), 0, 0, b) == decode_bytes(fresh.get(), 0, 0, b));
  CHECK(test::kept_positions(c.get(), 0, 0, 0) == test::kept_positions(fresh.get(), 0, 0, 0));
  // Releasing an empty slot (and twice) is a no-op.
  MKV_REQUIRE_OK(minikv_sequence_release(c.get(), 1));
  MKV_REQUIRE_OK(minikv_sequence_release(c.get(), 1));
  CHECK(decode_bytes(c.get(), 0, 0, b) == decode_bytes(fresh.get(), 0, 0, b));
}

TEST_CASE("lifecycle: release and reuse many times returns every block") {
  minikv_config cfg = config(1, 2);
  cfg.max_tokens = 128;  // 4 blocks of 32: two prompts of 128 (64 kept) fill it
  test::CachePtr c = test::make_cache(cfg);
  Data d(128, 4);
  const uint32_t ids[2] = {0, 1};
  const int32_t cu[3] = {0, 64, 128};
  for (int round = 0; round < 20; ++round) {
    CAPTURE(round);
    MKV_REQUIRE_OK(minikv_prefill(c.get(), 0, 1, &ids[round % 2], cu + 0, d.q.data(), d.k.data(),
                                  d.v.data(), d.out.data(), nullptr));
    const int32_t cu_full[2] = {0, 128};
    MKV_REQUIRE_OK(minikv_prefill(c.get(), 0, 1, &ids[1 - round % 2], cu_full, d.q.data(),
                                  d.k.data(), d.v.data(), d.out.data(), nullptr));
    MKV_REQUIRE_OK(minikv_sequence_release(c.get(), 0));
    MKV_REQUIRE_OK(minikv_sequence_release(c.get(), 1));
  }
  minikv_memory_stats st;
  st.struct_size = sizeof(st);
  MKV_REQUIRE_OK(minikv_memory_stats_get(c.get(), &st));
  CHECK(st.used_bytes == 0);
  CHECK(st.tokens_seen == 0);
  // Both slots can still take a full prompt at once.
  const int32_t cu2[3] = {0, 128, 256};
  Data big(256, 5);
  MKV_REQUIRE_OK(minikv_prefill(c.get(), 0, 2, ids, cu2, big.q.data(), big.k.data(), big.v.data(),
                                big.out.data(), nullptr));
}

TEST_CASE("lifecycle: kept positions with capacity 0 and partial") {
  test::CachePtr c = test::make_cache(config());
  Data d(100, 6);
  prefill(c.get(), 0, 1, 100, d);
  uint32_t count = 12345;
  MKV_REQUIRE_OK(minikv_kept_positions(c.get(), 1, 0, 0, nullptr, 0, &count));
  REQUIRE(count == 50);  // 25 heavy + 25 recent
  std::vector<int32_t> all(count + 4, -1);
  uint32_t got = 0;
  MKV_REQUIRE_OK(minikv_kept_positions(c.get(), 1, 0, 0, all.data(), count + 4, &got));
  CHECK(got == 50);
  CHECK(std::all_of(all.begin() + 50, all.end(), [](int32_t x) { return x == -1; }));
  all.resize(50);
  CHECK(std::is_sorted(all.begin(), all.end()));
  CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
  for (int32_t p = 75; p < 100; ++p) CHECK(std::binary_search(all.begin(), all.end(), p));
  CHECK(all.front() >= 0);
  // Partial: the first `capacity` positions, nothing written past them, *count = total.
  std::vector<int32_t> part(20, -1);
  got = 0;
  MKV_REQUIRE_OK(minikv_kept_positions(c.get(), 1, 0, 0, part.data(), 7, &got));
  CHECK(got == 50);
  CHECK(std::equal(part.begin(), part.begin() + 7, all.begin()));
  CHECK(std::all_of(part.begin() + 7, part.end(), [](int32_t x) { return x == -1; }));
  // Capacity 0 with a non-NULL array writes nothing.
  MKV_REQUIRE_OK(minikv_kept_positions(c.get(), 1, 0, 0, part.data() + 10, 0, &got));
  CHECK(part[10] == -1);
  // Appended tokens are not prompt positions: the count does not change.
  const uint32_t seq = 1;
  for (int i = 0; i < 40; ++i)
    MKV_REQUIRE_OK(minikv_append(c.get(), 0, 1, &seq, d.k.data(), d.v.data(), nullptr));
  MKV_REQUIRE_OK(minikv_kept_positions(c.get(), 1, 0, 0, nullptr, 0, &got));
  CHECK(got == 50);
  CHECK(test::kept_positions(c.get(), 1, 0, 0) == all);
}

TEST_CASE("lifecycle: max_seq_len bounds prompt + generation") {
  minikv_config cfg = config(1, 1);
  cfg.max_seq_len = 40;
  test::CachePtr c = test::make_cache(cfg);
  Data d(40, 7);
  prefill(c.get(), 0, 0, 37, d);
  const uint32_t seq = 0;
  for (int i = 0; i < 3; ++i)
    MKV_REQUIRE_OK(minikv_append(c.get(), 0, 1, &seq, d.k.data(), d.v.data(), nullptr));
  const std::vector<uint8_t> before = decode_bytes(c.get(), 0, 0, d);
  CHECK(minikv_append(c.get(), 0, 1, &seq, d.k.data(), d.v.data(), nullptr) ==
        MINIKV_ERR_CAPACITY_EXCEEDED);
  CHECK(std::string(minikv_last_error_message()).find("max_seq_len") != std::string::npos);
  uint64_t seen = 0, cached = 0;
  lengths(c.get(), 0, 0, seen, cached);
  CHECK(seen == 40);
  CHECK(cached == 21);  // 18 kept + 3 appended
  CHECK(decode_bytes(c.get(), 0, 0, d) == before);
  // A full-length prompt is accepted; one token more is not.
  MKV_REQUIRE_OK(minikv_sequence_release(c.get(), 0));
  prefill(c.get(), 0, 0, 40, d);
  CHECK(minikv_append(c.get(), 0, 1, &seq, d.k.data(), d.v.data(), nullptr) ==
        MINIKV_ERR_CAPACITY_EXCEEDED);
}

TEST_CASE("lifecycle: a prompt that keeps nothing decodes after its first append") {
  minikv_config cfg = config(1, 1);
  cfg.heavy_ratio = 0.0f;
  cfg.recent_ratio = 0.0f;
  test::CachePtr c = test::make_cache(cfg);
  Data d(30, 8);
  prefill(c.get(), 0, 0, 30, d);
  uint64_t seen = 0, cached = 0;
  lengths(c.get(), 0, 0, seen, cached);
  CHECK(seen == 30);
  CHECK(cached == 0);
  uint32_t count = 9;
  MKV_REQUIRE_OK(minikv_kept_positions(c.get(), 0, 0, 0, nullptr, 0, &count));
  CHECK(count == 0);
  const uint32_t seq = 0;
  test::Buf o(MINIKV_DTYPE_F16, size_t(kH) * kD);
  CHECK(minikv_decode(c.get(), 0, 1, &seq, d.q.data(), o.data(), nullptr) == MINIKV_ERR_BAD_STATE);
  CHECK(std::string(minikv_cache_last_error(c.get())).find("no cached token") != std::string::npos);
  // After one append the token attends to itself only: out = its value (per KV head).
  MKV_REQUIRE_OK(minikv_append(c.get(), 0, 1, &seq, d.k.data(), d.v.data(), nullptr));
  MKV_REQUIRE_OK(minikv_decode(c.get(), 0, 1, &seq, d.q.data(), o.data(), nullptr));
  for (uint32_t h = 0; h < kH; ++h)
    for (uint32_t ch = 0; ch < kD; ++ch) CHECK(o.get(size_t(h) * kD + ch) == d.v.get(ch));
}

TEST_CASE("lifecycle: destroy with live sequences + many caches") {
  for (int i = 0; i < 10; ++i) {
    test::CachePtr c = test::make_cache(config());
    Data d(50, 9 + i);
    prefill(c.get(), 0, 0, 50, d);
    prefill(c.get(), 1, 1, 50, d);
  }  // destroyed here with sequences in use
  minikv_cache_destroy(nullptr);
}

}  // TEST_SUITE
