// Runtime dtype / head_dim → compile-time template arguments. Sizes that are not compiled
// fail with MINIKV_ERR_UNSUPPORTED and a message naming the supported ones.
#pragma once

#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common.cuh"
#include "cuda_shapes.h"
#include "tensor_maps.h"

namespace minikv {
namespace kernels {

template <int D> using HeadDim = std::integral_constant<int, D>;

// fn(T{}) with T = __half or __nv_bfloat16.
template <typename Fn> void dispatch_dtype(minikv_dtype dtype, const char *what, Fn &&fn) {
  switch (dtype) {
    case MINIKV_DTYPE_F16: fn(__half{}); return;
    case MINIKV_DTYPE_BF16: fn(__nv_bfloat16{}); return;
    default:
      fail(MINIKV_ERR_UNSUPPORTED,
           "%s: dtype F32 is not supported by the CUDA backend (use F16 or BF16, or the CPU "
           "backend)",
           what);
  }
}

// fn(HeadDim<D>{}) when head_dim == D and D is compiled into this build (a D left out by
// MINIKV_HEAD_DIMS is never instantiated); false when no D of the list matched.
template <int... Ds, typename Fn>
bool dispatch_head_dim(HeadDimList<Ds...>, uint32_t head_dim, Fn &&fn) {
  bool found = false;
  auto one = [&](auto hd) {
    constexpr int D = decltype(hd)::value;
    if constexpr (head_dim_compiled(D)) {
      if (!found && head_dim == uint32_t(D)) {
        found = true;
        fn(hd);
      }
    }
  };
  (one(HeadDim<Ds>{}), ...);
  return found;
}

// fn(T{}, HeadDim<D>{}) for the compiled head_dim values of `List` (the kernel family's).
template <typename List = KernelHeadDims, typename Fn>
void dispatch_dtype_head_dim(minikv_dtype dtype, uint32_t head_dim, const char *what, Fn &&fn) {
  dispatch_dtype(dtype, what, [&](auto tag) {
    if (!dispatch_head_dim(List{}, head_dim, [&](auto hd) { fn(tag, hd); })) {
      fail(MINIKV_ERR_UNSUPPORTED,
           "%s: head_dim %u is not compiled into this CUDA kernel family (the CUDA backend "
           "supports: %s)",
           what, head_dim, compiled_head_dims_text().c_str());
    }
  });
}

// Whether an sm_90a prefill kernel (the forward or the score pass) of (dtype, head_dim) runs
// here, raising its dynamic shared memory limit if so: not forced to the sm_80 kernels by
// MINIKV_PREFILL_KERNEL=mma (a debug knob, for comparisons), head_dim in WgmmaHeadDims (other
// values run the mma.sync kernels), the driver able to encode their TMA tensor maps, and
// their sm_90a image the one this device loads (compute capability 9.0).
// kernel_of(T{}, HeadDim<D>{}) returns {the kernel, its dynamic shared memory bytes}.
template <typename KernelOf>
bool sm90a_prefill_usable(minikv_dtype dtype, uint32_t head_dim, KernelOf &&kernel_of) {
  if (const char *e = std::getenv("MINIKV_PREFILL_KERNEL")) {
    if (std::strcmp(e, "mma") == 0) return false;  // the sm_80 kernels, for comparisons
  }
  if (!in_list(WgmmaHeadDims{}, head_dim) || !tensor_maps_available()) return false;
  bool usable = false;
  dispatch_dtype_head_dim<WgmmaHeadDims>(dtype, head_dim, "minikv_cache_create",
                                         [&](auto tag, auto hd) {
    const auto k = kernel_of(tag, hd);
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, k.first) == cudaSuccess && attr.binaryVersion == 90) {
      MINIKV_CUDA_CHECK(cudaFuncSetAttribute(k.first, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(k.second)));
      usable = true;
    }
  });
  (void)cudaGetLastError();  // a failed attribute query leaves no sticky error
  return usable;
}

}  // namespace kernels
}  // namespace minikv
