// Device helpers shared by the prefill kernels (prefill_attention.cu: mma.sync, sm_80+;
// prefill_wgmma.cu: warpgroup MMA, sm_90a).
#pragma once

#include "common.cuh"
#include "params.h"

namespace minikv {
namespace kernels {

// 4-byte cp.async (zero-filled when !valid): LSE rows have no 16-byte alignment.
__device__ __forceinline__ void cp_async_4(void *smem, const void *gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(valid ? 4 : 0));
}

// 2^x on the MUFU unit (what exp2f compiles to, minus its denormal-result path: terms
// below 2^-126 are flushed to 0, far under fp32 rounding of any sum they join).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Sequence of a launch-wide tile index.
__device__ __forceinline__ uint32_t find_seq(const PrefillSeqs &s, uint32_t tile) {
  uint32_t i = 0;
  while (i + 1 < s.n && s.tile_begin[i + 1] <= tile) ++i;
  return i;
}

}  // namespace kernels
}  // namespace minikv
