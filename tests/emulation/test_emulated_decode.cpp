// minikv-test: white-box
// The default storage's sm_90 decode kernels, decode_k4v2_warp_kernel (one warp: groups of up
// to four heads) and decode_k4v2_kernel (four warps: larger groups), and the tensor-core
// kernel's instance for that storage (decode_mma.cuh, sm_80+), run on the CPU by the warp
// emulator (warp_emulator.h) on the CPU backend's own storage, against the CPU backend's
// decode on every output element: head_dim 64 and 128, MHA and GQA groups of 2 to 12 (one,
// two, four and eight head slots; several chunks), fp16 and bf16, with no, 4 and 17-20 sinks,
// tiles of 128, 64 and 32 tokens (R 128, 64, 96), ragged batches, steps across flushes,
// several split counts (in-kernel merge and partials), copies (bulk and cp.async) landing
// early and late, and the append fused into the decode launch (its residual rows must equal
// the CPU append's).
// Runs in CI: kernel changes are checked there without a GPU. Speed is not emulated.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "handle.h"
#include "support.hpp"

#include "../../kernels/decode_k4v2.cu"
#include "../../kernels/decode_k4v2_warp.cu"
#include "../../kernels/decode_mma.cuh"

namespace {

using minikv::CacheView;
using minikv::emulation::CopyLanding;
namespace k = minikv::kernels;

// The kernels: the one-warp kernel (what the plan picks for groups of up to four heads), the
// four-warp one (larger groups), and the tensor-core kernel of every storage (decode_mma.cuh).
enum Kernel : uint32_t { kOneWarp = 1, kFourWarps = 2, kMma = 4 };

struct Shape {
  uint32_t head_dim, n_rep;
  minikv_dtype dtype;
  uint32_t sinks, residual;
  uint32_t kernels;  // Kernel bits
};

// Query heads per CTA as the CUDA backend plans them for each kernel (the four-warp kernel's:
// decode_mma_heads_per_cta).
uint32_t heads_per_cta(Kernel kernel, uint32_t n_rep) {
  if (kernel == kOneWarp) return k::k4v2_warp_slots(n_rep);
  const uint32_t chunks = (n_rep + k::kMmaMaxHeads - 1) / k::kMmaMaxHeads;
  return (n_rep + chunks - 1) / chunks;
}

template <typename T, int D>
void launch_kernel(Kernel kernel, uint32_t per_cta, dim3 grid, CopyLanding landing, const k::K4V2Args &args) {
  auto go = [&](uint32_t threads, size_t smem, const std::function<void()> &thread) {
    minikv::emulation::launch(grid, dim3(threads), smem, landing, thread);
  };
  if (kernel == kOneWarp) {
    if (per_cta == 1) go(32, k::K4V2WarpLayout<D, 1>::kTotal, [&] { k::decode_k4v2_warp_kernel<T, D, 1>(args); });
    else if (per_cta == 2) go(32, k::K4V2WarpLayout<D, 2>::kTotal, [&] { k::decode_k4v2_warp_kernel<T, D, 2>(args); });
    else go(32, k::K4V2WarpLayout<D, 4>::kTotal, [&] { k::decode_k4v2_warp_kernel<T, D, 4>(args); });
  } else if (kernel == kMma) {
    const k::MmaLaunchPlan plan = k::make_mma_launch_plan(args.p.st.block);
    const k::MmaDecodeArgs mma_args{args.p, plan.g, plan.block_tokens};
    k::DecodeMmaKeyBits<4>::dispatch(std::is_same<T, __half>::value ? MINIKV_DTYPE_F16 : MINIKV_DTYPE_BF16,
                                     args.p.st.block, [&](auto fn) {
                                       go(k::kMmaThreads, plan.g.total, [&] { fn(mma_args); });
                                     });
  } else if (k::k4v2_head_slots(per_cta) == 4) {
    go(k::kK4V2Threads, k::K4V2Layout<sizeof(T), D, 4>::kTotal, [&] { k::decode_k4v2_kernel<T, D, 4>(args); });
  } else {
    go(k::kK4V2Threads, k::K4V2Layout<sizeof(T), D, 8>::kTotal, [&] { k::decode_k4v2_kernel<T, D, 8>(args); });
  }
}

// What one emulated decode launch needs besides the cache: the per-sequence views and the
// storage bytes they point into.
struct Launch {
  const minikv_config *cfg;
  std::vector<CacheView> views;
  std::vector<uint8_t> pool, residual;
  const void *q = nullptr, *new_k = nullptr, *new_v = nullptr;
  std::vector<int32_t> new_position;  // per sequence, or empty: a plain decode
};

// The decode's tiles of the longest sequence, as the CUDA backend counts them for its splits.
uint32_t tile_count(const Launch &l, uint32_t qtile) {
  uint32_t longest = 1, longest_q = 0;
  for (const CacheView &v : l.views) {
    longest = std::max(longest, v.sinks + v.quantized + v.residual);
    longest_q = std::max(longest_q, v.quantized);
  }
  return (longest_q + qtile - 1) / qtile + (longest - longest_q + k::kK4V2RowTile - 1) / k::kK4V2RowTile + 1;
}

// Runs the kernel over l with `splits`; returns the outputs (every head) as doubles, and leaves
// the residual bytes it wrote in l.residual.
template <typename T, int D>
std::vector<double> run_kernel(Launch &l, Kernel kernel, uint32_t splits, CopyLanding landing) {
  const minikv_config &cfg = *l.cfg;
  const uint32_t B = uint32_t(l.views.size()), H = cfg.num_heads, Hkv = cfg.num_kv_heads;
  const uint32_t n_rep = H / Hkv, per_cta = heads_per_cta(kernel, n_rep), chunks = (n_rep + per_cta - 1) / per_cta;
  const uint32_t R = cfg.residual_length;
  const minikv::BlockLayout bl = minikv::make_block_layout(R, Hkv, D, cfg.group_size, cfg.key_bits, cfg.value_bits, 2);
  const minikv::ResidualLayout rl = minikv::make_residual_layout(R, Hkv, D, 2, cfg.sink_tokens);
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
  p.heads_per_cta = per_cta;
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
  const k::K4V2LaunchPlan plan = k::make_k4v2_launch_plan(bl, 12080);
  const k::K4V2Args args{p, plan.tiles, plan.block_tokens};
  launch_kernel<T, D>(kernel, per_cta, dim3(splits, Hkv * chunks, B), landing, args);
  for (uint32_t c : counters) REQUIRE(c == 0);  // the merging CTA resets its counter

  std::vector<double> got(out.size());
  const bool merged_in_kernel = splits == 1 || (kernel == kOneWarp && k::k4v2_warp_fused_merge(splits, per_cta, n_rep));
  for (size_t i = 0; i < out.size(); ++i)
    got[i] = cfg.dtype == MINIKV_DTYPE_F16 ? ref::f16_value(out[i]) : ref::bf16_value(out[i]);
  if (!merged_in_kernel) {  // decode_merge's combine, on the host
    for (uint64_t head = 0; head < uint64_t(B) * H; ++head) {
      double m = -INFINITY, den = 0.0;
      for (uint32_t s = 0; s < splits; ++s) m = std::max<double>(m, part_ml[(head * splits + s) * 2]);
      std::vector<double> o(D, 0.0);
      for (uint32_t s = 0; s < splits; ++s) {
        const double ms = part_ml[(head * splits + s) * 2];
        const double w = ms == -INFINITY ? 0.0 : std::exp2(ms - m);
        den += w * part_ml[(head * splits + s) * 2 + 1];
        for (int c = 0; c < D; ++c) o[c] += w * part_o[(head * splits + s) * D + c];
      }
      for (int c = 0; c < D; ++c) got[head * D + c] = o[c] / den;
    }
  }
  return got;
}

template <typename T, int D>
void check_launches(Launch &l, uint32_t kernels, const std::vector<double> &want,
                    const std::vector<uint8_t> *residual_after, const std::string &what) {
  const k::K4V2LaunchPlan plan = k::make_k4v2_launch_plan(
      minikv::make_block_layout(l.cfg->residual_length, l.cfg->num_kv_heads, D, l.cfg->group_size,
                                l.cfg->key_bits, l.cfg->value_bits, 2),
      12080);
  const uint32_t tiles = tile_count(l, plan.tiles.qtile);
  const bool bf16 = l.cfg->dtype == MINIKV_DTYPE_BF16;
  const double atol = bf16 ? 1.5e-2 : 2e-3, rtol = bf16 ? 2e-2 : 5e-3;  // the GPU tests' bounds
  const std::vector<uint8_t> residual_before = l.residual;
  for (Kernel kernel : {kOneWarp, kFourWarps, kMma}) {
    if (!(kernels & kernel)) continue;
    for (uint32_t splits : {1u, 2u, std::min(tiles, 7u)}) {
      for (CopyLanding landing : {CopyLanding::kAtIssue, CopyLanding::kAtWait}) {
        l.residual = residual_before;
        const std::vector<double> got = run_kernel<T, D>(l, kernel, splits, landing);
        const test::CloseReport r = test::compare(got, want, atol, rtol);
        const std::string where = what + (kernel == kOneWarp ? ", one-warp kernel, " : kernel == kFourWarps ? ", four-warp kernel, " : ", mma kernel, ") +
                                  std::to_string(splits) + " splits, copies landing " +
                                  (landing == CopyLanding::kAtIssue ? "at issue" : "at the wait");
        INFO(where << ": " << r.describe(got, want));
        CHECK(r.bad == 0);
        if (residual_after != nullptr) CHECK(l.residual == *residual_after);
      }
    }
  }
}

template <typename T, int D> void run_shape(const Shape &s) {
  const uint32_t kv_heads = s.n_rep >= 8 ? 1 : 2, H = kv_heads * s.n_rep;
  const std::vector<uint32_t> lens = {1, 31, 33, 333, 700};
  const uint32_t B = uint32_t(lens.size()), steps = s.residual + 3;
  minikv_config cfg;
  minikv_config_default(&cfg);
  REQUIRE(minikv_config_preset(&cfg, MINIKV_PRESET_BALANCED) == MINIKV_OK);  // K4V2 G32
  cfg.backend = MINIKV_BACKEND_CPU;
  cfg.dtype = s.dtype;
  cfg.num_layers = 1;
  cfg.num_heads = H;
  cfg.num_kv_heads = kv_heads;
  cfg.head_dim = D;
  cfg.max_sequences = B;
  cfg.max_seq_len = 700 + steps + 8;
  cfg.residual_length = s.residual;
  cfg.sink_tokens = s.sinks;
  cfg.heavy_ratio = 0.25f;
  cfg.recent_ratio = 0.25f;
  REQUIRE(cfg.key_bits == 4);
  REQUIRE(cfg.value_bits == 2);
  REQUIRE(cfg.group_size == 32);
  test::CachePtr cache = test::make_cache(cfg);
  const minikv::Cache &impl = cache->impl;

  test::Rng rng(0x5eed + D * 131 + s.n_rep * 17 + s.sinks + s.residual);
  std::vector<int32_t> cu(B + 1, 0);
  for (uint32_t b = 0; b < B; ++b) cu[b + 1] = cu[b] + int32_t(lens[b]);
  std::vector<uint32_t> ids(B);
  for (uint32_t b = 0; b < B; ++b) ids[b] = b;
  {
    const size_t T_ = size_t(cu[B]);
    test::Buf q(s.dtype, T_ * H * D), kk(s.dtype, T_ * kv_heads * D), v(s.dtype, T_ * kv_heads * D),
        out(s.dtype, T_ * H * D);
    q.fill_normal(rng);
    kk.fill_normal(rng);
    v.fill_normal(rng);
    MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, B, ids.data(), cu.data(), q.data(), kk.data(), v.data(),
                                  out.data(), nullptr));
  }
  std::vector<uint8_t> pool, residual;
  for (uint32_t step = 0; step < steps; ++step) {
    test::Buf q(s.dtype, size_t(B) * H * D), kk(s.dtype, size_t(B) * kv_heads * D), v(s.dtype, size_t(B) * kv_heads * D),
        out(s.dtype, size_t(B) * H * D);
    q.fill_normal(rng, 2.0);
    kk.fill_normal(rng);
    v.fill_normal(rng, 3.0);
    std::vector<CacheView> before(B);
    for (uint32_t b = 0; b < B; ++b) before[b] = impl.view(b, 0);
    impl.backend().read_storage(pool, residual);
    MKV_REQUIRE_OK(minikv_append_decode(cache.get(), 0, B, ids.data(), q.data(), kk.data(), v.data(), out.data(), nullptr));
    // Emulate the first steps, the step of the flush and the last one.
    bool flushed = false;
    for (uint32_t b = 0; b < B; ++b) flushed = flushed || impl.view(b, 0).quantized != before[b].quantized;
    if (!(step < 2 || flushed || step + 1 == steps)) continue;
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
      check_launches<T, D>(l, s.kernels, want, &residual_after, what + ", append fused");
      l.new_position.clear();
    }
    impl.backend().read_storage(l.pool, l.residual);
    check_launches<T, D>(l, s.kernels, want, nullptr, what);
  }
}

template <int D> void run_dtype(const Shape &s) {
  if (s.dtype == MINIKV_DTYPE_F16) run_shape<__half, D>(s);
  else run_shape<__nv_bfloat16, D>(s);
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the K4V2 decode kernels run by the warp emulator match the CPU backend") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const uint32_t One = kOneWarp, Four = kFourWarps, Both = kOneWarp | kFourWarps, Mma = kMma;
  const Shape shapes[] = {
      {128, 1, F16, 4, 128, One},  {64, 1, F16, 0, 64, One},    {64, 1, BF16, 4, 96, One},
      {128, 1, BF16, 0, 96, One},  {128, 2, F16, 4, 128, One},  {64, 2, BF16, 0, 64, One},
      {128, 3, BF16, 4, 96, Both}, {128, 4, F16, 4, 128, Both}, {64, 4, BF16, 4, 128, One},
      {128, 8, F16, 0, 64, Both},
      // More sinks than a 16-row M-tile (a sink tile of two, next to quantized tiles).
      {128, 1, F16, 20, 128, One}, {64, 1, BF16, 17, 96, One},  {128, 4, BF16, 20, 64, Both},
      // Groups the four-warp kernel takes in one chunk of 8 slots, and in two chunks.
      {64, 6, BF16, 4, 128, Four}, {128, 12, F16, 4, 96, Four},
      // The tensor-core kernel's instance for this storage (MINIKV_DECODE_KERNEL=mma).
      {128, 1, BF16, 4, 128, Mma}, {64, 4, F16, 20, 96, Mma}, {128, 5, F16, 0, 64, Mma},
  };
  for (const Shape &s : shapes) {
    const std::string name = std::string(s.kernels & kOneWarp ? "one-warp " : "") +
                             (s.kernels & kFourWarps ? "four-warp " : "") + (s.kernels & kMma ? "mma " : "") + "hd" + std::to_string(s.head_dim) + " n_rep " + std::to_string(s.n_rep) +
                             (s.dtype == F16 ? " f16" : " bf16") + " sinks " + std::to_string(s.sinks) + " R " +
                             std::to_string(s.residual);
    SUBCASE(name.c_str()) {
      if (s.head_dim == 64) run_dtype<64>(s);
      else run_dtype<128>(s);
    }
  }
}
}  // TEST_SUITE
