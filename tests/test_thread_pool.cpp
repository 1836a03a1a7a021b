// minikv-test: white-box. The CPU backend's thread pool (src/cpu/thread_pool.h): every item
// of every job runs exactly once, even when jobs follow each other faster than the workers
// wake (a late worker must not take an item of the next job nor run one twice); the first
// exception is rethrown, the remaining items are skipped, and the pool keeps working.
#include <doctest/doctest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "cpu/thread_pool.h"
#include "splitmix64.hpp"

namespace {

using minikv::cpu::ThreadPool;

TEST_SUITE("cpu") {

TEST_CASE("thread pool: every item of many short jobs runs once on a valid worker") {
  for (unsigned threads : {2u, 3u, 5u}) {
    ThreadPool pool(threads);
    testdata::SplitMix64 rng(threads);
    std::vector<std::atomic<uint32_t>> runs(64);
    uint64_t wrong = 0;
    for (int job = 0; job < 20000; ++job) {
      const uint64_t n = rng.next() % 40;  // 0 and 1 included: the paths without workers
      for (auto &r : runs) r.store(0, std::memory_order_relaxed);
      std::atomic<uint32_t> bad_worker{0};
      pool.parallel_for(n, [&](uint64_t i, unsigned worker) {
        if (worker >= threads) bad_worker.fetch_add(1);
        runs[i < runs.size() ? i : runs.size() - 1].fetch_add(1, std::memory_order_relaxed);
      });
      for (uint64_t i = 0; i < runs.size(); ++i) wrong += runs[i].load(std::memory_order_relaxed) != (i < n);
      wrong += bad_worker.load();
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("thread pool: the first exception is rethrown and the pool runs the next job whole") {
  ThreadPool pool(3);
  for (int round = 0; round < 200; ++round) {
    const uint64_t n = 50;
    std::vector<std::atomic<uint32_t>> runs(n);
    bool thrown = false;
    try {
      pool.parallel_for(n, [&](uint64_t i, unsigned) {
        runs[i].fetch_add(1);
        if (i % 7 == 3) throw std::runtime_error("item failed");
      });
    } catch (const std::runtime_error &) {
      thrown = true;
    }
    CHECK(thrown);
    for (uint64_t i = 0; i < n; ++i) CHECK(runs[i].load() <= 1);  // run once or skipped
    std::atomic<uint64_t> sum{0};
    pool.parallel_for(n, [&](uint64_t i, unsigned) { sum.fetch_add(i + 1); });
    CHECK(sum.load() == n * (n + 1) / 2);
  }
}

}  // TEST_SUITE

}  // namespace
