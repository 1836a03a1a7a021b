// Kernel launches that may start as programmatic dependents of the kernel launched before
// them on the same stream (sm_90; a CUDA graph captures the edge with 12.3+ drivers).
// Host-only, for .cu launchers; absent from a CPU emulation (tests/emulation), whose launches
// are its own and whose gridDim/blockDim are macros.
#pragma once
#ifndef MINIKV_WARP_EMULATION

#include <cuda_runtime.h>

#include <utility>

#include "cuda_check.h"

namespace minikv {
namespace kernels {

// kernel<<<grid, block, smem, stream>>>(args...). With `programmatic`, the kernel's CTAs may
// start once every CTA of the kernel before it on `stream` has called pdl_launch_dependents
// (common.cuh) or exited, so its launch and whatever it does before pdl_wait overlap that
// kernel's tail. It must pdl_wait before reading anything that kernel (or one before it)
// wrote, and at least one of its CTAs must pdl_wait: its completion then implies that
// kernel's, which the launches after it rely on. A launch error throws (name: the kernel's).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   bool programmatic, const char *name, Args &&...args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) throw_cuda_error(err, name);
}

}  // namespace kernels
}  // namespace minikv
#endif  // MINIKV_WARP_EMULATION
