// Hopper warpgroup-MMA building blocks (sm_90a): the 128-byte-swizzled shared-memory layout
// that wgmma reads through matrix descriptors, the descriptors, the fences, the async-group
// bookkeeping and the products that the forward (prefill_wgmma.cu) and the score pass
// (prefill_scores_wgmma.cu) issue. Only the sm_90a device pass (and the host pass, which
// parses them) sees these; an sm_80 image compiles the kernels that use them as empty bodies
// that are never launched.
#pragma once

#include <type_traits>

#include "common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
namespace minikv {
namespace kernels {
namespace wg {

// A [rows][D] tile of 16-bit elements is stored as D / 64 column blocks of [rows][64]
// elements (128 B per row); 16-byte chunk c of row r sits at chunk c ^ (r mod 8), as TMA's
// 128-byte swizzle writes it. The swizzle repeats every 8 rows × 128 B, so every tile starts
// on a 1024-byte boundary.

// Matrix descriptor of a 128-byte-swizzled operand (PTX ISA, "Matrix Descriptor Format"):
// start address, leading and stride byte offsets (all >> 4), swizzle mode 1 (128 B).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_address, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_address & 0x3FFFF) >> 4) | uint64_t((lbo & 0x3FFFF) >> 4) << 16 |
         uint64_t((sbo & 0x3FFFF) >> 4) << 32 | uint64_t(1) << 62;
}

// Descriptor of k-step kk (16 elements of the K dimension) of a K-major swizzled [ROWS][D]
// tile at smem_address: column block kk / 4, 32 bytes per step inside it; 8-row groups
// 1024 B apart (SBO); LBO is unused by swizzled K-major operands.
template <int ROWS> __device__ __forceinline__ uint64_t kmajor_desc(uint32_t smem_address, int kk) {
  return sw128_desc(smem_address + uint32_t((kk / 4) * (ROWS * 128) + (kk % 4) * 32), 16, 1024);
}

#ifdef MINIKV_WARP_EMULATION
// The CPU emulation (tests/emulation) lands each product at the wait that covers it, and
// checks that nothing reads or changes its registers before: the fences have nothing to do.
__device__ __forceinline__ void fence() {}
__device__ __forceinline__ void commit() { emulation::wgmma_commit(); }
template <int N> __device__ __forceinline__ void wait() { emulation::wgmma_wait(N); }
template <typename R, int N> __device__ __forceinline__ void fence_regs(R (&)[N]) {}
#else
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins registers around the async wgmma (as CUTLASS's warpgroup_fence_operand): the
// compiler may not move their reads or writes across these points.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
#endif

// Operand lists of the wgmma asm statements: 32 accumulators from d[b], and the register
// numbers of 32 or 64 of them.
#define MINIKV_ACC32(b)                                                                          \
  "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), \
      "+f"(d[b + 6]), "+f"(d[b + 7]), "+f"(d[b + 8]), "+f"(d[b + 9]), "+f"(d[b + 10]),             \
      "+f"(d[b + 11]), "+f"(d[b + 12]), "+f"(d[b + 13]), "+f"(d[b + 14]), "+f"(d[b + 15]),         \
      "+f"(d[b + 16]), "+f"(d[b + 17]), "+f"(d[b + 18]), "+f"(d[b + 19]), "+f"(d[b + 20]),         \
      "+f"(d[b + 21]), "+f"(d[b + 22]), "+f"(d[b + 23]), "+f"(d[b + 24]), "+f"(d[b + 25]),         \
      "+f"(d[b + 26]), "+f"(d[b + 27]), "+f"(d[b + 28]), "+f"(d[b + 29]), "+f"(d[b + 30]),         \
      "+f"(d[b + 31])
#define MINIKV_REGS32 \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define MINIKV_REGS64                                                                               \
  MINIKV_REGS32                                                                                     \
  ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55," \
  "%56,%57,%58,%59,%60,%61,%62,%63"

// The products below, for one warpgroup, fp32 accumulators; TN is the PTX name of the
// element type. A in registers is 64×16 per warpgroup (per warp, rows 16·warp..+15 in the
// mma.sync m16n8k16 A-fragment layout); d[4i + 2r + c] is row 16·warp + lane / 4 + 8r,
// column 8i + 2 (lane % 4) + c. accumulate = 0 overwrites d.

// d (+)= A · B, A in registers, B = 16×64 in shared memory (descriptor): K-major, or
// MN-major (transposed) with TRANS_B = 1.
#define MINIKV_WGMMA_RS_M64N64K16(TN)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                             \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TN "." TN " {" MINIKV_REGS32 \
               "}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"                          \
               : MINIKV_ACC32(0)                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B))
template <typename T, int TRANS_B = 0>
__device__ __forceinline__ void rs_m64n64k16(float (&d)[32], const uint32_t *a, uint64_t desc_b, int accumulate) {
#ifdef MINIKV_WARP_EMULATION
  emulation::wgmma(d, 64, a, 0, desc_b, accumulate != 0, TRANS_B != 0, !std::is_same<T, __half>::value);
#else
  if constexpr (std::is_same<T, __half>::value) MINIKV_WGMMA_RS_M64N64K16("f16");
  else MINIKV_WGMMA_RS_M64N64K16("bf16");
#endif
}

// d (+)= A · Bᵀ, A = 64×16 and B = 128×16, both K-major in shared memory (descriptors).
#define MINIKV_WGMMA_SS_M64N128K16(TN)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                              \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TN "." TN " {" MINIKV_REGS64 \
               "}, %64, %65, p, 1, 1, 0, 0;\n}\n"                                        \
               : MINIKV_ACC32(0), MINIKV_ACC32(32)                                       \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))
template <typename T>
__device__ __forceinline__ void ss_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef MINIKV_WARP_EMULATION
  emulation::wgmma(d, 128, nullptr, desc_a, desc_b, accumulate != 0, false, !std::is_same<T, __half>::value);
#else
  if constexpr (std::is_same<T, __half>::value) MINIKV_WGMMA_SS_M64N128K16("f16");
  else MINIKV_WGMMA_SS_M64N128K16("bf16");
#endif
}

// d (+)= A · Bᵀ, A = 64×16 and B = 64×16, both K-major in shared memory (descriptors): the
// forward's S at head_dim 256, whose K/V tiles hold 64 keys.
#define MINIKV_WGMMA_SS_M64N64K16(TN)                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                              \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TN "." TN " {" MINIKV_REGS32 \
               "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                       \
               : MINIKV_ACC32(0)                                                         \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))
template <typename T>
__device__ __forceinline__ void ss_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#ifdef MINIKV_WARP_EMULATION
  emulation::wgmma(d, 64, nullptr, desc_a, desc_b, accumulate != 0, false, !std::is_same<T, __half>::value);
#else
  if constexpr (std::is_same<T, __half>::value) MINIKV_WGMMA_SS_M64N64K16("f16");
  else MINIKV_WGMMA_SS_M64N64K16("bf16");
#endif
}

// d += A · B, A in registers, B = 16×128 MN-major in shared memory (descriptor, transposed).
#define MINIKV_WGMMA_RS_M64N128K16_MNMAJOR(TN)                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                              \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TN "." TN " {" MINIKV_REGS64 \
               "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"                             \
               : MINIKV_ACC32(0), MINIKV_ACC32(32)                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
template <typename T>
__device__ __forceinline__ void rs_m64n128k16_mn(float (&d)[64], const uint32_t *a, uint64_t desc_b) {
#ifdef MINIKV_WARP_EMULATION
  emulation::wgmma(d, 128, a, 0, desc_b, true, true, !std::is_same<T, __half>::value);
#else
  if constexpr (std::is_same<T, __half>::value) MINIKV_WGMMA_RS_M64N128K16_MNMAJOR("f16");
  else MINIKV_WGMMA_RS_M64N128K16_MNMAJOR("bf16");
#endif
}
#undef MINIKV_WGMMA_RS_M64N64K16
#undef MINIKV_WGMMA_SS_M64N128K16
#undef MINIKV_WGMMA_SS_M64N64K16
#undef MINIKV_WGMMA_RS_M64N128K16_MNMAJOR
#undef MINIKV_ACC32
#undef MINIKV_REGS32
#undef MINIKV_REGS64

}  // namespace wg
}  // namespace kernels
}  // namespace minikv
#endif
