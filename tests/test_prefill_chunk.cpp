// minikv-test: white-box (links minikv_core: reads the stored bytes through src/handle.h)
// Chunked prefill (minikv_prefill_chunk): a prompt sent in chunks of any sizes, alone or in
// ragged batches with other prompts at other stages, gives exactly what minikv_prefill of
// the whole prompt gives: every output element, the kept positions of every KV head, the
// stored bytes, sequence lengths, memory statistics and the decode steps that follow; in
// both score modes, every dtype, with sinks and PYRAMID budgets. Then the states and errors:
// abandoned prompts, calls on a sequence mid-prompt, staging and pool exhaustion (nothing
// changes), bad arguments.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "handle.h"
#include "support.hpp"

namespace {

// The prompts of one test: per layer, the whole prompts' q/k/v packed back to back.
struct Prompts {
  minikv_config cfg;
  std::vector<uint32_t> lens;
  std::vector<int32_t> cu;  // of the whole prompts
  std::vector<test::Buf> q, k, v;  // [layer]
};

Prompts make_prompts(const minikv_config &cfg, const std::vector<uint32_t> &lens, uint64_t seed) {
  Prompts p;
  p.cfg = cfg;
  p.lens = lens;
  p.cu = test::cu_from_lengths(lens);
  const size_t T = static_cast<size_t>(p.cu.back());
  test::Rng rng(seed);
  for (uint32_t l = 0; l < cfg.num_layers; ++l) {
    p.q.emplace_back(cfg.dtype, T * cfg.num_heads * cfg.head_dim);
    p.k.emplace_back(cfg.dtype, T * cfg.num_kv_heads * cfg.head_dim);
    p.v.emplace_back(cfg.dtype, T * cfg.num_kv_heads * cfg.head_dim);
    p.q.back().fill_normal(rng, 1.5);
    p.k.back().fill_normal(rng);
    p.v.back().fill_normal(rng);
  }
  return p;
}

// How each sequence's prompt is cut: chunk sizes (summing to its length) and the step of
// its first chunk. At step t every sequence with a chunk left sends its next one, all
// layers in turn (the order of an engine), in one ragged batch.
struct Schedule {
  std::vector<std::vector<uint32_t>> chunks;  // [sequence]
  std::vector<uint32_t> start;                // [sequence]
};

std::vector<uint32_t> pieces(uint32_t len, uint32_t size) {
  std::vector<uint32_t> c;
  for (uint32_t at = 0; at < len; at += size) c.push_back(std::min(size, len - at));
  return c;
}

std::vector<uint32_t> random_pieces(uint32_t len, test::Rng &rng, uint32_t max_size) {
  std::vector<uint32_t> c;
  for (uint32_t at = 0; at < len;) {
    const uint32_t n = std::min(len - at, 1 + rng.below(max_size));
    c.push_back(n);
    at += n;
  }
  return c;
}

const uint32_t kIds[] = {3, 0, 5, 1, 4, 2, 7, 6};  // seq_id of sequence i: not in batch order

// Every output row, per layer ([layer] = [total tokens][H][D] in the whole prompts' packing).
struct Outputs {
  std::vector<test::Buf> out;
};

Outputs prefill_whole(minikv_cache *c, const Prompts &p) {
  Outputs o;
  const uint32_t n = static_cast<uint32_t>(p.lens.size());
  for (uint32_t l = 0; l < p.cfg.num_layers; ++l) {
    o.out.emplace_back(p.cfg.dtype, p.q[l].size());
    MKV_REQUIRE_OK(minikv_prefill(c, l, n, kIds, p.cu.data(), p.q[l].data(), p.k[l].data(),
                                  p.v[l].data(), o.out[l].data(), nullptr));
  }
  return o;
}

// One batch of chunks of one layer: rows of the whole prompts copied into packed buffers.
struct ChunkBatch {
  std::vector<uint32_t> seqs, ids, prompt_lens, first;  // first: prompt position of the chunk
  std::vector<int32_t> cu{0};
  test::Buf q, k, v, out;
};

ChunkBatch gather(const Prompts &p, uint32_t layer, const std::vector<uint32_t> &seqs,
                  const std::vector<uint32_t> &first, const std::vector<uint32_t> &sizes) {
  const uint32_t H = p.cfg.num_heads, Hkv = p.cfg.num_kv_heads, D = p.cfg.head_dim;
  ChunkBatch b;
  b.seqs = seqs;
  b.first = first;
  for (size_t i = 0; i < seqs.size(); ++i) {
    b.ids.push_back(kIds[seqs[i]]);
    b.prompt_lens.push_back(p.lens[seqs[i]]);
    b.cu.push_back(b.cu.back() + static_cast<int32_t>(sizes[i]));
  }
  const size_t T = static_cast<size_t>(b.cu.back());
  b.q = test::Buf(p.cfg.dtype, T * H * D);
  b.k = test::Buf(p.cfg.dtype, T * Hkv * D);
  b.v = test::Buf(p.cfg.dtype, T * Hkv * D);
  b.out = test::Buf(p.cfg.dtype, T * H * D);
  b.out.fill(std::nan(""));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const size_t src = static_cast<size_t>(p.cu[seqs[i]]) + first[i], dst = static_cast<size_t>(b.cu[i]);
    for (size_t e = 0; e < size_t(sizes[i]) * H * D; ++e)
      b.q.set(dst * H * D + e, p.q[layer].get(src * H * D + e));
    for (size_t e = 0; e < size_t(sizes[i]) * Hkv * D; ++e) {
      b.k.set(dst * Hkv * D + e, p.k[layer].get(src * Hkv * D + e));
      b.v.set(dst * Hkv * D + e, p.v[layer].get(src * Hkv * D + e));
    }
  }
  return b;
}

minikv_status send(minikv_cache *c, uint32_t layer, ChunkBatch &b) {
  return minikv_prefill_chunk(c, layer, static_cast<uint32_t>(b.ids.size()), b.ids.data(),
                              b.cu.data(), b.prompt_lens.data(), b.q.data(), b.k.data(),
                              b.v.data(), b.out.data(), nullptr);
}

// Runs the schedule; the outputs land in the whole prompts' packing.
Outputs prefill_chunked(minikv_cache *c, const Prompts &p, const Schedule &s) {
  const uint32_t H = p.cfg.num_heads, D = p.cfg.head_dim;
  Outputs o;
  for (uint32_t l = 0; l < p.cfg.num_layers; ++l) {
    o.out.emplace_back(p.cfg.dtype, p.q[l].size());
    o.out.back().fill(std::nan(""));
  }
  const size_t n = p.lens.size();
  std::vector<uint32_t> next(n, 0), done(n, 0);
  for (uint32_t step = 0;; ++step) {
    std::vector<uint32_t> seqs, first, sizes;
    bool left = false;
    for (uint32_t i = 0; i < n; ++i) {
      left = left || next[i] < s.chunks[i].size();
      if (step < s.start[i] || next[i] >= s.chunks[i].size()) continue;
      seqs.push_back(i);
      first.push_back(done[i]);
      sizes.push_back(s.chunks[i][next[i]]);
    }
    if (!left) break;
    if (seqs.empty()) continue;
    for (uint32_t l = 0; l < p.cfg.num_layers; ++l) {
      ChunkBatch b = gather(p, l, seqs, first, sizes);
      {
        INFO("step " << step << " layer " << l);
        MKV_REQUIRE_OK(send(c, l, b));
      }
      for (size_t i = 0; i < seqs.size(); ++i) {
        const size_t dst = static_cast<size_t>(p.cu[seqs[i]]) + first[i];
        for (size_t e = 0; e < size_t(sizes[i]) * H * D; ++e)
          o.out[l].set(dst * H * D + e, b.out.get(size_t(b.cu[i]) * H * D + e));
      }
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      done[seqs[i]] += sizes[i];
      ++next[seqs[i]];
    }
  }
  return o;
}

// Equal values on every element (the same float operations: only the sign of a zero may
// differ, where a tile of rows spans different masked keys).
void check_equal(const test::Buf &got, const test::Buf &want, const std::string &what) {
  REQUIRE(got.size() == want.size());
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(got.get(i) == want.get(i))) {
      if (bad == 0) first_bad = i;
      ++bad;
    }
  }
  INFO(what << ": " << bad << " of " << got.size() << " elements differ; first at " << first_bad
            << ": chunked " << got.get(first_bad) << " whole " << want.get(first_bad));
  CHECK(bad == 0);
}

// Everything observable after the prefill, and then `steps` append + decode steps with the
// same inputs on both caches.
void check_same_cache(minikv_cache *chunked, minikv_cache *whole, const Prompts &p,
                      bool same_block_order, uint32_t steps) {
  const minikv_config &cfg = p.cfg;
  const uint32_t n = static_cast<uint32_t>(p.lens.size());
  for (uint32_t l = 0; l < cfg.num_layers; ++l)
    for (uint32_t i = 0; i < n; ++i) {
      uint64_t seen_c = 0, cached_c = 0, seen_w = 1, cached_w = 1;
      MKV_REQUIRE_OK(minikv_sequence_length(chunked, kIds[i], l, &seen_c, &cached_c));
      MKV_REQUIRE_OK(minikv_sequence_length(whole, kIds[i], l, &seen_w, &cached_w));
      CHECK(seen_c == seen_w);
      CHECK(cached_c == cached_w);
      for (uint32_t g = 0; g < cfg.num_kv_heads; ++g) {
        INFO("layer " << l << " sequence " << i << " kv head " << g);
        CHECK(test::kept_positions(chunked, kIds[i], l, g) == test::kept_positions(whole, kIds[i], l, g));
      }
    }
  minikv_memory_stats a{}, b{};
  a.struct_size = b.struct_size = sizeof(minikv_memory_stats);
  MKV_REQUIRE_OK(minikv_memory_stats_get(chunked, &a));
  MKV_REQUIRE_OK(minikv_memory_stats_get(whole, &b));
  CHECK(a.used_bytes == b.used_bytes);
  CHECK(a.tokens_seen == b.tokens_seen);
  CHECK(a.tokens_cached == b.tokens_cached);
  CHECK(a.pool_bytes == b.pool_bytes);
  CHECK(a.workspace_bytes == b.workspace_bytes);
  if (same_block_order) {  // the same blocks taken in the same order: the same bytes
    std::vector<uint8_t> pool_c, res_c, pool_w, res_w;
    chunked->impl.backend().read_storage(pool_c, res_c);
    whole->impl.backend().read_storage(pool_w, res_w);
    CHECK(pool_c == pool_w);
    CHECK(res_c == res_w);
  }
  test::Rng rng(4242);
  const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  test::Buf k(cfg.dtype, size_t(n) * Hkv * D), v(cfg.dtype, size_t(n) * Hkv * D),
      q(cfg.dtype, size_t(n) * H * D), out_c(cfg.dtype, size_t(n) * H * D),
      out_w(cfg.dtype, size_t(n) * H * D);
  for (uint32_t step = 0; step < steps; ++step)
    for (uint32_t l = 0; l < cfg.num_layers; ++l) {
      k.fill_normal(rng);
      v.fill_normal(rng);
      q.fill_normal(rng, 1.5);
      for (minikv_cache *c : {chunked, whole})
        MKV_REQUIRE_OK(minikv_append(c, l, n, kIds, k.data(), v.data(), nullptr));
      MKV_REQUIRE_OK(minikv_decode(chunked, l, n, kIds, q.data(), out_c.data(), nullptr));
      MKV_REQUIRE_OK(minikv_decode(whole, l, n, kIds, q.data(), out_w.data(), nullptr));
      check_equal(out_c, out_w, "decode step " + std::to_string(step) + " layer " + std::to_string(l));
    }
}

minikv_config chunk_config(const std::vector<uint32_t> &lens, minikv_dtype dt = MINIKV_DTYPE_F32,
                           uint32_t H = 4, uint32_t Hkv = 2, uint32_t D = 32, uint32_t layers = 2) {
  minikv_config c = test::cpu_config(layers, H, Hkv, D, dt);
  c.max_sequences = 8;
  c.max_seq_len = *std::max_element(lens.begin(), lens.end()) + 64;
  c.residual_length = 32;
  c.prefill_staging_tokens = std::accumulate(lens.begin(), lens.end(), 0u);
  return c;
}

// Chunked against whole on the same config and prompts.
void check_schedule(const minikv_config &cfg, const Prompts &p, const Schedule &s,
                    uint32_t steps = 40) {
  test::CachePtr chunked = test::make_cache(cfg), whole = test::make_cache(cfg);
  const Outputs oc = prefill_chunked(chunked.get(), p, s);
  const Outputs ow = prefill_whole(whole.get(), p);
  for (uint32_t l = 0; l < cfg.num_layers; ++l)
    check_equal(oc.out[l], ow.out[l], "prefill output of layer " + std::to_string(l));
  const bool same_order = std::all_of(s.start.begin(), s.start.end(), [](uint32_t t) { return t == 0; });
  check_same_cache(chunked.get(), whole.get(), p, same_order, steps);
}

Schedule uniform(const std::vector<uint32_t> &lens, uint32_t size) {
  Schedule s;
  for (uint32_t L : lens) {
    s.chunks.push_back(pieces(L, size));
    s.start.push_back(0);
  }
  return s;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("prefill_chunk: chunks of 1 token equal one call") {
  const std::vector<uint32_t> lens = {70, 33};
  for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
    CAPTURE(mode);
    minikv_config c = chunk_config(lens);
    c.score_mode = mode;
    c.window_size = 8;
    check_schedule(c, make_prompts(c, lens, 1 + mode), uniform(lens, 1));
  }
}

TEST_CASE("prefill_chunk: chunk sizes not aligned to G or R or the query block") {
  // G = 16, R = 32, CPU query blocks of 16 rows: chunks of 7, 13, 17, 31, 33 and 50 rows.
  const std::vector<uint32_t> lens = {300, 129, 64, 5};
  for (uint32_t size : {7u, 13u, 17u, 31u, 33u, 50u}) {
    CAPTURE(size);
    minikv_config c = chunk_config(lens);
    check_schedule(c, make_prompts(c, lens, 10 + size), uniform(lens, size), 20);
  }
}

TEST_CASE("prefill_chunk: every split of a prompt into two chunks") {
  const uint32_t L = 41;
  for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
    minikv_config c = chunk_config({L}, MINIKV_DTYPE_F32, 2, 1, 16, 1);
    c.score_mode = mode;
    c.window_size = 6;
    c.pool_kernel = 3;
    const Prompts p = make_prompts(c, {L}, 20 + mode);
    for (uint32_t cut = 1; cut < L; ++cut) {
      CAPTURE(cut);
      Schedule s;
      s.chunks = {{cut, L - cut}};
      s.start = {0};
      check_schedule(c, p, s, 3);
    }
  }
}

TEST_CASE("prefill_chunk: ragged batches of prompts at different stages in every dtype") {
  // Random chunk sizes, staggered starts (batches mixing first, middle, last and whole-
  // prompt chunks), a 1-token prompt, GQA 4, both score modes.
  const std::vector<uint32_t> lens = {257, 1, 90, 160, 33, 17};
  for (minikv_dtype dt : {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16})
    for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
      CAPTURE(dt);
      CAPTURE(mode);
      minikv_config c = chunk_config(lens, dt, 8, 2, 64);
      c.score_mode = mode;
      c.window_size = 24;
      test::Rng rng(30 + dt * 2 + mode);
      Schedule s;
      for (size_t i = 0; i < lens.size(); ++i) {
        s.chunks.push_back(i == 4 ? std::vector<uint32_t>{lens[i]} : random_pieces(lens[i], rng, 70));
        s.start.push_back(rng.below(3));
      }
      check_schedule(c, make_prompts(c, lens, 40 + dt * 2 + mode), s, 35);
      s.start.assign(lens.size(), 0);  // the same blocks in the same order: the same bytes
      check_schedule(c, make_prompts(c, lens, 50 + dt * 2 + mode), s, 5);
    }
}

TEST_CASE("prefill_chunk: WINDOW with the window across chunks or longer than the prompt") {
  // window 40 over prompts of 100 and 30 (shorter than the window: every query scores, and
  // everything is kept) in chunks of 25: the window's queries arrive in two chunks.
  const std::vector<uint32_t> lens = {100, 30, 200};
  for (uint32_t pool : {1u, 7u}) {
    minikv_config c = chunk_config(lens);
    c.score_mode = MINIKV_SCORE_WINDOW;
    c.window_size = 40;
    c.pool_kernel = pool;
    c.budget_policy = MINIKV_BUDGET_UNIFORM;
    c.heavy_ratio = 0.2f;
    c.recent_ratio = 0.1f;
    check_schedule(c, make_prompts(c, lens, 60 + pool), uniform(lens, 25), 10);
  }
}

TEST_CASE("prefill_chunk: sinks and PYRAMID budgets over four layers") {
  const std::vector<uint32_t> lens = {150, 60, 9};
  for (uint32_t sinks : {4u, 20u}) {
    minikv_config c = chunk_config(lens, MINIKV_DTYPE_F16, 4, 4, 32, 4);
    c.sink_tokens = sinks;
    c.key_bits = 4;
    c.group_size = 32;
    c.residual_length = 64;
    check_schedule(c, make_prompts(c, lens, 70 + sinks), uniform(lens, 11), 60);
  }
}

TEST_CASE("prefill_chunk: whole prompts need no staging and equal minikv_prefill") {
  const std::vector<uint32_t> lens = {100, 7};
  minikv_config c = chunk_config(lens);
  c.prefill_staging_tokens = 0;  // chunked prefill off: whole prompts still work
  check_schedule(c, make_prompts(c, lens, 80), uniform(lens, 1000), 10);
}

TEST_CASE("prefill_chunk: an abandoned prompt frees its staging and its blocks") {
  const std::vector<uint32_t> lens = {120};
  minikv_config c = chunk_config(lens);
  c.prefill_staging_tokens = 120;  // room for exactly one prompt of 120 in each layer
  const Prompts p = make_prompts(c, lens, 90);
  test::CachePtr cache = test::make_cache(c), fresh = test::make_cache(c);
  minikv_memory_stats empty{};
  empty.struct_size = sizeof(empty);
  MKV_REQUIRE_OK(minikv_memory_stats_get(cache.get(), &empty));
  // Two chunks of 50 of the 120 in both layers, then the engine drops the request.
  for (uint32_t first : {0u, 50u})
    for (uint32_t l = 0; l < 2; ++l) {
      ChunkBatch b = gather(p, l, {0}, {first}, {50});
      MKV_REQUIRE_OK(send(cache.get(), l, b));
    }
  minikv_memory_stats mid{};
  mid.struct_size = sizeof(mid);
  MKV_REQUIRE_OK(minikv_memory_stats_get(cache.get(), &mid));
  CHECK(mid.tokens_seen == 0);  // nothing counts before the last chunk
  CHECK(mid.used_bytes == 0);
  CHECK(mid.workspace_bytes == empty.workspace_bytes);
  uint64_t seen = 1, cached = 1;
  MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), kIds[0], 0, &seen, &cached));
  CHECK(seen == 0);
  CHECK(cached == 0);
  MKV_REQUIRE_OK(minikv_sequence_release(cache.get(), kIds[0]));
  // The slot, the staging rows (another whole staging area's worth) and the blocks are
  // free: the prompt again, in other chunks, gives what a fresh cache gives.
  Schedule s;
  s.chunks = {{119, 1}};
  s.start = {0};
  const Outputs o1 = prefill_chunked(cache.get(), p, s);
  const Outputs o2 = prefill_chunked(fresh.get(), p, uniform(lens, 60));
  for (uint32_t l = 0; l < 2; ++l) check_equal(o1.out[l], o2.out[l], "after release");
  check_same_cache(cache.get(), fresh.get(), p, true, 40);
  // Releasing a slot never started, and one finished, is fine.
  MKV_REQUIRE_OK(minikv_sequence_release(cache.get(), kIds[5]));
  MKV_REQUIRE_OK(minikv_sequence_release(cache.get(), kIds[0]));
  minikv_memory_stats after{};
  after.struct_size = sizeof(after);
  MKV_REQUIRE_OK(minikv_memory_stats_get(cache.get(), &after));
  CHECK(after.used_bytes == 0);
}

TEST_CASE("prefill_chunk: a sequence mid-prompt refuses append and decode and prefill") {
  const std::vector<uint32_t> lens = {64};
  minikv_config c = chunk_config(lens);
  const Prompts p = make_prompts(c, lens, 100);
  test::CachePtr cache = test::make_cache(c);
  ChunkBatch b = gather(p, 0, {0}, {0}, {40});
  MKV_REQUIRE_OK(send(cache.get(), 0, b));
  const uint32_t id = kIds[0];
  test::Buf x(c.dtype, size_t(c.num_heads) * c.head_dim), o(c.dtype, x.size());
  x.fill(0.5);
  CHECK(minikv_append(cache.get(), 0, 1, &id, x.data(), x.data(), nullptr) == MINIKV_ERR_BAD_STATE);
  CHECK(std::string(minikv_last_error_message()).find("mid-prompt") != std::string::npos);
  CHECK(std::string(minikv_last_error_message()).find("40 of 64") != std::string::npos);
  CHECK(minikv_decode(cache.get(), 0, 1, &id, x.data(), o.data(), nullptr) == MINIKV_ERR_BAD_STATE);
  CHECK(std::string(minikv_cache_last_error(cache.get())).find("mid-prompt") != std::string::npos);
  uint32_t count = 7;
  CHECK(minikv_kept_positions(cache.get(), id, 0, 0, nullptr, 0, &count) == MINIKV_ERR_BAD_STATE);
  const int32_t cu[2] = {0, 24};
  CHECK(minikv_prefill(cache.get(), 0, 1, &id, cu, b.q.data(), b.k.data(), b.v.data(), b.out.data(),
                       nullptr) == MINIKV_ERR_BAD_STATE);
  CHECK(std::string(minikv_last_error_message()).find("minikv_prefill_chunk") != std::string::npos);
  // Layer 1 has not started: its state is simply "not prefilled".
  CHECK(minikv_decode(cache.get(), 1, 1, &id, x.data(), o.data(), nullptr) == MINIKV_ERR_BAD_STATE);
  CHECK(std::string(minikv_last_error_message()).find("has not been prefilled") != std::string::npos);
  // The rest of the prompt, then decode works, and a further chunk is a second prefill.
  ChunkBatch rest = gather(p, 0, {0}, {40}, {24});
  MKV_REQUIRE_OK(send(cache.get(), 0, rest));
  MKV_REQUIRE_OK(minikv_append(cache.get(), 0, 1, &id, x.data(), x.data(), nullptr));
  MKV_REQUIRE_OK(minikv_decode(cache.get(), 0, 1, &id, x.data(), o.data(), nullptr));
  CHECK(send(cache.get(), 0, rest) == MINIKV_ERR_BAD_STATE);
}

TEST_CASE("prefill_chunk: bad arguments fail and change nothing") {
  const std::vector<uint32_t> lens = {64, 48};
  minikv_config c = chunk_config(lens);
  c.max_seq_len = 100;
  c.prefill_staging_tokens = 90;
  const Prompts p = make_prompts(c, lens, 110);
  test::CachePtr cache = test::make_cache(c), whole = test::make_cache(c);
  // Sequence 0 is mid-prompt (32 of 64) in layer 0 when each failing call is made.
  ChunkBatch first = gather(p, 0, {0}, {0}, {32});
  MKV_REQUIRE_OK(send(cache.get(), 0, first));
  auto fails = [&](ChunkBatch b, minikv_status want, const char *needle) {
    const minikv_status st = send(cache.get(), 0, b);
    INFO(minikv_last_error_message());
    CHECK(st == want);
    CHECK(std::string(minikv_last_error_message()).find(needle) != std::string::npos);
  };
  SUBCASE("prompt_lens NULL") {
    ChunkBatch b = gather(p, 0, {0}, {32}, {32});
    CHECK(minikv_prefill_chunk(cache.get(), 0, 1, b.ids.data(), b.cu.data(), nullptr, b.q.data(),
                               b.k.data(), b.v.data(), b.out.data(), nullptr) ==
          MINIKV_ERR_INVALID_ARGUMENT);
    CHECK(std::string(minikv_last_error_message()) == "minikv_prefill_chunk: prompt_lens is NULL");
  }
  SUBCASE("a chunk past the prompt") {
    ChunkBatch b = gather(p, 0, {0}, {32}, {32});
    b.prompt_lens[0] = 63;
    fails(b, MINIKV_ERR_INVALID_ARGUMENT, "differs from the prompt length 64");
    ChunkBatch past = gather(p, 0, {1}, {0}, {40});
    past.prompt_lens[0] = 39;
    fails(past, MINIKV_ERR_INVALID_ARGUMENT, "covers prompt positions [0, 40), past its prompt_lens[0] (39)");
  }
  SUBCASE("prompt_lens out of range") {
    ChunkBatch b = gather(p, 0, {1}, {0}, {10});
    b.prompt_lens[0] = 0;
    fails(b, MINIKV_ERR_INVALID_ARGUMENT, "prompt_lens[0] (0, seq_id 0) must be in [1, max_seq_len = 100]");
    b.prompt_lens[0] = 101;
    fails(b, MINIKV_ERR_INVALID_ARGUMENT, "must be in [1, max_seq_len = 100]");
  }
  SUBCASE("a prompt longer than the staging area") {
    ChunkBatch b = gather(p, 0, {1}, {0}, {10});
    b.prompt_lens[0] = 91;
    fails(b, MINIKV_ERR_INVALID_ARGUMENT, "exceeds prefill_staging_tokens (90)");
  }
  SUBCASE("no free staging run: the whole batch fails") {
    // 32 + 48 = 80 rows of 90 after the first chunk would fit, but 64 + 48 > 90 does not:
    // sequence 0 holds 64 rows, the batch [seq 2 (fits alone), seq 1 (does not)] fails whole.
    Prompts p3 = make_prompts(c, {64, 48, 20}, 111);
    ChunkBatch b = gather(p3, 0, {2, 1}, {0, 0}, {10, 10});
    fails(b, MINIKV_ERR_CAPACITY_EXCEEDED, "64 are staged for prompts in flight (20 more by earlier sequences of this call) and the longest free run is 6 rows");
    // Sequence 2 did not start: its whole prompt in one call, or its first chunk, still works.
    ChunkBatch alone = gather(p3, 0, {2}, {0}, {10});
    MKV_REQUIRE_OK(send(cache.get(), 0, alone));
  }
  SUBCASE("misaligned or non-finite input") {
    ChunkBatch b = gather(p, 0, {0}, {32}, {32});
    b.k.set(5 * c.num_kv_heads * c.head_dim + 3, std::nan(""));
    fails(b, MINIKV_ERR_INVALID_ARGUMENT, "is NaN");
    ChunkBatch m = gather(p, 0, {0}, {32}, {32});
    CHECK(minikv_prefill_chunk(cache.get(), 0, 1, m.ids.data(), m.cu.data(), m.prompt_lens.data(),
                               static_cast<const char *>(m.q.data()) + 1, m.k.data(), m.v.data(),
                               m.out.data(), nullptr) == MINIKV_ERR_INVALID_ARGUMENT);
  }
  SUBCASE("chunking off") {
    minikv_config off = c;
    off.prefill_staging_tokens = 0;
    test::CachePtr none = test::make_cache(off);
    ChunkBatch b = gather(p, 0, {0}, {0}, {32});
    CHECK(send(none.get(), 0, b) == MINIKV_ERR_INVALID_ARGUMENT);
    CHECK(std::string(minikv_last_error_message()).find("chunked prefill is off (prefill_staging_tokens = 0)") !=
          std::string::npos);
  }
  // After every failure sequence 0 continues where it was and ends as one call would.
  ChunkBatch rest = gather(p, 0, {0}, {32}, {32});
  MKV_REQUIRE_OK(send(cache.get(), 0, rest));
  Outputs ow = prefill_whole(whole.get(), p);
  const size_t row = size_t(c.num_heads) * c.head_dim;
  test::Buf got(c.dtype, 64 * row), want(c.dtype, 64 * row);
  for (size_t e = 0; e < 32 * row; ++e) {
    got.set(e, first.out.get(e));
    got.set(32 * row + e, rest.out.get(e));
  }
  for (size_t e = 0; e < got.size(); ++e) want.set(e, ow.out[0].get(e));
  check_equal(got, want, "sequence 0 after the failed calls");
  for (uint32_t g = 0; g < c.num_kv_heads; ++g)
    CHECK(test::kept_positions(cache.get(), kIds[0], 0, g) == test::kept_positions(whole.get(), kIds[0], 0, g));
}

TEST_CASE("prefill_chunk: a full pool fails at the first chunk and later chunks cannot") {
  // R = 32; a prompt of 200 keeps 100 = 96 quantized + 4 residual: 3 blocks, reserved by
  // its first chunk. A pool of 4 blocks takes one such prompt; the second prompt's first
  // chunk fails (and stages nothing), the first prompt's later chunks all succeed.
  const std::vector<uint32_t> lens = {200, 200};
  minikv_config c = chunk_config(lens, MINIKV_DTYPE_F32, 2, 1, 16, 1);
  c.budget_policy = MINIKV_BUDGET_UNIFORM;
  c.max_tokens = 4 * 32;
  const Prompts p = make_prompts(c, lens, 120);
  test::CachePtr cache = test::make_cache(c);
  ChunkBatch a = gather(p, 0, {0}, {0}, {50});
  MKV_REQUIRE_OK(send(cache.get(), 0, a));
  ChunkBatch b = gather(p, 0, {1}, {0}, {50});
  CHECK(send(cache.get(), 0, b) == MINIKV_ERR_CAPACITY_EXCEEDED);
  CHECK(std::string(minikv_last_error_message()).find("needs 3 free blocks") != std::string::npos);
  for (uint32_t first : {50u, 100u, 150u}) {
    ChunkBatch next = gather(p, 0, {0}, {first}, {50});
    MKV_REQUIRE_OK(send(cache.get(), 0, next));
  }
  uint64_t cached = 0;
  MKV_REQUIRE_OK(minikv_sequence_length(cache.get(), kIds[0], 0, nullptr, &cached));
  CHECK(cached == 100);
  MKV_REQUIRE_OK(minikv_sequence_release(cache.get(), kIds[0]));
  MKV_REQUIRE_OK(send(cache.get(), 0, b));  // now it fits
}

TEST_CASE("prefill_chunk: a fragmented staging area reuses freed runs first-fit") {
  // Staging of 100 rows: prompts A (40), B (30), C (30) fill it; B finishes; D (30) takes
  // B's run; A finishes; E (41) does not fit A's 40 rows (CAPACITY_EXCEEDED, naming the
  // longest free run), F (40) does.
  const std::vector<uint32_t> lens = {40, 30, 30, 30, 41, 40};
  minikv_config c = chunk_config(lens, MINIKV_DTYPE_F32, 2, 1, 16, 1);
  c.prefill_staging_tokens = 100;
  const Prompts p = make_prompts(c, lens, 130);
  test::CachePtr cache = test::make_cache(c);
  auto chunk = [&](uint32_t seq, uint32_t first, uint32_t n) {
    ChunkBatch b = gather(p, 0, {seq}, {first}, {n});
    return send(cache.get(), 0, b);
  };
  MKV_REQUIRE_OK(chunk(0, 0, 20));
  MKV_REQUIRE_OK(chunk(1, 0, 10));
  MKV_REQUIRE_OK(chunk(2, 0, 10));
  MKV_REQUIRE_OK(chunk(1, 10, 20));  // B done
  MKV_REQUIRE_OK(chunk(3, 0, 10));   // D in B's rows
  MKV_REQUIRE_OK(chunk(0, 20, 20));  // A done
  CHECK(chunk(4, 0, 1) == MINIKV_ERR_CAPACITY_EXCEEDED);
  CHECK(std::string(minikv_last_error_message()).find("60 are staged for prompts in flight and the longest free run is 40 rows") !=
        std::string::npos);
  MKV_REQUIRE_OK(chunk(5, 0, 1));
  MKV_REQUIRE_OK(chunk(5, 1, 39));
  MKV_REQUIRE_OK(chunk(2, 10, 20));
  MKV_REQUIRE_OK(chunk(3, 10, 20));
  MKV_REQUIRE_OK(chunk(4, 0, 41));  // staging empty again
}

TEST_CASE("prefill_chunk: config field bounds and staging in workspace_bytes") {
  minikv_config c = test::cpu_config(3, 4, 2, 32);
  c.max_sequences = 2;
  c.max_seq_len = 100;
  c.prefill_staging_tokens = 201;
  minikv_cache *out = nullptr;
  CHECK(minikv_cache_create(&c, &out) == MINIKV_ERR_INVALID_ARGUMENT);
  CHECK(std::string(minikv_last_error_message()).find("prefill_staging_tokens (201) must be at most max_sequences (2) x max_seq_len (100)") !=
        std::string::npos);
  CHECK(out == nullptr);
  c.prefill_staging_tokens = 0;
  test::CachePtr off = test::make_cache(c);
  c.prefill_staging_tokens = 200;
  test::CachePtr on = test::make_cache(c);
  minikv_memory_stats a{}, b{};
  a.struct_size = b.struct_size = sizeof(a);
  MKV_REQUIRE_OK(minikv_memory_stats_get(off.get(), &a));
  MKV_REQUIRE_OK(minikv_memory_stats_get(on.get(), &b));
  // K and V (F32) of 3 layers, plus the score sums (double per query head) of 3 layers.
  CHECK(b.workspace_bytes - a.workspace_bytes == 3ull * 200 * 2 * 32 * 2 * 4 + 3ull * 4 * 200 * 8);
  CHECK(b.pool_bytes == a.pool_bytes);
}

}  // TEST_SUITE
