// Runtime dtype / head_dim → compile-time template arguments. Sizes that are not compiled
// fail with MINIKV_ERR_UNSUPPORTED and a message naming the supported ones.
#pragma once

#include <type_traits>

#include "common.cuh"

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

// fn(T{}, HeadDim<D>{}) for the compiled head_dim values.
template <typename Fn>
void dispatch_dtype_head_dim(minikv_dtype dtype, uint32_t head_dim, const char *what, Fn &&fn) {
  dispatch_dtype(dtype, what, [&](auto tag) {
    switch (head_dim) {
      case 64: fn(tag, HeadDim<64>{}); return;
      case 128: fn(tag, HeadDim<128>{}); return;
      default:
        fail(MINIKV_ERR_UNSUPPORTED,
             "%s: head_dim %u is not compiled into the CUDA backend (supported: 64, 128)", what,
             head_dim);
    }
  });
}

}  // namespace kernels
}  // namespace minikv
