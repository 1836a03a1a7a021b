// minikv-test: white-box
// The one-warp decode kernel (decode_k4v2_warp.cu) on G = 32 storage of the other bit pairs it
// is compiled for (k4v2_warp_bits: 2-bit, 4-bit and 8-bit keys and values), run by the warp
// emulator against the CPU backend (decode_harness.hpp): MINIKV_DECODE_KERNEL=k4v2-warp's
// kernel there. Each pair at head_dim 64 and 128, one, two and four head slots, fp16 and
// bf16, with and without sinks, tiles of 128, 64 and 32 tokens (R 128, 64, 96).
#include "k4v2_kernels.hpp"

namespace {

using namespace emu_test;

const std::vector<Kernel> kKernels = {one_warp_kernel<2, 2>(), one_warp_kernel<4, 4>(), one_warp_kernel<8, 8>()};

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the one-warp decode kernel on 2-bit and 4-bit and 8-bit storage matches the CPU backend") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const uint32_t K2V2 = 1, K4V4 = 2, K8V8 = 4;  // bits of the kernel list
  const std::vector<Shape> shapes = {
      {2, 2, 32, 128, 1, F16, 4, 128, K2V2},  {2, 2, 32, 64, 4, BF16, 0, 96, K2V2},  {2, 2, 32, 128, 2, BF16, 20, 64, K2V2},
      {4, 4, 32, 128, 1, BF16, 0, 96, K4V4},  {4, 4, 32, 64, 2, F16, 4, 128, K4V4},  {4, 4, 32, 128, 4, F16, 17, 64, K4V4},
      {8, 8, 32, 128, 1, F16, 4, 128, K8V8},  {8, 8, 32, 64, 1, BF16, 4, 64, K8V8},  {8, 8, 32, 128, 3, BF16, 0, 96, K8V8},
      {8, 8, 32, 64, 4, F16, 20, 128, K8V8},
  };
  run_shapes(shapes, kKernels);
}
}  // TEST_SUITE
