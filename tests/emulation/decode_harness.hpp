// The harness of the emulated decode tests (test_emulated_decode_*.cpp): a CPU cache driven
// through prefill and minikv_append_decode, and at chosen steps each kernel under test run by
// the warp emulator on that cache's own storage bytes, against the CPU decode's outputs on
// every element: 1, 2 and several splits (partials merged in the kernel or by the emulated
// decode_merge_kernel), copies landing at issue and at the wait, and the append fused into
// the launch where no sequence flushes (the residual bytes it writes must equal the CPU
// append's).
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "../../kernels/decode_merge.cu"
#include "../../kernels/params.h"
#include "handle.h"
#include "support.hpp"
#include "warp_emulator.h"

namespace emu_test {

using minikv::CacheView;
using minikv::emulation::CopyLanding;
namespace k = minikv::kernels;

// Under AddressSanitizer (scripts/reliability.sh) a launch runs several times slower: the
// first step and the flush's are checked, with copies landing at issue only, and 1 and the
// most splits.
// What the sanitizer adds is the bounds of the host buffers the kernels read (the storage, q,
// the caller's k/v).
constexpr bool kSanitized = minikv::emulation::kAddressSanitizer;

struct Shape {
  uint32_t key_bits, value_bits, group, head_dim, n_rep;
  minikv_dtype dtype;
  uint32_t sinks, residual;
  uint32_t kernels;    // which of the test's kernels run it (bits of its list)
  uint32_t flush = 0;  // flush_tokens (0: the whole residual)
  std::string name() const {
    return "K" + std::to_string(key_bits) + "V" + std::to_string(value_bits) + " G" + std::to_string(group) + " hd" +
           std::to_string(head_dim) + " n_rep " + std::to_string(n_rep) + (dtype == MINIKV_DTYPE_F16 ? " f16" : " bf16") +
           " sinks " + std::to_string(sinks) + " R " + std::to_string(residual) +
           (flush ? " F " + std::to_string(flush) : std::string());
  }
};

// One decode launch's inputs besides the kernel: the per-sequence views and the storage they
// point into.
struct Launch {
  const minikv_config *cfg;
  std::vector<CacheView> views;
  std::vector<uint8_t> pool, residual;
  const void *q = nullptr, *new_k = nullptr, *new_v = nullptr;
  std::vector<int32_t> new_position;  // per sequence, or empty: a plain decode
};

// A kernel under test.
struct Kernel {
  const char *name;
  // Query heads per CTA, as the CUDA backend plans them.
  std::function<uint32_t(uint32_t n_rep)> heads_per_cta;
  // Tiles of the longest sequence, as the CUDA backend counts them for its splits.
  std::function<uint32_t(const Launch &)> tiles;
  // Runs the grid of p (p.heads_per_cta and p.splits set); returns whether p.out holds the
  // outputs (else the split partials do).
  std::function<bool(const minikv_config &, const k::DecodeParams &, CopyLanding)> launch;
};

// Query heads per CTA where a KV head's n_rep heads go in the fewest equal chunks of at most
// `most` (decode_mma_heads_per_cta, decode_generic_heads_per_cta).
inline uint32_t heads_in_chunks(uint32_t n_rep, uint32_t most) {
  const uint32_t chunks = (n_rep + most - 1) / most;
  return (n_rep + chunks - 1) / chunks;
}

// Runs a decode grid of p (splits, KV heads x head chunks, sequences) of `threads` threads each.
inline void emulate(const k::DecodeParams &p, uint32_t threads, size_t smem, CopyLanding landing,
                    const std::function<void()> &thread) {
  const uint32_t n_rep = p.num_heads / p.num_kv_heads, chunks = (n_rep + p.heads_per_cta - 1) / p.heads_per_cta;
  minikv::emulation::launch(dim3(p.splits, p.num_kv_heads * chunks, p.n), dim3(threads), smem, landing, thread);
}

// The storage layouts of cfg (16-bit dtypes), as cache.cpp plans them.
inline minikv::BlockLayout block_layout(const minikv_config &cfg) {
  return minikv::make_block_layout(cfg.residual_length, cfg.num_kv_heads, cfg.head_dim, cfg.group_size, cfg.key_bits,
                                   cfg.value_bits, 2);
}
inline minikv::ResidualLayout residual_layout(const minikv_config &cfg) {
  return minikv::make_residual_layout(cfg.residual_length, cfg.num_kv_heads, cfg.head_dim, 2, cfg.sink_tokens);
}

// The longest (sequence) and quantized tokens of the launch.
inline void longest(const Launch &l, uint32_t &all, uint32_t &quantized) {
  all = 1;
  quantized = 0;
  for (const CacheView &v : l.views) {
    all = std::max(all, v.sinks + v.quantized + v.residual);
    quantized = std::max(quantized, v.quantized);
  }
}

// cuda_backend.cpp's tile count for the splits of the kernels that walk every token in tiles
// of qtile (all but the K4V2 and fast ones).
inline uint32_t tiles_of_all_tokens(const Launch &l, uint32_t qtile) {
  uint32_t all, quantized;
  longest(l, all, quantized);
  return (all + qtile - 1) / qtile + 2;
}

// decode_merge's launch (kernels/decode_merge.cu) of p's partials into p.out.
template <typename T> void emulate_merge_as(const k::DecodeParams &p, uint32_t D) {
  auto run = [&](auto hd) {
    constexpr int kD = decltype(hd)::value;
    minikv::emulation::launch(dim3(p.n, p.num_heads), dim3(k::kMergeThreads<kD>), 0, CopyLanding::kAtIssue,
                              [&] { k::decode_merge_kernel<T, kD>(p); });
  };
  switch (D) {
    case 64: run(std::integral_constant<int, 64>()); break;
    case 80: run(std::integral_constant<int, 80>()); break;
    case 96: run(std::integral_constant<int, 96>()); break;
    case 128: run(std::integral_constant<int, 128>()); break;
    default: REQUIRE(D == 256); run(std::integral_constant<int, 256>()); break;
  }
}
inline void emulate_merge(const k::DecodeParams &p, minikv_dtype dtype, uint32_t D) {
  if (dtype == MINIKV_DTYPE_F16) emulate_merge_as<__half>(p, D);
  else emulate_merge_as<__nv_bfloat16>(p, D);
}

inline std::vector<double> run_kernel(Launch &l, const Kernel &kernel, uint32_t splits, CopyLanding landing) {
  const minikv_config &cfg = *l.cfg;
  const uint32_t B = uint32_t(l.views.size()), H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  const minikv::BlockLayout bl = block_layout(cfg);
  const minikv::ResidualLayout rl = residual_layout(cfg);
  uint32_t width = 1;
  for (const CacheView &v : l.views) width = std::max(width, v.num_blocks);
  std::vector<int32_t> table(size_t(cfg.max_sequences) * cfg.num_layers * width, -1);
  for (const CacheView &v : l.views)
    for (uint32_t i = 0; i < v.num_blocks; ++i) table[size_t(v.residual_slot) * width + i] = int32_t(v.blocks[i]);

  std::vector<uint16_t> out(size_t(B) * H * D, 0xffff);  // NaN until written
  std::vector<float> part_o(size_t(B) * H * splits * D), part_ml(size_t(B) * H * splits * 2);
  std::vector<uint32_t> counters(size_t(B) * Hkv, 0);
  k::DecodeParams p{};
  p.q = l.q;
  p.out = out.data();
  p.part_o = part_o.data();
  p.part_ml = part_ml.data();
  p.counters = counters.data();
  p.st = k::DeviceStorage{l.pool.data(), l.residual.data(), table.data(), bl, rl, width, 0};
  p.num_heads = H;
  p.num_kv_heads = Hkv;
  p.heads_per_cta = kernel.heads_per_cta(H / Hkv);
  p.splits = splits;
  p.scale_log2 = k::kLog2e / std::sqrt(float(D));
  p.n = B;
  for (uint32_t b = 0; b < B; ++b) {
    p.slot[b] = l.views[b].residual_slot;
    p.sinks[b] = l.views[b].sinks;
    p.quantized[b] = l.views[b].quantized;
    p.residual[b] = l.views[b].residual;
    p.new_position[b] = l.new_position.empty() ? -1 : l.new_position[b];
  }
  p.new_k = l.new_position.empty() ? nullptr : l.new_k;
  p.new_v = l.new_position.empty() ? nullptr : l.new_v;
  const bool merged = kernel.launch(cfg, p, landing);
  for (uint32_t c : counters) REQUIRE(c == 0);  // a merging CTA resets its counter

  if (!merged) emulate_merge(p, cfg.dtype, D);  // the split partials combined as on the GPU
  std::vector<double> got(out.size());
  for (size_t i = 0; i < out.size(); ++i)
    got[i] = cfg.dtype == MINIKV_DTYPE_F16 ? ref::f16_value(out[i]) : ref::bf16_value(out[i]);
  return got;
}

inline void check_launches(Launch &l, const Shape &s, const std::vector<Kernel> &kernels,
                           const std::vector<double> &want, const std::vector<uint8_t> *residual_after,
                           const std::string &what) {
  const bool bf16 = l.cfg->dtype == MINIKV_DTYPE_BF16;
  const double atol = bf16 ? 1.5e-2 : 2e-3, rtol = bf16 ? 2e-2 : 5e-3;  // the GPU tests' bounds
  const std::vector<uint8_t> residual_before = l.residual;
  for (size_t ki = 0; ki < kernels.size(); ++ki) {
    if (!(s.kernels & (1u << ki))) continue;
    const Kernel &kernel = kernels[ki];
    const uint32_t tiles = std::max(kernel.tiles(l), 1u);  // the backend's splits stay within them
    for (uint32_t splits : {1u, std::min(tiles, 2u), std::min(tiles, 7u)}) {
      if (kSanitized && splits == 2 && tiles > 2) continue;
      for (CopyLanding landing : {CopyLanding::kAtIssue, CopyLanding::kAtWait}) {
        if (kSanitized && landing == CopyLanding::kAtWait) continue;
        l.residual = residual_before;
        const std::vector<double> got = run_kernel(l, kernel, splits, landing);
        const test::CloseReport r = test::compare(got, want, atol, rtol);
        const std::string where = what + ", " + kernel.name + ", " + std::to_string(splits) + " splits, copies landing " +
                                  (landing == CopyLanding::kAtIssue ? "at issue" : "at the wait");
        INFO(where << ": " << r.describe(got, want));
        CHECK(r.bad == 0);
        if (residual_after != nullptr) CHECK(l.residual == *residual_after);
      }
    }
  }
}

// A one-layer CPU cache of shape s (KV heads: 2, or 1 for groups of 8 or more; heavy and
// recent ratios 0.25) with the ragged prompts `lens` prefilled, room for `steps` more tokens.
// A one-layer CPU cache of shape s for B sequences of up to max_seq_len tokens: two KV heads
// (one from groups of 8 up), heavy and recent ratios 0.25.
inline minikv_config shape_config(const Shape &s, uint32_t B, uint32_t max_seq_len) {
  const uint32_t kv_heads = s.n_rep >= 8 ? 1 : 2;
  minikv_config cfg;
  minikv_config_default(&cfg);
  cfg.backend = MINIKV_BACKEND_CPU;
  cfg.dtype = s.dtype;
  cfg.num_layers = 1;
  cfg.num_heads = kv_heads * s.n_rep;
  cfg.num_kv_heads = kv_heads;
  cfg.head_dim = s.head_dim;
  cfg.max_sequences = B;
  cfg.max_seq_len = max_seq_len;
  cfg.key_bits = s.key_bits;
  cfg.value_bits = s.value_bits;
  cfg.group_size = s.group;
  cfg.residual_length = s.residual;
  cfg.flush_tokens = s.flush;
  cfg.sink_tokens = s.sinks;
  cfg.heavy_ratio = 0.25f;
  cfg.recent_ratio = 0.25f;
  return cfg;
}

struct Prefilled {
  minikv_config cfg;
  test::CachePtr cache;
  std::vector<uint32_t> lens, ids;
};
inline Prefilled prefill_cache(const Shape &s, uint32_t steps, test::Rng &rng) {
  Prefilled c;
  c.lens = {1, 31, 33, 333, 700};
  const uint32_t B = uint32_t(c.lens.size());
  minikv_config &cfg = c.cfg;
  cfg = shape_config(s, B, 700 + steps + 8);
  const uint32_t kv_heads = cfg.num_kv_heads, H = cfg.num_heads, D = s.head_dim;
  c.cache = test::make_cache(cfg);
  std::vector<int32_t> cu(B + 1, 0);
  for (uint32_t b = 0; b < B; ++b) cu[b + 1] = cu[b] + int32_t(c.lens[b]);
  for (uint32_t b = 0; b < B; ++b) c.ids.push_back(b);
  const size_t rows = size_t(cu[B]);
  test::Buf q(s.dtype, rows * H * D), k(s.dtype, rows * kv_heads * D), v(s.dtype, rows * kv_heads * D),
      out(s.dtype, rows * H * D);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  MKV_REQUIRE_OK(minikv_prefill(c.cache.get(), 0, B, c.ids.data(), cu.data(), q.data(), k.data(), v.data(),
                                out.data(), nullptr));
  return c;
}

// Prefill ragged prompts into a CPU cache of shape s, then decode step by step across a flush,
// checking the kernels at the first two steps, the flush's and the last.
inline void run_shape(const Shape &s, const std::vector<Kernel> &kernels) {
  const uint32_t steps = s.residual + 3;
  test::Rng rng(0x5eed + s.head_dim * 131 + s.n_rep * 17 + s.sinks + s.residual + s.key_bits * 7 + s.value_bits * 3 +
                s.group);
  Prefilled c = prefill_cache(s, steps, rng);
  const minikv_config &cfg = c.cfg;
  const minikv::Cache &impl = c.cache->impl;
  const std::vector<uint32_t> &lens = c.lens, &ids = c.ids;
  const uint32_t B = uint32_t(lens.size()), H = cfg.num_heads, kv_heads = cfg.num_kv_heads, D = s.head_dim;
  minikv_cache *cache = c.cache.get();
  std::vector<uint8_t> pool, residual;
  for (uint32_t step = 0; step < steps; ++step) {
    test::Buf q(s.dtype, size_t(B) * H * D), kk(s.dtype, size_t(B) * kv_heads * D),
        v(s.dtype, size_t(B) * kv_heads * D), out(s.dtype, size_t(B) * H * D);
    q.fill_normal(rng, 2.0);
    kk.fill_normal(rng);
    v.fill_normal(rng, 3.0);
    std::vector<CacheView> before(B);
    for (uint32_t b = 0; b < B; ++b) before[b] = impl.view(b, 0);
    impl.backend().read_storage(pool, residual);
    MKV_REQUIRE_OK(minikv_append_decode(cache, 0, B, ids.data(), q.data(), kk.data(), v.data(), out.data(), nullptr));
    bool flushed = false;
    for (uint32_t b = 0; b < B; ++b) flushed = flushed || impl.view(b, 0).quantized != before[b].quantized;
    if (kSanitized ? !(step == 0 || flushed) : !(step < 2 || flushed || step + 1 == steps)) continue;
    const std::vector<double> want = out.doubles();
    Launch l;
    l.cfg = &cfg;
    l.q = q.data();
    for (uint32_t b = 0; b < B; ++b) l.views.push_back(impl.view(b, 0));
    const std::string what = "step " + std::to_string(step);
    if (!flushed) {
      // The append fused into the decode launch: storage before the token, views after it.
      l.pool = pool;
      l.residual = residual;
      l.new_k = kk.data();
      l.new_v = v.data();
      for (uint32_t b = 0; b < B; ++b) l.new_position.push_back(int32_t(lens[b] + step));
      std::vector<uint8_t> pool_after, residual_after;
      impl.backend().read_storage(pool_after, residual_after);
      check_launches(l, s, kernels, want, &residual_after, what + ", append fused");
      l.new_position.clear();
    }
    impl.backend().read_storage(l.pool, l.residual);
    check_launches(l, s, kernels, want, nullptr, what);
  }
}

// Every shape as its own subcase.
inline void run_shapes(const std::vector<Shape> &shapes, const std::vector<Kernel> &kernels) {
  for (const Shape &s : shapes) {
    std::string name = s.name() + " (";
    for (size_t ki = 0; ki < kernels.size(); ++ki)
      if (s.kernels & (1u << ki)) name += std::string(kernels[ki].name) + " ";
    name.back() = ')';
    SUBCASE(name.c_str()) { run_shape(s, kernels); }
  }
}

// dtype and head_dim of a run-time config as template arguments: fn(T{}, std::integral_constant<int, D>{}).
template <int... Ds, typename Fn> void dispatch_dtype_head_dim(const minikv_config &cfg, Fn &&fn) {
  bool done = false;
  auto one = [&](auto d) {
    if (done || cfg.head_dim != uint32_t(decltype(d)::value)) return;
    done = true;
    if (cfg.dtype == MINIKV_DTYPE_F16) fn(__half{}, d);
    else fn(__nv_bfloat16{}, d);
  };
  (one(std::integral_constant<int, Ds>{}), ...);
  REQUIRE(done);
}

}  // namespace emu_test
