// minikv-test: white-box
// The one-warp decode kernel (decode_k4v2_warp.cu) on the storage of other groups than 32 it
// is compiled for (k4v2_warp_storage: 4-bit keys + 2-bit values and 2-bit both at G = 64 and
// 128; 2-bit and 4-bit keys and values at G = 16, head_dim 64 and 128), run by the warp
// emulator against the CPU backend (decode_harness.hpp): MINIKV_DECODE_KERNEL=k4v2-warp's
// kernel there. Each at head_dim 64, 128 and 256 (64 not for G = 128, 256 not for G = 16), one,
// two and four head slots, fp16 and bf16, with and without sinks. G = 32 is in
// test_emulated_decode_warp_bits.cpp.
#include "k4v2_kernels.hpp"

namespace {

using namespace emu_test;

const std::vector<Kernel> kKernels = {one_warp_kernel<4, 2, 64>(),  one_warp_kernel<2, 2, 64>(),
                                      one_warp_kernel<4, 2, 128>(), one_warp_kernel<2, 2, 128>(),
                                      one_warp_kernel<2, 2, 16>(),  one_warp_kernel<4, 4, 16>()};

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the one-warp decode kernel on groups of 64 and 128 and 16 tokens matches the CPU backend") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const uint32_t K4V2G64 = 1, K2V2G64 = 2, K4V2G128 = 4, K2V2G128 = 8, K2V2G16 = 16, K4V4G16 = 32;
  const std::vector<Shape> shapes = {
      // Larger groups: one or two key groups per tile (each 32-token step reads its group's
      // scales), one value group per 64-channel span or one over two spans.
      {4, 2, 64, 128, 1, F16, 4, 128, K4V2G64}, {4, 2, 64, 64, 4, BF16, 0, 192, K4V2G64},
      {4, 2, 64, 128, 2, BF16, 17, 128, K4V2G64}, {2, 2, 64, 64, 1, BF16, 4, 128, K2V2G64},
      {2, 2, 64, 128, 4, F16, 0, 128, K2V2G64},  {4, 2, 64, 64, 3, F16, 20, 64, K4V2G64},   {4, 2, 128, 128, 1, BF16, 4, 128, K4V2G128},
      {4, 2, 128, 128, 4, F16, 20, 256, K4V2G128}, {2, 2, 128, 128, 2, F16, 0, 128, K2V2G128},
      {2, 2, 128, 128, 1, BF16, 4, 384, K2V2G128},
      // head_dim 256: four value groups at G = 64 (two spans each), two at 128.
      {4, 2, 64, 256, 4, BF16, 17, 128, K4V2G64}, {2, 2, 64, 256, 1, F16, 4, 64, K2V2G64},
      {4, 2, 128, 256, 2, BF16, 4, 128, K4V2G128}, {2, 2, 128, 256, 4, F16, 0, 256, K2V2G128},
      // G = 16 (the paper's storage, and 4/4 bits): one key group per M-tile, four value
      // groups a span; one, two and four head slots (two P·V n-tiles, swizzled B rows),
      // groups of 3 (a padded slot) and 8 (two chunks).
      {2, 2, 16, 128, 1, F16, 0, 128, K2V2G16}, {2, 2, 16, 64, 2, BF16, 4, 96, K2V2G16},
      {2, 2, 16, 128, 2, F16, 17, 64, K2V2G16}, {2, 2, 16, 64, 1, BF16, 0, 32, K2V2G16},
      {4, 4, 16, 128, 1, BF16, 4, 128, K4V4G16}, {4, 4, 16, 64, 2, F16, 20, 64, K4V4G16},
      {4, 4, 16, 128, 2, F16, 0, 96, K4V4G16},  {4, 4, 16, 64, 1, BF16, 4, 48, K4V4G16},
      {2, 2, 16, 128, 4, F16, 0, 128, K2V2G16}, {2, 2, 16, 64, 3, BF16, 4, 96, K2V2G16},
      {2, 2, 16, 128, 8, BF16, 20, 32, K2V2G16}, {4, 4, 16, 128, 4, BF16, 17, 64, K4V4G16},
      {4, 4, 16, 64, 8, F16, 0, 128, K4V4G16},  {4, 4, 16, 128, 3, F16, 4, 48, K4V4G16},
  };
  run_shapes(shapes, kKernels);
}
}  // TEST_SUITE
