// The CPU-vs-CUDA harness shared by the GPU suites: a Case (one configuration and ragged
// batch), a Pair of caches (CPU and CUDA) driven with the same calls and compared on every
// output, and run_case (prefill two layers, then decode step by step across flushes).
#pragma once

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_util.h"

namespace gt {

struct Case {
  const char *name;
  minikv_dtype dtype;
  uint32_t head_dim, heads, kv_heads;
  minikv_score_mode mode;
  uint32_t key_bits, value_bits, group, residual;
  minikv_budget_policy policy;
  float heavy, recent;
  std::vector<uint32_t> lens;
  uint32_t steps;
  float q_scale = 1.0f;  // std of the decode queries (extreme magnitudes: tiny or large logits)
  uint32_t sinks = 0;    // sink_tokens
  bool saturated = false;  // keys and values at two levels (Tensor::saturate)
  uint32_t flush = 0;      // flush_tokens (0: the whole residual)
};

inline minikv_config make_config(const Case &c, minikv_backend backend) {
  minikv_config cfg;
  minikv_config_default(&cfg);
  minikv_config_preset(&cfg, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
  cfg.backend = backend;
  cfg.dtype = c.dtype;
  cfg.num_layers = 2;
  cfg.num_heads = c.heads;
  cfg.num_kv_heads = c.kv_heads;
  cfg.head_dim = c.head_dim;
  cfg.max_sequences = static_cast<uint32_t>(c.lens.size()) + 1;
  cfg.max_seq_len = *std::max_element(c.lens.begin(), c.lens.end()) + c.steps + 8;
  cfg.score_mode = c.mode;
  cfg.key_bits = c.key_bits;
  cfg.value_bits = c.value_bits;
  cfg.group_size = c.group;
  cfg.residual_length = c.residual;
  cfg.budget_policy = c.policy;
  cfg.heavy_ratio = c.heavy;
  cfg.recent_ratio = c.recent;
  cfg.sink_tokens = c.sinks;
  cfg.flush_tokens = c.flush;
  return cfg;
}

// Two caches hold the same tokens in the same bytes and pool.
inline void check_stats_equal(minikv_cache *x, minikv_cache *y) {
  minikv_memory_stats a{}, b{};
  a.struct_size = b.struct_size = sizeof(minikv_memory_stats);
  MKV_OK(minikv_memory_stats_get(x, &a));
  MKV_OK(minikv_memory_stats_get(y, &b));
  CHECK_EQ(a.used_bytes, b.used_bytes);
  CHECK_EQ(a.tokens_seen, b.tokens_seen);
  CHECK_EQ(a.tokens_cached, b.tokens_cached);
  CHECK_EQ(a.pool_bytes, b.pool_bytes);
}

// A CPU cache and a CUDA cache driven with the same calls.
class Pair {
 public:
  explicit Pair(minikv_config cfg) : cfg_(cfg) {
    cfg.backend = MINIKV_BACKEND_CPU;
    MKV_OK(minikv_cache_create(&cfg, &cpu_));
    cfg.backend = MINIKV_BACKEND_CUDA;
    MKV_OK(minikv_cache_create(&cfg, &gpu_));
  }
  ~Pair() {
    minikv_cache_destroy(cpu_);
    minikv_cache_destroy(gpu_);
  }
  Pair(const Pair &) = delete;
  Pair &operator=(const Pair &) = delete;
  minikv_cache *cpu() const { return cpu_; }
  minikv_cache *gpu() const { return gpu_; }
  const minikv_config &cfg() const { return cfg_; }

  // Prefill of one layer on both; compares outputs and kept positions.
  void prefill(uint32_t layer, const std::vector<uint32_t> &ids, const gt::Prompt &p) {
    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
    const size_t T = p.cu.back();
    INFO("layer " << layer << ", input seed " << p.seed);
    std::vector<uint16_t> out_cpu(T * H * D);
    MKV_OK(minikv_prefill(cpu_, layer, static_cast<uint32_t>(ids.size()), ids.data(), p.cu.data(),
                          p.q.bits.data(), p.k.bits.data(), p.v.bits.data(), out_cpu.data(), nullptr));
    DevBuf q(p.q.size() * 2), k(p.k.size() * 2), v(p.v.size() * 2), out(T * H * D * 2);
    q.upload(p.q.bits);
    k.upload(p.k.bits);
    v.upload(p.v.bits);
    CUDA_OK(cudaMemset(out.get(), 0xff, T * H * D * 2));  // NaN poison: every element must be written
    MKV_OK(minikv_prefill(gpu_, layer, static_cast<uint32_t>(ids.size()), ids.data(), p.cu.data(),
                          q.get(), k.get(), v.get(), out.get(), nullptr));
    gt::check_close(Tensor::from_device(cfg_.dtype, out, T * H * D),
                    Tensor::from_host_bits(cfg_.dtype, out_cpu), gt::attention_tol(cfg_.dtype),
                    "prefill output");
    for (size_t s = 0; s < ids.size(); ++s)
      for (uint32_t kvh = 0; kvh < Hkv; ++kvh) {
        INFO("seq_id " << ids[s] << " kv_head " << kvh);
        const std::vector<int32_t> c = kept(cpu_, ids[s], layer, kvh);
        const std::vector<int32_t> g = kept(gpu_, ids[s], layer, kvh);
        CHECK(g == c);
        CHECK(c == p.expected_kept[s * Hkv + kvh]);
      }
  }

  // Append + decode of one random token per sequence on both; compares the outputs.
  void step(uint32_t layer, const std::vector<uint32_t> &ids, std::mt19937 &rng,
            const std::string &what, float q_scale = 1.0f, bool saturated = false) {
    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
    const uint32_t n = static_cast<uint32_t>(ids.size());
    Tensor k(cfg_.dtype, size_t(n) * Hkv * D), v(cfg_.dtype, size_t(n) * Hkv * D),
        q(cfg_.dtype, size_t(n) * H * D);
    k.fill_normal(rng, 1.5f);
    v.fill_normal(rng, 1.0f);
    if (saturated) {
      k.saturate(-2.8f);
      v.saturate(-1.9f);
    }
    q.fill_normal(rng, q_scale);
    std::vector<uint16_t> out_cpu(q.size());
    MKV_OK(minikv_append(cpu_, layer, n, ids.data(), k.bits.data(), v.bits.data(), nullptr));
    MKV_OK(minikv_decode(cpu_, layer, n, ids.data(), q.bits.data(), out_cpu.data(), nullptr));
    DevBuf kd(k.size() * 2), vd(v.size() * 2), qd(q.size() * 2), od(q.size() * 2);
    kd.upload(k.bits);
    vd.upload(v.bits);
    qd.upload(q.bits);
    CUDA_OK(cudaMemset(od.get(), 0xff, q.size() * 2));
    MKV_OK(minikv_append(gpu_, layer, n, ids.data(), kd.get(), vd.get(), nullptr));
    MKV_OK(minikv_decode(gpu_, layer, n, ids.data(), qd.get(), od.get(), nullptr));
    gt::check_close(Tensor::from_device(cfg_.dtype, od, q.size()),
                    Tensor::from_host_bits(cfg_.dtype, out_cpu), gt::attention_tol(cfg_.dtype),
                    what);
    for (uint32_t id : ids) {
      uint64_t seen_c, cached_c, seen_g, cached_g;
      MKV_OK(minikv_sequence_length(cpu_, id, layer, &seen_c, &cached_c));
      MKV_OK(minikv_sequence_length(gpu_, id, layer, &seen_g, &cached_g));
      CHECK_EQ(seen_c, seen_g);
      CHECK_EQ(cached_c, cached_g);
    }
  }

  static std::vector<int32_t> kept(minikv_cache *c, uint32_t id, uint32_t layer, uint32_t kvh) {
    uint32_t count = 0;
    MKV_OK(minikv_kept_positions(c, id, layer, kvh, nullptr, 0, &count));
    std::vector<int32_t> pos(count);
    uint32_t again = 0;
    MKV_OK(minikv_kept_positions(c, id, layer, kvh, pos.data(), count, &again));
    CHECK_EQ(again, count);
    return pos;
  }

  void check_stats() const { check_stats_equal(cpu_, gpu_); }

 private:
  minikv_config cfg_;
  minikv_cache *cpu_ = nullptr, *gpu_ = nullptr;
};

inline void run_case(const Case &c) {
  INFO("case " << std::string(c.name));
  if (configs_only()) {
    check_config_on_cpu(make_config(c, MINIKV_BACKEND_CUDA));
    return;
  }
  Pair pair(make_config(c, MINIKV_BACKEND_CUDA));
  std::vector<uint32_t> ids(c.lens.size());
  std::iota(ids.begin(), ids.end(), 0u);
  std::reverse(ids.begin(), ids.end());  // slots not in batch order
  for (uint32_t layer = 0; layer < 2; ++layer)
    pair.prefill(layer, ids, gt::make_prompt(pair.cfg(), layer, c.lens, 17 + layer, c.saturated));
  pair.check_stats();
  std::mt19937 rng(99);
  for (uint32_t step = 0; step < c.steps; ++step)
    for (uint32_t layer = 0; layer < 2; ++layer)
      pair.step(layer, ids, rng, "decode step " + std::to_string(step) + " layer " + std::to_string(layer),
                c.q_scale, c.saturated);
  pair.check_stats();
}

}  // namespace gt
