// minikv-test: white-box
// Out-of-memory injection. A scripted workload (create, batched prefills, decodes, appends
// through residual flushes, release and reuse, queries) runs once as a control; then, for
// every step and every allocation N that step makes (C++ operator new of this executable,
// which libminikv's allocations also reach, and minikv::host_calloc through the hook in
// src/alloc.h, counted together), the workload is replayed with allocation N failing:
//   * one-shot: only allocation N fails;  * sticky: N and every later one fail.
// Each time:
//   - the step returns MINIKV_ERR_OUT_OF_MEMORY (MINIKV_OK once N is past its last
//     allocation), create leaves *out NULL, and both error messages are set;
//   - the cache is exactly as before the step: lengths, stats, kept positions and the
//     decode output of every live (sequence, layer), bit for bit;
//   - the step then succeeds when retried, and the rest of the workload gives outputs
//     bit-identical to the control (the handle keeps serving every sequence);
//   - no block of the pool was lost: after releasing everything, a capacity probe fits
//     exactly as many tokens as the pool holds;
//   - nothing leaked: operator-new blocks alive after destroy equal those before create
//     (and LeakSanitizer in the ASan build of scripts/reliability.sh covers calloc).
#include <doctest/doctest.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "alloc_control.h"
#include "exact_fill.hpp"
#include "minikv.h"

namespace {

// Failures are recorded without allocating (doctest would allocate while we measure
// leaks); the test case REQUIREs the record empty at the end.
struct Failures {
  char first[2048] = {0};
  unsigned count = 0;
  void add(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
    if (count++ == 0) {
      va_list args;
      va_start(args, fmt);
      std::vsnprintf(first, sizeof(first), fmt, args);
      va_end(args);
    }
  }
};

enum class Kind { kCreate, kPrefill, kPrefillChunk, kAppend, kDecode, kRelease, kLength, kKept, kStats };

struct Step {
  std::string name;
  Kind kind;
  uint32_t layer = 0;
  std::vector<uint32_t> ids;
  std::vector<int32_t> cu;
  std::vector<uint32_t> prompt_lens;  // kPrefillChunk
  std::vector<uint8_t> q, k, v;
  std::vector<uint8_t> out;  // preallocated: a step allocates nothing on the test's side
};

struct Workload {
  minikv_config cfg;
  std::vector<Step> steps;
  size_t esize;
};

using reliability::fill;

Workload make_workload(minikv_dtype dtype) {
  Workload w;
  minikv_config &c = w.cfg;
  minikv_config_default(&c);
  minikv_config_preset(&c, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
  c.backend = MINIKV_BACKEND_CPU;
  c.dtype = dtype;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.max_sequences = 3;
  c.max_seq_len = 512;
  c.group_size = 16;
  c.residual_length = 16;
  c.max_tokens = 16 * 16;  // 16 blocks: tight enough that a lost block shows
  c.prefill_staging_tokens = 64;
  w.esize = dtype == MINIKV_DTYPE_F32 ? 4 : 2;
  const size_t H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  uint64_t seed = static_cast<uint64_t>(dtype) * 1000;

  auto prefill = [&](uint32_t layer, std::vector<uint32_t> ids, std::vector<int32_t> lens) {
    Step s;
    s.kind = Kind::kPrefill;
    s.layer = layer;
    s.ids = ids;
    s.cu.push_back(0);
    for (int32_t l : lens) s.cu.push_back(s.cu.back() + l);
    const size_t T = static_cast<size_t>(s.cu.back());
    fill(s.q, T * H * D, ++seed, dtype);
    fill(s.k, T * Hkv * D, ++seed, dtype);
    fill(s.v, T * Hkv * D, ++seed, dtype);
    s.out.assign(T * H * D * w.esize, 0);
    s.name = "prefill layer " + std::to_string(layer) + " of " + std::to_string(ids.size()) + " sequences";
    w.steps.push_back(std::move(s));
  };
  // The chunks `lens` of prompts of lengths `prompt_lens` (minikv_prefill_chunk).
  auto prefill_chunk = [&](uint32_t layer, std::vector<uint32_t> ids, std::vector<int32_t> lens,
                           std::vector<uint32_t> prompt_lens) {
    prefill(layer, ids, lens);
    Step &s = w.steps.back();
    s.kind = Kind::kPrefillChunk;
    s.prompt_lens = prompt_lens;
    s.name = "prefill_chunk layer " + std::to_string(layer);
  };
  auto append = [&](uint32_t layer, std::vector<uint32_t> ids) {
    Step s;
    s.kind = Kind::kAppend;
    s.layer = layer;
    s.ids = ids;
    fill(s.k, ids.size() * Hkv * D, ++seed, dtype);
    fill(s.v, ids.size() * Hkv * D, ++seed, dtype);
    s.name = "append layer " + std::to_string(layer);
    w.steps.push_back(std::move(s));
  };
  auto decode = [&](uint32_t layer, std::vector<uint32_t> ids) {
    Step s;
    s.kind = Kind::kDecode;
    s.layer = layer;
    s.ids = ids;
    fill(s.q, ids.size() * H * D, ++seed, dtype);
    s.out.assign(ids.size() * H * D * w.esize, 0);
    s.name = "decode layer " + std::to_string(layer);
    w.steps.push_back(std::move(s));
  };
  auto simple = [&](Kind kind, const char *name, uint32_t seq = 0, uint32_t layer = 0) {
    Step s;
    s.kind = kind;
    s.layer = layer;
    s.ids = {seq};
    s.name = name;
    s.out.assign(kind == Kind::kStats ? sizeof(minikv_memory_stats) : kind == Kind::kKept ? 4 * 600 : 16, 0);
    w.steps.push_back(std::move(s));
  };

  simple(Kind::kCreate, "create");
  prefill(0, {0, 1}, {70, 45});  // keeps 34 (32 quantized + 2) and 22 (16 + 6)
  prefill(1, {1, 0}, {45, 70});
  prefill(0, {2}, {33});
  // Sequence 2's prompt in layer 1 in chunks: the first reserves staging rows and blocks.
  prefill_chunk(1, {2}, {10}, {33});
  prefill_chunk(1, {2}, {23}, {33});
  decode(0, {2, 0, 1});
  decode(1, {0, 1});
  // 14 appends: sequence 1 flushes at the 10th, sequence 0 at the 14th.
  for (int i = 0; i < 14; ++i) append(0, {0, 1});
  decode(0, {0, 1});
  simple(Kind::kRelease, "release sequence 1", 1);
  prefill(0, {1}, {20});
  prefill_chunk(1, {1}, {15}, {40});  // mid-prompt at the end: released by the capacity probe
  append(0, {1, 2});
  decode(0, {1, 2, 0});
  simple(Kind::kLength, "sequence_length", 0, 0);
  simple(Kind::kKept, "kept_positions", 0, 0);
  simple(Kind::kStats, "memory_stats_get");
  return w;
}

minikv_status run_step(Step &s, minikv_cache *&c, const minikv_config &cfg) {
  const uint32_t n = static_cast<uint32_t>(s.ids.size());
  switch (s.kind) {
    case Kind::kCreate: return minikv_cache_create(&cfg, &c);
    case Kind::kPrefill:
      return minikv_prefill(c, s.layer, n, s.ids.data(), s.cu.data(), s.q.data(), s.k.data(), s.v.data(),
                            s.out.data(), nullptr);
    case Kind::kPrefillChunk:
      return minikv_prefill_chunk(c, s.layer, n, s.ids.data(), s.cu.data(), s.prompt_lens.data(),
                                  s.q.data(), s.k.data(), s.v.data(), s.out.data(), nullptr);
    case Kind::kAppend: return minikv_append(c, s.layer, n, s.ids.data(), s.k.data(), s.v.data(), nullptr);
    case Kind::kDecode: return minikv_decode(c, s.layer, n, s.ids.data(), s.q.data(), s.out.data(), nullptr);
    case Kind::kRelease: return minikv_sequence_release(c, s.ids[0]);
    case Kind::kLength: {
      uint64_t v[2];
      const minikv_status st = minikv_sequence_length(c, s.ids[0], s.layer, &v[0], &v[1]);
      std::memcpy(s.out.data(), v, sizeof(v));
      return st;
    }
    case Kind::kKept: {
      uint32_t count = 0;
      const minikv_status st = minikv_kept_positions(
          c, s.ids[0], s.layer, 1, reinterpret_cast<int32_t *>(s.out.data() + 4),
          static_cast<uint32_t>(s.out.size() / 4 - 1), &count);
      std::memcpy(s.out.data(), &count, 4);
      return st;
    }
    case Kind::kStats: {
      minikv_memory_stats ms{};
      ms.struct_size = sizeof(ms);
      const minikv_status st = minikv_memory_stats_get(c, &ms);
      std::memcpy(s.out.data(), &ms, sizeof(ms));
      return st;
    }
  }
  return MINIKV_ERR_INTERNAL;
}

// Everything observable about a cache.
struct State {
  minikv_memory_stats stats{};
  std::vector<uint64_t> lengths;          // [seq][layer][seen, cached]
  std::vector<std::vector<int32_t>> kept;  // [seq][layer][head]
  std::vector<std::vector<uint8_t>> decoded;  // [seq][layer]
};

State observe(minikv_cache *c, const Workload &w) {
  State s;
  s.stats.struct_size = sizeof(s.stats);
  REQUIRE(minikv_memory_stats_get(c, &s.stats) == MINIKV_OK);
  const minikv_config &cfg = w.cfg;
  for (uint32_t seq = 0; seq < cfg.max_sequences; ++seq) {
    for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
      uint64_t seen = 0, cached = 0;
      REQUIRE(minikv_sequence_length(c, seq, layer, &seen, &cached) == MINIKV_OK);
      s.lengths.push_back(seen);
      s.lengths.push_back(cached);
      for (uint32_t h = 0; h < cfg.num_kv_heads; ++h) {
        std::vector<int32_t> pos(600, -1);
        uint32_t count = 0;
        if (seen > 0) REQUIRE(minikv_kept_positions(c, seq, layer, h, pos.data(), 600, &count) == MINIKV_OK);
        pos.resize(count);
        s.kept.push_back(pos);
      }
      std::vector<uint8_t> out;
      if (cached > 0) {
        std::vector<uint8_t> q;
        fill(q, size_t(cfg.num_heads) * cfg.head_dim, 777 + seq * 7 + layer, cfg.dtype);
        out.assign(q.size(), 0);
        REQUIRE(minikv_decode(c, layer, 1, &seq, q.data(), out.data(), nullptr) == MINIKV_OK);
      }
      s.decoded.push_back(out);
    }
  }
  return s;
}

bool same(const State &a, const State &b) {
  return std::memcmp(&a.stats, &b.stats, sizeof(a.stats)) == 0 && a.lengths == b.lengths &&
         a.kept == b.kept && a.decoded == b.decoded;
}

// Releases every sequence, then fills the pool through one sequence's appends: with
// nothing lost, exactly num_blocks * R + (R - 1) appends fit (the last flush that needs a
// block beyond the pool fails with CAPACITY_EXCEEDED).
uint32_t capacity_probe(minikv_cache *c, const Workload &w) {
  const minikv_config &cfg = w.cfg;
  for (uint32_t s = 0; s < cfg.max_sequences; ++s) REQUIRE(minikv_sequence_release(c, s) == MINIKV_OK);
  std::vector<uint8_t> q, k, v, out;
  fill(q, size_t(cfg.num_heads) * cfg.head_dim, 1, cfg.dtype);
  fill(k, size_t(cfg.num_kv_heads) * cfg.head_dim, 2, cfg.dtype);
  fill(v, size_t(cfg.num_kv_heads) * cfg.head_dim, 3, cfg.dtype);
  out.assign(q.size(), 0);
  const uint32_t seq = 0;
  const int32_t cu[2] = {0, 1};
  REQUIRE(minikv_prefill(c, 0, 1, &seq, cu, q.data(), k.data(), v.data(), out.data(), nullptr) == MINIKV_OK);
  uint32_t appended = 0;
  while (minikv_append(c, 0, 1, &seq, k.data(), v.data(), nullptr) == MINIKV_OK) ++appended;
  REQUIRE(minikv_sequence_release(c, seq) == MINIKV_OK);
  return appended;
}

struct Control {
  std::vector<std::vector<uint8_t>> outputs;  // per step
  std::vector<uint64_t> allocations;          // per step, counted
  uint32_t probe = 0;
};

Control run_control(Workload &w) {
  Control ctl;
  minikv_cache *c = nullptr;
  for (Step &s : w.steps) {
    minikv_status st;
    uint64_t count;
    {
      alloc_control::Armed counting;
      st = run_step(s, c, w.cfg);
      count = counting.count();
    }
    INFO("control step: " << s.name);
    REQUIRE(st == MINIKV_OK);
    ctl.outputs.push_back(s.out);
    ctl.allocations.push_back(count);
  }
  ctl.probe = capacity_probe(c, w);
  minikv_cache_destroy(c);
  return ctl;
}

// A long error message, so this thread's error string has the capacity for the messages
// of the failures below (it would otherwise grow during a measured step and look like a
// leak of one block).
void prewarm_thread_error() {
  std::vector<uint8_t> buf(sizeof(minikv_config) + 8, 0);
  minikv_config_default(reinterpret_cast<minikv_config *>(buf.data()));
  const uint32_t size = sizeof(minikv_config) + 8;
  std::memcpy(buf.data(), &size, 4);
  buf.back() = 1;
  minikv_cache *c = nullptr;
  REQUIRE(minikv_cache_create(reinterpret_cast<minikv_config *>(buf.data()), &c) ==
          MINIKV_ERR_VERSION_MISMATCH);
}

struct Totals {
  uint64_t points = 0, one_shot = 0, sticky = 0;
};

// One replay with allocation `fail_at` of step `target` failing.
void inject(Workload &w, const Control &ctl, size_t target, uint64_t fail_at, bool sticky,
            Failures &f) {
  const int64_t live0 = alloc_control::live();
  minikv_cache *c = nullptr;
  const char *mode = sticky ? "sticky" : "one-shot";
  for (size_t i = 0; i < target; ++i) {
    if (run_step(w.steps[i], c, w.cfg) != MINIKV_OK) {
      f.add("replay of step %zu (%s) failed before the injection", i, w.steps[i].name.c_str());
      minikv_cache_destroy(c);
      return;
    }
  }
  Step &s = w.steps[target];
  const bool has_cache = c != nullptr;
  State before;
  if (has_cache) before = observe(c, w);
  const int64_t live_before = alloc_control::live();
  minikv_status st;
  {
    alloc_control::Armed guard(fail_at, sticky);
    st = run_step(s, c, w.cfg);
  }
  const bool expect_oom = fail_at <= ctl.allocations[target];
  const char *name = s.name.c_str();
  if (st != (expect_oom ? MINIKV_ERR_OUT_OF_MEMORY : MINIKV_OK)) {
    f.add("step %zu (%s), %s failure of allocation %llu of %llu: returned %s (%s)", target, name, mode,
          (unsigned long long)fail_at, (unsigned long long)ctl.allocations[target], minikv_status_string(st),
          minikv_last_error_message());
  }
  if (st != MINIKV_OK) {
    if (minikv_last_error_message()[0] == '\0') f.add("step %zu (%s): no thread error message", target, name);
    if (s.kind == Kind::kCreate) {
      if (c != nullptr) f.add("failed create left *out non-NULL");
      if (alloc_control::live() != live_before)
        f.add("failed create (%s, allocation %llu) leaked %lld operator-new blocks", mode,
              (unsigned long long)fail_at, (long long)(alloc_control::live() - live_before));
      st = run_step(s, c, w.cfg);  // retry
    } else {
      if (std::strcmp(minikv_cache_last_error(c), minikv_last_error_message()) != 0)
        f.add("step %zu (%s): handle error '%s' != thread error '%s'", target, name, minikv_cache_last_error(c),
              minikv_last_error_message());
      if (!same(before, observe(c, w)))
        f.add("step %zu (%s): %s failure of allocation %llu changed the cache", target, name, mode,
              (unsigned long long)fail_at);
      st = run_step(s, c, w.cfg);  // retry
    }
    if (st != MINIKV_OK) f.add("step %zu (%s): retry after OOM returned %s", target, name, minikv_status_string(st));
  }
  before = State();  // its buffers would count as live blocks below
  if (c == nullptr) return;
  // The rest of the workload, outputs bit-identical to the control.
  for (size_t i = target; i < w.steps.size(); ++i) {
    if (i > target && run_step(w.steps[i], c, w.cfg) != MINIKV_OK) {
      f.add("after OOM at step %zu allocation %llu: step %zu (%s) failed: %s", target, (unsigned long long)fail_at,
            i, w.steps[i].name.c_str(), minikv_last_error_message());
      break;
    }
    if (w.steps[i].out != ctl.outputs[i])
      f.add("after OOM at step %zu (%s) allocation %llu: step %zu (%s) output differs from the control", target,
            name, (unsigned long long)fail_at, i, w.steps[i].name.c_str());
  }
  const uint32_t probe = capacity_probe(c, w);
  if (probe != ctl.probe)
    f.add("after OOM at step %zu (%s) allocation %llu (%s): the pool holds %u appended tokens, control %u "
          "(blocks lost or double-used)",
          target, name, (unsigned long long)fail_at, mode, probe, ctl.probe);
  minikv_cache_destroy(c);
  if (alloc_control::live() != live0)
    f.add("OOM at step %zu (%s) allocation %llu (%s): %lld operator-new blocks leaked after destroy", target,
          name, (unsigned long long)fail_at, mode, (long long)(alloc_control::live() - live0));
}

void run_oom_suite(minikv_dtype dtype) {
  // Several compute threads: create then starts workers (thread states are allocations).
  setenv("MINIKV_NUM_THREADS", "3", 1);
  prewarm_thread_error();
  Workload w = make_workload(dtype);
  const Control ctl = run_control(w);
  // The pool: 16 blocks of 16 tokens; a one-token prompt keeps nothing, so 16 flushes fit
  // and the 17th fails: 16 * 16 + 15 appends.
  CHECK(ctl.probe == 16 * 16 + 15);
  // Allocation counts must be reproducible, or "the N-th allocation" means nothing.
  {
    Workload w2 = make_workload(dtype);
    const Control again = run_control(w2);
    REQUIRE(again.allocations == ctl.allocations);
  }

  Totals t;
  Failures f;
  std::string per_step;
  for (size_t i = 0; i < w.steps.size(); ++i) {
    per_step += w.steps[i].name + ": " + std::to_string(ctl.allocations[i]) + "; ";
    for (uint64_t n = 1; n <= ctl.allocations[i] + 1; ++n) {
      inject(w, ctl, i, n, false, f);
      ++t.one_shot;
      if (n <= ctl.allocations[i]) {
        inject(w, ctl, i, n, true, f);
        ++t.sticky;
      }
    }
    t.points += ctl.allocations[i];
  }
  MESSAGE("dtype " << int(dtype) << ": " << t.points << " allocation points over " << w.steps.size()
                   << " steps; " << t.one_shot << " one-shot and " << t.sticky << " sticky injections. "
                   << "Allocations per step: " << per_step);
  INFO("first failure: " << f.first);
  CHECK(f.count == 0);
  setenv("MINIKV_NUM_THREADS", "1", 1);
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("OOM injection: every allocation of create/prefill/append/decode fails cleanly (F32)") {
    run_oom_suite(MINIKV_DTYPE_F32);
  }
  TEST_CASE("OOM injection: every allocation of create/prefill/append/decode fails cleanly (F16)") {
    run_oom_suite(MINIKV_DTYPE_F16);
  }
  TEST_CASE("successful prefill (whole and in chunks) + append + decode + append_decode + queries allocate nothing") {
    // The header promises it: everything is reserved at create (the CUDA backend relies on
    // the same host path, so graph capture never meets an allocation).
    minikv_config c;
    minikv_config_default(&c);
    minikv_config_preset(&c, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
    c.backend = MINIKV_BACKEND_CPU;
    c.dtype = MINIKV_DTYPE_F32;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 16;
    c.max_sequences = 3;
    c.max_seq_len = 256;
    c.residual_length = 16;
    c.prefill_staging_tokens = 100;
    minikv_cache *cache = nullptr;
    REQUIRE(minikv_cache_create(&c, &cache) == MINIKV_OK);
    const uint32_t ids[3] = {2, 0, 1};
    const int32_t cu[4] = {0, 40, 41, 100};
    std::vector<float> q(100 * 4 * 16), kv(100 * 2 * 16), out(q.size());
    for (size_t i = 0; i < q.size(); ++i) q[i] = float((i * 7919) % 23) / 23.0f - 0.5f;
    for (size_t i = 0; i < kv.size(); ++i) kv[i] = float((i * 104729) % 29) / 29.0f - 0.5f;
    uint64_t allocations = 0;
    {
      alloc_control::Armed armed;
      REQUIRE(minikv_prefill(cache, 0, 3, ids, cu, q.data(), kv.data(), kv.data(), out.data(),
                             nullptr) == MINIKV_OK);
      // Layer 1 in two chunks (the 1-token prompt whole in the first).
      const uint32_t lens[3] = {40, 1, 59}, ids_rest[2] = {2, 1}, lens_rest[2] = {40, 59};
      const int32_t cu_first[4] = {0, 17, 18, 48}, cu_rest[3] = {0, 23, 52};
      REQUIRE(minikv_prefill_chunk(cache, 1, 3, ids, cu_first, lens, q.data(), kv.data(),
                                   kv.data(), out.data(), nullptr) == MINIKV_OK);
      REQUIRE(minikv_prefill_chunk(cache, 1, 2, ids_rest, cu_rest, lens_rest, q.data(), kv.data(),
                                   kv.data(), out.data(), nullptr) == MINIKV_OK);
      for (int step = 0; step < 40; ++step)  // 40 > residual_length: several flushes
        for (uint32_t layer = 0; layer < 2; ++layer) {
          REQUIRE(minikv_append(cache, layer, 3, ids, kv.data(), kv.data(), nullptr) == MINIKV_OK);
          REQUIRE(minikv_decode(cache, layer, 3, ids, q.data(), out.data(), nullptr) == MINIKV_OK);
          REQUIRE(minikv_append_decode(cache, layer, 3, ids, q.data(), kv.data(), kv.data(),
                                       out.data(), nullptr) == MINIKV_OK);
        }
      uint64_t seen = 0, cached = 0;
      uint32_t count = 0;
      int32_t pos[8];
      minikv_memory_stats st{};
      st.struct_size = sizeof st;
      REQUIRE(minikv_sequence_length(cache, 0, 1, &seen, &cached) == MINIKV_OK);
      REQUIRE(minikv_kept_positions(cache, 0, 1, 1, pos, 8, &count) == MINIKV_OK);
      REQUIRE(minikv_memory_stats_get(cache, &st) == MINIKV_OK);
      REQUIRE(minikv_sequence_release(cache, 1) == MINIKV_OK);
      allocations = alloc_control::g_count.load();
    }
    CHECK(allocations == 0);
    minikv_cache_destroy(cache);
  }
  TEST_CASE("a pool of 2^31 blocks fails before any large allocation") {
    // The pool size was checked only against the block count (2^31 passed), then create
    // filled an 8 GiB free list of every block before the 7 TB pool failed (15-22 s, or the
    // OOM killer on a smaller machine). Requests above 1 GiB fail here, as on a small machine.
    minikv_config c;
    minikv_config_default(&c);
    c.backend = MINIKV_BACKEND_CPU;
    c.num_layers = 1;
    c.num_heads = 8;
    c.num_kv_heads = 8;
    c.head_dim = 128;
    c.max_tokens = (uint64_t(1) << 31) * c.residual_length;
    minikv_cache *cache = reinterpret_cast<minikv_cache *>(0x1);
    minikv_status st;
    size_t largest;
    {
      alloc_control::Armed guard(0, false, size_t(1) << 30);
      st = minikv_cache_create(&c, &cache);
      largest = guard.largest();
    }
    const std::string msg = minikv_last_error_message();
    INFO("message: ", msg, "; largest request ", largest, " bytes");
    CHECK(st == MINIKV_ERR_OUT_OF_MEMORY);
    CHECK(cache == nullptr);
    CHECK(largest < (size_t(1) << 20));
    CHECK(msg.rfind("minikv_cache_create: ", 0) == 0);
    CHECK(msg.find("lower max_tokens") != std::string::npos);
  }

  TEST_CASE("host_calloc seam: set_alloc_failure makes the n-th pool allocation fail") {
    minikv_config c;
    minikv_config_default(&c);
    minikv_config_preset(&c, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
    c.backend = MINIKV_BACKEND_CPU;
    c.num_layers = 1;
    c.num_heads = c.num_kv_heads = 1;
    c.head_dim = 16;
    c.max_seq_len = 64;
    const uint64_t calls0 = minikv::testing::host_calloc_calls();
    minikv_cache *cache = nullptr;
    REQUIRE(minikv_cache_create(&c, &cache) == MINIKV_OK);
    const uint64_t per_create = minikv::testing::host_calloc_calls() - calls0;
    minikv_cache_destroy(cache);
    REQUIRE(per_create >= 1);  // the block pool (and residual slots) go through the seam
    for (uint64_t n = 1; n <= per_create; ++n) {
      minikv::testing::set_alloc_failure(n);
      cache = reinterpret_cast<minikv_cache *>(uintptr_t(1));
      CHECK(minikv_cache_create(&c, &cache) == MINIKV_ERR_OUT_OF_MEMORY);
      CHECK(cache == nullptr);
      CHECK(std::strstr(minikv_last_error_message(), "cannot allocate") != nullptr);
    }
    minikv::testing::set_alloc_failure(per_create + 1);
    REQUIRE(minikv_cache_create(&c, &cache) == MINIKV_OK);  // n beyond the calls: no failure
    minikv_cache_destroy(cache);
    minikv::testing::set_alloc_failure(0);
  }
}
