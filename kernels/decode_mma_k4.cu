// The tensor-core decode instances with 4-bit keys: decode_mma.cuh.
#include "decode_mma.cuh"

namespace minikv {
namespace kernels {

uint32_t configure_decode_mma_k4(minikv_dtype dtype, const BlockLayout &bl) {
  return DecodeMmaKeyBits<4>::configure(dtype, bl);
}
void launch_decode_mma_k4(minikv_dtype dtype, const DecodeParams &p, const MmaLaunchPlan &plan,
                          cudaStream_t stream) {
  DecodeMmaKeyBits<4>::launch(dtype, p, plan, stream);
}

}  // namespace kernels
}  // namespace minikv
