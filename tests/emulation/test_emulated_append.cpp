// minikv-test: white-box
// The append kernel (append_flush.cu: a token into the 16-bit residual and, when the residual
// fills, the flush that quantizes it into pool blocks) run by the warp emulator on the CPU
// backend's storage: after every append, of a ragged batch across flushes, the pool and every
// residual slot must be byte-identical to the CPU backend's (the contract the GPU tests check
// for whole pools): key and value bits in {2, 4, 8, 16}, G 16 to 128, head_dim 64 to 256,
// fp16 and bf16, with and without sinks, whole and sliding flushes (flush_tokens < R: the
// rows that stay move to the slot's front).
#include "../../kernels/append_flush.cu"
#include "decode_harness.hpp"

namespace {

using namespace emu_test;

void run_appends(const Shape &s) {
  const uint32_t R = s.residual, F = s.flush ? s.flush : R;
  const uint32_t steps = R + 2 * F + 3;  // the first flush and two sliding ones
  test::Rng rng(0xa99e + s.head_dim + s.key_bits * 5 + s.value_bits * 3 + s.group + R);
  Prefilled c = prefill_cache(s, steps, rng);
  const minikv::Cache &impl = c.cache->impl;
  const std::vector<uint32_t> &lens = c.lens, &ids = c.ids;
  const uint32_t B = uint32_t(lens.size()), kv_heads = c.cfg.num_kv_heads, D = s.head_dim;
  const minikv::BlockLayout bl = block_layout(c.cfg);
  const minikv::ResidualLayout rl = residual_layout(c.cfg);
  uint32_t flushes = 0;
  for (uint32_t step = 0; step < steps; ++step) {
    test::Buf k(s.dtype, size_t(B) * kv_heads * D), v(s.dtype, size_t(B) * kv_heads * D);
    k.fill_normal(rng, step % 7 == 3 ? 100.0 : 1.0);  // some steps far from the others' scale
    v.fill_normal(rng);
    std::vector<CacheView> before(B);
    for (uint32_t b = 0; b < B; ++b) before[b] = impl.view(b, 0);
    std::vector<uint8_t> pool, residual, pool_want, residual_want;
    impl.backend().read_storage(pool, residual);
    MKV_REQUIRE_OK(minikv_append(c.cache.get(), 0, B, ids.data(), k.data(), v.data(), nullptr));
    impl.backend().read_storage(pool_want, residual_want);

    // cuda_backend.cpp's launch_appends: the state before the token, the blocks after it.
    k::AppendParams p{};
    p.k = k.data();
    p.v = v.data();
    uint32_t width = 1;
    for (uint32_t b = 0; b < B; ++b) width = std::max(width, impl.view(b, 0).num_blocks);
    std::vector<int32_t> table(size_t(B) * width, -1);
    p.st = k::DeviceStorage{pool.data(), residual.data(), table.data(), bl, rl, width, 0};
    p.flush_tokens = F;
    p.n = B;
    for (uint32_t b = 0; b < B; ++b) {
      const CacheView after = impl.view(b, 0);
      k::AppendItemParams &it = p.items[b];
      it.input = b;
      it.slot = before[b].residual_slot;
      it.row = before[b].residual;
      it.quantized = before[b].quantized;
      it.position = int32_t(lens[b] + step);
      it.flush = after.quantized != before[b].quantized ? 1u : 0u;
      if (it.flush) {
        it.block_lo = int32_t(after.blocks[before[b].quantized / R]);
        it.block_hi = int32_t(after.blocks[(before[b].quantized + F - 1) / R]);
        ++flushes;
      }
    }
    minikv::emulation::launch(dim3(p.n, kv_heads), dim3(k::kAppendThreads), 0, CopyLanding::kAtIssue, [&] {
      if (s.dtype == MINIKV_DTYPE_F16) k::append_kernel<__half>(p);
      else k::append_kernel<__nv_bfloat16>(p);
    });
    INFO("step " << step);
    CHECK(pool == pool_want);
    CHECK(residual == residual_want);
    for (uint32_t b = 0; b < B; ++b)
      if (p.items[b].flush) {
        const CacheView after = impl.view(b, 0);
        const uint32_t q = before[b].quantized;
        CHECK(table[size_t(p.items[b].slot) * width + q / R] == int32_t(after.blocks[q / R]));
        CHECK(table[size_t(p.items[b].slot) * width + (q + F - 1) / R] ==
              int32_t(after.blocks[(q + F - 1) / R]));
      }
  }
  CHECK(flushes >= B * (F < R ? 3 : 1));  // every sequence flushed (three times when sliding)
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the append kernel run by the warp emulator stores the CPU backend's bytes") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  // {key bits, value bits, G, head_dim, n_rep, dtype, sinks, R, kernels}
  const std::vector<Shape> shapes = {
      {4, 2, 32, 128, 1, F16, 4, 128, 1},  {2, 2, 16, 64, 1, BF16, 0, 32, 1},  {8, 8, 32, 128, 1, BF16, 0, 64, 1},
      {4, 4, 16, 80, 1, F16, 0, 64, 1},    {2, 4, 128, 128, 1, F16, 0, 128, 1}, {16, 2, 16, 96, 1, BF16, 4, 48, 1},
      {4, 16, 32, 256, 1, F16, 0, 96, 1},  {16, 16, 16, 64, 1, F16, 17, 32, 1}, {8, 2, 16, 128, 1, BF16, 0, 160, 1},
      // Sliding flushes: F dividing R, F not dividing R, F = G, F = R - G (rows move in one step)
      {4, 2, 32, 128, 1, F16, 4, 128, 1, 32}, {4, 2, 32, 64, 1, BF16, 4, 64, 1, 32},
      {2, 2, 16, 64, 1, F16, 0, 80, 1, 48},   {16, 4, 16, 80, 1, BF16, 0, 48, 1, 16},
      {8, 16, 32, 256, 1, F16, 0, 96, 1, 64},
  };
  for (const Shape &s : shapes) {
    SUBCASE(s.name().c_str()) { run_appends(s); }
  }
}
}  // TEST_SUITE
