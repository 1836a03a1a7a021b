// Pool exhaustion: a prefill or a flushing append that needs more blocks than are free
// fails with MINIKV_ERR_CAPACITY_EXCEEDED and changes nothing (lengths, stats, kept
// positions and the decode output of every sequence are identical before and after); after
// a release the same call succeeds and the cache still computes the oracle's answer.
#include <cstring>
#include <string>
#include <vector>

#include "../examples/engine/pool_blocks.h"
#include "cache_model.hpp"
#include "support.hpp"

namespace {

constexpr uint32_t kH = 2, kHkv = 1, kD = 64, kG = 16, kR = 16, kSeqs = 3;
constexpr minikv_dtype kDt = MINIKV_DTYPE_F32;

struct Pool {
  test::CachePtr cache;
  test::Buf q, k, v, out;
  test::Rng rng{5};
  Pool() : q(kDt, 400 * kH * kD), k(kDt, 400 * kHkv * kD), v(kDt, 400 * kHkv * kD), out(kDt, 400 * kH * kD) {
    minikv_config c = test::cpu_config(1, kH, kHkv, kD, kDt);
    c.max_sequences = kSeqs;
    c.max_seq_len = 200;
    c.group_size = kG;
    c.residual_length = kR;
    c.max_tokens = 96;  // 6 blocks of 16 tokens
    cache = test::make_cache(c);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
  }
  minikv_status prefill(uint32_t seq, uint32_t L) {
    const int32_t cu[2] = {0, static_cast<int32_t>(L)};
    return minikv_prefill(cache.get(), 0, 1, &seq, cu, q.data(), k.data(), v.data(), out.data(),
                          nullptr);
  }
  // Observable state: lengths and kept positions of every slot, stats, and a decode of
  // every prefilled sequence with a fixed query.
  std::vector<uint8_t> snapshot() {
    std::vector<uint8_t> s;
    auto put = [&](const void *p, size_t n) {
      s.insert(s.end(), static_cast<const uint8_t *>(p), static_cast<const uint8_t *>(p) + n);
    };
    for (uint32_t seq = 0; seq < kSeqs; ++seq) {
      uint64_t seen = 0, cached = 0;
      REQUIRE(minikv_sequence_length(cache.get(), seq, 0, &seen, &cached) == MINIKV_OK);
      put(&seen, 8);
      put(&cached, 8);
      if (seen == 0) continue;
      const std::vector<int32_t> kept = test::kept_positions(cache.get(), seq, 0, 0);
      put(kept.data(), kept.size() * 4);
      if (cached == 0) continue;
      test::Buf o(kDt, size_t(kH) * kD);
      REQUIRE(minikv_decode(cache.get(), 0, 1, &seq, q.data(), o.data(), nullptr) == MINIKV_OK);
      put(o.data(), size_t(kH) * kD * 4);
    }
    minikv_memory_stats st;
    std::memset(&st, 0, sizeof(st));
    st.struct_size = sizeof(st);
    REQUIRE(minikv_memory_stats_get(cache.get(), &st) == MINIKV_OK);
    put(&st, sizeof(st));
    return s;
  }
};

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("capacity: prefill that does not fit changes nothing and fits after a release") {
  Pool p;
  MKV_REQUIRE_OK(p.prefill(0, 100));  // keeps 50: 48 quantized = 3 blocks, 2 residual
  MKV_REQUIRE_OK(p.prefill(1, 64));   // keeps 32 = 2 blocks; 1 block left
  const std::vector<uint8_t> before = p.snapshot();
  CHECK(p.prefill(2, 100) == MINIKV_ERR_CAPACITY_EXCEEDED);  // needs 3
  const std::string msg = minikv_last_error_message();
  CHECK(msg.find("minikv_prefill") != std::string::npos);
  CHECK(msg.find("blocks") != std::string::npos);
  CHECK(std::string(minikv_cache_last_error(p.cache.get())) == msg);
  CHECK(p.snapshot() == before);
  // A batch that fits only partly changes nothing either.
  const uint32_t ids[2] = {2, 1};
  const int32_t cu[3] = {0, 40, 140};  // seq 2 keeps 20 (1 block), seq 1 keeps 50 (3)
  CHECK(minikv_prefill(p.cache.get(), 0, 2, ids, cu, p.q.data(), p.k.data(), p.v.data(),
                       p.out.data(), nullptr) == MINIKV_ERR_BAD_STATE);  // 1 is prefilled
  MKV_REQUIRE_OK(minikv_sequence_release(p.cache.get(), 1));             // 3 blocks free
  const std::vector<uint8_t> mid = p.snapshot();
  CHECK(minikv_prefill(p.cache.get(), 0, 2, ids, cu, p.q.data(), p.k.data(), p.v.data(),
                       p.out.data(), nullptr) == MINIKV_ERR_CAPACITY_EXCEEDED);  // 4 > 3
  CHECK(p.snapshot() == mid);
  MKV_REQUIRE_OK(p.prefill(1, 100));  // 3 blocks: the pool is full
  // A prompt whose kept tokens all fit the residual needs no block, even now.
  MKV_REQUIRE_OK(p.prefill(2, 30));  // keeps 14 < G
  MKV_REQUIRE_OK(minikv_sequence_release(p.cache.get(), 2));
  CHECK(p.prefill(2, 100) == MINIKV_ERR_CAPACITY_EXCEEDED);
  MKV_REQUIRE_OK(minikv_sequence_release(p.cache.get(), 0));
  MKV_REQUIRE_OK(p.prefill(2, 100));
  // Its output equals a fresh cache's (the recycled blocks carry nothing over).
  Pool fresh;
  MKV_REQUIRE_OK(fresh.prefill(2, 100));
  const uint32_t seq = 2;
  test::Buf o1(kDt, size_t(kH) * kD), o2(kDt, size_t(kH) * kD);
  MKV_REQUIRE_OK(minikv_decode(p.cache.get(), 0, 1, &seq, p.q.data(), o1.data(), nullptr));
  MKV_REQUIRE_OK(minikv_decode(fresh.cache.get(), 0, 1, &seq, fresh.q.data(), o2.data(), nullptr));
  CHECK(o1.bit_equal(o2));
}

TEST_CASE("capacity: a flush without a free block changes nothing and succeeds after a release") {
  Pool p;
  MKV_REQUIRE_OK(p.prefill(0, 100));  // 3 blocks, residual 2
  MKV_REQUIRE_OK(p.prefill(1, 64));   // 2 blocks, residual 0
  // Model of sequence 0 for the final check.
  test::SeqModel m0(kHkv, kD, kG, kR);
  m0.prefill({test::kept_positions(p.cache.get(), 0, 0, 0)}, p.k, p.v, 0);
  const uint32_t s0 = 0, s1 = 1, both[2] = {1, 0};
  test::Buf k1(kDt, size_t(2) * kHkv * kD), v1(kDt, size_t(2) * kHkv * kD);
  // Sequence 1: 16 appends, the 16th flushes into the last free block.
  for (int i = 0; i < 16; ++i) {
    k1.fill_normal(p.rng);
    v1.fill_normal(p.rng);
    MKV_REQUIRE_OK(minikv_append(p.cache.get(), 0, 1, &s1, k1.data(), v1.data(), nullptr));
  }
  // Sequence 0: residual 2 -> 15 after 13 appends; the 14th needs a block.
  for (int i = 0; i < 13; ++i) {
    k1.fill_normal(p.rng);
    v1.fill_normal(p.rng);
    MKV_REQUIRE_OK(minikv_append(p.cache.get(), 0, 1, &s0, k1.data(), v1.data(), nullptr));
    m0.append(k1, v1, 0);
  }
  const std::vector<uint8_t> before = p.snapshot();
  k1.fill_normal(p.rng);
  v1.fill_normal(p.rng);
  CHECK(minikv_append(p.cache.get(), 0, 1, &s0, k1.data(), v1.data(), nullptr) ==
        MINIKV_ERR_CAPACITY_EXCEEDED);
  CHECK(std::string(minikv_last_error_message()).find("minikv_append") != std::string::npos);
  CHECK(p.snapshot() == before);
  // In a batch with a sequence that needs no flush: neither changes.
  CHECK(minikv_append(p.cache.get(), 0, 2, both, k1.data(), v1.data(), nullptr) ==
        MINIKV_ERR_CAPACITY_EXCEEDED);
  CHECK(p.snapshot() == before);
  // The combined call neither appends nor writes out.
  test::Buf q2(kDt, size_t(2) * kH * kD), o2(kDt, size_t(2) * kH * kD);
  q2.fill_normal(p.rng);
  o2.fill(7.0);
  const test::Buf o2_before = o2;
  CHECK(minikv_append_decode(p.cache.get(), 0, 2, both, q2.data(), k1.data(), v1.data(),
                             o2.data(), nullptr) == MINIKV_ERR_CAPACITY_EXCEEDED);
  CHECK(std::string(minikv_last_error_message()).find("minikv_append_decode") != std::string::npos);
  CHECK(p.snapshot() == before);
  CHECK(o2.bit_equal(o2_before));
  // Release sequence 1 and retry: the flush happens and decode equals the oracle on the
  // dequantized cache (the failed calls lost or corrupted nothing).
  MKV_REQUIRE_OK(minikv_sequence_release(p.cache.get(), 1));
  MKV_REQUIRE_OK(minikv_append(p.cache.get(), 0, 1, &s0, k1.data(), v1.data(), nullptr));
  m0.append(k1, v1, 0);
  uint64_t seen = 0, cached = 0;
  MKV_REQUIRE_OK(minikv_sequence_length(p.cache.get(), 0, 0, &seen, &cached));
  CHECK(seen == 114);
  CHECK(cached == 64);
  CHECK(m0.quantized == 64);
  test::Buf qd(kDt, size_t(kH) * kD), od(kDt, size_t(kH) * kD);
  qd.fill_normal(p.rng, 1.5);
  MKV_REQUIRE_OK(minikv_decode(p.cache.get(), 0, 1, &s0, qd.data(), od.data(), nullptr));
  const std::vector<double> want = m0.decode(qd.doubles(), kH, true, 2, 2, kDt);
  MKV_CHECK_CLOSE(od.doubles(), want, 2e-5, 2e-5);
}

TEST_CASE("capacity: continuous batching keeps the pool consistent") {
  // Sequences come and go in a full pool; every admitted sequence decodes exactly as the
  // oracle says, and the free-block count returns to the start.
  Pool p;
  const minikv_memory_stats start = [&] {
    minikv_memory_stats st;
    st.struct_size = sizeof(st);
    REQUIRE(minikv_memory_stats_get(p.cache.get(), &st) == MINIKV_OK);
    return st;
  }();
  int admitted = 0, refused = 0;
  for (int round = 0; round < 12; ++round) {
    const uint32_t seq = static_cast<uint32_t>(round % kSeqs);
    MKV_REQUIRE_OK(minikv_sequence_release(p.cache.get(), seq));
    const uint32_t L = 40 + 23 * static_cast<uint32_t>(round % 5);
    const minikv_status st = p.prefill(seq, L);
    if (st == MINIKV_ERR_CAPACITY_EXCEEDED) {
      ++refused;
      continue;
    }
    MKV_REQUIRE_OK(st);
    ++admitted;
    test::SeqModel m(kHkv, kD, kG, kR);
    m.prefill({test::kept_positions(p.cache.get(), seq, 0, 0)}, p.k, p.v, 0);
    test::Buf qd(kDt, size_t(kH) * kD), od(kDt, size_t(kH) * kD);
    qd.fill_normal(p.rng);
    MKV_REQUIRE_OK(minikv_decode(p.cache.get(), 0, 1, &seq, qd.data(), od.data(), nullptr));
    MKV_CHECK_CLOSE(od.doubles(), m.decode(qd.doubles(), kH, true, 2, 2, kDt), 2e-5, 2e-5);
  }
  CHECK(admitted > 0);
  for (uint32_t s = 0; s < kSeqs; ++s) MKV_REQUIRE_OK(minikv_sequence_release(p.cache.get(), s));
  minikv_memory_stats end;
  end.struct_size = sizeof(end);
  MKV_REQUIRE_OK(minikv_memory_stats_get(p.cache.get(), &end));
  CHECK(end.used_bytes == 0);
  CHECK(end.pool_bytes == start.pool_bytes);
  // The whole pool is free again: 6 blocks = one prompt of 192 keeping 96 tokens.
  MKV_REQUIRE_OK(p.prefill(0, 192));
  (void)refused;
}

// The engine reserves engine_blocks_at_end's count for a sequence's whole life; too few and a
// flush would fail halfway through a decode step. A pool of exactly that many blocks must
// hold the prefill and every append, and one block fewer must not.
TEST_CASE("capacity: the engine's count of a sequence's blocks at its end is exact") {
  struct Setting {
    uint32_t group, residual, sinks;
    minikv_budget_policy policy;
    uint32_t flush;  // flush_tokens (0: the whole residual)
  };
  const Setting settings[] = {{16, 16, 0, MINIKV_BUDGET_PYRAMID, 0}, {16, 32, 4, MINIKV_BUDGET_PYRAMID, 0},
                              {32, 64, 3, MINIKV_BUDGET_UNIFORM, 0}, {16, 48, 9, MINIKV_BUDGET_UNIFORM, 0},
                              {16, 32, 4, MINIKV_BUDGET_PYRAMID, 16}, {16, 48, 0, MINIKV_BUDGET_UNIFORM, 32},
                              {32, 64, 3, MINIKV_BUDGET_UNIFORM, 32}};
  constexpr uint32_t kLayers = 3, kMaxPrompt = 150, kMaxAppends = 70;
  test::Rng rng{11};
  test::Buf q(kDt, kMaxPrompt * kH * kD), k(kDt, kMaxPrompt * kHkv * kD), v(kDt, kMaxPrompt * kHkv * kD),
      out(kDt, kMaxPrompt * kH * kD), k1(kDt, kHkv * kD), v1(kDt, kHkv * kD);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  k1.fill_normal(rng);
  v1.fill_normal(rng);
  const uint32_t seq = 0;
  for (const Setting &st : settings)
    for (uint32_t prompt : {5u, 37u, 150u})
      for (uint32_t appends : {0u, 1u, 29u, 70u}) {
        CAPTURE(st.group);
        CAPTURE(st.residual);
        CAPTURE(st.sinks);
        CAPTURE(st.flush);
        CAPTURE(prompt);
        CAPTURE(appends);
        minikv_config c = test::cpu_config(kLayers, kH, kHkv, kD, kDt);
        c.max_seq_len = kMaxPrompt + kMaxAppends;
        c.group_size = st.group;
        c.residual_length = st.residual;
        c.flush_tokens = st.flush;
        c.sink_tokens = st.sinks;
        c.budget_policy = st.policy;
        const int32_t cu[2] = {0, static_cast<int32_t>(prompt)};
        // Prefills, then `appends` tokens in every layer; the first failure's status.
        auto run = [&](uint64_t blocks, uint64_t *need) {
          c.max_tokens = blocks * st.residual;  // 0: room for everything
          test::CachePtr cache = test::make_cache(c);
          for (uint32_t l = 0; l < kLayers; ++l) {
            const minikv_status s =
                minikv_prefill(cache.get(), l, 1, &seq, cu, q.data(), k.data(), v.data(), out.data(), nullptr);
            if (s != MINIKV_OK) return s;
            uint64_t cached = 0;
            REQUIRE(minikv_sequence_length(cache.get(), seq, l, nullptr, &cached) == MINIKV_OK);
            if (need) *need += engine_blocks_at_end(&c, prompt, cached, appends);
          }
          for (uint32_t i = 0; i < appends; ++i)
            for (uint32_t l = 0; l < kLayers; ++l) {
              const minikv_status s = minikv_append(cache.get(), l, 1, &seq, k1.data(), v1.data(), nullptr);
              if (s != MINIKV_OK) return s;
            }
          return MINIKV_OK;
        };
        uint64_t need = 0;
        REQUIRE(run(0, &need) == MINIKV_OK);
        CHECK(run(need, nullptr) == MINIKV_OK);
        if (need > 1) CHECK(run(need - 1, nullptr) == MINIKV_ERR_CAPACITY_EXCEEDED);
      }
}

}  // TEST_SUITE
