// Determinism of the CUDA backend (issue 7): the same inputs on two fresh caches give
// bit-identical prefill outputs, kept positions and decode outputs at every step (no
// atomics-order or split-dependent results). Skipped when no CUDA device is present.
#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "gpu_util.h"

namespace {

using gt::DevBuf;
using gt::Tensor;

struct Run {
  std::vector<uint16_t> prefill_out, decode_out;
  std::vector<int32_t> kept;
};

Run run_once(minikv_dtype dtype, minikv_score_mode mode) {
  minikv_config c;
  minikv_config_default(&c);
  minikv_config_preset(&c, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
  c.backend = MINIKV_BACKEND_CUDA;
  c.dtype = dtype;
  c.num_layers = 2;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.max_sequences = 3;
  c.max_seq_len = 2048;
  c.residual_length = 64;
  c.score_mode = mode;
  c.budget_policy = MINIKV_BUDGET_PYRAMID;
  minikv_cache *cache = nullptr;
  MKV_OK(minikv_cache_create(&c, &cache));
  const std::vector<int32_t> cu = {0, 700, 733, 2233};
  const uint32_t ids[3] = {1, 2, 0};
  const size_t T = size_t(cu.back()), H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  std::mt19937 rng(1234);
  Tensor q(dtype, T * H * D), k(dtype, T * Hkv * D), v(dtype, T * Hkv * D);
  q.fill_normal(rng, 1.0f);
  k.fill_normal(rng, 1.5f);
  v.fill_normal(rng, 1.0f);
  DevBuf dq(q.size() * 2), dk(k.size() * 2), dv(v.size() * 2), dout(q.size() * 2);
  dq.upload(q.bits);
  dk.upload(k.bits);
  dv.upload(v.bits);
  Run r;
  for (uint32_t layer = 0; layer < 2; ++layer) {
    MKV_OK(minikv_prefill(cache, layer, 3, ids, cu.data(), dq.get(), dk.get(), dv.get(),
                          dout.get(), nullptr));
    const std::vector<uint16_t> out = dout.download<uint16_t>(q.size());
    r.prefill_out.insert(r.prefill_out.end(), out.begin(), out.end());
  }
  Tensor q1(dtype, 3 * H * D), k1(dtype, 3 * Hkv * D), v1(dtype, 3 * Hkv * D);
  DevBuf dq1(q1.size() * 2), dk1(k1.size() * 2), dv1(v1.size() * 2), do1(q1.size() * 2);
  for (int step = 0; step < 150; ++step) {  // > 2 residual flushes
    q1.fill_normal(rng, 1.0f);
    k1.fill_normal(rng, 1.5f);
    v1.fill_normal(rng, 1.0f);
    dq1.upload(q1.bits);
    dk1.upload(k1.bits);
    dv1.upload(v1.bits);
    for (uint32_t layer = 0; layer < 2; ++layer) {
      MKV_OK(minikv_append(cache, layer, 3, ids, dk1.get(), dv1.get(), nullptr));
      MKV_OK(minikv_decode(cache, layer, 3, ids, dq1.get(), do1.get(), nullptr));
      const std::vector<uint16_t> out = do1.download<uint16_t>(q1.size());
      r.decode_out.insert(r.decode_out.end(), out.begin(), out.end());
    }
  }
  for (uint32_t s = 0; s < 3; ++s)
    for (uint32_t layer = 0; layer < 2; ++layer)
      for (uint32_t h = 0; h < Hkv; ++h) {
        uint32_t n = 0;
        MKV_OK(minikv_kept_positions(cache, s, layer, h, nullptr, 0, &n));
        std::vector<int32_t> pos(n);
        MKV_OK(minikv_kept_positions(cache, s, layer, h, pos.data(), n, &n));
        r.kept.insert(r.kept.end(), pos.begin(), pos.end());
      }
  minikv_cache_destroy(cache);
  return r;
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("CUDA backend is deterministic: identical runs give bit-identical results") {
    GPU_OR_SKIP();
    for (minikv_dtype dtype : {MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
      for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
        CAPTURE(dtype);
        CAPTURE(mode);
        const Run a = run_once(dtype, mode), b = run_once(dtype, mode);
        CHECK(a.kept == b.kept);
        CHECK(a.prefill_out == b.prefill_out);
        CHECK(a.decode_out == b.decode_out);
      }
    }
  }
}
