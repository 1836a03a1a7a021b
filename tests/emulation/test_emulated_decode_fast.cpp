// minikv-test: white-box
// The fast decode kernel (decode_fast.cu: the MiniKV paper's storage, 2-bit keys and values,
// G = 16, no sinks, head_dim 64 and 128, GQA groups of 1, 2, 4 and 8) run by the warp emulator
// against the CPU backend (decode_harness.hpp): fp16 and bf16, R of 2 G to 128.
#include "../../kernels/decode_fast.cu"
#include "decode_harness.hpp"

namespace {

using namespace emu_test;

const Kernel kFast{
    "fast", [](uint32_t n_rep) { return n_rep; },  // a CTA takes a KV head's whole group
    [](const Launch &l) {  // cuda_backend.cpp's count for this kernel
      uint32_t all, quantized;
      longest(l, all, quantized);
      return (quantized + k::kDecodeFastTile - 1) / k::kDecodeFastTile;
    },
    [](const minikv_config &cfg, const k::DecodeParams &p, CopyLanding landing) {
      const uint32_t n_rep = p.num_heads / p.num_kv_heads;
      dispatch_dtype_head_dim<64, 128>(cfg, [&](auto t, auto d) {
        using T = decltype(t);
        constexpr int D = decltype(d)::value;
        auto go = [&](auto nr) {
          emulate(p, 32, 0, landing, [&] { k::decode_fast_kernel<T, D, decltype(nr)::value>(p); });
        };
        if (n_rep == 1) go(std::integral_constant<int, 1>{});
        else if (n_rep == 2) go(std::integral_constant<int, 2>{});
        else if (n_rep == 4) go(std::integral_constant<int, 4>{});
        else go(std::integral_constant<int, 8>{});
      });
      return p.splits == 1 || (n_rep == 1   ? k::fused_merge<1>(p.splits)
                               : n_rep == 2 ? k::fused_merge<2>(p.splits)
                               : n_rep == 4 ? k::fused_merge<4>(p.splits)
                                            : k::fused_merge<8>(p.splits));
    }};

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the fast decode kernel run by the warp emulator matches the CPU backend") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  // {key bits, value bits, G, head_dim, n_rep, dtype, sinks, R, kernels}
  const std::vector<Shape> shapes = {
      {2, 2, 16, 128, 1, F16, 0, 128, 1}, {2, 2, 16, 64, 1, BF16, 0, 32, 1}, {2, 2, 16, 128, 2, BF16, 0, 64, 1},
      {2, 2, 16, 64, 4, F16, 0, 128, 1},  {2, 2, 16, 128, 8, F16, 0, 32, 1}, {2, 2, 16, 64, 8, BF16, 0, 128, 1},
  };
  run_shapes(shapes, {kFast});
}
}  // TEST_SUITE
