// fork(): a handle created before fork() works in the child (Python's multiprocessing
// forks exactly so). The CPU backend's worker threads exist only in the parent; the child
// must start its own instead of waiting forever for the parent's. A hang shows up as the
// child killed by its alarm, never as a hung test. Not run under TSan, which does not
// support new threads after a multi-threaded fork.
#include <doctest/doctest.h>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "exact_fill.hpp"
#include "minikv.h"

namespace {

using reliability::fill;

constexpr unsigned kChildSeconds = 20;  // a child still running then is hung

struct Fixture {
  minikv_config cfg;
  minikv_cache *cache = nullptr;
  std::vector<uint8_t> q;  // one decode query per sequence

  Fixture() {
    const char *env = std::getenv("MINIKV_NUM_THREADS");
    const std::string saved = env ? env : "";
    setenv("MINIKV_NUM_THREADS", "4", 1);  // workers exist even on a one-core machine
    minikv_config_default(&cfg);
    cfg.backend = MINIKV_BACKEND_CPU;
    cfg.dtype = MINIKV_DTYPE_F32;
    cfg.num_layers = 2;
    cfg.num_heads = 8;
    cfg.num_kv_heads = 2;
    cfg.head_dim = 32;
    cfg.max_sequences = 3;
    cfg.max_seq_len = 256;
    cfg.residual_length = 32;
    const minikv_status st = minikv_cache_create(&cfg, &cache);
    if (env) {
      setenv("MINIKV_NUM_THREADS", saved.c_str(), 1);
    } else {
      unsetenv("MINIKV_NUM_THREADS");
    }
    REQUIRE(st == MINIKV_OK);
    for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
      REQUIRE(prefill(layer, {0, 1}, {70, 45}, 10 + layer) == MINIKV_OK);
      REQUIRE(append(layer, {0, 1}, 20 + layer) == MINIKV_OK);
    }
    fill(q, 2 * cfg.num_heads * cfg.head_dim, 99, cfg.dtype);
  }
  ~Fixture() { minikv_cache_destroy(cache); }

  minikv_status prefill(uint32_t layer, std::vector<uint32_t> ids, std::vector<int32_t> lens,
                        uint64_t seed) {
    std::vector<int32_t> cu{0};
    for (int32_t l : lens) cu.push_back(cu.back() + l);
    std::vector<uint8_t> qp, k, v;
    fill(qp, size_t(cu.back()) * cfg.num_heads * cfg.head_dim, seed, cfg.dtype);
    fill(k, size_t(cu.back()) * cfg.num_kv_heads * cfg.head_dim, seed + 1, cfg.dtype);
    fill(v, size_t(cu.back()) * cfg.num_kv_heads * cfg.head_dim, seed + 2, cfg.dtype);
    std::vector<uint8_t> out(qp.size());
    return minikv_prefill(cache, layer, static_cast<uint32_t>(ids.size()), ids.data(), cu.data(),
                          qp.data(), k.data(), v.data(), out.data(), nullptr);
  }
  minikv_status append(uint32_t layer, std::vector<uint32_t> ids, uint64_t seed) {
    std::vector<uint8_t> k, v;
    fill(k, ids.size() * cfg.num_kv_heads * cfg.head_dim, seed, cfg.dtype);
    fill(v, ids.size() * cfg.num_kv_heads * cfg.head_dim, seed + 1, cfg.dtype);
    return minikv_append(cache, layer, static_cast<uint32_t>(ids.size()), ids.data(), k.data(),
                         v.data(), nullptr);
  }
  // Decode output of sequences 0 and 1 in every layer, or empty on failure.
  std::vector<uint8_t> decode_all() {
    std::vector<uint8_t> all;
    const uint32_t ids[2] = {0, 1};
    for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
      std::vector<uint8_t> out(q.size());
      if (minikv_decode(cache, layer, 2, ids, q.data(), out.data(), nullptr) != MINIKV_OK) return {};
      all.insert(all.end(), out.begin(), out.end());
    }
    return all;
  }
};

// Runs `child` in a forked child (exit status: its return value) and returns what happened:
// "exit N", or "killed by signal N" (the alarm: a hang).
template <typename Fn>
std::string in_child(Fn &&child) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    alarm(kChildSeconds);
    _exit(child());  // no doctest reporting, no atexit handlers of the parent
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  return "killed by signal " + std::to_string(WIFSIGNALED(status) ? WTERMSIG(status) : -1);
}

}  // namespace

TEST_SUITE("cpu") {
  TEST_CASE("fork: a handle created before fork works in the child and in the parent") {
    Fixture f;
    const std::vector<uint8_t> before = f.decode_all();
    REQUIRE(!before.empty());
    // The child decodes (same outputs), appends, prefills a new sequence, and forks again.
    const std::string child = in_child([&] {
      if (f.decode_all() != before) return 1;
      for (uint32_t layer = 0; layer < f.cfg.num_layers; ++layer) {
        if (f.append(layer, {0, 1}, 30 + layer) != MINIKV_OK) return 2;
        if (f.prefill(layer, {2}, {90}, 40 + layer) != MINIKV_OK) return 3;
      }
      if (f.decode_all().empty()) return 4;
      // A grandchild: the child's own workers are gone there too.
      const pid_t pid = fork();
      if (pid < 0) return 5;
      if (pid == 0) {
        alarm(kChildSeconds);
        _exit(f.decode_all().empty() ? 6 : 0);
      }
      int status = 0;
      if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 7;
      return WEXITSTATUS(status);
    });
    CHECK(child == "exit 0");
    // The parent's handle is untouched by what the child did.
    CHECK(f.decode_all() == before);
  }

  TEST_CASE("fork: destroying an inherited handle in the child returns") {
    Fixture f;
    const std::string child = in_child([&] {
      minikv_cache_destroy(f.cache);  // must not join the parent's workers
      f.cache = nullptr;
      return 0;
    });
    CHECK(child == "exit 0");
    CHECK(!f.decode_all().empty());
  }
}
