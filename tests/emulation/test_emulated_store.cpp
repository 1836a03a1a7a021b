// minikv-test: white-box
// The prefill's store kernel (select_quantize.cu store_kept_kernel: the kept rows gathered
// from the caller's K/V, whole groups quantized into pool blocks, the sinks and the tail into
// the residual slot) run by the warp emulator on the CPU, over a block-table mirror that
// set_block_table_kernel wrote: given the kept positions the CPU backend chose, the pool and
// every residual slot must equal the CPU prefill's byte for byte (the contract the GPU storage
// test checks on a device), for key and value bits in {2, 4, 8, 16}, G 16 to 128, head_dim 64
// to 256, fp16 and bf16, both score modes, with and without sinks, prompts shorter than a
// group to several blocks. The positions the kernel finds without the selection (the sinks,
// the protected suffix, a prompt kept whole) are poisoned in the kept list it is given.
#include "../../kernels/select_plan.h"
#include "../../kernels/select_quantize.cu"
#include "decode_harness.hpp"

namespace {

using namespace emu_test;

int32_t read_i32(const std::vector<uint8_t> &bytes, uint64_t at) {
  int32_t x;
  std::memcpy(&x, bytes.data() + at, 4);
  return x;
}

// Signed zeros and the dtype's largest values among normal ones: the minimum and maximum of
// a group are then often ties of −0 and +0 (the earlier element's sign is stored), and
// groups spanning −max to +max take group_scale's overflow-free quotient. (Inputs are finite:
// the CPU backend refuses NaN and infinities.)
void sprinkle_special(test::Buf &x, test::Rng &rng, double biggest) {
  for (size_t i = 0; i < x.size(); ++i) {
    const double u = rng.uniform();
    if (u < 0.2) x.set(i, 0.0);
    else if (u < 0.4) x.set(i, -0.0);
    else if (u < 0.402) x.set(i, u < 0.401 ? biggest : -biggest);
  }
}

void run_store(const Shape &s, minikv_score_mode mode, bool special = false) {
  test::Rng rng(0x570e + s.head_dim + s.key_bits * 5 + s.value_bits * 3 + s.group + s.residual + mode);
  const std::vector<uint32_t> lens = {1, 17, 31, 33, 333, 700};
  const uint32_t B = uint32_t(lens.size());
  minikv_config cfg = shape_config(s, B, 708);
  cfg.score_mode = mode;
  const uint32_t kv_heads = cfg.num_kv_heads, H = cfg.num_heads, D = s.head_dim;
  test::CachePtr cache = test::make_cache(cfg);
  const minikv::Cache &impl = cache->impl;
  std::vector<int32_t> cu(B + 1, 0);
  std::vector<uint32_t> ids(B);
  for (uint32_t b = 0; b < B; ++b) {
    cu[b + 1] = cu[b] + int32_t(lens[b]);
    ids[b] = b;
  }
  const size_t rows = size_t(cu[B]);
  test::Buf q(s.dtype, rows * H * D), k(s.dtype, rows * kv_heads * D), v(s.dtype, rows * kv_heads * D),
      out(s.dtype, rows * H * D);
  q.fill_normal(rng);
  k.fill_normal(rng, 3.0);
  v.fill_normal(rng);
  if (special) {
    const double biggest = s.dtype == MINIKV_DTYPE_F16 ? 65504.0 : 0x1.fep127;
    sprinkle_special(k, rng, biggest);
    sprinkle_special(v, rng, biggest);
  }
  std::vector<uint8_t> pool, residual, pool_want, residual_want;
  impl.backend().read_storage(pool, residual);
  MKV_REQUIRE_OK(minikv_prefill(cache.get(), 0, B, ids.data(), cu.data(), q.data(), k.data(), v.data(), out.data(),
                                nullptr));
  impl.backend().read_storage(pool_want, residual_want);

  // cuda_backend.cpp's prefill_launch: one launch over the batch, each sequence's kept
  // positions at its workspace offset (here 3 rows past the previous one's end).
  const minikv::BlockLayout bl = block_layout(cfg);
  const minikv::ResidualLayout rl = residual_layout(cfg);
  const uint32_t R = s.residual;
  std::vector<CacheView> views(B);
  uint32_t width = 1, ws = 0;
  for (uint32_t b = 0; b < B; ++b) {
    views[b] = impl.view(b, 0);
    width = std::max(width, views[b].num_blocks);
  }
  std::vector<uint32_t> ws_offset(B);
  for (uint32_t b = 0; b < B; ++b) {
    ws_offset[b] = ws;
    ws += lens[b] + 3;
  }
  std::vector<int32_t> table(size_t(B) * width, -1), kept(size_t(kv_heads) * ws, -1);
  k::StoreParams p{};
  p.k = k.data();
  p.v = v.data();
  p.kept = kept.data();
  p.st = k::DeviceStorage{pool.data(), residual.data(), table.data(), bl, rl, width, 0};
  p.ws_tokens = ws;
  uint32_t max_tasks = 0, known = 0;
  for (uint32_t b = 0; b < B; ++b) {
    const CacheView &cv = views[b];
    // The block-table mirror's row by set_block_table_kernel (cuda_backend.cpp set_table).
    k::TableParams tp{};
    tp.block_table = table.data();
    tp.max_blocks_per_seq = width;
    tp.slot = cv.residual_slot;
    tp.count = cv.num_blocks;
    for (uint32_t i = 0; i < cv.num_blocks; ++i) tp.ids[i] = int32_t(cv.blocks[i]);
    minikv::emulation::launch(dim3(1), dim3(256), 0, CopyLanding::kAtIssue, [&] { k::set_block_table_kernel(tp); });
    for (uint32_t i = 0; i < width; ++i)
      REQUIRE(table[size_t(cv.residual_slot) * width + i] == (i < cv.num_blocks ? int32_t(cv.blocks[i]) : -1));
    // The kept positions in cache order: the sinks, the blocks' rows, the residual's.
    for (uint32_t h = 0; h < kv_heads; ++h) {
      int32_t *list = kept.data() + size_t(h) * ws + ws_offset[b];
      uint32_t n = 0;
      for (uint32_t t = 0; t < cv.sinks; ++t) list[n++] = int32_t(t);
      for (uint32_t t = 0; t < cv.quantized; ++t)
        list[n++] = read_i32(pool_want, uint64_t(cv.blocks[t / R]) * bl.bytes + bl.positions + h * bl.positions_head() +
                                            uint64_t(t % R) * 4);
      for (uint32_t t = 0; t < cv.residual; ++t)
        list[n++] = read_i32(residual_want, uint64_t(cv.residual_slot) * rl.bytes + rl.positions + (uint64_t(h) * R + t) * 4);
      REQUIRE(n <= lens[b]);
    }
    const uint32_t n_keep = cv.sinks + cv.quantized + cv.residual;
    // The positions known without the selection come from the plan, not from `kept`, whose
    // entries there are poisoned: the kernel must find them itself.
    k::set_store_positions(p, b, minikv::plan_selection(cfg, minikv::layer_heavy_ratios(cfg)[0], lens[b]));
    for (uint32_t h = 0; h < kv_heads; ++h)
      for (uint32_t i = 0; i < n_keep; ++i)
        if (i < cv.sinks || i >= p.chosen_end[b]) kept[size_t(h) * ws + ws_offset[b] + i] = -7;
    known += n_keep - (p.chosen_end[b] - cv.sinks);
    p.seqs.n = b + 1;
    p.seqs.token_begin[b] = cu[b];
    p.seqs.len[b] = lens[b];
    p.seqs.ws_offset[b] = ws_offset[b];
    p.sinks[b] = cv.sinks;
    p.quantized[b] = cv.quantized;
    p.n_keep[b] = n_keep;
    p.slot[b] = cv.residual_slot;
    max_tasks = std::max(max_tasks, cv.quantized / s.group + (n_keep > cv.quantized ? 1u : 0u));
  }
  CHECK(known > 0);  // the case has positions to find without the selection
  minikv::emulation::launch(dim3(max_tasks * kv_heads, B), dim3(k::kStoreThreads), 0, CopyLanding::kAtIssue, [&] {
    if (s.dtype == MINIKV_DTYPE_F16) k::store_kept_kernel<__half>(p);
    else k::store_kept_kernel<__nv_bfloat16>(p);
  });
  CHECK(pool == pool_want);
  CHECK(residual == residual_want);
  uint32_t quantized = 0;
  for (const CacheView &cv : views) quantized += cv.quantized;
  CHECK(quantized > 0);  // the case stores blocks, not only the residual
}

// Scales quantize_reciprocal has no reciprocal for: the store divides there.
const float kScalesWithoutReciprocal[] = {0.0f, 1e-40f, 1e-45f, 0x1p127f, INFINITY};

// pack_word's word against quantize_code element by element; each element has its own group
// (mn, scale), as a key word's channels do.
template <uint32_t BITS>
void check_word(const float (&x)[32 / BITS], const float (&mn)[32 / BITS], const float (&scale)[32 / BITS]) {
  constexpr uint32_t P = 32 / BITS, kLevels = (1u << BITS) - 1u;
  float r[P];
  for (uint32_t j = 0; j < P; ++j) r[j] = minikv::quantize_reciprocal(scale[j]);
  const uint32_t word = k::pack_word<BITS>(
      x, [&](uint32_t j) { return mn[j]; }, [&](uint32_t j) { return scale[j]; }, [&](uint32_t j) { return r[j]; });
  for (uint32_t j = 0; j < P; ++j) {
    const uint32_t want = minikv::quantize_code(x[j], mn[j], scale[j], kLevels);
    if (((word >> (j * BITS)) & kLevels) != want) {
      INFO("bits " << BITS << " x " << x[j] << " mn " << mn[j] << " scale " << scale[j]);
      CHECK(((word >> (j * BITS)) & kLevels) == want);
    }
  }
}

// Groups over magnitudes 2^±100, values rounded to float, on and a few ulp around the
// half-integer boundaries (where the word must take the division), past the clamps; NaN and
// infinite values and scales without a reciprocal (0, subnormal, above 2^126, infinite, NaN),
// which the CPU backend never stores but the device store can meet. Returns how many values
// lay within 0.05 of a boundary.
template <uint32_t BITS> uint64_t check_pack_word(test::Rng &rng) {
  constexpr uint32_t P = 32 / BITS, kLevels = (1u << BITS) - 1u;
  const float odd_x[] = {NAN, INFINITY, -INFINITY, -0.0f};
  uint64_t near_half = 0;
  for (uint32_t w = 0; w < 200000 / P; ++w) {
    float x[P], mn[P], scale[P];
    for (uint32_t j = 0; j < P; ++j) {
      const float mag = std::ldexp(1.0f, int(rng.uniform() * 200.0) - 100);
      mn[j] = float(rng.normal()) * mag;
      if (rng.below(64) == 0) {
        const uint32_t i = rng.below(6);
        scale[j] = i < 5 ? kScalesWithoutReciprocal[i] : NAN;
      } else {
        scale[j] = float(std::fabs(rng.normal()) + 1e-3) * mag;
      }
      switch (rng.below(5)) {
        case 0: x[j] = mn[j] + scale[j] * float(rng.uniform() * 1.4 * kLevels - 0.2); break;
        case 1: {  // on a boundary, then nudged by up to 3 ulp either way
          x[j] = mn[j] + (std::floor(float(rng.uniform()) * kLevels) + 0.5f) * scale[j];
          const int nudge = int(rng.below(7)) - 3;
          for (int n = 0; n < std::abs(nudge); ++n) x[j] = std::nextafter(x[j], nudge > 0 ? INFINITY : -INFINITY);
          break;
        }
        case 2: x[j] = mn[j] + scale[j] * std::round(float(rng.uniform()) * kLevels); break;
        case 3: x[j] = mn[j] + scale[j] * float(kLevels + 0.5 + rng.uniform()); break;
        default: x[j] = rng.below(4) == 0 ? odd_x[rng.below(4)] : mn[j] + scale[j] * float(rng.uniform() * kLevels);
      }
      const float t = (x[j] - mn[j]) / scale[j];
      if (std::fabs(t - std::rint(t)) > 0.45f) ++near_half;
    }
    check_word<BITS>(x, mn, scale);
  }
  return near_half;
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the store's packed codes equal quantize_code for every input") {
  test::Rng rng(11);
  const uint64_t near_half = check_pack_word<2>(rng) + check_pack_word<4>(rng) + check_pack_word<8>(rng);
  CHECK(near_half > 50000);  // the boundary cases were exercised
  // Exact ties (to even), a difference that overflows float, the clamps, and the scales
  // without a reciprocal against values down to the smallest subnormal, in one 2-bit word.
  float x[16] = {0.5f, 1.5f, 2.5f, 2.5000002f, -5.0f, 3e38f}, mn[16] = {0, 0, 0, 0, 0, -3e38f},
        scale[16] = {1, 1, 1, 1, 1, 1e38f};
  const float small_x[] = {0.0f, 1e-45f, 3e-45f, 1e-40f, 1.0f, 3e38f};
  for (uint32_t i = 0; i < 10; ++i) {
    x[6 + i] = small_x[i % 6];
    mn[6 + i] = 0.0f;
    scale[6 + i] = kScalesWithoutReciprocal[i % 5];
  }
  check_word<2>(x, mn, scale);
  for (float sc : kScalesWithoutReciprocal) CHECK(std::isnan(minikv::quantize_reciprocal(sc)));
}

TEST_CASE("the prefill's store kernel run by the warp emulator stores the CPU backend's bytes") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  // {key bits, value bits, G, head_dim, n_rep, dtype, sinks, R, kernels (unused)}
  const std::vector<Shape> shapes = {
      {4, 2, 32, 128, 1, F16, 4, 128, 0},  {2, 2, 16, 64, 2, BF16, 0, 32, 0},  {8, 8, 32, 128, 1, BF16, 0, 64, 0},
      {4, 4, 16, 80, 4, F16, 0, 64, 0},    {2, 4, 128, 128, 1, F16, 0, 128, 0}, {16, 2, 16, 96, 1, BF16, 4, 48, 0},
      {4, 16, 32, 256, 1, F16, 0, 96, 0},  {16, 16, 16, 64, 1, F16, 17, 32, 0}, {8, 2, 16, 128, 2, BF16, 0, 160, 0},
  };
  for (const Shape &s : shapes)
    for (minikv_score_mode mode : {MINIKV_SCORE_CUMULATIVE, MINIKV_SCORE_WINDOW}) {
      SUBCASE((s.name() + (mode == MINIKV_SCORE_WINDOW ? " window" : " cumulative")).c_str()) { run_store(s, mode); }
    }
}

TEST_CASE("the prefill's store kernel stores the CPU backend's bytes for signed zeros and the largest values") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const std::vector<Shape> shapes = {
      {4, 2, 32, 128, 1, F16, 4, 128, 0}, {2, 8, 16, 64, 2, BF16, 0, 32, 0}, {8, 4, 64, 128, 1, BF16, 0, 64, 0},
      {4, 2, 16, 80, 1, F16, 0, 64, 0},   {2, 2, 128, 256, 1, F16, 0, 128, 0},
  };
  for (const Shape &s : shapes)
    SUBCASE(s.name().c_str()) { run_store(s, MINIKV_SCORE_WINDOW, true); }
}
}  // TEST_SUITE
