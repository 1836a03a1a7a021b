// Helpers of the CUDA test suites: device buffers, dtype-rounded random tensors, element-wise
// comparison, and a float64 reference of the importance scores (used to pick inputs whose
// selection boundary is well separated, and to check the kept positions and the scores).
//
// Tie behaviour. Both backends order candidates by (score desc, position asc), NaN as -inf,
// so exact ties resolve identically. Their fp32 scores differ in the last bits (different
// summation order), so two candidates whose scores are within ~1e-6 relative at the
// selection boundary may be kept differently by the two backends. The tests therefore use
// inputs whose boundary gap is > 1e-4 relative in float64 (checked, else the next seed).
#pragma once

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dtype.h"
#include "minikv.h"
#include "policy.h"

namespace gt {

inline bool gpu_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

// MINIKV_GPU_TEST_CONFIGS=1 (the *_configs CTest entries, label cpu: CI runs them without a
// device): the test cases that only build gt::Case tables and drive gt::run_case run, and
// run_case checks each case's config with minikv_cache_create on the CPU backend instead of
// running it; every other GPU test case skips. A table with a config the library refuses
// then fails on every machine, not only on a GPU.
inline bool configs_only() {
  static const bool on = [] {
    const char *e = std::getenv("MINIKV_GPU_TEST_CONFIGS");
    return e != nullptr && std::strcmp(e, "1") == 0;
  }();
  return on;
}

#define GPU_OR_SKIP()                                                     \
  do {                                                                    \
    if (::gt::configs_only()) {                                           \
      MESSAGE("MINIKV_GPU_TEST_CONFIGS=1: only case tables are checked"); \
      return;                                                             \
    }                                                                     \
    if (!::gt::gpu_present()) {                                           \
      MESSAGE("no CUDA device present: GPU test skipped");               \
      return;                                                             \
    }                                                                     \
  } while (0)

// The same for a test case that, under configs_only, checks its case table's configs (through
// gt::run_case, or check_config_on_cpu below) instead of skipping.
#define GPU_OR_CHECK_CONFIGS()                                \
  do {                                                        \
    if (!::gt::configs_only() && !::gt::gpu_present()) {      \
      MESSAGE("no CUDA device present: GPU test skipped");   \
      return;                                                 \
    }                                                         \
  } while (0)

#define CUDA_OK(call) REQUIRE_EQ((call), cudaSuccess)
#define MKV_OK(call) REQUIRE_MESSAGE((call) == MINIKV_OK, std::string(minikv_last_error_message()))

// MINIKV_GPU_TEST_CONFIGS's check (configs_only): cfg, a GPU test's configuration, is one that
// minikv_cache_create takes on the CPU backend.
inline void check_config_on_cpu(minikv_config cfg) {
  cfg.backend = MINIKV_BACKEND_CPU;
  minikv_cache *cache = nullptr;
  MKV_OK(minikv_cache_create(&cfg, &cache));
  minikv_cache_destroy(cache);
}

// Move-only device allocation.
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : bytes_(bytes) { CUDA_OK(cudaMalloc(&p_, std::max<size_t>(bytes, 16))); }
  ~DevBuf() {
    if (p_) cudaFree(p_);
  }
  DevBuf(DevBuf &&o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  DevBuf &operator=(DevBuf &&o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void *get() const { return p_; }
  template <typename T> void upload(const std::vector<T> &h) {
    REQUIRE(h.size() * sizeof(T) <= bytes_);
    CUDA_OK(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <typename T> std::vector<T> download(size_t n) const {
    std::vector<T> h(n);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(h.data(), p_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  void *p_ = nullptr;
  size_t bytes_ = 0;
};

// Caches created while this lives decode with the named kernel ("fast", "mma", "generic";
// nullptr: the library's own plan), through MINIKV_DECODE_KERNEL, which create reads.
class DecodeKernelChoice {
 public:
  explicit DecodeKernelChoice(const char *kernel) {
    if (kernel) setenv("MINIKV_DECODE_KERNEL", kernel, 1);
  }
  ~DecodeKernelChoice() { unsetenv("MINIKV_DECODE_KERNEL"); }
  DecodeKernelChoice(const DecodeKernelChoice &) = delete;
  DecodeKernelChoice &operator=(const DecodeKernelChoice &) = delete;
};

// ---- 16-bit tensors ---------------------------------------------------------------------
inline uint16_t to_bits(minikv_dtype dt, float x) {
  return dt == MINIKV_DTYPE_BF16 ? minikv::float_to_bf16_bits(x) : minikv::float_to_half_bits(x);
}
inline float from_bits(minikv_dtype dt, uint16_t b) {
  return dt == MINIKV_DTYPE_BF16 ? minikv::bf16_bits_to_float(b) : minikv::half_bits_to_float(b);
}

// A host tensor of 16-bit elements plus its float values (exactly the rounded ones).
struct Tensor {
  minikv_dtype dtype = MINIKV_DTYPE_F16;
  std::vector<uint16_t> bits;
  std::vector<float> f;
  Tensor() = default;
  Tensor(minikv_dtype dt, size_t n) : dtype(dt), bits(n), f(n) {}
  size_t size() const { return bits.size(); }
  void set(size_t i, float x) {
    bits[i] = to_bits(dtype, x);
    f[i] = from_bits(dtype, bits[i]);
  }
  void fill_normal(std::mt19937 &rng, float stddev) {
    std::normal_distribution<float> nd(0.0f, stddev);
    for (size_t i = 0; i < size(); ++i) set(i, nd(rng));
  }
  // Two levels, -1 below `threshold` and +1 above: the quantized groups that hold both take
  // the top code almost everywhere (all-ones code bytes, which read as fp16 are NaN).
  void saturate(float threshold) {
    for (size_t i = 0; i < size(); ++i) set(i, f[i] < threshold ? -1.0f : 1.0f);
  }
  static Tensor from_device(minikv_dtype dt, const DevBuf &d, size_t n) {
    Tensor t(dt, n);
    t.bits = d.download<uint16_t>(n);
    for (size_t i = 0; i < n; ++i) t.f[i] = from_bits(dt, t.bits[i]);
    return t;
  }
  static Tensor from_host_bits(minikv_dtype dt, const std::vector<uint16_t> &b) {
    Tensor t(dt, b.size());
    t.bits = b;
    for (size_t i = 0; i < b.size(); ++i) t.f[i] = from_bits(dt, b[i]);
    return t;
  }
};

// Per-dtype tolerance of CUDA vs CPU on attention outputs: |g - c| <= atol + rtol |c|.
struct Tol {
  double atol, rtol;
};
inline Tol attention_tol(minikv_dtype dt) {
  return dt == MINIKV_DTYPE_BF16 ? Tol{1.5e-2, 2e-2} : Tol{2e-3, 5e-3};
}

// Every element: no NaN/Inf, within tolerance. Reports the worst element.
inline void check_close(const Tensor &gpu, const Tensor &cpu, Tol tol, const std::string &what) {
  REQUIRE_EQ(gpu.size(), cpu.size());
  size_t bad = 0, worst = 0;
  double worst_excess = -1.0, max_abs = 0.0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double g = gpu.f[i], c = cpu.f[i];
    const double d = std::fabs(g - c);
    const double excess = d - (tol.atol + tol.rtol * std::fabs(c));
    max_abs = std::max(max_abs, d);
    if (!std::isfinite(g) || !std::isfinite(c) || excess > 0) ++bad;
    if (!std::isfinite(g) || excess > worst_excess) {
      worst_excess = std::isfinite(g) ? excess : 1e30;
      worst = i;
    }
  }
  INFO(what << ": " << bad << " of " << gpu.size() << " elements out of tolerance; max |diff| "
            << max_abs << "; worst at " << worst << ": gpu " << gpu.f[worst] << " cpu "
            << cpu.f[worst]);
  CHECK(bad == 0);
}

// ---- float64 reference scores -----------------------------------------------------------
// Scores of one sequence (rows [begin, begin + L) of packed q [T][H][D], k [T][Hkv][D]):
// [Hkv][L], summed over each GQA group, over query rows >= row_from (0: CUMULATIVE,
// L - window: WINDOW), exactly as MINIKV.md §1 defines them.
inline std::vector<double> reference_scores(const Tensor &q, const Tensor &k, uint32_t H,
                                            uint32_t Hkv, uint32_t D, int64_t begin, uint32_t L,
                                            uint32_t row_from) {
  std::vector<double> scores(size_t(Hkv) * L, 0.0), s(L);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const uint32_t n_rep = H / Hkv;
  for (uint32_t h = 0; h < H; ++h) {
    const uint32_t kvh = h / n_rep;
    for (uint32_t i = row_from; i < L; ++i) {
      const float *qi = &q.f[(size_t(begin + i) * H + h) * D];
      double m = -INFINITY;
      for (uint32_t j = 0; j <= i; ++j) {
        const float *kj = &k.f[(size_t(begin + j) * Hkv + kvh) * D];
        double acc = 0.0;
        for (uint32_t c = 0; c < D; ++c) acc += double(qi[c]) * double(kj[c]);
        s[j] = acc * scale;
        m = std::max(m, s[j]);
      }
      double z = 0.0;
      for (uint32_t j = 0; j <= i; ++j) z += (s[j] = std::exp(s[j] - m));
      for (uint32_t j = 0; j <= i; ++j) scores[size_t(kvh) * L + j] += s[j] / z;
    }
  }
  return scores;
}

// The reference selection of one KV head (ascending positions: the sinks, the heavy
// hitters, the protected suffix), or an empty vector (and *separated = false) when the
// boundary gap is below 1e-4 relative.
inline std::vector<int32_t> reference_kept(const minikv::SelectionPlan &plan,
                                           const minikv_config &cfg, const double *scores,
                                           bool *separated) {
  *separated = true;
  std::vector<int32_t> kept;
  if (plan.keep_all) {
    for (uint32_t j = 0; j < plan.prompt_len; ++j) kept.push_back(static_cast<int32_t>(j));
    return kept;
  }
  for (uint32_t j = 0; j < plan.n_sink; ++j) kept.push_back(static_cast<int32_t>(j));
  if (plan.n_heavy > 0) {
    std::vector<double> sc(scores, scores + plan.candidates);  // by position
    if (cfg.score_mode == MINIKV_SCORE_WINDOW && cfg.pool_kernel > 1) {
      const int64_t half = cfg.pool_kernel / 2, n = plan.scored_prefix;
      for (int64_t j = 0; j < static_cast<int64_t>(plan.candidates); ++j) {
        double m = scores[std::max<int64_t>(0, j - half)];
        for (int64_t i = std::max<int64_t>(0, j - half); i <= std::min<int64_t>(n - 1, j + half); ++i)
          m = std::max(m, scores[i]);
        sc[j] = m;
      }
    }
    std::vector<uint32_t> order;  // the candidates [n_sink, candidates)
    for (uint32_t j = plan.n_sink; j < plan.candidates; ++j) order.push_back(j);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return sc[a] > sc[b]; });
    const double a = sc[order[plan.n_heavy - 1]], b = sc[order[plan.n_heavy]];
    // Equal pooled values come from one underlying score: both backends see them equal.
    if (a != b && a - b <= 1e-4 * std::max(std::fabs(a), 1e-30)) *separated = false;
    order.resize(plan.n_heavy);  // the heavy hitters, kept in position order
    std::sort(order.begin(), order.end());
    for (uint32_t j : order) kept.push_back(static_cast<int32_t>(j));
  }
  for (uint32_t j = plan.candidates; j < plan.prompt_len; ++j) kept.push_back(static_cast<int32_t>(j));
  return kept;
}

// Prompt inputs of one prefill call: packed q/k/v with cu_seqlens, plus the reference
// selection of every (sequence, KV head). Redraws (new seed) until every boundary is well
// separated.
struct Prompt {
  std::vector<int32_t> cu;
  Tensor q, k, v;
  std::vector<std::vector<int32_t>> expected_kept;  // [seq * Hkv + kvh]
  uint32_t seed = 0;
};

inline Prompt make_prompt(const minikv_config &cfg, uint32_t layer,
                          const std::vector<uint32_t> &lens, uint32_t seed,
                          bool saturated = false) {
  const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  const double ratio = minikv::layer_heavy_ratios(cfg)[layer];
  for (uint32_t attempt = 0; attempt < 64; ++attempt) {
    Prompt p;
    p.seed = seed * 1000 + attempt;
    std::mt19937 rng(p.seed);
    p.cu.push_back(0);
    for (uint32_t L : lens) p.cu.push_back(p.cu.back() + static_cast<int32_t>(L));
    const size_t T = p.cu.back();
    p.q = Tensor(cfg.dtype, T * H * D);
    p.k = Tensor(cfg.dtype, T * Hkv * D);
    p.v = Tensor(cfg.dtype, T * Hkv * D);
    // Logits with a spread of a few units: attention neither uniform nor one-hot.
    p.q.fill_normal(rng, 1.0f);
    p.k.fill_normal(rng, 1.5f);
    p.v.fill_normal(rng, 1.0f);
    if (saturated) {  // about 3% of the elements at -1
      p.k.saturate(-2.8f);
      p.v.saturate(-1.9f);
    }
    bool ok = true;
    for (size_t s = 0; s < lens.size() && ok; ++s) {
      const uint32_t L = lens[s];
      const minikv::SelectionPlan plan = minikv::plan_selection(cfg, ratio, L);
      const bool scored = !plan.keep_all && plan.n_heavy > 0;
      std::vector<double> ref;
      if (scored) {
        const uint32_t row_from = cfg.score_mode == MINIKV_SCORE_WINDOW ? plan.scored_prefix : 0;
        ref = reference_scores(p.q, p.k, H, Hkv, D, p.cu[s], L, row_from);
      }
      for (uint32_t kvh = 0; kvh < Hkv; ++kvh) {
        bool separated = true;
        p.expected_kept.push_back(
            reference_kept(plan, cfg, scored ? ref.data() + size_t(kvh) * L : nullptr, &separated));
        ok = ok && separated;
      }
    }
    if (ok) return p;
  }
  FAIL("could not draw inputs with a well separated selection boundary");
  return Prompt();
}

}  // namespace gt
