// The tensor-core decode instances with 16-bit keys (16-bit key rows): decode_mma.cuh.
#include "decode_mma.cuh"

namespace minikv {
namespace kernels {

uint32_t configure_decode_mma_k16(minikv_dtype dtype, const BlockLayout &bl) {
  return DecodeMmaKeyBits<16>::configure(dtype, bl);
}
void launch_decode_mma_k16(minikv_dtype dtype, const DecodeParams &p, const MmaLaunchPlan &plan,
                          cudaStream_t stream) {
  DecodeMmaKeyBits<16>::launch(dtype, p, plan, stream);
}

}  // namespace kernels
}  // namespace minikv
