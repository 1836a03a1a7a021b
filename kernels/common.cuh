// Device-side helpers shared by the kernel families: dtype traits, tensor-core fragments
// (mma.sync m16n8k16, ldmatrix, cp.async), and the error check that turns a CUDA error into
// minikv::Error(MINIKV_ERR_DEVICE, "<call>: <CUDA text>").
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../src/layout.h"

#include "cuda_check.h"

namespace minikv {
namespace kernels {

// ---- dtype traits ---------------------------------------------------------------------
template <typename T> struct DType;
template <> struct DType<__half> {
  using vec2 = __half2;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);  // a in the low half
    return *reinterpret_cast<uint32_t *>(&h);
  }
};
template <> struct DType<__nv_bfloat16> {
  using vec2 = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
  }
};

// ---- attention outputs -------------------------------------------------------------------
// An output is a weighted mean of values within the dtype's range, yet it can round past
// the largest finite value: fp16 values at 65504 dequantize to up to 65520 (a rounded
// scale), and probabilities rounded for a tensor-core product sum to 1 + 2^-11; fp16 then
// stores +inf. Outputs are clamped to the finite range before the conversion, as the CPU
// backend does (src/dtype.h clamp_finite); NaN stays NaN.
template <typename T> __device__ __forceinline__ float clamp_output(float x) {
  const float m = std::is_same<T, __half>::value ? 65504.0f : 3.38953139e38f;  // bf16 0x7f7f
  return x > m ? m : x < -m ? -m : x;
}
template <typename T> __device__ __forceinline__ T output_value(float x) {
  return DType<T>::from_float(clamp_output<T>(x));
}
template <typename T> __device__ __forceinline__ uint32_t output_pair(float a, float b) {
  return DType<T>::pack2(clamp_output<T>(a), clamp_output<T>(b));
}

// A kernel's dynamic shared memory, `name` (bytes, aligned to `align`). Under the CPU emulation
// of tests/emulation the running CTA's buffer.
#ifdef MINIKV_WARP_EMULATION
#define MINIKV_DYNAMIC_SMEM(name, align) uint8_t *const name = ::minikv::emulation::shared_base()
#else
#define MINIKV_DYNAMIC_SMEM(name, align) extern __shared__ __align__(align) uint8_t name[]
#endif

// ---- tensor-core fragments (sm_80+) ---------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global → shared copy; bytes past `src_bytes` (0 or 16) are zero-filled, so rows
// outside a sequence load as zeros and never read another sequence's (or no) memory.
// `smem`: a shared-state-space address (smem_addr), so a loop of copies converts its
// destination once.
__device__ __forceinline__ void cp_async_16(uint32_t smem, const void *gmem, bool valid) {
#ifdef MINIKV_WARP_EMULATION
  emulation::cp_async(smem, gmem, 16, valid);
#else
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem, bool valid) {
  cp_async_16(smem_addr(smem), gmem, valid);
}
// The same, always the whole 16 bytes.
__device__ __forceinline__ void cp_async_16(uint32_t smem, const void *gmem) {
#ifdef MINIKV_WARP_EMULATION
  emulation::cp_async(smem, gmem, 16, true);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef MINIKV_WARP_EMULATION
  emulation::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#ifdef MINIKV_WARP_EMULATION
  emulation::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *smem) {
#ifdef MINIKV_WARP_EMULATION
  emulation::ldmatrix_x4(r, smem, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *smem) {
#ifdef MINIKV_WARP_EMULATION
  emulation::ldmatrix_x4(r, smem, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
#endif
}

// d += a · b, A 16×16 row-major, B 16×8 column-major, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
#ifdef MINIKV_WARP_EMULATION
  emulation::mma_16816(d, a, b0, b1, false);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
#ifdef MINIKV_WARP_EMULATION
  emulation::mma_16816(d, a, b0, b1, true);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// d += a · b for the even columns only (C[g][2i] in c0, C[g + 8][2i] in c2), where the odd
// columns repeat them: the odd outputs are dropped, so their accumulators take no registers
// between calls.
template <typename T>
__device__ __forceinline__ void mma_16816_even(float &c0, float &c2, const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
#ifdef MINIKV_WARP_EMULATION
  float d[4] = {c0, 0.0f, c2, 0.0f};
  emulation::mma_16816(d, a, b0, b1, !std::is_same<T, __half>::value);
  c0 = d[0];
  c2 = d[2];
#else
  constexpr bool kF16 = std::is_same<T, __half>::value;
  float odd0, odd1;
  if constexpr (kF16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(c0), "=f"(odd0), "=f"(c2), "=f"(odd1)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c0), "f"(0.0f), "f"(c2), "f"(0.0f));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(c0), "=f"(odd0), "=f"(c2), "=f"(odd1)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c0), "f"(0.0f), "f"(c2), "f"(0.0f));
#endif
}

// Two 16-bit values of a 32-bit word (element 0 in the low half) as floats. Unpacking the
// words of a loaded uint4 keeps the load a single 16-byte one.
__device__ __forceinline__ float2 word_to_float2(uint32_t w, __half) {
  return __half22float2(*reinterpret_cast<const __half2 *>(&w));
}
__device__ __forceinline__ float2 word_to_float2(uint32_t w, __nv_bfloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <typename T> __device__ __forceinline__ void unpack8(const uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 t = word_to_float2(w[e], T{});
    f[2 * e] = t.x;
    f[2 * e + 1] = t.y;
  }
}

// acc + q[0]·f[0] + ... + q[N−1]·f[N−1], one fused multiply-add at a time in that order (N a
// multiple of 4; q 16-byte aligned, read as float4).
template <int N> __device__ __forceinline__ float fma_dot(const float *q, const float (&f)[N], float acc) {
#pragma unroll
  for (int k = 0; k < N; k += 4) {
    const float4 a = *reinterpret_cast<const float4 *>(q + k);
    acc = fmaf(a.x, f[k], acc);
    acc = fmaf(a.y, f[k + 1], acc);
    acc = fmaf(a.z, f[k + 2], acc);
    acc = fmaf(a.w, f[k + 3], acc);
  }
  return acc;
}

// 2^x on the MUFU unit (what exp2f compiles to, minus its denormal-result path: terms
// below 2^-126 are flushed to 0, far under fp32 rounding of any sum they join).
__device__ __forceinline__ float ex2(float x) {
  float y;
#ifdef MINIKV_WARP_EMULATION
  y = emulation::ex2_approx_ftz(x);
#else
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
#endif
  return y;
}

// ---- programmatic dependent launch (sm_90) ---------------------------------------------
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while
// the kernel before it in the stream still runs, once every CTA of that kernel has called
// pdl_launch_dependents (or exited); pdl_wait blocks until that kernel has completed and its
// writes are visible. Without the attribute (or before sm_90) both do nothing.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- small reductions -----------------------------------------------------------------
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace kernels
}  // namespace minikv
