// minikv-test: white-box
// The generic decode kernel (decode_generic.cuh, sm_80+: every storage and head_dim; the plan's
// kernel for MHA with 4- or 8-bit values and for head_dim 80 and 96) run by the warp emulator
// against the CPU backend (decode_harness.hpp): head_dim 64, 80, 96, 128 and 256, key and value
// bits in {2, 4, 8, 16}, G 16 to 128, groups of 1 to 16 query heads, fp16 and bf16, with and
// without sinks.
#include "../../kernels/decode_generic.cuh"
#include "decode_harness.hpp"

namespace {

using namespace emu_test;

uint32_t generic_heads_per_cta(uint32_t n_rep) { return heads_in_chunks(n_rep, k::kGenericMaxHeads); }
const Kernel kGeneric{
    "generic", generic_heads_per_cta,
    [](const Launch &l) {
      const minikv_config &c = *l.cfg;
      return tiles_of_all_tokens(
          l, k::make_generic_decode_plan(block_layout(c), generic_heads_per_cta(c.num_heads / c.num_kv_heads)).qtile);
    },
    [](const minikv_config &cfg, const k::DecodeParams &p, CopyLanding landing) {
      dispatch_dtype_head_dim<64, 80, 96, 128, 256>(cfg, [&](auto t, auto d) {
        using T = decltype(t);
        constexpr int D = decltype(d)::value;
        auto go = [&](auto nr) {
          constexpr int NR = decltype(nr)::value;
          const uint32_t smem = k::make_generic_decode_plan(p.st.block, NR).total;
          emulate(p, k::kGenericThreads, smem, landing, [&] { k::decode_generic_kernel<T, D, NR>(p); });
        };
        const uint32_t per = p.heads_per_cta;  // decode_generic.cu's dispatch_heads
        if (per <= 1) go(std::integral_constant<int, 1>{});
        else if (per <= 2) go(std::integral_constant<int, 2>{});
        else if (per <= 4) go(std::integral_constant<int, 4>{});
        else go(std::integral_constant<int, 8>{});
      });
      return p.splits == 1;
    }};

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the generic decode kernel run by the warp emulator matches the CPU backend") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  // {key bits, value bits, G, head_dim, n_rep, dtype, sinks, R, kernels}
  const std::vector<Shape> shapes = {
      {4, 4, 16, 128, 1, F16, 0, 32, 1},    {8, 8, 32, 128, 1, BF16, 4, 64, 1},   {4, 8, 64, 64, 1, F16, 0, 128, 1},
      {2, 2, 16, 80, 1, F16, 0, 32, 1},     {2, 2, 16, 80, 4, BF16, 0, 32, 1},    {4, 2, 16, 80, 3, F16, 4, 32, 1},
      {4, 8, 16, 80, 1, BF16, 0, 32, 1},    {16, 16, 32, 80, 2, F16, 0, 64, 1},   {8, 4, 16, 80, 6, F16, 0, 32, 1},
      {2, 2, 16, 96, 1, BF16, 0, 32, 1},    {2, 2, 32, 96, 4, F16, 0, 64, 1},     {4, 2, 32, 96, 1, F16, 4, 64, 1},
      {4, 4, 16, 96, 8, BF16, 0, 32, 1},    {8, 8, 32, 96, 2, BF16, 0, 64, 1},    {16, 2, 16, 96, 5, F16, 0, 32, 1},
      {2, 8, 32, 96, 12, F16, 0, 64, 1},    {2, 2, 16, 256, 1, F16, 0, 32, 1},    {4, 2, 32, 256, 1, BF16, 4, 64, 1},
      {8, 8, 64, 256, 8, F16, 0, 128, 1},   {2, 4, 32, 256, 16, BF16, 0, 64, 1},  {16, 8, 128, 256, 1, F16, 20, 128, 1},
      {2, 2, 16, 64, 1, F16, 0, 48, 1},
  };
  run_shapes(shapes, {kGeneric});
}
}  // TEST_SUITE
