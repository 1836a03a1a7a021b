// The shapes the CUDA kernels are compiled for, in one place: the dispatch (dispatch.cuh)
// instantiates from these lists, and minikv_cache_create rejects anything outside them with
// MINIKV_ERR_UNSUPPORTED and a message that lists what is supported (cuda_unsupported).
// Plain C++ (no CUDA headers), so a CPU-only build can test the create-time check.
#pragma once

#include <cstdint>
#include <string>

#include "../include/minikv.h"

namespace minikv {
namespace kernels {

// head_dim values of a kernel family, as template arguments.
template <int... Ds> struct HeadDimList {};
// What the kernels are written for: prefill (mma.sync), the generic decode and the merge.
using KernelHeadDims = HeadDimList<64, 80, 96, 128, 256>;
// Narrower families; a shape outside them takes the kernel above (see the plans).
using FastDecodeHeadDims = HeadDimList<64, 128>;  // decode_fast.cu (2-bit, G = 16)
using WgmmaHeadDims = HeadDimList<64, 128, 256>;  // prefill_wgmma.cu, prefill_scores_wgmma.cu (sm_90a)
using MmaDecodeHeadDims = HeadDimList<64, 128, 256>;  // decode_mma.cu (tensor cores)
using K4V2DecodeHeadDims = HeadDimList<64, 128>;      // decode_k4v2.cu (default storage, sm_90)
using K4V2WarpHeadDims = HeadDimList<64, 128, 256>;   // decode_k4v2_warp.cu (sm_90)

// The head_dim values of this build. A build may leave some out (less compile time):
// CMake's MINIKV_CUDA_HEAD_DIMS="64;128" defines MINIKV_NO_HEAD_DIM_<D> for the others.
constexpr uint32_t kCompiledHeadDims[] = {
#ifndef MINIKV_NO_HEAD_DIM_64
    64,
#endif
#ifndef MINIKV_NO_HEAD_DIM_80
    80,
#endif
#ifndef MINIKV_NO_HEAD_DIM_96
    96,
#endif
#ifndef MINIKV_NO_HEAD_DIM_128
    128,
#endif
#ifndef MINIKV_NO_HEAD_DIM_256
    256,
#endif
};

template <int... Ds> constexpr bool in_list(HeadDimList<Ds...>, uint32_t d) {
  return ((d == uint32_t(Ds)) || ...);
}
// In this build's list (a value of KernelHeadDims not left out).
constexpr bool head_dim_compiled(uint32_t d) {
  for (uint32_t x : kCompiledHeadDims)
    if (x == d) return true;
  return false;
}

// "64, 80, 96, 128, 256": the compiled head_dim values, for messages.
inline std::string compiled_head_dims_text() {
  std::string s;
  for (uint32_t x : kCompiledHeadDims) {
    if (!s.empty()) s += ", ";
    s += std::to_string(x);
  }
  return s;
}

// Why the CUDA backend of this build cannot hold `cfg` (a validated config), or "" when it
// can. Every storage configuration the config accepts (bits 2/4/8/16 each, group sizes
// 16..128, sinks, any GQA group) decodes on the generic kernel when the dtype and head_dim
// are compiled; the faster kernels are chosen at create where they apply.
inline std::string cuda_unsupported(const minikv_config &cfg) {
  if (cfg.dtype == MINIKV_DTYPE_F32) {
    return "dtype F32 is not supported by the CUDA backend (supported: F16, BF16; F32 runs on "
           "the CPU backend)";
  }
  if (!head_dim_compiled(cfg.head_dim)) {
    return "head_dim " + std::to_string(cfg.head_dim) +
           " is not compiled into the CUDA backend (supported: " + compiled_head_dims_text() +
           "; any multiple of 16 up to 256 runs on the CPU backend)";
  }
  return "";
}

}  // namespace kernels
}  // namespace minikv
