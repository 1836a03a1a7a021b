// minikv-test: white-box. The CUDA backend writes the same bytes as the CPU backend: the
// whole block pool (codes, scales, minima, positions) and every residual slot are compared
// byte for byte after prefill and after appends across flushes, for 2/4/8/16 bits, groups
// of 16/32/64/128, fp16/bf16, head_dim 64/80/96/128/256, both score modes, with and without
// sink tokens (the sink region of each residual slot). The GPU importance scores are checked
// against a float64 reference (1e-3 relative) at every head_dim, two ragged prompts in one
// launch.
// Skipped when no CUDA device is present.
#include <doctest/doctest.h>

#include <numeric>
#include <random>

#include "../../kernels/cuda_debug.h"
#include "../../kernels/cuda_shapes.h"
#include "cache.h"
#include "config.h"
#include "gpu_util.h"
#include "layout.h"
#include "selection_cases.hpp"

namespace {

using gt::DevBuf;
using gt::Tensor;

struct WCase {
  const char *name;
  minikv_dtype dtype;
  uint32_t head_dim, heads, kv_heads;
  minikv_score_mode mode;
  uint32_t key_bits, value_bits, group, residual;
  std::vector<uint32_t> lens;
  uint32_t steps;
  uint32_t sinks = 0;
  uint32_t flush = 0;  // flush_tokens (0: the whole residual)
};


minikv_config make_config(const WCase &c, minikv_backend backend) {
  minikv_config cfg;
  minikv_config_default(&cfg);
  minikv_config_preset(&cfg, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
  cfg.backend = backend;
  cfg.dtype = c.dtype;
  cfg.num_layers = 1;
  cfg.num_heads = c.heads;
  cfg.num_kv_heads = c.kv_heads;
  cfg.head_dim = c.head_dim;
  cfg.max_sequences = static_cast<uint32_t>(c.lens.size());
  cfg.max_seq_len = *std::max_element(c.lens.begin(), c.lens.end()) + c.steps + 4;
  cfg.score_mode = c.mode;
  cfg.key_bits = c.key_bits;
  cfg.value_bits = c.value_bits;
  cfg.group_size = c.group;
  cfg.residual_length = c.residual;
  cfg.sink_tokens = c.sinks;
  cfg.flush_tokens = c.flush;
  return minikv::config_read(&cfg);
}

// Names the region of the first differing byte, for a readable failure.
std::string describe(const minikv::BlockLayout &bl, size_t offset) {
  const uint64_t in = offset % bl.bytes;
  const char *region = in >= bl.positions ? "positions" : in >= bl.v_min ? "v_min"
                     : in >= bl.v_scale ? "v_scale" : in >= bl.k_min ? "k_min"
                     : in >= bl.k_scale ? "k_scale" : in >= bl.v_codes ? "v_codes" : "k_codes";
  return "block " + std::to_string(offset / bl.bytes) + " byte " + std::to_string(in) + " (" + region + ")";
}

void check_same_storage(const minikv::Cache &cpu, const minikv::Cache &gpu,
                        const minikv::BlockLayout &bl, const std::string &when) {
  std::vector<uint8_t> pool_c, res_c, pool_g, res_g;
  cpu.backend().read_storage(pool_c, res_c);
  gpu.backend().read_storage(pool_g, res_g);
  INFO(when);
  REQUIRE_EQ(pool_c.size(), pool_g.size());
  REQUIRE_EQ(res_c.size(), res_g.size());
  const auto pool_diff = std::mismatch(pool_c.begin(), pool_c.end(), pool_g.begin());
  if (pool_diff.first != pool_c.end()) {
    const size_t at = pool_diff.first - pool_c.begin();
    size_t n = 0;
    for (size_t i = 0; i < pool_c.size(); ++i) n += pool_c[i] != pool_g[i];
    FAIL_CHECK("pool differs first at " << describe(bl, at) << ": cpu " << int(pool_c[at])
                                        << " gpu " << int(pool_g[at]) << "; " << n << " bytes differ");
  }
  const auto res_diff = std::mismatch(res_c.begin(), res_c.end(), res_g.begin());
  if (res_diff.first != res_c.end()) {
    FAIL_CHECK("residual slots differ first at byte " << (res_diff.first - res_c.begin()));
  }
}

void run_storage_case(const WCase &c) {
  INFO("case " << std::string(c.name));
  const minikv_config cfg_c = make_config(c, MINIKV_BACKEND_CPU);
  const minikv_config cfg_g = make_config(c, MINIKV_BACKEND_CUDA);
  minikv::Cache cpu(cfg_c), gpu(cfg_g);
  const minikv::BlockLayout bl = minikv::make_block_layout(
      c.residual, c.kv_heads, c.head_dim, c.group, c.key_bits, c.value_bits, 2);
  const uint32_t H = c.heads, Hkv = c.kv_heads, D = c.head_dim;
  const uint32_t n = static_cast<uint32_t>(c.lens.size());
  std::vector<uint32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0u);

  const gt::Prompt p = gt::make_prompt(cfg_c, 0, c.lens, 31);
  const size_t T = p.cu.back();
  std::vector<uint16_t> out_c(T * H * D);
  cpu.prefill(0, n, ids.data(), p.cu.data(), p.q.bits.data(), p.k.bits.data(), p.v.bits.data(),
              out_c.data(), nullptr);
  DevBuf q(p.q.size() * 2), k(p.k.size() * 2), v(p.v.size() * 2), o(T * H * D * 2);
  q.upload(p.q.bits);
  k.upload(p.k.bits);
  v.upload(p.v.bits);
  gpu.prefill(0, n, ids.data(), p.cu.data(), q.get(), k.get(), v.get(), o.get(), nullptr);
  check_same_storage(cpu, gpu, bl, "after prefill");

  std::mt19937 rng(5);
  DevBuf kd(size_t(n) * Hkv * D * 2), vd(size_t(n) * Hkv * D * 2);
  for (uint32_t step = 0; step < c.steps; ++step) {
    Tensor kt(c.dtype, size_t(n) * Hkv * D), vt(c.dtype, size_t(n) * Hkv * D);
    kt.fill_normal(rng, 1.5f);
    vt.fill_normal(rng, 1.0f);
    if (step % 5 == 0) {  // structured rows too: constant groups (scale 0), signed zeros
      for (size_t i = 0; i < kt.size(); i += 2) kt.set(i, (i / D) % 2 ? 0.0f : -0.0f);
      for (size_t i = 0; i < vt.size() / 2; ++i) vt.set(i, 0.75f);
    }
    cpu.append(0, n, ids.data(), kt.bits.data(), vt.bits.data(), nullptr);
    kd.upload(kt.bits);
    vd.upload(vt.bits);
    gpu.append(0, n, ids.data(), kd.get(), vd.get(), nullptr);
    if (step % 16 == 15 || step + 1 == c.steps)
      check_same_storage(cpu, gpu, bl, "after append step " + std::to_string(step));
  }
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("CUDA pool and residual bytes equal the CPU backend's") {
  GPU_OR_CHECK_CONFIGS();
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const minikv_score_mode CUM = MINIKV_SCORE_CUMULATIVE, WIN = MINIKV_SCORE_WINDOW;
  const std::vector<WCase> cases = {
      {"f16 hd128 2/2 G16 R64", F16, 128, 8, 2, CUM, 2, 2, 16, 64, {300, 45, 1}, 140},
      {"bf16 hd64 2/2 G16 R32", BF16, 64, 4, 4, WIN, 2, 2, 16, 32, {200, 97}, 70},
      {"f16 hd64 4/4 G32 R64", F16, 64, 4, 1, CUM, 4, 4, 32, 64, {257}, 130},
      {"bf16 hd128 4/2 G64 R128", BF16, 128, 8, 8, CUM, 4, 2, 64, 128, {400}, 140},
      {"f16 hd128 2/4 G128 R128", F16, 128, 4, 2, WIN, 2, 4, 128, 128, {700}, 130},
      {"bf16 hd64 16/16 G16 R32", BF16, 64, 4, 2, CUM, 16, 16, 16, 32, {150, 33}, 40},
      {"f16 hd128 16/2 G16 R32", F16, 128, 4, 2, CUM, 16, 2, 16, 32, {120}, 40},
      {"f16 hd128 8/8 G32 R64", F16, 128, 8, 2, CUM, 8, 8, 32, 64, {300, 45, 1}, 70},
      {"bf16 hd64 8/2 G16 R32", BF16, 64, 4, 4, WIN, 8, 2, 16, 32, {200}, 40},
      // Sinks: short prompts (all sinks), sinks beyond the heavy-hitter share, keep-all.
      {"f16 hd128 4/2 G32 R128 4 sinks", F16, 128, 8, 2, CUM, 4, 2, 32, 128, {300, 45, 3, 1}, 140, 4},
      {"bf16 hd64 8/4 G32 R64 64 sinks", BF16, 64, 4, 4, WIN, 8, 4, 32, 64, {400, 97, 64, 40}, 70, 64},
      {"f16 hd64 16/16 G16 R32 17 sinks", F16, 64, 4, 2, CUM, 16, 16, 16, 32, {150, 20}, 40, 17},
      {"bf16 hd128 2/2 G16 R32 1 sink", BF16, 128, 4, 1, CUM, 2, 2, 16, 32, {257}, 40, 1},
      // head_dim 80, 96, 256: code rows of 20, 24, 40 bytes; value groups 16 and 32.
      {"f16 hd80 2/2 G16 R32", F16, 80, 4, 4, CUM, 2, 2, 16, 32, {300, 45, 1}, 40},
      {"bf16 hd80 4/8 G16 R64 4 sinks", BF16, 80, 8, 2, WIN, 4, 8, 16, 64, {200, 3}, 70, 4},
      {"bf16 hd96 2/4 G32 R64", BF16, 96, 6, 2, CUM, 2, 4, 32, 64, {257, 40}, 70},
      {"f16 hd96 16/2 G16 R32", F16, 96, 4, 4, WIN, 16, 2, 16, 32, {150}, 40},
      {"f16 hd256 4/2 G32 R128 4 sinks", F16, 256, 4, 2, CUM, 4, 2, 32, 128, {300, 45}, 140, 4},
      {"bf16 hd256 2/2 G128 R128", BF16, 256, 2, 2, CUM, 2, 2, 128, 128, {500}, 130},
      // Sliding flushes: the rows that stay move to the slot's front.
      {"f16 hd128 4/2 G32 R64 F32 4 sinks", F16, 128, 8, 2, CUM, 4, 2, 32, 64, {300, 45, 3, 1}, 140, 4, 32},
      {"bf16 hd128 4/2 G32 R128 F32", BF16, 128, 8, 8, WIN, 4, 2, 32, 128, {400}, 200, 0, 32},
      {"f16 hd64 2/2 G16 R80 F48", F16, 64, 4, 2, CUM, 2, 2, 16, 80, {200, 97}, 180, 0, 48},
      {"bf16 hd64 16/16 G16 R32 F16", BF16, 64, 4, 2, CUM, 16, 16, 16, 32, {150, 33}, 60, 0, 16},
  };
  for (const WCase &c : cases) {
    if (gt::configs_only()) {
      INFO("case " << std::string(c.name));
      gt::check_config_on_cpu(make_config(c, MINIKV_BACKEND_CUDA));
      continue;
    }
    if (!minikv::kernels::head_dim_compiled(c.head_dim)) continue;  // MINIKV_CUDA_HEAD_DIMS
    SUBCASE(c.name) { run_storage_case(c); }
  }
}

TEST_CASE("CUDA importance scores match a float64 reference") {
  GPU_OR_SKIP();
  // Two sequences in one launch (the second's scores start at workspace row 780, its 777-row
  // predecessor's rows rounded up to whole groups of four): partial
  // key and query tiles, tiles crossing the diagonal and interior tiles, more query tiles
  // than the score pass's pipeline stages; GQA groups 1, 4, 8 and 16 (heads / kv_heads;
  // WINDOW with 16 x 32 window rows holds them in two batches, 4 at head_dim 256).
  const uint32_t groups[][2] = {{8, 2}, {4, 4}, {8, 1}, {16, 1}};
  for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
    for (uint32_t D : {64u, 80u, 96u, 128u, 256u}) {
      if (!minikv::kernels::head_dim_compiled(D)) continue;
      for (minikv_dtype dt : {MINIKV_DTYPE_BF16, MINIKV_DTYPE_F16}) {
        for (const auto &hg : groups) {
          const WCase c{"scores", dt, D, hg[0], hg[1], mode, 2, 2, 16, 64, {777, 300}, 0};
          INFO("mode " << int(mode) << " head_dim " << D << " dtype " << int(dt) << " heads "
                       << hg[0] << "/" << hg[1]);
          minikv_config cfg = make_config(c, MINIKV_BACKEND_CUDA);
          cfg.max_seq_len = 777 + 300;  // workspace rows for both prompts: one launch
          minikv::Cache gpu(cfg);
          const gt::Prompt p = gt::make_prompt(cfg, 0, c.lens, 77);
          const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads;
          DevBuf q(p.q.size() * 2), k(p.k.size() * 2), v(p.v.size() * 2), o(p.q.size() * 2);
          q.upload(p.q.bits);
          k.upload(p.k.bits);
          v.upload(p.v.bits);
          const uint32_t ids[2] = {0, 1};
          gpu.prefill(0, 2, ids, p.cu.data(), q.get(), k.get(), v.get(), o.get(), nullptr);
          for (uint32_t sq = 0, ws_begin = 0; sq < 2; ws_begin += (c.lens[sq] + 3) / 4 * 4, ++sq) {
            const uint32_t L = c.lens[sq], begin = static_cast<uint32_t>(p.cu[sq]);
            const minikv::SelectionPlan plan =
                minikv::plan_selection(cfg, minikv::layer_heavy_ratios(cfg)[0], L);
            REQUIRE(!plan.keep_all);
            const bool window = mode == MINIKV_SCORE_WINDOW;
            const uint32_t cols = window ? plan.scored_prefix : plan.candidates;
            const std::vector<double> ref = gt::reference_scores(
                p.q, p.k, H, Hkv, D, begin, L, window ? plan.scored_prefix : 0);
            for (uint32_t kvh = 0; kvh < Hkv; ++kvh) {
              const std::vector<float> got =
                  minikv::cuda_debug_scores(gpu.backend(), kvh, ws_begin + cols);
              double max_ref = 0.0;
              for (uint32_t j = 0; j < cols; ++j)
                max_ref = std::max(max_ref, ref[size_t(kvh) * L + j]);
              uint32_t bad = 0, worst = 0;
              double worst_rel = 0.0;
              for (uint32_t j = 0; j < cols; ++j) {
                const double r = ref[size_t(kvh) * L + j], g = got[ws_begin + j];
                const double rel = std::fabs(g - r) / (std::fabs(r) + 1e-6 * max_ref);
                if (!(rel <= 1e-3)) ++bad;
                if (!(rel <= worst_rel)) {
                  worst_rel = rel;
                  worst = j;
                }
              }
              INFO("sequence " << sq << " kv_head " << kvh << ": worst relative error "
                               << worst_rel << " at column " << worst << " (gpu "
                               << got[ws_begin + worst] << ", ref " << ref[size_t(kvh) * L + worst]
                               << ")");
              CHECK(bad == 0);
              CHECK(max_ref > 0.0);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("CUDA selection keeps exactly the positions select_kept keeps (ties and NaN included)") {
  GPU_OR_SKIP();
  selection_cases::check_all(minikv::cuda_debug_select, {37, 1000, 8192 + 41, 30001});
}

}  // TEST_SUITE
