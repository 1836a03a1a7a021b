// mbarriers and the bulk global → shared copies completed on them (PTX ISA 8.0, sm_90): one
// thread moves a whole contiguous region, or a box of a tensor map (TMA, tensor_maps.h), and
// the waiting threads spin on the barrier's phase instead of issuing and committing
// per-thread cp.async groups (decode_k4v2.cu, the TMA pipelines of prefill_wgmma.cu and
// prefill_scores_wgmma.cu). The bodies exist in sm_90+ device passes only; kernels that call
// them are launched on such devices only.
#pragma once

#include <cstdint>

namespace minikv {
namespace kernels {
namespace bulk {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#elif defined(MINIKV_WARP_EMULATION)
  emulation::mbar_init(bar, count);
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
#elif defined(MINIKV_WARP_EMULATION)
  emulation::mbar_arrive_expect_tx(bar, bytes);
#endif
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
               : "memory");
#elif defined(MINIKV_WARP_EMULATION)
  emulation::mbar_arrive(bar);
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
#elif defined(MINIKV_WARP_EMULATION)
  emulation::mbar_wait(bar, parity);
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
#elif defined(MINIKV_WARP_EMULATION)
  emulation::bulk_copy(dst, src, bytes, bar);
#endif
}

// One box of the tensor map at `map` (a CUtensorMap in kernel parameters, constant or global
// memory) at coordinates (c0, c1, c2) into the shared address dst (aligned as the map's
// swizzle requires: 1024 bytes for 128-byte swizzle, else 128); its bytes complete on bar.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void *map, uint32_t bar, int c0, int c1, int c2) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
#elif defined(MINIKV_WARP_EMULATION)
  emulation::tma_load_3d(dst, map, bar, c0, c1, c2);
#endif
}
__device__ __forceinline__ void prefetch_tensor_map(const void *map) {
#if __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

}  // namespace bulk
}  // namespace kernels
}  // namespace minikv
