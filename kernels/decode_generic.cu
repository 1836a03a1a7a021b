// Sizing and launch of the generic decode kernel (decode_generic.cuh: what it computes and
// how). Its instances live in decode_generic_hd<D>.cu, one translation unit per head_dim.
#include <type_traits>

#include "common.cuh"
#include "decode_generic_plan.h"
#include "dispatch.cuh"
#include "launchers.h"

namespace minikv {
namespace kernels {
namespace {

// fn(std::integral_constant<int, NR>{}) for the heads-per-CTA tile that holds `per` heads.
template <typename Fn> void dispatch_heads(uint32_t per, Fn &&fn) {
  if (per <= 1) return fn(std::integral_constant<int, 1>{});
  if (per <= 2) return fn(std::integral_constant<int, 2>{});
  if (per <= 4) return fn(std::integral_constant<int, 4>{});
  if (per <= 8) return fn(std::integral_constant<int, 8>{});
  fail(MINIKV_ERR_INTERNAL, "minikv_decode: %u query heads per CTA (at most %u)", per,
       kGenericMaxHeads);
}

template <typename Fn>
void dispatch_generic(minikv_dtype dtype, uint32_t head_dim, uint32_t per, Fn &&fn) {
  dispatch_dtype_head_dim(dtype, head_dim, "minikv_decode", [&](auto tag, auto hd) {
    dispatch_heads(per, [&](auto nr) {
      fn(decode_generic_kernel_for<decltype(tag), decltype(hd)::value, decltype(nr)::value>(), nr);
    });
  });
}

}  // namespace

uint32_t decode_generic_heads_per_cta(uint32_t n_rep) {
  const uint32_t chunks = (n_rep + kGenericMaxHeads - 1) / kGenericMaxHeads;
  return (n_rep + chunks - 1) / chunks;
}

uint32_t decode_generic_smem_bytes(const BlockLayout &bl, uint32_t n_rep) {
  uint32_t bytes = 0;
  dispatch_heads(decode_generic_heads_per_cta(n_rep), [&](auto nr) {
    bytes = make_generic_decode_plan(bl, decltype(nr)::value).total;
  });
  return bytes;
}

uint32_t configure_decode_generic(minikv_dtype dtype, const BlockLayout &bl, uint32_t n_rep) {
  const uint32_t per = decode_generic_heads_per_cta(n_rep);
  const uint32_t smem = decode_generic_smem_bytes(bl, n_rep);
  int blocks = 0;
  dispatch_generic(dtype, bl.head_dim, per, [&](auto kernel, auto) {
    MINIKV_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
    MINIKV_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kGenericThreads, smem));
  });
  return static_cast<uint32_t>(blocks > 0 ? blocks : 1);
}

void launch_decode_generic(minikv_dtype dtype, const DecodeParams &p, cudaStream_t stream) {
  const BlockLayout &bl = p.st.block;
  const uint32_t n_rep = p.num_heads / p.num_kv_heads;
  const uint32_t chunks = (n_rep + p.heads_per_cta - 1) / p.heads_per_cta;
  const uint32_t smem = decode_generic_smem_bytes(bl, n_rep);
  dispatch_generic(dtype, bl.head_dim, p.heads_per_cta, [&](auto kernel, auto) {
    kernel<<<dim3(p.splits, p.num_kv_heads * chunks, p.n), kGenericThreads, smem, stream>>>(p);
    check_launch_error("decode_generic_kernel");
  });
  if (p.splits > 1) launch_decode_merge(dtype, bl.head_dim, p, stream);
}

}  // namespace kernels
}  // namespace minikv
