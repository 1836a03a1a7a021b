// minikv-test: white-box
// The one-warp decode kernel (decode_k4v2_warp.cu) on the G = 32 storage it is compiled for
// besides the default (k4v2_warp_storage: 2-bit, 4-bit and 8-bit keys and values, and 8-bit
// keys with 4- or 2-bit values), run by the warp emulator against the CPU backend
// (decode_harness.hpp): MINIKV_DECODE_KERNEL=k4v2-warp's kernel there. Each at head_dim 64, 128
// and 256, one, two and four head slots, fp16 and bf16, with and without sinks, tiles of 128,
// 64 and 32 tokens. Larger and smaller groups are in test_emulated_decode_warp_groups.cpp (one
// file of every instance took 20 minutes to compile under ASan, alone at the end of the build).
#include "k4v2_kernels.hpp"

namespace {

using namespace emu_test;

const std::vector<Kernel> kKernels = {one_warp_kernel<2, 2>(), one_warp_kernel<4, 4>(), one_warp_kernel<8, 8>(),
                                      one_warp_kernel<8, 4>(), one_warp_kernel<8, 2>()};

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the one-warp decode kernel on 2-bit and 4-bit and 8-bit storage at G 32 matches the CPU backend") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const uint32_t K2V2 = 1, K4V4 = 2, K8V8 = 4, K8V4 = 8, K8V2 = 16;
  const std::vector<Shape> shapes = {
      {2, 2, 32, 128, 1, F16, 4, 128, K2V2},  {2, 2, 32, 64, 4, BF16, 0, 96, K2V2},  {2, 2, 32, 128, 2, BF16, 20, 64, K2V2},
      {4, 4, 32, 128, 1, BF16, 0, 96, K4V4},  {4, 4, 32, 64, 2, F16, 4, 128, K4V4},  {4, 4, 32, 128, 4, F16, 17, 64, K4V4},
      {8, 8, 32, 128, 1, F16, 4, 128, K8V8},  {8, 8, 32, 64, 1, BF16, 4, 64, K8V8},  {8, 8, 32, 128, 3, BF16, 0, 96, K8V8},
      {8, 8, 32, 64, 4, F16, 20, 128, K8V8},
      // 8-bit keys with narrower values.
      {8, 4, 32, 128, 1, BF16, 4, 128, K8V4}, {8, 4, 32, 64, 4, F16, 0, 96, K8V4},
      {8, 2, 32, 128, 2, F16, 20, 64, K8V2}, {8, 2, 32, 64, 1, BF16, 4, 128, K8V2},
      // head_dim 256: eight value groups.
      {2, 2, 32, 256, 4, BF16, 4, 128, K2V2},  {4, 4, 32, 256, 2, F16, 20, 64, K4V4}, {8, 8, 32, 256, 1, BF16, 0, 128, K8V8},
      {8, 4, 32, 256, 3, F16, 4, 96, K8V4}, {8, 2, 32, 256, 1, BF16, 20, 128, K8V2},
  };
  run_shapes(shapes, kKernels);
}
}  // TEST_SUITE
