// Every public call with every bad argument: the status, a message naming the offending
// argument (thread-local and per-handle), and a cache left exactly as it was.
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

namespace {

constexpr uint32_t kH = 4, kHkv = 2, kD = 64, kL = 40, kSeqs = 3;

// A cache with sequence 0 prefilled on layer 0 (of 2), sequences 1, 2 empty, and buffers
// for every call.
struct Fixture {
  test::CachePtr cache;
  test::Buf q, k, v, out, q1, k1, v1, o1;
  Fixture()
      : q(MINIKV_DTYPE_F32, size_t(2 * kL) * kH * kD), k(MINIKV_DTYPE_F32, size_t(2 * kL) * kHkv * kD),
        v(MINIKV_DTYPE_F32, size_t(2 * kL) * kHkv * kD), out(MINIKV_DTYPE_F32, size_t(2 * kL) * kH * kD),
        q1(MINIKV_DTYPE_F32, size_t(kSeqs) * kH * kD), k1(MINIKV_DTYPE_F32, size_t(kSeqs) * kHkv * kD),
        v1(MINIKV_DTYPE_F32, size_t(kSeqs) * kHkv * kD), o1(MINIKV_DTYPE_F32, size_t(kSeqs) * kH * kD) {
    minikv_config c = test::cpu_config(2, kH, kHkv, kD);
    c.max_sequences = kSeqs;
    c.max_seq_len = 64;
    c.residual_length = 16;
    cache = test::make_cache(c);
    test::Rng rng(1);
    for (test::Buf *b : {&q, &k, &v, &q1, &k1, &v1}) b->fill_normal(rng);
    const uint32_t seq = 0;
    const int32_t cu[2] = {0, static_cast<int32_t>(kL)};
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, 1, &seq, cu, q.data(), k.data(), v.data(),
                                  out.data(), nullptr));
  }

  // Everything observable about the cache: lengths of every (seq, layer), stats, kept
  // positions and a decode of sequence 0 (decode reads only).
  std::vector<uint8_t> snapshot() {
    std::vector<uint8_t> s;
    auto put = [&](const void *p, size_t n) {
      s.insert(s.end(), static_cast<const uint8_t *>(p), static_cast<const uint8_t *>(p) + n);
    };
    for (uint32_t seq = 0; seq < kSeqs; ++seq) {
      for (uint32_t layer = 0; layer < 2; ++layer) {
        uint64_t seen = 0, cached = 0;
        REQUIRE(minikv_sequence_length(cache.get(), seq, layer, &seen, &cached) == MINIKV_OK);
        put(&seen, 8);
        put(&cached, 8);
      }
    }
    minikv_memory_stats st;
    std::memset(&st, 0, sizeof(st));
    st.struct_size = sizeof(st);
    REQUIRE(minikv_memory_stats_get(cache.get(), &st) == MINIKV_OK);
    put(&st, sizeof(st));
    for (uint32_t h = 0; h < kHkv; ++h) {
      const std::vector<int32_t> kept = test::kept_positions(cache.get(), 0, 0, h);
      put(kept.data(), kept.size() * 4);
    }
    const uint32_t seq = 0;
    test::Buf o(MINIKV_DTYPE_F32, size_t(kH) * kD);
    REQUIRE(minikv_decode(cache.get(), 0, 1, &seq, q1.data(), o.data(), nullptr) == MINIKV_OK);
    put(o.data(), size_t(kH) * kD * 4);
    return s;
  }
};

// Checks status, that both error texts name `what` (and the call), and that the cache did
// not change.
#define EXPECT_FAILS(fx, call_name, expr, status, what)                                   \
  do {                                                                                    \
    const std::vector<uint8_t> before_ = (fx).snapshot();                                  \
    const minikv_status st_ = (expr);                                                     \
    const std::string thread_msg_ = minikv_last_error_message();                          \
    const std::string handle_msg_ = minikv_cache_last_error((fx).cache.get());            \
    INFO(#expr, " -> ", std::string(minikv_status_string(st_)), ": ", thread_msg_);                   \
    CHECK(st_ == (status));                                                               \
    CHECK(thread_msg_.find(what) != std::string::npos);                                   \
    CHECK(thread_msg_.find(call_name) != std::string::npos);                              \
    CHECK(handle_msg_ == thread_msg_);                                                    \
    CHECK((fx).snapshot() == before_);                                                    \
  } while (0)

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("errors: NULL cache handle in every call") {
  uint32_t seq = 0, count = 0;
  int32_t cu[2] = {0, 1};
  float buf[4096] = {0};
  uint64_t a = 0;
  minikv_memory_stats st;
  st.struct_size = sizeof(st);
  struct Call {
    const char *name;
    minikv_status status;
  };
  const Call calls[] = {
      {"minikv_prefill", minikv_prefill(nullptr, 0, 1, &seq, cu, buf, buf, buf, buf, nullptr)},
      {"minikv_append", minikv_append(nullptr, 0, 1, &seq, buf, buf, nullptr)},
      {"minikv_decode", minikv_decode(nullptr, 0, 1, &seq, buf, buf, nullptr)},
      {"minikv_append_decode",
       minikv_append_decode(nullptr, 0, 1, &seq, buf, buf, buf, buf + 2048, nullptr)},
      {"minikv_sequence_release", minikv_sequence_release(nullptr, 0)},
      {"minikv_sequence_length", minikv_sequence_length(nullptr, 0, 0, &a, &a)},
      {"minikv_kept_positions", minikv_kept_positions(nullptr, 0, 0, 0, nullptr, 0, &count)},
      {"minikv_cache_backend", minikv_cache_backend(nullptr, nullptr)},
      {"minikv_memory_stats_get", minikv_memory_stats_get(nullptr, &st)},
  };
  for (const Call &c : calls) {
    CAPTURE(c.name);
    CHECK(c.status == MINIKV_ERR_INVALID_ARGUMENT);
  }
  // The message of the last one names the call and the handle.
  const std::string msg = minikv_last_error_message();
  CHECK(msg.find("minikv_memory_stats_get") != std::string::npos);
  CHECK(msg.find("cache") != std::string::npos);
  // Each call sets its own message.
  CHECK(minikv_decode(nullptr, 0, 1, &seq, buf, buf, nullptr) == MINIKV_ERR_INVALID_ARGUMENT);
  CHECK(std::string(minikv_last_error_message()).find("minikv_decode") != std::string::npos);
  const char *null_handle = minikv_cache_last_error(nullptr);
  REQUIRE(null_handle != nullptr);
  CHECK(std::string(null_handle).find("NULL") != std::string::npos);
}

TEST_CASE("errors: minikv_prefill") {
  Fixture fx;
  const uint32_t one = 1, seq0 = 0;
  const int32_t cu[2] = {0, 10};
  void *q = fx.q.data(), *k = fx.k.data(), *v = fx.v.data(), *o = fx.out.data();
  const char *call = "minikv_prefill";
  SUBCASE("NULL seq_ids") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, nullptr, cu, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "seq_ids");
  }
  SUBCASE("NULL cu_seqlens") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &one, nullptr, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "cu_seqlens");
  }
  SUBCASE("NULL q") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &one, cu, nullptr, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "q is NULL");
  }
  SUBCASE("NULL k") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &one, cu, q, nullptr, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "k is NULL");
  }
  SUBCASE("NULL v") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &one, cu, q, k, nullptr, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "v is NULL");
  }
  SUBCASE("NULL out") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &one, cu, q, k, v, nullptr, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "out is NULL");
  }
  SUBCASE("layer out of range") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 2, 1, &one, cu, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "layer");
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0xffffffffu, 1, &one, cu, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "layer");
  }
  SUBCASE("n_seqs 0 and above max_sequences") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 0, &one, cu, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "n_seqs");
    const uint32_t ids[4] = {1, 2, 0, 3};
    const int32_t cu4[5] = {0, 1, 2, 3, 4};
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 1, 4, ids, cu4, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "n_seqs");
  }
  SUBCASE("seq_id out of range") {
    const uint32_t ids[2] = {1, kSeqs};
    const int32_t cu2[3] = {0, 5, 10};
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 1, 2, ids, cu2, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "seq_ids[1]");
  }
  SUBCASE("duplicate seq_ids") {
    const uint32_t ids[2] = {2, 2};
    const int32_t cu2[3] = {0, 5, 10};
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 1, 2, ids, cu2, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "seq_ids");
    CHECK(std::string(minikv_last_error_message()).find("twice") != std::string::npos);
  }
  SUBCASE("cu_seqlens[0] != 0") {
    const int32_t bad[2] = {1, 10};
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &one, bad, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "cu_seqlens[0]");
  }
  SUBCASE("cu_seqlens not increasing (empty or negative length)") {
    const uint32_t ids[2] = {1, 2};
    const int32_t empty[3] = {0, 5, 5};
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 2, ids, empty, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "cu_seqlens");
    const int32_t decreasing[3] = {0, 8, 3};
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 2, ids, decreasing, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "cu_seqlens");
  }
  SUBCASE("prompt longer than max_seq_len") {
    const int32_t long_cu[2] = {0, 65};
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &one, long_cu, q, k, v, o, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "max_seq_len");
  }
  SUBCASE("stream must be NULL on the CPU backend") {
    int dummy = 0;
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &one, cu, q, k, v, o, &dummy),
                 MINIKV_ERR_INVALID_ARGUMENT, "stream");
  }
  SUBCASE("prefill twice is BAD_STATE, also inside a batch") {
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 1, &seq0, cu, q, k, v, o, nullptr),
                 MINIKV_ERR_BAD_STATE, "already prefilled");
    const uint32_t ids[2] = {1, 0};  // 1 is fresh, 0 is not: nothing happens to either
    const int32_t cu2[3] = {0, 5, 10};
    EXPECT_FAILS(fx, call, minikv_prefill(fx.cache.get(), 0, 2, ids, cu2, q, k, v, o, nullptr),
                 MINIKV_ERR_BAD_STATE, "sequence 0");
  }
}

TEST_CASE("errors: minikv_append") {
  Fixture fx;
  const uint32_t seq0 = 0, seq1 = 1;
  void *k = fx.k1.data(), *v = fx.v1.data();
  const char *call = "minikv_append";
  SUBCASE("NULL pointers") {
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 1, nullptr, k, v, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "seq_ids");
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 1, &seq0, nullptr, v, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "k is NULL");
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 1, &seq0, k, nullptr, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "v is NULL");
  }
  SUBCASE("ids and sizes") {
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 2, 1, &seq0, k, v, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "layer");
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 0, &seq0, k, v, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "n_seqs");
    const uint32_t bad = kSeqs;
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 1, &bad, k, v, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "seq_ids[0]");
    const uint32_t dup[2] = {0, 0};
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 2, dup, k, v, nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "twice");
    int dummy = 0;
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 1, &seq0, k, v, &dummy),
                 MINIKV_ERR_INVALID_ARGUMENT, "stream");
  }
  SUBCASE("before prefill is BAD_STATE (empty slot, other layer, inside a batch)") {
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 1, &seq1, k, v, nullptr),
                 MINIKV_ERR_BAD_STATE, "not been prefilled");
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 1, 1, &seq0, k, v, nullptr),
                 MINIKV_ERR_BAD_STATE, "layer 1");
    const uint32_t ids[2] = {0, 1};
    EXPECT_FAILS(fx, call, minikv_append(fx.cache.get(), 0, 2, ids, k, v, nullptr),
                 MINIKV_ERR_BAD_STATE, "sequence 1");
  }
}

TEST_CASE("errors: minikv_decode") {
  Fixture fx;
  const uint32_t seq0 = 0, seq2 = 2;
  void *q = fx.q1.data(), *o = fx.o1.data();
  const char *call = "minikv_decode";
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 0, 1, nullptr, q, o, nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "seq_ids");
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 0, 1, &seq0, nullptr, o, nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "q is NULL");
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 0, 1, &seq0, q, nullptr, nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 5, 1, &seq0, q, o, nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "layer");
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 0, 0, &seq0, q, o, nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "n_seqs");
  const uint32_t bad = 99;
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 0, 1, &bad, q, o, nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "seq_ids[0]");
  const uint32_t dup[3] = {0, 2, 0};
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 0, 3, dup, q, o, nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "seq_ids[2]");
  int dummy = 0;
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 0, 1, &seq0, q, o, &dummy),
               MINIKV_ERR_INVALID_ARGUMENT, "stream");
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 0, 1, &seq2, q, o, nullptr),
               MINIKV_ERR_BAD_STATE, "not been prefilled");
  EXPECT_FAILS(fx, call, minikv_decode(fx.cache.get(), 1, 1, &seq0, q, o, nullptr),
               MINIKV_ERR_BAD_STATE, "layer 1");
}

TEST_CASE("errors: minikv_append_decode") {
  // Every check of append and of decode, all before anything changes: no token appended and
  // out not written when the call fails.
  Fixture fx;
  const uint32_t seq0 = 0, seq1 = 1;
  void *q = fx.q1.data(), *k = fx.k1.data(), *v = fx.v1.data(), *o = fx.o1.data();
  const char *call = "minikv_append_decode";
  fx.o1.fill(7.0);
  const test::Buf o_before = fx.o1;
  auto ad = [&](uint32_t layer, uint32_t n, const uint32_t *ids, const void *qq, const void *kk,
                const void *vv, void *oo, void *stream = nullptr) {
    return minikv_append_decode(fx.cache.get(), layer, n, ids, qq, kk, vv, oo, stream);
  };
  SUBCASE("NULL pointers") {
    EXPECT_FAILS(fx, call, ad(0, 1, nullptr, q, k, v, o), MINIKV_ERR_INVALID_ARGUMENT, "seq_ids");
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, nullptr, k, v, o), MINIKV_ERR_INVALID_ARGUMENT, "q is NULL");
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, nullptr, v, o), MINIKV_ERR_INVALID_ARGUMENT, "k is NULL");
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, k, nullptr, o), MINIKV_ERR_INVALID_ARGUMENT, "v is NULL");
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, k, v, nullptr), MINIKV_ERR_INVALID_ARGUMENT, "out is NULL");
  }
  SUBCASE("ids and sizes and stream") {
    EXPECT_FAILS(fx, call, ad(2, 1, &seq0, q, k, v, o), MINIKV_ERR_INVALID_ARGUMENT, "layer");
    EXPECT_FAILS(fx, call, ad(0, 0, &seq0, q, k, v, o), MINIKV_ERR_INVALID_ARGUMENT, "n_seqs");
    const uint32_t bad = kSeqs, dup[2] = {0, 0};
    EXPECT_FAILS(fx, call, ad(0, 1, &bad, q, k, v, o), MINIKV_ERR_INVALID_ARGUMENT, "seq_ids[0]");
    EXPECT_FAILS(fx, call, ad(0, 2, dup, q, k, v, o), MINIKV_ERR_INVALID_ARGUMENT, "twice");
    int dummy = 0;
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, k, v, o, &dummy), MINIKV_ERR_INVALID_ARGUMENT, "stream");
  }
  SUBCASE("before prefill is BAD_STATE (empty slot, other layer, inside a batch)") {
    EXPECT_FAILS(fx, call, ad(0, 1, &seq1, q, k, v, o), MINIKV_ERR_BAD_STATE, "not been prefilled");
    EXPECT_FAILS(fx, call, ad(1, 1, &seq0, q, k, v, o), MINIKV_ERR_BAD_STATE, "layer 1");
    const uint32_t ids[2] = {0, 1};
    EXPECT_FAILS(fx, call, ad(0, 2, ids, q, k, v, o), MINIKV_ERR_BAD_STATE, "sequence 1");
  }
  SUBCASE("out overlapping an input") {
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, k, v, q), MINIKV_ERR_INVALID_ARGUMENT, "overlaps q");
    // out's last element is v's first: one shared element is enough.
    std::vector<float> joined(size_t(kH) * kD + size_t(kHkv) * kD);
    float *jo = joined.data(), *jv = joined.data() + size_t(kH) * kD - 1;
    std::memcpy(jv, v, size_t(kHkv) * kD * 4);
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, k, jv, jo), MINIKV_ERR_INVALID_ARGUMENT, "overlaps v");
    // Adjacent (out ends where k begins) is fine.
    float *jk = joined.data() + size_t(kH) * kD;
    std::memcpy(jk, k, size_t(kHkv) * kD * 4);
    MKV_REQUIRE_OK(ad(0, 1, &seq0, q, jk, v, jo));
  }
  SUBCASE("a non-finite q appends nothing") {
    test::Buf bad_q = fx.q1;
    bad_q.set(kD + 5, std::nanf(""));
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, bad_q.data(), k, v, o), MINIKV_ERR_INVALID_ARGUMENT,
                 "q[0][1][5] (seq_id 0, sequence 0, head 1, channel 5) is NaN");
    test::Buf bad_v = fx.v1;
    bad_v.set(3, -INFINITY);
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, k, bad_v.data(), o), MINIKV_ERR_INVALID_ARGUMENT,
                 "v[0][0][3]");
  }
  SUBCASE("misaligned tensors") {
    auto shifted = [](void *p) { return static_cast<uint8_t *>(p) + 2; };
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, shifted(q), k, v, o), MINIKV_ERR_INVALID_ARGUMENT, "q (");
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, k, v, shifted(o)), MINIKV_ERR_INVALID_ARGUMENT, "out (");
  }
  SUBCASE("max_seq_len reached: CAPACITY_EXCEEDED for the whole batch") {
    // The fixture's max_seq_len is 64 and its prompt 40 tokens: 24 appends fill it.
    for (int i = 0; i < 24; ++i) MKV_REQUIRE_OK(ad(0, 1, &seq0, q, k, v, o));
    fx.o1.fill(7.0);
    EXPECT_FAILS(fx, call, ad(0, 1, &seq0, q, k, v, o), MINIKV_ERR_CAPACITY_EXCEEDED, "max_seq_len");
  }
  CHECK(fx.o1.bit_equal(o_before));
}

TEST_CASE("errors: sequence calls + kept positions + stats") {
  Fixture fx;
  uint64_t seen = 0, cached = 0;
  uint32_t count = 0;
  int32_t pos[64];
  EXPECT_FAILS(fx, "minikv_sequence_release", minikv_sequence_release(fx.cache.get(), kSeqs),
               MINIKV_ERR_INVALID_ARGUMENT, "seq_id");
  EXPECT_FAILS(fx, "minikv_sequence_length",
               minikv_sequence_length(fx.cache.get(), kSeqs, 0, &seen, &cached),
               MINIKV_ERR_INVALID_ARGUMENT, "seq_id");
  EXPECT_FAILS(fx, "minikv_sequence_length",
               minikv_sequence_length(fx.cache.get(), 0, 2, &seen, &cached),
               MINIKV_ERR_INVALID_ARGUMENT, "layer");
  const char *kp = "minikv_kept_positions";
  EXPECT_FAILS(fx, kp, minikv_kept_positions(fx.cache.get(), kSeqs, 0, 0, pos, 64, &count),
               MINIKV_ERR_INVALID_ARGUMENT, "seq_id");
  EXPECT_FAILS(fx, kp, minikv_kept_positions(fx.cache.get(), 0, 2, 0, pos, 64, &count),
               MINIKV_ERR_INVALID_ARGUMENT, "layer");
  EXPECT_FAILS(fx, kp, minikv_kept_positions(fx.cache.get(), 0, 0, kHkv, pos, 64, &count),
               MINIKV_ERR_INVALID_ARGUMENT, "kv_head");
  EXPECT_FAILS(fx, kp, minikv_kept_positions(fx.cache.get(), 0, 0, 0, pos, 64, nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "count");
  EXPECT_FAILS(fx, kp, minikv_kept_positions(fx.cache.get(), 0, 0, 0, nullptr, 5, &count),
               MINIKV_ERR_INVALID_ARGUMENT, "positions");
  EXPECT_FAILS(fx, kp, minikv_kept_positions(fx.cache.get(), 1, 0, 0, pos, 64, &count),
               MINIKV_ERR_BAD_STATE, "not been prefilled");
  EXPECT_FAILS(fx, kp, minikv_kept_positions(fx.cache.get(), 0, 1, 0, pos, 64, &count),
               MINIKV_ERR_BAD_STATE, "layer 1");
  EXPECT_FAILS(fx, "minikv_cache_backend", minikv_cache_backend(fx.cache.get(), nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "backend");
  const char *ms = "minikv_memory_stats_get";
  EXPECT_FAILS(fx, ms, minikv_memory_stats_get(fx.cache.get(), nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "out");
  minikv_memory_stats st;
  std::memset(&st, 0, sizeof(st));
  for (uint32_t size : {0u, 4u, uint32_t(sizeof(st) - 8)}) {
    st.struct_size = size;
    EXPECT_FAILS(fx, ms, minikv_memory_stats_get(fx.cache.get(), &st),
                 MINIKV_ERR_VERSION_MISMATCH, "struct_size");
  }
}

TEST_CASE("errors: last-error texts are per thread and per handle") {
  Fixture fx;
  const uint32_t bad = 77;
  float buf[1024] = {0};
  REQUIRE(minikv_decode(fx.cache.get(), 0, 1, &bad, buf, buf, nullptr) == MINIKV_ERR_INVALID_ARGUMENT);
  const std::string main_msg = minikv_last_error_message();
  CHECK(main_msg.find("77") != std::string::npos);
  // A successful call does not clear either text.
  const uint32_t seq0 = 0;
  MKV_REQUIRE_OK(minikv_decode(fx.cache.get(), 0, 1, &seq0, fx.q1.data(), fx.o1.data(), nullptr));
  CHECK(std::string(minikv_last_error_message()) == main_msg);
  CHECK(std::string(minikv_cache_last_error(fx.cache.get())) == main_msg);
  std::string other_thread_before, other_thread_after, handle_from_other;
  std::thread t([&] {
    other_thread_before = minikv_last_error_message();   // nothing failed on this thread
    handle_from_other = minikv_cache_last_error(fx.cache.get());  // the handle's text
    const uint32_t bad_layer_seq = 0;
    (void)minikv_decode(fx.cache.get(), 9, 1, &bad_layer_seq, buf, buf, nullptr);
    other_thread_after = minikv_last_error_message();
  });
  t.join();
  CHECK(other_thread_before.empty());
  CHECK(handle_from_other == main_msg);
  CHECK(other_thread_after.find("layer") != std::string::npos);
  // The other thread's failure changed the handle's text but not this thread's.
  CHECK(std::string(minikv_last_error_message()) == main_msg);
  CHECK(std::string(minikv_cache_last_error(fx.cache.get())) == other_thread_after);
  // Handles are independent.
  Fixture other;
  CHECK(std::string(minikv_cache_last_error(other.cache.get())).empty());
}

TEST_CASE("errors: non-finite inputs are rejected by the CPU backend and change nothing") {
  // minikv.h: inputs must be finite. A NaN query used to evict every key up to its position
  // (its scores are NaN), a NaN in a value group's first channel poisoned the group, and an
  // inf in K/V made every later decode of the sequence NaN, all with status OK.
  Fixture fx;
  const float nan = std::nanf(""), inf = INFINITY;
  const uint32_t ids[2] = {1, 2};
  const int32_t cu[3] = {0, 10, 30};  // seq_id 1: tokens 0-9, seq_id 2: tokens 10-29
  SUBCASE("prefill") {
    fx.q.set((size_t(15) * kH + 3) * kD + 7, nan);  // token 15 = seq_id 2, position 5
    EXPECT_FAILS(fx, "minikv_prefill",
                 minikv_prefill(fx.cache.get(), 0, 2, ids, cu, fx.q.data(), fx.k.data(),
                                fx.v.data(), fx.out.data(), nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT,
                 "q[15][3][7] (seq_id 2, position 5, head 3, channel 7) is NaN");
    fx.q.set((size_t(15) * kH + 3) * kD + 7, 0.5);
    fx.v.set((size_t(29) * kHkv + 1) * kD, -inf);
    EXPECT_FAILS(fx, "minikv_prefill",
                 minikv_prefill(fx.cache.get(), 0, 2, ids, cu, fx.q.data(), fx.k.data(),
                                fx.v.data(), fx.out.data(), nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "v[29][1][0] (seq_id 2, position 19, kv head 1");
  }
  SUBCASE("append") {
    const uint32_t seq = 0;
    test::Buf k = fx.k1;  // (fx.q1 serves the snapshot's decode)
    k.set(kD + 3, inf);   // kv head 1, channel 3 of the one sequence
    EXPECT_FAILS(fx, "minikv_append",
                 minikv_append(fx.cache.get(), 0, 1, &seq, k.data(), fx.v1.data(), nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "k[0][1][3] (seq_id 0, sequence 0, kv head 1, channel 3) is +inf");
  }
  SUBCASE("decode") {
    const uint32_t seq = 0;
    test::Buf q = fx.q1;
    q.set(2 * kD + 9, -inf);
    EXPECT_FAILS(fx, "minikv_decode",
                 minikv_decode(fx.cache.get(), 0, 1, &seq, q.data(), fx.o1.data(), nullptr),
                 MINIKV_ERR_INVALID_ARGUMENT, "q[0][2][9] (seq_id 0, sequence 0, head 2, channel 9) is -inf");
  }
  SUBCASE("every dtype") {
    for (minikv_dtype dt : {MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
      CAPTURE(dt);
      test::CachePtr cache = test::make_cache(test::cpu_config(1, kH, kHkv, kD, dt));
      test::Buf q(dt, size_t(kL) * kH * kD), k(dt, size_t(kL) * kHkv * kD),
          v(dt, size_t(kL) * kHkv * kD), out(dt, size_t(kL) * kH * kD);
      q.fill(0.25);
      k.fill(0.5);
      v.fill(1.0);
      k.set(kHkv * kD * 7, dt == MINIKV_DTYPE_F16 ? 70000.0 : nan);  // F16: rounds to +inf
      const uint32_t seq = 0;
      const int32_t one[2] = {0, static_cast<int32_t>(kL)};
      CHECK(minikv_prefill(cache.get(), 0, 1, &seq, one, q.data(), k.data(), v.data(), out.data(),
                           nullptr) == MINIKV_ERR_INVALID_ARGUMENT);
      CHECK(std::string(minikv_last_error_message()).find("k[7][0][0]") != std::string::npos);
      uint64_t seen = 1;
      MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), 0, 0, &seen, nullptr));
      CHECK(seen == 0);
    }
  }
}

TEST_CASE("errors: misaligned tensors are rejected naming the alignment") {
  // minikv.h: q/k/v/out aligned to the element size (16 bytes for CUDA). Misaligned host
  // pointers were read as they came (misaligned loads, undefined behaviour: UBSan reported
  // them in cpu_backend.cpp).
  Fixture fx;
  const uint32_t seq = 1;
  const int32_t cu[2] = {0, 8};
  auto shifted = [](test::Buf &b) { return static_cast<uint8_t *>(b.data()) + 2; };
  EXPECT_FAILS(fx, "minikv_prefill",
               minikv_prefill(fx.cache.get(), 0, 1, &seq, cu, fx.q.data(), shifted(fx.k),
                              fx.v.data(), fx.out.data(), nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "k (");
  CHECK(std::string(minikv_last_error_message()).find("must be aligned to 4 bytes") != std::string::npos);
  EXPECT_FAILS(fx, "minikv_prefill",
               minikv_prefill(fx.cache.get(), 0, 1, &seq, cu, fx.q.data(), fx.k.data(),
                              fx.v.data(), shifted(fx.out), nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "out (");
  const uint32_t zero = 0;
  EXPECT_FAILS(fx, "minikv_append",
               minikv_append(fx.cache.get(), 0, 1, &zero, fx.k1.data(), shifted(fx.v1), nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "v (");
  EXPECT_FAILS(fx, "minikv_decode",
               minikv_decode(fx.cache.get(), 0, 1, &zero, shifted(fx.q1), fx.o1.data(), nullptr),
               MINIKV_ERR_INVALID_ARGUMENT, "q (");
  // 16-bit dtypes: 2-byte alignment is enough on the CPU.
  test::CachePtr half = test::make_cache(test::cpu_config(1, kH, kHkv, kD, MINIKV_DTYPE_F16));
  test::Buf q(MINIKV_DTYPE_F16, size_t(9) * kH * kD), k(MINIKV_DTYPE_F16, size_t(9) * kHkv * kD),
      v(MINIKV_DTYPE_F16, size_t(9) * kHkv * kD), out(MINIKV_DTYPE_F16, size_t(9) * kH * kD);
  q.fill(0.5);
  k.fill(0.5);
  v.fill(0.5);
  auto odd = [](test::Buf &b) { return static_cast<uint8_t *>(b.data()) + 1; };
  auto even = [](test::Buf &b) { return static_cast<uint8_t *>(b.data()) + 2; };
  CHECK(minikv_prefill(half.get(), 0, 1, &zero, cu, q.data(), odd(k), v.data(), out.data(),
                       nullptr) == MINIKV_ERR_INVALID_ARGUMENT);
  CHECK(std::string(minikv_last_error_message()).find("must be aligned to 2 bytes") != std::string::npos);
  MKV_REQUIRE_OK(minikv_prefill(half.get(), 0, 1, &zero, cu, even(q), even(k), even(v),
                                even(out), nullptr));
}

}  // TEST_SUITE
