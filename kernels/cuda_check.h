// CUDA error → minikv::Error. Host-only, usable from .cpp and .cu files.
#pragma once

#include <cuda_runtime.h>

#include "../src/error.h"

namespace minikv {

// Throws Error(MINIKV_ERR_DEVICE, "<call>: <cudaGetErrorString>") (MINIKV_ERR_OUT_OF_MEMORY
// for cudaErrorMemoryAllocation).
[[noreturn]] void throw_cuda_error(cudaError_t err, const char *call);

// After a kernel launch: cudaGetLastError() → throw_cuda_error(err, kernel_name).
void check_launch_error(const char *kernel_name);

}  // namespace minikv

#define MINIKV_CUDA_CHECK(call)                                                     \
  do {                                                                              \
    const cudaError_t minikv_err_ = (call);                                         \
    if (minikv_err_ != cudaSuccess) ::minikv::throw_cuda_error(minikv_err_, #call); \
  } while (0)
