// Host side of the tensor-core decode (decode_mma.cuh): when it applies, and the dispatch
// to the instances of each key bit width (decode_mma_k<KB>.cu).
#include "decode_mma.cuh"

namespace minikv {
namespace kernels {

bool decode_mma_path(const BlockLayout &bl, uint32_t n_rep) {
  return n_rep >= 1 && bl.elem_bytes == 2 && in_list(MmaDecodeHeadDims{}, bl.head_dim) &&
         head_dim_compiled(bl.head_dim) &&
         bl.group >= 16 && bl.head_dim % bl.group == 0 && bl.head_dim / bl.group <= kMmaMaxGroups &&
         bl.k_row_bytes % 16 == 0 && bl.v_row_bytes % 16 == 0;
}

uint32_t decode_mma_heads_per_cta(uint32_t n_rep) {
  const uint32_t chunks = (n_rep + kMmaMaxHeads - 1) / kMmaMaxHeads;
  return (n_rep + chunks - 1) / chunks;
}

uint32_t configure_decode_mma(minikv_dtype dtype, const BlockLayout &bl) {
  switch (bl.key_bits) {
    case 2: return configure_decode_mma_k2(dtype, bl);
    case 4: return configure_decode_mma_k4(dtype, bl);
    case 8: return configure_decode_mma_k8(dtype, bl);
    default: return configure_decode_mma_k16(dtype, bl);
  }
}

void launch_decode_mma(minikv_dtype dtype, const DecodeParams &p, const MmaLaunchPlan &plan,
                       cudaStream_t stream) {
  switch (p.st.block.key_bits) {
    case 2: launch_decode_mma_k2(dtype, p, plan, stream); break;
    case 4: launch_decode_mma_k4(dtype, p, plan, stream); break;
    case 8: launch_decode_mma_k8(dtype, p, plan, stream); break;
    default: launch_decode_mma_k16(dtype, p, plan, stream); break;
  }
  if (p.splits > 1) launch_decode_merge(dtype, p.st.block.head_dim, p, stream);
}

}  // namespace kernels
}  // namespace minikv
