// Thread safety and determinism of the C API (CPU backend), per the model minikv.h states:
// a handle is used by one thread at a time (any thread); distinct handles are independent;
// the last-error message is kept per thread (minikv_last_error_message) and per handle
// (minikv_cache_last_error). scripts/reliability.sh also runs this file under TSan.
//   * N threads, each driving its own cache, give results bit-identical to a serial run;
//   * a handle handed from thread to thread (with synchronization) behaves as on one thread;
//   * one thread's failure is not visible as another thread's error; handle errors are
//     per handle and readable from any thread; under contention each thread sees its own;
//   * a handle used by two threads at once: the second call fails with BAD_STATE naming
//     both calls and changes nothing (never a data race);
//   * outputs and kept positions are bit-identical across runs and across
//     MINIKV_NUM_THREADS = 1, 2, 4 (the compute pool size the CPU backend reads at create).
#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "exact_fill.hpp"
#include "handle.h"  // white-box: minikv_cache::in_use
#include "minikv.h"

namespace {

using reliability::fill;

struct Result {
  std::vector<uint8_t> outputs;  // every prefill and decode output, in call order
  std::vector<int32_t> kept;     // every (sequence, layer, head)'s kept positions
  std::vector<uint64_t> lengths;
  minikv_memory_stats stats{};
  std::string failure;  // first unexpected status, with its message
};

minikv_config workload_config(uint64_t seed) {
  minikv_config c;
  minikv_config_default(&c);
  minikv_config_preset(&c, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
  c.backend = MINIKV_BACKEND_CPU;
  c.dtype = seed % 2 ? MINIKV_DTYPE_F16 : MINIKV_DTYPE_F32;
  c.num_layers = 2;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.max_sequences = 4;
  c.max_seq_len = 256;
  c.group_size = 16;
  c.residual_length = 32;
  c.budget_policy = seed % 3 == 0 ? MINIKV_BUDGET_PYRAMID : MINIKV_BUDGET_UNIFORM;
  c.score_mode = seed % 4 == 1 ? MINIKV_SCORE_WINDOW : MINIKV_SCORE_CUMULATIVE;
  c.window_size = 8;
  c.key_bits = seed % 5 == 2 ? 4 : 2;
  return c;
}

// The steps of one workload, split so that consecutive steps can run on different threads.
class Workload {
 public:
  explicit Workload(uint64_t seed) : seed_(seed), cfg_(workload_config(seed)) {}
  const minikv_config &config() const { return cfg_; }
  size_t num_steps() const { return 3 + kGenSteps + 2; }

  // Runs step i on `cache` (created by step 0, destroyed by the last step).
  void step(size_t i, minikv_cache *&cache, Result &r) {
    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
    auto check = [&](minikv_status st, const char *what) {
      if (st != MINIKV_OK && r.failure.empty())
        r.failure = std::string(what) + ": " + minikv_status_string(st) + " (" + minikv_last_error_message() + ")";
    };
    if (i == 0) {
      check(minikv_cache_create(&cfg_, &cache), "create");
      return;
    }
    if (i == 1 || i == 2) {
      // A batch of three prompts of different lengths in every layer (step 2 adds a fourth
      // sequence, prefilled alone).
      const std::vector<uint32_t> ids = i == 1 ? std::vector<uint32_t>{2, 0, 1} : std::vector<uint32_t>{3};
      const std::vector<int32_t> lens = i == 1 ? std::vector<int32_t>{97, 40 + int32_t(seed_ % 7), 64}
                                               : std::vector<int32_t>{33};
      std::vector<int32_t> cu{0};
      for (int32_t l : lens) cu.push_back(cu.back() + l);
      for (uint32_t layer = 0; layer < cfg_.num_layers; ++layer) {
        std::vector<uint8_t> q, k, v;
        fill(q, size_t(cu.back()) * H * D, seed_ * 100 + i * 10 + layer, cfg_.dtype);
        fill(k, size_t(cu.back()) * Hkv * D, seed_ * 100 + i * 10 + layer + 3, cfg_.dtype);
        fill(v, size_t(cu.back()) * Hkv * D, seed_ * 100 + i * 10 + layer + 6, cfg_.dtype);
        std::vector<uint8_t> out(q.size(), 0);
        check(minikv_prefill(cache, layer, static_cast<uint32_t>(ids.size()), ids.data(), cu.data(), q.data(),
                             k.data(), v.data(), out.data(), nullptr),
              "prefill");
        r.outputs.insert(r.outputs.end(), out.begin(), out.end());
      }
      return;
    }
    if (i < 3 + kGenSteps) {
      // One generation step: append + decode for every sequence in every layer (flushes
      // happen every residual_length steps).
      const std::vector<uint32_t> ids{0, 1, 2, 3};
      for (uint32_t layer = 0; layer < cfg_.num_layers; ++layer) {
        std::vector<uint8_t> q, k, v;
        fill(k, ids.size() * Hkv * D, seed_ * 7919 + i * 13 + layer, cfg_.dtype);
        fill(v, ids.size() * Hkv * D, seed_ * 7919 + i * 13 + layer + 5, cfg_.dtype);
        fill(q, ids.size() * H * D, seed_ * 7919 + i * 13 + layer + 9, cfg_.dtype);
        std::vector<uint8_t> out(q.size(), 0);
        check(minikv_append(cache, layer, 4, ids.data(), k.data(), v.data(), nullptr), "append");
        check(minikv_decode(cache, layer, 4, ids.data(), q.data(), out.data(), nullptr), "decode");
        r.outputs.insert(r.outputs.end(), out.begin(), out.end());
      }
      return;
    }
    if (i == 3 + kGenSteps) {
      // Observe everything: kept positions, lengths, stats.
      for (uint32_t s = 0; s < cfg_.max_sequences; ++s) {
        for (uint32_t layer = 0; layer < cfg_.num_layers; ++layer) {
          uint64_t seen = 0, cached = 0;
          check(minikv_sequence_length(cache, s, layer, &seen, &cached), "sequence_length");
          r.lengths.push_back(seen);
          r.lengths.push_back(cached);
          for (uint32_t h = 0; h < Hkv; ++h) {
            uint32_t count = 0;
            check(minikv_kept_positions(cache, s, layer, h, nullptr, 0, &count), "kept_positions size");
            std::vector<int32_t> pos(count);
            check(minikv_kept_positions(cache, s, layer, h, pos.data(), count, &count), "kept_positions");
            r.kept.push_back(static_cast<int32_t>(count));
            r.kept.insert(r.kept.end(), pos.begin(), pos.end());
          }
        }
      }
      r.stats.struct_size = sizeof(r.stats);
      check(minikv_memory_stats_get(cache, &r.stats), "stats");
      return;
    }
    minikv_cache_destroy(cache);
    cache = nullptr;
  }

  Result run() {
    Result r;
    minikv_cache *cache = nullptr;
    for (size_t i = 0; i < num_steps(); ++i) step(i, cache, r);
    return r;
  }

 private:
  static constexpr size_t kGenSteps = 40;  // > residual_length: at least one flush
  uint64_t seed_;
  minikv_config cfg_;
};

void require_same(const Result &a, const Result &b, const std::string &what) {
  INFO(what);
  REQUIRE(a.failure == "");
  REQUIRE(b.failure == "");
  CHECK(a.outputs.size() == b.outputs.size());
  CHECK(a.outputs == b.outputs);
  CHECK(a.kept == b.kept);
  CHECK(a.lengths == b.lengths);
}

// A reusable barrier (C++17 has no std::barrier).
class Barrier {
 public:
  explicit Barrier(unsigned n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const unsigned gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen != gen_; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  unsigned n_, count_ = 0, gen_ = 0;
};

minikv_cache *small_cache() {
  minikv_config c;
  minikv_config_default(&c);
  minikv_config_preset(&c, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
  c.backend = MINIKV_BACKEND_CPU;
  c.num_layers = 2;
  c.num_heads = c.num_kv_heads = 1;
  c.head_dim = 16;
  c.max_sequences = 2;
  c.max_seq_len = 64;
  minikv_cache *cache = nullptr;
  REQUIRE(minikv_cache_create(&c, &cache) == MINIKV_OK);
  return cache;
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("threads: N threads with their own caches are bit-identical to a serial run") {
    constexpr unsigned kThreads = 4;
    std::vector<Result> serial(kThreads), parallel(kThreads);
    for (unsigned t = 0; t < kThreads; ++t) serial[t] = Workload(t).run();
    // Workloads differ (dtype, policy, score mode, bits): the comparison is not trivial.
    CHECK(serial[0].outputs != serial[1].outputs);
    Barrier start(kThreads);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        start.wait();  // maximize overlap
        parallel[t] = Workload(t).run();
      });
    }
    for (std::thread &th : threads) th.join();
    for (unsigned t = 0; t < kThreads; ++t) require_same(serial[t], parallel[t], "workload " + std::to_string(t));
  }

  TEST_CASE("threads: a handle handed from thread to thread behaves as on one thread") {
    Workload ref(5);
    const Result expected = ref.run();
    Workload w(5);
    Result r;
    minikv_cache *cache = nullptr;
    // Each step on a new thread; join() orders the uses (one thread at a time).
    for (size_t i = 0; i < w.num_steps(); ++i) std::thread([&, i] { w.step(i, cache, r); }).join();
    require_same(expected, r, "migrating handle");
  }

  TEST_CASE("threads: the last error is per thread and per handle") {
    minikv_cache *a = small_cache(), *b = small_cache(), *untouched = small_cache();
    Barrier sync(2);
    std::string a_msg, b_msg, a_seen_by_b, a_after_b, b_thread_before;
    std::thread ta([&] {
      uint32_t seq = 0;
      std::vector<uint8_t> buf(64, 0);
      // Decode before prefill: BAD_STATE on handle a.
      CHECK(minikv_decode(a, 1, 1, &seq, buf.data(), buf.data(), nullptr) == MINIKV_ERR_BAD_STATE);
      a_msg = minikv_last_error_message();
      sync.wait();  // 1: a failed
      sync.wait();  // 2: b looked, then failed on its own
      a_after_b = minikv_last_error_message();
    });
    std::thread tb([&] {
      sync.wait();  // 1
      b_thread_before = minikv_last_error_message();  // this thread has not failed yet
      a_seen_by_b = minikv_cache_last_error(a);       // the handle's error, from another thread
      CHECK(minikv_sequence_release(b, 77) == MINIKV_ERR_INVALID_ARGUMENT);
      b_msg = minikv_last_error_message();
      sync.wait();  // 2
    });
    ta.join();
    tb.join();
    CHECK(a_msg.find("not been prefilled") != std::string::npos);
    CHECK(b_msg.find("77") != std::string::npos);
    CHECK(b_thread_before == "");
    CHECK(a_seen_by_b == a_msg);
    CHECK(a_after_b == a_msg);  // b's failure did not overwrite a's thread error
    CHECK(std::string(minikv_cache_last_error(a)) == a_msg);
    CHECK(std::string(minikv_cache_last_error(b)) == b_msg);
    CHECK(std::string(minikv_cache_last_error(untouched)) == "");
    minikv_cache_destroy(a);
    minikv_cache_destroy(b);
    minikv_cache_destroy(untouched);
  }

  TEST_CASE("threads: a handle held by another call gives BAD_STATE naming both calls") {
    // Deterministic: hold the handle as a call running on another thread would.
    minikv_cache *cache = small_cache();
    const uint32_t seq = 0;
    const int32_t cu[2] = {0, 20};
    std::vector<uint8_t> buf(20 * 16 * 2, 0);
    REQUIRE(minikv_prefill(cache, 0, 1, &seq, cu, buf.data(), buf.data(), buf.data(), buf.data(),
                           nullptr) == MINIKV_OK);
    CHECK(minikv_sequence_release(cache, 99) == MINIKV_ERR_INVALID_ARGUMENT);
    const std::string handle_error = minikv_cache_last_error(cache);
    cache->in_use.store("minikv_prefill");
    std::vector<std::pair<const char *, std::function<minikv_status()>>> calls = {
        {"minikv_prefill", [&] { return minikv_prefill(cache, 1, 1, &seq, cu, buf.data(), buf.data(),
                                                       buf.data(), buf.data(), nullptr); }},
        {"minikv_append", [&] { return minikv_append(cache, 0, 1, &seq, buf.data(), buf.data(), nullptr); }},
        {"minikv_decode", [&] { return minikv_decode(cache, 0, 1, &seq, buf.data(), buf.data(), nullptr); }},
        {"minikv_sequence_release", [&] { return minikv_sequence_release(cache, 0); }},
        {"minikv_sequence_length", [&] { return minikv_sequence_length(cache, 0, 0, nullptr, nullptr); }},
        {"minikv_kept_positions", [&] {
           uint32_t n = 0;
           return minikv_kept_positions(cache, 0, 0, 0, nullptr, 0, &n);
         }},
        {"minikv_memory_stats_get", [&] {
           minikv_memory_stats st{};
           st.struct_size = sizeof(st);
           return minikv_memory_stats_get(cache, &st);
         }},
        {"minikv_cache_backend", [&] {
           minikv_backend b;
           return minikv_cache_backend(cache, &b);
         }}};
    for (auto &call : calls) {
      CAPTURE(call.first);
      CHECK(call.second() == MINIKV_ERR_BAD_STATE);
      const std::string msg = minikv_last_error_message();
      CHECK(msg.rfind(std::string(call.first) + ": the cache is in use by minikv_prefill on another thread", 0) == 0);
      CHECK(std::string(minikv_cache_last_error(cache)) == handle_error);  // the holder's to write
    }
    cache->in_use.store(nullptr);
    uint64_t seen = 0, cached = 0;
    CHECK(minikv_sequence_length(cache, 0, 0, &seen, &cached) == MINIKV_OK);
    CHECK(seen == 20);  // nothing changed: not released, not appended
    CHECK(minikv_sequence_length(cache, 0, 1, &seen, nullptr) == MINIKV_OK);
    CHECK(seen == 0);
    minikv_cache_destroy(cache);
  }

  TEST_CASE("threads: two threads on one handle at once - the second call fails with BAD_STATE") {
    // A long prefill on one thread while this thread keeps querying the same handle: each
    // query that overlaps the prefill must fail cleanly (BAD_STATE naming both calls), never
    // race. It used to succeed silently (a data race; with compute calls on both threads the
    // CPU backend's pool deadlocked or returned wrong outputs).
    minikv_config c;
    minikv_config_default(&c);
    c.backend = MINIKV_BACKEND_CPU;
    c.dtype = MINIKV_DTYPE_F32;
    c.num_layers = 2;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.max_sequences = 2;
    c.max_seq_len = 768;
    minikv_cache *cache = nullptr;
    REQUIRE(minikv_cache_create(&c, &cache) == MINIKV_OK);
    const int32_t L = 768;
    std::vector<uint8_t> q, k, v;
    fill(q, size_t(L) * 8 * 64, 1, c.dtype);
    fill(k, size_t(L) * 2 * 64, 2, c.dtype);
    fill(v, size_t(L) * 2 * 64, 3, c.dtype);
    std::vector<uint8_t> out(q.size());
    const int32_t cu[2] = {0, L};
    uint32_t overlaps = 0, wrong = 0, prefills = 0;
    for (uint32_t attempt = 0; attempt < 50 && overlaps == 0; ++attempt) {
      std::atomic<int> phase{0};  // 1: the prefill is about to start, 2: it returned
      minikv_status prefill_status = MINIKV_OK;
      std::string prefill_message;
      const uint32_t layer = attempt % 2, seq = (attempt / 2) % 2;
      std::thread other([&] {
        phase.store(1);
        prefill_status = minikv_prefill(cache, layer, 1, &seq, cu, q.data(), k.data(), v.data(),
                                        out.data(), nullptr);
        if (prefill_status != MINIKV_OK) prefill_message = minikv_last_error_message();
        phase.store(2);
      });
      while (phase.load() == 0) std::this_thread::yield();
      while (phase.load() == 1) {
        uint64_t seen = 0;
        const minikv_status st = minikv_sequence_length(cache, seq, layer, &seen, nullptr);
        if (st == MINIKV_ERR_BAD_STATE) {
          ++overlaps;
          if (std::string(minikv_last_error_message()).find(
                  "minikv_sequence_length: the cache is in use by minikv_prefill") != 0)
            ++wrong;
        } else if (st != MINIKV_OK || (seen != 0 && seen != uint64_t(L))) {
          ++wrong;
        }
      }
      other.join();
      if (prefill_status == MINIKV_OK) {
        ++prefills;
        REQUIRE(minikv_sequence_release(cache, seq) == MINIKV_OK);
      } else if (prefill_status != MINIKV_ERR_BAD_STATE ||  // lost the handle to a query
                 prefill_message.find("minikv_prefill: the cache is in use by "
                                      "minikv_sequence_length") != 0) {
        ++wrong;
      }
    }
    CHECK(overlaps > 0);
    CHECK(wrong == 0);
    minikv_cache_destroy(cache);
  }

  TEST_CASE("threads: concurrent failures - each thread and handle sees its own message") {
    constexpr unsigned kThreads = 4, kIters = 300;
    std::vector<minikv_cache *> caches;
    for (unsigned t = 0; t < kThreads; ++t) caches.push_back(small_cache());
    std::vector<unsigned> wrong(kThreads, 0);
    Barrier start(kThreads);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        start.wait();
        for (unsigned i = 0; i < kIters; ++i) {
          // A distinct bad seq_id per thread and iteration: the message must name it.
          const uint32_t id = 1000000 + t * 10000 + i;
          if (minikv_sequence_release(caches[t], id) != MINIKV_ERR_INVALID_ARGUMENT) ++wrong[t];
          const std::string want = std::to_string(id);
          if (std::string(minikv_last_error_message()).find(want) == std::string::npos) ++wrong[t];
          if (std::string(minikv_cache_last_error(caches[t])).find(want) == std::string::npos) ++wrong[t];
          // A successful call does not clear either.
          uint64_t seen = 0;
          if (minikv_sequence_length(caches[t], 0, 0, &seen, nullptr) != MINIKV_OK) ++wrong[t];
          if (std::string(minikv_last_error_message()).find(want) == std::string::npos) ++wrong[t];
        }
      });
    }
    for (std::thread &th : threads) th.join();
    for (unsigned t = 0; t < kThreads; ++t) {
      INFO("thread " << t);
      CHECK(wrong[t] == 0);
      minikv_cache_destroy(caches[t]);
    }
  }

  TEST_CASE("determinism: bit-identical across runs and across MINIKV_NUM_THREADS = 1/2/4") {
    const char *old = std::getenv("MINIKV_NUM_THREADS");
    const std::string saved = old ? old : "";
    for (uint64_t seed : {0u, 1u, 2u, 3u, 5u}) {
      std::vector<Result> by_threads;
      for (const char *n : {"1", "2", "4"}) {
        setenv("MINIKV_NUM_THREADS", n, 1);  // read by the CPU backend at create
        by_threads.push_back(Workload(seed).run());
      }
      setenv("MINIKV_NUM_THREADS", "4", 1);
      const Result again = Workload(seed).run();
      const std::string what = "seed " + std::to_string(seed);
      require_same(by_threads[0], by_threads[1], what + ": 1 vs 2 threads");
      require_same(by_threads[0], by_threads[2], what + ": 1 vs 4 threads");
      require_same(by_threads[2], again, what + ": two runs with 4 threads");
      // The variable took effect: per-thread scratch makes the workspace grow.
      CHECK(by_threads[0].stats.workspace_bytes < by_threads[1].stats.workspace_bytes);
      CHECK(by_threads[1].stats.workspace_bytes < by_threads[2].stats.workspace_bytes);
      CHECK(by_threads[0].stats.used_bytes == by_threads[2].stats.used_bytes);
    }
    if (old) {
      setenv("MINIKV_NUM_THREADS", saved.c_str(), 1);
    } else {
      unsetenv("MINIKV_NUM_THREADS");
    }
  }
}
