// mbarriers and the bulk global → shared copies completed on them (PTX ISA 8.0, sm_90): one
// thread moves a whole contiguous region, and the waiting threads spin on the barrier's phase
// instead of issuing and committing per-thread cp.async groups (decode_k4v2.cu; the TMA
// pipeline of prefill_wgmma.cu uses the barriers). The bodies exist in sm_90+ device passes
// only; kernels that call them are launched on such devices only.
#pragma once

#include <cstdint>

namespace minikv {
namespace kernels {
namespace bulk {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Makes initialized barriers visible to the async proxy (the copies' completions).
__device__ __forceinline__ void fence_mbar_init() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival that also announces `bytes` still to land on the barrier's current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
               : "memory");
#endif
}
// Waits until the phase of parity `parity` has completed (a fresh barrier: parity 1 passes).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
// Orders this thread's generic accesses to shared memory before later async-proxy ones: a
// bulk copy into bytes the thread wrote with ordinary stores (after a barrier that hands
// them to the copying thread).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from src to the shared address
// dst; their arrival completes that many bytes of the barrier's transaction count.
__device__ __forceinline__ void copy(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
#endif
}

}  // namespace bulk
}  // namespace kernels
}  // namespace minikv
